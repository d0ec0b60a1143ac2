"""An unmodified training script (no dtwatch import) that hangs on a rank-conditional barrier."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(2)
for step in range(1, 8):
    dist.all_reduce(t)
    if step == 5 and rank == 0:
        dist.barrier()  # site:plain_barrier
dist.destroy_process_group()
