"""Suppression comments on the reported line."""
import torch.distributed as dist


def save(rank, t):
    if rank == 0:
        dist.barrier()  # dtwatch: ignore
        dist.barrier()  # noqa: DTW001
        dist.barrier()  # noqa
        dist.barrier()  # noqa: E501  (another tool's code: still reported)  # expect: DTW001
