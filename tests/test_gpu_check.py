"""benchmarks/gpu_check (the one-GPU check of dtwatch): its summary logic, its reaping by marker, and a live
CPU-mode run of its short steps (gloo on the CPU; GPU-only checks must say SKIP, never PASS)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPU_CHECK = REPO / "benchmarks" / "gpu_check"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", GPU_CHECK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summary = load("summary")
common = load("common")


def check(name: str, result: str, advisory: bool = False) -> dict:
    return {"check": name, "result": result, "advisory": advisory, "evidence": ""}


def test_step_status_counts_advisory_checks_out():
    assert common.step_status([check("a", "PASS"), check("b", "FAIL", advisory=True)]) == "PASS"
    assert common.step_status([check("a", "PASS"), check("b", "FAIL")]) == "FAIL"
    assert common.step_status([check("a", "SKIP"), check("b", "PASS", advisory=True)]) == "SKIP"
    assert common.step_status([check("a", "SKIP"), check("b", "PASS")]) == "PASS"
    assert common.step_status([]) == "INFO"


def test_summary_of_finished_missing_and_timed_out_steps(tmp_path):
    done = {"step": "env", "status": "PASS", "title": "t", "checks": [check("imports", "PASS"), check("gpu", "SKIP")],
            "info": [{"name": "torch", "value": "2.13", "key": True}, {"name": "noise", "value": 1, "key": False}]}
    (tmp_path / "result-env.json").write_text(json.dumps(done))
    killed = {**done, "step": "pair", "status": "INCOMPLETE", "checks": [check("healthy", "PASS")], "info": []}
    (tmp_path / "result-pair.json").write_text(json.dumps(killed))
    (tmp_path / "timeout-pair").touch()
    (tmp_path / "skipped-nvml").touch()
    steps = [summary.load_step(tmp_path, n) for n in ("env", "pair", "nvml", "record")]
    assert [s["status"] for s in steps] == ["PASS", "TIMEOUT", "NOT RUN", "NO RESULT"]
    doc = summary.build(steps, 12.0, cpu_mode=True)
    assert doc["overall"] == "FAIL"
    assert doc["steps"] == {"env": "PASS", "pair": "TIMEOUT", "nvml": "NOT RUN", "record": "NO RESULT"}
    assert doc["counts"] == {"PASS": 2, "FAIL": 0, "SKIP": 1}
    assert doc["key_info"] == [{"step": "env", "name": "torch", "value": "2.13"}]
    text = "\n".join(summary.render(doc))
    assert "step pair: TIMEOUT" in text and "  PASS imports" in text and "  SKIP gpu" in text
    assert "INFO torch: 2.13" in text and "noise" not in text
    assert "overall: FAIL  (2 passed, 0 failed, 1 skipped; 12.0 s)" in text


def test_an_advisory_failure_leaves_the_run_passing():
    step = {"step": "record", "status": "PASS", "checks": [check("seq", "PASS"), check("funcol", "FAIL", True)],
            "info": []}
    doc = summary.build([step], 1.0, cpu_mode=False)
    assert doc["overall"] == "PASS" and doc["counts"]["FAIL"] == 0
    assert "  FAIL funcol  (advisory, not counted)" in summary.render(doc)


@pytest.mark.timeout(60)
def test_reap_ends_marked_processes_by_pid_and_spares_others():
    mark = f"test-{os.getpid()}-{time.time_ns()}"
    code = "import time; time.sleep(60)"
    marked = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "GPU_CHECK_MARK": mark},
                              start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "GPU_CHECK_MARK": mark + "-other"},
                             start_new_session=True)
    try:
        deadline = time.time() + 20
        while marked.pid not in common.marked_pids(mark) and time.time() < deadline:
            time.sleep(0.1)
        assert list(common.marked_pids(mark)) == [marked.pid]
        assert common.reap(mark, grace=5) == [marked.pid]
        assert marked.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None
    finally:
        for p in (marked, other):
            if p.poll() is None:
                p.kill()
            p.wait()


def leftovers(prefix: str) -> list[int]:
    needle = f"GPU_CHECK_MARK={prefix}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes():
                pids.append(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    return pids


@pytest.mark.timeout(150)  # three torch jobs beside the suite on two cores: 52-70 s, once past 80
def test_cpu_mode_run_of_the_short_steps(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTWATCH_")}
    env.update(GPU_CHECK_CPU="1", GPU_CHECK_STEPS="env record overhead", GPU_CHECK_PYTHON=sys.executable,
               GPU_CHECK_TOTAL="140", GPU_CHECK_OVERHEAD_CALLS="2000", OUT=str(out), GPU_CHECK_WORK=str(work))
    proc = subprocess.Popen(["bash", str(GPU_CHECK / "run.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    console, _ = proc.communicate(timeout=145)
    assert proc.returncode == 0, console
    log = (out / "gpu_check.log").read_text()
    assert "CPU mode" in log and "================ SUMMARY ================" in log
    assert log.count("[PASS]") >= 8, log
    doc = json.loads((out / "summary.json").read_text())
    assert doc["cpu_mode"] is True
    assert doc["steps"] == {"env": "PASS", "record": "PASS", "overhead": "PASS"}, log
    assert doc["overall"] == "PASS" and doc["counts"]["FAIL"] == 0, log
    results = {(c["step"], c["check"]): c for c in doc["checks"]}

    def result(step: str, start: str) -> str:
        found = [c["result"] for (s, name), c in results.items() if s == step and name.startswith(start)]
        assert len(found) == 1, (step, start, sorted(results))
        return found[0]

    # What CPU mode can check passes, with the evidence it names.
    assert result("env", "1-rank gloo group initialises") == "PASS"
    assert result("env", "dtwatch imports from this checkout") == "PASS"
    assert result("env", "dtwatch.install()") == "PASS"
    assert result("record", "ring: one record per call, each carrying torch's sequence number") == "PASS"
    assert result("record", "ring: the group's last sequence number is torch's counter") == "PASS"
    seq = results[("record", "ring: one record per call, each carrying torch's sequence number after it")]
    assert '"torch": 1, "ring": ["all_reduce", 1]' in seq["evidence"]
    assert result("overhead", "[gloo] every call recorded") == "PASS"
    # GPU-only checks say SKIP, never PASS.
    for step, start in [("env", "CUDA visible"), ("record", "all_reduce behind ~2 s of matmuls"),
                        ("record", "while the GPU works"), ("record", "after the GPU finished"),
                        ("record", "ring: NCCL group completion-tracked"), ("overhead", "nccl2 vs legacy")]:
        assert result(step, start) == "SKIP"
    # The functional collective is reported either way, and never decides the run.
    funcol = results[("record", "functional all_reduce: the ring holds a record with op all_reduce")]
    assert funcol["advisory"] is True and funcol["result"] in ("PASS", "FAIL")
    overhead = [i for i in doc["key_info"] if i["step"] == "overhead"]
    assert overhead and "torch" in overhead[0]["value"] and "with dtwatch" in overhead[0]["value"]
    # Every process a step started is gone (each step's mark is gpucheck-<run.sh's pid>-<step>).
    assert leftovers(f"gpucheck-{proc.pid}-") == []
