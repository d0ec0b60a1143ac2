#!/usr/bin/env python
"""How fast the watchdog diagnoses a hang, and what it costs to run: real jobs under a real watchdog.

    python benchmarks/detection.py                       # every stall kind once, then CPU use at 8 ranks
    python benchmarks/detection.py --repeats 3 --window 5
    python benchmarks/detection.py --only rank_conditional,sigstop --no-cpu
    python benchmarks/detection.py --no-detection        # only (b)
    python benchmarks/detection.py --json out.json       # also write the figures as JSON ('-': stdout)

(a) Detection latency. For each scenario of ``tests/scripts/hang_worker.py`` (2-3 gloo ranks on CPU), a
    real ``dtwatch watch`` (``--stall-window W``, ``--poll-interval 0.2``, as ``tests/harness.py`` starts
    it) and a real job (torchrun, or plain processes where torchrun would tear the survivors down). The
    worker writes the time the hang begins (``onset-rank<R>.txt``, just before it hangs); the figures are

    * ``onset->detected``: the incident's ``index.json`` "detected" field (the watchdog's clock when it
      decided) minus the onset;
    * ``onset->on disk``: the modification time of the first ``findings.json``/``index.json`` the
      watchdog wrote (polled every 50 ms, before the evidence is added and the files are rewritten)
      minus the onset: when a person or a tool could read the diagnosis;
    * ``progress->detected``: "detected" minus the bundle's own "onset" (the last progress the watchdog
      saw), i.e. the window plus polling, without the part of the hang before the last progress.

    The target is window + 2 s for stalls; rank_exited (exception / killed / returned) needs no window,
    so its target is 2 s.

(b) Watchdog CPU at 8 ranks. A healthy 8-rank gloo job (``benchmarks/workers/busy_worker.py``: steady
    all_reduces and optimizer steps) under ``dtwatch watch`` with the product defaults (poll every 1 s,
    adaptive window) and ``--metrics-port 0`` (the Prometheus exporter on, scraped every
    ``--scrape-interval`` s). After ``--warmup`` s of steady traffic, the watchdog's utime+stime from
    ``/proc/<pid>/stat`` over ``--cpu-window`` s (default 30) gives its CPU as % of one core (target
    <= 2 %), plus its RSS. torchrun runs 8 processes on however many cores there are (2 on the
    reference VM): the training processes compete with the watchdog for them, which is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dtwatch.watchdog.proctree import descendants
from tests.harness import Job, base_env, free_port, launch

BUSY_WORKER = REPO / "benchmarks" / "workers" / "busy_worker.py"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

# scenario, ranks, via torchrun, expected kind, needs the window
SCENARIOS = (
    ("rank_conditional", 2, True, "rank_conditional", True),
    ("subgroup_skip", 3, True, "rank_conditional", True),
    ("uneven_ddp", 2, True, "uneven_iterations", True),
    ("stuck_outside", 2, True, "stuck_outside_collective", True),
    ("mismatch", 3, True, "mismatch", True),
    ("sigstop", 2, False, "unresponsive", True),
    ("exception", 2, False, "rank_exited", False),
    ("killed", 2, False, "rank_exited", False),
    ("returned", 2, False, "rank_exited", False),
)
SLACK = 2.0  # seconds allowed on top of the window


# ---------------------------------------------------------------------------------------------------
# (a) detection latency
# ---------------------------------------------------------------------------------------------------
def _first_findings(job: Job, timeout: float) -> dict:
    """Poll (50 ms) for the first incident; return its index plus the mtime of the files as first seen."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for index_path in sorted(job.run_dir.glob("incidents/*/*/index.json")):
            try:
                index_mtime = index_path.stat().st_mtime
                findings_path = index_path.parent / "findings.json"
                findings_mtime = findings_path.stat().st_mtime if findings_path.exists() else index_mtime
                index = json.loads(index_path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            index["_path"] = str(index_path.parent)
            # findings.json is written (once) before index.json; index.json is rewritten once the evidence is in.
            index["_on_disk"] = min(findings_mtime, index_mtime)
            index["_seen_complete"] = bool(index.get("evidence_complete"))
            return index
        time.sleep(0.05)
    raise TimeoutError(f"no incident within {timeout:.0f}s; watchdog log:\n{job.watchdog_log()}")


def run_scenario(root: Path, scenario: str, nproc: int, torchrun: bool, window: float, timeout: float) -> dict:
    job = launch(root, scenario, nproc, torchrun=torchrun, window=window)
    try:
        index = _first_findings(job, timeout)
        onset = job.onset()
        stalls = [f for f in index["findings"] if f["severity"] == "stall"] or index["findings"]
        f = stalls[0] if stalls else {}
        return {
            "scenario": scenario, "kind": f.get("kind"), "ranks": f.get("ranks"), "nproc": nproc,
            "onset_to_detected_s": round(float(index["detected"]) - onset, 3),
            "onset_to_disk_s": round(index["_on_disk"] - onset, 3),
            "progress_to_detected_s": round(float(index["detected"]) - float(index.get("onset", index["detected"])), 3),
            "disk_figure_is_upper_bound": index["_seen_complete"],
            "bundle": index["_path"],
        }
    except TimeoutError as exc:
        return {"scenario": scenario, "kind": None, "ranks": None, "nproc": nproc, "error": str(exc)[-3000:]}
    finally:
        job.stop()


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def detection(args: argparse.Namespace, root: Path) -> list[dict]:
    only = set(args.only.split(",")) if args.only else None
    chosen = [s for s in SCENARIOS if only is None or s[0] in only]
    runs: dict[str, list[dict]] = {s[0]: [] for s in chosen}
    for rep in range(args.repeats):
        for scenario, nproc, torchrun, _kind, _windowed in chosen:
            t0 = time.time()
            r = run_scenario(root, scenario, nproc, torchrun, args.window, args.timeout)
            runs[scenario].append(r)
            status = (f"{r['kind']} after {r['onset_to_detected_s']:.2f}s" if r.get("kind")
                      else "NO INCIDENT: " + r.get("error", "")[:300])
            print(f"  [{rep + 1}/{args.repeats}] {scenario:<17} {status}  ({time.time() - t0:.0f}s wall)",
                  file=sys.stderr, flush=True)
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(parents=True, exist_ok=True)
    rows = []
    for scenario, nproc, torchrun, expected, windowed in chosen:
        rs = runs[scenario]
        ok = [r for r in rs if r.get("kind")]
        lat = [r["onset_to_detected_s"] for r in ok]
        disk = [r["onset_to_disk_s"] for r in ok]
        prog = [r["progress_to_detected_s"] for r in ok]
        window = args.window if windowed else 0.0
        target = window + SLACK
        disk_median = _median(disk)
        rows.append({
            "scenario": scenario, "ranks": nproc, "launcher": "torchrun" if torchrun else "processes",
            "expected_kind": expected, "kinds": sorted({str(r["kind"]) for r in rs}),
            "kind_ok": len(ok) == len(rs) and all(r["kind"] == expected for r in rs),
            "culprits": sorted({tuple(r["ranks"]) for r in ok if r["ranks"] is not None}),
            "window_s": window, "target_s": target, "runs": len(rs), "detected_runs": len(ok),
            "onset_to_detected_min_s": min(lat) if lat else None, "onset_to_detected_median_s": _median(lat),
            "onset_to_disk_min_s": min(disk) if disk else None, "onset_to_disk_median_s": disk_median,
            "progress_to_detected_median_s": _median(prog),
            "within_target_runs": sum(1 for x in disk if x <= target),
            "within_target": disk_median is not None and len(ok) == len(rs) and disk_median <= target,
            "errors": [r["error"] for r in rs if "error" in r],
            "raw": rs,
        })
    return rows


def print_detection(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n(a) Detection latency: real jobs (gloo, CPU) under a real watchdog, --stall-window {args.window:g} s, "
          f"poll 0.2 s; {args.repeats} run(s) each; figures min / median in seconds")
    head = (f"{'scenario':<17} {'expected kind':<25} {'diagnosed':<25} {'onset->detected':>16} {'onset->on disk':>15} "
            f"{'progress->det.':>14} {'window':>6} {'target':>6}  within")
    print(head)
    print("-" * len(head))

    def mm(a, b) -> str:
        return "-" if a is None else f"{a:.2f} / {b:.2f}"

    for r in rows:
        diag = ",".join(r["kinds"]) + ("" if r["kind_ok"] else " (!)")
        within = f"{'yes' if r['within_target'] else 'NO'} ({r['within_target_runs']}/{r['runs']})"
        window = f"{r['window_s']:g}" if r["window_s"] else "none"
        progress = r["progress_to_detected_median_s"]
        print(f"{r['scenario']:<17} {r['expected_kind']:<25} {diag:<25} "
              f"{mm(r['onset_to_detected_min_s'], r['onset_to_detected_median_s']):>16} "
              f"{mm(r['onset_to_disk_min_s'], r['onset_to_disk_median_s']):>15} "
              f"{'-' if progress is None else format(progress, '.2f'):>14} "
              f"{window:>6} {r['target_s']:>6g}  {within}")
    print("within: the median onset->on disk is <= target (window + 2 s; 2 s for rank_exited, which needs no window);"
          " (k/n) runs within.")
    print("onset = the worker's own timestamp just before it hangs; for uneven_ddp and stuck_outside the other ranks"
          " still progress for up to a step after it, which progress->detected excludes.")
    for r in rows:
        for e in r["errors"]:
            print(f"\n{r['scenario']}: {e[-1500:]}")


# ---------------------------------------------------------------------------------------------------
# (b) watchdog CPU at 8 ranks
# ---------------------------------------------------------------------------------------------------
def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


def _rss_kib(pid: int) -> tuple[int, int]:
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return rss, hwm




def _total_ticks(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            total += _cpu_ticks(p)
        except (OSError, IndexError, ValueError):
            pass
    return total


def _ring_stats(run_dir: Path) -> tuple[int, float]:
    """(records written by all ranks so far, mean fraction of the rings' capacity holding records)."""
    from dtwatch.ring import find_rings, read_ring

    total, fill = 0, []
    for p in find_rings(run_dir):
        try:
            snap = read_ring(p)
        except Exception:  # noqa: BLE001
            continue
        recs = snap.records
        total += int(recs["stamp"].max()) if len(recs) else 0
        with open(p, "rb") as f:
            capacity = struct.unpack_from("<I", f.read(24), 20)[0]  # header: magic, version, sizes, capacity
        fill.append(len(recs) / capacity if capacity else 0.0)
    return total, (sum(fill) / len(fill) if fill else 0.0)


def _records_written(run_dir: Path) -> int:
    return _ring_stats(run_dir)[0]


def watchdog_cpu(args: argparse.Namespace, root: Path) -> dict:
    nproc = args.ranks
    job_id = f"cpu-{nproc}ranks-{os.getpid()}"
    run_dir = root / job_id
    env = base_env(root, job_id)
    node = socket.gethostname()
    root.mkdir(parents=True, exist_ok=True)
    wlog = root / "watchdog-cpu.log"
    # Product defaults (poll 1 s, adaptive window) with the Prometheus exporter on a free port.
    prof = ["-m", "cProfile", "-o", str(Path(args.profile_watchdog).resolve())] if args.profile_watchdog else []
    wcmd = [sys.executable, *prof, "-m", "dtwatch", "watch", "--dir", str(root), "--job-id", job_id,
            "--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--store", "none", "--idle-exit", "5"]
    watchdog = subprocess.Popen(wcmd, env=env, stdout=wlog.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    ready = run_dir / f"watchdog-{node}.json"
    deadline = time.time() + 60
    while not ready.exists():
        if watchdog.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"watchdog did not start: {wlog.read_text()}")
        time.sleep(0.1)
    info = json.loads(ready.read_text())
    url = info.get("url")
    fill_wait = 90.0 if args.fill_rings else 0.0  # at ~85 records/s per rank a 4096-record ring fills in ~50 s
    seconds = args.warmup + fill_wait + args.cpu_window + 10
    jenv = dict(env, BUSY_SECONDS=str(seconds))
    tlog = root / "busy.out"
    trun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(BUSY_WORKER)],
        env=jenv, stdout=tlog.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    result: dict = {"ranks": nproc, "cores": os.cpu_count(), "metrics_url": url, "exporter": bool(url),
                    "fill_rings": args.fill_rings, "poll_interval_s": 0.5, "cpu_window_s": args.cpu_window,
                    "warmup_s": args.warmup}
    try:
        # Steady traffic: every ring exists and records are being written.
        deadline = time.time() + 180
        while True:
            rings = list(run_dir.glob("rank-*.ring"))
            if len(rings) >= nproc and _records_written(run_dir) > 20 * nproc:
                break
            if trun.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the {nproc}-rank job did not start: {tlog.read_text()[-3000:]}")
            time.sleep(0.5)
        time.sleep(args.warmup)
        deadline = time.time() + fill_wait
        while args.fill_rings and _ring_stats(run_dir)[1] < 0.98 and time.time() < deadline:
            time.sleep(2.0)
        scraped = 0
        workers = descendants(trun.pid)
        (r0, fill0), j0 = _ring_stats(run_dir), _total_ticks(workers)
        w0, t0 = _cpu_ticks(watchdog.pid), time.monotonic()
        rss_samples = []
        next_scrape = time.monotonic()
        while time.monotonic() - t0 < args.cpu_window:
            if url and args.scrape_interval > 0 and time.monotonic() >= next_scrape:
                try:
                    with urllib.request.urlopen(url, timeout=5) as resp:
                        resp.read()
                    scraped += 1
                except OSError:
                    pass
                next_scrape += args.scrape_interval
            rss_samples.append(_rss_kib(watchdog.pid)[0])
            time.sleep(1.0)
        w1, t1 = _cpu_ticks(watchdog.pid), time.monotonic()
        (r1, fill1), j1 = _ring_stats(run_dir), _total_ticks(workers)
        if trun.poll() is not None:
            result["warning"] = "the job ended inside the measurement window; the figure covers an idle tail"
        wall = t1 - t0
        rss, hwm = _rss_kib(watchdog.pid)
        result.update({
            "wall_s": round(wall, 2),
            "watchdog_cpu_s": round((w1 - w0) / CLK_TCK, 3),
            "watchdog_cpu_pct_of_core": round(100.0 * (w1 - w0) / CLK_TCK / wall, 2),
            "target_pct": 2.0,
            "watchdog_rss_mib": round(rss / 1024, 1), "watchdog_rss_max_mib": round(max(rss_samples + [rss]) / 1024, 1),
            "watchdog_peak_rss_mib": round(hwm / 1024, 1),
            "training_cpu_pct_of_core": round(100.0 * (j1 - j0) / CLK_TCK / wall, 1),
            "records_per_s_all_ranks": round((r1 - r0) / wall, 1),
            "ring_fill_start": round(fill0, 3), "ring_fill_end": round(fill1, 3),
            "scrapes": scraped,
        })
        result["within_target"] = result["watchdog_cpu_pct_of_core"] <= result["target_pct"]
        try:
            trun.wait(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            pass
        out = tlog.read_text(errors="replace")
        result["worker_summary"] = next((ln for ln in out.splitlines() if ln.startswith("busy_worker:")), "")
        result["job_exit"] = trun.poll()
    finally:
        for p in (trun, watchdog):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(timeout=15)
                except (OSError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait(timeout=10)
                    except (OSError, subprocess.TimeoutExpired):
                        pass
    return result


def print_cpu(r: dict) -> None:
    exporter = f"on, scraped {r['scrapes']}x" if r["exporter"] else "off"
    print(f"\n(b) Watchdog cost at {r['ranks']} ranks: healthy gloo job (benchmarks/workers/busy_worker.py) under "
          f"`dtwatch watch` (poll 1 s, adaptive window, Prometheus exporter {exporter})")
    print(f"  watchdog CPU       {r['watchdog_cpu_pct_of_core']:.2f} % of one core  ({r['watchdog_cpu_s']:.2f} s CPU "
          f"over {r['wall_s']:.0f} s, after {r['warmup_s']:g} s warm-up)  target <= {r['target_pct']:g} %: "
          f"{'yes' if r['within_target'] else 'NO'}")
    print(f"  watchdog RSS       {r['watchdog_rss_mib']:.1f} MiB at the end "
          f"(max sampled {r['watchdog_rss_max_mib']:.1f}, peak VmHWM {r['watchdog_peak_rss_mib']:.1f})")
    print(f"  traffic            {r['records_per_s_all_ranks']:.0f} ring records/s over all ranks; "
          f"{r['worker_summary']}")
    print(f"  rings              {100 * r['ring_fill_start']:.0f} % -> {100 * r['ring_fill_end']:.0f} % full "
          "during the window (a poll reads whole rings; parsing cost grows with the records held)")
    print(f"  contention         {r['ranks']} training processes used {r['training_cpu_pct_of_core']:.0f} % "
          f"of one core on a {r['cores']}-core machine: they compete with the watchdog for the cores "
          "(its CPU time is counted, not its wall time, so the figure stands; its polls may run late)")
    if r.get("warning"):
        print(f"  warning            {r['warning']}")


# ---------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=5.0, help="--stall-window of the watchdog for (a) (default 5 s)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per scenario (default 1); min/median reported")
    ap.add_argument("--only", default="",
                    help="comma-separated scenarios for (a): " + ",".join(s[0] for s in SCENARIOS))
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for an incident (default 90)")
    ap.add_argument("--no-detection", action="store_true", help="skip (a)")
    ap.add_argument("--no-cpu", action="store_true", help="skip (b)")
    ap.add_argument("--ranks", type=int, default=8, help="ranks of the job in (b) (default 8)")
    ap.add_argument("--cpu-window", type=float, default=30.0, help="seconds of CPU measurement in (b) (default 30)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of steady traffic before measuring (default 5)")
    ap.add_argument("--fill-rings", action="store_true",
                    help="(b): keep warming up until the rings are full "
                         "(steady state of a long job; the job runs ~90 s longer)")
    ap.add_argument("--scrape-interval", type=float, default=15.0,
                    help="scrape /metrics every N s during (b), as Prometheus would (0 = never; default 15)")
    ap.add_argument("--profile-watchdog", metavar="FILE",
                    help="run the watchdog of (b) under cProfile and write its stats to FILE (inflates the CPU figure)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE ('-' = stdout)")
    args = ap.parse_args()
    unknown = set(filter(None, args.only.split(","))) - {s[0] for s in SCENARIOS}
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")

    base = Path(tempfile.mkdtemp(prefix="dtwatch-detect-"))
    report: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "host": platform.node(),
                                "load_avg_start": os.getloadavg()}}
    try:
        if not args.no_detection:
            rows = detection(args, base / "detect")
            report["detection"] = [{k: v for k, v in r.items() if k != "raw" or args.json} for r in rows]
            print_detection(rows, args)
        if not args.no_cpu:
            cpu = watchdog_cpu(args, base / "cpu")
            report["watchdog_cpu"] = cpu
            print_cpu(cpu)
    finally:
        report["machine"]["load_avg_end"] = os.getloadavg()
        if args.keep:
            print(f"\nrun directories kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\nload average (1 min) at start / end: {report['machine']['load_avg_start'][0]:.2f} / "
          f"{report['machine']['load_avg_end'][0]:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        text = json.dumps(report, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    ok = all(r["within_target"] and r["kind_ok"] for r in report.get("detection", []))
    ok = ok and report.get("watchdog_cpu", {}).get("within_target", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
