"""Program order: align the ranks' call streams of one group and find the first point where they part.

The backend pairs the calls of a group by sequence number; the program meant to pair them by what
they are. Two ranks whose programs differ by one call (an extra ``all_reduce`` of a metric under
``if rank == 0``, a ``barrier`` at the end of a save only rank 0 runs, an ``async_op`` call one rank
adds) still pair call for call when the shapes agree: the job runs on, out of step, and hangs or crashes
calls later, far from the cause. Comparing the ranks at one sequence number then names the victim.

Here each rank's stream of one group is a list of :class:`Token` s, one per call, in issue order:

* a call issued from Python is identified by its op (its family: FR and dtwatch spell ops differently),
  its shape where every rank must pass the same one (:data:`~dtwatch.ops.SAME_SHAPE_OPS`) and the user's
  line;
* a number the rank's Python records do not cover was issued from C++ (DDP's reducer, FSDP): it is
  ``CPP`` (what it was is not known on every rank, so every such call is alike);
* point-to-point calls are matched with their peer, not by number: they are not in the stream.

Streams are aligned pairwise with an edit distance (:func:`align`): the same token pairs for free; the same
op and shape from another line for half an edit (``if rank == 0: broadcast(t, 0) else: broadcast(t, 0)``
pairs this way on every call, as does torch's ``Join``); a call only one side made costs one. A stream that
can still grow (the rank is running) may end anywhere: its tail is not an edit. A stream that cannot (the
rank exited, or every rank is blocked in a stall) must account for every call of the other.

The reference is the largest class of ranks whose streams align without an edit (majority); each other
class is aligned against it. The first *interior* edit - one after which the streams pair again - is where
the programs parted: a call one side made and the other did not (:class:`Parting`). Edits at the very end
are where the ranks are now, which the stall diagnosis reads from their positions. Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dtwatch.diagnose.rank_state import CPP_OP, Call, RankState
from dtwatch.ops import P2P_NAMES, SAME_SHAPE_OPS
from dtwatch.ring.layout import MAX_SEQ_SPAN

HISTORY = 192  # newest sequence numbers of a group turned into tokens (C++-issued numbers have no record)
# (where every number from the group's first has a record, all of them: see stream)
WINDOW = 160  # tokens aligned after the first number where the streams differ (bounds the O(n^2) table)
# Costs: an identical call; the same op and shape from a line that stands in for the other's repeatedly; the
# same from a pair of lines seen once; a call on one side only.
MATCH, SAME_SHAPE, ONCE, GAP = 0.0, 0.5, 1.5, 1.0
CPP_KEY = (CPP_OP, "", None)


@dataclass(frozen=True)
class Token:
    """One call of a rank's stream."""

    seq: int  # the first sequence number the call took
    key: tuple  # (op family, shape or "", user line (file, line) or None)
    call: Call | None = None  # the recorded call (None: issued from C++)
    done: bool = True  # it completed (False: issued and in flight, waiting for peers that have not issued it)

    @property
    def op(self) -> str:
        return str(self.key[0])

    @property
    def cpp(self) -> bool:
        return self.key == CPP_KEY

    def compatible(self, other: Token) -> bool:
        """The backend would pair the two silently: the same op and shape (the line may differ)."""
        return not self.cpp and not other.cpp and self.key[:2] == other.key[:2]


@dataclass(frozen=True)
class Step:
    """One step of an alignment of streams ``a`` and ``b``: indexes into each (-1: none)."""

    i: int
    j: int

    @property
    def kind(self) -> str:
        return "pair" if self.i >= 0 and self.j >= 0 else ("only_a" if self.i >= 0 else "only_b")


@dataclass
class Parting:
    """Where the ranks' programs parted in one group: ``ranks`` made ``extra`` calls the ``reference`` ranks
    did not (``extra=True``), or did not make calls they made (``extra=False``)."""

    group: str
    ranks: list[int]  # the side that differs from the reference
    reference: list[int]  # the majority (or, between equal sides, the other side)
    extra: bool  # True: ``ranks`` made the calls; False: the reference made them and ``ranks`` skipped them
    calls: list[Token]  # the calls one side made and the other did not (consecutive), first first
    paired_with: dict[int, Token] = field(default_factory=dict)  # what the other side issued at that number
    decided: bool = True  # False: two equal sides and nothing tells which one deviates
    counts: list[dict] = field(default_factory=list)  # per side: {"ranks", "calls": [{op, file, line, n}]}
    step: int | None = None  # told by the step counters (.step_order): the finished step the sides differ in
    step_calls: dict[str, int] = field(default_factory=dict)  # then: each rank's calls of the group in it

    @property
    def seq(self) -> int:
        return self.calls[0].seq


def _key(c: Call, op_family: Callable[[str], str]) -> tuple:
    shape = c.fingerprint if c.op in SAME_SHAPE_OPS else ""
    return (op_family(c.op), shape, c.user_site_key)


def stream(s: RankState, group: str, op_family: Callable[[str], str] = str) -> list[Token]:
    """Rank ``s``'s calls of ``group`` that it still has a record of, oldest first (see the module doc);
    at most the newest :data:`HISTORY` numbers."""
    g = s.groups.get(group)
    if g is None:
        return []
    covered: dict[int, Call] = {}
    for c in g.recent:
        if c.span <= 1:
            covered[c.seq] = c
        else:
            for q in range(c.seq, c.seq + min(c.span, MAX_SEQ_SPAN)):  # a garbled span costs nothing
                covered[q] = c
    if not covered and not g.complete:
        return []
    top = max(g.seq, max(covered, default=0))
    # Every number from the first is a recorded call (a Flight Recorder dump holds every collective): all of them,
    # so the streams stay anchored at the group's first call however long the history (no token is made up).
    every = g.complete and len(covered) >= top
    start = 1 if every else max(1 if g.complete else min(covered), top - HISTORY + 1)
    out: list[Token] = []
    q = start
    while q <= top:
        held = covered.get(q)
        if held is None:
            out.append(Token(q, CPP_KEY, None, q <= g.completed))
            q += 1
            continue
        if held.op not in P2P_NAMES:
            out.append(Token(held.seq, _key(held, op_family), held, _done(held, g.completed)))
        q = held.seq + max(held.span, 1)
    return out


def _done(c: Call, completed: int) -> bool:
    """Whether a recorded call completed: the group's completions passed it, or it was synchronous and returned."""
    return c.seq + max(c.span, 1) - 1 <= completed or (not c.in_flight and not c.is_async)


def _cost(x: Token, y: Token, rare: frozenset = frozenset()) -> float | None:
    if x.key == y.key:
        return MATCH
    if x.compatible(y):
        # Lines that stand in for each other again and again (both arms of an if/else, Join's shadow calls) pair
        # cheaply; a pair of lines seen once is costlier than one extra call (an extra call that paired silently).
        return ONCE if (x.key, y.key) in rare else SAME_SHAPE
    if not x.cpp and not y.cpp and x.key[0] == y.key[0] and x.key[2] is not None and x.key[2] == y.key[2]:
        # The same call of the program with different arguments (DDP's start-up broadcast of models that differ):
        # one call each, paired by the backend; the argument mismatch is the silent rule's to tell, no parting.
        return SAME_SHAPE
    return None


def align(a: list[Token], b: list[Token], *, a_final: bool, b_final: bool,
          anchored: bool = True) -> tuple[float, list[Step]]:
    """The cheapest alignment of ``a`` and ``b`` (both start at the same sequence number).

    Calls past the end of the other stream cost nothing while it can still grow (not final) or while they are
    in flight (issued, not completed: where a rank is now, not what it paired with). Unless ``anchored`` (the
    program is known to be at the same point on both at the start), either may also start anywhere. Once
    either stream is final, two passes: a pair of different lines the first finds only once costs more than
    an extra call in the second."""
    total, steps = _align(a, b, a_final, b_final, anchored, frozenset())
    if not (a_final or b_final):
        # While both run, a one-off pair of lines is not yet told from an extra call: only a pairing that the
        # calls after it contradict counts (the first pass).
        return total, steps
    pairs = [(a[st.i].key, b[st.j].key) for st in steps if st.kind == "pair" and a[st.i].key != b[st.j].key]
    rare = frozenset(k for k in set(pairs) if pairs.count(k) == 1)
    return _align(a, b, a_final, b_final, anchored, rare) if rare else (total, steps)


def _align(a: list[Token], b: list[Token], a_final: bool, b_final: bool, anchored: bool,
           rare: frozenset) -> tuple[float, list[Step]]:
    n, m = len(a), len(b)
    inf = float("inf")
    # cost[i][j]: a[:i] aligned with b[:j]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    back: list[list[int]] = [[0] * (m + 1) for _ in range(n + 1)]  # 1 pair, 2 only a, 3 only b
    cost[0][0] = 0.0
    for i in range(n + 1):
        row, prev = cost[i], cost[i - 1] if i else None
        for j in range(m + 1):
            if i == 0 and j == 0:
                continue
            best, how = inf, 0
            if not anchored and (i == 0 or j == 0):
                row[j], back[i][j] = 0.0, (3 if i == 0 else 2)  # a free start on the other stream
                continue
            if i and j:
                c = _cost(a[i - 1], b[j - 1], rare)
                if c is not None and prev is not None and prev[j - 1] + c < best:
                    best, how = prev[j - 1] + c, 1
            if i and prev is not None and prev[j] + GAP < best:
                best, how = prev[j] + GAP, 2
            if j and row[j - 1] + GAP < best:
                best, how = row[j - 1] + GAP, 3
            row[j], back[i][j] = best, how

    def tail(xs: list[Token], start: int, other_final: bool) -> float:
        return 0.0 if not other_final else float(sum(GAP for t in xs[start:] if t.done))

    # Where the alignment may end: one stream consumed, the other's remaining calls costed by ``tail``.
    ends = [(cost[i][m] + tail(a, i, b_final), i, m) for i in range(n + 1)]
    ends += [(cost[n][j] + tail(b, j, a_final), n, j) for j in range(m)]
    total, i, j = min(ends, key=lambda e: (e[0], -(e[1] + e[2])))
    steps: list[Step] = []
    while i or j:
        how = back[i][j]
        if how == 1:
            i, j = i - 1, j - 1
            steps.append(Step(i, j))
        elif how == 2:
            i -= 1
            steps.append(Step(i, -1))
        else:
            j -= 1
            steps.append(Step(-1, j))
    steps.reverse()
    return total, steps


def interior_edits(steps: list[Step], anchored: bool = True) -> list[tuple[int, int]]:
    """(start, end) index ranges into ``steps`` of runs of one-sided steps that the streams pair again
    after (a later ``pair`` step); unless ``anchored``, not before the first pair either."""
    last_pair = max((k for k, st in enumerate(steps) if st.kind == "pair"), default=-1)
    runs: list[tuple[int, int]] = []
    k = 0 if anchored else next((k for k, st in enumerate(steps) if st.kind == "pair"), len(steps))
    while k < last_pair:
        if steps[k].kind == "pair":
            k += 1
            continue
        e = k
        while e < last_pair and steps[e].kind != "pair":
            e += 1
        runs.append((k, e))
        k = e
    return runs


def _first_differing_seq(streams: dict[int, list[Token]]) -> int | None:
    """The first sequence number at which the ranks' streams hold different calls (or a call starts on some
    ranks and not on others); None when they agree as far as every one goes."""
    by_seq = [{t.seq: t for t in ts} for ts in streams.values()]
    lo = max(min(d) for d in by_seq)
    hi = min(max(d) for d in by_seq)
    for q in range(lo, hi + 1):
        keys = {(d[q].key if q in d else None) for d in by_seq}
        if len(keys) > 1:
            return q
    return None


def parting(group: str, streams: dict[int, list[Token]], final: dict[int, bool], *,
            under_rank_test: Callable[[int, Token], bool] = lambda r, t: False) -> Parting | None:
    """The first point where the ranks' programs parted in ``group`` (see the module doc), or None.

    ``streams``: each member's :func:`stream`; ``final``: whether a rank's stream can still grow;
    ``under_rank_test(rank, token)``: whether that rank reached that call through a rank test (it breaks a tie
    between two equal sides)."""
    streams = {r: ts for r, ts in streams.items() if ts}
    if len(streams) < 2:
        return None
    # Start where every rank still has records, at the first number where they differ.
    lo = max(ts[0].seq for ts in streams.values())
    streams = {r: [t for t in ts if t.seq >= lo] for r, ts in streams.items()}
    if any(not ts for ts in streams.values()):
        return None
    first = _first_differing_seq(streams)
    if first is None:
        return None
    cut = {r: [t for t in ts if t.seq >= first][:WINDOW] for r, ts in streams.items()}
    if any(not ts or ts[0].seq != first for ts in cut.values()):
        return None  # a multi-number call straddles the point: the streams cannot be cut there alike
    # The programs are known to be at the same point where the streams part when the records go back to the
    # first call, or when the calls before it agree and are not all alike (a stream of identical calls looks
    # the same shifted by one; so does a window that begins after an earlier parting).
    before = {t.key for t in next(iter(streams.values())) if t.seq < first}
    anchored = all(ts[0].seq == 1 for ts in streams.values()) or len(before) >= 2

    # Classes of ranks whose streams align without an edit; the largest is the reference.
    classes: list[list[int]] = []
    for r in sorted(cut):
        for cls in classes:
            rep = cls[0]
            if _edits(cut[r], cut[rep], final[r], final[rep], anchored) == []:
                cls.append(r)
                break
        else:
            classes.append([r])
    if len(classes) < 2:
        return None
    classes.sort(key=lambda c: (-len(c), c[0]))
    reference = classes[0]
    found: list[Parting] = []
    for cls in classes[1:]:
        p = _parting_of(group, cls, reference, cut, final, under_rank_test, tie=len(cls) == len(reference),
                        anchored=anchored)
        if p is not None:
            found.append(p)
    return min(found, key=lambda p: (p.seq, len(p.ranks))) if found else None


def _edits(a: list[Token], b: list[Token], a_final: bool, b_final: bool, anchored: bool) -> list[tuple[int, int]]:
    _, steps = align(a, b, a_final=a_final, b_final=b_final, anchored=anchored)
    return interior_edits(steps, anchored)


def _parting_of(group: str, cls: list[int], reference: list[int], cut: dict[int, list[Token]],
                final: dict[int, bool], under_rank_test: Callable[[int, Token], bool], tie: bool,
                anchored: bool) -> Parting | None:
    r, ref = cls[0], reference[0]
    a, b = cut[r], cut[ref]
    _, steps = align(a, b, a_final=final[r], b_final=final[ref], anchored=anchored)
    runs = interior_edits(steps, anchored)
    if not runs:
        return None
    start, end = runs[0]
    run = steps[start:end]
    only_a = [a[st.i] for st in run if st.kind == "only_a"]
    only_b = [b[st.j] for st in run if st.kind == "only_b"]
    if only_a and only_b:
        # Both sides made calls the other did not, here: report the side whose call comes first by number.
        extra = only_a[0].seq <= only_b[0].seq
    else:
        extra = bool(only_a)
    calls = only_a if extra else only_b
    side, other = list(cls), list(reference)
    decided = not tie
    if tie:
        # Two equal sides: the side that reached its extra call through a rank test deviates.
        a_test = extra and any(under_rank_test(r, t) for t in calls)
        b_test = not extra and any(under_rank_test(ref, t) for t in calls)
        if b_test and not a_test:
            side, other, extra = list(reference), list(cls), True
            calls = only_b
        decided = a_test or b_test
    # What the other side issued at that number: the executed pairing.
    at = calls[0].seq
    paired = {q: t for q in (other if extra else side) for t in cut[q] if t.seq == at}
    counts = [{"ranks": sorted(side), "calls": count_calls(cut[side[0]])},
              {"ranks": sorted(other), "calls": count_calls(cut[other[0]])}]
    return Parting(group=group, ranks=sorted(side), reference=sorted(other), extra=extra, calls=calls,
                   paired_with=paired, decided=decided, counts=counts)


def count_calls(tokens: Iterable[Token]) -> list[dict]:
    """How many calls of each op and line a stream holds (the window aligned)."""
    out: dict[tuple, int] = {}
    for t in tokens:
        out[(t.op, t.key[2])] = out.get((t.op, t.key[2]), 0) + 1
    return [{"op": op, "file": line[0] if line else None, "line": line[1] if line else None, "n": n}
            for (op, line), n in out.items()]
