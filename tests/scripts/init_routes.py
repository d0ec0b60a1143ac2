"""Worker for tests/test_attach.py: create the default process group by one ROUTE, run collectives, report.

    torchrun --nproc-per-node 2 init_routes.py ROUTE

Writes ``$REC_OUT/rank-<R>.json``: whether dtwatch attached (a ring exists for this process), the
ring's path, and the default group's torch sequence number at the end. The Python collectives carry
``# site:<name>`` markers.
"""
import json
import os
import sys
import time
import warnings

# Bound before dtwatch is installed, exactly as torch.distributed.device_mesh binds it.
from torch.distributed.distributed_c10d import init_process_group as init_by_name

ROUTE = sys.argv[1]
if ROUTE != "install_after_init":
    import dtwatch.auto

import torch
import torch.distributed as dist

import dtwatch
from dtwatch.record import installation

c10d = dist.distributed_c10d


def without_c10d_hook() -> None:
    """As on a torch without ``_update_default_pg``: only the first-use probe and the poll remain."""
    rec = installation.active()
    for owner, attr, original, wrapper in rec.patched:
        if attr == "_update_default_pg" and getattr(owner, attr) is wrapper:
            setattr(owner, attr, original)


def python_collectives(group=None) -> None:
    t = torch.ones(3)
    for _ in range(3):
        dist.all_reduce(t, group=group)  # site:route_all_reduce
    dist.barrier(group=group)  # site:route_barrier


def main() -> dict:
    note: dict = {"route": ROUTE}
    if ROUTE == "init_process_group":
        dist.init_process_group("gloo")
        python_collectives()
    elif ROUTE == "imported_by_name":
        init_by_name("gloo")
        python_collectives()
    elif ROUTE == "init_device_mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
        python_collectives(mesh.get_group("tp"))
    elif ROUTE == "install_after_init":
        dist.init_process_group("gloo")
        dtwatch.install()
        python_collectives()
    elif ROUTE == "explicit_groups":
        dist.init_process_group("gloo")
        pair = dist.new_group(list(range(dist.get_world_size())))
        python_collectives(pair)
        python_collectives(dist.group.WORLD)
    elif ROUTE == "accelerate":
        from accelerate import PartialState

        PartialState(cpu=True, backend="gloo")
        python_collectives()
    elif ROUTE == "lightning_fabric":
        from lightning.fabric import Fabric

        Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp").launch()
        python_collectives()
    elif ROUTE == "without_c10d_hook":
        without_c10d_hook()
        init_by_name("gloo")
        note["attached_before_first_use"] = installation.active().mm is not None
        python_collectives()
    elif ROUTE == "cpp_only_without_hook":
        # Nothing from Python after init: collectives issued from C++ only (as DDP's reducer does);
        # the 0.5 s poll is what attaches.
        without_c10d_hook()
        init_by_name("gloo")
        # A fixed count, not a deadline: each rank's clock would give it its own count, and the rank
        # with one call more would wait for a peer that has gone (about 3 s at 0.05 s a call).
        pg = c10d.GroupMember.WORLD
        for _ in range(60):
            pg.allreduce([torch.ones(2)]).wait()
            time.sleep(0.05)
    elif ROUTE == "constructed_group_no_default":
        # A ProcessGroup constructed directly and passed around, no default group: not recorded, one warning.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                              int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]) == 0)
        pg = dist.ProcessGroupGloo(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            python_collectives(pg)
        note["warnings"] = [str(w.message) for w in caught if "dtwatch" in str(w.message)]
        pg.barrier().wait()
    else:
        raise SystemExit(f"unknown route {ROUTE}")
    rec = installation.active()
    note["attached"] = rec is not None and rec.mm is not None
    note["ring"] = str(rec.ring.path) if rec is not None and rec.ring is not None else None
    if dist.is_initialized():
        note["default_seq"] = c10d._get_default_group()._get_sequence_number_for_group()
        time.sleep(0.3)  # a sampler tick or two: C++ sequence numbers reach the ring
    return note


if __name__ == "__main__":
    result = main()
    rank = os.environ["RANK"]
    with open(os.path.join(os.environ["REC_OUT"], f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()
