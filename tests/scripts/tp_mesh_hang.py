"""A tensor-parallel training job whose default process group comes from ``init_device_mesh``, hanging
on a rank-conditional barrier. Used by tests/test_watchdog.py.

    torchrun --nproc-per-node 2 tp_mesh_hang.py SCENARIO     (SCENARIO: tp_rank_conditional)

The model is a two-layer MLP split column-wise then row-wise across the mesh (DTensor on CPU, gloo);
its collectives are issued from C++ (functional collectives), the job's own metric all_reduce and the
faulty barrier from Python. Before the hang it writes ``<DTWATCH_DIR>/<job>/onset-rank<R>.txt``.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtwatch.auto  # noqa: F401  (first line, as the README says)

HANG_STEP = 4


def mark_onset() -> None:
    path = os.path.join(os.environ["DTWATCH_DIR"], os.environ["DTWATCH_JOB_ID"], f"onset-rank{dist.get_rank()}.txt")
    with open(path, "w") as f:
        f.write(repr(time.time()))


def main() -> None:
    assert sys.argv[1] == "tp_rank_conditional", sys.argv
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    metric = torch.zeros(1)
    for step in range(1, 20):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        metric += loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        if step == HANG_STEP:
            mark_onset()
            if rank == 0:
                dist.barrier(group=mesh.get_group("tp"))  # site:tp_barrier
        dist.all_reduce(metric, group=mesh.get_group("tp"))  # site:tp_metric
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
