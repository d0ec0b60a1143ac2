"""The words of the uneven-iterations findings (:mod:`dtwatch.diagnose.loops`): ranks that left a loop the others
are still in, ranks past a loop in their Flight Recorder dumps, and ranks that issued fewer collectives over the
same steps, from the facts the decisions hand over. ``fmt`` shows a site with its source line; ``waits`` is the
verb for the ranks it goes with (``waits``/``wait``, ``waited`` once they ended). Nothing here decides.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from dtwatch.diagnose.rank_state import Call
from dtwatch.diagnose.wording.phrases import describe, fmt_ranks, sentence, verb

Fmt = Callable[[dict | None], str]


def left_loop_summary(culprits: list[int], *, waits: str | None, call: Call | None, post_loop_site: dict | None,
                      ended_how: str | None, outside_site: dict | None, loop_site: dict | None,
                      inside_site: dict | None, inside_ranks: list[int], inside_known: bool,
                      inside_call: Call | None, exited: bool, waiting: str, loader_site: dict | None,
                      loader_lengths: dict | None, steps: dict[int, int] | None,
                      exits: Sequence[tuple[int, str]], branch: dict | None, fmt: Fmt) -> str:
    """``culprits`` left the loop early. Where they are now: waiting (``waits``) after the loop in ``call`` at
    ``post_loop_site``; else ended (``ended_how``, how the first ended); else at ``outside_site``, in no collective.
    ``loop_site`` (None: no loop found), with ``inside_ranks`` still in it at ``inside_site`` (in ``inside_call``
    where their positions are known, ``inside_known``; ``exited``: they ended since), else ``waiting``, who waits
    where. The evidence: a DataLoader at ``loader_site`` with per-rank ``loader_lengths`` (None: none), else the
    optimizer ``steps`` per rank (None: not shown), else the loop's early ``exits`` (line, text), the first under
    the rank test ``branch``."""
    if waits is not None:
        where = f"{waits} in {describe(call)} at {fmt(post_loop_site)}"
    elif ended_how is not None:
        where = f"then {ended_how}"
    else:
        where = f"{verb(culprits, 'is', 'are')} outside any collective, at {fmt(outside_site)}"
    parts = [f"{fmt_ranks(culprits)} left the loop earlier than the others and {where}"]
    if loop_site is not None:
        in_call = f"in {describe(inside_call)} " if inside_known else ""
        tense = verb(inside_ranks, "is", "are") if not exited else verb(inside_ranks, "was", "were")
        parts.append(f"{fmt_ranks(inside_ranks)} {tense} still inside the loop at "
                     f"{fmt(loop_site)}, {in_call}at {fmt(inside_site)}")
    elif waiting:
        parts.append(waiting)
    if loader_lengths is not None:
        parts.append(f"the DataLoader iterated at {fmt(loader_site)} has different lengths per rank: "
                     + ", ".join(f"rank {r}: {n}" for r, n in loader_lengths.items()))
    elif steps is not None:
        parts.append("steps so far: " + ", ".join(f"rank {r}: {n}" for r, n in sorted(steps.items())))
    if loader_lengths is None and exits:
        parts.append("the loop can be left early at " + ", ".join(f"line {ln} `{text}`" for ln, text in exits[:3]))
        if branch:
            parts.append(f"the first is under the rank test {fmt(branch)}")
    return sentence(*parts)


def past_the_loop_summary(past: list[int], within: list[int], *, loop_site: dict | None, call: Call,
                          post_loop_site: dict | None, inside_call: Call, inside_site: dict | None,
                          calls_at_line: dict[int, int] | None, deviant: list[int] | None, fmt: Fmt) -> str:
    """Ranks known from their dumps alone: ``past`` in ``call`` at ``post_loop_site``, after the loop at
    ``loop_site``, and ``within`` it in ``inside_call`` at ``inside_site``; ``calls_at_line``: how many calls each
    rank issued at that line (None: the records do not go back far enough); ``deviant``: the minority side (None:
    the sides are the same size)."""
    parts = [f"{fmt_ranks(past)} {verb(past, 'is', 'are')} past the loop at {fmt(loop_site)}, "
             f"in {describe(call)} at {fmt(post_loop_site)}, while {fmt_ranks(within)} "
             f"{verb(within, 'is', 'are')} still inside it, in {describe(inside_call)} at {fmt(inside_site)}"]
    if calls_at_line is not None:
        by_count: dict[int, list[int]] = {}
        for r, n in calls_at_line.items():
            by_count.setdefault(n, []).append(r)
        times = ", ".join(f"{n} time{'s' if n != 1 else ''} by {fmt_ranks(rs)}" for n, rs in sorted(by_count.items()))
        line = f"the call at line {inside_site['line']}" if inside_site and inside_site.get("line") else "that call"
        parts.append(f"{line} was issued {times}")
    parts.append(f"a dump holds no step counts, so whether the loop ran fewer times on {fmt_ranks(past)} or "
                 f"{fmt_ranks(within)} made a call in it that the others did not is not known")
    if deviant is None:
        parts.append("the two sides are the same size, so which deviates is not known")
    else:
        parts.append(f"{fmt_ranks(deviant)}, the minority, {verb(deviant, 'deviates', 'deviate')}")
    return sentence(*parts)


def fewer_calls_summary(short: list[int], more: list[int], *, group: str, call: Call, site: dict | None,
                        short_call: Call | None, short_site: dict | None, calls: dict[int, int],
                        steps: dict[int, int], ended: bool, waits_short: str, waits_more: str, certain: bool,
                        ahead: bool, steps_short: int, steps_more: int, line: dict | None, deviant_known: bool,
                        fmt: Fmt) -> str:
    """``short`` issued fewer collectives of ``group`` than ``more`` (``calls`` and optimizer ``steps`` per rank):
    ``short`` ended (``ended``) or waits (``waits_short``) in ``short_call`` at ``short_site``, after the loop,
    while ``more`` wait (``waits_more``) in ``call`` at ``site``, inside it. ``certain``: ``short`` did not stop
    early, having run as many steps as ``more`` or, ``ahead``, more (``steps_short`` against ``steps_more``).
    ``line``: the line that makes the count per iteration differ (its ``kind``: ``rank_skip``, ``skip`` or
    ``no_sync``; None: not found); ``deviant_known``: whether the calls tell which side deviates."""
    counts = ", ".join(f"rank {r}: {calls[r]} calls, {steps[r]} steps" for r in sorted(short + more))
    if ended:
        parts = [f"{fmt_ranks(short)} exited normally with fewer collectives of group {group} than "
                 f"{fmt_ranks(more)}, which {waits_more} inside the loop in {describe(call)} at "
                 f"{fmt(site)} ({counts})"]
    else:
        parts = [f"{fmt_ranks(short)} {waits_short} in {describe(short_call)} at "
                 f"{fmt(short_site)}, after the loop, while {fmt_ranks(more)} "
                 f"{waits_more} in {describe(call)} at {fmt(site)}, inside it ({counts}): "
                 f"{fmt_ranks(short)} issued fewer collectives in the loop"]
    if certain and not ahead:
        parts.append(f"{fmt_ranks(short)} did not stop early: {verb(short, 'it', 'they')} ran as many optimizer steps "
                     f"as {fmt_ranks(more)}, counting the step {fmt_ranks(more)} {verb(more, 'is', 'are')} in; the "
                     "ranks issued a different number of collectives for the same steps, so the backend paired them "
                     "out of step and the last call has no partner")
    elif certain:
        # Ahead by more than the step the others are in: their calls were paired with more of the others' calls
        # per step than they issued themselves.
        inside = verb(more, "it is", "they are")
        parts.append(f"{fmt_ranks(short)} did not stop early: {verb(short, 'it', 'they')} ran more optimizer steps "
                     f"({steps_short}) than {fmt_ranks(more)} ({steps_more}, and the step {inside} in); the ranks "
                     "issued a different number of collectives per step, so the backend paired "
                     f"them out of step and {fmt_ranks(short)} finished the loop on the others' calls")
    else:
        parts.append(f"{fmt_ranks(short)} either ran fewer iterations or issued fewer collectives in them; the "
                     "optimizer steps are the same, so the number of collectives per iteration differs by rank")
    if line is not None and line["kind"] == "rank_skip":
        parts.append(f"the rest of an iteration is skipped under a rank test at {fmt(line)}: the ranks that "
                     "take it issue fewer calls")
    elif line is not None and line["kind"] == "skip":
        parts.append(f"the loop skips the rest of an iteration at {fmt(line)}: a rank that takes it where its "
                     "peers do not (a per-rank loss or data check) issues fewer calls")
    elif line is not None:
        parts.append(f"the loop runs DDP's no_sync() at {fmt(line)}: a rank that enters it on other iterations "
                     "than its peers issues a different number of gradient all-reduces")
    else:
        parts.append("the usual causes: a rank-dependent skip before backward(), a no_sync window or accumulation "
                     "count, or a call only some ranks make (an evaluation forward under a rank test)")
    if not deviant_known:
        parts.append("which side deviates is not known from the calls alone")
    return sentence(*parts)
