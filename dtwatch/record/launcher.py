"""Starting the node's watchdog from inside a training process (local use; off in Kubernetes sidecars).

One watchdog runs per job per node. It holds an exclusive ``flock`` on ``<run dir>/watchdog-<node>.lock``
for its whole life, so "is one running?" is a non-blocking lock attempt, correct across restarts of the
ranks and free of stale pid files. The launch happens in a background thread: training never waits.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shlex
import subprocess
import sys
import threading

import dtwatch.paths as paths
from dtwatch.config import OPTIONS

log = logging.getLogger("dtwatch")


def lock_path(run_dir: str, node: str) -> str:
    return paths.watchdog_lock_file(run_dir, node)


def watchdog_running(run_dir: str, node: str) -> bool:
    """True if a watchdog holds this node's lock for the job."""
    path = lock_path(run_dir, node)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def start_watchdog(run_dir: str, node: str, extra_args: str = "") -> subprocess.Popen | None:
    """Start ``dtwatch watch`` for this run directory unless one runs; returns the process or None."""
    if watchdog_running(run_dir, node):
        return None
    os.makedirs(run_dir, exist_ok=True)
    root, job_id = os.path.split(os.path.abspath(run_dir))
    cmd = [
        sys.executable, "-m", "dtwatch", "watch", "--dir", root, "--job-id", job_id, "--node", node,
        *shlex.split(extra_args),
    ]
    env = dict(os.environ)
    env.pop(str(OPTIONS["watchdog_args"].env), None)
    log_file = open(paths.watchdog_log_file(run_dir, node), "ab")
    try:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, close_fds=True,
        )
    finally:
        log_file.close()


def start_watchdog_async(run_dir: str, node: str, extra_args: str = "") -> None:
    def launch() -> None:
        try:
            proc = start_watchdog(run_dir, node, extra_args)
            if proc is not None:
                log.info("dtwatch: started the node watchdog (pid %d) for %s", proc.pid, run_dir)
        except Exception as exc:  # noqa: BLE001
            log.warning("dtwatch: could not start the node watchdog: %r (run `dtwatch watch --dir %s`)", exc, run_dir)

    threading.Thread(target=launch, name="dtwatch-launch", daemon=True).start()
