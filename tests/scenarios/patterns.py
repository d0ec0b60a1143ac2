"""Patterns of well-known training scripts, written from scratch: evaluation on the master process only.

    python patterns.py VARIANT     (under torchrun, 4 ranks)

master_eval  a nanoGPT-style loop: ``if step % eval_interval == 0 and master_process`` runs an evaluation
             that all_reduces its loss, while the other ranks run the next DDP step
ddp_val      rank 0 validates through the DDP wrapper (not ``.module``) and forgets ``torch.no_grad()``; the
             model has BatchNorm, so the wrapper's forward broadcasts its buffers (from C++) on rank 0 only
ddp_val_no_grad  the same validation under ``torch.no_grad()``: the wrapper then communicates nothing, and
             the job is healthy (a control)
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import HANG_STEP, batch, capture_point, ddp_model, finish, mark_onset, setup

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


def ddp_val(rank: int, no_grad: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 16):
        loss = model(batch()).pow(2).mean()  # site:val_train_forward
        opt.zero_grad()
        loss.backward()  # site:val_backward
        opt.step()
        if step == HANG_STEP:
            mark_onset()
            capture_point(1.5)
            if rank == 0:  # site:val_branch
                model.eval()
                with torch.set_grad_enabled(not no_grad):
                    val = model(batch()).pow(2).mean()  # site:val_forward
                model.train()
                print(f"val loss {val.item():.4f}")
        time.sleep(0.3)


def main() -> None:
    rank, _ = setup()
    {
        "master_eval": master_eval,
        "ddp_val": lambda r: ddp_val(r, no_grad=False),
        "ddp_val_no_grad": lambda r: ddp_val(r, no_grad=True),
    }[VARIANT](rank)
    finish()


if __name__ == "__main__":
    main()
