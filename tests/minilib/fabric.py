"""A Fabric-like helper: rank properties, collectives, and a checkpoint save that synchronises."""
import torch
import torch.distributed as dist


class Fabric:
    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor / self.world_size

    def save(self, path: str, state: dict) -> None:
        """Write a checkpoint, then wait for every rank (meant to be called on every rank)."""
        if self.global_rank == 0:
            torch.save(state, path)
        self.barrier()
