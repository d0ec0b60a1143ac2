"""A DDP job that hangs the classic way: validation on rank 0 hides a collective.

Every 10 steps rank 0 validates and then all ranks meet at a barrier. ``validate`` computes its metric
with ``dist.all_reduce`` — so rank 0 sits in all_reduce while ranks 1..N-1 sit in barrier, forever
(until torch's 30-minute timeout). dtwatch names the rank, the collective and both lines:

    dtwatch run --stall-window 5 --fail-fast -- torchrun --nproc-per-node 4 examples/hang_rank_conditional.py
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def validate(model: torch.nn.Module) -> float:
    with torch.no_grad():
        loss = model(torch.randn(64, 32)).pow(2).mean()
    dist.all_reduce(loss)  # the hidden collective: only the ranks that validate get here
    return loss.item() / dist.get_world_size()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 41):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            if rank == 0:
                print(f"step {step}: validation loss {validate(model):.4f}", flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
