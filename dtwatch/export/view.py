"""What the watchdog hands its exporters after every poll: one consistent view of the node and job.

Exporters (Prometheus, OpenTelemetry, NVML) only read a :class:`NodeView`; they never touch rings,
processes or the network of the training job, so a slow or failing exporter cannot disturb diagnosis.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dtwatch.diagnose import Finding
from dtwatch.diagnose.rank_state import RankState
from dtwatch.ring import RankSnapshot


@dataclass
class WatchdogHealth:
    poll_seconds: list[float] = field(default_factory=list)  # durations of polls since the last view
    errors: dict[str, int] = field(default_factory=dict)  # component -> total errors so far
    started: float = 0.0
    version: str = ""


@dataclass
class NodeView:
    job_id: str
    node: str
    now: float
    window: float  # stall window in force (seconds)
    local: list[RankState]  # this node's ranks
    all_states: list[RankState]  # every rank known, this node's and other nodes'
    snapshots: dict[int, RankSnapshot]  # this node's rings as read this poll, by rank
    # per local rank: records (ring.RECORD_DTYPE) that completed since the last view, step markers included
    new_records: dict[int, np.ndarray]
    seq_lag: dict[tuple[int, str], int]  # (rank, group) -> collectives behind the group's most advanced member
    straggler_lag: dict[int, float]  # rank -> median seconds behind the first rank entering collectives
    stalled_ranks: set[int]
    culprit_ranks: set[int]
    incident_open: bool
    incidents_total: int
    findings_total: dict[tuple[str, str], int]  # (kind, severity) -> count
    restarts: dict[int, int]  # rank -> times its process was replaced
    findings: list[Finding]  # findings of the open incident, and current warnings
    health: WatchdogHealth
    straggler_ranks: set[int] = field(default_factory=set)  # the rank the straggler rule names this poll (at most one)
