"""OTLP metrics: the metric set of ``docs/metrics.md`` from one MeterProvider per node.

Same names and attributes (labels) as the Prometheus exporter, read from the latest view by
observable gauges and counters and exported by a ``PeriodicExportingMetricReader`` every
``metric_interval`` seconds (resource: ``service.instance.id = <job>/<node>``). The three histograms
are not SDK instruments: recording per collective costs ~20 us in the SDK, so they are the exact
numpy-bucketed histograms of :class:`dtwatch.export.node_metrics.NodeMetrics`, added to each export
as histogram points (cumulative, or delta when ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``
asks for it).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import numpy as np
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from dtwatch.export.metrics import METRICS
from dtwatch.export.node_metrics import Histogram, NodeMetrics
from dtwatch.export.otel.failures import ExportHealth, GuardedMetricExporter
from dtwatch.export.otel.resource import SCOPE, dtwatch_version


def _ns(t: float) -> int:
    return int(round(t * 1e9))


class NodeMeters:
    """The node's MeterProvider: observable instruments over NodeMetrics, plus injected histograms."""

    def __init__(
        self, metrics: NodeMetrics, otlp: MetricExporter, health: ExportHealth, resource: Resource,
        *, interval: float, timeout: float,
    ) -> None:
        self.metrics = metrics
        self.resource = resource
        self.scope = InstrumentationScope(SCOPE, dtwatch_version())
        preferred = getattr(otlp, "_preferred_temporality", None) or {}
        self.histogram_temporality = preferred.get(HistogramInstrument) or AggregationTemporality.CUMULATIVE
        self._last: dict[tuple[str, tuple[str, ...]], tuple[np.ndarray, float]] = {}  # delta: previous totals
        self._last_time = _ns(self.metrics.created)
        self.exporter = GuardedMetricExporter(otlp, health, self._with_histograms)
        self.reader = PeriodicExportingMetricReader(
            self.exporter, export_interval_millis=interval * 1000, export_timeout_millis=timeout * 1000,
        )
        self.provider = MeterProvider(resource=resource, metric_readers=[self.reader], shutdown_on_exit=False)
        meter = self.provider.get_meter(SCOPE, dtwatch_version())
        for spec in METRICS:
            callbacks = [self._callback(spec.name)]
            if spec.kind == "gauge":
                meter.create_observable_gauge(spec.name, callbacks=callbacks, unit=spec.unit, description=spec.help)
            elif spec.kind == "counter":
                meter.create_observable_counter(spec.name, callbacks=callbacks, unit=spec.unit, description=spec.help)

    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            fam = self.metrics.families().get(name)
            if fam is None:
                return []
            labels = fam.spec.labels
            return [Observation(value, dict(zip(labels, values, strict=True))) for values, value in fam.samples]

        return observe

    # -- histograms, added to each export ------------------------------------------------------------
    def _with_histograms(self, data: MetricsData | None) -> MetricsData:
        """``data`` with this node's histograms added to dtwatch's scope (created if absent)."""
        extra = self._histograms(self.histogram_temporality)
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

    def _histograms(self, temporality: AggregationTemporality) -> list[Metric]:
        now = time.time_ns()
        out = []
        for fam in self.metrics.families().values():
            spec = fam.spec
            if spec.kind != "histogram" or not fam.histograms:
                continue
            points = [self._point(spec.name, spec.labels, labels, h, now, temporality) for labels, h in fam.histograms]
            out.append(Metric(spec.name, spec.help, spec.unit, HistogramData(points, temporality)))
        self._last_time = now
        return out

    def _point(
        self, name: str, labelnames: tuple[str, ...], labels: tuple[str, ...], h: Histogram, now: int,
        temporality: AggregationTemporality,
    ) -> HistogramDataPoint:
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
            attributes=dict(zip(labelnames, labels, strict=True)), start_time_unix_nano=start, time_unix_nano=now,
            count=count, sum=float(total), bucket_counts=[int(c) for c in counts],
            explicit_bounds=[float(b) for b in h.bounds],
            min=h.min if count and math.isfinite(h.min) else 0.0, max=h.max if count and math.isfinite(h.max) else 0.0,
        )
