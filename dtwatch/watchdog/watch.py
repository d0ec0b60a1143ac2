"""``dtwatch watch``: the node watchdog, a separate process that reads the rings and diagnoses stalls.

It must keep working while a rank is wedged, so it never talks to the training processes except by
reading their rings (shared memory), sending the faulthandler signal, running py-spy, and raising the
Flight Recorder dump flag in a ring. One runs per job per node (an exclusive lock in the run
directory); it starts with a ready handshake (``watchdog-<node>.json`` appears once it serves) and
exits when its job is over (all ranks gone and nothing new for ``idle_exit`` seconds), when its
launcher has ended and no rank of this node is alive (``exit_with_launcher``), or when no rank has
appeared within ``rank_wait`` seconds.

What it finds is shown on the job's console (see :mod:`dtwatch.watchdog.console`) once per incident and once
per warning, and logged in full to its own log.

This module is the lifecycle and one poll's order of work; each step lives in its own module: reading the
rings (:mod:`~dtwatch.watchdog.ring_poll`), the other nodes (:mod:`~dtwatch.watchdog.peers`), the stall window
(:mod:`~dtwatch.watchdog.window`), the incident and its state machine (:mod:`~dtwatch.watchdog.incident`),
its evidence (:mod:`~dtwatch.watchdog.evidence_collection`), --fail-fast (:mod:`~dtwatch.watchdog.failfast`), warnings
(:mod:`~dtwatch.watchdog.warn`), what is said where (:mod:`~dtwatch.watchdog.outputs`), the exporters' view
(:mod:`~dtwatch.watchdog.metric_view`) and the services (:mod:`~dtwatch.watchdog.services`).
"""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import signal
import sys
import threading
import time

import dtwatch.paths as paths
from dtwatch.bundle.files import Bundle, incident_id
from dtwatch.config import WatchOptions
from dtwatch.diagnose import Diagnosis, Finding, diagnose, entry_lags
from dtwatch.diagnose.rank_state import RankState, from_snapshot
from dtwatch.diagnose.straggler import StragglerWatch
from dtwatch.diagnose.verdict import STALL, verdict
from dtwatch.export.view import WatchdogHealth
from dtwatch.paths import EXIT_FAILED_FAST, EXIT_LOCKED, EXIT_OK
from dtwatch.process_liveness import process_state
from dtwatch.render.notice import render_notice, render_warning
from dtwatch.version import __version__
from dtwatch.watchdog.evidence_collection import collect_evidence
from dtwatch.watchdog.failfast import end_ranks
from dtwatch.watchdog.incident import Incident, OpenIncident, Step, next_step, onset_of
from dtwatch.watchdog.live_evidence import LiveEvidence
from dtwatch.watchdog.metric_view import Poll, node_view
from dtwatch.watchdog.outputs import Outputs
from dtwatch.watchdog.peers import Peers
from dtwatch.watchdog.ring_poll import RingReader, collective_durations
from dtwatch.watchdog.services import Services
from dtwatch.watchdog.warn import Warnings
from dtwatch.watchdog.window import StallWindow

__all__ = ["EXIT_FAILED_FAST", "EXIT_LOCKED", "EXIT_OK", "StallWindow", "WatchOptions", "Watchdog"]

log = logging.getLogger("dtwatch")


class Watchdog:
    """Threads: the main (poll) thread owns everything here; one evidence thread per incident (see
    :mod:`dtwatch.watchdog.incident`) writes that incident's evidence and, with --fail-fast, sets
    ``failed_fast``; the lifeline thread only sets ``launcher_gone``."""

    def __init__(self, opts: WatchOptions) -> None:
        self.opts = opts
        self.run_dir = opts.run_dir
        self.health = WatchdogHealth(started=time.time(), version=__version__)
        self.window = StallWindow(opts)
        self.reader = RingReader(self.run_dir, opts.node)
        self.services = Services(opts, self.error)
        self.outputs = Outputs(opts, self.reader, self.services, self.error)
        self.live = LiveEvidence(self.run_dir, pyspy=opts.pyspy)
        self.warnings = Warnings()
        self.stragglers = StragglerWatch()  # the straggler rule's persistence across polls
        self.peers = Peers(opts, self.error)
        self.incident: OpenIncident | None = None
        self.incidents_total = 0
        self.findings_total: dict[tuple[str, str], int] = {}
        self.failed_fast = False
        self.stop_event = threading.Event()
        self.launcher_gone = threading.Event()
        self.wake = threading.Event()  # ends the wait between polls early (the launcher gone, a signal)
        self.last_seen_activity = time.time()
        self.ever_saw_ranks = False
        self.last_poll = 0.0
        self.lock_fd: int | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def acquire_lock(self) -> bool:
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(paths.watchdog_lock_file(self.run_dir, self.opts.node), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.lock_fd = fd
        return True

    def error(self, component: str) -> None:
        self.health.errors[component] = self.health.errors.get(component, 0) + 1

    def healthy(self) -> bool:
        return time.time() - self.last_poll < max(10.0, 20 * self.opts.poll_interval)

    def run(self) -> int:
        if not self.acquire_lock():
            log.info("dtwatch: a watchdog already runs for %s on %s", self.run_dir, self.opts.node)
            return EXIT_LOCKED
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, self._stop_on_signal)
            except ValueError:
                pass  # not the main thread (tests)
        self.services.start(healthy=self.healthy, started=self.health.started)
        if self.opts.exit_with_launcher:
            threading.Thread(target=self.watch_launcher, name="dtwatch-lifeline", daemon=True).start()
        log.info("dtwatch: watching %s on %s", self.run_dir, self.opts.node)
        try:
            while not self.stop_event.is_set():
                t0 = time.perf_counter()
                try:
                    if self.poll():
                        break
                except Exception as exc:
                    log.exception("dtwatch: watchdog poll failed: %r", exc)
                    self.error("poll")
                self.health.poll_seconds.append(time.perf_counter() - t0)
                self.last_poll = time.time()
                self.wake.wait(self.opts.poll_interval)
                self.wake.clear()
        finally:
            self.peers.close()
            self.services.close()
        return EXIT_FAILED_FAST if self.failed_fast else EXIT_OK

    def _stop_on_signal(self, *_: object) -> None:
        self.stop_event.set()
        self.wake.set()

    def watch_launcher(self) -> None:
        """Block on stdin until the launcher closes it (or dies): then the job is over for us."""
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except (OSError, ValueError):
            pass
        self.launcher_gone.set()
        self.wake.set()  # the next poll, now, acts on it

    # -- one poll -------------------------------------------------------------------------------------
    def poll(self) -> bool:
        """One look at the job; returns True when the watchdog should exit."""
        now = time.time()
        snaps = self.reader.read()
        local = [from_snapshot(s, process=process_state(s.pid)) for s in snaps.values()]
        if local:
            self.ever_saw_ranks = True
        new_records = self.reader.take_new_records(snaps)
        self.window.observe(collective_durations(new_records), local)
        window = self.window.value
        self.peers.exchange(local, now, window=window, incident=self.incident, warnings=self.warnings.all)
        states = self.peers.merge(local)

        # A crash needs no window; a stall needs the window without progress.
        result = diagnose(states, now, window, self.live.for_diagnosis(local, sample=self.peers.sample,
                                                                    earlier=self.warnings.all),
                          heartbeat_stale=self.opts.heartbeat_stale) if states else None
        step = next_step(self.incident, result, states, now, window, view_settling=self.peers.settling(now))
        if step is Step.OPEN and result is not None:
            self.open_incident(states, result, now, window, local_ranks=sorted(snaps))
        elif step is Step.CLOSE:
            self.close_incident(now)  # progress after the diagnosis (e.g. the ranks were restarted)
        elif step is Step.EARLY_DUMPS and result is not None and result.check is not None:
            self.live.request_early_dumps(local, result.check.last_progress, now)
        lags = entry_lags(states)
        # Every poll, so the exporters show who it names now (once the same rank was named for long enough);
        # not while a stall is open (nothing progresses), and a stall starts the rule over.
        straggler = self.stragglers.update(lags, now) if self.incident is None else None
        if self.incident is not None:
            self.stragglers.reset()
        if states and self.incident is None:
            self.report_warnings(states, now, straggler)
        self.export(Poll(now, window, snaps, local, states, new_records, lags, straggler))
        return self.should_exit(local, now)

    def should_exit(self, local: list[RankState], now: float) -> bool:
        if any(not s.gone for s in local) or any(s.last_activity > self.last_seen_activity for s in local):
            self.last_seen_activity = max([now] + [s.last_activity for s in local])
        evidence_idle = self.incident is None or self.incident.evidence_done
        all_gone = all(s.gone for s in local)
        if self.opts.idle_exit and self.ever_saw_ranks and all_gone and \
                now - self.last_seen_activity > self.opts.idle_exit and evidence_idle:
            log.info("dtwatch: all ranks of %s are gone; watchdog exiting", self.opts.job_id)
            return True
        if self.launcher_gone.is_set() and all_gone and evidence_idle:
            log.info("dtwatch: the launcher has ended and no rank of %s is alive on this node; watchdog exiting",
                     self.opts.job_id)
            return True
        if self.opts.rank_wait and not self.ever_saw_ranks and now - self.health.started > self.opts.rank_wait:
            log.warning("dtwatch: no rank of %s appeared in %s within %.0f s (--rank-wait); watchdog exiting",
                        self.opts.job_id, self.run_dir, self.opts.rank_wait)
            return True
        return False

    # -- warnings -------------------------------------------------------------------------------------
    def report_warnings(self, states: list[RankState], now: float, straggler: Finding | None) -> None:
        for f in self.warnings.new(states, now, straggler, self.live.for_diagnosis([])):
            self.count_finding(f)
            log.warning("dtwatch WARNING [%s]: %s", f.kind, f.summary)
            self.outputs.show(render_warning(f), what=f"the {f.kind} warning")
            self.outputs.event({"event": "warning", **f.to_dict()})
            self.outputs.alert("warning", [f])

    def count_finding(self, f: Finding) -> None:
        key = (f.kind, f.severity)
        self.findings_total[key] = self.findings_total.get(key, 0) + 1

    # -- incidents ------------------------------------------------------------------------------------
    def open_incident(self, states: list[RankState], result: Diagnosis, now: float, window: float, *,
                      local_ranks: list[int]) -> None:
        """Write the findings, say them everywhere, then start collecting the evidence in its own thread."""
        findings = result.findings
        inc_id = incident_id(findings[0], states)
        bundle = Bundle(self.run_dir, inc_id, self.opts.node)
        kind = verdict(findings, states, from_exits=result.ended)
        incident = Incident(id=inc_id, verdict=kind, findings=tuple(findings), states=tuple(states),
                            local_ranks=tuple(local_ranks), onset=onset_of(result), detected=now, window=window,
                            bundle=str(bundle.path), sample=self.peers.sample)
        bundle.write_findings(findings, states, {
            "job_id": self.opts.job_id, "window": window, "onset": incident.onset, "detected": now,
            "local_ranks": list(local_ranks), "world_size": states[0].world_size, "verdict": kind,
            # a large job: the other nodes' ranks in states/ are a sample (see dtwatch.diagnose.ViewSample)
            "view_sample": dataclasses.asdict(incident.sample) if incident.sample is not None else None,
        })
        from dtwatch.bundle.file_evidence import FileEvidence
        from dtwatch.render.report_text import render_text

        report = render_text(findings, states, now=now, verdict=kind, evidence=FileEvidence())
        bundle.add_text(paths.BUNDLE_REPORT, report)
        self.incident = OpenIncident(incident)
        self.incidents_total += 1
        for f in findings:
            self.count_finding(f)
            log.error("dtwatch %s [%s]: %s", kind.upper(), f.kind, f.summary)
        shown = self.outputs.show(render_notice(kind, findings, bundle=incident.bundle, run_dir=self.run_dir),
                                  what="the diagnosis")
        # "stall" is the event of every incident (a crash is an incident too); "verdict" says which it is.
        self.outputs.event({"event": "stall", "verdict": kind, "incident_id": inc_id, "bundle": incident.bundle,
                            "shown_on": shown, "findings": [f.to_dict() for f in findings]})
        self.outputs.alert("stall", findings, incident)
        # From here on the bundle object belongs to the evidence thread.
        threading.Thread(target=self.gather_evidence, args=(self.incident, bundle), name="dtwatch-evidence",
                         daemon=True).start()

    def gather_evidence(self, open_incident: OpenIncident, bundle: Bundle) -> None:
        """The evidence thread: collect, record, hand over; then --fail-fast."""
        incident = open_incident.incident
        record = None
        try:
            record = collect_evidence(incident, bundle, self.run_dir, pyspy=self.opts.pyspy,
                                      heartbeat_stale=self.opts.heartbeat_stale, on_error=self.error)
            self.outputs.event({"event": "evidence", "bundle": incident.bundle, **record.to_dict()})
        finally:
            open_incident.deliver(record)
        if self.opts.fail_fast:
            done = end_ranks(incident.local, self.reader.identity, self.outputs, grace=self.opts.fail_fast_grace)
            # Only ending a stall counts as "dtwatch ended the job" (exit 3): after a crash the launcher's
            # own status stands.
            if done is not None and incident.verdict == STALL:
                self.failed_fast = True

    def close_incident(self, now: float) -> None:
        assert self.incident is not None
        inc = self.incident.incident
        log.warning("dtwatch: progress resumed; incident %s closed after %.0fs", inc.id, now - inc.onset)
        self.outputs.event({"event": "resolved", "incident_id": inc.id, "after_s": now - inc.onset})
        self.outputs.alert("resolved", self.incident.findings, inc)
        self.incident = None

    # -- exporters ------------------------------------------------------------------------------------
    def export(self, poll: Poll) -> None:
        self.outputs.local_rank = {s.rank: s.local_rank for s in poll.local}
        if not self.services.exporters:
            return
        view = node_view(
            poll, job_id=self.opts.job_id, node=self.opts.node,
            incident_findings=self.incident.findings if self.incident is not None else None,
            warnings=self.warnings.recent, incidents_total=self.incidents_total,
            findings_total=self.findings_total, restarts=self.reader.restarts, health=self.health,
        )
        self.services.publish(view)
        self.health.poll_seconds = []
