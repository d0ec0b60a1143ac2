"""How ranks ended, on recorded incidents varied one fact at a time: every rank failing at start is a
CRASH finding (with its cause where the ranks' devices or the error name one), an interrupt of every rank
or a preemption is none; an exit status is an error, a clean exit is not."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from dtwatch.diagnose import diagnose_fixture
from dtwatch.diagnose.exits import Told, same_error, tell
from dtwatch.diagnose.rank_state import RankState

INCIDENTS = Path(__file__).parent / "incidents"


def fixture(name: str) -> dict:
    return json.loads((INCIDENTS / f"{name}.json").read_text())


def test_every_rank_failing_in_its_first_collective_is_one_crash_finding():
    [f] = diagnose_fixture(fixture("exit_every_rank_at_start"))
    assert f.kind == "rank_exited" and f.ranks == [0, 1, 2, 3]
    assert f.summary.startswith("every rank raised RuntimeError: ProcessGroupGloo::allgather: invalid output tensor")
    assert "(in its first collective)" in f.summary
    assert f.site["file"].endswith("exited.py") and "share one GPU" not in f.summary  # no cause invented


def test_two_ranks_on_one_gpu_are_named_as_the_cause():
    fx = fixture("exit_every_rank_at_start")
    for s in fx["states"]:
        s["gpu_uuid"] = "GPU-aaaa" if s["rank"] in (0, 1) else f"GPU-{s['rank']}"
    [f] = diagnose_fixture(fx)
    assert "ranks 0-1 share one GPU" in f.summary and f.details["cause"].startswith("ranks 0-1 share one GPU")
    # counter-case: one GPU each is no cause
    for s in fx["states"]:
        s["gpu_uuid"] = f"GPU-{s['rank']}"
    [f] = diagnose_fixture(fx)
    assert "share one GPU" not in f.summary and "cause" not in f.details


def test_nccl_saying_two_ranks_share_a_gpu_is_the_cause():
    fx = fixture("exit_every_rank_at_start")
    for s in fx["states"]:
        facts = fx["endings"][str(s["rank"])]["exit"]
        facts["type"] = "DistBackendError"
        facts["message"] = ("NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage, NCCL version 2.21.5\n"
                            "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
                            f"Duplicate GPU detected : rank {s['rank']} and rank {(s['rank'] + 1) % 4} both on CUDA "
                            "device 1000")
    [f] = diagnose_fixture(fx)
    assert f.summary.startswith("every rank raised DistBackendError")
    assert "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1000" in f.summary  # the key line kept
    assert "the error says two ranks use the same GPU" in f.summary


def test_every_rank_interrupted_or_terminated_is_no_finding():
    fx = fixture("exit_every_rank_at_start")
    for s in fx["states"]:
        fx["endings"][str(s["rank"])]["exit"] = {"how": "exception", "type": "KeyboardInterrupt", "message": "",
                                                 "frames": []}
    assert diagnose_fixture(fx) == []
    fx = fixture("exit_every_rank_at_start")
    for s in fx["states"]:  # the scheduler's SIGTERM: nothing recorded in the ring, faulthandler's note
        s.update(exit_state="running", exit_reason="", alive=False)
        fx["endings"][str(s["rank"])] = {"signal": "SIGTERM", "text": "", "frames": []}
    assert diagnose_fixture(fx) == []


def test_different_errors_are_told_per_group_of_ranks():
    fx = fixture("exit_every_rank_at_start")
    fx["endings"]["3"]["exit"] = {"how": "exception", "type": "OSError", "message": "No space left on device",
                                  "frames": [{"file": "tests/scenarios/exited.py", "line": 199, "function": "x"}]}
    [f] = diagnose_fixture(fx)
    assert f.summary.startswith("ranks 0-2 raised RuntimeError")
    assert "rank 3 raised OSError: No space left on device at tests/scenarios/exited.py:199" in f.summary


def states_of(name: str) -> dict[int, RankState]:
    return {s["rank"]: RankState.from_dict(s) for s in fixture(name)["states"]}


def test_an_exit_status_is_an_error_and_a_clean_exit_is_not():
    fx = fixture("exit_sys_exit_object")
    s = states_of("exit_sys_exit_object")[2]
    told = tell(s, fx["endings"]["2"], lambda path: "site-packages" in path)
    assert told.failed and told.text == "exited with status 2 through sys.exit(2)"
    assert told.site["line"] == fx["truth"]["line"] and not s.clean_exit  # the sys.exit line
    clean = copy.deepcopy(s)
    clean.exit_code = 0
    told = tell(clean, None, lambda path: False)
    assert not told.failed and clean.clean_exit and told.text.startswith("exited normally")


def test_a_runner_that_turns_an_error_into_an_exit_status_is_told_with_the_error():
    fx = fixture("exit_runner_sys_exit_1")
    s = {x["rank"]: RankState.from_dict(x) for x in fx["states"]}[2]
    told = tell(s, fx["endings"]["2"], lambda path: "minilib" in path or "site-packages" in path)
    assert told.text == ("exited with status 1 through sys.exit(1) while handling ValueError: learning rate must be "
                         "positive, got -0.1")
    assert told.site["function"] == "task"  # the line that raised, not the runner's sys.exit


def test_errors_that_differ_only_in_numbers_are_the_same():
    a = Told("raised X", None, error="RuntimeError: Connection closed by peer [127.0.0.1]:29417.")
    b = Told("raised X", None, error="RuntimeError: Connection closed by peer [127.0.0.1]:61123.")
    c = Told("raised X", None, error="RuntimeError: Connection reset by peer")
    assert same_error(a, b) and not same_error(a, c)


def test_an_error_exit_while_handling_a_peers_death_is_not_the_root():
    # A runner that turns every error into sys.exit(1) also turns "Connection reset by peer" into one: that
    # rank ended because a peer did, as a rank that raised the peer error itself.
    fx = fixture("exit_runner_sys_exit_1")
    handling = fx["endings"]["2"]["exit"]["handling"]
    [f] = diagnose_fixture(fx)
    assert f.ranks == [2] and f.kind == "rank_exited"
    handling["type"], handling["message"] = "RuntimeError", "[pair.cc:537] Read error: Connection reset by peer"
    rank0 = next(s for s in fx["states"] if s["rank"] == 0)  # the peer that died: gloo aborted it
    rank0.update(alive=False, exit_state="running")
    fx["endings"]["0"] = {"signal": "SIGABRT", "text": "Fatal Python error: Aborted", "frames": []}
    [f] = diagnose_fixture(fx)
    assert f.kind == "rank_exited" and f.ranks == [0] and f.summary.startswith("rank 0 was aborted (SIGABRT")


def test_a_rank_that_failed_inside_a_cpp_issued_call_on_a_peers_death_names_its_line():
    # Ranks 0, 2 and 3 waited in DDP's all-reduce (issued from C++) until rank 1's exit closed the
    # connection: the traceback of that peer error is where the call was, loss.backward().
    [f] = diagnose_fixture(fixture("exit_ddp_unused_parameters"))
    assert f.waiting_ranks == [0, 2, 3] and f.waiting_op == "cpp_collective"
    assert "loss.backward()" in f.waiting_site["source"]
    assert "waited in a collective issued from C++ (DDP/FSDP) (group 0, seq 8) at tests/scenarios/exited.py" \
        in f.summary
    # counter-case: the culprit raised its own error, not a peer's: its last C++ call gets no line from it
    assert "its last collective was a collective issued from C++ (DDP/FSDP) (group 0, seq 7);" in f.summary


def test_a_signal_beside_a_normal_exit_is_placed_before_or_after_it_by_its_frames():
    """faulthandler's dump of a signal that came once no Python frame ran (the interpreter's teardown) follows
    the exit; one with the program's frames came while it ran, and its own handler let it exit."""
    from dtwatch.diagnose.context import ending_text

    s = copy.deepcopy(states_of("exit_sys_exit_object")[2])
    s.exit_code, s.exit_reason = 0, "process exited normally"
    assert ending_text(s, None).startswith("exited normally (no exception, exit status or signal was recorded)")
    teardown = ending_text(s, {"signal": "SIGABRT", "frames": []})
    assert teardown.startswith("finished its program normally, then was aborted (SIGABRT")
    assert teardown.endswith("as its interpreter shut down")
    handled = ending_text(s, {"signal": "SIGTERM", "frames": [{"file": "train.py", "line": 9, "function": "main"}]})
    assert handled == "exited normally (no exception or exit status was recorded), having received SIGTERM while it ran"
    assert "then" not in handled
