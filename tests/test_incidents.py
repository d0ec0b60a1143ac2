"""Replay every recorded incident (``tests/incidents/*.json``) through the diagnosis; judge it by its truth.

Each fixture was captured from a real 4-rank gloo run of a scenario in ``tests/scenarios`` (see
``benchmarks/scenarios.py --capture tests/incidents``). The diagnosis must name the truth's kind,
culprit ranks, op and root-cause line, and its text must contain / avoid the truth's phrases; a
healthy control must give no stall finding. Re-capture after changing a scenario script:

    python benchmarks/scenarios.py --capture tests/incidents [--only NAME,...]
"""
from __future__ import annotations

from pathlib import Path

import pytest

from dtwatch.diagnose import diagnose_fixture
from dtwatch.report.capture import load_fixture
from tests.scenarios.catalog import SCENARIOS
from tests.scenarios.judge import judge

INCIDENTS = Path(__file__).resolve().parent / "incidents"
FIXTURES = sorted(INCIDENTS.glob("*.json"))


# Known gaps, named here so they stay visible (strict: the test fails once the diagnosis gets them right).
KNOWN_GAPS = {
    "mismatch_object_list": "object collectives record no payload size, so lists of different lengths "
                            "on one rank are not seen as a mismatch",
}


def _case(path: Path):
    gap = KNOWN_GAPS.get(path.stem)
    marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.mark.parametrize("path", [_case(p) for p in FIXTURES])
def test_incident_diagnosis_matches_truth(path: Path) -> None:
    fx = load_fixture(path)
    assert fx.truth, f"{path.name} has no truth"
    findings = diagnose_fixture(fx)
    verdict = judge([f.to_dict() for f in findings], fx.truth)
    summary = findings[0].summary if findings else "(no finding)"
    assert verdict.right, f"{fx.name}: " + "; ".join(verdict.failures()) + f"\n  diagnosis: {summary}"


def test_every_scenario_has_a_fixture_with_its_current_truth() -> None:
    by_name = {p.stem: p for p in FIXTURES}
    missing = [s.name for s in SCENARIOS if s.name not in by_name]
    assert not missing, f"{len(missing)} scenarios have no fixture: python benchmarks/scenarios.py --capture " \
        f"tests/incidents --only {','.join(missing)}"
    stale = []
    for s in SCENARIOS:
        recorded = {k: v for k, v in (load_fixture(by_name[s.name]).truth or {}).items() if k != "onset"}
        if recorded != s.truth():
            stale.append(s.name)
    assert not stale, f"the scripts or truths changed since capture: re-capture {','.join(stale)}"


def test_judge_flags_each_wrong_column() -> None:
    truth = {"kind": "rank_conditional", "ranks": [2], "op": "all_reduce", "file": "tests/scenarios/x.py",
             "line": 12, "lines": [11, 12], "present": ["rank 2"], "absent": ["never called"]}
    right = {"kind": "rank_conditional", "severity": "stall", "ranks": [2], "op": "all_reduce",
             "site": {"file": "<site-packages>/lib/a.py", "line": 3}, "summary": "rank 2 ...",
             "details": {"conditional_line": {"file": "/srv/repo/tests/scenarios/x.py", "line": 11}}}
    v = judge([right], truth)
    assert v.right and v.shown["line"] == "details.conditional_line=x.py:11"
    wrong = {**right, "kind": "mismatch", "ranks": [0, 1], "op": "barrier", "details": {},
             "summary": "ranks 0-1 ... never called it"}
    v = judge([wrong, {**right, "ranks": [3]}], truth)
    assert {c for c, ok in v.ok.items() if not ok} == {"kind", "ranks", "op", "line", "text"}
    assert judge([{**right, "severity": "warning"}], truth).ok["kind"] is False  # warnings are not diagnoses
    assert judge([], {"healthy": True}).right and not judge([right], {"healthy": True}).right
