"""Ranks at the same collective (same group, sequence number and line) that disagree on what it is.

    python mismatch.py VARIANT     (under torchrun, 4 ranks)

op        rank 1 read a config saying "barrier-only sync": it calls barrier where the others all_reduce
shape     rank 1 reduces a 4-element tensor where the others reduce 8 (gloo aborts the job)
dtype     in the subgroup [1, 2, 3], rank 3 reduces float64 where the others reduce float32
object    rank 2 broadcasts a 3-object list where the others expect 2 (broadcast_object_list)
async     rank 0 starts an async all_reduce of another shape than its peers, then waits
pair      in the subgroup [2, 3], one all_reduce whose dtype comes from each rank's data shard: rank 3's is
          float64, rank 2's float32, and nothing tells which is wrong
pair_was  in the subgroup [2, 3], rank 3 switches its all_reduce to float64 after two float32 steps
"""
import sys

import torch
import torch.distributed as dist

from common import HANG_STEP, finish, mark_onset, setup

VARIANT = sys.argv[1]


def op_mismatch(rank: int) -> None:
    barrier_only = rank == 1  # site:op_config
    t = torch.ones(4)
    for step in range(1, 10):
        if step == HANG_STEP:
            mark_onset()
        dist.barrier() if barrier_only and step >= HANG_STEP else dist.all_reduce(t)  # site:op_call


def shape(rank: int) -> None:
    for step in range(1, 10):
        n = 4 if rank == 1 and step >= HANG_STEP else 8  # site:shape_size
        if step == HANG_STEP:
            mark_onset()
        dist.all_reduce(torch.ones(n))  # site:shape_call


def dtype(rank: int) -> None:
    sub = dist.new_group([1, 2, 3])
    for step in range(1, 10):
        dt = torch.float64 if rank == 3 and step >= HANG_STEP else torch.float32  # site:dtype_choice
        if step == HANG_STEP:
            mark_onset()
        if rank in (1, 2, 3):
            dist.all_reduce(torch.ones(8, dtype=dt), group=sub)  # site:dtype_call
        dist.barrier()


def objects(rank: int) -> None:
    for step in range(1, 10):
        objs = [{"step": step}, {"lr": 0.1}]
        if rank == 2 and step >= HANG_STEP:
            objs.append({"extra": True})  # site:obj_extra_item
        if step == HANG_STEP:
            mark_onset()
        dist.broadcast_object_list(objs, src=0)  # site:obj_call


def async_shape(rank: int) -> None:
    for step in range(1, 10):
        n = 16 if rank == 0 and step >= HANG_STEP else 8  # site:async_size
        if step == HANG_STEP:
            mark_onset()
        work = dist.all_reduce(torch.ones(n), async_op=True)  # site:async_call
        work.wait()  # site:async_wait


def pair(rank: int) -> None:
    sub = dist.new_group([2, 3])
    shard = list(range(10))[rank::4]  # ranks 2 and 3 hold 2 samples each, but rank 3's are odd numbers
    dist.barrier()
    mark_onset()
    if rank in (2, 3):
        dt = torch.float64 if shard[0] % 2 else torch.float32  # site:pair_choice
        dist.all_reduce(torch.ones(8, dtype=dt), group=sub)  # site:pair_call
    dist.barrier()


def pair_was(rank: int) -> None:
    sub = dist.new_group([2, 3])
    for step in range(1, 10):
        dt = torch.float64 if rank == 3 and step >= HANG_STEP else torch.float32  # site:pairwas_choice
        if step == HANG_STEP:
            mark_onset()
        if rank in (2, 3):
            dist.all_reduce(torch.ones(8, dtype=dt), group=sub)  # site:pairwas_call
        dist.barrier()


def main() -> None:
    rank, _ = setup()
    {"op": op_mismatch, "shape": shape, "dtype": dtype, "object": objects, "async": async_shape, "pair": pair,
     "pair_was": pair_was}[VARIANT](rank)
    finish()


if __name__ == "__main__":
    main()
