"""Rank tests inside expressions and loops."""
import torch.distributed as dist


def step(t, rank, world):
    out = dist.all_reduce(t) if rank == 0 else None  # expect: DTW001
    out = None if rank == 0 else dist.all_reduce(t)  # expect: DTW001
    rank == 0 and dist.barrier()  # expect: DTW001
    if rank != 0 or dist.barrier():  # expect: DTW001
        pass
    while rank < world:
        dist.barrier()  # expect: DTW001
        world -= 1
    callback = (lambda: dist.barrier()) if rank == 0 else None  # defined, not called
    return out, callback


class Settings:
    if dist.get_rank() == 0:  # a class body runs where the class statement does
        dist.barrier()  # expect: DTW001

    def method(self):
        dist.barrier()  # a method is only defined here
