"""Process trees from ``/proc``: a rank and everything it started (DataLoader workers, subprocesses).

A process is named by ``(pid, start time)`` so that a PID the kernel reuses after the process ended is
never signalled by mistake. Descendants are collected *before* anything is signalled: once a rank dies
its children are re-parented (to init or a subreaper) and can no longer be found from it.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, is index 0)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def identity(pid: int) -> Proc | None:
    """``(pid, start time)`` of a live (not zombie) process, else None."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return pid, int(fields[19])


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def children_map() -> dict[int, list[int]]:
    """Parent PID -> child PIDs, from one pass over ``/proc``."""
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, by parent links (sessions do not matter)."""
    children = children_map()
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def tree(roots: list[Proc], spare: frozenset[int] = frozenset()) -> set[Proc]:
    """The live processes among ``roots`` and all their live descendants, except ``spare`` and below."""
    kids = children_map()
    found: set[Proc] = set()
    todo = [p for p in roots if identity(p[0]) == p]
    while todo:
        proc = todo.pop()
        if proc in found or proc[0] in spare:
            continue
        found.add(proc)
        for child in kids.get(proc[0], []):
            ident = identity(child)
            if ident is not None:
                todo.append(ident)
    return found


def alive(proc: Proc) -> bool:
    return identity(proc[0]) == proc


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    return identity(pid) is not None


@dataclass
class Termination:
    """What :func:`terminate_trees` did."""

    roots: list[int]
    descendants: list[int] = field(default_factory=list)  # every non-root process it signalled
    killed: list[int] = field(default_factory=list)  # still alive after the grace period: SIGKILL
    survivors: list[int] = field(default_factory=list)  # alive even after SIGKILL (should stay empty)


def terminate_trees(roots: list[int], grace: float = 5.0, kill_wait: float = 5.0) -> Termination:
    """SIGTERM each root and its descendants, SIGKILL what is left after ``grace`` seconds.

    During the grace period the trees are scanned again (a dying rank may start or re-parent
    processes); everything found is remembered by identity, so orphans are still ended. The calling
    process and its own children are spared (a watchdog a rank started is that rank's descendant).
    """
    spare = frozenset({os.getpid()})
    root_ids = [p for p in (identity(pid) for pid in roots) if p is not None and p[0] not in spare]
    members = tree(root_ids, spare)
    result = Termination(roots=sorted(p[0] for p in root_ids))
    signalled: set[Proc] = set()

    def send(procs: set[Proc], sig: int) -> None:
        for proc in procs:
            if not alive(proc):
                continue
            try:
                os.kill(proc[0], sig)
                if sig == signal.SIGTERM:
                    os.kill(proc[0], signal.SIGCONT)  # a stopped process handles SIGTERM only once continued
            except OSError:
                pass

    deadline = time.monotonic() + grace
    while True:
        new = members - signalled
        send(new, signal.SIGTERM)
        signalled |= new
        if not any(alive(p) for p in signalled) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
        members |= tree([p for p in signalled if alive(p)], spare)
    members |= tree([p for p in signalled if alive(p)], spare)
    left = {p for p in members if alive(p)}
    result.killed = sorted(p[0] for p in left)
    send(left, signal.SIGKILL)
    end = time.monotonic() + kill_wait
    while any(alive(p) for p in left) and time.monotonic() < end:
        time.sleep(0.05)
    result.survivors = sorted(p[0] for p in left if alive(p))
    result.descendants = sorted(p[0] for p in members if p not in root_ids)
    return result
