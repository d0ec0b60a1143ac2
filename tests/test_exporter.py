"""The Prometheus exporter (dtwatch.export.prometheus) and the NVML sampler (dtwatch.export.nvml), against real rings.

The NodeViews come from the rings of a real 2-rank gloo job (tests/scripts/exp_worker.py), or from
synthetic rings written in the real format for load; scrapes go over HTTP to a real MetricsServer,
and ``promtool check metrics`` lints a real scrape.
"""
from __future__ import annotations

import errno
import gzip
import json
import logging
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dtwatch
from dtwatch.export.nvml import GpuSampler, index_for, normalize_uuid, physical_index
from dtwatch.export.prometheus import DURATION_BUCKETS, METRICS, MetricsBindError, MetricsServer, PrometheusExporter
from dtwatch.ring import FLAG_MARKER, OP_CODES
from tests.exporter_helpers import REPO, ExpJob, node_view, read_states, shared_exp_job, synthetic_view
from tests.tools import require_tool


@pytest.fixture(scope="session")
def job(tmp_path_factory: pytest.TempPathFactory) -> ExpJob:
    return shared_exp_job(tmp_path_factory)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset(labels.items())): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(scraped: dict, name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in scraped.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def scrape(collector: PrometheusExporter) -> dict:
    return samples(prometheus_client.generate_latest(collector.registry).decode())


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# --- the contract -------------------------------------------------------------------------------

def test_metric_specs_equal_the_table_in_docs_metrics_md() -> None:
    rows = re.findall(r"^\| `(dtwatch_\w+)` \| ([^|]+) \| ([^|]+) \|", (REPO / "docs" / "metrics.md").read_text(), re.M)
    documented = {name: (kind.split()[0], tuple(x.strip() for x in labels.split(","))) for name, kind, labels in rows}
    implemented = {m.name: (m.kind, m.labels) for m in METRICS}
    assert implemented == documented


def test_buckets_are_log_spaced_from_100us_to_300s() -> None:
    assert DURATION_BUCKETS[0] == 1e-4 and DURATION_BUCKETS[-1] == 300.0 and 12 <= len(DURATION_BUCKETS) <= 16
    ratios = np.diff(np.log10(DURATION_BUCKETS))
    assert ratios.min() > 0.4 and ratios.max() < 0.6


# --- values equal what the rings say -------------------------------------------------------------

def test_series_equal_what_the_worker_did(job: ExpJob) -> None:
    collector = PrometheusExporter()
    collector.update(node_view(job.run_dir))
    got = scrape(collector)
    snaps, _ = read_states(job.run_dir)
    for rank, result in job.results.items():
        r = str(rank)
        for group, seq in result["seq"].items():
            assert value(got, "dtwatch_collective_seq", rank=r, group=group) == seq
            assert value(got, "dtwatch_collective_seq_completed", rank=r, group=group) == seq
            assert value(got, "dtwatch_collective_seq_lag", rank=r, group=group) == 0
        for op, n in result["counts"].items():
            assert value(got, "dtwatch_collectives_total", rank=r, op=op) == n
            assert value(got, "dtwatch_collective_duration_seconds_count", rank=r, op=op) == n
            assert value(got, "dtwatch_collective_duration_seconds_bucket", rank=r, op=op, le="+Inf") == n
        recs = snaps[rank].records
        calls = recs[(recs["flags"] & FLAG_MARKER) == 0]
        all_reduce = calls[calls["op"] == OP_CODES["all_reduce"]]
        durations = all_reduce["t_exit"] - all_reduce["t_enter"]
        assert (value(got, "dtwatch_collective_duration_seconds_sum", rank=r, op="all_reduce")
                == pytest.approx(durations.sum()))
        assert (value(got, "dtwatch_collective_duration_seconds_bucket", rank=r, op="all_reduce", le="0.01")
                == (durations <= 0.01).sum())
        assert (value(got, "dtwatch_collective_time_seconds_total", rank=r)
                == pytest.approx((calls["t_exit"] - calls["t_enter"]).sum()))
        markers = recs[(recs["flags"] & FLAG_MARKER) != 0]["t_enter"]
        assert value(got, "dtwatch_steps_total", rank=r) == result["steps"] == len(markers)
        assert value(got, "dtwatch_step_duration_seconds_count", rank=r) == len(markers) - 1
        assert value(got, "dtwatch_step_duration_seconds_sum", rank=r) == pytest.approx(markers[-1] - markers[0])
        assert value(got, "dtwatch_rank_up", rank=r) == 0  # the job has ended
        assert value(got, "dtwatch_rank_in_collective", rank=r) == 0
        assert value(got, "dtwatch_rank_restarts_total", rank=r) == 0
        assert value(got, "dtwatch_rank_heartbeat_age_seconds", rank=r) > 0
    assert value(got, "dtwatch_watchdog_ranks") == 2
    assert value(got, "dtwatch_watchdog_info", version=dtwatch.__version__) == 1
    assert value(got, "dtwatch_watchdog_poll_duration_seconds_count") == 2
    # label values are bounded: never a sequence number or a call site
    labels = {k for (_, ls) in got for k, _ in ls}
    assert labels <= {"job_id", "node", "rank", "local_rank", "group", "op", "le", "version"}


def test_counters_are_cumulative_across_views_and_restarts(job: ExpJob) -> None:
    full = node_view(job.run_dir)
    halves = {}
    for rank, recs in full.new_records.items():
        cut = len(recs) // 2
        halves[rank] = (recs[:cut], recs[cut:])
    collector = PrometheusExporter()
    collector.update(replace(full, new_records={r: h[0] for r, h in halves.items()}))
    first = scrape(collector)
    collector.update(replace(full, new_records={r: h[1] for r, h in halves.items()}))
    collector.update(replace(full, new_records={}))  # a poll with nothing new changes no counter
    got = scrape(collector)
    assert value(first, "dtwatch_collectives_total", rank="0", op="all_reduce") < 12
    assert value(got, "dtwatch_collectives_total", rank="0", op="all_reduce") == 12
    assert value(got, "dtwatch_step_duration_seconds_count", rank="0") == 2  # the gap across views counts

    # rank 1 restarts (new pid): its step counter starts again, dtwatch_steps_total keeps growing
    restarted = [replace(s, pid=s.pid + 100000, start_time=s.start_time + 1, step=1) if s.rank == 1 else s
                 for s in full.local]
    collector.update(replace(full, local=restarted, new_records={}, restarts={0: 0, 1: 1}))
    got = scrape(collector)
    assert value(got, "dtwatch_steps_total", rank="1") == 3 + 1
    assert value(got, "dtwatch_steps_total", rank="0") == 3
    assert value(got, "dtwatch_rank_restarts_total", rank="1") == 1


def test_stall_findings_and_errors_are_exported(job: ExpJob) -> None:
    collector = PrometheusExporter()
    view = node_view(job.run_dir)
    collector.update(replace(
        view, stalled_ranks={0, 1}, culprit_ranks={1}, incident_open=True, incidents_total=1, window=12.5,
        findings_total={("rank_conditional", "stall"): 1, ("straggler", "warning"): 3, ("desync", "warning"): 1},
        straggler_ranks={1},
        seq_lag={(0, "0"): 0, (1, "0"): 2, (0, "1"): 0, (1, "1"): 0},
    ))
    got = scrape(collector)
    assert value(got, "dtwatch_rank_stalled", rank="0") == 1 and value(got, "dtwatch_rank_culprit", rank="0") == 0
    assert value(got, "dtwatch_rank_culprit", rank="1") == 1
    assert value(got, "dtwatch_collective_seq_lag", rank="1", group="0") == 2
    assert value(got, "dtwatch_incident_open") == 1
    assert value(got, "dtwatch_incidents_total") == 1
    assert value(got, "dtwatch_stall_window_seconds") == 12.5
    assert value(got, "dtwatch_findings_total", kind="straggler", severity="warning") == 3
    assert value(got, "dtwatch_findings_total", kind="desync", severity="warning") == 1
    assert value(got, "dtwatch_straggler_lag_seconds", rank="0") == pytest.approx(view.straggler_lag[0])
    assert value(got, "dtwatch_rank_straggler", rank="1") == 1 and value(got, "dtwatch_rank_straggler", rank="0") == 0
    # no straggler named: every rank reports 0 (the series exists, so a panel shows "not named")
    collector.update(replace(view, straggler_ranks=set()))
    got = scrape(collector)
    assert value(got, "dtwatch_rank_straggler", rank="0") == 0 and value(got, "dtwatch_rank_straggler", rank="1") == 0


def test_collector_uses_its_own_registry_and_refuses_a_clash() -> None:
    a = PrometheusExporter()
    assert a.registry is not prometheus_client.REGISTRY
    assert scrape(a) == {}  # nothing before the first view
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrometheusExporter(a.registry)
    named = scrape(PrometheusExporter(job_id="job7", node="n1"))  # a new target shows up at once
    assert value(named, "dtwatch_watchdog_info", job_id="job7", node="n1", version=dtwatch.__version__) == 1
    assert value(named, "dtwatch_watchdog_ranks", job_id="job7", node="n1") == 0
    assert len(named) == 2


def test_update_of_50k_records_is_cheap(tmp_path: Path) -> None:
    view = synthetic_view(tmp_path, n=50_000, steps=50)
    collector = PrometheusExporter()
    t0 = time.perf_counter()
    collector.update(view)
    elapsed = time.perf_counter() - t0
    got = scrape(collector)
    assert value(got, "dtwatch_collectives_total", op="all_reduce") == 50_000
    assert value(got, "dtwatch_collective_duration_seconds_bucket", op="all_reduce", le="0.0003") == 0
    assert value(got, "dtwatch_collective_duration_seconds_bucket", op="all_reduce", le="0.001") == 50_000
    assert value(got, "dtwatch_steps_total") == 50
    assert value(got, "dtwatch_step_duration_seconds_count") == 49
    assert elapsed < 0.5, f"folding 50k records took {elapsed:.3f} s"


# --- the HTTP server ----------------------------------------------------------------------------

def test_promtool_accepts_a_real_scrape(job: ExpJob) -> None:
    promtool = require_tool("promtool", "prometheus.sh")
    collector = PrometheusExporter()
    collector.update(node_view(job.run_dir))
    with MetricsServer(collector.registry, addr="127.0.0.1", port=0) as server:
        status, headers, body = get(server.url)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b'dtwatch_collectives_total{job_id="expjob"' in body
    lint = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
    assert lint.stdout.strip() == b"" and lint.stderr.strip() == b""


def test_health_ready_and_formats(tmp_path: Path) -> None:
    collector = PrometheusExporter()
    collector.update(synthetic_view(tmp_path, n=100))
    healthy = [True]
    with MetricsServer(collector.registry, addr="127.0.0.1", port=0, health_fn=lambda: healthy[0]) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        base = server.base_url
        assert get(base + "/healthz")[0] == 200
        healthy[0] = False
        assert get(base + "/healthz")[0] == 503
        assert get(base + "/readyz")[0] == 503
        server.ready = True
        assert get(base + "/readyz")[0] == 200
        assert get(base + "/nope")[0] == 404
        status, headers, body = get(server.url, {"Accept-Encoding": "gzip"})
        assert status == 200 and headers["Content-Encoding"] == "gzip"
        assert b"dtwatch_collectives_total" in gzip.decompress(body)
        status, headers, body = get(server.url, {"Accept": "application/openmetrics-text; version=1.0.0"})
        assert headers["Content-Type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
        status, _, body = get(server.url + "?name[]=dtwatch_steps_total")
        assert {s for s, _ in samples(body.decode())} == {"dtwatch_steps_total"}


def test_health_fn_that_raises_is_unhealthy() -> None:
    def broken() -> bool:
        raise RuntimeError("store unreachable")

    with MetricsServer(PrometheusExporter().registry, addr="127.0.0.1", port=0, health_fn=broken) as server:
        status, _, body = get(server.base_url + "/healthz")
    assert status == 503 and b"store unreachable" in body


def test_taken_port_raises_metrics_bind_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(MetricsBindError) as info:
            MetricsServer(PrometheusExporter().registry, addr="127.0.0.1", port=port)
    assert isinstance(info.value, OSError) and info.value.errno == errno.EADDRINUSE
    assert f"127.0.0.1:{port}" in str(info.value) and "--metrics-port" in str(info.value)
    with pytest.raises(ValueError, match="port"):
        MetricsServer(PrometheusExporter().registry, port=70000)


def test_url_file_is_written_and_removed(tmp_path: Path) -> None:
    path = tmp_path / "run" / "watchdog-n1.json"
    server = MetricsServer(PrometheusExporter().registry, addr="127.0.0.1", port=0, url_file=path, node="n1")
    try:
        info = json.loads(path.read_text())
        assert info == {"url": server.url, "addr": "127.0.0.1", "port": server.port, "pid": os.getpid(), "node": "n1"}
        assert get(info["url"])[0] == 200
    finally:
        server.close()
    assert not path.exists()
    server.close()  # idempotent


# --- GPU ----------------------------------------------------------------------------------------

def test_gpu_sampler_without_nvml_is_disabled_quietly(job: ExpJob, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dtwatch"):
        gpu = GpuSampler(min_interval=0)
    assert not gpu.enabled
    assert [r.levelno for r in caplog.records if r.name.startswith("dtwatch")] == [logging.INFO]
    _, states = read_states(job.run_dir)
    assert gpu.sample(states) == {}
    collector = PrometheusExporter(gpu=gpu)
    collector.update(node_view(job.run_dir))
    assert not [k for k in scrape(collector) if k[0].startswith("dtwatch_gpu_")]
    gpu.close()
    gpu.close()


def test_gpu_mapping_prefers_uuid_then_visible_devices(job: ExpJob) -> None:
    uuids = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-cccc3333-0000"]
    assert normalize_uuid("GPU-AAAA1111-0000") == normalize_uuid("aaaa1111-0000")
    assert physical_index(1, None, uuids) == 1
    assert physical_index(1, "2,0", uuids) == 0
    assert physical_index(0, "GPU-cccc", uuids) == 2
    assert physical_index(2, "2,0", uuids) is None
    assert physical_index(0, "", uuids) is None
    assert physical_index(0, "MIG-xyz", uuids) is None
    _, states = read_states(job.run_dir)
    by_uuid = replace(states[0], gpu_uuid="bbbb2222-0000", device_index=0)
    assert index_for(by_uuid, "0", uuids) == 1
    assert index_for(replace(states[0], device_index=1), "2,0", uuids) == 0
    assert index_for(states[0], None, uuids) is None  # CPU job: device_index -1
