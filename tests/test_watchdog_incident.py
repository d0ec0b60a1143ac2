"""The watchdog's incident record: written once, evidence added as a new record, and the state machine
that opens and closes incidents. Pure: a recorded incident (``tests/incidents``) stands in for the job."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dtwatch import paths
from dtwatch.bundle.file_evidence import FileEvidence
from dtwatch.bundle.files import Bundle, bundle_findings
from dtwatch.diagnose import Diagnosis, Finding, diagnose
from dtwatch.report.analyze import analyze
from dtwatch.report.capture import load_fixture
from dtwatch.watchdog.evidence_collection import collect_evidence
from dtwatch.watchdog.incident import Incident, OpenIncident, Step, next_step

FIXTURE = Path(__file__).resolve().parent / "incidents" / "desync_order_swap.json"


def recorded():
    fx = load_fixture(FIXTURE)
    return list(fx.states), fx.now, fx.window


def incident_in(run_dir: Path, findings: list[Finding]) -> tuple[Incident, Bundle]:
    """An incident of the recorded job as the poll thread writes it (none of its ranks is on this machine)."""
    states, now, window = recorded()
    bundle = Bundle(str(run_dir), "inc-test", "node-a")
    bundle.write_findings(findings, states, {"job_id": "job", "window": window, "onset": now - window,
                                             "detected": now, "local_ranks": [], "world_size": len(states),
                                             "verdict": "stall"})
    incident = Incident(id="inc-test", verdict="stall", findings=tuple(findings), states=tuple(states),
                        local_ranks=(), onset=now - window, detected=now, window=window, bundle=str(bundle.path))
    return incident, bundle


def test_the_incident_cannot_be_changed_after_it_is_written(tmp_path):
    states, now, window = recorded()
    findings = diagnose(states, now, window, FileEvidence(), assume_stalled=True).findings
    incident, _bundle = incident_in(tmp_path, findings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        incident.findings = ()  # type: ignore[misc]
    assert isinstance(incident.findings, tuple)
    with pytest.raises(AttributeError):
        incident.findings.append(findings[0])  # type: ignore[attr-defined]


def test_evidence_is_a_new_record_and_the_findings_as_sent_stay_on_disk(tmp_path):
    # The findings sent at detection were incomplete (a placeholder); the evidence's diagnosis replaces
    # them in the bundle's conclusion, never in findings.json.
    sent = Finding(kind="rank_conditional", severity="stall", ranks=[0], summary="as sent at detection")
    incident, bundle = incident_in(tmp_path, [sent])
    as_sent = (bundle.path / paths.BUNDLE_FINDINGS).read_bytes()
    errors: list[str] = []

    record = collect_evidence(incident, bundle, str(tmp_path), pyspy=False, heartbeat_stale=None,
                              on_error=errors.append)

    assert errors == [] and record.complete
    assert (bundle.path / paths.BUNDLE_FINDINGS).read_bytes() == as_sent
    assert incident.findings == (sent,)  # untouched
    assert record.refined and [f.kind for f in record.findings] == ["desync"] and record.findings[0].ranks == [3]
    on_disk = json.loads((bundle.path / paths.BUNDLE_EVIDENCE).read_text())
    assert on_disk == json.loads(json.dumps(record.to_dict()))
    assert paths.BUNDLE_EVIDENCE in on_disk["files"] and paths.BUNDLE_FINDINGS in on_disk["files"]
    index = json.loads((bundle.path / paths.BUNDLE_INDEX).read_text())
    assert index["evidence_complete"] and index["refined"] and index["evidence"] == paths.BUNDLE_EVIDENCE
    assert index["findings"] == on_disk["findings"]  # the index's findings are the bundle's conclusion
    assert bundle_findings(bundle.path) == on_disk["findings"]
    assert [f.summary for f in analyze([str(tmp_path)]).findings] == [record.findings[0].summary]


def test_evidence_that_changes_nothing_says_so(tmp_path):
    states, now, window = recorded()
    findings = diagnose(states, now, window, FileEvidence(), assume_stalled=True).findings
    incident, bundle = incident_in(tmp_path, findings)
    record = collect_evidence(incident, bundle, str(tmp_path), pyspy=False, heartbeat_stale=None,
                              on_error=lambda _c: None)
    assert not record.refined and record.findings == incident.findings


def test_the_open_incident_hands_the_evidence_over_once_it_is_in(tmp_path):
    sent = Finding(kind="rank_conditional", severity="stall", ranks=[0], summary="as sent")
    incident, bundle = incident_in(tmp_path, [sent])
    open_incident = OpenIncident(incident)
    assert not open_incident.evidence_done and open_incident.findings == (sent,)
    record = collect_evidence(incident, bundle, str(tmp_path), pyspy=False, heartbeat_stale=None,
                              on_error=lambda _c: None)
    open_incident.deliver(record)
    assert open_incident.evidence_done and open_incident.evidence is record
    assert open_incident.findings == record.findings and open_incident.incident.findings == (sent,)


def test_the_state_machine(tmp_path):
    states, now, window = recorded()
    stalled = diagnose(states, now, window, FileEvidence(), assume_stalled=True)
    quiet = Diagnosis(False, [], stalled.check, now)
    assert next_step(None, None, states, now, window) is Step.NOTHING
    assert next_step(None, stalled, states, now, window) is Step.OPEN
    # The cross-node view still lacks ranks chosen for it: a stall waits for them, a crash does not.
    assert next_step(None, stalled, states, now, window, view_settling=True) is Step.EARLY_DUMPS  # not OPEN
    crashed = dataclasses.replace(stalled, ended=True)
    assert next_step(None, crashed, states, now, window, view_settling=True) is Step.OPEN
    # Blocked for more than half the window but not yet stalled: dump the Flight Recorder early.
    assert stalled.check is not None and stalled.check.blocked
    early = now - stalled.check.last_progress
    assert next_step(None, quiet, states, stalled.check.last_progress + early, 1.9 * early) is Step.EARLY_DUMPS
    assert next_step(None, quiet, states, stalled.check.last_progress + early, 2.1 * early) is Step.NOTHING

    incident, bundle = incident_in(tmp_path, stalled.findings)
    open_incident = OpenIncident(incident)
    later = max(s.last_activity for s in states) - 1.0  # progress seen after the detection
    resumed = OpenIncident(dataclasses.replace(incident, detected=later))
    assert next_step(open_incident, stalled, states, now, window) is Step.NOTHING
    assert next_step(resumed, quiet, states, now, window) is Step.NOTHING  # evidence still being collected
    resumed.deliver(None)
    assert next_step(resumed, quiet, states, now, window) is Step.CLOSE
    assert next_step(resumed, stalled, states, now, window) is Step.NOTHING  # still stalled
