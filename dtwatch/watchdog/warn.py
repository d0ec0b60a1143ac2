"""Warnings (no stall yet): uneven DataLoader lengths, a straggler, a silent desync, the setup checks'
findings (:mod:`dtwatch.diagnose.setup`). Each is reported once; each setup check once per run."""
from __future__ import annotations

import json

from dtwatch.diagnose import Evidence, Finding, silent_desyncs, uneven_loader_warnings
from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.setup import Hold as SetupHold
from dtwatch.diagnose.setup import setup_warnings

RECENT = 20
"""Warnings kept for the exporters' view."""


class Warnings:
    """Which warnings were reported already (poll thread only)."""

    def __init__(self) -> None:
        self.reported: set[tuple] = set()
        self.silent_reported: set[tuple] = set()  # (group, seq) of silent desyncs reported
        self.setup_hold = SetupHold()  # setup warnings wait a moment for the ranks behind
        self.all: list[Finding] = []

    def new(self, states: list[RankState], now: float, straggler: Finding | None, evidence: Evidence) -> list[Finding]:
        """The warnings found now that were not reported before; they count as reported from now on."""
        found = uneven_loader_warnings(states, now, evidence)
        if straggler is not None:
            found.append(straggler)
        found += silent_desyncs(states, now, self.silent_reported, evidence)
        if states:
            found += self.setup_hold.due(setup_warnings(states, now, evidence), now, states[0].world_size)
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
    if f.details.get("check"):
        return ("setup", f.details["check"])  # each setup check warns once per run
    lengths = json.dumps(f.details.get("loader", {}).get("lengths")) if f.kind != "straggler" else ""
    return (f.kind, tuple(f.ranks), lengths)
