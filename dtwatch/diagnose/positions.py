"""Where each rank is, and whether the job is stalled.

A rank is *blocked* when it has issued a collective that has not completed: it is inside a
synchronous Python-issued call, it issued an asynchronous one (``async_op=True``, ``isend``...) or, on
a backend whose collectives return before they complete (NCCL), a synchronous one that has not
completed (it waits for it later, at a synchronisation point), or it issued one from C++ (DDP's
reducer, FSDP) that has not completed. On such backends the rank reports what completed (a *tracked*
group, :mod:`dtwatch.record.completion`). Elsewhere a C++-issued collective counts as not completed when
it is the rank's latest operation in the group and some member has not issued that sequence number. The job
is stalled when some rank is blocked and nothing anywhere has progressed (no collective entered or left, no
step, no C++ sequence number advanced) for longer than the stall window. A quiet period where every rank is
outside collectives (eval or checkpointing on all ranks) is never a stall: nobody is blocked.
"""
from __future__ import annotations

from dataclasses import dataclass

from dtwatch.diagnose.model import Position
from dtwatch.diagnose.rank_state import CPP_OP, Call, RankState
from dtwatch.ops import P2P_NAMES


def tracked_cpp_call(s: RankState) -> Call | None:
    """On tracked groups: the oldest collective issued from C++ and not completed, if it is older than
    any Python-issued call still in flight in its group."""
    best: Call | None = None
    for g in s.groups.values():
        if not g.tracked or g.completed >= g.seq:
            continue
        first = g.completed + 1
        if any(c.group == g.name and c.seq <= first <= c.seq + max(c.span, 1) - 1 for c in s.open_calls):
            continue  # the oldest in flight is a Python-issued call: waiting_call names it
        call = Call(op=CPP_OP, group=g.name, seq=first, site=s.main_site, t_enter=g.cpp_seq_time, fingerprint=CPP_OP)
        if best is None or call.t_enter < best.t_enter:
            best = call
    return best


def cpp_blocked_call(s: RankState, by_rank: dict[int, RankState]) -> Call | None:
    """A collective issued from C++ (DDP/FSDP) that the rank must be waiting in.

    The rank's latest operation in a group was issued from C++ and cannot have completed: some member of
    the group has not issued that sequence number yet, or sits inside a different (Python) collective at
    that same number. If every member has issued it and nobody disagrees, it completed.
    """
    best: Call | None = None
    for g in s.groups.values():
        if g.tracked or g.cpp_seq == 0 or g.cpp_seq <= g.py_seq:
            continue
        peers = [by_rank[m] for m in (g.members or []) if m in by_rank and m != s.rank and g.name in by_rank[m].groups]
        behind = any(p.groups[g.name].seq < g.cpp_seq for p in peers)
        disagrees = any(c.group == g.name and c.seq == g.cpp_seq for p in peers for c in p.open_calls)
        if not (behind or disagrees):
            continue
        call = Call(op=CPP_OP, group=g.name, seq=g.cpp_seq, site=s.main_site, t_enter=g.cpp_seq_time,
                    fingerprint=CPP_OP)
        if best is None or call.t_enter > best.t_enter:
            best = call
    return best


def completed_by_peers(call: Call, s: RankState, by_rank: dict[int, RankState]) -> bool:
    """A collective still in flight in ``s``'s ring that every other member of its group completed: it
    completed here too (every member took part), and this rank could not report it yet. Its completions
    are polled, so a rank stopped or killed right after the work finished still lists it."""
    if call.op in P2P_NAMES or not (call.is_async and call.in_flight):
        return False
    g = s.groups.get(call.group)
    peers = [m for m in (g.members or []) if m != s.rank] if g is not None else []
    if not peers or any(m not in by_rank for m in peers):
        return False
    last = call.seq + max(call.span, 1) - 1
    return all((pg := by_rank[m].groups.get(call.group)) is not None and pg.completed >= last for m in peers)


def waiting_call(s: RankState, by_rank: dict[int, RankState] | None = None) -> Call | None:
    """The issued, not completed, call the rank waits on: its synchronous call if it is in one, else the
    oldest call still in flight (later ones queue behind it): asynchronous or returned before completing
    (NCCL), and on tracked groups one issued from C++."""
    sync = [c for c in s.open_calls if not c.is_async]
    if sync:
        return sync[-1]
    pending = [c for c in s.open_calls if c.is_async and not (by_rank and completed_by_peers(c, s, by_rank))]
    oldest = min(pending, key=lambda c: c.t_enter) if pending else None
    cpp = tracked_cpp_call(s)
    if cpp is not None and (oldest is None or (cpp.group == oldest.group and cpp.seq < oldest.seq)):
        return cpp
    return oldest


def positions(states: list[RankState], now: float, heartbeat_stale: float) -> dict[int, Position]:
    by_rank = {s.rank: s for s in states}
    out: dict[int, Position] = {}
    for s in states:
        if s.gone:
            out[s.rank] = Position(s.rank, "gone", s.last_call(), None)
        elif s.proc_state == "T" or (s.alive is not False and not s.from_dump  # a dump has no heartbeat
                                     and s.heartbeat_age(now) > heartbeat_stale):
            out[s.rank] = Position(s.rank, "unresponsive", waiting_call(s, by_rank), s.main_site)
        else:
            call = waiting_call(s, by_rank) or cpp_blocked_call(s, by_rank)
            out[s.rank] = Position(s.rank, "blocked" if call else "outside", call, s.main_site)
    return out


@dataclass
class StallCheck:
    stalled: bool
    last_progress: float
    blocked: list[int]
    positions: dict[int, Position]


def check_stall(states: list[RankState], now: float, window: float, heartbeat_stale: float | None = None) -> StallCheck:
    hb = heartbeat_stale if heartbeat_stale is not None else max(5.0, window / 2)
    pos = positions(states, now, hb)
    last_progress = max((s.last_activity for s in states), default=now)
    blocked = sorted(r for r, p in pos.items() if p.state == "blocked" or (p.state == "unresponsive" and p.call))
    any_live = any(p.state != "gone" for p in pos.values())
    stalled = bool(blocked) and any_live and now - last_progress > window
    return StallCheck(stalled, last_progress, blocked, pos)


def settle_completed(states: list[RankState], pos: dict[int, Position]) -> None:
    """What each rank has completed, per group, using the cross-rank view.

    A rank's own ring knows completion only for Python-issued calls. With every rank's position known,
    everything a rank issued in a group has completed, except the call it is blocked in.
    """
    for s in states:
        p = pos.get(s.rank)
        for g in s.groups.values():
            if p is not None and p.call is not None and p.call.group == g.name and p.state != "gone":
                g.completed = max(g.completed, min(g.seq, p.call.seq - 1))
            elif not any(c.group == g.name for c in s.open_calls):
                g.completed = max(g.completed, g.seq)
