"""Healthy controls: jobs with long waits or uneven work that must never be reported as stalled.

    python healthy.py VARIANT     (under torchrun, 4 ranks; stall window 10 s)

join        DDP with uneven inputs (rank r has 6 + 2r batches) under the Join context manager
eval_all    every rank evaluates for 14 s without collectives, then they all_reduce the metric
short_ckpt  rank 0 writes a 6 s checkpoint while the others wait in a barrier (shorter than the window)
quiet       every rank is quiet (reloading data) for 15 s, longer than the window, outside collectives
turns_slow  the ranks take turns being slow (4 s each) before an all_reduce: someone always waits
async_long  every rank starts an async all_reduce, computes for 13 s, then waits on it
"""
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join

from common import batch, capture_point, ddp_model, finish, setup

VARIANT = sys.argv[1]


def train_steps(model, opt, n: int) -> None:
    for _ in range(n):
        loss = model(batch()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def join(rank: int) -> None:
    model, opt = ddp_model()
    with Join([model]):
        for i in range(6 + 2 * rank):
            if rank == 0 and i == 5:
                capture_point(2.0)  # while ranks 0-2 shadow rank 3's remaining steps
            train_steps(model, opt, 1)
            time.sleep(0.3)


def eval_all(rank: int) -> None:
    model, opt = ddp_model()
    train_steps(model, opt, 3)
    capture_point(12.0)
    time.sleep(14.0)  # site:eval_all_quiet (evaluation without collectives)
    metric = torch.ones(1)
    dist.all_reduce(metric)
    train_steps(model, opt, 2)


def short_ckpt(rank: int) -> None:
    model, opt = ddp_model()
    train_steps(model, opt, 3)
    capture_point(5.0)
    if rank == 0:
        time.sleep(6.0)  # site:short_ckpt_write
    dist.barrier()  # site:short_ckpt_barrier
    train_steps(model, opt, 2)


def quiet(rank: int) -> None:
    model, opt = ddp_model()
    train_steps(model, opt, 3)
    capture_point(12.0)
    time.sleep(15.0)  # site:quiet_gap
    train_steps(model, opt, 3)


def turns_slow(rank: int) -> None:
    t = torch.ones(4)
    capture_point(11.0)  # 3 s into rank 2's slow turn
    for turn in range(4):
        if rank == turn:
            time.sleep(4.0)  # site:turn_slow
        dist.all_reduce(t)  # site:turn_reduce


def async_long(rank: int) -> None:
    t = torch.ones(8)
    dist.all_reduce(t)
    work = dist.all_reduce(t, async_op=True)  # site:async_long_start
    capture_point(11.0)
    time.sleep(13.0)  # site:async_long_compute
    work.wait()
    dist.all_reduce(t)


def main() -> None:
    rank, _ = setup()
    {"join": join, "eval_all": eval_all, "short_ckpt": short_ckpt, "quiet": quiet, "turns_slow": turns_slow,
     "async_long": async_long}[VARIANT](rank)
    finish()


if __name__ == "__main__":
    main()
