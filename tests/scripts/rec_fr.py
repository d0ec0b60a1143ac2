"""Worker for tests/test_flight.py (2 ranks, gloo): Python- and C++-issued collectives side by side.

Python collectives (some after two send/recv pairs, so that FR's two counters differ), a DDP model whose
forward (bucket rebuild broadcasts, step 2) and backward (gradient all-reduce) issue collectives from
C++, an object collective and a subgroup. After every phase the worker notes torch's own sequence
counter of the group; at the end it writes the notes (``$REC_OUT/rank-<R>.json``) and its Flight
Recorder dump (``rank-<R>.fr.pkl``).
"""
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dtwatch.auto  # noqa: F401  (first: installs before init_process_group; turns the Flight Recorder on)

c10d = dist.distributed_c10d
STEPS = 3


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    default = c10d._get_default_group()
    sub = dist.new_group([0, 1])
    notes = []

    def note(phase, group=default):
        notes.append({"phase": phase, "group": c10d._get_process_group_name(group),
                      "seq": group._get_sequence_number_for_group()})

    note("start")
    t = torch.ones(4, 3)
    dist.all_reduce(t)
    note("python")
    for sender in (0, 1):  # two p2p ops: FR's collective_seq_id falls two behind the group counter
        if rank == sender:
            dist.send(torch.ones(2), 1 - sender)
        else:
            dist.recv(torch.empty(2), sender)
        note("p2p")
    dist.barrier()
    note("python")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))  # site:ddp
    note("ddp_init")
    for _ in range(STEPS):
        out = model(torch.randn(5, 6))  # site:forward
        note("forward")
        out.sum().backward()  # site:backward
        note("backward")
    dist.broadcast(torch.zeros(7), src=0)
    note("python")
    objs = [None, None]
    dist.all_gather_object(objs, rank)
    note("python")
    dist.all_reduce(torch.ones(2, 2), group=sub)
    note("python", sub)
    out_dir = os.environ["REC_OUT"]
    with open(os.path.join(out_dir, f"rank-{rank}.fr.pkl"), "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace())
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "torch": torch.__version__, "notes": notes}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
