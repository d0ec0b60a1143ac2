"""Training jobs with a setup mistake that never hangs (or none): the setup checks' end-to-end tests.

    python setup_worker.py SCENARIO    (under torchrun, gloo, CPU)

Every scenario trains a small DDP model for a few epochs and ends normally. Lines that tests assert
on carry a ``# site:<name>`` marker.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import dtwatch.auto  # noqa: F401

SCENARIO = sys.argv[1]
EPOCHS = int(os.environ.get("EPOCHS", "3"))
PAUSE = float(os.environ.get("STEP_PAUSE", "0.15"))


class Net(torch.nn.Module):
    def __init__(self, frozen_head: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        if frozen_head:  # loaded on one rank only: DDP accepts it (it compares trainable parameters)
            self.head = torch.nn.Linear(4, 4)
            self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Stream(IterableDataset):
    """A stream of samples that every rank reads whole (it does not split itself by rank)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(7)
        for _ in range(48):
            yield torch.randn(8, generator=g)


def dataset(size: int = 64, seed: int = 0) -> TensorDataset:
    return TensorDataset(torch.randn(size, 8, generator=torch.Generator().manual_seed(seed)))


def train(model, loader, sampler=None, set_epoch=True) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(EPOCHS):
        if sampler is not None and set_epoch:
            sampler.set_epoch(epoch)
        for batch in loader:  # site:train_loop
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(PAUSE)


def evaluate(model, loader) -> None:
    model.eval()
    with torch.no_grad():
        total = torch.zeros(1)
        for (x,) in loader:  # site:eval_loop
            total += model(x).sum()
        dist.all_reduce(total)
    model.train()


def main() -> None:
    if SCENARIO == "not_distributed":
        # Launched by torchrun, but the script never initialises torch.distributed (as Accelerate on CPU
        # without ACCELERATE_USE_CPU): every rank trains alone.
        alone = Net()
        opt = torch.optim.SGD(alone.parameters(), lr=0.01)
        deadline = time.time() + float(os.environ.get("ALONE_SECONDS", "16"))
        while time.time() < deadline:
            loss = alone(torch.randn(8, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # site:alone_step
            time.sleep(0.1)
        return

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    if SCENARIO == "healthy":
        # The setup done right: DistributedSampler with set_epoch, the same drop_last everywhere, and an
        # evaluation loop on every rank over the whole validation set (no_grad: not training data).
        model = DDP(Net())
        data = dataset(64)
        sampler: DistributedSampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=True)
        val = DataLoader(dataset(32, seed=1), batch_size=8)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for (x,) in loader:
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                time.sleep(PAUSE)
            evaluate(model, val)
        per_rank = DataLoader(dataset(48, seed=100 + rank), batch_size=8, shuffle=True)  # a per-rank shard
        train(model, per_rank)

    elif SCENARIO == "same_data_sequential":
        # No DistributedSampler: every rank iterates the whole dataset in the same order.
        model = DDP(Net())
        loader = DataLoader(dataset(64), batch_size=8)  # site:sequential_loader
        train(model, loader)

    elif SCENARIO == "same_data_iterable":
        model = DDP(Net())
        loader = DataLoader(Stream(), batch_size=8)
        train(model, loader)

    elif SCENARIO == "same_data_random":
        # shuffle=True without a DistributedSampler: orders differ, but every rank reads the whole dataset.
        torch.manual_seed(rank)
        model = DDP(Net())
        loader = DataLoader(dataset(64), batch_size=8, shuffle=True)
        train(model, loader)

    elif SCENARIO == "sampler_rank":
        model = DDP(Net())
        data = dataset(64)
        sampler = DistributedSampler(data, num_replicas=world, rank=0, shuffle=True)  # site:fixed_rank_sampler
        train(model, DataLoader(data, batch_size=8, sampler=sampler), sampler)

    elif SCENARIO == "same_shuffle":
        model = DDP(Net())
        data = dataset(64)
        sampler = DistributedSampler(data, shuffle=True)
        train(model, DataLoader(data, batch_size=8, sampler=sampler), sampler, set_epoch=False)

    elif SCENARIO == "drop_last":
        # 64 samples over 2 ranks in batches of 8 divide evenly: the lengths agree today.
        model = DDP(Net())
        data = dataset(64)
        sampler = DistributedSampler(data, shuffle=True)
        loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=rank == 1)  # site:drop_last_loader
        train(model, loader, sampler)

    elif SCENARIO == "config_divergence":
        model = DDP(Net(frozen_head=rank == 1))  # site:ddp_wrap
        data = dataset(64)
        sampler = DistributedSampler(data, shuffle=True)
        train(model, DataLoader(data, batch_size=8, sampler=sampler), sampler)

    elif SCENARIO == "healthy_peek":
        # As the DDP tutorial does: the batch size read from a first batch at each epoch's start, before
        # set_epoch, then the loop. The peek sees the previous epoch; the loop sees the new one.
        model = DDP(Net())
        data = dataset(64)
        sampler = DistributedSampler(data, shuffle=True)
        loader = DataLoader(data, batch_size=8, sampler=sampler)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for epoch in range(EPOCHS):
            batch_size = len(next(iter(loader))[0])  # site:peek
            sampler.set_epoch(epoch)
            for (x,) in loader:
                loss = model(x[:batch_size]).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                time.sleep(PAUSE)

    else:
        raise SystemExit(f"unknown scenario {SCENARIO}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
