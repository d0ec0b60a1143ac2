"""A rank ends (raises, returns, exits, is killed, crashes) while the others wait for it.

    python exited.py VARIANT     (under torchrun, 4 ranks)

exception  rank 1 raises ValueError on a NaN loss; the others wait in all_reduce
ddp_raise  rank 2's model raises inside forward on a bad batch; the others wait in DDP's all_reduce
keyerror   rank 3's validation looks up a metric its empty shard never produced (KeyError)
returned   rank 3 returns early from training; its pair peer rank 2 waits in the pair all_reduce
sigkill    rank 1 (a pipeline receiver) is killed by SIGKILL, as the OOM killer does; rank 0 sends to it
sys_exit   rank 2 calls sys.exit(2) on a bad config while the others gather objects
os_exit    rank 0 ends with os._exit(3) while the others wait on an async all_reduce
segfault   rank 1 dereferences a null pointer (SIGSEGV) in a native call
worker     rank 1's DataLoader worker raises on a corrupt sample; the others wait in all_reduce
unused     rank 1's forward skips a layer at one step; DDP raises on its next forward, naming the parameters
runner     rank 2's task raises under a Hydra-style runner, which prints it and calls sys.exit(1)
startup    every rank raises in its first collective (an all_gather output list sized wrongly)
"""
import ctypes
import os
import signal
import sys

import torch
import torch.distributed as dist

from common import HANG_STEP, batch, ddp_model, finish, mark_onset, setup

VARIANT = sys.argv[1]


def check_loss(rank: int, step: int, loss: torch.Tensor) -> None:
    if rank == 1 and step == HANG_STEP:
        loss = loss * float("nan")
    if torch.isnan(loss).any():
        mark_onset()
        raise ValueError(f"loss is NaN at step {step}")  # site:exc_raise


def exception(rank: int) -> None:
    loss = torch.ones(1)
    for step in range(1, 10):
        check_loss(rank, step, loss)  # site:exc_call
        dist.all_reduce(loss)  # site:exc_step


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            mark_onset()
            raise RuntimeError("empty batch reached the model")  # site:ddp_raise
        return self.fc(x)


def ddp_raise(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 10):
        x = batch() if not (rank == 2 and step == HANG_STEP) else batch()[:0]
        loss = model(x).pow(2).mean()  # site:ddp_forward
        opt.zero_grad()
        loss.backward()  # site:ddp_backward
        opt.step()


def keyerror(rank: int) -> None:
    t = torch.ones(1)
    for step in range(1, 10):
        dist.all_reduce(t)  # site:key_step
        if step == HANG_STEP:
            metrics = {"val_loss": 0.5} if rank == 3 else {"val_loss": 0.5, "val_acc": 0.9}
            mark_onset()
            acc = torch.tensor([metrics["val_acc"]])  # site:key_lookup
            dist.all_reduce(acc)  # site:key_reduce


def returned(rank: int) -> None:
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    t = torch.ones(4)
    for step in range(1, 10):
        dist.all_reduce(t, group=pair)  # site:ret_step
        if rank == 3 and step == HANG_STEP:
            mark_onset()
            return  # site:ret_return
        dist.barrier()  # site:ret_barrier
    finish()


def sigkill(rank: int) -> None:
    act = torch.ones(4)
    for step in range(1, 10):
        if rank == 0:
            dist.send(act, dst=1)  # site:kill_send
        elif rank == 1:
            dist.recv(act, src=0)  # site:kill_recv
            if step == HANG_STEP:
                mark_onset()
                os.kill(os.getpid(), signal.SIGKILL)  # site:kill_kill
        dist.barrier()  # site:kill_barrier


def sys_exit(rank: int) -> None:
    for step in range(1, 10):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, {"step": step})  # site:sysexit_step
        if step == HANG_STEP and rank == 2:
            mark_onset()
            sys.exit(2)  # site:sysexit_exit


def os_exit(rank: int) -> None:
    t = torch.ones(8)
    for step in range(1, 10):
        if step == HANG_STEP and rank == 0:
            mark_onset()
            os._exit(3)  # site:osexit_exit
        work = dist.all_reduce(t, async_op=True)  # site:osexit_start
        t.mul_(0.5)
        work.wait()  # site:osexit_wait


def segfault(rank: int) -> None:
    t = torch.ones(1)
    for step in range(1, 10):
        dist.all_reduce(t)  # site:segv_step
        if step == HANG_STEP and rank == 1:
            mark_onset()
            ctypes.string_at(0)  # site:segv_crash


class Samples(torch.utils.data.Dataset):
    def __init__(self, corrupt: int) -> None:
        self.corrupt = corrupt

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.corrupt:
            raise ValueError(f"corrupt sample {i}")  # site:worker_raise
        return torch.ones(4)


def worker(rank: int) -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    data = Samples(corrupt=33)  # rank 1's shard is 1, 5, 9, ...: sample 33 is the first of its batch 3
    loader = DataLoader(data, batch_size=4, num_workers=1, sampler=DistributedSampler(data, shuffle=False))
    for step, x in enumerate(loader, start=1):  # site:worker_loop
        if rank == 1 and step == HANG_STEP - 1:
            mark_onset()
        dist.all_reduce(x)  # site:worker_step


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        h = self.a(x)
        return h.sum(dim=1, keepdim=True) if skip else self.b(h)  # site:unused_skip


def unused(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(TwoLayers())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 10):
        skip = rank == 1 and step == HANG_STEP
        if skip:
            mark_onset()
        loss = model(batch(), skip).pow(2).mean()  # site:unused_forward
        opt.zero_grad()
        loss.backward()
        opt.step()


def runner(rank: int) -> None:
    from minilib import run_job

    def task() -> None:
        t = torch.ones(2)
        for step in range(1, 10):
            dist.all_reduce(t)  # site:runner_step
            if rank == 2 and step == HANG_STEP:
                mark_onset()
                raise ValueError("learning rate must be positive, got -0.1")  # site:runner_raise

    run_job(task)


def startup(rank: int) -> None:
    t = torch.ones(2)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size() // 2)]
    mark_onset()
    dist.all_gather(out, t)  # site:startup_gather


def main() -> None:
    rank, _ = setup()
    variants = {
        "exception": exception, "ddp_raise": ddp_raise, "keyerror": keyerror, "returned": returned,
        "sigkill": sigkill, "sys_exit": sys_exit, "os_exit": os_exit, "segfault": segfault,
        "worker": worker, "unused": unused, "runner": runner, "startup": startup,
    }
    variants[VARIANT](rank)
    if VARIANT != "returned":
        finish()


if __name__ == "__main__":
    main()
