"""Worker for tests/test_recorder.py::test_mixed_collectives (4 ranks, gloo).

Every recorded call carries a ``# site:<name>`` marker; the test finds the line numbers by parsing this
file. After each call the worker notes torch's own sequence counter of the group (``done``), and at the
end it writes those notes and its Flight Recorder dump to ``$REC_OUT/rank-<R>.json`` / ``.fr.pkl``.
"""
import json
import os

import torch
import torch.distributed as dist

import dtwatch.auto  # noqa: F401  (first: installs before init_process_group)

c10d = dist.distributed_c10d
NEW_NAMES = hasattr(dist, "all_gather_single")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, world
    default = c10d._get_default_group()
    notes = []

    def done(site, group=None):
        pg = default if group is None else group
        notes.append({"site": site, "group": c10d._get_process_group_name(pg),
                      "seq_after": pg._get_sequence_number_for_group()})

    t = torch.full((4, 3), float(rank + 1))
    dist.all_reduce(t)  # site:all_reduce
    done("all_reduce")
    assert t[0, 0].item() == 10.0
    outs = [torch.empty(5, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(outs, torch.arange(5) + rank)  # site:all_gather
    done("all_gather")
    big = torch.empty(world * 6)
    dist.all_gather_into_tensor(big, torch.full((6,), float(rank)))  # site:all_gather_into_tensor
    done("all_gather_into_tensor")
    if NEW_NAMES:  # torch >= 2.13 spells the single-tensor ops *_single
        big2 = torch.empty(world * 2, 3)
        dist.all_gather_single(big2, torch.full((2, 3), float(rank)))  # site:all_gather_single
        done("all_gather_single")
        assert big2[-1].eq(world - 1).all()
    rs = torch.empty(2, 3)
    dist.reduce_scatter_tensor(rs, torch.ones(world * 2, 3))  # site:reduce_scatter_tensor
    done("reduce_scatter_tensor")
    assert rs.eq(world).all()
    if NEW_NAMES:
        rs2 = torch.empty(2, dtype=torch.float64)
        dist.reduce_scatter_single(rs2, torch.ones(world * 2, dtype=torch.float64))  # site:reduce_scatter_single
        done("reduce_scatter_single")
        assert rs2.eq(world).all()
    b = torch.full((7,), float(rank), dtype=torch.float64)
    dist.broadcast(b, src=1)  # site:broadcast
    done("broadcast")
    assert b.eq(1).all()
    dist.reduce(t, dst=0)  # site:reduce
    done("reduce")
    gl = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gl, dst=0)  # site:gather
    done("gather")
    sc = torch.empty(3)
    sl = [torch.full((3,), float(i)) for i in range(world)] if rank == 0 else None
    dist.scatter(sc, sl, src=0)  # site:scatter
    done("scatter")
    assert sc.eq(rank).all()
    a2a = torch.empty(world * 2)
    dist.all_to_all_single(a2a, torch.arange(world * 2, dtype=torch.float32))  # site:all_to_all_single
    done("all_to_all_single")
    dist.barrier()  # site:barrier
    done("barrier")
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})  # site:all_gather_object
    done("all_gather_object")
    assert objs[3] == {"rank": 3}
    ol = ["from-0", 42] if rank == 0 else [None, None]
    dist.broadcast_object_list(ol, src=0)  # site:broadcast_object_list
    done("broadcast_object_list")
    assert ol == ["from-0", 42]

    # Point-to-point between pairs (0, 1) and (2, 3).
    peer = rank ^ 1
    x = torch.arange(8, dtype=torch.float32) * (rank + 1)
    if rank % 2 == 0:
        dist.send(x, dst=peer)  # site:send
        done("send")
    else:
        dist.recv(x, src=peer)  # site:recv
        done("recv")
    y = torch.empty(3, 2, dtype=torch.int32)
    if rank % 2 == 0:
        work = dist.irecv(y, src=peer)  # site:irecv
        done("irecv")
    else:
        work = dist.isend(torch.ones(3, 2, dtype=torch.int32), dst=peer)  # site:isend
        done("isend")
    work.wait()
    ring_out, ring_in = torch.full((5,), float(rank)), torch.empty(5)
    ops = [dist.P2POp(dist.isend, ring_out, (rank + 1) % world), dist.P2POp(dist.irecv, ring_in, (rank - 1) % world)]
    works = dist.batch_isend_irecv(ops)  # site:batch_isend_irecv
    done("batch_isend_irecv")
    for w in works:
        w.wait()
    assert ring_in.eq((rank - 1) % world).all()

    # An async all_reduce waited on after another collective.
    z = torch.ones(16)
    handle = dist.all_reduce(z, async_op=True)  # site:async_all_reduce
    done("async_all_reduce")
    between = torch.zeros(1)
    dist.broadcast(between, src=0)  # site:between
    done("between")
    handle.wait()
    assert z.eq(world).all()

    # A subgroup: only its members call its collectives.
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        s = torch.ones(2, 2)
        dist.all_reduce(s, group=sub)  # site:sub_all_reduce
        done("sub_all_reduce", sub)
        dist.broadcast(s, src=1, group=sub)  # site:sub_broadcast
        done("sub_broadcast", sub)
        mine, theirs = torch.full((3,), rank, dtype=torch.int64), torch.empty(3, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, mine, peer, group=sub), dist.P2POp(dist.irecv, theirs, peer, group=sub)]
        works = dist.batch_isend_irecv(ops)  # site:sub_batch_isend_irecv
        done("sub_batch_isend_irecv", sub)
        for w in works:
            w.wait()
        assert theirs.eq(peer).all()
        so = [None, None]
        dist.all_gather_object(so, rank, group=sub)  # site:sub_all_gather_object
        done("sub_all_gather_object", sub)
    dist.all_reduce(torch.ones(1))  # site:final
    done("final")

    out = os.environ["REC_OUT"]
    fr = torch._C._distributed_c10d._dump_fr_trace()
    with open(os.path.join(out, f"rank-{rank}.fr.pkl"), "wb") as f:
        f.write(fr)
    counters = {c10d._get_process_group_name(default): default._get_sequence_number_for_group()}
    if rank in (0, 1):
        counters[c10d._get_process_group_name(sub)] = sub._get_sequence_number_for_group()
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "notes": notes, "counters": counters,
                   "script": os.path.abspath(__file__)}, f)


if __name__ == "__main__":
    main()
