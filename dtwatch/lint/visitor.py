"""The walk over one module's syntax tree that carries the rank conditions active at each node.

:class:`ModuleChecker` visits every statement and expression with the tuple of rank conditions it runs
under (the ``if rank == 0`` around it, the ``@rank_zero_only`` on its function...), records which lines
are rank-conditional, and reports DTW001/DTW003 for a collective under a condition the other ranks do
not balance and DTW002 for an exit that skips a later collective. :mod:`dtwatch.lint.checker` is the
public face: it runs this on files and applies suppression comments.
"""
from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

from dtwatch.lint import ranks, syntax
from dtwatch.lint.finding import LintFinding
from dtwatch.lint.local import Context, Definitions, FunctionNode
from dtwatch.lint.syntax import Located
from dtwatch.lint.vocabulary import (
    COLLECTIVE_KEYWORDS,
    COLLECTIVE_PROPERTIES,
    COLLECTIVES,
    CONVENTIONAL_ALIASES,
    DISTRIBUTED_RECEIVERS,
    EXIT_CALLS,
    RANK_DECORATORS,
    RANK_HINT,
    Op,
    in_modules,
    is_distributed_module,
)


@dataclass(frozen=True)
class Condition:
    label: str  # "if rank == 0": LintFinding.condition
    where: str  # "rank-conditional branch 'if rank == 0' (line 12)": used in messages
    node: Located  # the statement or expression holding the test
    balanced: frozenset[str] = frozenset()  # collectives the other ranks call elsewhere


Conditions: TypeAlias = tuple[Condition, ...]  # the rank conditions a node runs under, innermost last
# A node whose body the walk enters as a frame: a module, function or class, or a loop.
Body: TypeAlias = ranks.Scope | ast.For | ast.AsyncFor | ast.While


class Match(NamedTuple):
    name: str  # the COLLECTIVES (COLLECTIVE_KEYWORDS, COLLECTIVE_PROPERTIES) key, or a same-file function's qualname
    op: Op
    text: str  # "dist.barrier()", as shown in findings
    via: tuple[tuple[str, int], ...] = ()  # for a same-file function: the calls down to the collective, (text, line)

    def describe(self, line: int | None = None) -> str:
        """The call, its line if given, and for a same-file function what makes it collective:
        ``ckpt.save() (line 20; it calls dist.barrier() at line 12)``."""
        notes = [f"line {line}"] if line is not None else []
        if self.via:
            notes.append("it calls " + ", which calls ".join(f"{text} at line {n}" for text, n in self.via))
        return f"{self.text} ({'; '.join(notes)})" if notes else self.text


class Arm(NamedTuple):
    """One side of a rank-conditional if, for pairing up "rank 0 goes first" ifs."""

    node: ast.If
    negated: bool  # reads "not this rank": the else side of "if rank == 0", the body of "if rank != 0"
    subjects: frozenset[str]  # what the test reads: {"local_rank"}, {"dist.get_rank"}
    surplus: Counter[str]  # collectives this side calls more often than the other side


class Frame(NamedTuple):
    node: Body
    is_loop: bool
    depth: int  # how many conditions were active when it was entered


class ModuleChecker:
    """Walks one module, carrying the rank conditions active at each node."""

    def __init__(self, source: str, path: str, tree: ast.Module) -> None:
        self.source, self.path, self.tree = source, path, tree
        self.lines = syntax.split_lines(source)
        self.aliases: dict[str, str] = {}  # local names of torch.distributed-like modules -> what they name
        self.imported: dict[str, str] = {}  # local name -> collective, from "from torch.distributed import"
        self.defs = Definitions()  # the module's own functions and classes
        self.context = Context()  # what names mean in the scope being walked
        self._summaries: dict[FunctionNode, Match | None] = {}  # cache for summary()
        self.findings: list[LintFinding] = []
        self.conditional_lines: set[int] = set()
        self.branches: dict[int, Condition] = {}  # line -> the innermost rank condition it runs under
        self.frames: list[Frame] = []
        self.names: Mapping[str, bool] = {}  # this scope's exceptions to is_rank_name
        self.rank_attrs: frozenset[str] = frozenset()  # attributes assigned a rank (self.gpu_id)
        self.arms: list[Arm] = []  # both sides of every rank-conditional if in this scope
        self._sides: dict[ast.If, tuple[Counter[str], Counter[str]]] = {}  # cache for sides()
        # What to do at each kind of node (any other: visit its children under the same conditions).
        self._handlers: dict[type[ast.AST], Callable[[Any, Conditions], None]] = {
            ast.FunctionDef: self.visit_function, ast.AsyncFunctionDef: self.visit_function,
            ast.ClassDef: self.visit_class, ast.Lambda: self.visit_lambda,
            ast.For: self.visit_for, ast.AsyncFor: self.visit_for, ast.While: self.visit_while,
            ast.If: self.visit_if, ast.IfExp: self.visit_ifexp, ast.BinOp: self.visit_binop,
            ast.BoolOp: self.visit_boolop, ast.Call: self.visit_call, ast.Return: self.visit_return,
            ast.Break: self.visit_break, ast.Continue: self.visit_continue, ast.Attribute: self.visit_attribute,
        }

    def run(self) -> ModuleChecker:
        if RANK_HINT.search(self.source):
            self.aliases, self.imported = distributed_imports(self.tree)
            self.rank_attrs = ranks.rank_attributes(self.tree)
            self.defs = Definitions.of(self.tree)
            self._scope(self.tree, (), {})
        return self

    def visit(self, node: ast.AST, conds: Conditions) -> None:
        first = getattr(node, "lineno", None)
        if conds and first is not None:
            last = first if hasattr(node, "body") else getattr(node, "end_lineno", None) or first
            self.conditional_lines.update(range(first, last + 1))
            for line in range(first, last + 1):
                self.branches[line] = conds[-1]
        self._handlers.get(type(node), self.generic_visit)(node, conds)

    def generic_visit(self, node: ast.AST, conds: Conditions) -> None:
        for child in ast.iter_child_nodes(node):
            self.visit(child, conds)

    def visit_all(self, nodes: Sequence[ast.AST], conds: Conditions) -> None:
        for node in nodes:
            self.visit(node, conds)

    # Scopes and loops.
    def _scope(self, node: ranks.Scope, body_conds: Conditions, inherited: Mapping[str, bool]) -> None:
        """Visit the body of a module, function or class, whose names and ifs are its own."""
        saved = self.names, self.arms, self.context
        if isinstance(node, ast.Module):
            inherited = {**inherited, **{"." + attr: True for attr in self.rank_attrs}}
        self.names = ranks.scope_names(node, inherited)
        self.arms = []
        self.context = self.defs.contexts.get(node, self.context)
        for child in syntax.walk_scope(node.body):
            if isinstance(child, ast.If) and self.is_rank_test(child.test):
                body, orelse = self.sides(child)
                negated, subjects = ranks.negated(child.test, self.names), ranks.rank_subjects(child.test, self.names)
                self.arms += [
                    Arm(child, negated, subjects, body - orelse),
                    Arm(child, not negated, subjects, orelse - body),
                ]
        self.frames.append(Frame(node, False, len(body_conds)))
        self.visit_all(node.body, body_conds)
        self.frames.pop()
        self.names, self.arms, self.context = saved

    def visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef, conds: Conditions) -> None:
        self.visit_all(node.decorator_list, conds)
        self.visit(node.args, conds)
        if node.returns:
            self.visit(node.returns, conds)
        body_conds: Conditions = ()  # defined here, called who knows where
        for decorator in node.decorator_list:
            if is_rank_decorator(decorator):
                label = "@" + self.segment(decorator)
                body_conds = (Condition(label, f"rank-restricted function {self.quote(label, decorator)}", node),)
        self._scope(node, body_conds, self.names)

    def visit_class(self, node: ast.ClassDef, conds: Conditions) -> None:
        self.visit_all([*node.decorator_list, *node.bases, *node.keywords], conds)
        self._scope(node, conds, self.names)  # the class body runs where the class statement does

    def visit_lambda(self, node: ast.Lambda, conds: Conditions) -> None:
        self.visit(node.args, conds)
        self.visit(node.body, ())

    def visit_for(self, node: ast.For | ast.AsyncFor, conds: Conditions) -> None:
        self.visit(node.target, conds)
        self.visit(node.iter, conds)
        self._loop_body(node, conds)
        self.visit_all(node.orelse, conds)

    def visit_while(self, node: ast.While, conds: Conditions) -> None:
        self.visit(node.test, conds)
        body_conds = conds
        if self.is_rank_test(node.test):
            label = "while " + self.segment(node.test)
            body_conds += (Condition(label, f"rank-conditional loop {self.quote(label, node)}", node),)
        self._loop_body(node, body_conds)
        self.visit_all(node.orelse, conds)

    def _loop_body(self, node: ast.For | ast.AsyncFor | ast.While, conds: Conditions) -> None:
        self.frames.append(Frame(node, True, len(conds)))
        self.visit_all(node.body, conds)
        self.frames.pop()

    # Branches.
    def visit_if(self, node: ast.If, conds: Conditions) -> None:
        self.visit(node.test, conds)  # the test itself runs wherever the if does
        if not self.is_rank_test(node.test):
            self.visit_all(node.body, conds)
            self.visit_all(node.orelse, conds)
            return
        keyword = "elif" if self.lines[node.lineno - 1].lstrip().startswith("elif") else "if"
        label = f"{keyword} {self.segment(node.test)}"
        quoted = self.quote(label, node)
        body, orelse = self.sides(node)
        negated = ranks.negated(node.test, self.names)
        then = Condition(label, f"rank-conditional branch {quoted}", node,
                         self._balanced(node, negated, body, orelse))
        other = Condition(label, f"else branch of rank-conditional {quoted}", node,
                          self._balanced(node, not negated, orelse, body))
        self.visit_all(node.body, conds + (then,))
        self.visit_all(node.orelse, conds + (other,))

    def _balanced(self, node: ast.If, negated: bool, mine: Counter[str], theirs: Counter[str]) -> frozenset[str]:
        """Collectives of one side of a rank test that the other ranks call too: the other side calls
        them as often (``if rank == src: dist.scatter(t, chunks) else: dist.scatter(t)``), or the
        opposite side of another, separate test of the same rank in the same function does ("rank 0
        goes first": ``if rank != 0: dist.barrier()`` ... ``if rank == 0: dist.barrier()``)."""
        surplus = mine - theirs
        names = {name for name in mine if name not in surplus}
        subjects, span = ranks.rank_subjects(node.test, self.names), (syntax.start(node), syntax.end(node))
        for arm in self.arms:
            other_span = (syntax.start(arm.node), syntax.end(arm.node))
            nested = span[0] <= other_span[0] <= span[1] or other_span[0] <= span[0] <= other_span[1]
            if not nested and arm.negated != negated and arm.subjects == subjects:
                names |= {name for name, count in surplus.items() if arm.surplus[name] == count}
        return frozenset(names)

    def visit_ifexp(self, node: ast.IfExp, conds: Conditions) -> None:
        self.visit(node.test, conds)
        if self.is_rank_test(node.test):
            label = f"... if {self.segment(node.test)} else ..."
            shared = frozenset(self.counts([node.body])) & frozenset(self.counts([node.orelse]))
            conds += (Condition(label, f"rank-conditional expression {self.quote(label, node)}", node, shared),)
        self.visit(node.body, conds)
        self.visit(node.orelse, conds)

    def visit_binop(self, node: ast.BinOp, conds: Conditions) -> None:
        operands = []  # "a + b + c + ...": a loop, not a recursion, down the left-nested chain
        left: ast.expr = node
        while isinstance(left, ast.BinOp):
            operands.append(left.right)
            left = left.left
        for operand in [left, *reversed(operands)]:
            self.visit(operand, conds)

    def visit_boolop(self, node: ast.BoolOp, conds: Conditions) -> None:
        operator = "and" if isinstance(node.op, ast.And) else "or"
        gated = False
        for value in node.values:  # operands after a rank test run only on some ranks
            self.visit(value, conds)
            if not gated and self.is_rank_test(value):
                gated = True
                label = f"{self.segment(value)} {operator} ..."
                conds += (Condition(label, f"short-circuit after rank test {self.quote(label, value)}", node),)

    # Calls and exits.
    def visit_call(self, node: ast.Call, conds: Conditions) -> None:
        match = self.collective(node)
        if match is not None:
            self.check_collective(node, match, conds)
        if syntax.dotted(node.func) in EXIT_CALLS:
            self.check_exit(node, self.segment(node.func) + "()", conds)
        self.generic_visit(node, conds)

    def visit_attribute(self, node: ast.Attribute, conds: Conditions) -> None:
        match = self.collective_property(node)
        if match is not None:
            self.check_collective(node, match, conds)
        self.generic_visit(node, conds)

    def check_collective(self, node: ast.expr, match: Match, conds: Conditions) -> None:
        """DTW001/DTW003 when a rank condition around ``node`` is not balanced by the other ranks."""
        unbalanced = [c for c in conds if match.name not in c.balanced]
        if not unbalanced:
            return
        cond, text = unbalanced[-1], match.text
        if match.op.p2p:
            advice = f"{match.op.reason}; check that every rank's path posts the matching call"
        else:
            advice = ("only some ranks will call it and the others will hang; "
                      "call it on every rank and gate only the side effect")
        code = "DTW003" if match.op.p2p else "DTW001"
        self.report(node, code, text, cond, f"{match.describe()} inside {cond.where}: {advice}")

    def visit_return(self, node: ast.Return, conds: Conditions) -> None:
        self.check_exit(node, "return", conds)
        self.generic_visit(node, conds)

    def visit_break(self, node: ast.Break, conds: Conditions) -> None:
        self.check_exit(node, "break", conds)

    def visit_continue(self, node: ast.Continue, conds: Conditions) -> None:
        self.check_exit(node, "continue", conds)

    def check_exit(self, node: Located, exit_text: str, conds: Conditions) -> None:
        """DTW002 when a rank-conditional exit skips a collective the other ranks will still call."""
        leaves_loop = exit_text in ("break", "continue")
        index = self._exit_target(leaves_loop)
        if index is None or len(conds) <= self.frames[index].depth:
            return  # no rank condition between the exit and what it leaves
        cond, target = conds[-1], self.frames[index]
        start, end = syntax.start(cond.node), syntax.end(cond.node)

        def outside(pos: tuple[int, int]) -> bool:
            return not start <= pos <= end

        def collectives(body: Sequence[ast.stmt]) -> list[tuple[tuple[int, int], Match]]:
            return [(pos, match) for pos, match in self.calls_in(body) if not match.op.p2p]

        if exit_text == "continue":  # skips the rest of this iteration
            skipped = [c for c in collectives(target.node.body) if c[0] > end]
        elif exit_text == "break":  # skips every later iteration, all of the body
            skipped = [c for c in collectives(target.node.body) if outside(c[0])]
        else:  # the rest of the function, and later iterations of the loops around the exit
            skipped = [c for c in collectives(target.node.body) if c[0] > end]
            for frame in self.frames[index + 1:]:
                if frame.depth < len(conds):  # the loop encloses the condition
                    skipped += [c for c in collectives(frame.node.body) if outside(c[0])]
        if not skipped:
            return
        if exit_text not in ("break", "continue"):
            # The collectives after a rank-conditional return run only on the ranks that did not return: for the
            # runtime diagnosis they are reached through that test (named with its exit).
            gated = Condition(f"{cond.label}: {exit_text}", cond.where, cond.node, cond.balanced)
            after = _lines_after(target.node, cond.node)
            for (at, _), _m in skipped:
                if at in after:
                    self.branches.setdefault(at, gated)
        (line, _), match = min(skipped, key=lambda item: item[0])
        self.report(node, "DTW002", exit_text, cond, f"{exit_text} inside {cond.where} skips {match.describe(line)} "
                    "on those ranks, so the other ranks will hang in it; let every rank reach "
                    "the collective (broadcast the decision to stop first)")

    def _exit_target(self, leaves_loop: bool) -> int | None:
        for index in range(len(self.frames) - 1, -1, -1):
            if not self.frames[index].is_loop:
                return None if leaves_loop else index
            if leaves_loop:
                return index
        return None

    def calls_in(self, nodes: Sequence[ast.AST]) -> list[tuple[tuple[int, int], Match]]:
        """(position, match) of each collective that ``nodes`` run themselves (not nested functions),
        collective properties (``trainer.log_dir``) included."""
        found = []
        for node in syntax.walk_scope(nodes):
            if isinstance(node, ast.Call):
                match = self.collective(node)
            elif isinstance(node, ast.Attribute):
                match = self.collective_property(node)
            else:
                continue
            if match is not None:
                found.append((syntax.start(node), match))
        return found

    def counts(self, nodes: Sequence[ast.AST]) -> Counter[str]:
        return Counter(match.name for _, match in self.calls_in(nodes))

    def sides(self, node: ast.If) -> tuple[Counter[str], Counter[str]]:
        """How often each collective is called in the body and in the else side of ``node``."""
        if node not in self._sides:
            self._sides[node] = self.counts(node.body), self.counts(node.orelse)
        return self._sides[node]

    def collective(self, call: ast.Call) -> Match | None:
        """What ``call`` is, if it is a collective (or p2p op), or a call of a same-file function that
        calls one (the module's own definition wins over the name)."""
        func, name = call.func, None
        target = self.defs.target(func, self.context)
        if target is not None:
            return self.summary(target, self.segment(func) + "()")
        if isinstance(func, ast.Name):
            name = self.imported.get(func.id)
            op = COLLECTIVES.get(func.id)
            if name is None and op is not None and not op.qualified and not op.restricted:
                name = func.id
        elif isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            if self.counts_on(COLLECTIVES[func.attr], func.value):
                name = func.attr
        if name is not None:
            return Match(name, COLLECTIVES[name], self.segment(func) + "()")
        for keyword in call.keywords:
            if keyword.arg in COLLECTIVE_KEYWORDS and not syntax.is_false(keyword.value):
                text = f"{self.segment(func)}(..., {keyword.arg}={self.segment(keyword.value)})"
                return Match(keyword.arg, COLLECTIVE_KEYWORDS[keyword.arg], text)
        return None

    def collective_property(self, node: ast.Attribute) -> Match | None:
        """``trainer.log_dir`` read (not assigned): a property that runs a collective."""
        op = COLLECTIVE_PROPERTIES.get(node.attr)
        if op is None or not isinstance(node.ctx, ast.Load) or not self.counts_on(op, node.value):
            return None
        return Match(node.attr, op, self.segment(node))

    def summary(self, function: FunctionNode, text: str) -> Match | None:
        """A call of a same-file function that runs a collective itself (first in its body, nested
        functions aside, calls of other same-file functions followed); None when it runs none, runs only
        p2p ops, or runs only on some ranks anyway (``@rank_zero_only``: reported inside)."""
        if function not in self._summaries:
            self._summaries[function] = None  # while in progress: a recursive call adds nothing
            inner = None
            if not any(is_rank_decorator(d) for d in function.decorator_list):
                saved, self.context = self.context, self.defs.contexts.get(function, self.context)
                found = sorted(((pos, m) for pos, m in self.calls_in(function.body) if not m.op.p2p),
                               key=lambda item: item[0])
                self.context = saved
                if found:
                    (line, _), first = found[0]
                    inner = Match(self.defs.qualnames.get(function, function.name),
                                  Op(f"calls {first.text} (line {line})"), "", ((first.text, line), *first.via))
            self._summaries[function] = inner
        inner = self._summaries[function]
        return inner._replace(text=text) if inner is not None else None

    def counts_on(self, op: Op, receiver: ast.expr) -> bool:
        """Whether ``op``'s name, called on (or read from) ``receiver``, is the collective."""
        module = self.module_of(receiver)
        if op.restricted:
            if module is not None:
                return in_modules(module, op.modules)
            return receiver_tail(receiver).endswith(tuple(op.receivers)) if op.receivers else False
        return not op.qualified or module is not None or self.is_distributed(receiver)

    def module_of(self, receiver: ast.expr) -> str | None:
        """The torch.distributed-like module ``receiver`` names, aliases expanded (``dcp`` from ``import
        torch.distributed.checkpoint as dcp``), or None."""
        dotted = syntax.dotted(receiver)
        if dotted is None:
            return None
        head, dot, rest = dotted.partition(".")
        if head in self.aliases:
            dotted = self.aliases[head] + dot + rest
        elif head in CONVENTIONAL_ALIASES:
            dotted = CONVENTIONAL_ALIASES[head] + dot + rest
        return dotted if is_distributed_module(dotted) else None

    def is_distributed(self, receiver: ast.expr) -> bool:
        dotted = syntax.dotted(receiver)
        if dotted is None:
            return False
        tail = receiver_tail(receiver)
        return (dotted in self.aliases or tail in DISTRIBUTED_RECEIVERS or tail.endswith("accelerator")
                or is_distributed_module(dotted))

    def is_rank_test(self, test: ast.expr) -> bool:
        return ranks.mentions_rank(test, self.names)

    # Reporting.
    def report(self, node: Located, code: str, call: str, cond: Condition, message: str) -> None:
        line = self.lines[node.lineno - 1] if node.lineno <= len(self.lines) else ""
        col = len(line.encode()[: node.col_offset].decode(errors="ignore")) + 1  # col_offset counts bytes
        self.findings.append(LintFinding(self.path, node.lineno, col, code, call, cond.label, message))

    def segment(self, node: Located) -> str:
        """The shortened source text of ``node``: ast.get_source_segment without re-splitting the file."""
        if getattr(node, "end_lineno", None) is None or node.end_col_offset is None:
            return syntax.shorten(ast.unparse(node))
        lines = [line.encode() for line in self.lines[node.lineno - 1 : node.end_lineno]]
        lines[-1] = lines[-1][: node.end_col_offset]  # offsets count UTF-8 bytes
        lines[0] = lines[0][node.col_offset :]
        return syntax.shorten(b"\n".join(lines).decode(errors="replace"))

    @staticmethod
    def quote(label: str, node: Located) -> str:
        return f"'{label}' (line {node.lineno})"


def distributed_imports(tree: ast.Module) -> tuple[dict[str, str], dict[str, str]]:
    """Module aliases and what they name (``import torch.distributed.checkpoint as dcp`` gives
    ``{"dcp": "torch.distributed.checkpoint"}``) and collectives imported by name (``from
    torch.distributed import reduce as r`` gives ``{"r": "reduce"}``; a name restricted to some modules,
    such as DCP's ``save``, only from those)."""
    aliases: dict[str, str] = {}
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update((a.asname, a.name) for a in node.names if a.asname and is_distributed_module(a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if is_distributed_module(full):
                    local, op = alias.asname or alias.name, COLLECTIVES.get(alias.name)
                    if op is not None and (not op.restricted or in_modules(node.module, op.modules)):
                        imported[local] = alias.name
                    else:
                        aliases[local] = full
    return aliases, imported


def is_rank_decorator(decorator: ast.expr) -> bool:
    """``@rank_zero_only``, ``@accelerator.on_main_process``, ``@on_process(process_index=1)``..."""
    return syntax.tail(decorator.func if isinstance(decorator, ast.Call) else decorator) in RANK_DECORATORS


def receiver_tail(receiver: ast.expr) -> str:
    """The receiver's last name, lower-case, without leading underscores: ``self._trainer`` gives "trainer"."""
    dotted = syntax.dotted(receiver)
    return dotted.rsplit(".", 1)[-1].lstrip("_").lower() if dotted is not None else ""


def _lines_after(scope: ast.AST, stmt: ast.AST) -> set[int]:
    """The lines of the statements that run after ``stmt`` in ``scope`` on the way out: its following siblings,
    then those of each enclosing statement, up to ``scope`` (never another arm of an enclosing ``if``, and
    never the earlier part of an enclosing loop's body)."""
    path: list[tuple[list[ast.stmt], int]] = []

    def find(node: ast.AST) -> bool:
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, child in enumerate(block):
                if child is stmt or (isinstance(child, ast.AST) and find(child)):
                    path.append((block, i))
                    return True
        return False

    find(scope)
    lines: set[int] = set()
    for block, i in path:
        for later in block[i + 1:]:
            lines.update(range(later.lineno, (later.end_lineno or later.lineno) + 1))
    return lines

