"""The few lines the job's console shows about an incident and a warning.

The verdict (crash or stall) is decided with the diagnosis (:mod:`dtwatch.diagnose.verdict`); the wording comes
from the findings' fields; the full diagnosis stays in the bundle and ``dtwatch analyze``. Nothing here does I/O.
"""
from __future__ import annotations

import os

from dtwatch.diagnose import Finding, fmt_ranks
from dtwatch.diagnose.rank_state import CPP_OP

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


def _file_line(site: dict) -> tuple:
    return site.get("file"), site.get("line")


def _where(op: str | None, group: str | None, seq: int | None, site: dict | None, lead: str = "in",
           root: bool = False) -> str:
    """``in OP (group, seq) at LINE``; for a culprit (``root``) the line is the finding's root-cause line,
    which need not be the op's own (a loop exit, a raise, the rank test)."""
    parts = []
    if op == CPP_OP:
        op = "a collective issued from C++ (DDP/FSDP)"
    if op:
        call = op + (f" (group {group}, seq {seq})" if group is not None and seq is not None else "")
        parts.append(f"{lead} {call}")
    text = " ".join(parts)
    if site:
        text += (f"; root cause at {_site(site)}" if root and text else f"{' ' if text else ''}at {_site(site)}")
    return text or "at an unknown point"


def _lead(f: Finding) -> str:
    """How the culprit relates to the finding's call: inside it now, or a call it made (or skipped) earlier."""
    details = f.details or {}
    if f.kind == "rank_exited":
        return "ended after"  # its last collective: it is inside no call now
    if details.get("pattern") == "skipped_call":
        return "skipped"
    if details.get("pattern") == "fewer_calls":
        # The call the longer side waits in: the culprits made it (more calls) or did not (fewer).
        return {"short": "did not issue", "more": "made"}.get(str(details.get("culprit_side")), "at")
    if details.get("program_order") or details.get("diverged_at"):
        return "made"  # an earlier call that completed, paired with a different one
    if details.get("culprits_ended"):
        return "ended after"  # its process ended: in no call now
    return "in"


def render_notice(verdict_: str, findings: list[Finding], *, bundle: str, run_dir: str) -> str:
    """The console's lines for an incident: culprit, op, line, who waits, the diagnosis, the evidence."""
    f = findings[0]
    head = f"{verdict_.upper()} [{f.kind}] "
    if f.ranks:
        lead = _lead(f)
        first = head + f"{fmt_ranks(f.ranks)} {_where(f.op, f.group, f.seq, f.site, lead, root=True)}"
        branch = (f.details or {}).get("conditional_line")
        if isinstance(branch, dict) and _file_line(branch) != _file_line(f.site or {}):
            first += f", under the rank test at {_site(branch)}"
        lines = [first]
        if f.waiting_ranks:
            verb = "waited" if (f.details or {}).get("waiters_ended") else \
                "waits" if len(set(f.waiting_ranks)) == 1 else "wait"
            lines.append(f"  {fmt_ranks(f.waiting_ranks)} {verb} "
                         f"{_where(f.waiting_op, f.waiting_group, f.waiting_seq, f.waiting_site)}")
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
