"""The classic: a collective that only rank 0 reaches."""
import torch
import torch.distributed as dist


def save_checkpoint(model, path):
    rank = dist.get_rank()
    dist.barrier()  # outside any branch: every rank calls it
    if rank == 0:
        torch.save(model.state_dict(), path)
        dist.barrier()  # expect: DTW001
    if rank == 0:
        print("saved", path)  # a rank-0 side effect is fine
    if dist.get_rank() == 0:
        def report():
            dist.barrier()  # only defined here; whoever calls it may do so on every rank
        print(report)
    if dist.barrier() is None and rank == 0:  # the test itself runs on every rank
        print("after barrier")


def evaluate(metrics, rankings):
    if rankings:  # "rankings" is not a rank
        dist.all_reduce(metrics)
    ranker = len(rankings)
    if ranker > 1:  # neither is "ranker"
        dist.all_reduce(metrics)
