"""Collectives issued by a training library on the user's behalf (``minilib``, installed as site-packages).

    python library.py VARIANT     (under torchrun, 4 ranks)

fabric_save   ``fabric.save(...)`` (which ends in a barrier, meant for every rank) called under
              ``if fabric.global_rank == 0``; the others run the next DDP step
accel_gather  ``acc.gather(preds)`` only ``if acc.is_main_process``; the others go on to ``acc.wait_for_everyone()``
wait_main     ``acc.wait_for_everyone()`` indented into the main-process block; the others reduce the next loss
log_rank0     a metric logged with ``self.log(..., sync_dist=True)`` only on global rank 0 in a validation step:
              the trainer syncs it at the end of the epoch, from inside ``fit``, where the others are already at
              the epoch barrier (after Lightning-AI/pytorch-lightning#19917 and choderalab/modelforge#313:
              keys logged on some ranks only hang the reduction at the end of the epoch)
early_stop    per-rank early stopping on a local (not reduced) validation loss: rank 1 breaks out of its
              epoch loop first and waits in ``fabric.barrier()``; the others train another epoch (DDP)
"""
import os
import sys
import tempfile
import time

import torch

from common import HANG_STEP, batch, ddp_model, finish, mark_onset, setup
from minilib import Accelerator, EarlyStopping, Fabric, Module, Trainer

VARIANT = sys.argv[1]


def train_step(model, opt) -> torch.Tensor:
    loss = model(batch()).pow(2).mean()
    opt.zero_grad()
    loss.backward()  # site:lib_backward
    opt.step()
    return loss.detach()


def fabric_save(rank: int) -> None:
    fabric = Fabric()
    model, opt = ddp_model()
    path = os.path.join(tempfile.gettempdir(), f"ckpt-{os.getpid()}.pt")
    for step in range(1, 10):
        train_step(model, opt)  # site:fabric_step
        if step == HANG_STEP:
            mark_onset()
            if fabric.global_rank == 0:  # site:fabric_branch
                fabric.save(path, {"model": model.state_dict(), "step": step})  # site:fabric_save
    if os.path.exists(path):
        os.unlink(path)


def accel_gather(rank: int) -> None:
    acc = Accelerator()
    for step in range(1, 10):
        loss = acc.reduce(torch.ones(1))  # site:accel_reduce
        preds = torch.full((4,), float(rank))
        if step == HANG_STEP:
            mark_onset()
            if acc.is_main_process:  # site:accel_branch
                all_preds = acc.gather(preds)  # site:accel_gather
                print(f"gathered {all_preds.numel()} predictions, loss {loss.item():.2f}")
            acc.wait_for_everyone()  # site:accel_wait


def wait_main(rank: int) -> None:
    acc = Accelerator()
    for step in range(1, 10):
        loss = acc.reduce(torch.ones(1))  # site:wait_reduce
        if step == HANG_STEP:
            mark_onset()
        if step == HANG_STEP and acc.is_main_process:  # site:wait_branch
            print(f"saving at step {step}, loss {loss.item():.2f}")
            acc.wait_for_everyone()  # site:wait_call


class Classifier(Module):
    def validation_step(self, batch: torch.Tensor, index: int) -> None:
        acc = (batch.sum(dim=1) > 0).float().mean()
        self.log("val_acc", acc, sync_dist=True)
        if self.global_rank == 0 and self.epoch == HANG_STEP:  # site:log_branch
            self.log("val_acc_rank0", acc, sync_dist=True)  # site:log_rank0


def log_rank0(rank: int) -> None:
    model = Classifier()

    def on_epoch(epoch: int) -> None:
        model.epoch = epoch
        if epoch == HANG_STEP:
            mark_onset()

    Trainer(epochs=8).fit(model, batches=3, on_epoch=on_epoch)  # site:log_fit


def local_val_loss(rank: int, epoch: int) -> float:
    # rank 1's validation shard stops improving after epoch 1; the others keep improving
    return 1.0 if rank == 1 and epoch >= 1 else 1.0 / (epoch + 1)


def early_stop(rank: int) -> None:
    fabric = Fabric()
    model, opt = ddp_model()
    stopper = EarlyStopping(patience=2)
    for epoch in range(8):  # site:es_loop
        for _ in range(3):
            train_step(model, opt)  # site:es_step
            time.sleep(0.1)
        if stopper.should_stop(local_val_loss(rank, epoch)):  # site:es_check
            mark_onset()
            break  # site:es_break
    fabric.barrier()  # site:es_post


def main() -> None:
    rank, _ = setup()
    {"fabric_save": fabric_save, "accel_gather": accel_gather, "wait_main": wait_main,
     "early_stop": early_stop, "log_rank0": log_rank0}[VARIANT](rank)
    finish()


if __name__ == "__main__":
    main()
