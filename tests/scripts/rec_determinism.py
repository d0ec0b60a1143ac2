"""Worker for tests/test_recorder.py::test_results_identical_with_and_without_dtwatch (2 ranks, gloo).

Deterministic collectives and 3 DDP steps with fixed seeds; saves every result to
``$REC_OUT/rank-<R>.pt``. Run once with dtwatch (``import dtwatch.auto``) and once with
``DTWATCH_ENABLED=0``; the test compares the files bitwise.
"""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dtwatch.auto  # noqa: F401  (DTWATCH_ENABLED=0 turns it into a no-op)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234 + rank)
    out = {}

    t = torch.randn(1000, generator=gen)
    dist.all_reduce(t)
    out["all_reduce"] = t
    parts = [torch.empty(33) for _ in range(world)]
    dist.all_gather(parts, torch.randn(33, generator=gen))
    out["all_gather"] = torch.stack(parts)
    rs = torch.empty(50)
    dist.reduce_scatter_tensor(rs, torch.randn(50 * world, generator=gen))
    out["reduce_scatter_tensor"] = rs
    b = torch.randn(17, 3, generator=gen)
    dist.broadcast(b, src=1)
    out["broadcast"] = b
    h = dist.all_reduce(c := torch.randn(64, dtype=torch.float64, generator=gen), async_op=True)
    h.wait()
    out["async_all_reduce"] = c

    torch.manual_seed(7)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for name, p in model.named_parameters():
            out[f"grad{step}.{name}"] = p.grad.clone()
        opt.step()
    for name, p in model.named_parameters():
        out[f"param.{name}"] = p.detach().clone()
    torch.save(out, os.path.join(os.environ["REC_OUT"], f"rank-{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
