"""Prometheus exporter of the watchdog: the metrics of ``docs/metrics.md``, rendered from NodeViews.

The watchdog hands every :class:`~dtwatch.export.view.NodeView` it builds to :meth:`PrometheusExporter.update`;
each scrape renders the latest one, from the cumulative state of
:class:`~dtwatch.export.node_metrics.NodeMetrics` (which also feeds :mod:`dtwatch.export.otel`). The
metric contract (names, types, labels) is :data:`~dtwatch.export.metrics.METRICS`, which mirrors the
table in ``docs/metrics.md``; a test keeps the two equal. :class:`~dtwatch.export.server.MetricsServer`
serves the collector's registry over HTTP::

    from dtwatch.export.prometheus import PrometheusExporter
    from dtwatch.export.server import MetricsServer

    exporter = PrometheusExporter(job_id=job_id, node=node)   # its own CollectorRegistry, not the global one
    server = MetricsServer(exporter.registry, addr="0.0.0.0", port=9464,
                           health_fn=watchdog.healthy, url_file=f"{run_dir}/watchdog-{node}.json",
                           node=node)                # MetricsBindError (an OSError) if the port is taken
    server.ready = True                              # /readyz answers 200 from now on
    while running:
        exporter.update(view)                        # every poll
    server.close()

The contract, model and server names are importable from here too, as they were before they got
modules of their own.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from dtwatch.export.metrics import DURATION_BUCKETS, METRICS, MetricSpec
from dtwatch.export.node_metrics import Family, Histogram, NodeMetrics
from dtwatch.export.server import MetricsBindError, MetricsServer

if TYPE_CHECKING:
    from dtwatch.export.nvml import GpuSampler
    from dtwatch.export.view import NodeView


class PrometheusExporter(Collector):
    """A Prometheus collector that renders the latest NodeView on each scrape.

    It registers itself in ``registry`` (default: a new :class:`CollectorRegistry`, never the global
    one), so several watchdogs or tests in one process do not collide. ``job_id``/``node`` label the
    build-info series served before the first view; afterwards every label comes from the view::

        exporter = PrometheusExporter(job_id="job7", node="n1", gpu=GpuSampler())
        exporter.update(view)
        print(prometheus_client.generate_latest(exporter.registry).decode())
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        job_id: str = "",
        node: str = "",
        buckets: Iterable[float] = DURATION_BUCKETS,
        gpu: GpuSampler | None = None,
    ) -> None:
        self.metrics = NodeMetrics(buckets=buckets, gpu=gpu, job_id=job_id, node=node)
        self.registry = CollectorRegistry() if registry is None else registry
        self.registry.register(self)

    def update(self, view: NodeView) -> None:
        """Fold one NodeView in (call once per watchdog poll)."""
        self.metrics.update(view)

    def shutdown(self) -> None:
        """Nothing to release (the registry and a shared GpuSampler belong to the caller)."""

    def describe(self) -> Iterator[Metric]:
        """The metric names, without samples (lets the registry refuse a clashing collector)."""
        for spec in METRICS:
            yield _empty_family(spec)

    def collect(self) -> Iterator[Metric]:
        """Every metric of the latest view in prometheus_client's families."""
        for fam in self.metrics.families().values():
            yield _prometheus_family(fam)


def _empty_family(spec: MetricSpec) -> Metric:
    cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}[spec.kind]
    return cls(spec.name, spec.help, labels=spec.labels)


def _prometheus_family(fam: Family) -> Metric:
    spec = fam.spec
    if spec.kind == "histogram":
        histogram = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
        for labels, h in fam.histograms:
            cumulative = np.cumsum(h.counts)
            buckets = [(floatToGoString(b), int(c)) for b, c in zip(h.bounds, cumulative[:-1], strict=True)]
            buckets.append(("+Inf", int(cumulative[-1])))
            histogram.add_metric(list(labels), buckets, h.sum)
        return histogram
    family = GaugeMetricFamily if spec.kind == "gauge" else CounterMetricFamily
    metric = family(spec.name, spec.help, labels=spec.labels)
    for labels, value in fam.samples:
        metric.add_metric(list(labels), value)
    return metric


__all__ = [
    "DURATION_BUCKETS",
    "METRICS",
    "Family",
    "Histogram",
    "MetricSpec",
    "MetricsBindError",
    "MetricsServer",
    "NodeMetrics",
    "PrometheusExporter",
]
