"""Jobs whose collectives are issued by torch itself, not by a torch.distributed function: a tensor-parallel
model (DTensor's functional collectives) and a ``torch.compile``d model with a functional all-reduce. Each
hangs on a rank-conditional call. Used by tests/test_hooks.py.

    torchrun --nproc-per-node 2 functional_hang.py SCENARIO

* ``tp_eval_on_rank0``: a two-layer MLP split column- then row-wise over a 1-D mesh (``init_device_mesh`` +
  ``parallelize_module``); at step 4 only rank 0 runs an evaluation forward (its row-wise layer all-reduces
  the output), while rank 1 goes on to the barrier after it.
* ``compiled_eval_on_rank0``: a model whose forward all-reduces its activations with
  ``torch.distributed._functional_collectives.all_reduce``, compiled with ``torch.compile``; the same
  rank-conditional evaluation forward.
* ``tp_eval_every_step_on_rank0``: the tensor-parallel job with no collective of its own between steps; rank 0
  runs an evaluation forward of the training batch's shape after every step, whose all_reduce pairs silently with
  rank 1's next training calls, so rank 1 runs through its loop on them and exits while rank 0 is mid-way.
  ``..._own_model``: the same with a model class of the user's own, whose ``forward`` every call runs through.
* ``tp_healthy`` / ``compiled_healthy``: the same jobs without the fault (no finding may come of them).

Backend: ``HANG_BACKEND`` (gloo / gloo_async). Before the fault each rank writes
``<DTWATCH_DIR>/<job>/onset-rank<R>.txt``.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import dtwatch.auto  # noqa: F401  (first line, as the README says)

HANG_STEP = 4
STEPS = 12


def mark_onset() -> None:
    path = os.path.join(os.environ["DTWATCH_DIR"], os.environ["DTWATCH_JOB_ID"], f"onset-rank{dist.get_rank()}.txt")
    with open(path, "w") as f:
        f.write(repr(time.time()))


def backend() -> str:
    name = os.environ.get("HANG_BACKEND", "gloo")
    if name == "gloo_async":
        from dtwatch.testing import gloo_async

        gloo_async.register()
    return name


def synchronize() -> None:
    if os.environ.get("HANG_BACKEND") == "gloo_async":
        from dtwatch.testing import synchronize as sync

        sync()  # where a GPU job would call torch.cuda.synchronize()


class ToyMLP(torch.nn.Module):
    """A model of the user's own (as in pytorch/examples' tensor-parallel example): its forward is user code."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj, self.relu, self.out_proj = torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))  # site:toy_forward


def tp_model(own_model: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group(backend())  # the mesh's one dimension is the default group
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    if own_model:
        return parallelize_module(ToyMLP(), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


class AllReducedMLP(torch.nn.Module):
    """Each rank holds the whole model; the hidden activations are summed over the ranks in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        h = funcol.all_reduce(torch.relu(self.fc1(x)), "sum", dist.group.WORLD)
        return self.fc2(h)


def compiled_model():
    dist.init_process_group(backend())
    torch.manual_seed(0)
    # aot_eager: the graph dynamo captured, run without inductor's code generation (seconds on a CPU)
    return torch.compile(AllReducedMLP(), backend="aot_eager")


def main() -> None:
    scenario = sys.argv[1]
    model = tp_model(own_model=scenario.endswith("_own_model")) if scenario.startswith("tp_") else compiled_model()
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    metric = torch.zeros(1)
    if scenario.startswith("tp_eval_every_step_on_rank0"):
        for step in range(1, STEPS + 1):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 1:
                mark_onset()
            if rank == 0:  # site:every_step_branch
                with torch.no_grad():
                    model(torch.randn(8, 16))  # site:every_step_eval
        dist.destroy_process_group()
        return
    for step in range(1, STEPS + 1):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        metric += loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        dist.all_reduce(metric)  # site:metric_all_reduce
        if step == HANG_STEP:
            if scenario.endswith("_eval_on_rank0"):
                mark_onset()
                if rank == 0:
                    with torch.no_grad():
                        model(torch.randn(4, 16))  # site:eval_forward
            dist.barrier()  # site:eval_barrier
        synchronize()  # site:sync
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
