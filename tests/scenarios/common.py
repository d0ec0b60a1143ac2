"""What every scenario script shares: process-group setup, tiny models, and the marks the runner reads.

The scripts run under ``dtwatch run`` (dtwatch is installed by the bootstrap, not imported here), so
they look like any user's training script. Before the fault, each writes the time it happened to
``$DTWATCH_DIR/$DTWATCH_JOB_ID/onset-rank<R>.txt`` (``mark_onset``), which the runner subtracts from
the detection time. Healthy controls name the moment to capture the live job (``capture_point``).

``SCENARIO_BACKEND`` picks the backend: ``gloo`` (default) or ``gloo_async`` (``dtwatch.testing``, the one
import of dtwatch: NCCL's execution model, where collectives return before they complete).
``synchronize()`` stands where a GPU job synchronises (``.item()``); on gloo it does nothing.
"""
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

HANG_STEP = 3  # the step at which most scenarios go wrong
SLEEP_FOREVER = 3600.0
BACKEND = os.environ.get("SCENARIO_BACKEND", "gloo")
if BACKEND == "gloo_async":
    import dtwatch.testing  # registers the backend

    synchronize = dtwatch.testing.synchronize
else:
    def synchronize() -> None:
        pass


def setup() -> tuple[int, int]:
    dist.init_process_group(BACKEND)
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size()


def _run_file(name: str) -> str:
    return os.path.join(os.environ["DTWATCH_DIR"], os.environ["DTWATCH_JOB_ID"], name)


def mark_onset() -> None:
    """Record when this rank's fault starts (before it hangs, raises or stops)."""
    with open(_run_file(f"onset-rank{dist.get_rank()}.txt"), "w") as f:
        f.write(repr(time.time()))


def capture_point(after: float) -> None:
    """Ask the runner to capture the live job ``after`` seconds from now (rank 0 only)."""
    if dist.get_rank() == 0:
        with open(_run_file("capture-at.txt"), "w") as f:
            f.write(repr(time.time() + after))


def tiny_model(width: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def ddp_model(width: int = 8) -> tuple[DDP, torch.optim.Optimizer]:
    model = DDP(tiny_model(width))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(width: int = 8) -> torch.Tensor:
    return torch.randn(4, width)


def finish() -> None:
    dist.barrier()
    dist.destroy_process_group()
