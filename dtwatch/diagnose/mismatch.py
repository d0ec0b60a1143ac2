"""Ranks at the same call (group, sequence number, line) with different arguments: which side deviates.

The smaller side deviates. Sides of equal size are no minority: a rank test on one side's path, or the
line's own earlier calls (every rank called it with the same arguments before, and one side changed),
decide; otherwise every rank of the tied sides is named and the finding says which is wrong is not known.
"""
from __future__ import annotations

from dtwatch.diagnose.context import Context
from dtwatch.diagnose.model import STALL, Finding, Kind, Position
from dtwatch.diagnose.wording.mismatch_words import mismatch_summary


def site_key(site: dict | None) -> tuple | None:
    return (site.get("file"), site.get("line")) if site else None


def mismatch(ctx: Context, group: str, seq: int, sides: list[list[Position]], waiting: list[int]) -> Finding:
    ordered = sorted(sides, key=lambda side: (len(side), min(p.rank for p in side)))
    tied = [side for side in ordered if len(side) == len(ordered[0])]
    decided, rank_test, usual = None, None, None
    if len(tied) > 1:  # no minority: a rank test or the line's own history must say which side deviates
        decided, rank_test, usual = _tie_deviant(ctx, group, tied)
        if decided is not None:
            ordered = [decided] + [side for side in ordered if side is not decided]
    undecided = len(tied) > 1 and decided is None
    deviant = sorted({p.rank for side in tied for p in side}) if undecided else sorted(p.rank for p in ordered[0])
    culprit = ordered[0][0]
    site = ctx.user_site(culprit.rank, culprit.issued)
    fields, _ = ctx.waiting(r for r in waiting if r not in deviant)
    shown = [(sorted(p.rank for p in side), side[0].issued.fingerprint) for side in ordered]
    summary = mismatch_summary(group, seq, site, shown, deviant, undecided=undecided, rank_test=rank_test,
                               usual=usual, fmt=ctx.fmt)
    return Finding(
        kind=Kind.MISMATCH, severity=STALL, ranks=deviant, summary=summary, op=culprit.issued.op, group=group,
        seq=seq, site=ctx.site(site),
        details={"fingerprints": {side[0].issued.fingerprint: sorted(p.rank for p in side) for side in ordered},
                 **({"undecided": True} if undecided else {})},
        **fields,
    )


def _tie_deviant(ctx: Context, group: str, tied: list[list[Position]]
                 ) -> tuple[list[Position] | None, dict | None, str | None]:
    """Of sides with as many ranks each: the one that deviates (None: not known), and why: the rank test its
    call alone runs under; else the arguments (fingerprint) this line issued on every tied rank before (their
    completed calls in the ring), which its arguments alone differ from."""
    branches = [ctx.branch(side[0].rank, side[0].issued) for side in tied]
    under = [i for i, b in enumerate(branches) if b is not None]
    if len(under) == 1:
        return tied[under[0]], branches[under[0]], None
    before: set[str] = set()
    for side in tied:
        for p in side:
            key = site_key(ctx.user_site(p.rank, p.issued))
            g = ctx.by_rank[p.rank].groups.get(group)
            past = {c.fingerprint for c in (g.recent if g else []) if c.t_exit and c.seq < p.issued.seq
                    and site_key(ctx.user_site(p.rank, c)) == key}
            if not past:
                return None, None, None  # a rank with no earlier call here: its history says nothing
            before |= past
    if len(before) != 1:
        return None, None, None
    usual = next(iter(before))
    differ = [side for side in tied if side[0].issued.fingerprint != usual]
    if len(differ) == 1:
        return differ[0], None, usual
    return None, None, None
