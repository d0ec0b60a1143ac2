"""Cross-rank diagnosis: from every rank's state, decide whether the job is stalled and say why.

One entry point, :func:`diagnose`, serves the live watchdog, ``dtwatch analyze`` and the recorded
incidents of the test corpus. It is pure: its inputs are the ranks' states
(:class:`~dtwatch.diagnose.rank_state.RankState`), a clock, the stall window and an :class:`Evidence`
reader (source lines, the static rank-conditional check, loops, stacks, Flight Recorder entries, how
processes ended); its output is typed findings. It does no I/O and does not change its inputs' meaning
(it settles per-group completion counts).

Layout: :mod:`.align` and :mod:`.order` (program order: the first point where the ranks' call streams
parted, at a stall, when ranks end, and live); :mod:`.positions` (where each rank is; the stall decision);
:mod:`.hints` (the lint's leads where a library issued the call); :mod:`.decide` dispatching to
:mod:`.ended` (ranks that ended), :mod:`.idle` (wedged or idle ranks), :mod:`.compare` (ranks that
all issued something: alignment, desyncs, waits across groups), :mod:`.loops` (uneven iterations),
with :mod:`.context` (the questions they share); :mod:`.text` (every sentence); :mod:`.warn`
(warnings without a stall); :mod:`.evidence` and :mod:`.source` (what the decisions may look at).

The kinds (:class:`Kind`), in the order they are tested:

* ``rank_exited`` - a rank ended (raised, was killed, returned early) while others need it; a crash
  that follows a desync is reported as the desync.
* ``unresponsive`` - a rank is alive but not running Python (GIL held, stopped); py-spy says where.
* ``uneven_iterations`` - some ranks left the loop the others are still in (loader lengths, step
  counts, or positions: one side after the loop, the other inside it).
* ``stuck_outside_collective`` - a live rank that others wait for is not in any collective.
* ``mismatch`` - ranks in the same call (same group, seq and line) with different op, dtype or shape.
* ``desync`` - the ranks issued the same collectives in a different order.
* ``rank_conditional`` - a collective only some ranks make (an extra call under a rank test), or one
  a rank skipped while its peers wait in it (across groups and p2p pairs: the deviant, not the victim).
* ``stalled_collective`` - every rank is in the same collective and none is missing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dtwatch.diagnose.decide import classify as _classify
from dtwatch.diagnose.decide import exit_findings as _exit_findings
from dtwatch.diagnose.evidence import Evidence, RecordedEvidence, ViewSample
from dtwatch.diagnose.loaders import loader_evidence, uneven_loader_warnings
from dtwatch.diagnose.model import KINDS, PEER_ERRORS, STALL, WARNING, Finding, Kind, Position
from dtwatch.diagnose.positions import StallCheck, check_stall, cpp_blocked_call, positions, settle_completed
from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.silent import silent_desyncs
from dtwatch.diagnose.straggler import EntryLags, entry_lags, straggler_warning
from dtwatch.diagnose.wording.phrases import fmt_ranks, fmt_site, trim, with_source

__all__ = [
    "Diagnosis", "Evidence", "EntryLags", "Finding", "KINDS", "Kind", "PEER_ERRORS",
    "Position", "RecordedEvidence", "STALL", "StallCheck", "ViewSample", "WARNING", "check_stall", "classify",
    "cpp_blocked_call", "diagnose", "diagnose_fixture", "entry_lags", "exit_findings", "fmt_ranks",
    "fmt_site", "loader_evidence", "positions", "settle_completed", "silent_desyncs", "straggler_warning", "trim",
    "uneven_loader_warnings", "with_source",
]


@dataclass
class Diagnosis:
    """The verdict on one look at the job."""

    stalled: bool  # a stall (or a rank that ended while others need it) was found
    findings: list[Finding]  # stall-severity findings, culprits first
    check: StallCheck | None = None
    now: float = field(default_factory=time.time)
    ended: bool = False  # the findings are about ranks that ended (a crash), not a stall


def diagnose(states: list[RankState], now: float, window: float, evidence: Evidence | None = None, *,
             heartbeat_stale: float | None = None, assume_stalled: bool = False) -> Diagnosis:
    """Decide whether the job is stalled and why.

    Ranks that ended while others need them are diagnosed at once (no window). Otherwise the job is
    stalled when some rank is blocked and nothing progressed for ``window`` seconds; with
    ``assume_stalled`` (a post-mortem of a bundle or a dead job) any blocked rank counts.
    """
    ev = evidence or Evidence()  # knows nothing: no source lines, stacks or dumps
    if not states:
        return Diagnosis(False, [], None, now)
    check = check_stall(states, now, window, heartbeat_stale)
    settle_completed(states, check.positions)
    exits = _exit_findings(states, now, ev)
    if exits:
        return Diagnosis(True, _mark_ended(exits, states), check, now, ended=True)
    if assume_stalled and check.blocked and not check.stalled:
        check = StallCheck(True, check.last_progress, check.blocked, check.positions)
    if not check.stalled:
        return Diagnosis(False, [], check, now)
    return Diagnosis(True, _mark_ended(_classify(states, check, now, ev), states), check, now)


def _mark_ended(findings: list[Finding], states: list[RankState]) -> list[Finding]:
    """A finding whose culprits (or waiting ranks) have all ended says so (``culprits_ended``,
    ``waiters_ended``): a headline must not place them inside a call now."""
    gone = {s.rank for s in states if s.gone}
    for f in findings:
        if f.ranks and set(f.ranks) <= gone:
            f.details["culprits_ended"] = True
        if f.waiting_ranks and set(f.waiting_ranks) <= gone:
            f.details["waiters_ended"] = True  # they waited, then ended (failed on the lost peer)
    return findings


def classify(states: list[RankState], check: StallCheck, now: float, evidence: Evidence | None = None) -> list[Finding]:
    """Explain a stall that ``check`` found."""
    return _mark_ended(_classify(states, check, now, evidence or Evidence()), states)


def exit_findings(states: list[RankState], now: float, evidence: Evidence | None = None) -> list[Finding]:
    """Ranks that ended while others still need them (no window)."""
    return _mark_ended(_exit_findings(states, now, evidence or Evidence()), states)


def diagnose_fixture(fixture: object) -> list[Finding]:
    """Replay a captured incident (:func:`dtwatch.report.capture.load_fixture`) through :func:`diagnose`."""
    def get(key: str, default: Any = None) -> Any:
        return fixture.get(key, default) if isinstance(fixture, dict) else getattr(fixture, key, default)

    states = [s if isinstance(s, RankState) else RankState.from_dict(s) for s in get("states", [])]
    earlier = [w if isinstance(w, Finding) else Finding.from_dict(w) for w in get("warnings", []) or []]
    ev = RecordedEvidence(get("sources"), get("stacks"), get("flight_records"), get("endings"), earlier)
    result = diagnose(states, float(get("now") or 0.0), float(get("window") or 10.0), ev,
                      assume_stalled=get("source") == "bundle")
    return result.findings
