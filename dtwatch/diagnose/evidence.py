"""What the diagnosis may look at besides the ranks' states, behind one small interface.

The diagnosis itself does no I/O: it asks an :class:`Evidence` for source lines, rank-conditional
branches (the static check of :mod:`dtwatch.lint.checker`), loop structure, stacks, Flight Recorder entries
and how a process ended. :class:`FileEvidence` answers from this machine (the live watchdog,
``dtwatch analyze``); :class:`RecordedEvidence` from a captured incident (tests, bug reports).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from dtwatch.diagnose.source import Loop, loops


@dataclass(frozen=True)
class ViewSample:
    """The states are a sample of a large job's ranks: the cross-node exchange ships only the ranks that stand
    out and exemplars of the others (see :func:`dtwatch.watchdog.aggregate.select_ranks`). A rank without a
    state then exists; it was just not shipped to this node. The counts come from the digests of every rank."""

    ranks: int  # ranks in the job
    blocked: int  # of them, inside a collective


class Evidence:
    """The interface, answering "not known" to everything. Subclasses override what they know."""

    def source(self, path: str) -> str | None:
        """The whole text of a source file, if readable."""
        return None

    def line(self, path: str, line: int) -> str:
        text = self.source(path)
        if text is None:
            return ""
        lines = text.splitlines()
        return lines[line - 1].strip() if 0 < line <= len(lines) else ""

    def rank_branch(self, path: str, line: int) -> tuple[int, str] | None:
        """(line, text) of the rank test ``line`` runs under (``if rank == 0``), if any."""
        text = self.source(path)
        return _branches(text, path).get(line) if text is not None else None

    def rank_conditional_calls(self, path: str) -> list[dict]:
        """What ``dtwatch lint`` finds in the file: collectives reached under a rank test (DTW001) and early exits
        under one that skip a collective (DTW002), as {"line", "code", "call", "condition"}."""
        text = self.source(path)
        if text is None:
            return []
        from dtwatch.lint.checker import lint_source

        try:
            found = lint_source(text, path)
        except Exception:  # noqa: BLE001 - evidence is optional
            return []
        return [{"line": f.line, "code": f.code, "call": f.call, "condition": f.condition}
                for f in found if f.code in ("DTW001", "DTW002")]

    def enclosing_loops(self, path: str, line: int) -> list[Loop]:
        """Every loop ``line`` runs in, innermost first."""
        text = self.source(path)
        if text is None:
            return []
        return sorted((lp for lp in _loops(text) if lp.contains(line)), key=lambda lp: lp.end - lp.start)

    def stack(self, rank: int) -> list[dict] | None:
        """The main thread's frames (innermost first: file, line, function), from py-spy, if taken."""
        return None

    def flight_record(self, rank: int) -> dict | None:
        """The rank's Flight Recorder summary (see dtwatch.bundle.files.summarize_flight_record)."""
        return None

    def ending(self, rank: int) -> dict | None:
        """How the process ended when no exit was recorded: {"signal": "SIGABRT", "text": ...}."""
        return None

    def display_path(self, path: str) -> str:
        return path

    def view_sample(self) -> ViewSample | None:
        """What the states are a sample of, when they are (a large job); None: every rank that has a ring."""
        return None

    def unreadable(self) -> set[int]:
        """Ranks whose ring or bundle file exists but could not be read (damaged): not "never seen"."""
        return set()

    def earlier_findings(self) -> list:
        """Warnings already reported while the job ran (:class:`~dtwatch.diagnose.model.Finding`), oldest first:
        a silent desync seen then may have left the rings' history since."""
        return []

    def dump_facts(self, rank: int) -> dict | None:
        """For a rank known from torch's Flight Recorder dump alone: what the dump says beyond its entries
        (``p2p_unrecorded``: group -> point-to-point ops gloo's recorder left out, seen as skipped op numbers;
        ``frames``: whether its entries carry Python frames). None otherwise."""
        return None


class RecordedEvidence(Evidence):
    """Evidence kept with a captured incident (``dtwatch capture``): sources, stacks, flight records."""

    def __init__(self, sources: dict | None = None, stacks: dict | None = None,
                 flight_records: dict | None = None, endings: dict | None = None, earlier: list | None = None,
                 dump_facts: dict | None = None) -> None:
        self._earlier = list(earlier or [])
        self._dump_facts = dump_facts or {}
        self._sources = sources or {}
        self._stacks = stacks or {}
        self._fr = flight_records or {}
        self._endings = endings or {}

    def source(self, path: str) -> str | None:
        entry = self._sources.get(path)
        return entry.get("text") if isinstance(entry, dict) else None

    def line(self, path: str, line: int) -> str:
        entry = self._sources.get(path)
        if not isinstance(entry, dict):
            return ""
        if "text" in entry:
            return super().line(path, line)
        return str(entry.get("lines", {}).get(str(line), "")).strip()

    def earlier_findings(self) -> list:
        return self._earlier

    def stack(self, rank: int) -> list[dict] | None:
        return main_thread_frames(self._stacks.get(str(rank)))

    def flight_record(self, rank: int) -> dict | None:
        return self._fr.get(str(rank))

    def ending(self, rank: int) -> dict | None:
        return self._endings.get(str(rank))

    def dump_facts(self, rank: int) -> dict | None:
        return self._dump_facts.get(str(rank), self._dump_facts.get(rank))


def main_thread_frames(threads: object) -> list[dict] | None:
    """The main thread's Python frames from py-spy's ``--json`` output (innermost first), normalised to
    {file, line, function}. The main thread is the one whose OS thread id is the process id; native
    frames (``--native``: no Python line) are left out."""
    if not isinstance(threads, list):
        return None
    dicts = [t for t in threads if isinstance(t, dict)]
    main = next((t for t in dicts if t.get("pid") is not None and t.get("os_thread_id") == t.get("pid")), None) \
        or next((t for t in dicts if t.get("thread_name") == "MainThread"), None)
    if main is None:
        return None
    out = []
    for fr in main.get("frames", []):
        path = fr.get("filename") or fr.get("file") or ""
        line = int(fr.get("line", 0) or 0)
        if not path.endswith(".py") or line <= 0:
            continue
        out.append({"file": path, "line": line, "function": fr.get("name") or fr.get("function") or "?"})
    return out


@functools.lru_cache(maxsize=128)
def _branches(text: str, path: str) -> dict[int, tuple[int, str]]:
    from dtwatch.lint.checker import rank_branches

    return rank_branches(text, path)


@functools.lru_cache(maxsize=128)
def _loops(text: str) -> list[Loop]:
    return loops(text)
