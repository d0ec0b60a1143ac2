"""Every dashboard query returns data from a real Prometheus that scraped a real multi-rank run.

This catches metric names, labels and PromQL in dashboards/*.json drifting away from what the exporter
really serves (tests/test_dashboards.py checks the JSON's shape; this checks its queries against data).

The run: a real 3-rank torchrun job (tests/scripts/hang_worker.py ``dashboard_tour``) that trains with
DDP and a Python-issued all_reduce per step, with rank 2 entering that all_reduce late (straggler
warning), DataLoader lengths that differ (uneven-iterations warning) and then the uneven-iterations
stall, under a real watchdog serving /metrics; a real ``prometheus`` scrapes it every second. Then
every (dashboard, panel, expr) of ``dashboards_queries`` is run: as an instant ``/api/v1/query`` now
(it must execute) and as ``/api/v1/query_range`` over the run, what the panel would plot (it must
hold a value that is not NaN), except for the panels that cannot have data on this CPU-only run.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from tests.dashboard_queries import dashboards_queries, expected_empty_when_healthy
from tests.harness import launch
from tests.prom_servers import Prometheus, until, watchdog_metrics_target
from tests.tools import require_tool

RATE_INTERVAL = "10s"  # $__rate_interval for a 1 s scrape interval

# Panels of dashboards/expected_empty_when_healthy.json that this run does fill, so they must have data
# here too: the stall names a culprit, warnings and the stall raise findings, the ranks iterate
# DataLoaders, and the job issues all_reduce from Python.
FILLED_BY_THIS_RUN = {
    ("dtwatch-overview", "Culprit"),
    ("dtwatch-overview", "Findings by kind"),
    ("dtwatch-overview", "Findings over time"),
    ("dtwatch-drift", "Collective rate by op"),
    ("dtwatch-drift", "Collective latency by op (p50, p99)"),
    ("dtwatch-drift", "DataLoader length spread"),
    ("dtwatch-drift", "DataLoader length per rank"),
    ("dtwatch-drift", "DataLoader length spread by loader"),
}
# What stays empty here: no GPU on this machine, and the watchdog has no errors of its own.
EMPTY_HERE = {
    ("dtwatch-overview", "Watchdog errors"),
    ("dtwatch-drift", "GPU utilisation per rank"),
    ("dtwatch-drift", "GPU memory used per rank"),
    ("dtwatch-drift", "GPU power per rank"),
    ("dtwatch-drift", "GPU temperature per rank"),
}


def _values(series: list[dict]) -> list[float]:
    return [float(v) for s in series for _, v in s.get("values", [s["value"]] if "value" in s else [])]


def test_every_dashboard_query_returns_data_from_a_real_run(tmp_path: Path) -> None:
    prometheus_bin = require_tool("prometheus", "prometheus.sh")
    exempt = expected_empty_when_healthy()
    assert FILLED_BY_THIS_RUN <= exempt and EMPTY_HERE <= exempt, "expected_empty_when_healthy.json changed"
    assert exempt == FILLED_BY_THIS_RUN | EMPTY_HERE, (
        f"new panels in expected_empty_when_healthy.json; decide whether this run fills them: "
        f"{sorted(exempt - FILLED_BY_THIS_RUN - EMPTY_HERE)}"
    )
    job = prometheus = None
    try:
        job = launch(tmp_path / "dtwatch", "dashboard_tour", 3, window=4,
                     watch_args=["--metrics-addr", "127.0.0.1", "--metrics-port", "0", "--idle-exit", "60"])
        prometheus = Prometheus(prometheus_bin, tmp_path / "prometheus", [watchdog_metrics_target(job.run_dir)])
        prometheus.wait_target_up()
        start = time.time()
        index = job.wait_incident(120, complete=False)
        culprits = index["findings"][0]["ranks"]
        assert index["findings"][0]["kind"] == "uneven_iterations" and culprits == [1], index["findings"][0]
        # four scrapes of the open stall (the gauge is 0 or 1): culprit, stalled ranks, the incident counter
        until("four scrapes of the open incident", lambda: prometheus.query(
            f'sum_over_time(dtwatch_incident_open{{job_id="{job.job_id}"}}[1m]) >= 4'), timeout=30)
        end = time.time()

        queries = list(dashboards_queries(job_id=job.job_id, rate_interval=RATE_INTERVAL))
        assert len(queries) >= 40, f"only {len(queries)} dashboard queries found"
        panels = {(q.dashboard, q.panel) for q in queries}
        assert exempt <= panels, f"expected_empty_when_healthy.json names missing panels: {sorted(exempt - panels)}"

        failures: list[str] = []
        for dashboard, panel, expr in queries:
            where = f"{dashboard} / {panel}: {expr}"
            try:
                prometheus.query(expr)  # executes now, whatever it returns
                plotted = prometheus.query_range(expr, start, end, step=1.0)
            except AssertionError as exc:
                failures.append(f"{where}\n    query failed: {exc}")
                continue
            if (dashboard, panel) in EMPTY_HERE:
                continue
            values = [v for v in _values(plotted) if not math.isnan(v)]
            if not values:
                failures.append(f"{where}\n    no data ({len(plotted)} series, all NaN)" if plotted
                                else f"{where}\n    no data")
        assert not failures, f"{len(failures)} dashboard queries failed against real data:\n" + "\n".join(failures)

        # the panels show what happened: spot-check values against the watchdog's own diagnosis
        j = job.job_id
        culprit = prometheus.query(f'max by (rank) (dtwatch_rank_culprit{{job_id=~"{j}"}}) == 1')
        assert sorted(int(s["metric"]["rank"]) for s in culprit) == culprits
        lengths = {s["metric"]["rank"]: float(s["value"][1])
                   for s in prometheus.query(f'dtwatch_dataloader_length{{job_id=~"{j}"}}')}
        loader = index["findings"][0]["details"]["loaders"][0]["lengths"]
        assert lengths == {r: float(n) for r, n in loader.items()}, (lengths, loader)
        top = prometheus.query(f'topk(1, max by (rank) (dtwatch_straggler_lag_seconds{{job_id=~"{j}"}}))')
        assert [s["metric"]["rank"] for s in top] == ["2"], top  # the rank that enters the all_reduce late
        named = prometheus.query(f'max by (rank) (max_over_time(dtwatch_rank_straggler{{job_id=~"{j}"}}[10m])) == 1')
        assert [s["metric"]["rank"] for s in named] == ["2"], named  # the watchdog named it, and no other rank
        kinds = {(s["metric"]["kind"], s["metric"]["severity"])
                 for s in prometheus.query(f'sum by (kind, severity) (dtwatch_findings_total{{job_id=~"{j}"}})')}
        assert {("uneven_iterations", "warning"), ("straggler", "warning"), ("uneven_iterations", "stall")} <= kinds
    finally:
        if job is not None:
            job.stop()
        if prometheus is not None:
            prometheus.stop()
