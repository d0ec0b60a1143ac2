"""Ranks that all issued something: where they took different paths, and who deviated.

At one group and sequence number: the same line with other arguments (``mismatch``), one side past
a loop the other is still in (uneven iterations), the same calls in another order (``desync``), or a
call only some ranks make (``rank_conditional``). Across groups and p2p pairs: who waits for whom,
and which rank moved past a call its peers wait in. Before either, program-order alignment: the first
earlier point where the ranks issued different calls that still completed.

The decisions are here; their words are in :mod:`dtwatch.diagnose.wording.compare_words`.
"""
from __future__ import annotations

from collections import defaultdict

from dtwatch.diagnose.context import MATCHING_P2P, P2P, Context
from dtwatch.diagnose.loops import uneven
from dtwatch.diagnose.mismatch import mismatch, site_key
from dtwatch.diagnose.model import STALL, Finding, Kind, Position
from dtwatch.diagnose.rank_state import CPP_OP, Call
from dtwatch.diagnose.wording.compare_words import (
    extra_call_summary,
    never_seen_phrase,
    order_swap_summary,
    out_of_step_summary,
    p2p_deadlock_summary,
    skipped_summary,
    skipped_wait_summary,
    stalled_summary,
    waits_behind_summary,
)
from dtwatch.diagnose.wording.phrases import CPP_PREFIX, describe
from dtwatch.ops import SAME_SHAPE_OPS


def first_divergence(ctx: Context, blocked: list[Position]) -> Finding | None:
    """Program-order alignment: the first sequence number, before where the ranks now wait, at which
    the members of a group issued different collectives (another op, or the same op with another shape)
    and the calls still completed. Only what is known on every member counts (Python-issued calls, and
    C++-issued ones named by the Flight Recorder)."""
    waiting = sorted(p.rank for p in blocked)
    live = [s for s in ctx.states if not s.gone]
    groups = sorted({g for s in live for g in s.groups})
    for group in groups:
        members = [s.rank for s in live if group in s.groups]
        if len(members) < 2:
            continue
        upto = min(ctx.by_rank[m].groups[group].completed for m in members)
        known: set[int] = set()
        for m in members:
            known |= {c.seq for c in ctx.by_rank[m].groups[group].recent if c.seq <= upto}
            summary = ctx.ev.flight_record(m) or {}
            for e in summary.get("entries") or []:
                for key in ("op_id", "seq"):
                    if isinstance(e.get(key), int) and e[key] <= upto:
                        known.add(int(e[key]))
        def calls_at(seq: int, group: str = group, members: list[int] = members) -> dict[int, Call] | None:
            calls = {m: ctx.named(m, ctx.call_at(m, group, seq)) for m in members}
            issued = {m: c for m, c in calls.items() if c is not None and c.op != CPP_OP and c.op not in P2P}
            return issued if len(issued) == len(calls) else None

        for seq in sorted(known):
            calls = calls_at(seq)
            if calls is None or len({_op_shape(c) for c in calls.values()}) < 2:
                continue
            # The ops first differ here. Where the ranks split the same way, but still issued the same ops
            # from different lines, just before, is where they went out of step (the extra call).
            split = {m: _op_shape(c) for m, c in calls.items()}
            start = seq
            while start - 1 in known:
                earlier = calls_at(start - 1)
                if earlier is None or not _split_by_line(ctx, earlier, split):
                    break
                start, calls = start - 1, earlier
            seq = start
            sides: dict[tuple, list[Position]] = defaultdict(list)
            for m, c in calls.items():
                sides[split[m]].append(Position(m, "blocked", c, None))
            now_pos = ctx.pos
            ctx.pos = {**ctx.pos, **{m: Position(m, "blocked", c, None) for m, c in calls.items()}}
            ctx.past = True
            try:
                f = desync(ctx, group, seq, list(sides.values()), members)
            finally:
                ctx.pos, ctx.past = now_pos, False
            fields, waiting_txt = ctx.waiting(waiting)
            f.summary = out_of_step_summary(f.summary, waiting_txt)
            f.details["diverged_at"] = {"group": group, "seq": seq}
            for k, v in fields.items():
                setattr(f, k, v)
            return f
    return None


def _split_by_line(ctx: Context, calls: dict[int, Call], split: dict[int, tuple]) -> bool:
    """Whether the ranks issued these calls from lines that differ exactly between the sides of ``split``."""
    lines: dict[tuple, set] = defaultdict(set)
    for m, c in calls.items():
        lines[split[m]].add(site_key(ctx.user_site(m, c)))
    sets = list(lines.values())
    return len(sets) > 1 and all(len(x) == 1 for x in sets) and len(set().union(*sets)) == len(sets)


def _op_shape(c: Call) -> tuple:
    """What must agree across ranks at one sequence number: the op, and the shape where both sides
    state it the same way (Python-issued fingerprints)."""
    from dtwatch.diagnose.flight import op_family

    return (op_family(c.op), c.fingerprint if not c.fingerprint.startswith(CPP_PREFIX) else "")


# ---------------------------------------------------------------------------------------------------
# every rank has issued something: compare them
# ---------------------------------------------------------------------------------------------------
def blocked_findings(ctx: Context, blocked: list[Position], waiting: list[int]) -> list[Finding]:
    # 1. Ranks at the same group and sequence number in different calls: they took different paths.
    # (p2p calls pair with their peer's matching call, not by sequence number: they are followed below.)
    points: dict[tuple[str, int], list[Position]] = defaultdict(list)
    for p in blocked:
        if p.issued.op not in P2P:
            points[(p.issued.group, p.issued.seq)].append(p)
    for (group, seq), here in sorted(points.items(), key=lambda kv: min(p.issued.t_enter for p in kv[1])):
        # Members that already passed this point: what they issued there (their call completed on their
        # side, e.g. gloo finished a send of the wrong size) counts too.
        there = {p.rank for p in here}
        for m in ctx.members(here[0].rank, group):
            g = ctx.by_rank[m].groups.get(group) if m in ctx.by_rank and m not in there else None
            if g is not None and g.seq > seq:
                c = ctx.named(m, ctx.call_at(m, group, seq))
                if c is not None and c.op not in P2P:
                    here = here + [Position(m, "passed", c, None)]
        sides = sides_at(ctx, here)
        if len(sides) > 1:
            return [desync(ctx, group, seq, list(sides.values()), waiting)]

    # 2. Point-to-point calls that wait for each other in a cycle (each in recv from the next): a schedule
    # deadlock, whatever the network does.
    cycle = _p2p_cycle(ctx, blocked)
    if cycle:
        return [_schedule_deadlock(ctx, cycle, waiting)]

    # 3. Someone waits for ranks that have not issued the call: follow who waits for whom.
    edges = [(p, m) for p in blocked for m in ctx.missing(p.rank, p.issued)]
    if edges:
        return [_wait_cycle(ctx, edges, waiting)]

    # 4. Everyone seen is in the same collective and nobody seen is missing.
    p = min(blocked, key=lambda q: q.issued.t_enter)
    fields, _ = ctx.waiting(waiting)
    site = ctx.user_site(p.rank, p.issued)
    unseen = _unseen_members(ctx, p.rank, p.issued)
    # Every rank that dumped issued the call and it did not complete: the members with no dump are the only
    # ones it can be waiting for (what they did is not in any dump).
    culprits = unseen if unseen and _from_dumps(ctx) else []
    seen = sorted(ctx.by_rank)
    summary = stalled_summary(p.issued, site, seen, ctx.presence(seen) if culprits else "", unseen, bool(culprits),
                              _never_seen(ctx, unseen) if unseen else "", ctx.fmt)
    return [Finding(
        kind=Kind.STALLED_COLLECTIVE, severity=STALL, ranks=culprits, summary=summary,
        op=p.issued.op, group=p.issued.group, seq=p.issued.seq, site=None if culprits else ctx.site(site),
        details={"unseen_ranks": unseen, **({"no_dump": unseen} if culprits else {})}, **fields,
    )]


def _from_dumps(ctx: Context) -> bool:
    """The ranks are known from torch's Flight Recorder dumps alone (a job that ran without dtwatch)."""
    return any(s.from_dump for s in ctx.states)


def _p2p_cycle(ctx: Context, blocked: list[Position]) -> list[Position]:
    """Ranks blocked in point-to-point calls, each waiting for the next one's matching call, in a cycle."""
    waits: dict[int, int] = {}
    where = {p.rank: p for p in blocked}
    for p in blocked:
        if p.issued.op in P2P:
            missing = ctx.missing(p.rank, p.issued)
            if len(missing) == 1 and missing[0] in where and where[missing[0]].issued.op in P2P:
                waits[p.rank] = missing[0]
    for start in sorted(waits):
        path, r = [start], waits[start]
        while r in waits and r not in path:
            path.append(r)
            r = waits[r]
        if r == start:
            return [where[x] for x in path]
    return []


def _schedule_deadlock(ctx: Context, cycle: list[Position], waiting: list[int]) -> Finding:
    """Ranks each in a send or recv that only the next rank in the cycle could match, and it is in one too."""
    ranks = [p.rank for p in cycle]
    tests = {p.rank: ctx.branch(p.rank, p.issued) for p in cycle}
    tested = [r for r, b in tests.items() if b is not None]
    culprits = tested if len(tested) == 1 else sorted(ranks)
    one_way = len({p.issued.op in ("recv", "irecv") for p in cycle}) == 1
    roles = _role_differences(ctx, ranks)
    fields, waiting_txt = ctx.waiting(r for r in waiting if r not in ranks)
    lone = tested[0] if len(tested) == 1 else None
    summary = p2p_deadlock_summary(cycle, [ctx.user_site(p.rank, p.issued) for p in cycle], one_way,
                                   MATCHING_P2P[cycle[0].issued.op], lone, tests[lone] if lone is not None else None,
                                   roles, waiting_txt, ctx.fmt)
    first = cycle[0]
    return Finding(
        kind=Kind.DESYNC, severity=STALL, ranks=culprits, summary=summary, op=first.issued.op,
        group=first.issued.group, seq=first.issued.seq, site=ctx.site(ctx.user_site(first.rank, first.issued)),
        details={"pattern": "p2p_deadlock", "cycle": [{"rank": p.rank, "op": p.issued.op, "peer": p.issued.peer,
                                                       "site": ctx.site(ctx.user_site(p.rank, p.issued))}
                                                      for p in cycle],
                 "conditional_line": tests[tested[0]] if len(tested) == 1 else None,
                 "role_differences": {str(r): {"role_peer": q, "call_index": i, "made": m, "role_peer_made": t}
                                      for r, (q, i, m, t) in roles.items()}},
        **fields,
    )


def _p2p_order(ctx: Context, rank: int) -> list[tuple[str, int]] | None:
    """The rank's point-to-point calls in order, as (send|recv, peer - rank); None unless its records are complete."""
    calls: list[Call] = []
    for g in ctx.by_rank[rank].groups.values():
        if any(c.op in P2P for c in g.recent) and not g.complete:
            return None
        calls += [c for c in g.recent if c.op in P2P and c.peer is not None and c.peer >= 0]
    calls.sort(key=lambda c: c.t_enter)
    return [("recv" if c.op in ("recv", "irecv") else "send", c.peer - rank) for c in calls]


def _role_differences(ctx: Context, ranks: list[int]) -> dict[int, tuple[int, int, str, str]]:
    """For ranks of a p2p cycle: where a rank's send/recv order first differs from a rank outside the cycle that
    talks to its peers at the same offsets (the same stage of another pipeline replica), over what both did."""
    out: dict[int, tuple[int, int, str, str]] = {}
    orders = {r: _p2p_order(ctx, r) for r in ctx.by_rank}
    for r in ranks:
        mine = orders.get(r)
        if not mine:
            continue
        offsets = {off for _, off in mine}
        for q in sorted(ctx.by_rank):
            theirs = orders.get(q)
            if q in ranks or not theirs or {off for _, off in theirs} != offsets:
                continue
            n = min(len(mine), len(theirs))
            at = next((i for i in range(n) if mine[i] != theirs[i]), None)
            if at is not None:
                out[r] = (q, at, mine[at][0], theirs[at][0])
                break
    return out


def _unseen_members(ctx: Context, rank: int, call: Call) -> list[int]:
    """Members of ``call``'s group (its peer, for p2p) that dtwatch has no state of."""
    if call.op in P2P and call.peer is not None and call.peer >= 0:
        members: list[int] | range = [call.peer]
    else:
        progress = ctx.by_rank[rank].groups.get(call.group)
        members = ctx.members(rank, call.group) if progress and progress.members else range(ctx.world)
    return sorted(set(members) - set(ctx.by_rank))


def _never_seen(ctx: Context, unseen: list[int]) -> str:
    """Why there is no state of ``unseen``, and what that leaves unknown."""
    damaged = sorted(set(unseen) & ctx.ev.unreadable())
    return never_seen_phrase([r for r in unseen if r not in damaged], damaged, ctx.world, _from_dumps(ctx),
                             ctx.ev.view_sample() is not None)


def _waits_behind(ctx: Context, call: Call, waiters: list[int], m: int, m_call: Call,
                  waiting: list[int]) -> Finding | None:
    """``waiters`` wait in ``call`` for rank ``m``, which is itself blocked in ``m_call`` where no rank
    dtwatch sees is missing. ``m`` is then a victim like the waiters, not a rank that skipped ``call``:
    the chain of waits ends at ``m_call``, either at members dtwatch has not seen (what they do is not
    known) or at a collective every member joined that is not completing. None when ``m`` waits for a
    rank dtwatch sees (that rank, or ``m``, deviated: the caller decides)."""
    if any(r in ctx.by_rank for r in ctx.missing(m, m_call)):
        return None
    unseen = _unseen_members(ctx, m, m_call)
    absent = ctx.missing(waiters[0], call)
    # Of the ranks the waiters wait for, those in m's call (m among them); any other is elsewhere.
    inner = sorted(r for r, q in ctx.pos.items() if r in absent and q.call is not None and q.issued.group ==
                   m_call.group and q.issued.seq == m_call.seq and q.issued.op == m_call.op) or [m]
    site = ctx.user_site(waiters[0], call)
    m_site = ctx.user_site(m, m_call)
    fields, _ = ctx.waiting(waiting)
    summary = waits_behind_summary(waiters, call, site, absent, inner, m_call, m_site, unseen, _from_dumps(ctx),
                                   _never_seen(ctx, unseen) if unseen else "", ctx.fmt)
    return Finding(
        kind=Kind.STALLED_COLLECTIVE, severity=STALL, ranks=[], summary=summary,
        op=m_call.op, group=m_call.group, seq=m_call.seq, site=ctx.site(m_site),
        details={"unseen_ranks": unseen, "blocked_behind": {"op": call.op, "group": call.group, "seq": call.seq,
                                                            "site": ctx.site(site), "ranks": waiters}},
        **fields,
    )


def sides_at(ctx: Context, here: list[Position]) -> dict[tuple, list[Position]]:
    """Positions at one point grouped by what they issued. A C++-issued call the Flight Recorder did not
    name on some rank (a dead rank cannot dump it) is compared as "issued from C++" on every rank."""
    unnamed = any(p.issued.op == CPP_OP for p in here)
    sides: dict[tuple, list[Position]] = defaultdict(list)
    for p in here:
        sig = _signature(ctx, p)
        if unnamed and p.issued.fingerprint.startswith(CPP_PREFIX):
            sig = (CPP_OP,)
        sides[sig].append(p)
    return dict(sides)


def _signature(ctx: Context, p: Position) -> tuple:
    c = p.issued
    if c.op == CPP_OP:
        return (CPP_OP,)
    if c.fingerprint.startswith(CPP_PREFIX):
        return (c.fingerprint,)  # DDP/FSDP's own call: the same on every rank whatever line led there
    user = ctx.user_site(p.rank, c)
    # Only ops whose tensor every rank passes alike are told apart by shape: a scatter's or gather's root-only
    # lists and an all_to_all's splits legitimately differ from rank to rank.
    what = c.fingerprint if c.op in SAME_SHAPE_OPS else c.op
    return (what, (user or {}).get("file"), (user or {}).get("line"))


def desync(ctx: Context, group: str, seq: int, sides: list[list[Position]], waiting: list[int]) -> Finding:
    """Ranks at the same point of a group in different calls."""
    sides = sorted(sides, key=lambda side: (len(side), min(p.rank for p in side)))
    # Same line, different op/dtype/shape: the ranks disagree on the arguments of one call.
    python = [side for side in sides if side[0].issued.op != CPP_OP]
    by_line: dict[tuple, list[list[Position]]] = defaultdict(list)
    for side in python:
        call = side[0].issued
        line = tuple(sorted(k for k in (call.site_key, site_key(ctx.user_site(side[0].rank, call))) if k))
        if line:  # no line known (a dump without frames): nothing says the sides share one
            by_line[line].append(side)
    for line_sides in by_line.values():
        if len(line_sides) > 1:
            return mismatch(ctx, group, seq, line_sides, waiting)

    # A side that left the loop the others are still in: uneven iterations.
    for side in (sides if not ctx.past else []):
        ranks = [p.rank for p in side]
        others = [p for s2 in sides if s2 is not side for p in s2]
        f = uneven(ctx, ranks, [r for r in waiting if r not in ranks], positions_known=True, inside=others, side=side)
        if f:
            return f

    # The same calls in a different order.
    swap = _order_swap(ctx, group, sides)
    if swap:
        return _swapped(ctx, group, seq, swap, sides, waiting)

    # One side runs a collective the others do not: the side under a rank-conditional branch.
    # One side makes a call the other does not. The deviant is the smaller side; between equal sides,
    # the one under a rank test. If the deviant is under no rank test but the others are (``if rank != 0:
    # dist.broadcast_object_list(...)``), the others' branch left it out: it skipped their call.
    branches = {id(side): ctx.branch(side[0].rank, side[0].issued) for side in sides}
    scored = sorted(sides, key=lambda side: (len(side), branches[id(side)] is None, side[0].issued.op == CPP_OP,
                                             min(p.rank for p in side)))
    culprit = scored[0]
    others = [p for side in sides if side is not culprit for p in side]
    tie = len(scored) > 1 and len(scored[1]) == len(culprit)
    if branches[id(culprit)] is None and not tie and not ctx.past:
        majority = scored[-1]
        if branches[id(majority)] is not None:
            return _skipped(ctx, culprit, majority, waiting)
    return conditional(ctx, culprit, others, waiting)


def _skipped(ctx: Context, side: list[Position], majority: list[Position], waiting: list[int]) -> Finding:
    """``side`` did not make the call the majority is in, because the majority's rank test left it out."""
    ranks = sorted(p.rank for p in side)
    call = majority[0].issued
    site = ctx.user_site(majority[0].rank, call)
    branch = ctx.branch(majority[0].rank, call)
    mine = side[0].issued
    mine_site = ctx.user_site(side[0].rank, mine)
    maj_ranks = sorted(p.rank for p in majority)
    fields, _ = ctx.waiting(maj_ranks)
    summary = skipped_summary(ranks, call, site, maj_ranks, branch, mine, mine_site, ctx.fmt)
    return Finding(
        kind=Kind.RANK_CONDITIONAL, severity=STALL, ranks=ranks, summary=summary,
        op=call.op, group=call.group, seq=call.seq, site=ctx.site(site),
        details={"pattern": "skipped_call", "conditional_line": branch,
                 "culprit_position": {"op": mine.op, "group": mine.group, "seq": mine.seq, "site": ctx.site(mine_site)},
                 "skipped_by": ranks},
        **fields,
    )


def _order_swap(ctx: Context, group: str, sides: list[list[Position]]) -> tuple | None:
    """Two sides each in a call the other side made earlier in this group (same lines, other order)."""
    if len(sides) != 2 or any(side[0].issued.op == CPP_OP for side in sides):
        return None
    a, b = sides
    key_a, key_b = site_key(ctx.user_site(a[0].rank, a[0].issued)), site_key(ctx.user_site(b[0].rank, b[0].issued))
    if key_a == key_b:
        return None  # one line (a library's entry point, trainer.fit) issues both: its history says nothing of order

    def history(rank: int) -> set:
        g = ctx.by_rank[rank].groups.get(group)
        return {site_key(ctx.user_site(rank, c)) for c in (g.recent if g else []) if c.t_exit}

    if key_b in history(a[0].rank) and key_a in history(b[0].rank):
        return (a, b)
    return None


def _swapped(
    ctx: Context, group: str, seq: int, swap: tuple, sides: list[list[Position]], waiting: list[int],
) -> Finding:
    minority, majority = swap
    branch = ctx.branch(minority[0].rank, minority[0].issued)
    ranks = sorted(p.rank for p in minority)
    others = sorted(p.rank for p in majority)
    site_m = ctx.user_site(minority[0].rank, minority[0].issued)
    site_o = ctx.user_site(majority[0].rank, majority[0].issued)
    fields, _ = ctx.waiting(others)
    summary = order_swap_summary(group, seq, ranks, ctx.presence(ranks), minority[0].issued, site_m, others,
                                 ctx.presence(others), majority[0].issued, site_o, branch, ctx.fmt)
    return Finding(
        kind=Kind.DESYNC, severity=STALL, ranks=ranks, summary=summary,
        op=minority[0].issued.op, group=group, seq=seq, site=ctx.site(site_m),
        details={"pattern": "order_swap", "other_site": ctx.site(site_o), "conditional_line": branch}, **fields,
    )


def conditional(ctx: Context, side: list[Position], others_pos: list[Position], waiting: list[int],
                 note: str | None = None, others_known: bool = True) -> Finding:
    """A collective only some ranks call (``side``) at a point where the others are in another call."""
    call = side[0].issued
    ranks = sorted(p.rank for p in side)
    others = sorted({p.rank for p in others_pos}
                    | {r for r, p in ctx.pos.items() if r not in ranks and p.state != "gone"})
    fields, waiting_txt = ctx.waiting(others)
    branch = ctx.branch(side[0].rank, call)
    site = ctx.user_site(side[0].rank, call)
    details: dict = {"conditional_line": branch, "pattern": "extra_call"}
    members = ctx.members(side[0].rank, call.group)
    if len(members) < len(ctx.by_rank):
        details["subgroup_members"] = members
    details["skipped_by"] = sorted(set(members) - set(ranks))
    if call.site and site and site_key(call.site) != site_key(site):
        details["library_site"] = ctx.site(call.site)
    decided = branch is not None or len(side) < len(others_pos)
    other_ranks = sorted(p.rank for p in others_pos)
    other = others_pos[0] if others_pos else None
    summary = extra_call_summary(
        ranks, ctx.presence(ranks), call, site, call.site if "library_site" in details else None, branch,
        others=ctx.others(other_ranks) if other else "", others_presence=ctx.presence(other_ranks) if other else "",
        other_call=other.issued if other else None,
        other_site=ctx.user_site(other.rank, other.issued) if other else None,
        skipped_by=details["skipped_by"] if others_known else None, waiting=waiting_txt, decided=decided, note=note,
        fmt=ctx.fmt)
    # Without a rank test in the user's code the ranks took different paths for another reason (data,
    # a per-rank metric): a desync, named by where they differ.
    return Finding(
        kind=Kind.RANK_CONDITIONAL if branch is not None else Kind.DESYNC, severity=STALL, ranks=ranks,
        summary=summary, op=call.op, group=call.group, seq=call.seq, site=ctx.site(site),
        details=details, **fields,
    )


# ---------------------------------------------------------------------------------------------------
# waits across groups and p2p
# ---------------------------------------------------------------------------------------------------
def _wait_cycle(ctx: Context, edges: list[tuple[Position, int]], waiting: list[int]) -> Finding:
    """Blocked ranks wait for ranks that are themselves blocked elsewhere. The deviant is the rank that
    moved past a call its peers issued; a call its peers made under a rank-conditional branch that it
    never made is the peers' extra call instead."""
    def order(edge: tuple[Position, int]) -> tuple:
        p, m = edge
        p2p = p.issued.op in P2P
        return (not p2p, len(ctx.members(p.rank, p.issued.group)), p.issued.t_enter, p.rank, m)

    p, m = sorted(edges, key=order)[0]
    call = p.issued
    site = ctx.user_site(p.rank, call)
    pm = ctx.pos.get(m)
    m_call = pm.call if pm is not None else None
    if pm is not None and m_call is not None:
        # The missing rank waits after the loop the waiter is still in: it ran fewer iterations.
        f = uneven(ctx, [m], [r for r in waiting if r != m], positions_known=True, inside=[p], side=[pm])
        if f:
            return f
        # It waits for no rank dtwatch sees: it is not the deviant (it has not reached the call yet).
        f = _waits_behind(ctx, call, sorted({q.rank for q, mm in edges if mm == m}), m, m_call, waiting)
        if f:
            return f
    g = ctx.by_rank[m].groups.get(call.group)
    made_before = site is not None and g is not None and any(
        site_key(ctx.user_site(m, c)) == site_key(site) for c in g.recent)
    branch = ctx.branch(p.rank, call)
    waiters = sorted({q.rank for q, mm in edges if mm == m and q.issued.group == call.group})
    members = ctx.members(p.rank, call.group)
    absent = [r for r in members if r not in waiters and r != p.rank]
    issued_by = len(set(waiters) | {p.rank})
    if call.op not in P2P and not made_before and m_call is not None and (
            issued_by < len(absent) or (issued_by == len(absent) and branch is not None)):
        # Fewer members made the call than did not (or as many, and theirs is under a rank test):
        # the waiters made an extra call.
        side = [ctx.pos[r] for r in waiters]
        return conditional(ctx, side, [], waiting)
    if call.op in P2P:
        # The line of the matching call in the culprit's own history: the call it skipped this time.
        g_m = ctx.by_rank[m].groups.get(call.group)
        expected_ops = ("send", "isend") if call.op in ("recv", "irecv") else ("recv", "irecv")
        mine = [c for c in (g_m.recent if g_m else []) if c.op in expected_ops
                and c.peer in (p.rank, -1)]
        if mine:
            made_before = True
            site = ctx.user_site(m, mine[-1])
            branch = ctx.branch(m, mine[-1]) or branch
    m_site = ctx.user_site(m, m_call)
    expected = MATCHING_P2P.get(call.op, call.op)
    its_missing = ctx.missing(m, m_call) if m_call is not None else []
    summary = skipped_wait_summary(m, call, expected, call.op in P2P, waiters, site, made_before, m_call, m_site,
                                   its_missing, ctx.fmt)
    fields, _ = ctx.waiting(r for r in waiting if r != m)
    return Finding(
        kind=Kind.RANK_CONDITIONAL, severity=STALL, ranks=[m], summary=summary,
        op=expected if call.op in P2P else call.op, group=call.group, seq=call.seq, site=ctx.site(site),
        details={"pattern": "skipped_call", "skipped_call_site": ctx.site(site), "conditional_line": branch,
                 "culprit_position": {"op": m_call.op, "group": m_call.group, "seq": m_call.seq,
                                      "site": ctx.site(m_site)} if m_call else None,
                 "made_before": made_before, "waiting_in": describe(call),
                 "subgroup_members": ctx.members(p.rank, call.group)},
        **fields,
    )
