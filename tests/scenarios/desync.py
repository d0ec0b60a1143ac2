"""Ranks whose collectives drift apart without a rank condition in the code, and a crash that follows one.

    python desync.py VARIANT     (under torchrun, 4 ranks)

swap       rank 3 syncs its state in another order (broadcast, then all_reduce) than the others
extra      rank 2 clips gradients (an extra all_reduce of the norm) because its local loss is high
crash_ddp  rank 0 reduces a metric inside ``if rank == 0`` in a DDP loop: its all_reduce meets the
           others' gradient all_reduce (issued from C++) and gloo aborts on the size mismatch
"""
import sys

import torch
import torch.distributed as dist

from common import HANG_STEP, batch, ddp_model, finish, mark_onset, setup

VARIANT = sys.argv[1]


def sync_state(state: dict, order: list[str]) -> None:
    for name in order:
        if name == "grads":
            dist.all_reduce(state[name])  # site:swap_reduce
        else:
            dist.broadcast(state[name], src=0)  # site:swap_broadcast


def swap(rank: int) -> None:
    state = {"grads": torch.ones(8), "buffers": torch.ones(8)}
    for step in range(1, 10):
        order = ["grads", "buffers"]
        if rank == 3 and step >= HANG_STEP:
            order = sorted(state)  # site:swap_order (another order: "buffers" sorts first)
        if step == HANG_STEP:
            mark_onset()
        sync_state(state, order)  # site:swap_call


SPIKES = {(2, HANG_STEP): 5.0}  # (rank, step) -> loss spike of that rank's batch


def extra(rank: int) -> None:
    grad = torch.ones(8)
    for step in range(1, 10):
        local_loss = 1.0 + SPIKES.get((rank, step), 0.0)  # this rank's data: one bad batch on rank 2
        if step == HANG_STEP:
            mark_onset()
        if local_loss > 3.0:  # site:extra_branch
            norm = grad.norm().reshape(1)
            dist.all_reduce(norm)  # site:extra_call
        dist.barrier()  # site:extra_barrier
        dist.all_reduce(grad)


def crash_ddp(rank: int) -> None:
    model, opt = ddp_model()
    for step in range(1, 10):
        loss = model(batch()).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # site:crash_backward
        opt.step()
        if step == HANG_STEP:
            mark_onset()
        if rank == 0 and step >= HANG_STEP:  # site:crash_branch
            metric = loss.detach().reshape(1)
            dist.all_reduce(metric)  # site:crash_reduce


def main() -> None:
    rank, _ = setup()
    {"swap": swap, "extra": extra, "crash_ddp": crash_ddp}[VARIANT](rank)
    finish()


if __name__ == "__main__":
    main()
