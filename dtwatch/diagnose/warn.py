"""Warnings without a stall: DataLoaders of different lengths (before the hang), stragglers."""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from ..state import RankState
from .model import WARNING, Finding, Kind
from .text import fmt_ranks, fmt_site, with_source


def loader_evidence(states: list[RankState]) -> list[dict]:
    """DataLoaders (the same loop on every rank: same line, or the same position in the rank's list of
    loaders when no line is known) whose latest lengths differ across ranks."""
    by_site: dict[tuple, dict[int, int]] = defaultdict(dict)
    sites: dict[tuple, dict | None] = {}
    for s in states:
        for ld in s.loaders:
            if ld.get("length", -1) < 0:
                continue
            site = ld.get("site")
            key = (site["file"], site["line"]) if site else ("#loader", ld.get("index"))
            by_site[key][s.rank] = ld["length"]
            sites[key] = site
    out = []
    for key, lengths in by_site.items():
        if len(set(lengths.values())) > 1:
            shortest = min(lengths.values())
            out.append({
                "site": with_source(sites[key]), "lengths": {str(r): n for r, n in sorted(lengths.items())},
                "short_ranks": sorted(r for r, n in lengths.items() if n == shortest),
                "long_ranks": sorted(r for r, n in lengths.items() if n != shortest),
            })
    return out



def uneven_loader_warnings(states: list[RankState], now: float) -> list[Finding]:
    out = []
    for ld in loader_evidence(states):
        out.append(Finding(
            kind=Kind.UNEVEN_ITERATIONS, severity=WARNING, ranks=ld["short_ranks"],
            summary=f"DataLoader at {fmt_site(ld['site'])} has different lengths across ranks {ld['lengths']}: "
                    f"{fmt_ranks(ld['short_ranks'])} will leave the loop early and the others will hang in their next "
                    "collective (use DistributedSampler with the same drop_last everywhere, or the Join context manager)",
            site=ld["site"], detected=now, onset=now, details={"loader": ld},
        ))
    return out


@dataclass
class EntryLags:
    """How late each rank enters recent world-group collectives, relative to the first rank."""

    medians: dict[int, float]  # rank -> median seconds behind the first rank
    last_counts: dict[int, int]  # rank -> how many of the compared collectives it entered last
    compared: int  # collectives every live rank has in its recent history


def entry_lags(states: list[RankState]) -> EntryLags:
    entries: dict[int, dict[int, float]] = defaultdict(dict)  # seq -> rank -> t_enter
    live = [s for s in states if not s.gone]
    for s in live:
        g = s.groups.get("0")
        for c in (g.recent if g else []):
            entries[c.seq][s.rank] = c.t_enter
    full = [v for v in entries.values() if len(v) == len(live) > 0]
    lags: dict[int, list[float]] = defaultdict(list)
    last_counts: dict[int, int] = defaultdict(int)
    for v in full:
        first = min(v.values())
        for r, t in v.items():
            lags[r].append(t - first)
        last_counts[max(v, key=v.get)] += 1
    return EntryLags({r: statistics.median(x) for r, x in lags.items()}, dict(last_counts), len(full))


def straggler_warning(lags: EntryLags, now: float, min_lag: float = 0.05, min_share: float = 0.6) -> Finding | None:
    """One rank consistently last to enter the world group's collectives, while the job progresses."""
    if lags.compared < 8 or len(lags.medians) < 2:
        return None
    medians = lags.medians
    slow = max(medians, key=medians.get)
    share = lags.last_counts.get(slow, 0) / lags.compared
    if medians[slow] < min_lag or share < min_share:
        return None
    others = sorted(v for r, v in medians.items() if r != slow)
    return Finding(
        kind=Kind.STRAGGLER, severity=WARNING, ranks=[slow],
        summary=f"rank {slow} is the last to enter {share:.0%} of recent collectives, a median {medians[slow]*1000:.0f} ms "
                f"behind the first rank (others: {statistics.median(others)*1000:.0f} ms); the job is progressing",
        detected=now, onset=now,
        details={"median_lag_s": {str(r): round(v, 4) for r, v in sorted(medians.items())}, "last_share": round(share, 3)},
    )
