#!/usr/bin/env python
"""How long ``dtwatch analyze`` takes on a large job: 1024 ranks' rings, written by the real writer.

    python benchmarks/analyze_scale.py                    # 1024 ranks, capacity 4096, 200 records/rank
    python benchmarks/analyze_scale.py --json -           # figures as JSON on stdout (or --json FILE)
    python benchmarks/analyze_scale.py --profile 25       # also cProfile analyze(): top 25 functions
    python benchmarks/analyze_scale.py --ranks 256 --records 4096 --keep /tmp/rings

The rings are synthesised offline (no torch process group): ``dtwatch.ring.RingWriter`` creates each
rank's file, group table (the world group with all members, plus the rank's 8-rank "tensor parallel"
group, named as torch names groups created by every rank: "1", "2", ...), call-site table, DataLoader
table and live header fields; records go through ``RingWriter.write_record`` (the writer's own record
path, which the recorder uses for step markers; the hot path packs the same layout). The call sites
point into a small generated ``train.py`` so the analyzer's rank-conditional check
(``dtwatch.lint.checker``) and source lines see a real file.

Per rank: ``--records`` records (default 200) in steps of: a TP all_reduce (activations), a world
all_reduce (gradients, 1M floats), a step marker, and every 5th step a world all_reduce of the loss at
the logging line. At the end every rank but ``--culprit`` (17) is blocked in a world ``barrier`` at seq
N (line "barrier"), while rank 17 is blocked in a world ``all_reduce`` at seq N from a different line,
inside ``if rank == 17:`` (a rank-conditional desync). Nodes are 8 ranks each with their own host name,
as if the bundles of 128 nodes had been gathered in one directory.

Figures: seconds to write the rings (not part of the target), ``analyze([dir])`` end to end in this
process (read + merge + diagnose; target <= 10 s) with a breakdown of read_ring / from_snapshot /
diagnosis, and ``dtwatch analyze DIR --json`` as a subprocess (includes interpreter start and imports).
Each reports whether the first finding is rank_conditional naming rank 17 alone.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np

from dtwatch import ring as ringfmt
from dtwatch.ring import (
    DTYPE_CODES,
    FLAG_MARKER,
    OP_CODES,
    RECORD_DTYPE,
    STATUS_IN_FLIGHT,
    STATUS_OK,
    RingWriter,
    ring_filename,
)
from dtwatch.ring import writer as ringwriter

NO_GROUP = 0xFFFF
TARGET_S = 10.0
TP = 8  # ranks per node and per tensor-parallel group

TRAIN_PY = '''\
import torch
import torch.distributed as dist


def forward(x, tp_group):
    dist.all_reduce(x, group=tp_group)  # site:tp_all_reduce
    return x


def sync_gradients(grads):
    dist.all_reduce(grads)  # site:grad_all_reduce


def log_loss(loss):
    dist.all_reduce(loss)  # site:loss_all_reduce
    return loss.item()


def validate(model):
    loss = torch.zeros(1)
    dist.all_reduce(loss)  # site:validate_all_reduce
    return loss


def main(model, loader, tp_group, culprit):
    rank = dist.get_rank()
    for step, batch in enumerate(loader):  # site:loader_loop
        x = forward(batch, tp_group)
        sync_gradients(x)
        if step % 5 == 0:
            log_loss(x.sum())
    if rank == culprit:
        validate(model)  # site:conditional_call
    dist.barrier()  # site:barrier
'''


def _line(marker: str) -> int:
    for i, text in enumerate(TRAIN_PY.splitlines(), 1):
        if text.rstrip().endswith(f"# site:{marker}"):
            return i
    raise KeyError(marker)


def _record(w: RingWriter, stamp: int, capacity: int, *, op: str, seq: int, t_enter: float, t_exit: float = 0.0,
            seq_span: int = 1, dtype: str = "unknown", shape: tuple = (), numel: int | None = None, flags: int = 0,
            ntensors: int = 1, slot: int = 0, site: int = 0, step: int = 0) -> None:
    """One record, through the writer's own ``write_record`` (what the recorder uses for step markers)."""
    if hasattr(w, "write_record"):
        w.write_record(stamp, op=op, seq=seq, t_enter=t_enter, t_exit=t_exit, seq_span=seq_span, dtype=dtype,
                       shape=shape, numel=numel, flags=flags, ntensors=ntensors, group_slot=slot, site=site, step=step)
        return
    # Older writers: fill the record through the on-disk layout (RECORD_DTYPE), stamps last.
    view = np.frombuffer(w.mm, dtype=RECORD_DTYPE, count=capacity, offset=w.records_off)
    r = view[(stamp - 1) % capacity]
    n = 1
    for d in shape:
        n *= d
    r["stamp2"] = 0
    r["seq"], r["t_enter"], r["t_exit"], r["seq_span"] = seq, t_enter, t_exit, seq_span
    r["status"] = STATUS_OK if t_exit else STATUS_IN_FLIGHT
    r["op"], r["dtype"], r["ndim"] = OP_CODES[op], DTYPE_CODES[dtype], len(shape)
    r["flags"], r["ntensors"] = flags, ntensors
    r["group"], r["site"], r["step"], r["peer"] = slot, site, step, -1
    r["numel"] = n if numel is None else numel
    r["dims"] = list(shape[:4]) + [0] * (4 - len(shape[:4]))
    r["stamp"] = r["stamp2"] = stamp
    del r, view


def synthesize(run_dir: Path, *, ranks: int, records: int, capacity: int, culprit: int, now: float) -> dict:
    """Write ``ranks`` rings into ``run_dir``; returns what the analyzer should find."""
    run_dir.mkdir(parents=True, exist_ok=True)
    train = run_dir / "train.py"
    train.write_text(TRAIN_PY)
    lines = {m: _line(m) for m in ("tp_all_reduce", "grad_all_reduce", "loss_all_reduce", "validate_all_reduce",
                                   "loader_loop", "conditional_call", "barrier")}
    funcs = {"tp_all_reduce": "forward", "grad_all_reduce": "sync_gradients", "loss_all_reduce": "log_loss",
             "validate_all_reduce": "validate", "loader_loop": "main", "conditional_call": "main", "barrier": "main"}
    step_period = 0.5
    # One step = TP all_reduce, grad all_reduce, step marker (+ a loss all_reduce every 5th step).
    n_steps = max(1, int(records / 3.2))
    t_start = now - 5.0 - n_steps * step_period
    world = list(range(ranks))
    # The writer stamps the process start (and group creation) with its clock: make it the job's start,
    # not the moment the benchmark writes the file.
    last: dict[str, int] = {}
    with mock.patch.object(ringwriter, "time", _Clock(t_start - 30.0)):
        for rank in range(ranks):
            last = _write_rank(run_dir, rank, ranks, world, records, capacity, culprit, site_lines=lines, funcs=funcs,
                               train=train, t_start=t_start, step_period=step_period, n_steps=n_steps, now=now)
    return {"seq": last["seq"], "culprit_line": lines["validate_all_reduce"],
            "waiting_line": lines["barrier"], "file": str(train), "records_per_rank": last["stamp"],
            "steps": last["step"]}


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def time(self) -> float:
        return self.t


def _write_rank(run_dir: Path, rank: int, ranks: int, world: list[int], records: int, capacity: int, culprit: int, *,
                site_lines: dict, funcs: dict, train: Path, t_start: float, step_period: float, n_steps: int,
                now: float) -> dict[str, int]:
    """One rank's ring; returns what the analyzer should find (the hang's seq, records written, steps)."""
    lines = site_lines
    w = RingWriter(run_dir / ring_filename(rank), rank=rank, local_rank=rank % TP, world_size=ranks,
                   job_id=run_dir.name, host=f"node-{rank // TP:04d}", backend="nccl", torch_version="2.13.0",
                   capacity=capacity)
    site = {m: w.add_site(str(train), lines[m], funcs[m]) for m in lines}
    g_world = w.add_group("0", "default_pg", world, rank)
    tp_members = list(range(rank // TP * TP, min(rank // TP * TP + TP, ranks)))
    g_tp = w.add_group(str(1 + rank // TP), "tp", tp_members, rank % TP)
    loader = w.add_loader(site["loader_loop"])
    stamp = 0
    seq_world = seq_tp = 0
    step = 0
    t = t_start + (rank % 97) * 1e-4  # ranks do not enter in lockstep
    written = 0
    while written < records - 2:
        seq_tp += 1
        stamp += 1
        _record(w, stamp, capacity, seq=seq_tp, t_enter=t, t_exit=t + 0.01, op="all_reduce", dtype="bfloat16",
                shape=(4, 2048, 1024), slot=g_tp, site=site["tp_all_reduce"], step=step)
        seq_world += 1
        stamp += 1
        _record(w, stamp, capacity, seq=seq_world, t_enter=t + 0.2, t_exit=t + 0.35, op="all_reduce", dtype="float32",
                shape=(1048576,), slot=g_world, site=site["grad_all_reduce"], step=step)
        written += 2
        if step % 5 == 0:
            seq_world += 1
            stamp += 1
            _record(w, stamp, capacity, seq=seq_world, t_enter=t + 0.36, t_exit=t + 0.37, op="all_reduce",
                    dtype="float32", shape=(), slot=g_world, site=site["loss_all_reduce"], step=step)
            written += 1
        step += 1
        stamp += 1
        # A step marker, as the recorder writes it (seq = step, t_exit = t_enter, no group).
        _record(w, stamp, capacity, op="step", seq=step, t_enter=t + 0.4, t_exit=t + 0.4, seq_span=0,
                flags=FLAG_MARKER, ntensors=0, numel=0, slot=NO_GROUP, step=step)
        written += 1
        t += step_period
    w.set_step(step, t - step_period + 0.4)
    w.set_loader(loader, site["loader_loop"], n_steps, 1, t_start, 0)
    # The hang: the same world seq N, two different lines.
    seq_world += 1
    stamp += 1
    t_hang = t + 0.05
    if rank == culprit:
        _record(w, stamp, capacity, seq=seq_world, t_enter=t_hang, op="all_reduce", dtype="float32",
                shape=(1,), slot=g_world, site=site["validate_all_reduce"], step=step)
        w.set_main_site(site["conditional_call"], site["validate_all_reduce"], t_hang)
        w.set_main_stack([site["validate_all_reduce"], site["conditional_call"]])
    else:
        _record(w, stamp, capacity, seq=seq_world, t_enter=t_hang, op="barrier", numel=0,
                slot=g_world, site=site["barrier"], step=step)
        w.set_main_site(site["barrier"], site["barrier"], t_hang)
        w.set_main_stack([site["barrier"]])
    w.set_group_cpp_seq(g_world, seq_world, t_hang)
    w.set_group_cpp_seq(g_tp, seq_tp, t - step_period + 0.01)
    w.heartbeat(now, int((now - t_start) * 10))  # still alive: the sampler thread keeps beating
    w.close()
    return {"seq": seq_world, "stamp": stamp, "step": step}


def names_culprit(findings: list[dict], culprit: int, expect: dict) -> bool:
    if not findings:
        return False
    f = findings[0]
    return (f["kind"] == "rank_conditional" and f["ranks"] == [culprit] and f["op"] == "all_reduce"
            and f["group"] == "0" and f["seq"] == expect["seq"]
            and (f["site"] or {}).get("line") == expect["culprit_line"])


def time_in_process(run_dir: Path, profile: int) -> dict:
    """analyze([dir]) end to end, plus a breakdown of its parts (timed separately, after it)."""
    from dtwatch.bundle.file_evidence import FileEvidence
    from dtwatch.diagnose import diagnose
    from dtwatch.diagnose.rank_state import from_snapshot
    from dtwatch.report import analyze as an
    from dtwatch.ring import read_ring
    from dtwatch.watchdog.stacks import process_ending

    t0 = time.perf_counter()
    result = an.analyze([str(run_dir)])
    total = time.perf_counter() - t0
    t0 = time.perf_counter()
    doc = result.to_dict()
    to_dict_s = time.perf_counter() - t0

    # Breakdown (a second pass: the files are in the page cache for both).
    _bundles, paths, _events = an._scan([str(run_dir)])
    t0 = time.perf_counter()
    snaps = [read_ring(p) for p in paths]
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    states = [from_snapshot(s) for s in snaps]
    state_s = time.perf_counter() - t0
    now = max(max(s.heartbeat_time for s in states), max(s.last_activity for s in states))
    run_dirs = {s.rank: os.path.dirname(s.ring_path) for s in states if s.ring_path}
    starts = {s.rank: s.start_time for s in states}

    def ending(rank: int) -> dict | None:  # as analyze() looks for how a dead rank's process ended
        return process_ending(run_dirs[rank], rank, starts[rank]) if rank in run_dirs else None

    t0 = time.perf_counter()
    diagnose(states, now, 0.0, FileEvidence(endings=ending), heartbeat_stale=float("inf"), assume_stalled=True)
    diag_s = time.perf_counter() - t0
    out = {"analyze_s": round(total, 3), "to_dict_s": round(to_dict_s, 3), "read_ring_s": round(read_s, 3),
           "from_snapshot_s": round(state_s, 3), "diagnose_s": round(diag_s, 3), "ranks_seen": len(result.states),
           "findings": doc["findings"], "warnings": [w["kind"] for w in doc["warnings"]]}
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        an.analyze([str(run_dir)])
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(profile)
        buf.write("\n--- by own time ---\n")
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(profile)
        out["profile"] = buf.getvalue()
    return out


def time_cli(run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "dtwatch", "analyze", str(run_dir), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO))
    elapsed = time.perf_counter() - t0
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        doc = {"findings": []}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import dtwatch.cli, dtwatch.report.analyze"],
                   capture_output=True, cwd=str(REPO))
    startup = time.perf_counter() - t0
    return {"cli_s": round(elapsed, 3), "cli_exit": proc.returncode, "cli_startup_s": round(startup, 3),
            "cli_findings": doc.get("findings", []), "cli_stderr": proc.stderr[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--records", type=int, default=200, help="records written per rank (default 200)")
    ap.add_argument("--capacity", type=int, default=ringfmt.DEFAULT_CAPACITY,
                    help=f"ring capacity in records (default {ringfmt.DEFAULT_CAPACITY}, the product default)")
    ap.add_argument("--culprit", type=int, default=None,
                    help="the desynchronised rank (default 17, or the last rank if fewer)")
    ap.add_argument("--keep", metavar="DIR", help="write the rings here and keep them (default: a temp dir, removed)")
    ap.add_argument("--no-cli", action="store_true", help="skip the `dtwatch analyze --json` subprocess")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile analyze() and print the top N functions")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE ('-' = stdout)")
    args = ap.parse_args()
    if args.culprit is None:
        args.culprit = min(17, args.ranks - 1)
    if not 0 <= args.culprit < args.ranks or args.ranks < 2:
        ap.error("need --ranks >= 2 and 0 <= --culprit < --ranks")

    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dtwatch-scale-"))
    run_dir = base / "scale-job"
    try:
        if run_dir.exists():
            shutil.rmtree(run_dir)
        now = time.time()
        t0 = time.perf_counter()
        expect = synthesize(run_dir, ranks=args.ranks, records=args.records, capacity=args.capacity,
                            culprit=args.culprit, now=now)
        write_s = time.perf_counter() - t0
        ring_bytes = sum(p.stat().st_size for p in run_dir.glob("*.ring"))
        res = time_in_process(run_dir, args.profile)
        cli = {} if args.no_cli else time_cli(run_dir)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    ok_in = names_culprit(res["findings"], args.culprit, expect)
    ok_cli = names_culprit(cli.get("cli_findings", []), args.culprit, expect) if cli else None
    report = {
        "ranks": args.ranks, "capacity": args.capacity, "records_per_rank": expect["records_per_rank"],
        "ring_file_mib": round(ring_bytes / args.ranks / 2**20, 3), "rings_total_mib": round(ring_bytes / 2**20, 1),
        "write_s": round(write_s, 2), "target_s": TARGET_S,
        **{k: v for k, v in res.items() if k not in ("findings", "profile")},
        "within_target": res["analyze_s"] <= TARGET_S, "names_culprit": ok_in,
        "finding": ({k: res["findings"][0][k] for k in ("kind", "ranks", "op", "group", "seq")}
                    | {"line": (res["findings"][0]["site"] or {}).get("line")}) if res["findings"] else None,
        "expected": {"culprit": args.culprit, "seq": expect["seq"], "line": expect["culprit_line"]},
    }
    if cli:
        report.update({k: v for k, v in cli.items() if k not in ("cli_findings", "cli_stderr")})
        report["cli_names_culprit"] = ok_cli
        if cli["cli_exit"] != 1:
            report["cli_stderr"] = cli["cli_stderr"]

    print(f"dtwatch analyze at scale: {args.ranks} ranks, ring capacity {args.capacity} "
          f"({report['ring_file_mib']} MiB/file, {report['rings_total_mib']} MiB total), "
          f"{report['records_per_rank']} records/rank; rings written in {write_s:.1f} s")
    rows = [
        ("analyze([dir]) end to end", f"{res['analyze_s']:.2f} s", f"<= {TARGET_S:g} s",
         "yes" if report["within_target"] else "NO", "yes" if ok_in else "NO"),
        ("  read_ring x N", f"{res['read_ring_s']:.2f} s", "", "", ""),
        ("  from_snapshot x N", f"{res['from_snapshot_s']:.2f} s", "", "", ""),
        ("  diagnose", f"{res['diagnose_s']:.2f} s", "", "", ""),
        ("  Analysis.to_dict (JSON)", f"{res['to_dict_s']:.2f} s", "", "", ""),
    ]
    if cli:
        rows.append(("dtwatch analyze DIR --json", f"{cli['cli_s']:.2f} s", f"exit {cli['cli_exit']}",
                     f"(startup {cli['cli_startup_s']:.2f} s)", "yes" if ok_cli else "NO"))
    print(f"{'what':<30} {'time':>9}  {'target':<9} {'within':<20} {'names rank ' + str(args.culprit)}")
    for r in rows:
        print(f"{r[0]:<30} {r[1]:>9}  {r[2]:<9} {r[3]:<20} {r[4]}")
    if report["finding"]:
        print(f"finding: {report['finding']}  expected: {report['expected']}")
    else:
        print("finding: none")
    if "profile" in res:
        print(res["profile"])
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if report["within_target"] and ok_in and (ok_cli is not False) else 1


if __name__ == "__main__":
    sys.exit(main())
