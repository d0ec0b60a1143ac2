"""``dtwatch run [options] -- COMMAND``: run an unmodified training command under dtwatch.

It starts the node watchdog, then runs COMMAND with a ``sitecustomize`` on ``PYTHONPATH`` that installs
dtwatch in every Python process that has a ``RANK`` (every torchrun worker), before the script's
first line. Another ``sitecustomize`` already on the path still runs after ours.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent / "bootstrap")
EXIT_STALL = 3  # the job was ended by dtwatch --fail-fast after a diagnosed stall


def run(command: list[str], *, dir: str, job_id: str, watch_args: list[str], ready_timeout: float = 30.0) -> int:
    job_id = job_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = os.path.join(dir, job_id)
    os.makedirs(run_dir, exist_ok=True)
    env = dict(os.environ)
    env.update({"DTWATCH_DIR": dir, "DTWATCH_JOB_ID": job_id, "DTWATCH_WATCHDOG": "off", "DTWATCH_BOOTSTRAP": "1"})
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])

    # A sidecar (Kubernetes) already runs the node's watchdog: DTWATCH_WATCHDOG=off means "not ours to start".
    own_watchdog = os.environ.get("DTWATCH_WATCHDOG", "auto").strip().lower() != "off"
    node = os.uname().nodename
    ready_file = os.path.join(run_dir, f"watchdog-{node}.json")
    try:
        os.unlink(ready_file)
    except FileNotFoundError:
        pass
    watch_env = {k: v for k, v in env.items() if k not in ("DTWATCH_BOOTSTRAP",)}
    watch_env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "dtwatch", "watch", "--dir", dir, "--job-id", job_id, "--node", node, *watch_args],
        env=watch_env, start_new_session=True,
    ) if own_watchdog else None
    deadline = time.monotonic() + ready_timeout
    while watchdog is not None and not os.path.exists(ready_file):
        if watchdog.poll() is not None:
            print(f"dtwatch: the watchdog exited (code {watchdog.returncode}) before it was ready", file=sys.stderr)
            return 2
        if time.monotonic() > deadline:
            print(f"dtwatch: the watchdog was not ready within {ready_timeout:.0f}s; running without it", file=sys.stderr)
            break
        time.sleep(0.05)
    print(f"dtwatch: job {job_id}: run directory {run_dir}", file=sys.stderr, flush=True)

    child = subprocess.Popen(command, env=env)
    forwarded = {}

    def forward(sig: int, _frame: object) -> None:
        try:
            child.send_signal(sig)
        except OSError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM):
        forwarded[sig] = signal.signal(sig, forward)
    try:
        code = child.wait()
    finally:
        for sig, old in forwarded.items():
            signal.signal(sig, old)
    wcode = _finish_watchdog(watchdog) if watchdog is not None else 0
    incidents = sorted(Path(run_dir, "incidents").glob("*/*/index.json"))
    for index in incidents:
        data = json.loads(index.read_text())
        for f in data.get("findings", []):
            if f.get("severity") == "stall":
                print(f"dtwatch: [{f['kind']}] {f['summary']}", file=sys.stderr)
        print(f"dtwatch: incident bundle {index.parent}  (dtwatch analyze {run_dir})", file=sys.stderr)
    if wcode == EXIT_STALL:
        return EXIT_STALL
    return code


def _finish_watchdog(watchdog: subprocess.Popen) -> int:
    """Give the watchdog time to finish an incident's evidence and notice the job is over."""
    try:
        return watchdog.wait(timeout=30)
    except subprocess.TimeoutExpired:
        watchdog.terminate()
        try:
            return watchdog.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            return watchdog.wait()
