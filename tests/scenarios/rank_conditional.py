"""A collective that only some ranks call (or that one member of a group skips), in six settings.

    python rank_conditional.py VARIANT     (under torchrun, 4 ranks)

python      rank 0 all_reduces an extra metric inside ``if rank == 0``; the others go on to the barrier
ddp_py      in a DDP loop, rank 0 alone enters a barrier; the others run the next step (C++ all_reduce)
ddp_cpp     rank 0 alone runs an extra backward through DDP (C++ all_reduce); the others wait in a barrier
sub_skip    ranks 0-2 form a subgroup; the branch around its all_reduce leaves out member rank 2
sub_extra   only rank 0 of the subgroup [0, 1, 2] calls its all_reduce
p2p_skip    rank 0 skips its send to rank 1 when its batch is empty; rank 1 waits in recv
object      only rank 0 calls all_gather_object (rank-0-only logging of a config)
object_skip rank 0 leaves out broadcast_object_list that the other ranks call
async       rank 0 alone starts an async all_reduce and later waits on it
"""
import sys

import torch
import torch.distributed as dist

from common import HANG_STEP, batch, ddp_model, finish, mark_onset, setup

VARIANT = sys.argv[1]


def python_issued(rank: int) -> None:
    loss = torch.ones(1)
    for step in range(1, 10):
        dist.all_reduce(loss)  # site:python_step
        if step == HANG_STEP:
            mark_onset()
            if rank == 0:  # site:python_branch
                dist.all_reduce(torch.ones(3))  # site:python_extra
            dist.barrier()  # site:python_barrier


def ddp_python_side(rank: int) -> None:
    model, opt = ddp_model()
    for step in range(1, 10):
        loss = model(batch()).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # site:ddp_py_backward
        opt.step()
        if step == HANG_STEP:
            mark_onset()
            if rank == 0:  # site:ddp_py_branch
                dist.barrier()  # site:ddp_py_extra


def ddp_cpp_side(rank: int) -> None:
    model, opt = ddp_model()
    for step in range(1, 10):
        loss = model(batch()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == HANG_STEP:
            mark_onset()
            if rank == 0:  # site:ddp_cpp_branch
                model(batch()).sum().backward()  # site:ddp_cpp_extra
            dist.barrier()  # site:ddp_cpp_barrier


def subgroup(rank: int, skip: bool) -> None:
    shard = dist.new_group([0, 1, 2])
    stats = torch.ones(2)
    for step in range(1, 10):
        dist.all_reduce(stats)  # site:sub_world
        if step == HANG_STEP:
            mark_onset()
            if skip:
                if rank < 2:  # site:sub_skip_branch
                    dist.all_reduce(stats, group=shard)  # site:sub_skip_call
            elif rank == 0:  # site:sub_extra_branch
                dist.all_reduce(stats, group=shard)  # site:sub_extra_call
            dist.barrier()  # site:sub_barrier


def p2p_skip(rank: int) -> None:
    act = torch.ones(4)
    for step in range(1, 10):
        if rank == 0:
            empty = step == HANG_STEP  # this rank's batch came back empty
            if empty:
                mark_onset()
            if not empty:  # site:p2p_skip_branch
                dist.send(act, dst=1)  # site:p2p_send
        elif rank == 1:
            if step == HANG_STEP:
                mark_onset()
            dist.recv(act, src=0)  # site:p2p_recv
        dist.barrier()  # site:p2p_barrier


def objects(rank: int, skip: bool) -> None:
    cfg = {"lr": 0.1, "rank": rank}
    t = torch.ones(1)
    for step in range(1, 10):
        dist.all_reduce(t)  # site:obj_step
        if step == HANG_STEP:
            mark_onset()
            if skip:
                if rank != 0:  # site:obj_skip_branch
                    dist.broadcast_object_list([cfg], src=0)  # site:obj_skip_call
            elif rank == 0:  # site:obj_branch
                out = [None] * dist.get_world_size()
                dist.all_gather_object(out, cfg)  # site:obj_extra
            dist.barrier()  # site:obj_barrier


def async_op(rank: int) -> None:
    t = torch.ones(8)
    for step in range(1, 10):
        dist.all_reduce(t)  # site:async_step
        if step == HANG_STEP:
            mark_onset()
            work = None
            if rank == 0:  # site:async_branch
                work = dist.all_reduce(t, async_op=True)  # site:async_extra
            t.mul_(0.5)  # overlap some compute
            if work is not None:
                work.wait()  # site:async_wait
            dist.barrier()  # site:async_barrier


def main() -> None:
    rank, _ = setup()
    {
        "python": lambda: python_issued(rank),
        "ddp_py": lambda: ddp_python_side(rank),
        "ddp_cpp": lambda: ddp_cpp_side(rank),
        "sub_skip": lambda: subgroup(rank, skip=True),
        "sub_extra": lambda: subgroup(rank, skip=False),
        "p2p_skip": lambda: p2p_skip(rank),
        "object": lambda: objects(rank, skip=False),
        "object_skip": lambda: objects(rank, skip=True),
        "async": lambda: async_op(rank),
    }[VARIANT]()
    finish()


if __name__ == "__main__":
    main()
