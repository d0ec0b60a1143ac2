"""The program-order finding: where the ranks' call streams parted (:mod:`.align`), as a finding.

Used at a stall (every blocked or ended rank's stream is final), when ranks ended (a rank that exited
cleanly after the same calls as its peers is the reference, never the culprit of the rank that made one
more), and live, as a warning, while the job still runs (only ended ranks' streams are final).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from dtwatch.diagnose.align import Parting, Token, parting, stream
from dtwatch.diagnose.context import Context
from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.flight import op_family
from dtwatch.diagnose.model import PEER_ERRORS, STALL, WARNING, Finding, Kind
from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.step_order import step_parting
from dtwatch.diagnose.wording.order_words import at_stall_summary, seen_earlier_summary
from dtwatch.diagnose.wording.phrases import parting_summary


def call_branch(ev: Evidence, token: Token) -> dict | None:
    """The rank test the call's own lines (the user's line, then the library's) run under."""
    c = token.call
    if c is None:
        return None
    for site in (c.user_site, c.site):
        if not site:
            continue
        found = ev.rank_branch(str(site.get("file", "")), int(site.get("line", 0) or 0))
        if found:
            return {"file": site["file"], "line": found[0], "source": found[1], "call_line": site["line"]}
    return None


def group_parting(members: list[RankState], group: str, final: Callable[[RankState], bool],
                  ev: Evidence) -> Parting | None:
    """Where the members' streams of ``group`` parted (:func:`dtwatch.diagnose.align.parting`, then
    :func:`dtwatch.diagnose.step_order.step_parting`), if they did."""
    streams = {s.rank: stream(s, group, op_family) for s in members}
    def under_rank_test(r: int, t: Token) -> bool:
        return call_branch(ev, t) is not None

    # Where the calls pair again after an extra one, the alignment finds it; where the extra calls come every
    # step, they pair shifted with no call left over, and only the step counters tell.
    return parting(group, streams, {s.rank: final(s) for s in members}, under_rank_test=under_rank_test) or \
        step_parting(group, streams, {s.rank: s.step for s in members}, under_rank_test=under_rank_test)


def first_parting(states: list[RankState], final: Callable[[RankState], bool], ev: Evidence) -> Parting | None:
    """The earliest parting over every group the ranks share (by the time its first call was issued)."""
    found: list[tuple[float, Parting]] = []
    for group in sorted({g for s in states for g in s.groups}):
        members = [s for s in states if group in s.groups]
        expected = members[0].groups[group].members if members else None
        if len(members) < 2 or (expected and len(members) < len(expected)):
            continue  # not every member is seen: no majority to compare with
        p = group_parting(members, group, final, ev)
        if p is not None:
            when = min((t.call.t_enter for t in p.calls if t.call is not None), default=float(p.seq))
            found.append((when, p))
    return min(found, key=lambda x: x[0])[1] if found else None


def parting_finding(p: Parting, ev: Evidence, *, severity: str = STALL, now: float = 0.0,
                    fmt: Callable[[dict | None], str], site_of: Callable[[dict | None], dict | None]) -> Finding:
    """The finding for a parting: the culprit's extra (or skipped) call, its rank test, and what it paired with."""
    first = p.calls[0]
    owner = p.ranks if p.extra else p.reference  # whose stream holds the calls
    branch = call_branch(ev, first)
    call_site = (first.call.user_site or first.call.site) if first.call is not None else None
    paired = next(iter(p.paired_with.values()), None)
    paired_site = (paired.call.user_site or paired.call.site) if paired is not None and paired.call else None
    # While the job runs, a parting is a silent desync (the kind the alert rules watch), its rank test named in
    # the details; at a stall or crash, one reached through a rank test is a rank-conditional call.
    kind = Kind.RANK_CONDITIONAL if branch is not None and p.decided and severity == STALL else Kind.DESYNC
    summary = parting_summary(p, branch=branch, fmt=fmt, call_site=call_site, paired_site=paired_site,
                              live=severity == WARNING)
    details = {
        "pattern": "extra_call" if p.extra else "skipped_call", "program_order": True,
        "parted_at": {"group": p.group, "seq": first.seq}, "conditional_line": site_of(branch) if branch else None,
        "calls": [{"seq": t.seq, "op": t.call.op if t.call else "cpp_collective",
                   "site": site_of(t.call.user_site or t.call.site) if t.call else None} for t in p.calls],
        "made_by": owner, "paired_with": {str(r): {"op": t.call.op if t.call else "cpp_collective", "seq": t.seq,
                                                   "site": site_of(t.call.user_site or t.call.site) if t.call else None}
                                          for r, t in sorted(p.paired_with.items())},
        "deviant_known": p.decided, "counts": p.counts, "silent": severity == WARNING,
    }
    if p.step is not None:
        details["step"] = {"step": p.step, "calls": p.step_calls}
    if first.call is not None and first.call.site and call_site and first.call.site != call_site:
        details["library_site"] = site_of(first.call.site)
    return Finding(
        kind=kind, severity=severity, ranks=sorted(p.ranks) if p.decided else sorted(p.ranks + p.reference),
        summary=summary, op=first.call.op if first.call else "cpp_collective", group=p.group, seq=first.seq,
        site=site_of(call_site), onset=first.call.t_enter if first.call else 0.0, detected=now, details=details,
    )


def parting_at_stall(ctx: Context, waiting: list[int]) -> Finding | None:
    """At a stall or after ranks ended: every blocked, wedged or ended rank's stream is final."""
    def final(s: RankState) -> bool:
        p = ctx.pos.get(s.rank)
        return s.gone or (p is not None and p.state in ("blocked", "gone", "unresponsive"))

    p = first_parting(ctx.states, final, ctx.ev)
    f = parting_finding(p, ctx.ev, fmt=ctx.fmt, site_of=ctx.site, now=ctx.now) if p is not None else _seen_earlier(ctx)
    if f is None:
        return None
    ended = {s.rank: ctx.how_it_ended(s) for s in ctx.states if s.gone}
    fields, waiting_txt = ctx.waiting(r for r in waiting if r not in f.ranks and r not in ended)
    # In the order the ranks ended: the first end is often the cause of the next (a clean exit closes the
    # connections a peer then fails on). A rank that failed on a peer's end ("connection closed by peer") ended
    # after it, whatever was recorded; a rank whose end was not recorded (a signal) otherwise comes last.
    when = {s.rank: (s.exit_time or float("inf")) for s in ctx.states if s.gone}

    def order(item: tuple[int, str]) -> tuple:
        rank, how = item
        return (any(e in how.lower() for e in PEER_ERRORS), when[rank], rank)

    by_how: dict[str, list[int]] = {}
    for r, how in sorted(ended.items(), key=order):
        by_how.setdefault(how, []).append(r)
    f.summary = at_stall_summary(f.summary, by_how, waiting_txt)
    if ended:
        f.details["ended_by"] = {str(r): how for r, how in ended.items()}
    for k, v in fields.items():
        if k != "onset":
            setattr(f, k, v)
    f.onset = f.onset or ctx.onset
    return f


def _seen_earlier(ctx: Context) -> Finding | None:
    """A silent desync reported while the job ran, in a group the ranks still share, when the calls it was
    seen at have left the rings' history since (their window now starts after it)."""
    for w in ctx.ev.earlier_findings():
        details = getattr(w, "details", None) or {}
        if not (details.get("silent") or details.get("program_order")) or w.group is None or w.seq is None:
            continue
        groups = [s.groups[w.group] for s in ctx.states if w.group in s.groups]
        if len(groups) < 2 or not any(g.recent and min(c.seq for c in g.recent) > w.seq for g in groups):
            continue
        when = time.strftime("%H:%M:%S", time.localtime(w.detected)) if w.detected else "earlier"
        kind = Kind.RANK_CONDITIONAL if details.get("conditional_line") and details.get("deviant_known", True) \
            else w.kind
        return Finding(
            kind=kind, severity=STALL, ranks=list(w.ranks), op=w.op, group=w.group, seq=w.seq, site=w.site,
            summary=seen_earlier_summary(w.summary, when if w.detected else None),
            onset=w.onset, detected=ctx.now, details={**details, "silent": False, "seen_earlier": when},
        )
    return None
