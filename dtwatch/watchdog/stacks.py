"""Stacks of a stalled rank: py-spy (Python + native, all threads), with faulthandler as the fallback.

py-spy reads another process's memory, which needs ptrace rights: the same user (or CAP_SYS_PTRACE) and
the same PID namespace. When it is refused, the result carries advice instead of failing the bundle,
and the faulthandler fallback still works: the recorder registered ``faulthandler`` on a signal
(``DTWATCH_STACK_SIGNAL``, SIGUSR2 by default), and faulthandler writes every thread's Python stack
from its C signal handler even while the main thread is blocked inside a C++ collective.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

PTRACE_ADVICE = (
    "py-spy could not read the process (ptrace refused). Run the watchdog as the training user or give it "
    "CAP_SYS_PTRACE; in Kubernetes set `shareProcessNamespace: true` on the pod and add the SYS_PTRACE "
    "capability to the watchdog container (the dtwatch Helm chart does both); on a host with Yama, "
    "`sysctl kernel.yama.ptrace_scope=0` or run as root. The faulthandler dump below is the fallback."
)


@dataclass
class StackDump:
    rank: int
    pid: int
    method: str  # "py-spy", "py-spy (python only)", "faulthandler", "none"
    ok: bool
    text: str = ""
    threads: list | None = None  # py-spy --json
    error: str = ""
    advice: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def top_frames(self, n: int = 5) -> list[str]:
        """Innermost frames of the main thread (py-spy JSON), for the report."""
        if not self.threads:
            return []
        main = next((t for t in self.threads if t.get("thread_name") == "MainThread"), self.threads[0])
        out = []
        for fr in main.get("frames", [])[:n]:
            out.append(f"{fr.get('name')} ({fr.get('filename')}:{fr.get('line')})")
        return out


def pyspy_path() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    candidate = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return candidate if os.access(candidate, os.X_OK) else None


def pyspy_dump(rank: int, pid: int, timeout: float = 10.0) -> StackDump:
    exe = pyspy_path()
    if exe is None:
        return StackDump(rank, pid, "none", False, error="py-spy is not installed", advice="pip install py-spy")
    last_error = ""
    # A stopped process (SIGSTOP, a debugger) cannot be suspended again: read it without suspending.
    attempts = ((True, False, "py-spy"), (False, False, "py-spy (python only)"),
                (False, True, "py-spy (python only, not suspended)"))
    for native, nonblocking, method in attempts:
        cmd = [exe, "dump", "--pid", str(pid), "--json"] + (["--native"] if native else []) + \
            (["--nonblocking"] if nonblocking else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            last_error = f"py-spy timed out after {timeout:.0f}s"
            continue
        except OSError as exc:
            last_error = str(exc)
            break
        if proc.returncode == 0:
            try:
                threads = json.loads(proc.stdout)
            except json.JSONDecodeError:
                threads = None
            text = _render(threads) if threads else proc.stdout
            return StackDump(rank, pid, method, True, text=text, threads=threads)
        last_error = (proc.stderr or proc.stdout).strip()[-2000:]
    advice = PTRACE_ADVICE if any(w in last_error.lower() for w in ("permission", "not permitted", "ptrace")) else ""
    return StackDump(rank, pid, "py-spy", False, error=last_error, advice=advice)


def _render(threads: list) -> str:
    lines = []
    for t in threads:
        lines.append(f"Thread {t.get('thread_id')} ({t.get('thread_name')}) {'active' if t.get('active') else 'idle'}"
                     f"{' holds GIL' if t.get('owns_gil') else ''}")
        for fr in t.get("frames", []):
            lines.append(f"    {fr.get('name')} ({fr.get('filename')}:{fr.get('line')})")
    return "\n".join(lines)


def faulthandler_dump(rank: int, pid: int, sig: int, stack_file: str, wait: float = 2.0) -> StackDump:
    """Signal the rank and collect what faulthandler appends to its stack file."""
    if not sig:
        return StackDump(rank, pid, "faulthandler", False, error="the rank has no faulthandler signal registered")
    try:
        start = os.path.getsize(stack_file)
    except OSError:
        start = 0
    try:
        os.kill(pid, sig)
    except OSError as exc:
        return StackDump(rank, pid, "faulthandler", False, error=f"could not signal pid {pid}: {exc}")
    # faulthandler writes from a signal handler; wait until the file grew and then stopped growing.
    deadline = time.monotonic() + wait
    size, stable_since = start, None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now_size = os.path.getsize(stack_file)
        except OSError:
            continue
        if now_size != size:
            size, stable_since = now_size, time.monotonic()
        elif stable_since is not None and time.monotonic() - stable_since > 0.15:
            break
    text = ""
    if size > start:
        with open(stack_file, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    if not text:
        return StackDump(rank, pid, "faulthandler", False,
                         error="no faulthandler output (process stopped or wedged before Python)")
    return StackDump(rank, pid, "faulthandler", True, text=text)
