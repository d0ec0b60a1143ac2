"""Small helpers over the standard-library ``ast``: positions, dotted names, source text, scopes."""
from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence

# Nodes with a position in the source (what findings and conditions point at).
Located = ast.stmt | ast.expr
# Nodes whose body is a scope of its own: nested functions and classes run elsewhere, or later.
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_LINE_BREAK = re.compile(r"\r\n?|\n")


def split_lines(source: str) -> list[str]:
    """The lines of ``source`` as ``ast`` numbers them (``\\r\\n``, ``\\r`` and ``\\n`` all end one)."""
    return _LINE_BREAK.split(source)


def walk_scope(nodes: Sequence[ast.AST]) -> Iterator[ast.AST]:
    """Every node of ``nodes`` that runs with them: nested functions and classes are not entered."""
    stack: list[ast.AST] = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def dotted(node: ast.AST) -> str | None:
    """``"torch.distributed.barrier"`` for a chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def tail(node: ast.AST) -> str | None:
    """The last name of ``a.b.c`` (``c``) or of a plain name."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not node.value


def start(node: Located) -> tuple[int, int]:
    return node.lineno, node.col_offset


def end(node: Located) -> tuple[int, int]:
    return node.end_lineno or node.lineno, node.end_col_offset or 0


def shorten(text: str, width: int = 60) -> str:
    """``text`` on one line, cut to ``width`` characters with "..." when longer."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
