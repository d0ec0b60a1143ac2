"""Silent desyncs: ranks whose calls at one sequence number differ, caught while the job still runs.

A collective that one rank issues in addition to the others does not always hang. If the others' next
collective of the group has the same shape, the two pair up and complete. Gradients or metrics are then
mixed across calls, sometimes for minutes, until something hangs or crashes far from the cause.
torch's DETAIL mode checks the op type and shapes; it does not check that the ranks issued sequence
number N from the same place. The watchdog runs :func:`silent_desyncs` on every poll, not only on a
stall.

For each group, at each sequence number that every member has issued and completed, each rank's call
gets a signature:

* a call issued from Python: the op, the shape where it must match (:data:`~dtwatch.ops.SAME_SHAPE_OPS`),
  the user's line, and the step counter;
* a call issued from C++ (DDP's reducer): the group's C++ counter covers the number, and no Python record
  does.

The first number where the signatures disagree in one of these ways is reported once, as a ``desync``
warning (a shape difference as ``mismatch``):

* a Python-issued call on some ranks and a C++-issued one on the others: an extra (or skipped) Python
  collective paired with DDP's gradient all-reduce;
* different ops, or different shapes for an op whose shapes must match;
* the same op and shape from different lines, *at different steps*, once every rank has gone on to a
  later step. That is a shift: one rank is a call ahead or behind, and every later pairing is off by
  one. A rank whose step counter stopped is not a call ahead. torch's ``Join`` does this: a rank that
  ran out of data shadows the others' collectives from its join hook.

Not reported: point-to-point numbers (a send pairs with a recv); the same op and shape from different
lines at the same step (``if rank == 0: broadcast(t, 0) else: broadcast(t, 0)``, torch's ``Join``
shadowing); and numbers a rank is still in (the stall diagnosis owns those). The deviant is the smaller
side. With two equal sides, a Python call facing C++-issued ones is the deviant; otherwise both sides are
named, and the finding says that which one deviates is not known.
"""
from __future__ import annotations

from collections import Counter

from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.model import WARNING, Finding, Kind
from dtwatch.diagnose.order import group_parting, parting_finding
from dtwatch.diagnose.rank_state import CPP_OP, Call, RankState
from dtwatch.diagnose.wording.phrases import fmt_site, silent_desync_summary, with_source
from dtwatch.ops import P2P_NAMES, SAME_SHAPE_OPS
from dtwatch.ring.layout import MAX_SEQ_SPAN

CPP = "cpp"
_SKIP = "skip"


def _signature(s: RankState, group: str, seq: int, by_seq: dict[int, Call]) -> tuple | str | None:
    call = by_seq.get(seq)
    g = s.groups[group]
    if call is None:
        # No Python record at this number: C++-issued if torch's counter covers it and the ring's history
        # does (a number older than the oldest record kept is unknown, not C++).
        oldest = min(by_seq, default=None)
        if seq <= g.cpp_seq and (g.complete or (oldest is not None and seq > oldest)):
            return CPP
        return None
    if call.op in P2P_NAMES:
        return _SKIP
    shape = call.fingerprint if call.op in SAME_SHAPE_OPS else ""
    return (call.op, shape, call.user_site_key, call.step)


def _covering(calls: list[Call]) -> dict[int, Call]:
    out: dict[int, Call] = {}
    for c in calls:
        for seq in range(c.seq, c.seq + min(max(c.span, 1), MAX_SEQ_SPAN)):  # a garbled span costs nothing
            out[seq] = c
    return out


def _differ(a: tuple | str, b: tuple | str) -> str | None:
    """How two signatures at one number disagree (a pattern name), or None where they may legitimately differ."""
    if a == b:
        return None
    if isinstance(a, str) or isinstance(b, str):  # one side issued from C++ (CPP)
        return "python_vs_cpp"
    op_a, shape_a, line_a, step_a = a
    op_b, shape_b, line_b, step_b = b
    if op_a != op_b:
        return "op_mismatch"
    if shape_a != shape_b:
        return "shape_mismatch"
    if line_a != line_b and step_a != step_b and step_a >= 0 and step_b >= 0:
        return "shifted"
    return None


def _both_sides_step_on(sigs: dict, calls: dict, seq: int) -> bool:
    """Whether every rank issued a later call of the group at a higher step than its call at ``seq``."""
    for rank in sigs:
        here = calls[rank][seq].step
        later = [c.step for q, c in calls[rank].items() if q > seq]
        if not later or max(later) <= here:
            return False
    return True


def silent_desyncs(states: list[RankState], now: float, reported: set | None = None,
                   evidence: Evidence | None = None) -> list[Finding]:
    """The first silent divergence of each group (see the module doc); ``reported``: (group, seq) keys
    already reported, skipped and extended. ``evidence`` breaks ties between two equal sides: the side
    whose line runs under a rank test (``if rank == 0``) deviates."""
    reported = reported if reported is not None else set()
    live = [s for s in states if not s.gone]
    if len(live) < 2:
        return []
    found: list[Finding] = []
    for group in sorted({name for s in live for name in s.groups}):
        members = [s for s in live if group in s.groups]
        expected = members[0].groups[group].members
        if len(members) < 2 or (expected and len(members) < len(expected)):
            continue  # not every member is seen: no majority to compare with
        if any(k[0] == group for k in reported):
            continue  # one report per group: later numbers only repeat the first divergence
        calls = {s.rank: _covering(s.groups[group].recent) for s in members}
        # Numbers every member issued and completed.
        hi = min(s.groups[group].completed for s in members)
        lo = max((min(c) for c in calls.values() if c), default=hi + 1)
        differ = False  # some completed number paired different calls (a parting must pair such calls)
        for seq in range(lo, hi + 1):
            sigs = {s.rank: _signature(s, group, seq, calls[s.rank]) for s in members}
            if any(v is None or v == _SKIP for v in sigs.values()):
                continue
            counts: Counter[tuple | str] = Counter(v for v in sigs.values() if v is not None)
            if len(counts) == 1:
                continue
            differ = True
            (common, _), (other, _) = counts.most_common(2)
            pattern = _differ(common, other)
            if pattern is None:
                continue
            if pattern == "shifted" and not _both_sides_step_on(sigs, calls, seq):
                # A side whose step counter stopped is not a call ahead: torch's Join shadows the others'
                # collectives from a rank that ran out of data. Decided once both sides step again.
                break
            finding = _finding(group, seq, sigs, calls, counts, pattern, now, evidence)
            reported.add((group, seq))
            found.append(finding)
            break
        else:
            parted = _parted(members, group, now, evidence) if differ else None
            if parted is not None:
                reported.add((group, parted.seq))
                found.append(parted)
    return found


def _parted(members: list[RankState], group: str, now: float, evidence: Evidence | None) -> Finding | None:
    """Program order (:mod:`.align`): an extra or skipped call after which the ranks' streams pair again, while
    the job runs. A running rank's stream may still grow, so only what its later calls already show counts."""
    ev = evidence or Evidence()
    p = group_parting(members, group, lambda s: s.gone, ev)
    if p is None:
        return None
    return parting_finding(p, ev, severity=WARNING, now=now, fmt=lambda site: fmt_site(with_source(site, ev), ev),
                           site_of=lambda site: with_source(site, ev))


def _under_rank_test(sig: tuple | str, evidence: Evidence | None) -> bool:
    if evidence is None or not isinstance(sig, tuple) or sig[2] is None:
        return False
    path, line = sig[2]
    return evidence.rank_branch(path, line) is not None


def _finding(group: str, seq: int, sigs: dict, calls: dict, counts: Counter, pattern: str, now: float,
             evidence: Evidence | None) -> Finding:
    ranked = counts.most_common()
    top, second = ranked[0][1], ranked[1][1]
    if top > second:
        majority_sig = ranked[0][0]
        deviant = sorted(r for r, v in sigs.items() if v != majority_sig)
        known = True
    elif CPP in (ranked[0][0], ranked[1][0]) and len(ranked) == 2:
        majority_sig = CPP
        deviant = sorted(r for r, v in sigs.items() if v != CPP)
        known = True
    elif len(ranked) == 2 and _under_rank_test(ranked[0][0], evidence) != _under_rank_test(ranked[1][0], evidence):
        majority_sig = ranked[1][0] if _under_rank_test(ranked[0][0], evidence) else ranked[0][0]
        deviant = sorted(r for r, v in sigs.items() if v != majority_sig)
        known = True
    else:
        majority_sig = ranked[0][0]
        deviant = sorted(r for r, v in sigs.items() if v != majority_sig)
        known = False
    others = sorted(r for r in sigs if r not in deviant)
    d_call = calls[deviant[0]].get(seq)
    o_call = calls[others[0]].get(seq)
    kind = Kind.MISMATCH if pattern == "shape_mismatch" else Kind.DESYNC
    site = (d_call.user_site or d_call.site) if d_call is not None else None
    other_site = (o_call.user_site or o_call.site) if o_call is not None else None
    return Finding(
        kind=kind, severity=WARNING, ranks=deviant if known else sorted(sigs),
        summary=silent_desync_summary(group, seq, deviant, d_call, others, o_call, pattern, known,
                                      evidence.display_path if evidence is not None else str),
        op=d_call.op if d_call is not None else CPP_OP, group=group, seq=seq, site=site,
        waiting_ranks=others, waiting_op=o_call.op if o_call is not None else CPP_OP, waiting_group=group,
        waiting_seq=seq, waiting_site=other_site, onset=min(
            [c.t_enter for c in (d_call, o_call) if c is not None] or [now]), detected=now,
        details={"pattern": pattern, "silent": True, "deviant_known": known,
                 "steps": {str(r): (calls[r][seq].step if seq in calls[r] else None) for r in sorted(sigs)}},
    )
