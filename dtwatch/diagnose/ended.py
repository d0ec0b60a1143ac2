"""Ranks that ended while others need them: the root (not the launcher's teardown), how it ended, and
a crash that followed a desync reported as the desync."""
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
from dtwatch.diagnose.wording.phrases import describe, fmt_ranks, sentence, trim, verb


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
            return [conditional(ctx, side, [], waiting, f"{fmt_ranks(clean)} exited normally")]
    roots = _roots(ctx, [by_rank[r] for r in gone]) or gone
    return [exited(ctx, r, [x for x in waiting if x not in roots]) for r in sorted(roots)]



def exited(ctx: Context, r: int, others: list[int], extra: str = "") -> Finding:
    s = ctx.by_rank[r]
    last = ctx.last_call(r)
    fields, waiting_txt = ctx.waiting(others)
    told = ctx.told(s) if s.exit_state in ("exception", "exited") else None
    known_at = told.site if told is not None else None  # the line that raised or called the exit
    site = known_at or ctx.user_site(r, last)
    parts = [f"rank {r} {ctx.how_it_ended(s)}"]
    details: dict = {}
    if known_at:
        parts.append(f"at {ctx.fmt(known_at)}")
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
            exit_site = {"file": fact["loop_site"]["file"], "line": line,
                         "function": fact["loop_site"].get("function"), "source": text}
            branch = ctx.ev.rank_branch(fact["loop_site"]["file"], line) and fact["branch"]
            if known_at is None:
                site = exit_site
                parts.append(f"it left the loop at {ctx.fmt(fact['loop_site'])} early, through {ctx.fmt(exit_site)}"
                             + (f" under the rank test {ctx.fmt(fact['branch'])}" if fact["branch"] else ""))
                details["conditional_line"] = fact["branch"]
            else:
                parts.append(f"it left the loop at {ctx.fmt(fact['loop_site'])} early"
                             + (f", under the rank test {ctx.fmt(fact['branch'])}" if branch else ""))
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
            parts.append(f"the loop at {ctx.fmt(fact['loop_site'])} that the others are still in can end the process "
                         f"at {ctx.fmt(site)}, which leaves no record, as here")
            details["possible_exit"] = site
    elif s.exit_state == "running" and known_at is None and (ctx.ending(r) or {}).get("exit"):
        told = ctx.told(s)
        if told.site:
            site = told.site
            parts.append(f"at {ctx.fmt(told.site)}")
    last_site = ctx.user_site(r, last)
    parts.append((f"its last collective was {describe(last)}" + (f" at {ctx.fmt(last_site)}" if last_site else ""))
                 if last else "it had issued no collective")
    if told is not None and DDP_UNFINISHED in told.error:
        parts.append(_ddp_unfinished(r, last, fields))
    parts += [waiting_txt, extra]
    return Finding(
        kind=Kind.RANK_EXITED, severity=STALL, ranks=[r], summary=sentence(*parts),
        op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
        site=ctx.site(site),
        details={"exit_state": s.exit_state, "exit_reason": s.exit_reason, "pid": s.pid, "host": s.host,
                 "ending": ctx.ending(r), "last_call_site": ctx.site(ctx.user_site(r, last)), **details}, **fields,
    )


DDP_UNFINISHED = "Expected to have finished reduction in the prior iteration"


def _ddp_unfinished(r: int, last: Call | None, fields: dict) -> str:
    """What DDP's "Expected to have finished reduction" error means for the ranks that wait."""
    waited = ""
    if last is not None and fields.get("waiting_ranks") and fields.get("waiting_group") == last.group \
            and fields.get("waiting_seq") == last.seq + 1:
        who = fields["waiting_ranks"]
        waited = f" (seq {last.seq + 1} of group {last.group}, which {fmt_ranks(who)} {verb(who, 'waits', 'wait')} in)"
    return (f"DDP raises this at the forward after a step in which some of rank {r}'s parameters got no gradient: "
            f"a gradient all-reduce of that step was never issued on rank {r}{waited}; that step's forward left "
            "those parameters out of the loss (a branch or an early return in forward; if that is intended, pass "
            "find_unused_parameters=True to DistributedDataParallel)")


def _crashed_past_loop(ctx: Context, r: int, others: list[int], extra: str) -> Finding | None:
    """A rank that ended after leaving the loop the others were still in (it crashed in the code after
    the loop, e.g. a checkpoint whose collectives met the others' training step): uneven iterations."""
    stack = (ctx.ev.ending(r) or {}).get("frames") or []
    outer = [f for f in stack if not is_library_path(str(f.get("file", "")))]
    fact = past_loop(ctx, outer, [ctx.pos[o] for o in others if o in ctx.pos]) if outer else None
    if fact is None:
        return None
    f = exited(ctx, r, others, extra)
    loop_txt = f"{ctx.fmt(fact['loop_site'])}"
    inside = sorted(others)
    f.kind = Kind.UNEVEN_ITERATIONS
    f.summary = sentence(
        f"rank {r} left the loop at {loop_txt} earlier than {fmt_ranks(inside)}: it was at {ctx.fmt(outer[0])}, "
        f"after the loop, while they were still inside it at {ctx.fmt(fact['inside_site'])}",
        f.summary,
    )
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
        extra = f"{fmt_ranks(torn)} then ended too (the launcher's teardown)" if torn else ""
        return [_crashed_past_loop(ctx, r, others, extra) or exited(ctx, r, others, extra) for r in roots]
    clean = sorted(s.rank for s in ended if s.exit_state == "exited")
    failed = [s.rank for s in states if _secondary(ctx, s)]
    if clean and failed:
        reasons = {s.rank: ctx.told(s).error for s in states if _secondary(ctx, s)}
        extra = "then " + "; ".join(f"rank {r} failed: {trim(why, 160)}" for r, why in sorted(reasons.items()))
        f = beyond_clean_exit(ctx, clean, failed) or uneven(ctx, clean, failed, positions_known=False, exited=True)
        if f:
            f.summary = sentence(f.summary, extra)
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
    parts = []
    for ranks in kinds:
        t = told[ranks[0]]
        where = f" at {ctx.fmt(t.site)}" if t.site else ""
        who = "every rank" if len(ranks) == len(told) else fmt_ranks(ranks)
        parts.append(f"{who} {t.text}{where}")
    when = ("in its first collective" if first_call and any(c is not None for c in calls.values()) else
            "before its first collective" if all(c is None for c in calls.values()) else "")
    if when:
        parts[0] += f" ({when})"
    cause = same_gpu_cause(ctx, told)
    if cause:
        parts.append(cause)
    last = calls[first]
    return Finding(
        kind=Kind.RANK_EXITED, severity=STALL, ranks=sorted(told), summary=sentence(*parts),
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
    if shared:
        return ("; ".join(f"{fmt_ranks(r)} share one GPU" for r in shared) + " (set each rank's device from "
                "LOCAL_RANK before its first collective: torch.cuda.set_device(local_rank))")
    if any(("duplicate gpu" in t.error.lower() or "same gpu" in t.error.lower()) for t in told.values()):
        return ("the error says two ranks use the same GPU (set the device from LOCAL_RANK before the first "
                "collective, e.g. torch.cuda.set_device(local_rank))")
    return ""


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
                f = conditional(ctx, side, [], [], f"{fmt_ranks(clean)} exited normally after the same {end} calls of "
                                f"group {group} that {fmt_ranks(more)} had made before it")
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
        how = "; ".join(f"rank {r} {ctx.how_it_ended(ctx.by_rank[r])}" for r in roots)
        f = conditional(ctx, [ctx.pos[roots[0]]], [], sorted(r for r in known if r != roots[0]),
                        "what the other ranks issued at that sequence number was not recorded before they ended",
                        others_known=False)
        f.summary = f.summary.rstrip(".") + f"; the job then crashed ({how})."
        return with_cpp_entries(ctx, [f])
    sides = sides_at(ctx, [Position(r, "blocked", c, ctx.by_rank[r].main_site) for r, c in calls.items()])
    if len(sides) < 2:
        return []
    ctx.pos = {r: Position(r, "blocked", c, ctx.by_rank[r].main_site) for r, c in calls.items()}
    f = desync(ctx, last.group, last.seq, list(sides.values()), sorted(calls))
    how = "; ".join(f"rank {r} {ctx.how_it_ended(ctx.by_rank[r])}" for r in roots)
    f.summary = f.summary.rstrip(".") + f"; the job then crashed ({how})."
    f.details["ended_by"] = {str(s.rank): ctx.how_it_ended(s) for s in ctx.states}
    unknown = sorted(r for r, c in known.items() if c is None)
    if unknown:
        f.details["not_compared"] = unknown
    return with_cpp_entries(ctx, [f])
