"""Where a rank actually waits when the call it is blocked on returned before completing.

On NCCL (and on ``gloo_async``, and for ``async_op=True`` work anywhere) a rank that issued a
collective that cannot complete does not stop in it: the call returns and the rank runs on. It stops
later, at a synchronisation point (``torch.cuda.synchronize()``, ``.item()``, a barrier on another
group), or keeps issuing work. The finding names the collective, because that is the cause. This module
adds where the main thread waits, so that a reader who looks at the process (py-spy, a debugger) and
sees a different line is not misled: ``details["waits_at"]`` and a part of the summary's sentence.
"""
from __future__ import annotations

from dtwatch.diagnose.context import Context
from dtwatch.diagnose.model import STALL, Finding
from dtwatch.diagnose.wording.phrases import sentence, waits_elsewhere


def with_sync_points(ctx: Context, findings: list[Finding]) -> list[Finding]:
    for f in findings:
        if f.severity != STALL:
            continue
        by_place: dict[tuple, list[int]] = {}
        calls: dict[tuple, tuple] = {}
        for rank in list(dict.fromkeys(f.ranks + f.waiting_ranks)):
            p, s = ctx.pos.get(rank), ctx.by_rank.get(rank)
            # Only live, responsive ranks: a stopped rank's last sampled line is stale (py-spy tells).
            if p is None or s is None or p.state != "blocked" or p.call is None:
                continue
            call = p.call
            if not (call.is_async and call.in_flight) or s.main_site is None:
                continue
            here = (s.main_site.get("file"), s.main_site.get("line"))
            if here == call.site_key or here == call.user_site_key:
                continue
            f.details.setdefault("waits_at", {})[str(rank)] = ctx.site(s.main_site)
            key = (call.op, call.group, call.seq, call.enqueued, here)
            by_place.setdefault(key, []).append(rank)
            calls.setdefault(key, (call, s.main_site))
        notes = [waits_elsewhere(ranks, calls[key][0], ctx.fmt(calls[key][1])) for key, ranks in by_place.items()]
        if notes:
            f.summary = sentence(f.summary, *notes)  # one sentence: its parts joined by semicolons
    return findings
