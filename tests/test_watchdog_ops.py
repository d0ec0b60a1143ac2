"""The watchdog in operation: across nodes through the job's c10d store, webhooks and --fail-fast,
zero-edit `dtwatch run`, auto-start by the first rank, and torchrun restarts."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.prom_servers import WebhookReceiver, until
from tests.harness import SCRIPTS, WORKER, base_env, free_port, launch, site_line, start_watchdog, stop_processes


@pytest.mark.timeout(180)
def test_fail_fast_ends_the_job_and_webhook_names_the_rank(tmp_path):
    hook = WebhookReceiver()
    job = launch(tmp_path, "rank_conditional", 2, window=4.0, watch_args=["--fail-fast", "--webhook", hook.url])
    try:
        event = until("a stall webhook", lambda: next((p for p in hook.payloads if p.get("status") == "stall"), None), 90)
        assert event["findings"][0]["kind"] == "rank_conditional"
        assert event["findings"][0]["ranks"] == [0]
        assert event["job_id"] == job.job_id and event["bundle"]
        assert "rank 0 is in all_reduce" in event["summary"]
        codes = job.wait_exit(timeout=60)
        assert codes[0] not in (None, 0)  # torchrun reports the failed job
        assert job.watchdog.wait(timeout=30) == 3  # watchdog: "ended a hung job"
        index = job.wait_incident(timeout=5)
        assert index["evidence_complete"]
    finally:
        hook.stop()
        job.stop()


@pytest.mark.timeout(180)
def test_dtwatch_run_diagnoses_an_unmodified_script(tmp_path):
    script = SCRIPTS / "plain_hang.py"
    assert "dtwatch" not in script.read_text().replace('"""', "").split("\n", 1)[1]
    root = tmp_path / "runs"
    env = base_env(root, "unused")
    del env["DTWATCH_JOB_ID"]
    env.pop("DTWATCH_WATCHDOG")
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "dtwatch", "run", "--dir", str(root), "--job-id", "zeroedit", "--stall-window", "4",
         "--fail-fast", "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
        env=env, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "[rank_conditional] rank 0 is in barrier" in proc.stderr
    assert f"plain_hang.py:{site_line('plain_barrier', script)}" in proc.stderr
    assert sorted(p.name for p in (root / "zeroedit").glob("rank-*.ring")) == ["rank-00000.ring", "rank-00001.ring"]


@pytest.mark.timeout(120)
def test_first_rank_starts_the_node_watchdog_which_exits_with_the_job(tmp_path):
    job = launch(tmp_path, "healthy_quiet", 2, watchdog=False, extra_env={
        "DTWATCH_WATCHDOG": "auto", "QUIET_SECONDS": "1",
        "DTWATCH_WATCHDOG_ARGS": "--stall-window 4 --metrics-port off --idle-exit 2 --poll-interval 0.2 --store none",
    })
    try:
        assert job.wait_exit(timeout=90) == [0]
        ready = job.run_dir / f"watchdog-{socket.gethostname()}.json"
        assert ready.exists()
        pid = json.loads(ready.read_text())["pid"]
        log = (job.run_dir / f"watchdog-{socket.gethostname()}.log").read_text()
        assert log.count("dtwatch: watching") == 1  # one watchdog for the node, started by local rank 0
        deadline = time.time() + 30
        while time.time() < deadline and Path(f"/proc/{pid}").exists():
            status = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
            if status == "Z":
                break
            time.sleep(0.2)
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    finally:
        job.stop()


@pytest.mark.timeout(180)
def test_watchdog_survives_torchrun_restart_and_closes_the_incident(tmp_path):
    job_id = "restarts"
    root = tmp_path
    watchdog, log = start_watchdog(root, job_id, window=4.0, extra_args=["--idle-exit", "15"])
    port = free_port()
    env = base_env(root, job_id)
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "3",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(WORKER), "crash_once"],
        env=env, stdout=(root / "restarts.out").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        assert torchrun.wait(timeout=120) == 0, (root / "restarts.out").read_text()[-3000:]
        assert watchdog.wait(timeout=60) == 0, log.read_text()
        events = [json.loads(line) for line in (root / job_id / f"events-{socket.gethostname()}.jsonl").read_text().splitlines()]
        kinds = [e["event"] for e in events]
        assert "stall" in kinds and "resolved" in kinds and kinds.index("stall") < kinds.index("resolved")
        stall = next(e for e in events if e["event"] == "stall")
        f = stall["findings"][0]
        assert f["kind"] == "rank_exited" and f["ranks"] == [1]
        assert "simulated crash on the first attempt" in f["details"]["exit_reason"]
        assert f"hang_worker.py:{site_line('crash_once')}" in f["details"]["exit_reason"]
    finally:
        stop_processes([torchrun, watchdog])


@pytest.mark.timeout(200)
def test_two_nodes_compare_through_the_jobs_store(tmp_path):
    """Two torchrun 'nodes' on this machine, each with its own run directory and watchdog; the watchdogs
    see each other's ranks only through the job's c10d store."""
    job_id = "twonodes"
    port = free_port()
    nodes = {}
    try:
        for node_rank, name in enumerate(("node-a", "node-b")):
            root = tmp_path / name
            watchdog, log = start_watchdog(root, job_id, window=4.0, extra_args=[
                "--node", name, "--store", f"127.0.0.1:{port}", "--idle-exit", "3"])
            env = base_env(root, job_id)
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                 "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), str(WORKER),
                 "rank_conditional"],
                env=env, stdout=(root / "torchrun.out").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
            )
            nodes[name] = (root, watchdog, log, proc)
        indexes = {}
        deadline = time.time() + 120
        while len(indexes) < 2 and time.time() < deadline:
            for name, (root, *_rest) in nodes.items():
                for index_path in (root / job_id / "incidents").glob(f"*/{name}/index.json"):
                    data = json.loads(index_path.read_text())
                    if data.get("evidence_complete"):
                        indexes[name] = data
            time.sleep(0.3)
        assert len(indexes) == 2, {n: log.read_text()[-2000:] for n, (_r, _w, log, _p) in nodes.items()}
        a, b = indexes["node-a"], indexes["node-b"]
        assert a["incident_id"] == b["incident_id"]
        for data in (a, b):
            f = data["findings"][0]
            assert f["kind"] == "rank_conditional"
            assert f["ranks"] == [0] and f["waiting_ranks"] == [1]
            assert f["site"]["line"] == site_line("validate_all_reduce")
            assert f["waiting_site"]["line"] == site_line("barrier_after")
        assert a["local_ranks"] == [0] and b["local_ranks"] == [1]
        # The analyzer merges both nodes' bundles into one finding.
        out = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", "--json",
                              str(tmp_path / "node-a" / job_id), str(tmp_path / "node-b" / job_id)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        merged = json.loads(out.stdout)
        assert len(merged["findings"]) == 1 and merged["findings"][0]["ranks"] == [0]
        assert sorted(r["rank"] for r in merged["ranks"]) == [0, 1]
    finally:
        stop_processes([p for _root, watchdog, _log, proc in nodes.values() for p in (proc, watchdog)])
