"""Step record's worker: one rank under ``dtwatch run -- torchrun --nproc-per-node 1``. Writes what it saw to
argv[1] (JSON, rewritten after each phase, so a phase that hangs leaves the earlier ones).

1. collectives, sync and async: after each call, torch's sequence counter; then this rank's ring, read
   with dtwatch's reader, must hold one record per call carrying that number.
2. (GPU) an all_reduce queued behind ~2 s of matmuls: the call returns at once, the ring shows it in
   flight; after the GPU finished, completed.
3. a functional collective (``_functional_collectives.all_reduce(t, "sum", group)``, then ``.wait()``):
   which records the ring gained.
GPU_CHECK_CPU=1: gloo on the CPU, phase 2 left out.
"""
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

CPU = os.environ.get("GPU_CHECK_CPU") == "1"
OUT = sys.argv[1]
BUSY_S = 2.0
facts: dict = {}


def save() -> None:
    with open(OUT + ".tmp", "w") as f:
        json.dump(facts, f, indent=1, default=str)
    os.replace(OUT + ".tmp", OUT)


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def torch_seq() -> int:
    return int(dist.group.WORLD._get_sequence_number_for_group())


def ring() -> dict:
    """This rank's ring, read as the watchdog reads it: the default group and its records."""
    from dtwatch.ring import FLAG_ENQUEUED
    from dtwatch.ring.reader import read_ring

    path = os.path.join(os.environ["DTWATCH_DIR"], os.environ["DTWATCH_JOB_ID"], f"rank-{dist.get_rank():05d}.ring")
    snap = read_ring(path)
    g = snap.group(str(dist.group.WORLD.group_name)) or (snap.groups[0] if snap.groups else None)
    recs = [r for r in snap.records_list() if not r.is_marker]
    return {
        "backend": snap.backend,
        "group": None if g is None else {"name": g.name, "cpp_seq": g.cpp_seq, "completed_seq": g.completed_seq,
                                         "tracked": g.tracked},
        "last_seq": snap.last_seq(g.name) if g is not None else None,
        "records": [{"op": r.op, "seq": r.seq, "span": r.seq_span, "last_seq": r.last_seq, "group": r.group,
                     "t_enter": r.t_enter, "t_exit": r.t_exit, "enqueued": bool(r.flags & FLAG_ENQUEUED),
                     "line": r.site.line if r.site else None} for r in recs],
    }


def phase_seq(dev: torch.device) -> None:
    t = torch.ones(1024, device=dev)
    flat = torch.empty(1024 * dist.get_world_size(), device=dev)
    calls = []

    def call(name: str, fn) -> object:
        out = fn()
        calls.append({"op": name, "torch_seq": torch_seq()})
        return out

    for _ in range(4):
        call("all_reduce", lambda: dist.all_reduce(t))
    call("broadcast", lambda: dist.broadcast(t, 0))
    call("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(flat, t))
    works = [call("all_reduce", lambda: dist.all_reduce(t, async_op=True)) for _ in range(3)]
    for w in works:
        w.wait()
    call("barrier", dist.barrier)
    sync()
    time.sleep(2.5)  # the sampler's completion polls (NCCL: the Flight Recorder, about once a second)
    facts["seq"] = {"calls": calls, "torch_seq": torch_seq(), "ring": ring()}
    save()


def phase_inflight(dev: torch.device) -> None:
    a = torch.randn(8192, 8192, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a @ a  # cuBLAS set up before timing
    sync()
    start.record()
    for _ in range(3):
        a @ a
    end.record()
    sync()
    per_ms = max(start.elapsed_time(end) / 3, 0.05)
    n = int(BUSY_S * 1000 / per_ms) + 1
    t = torch.ones(16, device=dev)
    start.record()
    for _ in range(n):  # ~2 s of GPU work, enqueued at once
        a @ a
    end.record()
    issued = time.time()
    dist.all_reduce(t)  # site:inflight_all_reduce  (queued behind the matmuls on the GPU)
    returned = time.time()
    time.sleep(1.0)
    fl = {"matmuls": n, "matmul_ms": round(per_ms, 3), "issued_at": issued,
          "call_returned_after_s": round(returned - issued, 4), "mid": ring()}
    facts["inflight"] = fl
    save()
    sync()
    fl["gpu_busy_ms"] = round(start.elapsed_time(end), 1)
    fl["synced_at"] = time.time()
    time.sleep(2.5)
    fl["after"] = ring()
    save()


def phase_funcol(dev: torch.device) -> None:
    import torch.distributed._functional_collectives as funcol

    fc: dict = {"before": len(ring()["records"]), "torch_seq_before": torch_seq()}
    facts["funcol"] = fc
    save()
    t = torch.ones(8, device=dev)
    out = funcol.all_reduce(t, "sum", dist.group.WORLD)  # site:funcol_all_reduce
    if hasattr(out, "wait"):
        out = out.wait()
    fc["result"] = float(out.sum())
    sync()
    time.sleep(1.5)
    view = ring()
    fc["torch_seq_after"] = torch_seq()
    fc["new_records"] = view["records"][fc["before"]:]
    fc["group"] = view["group"]
    save()


def main() -> None:
    warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's rename notice
    local = int(os.environ["LOCAL_RANK"])
    if CPU:
        dev, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    dist.init_process_group(backend)
    import dtwatch

    facts.update(installed=dtwatch.is_installed(), backend=str(dist.get_backend()), errors=[])
    for phase in (phase_seq, phase_inflight, phase_funcol):
        if phase is phase_inflight and CPU:
            continue
        try:
            phase(dev)
        except Exception as exc:  # noqa: BLE001 - one phase failing must not hide the others
            facts["errors"].append(f"{phase.__name__}: {type(exc).__name__}: {exc}")
            save()
    dist.destroy_process_group()
    facts["ok"] = True
    save()


if __name__ == "__main__":
    main()
