"""The straggler warning (dtwatch.diagnose.straggler): the pure rule on synthetic lag series, then real jobs.

A warning that fires on scheduling noise gets dtwatch switched off, so the counter-cases come first:
noisy healthy ranks, a sequence clock's phase, a lag longer than a step (an artefact), a scheduler that
favours one rank for a few seconds then another, ranks that take turns. Then the cases where it must
fire, and a straggler that changes. The live tests run real gloo jobs with both cores saturated by busy
loops (started here, always killed) and assert no warning on healthy jobs and the right rank otherwise.
"""
from __future__ import annotations

import itertools
import random
import re
import subprocess
import sys
import time

import pytest

from dtwatch.diagnose.rank_state import Call, GroupProgress, RankState
from dtwatch.diagnose.straggler import (
    HOLD,
    MIN_STEPS,
    EntryLags,
    Step,
    StragglerWatch,
    entry_lags,
    judge,
    straggler_warning,
)
from tests.harness import SCRIPTS, launch

WORKER = SCRIPTS / "straggler_worker.py"


# -- synthetic series -------------------------------------------------------------------------------------
def series(n: int, step: float, lag_of, *, ranks: int = 2, clock: bool = False, t0: float = 1000.0) -> list[Step]:
    """``n`` steps of ``step`` seconds; ``lag_of(i, rank)`` is how late ``rank`` issued step i's collectives
    (before taking the first rank's as zero)."""
    out = []
    for i in range(n):
        raw = {r: lag_of(i, r) for r in range(ranks)}
        first = min(raw.values())
        start = t0 + i * step
        out.append(Step(first_seq=2 * i + 1, last_seq=2 * i + 2, start=start, end=start + step / 2,
                        lags={r: v - first for r, v in raw.items()}, clock=clock))
    return out


def lags_of(steps: list[Step], step: float) -> EntryLags:
    ranks = sorted(steps[0].lags)
    return EntryLags(medians={r: sorted(s.lags[r] for s in steps)[len(steps) // 2] for r in ranks},
                     compared=2 * len(steps), step_period=step, steps=steps, stepped=True)


def watch_over(steps: list[Step], step: float, every: float = 0.5) -> list[tuple[float, object]]:
    """Look every ``every`` seconds as the steps arrive, as the watchdog polls; (time, finding) per look."""
    watch = StragglerWatch()
    out = []
    t, n = steps[0].end, 0
    while t <= steps[-1].end + 1e-9:
        while n < len(steps) and steps[n].end <= t:
            n += 1
        out.append((t, watch.update(lags_of(steps[max(0, n - 60):n], step), t)))  # the watchdog sees ~60 steps
        t += every
    return out


def seen_at(steps: list[Step], t: float) -> list[Step]:
    return [s for s in steps if s.end <= t][-60:]


def fired(looks) -> list:
    return [(t, f) for t, f in looks if f is not None]


def noise(rng: random.Random, scale: float):
    """Scheduling noise on a loaded machine: mostly a few ms, now and then a preemption of tens of ms."""
    return lambda i, r: rng.expovariate(1 / scale) + (rng.uniform(0.02, 0.06) if rng.random() < 0.1 else 0.0)


# -- healthy, noisy: silent ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("step, scale, ranks", [(0.005, 0.01, 2), (0.03, 0.01, 2), (0.1, 0.02, 4)])
def test_healthy_ranks_with_scheduling_noise_are_never_named(seed, step, scale, ranks):
    # Short steps (5 ms) with noise of tens of ms: whoever is late changes at random.
    rng = random.Random(seed)
    steps = series(int(60 / step) if step > 0.01 else 4000, step, noise(rng, scale), ranks=ranks)
    assert not fired(watch_over(steps, step))
    assert straggler_warning(lags_of(steps[-60:], step), steps[-1].end) is None


def test_a_sequence_clocks_phase_is_not_a_straggler():
    # Issue times of C++-issued collectives come from each rank's sampler, read every 10 ms: one rank's
    # clock reading a steady 5-15 ms later looks like a rank that is always last, with little scatter.
    rng = random.Random(1)
    steps = series(600, 0.1, lambda i, r: rng.uniform(0.005, 0.015) if r == 1 else rng.uniform(0, 0.002), clock=True)
    v = judge(lags_of(steps, 0.1))
    assert v.rank is None and v.last == v.steps and "below the margin" in v.why
    assert not fired(watch_over(steps, 0.1))


def test_a_lag_longer_than_a_step_is_an_artefact():
    # "rank 1 is the last, a median 14 ms behind (a step takes 5 ms)": a rank steadily 14 ms late would make
    # every step at least 14 ms long. Exact entry times, no noise: still not named.
    steps = series(3000, 0.005, lambda i, r: 0.014 if r == 1 else 0.0)
    v = judge(lags_of(steps, 0.005))
    assert v.rank is None and "not less than a step" in v.why
    assert not fired(watch_over(steps, 0.005))


def test_a_rank_favoured_by_the_scheduler_for_a_few_seconds_is_not_named():
    # A loaded machine: for 3 s rank 1 shares a core with a busy process and is 40 ms late every step, then
    # rank 0 is. Each look names the slow rank of the moment; none holds long enough.
    rng = random.Random(2)
    step = 0.15

    def lag(i, r):
        slow = (int(i * step / 3.0) % 2) == 0  # rank 1 for 3 s, then rank 0, ...
        return (0.04 if (r == 1) == slow else 0.0) + rng.uniform(0, 0.003)

    steps = series(int(60 / step), step, lag)
    looks = watch_over(steps, step)
    named = {judge(lags_of(seen_at(steps, t), step)).rank for t, _ in looks}
    assert {0, 1} <= named  # each was named at some look
    assert not fired(looks)


def test_a_rank_held_back_by_an_oversubscribed_core_is_not_named():
    # Seen with 3 ranks and 2 busy loops on 2 cores: for 11 s one rank shares its core with more work and is
    # the last in about 4 of 5 steps of ~90 ms, 7-16 ms late (clock times). A real asymmetry, but the
    # scheduler lets it through first now and then: not a straggler.
    rng = random.Random(6)
    step = 0.09

    def lag(i, r):
        held = r == 1 and rng.random() < 0.8
        return (rng.uniform(0.007, 0.016) if held else 0.0) + rng.uniform(0, 0.003)

    steps = series(int(30 / step), step, lag, ranks=3, clock=True)
    assert not fired(watch_over(steps, step))


@pytest.mark.parametrize("block", [1, 5, 20])
def test_ranks_taking_turns_being_slow_are_not_a_straggler(block):
    # The slow rank changes every `block` steps (100 ms each: 2 s turns at most): someone always waits,
    # nobody is a straggler.
    steps = series(600, 0.1, lambda i, r: 0.1 if r == (i // block) % 3 else 0.0, ranks=3)
    assert not fired(watch_over(steps, 0.1))
    assert straggler_warning(lags_of(steps[-60:], 0.1), steps[-1].end) is None


def test_noise_larger_than_the_lag_is_not_a_straggler():
    # Rank 1 is 15 ms slower on average, but the steps scatter by ±50 ms: not a claim we can make.
    rng = random.Random(3)
    steps = series(600, 0.2, lambda i, r: (0.015 if r == 1 else 0.0) + rng.gauss(0, 0.05))
    assert not fired(watch_over(steps, 0.2))


# -- a straggler: named, with the numbers the decision used ---------------------------------------------
def test_a_rank_30_percent_slower_is_named_after_the_hold():
    rng = random.Random(4)
    step = 0.13  # the others' 100 ms, and rank 2's 30 ms more
    steps = series(400, step, lambda i, r: (0.03 if r == 2 else 0.0) + rng.uniform(0, 0.004), ranks=3)
    looks = watch_over(steps, step)
    (t, f), *_ = fired(looks)
    assert f.ranks == [2] and f.kind == "straggler" and f.severity == "warning"
    first = next(t for t, _ in looks if judge(lags_of(seen_at(steps, t), step)).rank == 2)
    assert HOLD <= t - first <= HOLD + 0.5  # named at every look for the hold, no longer
    assert t - steps[0].start < 30
    d = f.details
    assert 0.027 <= d["straggler_lag_s"] <= 0.034 and d["last_steps"] == d["steps"] == 20
    assert d["held_s"] >= HOLD and d["confirmed_by"]["last_steps"] >= MIN_STEPS
    # The sentence says what was measured, over which window, with the decision's own numbers.
    assert (f"rank 2 was the last to issue the collectives of group 0 in 20 of the last 20 training steps, a median "
            f"{d['straggler_lag_s'] * 1000:.0f} ms after every other rank (a step takes 130 ms; the scatter between "
            f"ranks is {d['noise_s'] * 1000:.0f} ms), and the last at every look for {d['held_s']:.1f} s") in f.summary
    assert f.onset == pytest.approx(t - d["held_s"])


def test_a_straggler_under_noise_is_named():
    # The same 30 % straggler on a loaded machine: a few ms of jitter, a preemption of tens of ms now and then.
    rng = random.Random(5)
    step = 0.2
    jitter = noise(rng, 0.004)
    steps = series(300, step, lambda i, r: (0.06 if r == 1 else 0.0) + jitter(i, r), clock=True)
    (t, f), *_ = fired(watch_over(steps, step))
    assert f.ranks == [1] and t - steps[0].start < 30


def test_a_straggler_that_changes_is_named_again_only_after_its_own_hold():
    step = 0.1
    switch = 300  # steps: rank 1 is slow for 30 s, then rank 0
    steps = series(600, step, lambda i, r: 0.03 if r == (1 if i < switch else 0) else 0.0)
    looks = watch_over(steps, step)
    named = [(t, f.ranks[0]) for t, f in fired(looks)]
    assert named[0][1] == 1
    change = steps[switch].start
    assert all(r == 1 for t, r in named if t < change)
    later = [t for t, r in named if r == 0]
    assert later and later[0] - change >= HOLD  # rank 0 needs its own hold
    assert not [t for t, r in named if r == 1 and t > change + 3.0]  # rank 1 is not named once it recovered


def test_no_new_steps_no_confirmation():
    # The job pauses (eval, checkpoint): time passes, but no step after the first look's window confirms it.
    steps = series(12, 0.1, lambda i, r: 0.03 if r == 1 else 0.0)
    watch = StragglerWatch()
    lags = lags_of(steps, 0.1)
    assert all(watch.update(lags, steps[-1].end + dt) is None for dt in range(0, 60))


def test_the_analyzer_replays_the_same_rule_over_the_recorded_window():
    step = 0.13
    slow = series(200, step, lambda i, r: 0.03 if r == 1 else 0.0)
    f = straggler_warning(lags_of(slow, step), slow[-1].end)
    assert f is not None and f.ranks == [1] and f.details["held_s"] >= HOLD
    short = slow[: int((HOLD - 1) / step)]  # a recorded window shorter than the hold: nothing to say
    assert straggler_warning(lags_of(short, step), short[-1].end) is None


# -- from the ranks' states -------------------------------------------------------------------------------
def _state(rank: int, seq_times, recent, step_seqs, step_times) -> RankState:
    g = GroupProgress(name="0", members=[0, 1], seq=seq_times[-1][0], completed=0, py_seq=0, cpp_seq=0,
                      cpp_seq_time=0.0, recent=recent, seq_times=seq_times)
    return RankState(
        rank=rank, local_rank=rank, world_size=2, host="h", pid=1, job_id="j", start_time=0.0, restart_count=0,
        backend="gloo", alive=True, proc_state="S", exit_state="running", exit_reason="", exit_time=0.0,
        heartbeat_time=100.0, step=3, step_time=0.0, groups={"0": g}, open_calls=[], main_site=None,
        main_top_site=None, main_site_since=0.0, main_stack=[], loaders=[], last_activity=50.0,
        step_times=step_times, step_seqs=step_seqs,
    )


def test_entry_lags_groups_the_collectives_by_the_ranks_common_step_markers():
    # Three collectives per step (seqs 3k+1..3k+3, step marker at 3k+3); rank 1 issues each step's first
    # one 40 ms late (its sequence clock), the rest with rank 0. Rank 0's last two are Python-issued.
    clock0 = [(3 * k + j, 10.0 + k + 0.01 * j) for k in range(6) for j in (1, 2, 3)]
    clock1 = [(3 * k + j, 10.0 + k + 0.01 * j + (0.04 if j == 1 else 0.0)) for k in range(6) for j in (1, 2, 3)]
    recent = [Call("all_reduce", "0", q, None, t) for q, t in clock0[-2:]]
    s0 = _state(0, clock0, recent, [3 * k + 3 for k in range(6)], [10.05 + k for k in range(6)])
    s1 = _state(1, clock1, [], [3 * k + 3 for k in range(1, 6)], [10.05 + k for k in range(1, 6)])
    lags = entry_lags([s0, s1])
    assert lags.stepped and lags.step_period == pytest.approx(1.0)
    # Steps between common markers only (rank 1 has no marker at 3: the first step is not whole there).
    assert [(s.first_seq, s.last_seq) for s in lags.steps] == [(7, 9), (10, 12), (13, 15), (16, 18)]
    assert all(s.lags[1] == pytest.approx(0.04) and s.lags[0] == 0.0 for s in lags.steps)
    assert all(s.clock for s in lags.steps)
    assert lags.steps[0].leads() == pytest.approx({0: -0.04, 1: 0.04})


def test_without_step_markers_each_collective_is_a_step():
    clock = [(q, 10.0 + q * 0.1) for q in range(1, 30)]
    s0 = _state(0, clock, [], [], [])
    s1 = _state(1, [(q, t + 0.02) for q, t in clock], [], [], [])
    lags = entry_lags([s0, s1])
    assert not lags.stepped and len(lags.steps) == 28 and lags.period == pytest.approx(0.1)


def test_a_garbled_sequence_number_costs_nothing_and_names_no_straggler():
    """A bit flipped in a damaged ring's sequence number (the format has no checksums) once made the issue times a
    dict of 2**39 entries. Only the newest numbers are ever compared, so only they are filled in."""
    from dtwatch.diagnose.straggler import FILL_BACK, issue_times

    clock = [(q, 10.0 + q * 0.1) for q in range(1, 30)]
    garbled = _state(0, clock[:-1] + [(1 << 39, clock[-1][1])], [], [], [])
    times = issue_times(garbled)
    assert len(times) <= FILL_BACK + len(clock)
    assert max(times) == 1 << 39
    assert straggler_warning(entry_lags([garbled, _state(1, clock, [], [], [])]), 20.0) is None


# -- live: real jobs, both cores saturated ---------------------------------------------------------------
def busy_loops(n: int = 2) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_loops(loops: list[subprocess.Popen]) -> None:
    for p in loops:
        p.kill()
        p.wait()


def warnings_of(job, kinds=("straggler", "desync", "mismatch")) -> list[dict]:
    return [e for e in job.events() if e["event"] == "warning" and e["kind"] in kinds]


def run_loaded(tmp_path, model: str, nproc: int, seconds: float, env: dict) -> tuple[object, float]:
    loops = busy_loops()
    job = None
    try:
        started = time.time()
        job = launch(tmp_path, model, nproc, window=4.0, script=WORKER,
                     extra_env={"RUN_SECONDS": str(seconds), **env})
        # Not a bound on dtwatch: the job's own start-up (three ranks importing torch) beside the saturated cores
        # and a busy CI machine took up to 30 s.
        assert job.wait_exit(timeout=seconds + 60) == [0], job.watchdog_log()
        job.watchdog.wait(timeout=20)
        return job, started
    finally:
        stop_loops(loops)
        if job is not None:
            job.stop()


@pytest.mark.timing
@pytest.mark.timeout(150)
@pytest.mark.parametrize("model, step_ms, nproc", [("ddp", "5", 2), ("fsdp", "20", 3)])
def test_healthy_job_on_a_loaded_machine_raises_no_straggler_warning(tmp_path, model, step_ms, nproc):
    # Both cores saturated by busy loops; steps of 5 ms (DDP: issue times from the sequence clocks) and
    # FSDP2 on 3 ranks. Whoever the scheduler delays changes all the time: no warning.
    job, _ = run_loaded(tmp_path, model, nproc, 20, {"STEP_MS": step_ms, "BUSY_FRACTION": "1"})
    assert not warnings_of(job), warnings_of(job)


@pytest.mark.timing
@pytest.mark.timeout(150)
def test_injected_straggler_on_a_loaded_machine_is_named(tmp_path):
    # Rank 1's input pipeline is 30 % of its own step time slower every step (steps of ~100 ms), with both
    # cores saturated.
    job, started = run_loaded(tmp_path, "ddp", 2, 30, {"STEP_MS": "100", "SLOW_RANK": "1", "SLOW_FRACTION": "0.3"})
    found = warnings_of(job)
    assert [w["ranks"] for w in found] == [[1]], found
    w = found[0]
    assert w["detected"] - started < 45, w  # within a minute of the launch (start-up takes 5-10 s of it)
    assert 0.02 <= w["details"]["straggler_lag_s"] <= 0.06
    assert re.search(r"rank 1 was the last to issue the collectives of group 0 in \d+ of the last \d+ training steps",
                     w["summary"])


def test_recorded_calls_time_the_sequence_numbers_when_the_clock_is_quiet():
    """The sequence clock runs only while calls go unrecorded: the recorded calls' entries then give the issue
    times, thinned to one per 5 ms (the newest), so 256 kept pairs span as long as the clock's would."""
    import numpy as np

    from dtwatch.diagnose.rank_state import SEQ_TIMES_KEPT, _seq_times
    from dtwatch.ring.layout import SEQ_CLOCK_DTYPE

    clock = np.zeros(2, dtype=SEQ_CLOCK_DTYPE)
    clock["t"], clock["seq"], clock["group"] = [100.0, 100.5], [3, 5], [0, 1]  # group 1's sample is not ours
    seqs = np.arange(4, 2004)
    entered = 100.0 + (seqs - 4) * 0.001  # a call every millisecond
    pairs = _seq_times(clock, 0, seqs, entered)
    assert len(pairs) == SEQ_TIMES_KEPT
    assert all(b[0] > a[0] and b[1] > a[1] for a, b in itertools.pairwise(pairs))
    assert pairs[-1] == (2003, float(entered[-1]))
    assert pairs[-1][1] - pairs[0][1] > 1.2  # ~256 x 5 ms, not 256 x 1 ms
    assert _seq_times(clock[:0], 0, seqs[:0], entered[:0]) == []
    assert _seq_times(clock, 0, seqs[:0], entered[:0]) == [(3, 100.0)]
