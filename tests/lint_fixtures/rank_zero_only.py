"""A function that only rank 0 runs (Lightning's @rank_zero_only and friends)."""
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_only
from accelerate import Accelerator

accelerator = Accelerator()


@rank_zero_only
def log_metrics(metrics):
    dist.all_reduce(metrics)  # expect: DTW001
    print(metrics)


@accelerator.on_main_process
def upload(t):
    dist.barrier()  # expect: DTW001


def compute_metrics(metrics):  # not decorated: runs on every rank
    dist.all_reduce(metrics)
    return metrics
