#!/usr/bin/env python
"""How long ``dtwatch analyze`` takes on torch's own Flight Recorder dumps of a 1,024-rank job run without dtwatch.

    python benchmarks/analyze_dumps.py                     # 1024 ranks, 200 entries per rank
    python benchmarks/analyze_dumps.py --entries 2000      # torch's buffer full (TORCH_FR_BUFFER_SIZE=2000)
    python benchmarks/analyze_dumps.py --json -            # figures as JSON on stdout (or --json FILE)
    python benchmarks/analyze_dumps.py --ranks 256 --keep /tmp/dumps --profile 25

The dumps are synthesised from a real one: the 4-rank gloo job of ``tests/scripts/fr_job.py`` in which rank 0
reduces a metric under ``if rank == 0`` (the fixture ``tests/fixtures/frdumps/rank_conditional-torch-2.13.json``,
captured from torch's own dumps). Rank ``--culprit`` (17) gets rank 0's dump, every other rank rank 1's; each
rank's history is lengthened to ``--entries`` entries with earlier steps of the same gradient all-reduce (the
numbers shifted after them), entry times jittered per rank, and every dump's group config lists the 1,024
ranks, as gloo's does. The worker's source, as captured, is written beside the dumps and the frames point at it,
so the rank test is read from the source. Each dump is written as a pickle of plain containers, one file per rank
named as torch names them (``fr_trace_rank_<rank>``).

Figures: seconds to write the dumps (not part of the target), ``analyze([dir])`` in this process (find by
content + read through the restricted unpickler + make the states + diagnose; target <= 10 s, DESIGN.md),
and ``dtwatch analyze DIR --json`` as a subprocess (interpreter start and imports included). Each says whether
the finding is rank_conditional naming rank ``--culprit`` alone, at its line.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pickle
import pstats
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURE = ROOT / "tests" / "fixtures" / "frdumps" / "rank_conditional-torch-2.13.json"
SCRIPT = "/job/fr_job.py"  # the worker's path in the fixture
PREFIX = "fr_trace_rank_"


def _lengthened(doc: dict, entries: int, script: str, jitter: float) -> dict:
    """``doc`` with earlier steps prepended (copies of its first entry) until it holds ``entries`` entries."""
    out = copy.deepcopy(doc)
    real = out["entries"]
    extra = max(0, entries - len(real))
    step_ns = 1_000_000
    for e in real:
        e["collective_seq_id"] += extra
        e["op_id"] += extra
        e["time_created_ns"] += extra * step_ns
    first = real[0]
    earlier = []
    for i in range(extra):
        e = copy.deepcopy(first)
        e["collective_seq_id"] = e["op_id"] = i + 1
        e["time_created_ns"] = (i + 1) * step_ns
        earlier.append(e)
    out["entries"] = earlier + real
    for e in out["entries"]:
        e["time_created_ns"] = int(e["time_created_ns"] + jitter)
        for fr in e.get("frames") or []:
            if fr.get("filename") == SCRIPT:
                fr["filename"] = script
    return out


def synthesize(root: Path, *, ranks: int, entries: int, culprit: int, seed: int = 0) -> Path:
    """Write ``ranks`` dumps under ``root/dumps`` (see the module doc); returns that directory."""
    fixture = json.loads(FIXTURE.read_text())
    job = root / "job"
    job.mkdir(parents=True, exist_ok=True)
    script = job / "fr_job.py"
    script.write_text(fixture["source"])
    out = root / "dumps"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    world = str(list(range(ranks)))
    base = {r: _lengthened(fixture["dumps"][str(r)], entries, str(script), 0.0) for r in (0, 1)}
    for rank in range(ranks):
        doc = copy.deepcopy(base[0 if rank == culprit else 1])
        shift = rng.uniform(0, 200_000)
        for e in doc["entries"]:
            e["time_created_ns"] = int(e["time_created_ns"] + shift)
        doc["pg_config"] = {"": {"name": "", "desc": "", "ranks": world}}
        (out / f"{PREFIX}{rank}").write_bytes(pickle.dumps(doc, protocol=2))
    return out


def _check(findings: list, culprit: int, line: int) -> bool:
    if not findings:
        return False
    f = findings[0]
    kind = f["kind"] if isinstance(f, dict) else str(f.kind)
    ranks = f["ranks"] if isinstance(f, dict) else f.ranks
    site = f["site"] if isinstance(f, dict) else f.site
    return kind == "rank_conditional" and ranks == [culprit] and bool(site) and site["line"] == line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--entries", type=int, default=200, help="Flight Recorder entries per rank (default 200)")
    ap.add_argument("--culprit", type=int, default=17)
    ap.add_argument("--keep", metavar="DIR", help="write the dumps here and keep them")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON ('-': stdout)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile analyze(): print the top N")
    args = ap.parse_args()

    from dtwatch.report.analyze import analyze

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dtwatch-frdumps-"))
    try:
        t0 = time.perf_counter()
        dumps = synthesize(root, ranks=args.ranks, entries=args.entries, culprit=args.culprit)
        t_write = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in dumps.iterdir())
        source = (root / "job" / "fr_job.py").read_text().splitlines()
        line = next(i for i, text in enumerate(source, 1) if "# metric reduced only on rank 0" in text)

        prof = cProfile.Profile() if args.profile else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        result = analyze([str(dumps)])
        if prof is not None:
            prof.disable()
        t_analyze = time.perf_counter() - t0

        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", str(dumps), "--json"], capture_output=True,
                              text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(ROOT)})
        t_cli = time.perf_counter() - t0
        cli_findings = json.loads(proc.stdout)["findings"] if proc.stdout.strip() else []

        figures = {
            "ranks": args.ranks, "entries_per_rank": args.entries, "culprit": args.culprit,
            "dump_bytes": size, "write_s": round(t_write, 2), "analyze_s": round(t_analyze, 2),
            "analyze_ok": _check(result.findings, args.culprit, line), "cli_s": round(t_cli, 2),
            "cli_rc": proc.returncode, "cli_ok": _check(cli_findings, args.culprit, line), "target_s": 10.0,
            "python": sys.version.split()[0],
        }
        if result.findings:
            figures["finding"] = result.findings[0].summary
        if args.json:
            text = json.dumps(figures, indent=2)
            if args.json == "-":
                print(text)
            else:
                Path(args.json).write_text(text + "\n")
        else:
            print(f"{args.ranks} ranks x {args.entries} entries ({size / 1e6:.1f} MB of dumps), written in "
                  f"{t_write:.1f}s")
            print(f"analyze(): {t_analyze:.2f}s  (names rank {args.culprit} at line {line}: {figures['analyze_ok']})")
            print(f"dtwatch analyze --json: {t_cli:.2f}s, exit {proc.returncode}  (names it: {figures['cli_ok']})")
        if prof is not None:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.profile)
            print(buf.getvalue())
        return 0 if figures["analyze_ok"] and figures["cli_ok"] else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
