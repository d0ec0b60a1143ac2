"""The OTLP exporter the watchdog drives: NodeViews in, spans and metrics out, never an exception."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from dtwatch.export.node_metrics import NodeMetrics
from dtwatch.export.otel.failures import ExportHealth, GuardedSpanExporter, SdkLogCapture
from dtwatch.export.otel.meters import NodeMeters
from dtwatch.export.otel.otel_config import (
    OtelConfigError,
    make_metric_exporter,
    make_span_exporter,
    otlp_configured,
    resolve_config,
)
from dtwatch.export.otel.resource import make_resource
from dtwatch.export.otel.sampling import SpanSampling
from dtwatch.export.otel.spans import RankSpans

if TYPE_CHECKING:
    from dtwatch.diagnose.rank_state import RankState
    from dtwatch.export.nvml import GpuSampler
    from dtwatch.export.view import NodeView

log = logging.getLogger("dtwatch.export.otel")


class OtelExporter:
    """Exports NodeViews as OTLP spans and metrics (see :mod:`dtwatch.export.otel` for the policies).

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
        for name, value in (
            ("metric_interval", metric_interval), ("schedule_delay", schedule_delay), ("retry_after", retry_after)
        ):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise OtelConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        for name, count in (("max_queue_size", max_queue_size), ("max_export_batch_size", max_export_batch_size)):
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise OtelConfigError(f"{name} must be a positive integer, got {count!r}")
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
        # The SDK's queue drops its *oldest* spans when full, so it holds at least what the sampling policy
        # lets one rank end in one update (a backlog read at start-up, a stall's burst of urgent spans).
        self.max_queue_size = max(max_queue_size, self.sampling.most_spans_at_once())
        self.max_export_batch_size = max_export_batch_size
        self.schedule_delay = float(schedule_delay)
        self.job_id, self.node = job_id, node
        self.metrics = NodeMetrics(gpu=gpu, job_id=job_id or "", node=node or "")
        where = ", ".join(sorted({t.endpoint for t in (self.config.traces, self.config.metrics) if t is not None}))
        self.health = ExportHealth(where, float(retry_after))
        self._capture = SdkLogCapture(self.health)
        self._capture.install()
        self._ranks: dict[int, RankSpans] = {}
        self._span_exporters: list[GuardedSpanExporter] = []
        self._meters: NodeMeters | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._update_failed = False

    @classmethod
    def from_env(
        cls, *, endpoint: str | None = None, environ: Mapping[str, str] | None = None, **kwargs: Any
    ) -> OtelExporter | None:
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
                    self._meters = self._node_meters(view)
                if self.config.traces is not None:
                    for state in view.local:
                        spans = self._ranks.get(state.rank)
                        if spans is None:
                            spans = self._ranks[state.rank] = self._rank_spans(view, state)
                        spans.update(view, state, view.new_records.get(state.rank), view.snapshots.get(state.rank))
            except Exception as exc:
                if not self._update_failed:
                    self._update_failed = True
                    log.warning(
                        "dtwatch: OpenTelemetry export of a view failed (%r); further failures are logged at debug", exc
                    )
                log.debug("dtwatch: OpenTelemetry update failed", exc_info=True)

    def flush(self, timeout: float = 5.0) -> bool:
        """Export what is queued now (spans and a metrics collection); True if all finished in time."""
        with self._lock:
            providers: list[Any] = [r.provider for r in self._ranks.values()]
            if self._meters is not None:
                providers.append(self._meters.provider)
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
        threads = [
            threading.Thread(target=_quietly, args=(fn,), name="dtwatch-otel-shutdown", daemon=True) for fn in providers
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            log.debug(
                "dtwatch: OpenTelemetry shutdown did not finish within %.1f s; leaving it to daemon threads", timeout
            )
        self._capture.uninstall()

    # -- introspection ---------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """Counts for tests and the watchdog's self-metrics: spans made, collectives sampled out, failures."""
        return {
            "spans": sum(r.spans for r in self._ranks.values()),
            "sampled_out": sum(r.sampled_out for r in self._ranks.values()),
            "spans_exported": sum(e.exported for e in self._span_exporters),
            "export_failures": self.health.failures,
            "exports_skipped": self.health.skipped,
        }

    # -- wiring ------------------------------------------------------------------------------------------
    def _rank_spans(self, view: NodeView, state: RankState) -> RankSpans:
        target = self.config.traces
        assert target is not None
        job_id, _ = self._identity(view)
        exporter = GuardedSpanExporter(make_span_exporter(target, self.config.timeout), self.health)
        processor: SpanProcessor = BatchSpanProcessor(
            exporter, max_queue_size=self.max_queue_size, schedule_delay_millis=self.schedule_delay * 1000,
            max_export_batch_size=min(self.max_export_batch_size, self.max_queue_size),
            export_timeout_millis=self.config.timeout * 1000,
        )
        resource = self._resource({
            "service.instance.id": f"{job_id}/rank-{state.rank}",
            "dtwatch.rank": state.rank, "dtwatch.local_rank": state.local_rank,
            "dtwatch.world_size": state.world_size,
        }, view)
        spans = RankSpans(
            rank=state.rank, job_id=job_id, restart_count=state.restart_count, resource=resource,
            sampling=self.sampling, processor=processor,
        )
        self._span_exporters.append(exporter)
        return spans

    def _node_meters(self, view: NodeView) -> NodeMeters:
        target = self.config.metrics
        assert target is not None
        job_id, node = self._identity(view)
        return NodeMeters(
            self.metrics, make_metric_exporter(target, self.config.timeout), self.health,
            self._resource({"service.instance.id": f"{job_id}/{node}"}, view),
            interval=self.metric_interval, timeout=self.config.timeout,
        )

    def _identity(self, view: NodeView) -> tuple[str, str]:
        return self.job_id or view.job_id, self.node or view.node

    def _resource(self, extra: dict[str, Any], view: NodeView) -> Resource:
        job_id, node = self._identity(view)
        return make_resource(self.config, job_id, node, extra)


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        log.debug("dtwatch: OpenTelemetry shutdown step failed", exc_info=True)
