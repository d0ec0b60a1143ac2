"""Replay every recorded incident (``tests/incidents/*.json``) through the diagnosis; judge it by its truth.

Each fixture was captured from a real 4-rank gloo run of a scenario in ``tests/scenarios`` (see
``benchmarks/scenarios.py --capture tests/incidents``). The diagnosis must name the truth's kind,
culprit ranks, op and root-cause line, and its text must contain / avoid the truth's phrases; a
healthy control must give no stall finding. Re-capture after changing a scenario script:

    python benchmarks/scenarios.py --capture tests/incidents [--only NAME,...]
"""
from __future__ import annotations

import copy
import linecache
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from dtwatch.capture import Fixture, load_fixture
from dtwatch.diagnose import Finding, StallCheck, check_stall, classify, exit_findings, settle_completed
from dtwatch.lint import is_rank_conditional_line
from tests.scenarios.catalog import SCENARIOS
from tests.scenarios.judge import judge

INCIDENTS = Path(__file__).resolve().parent / "incidents"
FIXTURES = sorted(INCIDENTS.glob("*.json"))

try:  # the diagnosis core's entry point, once it exists
    from dtwatch.diagnose import diagnose_fixture  # type: ignore[attr-defined]
except ImportError:
    diagnose_fixture = None


@contextmanager
def _captured_sources(fx: Fixture, root: Path) -> Iterator[dict[str, Path]]:
    """The fixture's source files where today's diagnosis reads them: in ``linecache`` under their
    (sanitised) names, and whole user files written under ``root`` for the rank-conditional lint."""
    on_disk: dict[str, Path] = {}
    added = []
    for name, src in fx.sources.items():
        if "text" in src:
            lines = src["text"].splitlines(keepends=True)
            path = root / re.sub(r"[^\w./-]", "_", name).lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(src["text"])
            on_disk[name] = path
        else:
            numbered = {int(n): text for n, text in src.get("lines", {}).items()}
            lines = [numbered.get(i, "") + "\n" for i in range(1, max(numbered, default=0) + 1)]
        if name not in linecache.cache:
            linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
            added.append(name)
    try:
        yield on_disk
    finally:
        for name in added:
            linecache.cache.pop(name, None)


def _diagnose(fx: Fixture, root: Path) -> list[Finding]:
    """Today's diagnosis, combined as the watchdog's poll does: exits first (no window), else the stall
    check; a bundle was written because the watchdog saw a stall, so a bundle's check counts as stalled."""
    from dtwatch.watch import refine_cpp_ops

    states = copy.deepcopy(fx.states)
    with _captured_sources(fx, root) as on_disk:
        def lint(path: str, line: int) -> bool:
            return path in on_disk and is_rank_conditional_line(on_disk[path], line)

        check = check_stall(states, fx.now, fx.window)
        settle_completed(states, check.positions)
        findings = exit_findings(states, fx.now, lint)
        if not findings:
            if fx.source == "bundle" and check.blocked:
                check = StallCheck(True, check.last_progress, check.blocked, check.positions)
            if check.stalled:
                findings = classify(states, check, fx.now, lint)
    for rank, summary in fx.flight_records.items():
        refine_cpp_ops(findings, int(rank), summary)
    return findings


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_incident_diagnosis_matches_truth(path: Path, tmp_path: Path) -> None:
    fx = load_fixture(path)
    assert fx.truth, f"{path.name} has no truth"
    findings = diagnose_fixture(fx) if diagnose_fixture is not None else _diagnose(fx, tmp_path)
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
