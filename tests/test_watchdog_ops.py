"""The watchdog in operation: across nodes through the job's c10d store, webhooks and --fail-fast,
zero-edit `dtwatch run`, auto-start by the first rank, torchrun restarts, the diagnosis on the job's
console, and nothing of a job left behind."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import (
    SCRIPTS,
    WORKER,
    base_env,
    free_port,
    job_processes,
    launch,
    process_report,
    site_line,
    start_watchdog,
    stop_processes,
)
from tests.prom_servers import WebhookReceiver, until
from tests.test_watchdog import DEADLINE, WINDOW

AUTO_WATCHDOG = "--stall-window 4 --metrics-port off --idle-exit 2 --poll-interval 0.2 --store none"


def dtwatch_run(root: Path, job_id: str, command: list[str], *args: str) -> subprocess.Popen:
    """``dtwatch run`` in a session of its own (so a test can end everything it started), output captured."""
    env = base_env(root, "unused")
    del env["DTWATCH_JOB_ID"]
    env.pop("DTWATCH_WATCHDOG")
    return subprocess.Popen(
        [sys.executable, "-m", "dtwatch", "run", "--dir", str(root), "--job-id", job_id, *args, "--", *command],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def torchrun_cmd(script: Path, *script_args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), str(script), *script_args]


def ready_watchdog_pid(run_dir: Path, timeout: float = 30) -> int:
    ready = run_dir / f"watchdog-{socket.gethostname()}.json"
    until("the watchdog to be ready", lambda: ready.exists() and json.loads(ready.read_text()).get("pid"), timeout)
    return json.loads(ready.read_text())["pid"]


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(180)
def test_fail_fast_ends_the_job_and_webhook_names_the_rank(tmp_path):
    hook = WebhookReceiver()
    job = launch(tmp_path, "rank_conditional", 2, window=4.0, watch_args=["--fail-fast", "--webhook", hook.url])
    try:
        event = until("a stall webhook",
                      lambda: next((p for p in hook.payloads if p.get("status") == "stall"), None), 90)
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
    # The diagnosis, once, on the terminal of `dtwatch run`, while the job hangs (before fail-fast ends it).
    notice = [line for line in proc.stderr.splitlines() if line.startswith("dtwatch: STALL [")]
    assert len(notice) == 1, proc.stderr[-3000:]
    assert notice[0].startswith("dtwatch: STALL [rank_conditional] rank 0 in barrier")
    assert f"plain_hang.py:{site_line('plain_barrier', script)}" in notice[0]
    assert proc.stderr.index(notice[0]) < proc.stderr.index("dtwatch: --fail-fast: ending ranks 0-1")
    bundle = next((root / "zeroedit" / "incidents").glob("*/*/index.json")).parent
    assert f"dtwatch:   bundle: {bundle}" in proc.stderr
    last_line = proc.stderr.rstrip().splitlines()[-1]
    assert last_line.startswith("dtwatch: the job hung and --fail-fast ended it: exit status 3")
    assert "watching" not in proc.stderr  # the watchdog's log is in the run directory, not on the terminal
    assert "dtwatch: watching" in (root / "zeroedit" / f"watchdog-{socket.gethostname()}.log").read_text()
    assert sorted(p.name for p in (root / "zeroedit").glob("rank-*.ring")) == ["rank-00000.ring", "rank-00001.ring"]


@pytest.mark.timeout(180)
def test_dtwatch_run_keeps_the_exit_status_of_a_crash_and_calls_it_one(tmp_path):
    # With --fail-fast: the crash is diagnosed, and dtwatch did not end the job, torchrun's teardown did.
    root = tmp_path / "runs"
    proc = dtwatch_run(root, "crash", torchrun_cmd(WORKER, "exception"), "--stall-window", "4", "--fail-fast")
    try:
        out, err = proc.communicate(timeout=150)
    finally:
        stop_processes([proc])
    assert proc.returncode == 1, err[-3000:]  # torchrun's own status for a failed worker
    notice = [line for line in err.splitlines() if line.startswith("dtwatch: CRASH [")]
    assert len(notice) == 1, err[-3000:]
    assert notice[0].startswith("dtwatch: CRASH [rank_exited] rank 1 ended after all_reduce"), err[-3000:]
    assert "ValueError: loss is NaN on rank 1" in err.split(notice[0], 1)[1]
    assert "STALL" not in err
    assert err.rstrip().splitlines()[-1].startswith("dtwatch: CRASH diagnosed; python exited with status 1; bundle ")
    index = json.loads(next((root / "crash" / "incidents").glob("*/*/index.json")).read_text())
    assert index["verdict"] == "crash"
    analysis = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", str(root / "crash")],
                              capture_output=True, text=True, timeout=60)
    assert analysis.stdout.splitlines()[2] == "CRASH"


@pytest.mark.timeout(150)
def test_one_line_import_shows_the_diagnosis_on_torchruns_console(tmp_path):
    # Plain torchrun, `import dtwatch.auto` in the script: local rank 0 starts the watchdog, whose own
    # output goes to a log file; the diagnosis must still reach torchrun's console, once. With
    # --fail-fast the watchdog, a child of rank 0, ends the ranks but not itself.
    job = launch(tmp_path, "rank_conditional", 2, watchdog=False,
                 extra_env={"DTWATCH_WATCHDOG": "auto", "DTWATCH_WATCHDOG_ARGS": AUTO_WATCHDOG + " --fail-fast"})
    console = tmp_path / f"{job.job_id}.out"
    try:
        def shown() -> str | None:
            text = console.read_text(errors="replace")
            return text if "dtwatch:   bundle: " in text else None

        text = until("the diagnosis on torchrun's console", shown, 90)
        assert time.time() - job.onset() < DEADLINE
        index = job.wait_incident(timeout=30, complete=False)
        lines = [line for line in text.splitlines() if line.startswith("dtwatch: ")]
        assert lines[0].startswith("dtwatch: STALL [rank_conditional] rank 0 in all_reduce (group 0, seq ")
        root_site = f"tests/scripts/hang_worker.py:{site_line('validate_all_reduce')} "
        assert lines[0].split(" at ", 1)[1].startswith(root_site)
        assert lines[1].startswith("dtwatch:   rank 1 waits in barrier (group 0, seq ")
        assert f"hang_worker.py:{site_line('barrier_after')} " in lines[1]
        assert lines[2].startswith("dtwatch:   diagnosis: rank 0 ")
        assert lines[3] == f"dtwatch:   bundle: {index['_path']}  (report: dtwatch analyze {job.run_dir})"
        assert job.wait_exit(timeout=60)[0] not in (None, 0)  # ended by --fail-fast
        final = console.read_text(errors="replace")
        assert final.count("dtwatch: STALL [") == 1
        assert "dtwatch: --fail-fast: ending ranks 0-1\n" in final  # nothing else: not the watchdog itself
        log_path = job.run_dir / f"watchdog-{socket.gethostname()}.log"
        until("the watchdog's fail-fast report", lambda: "--fail-fast: ended ranks [0, 1]" in log_path.read_text(), 30)
        log = log_path.read_text()
        assert "showed the diagnosis on the console (stderr of pid" in log
        assert "and 0 descendant(s)" in log
    finally:
        job.stop()


@pytest.mark.timeout(180)
def test_fail_fast_leaves_no_process_of_the_job(tmp_path):
    # Rank 1 hangs waiting for its DataLoader; both ranks have worker processes, rank 1 also a helper in
    # a session of its own. After --fail-fast, nothing carrying the job's id may remain.
    job = launch(tmp_path, "stuck_in_loader", 2, window=WINDOW, watch_args=["--fail-fast", "--fail-fast-grace", "2"])
    try:
        index = job.wait_incident(timeout=90)
        f = next(f for f in index["findings"] if f["severity"] == "stall")
        assert f["ranks"] == [1]
        event = until("the fail-fast event",
                      lambda: next((e for e in job.events() if e["event"] == "fail_fast"), None), 60)
        assert sorted(event["ranks"]) == [0, 1]
        assert len(event["descendants"]) >= 5  # 2 DataLoader workers per rank, rank 1's helper
        assert event["survivors"] == []
        assert job.wait_exit(timeout=60)[0] not in (None, 0)
        assert job.watchdog.wait(timeout=30) == 3
        deadline = time.time() + 10
        while job_processes(job.job_id) and time.time() < deadline:
            time.sleep(0.2)
        assert job_processes(job.job_id) == {}
    finally:
        job.stop()


@pytest.mark.timeout(120)
def test_watchdog_of_a_killed_dtwatch_run_exits(tmp_path):
    # `dtwatch run` killed with SIGKILL before any rank appeared: its watchdog (its own session) exits.
    root = tmp_path / "runs"
    proc = dtwatch_run(root, "killed", [sys.executable, "-c", "import time; time.sleep(90)"])
    try:
        pid = ready_watchdog_pid(root / "killed")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        until("the watchdog to exit", lambda: gone(pid), 10)
        log = (root / "killed" / f"watchdog-{socket.gethostname()}.log").read_text()
        assert "the launcher has ended and no rank of killed is alive" in log
    finally:
        stop_processes([proc])  # the command it ran, in the same session


@pytest.mark.timeout(180)
def test_watchdog_of_a_killed_dtwatch_run_outlives_its_ranks_only(tmp_path):
    # Killed while the job runs: torchrun and the ranks go on, watched; once they are gone, so is the watchdog.
    root = tmp_path / "runs"
    proc = dtwatch_run(root, "orphan", torchrun_cmd(WORKER, "healthy_quiet"), "--stall-window", "30")
    try:
        pid = ready_watchdog_pid(root / "orphan")
        until("the ranks' rings", lambda: len(list((root / "orphan").glob("rank-*.ring"))) == 2, 60)
        os.kill(proc.pid, signal.SIGKILL)
        time.sleep(3)
        assert not gone(pid)  # its ranks still run
        until("the job to end",
              lambda: not [c for c in job_processes("orphan").values() if "hang_worker" in c] or None, 90)
        until("the watchdog to exit", lambda: gone(pid), 10)
    finally:
        stop_processes([proc])


@pytest.mark.timeout(60)
def test_watchdog_that_never_sees_a_rank_exits_after_rank_wait(tmp_path):
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "dtwatch", "watch", "--dir", str(tmp_path), "--job-id", "nobody",
                           "--metrics-port", "off", "--store", "none", "--rank-wait", "2", "--poll-interval", "0.2"],
                          env=base_env(tmp_path, "nobody"), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    assert 2 <= time.time() - started < 15
    assert "no rank of nobody appeared" in proc.stderr and "within 2 s (--rank-wait)" in proc.stderr


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
        try:
            code = torchrun.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun still runs after 120 s:\n{process_report(torchrun.pid)}\n"
                        f"{(root / 'restarts.out').read_text()[-3000:]}\nwatchdog:\n{log.read_text()[-3000:]}")
        assert code == 0, (root / "restarts.out").read_text()[-3000:]
        assert watchdog.wait(timeout=60) == 0, log.read_text()
        events_file = root / job_id / f"events-{socket.gethostname()}.jsonl"
        events = [json.loads(line) for line in events_file.read_text().splitlines()]
        kinds = [e["event"] for e in events]
        assert "stall" in kinds and "resolved" in kinds and kinds.index("stall") < kinds.index("resolved")
        stall = next(e for e in events if e["event"] == "stall")
        f = stall["findings"][0]
        assert f["kind"] == "rank_exited" and f["ranks"] == [1]
        assert "simulated crash on the first attempt" in f["details"]["exit_reason"]
        assert f"hang_worker.py:{site_line('crash_once')}" in f["details"]["exit_reason"]
    finally:
        stop_processes([torchrun, watchdog])


def _start_node(root, job_id: str, node_rank: int, master_port: int) -> subprocess.Popen:
    """One torchrun 'node' (1 rank) of a 2-node job running the rank_conditional hang."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port), str(WORKER),
         "rank_conditional"],
        env=base_env(root, job_id), stdout=(root / "torchrun.out").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _completed_indexes(nodes: dict, job_id: str, into: dict[str, dict]) -> dict[str, dict]:
    """Each node's bundle index once its evidence is complete (node name -> index); ``nodes``: name -> (root, ...)."""
    for name, (root, *_rest) in nodes.items():
        for index_path in (root / job_id / "incidents").glob(f"*/{name}/index.json"):
            data = json.loads(index_path.read_text())
            if data.get("evidence_complete"):
                into[name] = data
    return into


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
            nodes[name] = (root, watchdog, log, _start_node(root, job_id, node_rank, port))
        indexes: dict[str, dict] = {}
        deadline = time.time() + 120
        while len(_completed_indexes(nodes, job_id, indexes)) < 2 and time.time() < deadline:
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


@pytest.mark.timeout(200)
def test_two_nodes_of_a_job_too_large_to_ship_whole(tmp_path):
    """The same two 'nodes' with --full-view-ranks 1: the job counts as large, so nothing is shipped while it
    runs and, once it stands still, only the ranks that stand out (here both). Each watchdog diagnoses from
    its own rank and the shipped one, names the culprit, says that its view is a sample, and records that in
    the bundle's index."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    job_id = "sampled"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    master_port = free_port()
    nodes = {}
    heads: list[dict] = []
    try:
        for node_rank, name in enumerate(("node-a", "node-b")):
            root = tmp_path / name
            watchdog, log = start_watchdog(root, job_id, window=4.0, extra_args=[
                "--node", name, "--store", f"127.0.0.1:{store.port}", "--store-interval", "0.5",
                "--full-view-ranks", "1", "--idle-exit", "3"])
            nodes[name] = (root, watchdog, log, _start_node(root, job_id, node_rank, master_port))
        indexes: dict[str, dict] = {}
        view_key = f"dtwatch/{job_id}/x1/view"
        deadline = time.time() + 120
        while len(_completed_indexes(nodes, job_id, indexes)) < 2 and time.time() < deadline:
            if store.check([view_key]):
                heads.append(json.loads(store.get(view_key)))
            time.sleep(0.2)
        assert len(indexes) == 2, {n: log.read_text()[-2000:] for n, (_r, _w, log, _p) in nodes.items()}
        # Once the aggregator has both nodes' digests, the job is large: a list of wanted nodes (None would be
        # every node), and while it ran, nothing shipped.
        heads = [h for h in heads if h["ranks"] == 2]
        assert heads and all(h["want"] is not None for h in heads)
        assert any(h["body_ranks"] == [] and not h["suspect"] for h in heads)
        assert any(h["body_ranks"] == [0, 1] and not h["pending"] for h in heads)
        for name, data in indexes.items():
            f = data["findings"][0]
            assert (f["kind"], f["ranks"], f["waiting_ranks"]) == ("rank_conditional", [0], [1]), (name, f)
            assert f["site"]["line"] == site_line("validate_all_reduce")
            assert "rank 1 (of the ranks in this node's view; by every node's digest, 2 of the job's 2 ranks are " \
                   "inside a collective)" in f["summary"], (name, f["summary"])
            assert data["view_sample"] == {"ranks": 2, "blocked": 2}
        assert indexes["node-a"]["local_ranks"] == [0] and indexes["node-b"]["local_ranks"] == [1]
    finally:
        stop_processes([p for _root, watchdog, _log, proc in nodes.values() for p in (proc, watchdog)])


@pytest.mark.timeout(240)
def test_another_node_takes_over_the_aggregation_when_its_watchdog_is_killed(tmp_path):
    """Two torchrun 'nodes' whose watchdogs exchange through a store of their own (not the job's). The
    aggregator's watchdog is killed: the other takes the lease over within two exchange intervals; the killed
    one is restarted (as a sidecar would be) and follows; both still diagnose the hang, naming the remote rank."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from dtwatch.watchdog.election import Lease

    job_id, interval, window = "takeover", 1.0, 12.0
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    master_port = free_port()
    lease_key = f"dtwatch/{job_id}/x1/lease"
    args = {name: ["--node", name, "--store", f"127.0.0.1:{store.port}", "--store-interval", str(interval),
                   "--idle-exit", "3"] for name in ("node-a", "node-b")}
    nodes: dict[str, list] = {}
    procs: list[subprocess.Popen] = []
    try:
        for node_rank, name in enumerate(("node-a", "node-b")):
            root = tmp_path / name
            watchdog, log = start_watchdog(root, job_id, window=window, extra_args=args[name])
            proc = _start_node(root, job_id, node_rank, master_port)
            nodes[name] = [root, watchdog, log]
            procs += [proc, watchdog]

        def head() -> dict | None:
            key = f"dtwatch/{job_id}/x1/view"
            return json.loads(store.get(key)) if store.check([key]) else None

        until("both nodes' ranks, hung, in the aggregator's view",
              lambda: (h := head()) is not None and h["body_ranks"] == [0, 1] and h["blocked"] == 2, 90)
        holder = Lease.decode(store.get(lease_key))
        assert holder is not None and holder.holder in nodes
        other = next(n for n in nodes if n != holder.holder)
        root, killed, _log = nodes[holder.holder]
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=10)
        stopped = time.time()

        def new_holder() -> Lease | None:
            lease = Lease.decode(store.get(lease_key))
            return lease if lease is not None and lease.holder == other else None

        lease = until("the other node to take the lease over", new_holder, 30, interval=0.05)
        took = time.time() - stopped
        print(f"takeover after {took:.2f} s (exchange interval {interval} s)")
        assert took <= 2 * interval + 0.5, f"took {took:.2f}s"
        assert lease.term == holder.term + 1
        # The killed watchdog comes back (a sidecar restart): it follows the new aggregator.
        restarted, log = start_watchdog(root, job_id, window=window, extra_args=args[holder.holder])
        nodes[holder.holder][1:] = [restarted, log]
        procs.append(restarted)
        indexes: dict[str, dict] = {}

        def incidents() -> bool:
            return len(_completed_indexes(nodes, job_id, indexes)) == 2

        until("both nodes' diagnoses", incidents, 120)
        for data in indexes.values():
            f = data["findings"][0]
            assert f["kind"] == "rank_conditional"
            assert f["ranks"] == [0] and f["waiting_ranks"] == [1]
            assert f["site"]["line"] == site_line("validate_all_reduce")
        final = Lease.decode(store.get(lease_key))
        assert final is not None and final.holder == other  # the restarted one did not take it back
        assert "aggregates the cross-node exchange" in nodes[other][2].read_text()
    finally:
        stop_processes(procs)


def test_dtwatch_run_prints_a_diagnosis_the_watchdog_could_not_show(tmp_path, capsys):
    from dtwatch.diagnose import Finding
    from dtwatch.watchdog.runner import _conclude

    f = Finding(kind="rank_conditional", severity="stall", ranks=[0], summary="rank 0 is in barrier ...", op="barrier",
                group="0", seq=6,
                site={"file": "/job/train.py", "line": 11, "function": "main", "source": "dist.barrier()"},
                waiting_ranks=[1], waiting_op="all_reduce", waiting_group="0", waiting_seq=6)
    shown = {"event": "stall", "verdict": "stall", "incident_id": "a", "bundle": "/b/a", "shown_on": "watchdog stderr",
             "findings": [f.to_dict()]}
    lost = dict(shown, incident_id="b", bundle="/b/b", shown_on=None)
    (tmp_path / "events-n.jsonl").write_text(json.dumps(shown) + "\n" + json.dumps({"event": "warning"}) + "\n")
    assert _conclude(str(tmp_path), "n", ["torchrun"], 1, 0) == 1
    err = capsys.readouterr().err
    assert "STALL [" not in err  # already on the console: only the closing line
    assert err == f"dtwatch: STALL diagnosed; torchrun exited with status 1; bundle /b/a (dtwatch analyze {tmp_path})\n"
    (tmp_path / "events-n.jsonl").write_text(json.dumps(lost) + "\n")
    assert _conclude(str(tmp_path), "n", ["torchrun"], 1, 3) == 3
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("dtwatch: STALL [rank_conditional] rank 0 in barrier (group 0, seq 6); "
                      "root cause at /job/train.py:11 `dist.barrier()`")
    assert err[1] == "dtwatch:   rank 1 waits in all_reduce (group 0, seq 6)"
    assert err[-1].startswith("dtwatch: the job hung and --fail-fast ended it: exit status 3 (torchrun exited with 1)")
