"""Every way a test can depend on the rank."""
import os

import torch
import torch.distributed as dist
from torch.distributed import get_rank

IS_LEADER = int(os.environ.get("RANK", "0")) == 0  # a module-level derived name


class Trainer:
    def step(self, t, args, accelerator, trainer):
        if self.rank == 0:
            dist.all_reduce(t)  # expect: DTW001
        if args.local_rank in (-1, 0):  # true on rank 0 only (or when not distributed)
            dist.all_reduce(t)  # expect: DTW001
        if accelerator.is_main_process:
            accelerator.wait_for_everyone()  # expect: DTW001
        if accelerator.is_local_main_process:
            dist.all_reduce(t)  # expect: DTW001
        if trainer.is_global_zero:
            dist.all_reduce(t)  # expect: DTW001
        if self.global_rank:
            dist.all_reduce(t)  # expect: DTW001


def env_and_calls(t, group, my_rank, worldRank):
    if os.environ["RANK"] == "0":
        dist.all_reduce(t)  # expect: DTW001
    if os.environ.get("LOCAL_RANK") == "0":
        dist.all_reduce(t)  # expect: DTW001
    if int(os.getenv("RANK", 0)) == 0:
        dist.all_reduce(t)  # expect: DTW001
    if torch.distributed.get_rank() == 0:
        dist.all_reduce(t)  # expect: DTW001
    if get_rank() % 2:
        dist.all_reduce(t)  # expect: DTW001
    if dist.get_rank(group) == 0:
        dist.all_reduce(t)  # expect: DTW001
    if not dist.get_local_rank():
        dist.all_reduce(t)  # expect: DTW001
    if my_rank == 1:
        dist.all_reduce(t)  # expect: DTW001
    if worldRank > 3:
        dist.all_reduce(t)  # expect: DTW001
    if int(os.environ["SLURM_PROCID"]) == 0:
        dist.all_reduce(t)  # expect: DTW001


def derived_names(t):
    is_leader = dist.get_rank() == 0
    should_log = is_leader and t.numel() > 0
    if should_log:
        dist.all_reduce(t)  # expect: DTW001
    if IS_LEADER:
        dist.all_reduce(t)  # expect: DTW001


def is_main_process():
    return dist.get_rank() == 0


def helper_predicates(t, is_master):
    if is_main_process():
        dist.all_reduce(t)  # expect: DTW001
    if is_master:
        dist.all_reduce(t)  # expect: DTW001
