"""Static check for collectives that only some ranks will reach.

The classic torch.distributed deadlock is a collective inside a rank-conditional branch: rank 0
calls ``dist.barrier()``, the other ranks never do, and every rank waits forever. This module
finds such calls with the standard-library ``ast`` module; nothing is imported or executed.

From the command line (``python -m dtwatch.lint.cli`` works the same)::

    $ dtwatch lint train.py src/
    train.py:12:9: DTW001 dist.barrier() inside rank-conditional branch 'if rank == 0' (line 11): ...

From Python::

    >>> from dtwatch.lint.checker import lint_source
    >>> src = "import torch.distributed as dist\\nif dist.get_rank() == 0:\\n    dist.barrier()\\n"
    >>> [(f.line, f.code, f.call, f.condition) for f in lint_source(src, "train.py")]
    [(3, 'DTW001', 'dist.barrier()', 'if dist.get_rank() == 0')]

``lint_paths([...])`` checks files and directories (``*.py``, recursively); ``is_rank_conditional_line``
tells the watchdog whether a line it found in a stack lies in rank-conditional code.

Codes
    DTW000  could not parse the file (unreadable, bad encoding or syntax error).
    DTW001  collective inside a rank-conditional branch: the ``if`` body and its ``else``/``elif``
            side, a ``while`` body, either side of ``x if rank == 0 else y``, the operands after a
            rank test in ``rank == 0 and dist.barrier()``, or a function decorated ``@rank_zero_only``.
    DTW002  ``return``/``break``/``continue``/``sys.exit()`` in a rank-conditional branch that skips a
            collective later in the same function or loop body.
    DTW003  point-to-point op (send/recv...) in a rank-conditional branch. That is how p2p code is
            normally written, so the CLI reports it only when asked: ``--select DTW003``.

A test is rank-conditional when it mentions a rank: a name whose last word is ``rank`` (``rank``,
``local_rank``, ``self.global_rank``, ``dist.get_rank()``, ``myRank``; not ``rankings``), one of
``RANK_NAMES`` (``is_main_process``, ``trainer.is_global_zero``...), an environment lookup of
``RANK``/``LOCAL_RANK``/``SLURM_PROCID``..., or a local name assigned from one of those
(``is_main = rank == 0``). These are the same on every rank, so they do not count: names for
another rank (``src_rank``, ``peer_rank``: OTHER_RANK_WORDS), ``for`` loop variables
(``for rank in range(world_size)``), ``dist.get_global_rank(group, 0)``, and ``local_rank == -1``
or ``rank is None``, which ask "is this run distributed?".

A collective is a call named in ``COLLECTIVES`` (the table says why each one blocks). Names other
libraries use as well (``gather``, ``reduce``, ``broadcast``, ``send``...) count only on a
torch.distributed-like receiver (``dist``, ``torch.distributed``, ``c10d``, an accelerator, a Lightning
strategy or Fabric, an alias from ``import torch.distributed as td``) or when imported from
torch.distributed, deepspeed.comm or accelerate. ``self.log(..., sync_dist=True)`` counts too.
The test of an ``if`` runs on every rank, so a collective in it is not reported by that ``if``.

A collective that the other ranks call too is not reported: when both sides of the ``if``/``else``
call it equally often (``if rank == src: dist.scatter(t, chunks) else: dist.scatter(t)``), or when
another, opposite test of the same rank in the same function calls it, as in "rank 0 goes first"::

    if local_rank not in (-1, 0):
        dist.barrier()      # the others wait here...
    yield
    if local_rank == 0:
        dist.barrier()      # ...until rank 0 is done

Suppress a finding with ``# dtwatch: ignore`` or ``# noqa: DTW001`` on the reported line.

Out of scope: calls to your own functions that call a collective inside (``if rank == 0:
sync_everything()``), calls that are collective only under some wrapper (``model.state_dict()``
under FSDP, ``metric.compute()`` in torchmetrics), and loops whose trip count depends on the rank.
A function merely *defined* inside a rank-conditional branch is not flagged: it may be called
on every rank.
"""
from __future__ import annotations

import ast
import dataclasses
import errno
import functools
import os
import re
import tokenize
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "CODES",
    "COLLECTIVES",
    "LintFinding",
    "Op",
    "is_rank_conditional_line",
    "iter_python_files",
    "lint_file",
    "lint_paths",
    "lint_source",
]

CODES: dict[str, str] = {
    "DTW000": "could not parse",
    "DTW001": "collective inside a rank-conditional branch",
    "DTW002": "rank-conditional early exit before a collective",
    "DTW003": "point-to-point op inside a rank-conditional branch",
}


class Op(NamedTuple):
    """Why a call blocks, and how sure we can be from its name alone."""

    reason: str
    qualified: bool = False  # a common name: needs a distributed receiver or import to count
    p2p: bool = False  # point-to-point: reported as DTW003 and never as a skipped collective


COLLECTIVES: dict[str, Op] = {
    # torch.distributed collectives: every rank of the group calls them, in the same order.
    "all_reduce": Op("every rank contributes to and receives the reduction"),
    "all_reduce_coalesced": Op("all_reduce over a list of tensors"),
    "all_gather": Op("every rank contributes to and receives every tensor"),
    "all_gather_into_tensor": Op("all_gather into one output tensor"),
    "all_gather_object": Op("pickles and all-gathers Python objects"),
    "all_gather_coalesced": Op("all_gather over a list of tensors"),
    "_all_gather_base": Op("older name of all_gather_into_tensor"),
    "all_to_all": Op("every rank exchanges a chunk with every other rank"),
    "all_to_all_single": Op("all_to_all on one flat tensor"),
    "reduce_scatter": Op("reduces, then hands every rank its chunk"),
    "reduce_scatter_tensor": Op("reduce_scatter into one tensor"),
    "_reduce_scatter_base": Op("older name of reduce_scatter_tensor"),
    "barrier": Op("returns only once every rank has arrived"),
    "monitored_barrier": Op("a barrier that names the missing ranks after its timeout"),
    "broadcast_object_list": Op("the source sends, every other rank must receive"),
    "scatter_object_list": Op("the source sends, every other rank must receive"),
    "gather_object": Op("every rank sends to the destination, which waits for all"),
    "new_group": Op("every rank of the default group must call it, even ranks left out"),
    "new_subgroups": Op("builds groups with new_group: every rank must call it"),
    "new_subgroups_by_enumeration": Op("builds groups with new_group: every rank must call it"),
    "init_process_group": Op("a rendezvous: blocks until every rank has joined"),
    "destroy_process_group": Op("tears the group down; every rank must call it"),
    # The same, under names that other libraries use too (functools.reduce, asyncio.gather...).
    "broadcast": Op("the source sends, every other rank must receive", qualified=True),
    "gather": Op("every rank sends to the destination (accelerator.gather: to all)", qualified=True),
    "scatter": Op("the source sends each rank its chunk", qualified=True),
    "reduce": Op("every rank sends to the destination (accelerator.reduce: to all)", qualified=True),
    # Library calls that run a collective inside.
    "wait_for_everyone": Op("Accelerate's barrier"),
    "gather_for_metrics": Op("Accelerate: an all_gather that drops duplicated samples"),
    "pad_across_processes": Op("Accelerate: all-gathers the sizes to pad to the largest"),
    "summon_full_params": Op("FSDP: all-gathers the full parameters on every rank"),
    "full_optim_state_dict": Op("FSDP: gathers the optimizer state from every rank"),
    # Point-to-point: the peer blocks until the matching call is posted.
    "send": Op("blocks until the destination posts the matching recv", qualified=True, p2p=True),
    "recv": Op("blocks until the source posts the matching send", qualified=True, p2p=True),
    "isend": Op("the destination must post the matching recv", qualified=True, p2p=True),
    "irecv": Op("the source must post the matching send", qualified=True, p2p=True),
    "send_object_list": Op("send of pickled objects", p2p=True),
    "recv_object_list": Op("recv of pickled objects", p2p=True),
    "batch_isend_irecv": Op("batched isend/irecv; peers must post the matching ops", p2p=True),
}

# Keyword arguments that make an ordinary-looking call collective.
COLLECTIVE_KEYWORDS: dict[str, Op] = {
    "sync_dist": Op("Lightning's log(..., sync_dist=True) all-reduces the logged value"),
}

# Receivers whose gather/reduce/broadcast/send... are the distributed ones (compared lower-case).
DISTRIBUTED_RECEIVERS = frozenset({
    "dist", "distributed", "c10d", "distributed_c10d", "accelerator", "strategy", "fabric",
})
DISTRIBUTED_MODULES = ("torch.distributed", "deepspeed.comm", "accelerate")

# Rank-ish names besides those whose last word is "rank" (compared lower-case).
RANK_NAMES = frozenset({
    "is_main_process", "is_local_main_process", "main_process", "is_main",
    "is_master", "is_master_process", "is_local_master", "is_master_ordinal",
    "is_rank_zero", "is_rank_0", "is_rank0", "rank0", "rank_zero", "rank_zero_only", "rank_id",
    "is_global_zero", "is_local_zero", "process_index", "local_process_index",
    "get_ordinal", "get_local_ordinal",
})
RANK_ENV_KEYS = frozenset({"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"})  # plus *RANK
# "src_rank", "peer_rank"...: another rank, the same number on every rank.
OTHER_RANK_WORDS = frozenset({
    "src", "dst", "source", "dest", "destination", "root", "peer", "target", "master", "main",
    "leader", "failed", "next", "prev", "max", "min", "num", "per", "each", "every", "by",
})
RANK_TRANSLATIONS = frozenset({"get_global_rank", "get_group_rank"})  # (group, some rank) -> rank
RANK_DECORATORS = frozenset({
    "rank_zero_only", "master_only", "main_process_only",  # Lightning, mmcv
    "on_main_process", "on_local_main_process", "on_process", "on_local_process",  # Accelerate
})
# Every rank test needs one of these words, so a file without any is skipped after parsing.
_RANK_HINT = re.compile("|".join(sorted({"rank", *RANK_NAMES, *RANK_DECORATORS, *RANK_ENV_KEYS})), re.IGNORECASE)
EXIT_CALLS = frozenset({"sys.exit", "exit", "quit", "os._exit"})
_CONVERSIONS = frozenset({"int", "str", "bool", "float"})
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_WORD_BREAK = re.compile(r"_+|(?<=[a-z0-9])(?=[A-Z])")
_LINE_BREAK = re.compile(r"\r\n?|\n")
_SUPPRESS = re.compile(
    r"#\s*(?:dtwatch:\s*ignore|noqa)\b(?:\s*:\s*(?P<codes>[A-Z]+[0-9]*(?:[\s,]+[A-Z]+[0-9]+)*))?",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class LintFinding:
    """One problem. ``line`` and ``col`` are 1-based, as in flake8 and editors."""

    path: str
    line: int
    col: int
    code: str
    call: str  # "dist.barrier()", or the exit ("return") for DTW002; empty for DTW000
    condition: str  # "if rank == 0", "@rank_zero_only"...; empty for DTW000
    message: str

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def lint_source(source: str, filename: str = "<string>") -> list[LintFinding]:
    """Findings for one module's source text, sorted by position, suppression comments applied."""
    try:
        checker = _Checker(source, filename, ast.parse(source, filename=filename)).run()
    except (SyntaxError, ValueError, RecursionError) as exc:  # ValueError: NUL bytes
        return [_unparsable(filename, exc)]
    lines = _LINE_BREAK.split(source)
    kept = [f for f in checker.findings if not _is_suppressed(lines[f.line - 1], f.code)]
    return sorted(kept, key=lambda f: (f.line, f.col, f.code))


def lint_file(path: str | os.PathLike[str]) -> list[LintFinding]:
    """Findings for one file; a file that cannot be read or parsed gives a single DTW000."""
    try:
        with tokenize.open(path) as handle:  # honours a PEP 263 coding cookie
            source = handle.read()
    except (OSError, UnicodeDecodeError, SyntaxError) as exc:
        return [_unparsable(str(path), exc)]
    return lint_source(source, str(path))


def lint_paths(paths: Iterable[str | os.PathLike[str]]) -> list[LintFinding]:
    """Findings for files and directories (searched recursively for ``*.py``)."""
    return [finding for path in iter_python_files(paths) for finding in lint_file(path)]


def iter_python_files(paths: Iterable[str | os.PathLike[str]]) -> Iterator[Path]:
    """Each file named, and each ``*.py`` under each directory named, once, in sorted order.

    Hidden directories, ``__pycache__``, ``node_modules`` and ``site-packages`` are not entered.
    Raises FileNotFoundError for a path that does not exist.
    """
    seen: set[str] = set()
    for raw in paths:
        root = Path(raw)
        if root.is_dir():
            files = []
            for folder, subfolders, names in os.walk(root):
                subfolders[:] = sorted(d for d in subfolders if not _skipped_folder(d))
                files += [Path(folder, name) for name in sorted(names) if name.endswith(".py")]
        elif root.exists():
            files = [root]
        else:
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", str(root))
        for path in files:
            key = os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                yield path


def is_rank_conditional_line(path: str | os.PathLike[str], line: int) -> bool:
    """Whether ``line`` of ``path`` runs only on some ranks (inside a rank-conditional branch).

    Meant for the watchdog, as evidence when it decides which side of a desync is the culprit.
    Parsed files are cached (keyed on modification time); an unreadable file gives False.
    """
    try:
        stat = os.stat(path)
    except (OSError, ValueError):
        return False
    return line in _conditional_lines(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


def rank_branches(source: str, filename: str = "<string>") -> dict[int, tuple[int, str]]:
    """For each line of ``source`` that runs only on some ranks: (line of the innermost rank test,
    its text, e.g. ``if self.gpu_id == 0``). Unparsable source gives an empty map."""
    try:
        checker = _Checker(source, filename, ast.parse(source, filename=filename)).run()
    except (SyntaxError, ValueError, RecursionError):
        return {}
    return {line: (getattr(c.node, "lineno", line), c.label) for line, c in checker.branches.items()}


def rank_branch(path: str | os.PathLike[str], line: int) -> tuple[int, str] | None:
    """The rank test that ``line`` of ``path`` runs under (innermost), or None: see rank_branches."""
    try:
        stat = os.stat(path)
    except (OSError, ValueError):
        return None
    return _branches(os.path.realpath(path), stat.st_mtime_ns, stat.st_size).get(line)


@functools.lru_cache(maxsize=256)
def _branches(path: str, mtime_ns: int, size: int) -> dict[int, tuple[int, str]]:
    try:
        with tokenize.open(path) as handle:
            return rank_branches(handle.read(), path)
    except (OSError, UnicodeDecodeError, SyntaxError):
        return {}


@functools.lru_cache(maxsize=256)
def _conditional_lines(path: str, mtime_ns: int, size: int) -> frozenset[int]:
    try:
        with tokenize.open(path) as handle:
            source = handle.read()
        return frozenset(_Checker(source, path, ast.parse(source, filename=path)).run().conditional_lines)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return frozenset()


@dataclass(frozen=True)
class _Condition:
    label: str  # "if rank == 0": LintFinding.condition
    where: str  # "rank-conditional branch 'if rank == 0' (line 12)": used in messages
    node: ast.AST  # the statement or expression holding the test
    balanced: frozenset[str] = frozenset()  # collectives the other ranks call elsewhere


class _Match(NamedTuple):
    name: str  # the COLLECTIVES (or COLLECTIVE_KEYWORDS) key
    op: Op
    text: str  # "dist.barrier()", as shown in findings


class _Arm(NamedTuple):
    """One side of a rank-conditional if, for pairing up "rank 0 goes first" ifs."""

    node: ast.If
    negated: bool  # reads "not this rank": the else side of "if rank == 0", the body of "if rank != 0"
    subjects: frozenset[str]  # what the test reads: {"local_rank"}, {"dist.get_rank"}
    surplus: Counter[str]  # collectives this side calls more often than the other side


class _Frame(NamedTuple):
    node: ast.AST  # the module, a function or a loop
    is_loop: bool
    depth: int  # how many conditions were active when it was entered


class _Checker:
    """Walks one module, carrying the rank conditions active at each node."""

    def __init__(self, source: str, path: str, tree: ast.Module) -> None:
        self.source, self.path, self.tree = source, path, tree
        self.lines = _LINE_BREAK.split(source)
        self.aliases: frozenset[str] = frozenset()  # local names of torch.distributed-like modules
        self.imported: dict[str, str] = {}  # local name -> collective, from "from torch.distributed import"
        self.findings: list[LintFinding] = []
        self.conditional_lines: set[int] = set()
        self.branches: dict[int, _Condition] = {}  # line -> the innermost rank condition it runs under
        self.frames: list[_Frame] = []
        self.names: Mapping[str, bool] = {}  # this scope's exceptions to _is_rank_name
        self.rank_attrs: frozenset[str] = frozenset()  # attributes assigned a rank (self.gpu_id)
        self.arms: list[_Arm] = []  # both sides of every rank-conditional if in this scope
        self._sides: dict[ast.If, tuple[Counter[str], Counter[str]]] = {}  # cache for sides()

    def run(self) -> _Checker:
        if _RANK_HINT.search(self.source):
            self.aliases, self.imported = _distributed_imports(self.tree)
            self.rank_attrs = _rank_attributes(self.tree)
            self._scope(self.tree, (), {})
        return self

    def visit(self, node: ast.AST, conds: tuple[_Condition, ...]) -> None:
        if conds and hasattr(node, "lineno"):
            last = node.lineno if hasattr(node, "body") else node.end_lineno or node.lineno
            self.conditional_lines.update(range(node.lineno, last + 1))
            for line in range(node.lineno, last + 1):
                self.branches[line] = conds[-1]
        getattr(self, "visit_" + type(node).__name__, self.generic_visit)(node, conds)

    def generic_visit(self, node: ast.AST, conds: tuple[_Condition, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            self.visit(child, conds)

    def visit_all(self, nodes: list[ast.stmt], conds: tuple[_Condition, ...]) -> None:
        for node in nodes:
            self.visit(node, conds)

    # Scopes and loops.
    def _scope(self, node: ast.AST, body_conds: tuple[_Condition, ...], inherited: Mapping[str, bool]) -> None:
        """Visit the body of a module, function or class, whose names and ifs are its own."""
        saved = self.names, self.arms
        if isinstance(node, ast.Module):
            inherited = {**inherited, **{"." + attr: True for attr in self.rank_attrs}}
        self.names = _scope_names(node, inherited)
        self.arms = []
        for child in _walk_scope(node.body):
            if isinstance(child, ast.If) and self.is_rank_test(child.test):
                body, orelse = self.sides(child)
                negated, subjects = _negated(child.test, self.names), _rank_subjects(child.test, self.names)
                self.arms += [
                    _Arm(child, negated, subjects, body - orelse),
                    _Arm(child, not negated, subjects, orelse - body),
                ]
        self.frames.append(_Frame(node, False, len(body_conds)))
        self.visit_all(node.body, body_conds)
        self.frames.pop()
        self.names, self.arms = saved

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef, conds: tuple[_Condition, ...]
                          ) -> None:
        self.visit_all(node.decorator_list, conds)
        self.visit(node.args, conds)
        if node.returns:
            self.visit(node.returns, conds)
        body_conds: tuple[_Condition, ...] = ()  # defined here, called who knows where
        for decorator in node.decorator_list:
            if _tail(decorator.func if isinstance(decorator, ast.Call) else decorator) in RANK_DECORATORS:
                label = "@" + self.segment(decorator)
                body_conds = (_Condition(label, f"rank-restricted function {self.quote(label, decorator)}", node),)
        self._scope(node, body_conds, self.names)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef, conds: tuple[_Condition, ...]) -> None:
        self.visit_all([*node.decorator_list, *node.bases, *node.keywords], conds)
        self._scope(node, conds, self.names)  # the class body runs where the class statement does

    def visit_Lambda(self, node: ast.Lambda, conds: tuple[_Condition, ...]) -> None:
        self.visit(node.args, conds)
        self.visit(node.body, ())

    def visit_For(self, node: ast.For | ast.AsyncFor, conds: tuple[_Condition, ...]) -> None:
        self.visit(node.target, conds)
        self.visit(node.iter, conds)
        self._loop_body(node, conds)
        self.visit_all(node.orelse, conds)

    visit_AsyncFor = visit_For

    def visit_While(self, node: ast.While, conds: tuple[_Condition, ...]) -> None:
        self.visit(node.test, conds)
        body_conds = conds
        if self.is_rank_test(node.test):
            label = "while " + self.segment(node.test)
            body_conds += (_Condition(label, f"rank-conditional loop {self.quote(label, node)}", node),)
        self._loop_body(node, body_conds)
        self.visit_all(node.orelse, conds)

    def _loop_body(self, node: ast.For | ast.AsyncFor | ast.While, conds: tuple[_Condition, ...]) -> None:
        self.frames.append(_Frame(node, True, len(conds)))
        self.visit_all(node.body, conds)
        self.frames.pop()

    # Branches.
    def visit_If(self, node: ast.If, conds: tuple[_Condition, ...]) -> None:
        self.visit(node.test, conds)  # the test itself runs wherever the if does
        if not self.is_rank_test(node.test):
            self.visit_all(node.body, conds)
            self.visit_all(node.orelse, conds)
            return
        keyword = "elif" if self.lines[node.lineno - 1].lstrip().startswith("elif") else "if"
        label = f"{keyword} {self.segment(node.test)}"
        quoted = self.quote(label, node)
        body, orelse = self.sides(node)
        negated = _negated(node.test, self.names)
        then = _Condition(label, f"rank-conditional branch {quoted}", node,
                          self._balanced(node, negated, body, orelse))
        other = _Condition(label, f"else branch of rank-conditional {quoted}", node,
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
        subjects, span = _rank_subjects(node.test, self.names), (_start(node), _end(node))
        for arm in self.arms:
            other_span = (_start(arm.node), _end(arm.node))
            nested = span[0] <= other_span[0] <= span[1] or other_span[0] <= span[0] <= other_span[1]
            if not nested and arm.negated != negated and arm.subjects == subjects:
                names |= {name for name, count in surplus.items() if arm.surplus[name] == count}
        return frozenset(names)

    def visit_IfExp(self, node: ast.IfExp, conds: tuple[_Condition, ...]) -> None:
        self.visit(node.test, conds)
        if self.is_rank_test(node.test):
            label = f"... if {self.segment(node.test)} else ..."
            shared = frozenset(self.counts([node.body])) & frozenset(self.counts([node.orelse]))
            conds += (_Condition(label, f"rank-conditional expression {self.quote(label, node)}", node, shared),)
        self.visit(node.body, conds)
        self.visit(node.orelse, conds)

    def visit_BinOp(self, node: ast.BinOp, conds: tuple[_Condition, ...]) -> None:
        operands = []  # "a + b + c + ...": a loop, not a recursion, down the left-nested chain
        while isinstance(node, ast.BinOp):
            operands.append(node.right)
            node = node.left
        for operand in [node, *reversed(operands)]:
            self.visit(operand, conds)

    def visit_BoolOp(self, node: ast.BoolOp, conds: tuple[_Condition, ...]) -> None:
        operator = "and" if isinstance(node.op, ast.And) else "or"
        gated = False
        for value in node.values:  # operands after a rank test run only on some ranks
            self.visit(value, conds)
            if not gated and self.is_rank_test(value):
                gated = True
                label = f"{self.segment(value)} {operator} ..."
                conds += (_Condition(label, f"short-circuit after rank test {self.quote(label, value)}", node),)

    # Calls and exits.
    def visit_Call(self, node: ast.Call, conds: tuple[_Condition, ...]) -> None:
        match = self.collective(node)
        unbalanced = [c for c in conds if match and match.name not in c.balanced]
        if unbalanced:
            cond, text = unbalanced[-1], match.text
            if match.op.p2p:
                advice = f"{match.op.reason}; check that every rank's path posts the matching call"
            else:
                advice = ("only some ranks will call it and the others will hang; "
                          "call it on every rank and gate only the side effect")
            code = "DTW003" if match.op.p2p else "DTW001"
            self.report(node, code, text, cond, f"{text} inside {cond.where}: {advice}")
        if _dotted(node.func) in EXIT_CALLS:
            self.check_exit(node, self.segment(node.func) + "()", conds)
        self.generic_visit(node, conds)

    def visit_Return(self, node: ast.Return, conds: tuple[_Condition, ...]) -> None:
        self.check_exit(node, "return", conds)
        self.generic_visit(node, conds)

    def visit_Break(self, node: ast.Break, conds: tuple[_Condition, ...]) -> None:
        self.check_exit(node, "break", conds)

    def visit_Continue(self, node: ast.Continue, conds: tuple[_Condition, ...]) -> None:
        self.check_exit(node, "continue", conds)

    def check_exit(self, node: ast.AST, exit_text: str, conds: tuple[_Condition, ...]) -> None:
        """DTW002 when a rank-conditional exit skips a collective the other ranks will still call."""
        leaves_loop = exit_text in ("break", "continue")
        index = self._exit_target(leaves_loop)
        if index is None or len(conds) <= self.frames[index].depth:
            return  # no rank condition between the exit and what it leaves
        cond, target = conds[-1], self.frames[index]
        start, end = _start(cond.node), _end(cond.node)

        def outside(pos: tuple[int, int]) -> bool:
            return not start <= pos <= end

        def collectives(body: list[ast.stmt]) -> list[tuple[tuple[int, int], str]]:
            return [(pos, match.text) for pos, match in self.calls_in(body) if not match.op.p2p]

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
        (line, _), text = min(skipped)
        self.report(node, "DTW002", exit_text, cond, f"{exit_text} inside {cond.where} skips {text} "
                    f"(line {line}) on those ranks, so the other ranks will hang in it; let every rank reach "
                    "the collective (broadcast the decision to stop first)")

    def _exit_target(self, leaves_loop: bool) -> int | None:
        for index in range(len(self.frames) - 1, -1, -1):
            if not self.frames[index].is_loop:
                return None if leaves_loop else index
            if leaves_loop:
                return index
        return None

    def calls_in(self, nodes: list[ast.AST]) -> list[tuple[tuple[int, int], _Match]]:
        """(position, match) of each collective that ``nodes`` run themselves (not nested functions)."""
        found = []
        for node in _walk_scope(nodes):
            match = self.collective(node) if isinstance(node, ast.Call) else None
            if match:
                found.append((_start(node), match))
        return found

    def counts(self, nodes: list[ast.AST]) -> Counter[str]:
        return Counter(match.name for _, match in self.calls_in(nodes))

    def sides(self, node: ast.If) -> tuple[Counter[str], Counter[str]]:
        """How often each collective is called in the body and in the else side of ``node``."""
        if node not in self._sides:
            self._sides[node] = self.counts(node.body), self.counts(node.orelse)
        return self._sides[node]

    def collective(self, call: ast.Call) -> _Match | None:
        """What ``call`` is, if it is a collective (or p2p op)."""
        func, name = call.func, None
        if isinstance(func, ast.Name):
            name = self.imported.get(func.id)
            if name is None and func.id in COLLECTIVES and not COLLECTIVES[func.id].qualified:
                name = func.id
        elif isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            if not COLLECTIVES[func.attr].qualified or self.is_distributed(func.value):
                name = func.attr
        if name is not None:
            return _Match(name, COLLECTIVES[name], self.segment(func) + "()")
        for keyword in call.keywords:
            if keyword.arg in COLLECTIVE_KEYWORDS and not _is_false(keyword.value):
                text = f"{self.segment(func)}(..., {keyword.arg}={self.segment(keyword.value)})"
                return _Match(keyword.arg, COLLECTIVE_KEYWORDS[keyword.arg], text)
        return None

    def is_distributed(self, receiver: ast.expr) -> bool:
        dotted = _dotted(receiver)
        if dotted is None:
            return False
        tail = dotted.rsplit(".", 1)[-1].lstrip("_").lower()
        return (dotted in self.aliases or tail in DISTRIBUTED_RECEIVERS or tail.endswith("accelerator")
                or _is_distributed_module(dotted))

    def is_rank_test(self, test: ast.expr) -> bool:
        return _mentions_rank(test, self.names)

    # Reporting.
    def report(self, node: ast.AST, code: str, call: str, cond: _Condition, message: str) -> None:
        line = self.lines[node.lineno - 1] if node.lineno <= len(self.lines) else ""
        col = len(line.encode()[: node.col_offset].decode(errors="ignore")) + 1  # col_offset counts bytes
        self.findings.append(LintFinding(self.path, node.lineno, col, code, call, cond.label, message))

    def segment(self, node: ast.AST) -> str:
        """The shortened source text of ``node``: ast.get_source_segment without re-splitting the file."""
        if getattr(node, "end_lineno", None) is None or node.end_col_offset is None:
            return _shorten(ast.unparse(node))
        lines = [line.encode() for line in self.lines[node.lineno - 1 : node.end_lineno]]
        lines[-1] = lines[-1][: node.end_col_offset]  # offsets count UTF-8 bytes
        lines[0] = lines[0][node.col_offset :]
        return _shorten(b"\n".join(lines).decode(errors="replace"))

    @staticmethod
    def quote(label: str, node: ast.AST) -> str:
        return f"'{label}' (line {node.lineno})"


def _mentions_rank(node: ast.AST, names: Mapping[str, bool], through_calls: bool = True) -> bool:
    """Whether an expression depends on the rank. ``names`` overrides the name rule for this scope
    (see _scope_names). With ``through_calls=False`` a call counts only if it is a rank getter or a
    conversion of one (``int(os.environ["RANK"])``), not ``f(rank)``."""
    stack = [node]  # iterative: generated code nests "a + b + ..." deeper than the recursion limit
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name):
            if names[node.id] if node.id in names else _is_rank_name(node.id):
                return True
            continue
        if isinstance(node, ast.Attribute):
            if _is_rank_name(node.attr) or names.get("." + node.attr):
                return True
            stack.append(node.value)
            continue
        key = _env_key(node)
        if key is not None:
            if _is_rank_name(key) or key in RANK_ENV_KEYS:
                return True
            continue
        if isinstance(node, (ast.Lambda, ast.Constant)) or _is_sentinel_check(node):
            continue
        if isinstance(node, ast.Call):
            arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
            if _tail(node.func) in RANK_TRANSLATIONS and len(arguments) >= 2:  # get_global_rank(group, 0)
                stack += arguments
                continue
            if not through_calls:
                stack.append(node.func)
                if _tail(node.func) in _CONVERSIONS:
                    stack += node.args
                continue
        stack.extend(ast.iter_child_nodes(node))
    return False


def _rank_subjects(test: ast.expr, names: Mapping[str, bool]) -> frozenset[str]:
    """The rank references a test reads, as text: ``{"local_rank"}`` for ``local_rank not in [-1, 0]``."""
    return frozenset(
        ast.unparse(node) for node in ast.walk(test)
        if _mentions_rank(node, names) and not any(_mentions_rank(c, names) for c in ast.iter_child_nodes(node))
    )


def _negated(test: ast.expr, names: Mapping[str, bool]) -> bool:
    """Whether a rank test reads "not this rank" (``not``, ``!=``, ``not in``, ``>``): pairs up the
    two ifs of "rank 0 goes first"."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return not _negated(test.operand, names)
    if isinstance(test, ast.BoolOp):
        return any(_negated(value, names) for value in test.values if _mentions_rank(value, names))
    negative = (ast.NotEq, ast.NotIn, ast.IsNot, ast.Gt, ast.GtE)
    return isinstance(test, ast.Compare) and isinstance(test.ops[0], negative)


def _is_rank_name(name: str) -> bool:
    """``rank``, ``local_rank``, ``RANK``, ``myRank``, ``get_rank`` and RANK_NAMES; not ``rankings``,
    nor ``src_rank`` and the like (OTHER_RANK_WORDS)."""
    if name.lower() in RANK_NAMES:
        return True
    words = [word.lower() for word in _WORD_BREAK.split(name) if word]
    return bool(words) and words[-1] == "rank" and (len(words) == 1 or words[-2] not in OTHER_RANK_WORDS)


def _env_key(node: ast.AST) -> str | None:
    """The key of ``os.environ["K"]``, ``os.environ.get("K")`` or ``os.getenv("K")``."""
    if isinstance(node, ast.Subscript) and _tail(node.value) == "environ":
        key = node.slice
    elif isinstance(node, ast.Call) and node.args and (
        _tail(node.func) == "getenv"
        or (isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
            and _tail(node.func.value) == "environ")
    ):
        key = node.args[0]
    else:
        return None
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def _is_sentinel_check(node: ast.AST) -> bool:
    """``local_rank == -1`` / ``rank is None``: "is this run distributed?", alike on every rank."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1
            and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.Is, ast.IsNot))):
        return False
    right = node.comparators[0]
    if isinstance(right, ast.Constant):
        return right.value is None
    return (isinstance(right, ast.UnaryOp) and isinstance(right.op, ast.USub)
            and isinstance(right.operand, ast.Constant) and type(right.operand.value) is int
            and right.operand.value == 1)


def _scope_names(scope: ast.AST, inherited: Mapping[str, bool]) -> dict[str, bool]:
    """A scope's exceptions to the name rule: names assigned from a rank expression are rank-ish
    (``is_main = rank == 0``), ``for`` loop variables are not (``for peer_rank in ranks``: the same
    on every rank). Enclosing scopes' exceptions hold unless this scope binds the name itself."""
    pairs, loop_vars = [], set()
    for node in _walk_scope(scope.body):
        if isinstance(node, ast.Assign):
            pairs += [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            if isinstance(node.target, ast.Name):
                pairs.append((node.target.id, node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            loop_vars |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    params = {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)} if hasattr(scope, "args") else set()
    assigned = params | loop_vars | {name for name, _ in pairs}
    names = {name: value for name, value in inherited.items() if name not in assigned}
    names.update(dict.fromkeys(loop_vars, False))
    changed = True
    while changed:
        changed = False
        for name, value in pairs:
            if not names.get(name) and _mentions_rank(value, names, through_calls=False):
                names[name] = True
                changed = True
    return names


def _rank_attributes(tree: ast.Module) -> frozenset[str]:
    """Attributes assigned a rank anywhere in the module: ``self.gpu_id = int(os.environ["LOCAL_RANK"])``
    makes ``self.gpu_id == 0`` a rank test in every method."""
    attrs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _mentions_rank(node.value, {}, through_calls=False):
            attrs.update(t.attr for t in node.targets if isinstance(t, ast.Attribute))
    return frozenset(attrs)


def _distributed_imports(tree: ast.Module) -> tuple[frozenset[str], dict[str, str]]:
    """Module aliases (``import torch.distributed as td``) and collectives imported by name
    (``from torch.distributed import reduce as r`` gives ``{"r": "reduce"}``)."""
    aliases: set[str] = set()
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.asname and _is_distributed_module(a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if _is_distributed_module(f"{node.module}.{alias.name}"):
                    local = alias.asname or alias.name
                    if alias.name in COLLECTIVES:
                        imported[local] = alias.name
                    else:
                        aliases.add(local)
    return frozenset(aliases), imported


def _is_distributed_module(dotted: str) -> bool:
    return any(dotted == m or dotted.startswith(m + ".") for m in DISTRIBUTED_MODULES)


def _walk_scope(nodes: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of ``nodes`` that runs with them: nested functions and classes are not entered."""
    stack: list[ast.AST] = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _dotted(node: ast.AST) -> str | None:
    """``"torch.distributed.barrier"`` for a chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _tail(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not node.value


def _start(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


def _end(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno or node.lineno, node.end_col_offset or 0


def _shorten(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _skipped_folder(name: str) -> bool:
    return name.startswith(".") or name in ("__pycache__", "node_modules", "site-packages")


def _is_suppressed(line: str, code: str) -> bool:
    match = _SUPPRESS.search(line)
    if match is None:
        return False
    codes = match.group("codes")
    return codes is None or any(code.startswith(c) for c in re.split(r"[\s,]+", codes.upper()) if c)


def _unparsable(path: str, exc: BaseException) -> LintFinding:
    if isinstance(exc, SyntaxError):
        line, col, reason = exc.lineno or 1, exc.offset or 1, f"{exc.msg}"
    elif isinstance(exc, RecursionError):
        line, col, reason = 1, 1, "nested too deeply to check"
    else:
        line, col, reason = 1, 1, str(exc)
    return LintFinding(path, line, col, "DTW000", "", "", f"could not parse: {reason}")
