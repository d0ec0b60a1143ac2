"""Worker for tests/test_recorder.py::test_call_sites_through_a_library (2 ranks, gloo).

Collectives called directly and through ``wrapperlib``, a small third-party-style library that the test
writes into a ``site-packages`` directory on ``PYTHONPATH``. Every user line the test asserts on carries
a ``# site:<name>`` marker. Between the calls the worker waits inside the library until the test, having
read the ring, creates ``$REC_OUT/release`` (the sampler's view of a rank inside a library).
"""
import json
import os

import torch
import torch.distributed as dist
import wrapperlib

import dtwatch.auto  # noqa: F401  (first: installs before init_process_group)


def metric_step(t):
    wrapperlib.all_reduce_mean(t)  # site:helper


def callback(t):
    dist.all_reduce(t)  # site:callback


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(3)
    dist.all_reduce(t)  # site:direct
    wrapperlib.barrier()  # site:lib_barrier
    wrapperlib.all_reduce_mean(t)  # site:mean_a
    wrapperlib.all_reduce_mean(t)  # site:mean_b
    metric_step(t)  # site:via_helper
    objs = wrapperlib.gather_objects({"rank": rank})  # site:lib_object
    assert [o["rank"] for o in objs] == [0, 1]
    work = wrapperlib.start_all_reduce(t)  # site:lib_async
    work.wait()
    wrapperlib.run_callback(callback, t)  # site:lib_callback
    out = [None, None]
    dist.all_gather_object(out, rank)  # site:direct_object
    dist.all_reduce(t, async_op=True).wait()  # site:direct_async
    exec(compile("dist.all_reduce(t)", "<string>", "exec"), {"dist": dist, "t": t})  # site:exec_string
    wrapperlib.wait_for_file(os.path.join(os.environ["REC_OUT"], "release"))  # site:lib_wait
    dist.barrier()  # site:final
    with open(os.path.join(os.environ["REC_OUT"], f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
