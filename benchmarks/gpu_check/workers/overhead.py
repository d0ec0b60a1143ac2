"""Step overhead's worker: what dtwatch adds to one small all_reduce on a 1-rank group, in one process.

    python overhead.py OUT.json BACKEND [CALLS]

dtwatch is installed before init_process_group (as a user would). Torch's own all_reduce (the wrapper's
``__dtwatch_original__``) and dtwatch's wrapper are timed in alternating blocks of BLOCK calls (order
flipped every block, GC off, the GPU drained between blocks, untimed); reported: the median per call of
each, of their per-block differences, and with the block's final synchronize included; where the native path
records, the Python path is timed the same way. GPU_CHECK_CPU=1: gloo on the CPU.
"""
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

CPU = os.environ.get("GPU_CHECK_CPU") == "1"
OUT, BACKEND = sys.argv[1], sys.argv[2]
CALLS = int(sys.argv[3]) if len(sys.argv) > 3 else 20000
BLOCK = 500


def alternate(fa, fb, sync, total: int) -> dict:
    for fn in (fa, fb):  # warm up
        for _ in range(200):
            fn()
    sync()
    ta, tb, sa, sb = [], [], [], []
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for block in range(max(total // BLOCK, 4)):
            order = ((fa, ta, sa), (fb, tb, sb)) if block % 2 == 0 else ((fb, tb, sb), (fa, ta, sa))
            for fn, times, times_sync in order:
                sync()
                t0 = clock()
                for _ in range(BLOCK):
                    fn()
                t1 = clock()
                sync()
                times.append((t1 - t0) / BLOCK)
                times_sync.append((clock() - t0) / BLOCK)
    finally:
        gc.enable()
    diffs = [b - a for a, b in zip(ta, tb, strict=True)]
    q = statistics.quantiles(diffs, n=4)
    return {"torch_us": round(statistics.median(ta) / 1000, 3), "dtwatch_us": round(statistics.median(tb) / 1000, 3),
            "added_us": round(statistics.median(diffs) / 1000, 3),
            "added_us_iqr": [round(q[0] / 1000, 3), round(q[2] / 1000, 3)],
            "torch_us_with_sync": round(statistics.median(sa) / 1000, 3),
            "dtwatch_us_with_sync": round(statistics.median(sb) / 1000, 3), "blocks": len(ta)}


def main() -> None:
    os.environ.update(DTWATCH_WATCHDOG="off", DTWATCH_STACK_SIGNAL="off", DTWATCH_JOB_ID="bench",
                      DTWATCH_DIR=tempfile.mkdtemp(prefix="gpu-check-overhead-"))
    import dtwatch
    from dtwatch.record import installation
    from dtwatch.ring.reader import read_ring

    assert dtwatch.install(), "dtwatch was installed already"
    if CPU:
        dev, sync = torch.device("cpu"), (lambda: None)
    else:
        torch.cuda.set_device(0)
        dev, sync = torch.device("cuda", 0), torch.cuda.synchronize
    dist.init_process_group(BACKEND, rank=0, world_size=1, store=dist.TCPStore("127.0.0.1", 0, 1, True))
    pg = dist.group.WORLD
    res: dict = {"backend": str(dist.get_backend()), "calls": CALLS, "block": BLOCK,
                 "device_backend_class": type(pg._get_backend(dev)).__name__}
    t = torch.ones(16, device=dev)
    wrapper = dist.all_reduce
    original = wrapper.__dtwatch_original__
    res["recording_path"] = "native" if type(wrapper).__name__ == "Recorded" else "python"
    res["all_reduce"] = alternate(lambda: original(t), lambda: wrapper(t), sync, CALLS)
    if res["recording_path"] == "native":  # the Python path too, for the comparison (its own records)
        from dtwatch.ops import bind
        from dtwatch.record.wrapper import make_wrapper

        spec = bind("all_reduce", original)
        assert spec is not None
        python_path = make_wrapper(installation.active(), original, spec)
        res["all_reduce_python_path"] = alternate(lambda: original(t), lambda: python_path(t), sync, CALLS)
    sync()
    time.sleep(1.5)  # completion polls catch up (NCCL)
    snap = read_ring(os.path.join(os.environ["DTWATCH_DIR"], "bench", "rank-00000.ring"))
    g = snap.group(str(pg.group_name))
    recs = snap.collectives()
    res["ring"] = {"records": int(len(recs)), "in_flight": len(snap.open_records()),
                   "last_seq": snap.last_seq(g.name) if g else None, "tracked": g.tracked if g else None}
    res["torch_seq"] = int(pg._get_sequence_number_for_group())
    res["recorder_warned"] = bool(getattr(installation.active(), "warned", False))
    dtwatch.uninstall()
    dist.destroy_process_group()
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
