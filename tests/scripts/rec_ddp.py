"""Worker for tests/test_recorder.py::test_ddp_training_loop (2 ranks, gloo, CPU).

A small DDP training loop fed by a DataLoader with a DistributedSampler. At the end the worker writes
what torch itself says (the default group's sequence number, optimizer steps, ``len(loader)``) and its
Flight Recorder dump to ``$REC_OUT/rank-<R>.json`` / ``.fr.pkl``, then destroys the process group.
"""
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import dtwatch.auto  # noqa: F401  (first: installs before init_process_group)

EPOCHS = 2


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        total = torch.zeros(1)
        for x, y in loader:  # site:loader
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # site:backward  (the DDP reducer all-reduces the gradient bucket here, from C++)
            opt.step()
            steps += 1
            total += loss.detach()
        dist.all_reduce(total)  # site:epoch_loss
    pg = dist.distributed_c10d._get_default_group()
    result = {
        "rank": rank, "seq": pg._get_sequence_number_for_group(), "steps": steps, "len_loader": len(loader),
        "epochs": EPOCHS, "group": dist.distributed_c10d._get_process_group_name(pg),
    }
    out = os.environ["REC_OUT"]
    with open(os.path.join(out, f"rank-{rank}.fr.pkl"), "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace())
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
