"""Which calls count as collectives, by name, receiver and import."""
import asyncio
import functools

import torch
import torch.distributed as tdist
from accelerate.utils import gather as acc_gather
from torch.distributed import reduce as dist_reduce


def collectives(t, metric, accelerator, sock, rank, self_):
    if rank == 0:
        tdist.gather(t, dst=0)  # expect: DTW001
        torch.distributed.scatter(t, src=0)  # expect: DTW001
        dist_reduce(t, dst=0)  # expect: DTW001
        acc_gather(t)  # expect: DTW001
        accelerator.reduce(t)  # expect: DTW001
        self_.accelerator.gather_for_metrics(t)  # expect: DTW001
        metric.all_reduce()  # expect: DTW001
        tdist.new_group([0])  # expect: DTW001
        tdist.monitored_barrier()  # expect: DTW001
        self_.log("loss", t, sync_dist=True)  # expect: DTW001


def not_collectives(t, rank, sock, self_):
    if rank == 0:
        functools.reduce(lambda a, b: a + b, [1, 2])
        asyncio.gather()
        torch.gather(t, 0, t)
        t.scatter(0, t, t)
        sock.send(b"x")
        self_.log("loss", t, sync_dist=False)
        self_.log("loss", t)
