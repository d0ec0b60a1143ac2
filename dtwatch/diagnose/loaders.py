"""DataLoaders of different lengths across ranks: a warning before the hang they lead to."""
from __future__ import annotations

from collections import defaultdict

from dtwatch.diagnose.model import WARNING, Finding, Kind
from dtwatch.diagnose.state import RankState
from dtwatch.diagnose.text import fmt_ranks, fmt_site, with_source


def loader_key(ld: dict) -> tuple:
    """The same DataLoader on every rank: the same loop line and the same user line that led to it (a
    library's loop iterates all of a job's loaders), or the same slot when no line is known."""
    site, user = ld.get("site"), ld.get("user_site")
    if not site:
        return ("#loader", str(ld.get("index")))
    return (site["file"], site["line"]) + ((user["file"], user["line"]) if user else ())


def loader_evidence(states: list[RankState]) -> list[dict]:
    """DataLoaders (see :func:`loader_key`) whose latest lengths differ across ranks."""
    by_site: dict[tuple, dict[int, int]] = defaultdict(dict)
    sites: dict[tuple, tuple[dict | None, dict | None]] = {}
    for s in states:
        for ld in s.loaders:
            if ld.get("length", -1) < 0:
                continue
            key = loader_key(ld)
            by_site[key][s.rank] = ld["length"]
            sites[key] = (ld.get("site"), ld.get("user_site"))
    out = []
    for key, lengths in by_site.items():
        if len(set(lengths.values())) > 1:
            shortest = min(lengths.values())
            site, user = sites[key]
            out.append({
                "site": with_source(site), "user_site": with_source(user) if user else None,
                "lengths": {str(r): n for r, n in sorted(lengths.items())},
                "short_ranks": sorted(r for r, n in lengths.items() if n == shortest),
                "long_ranks": sorted(r for r, n in lengths.items() if n != shortest),
            })
    return out



def loader_place(ld: dict) -> str:
    """Where a loader is iterated: the user's line, and the library's loop it goes through."""
    if ld.get("user_site"):
        return f"{fmt_site(ld['user_site'])} (iterated in {fmt_site(ld['site'])})"
    return fmt_site(ld["site"])


def uneven_loader_warnings(states: list[RankState], now: float) -> list[Finding]:
    out = []
    for ld in loader_evidence(states):
        out.append(Finding(
            kind=Kind.UNEVEN_ITERATIONS, severity=WARNING, ranks=ld["short_ranks"],
            summary=f"DataLoader at {loader_place(ld)} has different lengths across ranks {ld['lengths']}: "
                    f"{fmt_ranks(ld['short_ranks'])} will leave the loop early and the others will hang in their "
                    "next collective (use DistributedSampler with the same drop_last everywhere, or the Join "
                    "context manager)",
            site=ld["site"], detected=now, onset=now, details={"loader": ld},
        ))
    return out
