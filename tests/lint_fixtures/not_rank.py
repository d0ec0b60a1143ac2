"""Tests that look rank-ish but are the same on every rank: nothing here may be reported."""
import os

import torch.distributed as dist
from torch.utils.data import DistributedSampler


def train(args, model, t, dataset, rankings, ranker, num_ranks, franker):
    if args.local_rank == -1:  # "is this run distributed?": same answer everywhere
        model.cuda()
    else:
        dist.init_process_group("nccl")
    if args.local_rank != -1 and args.no_cuda:
        dist.barrier()
    rank = None
    if rank is None:
        rank = dist.get_rank()
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    if dist.is_initialized():
        dist.barrier()
    if num_ranks > 1:  # "ranks" (a count) is not "rank"
        dist.barrier()
    if rankings or ranker or franker:
        dist.barrier()
    if os.environ.get("MASTER_ADDR"):
        dist.barrier()
    if args.mode == "rank":  # a string constant, not a name
        dist.barrier()
    sampler = DistributedSampler(dataset, rank=rank)  # uses the rank, but is not a rank test
    if sampler is not None:
        dist.barrier()
