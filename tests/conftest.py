"""Shared test fixtures: a private dtwatch environment, and a launcher for real torchrun jobs."""
from __future__ import annotations

import fcntl
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"

# Variables dtwatch reads or sets: cleared for every test that uses the fixtures below (and restored after).
DTWATCH_ENV = (
    "DTWATCH_DIR", "DTWATCH_JOB_ID", "DTWATCH_RING_RECORDS", "DTWATCH_SAMPLE_INTERVAL", "DTWATCH_WATCHDOG",
    "DTWATCH_TORCH_ENV", "DTWATCH_FR_BUFFER_SIZE", "DTWATCH_STACK_SIGNAL", "DTWATCH_AUTO_STEP",
    "DTWATCH_WATCHDOG_ARGS", "DTWATCH_ENABLED", "DTWATCH_COLLECTIVE_HOOKS",
)
TORCH_ENV = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
)


# .ci/run names the test a killed run was in: one file per xdist worker (``<file>.gw0``...), or the file itself
CURRENT_TEST_FILE = os.environ.get("DTWATCH_CI_CURRENT_TEST")
if CURRENT_TEST_FILE and os.environ.get("PYTEST_XDIST_WORKER"):
    CURRENT_TEST_FILE += "." + os.environ["PYTEST_XDIST_WORKER"]


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if CURRENT_TEST_FILE:
        with open(CURRENT_TEST_FILE, "w") as f:
            f.write(nodeid + "\n")


@pytest.fixture(autouse=True)
def one_timing_test_at_a_time(request):
    """A timing test (marked ``timing``) loads the machine on purpose and asserts on how fast dtwatch answers: two at
    once (``pytest -n`` over them, or two sessions on one machine) measure each other. .ci/run runs them in one
    serial session; here a second one at once fails at once, naming why, instead of failing later on a bound."""
    if request.node.get_closest_marker("timing") is None:
        yield
        return
    with open(Path(tempfile.gettempdir()) / f"dtwatch-timing-tests-{os.getuid()}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail("another timing test runs on this machine at the same time: run tests marked `timing` one "
                        "at a time (.ci/run runs them in a serial session of their own: -p no:xdist -m timing)")
        yield


@pytest.fixture
def dtwatch_env(tmp_path, monkeypatch):
    """A clean dtwatch environment in this process: ``DTWATCH_DIR`` under tmp_path, a unique job id, the
    watchdog off, no other ``DTWATCH_*`` / torch diagnostics variables. Yields the run directory. At the
    end dtwatch is uninstalled and any process group destroyed; the environment is restored."""
    for name in DTWATCH_ENV + TORCH_ENV:
        monkeypatch.setenv(name, "")  # records the original value (or its absence) for the restore
        monkeypatch.delenv(name)
    root = tmp_path / "dtwatch"
    job_id = f"test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("DTWATCH_DIR", str(root))
    monkeypatch.setenv("DTWATCH_JOB_ID", job_id)
    monkeypatch.setenv("DTWATCH_WATCHDOG", "off")
    monkeypatch.setenv("DTWATCH_STACK_SIGNAL", "off")  # leave the test runner's signals alone
    yield root / job_id
    import torch.distributed as dist

    import dtwatch

    dtwatch.uninstall()
    if dist.is_initialized():
        dist.destroy_process_group()


def init_world1():
    """A real one-rank gloo process group in this process (no torchrun)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.TCPStore("127.0.0.1", 0, 1, True))


class Job:
    """One torchrun launch: its process, run directory (rings) and output directory (worker results)."""

    def __init__(self, script: Path, proc: subprocess.Popen, run_dir: Path, out_dir: Path, log: Path) -> None:
        self.script, self.proc, self.run_dir, self.out_dir, self.log = script, proc, run_dir, out_dir, log

    def ring_path(self, rank: int) -> Path:
        return self.run_dir / f"rank-{rank:05d}.ring"

    def ring(self, rank: int):
        import dtwatch

        return dtwatch.read_ring(self.ring_path(rank))

    def result(self, rank: int) -> dict:
        return json.loads((self.out_dir / f"rank-{rank}.json").read_text())

    def flight_recorder(self, rank: int) -> dict:
        return pickle.loads((self.out_dir / f"rank-{rank}.fr.pkl").read_bytes())

    def output(self, tail: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.script.name} did not finish in {timeout} s; output:\n{self.output()}")

    def children(self) -> list[int]:
        """Worker pids: torchrun starts each in its own session, so they are found by parent pid."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == self.proc.pid:
                pids.append(int(stat.parent.name))
        return pids

    def stop(self) -> None:
        """End the launcher and every worker it started (only those: by pid, checked by command line)."""
        if self.proc.poll() is not None:
            return
        workers = self.children()
        self.proc.send_signal(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        for pid in workers:
            try:
                if self.script.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def torchrun(tmp_path):
    """``torchrun(script, nproc, env={...}, wait=True, timeout=120, args=[...]) -> Job``: a real gloo job on this host.

    Workers get ``DTWATCH_DIR``/``DTWATCH_JOB_ID`` (a fresh run directory), ``DTWATCH_WATCHDOG=off`` and
    ``REC_OUT`` (a directory for their results). With ``wait=True`` the job must exit 0. Every job is
    stopped (launcher and workers) when the test ends, whatever happened.
    """
    jobs: list[Job] = []

    def launch(script: str, nproc: int, *, env: dict | None = None, wait: bool = True, timeout: float = 120,
               args: list[str] | None = None) -> Job:
        path = SCRIPTS / script
        job_id = f"{path.stem}-{uuid.uuid4().hex[:8]}"
        root = tmp_path / "dtwatch"
        out = tmp_path / f"out-{job_id}"
        out.mkdir(parents=True)
        child_env = {k: v for k, v in os.environ.items() if k not in DTWATCH_ENV + TORCH_ENV}
        child_env.update(
            DTWATCH_DIR=str(root), DTWATCH_JOB_ID=job_id, DTWATCH_WATCHDOG="off", REC_OUT=str(out),
            OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="WARNING",
        )
        child_env.update(env or {})
        log = tmp_path / f"{job_id}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--monitor-interval=0.1", str(path), *(args or [])]
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env, cwd=tmp_path)
        job = Job(path, proc, root / job_id, out, log)
        jobs.append(job)
        if wait:
            rc = job.wait(timeout)
            assert rc == 0, f"{script} failed with exit code {rc}; output:\n{job.output()}"
        return job

    yield launch
    for job in jobs:
        job.stop()


def wait_for(condition, timeout: float, what: str, interval: float = 0.1):
    """Poll ``condition()`` until it returns something truthy (returned) or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - e.g. a ring file not created yet
            last_exc = exc
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (last error: {last_exc!r})")
