"""An Accelerate-like helper: main-process checks, gather, wait_for_everyone, reduce."""
import torch
import torch.distributed as dist


class Accelerator:
    @property
    def process_index(self) -> int:
        return dist.get_rank()

    @property
    def is_main_process(self) -> bool:
        return dist.get_rank() == 0

    def wait_for_everyone(self) -> None:
        dist.barrier()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(out, tensor)
        return torch.cat(out)

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def gather_for_metrics(self, obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
