"""The words of the findings about ranks that all issued something (:mod:`dtwatch.diagnose.compare`): desyncs
(calls in another order, a point-to-point schedule deadlock, ranks that went on out of step), extra or skipped
rank-conditional calls, and collectives that are not completing, from the facts the decisions hand over.
``fmt`` shows a site with its source line; ``waiting`` is the phrase for who waits where; ``presence`` phrases
(``is in``, ``are in``, ``issued``, ``made``) say how ranks relate to the call they are shown in.
"""
from __future__ import annotations

from collections.abc import Callable

from dtwatch.diagnose.model import Position
from dtwatch.diagnose.rank_state import Call
from dtwatch.diagnose.wording.phrases import describe, fmt_ranks, op_name, sentence, verb

Fmt = Callable[[dict | None], str]

# Every member joined a call that does not complete: what holds it is outside the ranks' records.
_HOLD_UNKNOWN = ("what holds it (the network, the transport, the backend, or a peer outside this job) is not in the "
                 "ranks' records")


def out_of_step_summary(summary: str, waiting: str) -> str:
    """An earlier split (``summary``, worded as of that moment) whose calls completed, and who waits now."""
    return sentence(summary, "those calls were paired with each other and completed, so the ranks went on out of step",
                    f"now {waiting}" if waiting else "")


def never_seen_phrase(unseen: list[int], damaged: list[int], world: int, from_dumps: bool,
                      in_view_sample: bool) -> str:
    """Why there is no state of some members, and what that leaves unknown: ``damaged``, ranks whose dump or ring
    could not be read (``from_dumps``: the ranks are known from dumps alone); ``unseen``, the other ones, outside
    this node's view of a large job (``in_view_sample``), with no dump, or never seen."""
    parts = []
    if damaged:
        it = "it" if len(damaged) == 1 else "they"
        what = "a dump" if from_dumps else "a ring"
        parts.append(f"{fmt_ranks(damaged)} wrote {what if len(damaged) == 1 else what[2:] + 's'} that could not be "
                     f"read (damaged: see the damaged inputs), so whether {it} issued this call is not known")
    if not unseen:
        return "; ".join(parts)
    pronoun = "it" if len(unseen) == 1 else "they"
    if in_view_sample:
        parts.append(f"{fmt_ranks(unseen)} of the job (world size {world}) {verb(unseen, 'is', 'are')} not in this "
                     "node's view (a job this large exchanges only the ranks that stand out and a sample of the "
                     f"others), so whether {pronoun} issued this call is not known here")
    elif from_dumps:
        parts.append(f"{fmt_ranks(unseen)} of the job (world size {world}) left no Flight Recorder dump (a crash or a "
                     "kill before the others dumped, or a dump that was not written or not collected), so whether "
                     f"{pronoun} issued this call is not known")
    else:
        parts.append(f"{fmt_ranks(unseen)} of the job (world size {world}) {verb(unseen, 'was', 'were')} never seen: "
                     "no ring (started without dtwatch, or on a node whose watchdog this one cannot reach), so "
                     f"whether {pronoun} issued this call is not known")
    return "; ".join(parts)


def stalled_summary(call: Call, site: dict | None, seen: list[int], presence: str, unseen: list[int], no_dump: bool,
                    never_seen: str, fmt: Fmt) -> str:
    """Every rank seen is in ``call``: ``seen``, the ranks with a state (``presence``: how they relate to the call);
    ``unseen``, the members with none (``never_seen`` says why); ``no_dump``: they are the members with no dump,
    which the others wait for."""
    if no_dump:
        return sentence(
            f"{fmt_ranks(seen)} (every rank that left a dump) {presence} {describe(call)} at {fmt(site)}, "
            "not completed",
            never_seen,
            f"{verb(unseen, 'it is', 'they are')} the only member{'' if len(unseen) == 1 else 's'} of group "
            f"{call.group} not shown in that call, so the others wait for {verb(unseen, 'it', 'them')}, "
            "unless the collective itself is not completing")
    if unseen:
        return sentence(f"{fmt_ranks(seen)} (every rank dtwatch sees) {verb(seen, 'is', 'are')} inside "
                        f"{describe(call)} at {fmt(site)}", never_seen)
    return sentence(f"all ranks are inside {describe(call)} at {fmt(site)} and none is missing",
                    f"the collective itself is not completing; {_HOLD_UNKNOWN}")


def waits_behind_summary(waiters: list[int], call: Call, site: dict | None, absent: list[int], inner: list[int],
                         m_call: Call, m_site: dict | None, unseen: list[int], from_dumps: bool, never_seen: str,
                         fmt: Fmt) -> str:
    """``waiters`` wait in ``call`` for ``absent``; ``inner``, those of them inside ``m_call`` (at least one), where
    no rank with a state is missing: ``unseen`` members have none (``never_seen`` says why), or the call is not
    completing. Absent ranks elsewhere are not placed: only those inside ``m_call`` are said to be there."""
    where = f"inside {describe(m_call)} at {fmt(m_site)}"
    head = f"{fmt_ranks(waiters)} {verb(waiters, 'waits', 'wait')} in {describe(call)} at {fmt(site)} for " + (
        f"{fmt_ranks(absent)}, which {verb(absent, 'is', 'are')} {where}" if inner == absent else
        f"{fmt_ranks(absent)}; {fmt_ranks(inner)} {verb(inner, 'is', 'are')} {where}")
    if unseen:
        seen = "with a dump" if from_dumps else "dtwatch sees"
        return sentence(head, f"every member of that call {seen} has joined it; {never_seen}",
                        "the rank that holds the job up is among them, or the call itself is not completing")
    return sentence(head, f"every member of group {m_call.group} has joined that call and none is missing",
                    "that collective itself is not completing, and the others wait behind it", _HOLD_UNKNOWN)


def p2p_deadlock_summary(cycle: list[Position], sites: list[dict | None], one_way: bool, matching: str,
                         tested: int | None, branch: dict | None, roles: dict[int, tuple[int, int, str, str]],
                         waiting: str, fmt: Fmt) -> str:
    """Ranks each in a send or recv (``cycle``, their lines ``sites``) only the next one could match. ``one_way``:
    all in recv or all in send, whose call is matched only by a ``matching`` one; ``tested``: the one rank whose
    call is under the rank test ``branch``; ``roles``: rank -> (a rank talking to its peers the same way, the
    index of the first point-to-point call where they differ, what each made there)."""
    ranks = [p.rank for p in cycle]

    def peer_of(p: Position) -> str:
        return f"{'from' if p.issued.op in ('recv', 'irecv') else 'to'} rank {p.issued.peer}"
    each = "; ".join(f"rank {p.rank} is in {p.issued.op} {peer_of(p)} at {fmt(site)}"
                     for p, site in zip(cycle, sites, strict=True))
    why = (f"a {cycle[0].issued.op} is matched only by a {matching}, so none of them can proceed" if one_way
           else "each waits for a call the next one has not posted")
    names = " and ".join(f"rank {r}" for r in ranks) if len(ranks) == 2 else fmt_ranks(ranks)
    parts = [f"schedule deadlock between {names}: {each}", why,
             "the ranks' point-to-point order disagrees: the program's schedule is at fault (a pipeline whose "
             "warm-up count or send/recv order differs between the ranks)"]
    if tested is not None:
        parts.append(f"rank {tested}'s call is reached through the rank test {fmt(branch)}")
    for r, (q, index, mine, theirs) in sorted(roles.items()):
        parts.append(f"rank {r}'s point-to-point order differs from that of rank {q}, which talks to its peer the "
                     f"same way (the same position in another pipeline or group): at its point-to-point call "
                     f"{index + 1}, rank {r} made a {mine} where rank {q} made a {theirs}")
    if waiting:
        parts.append(waiting)
    return sentence(*parts)


def order_swap_summary(group: str, seq: int, ranks: list[int], presence: str, call: Call, site: dict | None,
                       others: list[int], others_presence: str, other_call: Call, other_site: dict | None,
                       branch: dict | None, fmt: Fmt) -> str:
    """``ranks`` are in ``call`` and ``others`` in ``other_call`` at one point, each a call the other side made
    earlier; ``branch``: the branch that decides the order on ``ranks``."""
    return sentence(
        f"{fmt_ranks(ranks)} and {fmt_ranks(others)} issue the same collectives of group {group} in a different order: "
        f"at seq {seq}, {fmt_ranks(ranks)} {presence} {op_name(call)} at {fmt(site)}, "
        f"while {fmt_ranks(others)} {others_presence} {op_name(other_call)} at {fmt(other_site)}; "
        "both lines ran on every rank earlier",
        f"the branch {fmt(branch)} decides the order on {fmt_ranks(ranks)}" if branch else "",
    )


def skipped_summary(ranks: list[int], call: Call, site: dict | None, callers: list[int], branch: dict | None,
                    mine: Call, mine_site: dict | None, fmt: Fmt) -> str:
    """``ranks`` did not make ``call`` that ``callers`` wait in, under the rank test ``branch``, and are in
    ``mine`` instead."""
    return sentence(
        f"{fmt_ranks(ranks)} did not call {describe(call)} that {fmt_ranks(callers)} "
        f"{verb(callers, 'waits', 'wait')} in at {fmt(site)}",
        f"that call is under the rank test {fmt(branch)}",
        f"{fmt_ranks(ranks)} went on to {describe(mine)} at {fmt(mine_site)}",
    )


def extra_call_summary(ranks: list[int], presence: str, call: Call, site: dict | None, through: dict | None,
                       branch: dict | None, *, others: str, others_presence: str, other_call: Call | None,
                       other_site: dict | None, skipped_by: list[int] | None, waiting: str, decided: bool,
                       note: str | None, fmt: Fmt) -> str:
    """A collective only ``ranks`` make. ``through``: the library line it was issued at, where not the user's;
    ``branch``: the rank-conditional branch it is reached through; ``others`` (the ranks phrase), their
    ``others_presence`` and ``other_call`` at ``other_site``: the other side at the same point, where it is in
    one (then ``waiting`` is not told); else ``skipped_by``: the members that did not call it, where known.
    ``decided``: which side deviates is known; ``note``: a last phrase of the caller's."""
    parts = [f"{fmt_ranks(ranks)} {presence} {describe(call)} at {fmt(site)}"
             + (f" (through {fmt(through)})" if through is not None else "")]
    if branch is not None:
        parts.append(f"it is reached through the rank-conditional branch {fmt(branch)}")
    if other_call is not None:
        parts.append(f"at the same point {others} {others_presence} {describe(other_call)} at {fmt(other_site)}")
    elif skipped_by is not None:
        parts.append(f"{fmt_ranks(skipped_by)} of group {call.group} did not call it")
    if waiting and other_call is None:
        parts.append(waiting)
    if not decided:
        parts.append("the two sides are the same size and no rank-conditional branch was found, so which side "
                     "deviates is not known")
    if note:
        parts.append(note)
    return sentence(*parts)


def skipped_wait_summary(rank: int, call: Call, expected: str, p2p: bool, waiters: list[int], site: dict | None,
                         made_before: bool, went_on: Call | None, went_on_site: dict | None, its_missing: list[int],
                         fmt: Fmt) -> str:
    """``rank`` did not issue ``call`` (the ``expected`` op matching it, for a ``p2p`` call) that ``waiters`` wait
    in; ``site``: the waiters' line, or for p2p where ``made_before`` the rank's own line of the matching call.
    ``went_on``: the call it is in now at ``went_on_site``, where it waits for ``its_missing``."""
    parts = [
        f"rank {rank} did not issue {'the ' + expected + ' matching the ' + call.op if p2p else call.op} "
        f"(group {call.group}, seq {call.seq}) that {fmt_ranks(waiters)} {verb(waiters, 'waits', 'wait')} in"
        + (f"; rank {rank} makes it at {fmt(site)}" if p2p and made_before else f" at {fmt(site)}"),
    ]
    if made_before:
        parts.append(f"rank {rank} made that call at the same line earlier, so it skipped it this time")
    if went_on is not None:
        parts.append(f"rank {rank} went on to {describe(went_on)} at {fmt(went_on_site)}"
                     + (f", where it waits for {fmt_ranks(its_missing)}" if its_missing else ""))
    if not made_before:
        parts.append(f"rank {rank} either skipped the call or makes it later in a different order")
    return sentence(*parts)
