"""Both sides of a rank test are conditional: the else side, and every elif."""
import torch.distributed as dist


def sync(tensor, rank):
    if rank == 0:
        tensor.zero_()
    else:
        dist.all_reduce(tensor)  # expect: DTW001


def route(tensor, rank, world_size):
    if rank == 0:
        print("leader")
    elif rank == world_size - 1:
        dist.broadcast(tensor, src=0)  # expect: DTW001
    elif dist.all_reduce(tensor) is None:  # expect: DTW001
        pass
    else:
        dist.barrier()  # expect: DTW001
    dist.barrier()
