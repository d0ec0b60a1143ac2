"""The words for the ranks that wait on a finding's culprits (:meth:`dtwatch.diagnose.context.Context.waiting`),
the phrase every stall finding ends with: who waits, and where the first of them waits. Nothing here decides which
ranks wait or where; the context hands those facts over.
"""
from __future__ import annotations

from collections.abc import Callable

from dtwatch.diagnose.rank_state import Call
from dtwatch.diagnose.wording.phrases import describe, fmt_ranks, verb

Fmt = Callable[[dict | None], str]


def others_phrase(ranks: list[int], view_blocked: int | None = None, view_ranks: int | None = None) -> str:
    """``ranks`` as a finding lists the ranks besides its culprits; ``view_blocked`` of the job's ``view_ranks``
    ranks are inside a collective by every node's digest, where this node sees only a sample of a large job."""
    if view_ranks is None:
        return fmt_ranks(ranks)
    return (f"{fmt_ranks(ranks)} (of the ranks in this node's view; by every node's digest, {view_blocked:,} "
            f"of the job's {view_ranks:,} ranks are inside a collective)")


def not_seen_waiting_phrase(names: str, ranks: list[int], ended: bool, all_from_dumps: bool) -> str:
    """Ranks seen in no collective: they may be computing still, or about to fail the same way; that they wait
    for the culprit is not known. ``ended``: all of them ended; ``all_from_dumps``: all are known from Flight
    Recorder dumps alone."""
    if ended:
        return f"{names} ended as well"
    if all_from_dumps:
        return f"{names} {verb(ranks, 'has', 'have')} no collective in flight in {verb(ranks, 'its', 'their')} dump"
    return f"{names} {verb(ranks, 'is', 'are')} still running, in no collective seen"


def waiting_phrase(names: str, ranks: list[int], ended: bool, first: Call | None, site: dict | None,
                   returned: bool, waits_at: dict | None, several_places: bool, fmt: Fmt) -> str:
    """``names`` wait (or, ``ended``, waited) on the culprits, the first of them in ``first`` issued at ``site``.
    ``returned``: that call is asynchronous and still in flight (NCCL's model: the rank waits elsewhere, at
    ``waits_at`` where that is a different line); ``several_places``: the ranks wait in more than one call."""
    waits = "waited" if ended else verb(ranks, "waits", "wait")
    if several_places:
        return f"{names} {'waited' if ended else 'wait'}, the first in {describe(first)} at {fmt(site)}"
    if not returned:
        return f"{names} {waits} in {describe(first)} at {fmt(site)}"
    text = f"{names} {waits} for {describe(first)}, issued at {fmt(site)}"
    return text + (f", at {fmt(waits_at)}" if waits_at is not None else "")
