"""Where the watchdog says what it found: the events file, the job's console, and the alert webhook.

Used by the poll thread and, for an incident's evidence and --fail-fast, by the evidence thread: the
events file is appended under a lock, one JSON object a line; the console and the webhook are safe to
use from either (the console reads the reader's mappings, which are replaced whole, never edited).
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence

import dtwatch.paths as paths
from dtwatch.config import WatchOptions
from dtwatch.diagnose import Finding
from dtwatch.watchdog.console import show
from dtwatch.watchdog.incident import Incident
from dtwatch.watchdog.proctree import running
from dtwatch.watchdog.ring_poll import RingReader
from dtwatch.watchdog.services import Services

log = logging.getLogger("dtwatch")


class Outputs:
    def __init__(self, opts: WatchOptions, reader: RingReader, services: Services,
                 on_error: Callable[[str], None]) -> None:
        self.opts = opts
        self.reader = reader
        self.services = services
        self.on_error = on_error
        self.events_path = paths.events_file(opts.run_dir, opts.node)
        self.local_rank: dict[int, int] = {}  # global rank -> local rank, replaced whole by the poll thread
        self._events_lock = threading.Lock()
        self._console_failed = False

    def event(self, event: dict) -> None:
        """Append one event to ``events-<node>.jsonl``."""
        line = json.dumps(event, default=str) + "\n"
        try:
            with self._events_lock, open(self.events_path, "a") as f:
                f.write(line)
        except OSError:
            self.on_error("events")

    def show(self, text: str, *, what: str) -> str | None:
        """Put ``text`` on the job's console; returns where, or None (then one warning in our log)."""
        identity, parents, local_rank = self.reader.identity, self.reader.parents, self.local_rank
        order = sorted(identity, key=lambda r: (local_rank.get(r, r), r))
        candidates = [identity[r][0] for r in order if running(identity[r][0])]
        candidates += [p for p in dict.fromkeys(parents.values()) if p > 1 and running(p)]
        done = show(text, self.opts.console, candidates)
        if done.ok:
            log.info("dtwatch: showed %s on the console (%s)", what, done.where)
            return done.where
        if self.opts.console != "off" and not self._console_failed:
            self._console_failed = True
            log.warning("dtwatch: could not show %s on the job's console: %s (it is in this log and the bundle)",
                        what, done.error)
        self.on_error("console")
        return None

    def alert(self, status: str, findings: Sequence[Finding], incident: Incident | None = None) -> None:
        """POST an alert to the webhook, if one is configured: ``stall``, ``warning`` or ``resolved``."""
        if self.services.webhook is None:
            return
        self.services.alert({
            "source": "dtwatch", "status": status, "job_id": self.opts.job_id, "node": self.opts.node,
            "incident_id": incident.id if incident else None,
            "verdict": incident.verdict if incident else None,
            "bundle": incident.bundle if incident else None,
            "summary": findings[0].summary if findings else "",
            "findings": [f.to_dict() for f in findings],
        })
