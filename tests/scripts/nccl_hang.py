"""A real NCCL job (one GPU per rank) for tests/test_nccl.py; skipped where there are fewer than 2 GPUs.

    torchrun --nproc-per-node 2 nccl_hang.py {rank_conditional|healthy_ddp}

``rank_conditional``: rank 0 logs a metric with an all_reduce under ``if rank == 0``; the call returns
at once (NCCL enqueues it) and rank 0 blocks three lines later, in ``torch.cuda.synchronize()``; rank 1
waits in the barrier after it. ``healthy_ddp``: DDP training with a quiet gap longer than the window.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dtwatch.auto  # noqa: F401  (first: before init_process_group)

SCENARIO = sys.argv[1]
HANG_STEP = 4


def mark_onset() -> None:
    path = os.path.join(os.environ["DTWATCH_DIR"], os.environ["DTWATCH_JOB_ID"], f"onset-rank{dist.get_rank()}.txt")
    with open(path, "w") as f:
        f.write(repr(time.time()))


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 30):
        loss = model(torch.randn(32, 64, device="cuda")).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if SCENARIO == "rank_conditional" and step == HANG_STEP:
            if rank == 0:  # site:nccl_branch
                mark_onset()
                metric = loss.detach().clone()
                dist.all_reduce(metric)  # site:nccl_all_reduce
                metric /= dist.get_world_size()
                metric = metric.clamp(min=0.0)
                torch.cuda.synchronize()  # site:nccl_sync
            dist.barrier()  # site:nccl_barrier
        if SCENARIO == "healthy_ddp" and step == 15:
            torch.cuda.synchronize()
            time.sleep(7)  # quiet on every rank, longer than the window
        loss.item()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
