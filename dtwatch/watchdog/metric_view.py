"""The view the exporters get after each poll (:class:`dtwatch.export.view.NodeView`), built from what the
poll saw. Pure: no I/O."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtwatch.diagnose import EntryLags, Finding
from dtwatch.diagnose.rank_state import RankState
from dtwatch.export.view import NodeView, WatchdogHealth
from dtwatch.ring import RankSnapshot


@dataclass
class Poll:
    """What one poll saw and decided."""

    now: float
    window: float
    snapshots: dict[int, RankSnapshot]  # this node's rings, by rank
    local: list[RankState]  # this node's ranks
    states: list[RankState]  # every rank known
    new_records: dict[int, np.ndarray]
    lags: EntryLags
    straggler: Finding | None


def seq_lag(local: list[RankState], states: list[RankState]) -> dict[tuple[int, str], int]:
    """(rank, group) -> collectives this node's rank is behind the group's most advanced member."""
    leaders: dict[str, int] = {}
    for s in states:
        for g in s.groups.values():
            leaders[g.name] = max(leaders.get(g.name, 0), g.seq)
    return {(s.rank, g.name): leaders[g.name] - g.seq for s in local for g in s.groups.values()}


def node_view(poll: Poll, *, job_id: str, node: str, incident_findings: Sequence[Finding] | None,
              warnings: list[Finding], incidents_total: int, findings_total: dict[tuple[str, str], int],
              restarts: dict[int, int], health: WatchdogHealth) -> NodeView:
    """``incident_findings``: the open incident's current findings, None when none is open."""
    findings = list(incident_findings or ())
    return NodeView(
        job_id=job_id, node=node, now=poll.now, window=poll.window, local=poll.local,
        all_states=poll.states, snapshots=poll.snapshots, new_records=poll.new_records,
        seq_lag=seq_lag(poll.local, poll.states), straggler_lag=poll.lags.medians,
        stalled_ranks={r for f in findings for r in f.ranks + f.waiting_ranks},
        culprit_ranks={r for f in findings for r in f.ranks},
        incident_open=incident_findings is not None, incidents_total=incidents_total,
        findings_total=dict(findings_total), restarts=dict(restarts),
        findings=findings + warnings, health=health,
        straggler_ranks=set(poll.straggler.ranks) if poll.straggler is not None else set(),
    )
