"""``dtwatch run [options] -- COMMAND``: run an unmodified training command under dtwatch.

It starts the node watchdog, then runs COMMAND with a ``sitecustomize`` on ``PYTHONPATH`` that installs
dtwatch in every Python process that has a ``RANK`` (every torchrun worker), before the script's
first line. Another ``sitecustomize`` already on the path still runs after ours.

The watchdog shares this terminal: it shows a diagnosis there once, as soon as it is made (its log
goes to ``<run dir>/watchdog-<node>.log``). It holds the read end of a pipe whose write end only this
process has, so it learns that the command ended, or that this process died (even by SIGKILL), and
exits once the node's ranks are gone. The exit status is the command's, except 3 when dtwatch ended a
hung job (``--fail-fast``); a crash dtwatch diagnosed keeps the command's status.
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

import dtwatch.paths as paths
from dtwatch.config import ENV_BOOTSTRAP, OPTIONS, environment_value
from dtwatch.paths import EXIT_FAILED_FAST

BOOTSTRAP_DIR = str(Path(__file__).resolve().parent.parent / "record" / "bootstrap")


def _env_name(option: str) -> str:
    return str(OPTIONS[option].env)


def run(command: list[str], *, root: str, job_id: str, watch_args: list[str]) -> int:
    """Run ``command`` under dtwatch with run directories under ``root``; returns the exit status."""
    job_id = job_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = paths.run_dir(root, job_id)
    os.makedirs(run_dir, exist_ok=True)
    # A sidecar (Kubernetes) already runs the node's watchdog: DTWATCH_WATCHDOG=off means "not ours to start".
    own_watchdog = environment_value(OPTIONS, "watchdog", "auto") != "off"
    env = dict(os.environ)
    env.update({_env_name("dir"): root, _env_name("job_id"): job_id, _env_name("watchdog"): "off", ENV_BOOTSTRAP: "1"})
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])

    node = os.uname().nodename
    ready_file = paths.watchdog_ready_file(run_dir, node)
    try:
        os.unlink(ready_file)
    except FileNotFoundError:
        pass
    watch_env = {k: v for k, v in env.items() if k != ENV_BOOTSTRAP}
    watch_env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    log_file = paths.watchdog_log_file(run_dir, node)
    # Its own session: a Ctrl-C meant for the job does not cut the diagnosis short. Its stdin is the
    # lifeline (see the module docstring); its stderr is this terminal, for the diagnosis.
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "dtwatch", "watch", "--dir", root, "--job-id", job_id, "--node", node,
         "--exit-with-launcher", "--log-file", log_file, *watch_args],
        env=watch_env, start_new_session=True, stdin=subprocess.PIPE,
    ) if own_watchdog else None
    # The command starts at once: the watchdog catches up while it starts (the rings are files, so nothing the
    # ranks record meanwhile is lost), instead of every job waiting for its imports.
    print(f"dtwatch: job {job_id}: run directory {run_dir}"
          + (f" (watchdog log: {log_file})" if watchdog is not None else ""), file=sys.stderr, flush=True)

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
    wcode = _finish_watchdog(watchdog, code, ready_file) if watchdog is not None else 0
    return _conclude(run_dir, node, command, code, wcode)


def _conclude(run_dir: str, node: str, command: list[str], code: int, wcode: int) -> int:
    """One closing line (verdict, exit status, bundle); the diagnosis itself only if the watchdog could
    not show it while the job ran."""
    from dtwatch.diagnose import Finding  # only now: `dtwatch run` starts the command without loading torch
    from dtwatch.render.notice import render_notice

    incidents = _incidents(run_dir, node)
    for event in incidents:
        if not event.get("shown_on"):
            findings = [Finding.from_dict(f) for f in event.get("findings", [])]
            if findings:
                sys.stderr.write(render_notice(event.get("verdict", "stall"), findings, bundle=event.get("bundle", "?"),
                                               run_dir=run_dir))
    name = os.path.basename(command[0]) if command else "the command"
    last = incidents[-1] if incidents else None
    where = f"; bundle {last.get('bundle')} (dtwatch analyze {run_dir})" if last else ""
    if wcode == EXIT_FAILED_FAST:
        print(f"dtwatch: the job hung and --fail-fast ended it: exit status {EXIT_FAILED_FAST} "
              f"({name} exited with {code}){where}", file=sys.stderr)
        return EXIT_FAILED_FAST
    if last is not None:
        kind = str(last.get("verdict", "stall")).upper()
        print(f"dtwatch: {kind} diagnosed; {name} exited with status {code}{where}", file=sys.stderr)
    return code


def _incidents(run_dir: str, node: str) -> list[dict]:
    """The incidents this node's watchdog opened, from its events file."""
    out: list[dict] = []
    try:
        lines = Path(paths.events_file(run_dir, node)).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "stall":
            out.append(event)
    return out


def _finish_watchdog(watchdog: subprocess.Popen, code: int, ready_file: str, timeout: float = 30.0) -> int:
    """Tell the watchdog the command ended and wait for it: it exits at once when no rank of the node is left and
    no incident is collecting evidence, or finishes the incident first. A command that ended cleanly before its
    watchdog was even ready (a job shorter than the watchdog's start) left it nothing to watch: it is stopped."""
    if watchdog.poll() is not None:
        if watchdog.returncode != 0 and not os.path.exists(ready_file):
            print(f"dtwatch: the watchdog exited (code {watchdog.returncode}) before it was ready; see its log",
                  file=sys.stderr)
        return watchdog.returncode
    if code == 0 and not os.path.exists(ready_file):
        watchdog.terminate()
        return _reap(watchdog, 10.0) and 0
    try:
        if watchdog.stdin is not None:
            watchdog.stdin.close()
    except OSError:
        pass
    return _reap(watchdog, timeout)


def _reap(watchdog: subprocess.Popen, timeout: float) -> int:
    try:
        return watchdog.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        watchdog.terminate()
        try:
            return watchdog.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            return watchdog.wait()
