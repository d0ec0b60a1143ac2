"""The console notice and the text report place a finding's ranks with the same words, from the same fields.

Every recorded incident is diagnosed and rendered both ways; where the findings name culprits, the notice's first
line and the report's line under the finding must agree, and so must the waiting line. Only how a site is shown
differs by design: the narrow console leaves out the function name the report gives.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtwatch.diagnose import diagnose_fixture
from dtwatch.diagnose.model import STALL
from dtwatch.diagnose.verdict import STALL as STALL_VERDICT
from dtwatch.render.notice import PREFIX, render_notice
from dtwatch.render.report_text import render_text
from dtwatch.report.capture import load_fixture

_FUNCTION = re.compile(r" in [\w<>.]+(?= `|,|;|$)")  # ``file:line in fn `source```: the report's extra


def _same_sites(line: str) -> str:
    return _FUNCTION.sub("", line.strip())


INCIDENTS = sorted((Path(__file__).parent / "incidents").glob("*.json"))


@pytest.mark.parametrize("path", INCIDENTS, ids=lambda p: p.stem)
def test_console_and_report_place_the_ranks_in_the_same_words(path: Path) -> None:
    fx = load_fixture(path)
    findings = [f for f in diagnose_fixture(fx) if f.severity == STALL]
    report = render_text(findings, fx.states, now=fx.now).splitlines()
    if not findings:  # a healthy control
        assert "No stall." in report
        return
    f = findings[0]
    notice = render_notice(STALL_VERDICT, findings, bundle="b", run_dir="r").splitlines()
    head = f"{PREFIX}STALL [{f.kind}] "
    at = report.index(f"  [{f.kind}] {f.summary}")
    if not f.ranks:  # no culprit to place: the notice is the summary alone
        assert notice[0] == head + f.summary
        return
    assert notice[0].startswith(head)
    culprit = notice[0].removeprefix(head)
    assert _same_sites(report[at + 1]) == culprit, (report[at + 1], culprit)
    if f.waiting_ranks:
        assert _same_sites(report[at + 2]) == notice[1].removeprefix(PREFIX).strip()
