"""Static check for collectives that only some ranks will reach.

The classic torch.distributed deadlock is a collective inside a rank-conditional branch: rank 0
calls ``dist.barrier()``, the other ranks never do, and every rank waits forever. This module
finds such calls with the standard-library ``ast`` module; nothing is imported or executed.

From the command line (``python -m dtwatch.lint.lint_command`` works the same)::

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
``local_rank``, ``self.global_rank``, ``fabric.global_rank``, ``dist.get_rank()``, ``myRank``; not
``rankings``), one of ``RANK_NAMES`` (``accelerator.is_main_process``, ``is_local_main_process``,
``is_last_process``, ``process_index``, ``trainer.is_global_zero``, ``fabric.is_global_zero``...), an
environment lookup of ``RANK``/``LOCAL_RANK``/``SLURM_PROCID``..., or a local name assigned from one
of those (``is_main = rank == 0``). These are the same on every rank, so they do not count: names for
another rank (``src_rank``, ``peer_rank``: OTHER_RANK_WORDS), ``for`` loop variables
(``for rank in range(world_size)``), ``dist.get_global_rank(group, 0)``, and ``local_rank == -1``
or ``rank is None``, which ask "is this run distributed?".

A function decorated ``@rank_zero_only`` (Lightning), ``@rank_zero_experiment``, ``@accelerator.on_main_process``,
``on_local_main_process``, ``on_last_process``, ``on_process(...)``... runs its body only on some ranks.
``with accelerator.main_process_first():`` (and Fabric's ``rank_zero_first()``) is not a rank test: rank 0
goes first, but every rank runs the body and both barriers.

A collective is a call named in ``COLLECTIVES`` (the table says why each one blocks; the torch.distributed
ones come from the table of ops, :mod:`dtwatch.ops`). Names other
libraries use as well (``gather``, ``reduce``, ``broadcast``, ``send``...) count only on a
torch.distributed-like receiver (``dist``, ``torch.distributed``, ``c10d``, an accelerator, a Lightning
strategy or Fabric, an alias from ``import torch.distributed as td``) or when imported from
torch.distributed, deepspeed.comm or accelerate (``accelerate.utils.gather``, ``broadcast``...). Some names
count only on one kind of receiver or from one module: ``fabric.save``/``fabric.load`` and
``trainer.save_checkpoint`` (they wait in a barrier; ``torch.save``, ``accelerator.save`` do not), and
Distributed Checkpoint's ``save``/``load``/``async_save`` and its state_dict helpers
(``get_model_state_dict``, ``get_optimizer_state_dict``, ``get_state_dict``, ``set_model_state_dict``...),
from ``torch.distributed.checkpoint`` or an alias of it (``dcp.save``). Accelerate's ``wait_for_everyone``,
``gather_for_metrics``, ``pad_across_processes``, ``check_trigger``, Lightning's ``self.all_gather``,
``strategy.barrier``/``broadcast``/``reduce_boolean_decision`` and ``self.log(..., sync_dist=True)`` count
too, and so does reading ``trainer.log_dir`` (the property broadcasts rank 0's directory).

A call of a function or method defined in the same file counts when that function runs a collective
itself or through another such call (``if rank == 0: checkpointer.save(model)``, where ``save`` gathers
the state dict; the message names the chain down to the collective). The lint follows plain names through
the enclosing scopes, ``self.method()``, and ``obj.method()`` where the file builds ``obj`` from one of its
own classes (``obj = Checkpointer(...)``, ``self.ckpt = Checkpointer(...)``); it never guesses from a name,
so a method of an imported class is not followed.
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

Out of scope: calls to functions of other files that call a collective inside (``from utils import
sync_everything``; ``if rank == 0: sync_everything()``), calls that are collective only under some wrapper
or strategy (``model.state_dict()`` under FSDP, ``metric.compute()`` in torchmetrics,
``accelerator.get_state_dict``/``save_model``/``save_state`` under FSDP or DeepSpeed ZeRO-3), and loops
whose trip count depends on the rank.
A function merely *defined* inside a rank-conditional branch is not flagged: it may be called
on every rank.

The modules: this one reads files and applies suppression comments; :mod:`~dtwatch.lint.visitor` walks a
module's tree carrying the rank conditions; :mod:`~dtwatch.lint.ranks` decides what is a rank test;
:mod:`~dtwatch.lint.vocabulary` holds the names; :mod:`~dtwatch.lint.local` finds the same-file function
a call runs; :mod:`~dtwatch.lint.callers` which functions run only under their callers' rank tests (for
``rank_branches``); :mod:`~dtwatch.lint.finding` what is reported.
"""
from __future__ import annotations

import ast
import errno
import functools
import os
import re
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

from dtwatch.lint import callers
from dtwatch.lint.finding import CODES, LintFinding, unparsable
from dtwatch.lint.syntax import split_lines
from dtwatch.lint.visitor import ModuleChecker
from dtwatch.lint.vocabulary import COLLECTIVES, Op

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
    "rank_branch",
    "rank_branches",
]

_SUPPRESS = re.compile(
    r"#\s*(?:dtwatch:\s*ignore|noqa)\b(?:\s*:\s*(?P<codes>[A-Z]+[0-9]*(?:[\s,]+[A-Z]+[0-9]+)*))?",
    re.IGNORECASE,
)


def lint_source(source: str, filename: str = "<string>") -> list[LintFinding]:
    """Findings for one module's source text, sorted by position, suppression comments applied."""
    try:
        checker = ModuleChecker(source, filename, ast.parse(source, filename=filename)).run()
    except (SyntaxError, ValueError, RecursionError) as exc:  # ValueError: NUL bytes
        return [unparsable(filename, exc)]
    lines = split_lines(source)
    kept = [f for f in checker.findings if not _is_suppressed(lines[f.line - 1], f.code)]
    return sorted(kept, key=lambda f: (f.line, f.col, f.code))


def lint_file(path: str | os.PathLike[str]) -> list[LintFinding]:
    """Findings for one file; a file that cannot be read or parsed gives a single DTW000."""
    try:
        with tokenize.open(path) as handle:  # honours a PEP 263 coding cookie
            source = handle.read()
    except (OSError, UnicodeDecodeError, SyntaxError) as exc:
        return [unparsable(str(path), exc)]
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
    its text, e.g. ``if self.gpu_id == 0``). Unparsable source gives an empty map.

    A line of a same-file function without a rank test of its own runs under its callers' test when every
    call of the function in the file does (:mod:`dtwatch.lint.callers`): ``(9, "if rank == 0 (calls
    save() at line 10)")``."""
    try:
        checker = ModuleChecker(source, filename, ast.parse(source, filename=filename)).run()
        own = {line: (c.node.lineno, c.label) for line, c in checker.branches.items()}
        arms = {line: (c.node.lineno, c.where) for line, c in checker.branches.items()}  # the if's two sides differ
        return callers.inherit(checker.tree, checker.defs, own, arms) if own else own
    except (SyntaxError, ValueError, RecursionError):
        return {}


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
        return frozenset(ModuleChecker(source, path, ast.parse(source, filename=path)).run().conditional_lines)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return frozenset()


def _skipped_folder(name: str) -> bool:
    return name.startswith(".") or name in ("__pycache__", "node_modules", "site-packages")


def _is_suppressed(line: str, code: str) -> bool:
    match = _SUPPRESS.search(line)
    if match is None:
        return False
    codes = match.group("codes")
    return codes is None or any(code.startswith(c) for c in re.split(r"[\s,]+", codes.upper()) if c)
