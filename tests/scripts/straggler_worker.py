"""Training jobs for the straggler warning: healthy ones (which must never be warned of, even on a loaded
machine) and ones with a real straggler. Used by tests/test_straggler.py.

    python straggler_worker.py MODEL      (under torchrun, 2-3 ranks, gloo)

MODEL: ``ddp`` (gradient all-reduces issued from C++ by DDP's reducer, timed by the ranks' sequence
clocks), ``fsdp`` (FSDP2: all-gathers and reduce-scatters issued from Python) or ``allreduce`` (one
Python-issued all_reduce per step, marked with ``dtwatch.step()``).

Environment:

* ``RUN_SECONDS`` (default 20): how long the job trains;
* ``STEP_MS`` (default 5): each step's own work on every rank, in milliseconds: real computation
  (``BUSY_FRACTION`` of it, default 1/3) and a sleep standing for the input pipeline;
* ``SLOW_RANK`` (default -1: none): this rank's input pipeline is ``SLOW_FRACTION`` (default 0.3) of its
  own measured step time slower every step, so it is that much slower whatever the machine's load;
* ``TURNS`` (default 0): if > 0, the slow rank changes every ``TURNS`` steps (rank 0, 1, 2, ...): the
  ranks take turns being slow, which is not a straggler.
"""
import atexit
import os
import sys
import time

import torch
import torch.distributed as dist

import dtwatch
import dtwatch.auto  # installs dtwatch from the DTWATCH_* environment

MODEL = sys.argv[1]


def model_and_opt(world_model: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if world_model == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    elif world_model == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.001)


def busy(seconds: float) -> None:
    """Real computation for about ``seconds`` (on an idle core)."""
    end = time.perf_counter() + seconds
    a = torch.ones(32, 32)
    while time.perf_counter() < end:
        a = (a @ a).clamp_(-1, 1)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seconds = float(os.environ.get("RUN_SECONDS", "20"))
    step_s = float(os.environ.get("STEP_MS", "5")) / 1000
    slow_rank = int(os.environ.get("SLOW_RANK", "-1"))
    fraction = float(os.environ.get("SLOW_FRACTION", "0.3"))
    turns = int(os.environ.get("TURNS", "0"))
    busy_fraction = float(os.environ.get("BUSY_FRACTION", str(1 / 3)))
    model, opt = (None, None) if MODEL == "allreduce" else model_and_opt(MODEL)
    t = torch.ones(16)
    own = step_s  # this rank's own step time (its work, without the waits), measured
    end = time.time() + seconds
    step = 0
    stop = torch.zeros(1)
    check_every = max(1, int(0.5 / step_s))
    while True:
        if step % check_every == 0:
            # Every rank stops at the same step: rank 0 decides (about every half a second of steps).
            stop.fill_(1.0 if rank == 0 and time.time() > end else 0.0)
            dist.broadcast(stop, 0)
            if stop.item():
                break
        t0 = time.perf_counter()
        busy(step_s * busy_fraction)
        time.sleep(step_s * (1 - busy_fraction))  # the input pipeline
        own = 0.8 * own + 0.2 * (time.perf_counter() - t0)
        slow = (step // turns) % world if turns else slow_rank
        if rank == slow:
            time.sleep(fraction * own)  # site:slow_rank
        if MODEL == "allreduce":
            dist.all_reduce(t)
            dtwatch.step()
        else:
            loss = model(torch.randn(16, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        step += 1
    dist.barrier()
    dist.destroy_process_group()
    if MODEL == "fsdp":
        # FSDP2 keeps the group alive past destroy_process_group; leave without finalizing (torch's gloo
        # teardown race, as in hang_worker.py).
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
