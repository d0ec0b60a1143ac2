"""Point-to-point ops are written rank-conditionally on purpose: DTW003, off in the CLI by default."""
import torch.distributed as dist


def exchange(t, rank):
    if rank == 0:
        dist.send(t, dst=1)  # expect: DTW003
    else:
        dist.recv(t, src=0)  # expect: DTW003
    dist.barrier()
