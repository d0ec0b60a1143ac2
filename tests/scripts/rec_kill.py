"""Worker for tests/test_recorder.py::test_killed_rank_and_exit_states (4 ranks, gloo).

After two collectives on the default group:

* rank 3 returns normally (its ring must read "exited");
* rank 0 blocks in an all_reduce on group [0, 2] and rank 1 in one on group [1, 2]: rank 2 never joins
  either, so both stay in flight until the test SIGKILLs rank 1 and torchrun then SIGTERMs the rest;
* rank 2 waits; torchrun's SIGTERM makes it raise (its ring must read "exception" with the message).
"""
import datetime
import signal
import time

import torch
import torch.distributed as dist

import dtwatch.auto  # noqa: F401  (first: installs before init_process_group)


class StoppedError(RuntimeError):
    pass


def on_sigterm(signum, frame):
    raise StoppedError("rank 2 stopped by the launcher's SIGTERM")


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(3))  # site:warmup
    g02 = dist.new_group([0, 2])
    g12 = dist.new_group([1, 2])
    dist.barrier()  # site:sync
    if rank == 3:
        return
    if rank == 2:
        signal.signal(signal.SIGTERM, on_sigterm)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise SystemExit(3)
    if rank == 0:
        dist.all_reduce(torch.ones(5), group=g02)  # site:stuck0
    else:
        dist.all_reduce(torch.ones(2, 2), group=g12)  # site:stuck1
    raise SystemExit(4)  # not reached: the test ends this job


if __name__ == "__main__":
    main()
