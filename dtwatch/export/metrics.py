"""The metric contract: every metric dtwatch exports, with the names, types, labels and help of ``docs/metrics.md``.

:data:`METRICS` mirrors the table in ``docs/metrics.md`` (a test keeps the two equal). The Prometheus
collector (:mod:`dtwatch.export.prometheus`) and the OTLP meters (:mod:`dtwatch.export.otel`) both
export exactly this set, computed by :class:`dtwatch.export.node_metrics.NodeMetrics`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Log-spaced bucket bounds (seconds) shared by the three duration histograms: 100 us to 5 minutes.
DURATION_BUCKETS: tuple[float, ...] = (
    1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0,
)

_RANK = ("job_id", "node", "rank", "local_rank")  # the labels of a per-rank series
_NODE = ("job_id", "node")  # the labels of a per-node series

MetricKind = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One row of the metric contract: Prometheus name and type, label names, help, OTel unit."""

    name: str
    kind: MetricKind
    labels: tuple[str, ...]
    help: str
    unit: str = ""  # UCUM unit for OpenTelemetry ("s", "By", "W", "Cel", "1")


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("dtwatch_collective_seq", "gauge", _RANK + ("group",),
        "Last sequence number this rank entered in this group (torch's numbering; includes C++-issued collectives)."),
    MetricSpec("dtwatch_collective_seq_completed", "gauge", _RANK + ("group",),
        "Last sequence number known completed on this rank in this group."),
    MetricSpec("dtwatch_collective_seq_lag", "gauge", _RANK + ("group",),
        "Collectives this rank is behind the most advanced member of the group."),
    MetricSpec("dtwatch_collectives_total", "counter", _RANK + ("op",),
        "Collectives issued from Python and completed, by op."),
    MetricSpec("dtwatch_collective_duration_seconds", "histogram", _RANK + ("op",),
        "Time from entering to leaving a collective (async: until its work completed).", "s"),
    MetricSpec("dtwatch_collective_time_seconds_total", "counter", _RANK, "Total time spent inside collectives.", "s"),
    MetricSpec("dtwatch_rank_in_collective", "gauge", _RANK,
        "1 while the rank is inside a Python-issued (synchronous) collective."),
    MetricSpec("dtwatch_seconds_since_progress", "gauge", _RANK,
        "Seconds since this rank last entered or left a collective or finished a step.", "s"),
    MetricSpec("dtwatch_steps_total", "counter", _RANK, "Training steps (optimizer steps, or dtwatch.step())."),
    MetricSpec("dtwatch_step_duration_seconds", "histogram", _RANK, "Wall time between consecutive steps.", "s"),
    MetricSpec("dtwatch_rank_stalled", "gauge", _RANK,
        "1 while the rank is part of an open stall incident (waiting or culprit)."),
    MetricSpec("dtwatch_rank_culprit", "gauge", _RANK, "1 while the rank is named as the cause of an open stall."),
    MetricSpec("dtwatch_rank_up", "gauge", _RANK, "1 while the rank's process is alive."),
    MetricSpec("dtwatch_rank_heartbeat_age_seconds", "gauge", _RANK,
        "Age of the rank's in-process heartbeat (large while alive = wedged).", "s"),
    MetricSpec("dtwatch_rank_restarts_total", "counter", _RANK,
        "Times the rank's process was replaced (torchrun restarts)."),
    MetricSpec("dtwatch_dataloader_length", "gauge", _RANK + ("loader",),
        "len() of each DataLoader the rank iterates, as of its latest epoch."),
    MetricSpec("dtwatch_straggler_lag_seconds", "gauge", _RANK,
        "Median delay of this rank entering collectives behind the first rank.", "s"),
    MetricSpec("dtwatch_rank_straggler", "gauge", _RANK,
        "1 while the watchdog names this rank as the straggler (re-evaluated every poll)."),
    MetricSpec("dtwatch_findings_total", "counter", _NODE + ("kind", "severity"), "Findings raised by the watchdog."),
    MetricSpec("dtwatch_incidents_total", "counter", _NODE, "Stall incidents opened."),
    MetricSpec("dtwatch_incident_open", "gauge", _NODE, "1 while a stall incident is open."),
    MetricSpec("dtwatch_stall_window_seconds", "gauge", _NODE, "The stall window in force (adapts to the job).", "s"),
    MetricSpec("dtwatch_watchdog_ranks", "gauge", _NODE, "Ranks this watchdog watches."),
    MetricSpec("dtwatch_watchdog_poll_duration_seconds", "histogram", _NODE, "Time one watchdog poll takes.", "s"),
    MetricSpec("dtwatch_watchdog_errors_total", "counter", _NODE + ("component",),
        "The watchdog's own errors (store, dump, export, webhook)."),
    MetricSpec("dtwatch_watchdog_info", "gauge", _NODE + ("version",), "Build info (always 1)."),
    MetricSpec("dtwatch_gpu_utilization_ratio", "gauge", _RANK + ("gpu",), "GPU utilisation 0..1 (NVML).", "1"),
    MetricSpec("dtwatch_gpu_memory_used_bytes", "gauge", _RANK + ("gpu",), "GPU memory used.", "By"),
    MetricSpec("dtwatch_gpu_memory_total_bytes", "gauge", _RANK + ("gpu",), "GPU memory total.", "By"),
    MetricSpec("dtwatch_gpu_power_watts", "gauge", _RANK + ("gpu",), "GPU power draw.", "W"),
    MetricSpec("dtwatch_gpu_temperature_celsius", "gauge", _RANK + ("gpu",), "GPU temperature.", "Cel"),
)
SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}

# GpuSampler reading -> metric name.
GPU_FIELDS = {
    "utilization": "dtwatch_gpu_utilization_ratio",
    "memory_used": "dtwatch_gpu_memory_used_bytes",
    "memory_total": "dtwatch_gpu_memory_total_bytes",
    "power_watts": "dtwatch_gpu_power_watts",
    "temperature_celsius": "dtwatch_gpu_temperature_celsius",
}

__all__ = ["DURATION_BUCKETS", "GPU_FIELDS", "METRICS", "SPECS", "MetricKind", "MetricSpec"]
