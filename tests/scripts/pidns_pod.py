"""A pod's shared PID namespace, simulated: run as PID 1 of a fresh PID namespace.

    unshare --pid --fork --mount-proc --kill-child python pidns_pod.py SPEC.json

SPEC (JSON):
    workdir    directory for the results (world-writable subdirectory ``ready/`` is created)
    python     interpreter of the trainers
    trainer    path of pidns_trainer.py
    trainers   {name: {"setpriv": [args]}}: trainers to start, each optionally under
               ``setpriv ARGS`` (e.g. another UID), like containers with their own securityContext
    probes     [{"name", "trainer", "argv", "setpriv"}]: commands to run inside the namespace once the
               trainers are up; "{pid}" in argv is replaced by the trainer's PID in this namespace
    hold       when true, wait for ``workdir/release`` (at most 60 s) before ending the trainers, so a
               test can look at them from outside the namespace meanwhile

Writes ``workdir/pod.json``: {"trainers": {name: {"pid", "nspid", "cmdline"}}, "probes": {name:
{"returncode", "stdout", "stderr"}}}, then ``workdir/pod.done``. When this process exits, the kernel
kills everything left in the namespace.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def wait_for(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def proc_status_field(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(spec["workdir"])
    ready = workdir / "ready"
    ready.mkdir(exist_ok=True)
    ready.chmod(0o777)  # trainers may run as other users
    result: dict = {"self_pid": os.getpid(), "trainers": {}, "probes": {}}
    procs = []
    try:
        for name, trainer in spec["trainers"].items():
            prefix = ["setpriv", *trainer["setpriv"]] if trainer.get("setpriv") else []
            procs.append(subprocess.Popen([*prefix, spec["python"], spec["trainer"], str(ready / name), "60"]))
        for name in spec["trainers"]:
            if not wait_for(ready / name, 20):
                result["error"] = f"trainer {name} did not start within 20 s"
                return 1
            pid = int((ready / name).read_text())
            result["trainers"][name] = {
                "pid": pid,
                "nspid": proc_status_field(pid, "NSpid"),
                "cmdline": Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip(),
            }
        for probe in spec["probes"]:
            pid = result["trainers"][probe["trainer"]]["pid"]
            prefix = ["setpriv", *probe["setpriv"]] if probe.get("setpriv") else []
            argv = [*prefix, *(a.replace("{pid}", str(pid)) for a in probe["argv"])]
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
                result["probes"][probe["name"]] = {
                    "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
            except subprocess.TimeoutExpired:
                result["probes"][probe["name"]] = {"returncode": None, "stdout": "", "stderr": "timed out"}
        return 0
    finally:
        (workdir / "pod.json").write_text(json.dumps(result, indent=2))
        (workdir / "pod.done").touch()
        if spec.get("hold"):
            wait_for(workdir / "release", 60)
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
