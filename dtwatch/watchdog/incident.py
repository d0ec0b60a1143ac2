"""The incident: what the watchdog diagnosed and sent, as one immutable record, and what to do next.

Thread ownership. The poll thread (the watchdog's main loop) decides, creates an :class:`Incident` and
sends it (bundle, events, console, webhook). From then on nobody changes it: it is frozen and its
findings are a tuple. The evidence thread (one per incident, :mod:`dtwatch.watchdog.evidence_collection`) reads it
and adds what it learned as a new record, :class:`IncidentEvidence`, handed over once through
:class:`OpenIncident` (a write, then an event; the poll thread reads it only after the event). The
bundle's files written at detection are not rewritten by the evidence thread; it adds files, an
``evidence`` event, and rewrites only the bundle's index (which lists the files).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum

from dtwatch.diagnose import Diagnosis, Finding, ViewSample
from dtwatch.diagnose.rank_state import RankState


@dataclass(frozen=True)
class Incident:
    """An incident as diagnosed and sent; written once by the poll thread."""

    id: str
    verdict: str
    """``stall`` or ``crash`` (see :func:`dtwatch.render.notice.verdict`)."""
    findings: tuple[Finding, ...]
    """Stall-severity findings, culprits first, as written to ``findings.json`` and sent."""
    states: tuple[RankState, ...]
    """Every rank known at detection (this node's and other nodes'): a private copy."""
    local_ranks: tuple[int, ...]
    """This node's ranks."""
    onset: float
    detected: float
    window: float
    bundle: str
    """The bundle's directory (``incidents/<id>/<node>``)."""
    sample: ViewSample | None = None
    """The other nodes' ranks were a sample of a large job (see :class:`dtwatch.diagnose.ViewSample`)."""

    @property
    def local(self) -> list[RankState]:
        return [s for s in self.states if s.rank in self.local_ranks]


@dataclass(frozen=True)
class IncidentEvidence:
    """What the evidence added to an incident; written once by its evidence thread."""

    incident_id: str
    findings: tuple[Finding, ...]
    """The diagnosis made again with the evidence (stacks, Flight Recorder dumps, how processes ended);
    the incident's own findings when the evidence changed nothing."""
    refined: bool
    """True when ``findings`` differ from the incident's."""
    files: tuple[str, ...]
    """The bundle's files, relative to it."""
    complete: bool
    """False when collecting failed part way (the watchdog's log says why)."""
    collected: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {"incident_id": self.incident_id, "refined": self.refined, "complete": self.complete,
                "collected": self.collected, "files": list(self.files),
                "findings": [f.to_dict() for f in self.findings]}


class OpenIncident:
    """The open incident and the hand-over of its evidence from the evidence thread to the poll thread."""

    def __init__(self, incident: Incident) -> None:
        self.incident = incident
        self._evidence: IncidentEvidence | None = None
        self._done = threading.Event()

    def deliver(self, evidence: IncidentEvidence | None) -> None:
        """Evidence thread, once: its record (None when collecting failed before one was made)."""
        self._evidence = evidence
        self._done.set()

    @property
    def evidence_done(self) -> bool:
        return self._done.is_set()

    @property
    def evidence(self) -> IncidentEvidence | None:
        return self._evidence if self._done.is_set() else None

    @property
    def findings(self) -> tuple[Finding, ...]:
        """The latest conclusion: the evidence's findings once they are in, the incident's before."""
        ev = self.evidence
        return ev.findings if ev is not None else self.incident.findings


class Step(Enum):
    """What a poll does about incidents."""

    NOTHING = "nothing"
    OPEN = "open"
    CLOSE = "close"
    EARLY_DUMPS = "early_dumps"
    """A stall is suspected (half the window without progress): ask for Flight Recorder dumps now, so the
    diagnosis can name C++-issued collectives when the window is up."""


def next_step(open_incident: OpenIncident | None, result: Diagnosis | None, states: list[RankState], now: float,
              window: float, *, view_settling: bool = False) -> Step:
    """The incident state machine: open on a diagnosed stall or crash; close once the evidence is in and
    ranks progressed after the detection (e.g. they were restarted); otherwise maybe dump early.

    ``view_settling``: the cross-node view still lacks ranks chosen for it (see
    :meth:`dtwatch.watchdog.exchange.Exchange.settling`). A stall is then not opened yet: an incident is
    written once, and one opened on a partial view could name a victim for lack of the rank it waits for.
    A crash is (its findings come from how ranks ended, not from comparing them)."""
    if result is None:
        return Step.NOTHING
    if open_incident is None:
        if result.stalled and result.findings and (result.ended or not view_settling):
            return Step.OPEN
        check = result.check
        if check is not None and check.blocked and now - check.last_progress > window / 2:
            return Step.EARLY_DUMPS
        return Step.NOTHING
    if open_incident.evidence_done and not result.stalled and \
            max(s.last_activity for s in states) > open_incident.incident.detected:
        return Step.CLOSE
    return Step.NOTHING


def onset_of(result: Diagnosis) -> float:
    """When the incident began: the earliest finding's onset, else the last progress seen."""
    fallback = result.check.last_progress if result.check is not None else result.now
    return min((f.onset for f in result.findings if f.onset), default=fallback)
