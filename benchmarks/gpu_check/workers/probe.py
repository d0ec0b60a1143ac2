"""Initialise a one-rank process group with backend argv[1] and say what torch made of it (JSON on stdout).

    python probe.py nccl            # the default NCCL process group (nccl2 on torch >= 2.15)
    TORCH_DIST_USE_NCCL2=0 python probe.py nccl
    python probe.py nccl-legacy

The last line printed is one JSON object: ok, the error if any, torch's name for the backend, the
process group's and the device backend's classes, and whether the group has the sequence counter
dtwatch numbers calls by.
"""
import json
import os
import sys
import time

BACKEND = sys.argv[1]


def main() -> dict:
    import torch
    import torch.distributed as dist

    res: dict = {"backend_asked": BACKEND, "torch": torch.__version__, "ok": False,
                 "env": {k: v for k, v in os.environ.items() if k.startswith("TORCH_DIST_")}}
    cuda = BACKEND != "gloo"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    t0 = time.time()
    dist.init_process_group(BACKEND, rank=0, world_size=1, store=dist.TCPStore("127.0.0.1", 0, 1, True))
    pg = dist.group.WORLD
    res["init_s"] = round(time.time() - t0, 2)
    res["get_backend"] = str(dist.get_backend())
    res["pg_class"] = type(pg).__name__
    try:
        res["pg_name"] = pg.name()
    except Exception as exc:  # noqa: BLE001 - whatever this torch lacks is the answer
        res["pg_name"] = repr(exc)
    try:
        res["device_backend_class"] = type(pg._get_backend(dev)).__name__
    except Exception as exc:  # noqa: BLE001
        res["device_backend_class"] = repr(exc)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    if cuda:
        torch.cuda.synchronize()
    res["all_reduce"] = t.tolist()
    try:
        res["seq_counter"] = int(pg._get_sequence_number_for_group())
    except Exception as exc:  # noqa: BLE001
        res["seq_counter"] = repr(exc)
    dist.destroy_process_group()
    res["ok"] = True
    return res


if __name__ == "__main__":
    try:
        out = main()
    except Exception as exc:  # noqa: BLE001 - a backend this torch lacks: report, not crash
        out = {"backend_asked": BACKEND, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    print(json.dumps(out), flush=True)
