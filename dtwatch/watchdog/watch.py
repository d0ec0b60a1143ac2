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
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dtwatch import __version__
from dtwatch.diagnose import (
    FileEvidence,
    Finding,
    diagnose,
    entry_lags,
    silent_desyncs,
    straggler_warning,
    uneven_loader_warnings,
)
from dtwatch.diagnose.evidence import main_thread_frames
from dtwatch.diagnose.setup import Hold as SetupHold
from dtwatch.diagnose.setup import setup_warnings
from dtwatch.diagnose.state import RankState, from_snapshot
from dtwatch.export.view import NodeView, WatchdogHealth
from dtwatch.record.launcher import lock_path
from dtwatch.report.bundle import Bundle, incident_id, summarize_flight_record
from dtwatch.ring import RankSnapshot, RingFormatError, find_rings, read_ring, request_dump
from dtwatch.watchdog.console import show
from dtwatch.watchdog.notice import STALL, render_fail_fast, render_notice, render_warning, verdict
from dtwatch.watchdog.proctree import identity, parent_pid, running, terminate_trees, tree
from dtwatch.watchdog.stacks import faulthandler_dump, process_ending, pyspy_dump

log = logging.getLogger("dtwatch")

EXIT_OK, EXIT_USAGE, EXIT_FAILED_FAST, EXIT_LOCKED = 0, 2, 3, 4


@dataclass(kw_only=True)
class WatchOptions:
    dir: str
    """Root of run directories (``DTWATCH_DIR``); the job's rings are in ``<dir>/<job_id>``."""
    job_id: str
    node: str = field(default_factory=socket.gethostname)
    stall_window: float | None = None
    """Fixed stall window in seconds; None adapts it to the job within [window_floor, window_ceiling]."""
    window_floor: float = 20.0
    window_ceiling: float = 600.0
    window_multiplier: float = 10.0
    startup_window: float = 120.0
    """Window before every rank finished a first step (loading, compiling, first rendezvous)."""
    poll_interval: float = 1.0
    """Seconds between looks at the rings (detection takes up to the window plus one poll)."""
    metrics_addr: str = "0.0.0.0"
    metrics_port: int | None = 9464
    """None: no Prometheus endpoint; 0: any free port."""
    webhook: str = ""
    fail_fast: bool = False
    store: str = ""
    """HOST:PORT of the job's c10d store for cross-node comparison; "" = from MASTER_ADDR/PORT; "none" = off."""
    idle_exit: float = 30.0
    """Exit when all ranks are gone and nothing new appeared for this long; 0 = never."""
    rank_wait: float = 3600.0
    """Exit if no rank has appeared this long after start; 0 = wait forever. The default outlasts torch's
    30-minute rendezvous timeout: a ring appears only once the default process group exists."""
    exit_with_launcher: bool = False
    """Standard input is a pipe held by the launcher (``dtwatch run``): once it closes (the command ended,
    or the launcher died, even by SIGKILL), exit as soon as no rank of this node is alive."""
    console: str = "auto"
    """Where diagnoses and warnings are shown: ``auto`` (a live local rank's stderr), ``stderr`` (ours), ``off``."""
    fail_fast_grace: float = 5.0
    """Seconds between SIGTERM and SIGKILL when --fail-fast ends the ranks and the processes they started."""
    pyspy: bool = True
    otlp_endpoint: str = ""
    heartbeat_stale: float | None = None
    store_interval: float = 2.0

    @property
    def run_dir(self) -> str:
        return os.path.join(self.dir, self.job_id)


class StallWindow:
    """The stall window: fixed, or ``multiplier`` x the longest collective seen, clamped to [floor, ceiling]."""

    def __init__(self, opts: WatchOptions) -> None:
        self.fixed = opts.stall_window
        self.floor, self.ceiling, self.multiplier = opts.window_floor, opts.window_ceiling, opts.window_multiplier
        self.startup = opts.startup_window
        self.longest = 0.0
        self.started = False

    def observe(self, durations: np.ndarray, states: list[RankState]) -> None:
        if len(durations):
            self.longest = max(self.longest, float(durations.max()))
        if not self.started and states and all(s.step >= 1 for s in states):
            self.started = True

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return self.fixed
        adaptive = min(max(self.multiplier * self.longest, self.floor), self.ceiling)
        return adaptive if self.started else max(adaptive, self.startup)


class Watchdog:
    def __init__(self, opts: WatchOptions) -> None:
        self.opts = opts
        self.run_dir = opts.run_dir
        self.window = StallWindow(opts)
        self.health = WatchdogHealth(started=time.time(), version=__version__)
        self.identity: dict[int, tuple[int, float]] = {}  # rank -> (pid, start_time)
        self.restarts: dict[int, int] = {}
        self.processed: dict[int, int] = {}  # rank -> highest stamp looked at
        self.in_flight: dict[int, set[int]] = {}  # rank -> stamps seen in flight, handed over when they complete
        self.incident: dict | None = None
        self.incidents_total = 0
        self.findings_total: dict[tuple[str, str], int] = {}
        self.warned: set[tuple] = set()
        self.silent_reported: set[tuple] = set()  # (group, seq) of silent desyncs reported
        self.setup_hold = SetupHold()  # setup warnings wait for the ranks a moment behind
        self.warnings: list[Finding] = []
        self.exporters: list = []
        self.webhook = None
        self.store = None
        self.store_last = 0.0
        self.remote: list[RankState] = []
        self.failed_fast = False
        self.stop_event = threading.Event()
        self.last_seen_activity = time.time()
        self.ever_saw_ranks = False
        # Flight Recorder dumps requested while a stall is suspected (before the window is up), so the
        # first diagnosis can name C++-issued collectives: {"episode": last progress time, "requests":
        # {rank: request id}, "summaries": {rank: summary}, "at": time requested}.
        self.early_fr: dict = {"episode": None, "requests": {}, "summaries": {}, "at": 0.0}
        self.lock_fd: int | None = None
        self.metrics_server = None
        self.gpu = None
        self.last_view: NodeView | None = None
        self.parents: dict[int, int] = {}  # rank -> its parent (launcher) when first seen
        self.console_failed = False
        self.launcher_gone = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------------------
    def acquire_lock(self) -> bool:
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(lock_path(self.run_dir, self.opts.node), os.O_RDWR | os.O_CREAT, 0o644)
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

    def start_services(self) -> None:
        opts = self.opts
        try:
            from dtwatch.export.nvml import GpuSampler

            self.gpu = GpuSampler()
        except Exception as exc:  # noqa: BLE001 - NVML is optional
            log.debug("dtwatch: no GPU metrics: %r", exc)
            self.gpu = None
        if opts.metrics_port is not None:
            try:
                from dtwatch.export.prometheus import MetricsServer, PrometheusExporter

                exporter = PrometheusExporter(job_id=opts.job_id, node=opts.node, gpu=self.gpu)
                self.metrics_server = MetricsServer(
                    exporter.registry, addr=opts.metrics_addr, port=opts.metrics_port,
                    health_fn=self.healthy, url_file=os.path.join(self.run_dir, f"watchdog-{opts.node}.json"),
                    node=opts.node,
                )
                self.exporters.append(exporter)
            except OSError as exc:
                log.warning("dtwatch: metrics endpoint %s:%s unavailable (%s); diagnosis continues without it",
                            opts.metrics_addr, opts.metrics_port, exc)
                self.error("metrics")
            except ImportError as exc:
                log.warning("dtwatch: Prometheus exporter unavailable: %s", exc)
        otlp_wanted = opts.otlp_endpoint or any(
            os.environ.get(f"OTEL_EXPORTER_OTLP_{k}ENDPOINT") for k in ("", "TRACES_", "METRICS_"))
        try:
            from dtwatch.export.otel import OtelExporter  # only imported when an endpoint is configured

            otel = None if not otlp_wanted else OtelExporter.from_env(endpoint=opts.otlp_endpoint or None, job_id=opts.job_id, node=opts.node, gpu=self.gpu)
            if otel is not None:
                self.exporters.append(otel)
        except ImportError as exc:
            if opts.otlp_endpoint:
                log.warning("dtwatch: OpenTelemetry export unavailable (pip install 'dtwatch[otel]'): %s", exc)
        except Exception as exc:  # noqa: BLE001
            log.warning("dtwatch: OpenTelemetry export unavailable: %s", exc)
            self.error("otel")
        if opts.webhook:
            from dtwatch.export.webhook import Webhook

            self.webhook = Webhook(opts.webhook, on_error=lambda: self.error("webhook"))
        store = opts.store or (
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT") else ""
        )
        if store and store != "none":
            host, _, port = store.rpartition(":")
            from dtwatch.watchdog.exchange import JobStore

            self.store = JobStore(host, int(port), opts.job_id, opts.node)
        ready_path = os.path.join(self.run_dir, f"watchdog-{opts.node}.json")
        try:
            ready = json.loads(Path(ready_path).read_text()) if self.metrics_server is not None else {}
        except (OSError, ValueError):
            ready = {}
        ready.update({"pid": os.getpid(), "node": opts.node, "job_id": opts.job_id, "started": self.health.started,
                      "url": getattr(self.metrics_server, "url", None)})
        _atomic_json(ready_path, ready)
        if self.metrics_server is not None:
            self.metrics_server.ready = True

    def healthy(self) -> bool:
        return time.time() - self.last_poll < max(10.0, 20 * self.opts.poll_interval)

    last_poll = 0.0

    def run(self) -> int:
        if not self.acquire_lock():
            log.info("dtwatch: a watchdog already runs for %s on %s", self.run_dir, self.opts.node)
            return EXIT_LOCKED
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, lambda *_: self.stop_event.set())
            except ValueError:
                pass  # not the main thread (tests)
        self.start_services()
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
                self.stop_event.wait(self.opts.poll_interval)
        finally:
            self.shutdown()
        return EXIT_FAILED_FAST if self.failed_fast else EXIT_OK

    def watch_launcher(self) -> None:
        """Block on stdin until the launcher closes it (or dies): then the job is over for us."""
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except (OSError, ValueError):
            pass
        self.launcher_gone.set()  # the next poll acts on it

    def shutdown(self) -> None:
        for exp in self.exporters:
            try:
                exp.shutdown()
            except Exception:  # noqa: BLE001
                pass
        if self.webhook is not None:
            self.webhook.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.gpu is not None:
            self.gpu.close()

    # -- one poll -------------------------------------------------------------------------------------
    def read_local(self) -> dict[int, RankSnapshot]:
        snaps: dict[int, RankSnapshot] = {}
        for path in find_rings(self.run_dir):
            try:
                snap = read_ring(path)
            except (OSError, RingFormatError):
                continue
            if snap.host != self.opts.node and snap.host != socket.gethostname():
                continue
            ident = (snap.pid, snap.start_time)
            old = self.identity.get(snap.rank)
            if old is not None and old != ident:
                self.restarts[snap.rank] = self.restarts.get(snap.rank, 0) + 1
                self.processed[snap.rank] = 0
                self.in_flight[snap.rank] = set()
            if old != ident:
                ppid = parent_pid(snap.pid)
                if ppid is not None:
                    self.parents[snap.rank] = ppid
            self.identity[snap.rank] = ident
            snaps[snap.rank] = snap
        return snaps

    def poll(self) -> bool:
        """One look at the job; returns True when the watchdog should exit."""
        now = time.time()
        snaps = self.read_local()
        local = [from_snapshot(s) for s in snaps.values()]
        if local:
            self.ever_saw_ranks = True
        new_records = self.take_new_records(snaps)
        durations = np.concatenate([
            (r["t_exit"] - r["t_enter"])[(r["flags"] & 16) == 0] for r in new_records.values()
        ]) if new_records else np.empty(0)
        self.window.observe(durations, local)
        self.exchange(local, now)
        states = self.merge(local)
        window = self.window.value

        # A crash needs no window; a stall needs the window without progress.
        result = diagnose(states, now, window, self.evidence(local), heartbeat_stale=self.opts.heartbeat_stale) \
            if states else None
        if self.incident is None and result is not None and result.stalled and result.findings:
            onset = min((f.onset for f in result.findings if f.onset), default=result.check.last_progress)
            self.open_incident(states, result.findings, now, snaps, onset=onset, from_exits=result.ended)
        elif self.incident is not None and self.incident["evidence_done"] and result is not None \
                and not result.stalled and max(s.last_activity for s in states) > self.incident["detected"]:
            self.close_incident(now)  # progress after the diagnosis (e.g. the ranks were restarted)
        elif self.incident is None and result is not None and result.check is not None and result.check.blocked \
                and now - result.check.last_progress > window / 2:
            self.request_early_dumps(local, result.check.last_progress, now)
        lags = entry_lags(states)
        # Every poll, so the exporters show who it names now; not while a stall is open (nothing progresses).
        straggler = straggler_warning(lags, now) if self.incident is None else None
        if states and self.incident is None:
            self.check_warnings(states, now, straggler)

        self.export(snaps, local, states, new_records, now, window, lags, straggler)
        if any(not s.gone for s in local) or any(s.last_activity > self.last_seen_activity for s in local):
            self.last_seen_activity = max([now] + [s.last_activity for s in local])
        if self.opts.idle_exit and self.ever_saw_ranks and all(s.gone for s in local) and \
                now - self.last_seen_activity > self.opts.idle_exit and self.incident_idle():
            log.info("dtwatch: all ranks of %s are gone; watchdog exiting", self.opts.job_id)
            return True
        if self.launcher_gone.is_set() and all(s.gone for s in local) and self.incident_idle():
            log.info("dtwatch: the launcher has ended and no rank of %s is alive on this node; watchdog exiting",
                     self.opts.job_id)
            return True
        if self.opts.rank_wait and not self.ever_saw_ranks and now - self.health.started > self.opts.rank_wait:
            log.warning("dtwatch: no rank of %s appeared in %s within %.0f s (--rank-wait); watchdog exiting",
                        self.opts.job_id, self.run_dir, self.opts.rank_wait)
            return True
        return False

    def request_early_dumps(self, local: list[RankState], episode: float, now: float) -> None:
        """Ask this node's ranks for their Flight Recorder once per quiet episode (at most once a minute):
        their sampler threads write it while the main threads are blocked."""
        early = self.early_fr
        if early["episode"] == episode or now - early["at"] < 60.0:
            return
        requests = {}
        for s in local:
            if s.alive and not s.gone:
                try:
                    requests[s.rank] = request_dump(s.ring_path)
                except OSError:
                    pass
        self.early_fr = {"episode": episode, "requests": requests, "summaries": {}, "at": now}

    def early_flight_records(self) -> dict[int, dict]:
        """Summaries of the early Flight Recorder dumps that have been written so far."""
        early = self.early_fr
        for rank, req in early["requests"].items():
            if rank not in early["summaries"]:
                path = os.path.join(self.run_dir, "fr", f"rank-{rank:05d}.{req}.pkl")
                if os.path.exists(path):
                    summary = summarize_flight_record(path)
                    if summary is not None:
                        early["summaries"][rank] = summary
        return dict(early["summaries"])

    def evidence(self, local: list[RankState]) -> FileEvidence:
        """What the diagnosis may look at: sources here, py-spy on demand for this node's ranks (only
        the ranks a decision needs: a wedged rank, one outside any collective), how processes ended."""
        by_rank = {s.rank: s for s in local}
        stacks: dict[int, list[dict] | None] = {}

        def stack(rank: int) -> list[dict] | None:
            s = by_rank.get(rank)
            if s is None or not s.alive or not self.opts.pyspy:
                return None
            if rank not in stacks:
                dump = pyspy_dump(rank, s.pid, timeout=5.0)
                stacks[rank] = main_thread_frames(dump.threads) if dump.ok else None
            return stacks[rank]

        def ending(rank: int) -> dict | None:
            s = by_rank.get(rank)
            return process_ending(self.run_dir, rank, s.start_time) if s is not None else None

        return FileEvidence(stacks=stack, endings=ending,
                            flight_records=self.early_flight_records() if self.early_fr["requests"] else None)

    def incident_idle(self) -> bool:
        return self.incident is None or self.incident.get("evidence_done", True)

    def take_new_records(self, snaps: dict[int, RankSnapshot]) -> dict[int, np.ndarray]:
        """Records completed since the last poll, per rank. A record still in flight is handed over once it
        completes, however many later records completed before it (an irecv may stay posted for long)."""
        out = {}
        for rank, snap in snaps.items():
            recs = snap.records
            last, waiting = self.processed.get(rank, 0), self.in_flight.get(rank, set())
            stamps = recs["stamp"]
            fresh = (stamps > last) | np.isin(stamps, list(waiting))
            done = recs[fresh & (recs["t_exit"] != 0.0)]
            self.in_flight[rank] = set(int(x) for x in stamps[fresh & (recs["t_exit"] == 0.0)])
            if len(recs):
                self.processed[rank] = max(last, int(stamps.max()))
            out[rank] = done
        return out

    def exchange(self, local: list[RankState], now: float) -> None:
        if self.store is None or not local:
            return
        world = local[0].world_size
        if len(local) >= world:
            return  # every rank is on this node
        suspicious = any(s.open_calls for s in local)
        interval = self.opts.store_interval if suspicious or self.incident else self.opts.store_interval * 5
        if now - self.store_last < interval:
            return
        self.store_last = now
        try:
            self.store.publish(local)
            self.remote = self.store.fetch()
        except Exception as exc:  # noqa: BLE001
            if self.health.errors.get("store", 0) == 0:
                log.warning("dtwatch: cannot reach the job's store %s:%s (%s); diagnosing with this node's ranks only",
                            self.store.host, self.store.port, exc)
            self.error("store")  # retried at the next interval: the store may not be up yet

    def merge(self, local: list[RankState]) -> list[RankState]:
        mine = {s.rank for s in local}
        return sorted(local + [s for s in self.remote if s.rank not in mine], key=lambda s: s.rank)

    # -- warnings -------------------------------------------------------------------------------------
    def check_warnings(self, states: list[RankState], now: float, straggler: Finding | None) -> None:
        found = uneven_loader_warnings(states, now)
        if straggler is not None:
            found.append(straggler)
        found += silent_desyncs(states, now, self.silent_reported, self.evidence([]))
        found += self.setup_hold.due(setup_warnings(states, now), now, states[0].world_size)
        for f in found:
            key: tuple
            if f.details.get("silent"):
                key = (f.kind, f.group, f.seq)
            elif f.details.get("check"):
                key = ("setup", f.details["check"])  # each setup check warns once per run
            else:
                key = (f.kind, tuple(f.ranks), json.dumps(f.details.get("loader", {}).get("lengths")) if f.kind != "straggler" else "")
            if key in self.warned:
                continue
            self.warned.add(key)
            self.warnings.append(f)
            self.count_finding(f)
            log.warning("dtwatch WARNING [%s]: %s", f.kind, f.summary)
            self.show(render_warning(f), what=f"the {f.kind} warning")
            self.append_event({"event": "warning", **f.to_dict()})
            if self.webhook is not None:
                self.webhook.send(self.alert_payload("warning", [f]))

    def count_finding(self, f: Finding) -> None:
        key = (f.kind, f.severity)
        self.findings_total[key] = self.findings_total.get(key, 0) + 1

    def append_event(self, event: dict) -> None:
        try:
            with open(os.path.join(self.run_dir, f"events-{self.opts.node}.jsonl"), "a") as f:
                f.write(json.dumps(event, default=str) + "\n")
        except OSError:
            self.error("events")

    def show(self, text: str, *, what: str) -> str | None:
        """Put ``text`` on the job's console; returns where, or None (then one warning in our log)."""
        candidates = [self.identity[r][0] for r in sorted(self.identity, key=self._local_rank_order)
                      if running(self.identity[r][0])]
        candidates += [p for p in dict.fromkeys(self.parents.values()) if p > 1 and running(p)]
        done = show(text, self.opts.console, candidates)
        if done.ok:
            log.info("dtwatch: showed %s on the console (%s)", what, done.where)
            return done.where
        if self.opts.console != "off" and not self.console_failed:
            self.console_failed = True
            log.warning("dtwatch: could not show %s on the job's console: %s (it is in this log and the bundle)",
                        what, done.error)
        self.error("console")
        return None

    def _local_rank_order(self, rank: int) -> tuple:
        view = self.last_view
        local = {s.rank: s.local_rank for s in view.local} if view is not None else {}
        return (local.get(rank, rank), rank)

    def alert_payload(self, status: str, findings: list[Finding]) -> dict:
        return {
            "source": "dtwatch", "status": status, "job_id": self.opts.job_id, "node": self.opts.node,
            "incident_id": self.incident["id"] if self.incident else None,
            "verdict": self.incident["verdict"] if self.incident else None,
            "bundle": str(self.incident["bundle"].path) if self.incident else None,
            "summary": findings[0].summary if findings else "",
            "findings": [f.to_dict() for f in findings],
        }

    # -- incidents ------------------------------------------------------------------------------------
    def open_incident(self, states: list[RankState], findings: list[Finding], now: float,
                      snaps: dict[int, RankSnapshot], onset: float, from_exits: bool = False) -> None:
        inc = incident_id(findings[0], states)
        bundle = Bundle(self.run_dir, inc, self.opts.node)
        local = [s for s in states if s.rank in snaps]
        kind = verdict(findings, states, from_exits=from_exits)
        bundle.write_findings(findings, states, {
            "job_id": self.opts.job_id, "window": self.window.value, "onset": onset,
            "detected": now, "local_ranks": sorted(snaps), "world_size": states[0].world_size, "verdict": kind,
        })
        from dtwatch.report.text import render_text

        bundle.add_text("report.txt", render_text(findings, states, now=now, verdict=kind))
        self.incident = {"id": inc, "bundle": bundle, "findings": findings, "onset": onset,
                         "detected": now, "evidence_done": False, "verdict": kind}
        self.incidents_total += 1
        for f in findings:
            self.count_finding(f)
            log.error("dtwatch %s [%s]: %s", kind.upper(), f.kind, f.summary)
        shown = self.show(render_notice(kind, findings, bundle=str(bundle.path), run_dir=self.run_dir),
                          what="the diagnosis")
        # "stall" is the event of every incident (a crash is an incident too); "verdict" says which it is.
        self.append_event({"event": "stall", "verdict": kind, "incident_id": inc, "bundle": str(bundle.path),
                           "shown_on": shown, "findings": [f.to_dict() for f in findings]})
        if self.webhook is not None:
            self.webhook.send(self.alert_payload("stall", findings))
        threading.Thread(target=self.collect_evidence, args=(states, local, snaps), name="dtwatch-evidence",
                         daemon=True).start()

    def collect_evidence(self, states: list[RankState], local: list[RankState], snaps: dict[int, RankSnapshot]) -> None:
        inc = self.incident
        if inc is None:
            return
        bundle: Bundle = inc["bundle"]
        findings: list[Finding] = inc["findings"]
        try:
            requests = {}
            for s in local:
                try:
                    requests[s.rank] = request_dump(s.ring_path)
                except OSError:
                    pass
            for s in local:
                bundle.copy(s.ring_path, f"rings/rank-{s.rank:05d}.ring")
            fr_summaries: dict[int, dict] = {}
            dumps = self.collect_stacks(bundle, local)
            deadline = time.time() + 3.0
            pending = dict(requests)
            while pending and time.time() < deadline:
                for rank, req in list(pending.items()):
                    fr = os.path.join(self.run_dir, "fr", f"rank-{rank:05d}.{req}.pkl")
                    if os.path.exists(fr):
                        bundle.copy(fr, f"fr/rank-{rank:05d}.pkl")
                        summary = summarize_flight_record(fr)
                        if summary is not None:
                            bundle.add_json(f"fr/rank-{rank:05d}.json", summary)
                            fr_summaries[rank] = summary
                        del pending[rank]
                time.sleep(0.1)
            for rank in pending:
                bundle.add_text(f"fr/rank-{rank:05d}.missing.txt",
                                "no Flight Recorder dump: the rank's sampler thread did not answer (GIL held or process stopped)\n")
            self.refine(findings, states, local, dumps, fr_summaries)
            for s in local:
                ending = process_ending(self.run_dir, s.rank, s.start_time)
                if ending is not None:
                    bundle.add_json(f"endings/rank-{s.rank:05d}.json", ending)
            try:
                from dtwatch.report.timeline import render_svg

                bundle.add_text("timeline.svg", render_svg(states, findings, now=inc["detected"]))
            except Exception as exc:  # noqa: BLE001
                log.debug("dtwatch: timeline failed: %r", exc)
            from dtwatch.report.text import render_text

            bundle.add_text("report.txt", render_text(findings, states, now=inc["detected"], bundle_dir=str(bundle.path),
                                                      verdict=inc.get("verdict")))
            bundle.add_json("findings.json", [f.to_dict() for f in findings])
            bundle.write_index(findings, complete=True)
        except Exception as exc:
            log.exception("dtwatch: collecting evidence failed: %r", exc)
            self.error("dump")
        finally:
            inc["evidence_done"] = True
        if self.opts.fail_fast:
            self.fail_fast(local)

    def refine(self, findings: list[Finding], states: list[RankState], local: list[RankState],
               dumps: dict, fr_summaries: dict[int, dict]) -> None:
        """The same diagnosis again with the evidence collected since (stacks, Flight Recorder entries
        naming C++-issued calls); the incident's findings are replaced in place."""
        frames = {r: main_thread_frames(d.threads) for r, d in dumps.items() if d is not None and d.threads}
        by_rank = {s.rank: s for s in local}
        ev = FileEvidence(stacks=frames.get, flight_records=fr_summaries,
                          endings=lambda r: process_ending(self.run_dir, r, by_rank[r].start_time) if r in by_rank else None)
        detected = self.incident["detected"] if self.incident else time.time()
        refined = diagnose(states, detected, self.window.value, ev, heartbeat_stale=self.opts.heartbeat_stale,
                           assume_stalled=True).findings
        if refined:
            findings[:] = refined

    def collect_stacks(self, bundle: Bundle, local: list[RankState]) -> dict:
        results: dict[int, object] = {}

        def one(s: RankState) -> None:
            dump = None
            if self.opts.pyspy and s.alive:
                dump = pyspy_dump(s.rank, s.pid)
            if (dump is None or not dump.ok) and s.alive and s.proc_state != "T":
                stack_file = os.path.join(self.run_dir, "stacks", f"rank-{s.rank:05d}.txt")
                fh = faulthandler_dump(s.rank, s.pid, s.stack_signal, stack_file)
                if dump is not None and not dump.ok:
                    fh.advice, fh.error = dump.advice, f"py-spy: {dump.error}"
                dump = fh
            results[s.rank] = dump

        threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in local if not s.gone]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        for rank, dump in sorted(results.items()):
            if dump is None:
                continue
            header = f"# rank {rank} pid {dump.pid}: {dump.method} {'ok' if dump.ok else 'FAILED: ' + dump.error}\n"
            if dump.advice:
                header += f"# advice: {dump.advice}\n"
            bundle.add_text(f"stacks/rank-{rank:05d}.txt", header + dump.text)
            if dump.threads is not None:
                bundle.add_json(f"stacks/rank-{rank:05d}.json", dump.threads)
        return results

    def fail_fast(self, local: list[RankState]) -> None:
        """End this node's ranks and everything they started, so torchrun / Kubernetes can restart the job
        instead of waiting out the timeout. Only ending a stall counts as "dtwatch ended the job" (exit 3):
        after a crash the launcher's own status stands."""
        live = [s for s in local if running(s.pid) and self.identity.get(s.rank, (s.pid,))[0] == s.pid]
        if not live:
            log.info("dtwatch: --fail-fast: no rank of this node is alive any more; nothing to end")
            return
        ranks = [s.rank for s in live]
        started = len(tree([p for p in (identity(s.pid) for s in live) if p is not None], frozenset({os.getpid()}))) - len(live)
        log.error("dtwatch: --fail-fast: terminating this node's ranks %s and their descendants", ranks)
        self.show(render_fail_fast(ranks, max(started, 0)), what="the --fail-fast notice")
        done = terminate_trees([s.pid for s in live], grace=self.opts.fail_fast_grace)
        if not done.roots:
            return
        if self.incident is not None and self.incident.get("verdict") == STALL:
            self.failed_fast = True
        log.error("dtwatch: --fail-fast: ended ranks %s (pids %s) and %d descendant(s) %s; SIGKILL needed for %s%s",
                  ranks, done.roots, len(done.descendants), done.descendants, done.killed or "none",
                  f"; STILL ALIVE: {done.survivors}" if done.survivors else "")
        self.append_event({"event": "fail_fast", "ranks": ranks, "pids": done.roots, "descendants": done.descendants,
                           "killed": done.killed, "survivors": done.survivors})

    def close_incident(self, now: float) -> None:
        inc = self.incident
        log.warning("dtwatch: progress resumed; incident %s closed after %.0fs", inc["id"], now - inc["onset"])
        self.append_event({"event": "resolved", "incident_id": inc["id"], "after_s": now - inc["onset"]})
        if self.webhook is not None:
            self.webhook.send({**self.alert_payload("resolved", inc["findings"])})
        self.incident = None

    # -- exporters ------------------------------------------------------------------------------------
    def export(self, snaps, local, states, new_records, now, window, lags, straggler) -> None:
        if not self.exporters:
            return
        lag: dict[tuple[int, str], int] = {}
        leaders: dict[str, int] = {}
        for s in states:
            for g in s.groups.values():
                leaders[g.name] = max(leaders.get(g.name, 0), g.seq)
        for s in local:
            for g in s.groups.values():
                lag[(s.rank, g.name)] = leaders[g.name] - g.seq
        findings = list(self.incident["findings"]) if self.incident else []
        stalled = set(f_r for f in findings for f_r in f.ranks + f.waiting_ranks)
        culprits = set(r for f in findings for r in f.ranks)
        health = self.health
        view = NodeView(
            job_id=self.opts.job_id, node=self.opts.node, now=now, window=window, local=local,
            all_states=states, snapshots=snaps, new_records=new_records, seq_lag=lag,
            straggler_lag=lags.medians, stalled_ranks=stalled, culprit_ranks=culprits,
            incident_open=self.incident is not None, incidents_total=self.incidents_total,
            findings_total=dict(self.findings_total), restarts=dict(self.restarts),
            findings=findings + self.warnings[-20:], health=health,
            straggler_ranks=set(straggler.ranks) if straggler is not None else set(),
        )
        self.last_view = view
        for exp in self.exporters:
            try:
                exp.update(view)
            except Exception as exc:  # noqa: BLE001
                self.error(type(exp).__name__)
                log.debug("dtwatch: exporter failed: %r", exc)
        health.poll_seconds = []




def _atomic_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)
