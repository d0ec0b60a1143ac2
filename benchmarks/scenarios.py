#!/usr/bin/env python
"""End-to-end scenarios: real 4-rank gloo jobs under ``dtwatch run``, the diagnosis judged against the truth.

    python benchmarks/scenarios.py                           # every scenario of tests/scenarios/catalog.py
    python benchmarks/scenarios.py --only rc_python,rc_async_wait
    python benchmarks/scenarios.py --capture tests/incidents # also (re)write one replay fixture per scenario
    python benchmarks/scenarios.py --json -                  # results as JSON on stdout (table on stderr)
    python benchmarks/scenarios.py --list

Each scenario runs, one at a time, as::

    python -m dtwatch run --stall-window 10 --fail-fast --dir <tmp> --job-id <id> --metrics-port off -- \\
        python -m torch.distributed.run --nproc-per-node 4 --master-port <free> tests/scenarios/<script> ARGS

with ``tests/minilib`` copied into a temporary ``site-packages`` directory on ``PYTHONPATH`` (so
its frames are library frames) and a hard timeout (the job's process tree is killed after it). For an
incident, the first stall-severity finding of the first incident bundle is compared with the truth:
kind, culprit ranks, op, and the root-cause line (matched against the finding's site, user_site and
``details.conditional_line``; the table shows which matched), plus the phrases that must / must not
appear. Latency = the bundle's detection time minus the onset the script wrote just before its fault.
A healthy control is right when no stall finding is written at all; it is captured live at the moment
the script names (``capture-at.txt``, e.g. in the middle of a quiet gap), or at the end.
An incident that was not diagnosed before the timeout is captured live, then killed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dtwatch.bundle.files import bundle_findings
from dtwatch.report.capture import capture, live_warnings, write_fixture
from dtwatch.watchdog.proctree import descendants
from tests.scenarios.catalog import HERE as SCENARIO_DIR
from tests.scenarios.catalog import SCENARIOS, Scenario
from tests.scenarios.judge import judge, stall_findings

COLUMNS = ("kind", "ranks", "op", "line", "text")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def kill_tree(proc: subprocess.Popen) -> None:
    """End the job this runner started: its launcher, watchdog and ranks, by pid."""
    pids = descendants(proc.pid)
    for pid in [proc.pid] + pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def job_env(root: Path, libdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTWATCH_", "TORCH_NCCL", "TORCH_FR", "OTEL_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), str(libdir)])})
    return env


def read_bundles(run_dir: Path) -> list[tuple[dict, Path]]:
    out = []
    for index_file in run_dir.glob("incidents/*/*/index.json"):
        try:
            index = json.loads(index_file.read_text())
            if (index_file.parent / "findings.json").exists():
                index["findings"] = bundle_findings(index_file.parent)
        except (OSError, ValueError):
            continue
        out.append((index, index_file.parent))
    return sorted(out, key=lambda x: x[0].get("detected", 0.0))


def onset_time(run_dir: Path) -> float | None:
    times = []
    for p in run_dir.glob("onset-rank*.txt"):
        try:
            times.append(float(p.read_text()))
        except (OSError, ValueError):
            pass
    return min(times) if times else None


def run_one(sc: Scenario, *, window: float, work: Path, capture_dir: Path | None, keep: bool) -> dict:
    root = work / sc.name
    shutil.rmtree(root, ignore_errors=True)
    libdir = root / "lib" / "site-packages"
    shutil.copytree(SCENARIO_DIR.parent / "minilib", libdir / "minilib", ignore=shutil.ignore_patterns("__pycache__"))
    job_id = f"{sc.name}-{uuid.uuid4().hex[:6]}"
    run_dir = root / job_id
    cmd = [sys.executable, "-m", "dtwatch", "run", "--stall-window", str(window), "--fail-fast", "--dir", str(root),
           "--job-id", job_id, "--metrics-port", "off", "--",
           sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(sc.nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(sc.path), *sc.args]
    log = root / "job.log"
    t0 = time.time()
    env = {**job_env(root, libdir), **sc.env}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=REPO)
    live_capture: dict | None = None
    timed_out = False
    capture_at_file = run_dir / "capture-at.txt"
    while proc.poll() is None:
        if time.time() - t0 > sc.timeout:
            timed_out = True
            break
        if sc.healthy and live_capture is None and capture_at_file.exists():
            try:
                at = float(capture_at_file.read_text())
            except ValueError:
                at = None
            if at is not None and time.time() >= at:
                live_capture = capture(run_dir, name=sc.name, relative_to=str(REPO), window=window,
                                       truth=sc.truth())
        time.sleep(0.2)
    if timed_out:
        if run_dir.exists() and not read_bundles(run_dir):
            live_capture = capture(run_dir, name=sc.name, relative_to=str(REPO), window=window, truth=sc.truth())
        kill_tree(proc)
    else:
        kill_tree(proc)  # nothing should be left; make sure
    wall = time.time() - t0
    bundles = read_bundles(run_dir)
    findings = bundles[0][0].get("findings", []) if bundles else []
    truth = sc.truth()
    onset = onset_time(run_dir)
    detected = bundles[0][0].get("detected") if bundles else None
    verdict = judge(findings, truth)
    # What the watchdog warned of while the job ran (its events file): a healthy control gives none.
    warned = live_warnings(run_dir, float("inf")) if run_dir.exists() else []
    if sc.healthy and warned:
        verdict.ok["stall"] = False
        verdict.shown["stall"] = "warned: " + "; ".join(f"[{w.get('kind')}] {str(w.get('summary'))[:120]}"
                                                         for w in warned)
    stalls = stall_findings(findings)
    first = stalls[0] if stalls else None
    result = {
        "name": sc.name, "truth": truth, "exit_code": proc.returncode, "timed_out": timed_out, "wall_s": round(wall, 1),
        "onset": onset, "detected": detected,
        "latency_s": round(detected - onset, 2) if detected and onset else None,
        "finding": first, "stall_findings": len(stall_findings(findings)),
        "warnings": [{k: w.get(k) for k in ("kind", "ranks", "summary")} for w in warned],
        "ok": verdict.ok, "shown": verdict.shown, "right": verdict.right and not (sc.healthy and warned),
        "bundle": str(bundles[0][1]) if bundles else None,
    }
    if capture_dir is not None:
        truth_with_onset = {**truth, "onset": onset}
        if bundles and not sc.healthy:
            data = capture(bundles[0][1], name=sc.name, relative_to=str(REPO), truth=truth_with_onset)
        elif live_capture is not None:
            data = {**live_capture, "truth": {**live_capture["truth"], "onset": onset}}
        elif run_dir.exists():
            data = capture(run_dir, name=sc.name, relative_to=str(REPO), window=window, truth=truth_with_onset)
        else:
            data = None
        if data is not None:
            result["fixture"] = str(capture_dir / f"{sc.name}.json")
            result["fixture_bytes"] = write_fixture(data, capture_dir / f"{sc.name}.json")
    if not keep and not timed_out:
        shutil.rmtree(root, ignore_errors=True)
    else:
        result["log"] = str(log)
    return result


def _truth_cell(t: dict) -> str:
    if t.get("healthy"):
        return "healthy"
    return f"{t['kind']} {t['ranks']} {t['op'] or '-'} :{t['line']}"


def _finding_cell(r: dict) -> str:
    if r["truth"].get("healthy"):
        return r["shown"].get("stall", "")
    f = r["finding"]
    if f is None:
        return "no stall finding" + (" (timed out)" if r["timed_out"] else "")
    return f"{f['kind']} {sorted(f.get('ranks') or [])} {f.get('op') or '-'} {r['shown'].get('line', '')}"


def table(results: list[dict]) -> str:
    rows = [("scenario", "truth", "finding (kind ranks op line)", "kind", "rank", "op", "line", "text", "latency")]
    for r in results:
        marks = []
        for col in COLUMNS:
            if r["truth"].get("healthy"):
                marks.append("")
            elif col not in r["ok"]:
                marks.append("-")
            else:
                marks.append("ok" if r["ok"][col] else "NO")
        if r["truth"].get("healthy"):
            marks[0] = "ok" if r["ok"].get("stall") else "NO"
        lat = f"{r['latency_s']:.1f}s" if r.get("latency_s") is not None else "-"
        rows.append((r["name"], _truth_cell(r["truth"]), _finding_cell(r), *marks, lat))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    right = sum(r["right"] for r in results)
    lines.append(f"\n{right}/{len(results)} scenarios fully right "
                 f"({sum(r['right'] for r in results if not r['truth'].get('healthy'))}/"
                 f"{sum(not r['truth'].get('healthy') for r in results)} incidents, "
                 f"{sum(r['right'] for r in results if r['truth'].get('healthy'))}/"
                 f"{sum(bool(r['truth'].get('healthy')) for r in results)} healthy controls)")
    for col in COLUMNS:
        judged = [r for r in results if col in r["ok"]]
        if judged:
            lines.append(f"  {col}: {sum(r['ok'][col] for r in judged)}/{len(judged)} right")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--window", type=float, default=10.0, help="stall window (default 10)")
    ap.add_argument("--capture", metavar="DIR", help="write one fixture per scenario into DIR")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': stdout, the table goes to stderr)")
    ap.add_argument("--keep", action="store_true", help="keep every run directory (default: only failed runs)")
    ap.add_argument("--workdir", default=None, help="where the run directories go (default: a temporary directory)")
    ap.add_argument("--list", action="store_true", help="list the scenarios and their truths")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="keep N busy processes spinning while the scenarios run (a loaded training node)")
    args = ap.parse_args(argv)
    chosen = list(SCENARIOS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {s.name: s for s in SCENARIOS}
        unknown = [n for n in names if n not in known]
        if unknown:
            ap.error(f"unknown scenarios: {', '.join(unknown)}")
        chosen = [known[n] for n in names]
    if args.list:
        for s in chosen:
            print(f"{s.name:34} {s.script} {' '.join(s.args):12} {_truth_cell(s.truth())}  tags={','.join(s.tags)}")
        return 0
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dtwatch-scenarios-"))
    work.mkdir(parents=True, exist_ok=True)
    capture_dir = Path(args.capture) if args.capture else None
    out = sys.stderr if args.json == "-" else sys.stdout
    results = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(0, args.load))]
    try:
        _run_all(chosen, args, work, capture_dir, out, results)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    print(table(results), file=out, flush=True)
    if args.json:
        text = json.dumps(results, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if not args.workdir and not args.keep and not any("log" in r for r in results):
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["right"] for r in results) else 1


def _run_all(chosen: list[Scenario], args: argparse.Namespace, work: Path, capture_dir: Path | None, out,
             results: list[dict]) -> None:
    for i, sc in enumerate(chosen, 1):
        r = run_one(sc, window=args.window, work=work, capture_dir=capture_dir, keep=args.keep)
        results.append(r)
        verdict = "right" if r["right"] else "WRONG: " + "; ".join(
            f"{c} {r['shown'].get(c)}" for c, ok in r["ok"].items() if not ok)
        print(f"[{i}/{len(chosen)}] {sc.name}: {verdict} ({r['wall_s']}s, exit {r['exit_code']}"
              f"{', timed out' if r['timed_out'] else ''})", file=out, flush=True)


if __name__ == "__main__":
    sys.exit(main())
