"""Calls of the file's own functions that run a collective inside: followed only where the lint sees
the code (same file); an object of a class it cannot see is never guessed from its name."""
import torch
import torch.distributed as dist
from myproject.checkpoint import RemoteCheckpointer
from torch.distributed.checkpoint.state_dict import get_model_state_dict


def sync_all(t):
    dist.all_reduce(t)


def sync_twice(t):
    sync_all(t)


def write(t, path):
    torch.save(t, path)


class Checkpointer:
    def __init__(self, folder):
        self.folder = folder

    def save(self, model):
        full = self._full_state_dict(model)  # every rank gathers...
        if dist.get_rank() == 0:
            torch.save(full, self.folder)  # ...rank 0 writes

    def _full_state_dict(self, model):
        return get_model_state_dict(model)

    def describe(self):
        return self.folder


class Trainer:
    def __init__(self, model, rank):
        self.model, self.rank = model, rank
        self.ckpt = Checkpointer("checkpoints")
        self.remote = RemoteCheckpointer("s3://bucket")

    def epoch_end(self, t):
        if self.rank == 0:
            self.ckpt.save(self.model)  # expect: DTW001
            self.sync(t)  # expect: DTW001
            self.ckpt.describe()
            self.remote.save(self.model)  # a class the lint cannot see: not guessed
            self.report()
        self.ckpt.save(self.model)  # every rank: fine

    def sync(self, t):
        sync_twice(t)

    def report(self):
        print(self.ckpt.describe())


def main(model, t, rank, evaluate):
    checkpointer = Checkpointer("checkpoints")
    remote = RemoteCheckpointer("s3://bucket")
    if rank == 0:
        checkpointer.save(model)  # expect: DTW001
        sync_twice(t)  # expect: DTW001
        write(t, "t.pt")
        remote.save(model)
        evaluate(t)  # a parameter, not the file's function of that name
    if rank == 0:  # both sides reach the same function: every rank takes part
        sync_all(t)
    else:
        sync_all(t)


def evaluate(t):
    dist.all_reduce(t)


def stop_early(model, rank):
    checkpointer = Checkpointer("checkpoints")
    if rank != 0:
        return  # expect: DTW002
    checkpointer.save(model)


def recursive(n, t):
    if n:
        return recursive(n - 1, t)
    return t
