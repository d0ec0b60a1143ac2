"""``dtwatch analyze DIR...``: merge run directories and incident bundles of any number of nodes.

Inputs are found by walking each DIR: incident bundles (``index.json`` + ``findings.json`` +
``ranks/*.json``: the state at detection, with each node's liveness view), rings (``*.ring``: a run
directory, or a bundle's ``rings/``) and the watchdogs' event logs (``events-<node>.jsonl``: the
warnings they issued while the job ran). Per rank the bundle state wins over a ring read now. Findings
and warnings recorded by a watchdog are reported as they were; without findings, the ranks are
diagnosed here as they were when their rings were last written (a process that died without a clean
exit is taken where it stopped).

A damaged input (a ring or bundle file cut short, garbled, of another format) is named with what is wrong
(an :class:`~dtwatch.ring.reader.InputProblem`, reported as a ``damaged_input`` warning), and the rest is
read: the ranks it held that no other file holds are listed as unreadable, and the diagnosis, made from the
ranks that could be read, is reported as such (no "No stall." as if every rank had been seen).
"""
from __future__ import annotations

import dataclasses
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dtwatch.bundle.file_evidence import FileEvidence
from dtwatch.bundle.files import read_bundle
from dtwatch.bundle.process_endings import process_ending
from dtwatch.diagnose import (
    Finding,
    diagnose,
    entry_lags,
    fmt_ranks,
    straggler_warning,
    uneven_loader_warnings,
)
from dtwatch.diagnose.context import ending_text
from dtwatch.diagnose.fr_states import JobFacts, states_from_dumps
from dtwatch.diagnose.rank_state import UNKNOWN_PROCESS, RankState, from_snapshot
from dtwatch.diagnose.setup import setup_warnings
from dtwatch.diagnose.verdict import CRASH, STALL
from dtwatch.diagnose.verdict import verdict as incident_verdict
from dtwatch.paths import BUNDLE_FINDINGS, BUNDLE_INDEX, FLIGHT_RECORDS, RING_SUFFIX, is_events_file
from dtwatch.process_liveness import process_state
from dtwatch.render.report_text import DAMAGED_INPUT
from dtwatch.report.events import warnings_in
from dtwatch.report.fr_dumps import DumpSet, candidates, collector_paused, dump_facts, in_flight, limits, read_dumps
from dtwatch.ring import RankSnapshot
from dtwatch.ring.reader import InputProblem, try_read_ring

INCONSISTENT = "inconsistent"  # a ring whose world size the other rings of its job and restart contradict


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
    problems: list[InputProblem] = field(default_factory=list)  # the damaged inputs (also among ``warnings``)
    unreadable: list[int] = field(default_factory=list)  # ranks a damaged input held that no other input holds
    dumps: DumpReport | None = None  # torch's Flight Recorder dumps read (a job that ran without dtwatch)
    # How each rank that ended did, as the diagnosis tells it: its ring, and the signal files its process wrote
    # (a crash in the interpreter's teardown after a normal exit included).
    endings: dict[int, str] = field(default_factory=dict)

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
            "ranks": [rank_summary(s, self.now, self.endings.get(s.rank)) for s in self.states],
            "bundles": self.bundles,
            "sources": self.sources,
            "damaged_inputs": [p.to_dict() for p in self.problems],
            "unreadable_ranks": self.unreadable,
            "flight_recorder": self.dumps.to_dict() if self.dumps is not None else None,
        }


@dataclass
class DumpReport:
    """torch's Flight Recorder dumps that ``analyze`` read, and what they leave unknown."""

    files: dict[int, str]  # rank -> the dump used
    facts: JobFacts
    in_flight: dict[int, list[dict]]  # rank -> its entries not completed (fr_dumps.in_flight)
    limits: list[str]  # what the dumps cannot show, and what would have (fr_dumps.limits)
    no_dump: list[int] = field(default_factory=list)  # ranks of the job no file holds (a damaged one is not this)
    unused: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"files": {str(r): f for r, f in sorted(self.files.items())}, **self.facts.to_dict(),
                "no_dump": self.no_dump,
                "in_flight": {str(r): v for r, v in sorted(self.in_flight.items())}, "cannot_show": self.limits,
                "unused_files": self.unused}


def rank_summary(s: RankState, now: float, ended: str | None = None) -> dict:
    """One rank's state for ``--json``; ``ended``: how it ended where the diagnosis told it (else its ring's)."""
    if s.from_dump:
        return {"rank": s.rank, "host": None, "pid": None, "step": None, "state": "unknown (Flight Recorder dump)",
                "ended": None, "groups": {g.name: {"seq": g.seq, "completed": g.completed} for g in s.groups.values()},
                "current_op": None, "main_site": None, "stack_top": None, "loaders": None}
    call = s.blocking_call()
    return {
        "rank": s.rank, "host": s.host, "pid": s.pid, "step": s.step, "state": "gone" if s.gone else "running",
        "ended": (ended or s.how_it_ended()) if s.gone else None,
        "groups": {g.name: {"seq": g.seq, "completed": g.completed, "cpp_seq": g.cpp_seq} for g in s.groups.values()},
        "current_op": None if call is None else {"op": call.op, "group": call.group, "seq": call.seq,
                                                "site": call.site, "for_s": round(now - call.t_enter, 3)},
        "main_site": s.main_site, "stack_top": s.main_top_site,
        "loaders": [{"site": ld["site"], "length": ld["length"], "epochs": ld["epochs"]} for ld in s.loaders],
    }


@dataclass
class Inputs:
    """The files ``dtwatch analyze`` found under its paths."""

    bundles: list[Path]
    rings: list[Path]
    events: list[Path]
    others: list[Path]  # every other file, outside bundles: Flight Recorder dumps are found among them by content


def _scan(paths: list[str]) -> Inputs:
    bundles: list[Path] = []
    rings: list[Path] = []
    events: list[Path] = []
    others: list[Path] = []
    for p in paths:
        root = Path(p)
        if root.is_file():
            (rings if root.suffix == RING_SUFFIX else events if is_events_file(root.name) else others).append(root)
            continue
        own: list[Path] = []  # bundles, and run directories' fr/: their dumps are evidence of ranks rings hold
        for dirpath, _dirs, files in os.walk(root):
            d = Path(dirpath)
            if BUNDLE_INDEX in files and BUNDLE_FINDINGS in files:
                bundles.append(d)
                own.append(d)
            here = [d / f for f in files if f.endswith(RING_SUFFIX)]
            if here:
                own.append(d / FLIGHT_RECORDS)
            rings.extend(here)
            events.extend(d / f for f in files if is_events_file(f))
            if not any(d == o or o in d.parents for o in own):
                others.extend(d / f for f in files if not f.endswith(RING_SUFFIX) and not is_events_file(f))
    return Inputs(sorted(set(bundles)), sorted(set(rings)), sorted(set(events)), sorted(set(others)))


def live_warnings(event_files: list[Path]) -> list[Finding]:
    """The warnings watchdogs issued during the run, once each (several nodes may issue the same)."""
    return [Finding.from_dict(w) for w in warnings_in(event_files)]


def analyze(paths: list[str], *, window: float = 0.0) -> Analysis:
    """Read, merge and diagnose everything under ``paths`` (see the module doc)."""
    with collector_paused():  # millions of small objects for a large job, freed by reference counting
        return _analyze(paths, window)


def _analyze(paths: list[str], window: float) -> Analysis:
    inputs = _scan(paths)
    bundle_dirs, ring_paths, event_files = inputs.bundles, inputs.rings, inputs.events
    states: dict[int, RankState] = {}
    findings: dict[tuple, Finding] = {}
    verdicts: set[str] = set()
    problems: list[InputProblem] = []
    now = 0.0
    for b in bundle_dirs:
        bundle = read_bundle(b)
        problems.extend(bundle.problems)
        index = bundle.index
        now = max(now, float(index.get("detected", 0)))
        if index.get("verdict"):
            verdicts.add(str(index["verdict"]))
        for fd in bundle.findings:
            findings.setdefault(fd.key(), fd)
        for s in bundle.states:
            # The node that owns a rank knows its liveness; prefer that node's copy.
            if s.rank not in states or (s.host == index.get("node") and s.alive is not None):
                states[s.rank] = s
    host = socket.gethostname()
    snaps: list[RankSnapshot] = []
    for path in ring_paths:
        snap, problem = try_read_ring(path)
        if problem is not None:
            problems.append(problem)
        if snap is not None:
            snaps.append(snap)
    snaps, contradicted = inconsistent_rings(snaps)
    problems.extend(contradicted)
    ring_states: dict[int, RankState] = {}
    for snap in snaps:
        local = snap.host == host and "rings" not in Path(snap.path).parts
        s = from_snapshot(snap, process=process_state(snap.pid) if local else UNKNOWN_PROCESS)
        prev = ring_states.get(s.rank)
        if prev is None or s.start_time > prev.start_time:  # the newest process of a restarted rank
            ring_states[s.rank] = s
    for rank, s in ring_states.items():
        states.setdefault(rank, s)
    dump_set = read_dumps(candidates(inputs.others))
    problems.extend(dump_set.problems)
    dumps = None
    if any(d.rank not in states for d in dump_set.dumps):
        dump_states, job = states_from_dumps(dump_set.dumps)
        dumps = _dump_report(dump_set, job, states)
        for s in dump_states:
            states.setdefault(s.rank, s)  # a dtwatch ring or bundle of the same rank knows more
    ordered = sorted(states.values(), key=lambda s: s.rank)
    unreadable = sorted({r for p in problems if not p.read for r in p.ranks} - set(states))
    if not now:
        now = max([s.heartbeat_time for s in ordered] + [s.last_activity for s in ordered], default=0.0)
    result_findings = list(findings.values())
    ring_verdict = None
    run_dirs = {s.rank: os.path.dirname(s.ring_path) for s in ordered if s.ring_path}
    starts = {s.rank: s.start_time for s in ordered}

    def ending(rank: int) -> dict | None:
        return process_ending(run_dirs[rank], rank, starts[rank]) if rank in run_dirs else None

    endings = {s.rank: ending_text(s, ending(s.rank)) for s in ordered if s.gone and not s.from_dump}
    if not result_findings and ordered:
        facts = {d.rank: dump_facts(d) for d in dump_set.dumps}
        ev = FileEvidence(endings=ending, unreadable=set(unreadable), dump_facts=facts)
        result = diagnose(ordered, now, window, ev, heartbeat_stale=float("inf"), assume_stalled=window == 0.0)
        result_findings = result.findings
        if result_findings and not any(s.from_dump for s in ordered):  # a dump does not say how a process ended
            ring_verdict = incident_verdict(result_findings, ordered, from_exits=result.ended)
    result_findings = [_unreadable_noted(f, unreadable) for f in result_findings]
    live = live_warnings(event_files)
    issued = {(f.kind, tuple(f.ranks)) for f in live}
    files = FileEvidence()  # source lines and paths for the warnings' sentences
    computed = uneven_loader_warnings(ordered, now, files) + setup_warnings(ordered, now, files)
    strag = straggler_warning(entry_lags([s for s in ordered if not s.from_dump]), now)
    if strag is not None:
        computed.append(strag)
    checked = {f.details.get("check") for f in live if f.details.get("check")}  # setup checks: once per run
    warnings = live + [f for f in computed if (f.kind, tuple(f.ranks)) not in issued
                       and (not f.details.get("check") or f.details["check"] not in checked)]
    warnings += [damage_warning(p, unreadable, now) for p in problems]  # last: the live ones stay first
    verdict = CRASH if CRASH in verdicts else (STALL if verdicts else ring_verdict)
    return Analysis(
        result_findings, warnings, ordered, now, [str(p) for p in ring_paths], [str(b) for b in bundle_dirs],
        verdict=verdict, live_warnings=len(live), problems=problems, unreadable=unreadable, dumps=dumps,
        endings=endings,
    )


def _dump_report(dump_set: DumpSet, facts: JobFacts, states: dict[int, RankState]) -> DumpReport:
    """The dumps of ranks no ring or bundle holds, with the job's facts and what they cannot show."""
    used = [d for d in dump_set.dumps if d.rank not in states]
    damaged = {r for p in dump_set.problems for r in p.ranks}
    no_dump = [r for r in facts.no_dump if r not in states and r not in damaged]
    return DumpReport({d.rank: d.path for d in used}, facts, {d.rank: in_flight(d) for d in used},
                      limits(used, no_dump, facts.world_known), no_dump, dump_set.unused)


def inconsistent_rings(snaps: list[RankSnapshot]) -> tuple[list[RankSnapshot], list[InputProblem]]:
    """Rings of one job and restart must agree on its world size: one most of them contradict has a garbled
    header (its ranks would be taken for never seen). Returns the rings that agree, and the others named."""
    sizes: dict[tuple[str, int], Counter] = {}
    for s in snaps:
        sizes.setdefault((s.job_id, s.restart_count), Counter())[s.world_size] += 1
    kept, bad = [], []
    for s in snaps:
        (size, n), *rest = sizes[(s.job_id, s.restart_count)].most_common()
        if s.world_size != size and n > sum(c for _, c in rest):
            bad.append(InputProblem(s.path, INCONSISTENT, f"its header says world size {s.world_size}, {n} other "
                                    f"ring(s) of job {s.job_id} say {size}", (s.rank,)))
        else:
            kept.append(s)
    return kept, bad


def damage_warning(p: InputProblem, unreadable: list[int], now: float) -> Finding:
    """One damaged input as a warning: the file, what is wrong, what it cost (``ranks``: those no input holds)."""
    lost = [r for r in p.ranks if r in unreadable]
    cost = ""
    if not p.read and p.ranks:
        cost = (f", and no other file holds {fmt_ranks(lost)}" if lost == list(p.ranks)
                else f" ({fmt_ranks(set(p.ranks) - set(lost))} read from another file"
                     + (f"; {fmt_ranks(lost)} from none)" if lost else ")"))
    return Finding(DAMAGED_INPUT, "warning", lost, p.line() + cost, detected=now, details=p.to_dict())


def _unreadable_noted(f: Finding, unreadable: list[int]) -> Finding:
    """A finding that says some ranks were never seen: those that were, but could not be read, noted."""
    unseen = set(f.details.get("unseen_ranks") or []) if isinstance(f.details, dict) else set()
    damaged = sorted(unseen & set(unreadable))
    return dataclasses.replace(f, details={**f.details, "unreadable_ranks": damaged}) if damaged else f
