"""A real Prometheus server scrapes a real watchdog watching a real 2-rank job.

The job (tests/scripts/exp_worker.py) does its collectives and then stays alive outside any
collective; ``dtwatch watch`` serves /metrics on a free port; ``prometheus`` scrapes it every second.
The series Prometheus stores must equal what the ranks did and what their rings say.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import uuid
from pathlib import Path

from tests.exporter_helpers import WORKER, read_states
from tests.harness import base_env, free_port, start_watchdog
from tests.prom_servers import get_json as _get_json
from tests.prom_servers import stop as _stop
from tests.prom_servers import until as _until
from tests.tools import require_tool


def test_prometheus_scrapes_the_watchdog_and_stores_what_the_rings_say(tmp_path: Path) -> None:
    prometheus = require_tool("prometheus", "prometheus.sh")
    root, job_id = tmp_path / "dtwatch", f"e2e-{uuid.uuid4().hex[:6]}"
    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    metrics_port, prom_port = free_port(), free_port()
    job = watchdog = server = None
    try:
        watchdog, log = start_watchdog(
            root, job_id, window=30, extra_args=["--metrics-addr", "127.0.0.1", "--metrics-port", str(metrics_port)]
        )
        env = base_env(root, job_id)
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port()), str(WORKER), "--out", str(out), "--hold-until", str(release)],
            env=env, stdout=(tmp_path / "job.out").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        _until("the ranks' results", lambda: all((out / f"rank-{r}.json").exists() for r in (0, 1)), timeout=120)
        results = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)}

        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: dtwatch\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{metrics_port}']\n"
        )
        server = subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=(tmp_path / "prometheus.log").open("wb"), stderr=subprocess.STDOUT,
        )
        api = f"http://127.0.0.1:{prom_port}/api/v1"

        def target_up() -> bool:
            targets = _get_json(f"{api}/targets")["data"]["activeTargets"]
            return any(t["health"] == "up" for t in targets)

        _until("the watchdog target's health", target_up)

        def query(expr: str) -> dict[tuple, float]:
            data = _get_json(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"]
            return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in data}

        def series(expr: str, **labels: str) -> float | None:
            found = [v for k, v in query(expr).items() if set(labels.items()) <= set(k)]
            return found[0] if len(found) == 1 else None

        # the watchdog may have been scraped before it saw the last records: wait for the final values
        _until("the final all_reduce count", lambda: all(
            series("dtwatch_collectives_total", rank=str(r), op="all_reduce") == results[r]["counts"]["all_reduce"]
            for r in (0, 1)
        ), timeout=30)
        _, states = read_states(root / job_id)
        for state in states:
            r = str(state.rank)
            expected = results[state.rank]
            for group, progress in state.groups.items():
                assert series("dtwatch_collective_seq", rank=r, group=group) == progress.seq == expected["seq"][group]
                assert series("dtwatch_collective_seq_lag", rank=r, group=group) == 0
            assert series("dtwatch_steps_total", rank=r) == state.step == expected["steps"]
            assert series("dtwatch_rank_up", rank=r, local_rank=str(state.local_rank)) == 1
            assert series("dtwatch_rank_in_collective", rank=r) == 0
            assert (series("dtwatch_collective_duration_seconds_count", rank=r, op="broadcast")
                    == expected["counts"]["broadcast"])
        assert series("dtwatch_watchdog_ranks", job_id=job_id) == 2
        assert series("dtwatch_incident_open", job_id=job_id) == 0
        assert series("up", job="dtwatch") == 1
    finally:
        release.touch()
        if job is not None:
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _stop(job, group=True)
        _stop(server)
        _stop(watchdog, group=True)
