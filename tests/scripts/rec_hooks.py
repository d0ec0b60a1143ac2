"""Worker for tests/test_hooks.py: collectives that no torch.distributed function issues, beside ones that one
does (2 ranks). Backend: ``HANG_BACKEND`` (gloo / gloo_async).

Each call carries a ``# site:<name>`` marker. After each one the worker notes torch's own sequence counter of
the group; at the end it writes the notes to ``$REC_OUT/rank-<R>.json``.
"""
import json
import os

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.nn.parallel import DistributedDataParallel as DDP

import dtwatch.auto  # noqa: F401  (first: installs before init_process_group)


def main() -> None:
    name = os.environ.get("HANG_BACKEND", "gloo")
    if name == "gloo_async":
        from dtwatch.testing import gloo_async

        gloo_async.register()
    dist.init_process_group(name)
    rank = dist.get_rank()
    world = dist.group.WORLD
    notes = {}

    def done(site, group=world):
        notes[site] = group._get_sequence_number_for_group()

    t = torch.ones(4, 3)
    dist.all_reduce(t)  # site:eager
    done("eager")
    y = funcol.all_reduce(t, "sum", world)  # site:functional
    y = y + 1  # waits for it
    done("functional")
    gathered = funcol.all_gather_tensor(torch.full((2, 5), float(rank)), 0, world)  # site:functional_gather
    assert gathered.sum().item() == 10.0
    done("functional_gather")
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})  # site:object
    done("object")
    model = DDP(torch.nn.Linear(4, 2))  # site:ddp_wrap
    done("ddp_wrap")
    model(torch.randn(3, 4)).sum().backward()  # site:ddp_backward
    done("ddp_backward")
    sub = dist.new_group([0, 1])  # used only by a functional collective
    y = funcol.all_reduce(torch.ones(7), "sum", sub)  # site:subgroup_functional
    y = y + 1
    done("subgroup_functional", sub)
    dist.barrier()  # site:barrier
    done("barrier")
    if name == "gloo_async":
        from dtwatch.testing import synchronize

        synchronize()
    with open(os.path.join(os.environ["REC_OUT"], f"rank-{rank}.json"), "w") as f:
        json.dump({"seq": notes, "subgroup": dist.distributed_c10d._get_process_group_name(sub)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
