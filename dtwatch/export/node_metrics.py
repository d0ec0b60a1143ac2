"""The metric model: the metric set of :mod:`dtwatch.export.metrics`, computed from successive NodeViews.

Gauges are read from the latest view as it stands; counters and histograms are cumulative over views
(``collectives_total`` and the duration histogram from the view's ``new_records``, step durations from
consecutive step markers), so an exporter never misses what happened between two of its reads. A
wedged rank keeps being reported precisely: the numbers come from its ring, not from the rank.
:class:`NodeMetrics` holds this state (with numpy); the Prometheus collector renders it on each
scrape and the OTLP meters export it periodically.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dtwatch.export.metrics import DURATION_BUCKETS, GPU_FIELDS, METRICS, SPECS, MetricSpec
from dtwatch.ring import FLAG_MARKER, OPS, RECORD_DTYPE, STATUS_IN_FLIGHT

if TYPE_CHECKING:
    from dtwatch.export.nvml import GpuSampler
    from dtwatch.export.view import NodeView

log = logging.getLogger("dtwatch.export.prometheus")


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
        self, *, buckets: Iterable[float] = DURATION_BUCKETS, gpu: GpuSampler | None = None, job_id: str = "",
        node: str = "",
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
                for op in np.flatnonzero(totals.ops.counts.sum(axis=1)).tolist():
                    labels = r + (OPS[op],)
                    put("dtwatch_collectives_total", labels, totals.ops.counts[op].sum())
                    fam["dtwatch_collective_duration_seconds"].histograms.append((labels, totals.ops.histogram(op)))
            reading = self._gpu.get(s.rank)
            if reading:
                gpu_labels = r + (str(reading.get("gpu", "")),)
                for key, name in GPU_FIELDS.items():
                    if reading.get(key) is not None:
                        put(name, gpu_labels, reading[key])
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
    from dtwatch.version import __version__

    return __version__

