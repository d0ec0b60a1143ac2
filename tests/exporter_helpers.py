"""NodeViews built from REAL rings, for the exporter tests and the watchdog's integration tests.

* :func:`run_exp_job` runs ``tests/scripts/exp_worker.py``: a real 2-rank gloo job under
  ``python -m torch.distributed.run`` with dtwatch installed, and returns what each rank did.
* :func:`node_view` reads a run directory's rings (``dtwatch.ring.read_ring`` +
  ``dtwatch.diagnose.rank_state.from_snapshot``) and assembles the :class:`~dtwatch.export.view.NodeView` a watchdog
  would hand its exporters on its first poll (``new_records`` = every completed record).
* :func:`write_synthetic_ring` writes a ring in the real format with many collectives (RingWriter +
  the recorder's record structs), for load tests that a 2-core machine cannot produce for real.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import dtwatch
from dtwatch.diagnose import entry_lags
from dtwatch.diagnose.rank_state import RankState, from_snapshot
from dtwatch.export.view import NodeView, WatchdogHealth
from dtwatch.process_liveness import process_state
from dtwatch.ring import FLAG_MARKER, RankSnapshot, RingWriter, find_rings, read_ring, ring_filename

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "scripts" / "exp_worker.py"
NO_GROUP = 0xFFFF


@dataclass
class ExpJob:
    """A finished run of exp_worker.py: where its rings are and what each rank reported."""

    run_dir: Path
    job_id: str
    steps: int
    per_step: int
    results: dict[int, dict[str, Any]]  # rank -> {"seq": {group: seq}, "counts": {op: n}, "steps": n}


def run_exp_job(root: Path, *, job_id: str = "expjob", steps: int = 3, per_step: int = 4,
                timeout: float = 180) -> ExpJob:
    """Run the 2-rank gloo worker with ``DTWATCH_DIR=root`` and return its results."""
    out = root / "out"
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ, "DTWATCH_DIR": str(root), "DTWATCH_JOB_ID": job_id, "DTWATCH_WATCHDOG": "off",
        "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(WORKER), "--steps", str(steps), "--per-step", str(per_step), "--out", str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"exp_worker failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    results = {}
    for rank in (0, 1):
        results[rank] = json.loads((out / f"rank-{rank}.json").read_text())
    return ExpJob(root / job_id, job_id, steps, per_step, results)


_SHARED: dict[str, ExpJob] = {}


def shared_exp_job(tmp_path_factory: Any) -> ExpJob:
    """One run of the worker per test session, whichever test module asks first."""
    if "job" not in _SHARED:
        _SHARED["job"] = run_exp_job(tmp_path_factory.mktemp("expjob"))
    return _SHARED["job"]


def read_states(run_dir: Path) -> tuple[dict[int, RankSnapshot], list[RankState]]:
    snaps = {s.rank: s for s in (read_ring(p) for p in find_rings(run_dir))}
    return snaps, [from_snapshot(s, process=process_state(s.pid)) for s in sorted(snaps.values(), key=lambda s: s.rank)]


def seq_lags(states: list[RankState]) -> dict[tuple[int, str], int]:
    """(rank, group) -> how far the rank is behind the group's most advanced member."""
    best: dict[str, int] = defaultdict(int)
    for s in states:
        for name, g in s.groups.items():
            best[name] = max(best[name], g.seq)
    return {(s.rank, name): best[name] - g.seq for s in states for name, g in s.groups.items()}


def node_view(run_dir: Path, **overrides: Any) -> NodeView:
    """The NodeView of a watchdog's first poll of ``run_dir``; ``overrides`` replace fields."""
    snaps, states = read_states(run_dir)
    if not states:
        raise FileNotFoundError(f"no rings in {run_dir}")
    first = snaps[states[0].rank]
    # The job has ended by now: straggler lags as they were while it ran.
    running = [replace(st, alive=True, exit_state="running") for st in states]
    view = NodeView(
        job_id=first.job_id, node=first.host, now=time.time(), window=30.0, local=states,
        all_states=list(states), snapshots=snaps,
        new_records={r: s.records[s.records["t_exit"] != 0.0] for r, s in snaps.items()},
        seq_lag=seq_lags(states), straggler_lag=entry_lags(running).medians, stalled_ranks=set(),
        culprit_ranks=set(), incident_open=False, incidents_total=0, findings_total={},
        restarts={s.rank: s.restart_count for s in states}, findings=[],
        health=WatchdogHealth(poll_seconds=[0.002, 0.004], errors={}, started=time.time() - 5,
                              version=dtwatch.__version__),
    )
    return replace(view, **overrides) if overrides else view


def write_synthetic_ring(
    path: Path, *, rank: int = 0, local_rank: int | None = None, world_size: int = 1, job_id: str = "synthetic",
    host: str = "synthetic-node", n: int = 50_000, steps: int = 1, duration: float = 0.0005,
    op: str = "all_reduce", numel: int = 1024, start: float | None = None, slow_every: int = 0,
    slow_duration: float = 2.0, in_flight: int = 0,
) -> RankSnapshot:
    """Write ``n`` completed collectives (spread over ``steps`` steps, with step markers) into a ring.

    Records use the recorder's own structs, so the ring is byte-for-byte what a rank writes. Every
    ``slow_every``-th collective (if > 0) lasts ``slow_duration`` seconds; the last ``in_flight`` of the
    ``n`` collectives are left in flight (entered, never left). Returns the ring read back.
    """
    capacity = 1 << max(10, int(n + steps + 16).bit_length())
    writer = RingWriter(
        path, rank=rank, local_rank=rank if local_rank is None else local_rank, world_size=world_size,
        job_id=job_id, host=host, backend="gloo", capacity=capacity,
    )
    try:
        slot = writer.add_group("0", "default_pg", list(range(world_size)), rank)
        site = writer.add_site("/synthetic/train.py", 42, "train_step")
        t = time.time() - (n * (duration + 1e-5) + 1.0) if start is None else start
        per_step = max(1, n // steps)
        stamp = 0
        step = 0
        for i in range(n):
            stamp += 1
            d = slow_duration if slow_every and (i + 1) % slow_every == 0 else duration
            writer.write_record(
                stamp, op=op, seq=i + 1, t_enter=t, t_exit=t + d if i < n - in_flight else 0.0,
                dtype="float32", shape=(numel,), group_slot=slot, site=site, step=step,
            )
            t += d + 1e-5
            if (i + 1) % per_step == 0 and step < steps:
                step += 1
                stamp += 1
                writer.write_record(stamp, op="step", seq=step, t_enter=t, t_exit=t, seq_span=0, flags=FLAG_MARKER,
                                    ntensors=0, numel=0, group_slot=NO_GROUP, step=step)
                writer.set_step(step, t)
        writer.heartbeat(time.time(), 1)
    finally:
        writer.close()
    return read_ring(path)


def synthetic_view(directory: Path, **ring_args: Any) -> NodeView:
    """A NodeView of one synthetic ring written into ``directory`` (see :func:`write_synthetic_ring`)."""
    rank = ring_args.get("rank", 0)
    write_synthetic_ring(directory / ring_filename(rank), **ring_args)
    return node_view(directory)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (and now is closed: nothing listens)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
