"""A healthy, busy training worker for benchmarks/detection.py (watchdog CPU use): a steady stream of
collectives and optimizer steps for a while, then a clean exit. Run under torchrun:

    BUSY_SECONDS=40 torchrun --nproc-per-node 8 benchmarks/workers/busy_worker.py

Per step: a small MLP forward/backward, a Python all_reduce of the flattened gradients, an optimizer
step (dtwatch counts it as a step), a MIN all_reduce of a "keep going" flag (so every rank runs the
same number of steps and stops together), and every 50 steps a barrier. ``BUSY_SLEEP`` (default
0.01 s) of "compute" per step keeps the stream steady rather than CPU-bound. Writes nothing but its
ring; prints the step count and collective rate of rank 0 at the end.
"""
import os
import time

import torch
import torch.distributed as dist

import dtwatch.auto  # noqa: F401  (first: before init_process_group)


def grad_of(p: torch.nn.Parameter) -> torch.Tensor:
    """``p``'s gradient, which backward() has just set (every parameter takes part in the loss)."""
    if p.grad is None:
        raise RuntimeError("a parameter got no gradient")
    return p.grad


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seconds = float(os.environ.get("BUSY_SECONDS", "40"))
    pause = float(os.environ.get("BUSY_SLEEP", "0.01"))
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    params = list(model.parameters())
    go = torch.ones(1)
    dist.barrier()
    start = time.time()
    end = start + seconds
    steps = calls = 0
    while True:
        loss = model(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([grad_of(p).reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            grad = grad_of(p)
            grad.copy_(flat[offset:offset + n].view_as(grad)).div_(dist.get_world_size())
            offset += n
        opt.step()
        steps += 1
        time.sleep(pause)
        go.fill_(1.0 if time.time() < end else 0.0)
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        calls += 2
        if steps % 50 == 0:
            dist.barrier()
            calls += 1
        if go.item() == 0.0:
            break
    elapsed = time.time() - start
    dist.barrier()
    if rank == 0:
        print(f"busy_worker: {steps} steps, {calls} collectives in {elapsed:.1f}s "
              f"({calls / elapsed:.1f} collectives/s per rank)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
