"""Worker for tests/test_completion.py (2 ranks, gloo_async): a collective that returned stays in flight
in the ring until it completed, and the group reports what completed.

Rank 1 joins each collective 1.5 s late. Rank 0 reads its own ring while it waits and writes what it
saw to ``$REC_OUT/rank-0.json``.
"""
import json
import os
import time

import torch
import torch.distributed as dist

import dtwatch
import dtwatch.auto
import dtwatch.testing

LATE = 1.5


def ring_view() -> dict:
    snap = dtwatch.read_ring(os.path.join(os.environ["DTWATCH_DIR"], os.environ["DTWATCH_JOB_ID"], "rank-00000.ring"))
    recs = [r for r in snap.records_list() if not r.is_marker]
    g = snap.groups[0]
    return {"records": [{"op": r.op, "seq": r.seq, "in_flight": r.in_flight, "flags": r.flags} for r in recs],
            "group": {"tracked": g.tracked, "completed_seq": g.completed_seq}}


def main() -> None:
    dist.init_process_group("gloo_async")
    rank = dist.get_rank()
    t = torch.ones(4)
    seen = {}
    if rank == 1:
        time.sleep(LATE)
    dist.all_reduce(t)  # returns at once on rank 0
    if rank == 0:
        time.sleep(0.6)  # several sampler ticks: still in flight, rank 1 has not joined
        seen["returned"] = ring_view()
    dtwatch.testing.synchronize()
    if rank == 0:
        time.sleep(0.6)
        seen["synchronized"] = ring_view()
    # async_op work: in flight until completed, whatever wait() did
    if rank == 1:
        time.sleep(LATE)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    if rank == 0:
        time.sleep(0.6)
        seen["async_waited"] = ring_view()
    dtwatch.testing.synchronize()
    dist.barrier()  # blocks: completes when it returns
    if rank == 0:
        seen["after_barrier"] = ring_view()
        time.sleep(0.6)
        seen["settled"] = ring_view()
        with open(os.path.join(os.environ["REC_OUT"], "rank-0.json"), "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
