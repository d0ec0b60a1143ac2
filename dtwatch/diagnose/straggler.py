"""A straggler: one rank consistently last to issue the world group's collectives while the job progresses."""
from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from dtwatch.diagnose.model import WARNING, Finding, Kind
from dtwatch.diagnose.state import RankState


@dataclass
class EntryLags:
    """How late each rank issues recent world-group collectives, relative to the first rank."""

    medians: dict[int, float]  # rank -> median seconds behind the first rank
    last_counts: dict[int, int]  # rank -> how many of the compared collectives it issued last
    compared: int  # collectives every live rank has a time for
    period: float | None = None  # median seconds between consecutive compared collectives
    # Per compared collective: (the rank that issued it last, how far behind the first rank); ties none.
    lasts: list[tuple[int, float]] = field(default_factory=list)
    step_period: float | None = None  # median seconds between training steps (step markers), if counted


MAX_COMPARED = 200


def issue_times(s: RankState, group: str = "0") -> dict[int, float]:
    """seq -> when ``s`` issued it: a Python-issued call's entry time; otherwise (issued from C++, e.g. by
    DDP's reducer) when the rank's sequence clock first showed the counter at or past it (at most the
    clock's interval late)."""
    g = s.groups.get(group)
    if g is None:
        return {}
    out: dict[int, float] = {}
    prev = None
    for seq, t in g.seq_times:
        seq = int(seq)
        if prev is not None:
            for q in range(prev + 1, seq + 1):
                out[q] = t
        prev = seq if prev is None else max(prev, seq)
    for c in g.recent:
        out[c.seq] = c.t_enter
    return out


def entry_lags(states: list[RankState]) -> EntryLags:
    live = [s for s in states if not s.gone]
    times = {s.rank: issue_times(s) for s in live}
    common = sorted(set.intersection(*(set(t) for t in times.values()))) if times else []
    common = common[-MAX_COMPARED:]
    lags: dict[int, list[float]] = defaultdict(list)
    last_counts: dict[int, int] = defaultdict(int)
    lasts: list[tuple[int, float]] = []
    firsts = []
    for seq in common:
        v = {r: t[seq] for r, t in times.items()}
        first = min(v.values())
        firsts.append(first)
        for r, t in v.items():
            lags[r].append(t - first)
        last = max(v, key=lambda r: v[r])
        if v[last] > first:  # a tie (one clock sample for all) names nobody
            last_counts[last] += 1
            lasts.append((last, v[last] - first))
    gaps = [b - a for a, b in itertools.pairwise(firsts) if b > a]
    steps = [b - a for s in live for a, b in itertools.pairwise(s.step_times) if b > a]
    return EntryLags({r: statistics.median(x) for r, x in lags.items()}, dict(last_counts), len(common),
                     statistics.median(gaps) if gaps else None, lasts, statistics.median(steps) if steps else None)


def straggler_warning(lags: EntryLags, now: float, min_lag: float = 0.01, min_share: float = 0.7,
                      min_fraction: float = 0.03, min_spread: int = 15) -> Finding | None:
    """One rank consistently last to issue the world group's collectives, while the job progresses.

    Only collectives where some rank was notably late count (*spread*: the last rank at least
    ``min_lag`` and ``min_fraction`` of a training step behind the first; without step markers, of
    the time between collectives). Within a step,
    later collectives often wait for the earlier ones to complete, as FSDP's all-gathers do, and show
    no spread. The straggler is last in at least ``min_share`` of ``min_spread`` or more spread
    collectives, and its median lag over them is at least twice every other rank's overall median.
    Ranks that take turns being slow share "last" and are not named."""
    if len(lags.medians) < 2:
        return None
    period = lags.step_period or lags.period
    floor = max(min_lag, min_fraction * period) if period else min_lag
    spread = [(r, lag) for r, lag in lags.lasts if lag >= floor]
    if len(spread) < min_spread:
        return None
    counts: dict[int, int] = defaultdict(int)
    for r, _lag in spread:
        counts[r] += 1
    slow = max(counts, key=lambda r: counts[r])
    share = counts[slow] / len(spread)
    lag = statistics.median(x for r, x in spread if r == slow)
    others = sorted(v for r, v in lags.medians.items() if r != slow)
    if share < min_share or lag < 2 * max(others):
        return None
    period_text = (f" (a step takes {lags.step_period * 1000:.0f} ms)" if lags.step_period else
                   f" (of {lags.period * 1000:.0f} ms between collectives)" if lags.period else "")
    return Finding(
        kind=Kind.STRAGGLER, severity=WARNING, ranks=[slow],
        summary=f"rank {slow} is the last to issue {share:.0%} of the recent collectives of group 0 that some rank "
                f"was late for, a median {lag*1000:.0f} ms{period_text} behind the first rank (the others' median "
                f"lag: {statistics.median(others)*1000:.0f} ms); the job is progressing",
        detected=now, onset=now,
        details={"median_lag_s": {str(r): round(v, 4) for r, v in sorted(lags.medians.items())},
                 "straggler_lag_s": round(lag, 4), "last_share": round(share, 3), "spread": len(spread),
                 "compared": lags.compared, "period_s": round(lags.period, 4) if lags.period else None,
                 "step_s": round(lags.step_period, 4) if lags.step_period else None},
    )
