"""The few lines the job's console shows about an incident and a warning.

The verdict (crash or stall) is decided with the diagnosis (:mod:`dtwatch.diagnose.verdict`); the wording comes
from the findings' fields; the full diagnosis stays in the bundle and ``dtwatch analyze``. Nothing here does I/O.
"""
from __future__ import annotations

import os

from dtwatch.diagnose import Finding, fmt_ranks
from dtwatch.render.finding_lines import culprit_line, waiting_line

PREFIX = "dtwatch: "


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (the console is narrow)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _site(site: dict | None) -> str:
    if not site:
        return "an unknown line"
    text = f"{_short(str(site.get('file')))}:{site.get('line')}"
    src = (site.get("source") or "").strip()
    return f"{text} `{src}`" if src else text


def render_notice(verdict_: str, findings: list[Finding], *, bundle: str, run_dir: str) -> str:
    """The console's lines for an incident: culprit, op, line, who waits, the diagnosis, the evidence."""
    f = findings[0]
    head = f"{verdict_.upper()} [{f.kind}] "
    if f.ranks:
        lines = [head + culprit_line(f, _site)]
        waiting = waiting_line(f, _site)
        if waiting:
            lines.append(f"  {waiting}")
        lines.append(f"  diagnosis: {f.summary}")
    else:
        lines = [head + f.summary]
    for extra in findings[1:]:
        lines.append(f"  also [{extra.kind}]: {extra.summary}")
    lines.append(f"  bundle: {bundle}  (report: dtwatch analyze {run_dir})")
    return "".join(PREFIX + line + "\n" for line in lines)


def render_warning(f: Finding) -> str:
    return f"{PREFIX}WARNING [{f.kind}]: {f.summary}\n"


def render_fail_fast(ranks: list[int], descendants: int) -> str:
    extra = f" and {descendants} process(es) they started" if descendants else ""
    return f"{PREFIX}--fail-fast: ending {fmt_ranks(ranks)}{extra}\n"
