"""An incident's evidence, collected by its own thread after the findings were written and sent.

In this order: Flight Recorder dumps are requested through the rings, the rings are copied, stacks are
taken (py-spy, faulthandler as the fallback), the dumps are awaited briefly, the diagnosis is made again
with all of it (:func:`refine`), then how processes ended, a timeline and the report. What it learned is
one new record, :class:`~dtwatch.watchdog.incident.IncidentEvidence`, written to the bundle as
``evidence.json``; the findings written at detection are never rewritten (see
:mod:`dtwatch.watchdog.incident` for who owns what).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import dtwatch.paths as paths
from dtwatch.bundle.file_evidence import FileEvidence
from dtwatch.bundle.files import Bundle, summarize_flight_record
from dtwatch.bundle.process_endings import process_ending
from dtwatch.diagnose import Finding, diagnose
from dtwatch.diagnose.evidence import main_thread_frames
from dtwatch.diagnose.rank_state import RankState
from dtwatch.ring import request_dump
from dtwatch.watchdog.incident import Incident, IncidentEvidence
from dtwatch.watchdog.stacks import StackDump, faulthandler_dump, pyspy_dump

log = logging.getLogger("dtwatch")

FLIGHT_RECORD_WAIT = 3.0
"""Seconds to wait for the ranks' sampler threads to write the requested Flight Recorder dumps."""
STACKS_WAIT = 20.0
NO_FLIGHT_RECORD = ("no Flight Recorder dump: the rank's sampler thread did not answer (GIL held or process "
                    "stopped)\n")


def collect_evidence(incident: Incident, bundle: Bundle, run_dir: str, *, pyspy: bool,
                     heartbeat_stale: float | None, on_error: Callable[[str], None]) -> IncidentEvidence:
    """Collect the evidence into ``bundle`` and write its record; never raises (a failure is logged, counted
    and leaves ``complete`` False)."""
    local = incident.local
    findings = incident.findings
    complete = False
    try:
        requests = {}
        for s in local:
            try:
                requests[s.rank] = request_dump(s.ring_path)
            except OSError:
                pass
        for s in local:
            bundle.copy(s.ring_path, paths.bundle_rank_file("rings", s.rank, paths.RING_SUFFIX))
        dumps = collect_stacks(bundle, local, run_dir, pyspy=pyspy)
        fr_summaries = await_flight_records(bundle, run_dir, requests)
        findings = refine(incident, run_dir, dumps, fr_summaries, heartbeat_stale=heartbeat_stale)
        for s in local:
            ending = process_ending(run_dir, s.rank, s.start_time)
            if ending is not None:
                bundle.add_json(paths.bundle_rank_file("endings", s.rank, ".json"), ending)
        write_reports(incident, bundle, findings)
        complete = True
    except Exception as exc:
        log.exception("dtwatch: collecting evidence failed: %r", exc)
        on_error("dump")
    refined = [f.to_dict() for f in findings] != [f.to_dict() for f in incident.findings]
    record = IncidentEvidence(incident_id=incident.id, findings=findings, refined=refined,
                              files=tuple(sorted({*bundle.files, paths.BUNDLE_EVIDENCE})), complete=complete)
    try:
        bundle.add_json(paths.BUNDLE_EVIDENCE, record.to_dict())
        if complete:
            bundle.write_index(list(findings), complete=True, refined=refined, evidence=paths.BUNDLE_EVIDENCE)
    except OSError as exc:
        log.warning("dtwatch: could not write the evidence record of %s: %r", incident.id, exc)
        on_error("dump")
    return record


def refine(incident: Incident, run_dir: str, dumps: dict[int, StackDump | None], fr_summaries: dict[int, dict], *,
           heartbeat_stale: float | None) -> tuple[Finding, ...]:
    """The same diagnosis again with the evidence collected since (stacks, Flight Recorder entries naming
    C++-issued calls); the incident's findings when it finds nothing."""
    if any(f.details.get("seen_earlier") for f in incident.findings):
        return incident.findings  # from a warning of the running job: the evidence collected since cannot add to it
    frames = {r: main_thread_frames(d.threads) for r, d in dumps.items() if d is not None and d.threads}
    by_rank = {s.rank: s for s in incident.local}

    def ending(rank: int) -> dict | None:
        return process_ending(run_dir, rank, by_rank[rank].start_time) if rank in by_rank else None

    ev = FileEvidence(stacks=frames.get, flight_records=fr_summaries, endings=ending, sample=incident.sample)
    refined = diagnose(list(incident.states), incident.detected, incident.window, ev,
                       heartbeat_stale=heartbeat_stale, assume_stalled=True).findings
    return tuple(refined) if refined else incident.findings


def collect_stacks(bundle: Bundle, local: list[RankState], run_dir: str, *, pyspy: bool) -> dict[int, StackDump | None]:
    """Every live local rank's stacks, in parallel: py-spy, else the faulthandler signal."""
    results: dict[int, StackDump | None] = {}

    def one(s: RankState) -> None:
        dump = None
        if pyspy and s.alive:
            dump = pyspy_dump(s.rank, s.pid)
        if (dump is None or not dump.ok) and s.alive and s.proc_state != "T":
            fh = faulthandler_dump(s.rank, s.pid, s.stack_signal, paths.stack_file(run_dir, s.rank))
            if dump is not None and not dump.ok:
                fh.advice, fh.error = dump.advice, f"py-spy: {dump.error}"
            dump = fh
        results[s.rank] = dump

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in local if not s.gone]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=STACKS_WAIT)
    for rank, dump in sorted(results.items()):
        if dump is None:
            continue
        header = f"# rank {rank} pid {dump.pid}: {dump.method} {'ok' if dump.ok else 'FAILED: ' + dump.error}\n"
        if dump.advice:
            header += f"# advice: {dump.advice}\n"
        bundle.add_text(paths.bundle_rank_file("stacks", rank, ".txt"), header + dump.text)
        if dump.threads is not None:
            bundle.add_json(paths.bundle_rank_file("stacks", rank, ".json"), dump.threads)
    return results


def await_flight_records(bundle: Bundle, run_dir: str, requests: dict[int, int]) -> dict[int, dict]:
    """Copy the requested Flight Recorder dumps (and readable summaries) into the bundle as they appear."""
    summaries: dict[int, dict] = {}
    deadline = time.time() + FLIGHT_RECORD_WAIT
    pending = dict(requests)
    while pending and time.time() < deadline:
        for rank, req in list(pending.items()):
            fr = paths.flight_record_file(run_dir, rank, req)
            if os.path.exists(fr):
                bundle.copy(fr, paths.bundle_rank_file("fr", rank, ".pkl"))
                summary = summarize_flight_record(fr)
                if summary is not None:
                    bundle.add_json(paths.bundle_rank_file("fr", rank, ".json"), summary)
                    summaries[rank] = summary
                del pending[rank]
        time.sleep(0.1)
    for rank in pending:
        bundle.add_text(paths.bundle_rank_file("fr", rank, ".missing.txt"), NO_FLIGHT_RECORD)
    return summaries


def write_reports(incident: Incident, bundle: Bundle, findings: tuple[Finding, ...]) -> None:
    """The timeline and the human report, with what the evidence concluded."""
    states = list(incident.states)
    try:
        from dtwatch.render.timeline import render_svg

        bundle.add_text(paths.BUNDLE_TIMELINE, render_svg(states, list(findings), now=incident.detected))
    except Exception as exc:  # noqa: BLE001
        log.debug("dtwatch: timeline failed: %r", exc)
    from dtwatch.render.report_text import render_text

    bundle.add_text(paths.BUNDLE_REPORT, render_text(list(findings), states, now=incident.detected,
                                                     bundle_dir=str(bundle.path), verdict=incident.verdict,
                                                     evidence=FileEvidence()))
