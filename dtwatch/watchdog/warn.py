"""Warnings (no stall yet): uneven DataLoader lengths, a straggler, a silent desync. Each is reported once."""
from __future__ import annotations

import json

from dtwatch.diagnose import Evidence, Finding, silent_desyncs, uneven_loader_warnings
from dtwatch.diagnose.state import RankState

RECENT = 20
"""Warnings kept for the exporters' view."""


class Warnings:
    """Which warnings were reported already (poll thread only)."""

    def __init__(self) -> None:
        self.reported: set[tuple] = set()
        self.silent_reported: set[tuple] = set()  # (group, seq) of silent desyncs reported
        self.all: list[Finding] = []

    def new(self, states: list[RankState], now: float, straggler: Finding | None, evidence: Evidence) -> list[Finding]:
        """The warnings found now that were not reported before; they count as reported from now on."""
        found = uneven_loader_warnings(states, now)
        if straggler is not None:
            found.append(straggler)
        found += silent_desyncs(states, now, self.silent_reported, evidence)
        fresh = []
        for f in found:
            key = _key(f)
            if key in self.reported:
                continue
            self.reported.add(key)
            self.all.append(f)
            fresh.append(f)
        return fresh

    @property
    def recent(self) -> list[Finding]:
        return self.all[-RECENT:]


def _key(f: Finding) -> tuple:
    """What makes a warning the same one again."""
    if f.details.get("silent"):
        return (f.kind, f.group, f.seq)
    lengths = json.dumps(f.details.get("loader", {}).get("lengths")) if f.kind != "straggler" else ""
    return (f.kind, tuple(f.ranks), lengths)
