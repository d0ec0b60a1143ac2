"""A correct training loop: every rank runs every collective; only side effects are gated."""
import os

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    model = torch.nn.Linear(4, 4)
    for step in range(10):
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        stop = torch.tensor(int(rank == 0 and step == 5))
        dist.broadcast(stop, src=0)  # the decision to stop is shared, not taken alone
        if stop.item():
            break
        if rank == 0:
            print(f"step {step} loss {loss.item():.3f} (local rank {local_rank})")
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
