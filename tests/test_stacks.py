"""Stacks of stalled ranks: faulthandler when py-spy is not used, and py-spy's permission failure as advice."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.harness import launch, site_line
from tests.tools import ON_CI

pytestmark = pytest.mark.torch_versions  # also run on the oldest torch the README claims (.ci/run)


@pytest.mark.timeout(150)
def test_faulthandler_fallback_dumps_the_blocked_main_thread(tmp_path):
    # py-spy off: the watchdog signals the rank and faulthandler writes every thread's stack from C, even
    # though the main thread is blocked inside a gloo all_reduce.
    job = launch(tmp_path, "rank_conditional", 2, window=4.0, watch_args=["--no-pyspy"])
    try:
        index = job.wait_incident(timeout=90)
        stack0 = open(os.path.join(index["_path"], "stacks", "rank-00000.txt")).read()
        assert "faulthandler ok" in stack0.splitlines()[0]
        assert "Current thread" in stack0 or "Thread 0x" in stack0
        assert f'line {site_line("validate_all_reduce")} in validate' in stack0
        assert f'line {site_line("conditional_call")} in main' in stack0
        assert "sampling_thread.py" in stack0  # every thread is dumped: the sampler thread too
    finally:
        job.stop()


def _unprivileged() -> list[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        message = "needs root and setpriv to run py-spy as an unprivileged user"
        if ON_CI:
            pytest.fail(message)
        pytest.skip(message)
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all"]


@pytest.mark.timeout(60)
def test_pyspy_permission_failure_becomes_advice(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
    try:
        time.sleep(0.5)
        code = (
            "import json, sys\n"
            "from dtwatch.watchdog.stacks import pyspy_dump\n"
            f"print(json.dumps(pyspy_dump(0, {target.pid}, timeout=20).to_dict()))\n"
        )
        env = dict(os.environ, HOME=str(tmp_path))
        out = subprocess.run(_unprivileged() + [sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=50, env=env, cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr
        import json

        result = json.loads(out.stdout)
        assert result["ok"] is False
        assert "SYS_PTRACE" in result["advice"] and "shareProcessNamespace" in result["advice"]
        assert "faulthandler" in result["advice"]
    finally:
        target.kill()
        target.wait()
