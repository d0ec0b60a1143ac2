"""What an incident is called: a crash (it began with a rank ending abnormally) or a stall.

Decided from the ranks' states and the findings, with the diagnosis, so the watchdog's console, its bundle and
``dtwatch analyze`` on rings alone give the same verdict.
"""
from __future__ import annotations

from dtwatch.diagnose.model import Finding
from dtwatch.diagnose.rank_state import RankState

CRASH, STALL = "crash", "stall"


def ended_abnormally(s: RankState) -> bool:
    """Raised, exited with an error status, killed by a signal, or vanished without a clean exit."""
    return s.exit_state in ("exception", "signal") or (s.exit_state == "exited" and s.exit_code != 0) or \
        (s.alive is False and s.exit_state == "running")


def verdict(findings: list[Finding], states: list[RankState], *, from_exits: bool) -> str:
    """``crash`` when the incident began with a rank ending abnormally; otherwise ``stall``.

    A rank that returned early while the others wait is a stall (they cannot progress); ranks killed
    later (by the launcher's teardown or by --fail-fast) do not count: this is decided when the
    incident opens, before dtwatch acts.
    """
    if not from_exits:
        return STALL
    named = {r for f in findings for r in f.ranks}
    return CRASH if any(ended_abnormally(s) for s in states if s.rank in named or not named) else STALL
