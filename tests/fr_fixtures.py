"""Flight Recorder fixtures: one rank's FR entries and dtwatch calls from a real run, with paths made neutral.

A fixture (``tests/fixtures/flight/<backend>-torch-<version>.json``) holds, for rank 0 of a 2-rank run of
``tests/scripts/rec_fr.py``: the raw FR entries (fields dtwatch reads, frames included), dtwatch's
Python-issued calls from the ring (op, group, seq, span, fingerprint) and the worker's notes of torch's
sequence counter after each phase, which say which numbers were issued from C++ (DDP) and where.

Capture one for the installed torch (or another interpreter with its own torch)::

    PYTHONPATH=. python -m tests.fr_fixtures tests/fixtures/flight/gloo-torch-2.13.json
    PYTHONPATH=. python -m tests.fr_fixtures OUT.json --python /path/to/other/venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DTWATCH_DIR = Path(__file__).resolve().parent.parent / "dtwatch"
WORKER = "rec_fr.py"
NEUTRAL_SITE_PACKAGES = "/venv/lib/python3/site-packages"
NEUTRAL_SCRIPT_DIR = "/job"
ENTRY_FIELDS = ("process_group", "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name", "input_sizes",
                "input_dtypes", "state", "is_p2p", "frames")


def _neutral_path(path: str, site_packages: list[str]) -> str:
    """A frame's file name without this machine's directories."""
    if path.startswith(str(SCRIPTS) + os.sep):
        return NEUTRAL_SCRIPT_DIR + path[len(str(SCRIPTS)):]
    if path.startswith(str(DTWATCH_DIR) + os.sep):  # dtwatch's wrapper frames, as if installed
        return NEUTRAL_SITE_PACKAGES + "/dtwatch" + path[len(str(DTWATCH_DIR)):]
    for sp in site_packages:
        if path.startswith(sp + os.sep):
            return NEUTRAL_SITE_PACKAGES + path[len(sp):]
    if path.startswith("<"):
        return path
    return "/python/lib/" + os.path.basename(path)  # the standard library, or anything else


def make_fixture(fr: dict, calls: list[dict], notes: list[dict], torch_version: str, backend: str,
                 site_packages: list[str]) -> dict:
    entries = []
    for e in fr.get("entries", []):
        kept = {k: e.get(k) for k in ENTRY_FIELDS}
        kept["frames"] = [{"name": f.get("name"), "filename": _neutral_path(str(f.get("filename")), site_packages),
                           "line": f.get("line")} for f in e.get("frames") or []]
        entries.append(kept)
    return {"torch": torch_version, "backend": backend, "fr_version": fr.get("version"), "worker": WORKER,
            "entries": entries, "calls": calls, "notes": notes}


def python_calls(state) -> list[dict]:
    """dtwatch's Python-issued calls of a RankState, the fields the FR mapping uses."""
    return [{"op": c.op, "group": c.group, "seq": c.seq, "span": c.span, "fingerprint": c.fingerprint}
            for g in state.groups.values() for c in g.recent]


def run_worker(python: str, workdir: Path, nproc: int = 2, timeout: float = 180) -> tuple[Path, Path]:
    """Run rec_fr.py under torchrun with ``python``; returns (run directory with rings, output directory)."""
    job_id = f"fr-{uuid.uuid4().hex[:8]}"
    out = workdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTWATCH_", "TORCH_FR", "TORCH_NCCL"))}
    env.update(DTWATCH_DIR=str(workdir / "dtwatch"), DTWATCH_JOB_ID=job_id, DTWATCH_WATCHDOG="off",
               DTWATCH_STACK_SIGNAL="off", REC_OUT=str(out), OMP_NUM_THREADS="1", LOGLEVEL="WARNING")
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.1", str(SCRIPTS / WORKER)]
    subprocess.run(cmd, env=env, cwd=workdir, check=True, timeout=timeout, capture_output=True)
    return workdir / "dtwatch" / job_id, out


def capture(python: str, rank: int = 0) -> dict:
    from dtwatch.diagnose.rank_state import from_snapshot
    from dtwatch.ring import read_ring

    with tempfile.TemporaryDirectory(prefix="dtwatch-fr-") as tmp:
        run_dir, out = run_worker(python, Path(tmp))
        snap = read_ring(run_dir / f"rank-{rank:05d}.ring")
        state = from_snapshot(snap)
        fr = pickle.loads((out / f"rank-{rank}.fr.pkl").read_bytes())
        notes = json.loads((out / f"rank-{rank}.json").read_text())["notes"]
        site_packages = subprocess.run(
            [python, "-c", "import site, sys; print('\\n'.join(site.getsitepackages() + sys.path))"],
            check=True, capture_output=True, text=True).stdout.split()
        site_packages = sorted({p.rstrip(os.sep) for p in site_packages if p.endswith("-packages")},
                               key=len, reverse=True)
        return make_fixture(fr, python_calls(state), notes, snap.torch_version, snap.backend, site_packages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="fixture file to write")
    ap.add_argument("--python", default=sys.executable, help="interpreter whose torch runs the worker")
    args = ap.parse_args()
    data = capture(args.python)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"{args.out}: torch {data['torch']}, {len(data['entries'])} FR entries, {len(data['calls'])} calls")


if __name__ == "__main__":
    main()
