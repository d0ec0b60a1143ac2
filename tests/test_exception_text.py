"""How an exception is told: cut at a sentence, the facts of a long torch error kept, a DataLoader
worker's original exception and line found; the exit calls the recorder notes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dtwatch.exception_text import fit_utf8, key_lines, raised, short_message, worker_origin
from dtwatch.record.endings import exception_summary

# DDP's error on the next forward after a step where some parameters got no gradient (torch 2.13, verbatim).
DDP_UNUSED = (
    "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
    "that your module has parameters that were not used in producing loss. You can enable unused parameter "
    "detection by passing the keyword argument `find_unused_parameters=True` to "
    "`torch.nn.parallel.DistributedDataParallel`, and by \nmaking sure all `forward` function outputs participate "
    "in calculating loss. \nIf you already have done the above, then the distributed data parallel module wasn't "
    "able to locate the output tensors in the return value of your module's `forward` function. Please include the "
    "loss function and the structure of the return value of `forward` of your module when reporting this issue "
    "(e.g. list, dict, iterable).\nParameter indices which did not receive grad for rank 1: 2 3 4 5 6 7\n In "
    "addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL to print out "
    "information about which particular parameters did not receive gradient on this rank as part of this error"
)
GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:52613. This is typically caused by a remote worker crashing. Check the logs of the "
               "remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
NCCL_DUPLICATE = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, invalid usage "
                  "(run with NCCL_DEBUG=WARN for details), NCCL version 2.21.5\nncclInvalidUsage: This usually "
                  "reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 "
                  "both on CUDA device 1000")


def test_a_long_torch_error_keeps_its_first_sentence_and_its_facts():
    told = short_message(DDP_UNUSED, 200)
    assert told.startswith("Expected to have finished reduction in the prior iteration before starting a new one.")
    assert told.endswith("Parameter indices which did not receive grad for rank 1: 2 3 4 5 6 7")
    assert "..." in told and "TORCH_DISTRIBUTED_DEBUG" not in told  # the advice is cut, between sentences
    duplicate = "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"
    assert short_message(NCCL_DUPLICATE, 120).endswith(duplicate)


def test_a_message_is_cut_between_sentences_never_inside_one():
    told = short_message(GLOO_CLOSED, 120)
    assert told == ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                    "[127.0.0.1]:52613. ...")
    # counter-cases: a short message is told as it is; a file name or version is no sentence end
    assert short_message("loss is NaN at step 3", 120) == "loss is NaN at step 3"
    assert short_message("bad value in model.py:12 for torch 2.15", 20) == "bad value in model.py:12 for torch 2.15"
    assert key_lines("no facts here. Just advice.") == []
    assert short_message("") == ""


def test_one_very_long_sentence_is_cut_at_a_word_with_an_ellipsis():
    long = "word " * 400
    told = short_message(long, 100)
    assert len(told) <= 305 and told.endswith(" ...") and "wor ..." not in told


def test_a_dataloader_worker_exception_is_told_as_the_original():
    message = ("Caught ValueError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
               '  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", line 374, '
               'in _worker_loop\n'
               "    data = fetcher.fetch(index)\n"
               '  File "/job/data.py", line 21, in __getitem__\n'
               '    raise ValueError(f"corrupt sample {i}")\n'
               "ValueError: corrupt sample 1261\n")
    told = worker_origin("ValueError", message)
    assert told is not None and told.type == "ValueError" and told.message == "corrupt sample 1261"
    assert told.origin == "DataLoader worker process 1"
    assert told.frames[0] == {"file": "/job/data.py", "line": 21, "function": "__getitem__"}
    assert told.text() == "ValueError: corrupt sample 1261 (in DataLoader worker process 1)"
    # counter-case: an ordinary message that mentions a worker is not parsed as one
    assert worker_origin("RuntimeError", "DataLoader worker (pid 12) is killed by signal: Killed.") is None
    assert raised("RuntimeError", "plain", [{"file": "a.py", "line": 1}]).frames == ({"file": "a.py", "line": 1},)


def test_the_ring_reason_fits_its_field_and_keeps_the_line():
    try:
        raise RuntimeError(DDP_UNUSED)
    except RuntimeError as exc:
        reason = exception_summary(type(exc), exc, exc.__traceback__)
    assert len(reason.encode()) <= 255
    raised_at = test_the_ring_reason_fits_its_field_and_keeps_the_line.__code__.co_firstlineno + 2
    assert reason.endswith(f"{__file__}:{raised_at}")
    assert "did not receive grad for rank 1" in reason
    assert fit_utf8("\U0001f3d6" * 10, 5) == "\U0001f3d6"  # never half a character


class Corrupt(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 5:
            raise ValueError(f"corrupt sample {i}")
        return torch.ones(2)


def test_a_real_worker_exception_is_summarised_with_the_worker_line():
    loader = torch.utils.data.DataLoader(Corrupt(), batch_size=2, num_workers=1)
    with pytest.raises(ValueError) as info:
        list(loader)
    reason = exception_summary(info.type, info.value, info.tb)
    line = Corrupt.__getitem__.__code__.co_firstlineno + 2
    assert reason == f"ValueError: corrupt sample 5 (in DataLoader worker process 0) at {__file__}:{line}"


EXIT_JOB = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    import dtwatch
    dtwatch.install(dir=sys.argv[1], watchdog="off")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    if sys.argv[3] == "fork":  # a forked child's os._exit is not this rank's end
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        os.waitpid(pid, 0)
    if sys.argv[3] == "thread":  # sys.exit in a thread ends the thread, not the process
        import threading
        t = threading.Thread(target=sys.exit, args=(5,))
        t.start()
        t.join()
        raise SystemExit(0)
    def fail():
        raise ValueError("bad config value")
    try:
        fail()
    except ValueError:
        sys.exit(3)  # as a job runner does after printing the error
""")


@pytest.mark.parametrize("mode", ["plain", "fork"])
def test_sys_exit_is_recorded_with_its_status_line_and_the_error_it_handled(tmp_path, mode):
    from tests.harness import free_port

    script = tmp_path / "job.py"
    script.write_text(EXIT_JOB)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs"), str(free_port()), mode],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DTWATCH_JOB_ID": "exit-test"})
    assert proc.returncode == 3, proc.stderr
    exit_files = list((tmp_path / "runs").rglob("*.exit.json"))
    assert len(exit_files) == 1, exit_files
    facts = json.loads(exit_files[0].read_text())
    assert facts["how"] == "sys.exit" and facts["code"] == 3
    assert facts["frames"][0]["file"] == str(script) and facts["frames"][0]["line"] == 23
    assert facts["handling"]["type"] == "ValueError" and facts["handling"]["message"] == "bad config value"
    from dtwatch.ring import read_ring

    ring = next((tmp_path / "runs").rglob("*.ring"))
    snap = read_ring(str(ring))
    assert snap.exit_state_name == "exited" and snap.exit_code == 3
    assert snap.exit_reason == f"sys.exit(3) at {script}:23"


def test_sys_exit_in_a_thread_is_not_the_process_ending(tmp_path):
    from tests.harness import free_port

    script = tmp_path / "job.py"
    script.write_text(EXIT_JOB)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs"), str(free_port()), "thread"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DTWATCH_JOB_ID": "exit-test"})
    assert proc.returncode == 0, proc.stderr
    assert not list((tmp_path / "runs").rglob("*.exit.json"))
    from dtwatch.ring import read_ring

    snap = read_ring(str(next((tmp_path / "runs").rglob("*.ring"))))
    assert snap.exit_state_name == "exited" and snap.exit_code == 0
