"""Ranks that ended while others need them: the root (not the launcher's teardown), how it ended, and
a crash that followed a desync reported as the desync. The words are in
:mod:`dtwatch.diagnose.wording.ended_words`."""
from __future__ import annotations

from dtwatch.diagnose.compare import conditional, desync, sides_at
from dtwatch.diagnose.context import P2P, Context, is_library_path, with_cpp_entries
from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.exits import Told, interrupted, same_error
from dtwatch.diagnose.loops import (
    early_exit_loop,
    fewer_calls,
    is_exit_gate,
    is_return,
    past_loop,
    per_rank_count,
    uneven,
)
from dtwatch.diagnose.model import PEER_ERRORS, STALL, Finding, Kind, Position
from dtwatch.diagnose.order import parting_at_stall
from dtwatch.diagnose.rank_state import CPP_OP, Call, RankState
from dtwatch.diagnose.wording.ended_words import (
    OTHERS_NOT_RECORDED,
    crashed_past_loop_summary,
    every_rank_failed_summary,
    exited_after_same_calls,
    exited_normally,
    exited_summary,
    followed_by,
    same_gpu_words,
    teardown,
    then_crashed,
    then_failed,
)


# ---------------------------------------------------------------------------------------------------
# ranks that ended
# ---------------------------------------------------------------------------------------------------
def gone_findings(ctx: Context, gone: list[int], waiting: list[int]) -> list[Finding]:
    by_rank = ctx.by_rank
    clean = [r for r in gone if by_rank[r].clean_exit]
    if len(clean) == len(gone):
        f = uneven(ctx, clean, waiting, positions_known=False, exited=True)
        if f:
            return [f]
        blocked = [ctx.pos[r] for r in waiting if ctx.pos[r].call is not None]
        first = min(blocked, key=lambda p: p.issued.t_enter) if blocked else None
        if first is not None and first.issued.op not in P2P and ctx.branch(first.rank, first.issued):
            side = [p for p in blocked if p.key() == first.key()]
            return [conditional(ctx, side, [], waiting, exited_normally(clean))]
    roots = _roots(ctx, [by_rank[r] for r in gone]) or gone
    return [exited(ctx, r, [x for x in waiting if x not in roots]) for r in sorted(roots)]



def exited(ctx: Context, r: int, others: list[int], extra: str = "") -> Finding:
    s = ctx.by_rank[r]
    last = ctx.last_call(r)
    fields, waiting_txt = ctx.waiting(others)
    told = ctx.told(s) if s.exit_state in ("exception", "exited") else None
    known_at = told.site if told is not None else None  # the line that raised or called the exit
    site = known_at or ctx.user_site(r, last)
    at = known_at
    # Where it left the loop the others are still in: the loop, the exit it took, the rank test over it; or an
    # os._exit() that can leave it (see ended_words.exited_summary).
    loop_site: dict | None = None
    exit_site: dict | None = None
    exit_branch: dict | None = None
    possible_exit: dict | None = None
    details: dict = {}
    if s.exit_state == "exited":
        # Left the loop the others are still in: name that exit (the recorded one, else the loop's exit a
        # rank test leads to) and its rank test.
        fact = early_exit_loop(ctx, [x for x in ctx.by_rank if x != r])
        exits = list((fact or {}).get("exits", []))
        if known_at is not None and fact is not None:
            exits = [e for e in exits if known_at.get("file") == fact["loop_site"]["file"]
                     and e[0] == known_at.get("line")]
        exits = exits[:1] if exits and is_return(exits[0][1]) else []
        if fact is not None and exits:
            line, text = exits[0]
            taken = {"file": fact["loop_site"]["file"], "line": line,
                     "function": fact["loop_site"].get("function"), "source": text}
            branch = ctx.ev.rank_branch(fact["loop_site"]["file"], line) and fact["branch"]
            if known_at is None:
                site = exit_site = taken
                loop_site, exit_branch = fact["loop_site"], fact["branch"]
                details["conditional_line"] = fact["branch"]
            else:
                loop_site, exit_branch = fact["loop_site"], fact["branch"] if branch else None
                if branch:
                    details["conditional_line"] = fact["branch"]
    elif s.alive is False and s.exit_state == "running" and not (ctx.ending(r) or {}).get("signal") \
            and not (ctx.ending(r) or {}).get("exit"):
        # Nothing recorded how it ended. os._exit() ends a process exactly that way: if the loop the
        # others are still in can be left through it, say so (as a possibility, not a fact).
        fact = early_exit_loop(ctx, [x for x in ctx.by_rank if x != r])
        hard = [e for e in (fact or {}).get("exits", []) if "_exit(" in e[1]]
        if fact and hard:
            line, text = hard[0]
            site = {"file": fact["loop_site"]["file"], "line": line, "function": fact["loop_site"].get("function"),
                    "source": text}
            loop_site, possible_exit = fact["loop_site"], site
            details["possible_exit"] = site
    elif s.exit_state == "running" and known_at is None and (ctx.ending(r) or {}).get("exit"):
        told = ctx.told(s)
        if told.site:
            site = at = told.site
    ddp_unfinished = told is not None and DDP_UNFINISHED in told.error
    summary = exited_summary(r, ctx.how_it_ended(s), at, last, ctx.user_site(r, last), waiting_txt, extra, ctx.fmt,
                             loop_site=loop_site, exit_site=exit_site, branch=exit_branch, possible_exit=possible_exit,
                             ddp_unfinished=ddp_unfinished, next_waiting=_waiting_next(last, fields))
    return Finding(
        kind=Kind.RANK_EXITED, severity=STALL, ranks=[r], summary=summary,
        op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
        site=ctx.site(site),
        details={"exit_state": s.exit_state, "exit_reason": s.exit_reason, "pid": s.pid, "host": s.host,
                 "ending": ctx.ending(r), "last_call_site": ctx.site(ctx.user_site(r, last)), **details}, **fields,
    )


DDP_UNFINISHED = "Expected to have finished reduction in the prior iteration"


def _waiting_next(last: Call | None, fields: dict) -> list[int]:
    """The ranks that wait in the call of ``last``'s group after it (the gradient all-reduce DDP's "Expected to
    have finished reduction" says was never issued), from the finding's waiting fields; none where they wait
    elsewhere."""
    if last is not None and fields.get("waiting_ranks") and fields.get("waiting_group") == last.group \
            and fields.get("waiting_seq") == last.seq + 1:
        return list(fields["waiting_ranks"])
    return []


def _crashed_past_loop(ctx: Context, r: int, others: list[int], extra: str) -> Finding | None:
    """A rank that ended after leaving the loop the others were still in (it crashed in the code after
    the loop, e.g. a checkpoint whose collectives met the others' training step): uneven iterations."""
    stack = (ctx.ev.ending(r) or {}).get("frames") or []
    outer = [f for f in stack if not is_library_path(str(f.get("file", "")))]
    fact = past_loop(ctx, outer, [ctx.pos[o] for o in others if o in ctx.pos]) if outer else None
    if fact is None:
        return None
    f = exited(ctx, r, others, extra)
    f.kind = Kind.UNEVEN_ITERATIONS
    f.summary = crashed_past_loop_summary(r, fact["loop_site"], sorted(others), outer[0], fact["inside_site"],
                                          f.summary, ctx.fmt)
    f.site = ctx.site(fact["loop_site"])
    f.details["crash_site"] = ctx.site(outer[0])
    f.details["loop"] = {"file": fact["loop_site"]["file"], "line": fact["loop"].start,
                         "exits": [list(e) for e in fact["loop"].exits]}
    return f


def _end_time(s: RankState) -> float:
    return s.exit_time or s.heartbeat_time


def _secondary(ctx: Context, s: RankState) -> bool:
    """Ended on a peer's death: it raised a peer error ("Connection closed by peer", a timeout), or exited
    with an error status while handling one (a runner that turns errors into ``sys.exit(1)``)."""
    if s.exit_state == "exception" or (s.exit_state == "exited" and s.exit_code):
        error = ctx.told(s).error.lower() or s.exit_reason.lower()
        return any(w in error for w in PEER_ERRORS)
    return False


def _roots(ctx: Context, ended: list[RankState]) -> list[int]:
    """The ranks whose end started it: a raise, else a fatal signal recorded (not SIGTERM), else the
    earliest silent death. Ranks that ended later by SIGTERM or silently are the launcher's teardown."""
    crashed = [s for s in ended if not s.clean_exit and not _secondary(ctx, s)]
    if not crashed:
        return []
    raised = [s for s in crashed if s.exit_state in ("exception", "exited")]  # an error, or an exit status
    fatal = [s for s in crashed if (ctx.ev.ending(s.rank) or {}).get("signal") not in (None, "SIGTERM")]
    # Ranks that received SIGTERM were ended by someone else (the launcher's teardown, a scheduler):
    # never the root.
    pool = raised or fatal or [s for s in crashed if (ctx.ev.ending(s.rank) or {}).get("signal") != "SIGTERM"]
    if not pool:
        return []
    first = min(_end_time(s) for s in pool)
    return sorted(s.rank for s in pool if _end_time(s) <= first + 1.0)


def exit_findings(states: list[RankState], now: float, evidence: Evidence) -> list[Finding]:
    """Ranks that ended while others still needed them, diagnosed as soon as it happens (no window).

    The root is the earliest rank that ended abnormally, not counting exceptions caused by a peer's
    death (connection reset, communicator aborted, timeouts) nor ranks the launcher tore down. If only
    clean exits remain, a rank that exited normally while a peer then failed on it is the root (it
    returned early, or ran fewer iterations). Every rank ending at once (preemption, Ctrl-C) is not a
    finding. A crash that follows a desync is reported as the desync.
    """
    ended = [s for s in states if s.gone]
    if not ended or len(states) < 2:
        return []
    pos = {s.rank: Position(s.rank, "gone", s.last_call(), None) for s in states}
    ctx = Context(states, pos, min(_end_time(s) for s in ended), now, evidence)
    # The ranks' programs parted earlier (an extra or skipped call that paired with another): that is the
    # cause, and ranks that ended cleanly after the same calls as their peers are not. (Ranks that all end
    # at once by preemption or Ctrl-C have not parted.)
    parted = parting_at_stall(ctx, [s.rank for s in states if not s.gone])
    if parted is not None:
        return with_cpp_entries(ctx, [parted])
    roots = _roots(ctx, ended)
    if roots:
        desync = crash_desync(ctx, roots)
        if desync:
            return desync
        if len(roots) == len(states):
            # Everything ended at once: preemption, Ctrl-C, a node lost (nothing to single out), or every
            # rank failed on its own (a start-up crash: a bad setting, two ranks on one GPU).
            f = every_rank_failed(ctx)
            return [f] if f is not None else []
        others = [s.rank for s in states if s.rank not in roots]
        torn = sorted(s.rank for s in ended if s.rank not in roots and not _secondary(ctx, s) and not s.clean_exit)
        extra = teardown(torn) if torn else ""
        return [_crashed_past_loop(ctx, r, others, extra) or exited(ctx, r, others, extra) for r in roots]
    clean = sorted(s.rank for s in ended if s.exit_state == "exited")
    failed = [s.rank for s in states if _secondary(ctx, s)]
    if clean and failed:
        reasons = {s.rank: ctx.told(s).error for s in states if _secondary(ctx, s)}
        extra = then_failed(reasons)
        f = beyond_clean_exit(ctx, clean, failed) or uneven(ctx, clean, failed, positions_known=False, exited=True)
        if f:
            f.summary = followed_by(f.summary, extra)
            return [f]
        return [exited(ctx, r, failed, extra) for r in clean]
    return []


def every_rank_failed(ctx: Context) -> Finding | None:
    """Every rank raised (or exited with an error status) on its own, not because a peer died, nor by an
    interrupt: one CRASH finding with the error each group of ranks raised and the line, and the cause
    where the error names one (two ranks on one GPU)."""
    told = {s.rank: ctx.told(s) for s in ctx.states}
    if not all(t.failed and not interrupted(t) for t in told.values()):
        return None
    kinds: list[list[int]] = []
    for r in sorted(told):
        same = next((k for k in kinds if same_error(told[k[0]], told[r])), None)
        if same is None:
            kinds.append([r])
        else:
            same.append(r)
    first = kinds[0][0]
    calls = {r: ctx.last_call(r) for r in told}
    first_call = all(c is None or c.seq <= 1 for c in calls.values())
    when = ("in" if first_call and any(c is not None for c in calls.values()) else
            "before" if all(c is None for c in calls.values()) else "")
    cause = same_gpu_cause(ctx, told)
    summary = every_rank_failed_summary([(ranks, told[ranks[0]].text, told[ranks[0]].site) for ranks in kinds],
                                        len(told), when, cause, ctx.fmt)
    last = calls[first]
    return Finding(
        kind=Kind.RANK_EXITED, severity=STALL, ranks=sorted(told), summary=summary,
        op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
        site=ctx.site(told[first].site),
        details={"every_rank_failed": True, "errors": {str(r): t.error for r, t in sorted(told.items())},
                 **({"cause": cause} if cause else {})},
    )


def same_gpu_cause(ctx: Context, told: dict[int, Told]) -> str:
    """Two ranks on one GPU, where the errors (NCCL's "Duplicate GPU detected" / "Multiple Ranks are using
    the same GPU") or the ranks' own device identities say so."""
    by_device: dict[tuple[str, str], list[int]] = {}
    for s in ctx.states:
        if s.gpu_uuid:
            by_device.setdefault((s.host, s.gpu_uuid), []).append(s.rank)
    shared = [sorted(r) for r in by_device.values() if len(r) > 1]
    error_says = any(("duplicate gpu" in t.error.lower() or "same gpu" in t.error.lower()) for t in told.values())
    return same_gpu_words(shared, error_says)


def beyond_clean_exit(ctx: Context, clean: list[int], others: list[int]) -> Finding | None:
    """``clean`` exited normally; ``others`` issued more calls of a group than they did. Two stories the
    calls tell apart from "the clean ranks left the loop early":

    * the first call past the clean ranks' end runs under a rank test on the others (a checkpoint gather
      only rank 0 makes): the others made an extra call, the clean ranks are not the culprit;
    * the clean ranks ran as many steps as the others (the others are inside their last one) and still
      issued fewer calls: the ranks issued a different number of collectives for the same steps (a
      rank-dependent ``continue`` before ``backward()``, a per-rank ``no_sync`` window); not a loop exit.
    """
    for group in sorted({g for r in others for g in ctx.by_rank[r].groups}):
        ends = {ctx.by_rank[c].groups[group].seq for c in clean if group in ctx.by_rank[c].groups}
        if len(ends) != 1:
            continue  # the clean ranks themselves ended at different points (or are not members)
        end = ends.pop()
        more = [o for o in others if group in ctx.by_rank[o].groups and ctx.by_rank[o].groups[group].seq > end]
        if not more:
            continue
        o = more[0]
        call = ctx.named(o, ctx.call_at(o, group, end + 1))
        if call is None:
            continue
        branch = ctx.branch(o, call)
        if branch is not None and not is_exit_gate(branch):
            ctx.past = True
            try:
                side = [Position(r, "blocked", call, None) for r in more]
                f = conditional(ctx, side, [], [], exited_after_same_calls(clean, end, group, more))
            finally:
                ctx.past = False
            f.details["program_order"] = True  # a call past the end of its peers' program
            return f
        if any(set(ld["short_ranks"]) & set(clean) for ld in ctx.loaders):
            continue  # their DataLoader was shorter: uneven iterations (see loops.uneven)
        steps_clean = [ctx.steps.get(c, 0) for c in clean]
        steps_more = [ctx.steps.get(r, 0) for r in more]
        # More optimizer steps than the others have finished: the clean ranks did not stop early. As many:
        # only where the loop makes the number of calls per iteration rank-dependent.
        if min(steps_clean) > 0 and (min(steps_clean) > max(steps_more) or (
                min(steps_clean) == max(steps_more) and per_rank_count(ctx, o, call) is not None)):
            return fewer_calls(ctx, clean, more, group, call, certain=min(steps_clean) > max(steps_more))
    return None


def crash_desync(ctx: Context, roots: list[int]) -> list[Finding]:
    """A crash that followed a desync: at the root's last (group, seq), ranks had issued different calls
    (a Python collective on one rank meeting DDP's C++-issued all-reduce on the others included)."""
    last = ctx.last_call(roots[0])
    if last is None or last.op in P2P:
        return []  # p2p calls pair with the peer's matching call, not by sequence number
    known = {s.rank: ctx.named(s.rank, ctx.call_at(s.rank, last.group, last.seq)) for s in ctx.states}
    # Ranks whose call there is not known (their ring's view is older) are left out of the comparison.
    calls = {r: c for r, c in known.items() if c is not None and c.op not in P2P}
    if roots[0] not in calls:
        return []
    if len(calls) < 2:
        # Only the root's call there is known (the others' C++-issued progress was not sampled before
        # they ended). A Python call under a rank test is still the likely cause: said with that caveat.
        root_call = calls[roots[0]]
        if root_call.op == CPP_OP or ctx.branch(roots[0], root_call) is None:
            return []
        ctx.pos = {**ctx.pos, roots[0]: Position(roots[0], "blocked", root_call, None)}
        f = conditional(ctx, [ctx.pos[roots[0]]], [], sorted(r for r in known if r != roots[0]),
                        OTHERS_NOT_RECORDED, others_known=False)
        f.summary = then_crashed(f.summary, [(r, ctx.how_it_ended(ctx.by_rank[r])) for r in roots])
        return with_cpp_entries(ctx, [f])
    sides = sides_at(ctx, [Position(r, "blocked", c, ctx.by_rank[r].main_site) for r, c in calls.items()])
    if len(sides) < 2:
        return []
    ctx.pos = {r: Position(r, "blocked", c, ctx.by_rank[r].main_site) for r, c in calls.items()}
    f = desync(ctx, last.group, last.seq, list(sides.values()), sorted(calls))
    f.summary = then_crashed(f.summary, [(r, ctx.how_it_ended(ctx.by_rank[r])) for r in roots])
    f.details["ended_by"] = {str(s.rank): ctx.how_it_ended(s) for s in ctx.states}
    unknown = sorted(r for r, c in known.items() if c is None)
    if unknown:
        f.details["not_compared"] = unknown
    return with_cpp_entries(ctx, [f])
