"""What the GPU check's steps share: results, bounded subprocesses, `dtwatch run`, reaping by marker.

Every process a step starts inherits ``GPU_CHECK_MARK=<mark>`` (torchrun's ranks, the watchdog `dtwatch run`
starts in a session of its own, NCCL's helpers): :func:`reap` ends exactly those, by PID, never by name.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
REPO = HERE.parent.parent
WORK = Path(os.environ.get("GPU_CHECK_WORK") or "/tmp/gpu_check_work")
CPU = os.environ.get("GPU_CHECK_CPU") == "1"  # gloo on the CPU instead of NCCL on the GPU
MARK = os.environ.get("GPU_CHECK_MARK", "")
PY = sys.executable
DTWATCH = [PY, "-m", "dtwatch"]
TORCHRUN = [PY, "-m", "torch.distributed.run"]
RESULTS = ("PASS", "FAIL", "SKIP")


def say(text: str = "") -> None:
    print(text, flush=True)


def short(value: object, limit: int = 600) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("\n", " | ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Step:
    """One step's results, kept in ``WORK/result-<name>.json`` (rewritten after each line, so a step
    killed by its timeout still leaves what it found).

    A check is PASS, FAIL or SKIP (a GPU-only check in CPU mode); an ``advisory`` check is reported but
    does not decide the step's status. An info is a fact or a figure; ``key=True`` puts it in the summary.
    """

    def __init__(self, name: str, title: str) -> None:
        self.name, self.title = name, title
        self.checks: list[dict] = []
        self.infos: list[dict] = []
        self.t0 = time.time()
        self.dir = WORK / name
        self.dir.mkdir(parents=True, exist_ok=True)
        say(f"--- {name}: {title}{'  [CPU mode]' if CPU else ''}")
        self.write()

    def check(self, name: str, ok: bool, evidence: object = "", advisory: bool = False) -> bool:
        self._add(name, "PASS" if ok else "FAIL", evidence, advisory)
        return ok

    def skip(self, name: str, why: str = "GPU only") -> None:
        self._add(name, "SKIP", why, False)

    def info(self, name: str, value: object, key: bool = False) -> None:
        self.infos.append({"name": name, "value": value, "key": key})
        say(f"[INFO] {self.name} {name}: {short(value, 2000)}")
        self.write()

    def _add(self, name: str, result: str, evidence: object, advisory: bool) -> None:
        self.checks.append({"check": name, "result": result, "advisory": advisory, "evidence": short(evidence)})
        say(f"[{result}] {self.name} {name}{' (advisory)' if advisory else ''}: {short(evidence)}")
        self.write()

    @property
    def status(self) -> str:
        return step_status(self.checks)

    def write(self, done: bool = False) -> None:
        doc = {"step": self.name, "title": self.title, "status": self.status if done else "INCOMPLETE",
               "checks": self.checks, "info": self.infos, "seconds": round(time.time() - self.t0, 1),
               "cpu_mode": CPU}
        tmp = WORK / f"result-{self.name}.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(WORK / f"result-{self.name}.json")

    def done(self) -> None:
        self.write(done=True)
        say(f"--- {self.name} {self.status} ({time.time() - self.t0:.1f} s)")


def step_status(checks: list[dict]) -> str:
    """FAIL if a counted check failed; PASS if one passed; SKIP if all were skipped; INFO without checks."""
    counted = [c["result"] for c in checks if not c.get("advisory")]
    if "FAIL" in counted:
        return "FAIL"
    if "PASS" in counted:
        return "PASS"
    return "SKIP" if counted else "INFO"


# -- processes ---------------------------------------------------------------------------------------
class Proc:
    """A command in a session of its own, its output in ``<step dir>/<name>.out``."""

    def __init__(self, name: str, cmd: list[str], step: Step, env: dict | None = None) -> None:
        self.name, self.cmd = name, cmd
        self.out_path = step.dir / f"{name}.out"
        say(f"  $ {' '.join(cmd)}")
        self.t0 = time.time()
        self.timed_out = False
        self.rc: int | None = None
        with open(self.out_path, "wb") as out:
            self.p = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self, timeout: float) -> int | None:
        try:
            self.rc = self.p.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            say(f"  ! {self.name}: still running after {timeout:.0f} s; ending it")
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.p.pid, sig)
                    self.rc = self.p.wait(timeout=5)
                    break
                except (OSError, subprocess.TimeoutExpired):
                    continue
        return self.rc

    def output(self) -> str:
        try:
            return self.out_path.read_text(errors="replace")
        except OSError:
            return ""

    def show(self, max_lines: int = 120) -> str:
        text = self.output()
        lines = text.splitlines()
        if len(lines) > max_lines:
            lines = lines[:30] + [f"[... {len(lines) - max_lines} lines ...]"] + lines[-(max_lines - 30):]
        say(f"  --- {self.name}: exit {self.rc}{', TIMED OUT' if self.timed_out else ''}, "
            f"{time.time() - self.t0:.1f} s ---")
        for line in lines:
            say(f"  | {line}")
        return text


def run(name: str, cmd: list[str], step: Step, timeout: float, env: dict | None = None,
        max_lines: int = 120) -> tuple[int | None, str]:
    proc = Proc(name, cmd, step, env)
    proc.wait(timeout)
    return proc.rc, proc.show(max_lines)


def dtwatch_run(job: str, worker: list[str], nproc: int, step: Step, *, timeout: float, watch: list[str] | None = None,
                env: dict | None = None, background: bool = False):
    """``dtwatch run --dir D --job-id J [watch] -- torchrun --standalone --nproc-per-node N worker...``
    (``--no-pyspy`` added with GPU_CHECK_NO_PYSPY=1: stacks from faulthandler, as where py-spy is missing).

    Returns (exit status, console text, run directory), or the :class:`Proc` with ``background``."""
    root = step.dir / "dtw"
    watch = [*(watch or []), *(["--no-pyspy"] if os.environ.get("GPU_CHECK_NO_PYSPY") == "1" else [])]
    cmd = [*DTWATCH, "run", "--dir", str(root), "--job-id", job, *watch, "--",
           *TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), *worker]
    full_env = {"OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING", **(env or {})}
    if background:
        return Proc(job, cmd, step, full_env)
    rc, text = run(job, cmd, step, timeout, full_env)
    return rc, text, root / job


def marked_pids(mark: str) -> dict[int, str]:
    """Live processes whose environment holds ``GPU_CHECK_MARK=<mark>`` (pid -> command line), this process
    and its ancestors left out."""
    needle = f"GPU_CHECK_MARK={mark}".encode() + b"\0"
    spare, pid = set(), os.getpid()
    while pid > 1 and pid not in spare:
        spare.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            pid = int(environ.parent.name)
            if pid in spare or needle not in environ.read_bytes():
                continue
            if (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[pid] = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    return found


def reap(mark: str, grace: float = 3.0) -> list[int]:
    """End every process carrying ``mark``: SIGTERM, then SIGKILL to those left after ``grace`` seconds."""
    if not mark:
        return []
    pids = marked_pids(mark)
    for pid, cmd in sorted(pids.items()):
        say(f"  reaping pid {pid}: {cmd[:160]}")
        _signal(pid, signal.SIGTERM)
    deadline = time.time() + grace
    while pids and time.time() < deadline and marked_pids(mark):
        time.sleep(0.2)
    for pid in marked_pids(mark) if pids else ():
        _signal(pid, signal.SIGCONT)
        _signal(pid, signal.SIGKILL)
    return sorted(pids)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


# -- what dtwatch wrote --------------------------------------------------------------------------------
def analyze_json(run_dir: Path, step: Step, timeout: float = 40) -> dict | None:
    """``dtwatch analyze --json RUN_DIR``, parsed (None if it printed no JSON)."""
    proc = Proc(f"analyze-{run_dir.name}", [*DTWATCH, "analyze", "--json", str(run_dir)], step)
    proc.wait(timeout)
    text = proc.output()
    try:
        return json.loads(text[text.index("{"):])
    except ValueError:
        proc.show(40)
        return None


def stall_finding(run_dir: Path) -> dict:
    """The watchdog's diagnosis: the stall finding of the first incident bundle ({} if none)."""
    for index in sorted(run_dir.glob("incidents/*/*/index.json")):
        try:
            findings = json.loads(index.read_text()).get("findings") or []
        except (OSError, ValueError):
            continue
        stalls = [f for f in findings if f.get("severity") == "stall"]
        if stalls or findings:
            return (stalls or findings)[0]
    return {}


def console_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("dtwatch")]


def tracebacks(text: str) -> list[str]:
    """The exception line of each traceback in ``text``."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            j = i + 1
            while j < len(lines) and re.match(r"(\[rank\d+\]:)?\s", lines[j]):
                j += 1
            out.append(lines[j].strip() if j < len(lines) else line)
    return out


def site_line(marker: str, script: Path) -> int:
    """Line number of the ``# site:<marker>`` comment in ``script``."""
    for i, line in enumerate(script.read_text().splitlines(), 1):
        if re.search(rf"#\s*site:{re.escape(marker)}\b", line):
            return i
    raise KeyError(marker)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str, timeout: float = 3.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode(errors="replace")
    except OSError:
        return None


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
