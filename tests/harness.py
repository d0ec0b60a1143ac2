"""Running real hanging jobs under a real watchdog, for the watchdog tests and the detection benchmark."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "scripts"
WORKER = SCRIPTS / "hang_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def site_line(marker: str, script: Path = WORKER) -> int:
    """Line number of the ``# site:<marker>`` comment in ``script``."""
    for i, line in enumerate(script.read_text().splitlines(), 1):
        if re.search(rf"#\s*site:{re.escape(marker)}\b", line):
            return i
    raise KeyError(marker)


@dataclass
class Job:
    root: Path
    job_id: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    watchdog: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def run_dir(self) -> Path:
        return self.root / self.job_id

    def onset(self) -> float:
        times = [float(p.read_text()) for p in self.run_dir.glob("onset-rank*.txt")]
        return min(times) if times else float("nan")

    def bundles(self) -> list[Path]:
        return sorted(p.parent for p in self.run_dir.glob("incidents/*/*/index.json"))

    def wait_incident(self, timeout: float, complete: bool = True) -> dict:
        """The first incident's index, once written (and its evidence complete)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for b in self.bundles():
                try:
                    index = json.loads((b / "index.json").read_text())
                except (OSError, json.JSONDecodeError):
                    continue
                if not complete or index.get("evidence_complete"):
                    index["_path"] = str(b)
                    return index
            time.sleep(0.2)
        raise TimeoutError(f"no incident within {timeout}s; watchdog log:\n{self.watchdog_log()}")

    def events(self) -> list[dict]:
        out = []
        for p in self.run_dir.glob("events-*.jsonl"):
            out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return out

    def watchdog_log(self) -> str:
        return self.log.read_text()[-6000:] if self.log and self.log.exists() else ""

    def wait_exit(self, timeout: float) -> list[int | None]:
        deadline = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def stop(self) -> None:
        stop_processes(self.procs + ([self.watchdog] if self.watchdog else []))


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """Kill launched processes and, for torchrun, its ranks. torchrun starts every worker in a session of
    its own, so the ranks are found as torchrun's children (before it dies) and killed by PID, after
    checking that each still runs the job's script; otherwise they would stay behind, hung in a collective."""
    ranks = []
    for proc in procs:
        script = next((Path(a).name.encode() for a in proc.args if str(a).endswith(".py")), None)
        if script is not None and proc.poll() is None:
            ranks += [(pid, script) for pid in _children(proc.pid)]
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for pid, script in ranks:
        try:
            if script in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def job_processes(job_id: str) -> dict[int, str]:
    """Live processes (pid -> command line) whose environment carries ``DTWATCH_JOB_ID=job_id``: every
    process of a job launched here (launcher, ranks, their workers and helpers, the watchdog)."""
    needle = f"DTWATCH_JOB_ID={job_id}".encode() + b"\0"
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle not in environ.read_bytes():
                continue
            stat = (environ.parent / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(environ.parent.name)] = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
    return found


def _children(pid: int) -> list[int]:
    """PIDs of the live processes whose parent is ``pid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def process_report(root_pid: int) -> str:
    """What a launched process and its descendants are doing, for a test whose job outlived its deadline:
    each one's command line and, where py-spy is installed, its Python stacks."""
    py_spy = next((str(c) for c in (Path(sys.executable).parent / "py-spy",) if c.exists()), None)
    lines, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        todo += _children(pid)
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        lines.append(f"--- pid {pid}: {cmd[:300]}")
        if py_spy and "python" in cmd:
            out = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            lines.append((out.stdout or out.stderr)[-3000:])
    return "\n".join(lines)


def base_env(root: Path, job_id: str, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("DTWATCH_", "TORCH_NCCL", "TORCH_FR", "OTEL_")):
            del env[k]
    env.update({
        "DTWATCH_DIR": str(root), "DTWATCH_JOB_ID": job_id, "DTWATCH_WATCHDOG": "off",
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


def start_watchdog(root: Path, job_id: str, *, window: float = 4.0, extra_args: list[str] | None = None,
                   env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    log = root / f"watchdog-{job_id}.log"
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dtwatch", "watch", "--dir", str(root), "--job-id", job_id,
           "--stall-window", str(window), "--metrics-port", "off", "--idle-exit", "3", "--poll-interval", "0.2",
           "--store", "none", "--rank-wait", "300", *(extra_args or [])]  # an orphan exits by itself
    proc = subprocess.Popen(cmd, env=env or base_env(root, job_id), stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    node = extra_args[extra_args.index("--node") + 1] if extra_args and "--node" in extra_args else socket.gethostname()
    ready = root / job_id / f"watchdog-{node}.json"
    deadline = time.time() + 30
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise RuntimeError(f"watchdog did not start: {log.read_text()}")
        time.sleep(0.05)
    return proc, log


def launch(root: Path, scenario: str, nproc: int, *, torchrun: bool = True, window: float = 4.0,
           watchdog: bool = True, watch_args: list[str] | None = None, extra_env: dict | None = None,
           script: Path = WORKER) -> Job:
    """Start a watchdog and an ``nproc``-rank job. ``torchrun=False`` launches the ranks as plain processes
    (like srun or a custom launcher: nobody tears the others down when one dies)."""
    job_id = f"{scenario}-{uuid.uuid4().hex[:6]}"
    job = Job(root, job_id)
    env = base_env(root, job_id, extra_env)
    if watchdog:
        job.watchdog, job.log = start_watchdog(root, job_id, window=window, extra_args=watch_args)
    out = root / f"{job_id}.out"
    port = free_port()
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(port), str(script), scenario]
        job.procs.append(subprocess.Popen(cmd, env=env, stdout=out.open("wb"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
    else:
        for rank in range(nproc):
            renv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            job.procs.append(subprocess.Popen([sys.executable, str(script), scenario], env=renv,
                                              stdout=(root / f"{job_id}.rank{rank}.out").open("wb"),
                                              stderr=subprocess.STDOUT, start_new_session=True))
    return job


def assert_rank_conditional_finding(f: dict) -> None:
    """The finding for hang_worker's ``rank_conditional`` scenario: rank 0 validates (all_reduce) inside
    ``if rank == 0`` while rank 1 waits in the barrier after it."""
    assert f["kind"] == "rank_conditional"
    assert f["severity"] == "stall"
    assert f["ranks"] == [0]
    assert f["op"] == "all_reduce"
    assert f["group"] == "0"
    assert f["site"]["file"] == str(WORKER)
    assert f["site"]["line"] == site_line("validate_all_reduce")
    assert f["site"]["function"] == "validate"
    assert "dist.all_reduce(loss)" in f["site"]["source"]
    assert f["waiting_ranks"] == [1]
    assert f["waiting_op"] == "barrier"
    assert f["waiting_site"]["line"] == site_line("barrier_after")
