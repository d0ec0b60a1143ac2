"""``dtwatch analyze DIR...``: merge run directories and incident bundles of any number of nodes.

Inputs are found by walking each DIR: incident bundles (``index.json`` + ``findings.json`` +
``ranks/*.json``: the state at detection, with each node's liveness view), rings (``*.ring``: a run
directory, or a bundle's ``rings/``) and the watchdogs' event logs (``events-<node>.jsonl``: the
warnings they issued while the job ran). Per rank the bundle state wins over a ring read now. Findings
and warnings recorded by a watchdog are reported as they were; without findings, the ranks are
diagnosed here as they were when their rings were last written (a process that died without a clean
exit is taken where it stopped).
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from dtwatch.diagnose import FileEvidence, Finding, diagnose, entry_lags, straggler_warning, uneven_loader_warnings
from dtwatch.diagnose.setup import setup_warnings
from dtwatch.diagnose.state import RankState, from_snapshot
from dtwatch.paths import BUNDLE_FINDINGS, BUNDLE_INDEX, RING_SUFFIX, is_events_file
from dtwatch.report.bundle import bundle_findings
from dtwatch.report.events import warnings_in
from dtwatch.ring import RingFormatError, read_ring
from dtwatch.watchdog.stacks import process_ending


@dataclass
class Analysis:
    findings: list[Finding]
    warnings: list[Finding]
    states: list[RankState]
    now: float
    sources: list[str] = field(default_factory=list)
    bundles: list[str] = field(default_factory=list)
    verdict: str | None = None  # "crash" / "stall" as the watchdog called the incident; None: no incident recorded
    live_warnings: int = 0  # how many of ``warnings`` (the first ones) a watchdog issued while the job ran

    @property
    def stalled(self) -> bool:
        return any(f.severity == "stall" for f in self.findings)

    def to_dict(self) -> dict:
        return {
            "stalled": self.stalled,
            "verdict": self.verdict,
            "findings": [f.to_dict() for f in self.findings],
            "warnings": [{**f.to_dict(), "issued": "live" if i < self.live_warnings else "analysis"}
                         for i, f in enumerate(self.warnings)],
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


def _scan(paths: list[str]) -> tuple[list[Path], list[Path], list[Path]]:
    bundles: list[Path] = []
    rings: list[Path] = []
    events: list[Path] = []
    for p in paths:
        root = Path(p)
        if root.is_file() and root.suffix == ".ring":
            rings.append(root)
            continue
        for dirpath, _dirs, files in os.walk(root):
            d = Path(dirpath)
            if BUNDLE_INDEX in files and BUNDLE_FINDINGS in files:
                bundles.append(d)
            rings.extend(d / f for f in files if f.endswith(RING_SUFFIX))
            events.extend(d / f for f in files if is_events_file(f))
    return sorted(set(bundles)), sorted(set(rings)), sorted(set(events))


def live_warnings(event_files: list[Path]) -> list[Finding]:
    """The warnings watchdogs issued during the run, once each (several nodes may issue the same)."""
    return [Finding.from_dict(w) for w in warnings_in(event_files)]


def analyze(paths: list[str], *, window: float = 0.0) -> Analysis:
    bundle_dirs, ring_paths, event_files = _scan(paths)
    states: dict[int, RankState] = {}
    findings: dict[tuple, Finding] = {}
    verdicts: set[str] = set()
    now = 0.0
    for b in bundle_dirs:
        index = json.loads((b / BUNDLE_INDEX).read_text())
        now = max(now, float(index.get("detected", 0)))
        if index.get("verdict"):
            verdicts.add(str(index["verdict"]))
        for f in bundle_findings(b):
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
        run_dirs = {s.rank: os.path.dirname(s.ring_path) for s in ordered if s.ring_path}
        starts = {s.rank: s.start_time for s in ordered}

        def ending(rank: int) -> dict | None:
            return process_ending(run_dirs[rank], rank, starts[rank]) if rank in run_dirs else None

        result_findings = diagnose(ordered, now, window, FileEvidence(endings=ending), heartbeat_stale=float("inf"),
                                   assume_stalled=window == 0.0).findings
    live = live_warnings(event_files)
    issued = {(f.kind, tuple(f.ranks)) for f in live}
    computed = uneven_loader_warnings(ordered, now) + setup_warnings(ordered, now)
    strag = straggler_warning(entry_lags(ordered), now)
    if strag is not None:
        computed.append(strag)
    checked = {f.details.get("check") for f in live if f.details.get("check")}  # setup checks: once per run
    warnings = live + [f for f in computed if (f.kind, tuple(f.ranks)) not in issued
                       and (not f.details.get("check") or f.details["check"] not in checked)]
    verdict = "crash" if "crash" in verdicts else ("stall" if verdicts else None)
    return Analysis(
        result_findings, warnings, ordered, now, [str(p) for p in ring_paths], [str(b) for b in bundle_dirs],
        verdict=verdict, live_warnings=len(live),
    )
