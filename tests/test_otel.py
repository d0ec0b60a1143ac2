"""OpenTelemetry export (dtwatch.export.otel) into real OTLP receivers (gRPC and HTTP), from real rings.

The receivers (tests/otlp_receivers.py) are the collector's own services built from
opentelemetry-proto; nothing about the SDK or the wire is mocked.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dtwatch.export.otel import (
    OtelConfigError,
    OtelExporter,
    SpanSampling,
    otlp_configured,
    resolve_config,
    step_trace_id,
)
from dtwatch.export.prometheus import DURATION_BUCKETS
from dtwatch.ring import FLAG_MARKER, ring_filename
from tests.exporter_helpers import (
    WORKER,
    ExpJob,
    free_port,
    node_view,
    read_states,
    shared_exp_job,
    synthetic_view,
    write_synthetic_ring,
)
from tests.otlp_receivers import GrpcReceiver, HttpReceiver, ReceivedSpan


@pytest.fixture(scope="session")
def job(tmp_path_factory: pytest.TempPathFactory) -> ExpJob:
    return shared_exp_job(tmp_path_factory)


@pytest.fixture(params=["grpc", "http/protobuf"])
def receiver(request: pytest.FixtureRequest):
    rx = GrpcReceiver() if request.param == "grpc" else HttpReceiver()
    try:
        yield rx
    finally:
        rx.close()


def line_of(fragment: str) -> int:
    lines = [n for n, text in enumerate(WORKER.read_text().splitlines(), start=1) if fragment in text]
    assert len(lines) == 1
    return lines[0]


def dtwatch_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("dtwatch") and r.levelno >= logging.WARNING]


# --- configuration ------------------------------------------------------------------------------

def test_config_argument_beats_environment_beats_default() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc,x-team=ml",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-team=infra",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1500", "OTEL_SERVICE_NAME": "trainer-watch",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,k8s.pod.name=pod%2D1",
    }
    cfg = resolve_config(environ=env)
    assert cfg.traces is not None and cfg.metrics is not None
    assert cfg.traces.endpoint == "http://collector:4318/v1/traces" and cfg.metrics.endpoint == "http://collector:4318/v1/metrics"
    assert cfg.traces.headers == {"authorization": "Bearer abc", "x-team": "ml"}
    assert cfg.metrics.headers["x-team"] == "infra"
    assert cfg.timeout == 1.5 and cfg.service_name == "trainer-watch"
    assert cfg.resource_attributes == {"deployment.environment": "prod", "k8s.pod.name": "pod-1"}

    cfg = resolve_config(endpoint="http://other:4317", protocol="grpc", timeout=0.5, environ=env)
    assert cfg.traces is not None and cfg.traces.endpoint == "http://other:4317" and cfg.traces.protocol == "grpc"
    assert cfg.timeout == 0.5

    only_traces = resolve_config(environ={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/custom"})
    assert only_traces.metrics is None and only_traces.traces is not None
    assert only_traces.traces.endpoint == "http://t:4318/custom" and only_traces.traces.protocol == "grpc"
    assert resolve_config(environ={**env, "OTEL_TRACES_EXPORTER": "none"}).traces is None


def test_config_refuses_bad_arguments_and_warns_on_bad_environment(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(OtelConfigError, match="protocol"):
        resolve_config(endpoint="http://x:4317", protocol="thrift", environ={})
    with pytest.raises(OtelConfigError, match="no OTLP endpoint"):
        OtelExporter(environ={})
    with pytest.raises(OtelConfigError, match="every_n_steps"):
        SpanSampling(every_n_steps=0)
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        cfg = resolve_config(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317",
                                      "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})
    assert cfg.traces is not None and cfg.traces.protocol == "grpc"
    assert len(dtwatch_warnings(caplog)) == 1 and "OTEL_EXPORTER_OTLP_PROTOCOL" in caplog.text


def test_enabled_only_when_an_endpoint_is_configured() -> None:
    assert OtelExporter.from_env(environ={}) is None
    assert not otlp_configured(environ={"OTEL_SERVICE_NAME": "x"})
    assert otlp_configured("http://127.0.0.1:4317", environ={})
    assert otlp_configured(environ={"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:4318/v1/metrics"})
    assert not otlp_configured("http://127.0.0.1:4317", environ={"OTEL_SDK_DISABLED": "true"})


# --- spans and metrics into real receivers ---------------------------------------------------------

def test_spans_and_metrics_reach_a_real_receiver(job: ExpJob, receiver, caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": receiver.protocol,
        "OTEL_EXPORTER_OTLP_HEADERS": "x-dtwatch-test=yes", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=ci",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
    }
    view = node_view(job.run_dir)
    exporter = OtelExporter.from_env(environ=env, metric_interval=60)
    assert exporter is not None
    exporter.update(view)
    exporter.shutdown()
    assert not dtwatch_warnings(caplog)

    spans = receiver.spans()
    steps = {(s.attributes["dtwatch.rank"], s.attributes["dtwatch.step"]): s for s in spans if s.name == "step"}
    calls = [s for s in spans if s.name != "step"]
    snaps, _ = read_states(job.run_dir)
    for rank, result in job.results.items():
        mine = [s for s in calls if s.attributes["dtwatch.rank"] == rank]
        assert len(mine) == sum(result["counts"].values())
        by_op = {op: len([s for s in mine if s.name == op]) for op in result["counts"]}
        assert by_op == result["counts"]
        recs = snaps[rank].records
        markers = recs[(recs["flags"] & FLAG_MARKER) != 0]
        for s in mine:
            assert s.attributes["dtwatch.op"] == s.name
            assert s.resource["dtwatch.rank"] == rank and s.resource["dtwatch.local_rank"] == rank
            assert s.resource["service.name"] == "dtwatch" and s.resource["dtwatch.job_id"] == job.job_id
            assert s.resource["service.instance.id"] == f"{job.job_id}/rank-{rank}"
            assert s.resource["host.name"] == s.resource["dtwatch.node"] == snaps[rank].host
            assert s.resource["deployment.environment"] == "ci"
            assert s.attributes["code.filepath"] == str(WORKER) and s.attributes["code.function"] == "main"
            row = recs[(recs["seq"] == s.attributes["dtwatch.seq"]) & ((recs["flags"] & FLAG_MARKER) == 0)]
            row = row[[snaps[rank].groups[g].name == s.attributes["dtwatch.group"] for g in row["group"]]]
            assert len(row) == 1
            assert abs(s.start_ns - row["t_enter"][0] * 1e9) < 1000 and abs(s.end_ns - row["t_exit"][0] * 1e9) < 1000
            step = steps[(rank, s.attributes["dtwatch.step"])]
            assert s.parent_span_id == step.span_id and s.trace_id == step.trace_id
            assert step.start_ns <= s.start_ns
            assert step.attributes.get("dtwatch.step_incomplete") or s.end_ns <= step.end_ns
        ar = [s for s in mine if s.name == "all_reduce"]
        assert {s.attributes["dtwatch.bytes"] for s in ar} == {16 * 4}
        assert {s.attributes["code.lineno"] for s in ar} == {line_of("dist.all_reduce(t)")}
        assert sorted(s.attributes["dtwatch.seq"] for s in ar) == list(range(1, 12 + 1))  # barrier is seq 13
        # step k runs from marker k to marker k+1 (step 0 from its first collective)
        for k in range(1, result["steps"]):
            assert abs(steps[(rank, k)].start_ns - markers["t_enter"][k - 1] * 1e9) < 1000
            assert abs(steps[(rank, k)].end_ns - markers["t_enter"][k] * 1e9) < 1000
            assert steps[(rank, k)].attributes["dtwatch.collectives"] == job.per_step + 1  # all_reduces + broadcast
    # job-wide traces: both ranks' step k share one trace id, derived from the job id
    for k in range(job.steps):
        assert steps[(0, k)].trace_id == steps[(1, k)].trace_id == step_trace_id(job.job_id, 0, k).to_bytes(16, "big")
    assert any(h.get("x-dtwatch-test") == "yes" for h in receiver.headers)
    if isinstance(receiver, HttpReceiver):
        assert "gzip" in receiver.encodings

    total = receiver.latest("dtwatch_collectives_total")
    for rank, result in job.results.items():
        labels = {"job_id": job.job_id, "node": view.node, "rank": str(rank), "local_rank": str(rank),
                  "op": "all_reduce"}
        point = total[tuple(sorted(labels.items()))]
        assert point.kind == "sum" and point.monotonic and point.value == result["counts"]["all_reduce"]
        seq = [p for p in receiver.latest("dtwatch_collective_seq").values()
               if p.attributes["rank"] == str(rank) and p.attributes["group"] == "0"]
        assert len(seq) == 1 and seq[0].kind == "gauge" and seq[0].value == result["seq"]["0"]
        hist = [p for p in receiver.latest("dtwatch_collective_duration_seconds").values()
                if p.attributes["rank"] == str(rank) and p.attributes["op"] == "all_reduce"]
        assert len(hist) == 1 and hist[0].count == result["counts"]["all_reduce"] and hist[0].unit == "s"
        assert hist[0].explicit_bounds == list(DURATION_BUCKETS) and sum(hist[0].bucket_counts) == hist[0].count
        steps_total = [p for p in receiver.latest("dtwatch_steps_total").values() if p.attributes["rank"] == str(rank)]
        assert steps_total[0].value == result["steps"]
    assert {p.resource["service.instance.id"] for p in receiver.points()} == {f"{job.job_id}/{view.node}"}


# --- sampling ------------------------------------------------------------------------------------

def exported(rx: GrpcReceiver) -> tuple[list[ReceivedSpan], list[ReceivedSpan]]:
    spans = rx.spans()
    return [s for s in spans if s.name != "step"], [s for s in spans if s.name == "step"]


def test_a_flood_of_collectives_is_capped_but_slow_ones_are_kept(tmp_path: Path) -> None:
    view = synthetic_view(tmp_path, n=50_000, steps=1, slow_every=2_000, slow_duration=1.5)  # all in step 0
    sampling = SpanSampling(max_spans_per_second=50, burst_seconds=4, slow_threshold=1.0)
    with GrpcReceiver() as rx:
        exporter = OtelExporter(endpoint=rx.endpoint, protocol="grpc", sampling=sampling, environ={})
        t0 = time.perf_counter()
        exporter.update(view)
        elapsed = time.perf_counter() - t0
        exporter.shutdown()
        calls, steps = exported(rx)
    slow = [s for s in calls if (s.end_ns - s.start_ns) >= 1e9]
    assert len(slow) == 50_000 // 2_000  # every slow collective, from the priority bucket
    assert len(calls) <= 50 * 4 + len(slow)  # the routine bucket's capacity
    assert len(calls) >= 50 * 4
    assert exporter.stats["sampled_out"] == 50_000 - len(calls)
    assert len(steps) == 1 and steps[0].attributes["dtwatch.step"] == 0
    assert steps[0].attributes["dtwatch.collectives"] == 50_000
    assert steps[0].attributes["dtwatch.spans_dropped"] == 50_000 - len(calls)
    assert elapsed < 2.0, f"update of 50k records took {elapsed:.2f} s"


def test_high_rate_keeps_whole_steps_and_the_same_steps_on_every_rank(tmp_path: Path) -> None:
    # two ranks, 20k collectives in 200 steps of 100 each within ~10 s: 2000/s >> cap of 100/s
    for rank in (0, 1):
        write_synthetic_ring(tmp_path / ring_filename(rank), rank=rank, world_size=2, n=20_000, steps=200,
                             duration=0.0005)
    view = node_view(tmp_path)
    sampling = SpanSampling(max_spans_per_second=100, burst_seconds=1000)  # a large bucket: the stride decides
    with GrpcReceiver() as rx:
        exporter = OtelExporter(endpoint=rx.endpoint, protocol="grpc", sampling=sampling, environ={})
        exporter.update(view)
        exporter.shutdown()
        calls, steps = exported(rx)
    kept = {r: sorted({s.attributes["dtwatch.step"] for s in calls if s.attributes["dtwatch.rank"] == r})
            for r in (0, 1)}
    assert kept[0] == kept[1] and len(kept[0]) >= 2
    stride = kept[0][1] - kept[0][0]
    assert stride in (16, 32) and all(k % stride == 0 for k in kept[0])  # 2000/s over 100/s -> 2**5 (rate estimate +-)
    per_step = {}
    for s in calls:
        key = (s.attributes["dtwatch.rank"], s.attributes["dtwatch.step"])
        per_step[key] = per_step.get(key, 0) + 1
    assert set(per_step.values()) == {100}  # kept steps are complete
    assert all(s.attributes["dtwatch.spans_dropped"] == 0 for s in steps)


def test_the_span_queue_holds_what_one_update_may_end() -> None:
    # The SDK's queue drops its oldest spans when full: a backlog the buckets allow would lose its first steps.
    wide = OtelExporter(endpoint="http://127.0.0.1:1", protocol="grpc", environ={},
                        sampling=SpanSampling(max_spans_per_second=100, burst_seconds=10))
    default = OtelExporter(endpoint="http://127.0.0.1:1", protocol="grpc", environ={})
    try:
        assert wide.max_queue_size == 2 * 100 * 10
        assert default.max_queue_size == 512  # the defaults' 2 x 20/s x 5 s fit the SDK's usual size
    finally:
        wide.shutdown()
        default.shutdown()


def test_every_n_steps_when_the_rate_is_low(job: ExpJob) -> None:
    with GrpcReceiver() as rx:
        exporter = OtelExporter(endpoint=rx.endpoint, protocol="grpc", sampling=SpanSampling(every_n_steps=2),
                                environ={})
        exporter.update(node_view(job.run_dir))
        exporter.shutdown()
        calls, steps = exported(rx)
    assert {s.attributes["dtwatch.step"] for s in calls} == {0, 2}
    assert {s.attributes["dtwatch.step"] for s in steps} == {0, 2}


def test_a_stalled_rank_reports_the_call_it_is_stuck_in(tmp_path: Path) -> None:
    write_synthetic_ring(tmp_path / ring_filename(0), n=1_000, steps=2, in_flight=1)
    view = node_view(tmp_path)
    view = replace(view, incident_open=True, stalled_ranks={0}, culprit_ranks=set(), now=time.time())
    sampling = SpanSampling(every_n_steps=1000, max_spans_per_second=50, burst_seconds=4)
    with GrpcReceiver() as rx:
        exporter = OtelExporter(endpoint=rx.endpoint, protocol="grpc", sampling=sampling, environ={})
        exporter.update(view)
        exporter.update(replace(view, new_records={}, now=view.now + 1))  # reported once, not every poll
        exporter.shutdown()
        calls, _ = exported(rx)
    stuck = [s for s in calls if s.attributes.get("dtwatch.in_flight")]
    assert len(stuck) == 1
    assert stuck[0].attributes["dtwatch.seq"] == 1_000 and stuck[0].attributes["dtwatch.stalled"] is True
    assert stuck[0].status_code == 2  # STATUS_CODE_ERROR
    assert abs(stuck[0].end_ns - view.now * 1e9) < 1e6
    # while the incident is open every collective of the stalled rank is priority (bucket: 50*4)
    assert len(calls) == 200


def test_a_late_completion_of_a_forgotten_step_lands_in_that_steps_trace(tmp_path: Path) -> None:
    view = synthetic_view(tmp_path, n=2_000, steps=100)  # 20 collectives per step, steps 0..99
    recs = view.new_records[0]
    late = recs[(recs["step"] == 3) & ((recs["flags"] & FLAG_MARKER) == 0)][:1].copy()  # "completes" only now
    with GrpcReceiver() as rx:
        exporter = OtelExporter(endpoint=rx.endpoint, protocol="grpc", sampling=SpanSampling(every_n_steps=1000),
                                environ={})
        exporter.update(view)
        exporter.update(replace(view, new_records={0: late}, now=view.now + 1))
        exporter.shutdown()
        calls, steps = exported(rx)
    assert [s.attributes["dtwatch.step"] for s in steps] == [0]  # only step 0 is sampled
    late_span = [s for s in calls if s.attributes["dtwatch.step"] == 3]
    assert late_span == []  # a routine collective of an unsampled step stays out, even late
    slow = replace(view, new_records={0: late}, now=view.now + 1)
    slow.new_records[0]["t_exit"] = slow.new_records[0]["t_enter"] + 5.0  # now slow: always kept
    with GrpcReceiver() as rx:
        exporter = OtelExporter(endpoint=rx.endpoint, protocol="grpc", sampling=SpanSampling(every_n_steps=1000),
                                environ={})
        exporter.update(view)
        exporter.update(slow)
        exporter.shutdown()
        calls, _ = exported(rx)
    (span,) = [s for s in calls if s.attributes["dtwatch.step"] == 3]
    assert span.parent_span_id == b"" and span.trace_id == step_trace_id("synthetic", 0, 3).to_bytes(16, "big")


# --- failure: quiet, bounded, prompt -----------------------------------------------------------

@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_unreachable_collector_is_one_warning_and_a_prompt_shutdown(
    job: ExpJob, protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    view = node_view(job.run_dir)
    caplog.set_level(logging.DEBUG, logger="dtwatch")
    exporter = OtelExporter(
        endpoint=f"http://127.0.0.1:{free_port()}", protocol=protocol, timeout=1.0, metric_interval=0.2,
        schedule_delay=0.1, environ={},
    )
    t0 = time.monotonic()
    for i in range(5):
        exporter.update(replace(view, now=view.now + i))
        time.sleep(0.2)
    exporter.shutdown(timeout=5)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 5 * 0.2 + 3.0, f"took {elapsed:.1f} s"
    warnings = dtwatch_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "127.0.0.1" in warnings[0].getMessage() and "failed" in warnings[0].getMessage()
    # the SDK's own exporter logs did not reach the root logger's handlers
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING]
    assert exporter.stats["export_failures"] >= 1 and exporter.stats["spans_exported"] == 0
    assert logging.getLogger("opentelemetry.exporter").propagate  # restored after shutdown


def test_update_never_raises_into_the_watchdog(job: ExpJob, caplog: pytest.LogCaptureFixture) -> None:
    view = node_view(job.run_dir)
    broken = replace(view, snapshots={0: object(), 1: object()})  # not RankSnapshots
    with GrpcReceiver() as rx:
        exporter = OtelExporter(endpoint=rx.endpoint, protocol="grpc", environ={})
        exporter.update(broken)
        exporter.update(broken)
        exporter.update(view)  # still works afterwards
        exporter.shutdown()
        exporter.shutdown()  # idempotent
        exporter.update(view)  # after shutdown: ignored
        assert rx.spans()
    assert len(dtwatch_warnings(caplog)) == 1
