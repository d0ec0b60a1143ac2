"""Completion is tracked, not assumed: on backends whose collectives return before they complete
(NCCL; gloo_async in tests), a call stays in flight until its group reports it completed.

A real 2-rank gloo_async job checks the recorder end to end; the rest is the pure logic (watermarks,
ring fields, where a rank is blocked)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from dtwatch.diagnose.positions import completed_by_peers, positions, waiting_call
from dtwatch.diagnose.rank_state import CPP_OP, Call, GroupProgress, RankState, from_snapshot
from dtwatch.record.completion import _dump_entries, is_nccl, never_listed, watermark, watermarks
from dtwatch.record.torchenv import flight_recorder_on
from dtwatch.ring import FLAG_ENQUEUED, RingWriter, read_ring
from tests.conftest import init_world1

pytestmark = pytest.mark.torch_versions  # also run on the oldest torch the README claims (.ci/run)


# ---------------------------------------------------------------------------------------------------
# the recorder, in a real job
# ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_returned_collective_stays_in_flight_until_it_completed(torchrun):
    job = torchrun("rec_completion.py", 2)
    seen = json.loads((job.out_dir / "rank-0.json").read_text())

    returned = seen["returned"]
    assert returned["group"]["tracked"] is True
    (rec,) = [r for r in returned["records"] if r["op"] == "all_reduce"]
    # The call returned 0.6 s ago, but rank 1 joins 1.5 s late: the work has not completed.
    assert rec["in_flight"] and rec["flags"] & FLAG_ENQUEUED
    assert returned["group"]["completed_seq"] < rec["seq"]

    synced = seen["synchronized"]
    assert not synced["records"][0]["in_flight"]
    assert synced["group"]["completed_seq"] >= rec["seq"]

    # async_op work: the user's wait() returned (NCCL's semantics), the work had not completed.
    (async_rec,) = [r for r in seen["async_waited"]["records"] if r["op"] == "all_reduce" and r["seq"] > rec["seq"]]
    assert async_rec["in_flight"] and not async_rec["flags"] & FLAG_ENQUEUED

    # A barrier blocks on NCCL: it completed when it returned; nothing is left in flight.
    barrier = [r for r in seen["after_barrier"]["records"] if r["op"] == "barrier"]
    assert barrier and not barrier[0]["in_flight"] and not barrier[0]["flags"] & FLAG_ENQUEUED
    assert not any(r["in_flight"] for r in seen["settled"]["records"])


# ---------------------------------------------------------------------------------------------------
# pure logic
# ---------------------------------------------------------------------------------------------------
def test_watermark_is_the_last_seq_before_the_oldest_active_one():
    assert watermark(5, []) == 5
    assert watermark(5, [4, 3]) == 2
    assert watermark(0, []) == 0
    assert watermark(7, [1]) == 0


def test_watermarks_from_nccl_flight_recorder_active_entries():
    # The shape of torch's entries (onlyActive=True): still-running work of two groups and a p2p op.
    entries = [
        {"process_group": ("0", "default_pg"), "collective_seq_id": 8, "p2p_seq_id": 0, "is_p2p": False,
         "state": "started", "profiling_name": "nccl:all_reduce"},
        {"process_group": ("0", "default_pg"), "collective_seq_id": 9, "p2p_seq_id": 0, "is_p2p": False,
         "state": "scheduled", "profiling_name": "nccl:all_reduce"},
        {"process_group": ("1", "tp"), "collective_seq_id": 0, "p2p_seq_id": 4, "is_p2p": True,
         "state": "scheduled", "profiling_name": "nccl:send"},
    ]
    assert watermarks({"0": 9, "1": 5, "2": 3}, entries) == {"0": 7, "1": 5, "2": 3}


def test_nccl_groups_of_every_spelling_are_tracked_and_a_group_no_recorder_lists_is_found():
    # torch 2.15: "nccl" builds nccl2; "nccl2", "nccl-legacy" and "nccl-lazy" name the kinds explicitly.
    assert all(is_nccl(b) for b in ("nccl", "nccl2", "nccl-legacy", "nccl-lazy", "NCCL"))
    assert not any(is_nccl(b) for b in ("gloo", "gloo_async", "mpi", "ucc", "?"))
    # A group whose collectives no recorder lists (e.g. a Flight Recorder hook missing on nccl2) must not pass
    # as "nothing active, so all completed".
    entries = [{"process_group": ("0", "default_pg"), "collective_seq_id": 3, "state": "completed"}]
    assert never_listed({"0", "1"}, entries) == {"1"}
    assert never_listed({"0"}, []) == {"0"}


def test_flight_recorder_dumps_are_read_from_every_recorder(dtwatch_env, monkeypatch):
    # gloo feeds the generic recorder (as nccl2 does, through its hook): read with NCCL's, merged.
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    init_world1()
    dist.all_reduce(torch.ones(3))
    entries = _dump_entries(only_active=False)
    assert entries is not None
    assert any(str(e["process_group"][0]) == "0" for e in entries)
    assert never_listed({"0"}, entries) == set()


def test_flight_recorder_on_reads_either_spelling():
    assert flight_recorder_on({"TORCH_FR_BUFFER_SIZE": "2000"})
    assert flight_recorder_on({"TORCH_NCCL_TRACE_BUFFER_SIZE": "20"})
    assert not flight_recorder_on({"TORCH_FR_BUFFER_SIZE": "0"})
    assert not flight_recorder_on({})
    assert not flight_recorder_on({"TORCH_FR_BUFFER_SIZE": "lots"})


def test_ring_keeps_a_tracked_groups_completions(tmp_path):
    w = RingWriter(tmp_path / "rank-00000.ring", rank=0, local_rank=0, world_size=2, job_id="j", host="h",
                   backend="nccl")
    w.add_group("0", "default_pg", [0, 1], 0)
    tracked = w.add_group("1", "tp", [0, 1], 0, tracked=True)
    w.set_group_cpp_seq(tracked, 9, 100.0)
    w.set_group_completed(tracked, 7, 101.0)
    snap = read_ring(w.path)
    g0, g1 = snap.groups
    assert (g0.tracked, g0.completed_seq) == (False, 0)
    assert (g1.tracked, g1.completed_seq, g1.completed_time, g1.cpp_seq) == (True, 7, 101.0, 9)
    state = from_snapshot(snap)
    assert state.groups["1"].tracked and state.groups["1"].completed == 7
    assert state.last_activity >= 101.0
    w.close()


def _state(rank: int, groups: dict, open_calls: list[Call] | None = None) -> RankState:
    return RankState(
        rank=rank, local_rank=rank, world_size=2, host="h", pid=1, job_id="j", start_time=0.0, restart_count=0,
        backend="nccl", alive=True, proc_state="S", exit_state="running", exit_reason="", exit_time=0.0,
        heartbeat_time=100.0, step=3, step_time=0.0, groups=groups, open_calls=open_calls or [], main_site=None,
        main_top_site=None, main_site_since=0.0, main_stack=[], loaders=[], last_activity=50.0, stack_signal=0,
        device_index=rank, gpu_uuid="", ring_path="",
    )


def _group(seq: int, completed: int, py_seq: int = 0, tracked: bool = True) -> dict:
    return {"0": GroupProgress(name="0", members=[0, 1], seq=seq, completed=completed, py_seq=py_seq,
                               cpp_seq=seq, cpp_seq_time=40.0, tracked=tracked)}


def test_tracked_group_names_the_oldest_collective_not_completed():
    # DDP's all-reduces (C++) up to seq 9 issued; 7 completed: the rank is blocked in seq 8.
    s = _state(0, _group(9, 7))
    call = waiting_call(s)
    assert call is not None and call.op == CPP_OP and call.seq == 8
    # A Python call that returned at seq 8 and has not completed: that one is named.
    mine = Call("all_reduce", "0", 8, {"file": "t.py", "line": 3, "function": "f"}, 30.0, is_async=True,
                enqueued=True)
    s = _state(0, _group(9, 7, py_seq=8), [mine])
    assert waiting_call(s) is mine
    # Everything completed: nothing to wait for, the rank is outside any collective.
    s = _state(0, _group(9, 9))
    assert waiting_call(s) is None
    assert positions([s], 100.0, 5.0)[0].state == "outside"


def test_untracked_group_is_unchanged():
    # gloo: completion = the call returned; a C++ seq ahead of Python's with no peers behind is done.
    s = _state(0, _group(9, 7, tracked=False))
    assert waiting_call(s) is None


def test_a_call_every_peer_completed_completed_here_too():
    # Rank 1 was stopped before its sampler saw seq 4 complete; rank 0 completed up to 6.
    late = Call("all_reduce", "0", 4, None, 10.0, is_async=True, enqueued=True)
    r1 = _state(1, _group(4, 3), [late])
    r0 = _state(0, _group(6, 6))
    by_rank = {0: r0, 1: r1}
    assert completed_by_peers(late, r1, by_rank)
    assert waiting_call(r1, by_rank) is None
    stuck = Call("all_reduce", "0", 7, None, 10.0, is_async=True, enqueued=True)
    assert not completed_by_peers(stuck, r1, by_rank)
