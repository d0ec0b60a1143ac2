#!/usr/bin/env python
"""What ``dtwatch run`` adds to a job's wall time: a fixed cost per job (start and end), not per step.

    python benchmarks/launch.py              # 8 pairs
    python benchmarks/launch.py --pairs 20 --json out.json

The same short DDP job (2 ranks, gloo, CPU, 20 steps of a small MLP) runs as ``torchrun ...`` and as
``dtwatch run -- torchrun ...``, alternating (the order flips every pair), so both see the same machine.
Reported: the median wall time of each, the median of the per-pair differences (the fixed cost; target
<= 1 s) and its spread. ``--worker`` is the job itself.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                        torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(20):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-12000:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=8, help="alternated pairs of runs (default 8)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTWATCH_")}
    env.update(OMP_NUM_THREADS="1", LOGLEVEL="WARNING")
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE), "--worker"]
    with tempfile.TemporaryDirectory(prefix="dtwatch-launch-") as root:
        modes = {"torchrun": job, "dtwatch run": [sys.executable, "-m", "dtwatch", "run", "--dir", root, "--", *job]}
        timed(job, env)  # warm the page cache
        times: dict[str, list[float]] = {name: [] for name in modes}
        names = list(modes)
        for i in range(args.pairs):
            for name in names if i % 2 == 0 else names[::-1]:
                times[name].append(timed(modes[name], env))
    diffs = [b - a for a, b in zip(times["torchrun"], times["dtwatch run"], strict=True)]
    q = statistics.quantiles(diffs, n=4) if len(diffs) >= 4 else [min(diffs), 0, max(diffs)]
    res = {
        "pairs": args.pairs, "cpus": os.cpu_count(),
        "torchrun_s": round(statistics.median(times["torchrun"]), 3),
        "dtwatch_run_s": round(statistics.median(times["dtwatch run"]), 3),
        "fixed_cost_s": round(statistics.median(diffs), 3), "fixed_cost_iqr_s": [round(q[0], 3), round(q[2], 3)],
    }
    print(f"dtwatch run's fixed cost per job ({args.pairs} alternated pairs, a 2-rank DDP job of 20 steps, "
          f"{res['cpus']} CPUs)")
    print(f"  torchrun alone          : {res['torchrun_s']:.2f} s (median)")
    print(f"  dtwatch run -- torchrun : {res['dtwatch_run_s']:.2f} s (median)")
    print(f"  added per job           : {res['fixed_cost_s']:+.2f} s (median of pair differences; target <= 1 s), "
          f"IQR [{res['fixed_cost_iqr_s'][0]:+.2f}, {res['fixed_cost_iqr_s'][1]:+.2f}] s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
