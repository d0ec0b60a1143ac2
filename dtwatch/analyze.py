"""``dtwatch analyze DIR...``: merge run directories and incident bundles of any number of nodes.

Inputs are found by walking each DIR: incident bundles (``index.json`` + ``findings.json`` +
``ranks/*.json``: the state at detection, with each node's liveness view) and rings (``*.ring``: a run
directory, or a bundle's ``rings/``). Per rank the bundle state wins over a ring read now. Findings
recorded by a watchdog are reported as they were; without any, the ranks are diagnosed here as they
were when their rings were last written (a process that died without a clean exit is taken where it
stopped).
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from .diagnose import FileEvidence, Finding, diagnose, entry_lags, straggler_warning, uneven_loader_warnings
from .ring import RingFormatError, read_ring
from .state import RankState, from_snapshot


@dataclass
class Analysis:
    findings: list[Finding]
    warnings: list[Finding]
    states: list[RankState]
    now: float
    sources: list[str] = field(default_factory=list)
    bundles: list[str] = field(default_factory=list)

    @property
    def stalled(self) -> bool:
        return any(f.severity == "stall" for f in self.findings)

    def to_dict(self) -> dict:
        return {
            "stalled": self.stalled,
            "findings": [f.to_dict() for f in self.findings],
            "warnings": [f.to_dict() for f in self.warnings],
            "ranks": [rank_summary(s, self.now) for s in self.states],
            "bundles": self.bundles,
            "sources": self.sources,
        }


def rank_summary(s: RankState, now: float) -> dict:
    call = s.blocking_call()
    return {
        "rank": s.rank, "host": s.host, "pid": s.pid, "step": s.step, "state": "gone" if s.gone else "running",
        "ended": s.how_it_ended() if s.gone else None,
        "groups": {g.name: {"seq": g.seq, "completed": g.completed, "cpp_seq": g.cpp_seq} for g in s.groups.values()},
        "current_op": None if call is None else {"op": call.op, "group": call.group, "seq": call.seq,
                                                "site": call.site, "for_s": round(now - call.t_enter, 3)},
        "main_site": s.main_site, "stack_top": s.main_top_site,
        "loaders": [{"site": ld["site"], "length": ld["length"], "epochs": ld["epochs"]} for ld in s.loaders],
    }


def _scan(paths: list[str]) -> tuple[list[Path], list[Path]]:
    bundles, rings = [], []
    for p in paths:
        root = Path(p)
        if root.is_file() and root.suffix == ".ring":
            rings.append(root)
            continue
        for dirpath, _dirs, files in os.walk(root):
            d = Path(dirpath)
            if "index.json" in files and "findings.json" in files:
                bundles.append(d)
            rings.extend(d / f for f in files if f.endswith(".ring"))
    return sorted(set(bundles)), sorted(set(rings))


def analyze(paths: list[str], *, window: float = 0.0) -> Analysis:
    bundle_dirs, ring_paths = _scan(paths)
    states: dict[int, RankState] = {}
    findings: dict[tuple, Finding] = {}
    now = 0.0
    for b in bundle_dirs:
        index = json.loads((b / "index.json").read_text())
        now = max(now, float(index.get("detected", 0)))
        for f in json.loads((b / "findings.json").read_text()):
            fd = Finding.from_dict(f)
            findings.setdefault(fd.key(), fd)
        for rf in sorted((b / "ranks").glob("rank-*.json")):
            s = RankState.from_dict(json.loads(rf.read_text()))
            # The node that owns a rank knows its liveness; prefer that node's copy.
            if s.rank not in states or (s.host == index.get("node") and s.alive is not None):
                states[s.rank] = s
    host = socket.gethostname()
    ring_states: dict[int, RankState] = {}
    for path in ring_paths:
        try:
            snap = read_ring(path)
        except (OSError, RingFormatError):
            continue
        s = from_snapshot(snap, local=(snap.host == host and "rings" not in path.parts))
        prev = ring_states.get(s.rank)
        if prev is None or s.start_time > prev.start_time:  # the newest process of a restarted rank
            ring_states[s.rank] = s
    for rank, s in ring_states.items():
        states.setdefault(rank, s)
    ordered = sorted(states.values(), key=lambda s: s.rank)
    if not now:
        now = max([s.heartbeat_time for s in ordered] + [s.last_activity for s in ordered], default=0.0)
    result_findings = list(findings.values())
    if not result_findings and ordered:
        result_findings = diagnose(ordered, now, window, FileEvidence(), heartbeat_stale=float("inf"),
                                   assume_stalled=window == 0.0).findings
    warnings = uneven_loader_warnings(ordered, now)
    strag = straggler_warning(entry_lags(ordered), now)
    if strag is not None:
        warnings.append(strag)
    return Analysis(result_findings, warnings, ordered, now, [str(p) for p in ring_paths], [str(b) for b in bundle_dirs])
