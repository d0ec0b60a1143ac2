"""torch Flight Recorder dumps of real faulty jobs run without dtwatch, captured as fixtures.

Runs ``tests/scripts/fr_job.py`` under torchrun (gloo, no dtwatch) with one fault, collects every rank's dump
and keeps it as JSON with the machine's paths made neutral (as :mod:`tests.fr_fixtures` does) and the entries'
times made relative to the job's first entry. A fixture (``tests/fixtures/frdumps/<fault>-torch-<version>.json``)
holds the dumps per rank (their top-level fields, and per entry those a reader uses), the ranks that left none,
and the worker's source as it was, so that the lines the entries name can be read back whatever the worker
became since.

    PYTHONPATH=. python -m tests.frdump_fixtures tests/fixtures/frdumps               # every fault, this torch
    PYTHONPATH=. python -m tests.frdump_fixtures OUT --python /other/venv/bin/python --fault crash
    PYTHONPATH=. python -m tests.frdump_fixtures OUT --raw --fault rank_conditional   # torch's own bytes, no frames

``--raw`` copies the dump files as torch wrote them instead, written without Python frames (``FR_STACKS=0``), so
that they hold no path of this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.fr_fixtures import SCRIPTS, _neutral_path

WORKER = "fr_job.py"
FAULTS = ("healthy", "rank_conditional", "uneven", "subgroup_skip", "p2p", "mismatch", "crash", "stuck")
PREFIX = "fr_trace_rank_"
ENTRY_FIELDS = ("process_group", "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name", "input_sizes",
                "input_dtypes", "output_sizes", "state", "retired", "is_p2p", "time_created_ns",
                "time_discovered_started_ns", "time_discovered_completed_ns", "timeout_ms")
TOP_FIELDS = ("version", "pg_config", "pg_status", "comm_lib_version", "nccl_version")


def world_of(fault: str) -> int:
    return 2 if fault == "p2p" else 4


def run_job(python: str, fault: str, out: Path, *, stacks: bool = True, fmt: str = "pickle",
            dump_after: float = 4.0, timeout: float = 150, nproc: int | None = None) -> subprocess.CompletedProcess:
    """Run the worker with ``fault`` under torchrun; the ranks' dumps land in ``out`` (``<PREFIX><rank>``)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTWATCH_", "TORCH_FR", "TORCH_NCCL"))}
    env.update(FR_FAULT=fault, FR_DUMP_DIR=str(out), FR_PREFIX=PREFIX, FR_DUMP_AFTER=str(dump_after),
               FR_STACKS="1" if stacks else "0", TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
               TORCH_FR_DUMP_TEMP_FILE=str(out / PREFIX), OMP_NUM_THREADS="1", LOGLEVEL="WARNING",
               TORCH_CPP_LOG_LEVEL="ERROR")
    if fmt == "json":
        env["FR_FORMAT"] = "json"
    env.pop("PYTHONPATH", None)  # a plain job: nothing of dtwatch on its path
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc or world_of(fault)}",
           "--monitor-interval=1", str(SCRIPTS / WORKER)]
    return subprocess.run(cmd, env=env, cwd=out, timeout=timeout, capture_output=True, text=True)


def _site_packages(python: str) -> list[str]:
    found = subprocess.run([python, "-c", "import site, sys; print('\\n'.join(site.getsitepackages() + sys.path))"],
                           check=True, capture_output=True, text=True).stdout.split()
    return sorted({p.rstrip(os.sep) for p in found if p.endswith("-packages")}, key=len, reverse=True)


def make_fixture(docs: dict[int, dict], fault: str, torch_version: str, site_packages: list[str]) -> dict:
    t0 = min((e.get("time_created_ns") or 0 for d in docs.values() for e in d.get("entries", [])), default=0)
    dumps = {}
    for rank, doc in sorted(docs.items()):
        entries = []
        for e in doc.get("entries", []):
            kept = {k: e.get(k) for k in ENTRY_FIELDS if k in e}
            for k in ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns"):
                if kept.get(k):
                    kept[k] = int(kept[k]) - t0 + 1
            kept["frames"] = [{"name": f.get("name"), "filename": _neutral_path(str(f.get("filename")), site_packages),
                               "line": f.get("line")} for f in e.get("frames") or []]
            entries.append(kept)
        dumps[str(rank)] = {**{k: doc[k] for k in TOP_FIELDS if k in doc}, "entries": entries}
    world = world_of(fault)
    return {"torch": torch_version, "backend": "gloo", "fault": fault, "world": world, "worker": WORKER,
            "dumps": dumps, "no_dump": sorted(set(range(world)) - set(docs)),
            "source": (SCRIPTS / WORKER).read_text()}


def capture(python: str, fault: str) -> dict:
    from dtwatch.bundle.safe_pickle import load_plain

    with tempfile.TemporaryDirectory(prefix="dtwatch-frdump-") as tmp:
        out = Path(tmp) / "dumps"
        run_job(python, fault, out)
        docs = {int(p.name[len(PREFIX):]): load_plain(p.read_bytes(), str(p)) for p in out.glob(PREFIX + "*")}
        version = subprocess.run([python, "-c", "import torch; print(torch.__version__.split('+')[0])"], check=True,
                                 capture_output=True, text=True).stdout.strip()
        return make_fixture(docs, fault, version, _site_packages(python))


def capture_raw(python: str, fault: str, dest: Path, fmt: str = "pickle") -> list[Path]:
    """torch's own dump files of ``fault``, written without frames, copied to ``dest``."""
    with tempfile.TemporaryDirectory(prefix="dtwatch-frdump-") as tmp:
        out = Path(tmp) / "dumps"
        run_job(python, fault, out, stacks=False, fmt=fmt)
        dest.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(p, dest / p.name)) for p in sorted(out.glob(PREFIX + "*"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory to write the fixtures (or, with --raw, the dump files) to")
    ap.add_argument("--python", default=sys.executable, help="interpreter whose torch runs the job")
    ap.add_argument("--fault", action="append", choices=FAULTS, help="fault(s) to capture (default: all)")
    ap.add_argument("--raw", action="store_true", help="copy torch's dump files, written without frames")
    ap.add_argument("--json", action="store_true", help="with --raw: torch's JSON dumps")
    args = ap.parse_args()
    out = Path(args.out)
    for fault in args.fault or FAULTS:
        if args.raw:
            files = capture_raw(args.python, fault, out, "json" if args.json else "pickle")
            print(f"{out}: {len(files)} dump file(s) of {fault}")
            continue
        data = capture(args.python, fault)
        path = out / f"{fault}-torch-{data['torch'].rsplit('.', 1)[0]}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        n = sum(len(d["entries"]) for d in data["dumps"].values())
        print(f"{path}: torch {data['torch']}, {len(data['dumps'])} dump(s), {n} entries, no dump: {data['no_dump']}")


if __name__ == "__main__":
    main()
