"""A rank-conditional exit that makes the other ranks wait in a later collective alone."""
import sys

import torch.distributed as dist


def train(loader, loss, rank):
    for batch in loader:
        if rank == 0 and batch is None:
            continue  # expect: DTW002
        dist.all_reduce(loss)
        if rank == 0 and loss.item() < 0.01:
            break  # expect: DTW002


def train_until(loader, loss, rank):
    for batch in loader:
        dist.all_reduce(loss)
        if rank == 0 and loss.item() < 0.01:
            return loss  # expect: DTW002
    return loss


def checkpoint(model, rank):
    if rank != 0:
        return  # expect: DTW002
    dist.barrier()


def shutdown(rank, ok):
    if rank == 0 and not ok:
        sys.exit(1)  # expect: DTW002
    dist.destroy_process_group()


def fine_early_return(t, rank):
    dist.all_reduce(t)
    if rank == 0:
        return t  # nothing collective follows
    return None


def fine_loop_exits(t, rank, loader):
    for batch in loader:
        dist.all_reduce(t)
        if batch is None:  # not a rank test: every rank stops together
            break
    for batch in loader:
        if rank == 0:
            for item in batch:
                if item is None:
                    break  # leaves a loop that only rank 0 runs
    for batch in loader:
        dist.all_reduce(t)
        if rank == 0:
            continue  # only skips the print below
        print(batch)
    return t
