#!/usr/bin/env python
"""What the watchdog's continuous checks cost per poll: silent-desync comparison and straggler lags.

    python benchmarks/continuous.py                 # 8 ranks, 4096 records each
    python benchmarks/continuous.py --ranks 64 --json -

The rings are written by the real writer (benchmarks/analyze_scale.py's synthesiser: world and tensor
parallel groups, step markers, 4096 records per rank), and each rank's sequence clock is filled as a
running rank's sampler would fill it. One watchdog poll is timed as the watchdog runs it: read every
ring, summarise it (``from_snapshot``), then the checks that run on every poll whether or not anything
hangs: ``silent_desyncs`` and ``entry_lags`` + ``straggler_warning``. Reported: milliseconds per poll
for each part (median of ``--repeat`` polls) and the checks' share of one core at the default poll
interval (1 s).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def _synthesiser() -> ModuleType:
    spec = importlib.util.spec_from_file_location("analyze_scale", HERE / "analyze_scale.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {HERE / 'analyze_scale.py'}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["analyze_scale"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--records", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--poll-interval", type=float, default=1.0)
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON ('-': stdout only)")
    args = ap.parse_args()

    from dtwatch.diagnose import entry_lags, silent_desyncs, straggler_warning
    from dtwatch.diagnose.rank_state import from_snapshot
    from dtwatch.ring import SEQ_CLOCK_ENTRIES, RingWriter, read_ring

    scale = _synthesiser()
    run_dir = Path(tempfile.mkdtemp(prefix="dtwatch-continuous-"))
    now = time.time()
    scale.synthesize(run_dir, ranks=args.ranks, records=args.records, capacity=args.records, culprit=1, now=now)
    paths = sorted(run_dir.glob("rank-*.ring"))
    # A full sequence clock per rank (the sampler's view of the world group's counter).
    for p in paths:
        w = RingWriter.__new__(RingWriter)  # the existing file, for RingWriter.add_seq_time only
        fd = os.open(p, os.O_RDWR)
        w.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        os.close(fd)
        w.seq_clock_off, w.seq_clock_count = _seq_clock_off(p), 0
        for i in range(SEQ_CLOCK_ENTRIES):
            w.add_seq_time(0, i + 1, now - (SEQ_CLOCK_ENTRIES - i) * 0.05)
        w.mm.close()

    read_s, summarise_s, desync_s, lags_s = [], [], [], []
    reported: set = set()
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        snaps = [read_ring(p) for p in paths]
        t1 = time.perf_counter()
        states = [from_snapshot(s) for s in snaps]
        for s in states:
            s.alive, s.exit_state = True, "running"
        t2 = time.perf_counter()
        reported.clear()
        silent_desyncs(states, now, reported)
        t3 = time.perf_counter()
        straggler_warning(entry_lags(states), now)
        t4 = time.perf_counter()
        read_s.append(t1 - t0)
        summarise_s.append(t2 - t1)
        desync_s.append(t3 - t2)
        lags_s.append(t4 - t3)
    med = {k: statistics.median(v) * 1000 for k, v in
           (("read_ms", read_s), ("summarise_ms", summarise_s), ("silent_desyncs_ms", desync_s),
            ("straggler_ms", lags_s))}
    checks = med["silent_desyncs_ms"] + med["straggler_ms"]
    out = {"ranks": args.ranks, "records_per_rank": args.records, **{k: round(v, 3) for k, v in med.items()},
           "checks_ms_per_poll": round(checks, 3),
           "checks_pct_of_one_core": round(checks / 1000 / args.poll_interval * 100, 3),
           "poll_interval_s": args.poll_interval}
    if args.json != "-":
        for k, v in out.items():
            print(f"{k:28s} {v}")
    if args.json:
        text = json.dumps(out, indent=2)
        print(text) if args.json == "-" else Path(args.json).write_text(text + "\n")
    return 0


def _seq_clock_off(path: Path) -> int:
    from dtwatch.ring.layout import STATIC

    with open(path, "rb") as f:
        return STATIC.unpack(f.read(STATIC.size))["seq_clock_off"]


if __name__ == "__main__":
    sys.exit(main())
