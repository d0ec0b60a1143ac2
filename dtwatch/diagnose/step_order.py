"""Program order by optimizer step: the ranks issued a different number of calls of a group in the same step.

The alignment (:mod:`.align`) cannot see one kind of parting. A rank that makes one extra call every step (an
evaluation forward under ``if rank == 0`` whose all-reduce has the training forward's shape) pairs its extra
calls with its peers' next training calls, step after step: shifted by one, the two streams pair call for call
at the cost of a line standing in for another, and no single call is left over. The step counter the ranks
record with every call (their optimizer steps, or ``dtwatch.step()``) tells the programs apart: every rank runs
the same steps, and in a step every rank has finished, each issued its own calls, whatever the backend paired.

The rule speaks only where the records leave no doubt:

* the step is finished on every member (its counter is past it) and its first call is still in the records
  of every member (the history reaches back before it, or to the group's first call);
* each rank's calls of that step are all recorded from Python with a step (no number issued from C++ without
  a record inside it);
* the ranks fall in two classes by the number of calls they made in that step, and every call one class made
  beyond the other's is a call (op, shape, line) the other class made nowhere in its records: a call only
  some ranks make. A difference the other side could have made too (a racing thread, a skipped iteration
  of the same loop) stays unsaid.

torch's ``Join`` shadows its peers' calls from a rank that stopped stepping: those calls are in its last
step, which it never finishes, and are never compared. Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Callable

from dtwatch.diagnose.align import Parting, Token, align, count_calls


def _by_step(tokens: list[Token]) -> tuple[dict[int, list[Token]], set[int]] | None:
    """A rank's recorded calls by the step they were issued in, and the steps whose calls are not all known (a
    number without a record or a step inside them). None where the steps do not rise with the numbers."""
    steps: dict[int, list[Token]] = {}
    unknown: set[int] = set()
    last = -1
    blind = False  # a call without a step was seen since the last call with one
    for t in tokens:
        step = t.call.step if t.call is not None else -1
        if step < 0:
            blind = True
            if last >= 0:
                unknown.add(last)
            continue
        if step < last:
            return None  # calls from threads that race the step counter: the step says nothing here
        if blind:
            unknown.add(step)
            blind = False
        steps.setdefault(step, []).append(t)
        last = step
    return steps, unknown


def step_parting(group: str, streams: dict[int, list[Token]], steps_now: dict[int, int], *,
                 under_rank_test: Callable[[int, Token], bool] = lambda r, t: False) -> Parting | None:
    """The first finished step in which the members of ``group`` issued a different number of calls, one side
    making calls the other never made (see the module doc); ``steps_now``: each rank's step counter now."""
    by_rank: dict[int, dict[int, list[Token]]] = {}
    comparable: set[int] | None = None
    for r, ts in streams.items():
        split = _by_step(ts)
        if not ts or split is None or r not in steps_now:
            return None
        steps, unknown = split
        reaches_back = ts[0].seq == 1
        lowest = min(steps, default=0)
        known = {k for k in steps if k < steps_now[r] and k not in unknown and (k > lowest or reaches_back)}
        by_rank[r] = steps
        comparable = known if comparable is None else comparable & known
    for k in sorted(comparable or ()):
        counts = {r: len(steps[k]) for r, steps in by_rank.items()}
        if len(set(counts.values())) != 2:
            continue  # the same everywhere, or more than two ways: not this rule's to tell
        more_n = max(counts.values())
        more = sorted(r for r, n in counts.items() if n == more_n)
        fewer = sorted(r for r, n in counts.items() if n != more_n)
        a, b = by_rank[more[0]][k], by_rank[fewer[0]][k]
        if any([t.key for t in by_rank[r][k]] != [t.key for t in a] for r in more) or \
                any([t.key for t in by_rank[r][k]] != [t.key for t in b] for r in fewer):
            continue  # the ranks of one side differ among themselves
        elsewhere = {t.key for r in fewer for t in streams[r]}
        _, steps_ab = align(a, b, a_final=True, b_final=True)
        extra = [a[st.i] for st in steps_ab if st.kind == "only_a"]
        if len(extra) != more_n - counts[fewer[0]] or any(st.kind == "only_b" for st in steps_ab) or \
                any(t.key in elsewhere or t.cpp for t in extra):
            continue  # the extra calls are not ones only that side makes
        tie = len(more) == len(fewer)
        if len(more) < len(fewer) or tie:
            side, reference = more, fewer
            decided = not tie or any(under_rank_test(side[0], t) for t in extra)
        else:
            # The many made calls the few never made: the few skipped them.
            side, reference = fewer, more
            decided = True
        at = extra[0].seq
        paired = {q: t for q in (reference if side == more else side) for t in streams[q] if t.seq == at}
        return Parting(group=group, ranks=side, reference=reference, extra=side == more, calls=extra,
                       paired_with=paired, decided=decided,
                       counts=[{"ranks": more, "calls": count_calls(a)}, {"ranks": fewer, "calls": count_calls(b)}],
                       step=k, step_calls={str(r): n for r, n in sorted(counts.items())})
    return None
