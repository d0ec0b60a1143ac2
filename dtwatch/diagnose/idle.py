"""Ranks not in any collective while others wait: wedged (not running Python) or stuck elsewhere."""
from __future__ import annotations

from dtwatch.diagnose.context import Context, is_library_path
from dtwatch.diagnose.loops import uneven
from dtwatch.diagnose.model import STALL, Finding, Kind, Position
from dtwatch.diagnose.wording.idle_words import outside_in_dump_summary, stuck_outside_summary, unresponsive_summary
from dtwatch.diagnose.wording.phrases import fmt_site


def unresponsive(ctx: Context, p: Position, waiting: list[int]) -> Finding:
    s = ctx.by_rank[p.rank]
    fields, waiting_txt = ctx.waiting(r for r in waiting if r != p.rank)
    stack = ctx.ev.stack(p.rank)
    user = next((f for f in (stack or []) if not is_library_path(str(f.get("file", "")))), None)
    site: dict | None
    last = s.last_call()
    if user is not None:
        site, source = user, "py-spy"
    elif last is not None and last.t_exit and last.t_exit > s.main_site_since:
        # No stack: the later of the last sampled line and the last collective it left.
        site, source = ctx.user_site(p.rank, last), "last collective"
    else:
        site, source = s.main_site, "last sample"
    summary = unresponsive_summary(p.rank, s.proc_state, s.heartbeat_age(ctx.now), source, site, last, waiting_txt,
                                   ctx.fmt)
    return Finding(
        kind=Kind.UNRESPONSIVE, severity=STALL, ranks=[p.rank], summary=summary,
        op=p.call.op if p.call else None, group=p.call.group if p.call else None,
        seq=p.call.seq if p.call else None, site=ctx.site(site),
        details={"proc_state": s.proc_state, "heartbeat_age_s": round(s.heartbeat_age(ctx.now), 1),
                 "main_top_site": s.main_top_site, "site_from": source, "pid": s.pid, "host": s.host},
        **fields,
    )


def stuck_outside(ctx: Context, outside: list[int], waiting: list[int]) -> list[Finding]:
    f = uneven(ctx, outside, waiting, positions_known=False)
    if f:
        return [f]
    findings = []
    fields, waiting_txt = ctx.waiting(waiting)
    first_group = fields["waiting_group"]
    for r in outside:
        s = ctx.by_rank[r]
        if s.from_dump:
            findings.append(_outside_in_dump(ctx, r, fields, waiting_txt))
            continue
        stack = ctx.ev.stack(r)
        top_user = next((f for f in (stack or []) if not is_library_path(str(f.get("file", "")))), None)
        site = top_user or s.main_site
        seq = s.groups[first_group].seq if first_group in s.groups else None
        innermost = fmt_site(s.main_top_site, ctx.ev) if s.main_top_site and s.main_top_site != site else ""
        summary = stuck_outside_summary(r, site, innermost, ctx.now - s.main_site_since, first_group, seq, waiting_txt,
                                        ctx.fmt)
        findings.append(Finding(
            kind=Kind.STUCK_OUTSIDE, severity=STALL, ranks=[r], summary=summary,
            site=ctx.site(site), group=first_group, seq=seq,
            details={"main_top_site": s.main_top_site, "main_stack": s.main_stack, "step": s.step}, **fields,
        ))
    return findings


def _outside_in_dump(ctx: Context, r: int, fields: dict, waiting_txt: str) -> Finding:
    """A rank known from its Flight Recorder dump alone, with no collective in flight there: its last recorded
    one, and that where it is now is not in a dump. gloo's recorder leaves out send/recv: a rank whose op numbers
    skip some made point-to-point calls, and may be blocked in one now."""
    s = ctx.by_rank[r]
    group = fields["waiting_group"]
    last = max((c for g in s.groups.values() for c in g.recent), key=lambda c: c.t_enter, default=None)
    seq = s.groups[group].seq if group in s.groups else None
    site = ctx.user_site(r, last)
    behind = seq is not None and (last is None or (last.group, last.seq) != (group, seq))
    skipped = ((ctx.ev.dump_facts(r) or {}).get("p2p_unrecorded") or {})
    unrecorded = sum(skipped.values()) if skipped and s.backend == "gloo" else 0
    summary = outside_in_dump_summary(r, last, site, group, seq, behind, unrecorded, waiting_txt, ctx.fmt)
    return Finding(
        kind=Kind.STUCK_OUTSIDE, severity=STALL, ranks=[r], summary=summary, site=None, group=group, seq=seq,
        details={"from_dump": True, "last_recorded": ({"op": last.op, "group": last.group, "seq": last.seq,
                                                       "site": ctx.site(site)} if last else None),
                 "p2p_unrecorded": skipped},
        **fields,
    )
