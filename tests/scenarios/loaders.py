"""DataLoaders told apart, and evaluation loops with and without collectives.

    python loaders.py VARIANT     (under torchrun, 4 ranks)

trainer      a Trainer whose one _run_epoch(loader) iterates a training loader (12 batches a rank, DDP) and an
             evaluation loader (3 batches a rank, under no_grad, no collective), both made at one line of a
             make_loader() helper; rank 0 evaluates slowest, so the others start the next epoch's training
             while it still evaluates; after the last epoch every rank all_gather_objects its losses: healthy
eval_local   every rank evaluates its own shard (3 + rank batches) under no_grad with no collective inside the
             loop, then all ranks all_gather_object the results: healthy
eval_reduce  the same evaluation loop with an all_reduce of the loss per batch; rank 1's shard has 4 batches, the
             others' 6: rank 1 leaves the loop first and waits in the all_gather_object after it
"""
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common import capture_point, ddp_model, finish, mark_onset, setup

VARIANT = sys.argv[1]


def make_loader(dataset, shuffle: bool) -> DataLoader:
    return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=shuffle))  # site:make_loader


class Trainer:
    def __init__(self, rank: int, train_data: DataLoader, eval_data: DataLoader) -> None:
        self.rank = rank
        self.model, self.optimizer = ddp_model()
        self.train_data, self.eval_data = train_data, eval_data
        self.eval_losses: list[float] = []

    def _train_batch(self, x: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        time.sleep(0.05)
        return loss.item()

    def _eval_batch(self, x: torch.Tensor) -> float:
        time.sleep(1.0 if self.rank == 0 else 0.05)  # rank 0 evaluates slowest
        return self.model(x).pow(2).mean().item()

    def _run_epoch(self, dataloader: DataLoader, train: bool) -> float:
        total = 0.0
        for _step, (x,) in enumerate(dataloader):  # site:trainer_loop
            total += self._train_batch(x) if train else self._eval_batch(x)
        return total

    def fit(self, epochs: int) -> None:
        for epoch in range(epochs):
            self.train_data.sampler.set_epoch(epoch)
            self.model.train()
            self._run_epoch(self.train_data, train=True)
            self.model.eval()
            if epoch == 1:
                capture_point(2.0)  # rank 0 evaluates; the others already train the next epoch
            with torch.no_grad():
                self.eval_losses.append(self._run_epoch(self.eval_data, train=False))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.eval_losses)  # site:trainer_gather


def trainer(rank: int) -> None:
    train_set = TensorDataset(torch.randn(96, 8))
    eval_set = TensorDataset(torch.randn(24, 8))
    train_data = make_loader(train_set, shuffle=True)  # site:trainer_train_loader
    eval_data = make_loader(eval_set, shuffle=False)  # site:trainer_eval_loader
    Trainer(rank, train_data, eval_data).fit(epochs=3)


def train_steps(model, opt, n: int) -> None:
    for _ in range(n):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)


def eval_local(rank: int) -> None:
    model, opt = ddp_model()
    for epoch in range(2):
        train_steps(model, opt, 4)
        model.eval()
        shard = DataLoader(TensorDataset(torch.randn(4 * (3 + rank), 8)), batch_size=4)  # site:local_loader
        if epoch == 1:
            capture_point(1.0)  # every rank evaluates, rank 0 finishes first and waits in the gather
        total = 0.0
        with torch.no_grad():
            for (x,) in shard:  # site:local_loop
                total += model(x).pow(2).mean().item()
                time.sleep(0.4)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, total)  # site:local_gather
        model.train()


def eval_reduce(rank: int) -> None:
    model, opt = ddp_model()
    train_steps(model, opt, 4)
    model.eval()
    n = 6 if rank != 1 else 4  # site:reduce_count
    shard = DataLoader(TensorDataset(torch.randn(4 * n, 8)), batch_size=4)  # site:reduce_loader
    total = torch.zeros(1)
    with torch.no_grad():
        for (x,) in shard:  # site:reduce_loop
            loss = model(x).pow(2).mean().reshape(1)
            dist.all_reduce(loss)  # site:reduce_step
            total += loss
            time.sleep(0.3)
    mark_onset()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, float(total))  # site:reduce_gather


def main() -> None:
    rank, _ = setup()
    {
        "trainer": lambda: trainer(rank),
        "eval_local": lambda: eval_local(rank),
        "eval_reduce": lambda: eval_reduce(rank),
    }[VARIANT]()
    finish()


if __name__ == "__main__":
    main()
