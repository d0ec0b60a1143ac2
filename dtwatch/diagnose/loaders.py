"""DataLoaders of different lengths across ranks: a warning before the hang they lead to.

Two things must hold for a warning. The loaders compared are one loader: a training and an evaluation
loader iterated by one ``_run_epoch(loader)`` are two (:func:`loader_key`). And its loop issues
collectives: a rank that runs out of batches first leaves the loop while the others' next collective in
it has no partner. An evaluation loop without a collective inside it hangs nobody, whatever the lengths:
every rank meets the collective after it (an ``all_gather_object`` of the metrics) when it gets there.
What the recorder tells (per rank and loader, :mod:`dtwatch.diagnose.rank_state`): the collectives the rank
issued while the latest ended epoch's loop ran, and those seen so far in an epoch still running. While no
rank has issued two in the loop (its first epoch has just started, or its loop has none but DDP's buffer
broadcast at the first forward), or once a rank ended the loop with fewer collectives than batches (not one
per batch), nothing is said.
"""
from __future__ import annotations

from collections import defaultdict

from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.model import WARNING, Finding, Kind
from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.wording.loader_words import uneven_loader_summary
from dtwatch.diagnose.wording.phrases import with_source


def loader_key(ld: dict) -> tuple:
    """The same DataLoader on every rank: where it was made and what it holds (``ident``, see
    :class:`dtwatch.record.data_samplers.LoaderMakes`), iterated at the same loop line and the same user line
    that led to it (a library's loop iterates all of a job's loaders). Rings written before loaders were
    told apart have no ``ident``: the loop's lines alone, or the same slot when no line is known."""
    site, user = ld.get("site"), ld.get("user_site")
    ident = (ld["ident"],) if ld.get("ident") else ()
    if not site:
        return ident + ("#loader",) if ident else ("#loader", str(ld.get("index")))
    return ident + (site["file"], site["line"]) + ((user["file"], user["line"]) if user else ())


def loop_issued(ld: dict) -> int | None:
    """Collectives this rank issued while the loader's loop ran: in its latest epoch whose loop ended, or
    so far in a later one still running, whichever is more. None: the ring does not say (older)."""
    if not ld.get("ident"):
        return None
    ended = int(ld.get("colls") or 0) if ld.get("ended") else 0
    return max(ended, int(ld.get("issued_now") or 0))


def not_per_batch(per_rank: dict[int, dict]) -> bool:
    """Ranks of different lengths ran the same epoch's loop to its end issuing as many collectives: they
    do not depend on its batches (one at the epoch's end, the ``Join`` context manager shadowing the
    others' calls, a loop left at the same step everywhere), so the lengths hang nobody."""
    by_epoch: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    for r, ld in per_rank.items():
        if ld.get("ident") and ld.get("ended"):
            by_epoch[int(ld["ended"])][r] = (int(ld["length"]), int(ld.get("colls") or 0))
    return any(len({n for n, _ in v.values()}) > 1 and len({c for _, c in v.values()}) == 1
               for v in by_epoch.values())


IN_LOOP = 2
"""Collectives a rank must have issued in the loop before its lengths are said to hang anybody: one alone
is what a loop without collectives of its own issues at its first batch (DDP broadcasting the module's
buffers in the first forward of an evaluation loop)."""


def fewer_than_batches(per_rank: dict[int, dict]) -> bool:
    """A rank ran an epoch's loop to its end with fewer collectives than it had batches: the loop does not
    issue one per batch (one at its start, or every few batches), so the others' extra batches need not
    meet a collective the short rank no longer makes."""
    return any(ld.get("ident") and ld.get("ended") and int(ld.get("colls") or 0) < int(ld["length"])
               for ld in per_rank.values())


def loader_evidence(states: list[RankState], ev: Evidence | None = None) -> list[dict]:
    """DataLoaders (see :func:`loader_key`) whose latest lengths differ across ranks and whose loop issues
    collectives on some rank (or whose rings do not say: written before that was recorded)."""
    by_key: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for s in states:
        for ld in s.loaders:
            if ld.get("length", -1) >= 0:
                by_key[loader_key(ld)][s.rank] = ld
    out = []
    for per_rank in by_key.values():
        lengths = {r: int(ld["length"]) for r, ld in per_rank.items()}
        if len(set(lengths.values())) < 2:
            continue
        issued = {r: n for r, n in ((r, loop_issued(ld)) for r, ld in per_rank.items()) if n is not None}
        if issued and max(issued.values()) < IN_LOOP:
            continue  # not a collective per batch (none, or DDP's buffer broadcast at the first forward)
        if not_per_batch(per_rank) or fewer_than_batches(per_rank):
            continue
        shortest = min(lengths.values())
        some = next(iter(per_rank.values()))
        made = next((ld["made_site"] for ld in per_rank.values() if ld.get("made_site")), None)
        out.append({
            "site": with_source(some.get("site"), ev),
            "user_site": with_source(some["user_site"], ev) if some.get("user_site") else None,
            "made_site": with_source(made, ev) if made else None,
            "lengths": {str(r): n for r, n in sorted(lengths.items())},
            "short_ranks": sorted(r for r, n in lengths.items() if n == shortest),
            "long_ranks": sorted(r for r, n in lengths.items() if n != shortest),
            "issued": {str(r): n for r, n in sorted(issued.items())} if issued else None,
        })
    return out


def uneven_loader_warnings(states: list[RankState], now: float, ev: Evidence | None = None) -> list[Finding]:
    out = []
    for ld in loader_evidence(states, ev):
        out.append(Finding(
            kind=Kind.UNEVEN_ITERATIONS, severity=WARNING, ranks=ld["short_ranks"],
            summary=uneven_loader_summary(ld, ev),
            site=ld["site"], detected=now, onset=now, details={"loader": ld},
        ))
    return out
