"""Prometheus exporter of the watchdog: the metrics of ``docs/metrics.md``, rendered from NodeViews.

The watchdog hands every :class:`~dtwatch.export.view.NodeView` it builds to :meth:`PrometheusExporter.update`;
each scrape renders the latest one. Gauges are read from the view as it stands; counters and
histograms are cumulative over views (``collectives_total`` and the duration histogram from the
view's ``new_records``, step durations from consecutive step markers), so a scrape never misses
what happened between two scrapes. A wedged rank keeps being reported precisely: the numbers come
from its ring, not from the rank.

Serving them::

    from dtwatch.export.prometheus import MetricsServer, PrometheusExporter

    exporter = PrometheusExporter(job_id=job_id, node=node)   # its own CollectorRegistry, not the global one
    server = MetricsServer(exporter.registry, addr="0.0.0.0", port=9464,
                           health_fn=watchdog.healthy, url_file=f"{run_dir}/watchdog-{node}.json",
                           node=node)                # MetricsBindError (an OSError) if the port is taken
    server.ready = True                              # /readyz answers 200 from now on
    while running:
        exporter.update(view)                        # every poll
    server.close()

:class:`NodeMetrics` (the cumulative state, with numpy) also feeds :mod:`dtwatch.export.otel`, which exports
the same metric set over OTLP. The metric contract (names, types, labels) is :data:`METRICS`,
which mirrors the table in ``docs/metrics.md``; a test keeps the two equal.
"""
from __future__ import annotations

import errno as errno_mod
import gzip
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from dtwatch.ring import FLAG_MARKER, OPS, RECORD_DTYPE, STATUS_IN_FLIGHT

if TYPE_CHECKING:
    from dtwatch.export.nvml import GpuSampler
    from dtwatch.export.view import NodeView

log = logging.getLogger("dtwatch.export.prometheus")

# Log-spaced bucket bounds (seconds) shared by the three duration histograms: 100 us to 5 minutes.
DURATION_BUCKETS: tuple[float, ...] = (
    1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0,
)

_RANK = ("job_id", "node", "rank", "local_rank")
_NODE = ("job_id", "node")


@dataclass(frozen=True)
class MetricSpec:
    """One row of the metric contract: Prometheus name and type, label names, help, OTel unit."""

    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    labels: tuple[str, ...]
    help: str
    unit: str = ""  # UCUM unit for OpenTelemetry ("s", "By", "W", "Cel", "1")


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("dtwatch_collective_seq", "gauge", _RANK + ("group",), "Last sequence number this rank entered in this group (torch's numbering; includes C++-issued collectives)."),
    MetricSpec("dtwatch_collective_seq_completed", "gauge", _RANK + ("group",), "Last sequence number known completed on this rank in this group."),
    MetricSpec("dtwatch_collective_seq_lag", "gauge", _RANK + ("group",), "Collectives this rank is behind the most advanced member of the group."),
    MetricSpec("dtwatch_collectives_total", "counter", _RANK + ("op",), "Collectives issued from Python and completed, by op."),
    MetricSpec("dtwatch_collective_duration_seconds", "histogram", _RANK + ("op",), "Time from entering to leaving a collective (async: until its work completed).", "s"),
    MetricSpec("dtwatch_collective_time_seconds_total", "counter", _RANK, "Total time spent inside collectives.", "s"),
    MetricSpec("dtwatch_rank_in_collective", "gauge", _RANK, "1 while the rank is inside a Python-issued (synchronous) collective."),
    MetricSpec("dtwatch_seconds_since_progress", "gauge", _RANK, "Seconds since this rank last entered or left a collective or finished a step.", "s"),
    MetricSpec("dtwatch_steps_total", "counter", _RANK, "Training steps (optimizer steps, or dtwatch.step())."),
    MetricSpec("dtwatch_step_duration_seconds", "histogram", _RANK, "Wall time between consecutive steps.", "s"),
    MetricSpec("dtwatch_rank_stalled", "gauge", _RANK, "1 while the rank is part of an open stall incident (waiting or culprit)."),
    MetricSpec("dtwatch_rank_culprit", "gauge", _RANK, "1 while the rank is named as the cause of an open stall."),
    MetricSpec("dtwatch_rank_up", "gauge", _RANK, "1 while the rank's process is alive."),
    MetricSpec("dtwatch_rank_heartbeat_age_seconds", "gauge", _RANK, "Age of the rank's in-process heartbeat (large while alive = wedged).", "s"),
    MetricSpec("dtwatch_rank_restarts_total", "counter", _RANK, "Times the rank's process was replaced (torchrun restarts)."),
    MetricSpec("dtwatch_dataloader_length", "gauge", _RANK + ("loader",), "len() of each DataLoader the rank iterates, as of its latest epoch."),
    MetricSpec("dtwatch_straggler_lag_seconds", "gauge", _RANK, "Median delay of this rank entering collectives behind the first rank.", "s"),
    MetricSpec("dtwatch_rank_straggler", "gauge", _RANK, "1 while the watchdog names this rank as the straggler (re-evaluated every poll)."),
    MetricSpec("dtwatch_findings_total", "counter", _NODE + ("kind", "severity"), "Findings raised by the watchdog."),
    MetricSpec("dtwatch_incidents_total", "counter", _NODE, "Stall incidents opened."),
    MetricSpec("dtwatch_incident_open", "gauge", _NODE, "1 while a stall incident is open."),
    MetricSpec("dtwatch_stall_window_seconds", "gauge", _NODE, "The stall window in force (adapts to the job).", "s"),
    MetricSpec("dtwatch_watchdog_ranks", "gauge", _NODE, "Ranks this watchdog watches."),
    MetricSpec("dtwatch_watchdog_poll_duration_seconds", "histogram", _NODE, "Time one watchdog poll takes.", "s"),
    MetricSpec("dtwatch_watchdog_errors_total", "counter", _NODE + ("component",), "The watchdog's own errors (store, dump, export, webhook)."),
    MetricSpec("dtwatch_watchdog_info", "gauge", _NODE + ("version",), "Build info (always 1)."),
    MetricSpec("dtwatch_gpu_utilization_ratio", "gauge", _RANK + ("gpu",), "GPU utilisation 0..1 (NVML).", "1"),
    MetricSpec("dtwatch_gpu_memory_used_bytes", "gauge", _RANK + ("gpu",), "GPU memory used.", "By"),
    MetricSpec("dtwatch_gpu_memory_total_bytes", "gauge", _RANK + ("gpu",), "GPU memory total.", "By"),
    MetricSpec("dtwatch_gpu_power_watts", "gauge", _RANK + ("gpu",), "GPU power draw.", "W"),
    MetricSpec("dtwatch_gpu_temperature_celsius", "gauge", _RANK + ("gpu",), "GPU temperature.", "Cel"),
)
SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}

# GpuSampler reading -> metric name.
_GPU_FIELDS = {
    "utilization": "dtwatch_gpu_utilization_ratio",
    "memory_used": "dtwatch_gpu_memory_used_bytes",
    "memory_total": "dtwatch_gpu_memory_total_bytes",
    "power_watts": "dtwatch_gpu_power_watts",
    "temperature_celsius": "dtwatch_gpu_temperature_celsius",
}


# ---------------------------------------------------------------------------------------------------
# Cumulative state
# ---------------------------------------------------------------------------------------------------
class Histogram:
    """A cumulative histogram over fixed bucket bounds; ``add`` takes a numpy array of observations.

    ``counts[i]`` counts observations in ``(bounds[i-1], bounds[i]]``; the last slot is ``+Inf``.
    """

    def __init__(self, bounds: np.ndarray) -> None:
        self.bounds = bounds
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self.sum = 0.0
        self.min = float("inf")
        self.max = float("-inf")

    def add(self, values: np.ndarray) -> None:
        """Count an array of observations (one searchsorted + one bincount)."""
        if len(values) == 0:
            return
        self.counts += np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=len(self.counts))
        self.sum += float(values.sum())
        self.min = min(self.min, float(values.min()))
        self.max = max(self.max, float(values.max()))

    @property
    def count(self) -> int:
        return int(self.counts.sum())


class _OpHistograms:
    """Per-op duration histograms of one rank, updated for all ops with one bincount."""

    def __init__(self, bounds: np.ndarray) -> None:
        self.bounds = bounds
        self.nb = len(bounds) + 1
        self.counts = np.zeros((len(OPS), self.nb), dtype=np.int64)
        self.sums = np.zeros(len(OPS), dtype=np.float64)
        self.mins = np.full(len(OPS), np.inf)
        self.maxs = np.full(len(OPS), -np.inf)

    def add(self, ops: np.ndarray, durations: np.ndarray) -> None:
        if len(ops) == 0:
            return
        idx = np.searchsorted(self.bounds, durations, side="left")
        flat = ops.astype(np.int64) * self.nb + idx
        self.counts += np.bincount(flat, minlength=self.counts.size).reshape(self.counts.shape)
        self.sums += np.bincount(ops, weights=durations, minlength=len(OPS))
        np.minimum.at(self.mins, ops, durations)
        np.maximum.at(self.maxs, ops, durations)

    def histogram(self, op: int) -> Histogram:
        h = Histogram(self.bounds)
        h.counts, h.sum = self.counts[op].copy(), float(self.sums[op])
        h.min, h.max = float(self.mins[op]), float(self.maxs[op])
        return h


@dataclass
class _RankTotals:
    """What the collector accumulates for one rank across views (and across its restarts)."""

    ops: _OpHistograms
    steps: Histogram
    collective_time: float = 0.0
    incarnation: tuple[int, float] | None = None  # (pid, start time) of the process last seen
    steps_before: int = 0  # steps counted by earlier incarnations
    steps_now: int = 0  # step counter of the current incarnation
    last_marker: tuple[int, float] | None = None  # (step number, time) of the newest marker seen


@dataclass
class Family:
    """One metric's current samples, independent of the exposition format.

    ``samples``: (label values in ``spec.labels`` order, value) for gauges and counters;
    ``histograms``: (label values, :class:`Histogram`) for histograms.
    """

    spec: MetricSpec
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    histograms: list[tuple[tuple[str, ...], Histogram]] = field(default_factory=list)


class NodeMetrics:
    """The metric set of ``docs/metrics.md`` computed from successive NodeViews.

    ``update(view)`` folds one view in (cost: a few numpy operations per rank, independent of how
    many records completed); ``families()`` returns every metric's samples as of the latest view,
    computed once per view and cached. Thread-safe: the watchdog updates while scrapes read.

    Counters are cumulative over the life of this object: ``dtwatch_collectives_total`` and the
    duration histograms count each completed record of ``view.new_records`` once (the watchdog hands
    each record once); ``dtwatch_steps_total`` follows the ring's step counter and keeps growing
    across restarts of the rank (an incarnation is a (pid, start time)); step durations are the gaps
    between consecutive step markers of one incarnation. Counters the watchdog already keeps
    cumulatively (restarts, findings, incidents, its errors) are passed through.

    GPU series come from ``gpu.sample(view.local)`` when a :class:`~dtwatch.export.nvml.GpuSampler` is given
    (the sampler rate-limits NVML itself, so several exporters can share one).
    """

    def __init__(
        self, *, buckets: Iterable[float] = DURATION_BUCKETS, gpu: GpuSampler | None = None, job_id: str = "", node: str = ""
    ) -> None:
        self.job_id, self.node = job_id, node
        bounds = np.asarray(sorted(float(b) for b in buckets), dtype=np.float64)
        if len(bounds) == 0 or not np.all(np.isfinite(bounds)) or len(np.unique(bounds)) != len(bounds):
            raise ValueError(f"histogram buckets must be distinct finite numbers, got {list(buckets)!r}")
        self.bounds = bounds
        self.gpu = gpu
        self.created = time.time()
        self._lock = threading.Lock()
        self._view: NodeView | None = None
        self._ranks: dict[int, _RankTotals] = {}
        self._poll = Histogram(bounds)
        self._gpu: dict[int, dict[str, Any]] = {}
        self._families: dict[str, Family] | None = None
        self.generation = 0  # increases with every update

    # -- folding views in ----------------------------------------------------------------------------
    def update(self, view: NodeView) -> None:
        """Fold one NodeView into the cumulative state; the next scrape renders it."""
        gpu = {}
        if self.gpu is not None:
            try:
                gpu = self.gpu.sample(view.local)
            except Exception:
                log.debug("dtwatch: GPU sampling failed", exc_info=True)
        with self._lock:
            for state in view.local:
                totals = self._ranks.get(state.rank)
                if totals is None:
                    totals = self._ranks[state.rank] = _RankTotals(_OpHistograms(self.bounds), Histogram(self.bounds))
                incarnation = (state.pid, state.start_time)
                if totals.incarnation != incarnation:
                    if totals.incarnation is not None:
                        totals.steps_before += totals.steps_now
                    totals.incarnation, totals.steps_now, totals.last_marker = incarnation, 0, None
                totals.steps_now = max(totals.steps_now, int(state.step))
                recs = view.new_records.get(state.rank)
                if recs is not None and len(recs) and recs.dtype == RECORD_DTYPE:
                    self._fold_records(totals, recs)
            if view.health.poll_seconds:
                self._poll.add(np.asarray(view.health.poll_seconds, dtype=np.float64))
            self._gpu = gpu
            self._view = view
            self._families = None
            self.generation += 1

    @staticmethod
    def _fold_records(totals: _RankTotals, recs: np.ndarray) -> None:
        marker = (recs["flags"] & FLAG_MARKER) != 0
        calls = recs[~marker & (recs["status"] != STATUS_IN_FLIGHT) & (recs["t_exit"] != 0.0)]
        if len(calls):
            ops = calls["op"].astype(np.int64)
            ops[ops >= len(OPS)] = 0  # unknown codes all count as "unknown"
            durations = np.maximum(calls["t_exit"] - calls["t_enter"], 0.0)
            totals.ops.add(ops, durations)
            totals.collective_time += float(durations.sum())
        markers = recs[marker]
        if len(markers):
            steps = markers["step"].astype(np.int64)
            times = markers["t_enter"].astype(np.float64)
            if totals.last_marker is not None:
                steps = np.concatenate(([totals.last_marker[0]], steps))
                times = np.concatenate(([totals.last_marker[1]], times))
            consecutive = np.diff(steps) == 1  # a gap in step numbers (ring wrapped) is not one step
            totals.steps.add(np.maximum(np.diff(times)[consecutive], 0.0))
            totals.last_marker = (int(steps[-1]), float(times[-1]))

    # -- reading -------------------------------------------------------------------------------------
    def view(self) -> NodeView | None:
        """The latest view folded in."""
        return self._view

    def families(self) -> dict[str, Family]:
        """Every metric of :data:`METRICS` with its samples as of the latest view.

        Before the first view: only ``dtwatch_watchdog_info`` and ``dtwatch_watchdog_ranks`` (0), if
        ``job_id``/``node`` were given, so a scrape target shows up at once.
        """
        with self._lock:
            if self._families is None:
                self._families = self._compute() if self._view is not None else self._identity_only()
            return self._families

    def _identity_only(self) -> dict[str, Family]:
        if not (self.job_id or self.node):
            return {}
        node = (self.job_id, self.node)
        info, ranks = Family(SPECS["dtwatch_watchdog_info"]), Family(SPECS["dtwatch_watchdog_ranks"])
        info.samples.append((node + (_version(),), 1.0))
        ranks.samples.append((node, 0.0))
        return {info.spec.name: info, ranks.spec.name: ranks}

    def _compute(self) -> dict[str, Family]:
        v = self._view
        assert v is not None
        fam = {spec.name: Family(spec) for spec in METRICS}
        node = (v.job_id, v.node)

        def put(name: str, labels: tuple[str, ...], value: float) -> None:
            fam[name].samples.append((labels, float(value)))

        for s in sorted(v.local, key=lambda s: s.rank):
            r = node + (str(s.rank), str(s.local_rank))
            for gname, g in sorted(s.groups.items()):
                put("dtwatch_collective_seq", r + (gname,), g.seq)
                put("dtwatch_collective_seq_completed", r + (gname,), g.completed)
                put("dtwatch_collective_seq_lag", r + (gname,), v.seq_lag.get((s.rank, gname), 0))
            put("dtwatch_rank_in_collective", r, 1 if s.blocking_call() is not None else 0)
            put("dtwatch_seconds_since_progress", r, max(0.0, v.now - s.last_activity))
            put("dtwatch_rank_stalled", r, 1 if s.rank in v.stalled_ranks else 0)
            put("dtwatch_rank_culprit", r, 1 if s.rank in v.culprit_ranks else 0)
            put("dtwatch_rank_up", r, 1 if s.alive and not s.gone else 0)
            put("dtwatch_rank_heartbeat_age_seconds", r, s.heartbeat_age(v.now))
            put("dtwatch_rank_restarts_total", r, v.restarts.get(s.rank, 0))
            for ld in s.loaders:
                if ld.get("length", -1) >= 0:
                    put("dtwatch_dataloader_length", r + (str(ld["index"]),), ld["length"])
            if s.rank in v.straggler_lag:
                put("dtwatch_straggler_lag_seconds", r, v.straggler_lag[s.rank])
            put("dtwatch_rank_straggler", r, 1 if s.rank in v.straggler_ranks else 0)
            totals = self._ranks.get(s.rank)
            if totals is not None:
                put("dtwatch_steps_total", r, totals.steps_before + totals.steps_now)
                put("dtwatch_collective_time_seconds_total", r, totals.collective_time)
                fam["dtwatch_step_duration_seconds"].histograms.append((r, _copy(totals.steps)))
                for op in np.flatnonzero(totals.ops.counts.sum(axis=1)):
                    put("dtwatch_collectives_total", r + (OPS[op],), totals.ops.counts[op].sum())
                    fam["dtwatch_collective_duration_seconds"].histograms.append((r + (OPS[op],), totals.ops.histogram(op)))
            reading = self._gpu.get(s.rank)
            if reading:
                g = r + (str(reading.get("gpu", "")),)
                for key, name in _GPU_FIELDS.items():
                    if reading.get(key) is not None:
                        put(name, g, reading[key])
        for (kind, severity), n in sorted(v.findings_total.items()):
            put("dtwatch_findings_total", node + (kind, severity), n)
        put("dtwatch_incidents_total", node, v.incidents_total)
        put("dtwatch_incident_open", node, 1 if v.incident_open else 0)
        put("dtwatch_stall_window_seconds", node, v.window)
        put("dtwatch_watchdog_ranks", node, len(v.local))
        fam["dtwatch_watchdog_poll_duration_seconds"].histograms.append((node, _copy(self._poll)))
        for component, n in sorted(v.health.errors.items()):
            put("dtwatch_watchdog_errors_total", node + (component,), n)
        put("dtwatch_watchdog_info", node + (v.health.version or _version(),), 1)
        return fam


def _copy(h: Histogram) -> Histogram:
    c = Histogram(h.bounds)
    c.counts, c.sum, c.min, c.max = h.counts.copy(), h.sum, h.min, h.max
    return c


def _version() -> str:
    from dtwatch import __version__

    return __version__


# ---------------------------------------------------------------------------------------------------
# Prometheus collector
# ---------------------------------------------------------------------------------------------------
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
    metric = _empty_family(spec)
    if spec.kind == "histogram":
        for labels, h in fam.histograms:
            cumulative = np.cumsum(h.counts)
            buckets = [(floatToGoString(b), int(c)) for b, c in zip(h.bounds, cumulative[:-1])]
            buckets.append(("+Inf", int(cumulative[-1])))
            metric.add_metric(list(labels), buckets, h.sum)
    else:
        for labels, value in fam.samples:
            metric.add_metric(list(labels), value)
    return metric


# ---------------------------------------------------------------------------------------------------
# HTTP server
# ---------------------------------------------------------------------------------------------------
class MetricsBindError(OSError):
    """The metrics server could not listen on the address asked for (port taken, bad address...).

    ``errno`` is the socket error's (``errno.EADDRINUSE`` for a taken port). The watchdog catches it,
    logs its message once as a warning, and runs on without ``/metrics``.
    """


class MetricsServer:
    """Serves ``/metrics`` (a registry), ``/healthz`` and ``/readyz`` from a daemon thread.

    ``/healthz`` answers 200 while ``health_fn()`` returns True (503 otherwise, or when it raises);
    ``/readyz`` answers 200 once ``ready`` is True. Port 0 picks a free port; ``.port`` and ``.url``
    say which. With ``url_file``, ``{"url", "addr", "port", "pid", "node"}`` is written there as
    JSON (atomically) and removed again by :meth:`close`::

        server = MetricsServer(exporter.registry, addr="127.0.0.1", port=0, url_file="watchdog-n1.json")
        print(server.url)           # http://127.0.0.1:43817/metrics
        server.ready = True
        ...
        server.close()

    A port that cannot be bound raises :class:`MetricsBindError` (an ``OSError``) from the constructor;
    a port outside 0..65535 raises ``ValueError``. A URL file that cannot be written is one warning.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        addr: str = "0.0.0.0",
        port: int = 9464,
        health_fn: Callable[[], bool] | None = None,
        url_file: str | os.PathLike | None = None,
        node: str = "",
    ) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be an integer from 0 to 65535, got {port!r}")
        self.registry = registry
        self.health_fn = health_fn or (lambda: True)
        self._ready = threading.Event()
        self.node = node or socket.gethostname()
        self.url_file = os.fspath(url_file) if url_file is not None else None
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        server_cls = type("_Server", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
        try:
            self._httpd = server_cls((addr, port), _make_handler(self))
        except OSError as exc:
            hint = " (another watchdog or exporter uses it; pick another --metrics-port, or 0 for any free port)" if exc.errno == errno_mod.EADDRINUSE else ""
            raise MetricsBindError(exc.errno or 0, f"dtwatch: cannot serve metrics on {addr}:{port}: {exc.strerror or exc}{hint}") from exc
        self.addr = addr
        self.port = int(self._httpd.server_address[1])
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(addr, addr)
        self.base_url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        self.url = self.base_url + "/metrics"
        self._scrape_failed = False
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.1,), name="dtwatch-metrics", daemon=True)
        self._thread.start()
        if self.url_file is not None:
            try:
                self._write_url_file()
            except OSError as exc:
                log.warning("dtwatch: serving metrics on %s but cannot write %s: %s", self.url, self.url_file, exc)

    def _write_url_file(self) -> None:
        assert self.url_file is not None
        info = {"url": self.url, "addr": self.addr, "port": self.port, "pid": os.getpid(), "node": self.node}
        directory = os.path.dirname(os.path.abspath(self.url_file))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{self.url_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
            f.write("\n")
        os.replace(tmp, self.url_file)

    def close(self) -> None:
        """Stop serving, free the port, and remove the URL file if it is still this server's."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._httpd = None  # type: ignore[assignment]
        if self.url_file is not None:
            try:
                with open(self.url_file) as f:
                    info = json.load(f)
                if info.get("pid") == os.getpid() and info.get("port") == self.port:
                    os.unlink(self.url_file)
            except (OSError, ValueError):
                pass

    @property
    def ready(self) -> bool:
        """Whether ``/readyz`` answers 200; the watchdog sets it True once its services run."""
        return self._ready.is_set()

    @ready.setter
    def ready(self, value: bool) -> None:
        if value:
            self._ready.set()
        else:
            self._ready.clear()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request handling (called from the server's threads) ----------------------------------------
    def _metrics(self, query: str, accept: str, accept_encoding: str) -> tuple[int, dict[str, str], bytes]:
        registry: Any = self.registry
        names = parse_qs(query).get("name[]")
        if names:
            registry = registry.restricted_registry(names)
        try:
            encoder, content_type = choose_encoder(accept)
            body = encoder(registry)
        except Exception as exc:
            if not self._scrape_failed:
                self._scrape_failed = True
                log.warning("dtwatch: rendering /metrics failed: %r (further failures are logged at debug)", exc)
            log.debug("dtwatch: rendering /metrics failed", exc_info=True)
            return 500, {"Content-Type": "text/plain; charset=utf-8"}, f"error rendering metrics: {exc!r}\n".encode()
        headers = {"Content-Type": content_type}
        if "gzip" in accept_encoding:
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        return 200, headers, body

    def _health(self) -> tuple[int, bytes]:
        try:
            ok = bool(self.health_fn())
        except Exception as exc:  # noqa: BLE001
            return 503, f"unhealthy: health check raised {exc!r}\n".encode()
        return (200, b"ok\n") if ok else (503, b"unhealthy\n")


def _make_handler(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "dtwatch"

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            text = {"Content-Type": "text/plain; charset=utf-8"}
            if parts.path == "/metrics":
                status, headers, body = server._metrics(
                    parts.query, self.headers.get("Accept", ""), self.headers.get("Accept-Encoding", "")
                )
            elif parts.path == "/healthz":
                status, body = server._health()
                headers = text
            elif parts.path == "/readyz":
                status, body = (200, b"ready\n") if server.ready else (503, b"not ready\n")
                headers = text
            elif parts.path == "/":
                status, headers = 200, text
                body = b"dtwatch watchdog: /metrics /healthz /readyz\n"
            else:
                status, headers, body = 404, text, b"not found: try /metrics /healthz /readyz\n"
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            log.debug("metrics server: " + format, *args)

    return Handler


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
