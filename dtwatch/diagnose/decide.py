"""The decisions: from every rank's position, who is the culprit and what they did.

Principles (see the package docstring): name the deviant, not the victim; compare the ranks' program
order (group, sequence number, op, call site) to find where they diverged; recognise ranks that left
a loop early by where they are as much as by counts; state how a rank ended as it was; never claim
more than the evidence shows. Sentences come from :mod:`.text`; nothing here does I/O (all outside
facts come through the :class:`~.evidence.Evidence` passed in). This module dispatches: ranks that
ended (:mod:`.ended`), wedged or idle ranks (:mod:`.idle`), ranks that all issued something
(:mod:`.compare`), loops (:mod:`.loops`), shared questions (:mod:`.context`).
"""
from __future__ import annotations

from dtwatch.diagnose.compare import blocked_findings, first_divergence
from dtwatch.diagnose.context import Context, with_cpp_entries
from dtwatch.diagnose.ended import exit_findings, gone_findings
from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.hints import with_lint_hints
from dtwatch.diagnose.idle import stuck_outside, unresponsive
from dtwatch.diagnose.model import Finding
from dtwatch.diagnose.order import parting_at_stall
from dtwatch.diagnose.positions import StallCheck
from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.sync_points import with_sync_points

__all__ = ["classify", "exit_findings"]


def classify(states: list[RankState], check: StallCheck, now: float, evidence: Evidence) -> list[Finding]:
    """Explain a stall. ``check`` must say ``stalled``."""
    ctx = Context(states, check.positions, check.last_progress, now, evidence)
    return with_lint_hints(ctx, with_sync_points(ctx, with_cpp_entries(ctx, _classify(ctx, check))))




def _classify(ctx: Context, check: StallCheck) -> list[Finding]:
    pos = ctx.pos
    waiting = sorted(check.blocked)

    # Program order first: the first point where the ranks' call streams parted, when they paired again
    # after it (an extra or skipped call the backend paired with a same-shaped one), is the root cause;
    # where the ranks are now (and how some ended) is its symptom.
    parted = parting_at_stall(ctx, waiting)
    if parted is not None:
        return [parted]

    gone = [p.rank for p in pos.values() if p.state == "gone"]
    if gone:
        return gone_findings(ctx, gone, waiting)

    wedged = [p for p in pos.values() if p.state == "unresponsive"]
    if wedged:
        return [unresponsive(ctx, p, waiting) for p in wedged]

    blocked = [pos[r] for r in check.blocked if pos[r].call is not None]
    # The ranks went out of step earlier, at a call they all completed (paired with a different call):
    # that first divergence is the root cause, the stall only its symptom.
    diverged = first_divergence(ctx, blocked)
    if diverged is not None:
        return [diverged]
    needed = {m for p in blocked for m in ctx.missing(p.rank, p.issued)}
    outside = [p.rank for p in pos.values() if p.state == "outside" and p.rank in needed]
    if outside:
        return stuck_outside(ctx, outside, waiting)
    return blocked_findings(ctx, blocked, waiting)
