"""Uneven iterations: one rank has fewer batches (or steps) than the others and leaves the loop first.

    python uneven.py VARIANT     (under torchrun, 4 ranks)

python    plain loop over a per-rank list of batches, all_reduce per batch; rank 2 has 4 batches, not 6
ddp       DDP + DataLoader over a per-rank dataset; rank 1's is shorter; post-loop barrier
ddp_exit  as ddp, but the short rank's process simply ends after its loop
subgroup  data-parallel pairs [0,1] and [2,3] reduce per batch in their pair; rank 3 has fewer batches
p2p       pipeline pairs 0->1 and 2->3 send one activation per micro-batch; rank 2 has fewer
object    per-step metrics gathered with all_gather_object; rank 1 runs fewer steps
async     per-step async all_reduce overlapped with compute, then wait; rank 3 has fewer batches
fsdp2     FSDP2 (fully_shard) training with per-rank step counts; rank 0 stops early
"""
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from common import ddp_model, finish, mark_onset, setup, tiny_model

VARIANT = sys.argv[1]


def plain(rank: int) -> None:
    n = 6 if rank != 2 else 4  # site:python_count
    batches = [torch.ones(4) * i for i in range(n)]
    for b in batches:  # site:python_loop
        dist.all_reduce(b)  # site:python_step
        time.sleep(0.2)
    mark_onset()
    dist.barrier()  # site:python_post


def ddp(rank: int, post_loop: bool) -> None:
    model, opt = ddp_model()
    size = 48 if rank != 1 else 24  # site:ddp_size
    loader = DataLoader(TensorDataset(torch.randn(size, 8)), batch_size=8)  # site:ddp_loader
    for (x,) in loader:  # site:ddp_loop
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # site:ddp_backward
        opt.step()
        time.sleep(0.2)
    mark_onset()
    if post_loop:
        dist.barrier()  # site:ddp_post
    else:
        sys.exit(0)  # site:ddp_exit


def subgroup(rank: int) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    n = 6 if rank != 3 else 3  # site:sub_count
    grad = torch.ones(4)
    for _ in range(n):  # site:sub_loop
        dist.all_reduce(grad, group=mine)  # site:sub_step
        time.sleep(0.2)
    mark_onset()
    dist.barrier()  # site:sub_post


def p2p(rank: int) -> None:
    n = 6 if rank != 2 else 3  # site:p2p_count
    act = torch.ones(4)
    for _ in range(n):  # site:p2p_loop
        if rank % 2 == 0:
            dist.send(act, dst=rank + 1)  # site:p2p_send
        else:
            dist.recv(act, src=rank - 1)  # site:p2p_recv
        time.sleep(0.2)
    mark_onset()
    dist.barrier()  # site:p2p_post


def objects(rank: int) -> None:
    steps = 6 if rank != 1 else 4  # site:obj_count
    for step in range(steps):  # site:obj_loop
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, {"step": step, "loss": 1.0 / (step + 1)})  # site:obj_step
        time.sleep(0.2)
    mark_onset()
    dist.barrier()  # site:obj_post


def async_overlap(rank: int) -> None:
    n = 6 if rank != 3 else 4  # site:async_count
    grad = torch.ones(16)
    for _ in range(n):  # site:async_loop
        work = dist.all_reduce(grad, async_op=True)  # site:async_start
        time.sleep(0.2)  # compute that overlaps the reduction
        work.wait()  # site:async_wait
    mark_onset()
    dist.barrier()  # site:async_post


def fsdp2(rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

    model = tiny_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 8 if rank != 0 else 5  # site:fsdp_steps
    for _ in range(steps):  # site:fsdp_loop
        loss = model(torch.randn(4, 8)).pow(2).mean()  # site:fsdp_forward
        loss.backward()  # site:fsdp_backward
        opt.step()
        opt.zero_grad()
        time.sleep(0.2)
    mark_onset()
    dist.barrier()  # site:fsdp_post


def main() -> None:
    rank, _ = setup()
    {
        "python": lambda: plain(rank),
        "ddp": lambda: ddp(rank, post_loop=True),
        "ddp_exit": lambda: ddp(rank, post_loop=False),
        "subgroup": lambda: subgroup(rank),
        "p2p": lambda: p2p(rank),
        "object": lambda: objects(rank),
        "async": lambda: async_overlap(rank),
        "fsdp2": lambda: fsdp2(rank),
    }[VARIANT]()
    finish()


if __name__ == "__main__":
    main()
