"""A tiny real 2-rank gloo job whose rings feed the exporter tests (``tests/exporter_helpers.py``).

Run under torchrun with ``DTWATCH_DIR``/``DTWATCH_JOB_ID`` set and ``DTWATCH_WATCHDOG=off``. It does
``--steps`` optimizer steps; each does ``--per-step`` all_reduces on the default group, one broadcast
on a second group of both ranks, and ``optimizer.step()`` (which dtwatch records as a step marker).
Then one barrier. Each rank writes what it did to ``<--out>/rank-<r>.json``: the sequence number of
each group as torch counts it, and how many calls of each op it issued. With ``--hold-until FILE`` the
ranks then stay alive, outside any collective, until FILE exists (at most 120 s), so a watchdog and a
Prometheus server can observe a live, healthy job.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import dtwatch.auto  # noqa: F401  (first: installs dtwatch from the DTWATCH_* environment)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--per-step", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold-until", default="")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = dist.new_group([0, 1])
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = torch.ones(16, dtype=torch.float32)
    counts = {"all_reduce": 0, "broadcast": 0, "barrier": 0}
    for _ in range(args.steps):
        for _ in range(args.per_step):
            dist.all_reduce(t)
            counts["all_reduce"] += 1
        dist.broadcast(t, src=0, group=side)
        counts["broadcast"] += 1
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    counts["barrier"] += 1

    seqs = {
        dist.distributed_c10d._get_process_group_name(pg): pg._get_sequence_number_for_group()
        for pg in (dist.group.WORLD, side)
    }
    result = {"rank": rank, "seq": seqs, "counts": counts, "steps": args.steps}
    print(json.dumps(result), flush=True)
    path = os.path.join(args.out, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)  # readers never see half a file
    deadline = time.time() + 120
    while args.hold_until and not os.path.exists(args.hold_until) and time.time() < deadline:
        time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
