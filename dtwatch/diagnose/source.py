"""Loops in Python source: which loop a line runs in, and where that loop can be left early.

Pure functions of source text (the evidence reader supplies the text), cached by the caller.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass


@dataclass(frozen=True)
class Loop:
    start: int  # the ``for``/``while`` line
    end: int  # its last line (else clause included)
    header: str  # "for batch in loader:" (first line, stripped)
    exits: tuple[tuple[int, str], ...]  # (line, text) of each break/return/sys.exit that leaves it early

    def contains(self, line: int) -> bool:
        return self.start <= line <= self.end


def loops(source: str) -> list[Loop]:
    """Every loop in ``source``, outermost first. Unparsable source gives none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = source.splitlines()
    out: list[Loop] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            exits = tuple(
                (n.lineno, lines[n.lineno - 1].strip() if n.lineno <= len(lines) else "")
                for n in _exits(node)
            )
            header = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""
            out.append(Loop(node.lineno, node.end_lineno or node.lineno, header, exits))
    return sorted(out, key=lambda lp: (lp.start, -lp.end))


def _exits(loop: ast.AST) -> list[ast.stmt]:
    """``break`` statements of this loop (not of nested loops) and ``return``s anywhere in its body."""
    found: list[ast.stmt] = []
    stack: list[tuple[ast.AST, bool]] = [(child, True) for child in getattr(loop, "body", [])]
    while stack:
        node, own = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Break) and own:
            found.append(node)
        elif isinstance(node, ast.Return) or (isinstance(node, ast.Expr) and _is_exit_call(node.value)):
            found.append(node)
        nested = isinstance(node, (ast.For, ast.AsyncFor, ast.While))
        stack.extend((child, own and not nested) for child in ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: n.lineno)


_EXIT_CALLS = {"sys.exit", "exit", "quit", "os._exit"}


def _is_exit_call(node: ast.AST) -> bool:
    """``sys.exit(...)``, ``os._exit(...)``, ``exit()``: leaves the loop by ending the process."""
    return isinstance(node, ast.Call) and ast.unparse(node.func) in _EXIT_CALLS


def innermost_loop(all_loops: list[Loop], line: int) -> Loop | None:
    inside = [lp for lp in all_loops if lp.contains(line)]
    return min(inside, key=lambda lp: lp.end - lp.start) if inside else None
