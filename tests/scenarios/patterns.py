"""Patterns of well-known training scripts, written from scratch: evaluation on the master process only.

    python patterns.py VARIANT     (under torchrun, 4 ranks)

master_eval  a nanoGPT-style loop: ``if step % eval_interval == 0 and master_process`` runs an evaluation
             that all_reduces its loss, while the other ranks run the next DDP step
ddp_val      rank 0 validates through the DDP wrapper (not ``.module``); the model has BatchNorm, so the
             wrapper's forward broadcasts buffers (C++) on rank 0 only
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import HANG_STEP, batch, ddp_model, finish, mark_onset, setup

VARIANT = sys.argv[1]
EVAL_INTERVAL = HANG_STEP


@torch.no_grad()
def estimate_loss(model: torch.nn.Module) -> float:
    model.eval()
    loss = model(batch()).pow(2).mean().reshape(1)
    dist.all_reduce(loss)  # site:eval_reduce
    model.train()
    return loss.item() / dist.get_world_size()


def master_eval(rank: int) -> None:
    master_process = int(os.environ["RANK"]) == 0
    model, opt = ddp_model()
    for step in range(1, 10):
        if step % EVAL_INTERVAL == 0 and master_process:  # site:eval_branch
            mark_onset()
            losses = estimate_loss(model)  # site:eval_call
            print(f"step {step}: val loss {losses:.4f}")
        loss = model(batch()).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # site:eval_backward
        opt.step()


def ddp_val(rank: int) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 10):
        loss = model(batch()).pow(2).mean()  # site:val_train_forward
        opt.zero_grad()
        loss.backward()  # site:val_backward
        opt.step()
        if step == HANG_STEP:
            mark_onset()
            if rank == 0:  # site:val_branch
                with torch.no_grad():
                    val = model(batch()).pow(2).mean()  # site:val_forward
                print(f"val loss {val.item():.4f}")


def main() -> None:
    rank, _ = setup()
    {"master_eval": master_eval, "ddp_val": ddp_val}[VARIANT](rank)
    finish()


if __name__ == "__main__":
    main()
