"""The lines that place a finding's ranks, shared by the console notice and the text report: who the culprits are
and where (inside a call now, or a call they made, skipped or ended after), under which rank test, and who waits
where. How a site is shown is the caller's (the console shortens paths; the report shows them as the evidence
reader does). Nothing here does I/O.
"""
from __future__ import annotations

from collections.abc import Callable

from dtwatch.diagnose import Finding, fmt_ranks
from dtwatch.diagnose.rank_state import CPP_OP

SiteText = Callable[[dict | None], str]


def culprit_line(f: Finding, show: SiteText) -> str:
    """``rank 0 in all_reduce (group 0, seq 16); root cause at LINE, under the rank test at LINE``."""
    text = f"{fmt_ranks(f.ranks)} {_where(f.op, f.group, f.seq, f.site, show, _lead(f), root=True)}"
    branch = (f.details or {}).get("conditional_line")
    if isinstance(branch, dict) and _file_line(branch) != _file_line(f.site or {}):
        text += f", under the rank test at {show(branch)}"
    return text


def waiting_line(f: Finding, show: SiteText) -> str:
    """``ranks 1-3 wait in barrier (group 0, seq 16) at LINE``; "" when the finding names no waiting rank."""
    if not f.waiting_ranks:
        return ""
    verb = "waited" if (f.details or {}).get("waiters_ended") else \
        "waits" if len(set(f.waiting_ranks)) == 1 else "wait"
    where = _where(f.waiting_op, f.waiting_group, f.waiting_seq, f.waiting_site, show)
    return f"{fmt_ranks(f.waiting_ranks)} {verb} {where}"


def _file_line(site: dict) -> tuple:
    return site.get("file"), site.get("line")


def _where(op: str | None, group: str | None, seq: int | None, site: dict | None, show: SiteText, lead: str = "in",
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
        text += (f"; root cause at {show(site)}" if root and text else f"{' ' if text else ''}at {show(site)}")
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
