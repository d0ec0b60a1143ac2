"""OpenTelemetry export of the watchdog over OTLP: spans per collective, grouped by step, and metrics.

Enabled only when an OTLP endpoint is configured: ``--otlp-endpoint`` (the ``endpoint`` argument) or
the standard variables ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT``.
Also honoured: ``OTEL_EXPORTER_OTLP[_{TRACES,METRICS}]_PROTOCOL`` (``grpc``, the default as in the
Python SDK, or ``http/protobuf``), ``..._HEADERS``, ``..._COMPRESSION`` (``gzip``/``none``),
``..._TIMEOUT`` (milliseconds, as the specification says), ``OTEL_EXPORTER_OTLP_INSECURE``,
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SDK_DISABLED``, and
``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER`` = ``none`` to turn one signal off. An argument
beats the environment; a malformed environment value is refused with a warning (the default is
used), a bad argument raises :class:`OtelConfigError`. A base endpoint gets ``/v1/traces`` and
``/v1/metrics`` appended for OTLP/HTTP; a per-signal endpoint is used as given::

    from dtwatch.export.otel import OtelExporter

    otel = OtelExporter.from_env(endpoint=args.otlp_endpoint, gpu=gpu)   # None: not configured
    while running:
        if otel: otel.update(view)                                        # every poll
    if otel: otel.shutdown()                                              # bounded by its timeout

**Spans.** Every collective in ``view.new_records`` can become a span named after its op, with its
real start and end (``t_enter``/``t_exit``) and attributes ``dtwatch.op``, ``dtwatch.group``,
``dtwatch.seq``, ``dtwatch.bytes`` (numel x itemsize), ``dtwatch.dtype``, ``dtwatch.rank``,
``dtwatch.step``, ``code.filepath``, ``code.lineno``, ``code.function``; status ERROR if it raised.
Its parent is the *step span* of its rank: a record carries the step counter at entry, so the
collectives with ``step == k`` happen between step marker ``k`` (written when step ``k`` completed)
and marker ``k+1``. Step span ``k`` (name ``step``, attribute ``dtwatch.step = k``) therefore runs
from marker ``k`` (for ``k = 0`` or a marker not seen: its first collective's entry) to marker
``k+1``, and ends when that marker arrives. With ``job_wide_traces`` (default) the trace id of step
``k`` is derived from (job id, restart count, k), so every rank's step ``k`` - on every node - lands in
one trace, side by side. Each local rank has its own TracerProvider whose resource says
``service.name`` (``dtwatch`` unless ``OTEL_SERVICE_NAME``), ``service.instance.id``
(``<job>/rank-<r>``), ``dtwatch.job_id``, ``host.name``, ``dtwatch.node``, ``dtwatch.rank``,
``dtwatch.local_rank``, ``dtwatch.world_size``.

**Sampling** (:class:`SpanSampling`), per rank, so thousands of collectives per second cannot flood a
backend:

1. *Step stride.* Step ``k`` is kept when ``k % stride == 0`` with
   ``stride = every_n_steps * 2**ceil(log2(rate / max_spans_per_second))`` (the second factor is 1
   while the rank's collective rate is at most the cap). Defaults keep every step while the rate is
   low; above it, whole steps are kept (complete, comparable) and the same steps on every rank (a
   power-of-two stride is shared by ranks whose rates differ by less than 2x).
2. *Hard cap.* A token bucket of ``max_spans_per_second`` per rank (burst ``burst_seconds`` worth)
   bounds the collective spans of kept steps (plus one step span per step that has any); a step too
   large for it is truncated (its first collectives kept) and its step span says ``dtwatch.spans_dropped``.
3. *Always kept*, from a second bucket of the same size: collectives slower than
   ``slow_threshold`` seconds, collectives that raised, every collective of a rank that is part of an
   open stall incident, and - once per call - the collectives such ranks are still inside, as spans
   ending "now" with ``dtwatch.in_flight=true`` and status ERROR. They keep their step as parent
   (a step span is created for them if their step was not sampled; a late completion of a step
   older than the last 16 becomes a root span in that step's trace).

Also honoured: ``OTEL_TRACES_SAMPLER`` (the SDK applies it to step spans; children follow; with
job-wide traces a ratio sampler picks the same steps on every rank).

**Metrics.** The metric set of ``docs/metrics.md``, with the same names and attributes (labels), read
from the latest view by observable gauges and counters and exported by a
``PeriodicExportingMetricReader`` every ``metric_interval`` seconds from one MeterProvider per node
(resource: ``service.instance.id = <job>/<node>``). The three histograms are not SDK instruments:
recording per collective costs ~20 us in the SDK, so they are the exact numpy-bucketed histograms of
:class:`dtwatch.export.prometheus.NodeMetrics`, added to each export as histogram points (cumulative, or delta
when ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`` asks for it).

**Failure is quiet and bounded.** Exports run in the SDK's threads (BatchSpanProcessor with a bounded
queue, periodic reader) with a short timeout (default 2 s). The first failure logs ONE warning on the
``dtwatch.export.otel`` logger (with the SDK's reason); then exports are skipped for ``retry_after`` seconds
at a time (one probe per period) and a recovery is logged at info. The SDK's own exporter loggers
(``opentelemetry.exporter``, the batch processor's, the metric reader's) are captured while an
exporter lives - logged again at debug on ``dtwatch.export.otel`` - so a dead collector does not repeat
itself in the watchdog's log. :meth:`OtelExporter.update` and :meth:`OtelExporter.shutdown` never
raise; shutdown returns within its timeout.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import numpy as np

try:
    from opentelemetry import trace as trace_api
    from opentelemetry.context import Context
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        HistogramDataPoint,
        Metric,
        MetricExporter,
        MetricExportResult,
        MetricsData,
        PeriodicExportingMetricReader,
        ResourceMetrics,
        ScopeMetrics,
    )
    from opentelemetry.sdk.metrics.export import Histogram as HistogramData
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.sdk.version import __version__ as _sdk_version
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
    from opentelemetry.util.re import parse_env_headers
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"dtwatch.export.otel needs the OpenTelemetry SDK and OTLP exporters ({_exc}): pip install 'dtwatch[otel]'"
    ) from _exc

from dtwatch.export.prometheus import METRICS, Histogram, NodeMetrics
from dtwatch.ring import (
    DTYPE_ITEMSIZE,
    DTYPES,
    FLAG_ASYNC,
    FLAG_MARKER,
    OPS,
    RECORD_DTYPE,
    STATUS_ERROR,
    RankSnapshot,
    Record,
)

if TYPE_CHECKING:
    from dtwatch.diagnose.state import RankState
    from dtwatch.export.nvml import GpuSampler
    from dtwatch.export.view import NodeView

log = logging.getLogger("dtwatch.export.otel")

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "grpc"
SCOPE = "dtwatch"
SIGNAL_PATHS = {"traces": "v1/traces", "metrics": "v1/metrics"}
# SDK loggers captured while an exporter lives (their records are re-logged at debug on dtwatch.export.otel).
SDK_LOGGERS = (
    "opentelemetry.exporter",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk.metrics._internal.export",
)
MAX_OPEN_STEPS = 16  # step spans remembered per rank (open, or closed but parent of late children)
MAX_IN_FLIGHT_SPANS = 16  # in-flight calls reported per rank per stall


class OtelConfigError(ValueError):
    """An OpenTelemetry export option has a value dtwatch does not accept (or no endpoint is set)."""


# ---------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class SpanSampling:
    """Which collectives become spans (see the module docstring for the whole policy)."""

    every_n_steps: int = 1
    """Keep the spans of one step in N (on every rank the same steps); 1 keeps all while the rate is low."""
    max_spans_per_second: float = 20.0
    """Per rank: above this collective rate the step stride doubles until it fits; also the hard cap.
    A span costs the watchdog ~80-110 us of CPU in the SDK (measured), so 20/s at 8 ranks is ~1.5% of a core."""
    burst_seconds: float = 5.0
    """The hard cap's bucket holds this many seconds' worth of spans."""
    slow_threshold: float = 1.0
    """Collectives at least this slow (seconds) are always kept (from their own bucket)."""
    job_wide_traces: bool = True
    """Step k of every rank shares one trace id derived from (job id, restart count, k)."""

    def __post_init__(self) -> None:
        if not isinstance(self.every_n_steps, int) or isinstance(self.every_n_steps, bool) or self.every_n_steps < 1:
            raise OtelConfigError(f"every_n_steps must be an integer >= 1, got {self.every_n_steps!r}")
        for name in ("max_spans_per_second", "burst_seconds", "slow_threshold"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
                raise OtelConfigError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SignalTarget:
    """Where and how one signal (traces or metrics) is sent."""

    endpoint: str
    protocol: str
    headers: dict[str, str]
    compression: str | None  # "gzip" or None
    insecure: bool | None  # gRPC only; None: the URL scheme decides (http = plaintext)


@dataclass(frozen=True)
class OtlpConfig:
    """OTLP settings resolved from arguments over ``OTEL_*`` variables; a signal is None when off."""

    traces: SignalTarget | None
    metrics: SignalTarget | None
    timeout: float  # seconds per export, retries included
    service_name: str
    resource_attributes: dict[str, str]


def _env_choice(env: Mapping[str, str], names: Sequence[str], allowed: Sequence[str], warned: set[str]) -> str | None:
    for name in names:
        raw = env.get(name, "").strip()
        if not raw:
            continue
        if raw.lower() in allowed:
            return raw.lower()
        if name not in warned:  # the generic variable is read once per signal: warn once
            warned.add(name)
            log.warning("dtwatch: ignoring %s=%r: allowed %s; using the default", name, raw, ", ".join(allowed))
        return None
    return None


def _env_headers(env: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name in reversed(names):  # generic first, then the signal's own override it
        raw = env.get(name, "").strip()
        if raw:
            headers.update(parse_env_headers(raw, liberal=True))
    return headers


def _env_timeout(env: Mapping[str, str], names: Sequence[str]) -> float | None:
    for name in names:
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            value = float(raw) / 1000.0
            if value > 0 and math.isfinite(value):
                return value
        except ValueError:
            pass
        log.warning("dtwatch: ignoring %s=%r: allowed a positive number of milliseconds", name, raw)
        return None
    return None


def parse_resource_attributes(text: str) -> dict[str, str]:
    """``OTEL_RESOURCE_ATTRIBUTES`` syntax: ``k1=v1,k2=v2`` with percent-encoded values."""
    attrs: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            log.warning("dtwatch: ignoring malformed OTEL_RESOURCE_ATTRIBUTES entry %r (expected key=value)", item)
            continue
        attrs[key.strip()] = unquote(value.strip())
    return attrs


def resolve_config(
    *,
    endpoint: str | None = None,
    protocol: str | None = None,
    traces_endpoint: str | None = None,
    metrics_endpoint: str | None = None,
    headers: Mapping[str, str] | None = None,
    compression: str | None = None,
    timeout: float | None = None,
    service_name: str | None = None,
    resource_attributes: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> OtlpConfig:
    """Resolve OTLP settings: argument > ``OTEL_*`` environment > default. Raises on a bad argument."""
    env = os.environ if environ is None else environ
    if protocol is not None and protocol not in PROTOCOLS:
        raise OtelConfigError(f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if compression is not None and compression not in ("gzip", "none"):
        raise OtelConfigError(f"OTLP compression must be 'gzip' or 'none', got {compression!r}")
    if timeout is not None and (not isinstance(timeout, (int, float)) or not timeout > 0):
        raise OtelConfigError(f"OTLP timeout must be a positive number of seconds, got {timeout!r}")
    warned: set[str] = set()
    insecure_raw = env.get("OTEL_EXPORTER_OTLP_INSECURE", "").strip().lower()
    insecure = True if insecure_raw == "true" else False if insecure_raw == "false" else None

    def target(signal: str, explicit: str | None) -> SignalTarget | None:
        up = signal.upper()
        if env.get(f"OTEL_{up}_EXPORTER", "").strip().lower() == "none":
            return None
        proto = protocol or _env_choice(
            env, (f"OTEL_EXPORTER_OTLP_{up}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"), PROTOCOLS, warned
        ) or DEFAULT_PROTOCOL
        url: str | None
        if explicit:
            url = explicit
        elif endpoint:
            url = _signal_url(endpoint, signal, proto)
        elif env.get(f"OTEL_EXPORTER_OTLP_{up}_ENDPOINT", "").strip():
            url = env[f"OTEL_EXPORTER_OTLP_{up}_ENDPOINT"].strip()
        elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
            url = _signal_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip(), signal, proto)
        else:
            return None
        hdrs = _env_headers(env, (f"OTEL_EXPORTER_OTLP_{up}_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"))
        hdrs.update(headers or {})
        comp = compression or _env_choice(
            env, (f"OTEL_EXPORTER_OTLP_{up}_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"), ("gzip", "none"), warned
        )
        return SignalTarget(url, proto, {k.lower(): v for k, v in hdrs.items()}, comp if comp == "gzip" else None, insecure)

    attrs = parse_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    attrs.update(resource_attributes or {})
    name = service_name or env.get("OTEL_SERVICE_NAME", "").strip() or attrs.pop("service.name", "") or "dtwatch"
    attrs.pop("service.name", None)
    resolved_timeout = timeout or _env_timeout(env, ("OTEL_EXPORTER_OTLP_TIMEOUT",)) or 2.0
    return OtlpConfig(
        traces=target("traces", traces_endpoint), metrics=target("metrics", metrics_endpoint),
        timeout=float(resolved_timeout), service_name=name, resource_attributes=attrs,
    )


def _signal_url(base: str, signal: str, protocol: str) -> str:
    if protocol == "grpc":
        return base
    return base.rstrip("/") + "/" + SIGNAL_PATHS[signal]


def otlp_configured(endpoint: str | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """True when OTLP export should run: an endpoint is given or set, and the SDK is not disabled."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(endpoint) or any(
        env.get(f"OTEL_EXPORTER_OTLP{s}_ENDPOINT", "").strip() for s in ("", "_TRACES", "_METRICS")
    )


# ---------------------------------------------------------------------------------------------------
# Failure policy: one warning, then quiet, bounded retries
# ---------------------------------------------------------------------------------------------------
class _ExportHealth:
    """Shared by every exporter of one OtelExporter: warns once per outage, skips exports meanwhile."""

    def __init__(self, where: str, retry_after: float) -> None:
        self.where = where
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self.failing = False
        self.failures = 0
        self.skipped = 0  # batches not even tried while failing
        self.warnings = 0
        self.last_sdk_message = ""

    def allow(self) -> bool:
        """May an export be tried now? While failing: one probe per ``retry_after`` seconds."""
        with self._lock:
            if not self.failing:
                return True
            now = time.monotonic()
            if now >= self._retry_at:
                self._retry_at = now + self.retry_after
                return True
            self.skipped += 1
            return False

    def failed(self, reason: str = "") -> None:
        with self._lock:
            self.failures += 1
            self._retry_at = time.monotonic() + self.retry_after
            if self.failing:
                return
            self.failing = True
            self.warnings += 1
            detail = reason or self.last_sdk_message or "no detail from the SDK"
        log.warning(
            "dtwatch: OpenTelemetry export to %s failed (%s); spans and metrics are dropped while it fails, "
            "retrying every %.0f s without further warnings", self.where, detail, self.retry_after,
        )

    def succeeded(self) -> None:
        with self._lock:
            was_failing, self.failing = self.failing, False
        if was_failing:
            log.info("dtwatch: OpenTelemetry export to %s works again", self.where)


class _SdkLogCapture(logging.Handler):
    """Takes the SDK exporters' log records while installed (they stop propagating to the root)."""

    _lock = threading.Lock()
    _installed: list[_SdkLogCapture] = []
    _saved: dict[str, bool] = {}

    def __init__(self, health: _ExportHealth) -> None:
        super().__init__(level=logging.DEBUG)
        self.health = health

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001
            message = str(record.msg)
        if record.levelno >= logging.WARNING:
            self.health.last_sdk_message = message[:500]
        log.debug("otel sdk (%s): %s", record.name, message)

    def install(self) -> None:
        with self._lock:
            if not self._installed:
                for name in SDK_LOGGERS:
                    lg = logging.getLogger(name)
                    self._saved[name] = lg.propagate
                    lg.propagate = False
            for name in SDK_LOGGERS:
                logging.getLogger(name).addHandler(self)
            self._installed.append(self)

    def uninstall(self) -> None:
        with self._lock:
            if self not in self._installed:
                return
            self._installed.remove(self)
            for name in SDK_LOGGERS:
                logging.getLogger(name).removeHandler(self)
            if not self._installed:
                for name, propagate in self._saved.items():
                    logging.getLogger(name).propagate = propagate
                self._saved.clear()


class _GuardedSpanExporter(SpanExporter):
    """Wraps an OTLP span exporter: skips while the endpoint fails, reports to :class:`_ExportHealth`."""

    def __init__(self, inner: SpanExporter, health: _ExportHealth) -> None:
        self.inner = inner
        self.health = health
        self.exported = 0

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        if not self.health.allow():
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # noqa: BLE001 - an exporter must not kill the batch thread
            self.health.failed(repr(exc))
            return SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            self.health.succeeded()
        else:
            self.health.failed()
        return result

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception:
            log.debug("dtwatch: span exporter shutdown failed", exc_info=True)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class _GuardedMetricExporter(MetricExporter):
    """Wraps an OTLP metric exporter like :class:`_GuardedSpanExporter`, adding dtwatch's histograms."""

    def __init__(self, inner: MetricExporter, health: _ExportHealth, extra: Callable[[AggregationTemporality], list[Metric]], resource: Resource) -> None:
        super().__init__(
            preferred_temporality=getattr(inner, "_preferred_temporality", None),
            preferred_aggregation=getattr(inner, "_preferred_aggregation", None),
        )
        self.inner = inner
        self.health = health
        self.extra = extra
        self.resource = resource
        self.scope = InstrumentationScope(SCOPE, _dtwatch_version())
        temporality = (getattr(inner, "_preferred_temporality", None) or {}).get(HistogramInstrument)
        self.histogram_temporality = temporality or AggregationTemporality.CUMULATIVE

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if not self.health.allow():
            return MetricExportResult.FAILURE
        try:
            data = self._with_histograms(metrics_data)
            result = self.inner.export(data, timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self.health.failed(repr(exc))
            return MetricExportResult.FAILURE
        if result is MetricExportResult.SUCCESS:
            self.health.succeeded()
        else:
            self.health.failed()
        return result

    def _with_histograms(self, data: MetricsData | None) -> MetricsData:
        extra = self.extra(self.histogram_temporality)
        rms = list(data.resource_metrics) if data is not None else []
        if not extra:
            return MetricsData(rms)
        if not rms:
            return MetricsData([ResourceMetrics(self.resource, [ScopeMetrics(self.scope, extra, "")], "")])
        rm = rms[0]
        scopes = list(rm.scope_metrics)
        for i, sm in enumerate(scopes):
            if sm.scope.name == SCOPE:
                scopes[i] = ScopeMetrics(sm.scope, list(sm.metrics) + extra, sm.schema_url)
                break
        else:
            scopes.append(ScopeMetrics(self.scope, extra, ""))
        rms[0] = ResourceMetrics(rm.resource, scopes, rm.schema_url)
        return MetricsData(rms)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        try:
            self.inner.shutdown(timeout_millis=timeout_millis)
        except Exception:
            log.debug("dtwatch: metric exporter shutdown failed", exc_info=True)


def _make_exporter(signal: str, target: SignalTarget, timeout: float) -> Any:
    """The SDK's OTLP exporter for one signal, configured entirely from ``target`` (no env lookups)."""
    if target.protocol == "grpc":
        import grpc
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

        cls = GrpcSpans if signal == "traces" else GrpcMetrics
        return cls(
            endpoint=target.endpoint, insecure=target.insecure, headers=dict(target.headers) or None,
            timeout=timeout, compression=grpc.Compression.Gzip if target.compression == "gzip" else grpc.Compression.NoCompression,
        )
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

    cls = HttpSpans if signal == "traces" else HttpMetrics
    return cls(
        endpoint=target.endpoint, headers=dict(target.headers), timeout=timeout,
        compression=Compression.Gzip if target.compression == "gzip" else Compression.NoCompression,
    )


# ---------------------------------------------------------------------------------------------------
# Spans
# ---------------------------------------------------------------------------------------------------
class _TokenBucket:
    def __init__(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.tokens = capacity
        self.last: float | None = None

    def refill(self, now: float) -> None:
        if self.last is not None and now > self.last:
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now if self.last is None else max(self.last, now)

    def take(self, n: int) -> int:
        """Grant up to ``n`` tokens; returns how many."""
        granted = max(0, min(n, int(self.tokens)))
        self.tokens -= granted
        return granted


class _StepIds(IdGenerator):
    """Random ids, except the trace id of a step span when one is requested (job-wide traces)."""

    def __init__(self) -> None:
        self.random = RandomIdGenerator()
        self.next_trace_id = 0

    def generate_span_id(self) -> int:
        return self.random.generate_span_id()

    def generate_trace_id(self) -> int:
        if self.next_trace_id:
            return self.next_trace_id
        return self.random.generate_trace_id()


def step_trace_id(job_id: str, restart_count: int, step: int) -> int:
    """The trace id every rank (on every node) uses for step ``step`` of the job."""
    digest = hashlib.sha256(f"dtwatch/{job_id}/{restart_count}/{step}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


@dataclass
class _Step:
    number: int
    kept: bool  # chosen by the stride when first seen
    start: float | None = None  # time of marker `number` (None: not seen)
    first_enter: float = math.inf
    end: float | None = None  # time of marker `number + 1` once seen
    span: Any = None  # open step span
    context: SpanContext | None = None  # the step span's context (kept after it ended)
    seen: int = 0
    emitted: int = 0


def _ns(t: float) -> int:
    return int(round(t * 1e9))


class _RankSpans:
    """Spans of one local rank: its TracerProvider, step spans and sampling state."""

    def __init__(self, owner: OtelExporter, view: NodeView, state: RankState) -> None:
        self.owner = owner
        self.rank = state.rank
        self.job_id, _ = owner._identity(view)
        self.sampling = owner.sampling
        resource = owner._resource({
            "service.instance.id": f"{self.job_id}/rank-{state.rank}",
            "dtwatch.rank": state.rank, "dtwatch.local_rank": state.local_rank,
            "dtwatch.world_size": state.world_size,
        }, view)
        self.ids = _StepIds()
        self.provider = TracerProvider(resource=resource, id_generator=self.ids, shutdown_on_exit=False)
        target = owner.config.traces
        assert target is not None
        self.exporter = _GuardedSpanExporter(_make_exporter("traces", target, owner.config.timeout), owner.health)
        self.processor = BatchSpanProcessor(
            self.exporter, max_queue_size=owner.max_queue_size, schedule_delay_millis=owner.schedule_delay * 1000,
            max_export_batch_size=min(owner.max_export_batch_size, owner.max_queue_size),
            export_timeout_millis=owner.config.timeout * 1000,
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer(SCOPE, _dtwatch_version())
        cap = self.sampling.max_spans_per_second
        self.routine = _TokenBucket(cap, cap * self.sampling.burst_seconds)
        self.priority = _TokenBucket(cap, cap * self.sampling.burst_seconds)
        self.rate: float | None = None
        self.last_now: float | None = None
        self.incarnation: tuple[int, float] | None = None
        self.restart_count = state.restart_count
        self.steps: OrderedDict[int, _Step] = OrderedDict()
        self.marker_times: OrderedDict[int, float] = OrderedDict()
        self.reported: set[tuple[str, int]] = set()
        self.open: set[int] = set()  # steps whose span is open
        self.forgotten = -1  # steps up to this number were dropped from `steps` (late records: no parent)
        self.spans = 0  # spans started (collectives and steps)
        self.sampled_out = 0  # collectives not turned into spans

    # -- per view ------------------------------------------------------------------------------------
    def update(self, view: NodeView, state: RankState, recs: np.ndarray | None, snap: RankSnapshot | None) -> None:
        incarnation = (state.pid, state.start_time)
        if incarnation != self.incarnation:
            if self.incarnation is not None:
                self.close_steps(incomplete=True)
                self.steps.clear()
                self.open.clear()
                self.forgotten = -1
                self.marker_times.clear()
                self.reported.clear()
            self.incarnation, self.restart_count = incarnation, state.restart_count
        self.routine.refill(view.now)
        self.priority.refill(view.now)
        in_stall = view.incident_open and (state.rank in view.stalled_ranks or state.rank in view.culprit_ranks)
        if in_stall and snap is not None:
            self._in_flight(view, state, snap)  # first: the call a rank is stuck in matters most
        elif not view.incident_open:
            self.reported.clear()
        if recs is not None and len(recs) and recs.dtype == RECORD_DTYPE:
            self._records(view, recs, snap, in_stall)
        else:
            self._observe_rate(0, None, view.now)
        while len(self.steps) > MAX_OPEN_STEPS:
            _, old = self.steps.popitem(last=False)
            self.forgotten = max(self.forgotten, old.number)
            if old.span is not None:
                self._finish(old, old.end or old.first_enter, incomplete=old.end is None)

    def _observe_rate(self, n: int, recs: np.ndarray | None, now: float) -> None:
        if self.last_now is None:
            span = float(recs["t_exit"].max() - recs["t_enter"].min()) if recs is not None and n else 0.0
            dt = max(span, 1.0)
        else:
            dt = max(now - self.last_now, 1e-3)
        self.last_now = now
        rate = n / dt
        self.rate = rate if self.rate is None else 0.5 * self.rate + 0.5 * rate

    def stride(self) -> int:
        cap = self.sampling.max_spans_per_second
        factor = 1
        if self.rate is not None and self.rate > cap:
            factor = 2 ** math.ceil(math.log2(self.rate / cap))
        return self.sampling.every_n_steps * factor

    def _step(self, number: int, stride: int) -> _Step | None:
        """The state of step ``number``, created on first sight; None for a step forgotten already."""
        st = self.steps.get(number)
        if st is None and number > self.forgotten:
            st = self.steps[number] = _Step(number, kept=number % stride == 0, start=self.marker_times.get(number))
        return st

    def _records(self, view: NodeView, recs: np.ndarray, snap: RankSnapshot | None, in_stall: bool) -> None:
        marker = (recs["flags"] & FLAG_MARKER) != 0
        calls = np.flatnonzero(~marker & (recs["t_exit"] != 0.0))
        self._observe_rate(len(calls), recs[calls] if len(calls) else None, view.now)
        stride = self.stride()
        selected = np.empty(0, dtype=np.int64)
        if len(calls):
            steps = recs["step"][calls].astype(np.int64)
            enters = recs["t_enter"][calls]
            order = np.argsort(steps, kind="stable")
            uniq, starts, counts = np.unique(steps[order], return_index=True, return_counts=True)
            first_enters = np.minimum.reduceat(enters[order], starts)
            kept = np.zeros(len(uniq), dtype=bool)
            for i, (number, n, t0) in enumerate(zip(uniq.tolist(), counts.tolist(), first_enters.tolist())):
                st = self._step(number, stride)
                if st is not None:
                    st.seen += n
                    st.first_enter = min(st.first_enter, t0)
                    kept[i] = st.kept
            in_kept_step = kept[np.searchsorted(uniq, steps)]
            durations = recs["t_exit"][calls] - enters
            prio = (durations >= self.sampling.slow_threshold) | (recs["status"][calls] == STATUS_ERROR)
            if in_stall:
                prio[:] = True
            routine = calls[in_kept_step & ~prio]
            urgent = calls[prio]
            routine = routine[: self.routine.take(len(routine))]
            urgent = urgent[: self.priority.take(len(urgent))]
            selected = np.concatenate((routine, urgent))
            self.sampled_out += len(calls) - len(selected)
        events = np.sort(np.concatenate((selected, np.flatnonzero(marker))))
        for i in events.tolist():
            row = recs[i]
            if marker[i]:
                self._marker(int(row["step"]), float(row["t_enter"]), stride)
            else:
                self._collective(row, snap)

    def _marker(self, number: int, t: float, stride: int) -> None:
        self.marker_times[number] = t
        while len(self.marker_times) > 4 * MAX_OPEN_STEPS:
            self.marker_times.popitem(last=False)
        nxt = self.steps.get(number)
        if nxt is not None and nxt.start is None:
            nxt.start = t
        prev = self._step(number - 1, stride) if number >= 1 else None
        if prev is not None:
            prev.end = t if prev.end is None else prev.end
            if prev.span is None and prev.context is None and prev.kept and self.routine.take(1):
                self._open(prev)
            if prev.span is not None:
                self._finish(prev, t)
        for n in [n for n in self.open if n < number - 1]:  # steps whose own marker was lost (ring wrapped)
            st = self.steps[n]
            self._finish(st, st.end or t, incomplete=st.end is None)

    def _open(self, st: _Step) -> None:
        start = st.start if st.start is not None else st.first_enter
        if not math.isfinite(start):
            start = st.end if st.end is not None else time.time()
        attrs = {"dtwatch.rank": self.rank, "dtwatch.step": st.number, "dtwatch.sampled": st.kept}
        st.span = self._root_span("step", st.number, attrs, start)
        st.context = st.span.get_span_context()
        self.open.add(st.number)
        self.spans += 1

    def _root_span(self, name: str, step: int, attrs: dict[str, Any], start: float) -> Any:
        """A span without parent; with job-wide traces, in the trace of ``step`` shared by all ranks."""
        if self.sampling.job_wide_traces:
            self.ids.next_trace_id = step_trace_id(self.job_id, self.restart_count, step)
        try:
            return self.tracer.start_span(name, context=Context(), kind=SpanKind.INTERNAL, attributes=attrs, start_time=_ns(start))
        finally:
            self.ids.next_trace_id = 0

    def _finish(self, st: _Step, end: float, incomplete: bool = False) -> None:
        span, st.span = st.span, None
        if span is None:
            return
        self.open.discard(st.number)
        span.set_attribute("dtwatch.collectives", st.seen)
        span.set_attribute("dtwatch.spans_dropped", max(0, st.seen - st.emitted))
        if incomplete:
            span.set_attribute("dtwatch.step_incomplete", True)
        span.end(end_time=_ns(end))

    def _parent(self, number: int) -> Any:
        """(step, context) for a child of step ``number``; (None, None) for a step forgotten long ago."""
        st = self.steps.get(number)
        if st is None:
            return None, None
        if st.context is None:
            self._open(st)
        assert st.context is not None
        return st, trace_api.set_span_in_context(NonRecordingSpan(st.context))

    def _child_span(self, rec: Record, ctx: Any, attrs: dict[str, Any]) -> Any:
        if ctx is None:  # a late completion of a forgotten step: a root span in that step's trace
            return self._root_span(rec.op, rec.step, attrs, rec.t_enter)
        return self.tracer.start_span(rec.op, context=ctx, kind=SpanKind.INTERNAL, attributes=attrs, start_time=_ns(rec.t_enter))

    def _collective(self, row: np.void, snap: RankSnapshot | None) -> None:
        rec = _record(row, snap)
        st, ctx = self._parent(rec.step)
        span = self._child_span(rec, ctx, _call_attributes(rec, self.rank))
        if rec.status == STATUS_ERROR:
            span.set_status(Status(StatusCode.ERROR, "the collective raised"))
        span.end(end_time=_ns(rec.t_exit))
        self.spans += 1
        if st is not None:
            st.emitted += 1
            if st.end is not None and st.span is not None:  # a late child of a step already over
                self._finish(st, st.end)

    def _in_flight(self, view: NodeView, state: RankState, snap: RankSnapshot) -> None:
        """Calls a stalled rank is still inside: one span each, ending now, status ERROR."""
        for rec in snap.open_records()[-MAX_IN_FLIGHT_SPANS:]:
            key = (rec.group, rec.seq)
            if key in self.reported or not self.priority.take(1):
                continue
            self.reported.add(key)
            st = self._step(rec.step, self.stride())
            if st is not None:
                st.first_enter = min(st.first_enter, rec.t_enter)
            _, ctx = self._parent(rec.step)
            attrs = _call_attributes(rec, self.rank)
            attrs.update({"dtwatch.in_flight": True, "dtwatch.stalled": True})
            span = self._child_span(rec, ctx, attrs)
            span.set_status(Status(StatusCode.ERROR, f"still in flight after {view.now - rec.t_enter:.1f} s during a stall"))
            span.end(end_time=_ns(max(view.now, rec.t_enter)))
            self.spans += 1

    def close_steps(self, incomplete: bool) -> None:
        """End every open step span (at its last known time)."""
        for st in self.steps.values():
            if st.span is not None:
                self._finish(st, st.end if st.end is not None else time.time(), incomplete=incomplete and st.end is None)


def _record(row: np.void, snap: RankSnapshot | None) -> Record:
    if snap is not None:
        return snap.record(row)
    op = int(row["op"])
    dt = int(row["dtype"])
    return Record(
        stamp=int(row["stamp"]), seq=int(row["seq"]), seq_span=int(row["seq_span"]),
        op=OPS[op] if op < len(OPS) else "unknown", group=str(int(row["group"])), site=None,
        t_enter=float(row["t_enter"]), t_exit=float(row["t_exit"]), status=int(row["status"]),
        flags=int(row["flags"]), dtype=DTYPES[dt] if dt < len(DTYPES) else "unknown", shape=(),
        numel=int(row["numel"]), ntensors=int(row["ntensors"]), peer=int(row["peer"]), step=int(row["step"]),
    )


def _call_attributes(rec: Record, rank: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "dtwatch.op": rec.op, "dtwatch.group": rec.group, "dtwatch.seq": rec.seq,
        "dtwatch.bytes": max(rec.numel, 0) * DTYPE_ITEMSIZE.get(rec.dtype, 0), "dtwatch.dtype": rec.dtype,
        "dtwatch.rank": rank, "dtwatch.step": rec.step, "dtwatch.async": bool(rec.flags & FLAG_ASYNC),
    }
    if rec.seq_span > 1:
        attrs["dtwatch.seq_span"] = rec.seq_span
    if rec.peer >= 0:
        attrs["dtwatch.peer"] = rec.peer
    if rec.site is not None:
        attrs.update({"code.filepath": rec.site.file, "code.lineno": rec.site.line, "code.function": rec.site.function})
    return attrs


# ---------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------
class _NodeMeters:
    """The node's MeterProvider: observable instruments over NodeMetrics, plus injected histograms."""

    def __init__(self, owner: OtelExporter, view: NodeView) -> None:
        self.metrics = owner.metrics
        target = owner.config.metrics
        assert target is not None
        job_id, node = owner._identity(view)
        resource = owner._resource({"service.instance.id": f"{job_id}/{node}"}, view)
        self.exporter = _GuardedMetricExporter(
            _make_exporter("metrics", target, owner.config.timeout), owner.health, self._histograms, resource
        )
        self.reader = PeriodicExportingMetricReader(
            self.exporter, export_interval_millis=owner.metric_interval * 1000,
            export_timeout_millis=owner.config.timeout * 1000,
        )
        self.provider = MeterProvider(resource=resource, metric_readers=[self.reader], shutdown_on_exit=False)
        meter = self.provider.get_meter(SCOPE, _dtwatch_version())
        for spec in METRICS:
            if spec.kind == "gauge":
                meter.create_observable_gauge(spec.name, callbacks=[self._callback(spec.name)], unit=spec.unit, description=spec.help)
            elif spec.kind == "counter":
                meter.create_observable_counter(spec.name, callbacks=[self._callback(spec.name)], unit=spec.unit, description=spec.help)
        self._last: dict[tuple[str, tuple[str, ...]], tuple[np.ndarray, float]] = {}
        self._last_time = _ns(self.metrics.created)

    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            fam = self.metrics.families().get(name)
            if fam is None:
                return []
            labels = fam.spec.labels
            return [Observation(value, dict(zip(labels, values))) for values, value in fam.samples]

        return observe

    def _histograms(self, temporality: AggregationTemporality) -> list[Metric]:
        now = time.time_ns()
        out = []
        for fam in self.metrics.families().values():
            if fam.spec.kind != "histogram" or not fam.histograms:
                continue
            points = [self._point(fam.spec.name, fam.spec.labels, labels, h, now, temporality) for labels, h in fam.histograms]
            out.append(Metric(fam.spec.name, fam.spec.help, fam.spec.unit, HistogramData([p for p in points if p is not None], temporality)))
        self._last_time = now
        return out

    def _point(self, name: str, labelnames: tuple[str, ...], labels: tuple[str, ...], h: Histogram, now: int, temporality: AggregationTemporality) -> HistogramDataPoint | None:
        counts, total = h.counts, h.sum
        start = _ns(self.metrics.created)
        if temporality == AggregationTemporality.DELTA:
            prev = self._last.get((name, labels))
            self._last[(name, labels)] = (counts.copy(), total)
            if prev is not None:
                counts, total = counts - prev[0], total - prev[1]
            start = self._last_time
        count = int(counts.sum())
        return HistogramDataPoint(
            attributes=dict(zip(labelnames, labels)), start_time_unix_nano=start, time_unix_nano=now,
            count=count, sum=float(total), bucket_counts=[int(c) for c in counts],
            explicit_bounds=[float(b) for b in h.bounds],
            min=h.min if count and math.isfinite(h.min) else 0.0, max=h.max if count and math.isfinite(h.max) else 0.0,
        )


# ---------------------------------------------------------------------------------------------------
# The exporter
# ---------------------------------------------------------------------------------------------------
class OtelExporter:
    """Exports NodeViews as OTLP spans and metrics (see the module docstring for the policies).

    ``update(view)`` once per watchdog poll (it does the span selection and hands spans to the SDK's
    batch processors; network I/O happens in the SDK's threads); ``shutdown()`` once at the end.
    ``job_id``/``node`` name the job and node in resources (default: the view's).
    Raises :class:`OtelConfigError` for a bad argument or when no endpoint is configured at all;
    :meth:`from_env` returns None instead in that case.
    """

    def __init__(
        self,
        *,
        job_id: str | None = None,
        node: str | None = None,
        endpoint: str | None = None,
        protocol: str | None = None,
        traces_endpoint: str | None = None,
        metrics_endpoint: str | None = None,
        headers: Mapping[str, str] | None = None,
        compression: str | None = None,
        timeout: float | None = None,
        service_name: str | None = None,
        resource_attributes: Mapping[str, str] | None = None,
        metric_interval: float = 10.0,
        sampling: SpanSampling | None = None,
        max_queue_size: int = 512,
        max_export_batch_size: int = 256,
        schedule_delay: float = 1.0,
        retry_after: float = 30.0,
        gpu: GpuSampler | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        for name, value in (("metric_interval", metric_interval), ("schedule_delay", schedule_delay), ("retry_after", retry_after)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise OtelConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        for name, value in (("max_queue_size", max_queue_size), ("max_export_batch_size", max_export_batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OtelConfigError(f"{name} must be a positive integer, got {value!r}")
        self.config = resolve_config(
            endpoint=endpoint, protocol=protocol, traces_endpoint=traces_endpoint, metrics_endpoint=metrics_endpoint,
            headers=headers, compression=compression, timeout=timeout, service_name=service_name,
            resource_attributes=resource_attributes, environ=environ,
        )
        if self.config.traces is None and self.config.metrics is None:
            raise OtelConfigError(
                "no OTLP endpoint configured: pass endpoint= (--otlp-endpoint) or set OTEL_EXPORTER_OTLP_ENDPOINT"
            )
        self.sampling = sampling or SpanSampling()
        self.metric_interval = float(metric_interval)
        self.max_queue_size = max_queue_size
        self.max_export_batch_size = max_export_batch_size
        self.schedule_delay = float(schedule_delay)
        self.job_id, self.node = job_id, node
        self.metrics = NodeMetrics(gpu=gpu, job_id=job_id or "", node=node or "")
        where = ", ".join(sorted({t.endpoint for t in (self.config.traces, self.config.metrics) if t is not None}))
        self.health = _ExportHealth(where, float(retry_after))
        self._capture = _SdkLogCapture(self.health)
        self._capture.install()
        self._ranks: dict[int, _RankSpans] = {}
        self._meters: _NodeMeters | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._update_failed = False

    @classmethod
    def from_env(cls, *, endpoint: str | None = None, environ: Mapping[str, str] | None = None, **kwargs: Any) -> OtelExporter | None:
        """An exporter if an endpoint is given or configured (and ``OTEL_SDK_DISABLED`` is not true), else None."""
        if not otlp_configured(endpoint, environ):
            return None
        return cls(endpoint=endpoint, environ=environ, **kwargs)

    # -- per poll ------------------------------------------------------------------------------------
    def update(self, view: NodeView) -> None:
        """Fold one NodeView in: metrics state, and spans for its new records. Never raises."""
        with self._lock:
            if self._closed:
                return
            try:
                self.metrics.update(view)
                if self.config.metrics is not None and self._meters is None:
                    self._meters = _NodeMeters(self, view)
                if self.config.traces is not None:
                    for state in view.local:
                        spans = self._ranks.get(state.rank)
                        if spans is None:
                            spans = self._ranks[state.rank] = _RankSpans(self, view, state)
                        spans.update(view, state, view.new_records.get(state.rank), view.snapshots.get(state.rank))
            except Exception as exc:
                if not self._update_failed:
                    self._update_failed = True
                    log.warning("dtwatch: OpenTelemetry export of a view failed (%r); further failures are logged at debug", exc)
                log.debug("dtwatch: OpenTelemetry update failed", exc_info=True)

    def flush(self, timeout: float = 5.0) -> bool:
        """Export what is queued now (spans and a metrics collection); True if all finished in time."""
        with self._lock:
            providers = [r.provider for r in self._ranks.values()] + ([self._meters.provider] if self._meters else [])
        ok = True
        deadline = time.monotonic() + timeout
        for p in providers:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                ok = bool(p.force_flush(int(remaining * 1000))) and ok
            except Exception:  # noqa: BLE001
                ok = False
        return ok

    def shutdown(self, timeout: float = 5.0) -> None:
        """End open step spans, flush, and stop every provider; returns within about ``timeout`` seconds."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for spans in self._ranks.values():
                try:
                    spans.close_steps(incomplete=True)
                except Exception:
                    log.debug("dtwatch: closing step spans failed", exc_info=True)
            providers: list[Callable[[], Any]] = [r.provider.shutdown for r in self._ranks.values()]
            if self._meters is not None:
                meters = self._meters.provider
                providers.append(lambda: meters.shutdown(timeout_millis=timeout * 1000))
        threads = [threading.Thread(target=_quietly, args=(fn,), name="dtwatch-otel-shutdown", daemon=True) for fn in providers]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            log.debug("dtwatch: OpenTelemetry shutdown did not finish within %.1f s; leaving it to daemon threads", timeout)
        self._capture.uninstall()

    # -- introspection ---------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """Counts for tests and the watchdog's self-metrics: spans made, collectives sampled out, failures."""
        return {
            "spans": sum(r.spans for r in self._ranks.values()),
            "sampled_out": sum(r.sampled_out for r in self._ranks.values()),
            "spans_exported": sum(r.exporter.exported for r in self._ranks.values()),
            "export_failures": self.health.failures,
            "exports_skipped": self.health.skipped,
        }

    def _identity(self, view: NodeView) -> tuple[str, str]:
        return self.job_id or view.job_id, self.node or view.node

    def _resource(self, extra: dict[str, Any], view: NodeView) -> Resource:
        attrs: dict[str, Any] = {
            "telemetry.sdk.language": "python", "telemetry.sdk.name": "opentelemetry",
            "telemetry.sdk.version": _sdk_version,
        }
        attrs.update(self.config.resource_attributes)
        job_id, node = self._identity(view)
        attrs.update({
            "service.name": self.config.service_name, "service.version": _dtwatch_version(),
            "dtwatch.job_id": job_id, "host.name": node, "dtwatch.node": node,
        })
        attrs.update(extra)
        return Resource(attrs)


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        log.debug("dtwatch: OpenTelemetry shutdown step failed", exc_info=True)


def _dtwatch_version() -> str:
    from dtwatch import __version__

    return __version__


__all__ = [
    "OtelConfigError",
    "OtelExporter",
    "OtlpConfig",
    "SignalTarget",
    "SpanSampling",
    "otlp_configured",
    "parse_resource_attributes",
    "resolve_config",
    "step_trace_id",
]
