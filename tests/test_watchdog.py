"""Real hanging jobs (2-3 ranks) under a real watchdog: each kind is diagnosed with the right rank,
op and line; healthy runs with quiet gaps and a straggler raise no stall.

Every stall kind runs on gloo and on ``gloo_async`` (dtwatch.testing: NCCL's execution model, where a
collective returns before it completes and the rank waits later, at a synchronisation point): the
diagnosis must be the same, naming the collective, not the line where the rank happens to wait."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from dtwatch.record import hooks
from tests.harness import SCRIPTS, assert_rank_conditional_finding, launch, site_line

pytestmark = pytest.mark.torch_versions  # also run on the oldest torch the README claims (.ci/run)

WINDOW = 4.0
# Diagnosis must be written within the window + 2 s of the hang; CI machines are slow and loaded, so the
# tests allow a margin on top (benchmarks/detection.py measures the real figure).
DEADLINE = WINDOW + 2.0 + 8.0


def stall(index: dict) -> dict:
    findings = [f for f in index["findings"] if f["severity"] == "stall"]
    assert findings, index
    return findings[0]


@pytest.fixture(params=["gloo", "gloo_async"])
def backend(request) -> str:
    return request.param


def false_warnings(job, kinds=("desync", "mismatch")) -> list[dict]:
    """Warnings of these kinds in a run that has no such problem (there must be none); the setup checks'
    warnings too: no test job has a setup mistake."""
    return [e for e in job.events() if e["event"] == "warning"
            and (e["kind"] in kinds or e.get("details", {}).get("check"))]


@contextmanager
def incident(tmp_path, scenario, nproc, backend="gloo", **kw):
    """Run a hanging job under a watchdog; yield (job, index of its first complete incident); stop it."""
    kw["extra_env"] = {**kw.get("extra_env", {}), "HANG_BACKEND": backend}
    job = launch(tmp_path, scenario, nproc, window=WINDOW, **kw)
    try:
        yield job, job.wait_incident(timeout=90)
        assert not false_warnings(job, ()), job.events()  # no setup warning in a job without a setup mistake
    finally:
        job.stop()


@pytest.mark.timeout(150)
def test_rank_conditional_collective_in_ddp_job(tmp_path, backend):
    with incident(tmp_path, "rank_conditional", 2, backend) as (job, index):
        f = stall(index)
        assert_rank_conditional_finding(f)
        # The branch named is the `if` that made the ranks differ, reached from the call's line.
        assert f["details"]["conditional_line"]["line"] == site_line("rank_branch")
        assert f["details"]["conditional_line"]["call_line"] == site_line("conditional_call")
        assert "if rank == 0" in f["summary"] and "never" not in f["summary"]
        assert f["seq"] == f["waiting_seq"]
        # The detection deadline: from the hang's onset to the findings on disk.
        assert index["detected"] - job.onset() < DEADLINE
        bundle = index["_path"]
        files = index["files"]
        for rank in (0, 1):
            assert f"stacks/rank-{rank:05d}.txt" in files
            assert f"rings/rank-{rank:05d}.ring" in files
            assert f"fr/rank-{rank:05d}.pkl" in files
        stack0 = open(f"{bundle}/stacks/rank-00000.txt").read()
        assert "validate" in stack0 and "py-spy ok" in stack0
        fr = json.load(open(f"{bundle}/fr/rank-00000.json"))
        assert any(e["op"] == "all_reduce" and e["op_id"] == f["seq"] for e in fr["entries"])  # gloo: op_id == seq
        assert "timeline.svg" in files
        if backend == "gloo_async":
            # The all_reduce returned; rank 0 waits three lines later, where it synchronises. The finding
            # names the all_reduce and says where the rank waits, without claiming it is inside the call.
            assert f["details"]["waits_at"]["0"]["line"] == site_line("validate_sync")
            assert "returned before it completed" in f["summary"]
            assert "rank 0 issued all_reduce" in f["summary"]
        else:
            assert "waits_at" not in f["details"] and "rank 0 is in all_reduce" in f["summary"]


@pytest.mark.timeout(150)
def test_tensor_parallel_job_initialised_by_init_device_mesh(tmp_path):
    # init_device_mesh creates the default group through the init_process_group it imported by name.
    script = SCRIPTS / "tp_mesh_hang.py"
    with incident(tmp_path, "tp_rank_conditional", 2, script=script) as (job, index):
        assert sorted(p.name for p in job.run_dir.glob("rank-*.ring")) == ["rank-00000.ring", "rank-00001.ring"]
        f = stall(index)
        assert f["kind"] == "rank_conditional"
        assert f["ranks"] == [0] and f["op"] == "barrier"
        assert f["site"]["file"] == str(script) and f["site"]["line"] == site_line("tp_barrier", script)
        assert f["waiting_ranks"] == [1] and f["waiting_op"] == "all_reduce"
        assert f["waiting_site"]["line"] == site_line("tp_metric", script)
        assert index["detected"] - job.onset() < DEADLINE


@pytest.mark.timeout(150)
def test_subgroup_collective_skipped_by_a_member(tmp_path, backend):
    with incident(tmp_path, "subgroup_skip", 3, backend) as (job, index):
        f = stall(index)
        assert f["kind"] == "rank_conditional"
        assert f["ranks"] == [0]
        assert f["group"] == "1"  # the subgroup, as torch names it
        assert f["op"] == "all_reduce"
        assert f["site"]["line"] == site_line("subgroup_all_reduce")
        assert f["details"]["skipped_by"] == [1]
        assert f["details"]["subgroup_members"] == [0, 1]
        if backend == "gloo":
            assert f["waiting_op"] == "barrier" and f["waiting_site"]["line"] == site_line("subgroup_barrier")
        else:
            # rank 0's subgroup all_reduce returned, so it reached the barrier, which completed; it then
            # blocks where it synchronises, and the others wait in the next step's all_reduce.
            assert f["waiting_op"] == "all_reduce" and f["waiting_site"]["line"] == site_line("world_all_reduce")
        assert sorted(f["waiting_ranks"]) == [1, 2]


@pytest.mark.timeout(150)
def test_uneven_iterations_warned_before_the_hang_and_diagnosed(tmp_path, backend):
    with incident(tmp_path, "uneven_ddp", 2, backend) as (job, index):
        f = stall(index)
        assert f["kind"] == "uneven_iterations"
        assert f["ranks"] == [1]
        loader = f["details"]["loaders"][0]
        assert loader["lengths"] == {"0": 8, "1": 6}
        assert loader["site"]["line"] == site_line("loader_loop")
        # Rank 0 waits in DDP's gradient all_reduce, issued from C++: torch's collective hooks recorded it
        # (torch >= 2.14), else the Flight Recorder names it.
        assert f["waiting_ranks"] == [0]
        assert f["waiting_op"] == "all_reduce"
        assert f["waiting_site"]["line"] == site_line("backward")
        if hooks.available():
            assert "issued_from_cpp" not in f["details"]
        else:
            assert "1" in f["details"]["issued_from_cpp"] or "0" in f["details"]["issued_from_cpp"]
        # The warning came once the loop had issued collectives per batch (its second batch), seconds before
        # the hang (rank 1 has 6 batches of 0.3 s).
        warnings = [e for e in job.events() if e["event"] == "warning" and e["kind"] == "uneven_iterations"]
        assert warnings and warnings[0]["ranks"] == [1]
        assert warnings[0]["detected"] < job.onset() - 0.5


@pytest.mark.timeout(150)
def test_rank_stuck_outside_collective_while_others_wait_in_ddp_allreduce(tmp_path, backend):
    with incident(tmp_path, "stuck_outside", 2, backend) as (job, index):
        f = stall(index)
        assert f["kind"] == "stuck_outside_collective"
        assert f["ranks"] == [1]
        assert f["site"]["line"] == site_line("stuck_sleep")
        assert f["site"]["function"] == "load_batch"
        assert f["waiting_ranks"] == [0]
        assert f["waiting_op"] == "all_reduce"  # DDP's, named from the Flight Recorder
        stack1 = open(f"{index['_path']}/stacks/rank-00001.txt").read()
        assert "load_batch" in stack1


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario, how", [
    ("exception", "raised ValueError: loss is NaN on rank 1"),
    ("killed", "ended without a Python exception or a normal exit (no exit was recorded"),
    # Its program returns; gloo's teardown may then abort the process (torch 2.8), which is told after it.
    ("returned", ("exited normally", "finished its program normally, then was aborted (SIGABRT")),
])
def test_rank_exited_while_others_wait(tmp_path, scenario, how, backend):
    # Plain processes (like srun): nobody tears the survivors down when a rank dies.
    with incident(tmp_path, scenario, 2, backend, torchrun=False) as (job, index):
        f = stall(index)
        assert f["ranks"] == [1]
        assert any(h in f["summary"] for h in ((how,) if isinstance(how, str) else how)), f["summary"]
        assert f["op"] == "all_reduce"
        assert f["waiting_ranks"] == [0] and f["waiting_op"] == "all_reduce"
        assert f["kind"] == "rank_exited"
        if scenario == "returned":
            # A clean exit from inside the loop the others are still in: the `return` (under the rank
            # test) is the root-cause line.
            assert f["site"]["line"] == site_line("return_early")
            assert f["details"]["conditional_line"]["line"] == site_line("exit_branch")
            return
        assert f["details"]["last_call_site"]["line"] == site_line("exit_all_reduce")
        # The root-cause line: where the exception was raised, else the last collective.
        assert f["site"]["line"] == site_line("raise" if scenario == "exception" else "exit_all_reduce")
        if scenario == "exception":
            assert f"hang_worker.py:{site_line('raise')}" in f["details"]["exit_reason"]


@pytest.mark.timeout(150)
def test_op_mismatch_at_same_sequence_number(tmp_path, backend):
    with incident(tmp_path, "mismatch", 3, backend) as (job, index):
        f = stall(index)
        assert f["kind"] == "mismatch"
        assert f["ranks"] == [1]
        assert f["site"]["line"] == site_line("mismatch_line")
        fps = f["details"]["fingerprints"]
        assert fps["barrier[unknown:]"] == [1]
        assert fps["all_reduce[float32:4]"] == [0, 2]


@pytest.mark.timeout(150)
def test_shape_mismatch_that_crashes_gloo_is_explained(tmp_path, backend):
    # gloo aborts one rank ("Received data size doesn't match") and torchrun tears the others down.
    with incident(tmp_path, "shape_mismatch", 3, backend) as (job, index):
        f = stall(index)
        assert f["kind"] == "mismatch"
        assert f["ranks"] == [1]
        assert f["site"]["line"] == site_line("shape_mismatch")
        assert f["details"]["fingerprints"] == {"all_reduce[float32:4]": [1], "all_reduce[float32:8]": [0, 2]}
        assert "the job then crashed" in f["summary"]


@pytest.mark.timeout(150)
def test_wedged_rank_sigstop_is_unresponsive(tmp_path, backend):
    with incident(tmp_path, "sigstop", 2, backend, torchrun=False) as (job, index):  # stop() sends SIGCONT first
        f = stall(index)
        assert f["kind"] == "unresponsive"
        assert f["ranks"] == [1]
        assert f["details"]["proc_state"] == "T"
        assert f["waiting_ranks"] == [0] and f["waiting_op"] == "all_reduce"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", ["healthy_quiet", "healthy_fsdp", "join_uneven"])
def test_healthy_run_with_quiet_gaps_raises_no_stall(tmp_path, scenario, backend):
    # DDP and FSDP2 training with a quiet gap on every rank longer than the window; DDP with uneven
    # inputs under torch's Join (legitimately asymmetric collectives: no desync).
    job = launch(tmp_path, scenario, 2, window=3.0, extra_env={"QUIET_SECONDS": "7", "HANG_BACKEND": backend})
    try:
        codes = job.wait_exit(timeout=180)
        assert codes == [0], job.watchdog_log()
        job.watchdog.wait(timeout=30)
        assert job.bundles() == []
        assert not [e for e in job.events() if e["event"] == "stall"]
        assert not false_warnings(job, ("desync", "mismatch", "straggler")), job.events()
    finally:
        job.stop()


@pytest.mark.timing
@pytest.mark.timeout(240)
def test_straggler_is_a_warning_not_a_stall(tmp_path):
    # Rank 2 enters every step's all_reduce (Python-issued, one per dtwatch.step()) 120 ms late; the warning
    # waits until the same rank was named at every look for straggler.HOLD seconds, so the job trains for 15 s.
    job = launch(tmp_path, "allreduce", 3, window=3.0, script=SCRIPTS / "straggler_worker.py",
                 extra_env={"RUN_SECONDS": "15", "STEP_MS": "100", "SLOW_RANK": "2", "SLOW_FRACTION": "1.2"})
    try:
        assert job.wait_exit(timeout=180) == [0]
        job.watchdog.wait(timeout=30)
        assert job.bundles() == []
        warnings = [e for e in job.events() if e["event"] == "warning" and e["kind"] == "straggler"]
        assert warnings, job.watchdog_log()
        assert not false_warnings(job), false_warnings(job)
        assert warnings[0]["ranks"] == [2]
        assert warnings[0]["details"]["median_lag_s"]["2"] > 0.08
        # The analyzer lists the warning the watchdog issued while the job ran, as it was issued.
        out = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", "--json", str(job.run_dir)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        listed = [w for w in json.loads(out.stdout)["warnings"] if w["kind"] == "straggler"]
        assert len(listed) == 1 and listed[0]["issued"] == "live"
        assert listed[0]["ranks"] == [2] and listed[0]["detected"] == warnings[0]["detected"]
        text = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", str(job.run_dir)],
                              capture_output=True, text=True, timeout=60).stdout
        section = text.split("WARNINGS", 1)[1]
        assert "[straggler]" in section and "(issued by the watchdog at" in section
    finally:
        job.stop()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario, nproc, backend, marker", [
    ("extra_call", 3, "gloo", "extra_all_reduce"),
    ("extra_call", 2, "gloo_async", "extra_all_reduce"),  # two equal sides: the rank test decides
    ("extra_call_helper", 3, "gloo", "helper_all_reduce"),
    ("extra_call_library", 3, "gloo", "extra_library_call"),  # the user's line that called the library
    ("extra_call_ddp", 3, "gloo", "extra_bucket_all_reduce"),  # pairs with DDP's C++-issued all-reduce
])
def test_extra_same_shape_collective_is_a_silent_desync_named_before_any_hang(tmp_path, scenario, nproc, backend,
                                                                              marker):
    # Rank 1 issues one extra all_reduce at step 6; it pairs with the others' next one and nothing hangs
    # until the end of the job (when rank 1, one call ahead, waits alone).
    job = launch(tmp_path, scenario, nproc, window=WINDOW, extra_env={"HANG_BACKEND": backend})
    try:
        index = job.wait_incident(timeout=90)  # the final hang
        desyncs = [e for e in job.events() if e["event"] == "warning" and e["kind"] == "desync"]
        assert len(desyncs) == 1, job.watchdog_log()
        d = desyncs[0]
        assert d["ranks"] == [1] and d["op"] == "all_reduce" and d["group"] == "0"
        assert d["site"]["line"] == site_line(marker)
        assert d["details"]["silent"] is True
        if scenario == "extra_call_ddp" and hooks.available():
            # DDP's gradient all_reduce is recorded from torch's hooks, named, under backward()'s line: the
            # program-order rule names the extra call and what it paired with; nobody waits yet.
            assert d["details"]["pattern"] == "extra_call" and d["waiting_ranks"] == []
            assert "rank 1 made an extra call" in d["summary"] and "which ranks 0,2 did not make" in d["summary"]
            assert f"hang_worker.py:{site_line('backward')} in train_step" in d["summary"]
        else:
            assert d["waiting_ranks"] == [r for r in range(nproc) if r != 1]
            if scenario == "extra_call_ddp":
                assert d["waiting_op"] == "cpp_collective" and d["details"]["pattern"] == "python_vs_cpp"
            else:
                assert d["waiting_site"]["line"] == site_line("loop_all_reduce")
                assert d["details"]["pattern"] == "shifted"
            assert "rank 1 deviates" in d["summary"]
        assert d["detected"] - job.onset() < 10.0
        assert d["detected"] < index["detected"] - 2.0  # long before the hang at the end
    finally:
        job.stop()


@pytest.mark.timing
@pytest.mark.timeout(200)
@pytest.mark.parametrize("model, lag", [("ddp", 0.2), ("ddp", 0.08), ("fsdp", 0.08)])
def test_straggler_in_ddp_and_fsdp_is_named_within_a_minute(tmp_path, model, lag):
    # The last rank's input pipeline is `lag` seconds slower every step (steps take ~0.25 s: 0.08 s is about
    # 30 % slower). DDP's all-reduces are issued from C++: their issue times come from the ranks' sequence
    # clocks. A lag under 15 % of a step (or 20 ms, timed by the sequence clocks) is never named.
    started = time.time()
    job = launch(tmp_path, "slow_input", 3, window=WINDOW,
                 extra_env={"MODEL": model, "STRAGGLER_LAG": str(lag), "STEPS": "50"})
    try:
        assert job.wait_exit(timeout=180) == [0], job.watchdog_log()
        job.watchdog.wait(timeout=30)
        assert job.bundles() == []
        warnings = [e for e in job.events() if e["event"] == "warning" and e["kind"] == "straggler"]
        assert len(warnings) == 1, job.events()
        w = warnings[0]
        assert w["ranks"] == [2]
        assert w["detected"] - started < 60
        assert lag * 0.7 <= w["details"]["straggler_lag_s"] <= lag + 0.05
        assert not false_warnings(job), false_warnings(job)
    finally:
        job.stop()


@pytest.mark.timing
@pytest.mark.timeout(200)
def test_ranks_taking_turns_being_slow_are_not_a_straggler(tmp_path):
    # The slow rank changes every step: each is last in a third of the steps, far from the rule's 90 %
    # (tests/test_straggler.py checks turns of several lengths on synthetic series, deterministically).
    job = launch(tmp_path, "slow_input", 3, window=WINDOW,
                 extra_env={"TURNS": "1", "STRAGGLER_LAG": "0.1", "STEPS": "40"})
    try:
        assert job.wait_exit(timeout=180) == [0], job.watchdog_log()
        job.watchdog.wait(timeout=30)
        assert not false_warnings(job, ("straggler", "desync", "mismatch")), job.events()
    finally:
        job.stop()
