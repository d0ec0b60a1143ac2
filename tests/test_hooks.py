"""Collectives torch issues itself (functional collectives, tensor parallel, compiled graphs, DDP's reducer),
recorded from torch >= 2.14's collective hooks (dtwatch.record.hooks), against real gloo / gloo_async jobs.

On an older torch the hooks do not exist and these tests are skipped: the sampler's sequence numbers and the
Flight Recorder cover such calls there (tests/test_flight.py). CI runs the whole suite on torch 2.15.
"""
from __future__ import annotations

import pytest

from dtwatch.record import hooks
from tests.harness import SCRIPTS, launch, site_line
from tests.test_recorder import site_lines
from tests.tools import ON_CI


@pytest.fixture(autouse=True)
def _collective_hooks() -> None:
    """Checked per test that runs (not at collection: an older torch's run in CI collects this file and deselects
    its tests, none of which is marked torch_versions). CI runs them on torch 2.15 (.ci/run): missing there, fail."""
    if not hooks.available():
        if ON_CI:
            pytest.fail("CI runs these on a torch with collective hooks (>= 2.14); this one has none", pytrace=False)
        pytest.skip("this torch has no collective hooks (torch < 2.14)")


FUNCTIONAL = SCRIPTS / "functional_hang.py"


@pytest.fixture(params=["gloo", "gloo_async"])
def backend(request) -> str:
    return request.param


def by_site(snap) -> dict[int, list]:
    out: dict[int, list] = {}
    for r in snap.records_list():
        if not r.is_marker:
            out.setdefault(r.user_site.line if r.user_site else 0, []).append(r)
    return out


@pytest.mark.timeout(150)
def test_calls_torch_issues_are_recorded_once_with_op_shape_and_the_users_line(torchrun, backend):
    job = torchrun("rec_hooks.py", 2, env={"HANG_BACKEND": backend})
    lines = site_lines("rec_hooks.py")
    for rank in range(2):
        snap, res = job.ring(rank), job.result(rank)
        at = by_site(snap)
        # A wrapped call is recorded by the wrapper alone, not a second time by the hook.
        (eager,) = at[lines["eager"]]
        assert not eager.hooked and eager.op == "all_reduce" and eager.seq == res["seq"]["eager"]
        # A functional all_reduce: named, shaped, numbered like torch, at the user's line.
        (functional,) = at[lines["functional"]]
        assert functional.hooked and (functional.op, functional.shape, functional.dtype) == (
            "all_reduce", (4, 3), "float32")
        assert functional.seq == res["seq"]["functional"] and functional.site.line == lines["functional"]
        assert not functional.in_flight
        (gather,) = at[lines["functional_gather"]]
        # (torch 2.14 names it all_gather; 2.15 a coalesced all_gather_into_tensor of one tensor, recorded as the
        # plain op)
        assert gather.hooked and gather.op in ("all_gather", "all_gather_into_tensor") and gather.shape == (2, 5)
        # An object collective: one record spanning its inner calls, none of them recorded again.
        (obj,) = at[lines["object"]]
        assert not obj.hooked and obj.op == "all_gather_object" and obj.last_seq == res["seq"]["object"]
        # DDP's calls from C++: its set-up broadcasts under the wrap's line, the gradient all_reduce under backward().
        wrap = at[lines["ddp_wrap"]]
        assert wrap and all(r.hooked for r in wrap) and "broadcast" in {r.op for r in wrap}
        assert wrap[-1].last_seq == res["seq"]["ddp_wrap"]
        (grads,) = at[lines["ddp_backward"]]
        assert grads.hooked and grads.op == "all_reduce" and grads.seq == res["seq"]["ddp_backward"]
        # A group no Python collective ever used, hooked when torch registered it: from its first call.
        (sub,) = at[lines["subgroup_functional"]]
        assert sub.hooked and sub.group == res["subgroup"] and sub.seq == 1 and sub.shape == (7,)
        # Every number of the default group is covered by exactly one record.
        default = sorted(s for r in snap.records_list() if not r.is_marker and r.group == "0"
                         for s in range(r.seq, r.last_seq + 1))
        assert default == list(range(1, res["seq"]["barrier"] + 1))


@pytest.mark.timeout(150)
def test_hooks_switched_off_leave_the_wrapper_alone(torchrun):
    job = torchrun("rec_hooks.py", 2, env={"DTWATCH_COLLECTIVE_HOOKS": "off"})
    lines = site_lines("rec_hooks.py")
    at = by_site(job.ring(0))
    assert not any(r.hooked for rs in at.values() for r in rs)
    assert lines["functional"] not in at and lines["eager"] in at


def first_stall(job) -> dict:
    """The findings of the first notice (the console's and the event stream's), before any evidence."""
    stalls = [e for e in job.events() if e["event"] == "stall"]
    assert stalls, job.watchdog_log()
    return stalls[0]["findings"][0]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario", ["tp_eval_on_rank0", "compiled_eval_on_rank0"])
def test_functional_collective_under_a_rank_test_is_named_in_the_first_notice(tmp_path, backend, scenario):
    # Rank 0 alone runs an evaluation forward whose all_reduce torch issues (DTensor's row-wise layer, or a
    # compiled graph's functional all_reduce); rank 1 waits in the barrier after it.
    job = launch(tmp_path, scenario, 2, window=4.0, script=FUNCTIONAL, extra_env={"HANG_BACKEND": backend})
    try:
        job.wait_incident(timeout=90)
        f = first_stall(job)
        assert f["kind"] == "rank_conditional", f
        assert f["ranks"] == [0] and f["op"] == "all_reduce"
        assert f["site"]["line"] == site_line("eval_forward", FUNCTIONAL)
        assert f["waiting_ranks"] == [1] and f["waiting_op"] == "barrier"
        assert f["waiting_site"]["line"] == site_line("eval_barrier", FUNCTIONAL)
        # Named from the ring, with no Flight Recorder dump and no "issued from C++" placeholder.
        assert "issued_from_cpp" not in f["details"]
        assert "all_reduce" in f["summary"] and "C++" not in f["summary"]
    finally:
        job.stop()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario", ["tp_healthy", "compiled_healthy"])
def test_healthy_functional_jobs_raise_nothing(tmp_path, scenario):
    job = launch(tmp_path, scenario, 2, window=4.0, script=FUNCTIONAL)
    try:
        assert job.wait_exit(timeout=120) == [0]
        assert not [e for e in job.events() if e["event"] in ("stall", "warning")], job.events()
    finally:
        job.stop()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario", ["tp_eval_every_step_on_rank0", "tp_eval_every_step_on_rank0_own_model"])
def test_an_extra_tensor_parallel_forward_that_pairs_silently_is_named_with_its_rank_test(tmp_path, scenario):
    # Rank 0 runs an evaluation forward of the training batch's shape after every step: its all_reduce pairs with
    # rank 1's next training call, rank 1 runs through its loop on rank 0's calls and exits; rank 0 then fails.
    # With a model class of the user's own, both forwards run through its forward line: the line that called the
    # model tells them apart.
    job = launch(tmp_path, scenario, 2, window=4.0, script=FUNCTIONAL)
    try:
        job.wait_incident(timeout=90)
        f = first_stall(job)
        assert f["kind"] == "rank_conditional" and f["ranks"] == [0] and f["op"] == "all_reduce", f
        assert f["site"]["line"] == site_line("every_step_eval", FUNCTIONAL)
        assert "rank test" in f["summary"] and f"functional_hang.py:{site_line('every_step_branch', FUNCTIONAL)}" in \
            f["summary"]
        assert "as many optimizer steps" not in f["summary"]
        # The ends are told in the order they came: rank 1's clean exit closed the connection rank 0 failed on. On a
        # loaded machine the watchdog may decide before gloo tells rank 0 (it still waits): then no raise is told.
        assert "rank 1 then exited" in f["summary"]
        if "rank 0 then raised" in f["summary"]:
            assert f["summary"].index("rank 1 then exited") < f["summary"].index("rank 0 then raised")
    finally:
        job.stop()
