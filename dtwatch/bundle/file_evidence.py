"""Evidence read from this machine's files: source lines, the static rank-conditional check, and what the
watchdog collected for an incident (stacks, Flight Recorder summaries, how processes ended).

The diagnosis (:mod:`dtwatch.diagnose`) does no I/O: the watchdog and ``dtwatch analyze`` hand it this reader.
"""
from __future__ import annotations

import linecache
import os
from collections.abc import Callable

from dtwatch.diagnose.evidence import Evidence, ViewSample


class FileEvidence(Evidence):
    """Evidence from this machine: source files, lint, and whatever the watchdog collected."""

    def __init__(
        self,
        cwd: str | None = None,
        stacks: Callable[[int], list[dict] | None] | None = None,
        flight_records: dict[int, dict] | None = None,
        endings: Callable[[int], dict | None] | None = None,
        sample: ViewSample | None = None,
        earlier: list | None = None,
        unreadable: set[int] | None = None,
        dump_facts: dict[int, dict] | None = None,
    ) -> None:
        self.cwd = os.path.abspath(cwd or os.getcwd())
        self._dump_facts = dump_facts or {}
        self._unreadable = set(unreadable or ())
        self._sample = sample
        self._earlier = list(earlier or [])
        self._stacks = stacks
        self._fr = flight_records or {}
        self._endings = endings

    def source(self, path: str) -> str | None:
        if not path or path.startswith("<"):
            return None
        lines = linecache.getlines(path)
        return "".join(lines) if lines else None

    def line(self, path: str, line: int) -> str:
        if not path or path.startswith("<"):
            return ""
        return linecache.getline(path, line).strip()

    def rank_branch(self, path: str, line: int) -> tuple[int, str] | None:
        from dtwatch.lint.checker import rank_branch

        try:
            return rank_branch(path, line)
        except Exception:  # noqa: BLE001 - evidence is optional
            return None

    def stack(self, rank: int) -> list[dict] | None:
        try:
            return self._stacks(rank) if self._stacks is not None else None
        except Exception:  # noqa: BLE001
            return None

    def flight_record(self, rank: int) -> dict | None:
        return self._fr.get(rank)

    def ending(self, rank: int) -> dict | None:
        try:
            return self._endings(rank) if self._endings is not None else None
        except Exception:  # noqa: BLE001
            return None

    def display_path(self, path: str) -> str:
        if path and os.path.isabs(path) and path.startswith(self.cwd + os.sep):
            return os.path.relpath(path, self.cwd)
        return path

    def view_sample(self) -> ViewSample | None:
        return self._sample

    def unreadable(self) -> set[int]:
        return self._unreadable

    def earlier_findings(self) -> list:
        return self._earlier

    def dump_facts(self, rank: int) -> dict | None:
        return self._dump_facts.get(rank)
