"""Collectives that every rank reaches, from different lines: not reported."""
from contextlib import contextmanager

import torch.distributed as dist


def scatter_chunks(t, chunks, rank, src=0):
    if rank == src:  # both sides call scatter once: every rank takes part
        dist.scatter(t, chunks, src=src)
    else:
        dist.scatter(t, None, src=src)


def scatter_then_barrier(t, chunks, rank):
    if rank == 0:
        dist.scatter(t, chunks, src=0)
        dist.barrier()  # expect: DTW001
    else:
        dist.scatter(t, None, src=0)


def broadcast_both_arms(t, rank):
    if rank == 0:  # the same call on both arms: every rank takes part
        dist.broadcast(t, 0)
    else:
        dist.broadcast(t, 0)


def broadcast_twice(t, rank):
    if rank == 0:  # one call too many on this side: both are reported
        dist.broadcast(t, src=0)  # expect: DTW001
        dist.broadcast(t, src=0)  # expect: DTW001
    else:
        dist.broadcast(t, src=0)


@contextmanager
def torch_distributed_zero_first(local_rank):
    """Rank 0 goes first: the others wait in a barrier that rank 0 joins after its work."""
    if local_rank not in [-1, 0]:
        dist.barrier()
    yield
    if local_rank == 0:
        dist.barrier()


@contextmanager
def main_process_first(is_main_process):
    try:
        if not is_main_process:
            dist.barrier()
        yield
    finally:
        if is_main_process:
            dist.barrier()


def rank_zero_twice(rank):
    if rank == 0:
        dist.barrier()  # expect: DTW001
    if rank == 0:  # the same test again does not let the other ranks in
        dist.barrier()  # expect: DTW001


def different_subjects(rank, local_rank):
    if rank != 0:
        dist.barrier()  # expect: DTW001
    if local_rank == 0:  # another rank's test: does not pair with the one above
        dist.barrier()  # expect: DTW001


def other_ranks_are_not_my_rank(t, group, world_size, src_rank, peer_rank):
    for rank in range(world_size):  # the same loop on every rank
        if rank == 0:
            dist.barrier()
    if src_rank == 0 or peer_rank > 1:
        dist.broadcast(t, src=src_rank)
    if dist.get_global_rank(group, 0) == 0:
        dist.barrier()
    if dist.get_global_rank(group, dist.get_rank(group)) == 0:
        dist.barrier()  # expect: DTW001


def ternary(t, rank, chunks):
    return dist.scatter(t, chunks) if rank == 0 else dist.scatter(t, None)
