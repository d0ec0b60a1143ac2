"""Worker for tests/test_analyze.py::test_a_crash_in_teardown_after_a_normal_exit_is_told (2 ranks, gloo).

Both ranks train a few steps and return normally. Rank 1 then aborts after its exit handlers ran, as a gloo or
NCCL destructor does when the interpreter shuts down: the launcher reports SIGABRT, and its ring says it
exited normally. An atexit handler registered before dtwatch's runs after it (last in, first out).
"""
import atexit
import os

if os.environ.get("RANK") == "1":
    atexit.register(os.abort)  # runs after dtwatch's handler, which is registered later

import torch
import torch.distributed as dist

import dtwatch.auto  # noqa: F401


def main() -> None:
    dist.init_process_group("gloo")
    for _ in range(4):
        dist.all_reduce(torch.ones(4))  # site:step
    dist.barrier()  # site:done
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
