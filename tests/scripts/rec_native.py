"""Worker (2 ranks): the same calls, in the same lines, whichever recording path is in use (DTWATCH_NATIVE).

Every kind of call the native path takes (positional and keyword arguments, an explicit group, async, p2p, a
tensor of more than 4 dimensions, a call that raises, a call through a library's frames, a call from another
thread) and some the Python path keeps (lists, objects), so tests/test_native.py can compare the two paths'
records field by field. Writes which path recorded all_reduce to REC_OUT/rank-N.json.
"""
import json
import os
import tempfile
import threading

import torch
import torch.distributed as dist

import dtwatch

dtwatch.install()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
peer = 1 - rank
pair = dist.new_group([0, 1])

# A library's frame (a file under site-packages) between the user's line and torch.
_lib: dict = {}
exec(compile("def reduce_through(fn, t):\n    return fn(t)\n",
             os.path.join(tempfile.gettempdir(), "site-packages", "nativelib", "ops.py"), "exec"), _lib)

t = torch.ones(4, 3)
dist.all_reduce(t)
dist.all_reduce(tensor=t, group=pair)
dist.all_reduce(t, group=None, async_op=True).wait()
dist.broadcast(t, src=1)
dist.reduce(t, dst=0)
dist.all_gather_into_tensor(torch.zeros(8, 3), t)
dist.reduce_scatter_tensor(torch.zeros(2, 3), t)
dist.all_to_all_single(torch.zeros(4, 3), t)
dist.all_reduce(torch.ones(2, 3, 1, 2, 2, dtype=torch.bfloat16))
dist.barrier()
if rank == 0:
    dist.send(t, dst=peer)
    dist.isend(t, dst=peer).wait()
else:
    dist.recv(t, src=peer)
    dist.irecv(t, src=peer).wait()
try:
    dist.all_reduce(t, op="not an op")  # torch refuses it: the record ends in an error
except (TypeError, ValueError, RuntimeError):
    pass
_lib["reduce_through"](dist.all_reduce, t)
dist.all_gather([torch.zeros(4, 3) for _ in range(world)], t)
dist.all_gather_object([None] * world, {"rank": rank})
thread = threading.Thread(target=lambda: dist.all_reduce(t, group=pair))
thread.start()
thread.join()
dist.barrier()

with open(os.path.join(os.environ["REC_OUT"], f"rank-{rank}.json"), "w") as f:
    json.dump({"all_reduce": type(dist.all_reduce).__name__}, f)
dist.destroy_process_group()
