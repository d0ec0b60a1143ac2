"""A straggler: one rank consistently last to issue the world group's collectives while the job progresses.

A warning that fires on scheduling noise gets dtwatch switched off, so the rule has three parts
(docs/diagnosis.md, "Stragglers"):

1. **Steps** (:func:`entry_lags`). The collectives of group 0 that every live rank has issued are
   grouped by training step (the step markers' sequence numbers, where every rank has the marker;
   without step markers each collective stands alone). In a step, a rank's *lag* is the largest over
   the step's collectives of how late it issued one after the first rank; its *lead* is its lag minus
   the largest of the other ranks' lags: how long after every other rank it was (negative when it was
   not the last).
2. **One look** (:func:`judge`), over the last ``WINDOW_STEPS`` complete steps (at least ``MIN_STEPS``).
   The candidate is the rank that was last in the most steps. It is named when it was last in at least
   ``MIN_SHARE`` of them (a scheduler that favours one rank on a loaded machine lets it off now and then;
   a straggler is last every step) and its median lead *d* is at least the margin, the largest of:
   ``MIN_LAG`` (``MIN_LAG_CLOCK``, two sequence-clock intervals, when some compared time comes from a
   rank's sequence clock rather than a Python-issued call's own entry time: two samplers' phases alone
   differ by up to one interval); ``MIN_FRACTION`` of a step (smaller asymmetries, such as rank 0's
   logging, are normal); ``NOISE_FACTOR`` times the scatter of the leads, every rank's around its own
   median (1.4826 x the pooled median absolute deviation; it includes the clocks' own scatter, which
   ``MIN_LAG_CLOCK`` covers). And *d* must be less than a step (less one
   clock interval for clock times): a rank steadily *d* later than the others makes every step at least
   *d* long, so a longer lead is a measurement artefact (a sampler thread starved of CPU), not a
   straggler.
3. **Persistence** (:class:`StragglerWatch`). The warning is issued once the same rank was named at every
   look for at least ``HOLD`` seconds, and the steps that came after the first look that named it, judged
   on their own, name it too (two disjoint windows agree). A look that names nobody, or another rank,
   starts over: a rank the scheduler holds back for a few seconds, then another, is never named.
"""
from __future__ import annotations

import bisect
import itertools
import statistics
from dataclasses import dataclass, field, replace

from dtwatch.diagnose.model import WARNING, Finding, Kind
from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.wording.straggler_words import (
    TOO_FEW_STEPS,
    lead_below_margin,
    lead_not_below_step,
    rarely_last,
    straggler_summary,
)

MAX_COMPARED = 200  # the newest collectives of group 0 compared across ranks
FILL_BACK = 10 * MAX_COMPARED  # how far back from the newest number the issue times are filled in
WINDOW_STEPS = 20  # one look judges at most this many of the newest complete steps
MIN_STEPS = 10  # ... and at least this many
MIN_SHARE = 0.9  # the candidate was the last rank in at least this share of them (18 of 20)
MIN_LAG = 0.010  # s: the smallest median lead named, between exact entry times
CLOCK_INTERVAL = 0.010  # s: the ranks' sequence clocks are read every 10 ms (a time from one is up to that late)
MIN_LAG_CLOCK = 2 * CLOCK_INTERVAL  # s: the smallest median lead named when a compared time comes from a clock
MIN_FRACTION = 0.15  # of a step: the smallest median lead named
NOISE_FACTOR = 2.0  # the median lead is at least this many times the ranks' scatter
HOLD = 5.0  # s: the same rank named at every look for this long before the warning


@dataclass
class Step:
    """One training step's collectives of group 0 as the ranks issued them (or one collective, without
    step markers)."""

    first_seq: int
    last_seq: int
    start: float  # when the first rank issued the step's first compared collective
    end: float  # ... and its last
    lags: dict[int, float]  # rank -> its largest lag behind the first rank over the step's collectives
    clock: bool = False  # some compared time came from a rank's sequence clock (not an exact entry time)
    _leads: dict[int, float] | None = field(default=None, init=False, repr=False, compare=False)

    def leads(self) -> dict[int, float]:
        """rank -> how long after every other rank it was (its lag minus the largest other lag)."""
        if self._leads is None:
            top = sorted(self.lags.items(), key=lambda x: -x[1])[:2]
            if len(top) < 2:
                self._leads = {r: 0.0 for r in self.lags}
            else:
                (r1, v1), (_, v2) = top
                self._leads = {r: lag - (v2 if r == r1 else v1) for r, lag in self.lags.items()}
        return self._leads


@dataclass
class EntryLags:
    """How late each rank issues recent world-group collectives, relative to the first rank."""

    medians: dict[int, float]  # rank -> median seconds behind the first rank (every compared collective)
    compared: int = 0  # collectives every live rank has a time for
    period: float | None = None  # median seconds between consecutive compared collectives
    step_period: float | None = None  # median seconds between training steps (step markers), if counted
    steps: list[Step] = field(default_factory=list)  # complete steps, oldest first
    stepped: bool = False  # steps are training steps (step markers); otherwise single collectives


def issue_times(s: RankState, group: str = "0") -> dict[int, float]:
    """seq -> when ``s`` issued it: a Python-issued call's entry time; otherwise (issued from C++, e.g. by
    DDP's reducer) when the rank's sequence clock first showed the counter at or past it (at most the
    clock's interval late)."""
    return _issue_times(s, group)[0]


def _issue_times(s: RankState, group: str = "0") -> tuple[dict[int, float], set[int]]:
    """(seq -> issue time, the seqs whose time is a Python-issued call's exact entry time)."""
    g = s.groups.get(group)
    if g is None:
        return {}, set()
    out: dict[int, float] = {}
    # Only the newest numbers are ever compared (MAX_COMPARED common to all ranks, which a group's ranks cannot
    # be far apart in): the gaps are filled no further back than FILL_BACK from the newest, so one garbled number
    # in a damaged ring costs nothing.
    newest = max([int(seq) for seq, _ in g.seq_times] + [c.seq for c in g.recent], default=0)
    floor = newest - FILL_BACK
    prev = None
    for seq, t in g.seq_times:
        seq = int(seq)
        if prev is not None:
            for q in range(max(prev + 1, floor), seq + 1):
                out[q] = t
        prev = seq if prev is None else max(prev, seq)
    exact = set()
    for c in g.recent:
        out[c.seq] = c.t_enter
        exact.add(c.seq)
    return out, exact


def entry_lags(states: list[RankState]) -> EntryLags:
    live = [s for s in states if not s.gone]
    got = {s.rank: _issue_times(s) for s in live}
    times = {r: t for r, (t, _) in got.items()}
    common = sorted(set.intersection(*(set(t) for t in times.values()))) if times else []
    common = common[-MAX_COMPARED:]
    lags: dict[int, list[float]] = {r: [] for r in times}
    firsts = []
    for seq in common:
        first = min(t[seq] for t in times.values())
        firsts.append(first)
        for r, t in times.items():
            lags[r].append(t[seq] - first)
    gaps = [b - a for a, b in itertools.pairwise(firsts) if b > a]
    step_gaps = [b - a for s in live for a, b in itertools.pairwise(s.step_times) if b > a]
    # Step boundaries every live rank marked (the default group's seq at its optimizer step / dtwatch.step()).
    marks = [set(s.step_seqs) for s in live]
    bounds = sorted(set.intersection(*marks)) if marks and all(marks) else []
    steps: list[Step] = []
    if common and len(times) >= 2:
        exact = {r: e for r, (_, e) in got.items()}
        stepped = len(bounds) >= 2
        if stepped:
            # seq q belongs to the step that ends at the first boundary >= q; only steps with both ends.
            groups: dict[int, list[int]] = {}
            for i, seq in enumerate(common):
                k = bisect.bisect_left(bounds, seq)
                if 0 < k < len(bounds) and (k in groups or seq == bounds[k - 1] + 1):  # whole steps only
                    groups.setdefault(k, []).append(i)
            members = [groups[k] for k in sorted(groups)]
        else:
            members = [[i] for i in range(len(common))]
        for idx in members:
            seqs = [common[i] for i in idx]
            steps.append(Step(
                first_seq=seqs[0], last_seq=seqs[-1], start=firsts[idx[0]], end=firsts[idx[-1]],
                lags={r: max(lags[r][i] for i in idx) for r in times},
                clock=any(q not in exact[r] for q in seqs for r in times),
            ))
    else:
        stepped = False
    return EntryLags(
        medians={r: statistics.median(x) for r, x in lags.items() if x}, compared=len(common),
        period=statistics.median(gaps) if gaps else None,
        step_period=statistics.median(step_gaps) if step_gaps else None, steps=steps, stepped=stepped,
    )


@dataclass
class Verdict:
    """What one look at a window of steps says."""

    rank: int | None  # the rank named, or None
    steps: int = 0  # steps judged
    last: int = 0  # of them, the steps the candidate was the last rank in
    lead: float = 0.0  # its median lead over every other rank (s)
    noise: float = 0.0  # the ranks' scatter (s)
    margin: float = 0.0  # the smallest median lead named (s)
    step: float | None = None  # a step (or the time between collectives, without step markers) (s)
    first_seq: int = 0
    last_seq: int = 0
    start: float = 0.0  # when the first step judged began (its first collective, first rank)
    end: float = 0.0
    why: str = ""  # why nobody is named


def judge(lags: EntryLags, steps: list[Step] | None = None) -> Verdict:
    """One look: is one rank the last, by more than the noise, in nearly all of the newest steps?"""
    steps = (lags.steps if steps is None else steps)[-WINDOW_STEPS:]
    if len(lags.medians) < 2 or len(steps) < MIN_STEPS:
        return Verdict(None, len(steps), why=TOO_FEW_STEPS)
    step = lags.step_period if lags.stepped else lags.period
    leads = [s.leads() for s in steps]
    ranks = sorted(leads[0])
    last_in = {r: sum(1 for ld in leads if ld[r] > 0) for r in ranks}
    cand = max(ranks, key=lambda r: (last_in[r], r))
    lead = statistics.median(ld[cand] for ld in leads)
    resid = []
    for r in ranks:
        mid = statistics.median(ld[r] for ld in leads)
        resid += [abs(ld[r] - mid) for ld in leads]
    noise = 1.4826 * statistics.median(resid)
    clock = any(s.clock for s in steps)
    margin = max(MIN_LAG_CLOCK if clock else MIN_LAG, MIN_FRACTION * step if step else 0.0, NOISE_FACTOR * noise)
    v = Verdict(None, len(steps), last_in[cand], lead, noise, margin, step, steps[0].first_seq, steps[-1].last_seq,
                steps[0].start, steps[-1].end)
    if last_in[cand] < MIN_SHARE * len(steps):
        v.why = rarely_last(cand, last_in[cand], len(steps))
    elif lead < margin:
        v.why = lead_below_margin(cand, lead, margin)
    elif step and lead + (CLOCK_INTERVAL if clock else 0.0) >= step:
        v.why = lead_not_below_step(cand, lead, step, clock)
    else:
        v.rank = cand
    return v


class StragglerWatch:
    """The rule's memory between looks (the watchdog holds one and calls :meth:`update` every poll): the rank
    named at every look since ``since``, and the last sequence number of the first window that named it."""

    def __init__(self, hold: float = HOLD) -> None:
        self.hold = hold
        self.rank: int | None = None
        self.since = 0.0
        self.first_last_seq = 0
        self.looks = 0

    def reset(self) -> None:
        self.rank, self.since, self.first_last_seq, self.looks = None, 0.0, 0, 0

    def update(self, lags: EntryLags, now: float) -> Finding | None:
        """One look; the warning while the same rank has been named long enough (None otherwise)."""
        v = judge(lags)
        if v.rank is None:
            self.reset()
            return None
        if v.rank != self.rank:
            self.rank, self.since, self.first_last_seq, self.looks = v.rank, now, v.last_seq, 1
        else:
            self.looks += 1
        if now - self.since < self.hold:
            return None
        newer = [s for s in lags.steps if s.first_seq > self.first_last_seq]
        again = judge(lags, newer)
        if again.rank != v.rank:
            return None
        return straggler_finding(v, again, lags, now, now - self.since, self.looks)


def straggler_finding(v: Verdict, again: Verdict, lags: EntryLags, now: float, held: float, looks: int) -> Finding:
    if v.rank is None:
        raise ValueError("a verdict that names no rank is no straggler")
    stepped = lags.stepped
    details = {"median_lag_s": {str(r): round(x, 4) for r, x in sorted(lags.medians.items())},
               "straggler_lag_s": round(v.lead, 4), "last_steps": v.last, "steps": v.steps, "stepped": stepped,
               "noise_s": round(v.noise, 4), "margin_s": round(v.margin, 4),
               "step_s": round(v.step, 4) if v.step else None, "window_s": round(v.end - v.start, 3),
               "held_s": round(held, 3), "looks": looks,
               "confirmed_by": {"steps": again.steps, "last_steps": again.last,
                                "straggler_lag_s": round(again.lead, 4)}}
    return Finding(
        kind=Kind.STRAGGLER, severity=WARNING, ranks=[v.rank],
        summary=straggler_summary(v.rank, v.last, v.steps, stepped, v.lead, v.step, v.noise, held),
        detected=now, onset=now - held, details=details,
    )


def straggler_warning(lags: EntryLags, now: float, hold: float = HOLD) -> Finding | None:
    """The same rule over a recorded window (``dtwatch analyze``): a look after every step, as the watchdog
    would have looked; the warning the watchdog would have issued first, if any."""
    watch = StragglerWatch(hold)
    for j in range(MIN_STEPS, len(lags.steps) + 1):
        f = watch.update(replace(lags, steps=lags.steps[:j]), lags.steps[j - 1].end)
        if f is not None:
            return f
    return None
