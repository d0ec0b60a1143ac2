"""The human report: findings first, then every rank's state, then where the evidence is."""
from __future__ import annotations

import functools
import time

from dtwatch.diagnose import Evidence, Finding, fmt_ranks, fmt_site, with_source
from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.wording.phrases import verb
from dtwatch.render.finding_lines import culprit_line, waiting_line

DAMAGED_INPUT = "damaged_input"
"""The kind of a warning naming a damaged input file (see :mod:`dtwatch.report.analyze`); its ``ranks`` are those
it held that no other input holds. These warnings get their own section, first, and qualify the diagnosis."""


def render_text(findings: list[Finding], states: list[RankState], *, now: float, bundle_dir: str | None = None,
                warnings: list[Finding] | None = None, verdict: str | None = None, live_warnings: int = 0,
                dumps: dict | None = None, evidence: Evidence | None = None,
                endings: dict[int, str] | None = None) -> str:
    """``verdict``: what the incident was called ("crash" / "stall"; default stall); ``live_warnings``: how many
    of ``warnings`` (the first ones) the watchdog issued while the job ran; ``damaged_input`` warnings come last;
    ``dumps``: the torch Flight Recorder dumps read (``DumpReport.to_dict()`` of :mod:`dtwatch.report.analyze`);
    ``endings``: how each rank that ended did, as the diagnosis told it (else as its ring tells)."""
    out: list[str] = []
    stalls = [f for f in findings if f.severity == "stall"]
    damaged = [f for f in warnings or [] if f.kind == DAMAGED_INPUT]
    warnings = [f for f in warnings or [] if f.kind != DAMAGED_INPUT]
    unread = sorted({r for f in damaged for r in f.ranks} - {s.rank for s in states})
    warns = [f for f in findings if f.severity != "stall"] + warnings
    job = states[0].job_id if states else "?"
    no_dump = [r for r in (dumps or {}).get("no_dump", []) if r not in unread]
    if states and all(s.from_dump for s in states):
        out.append(f"dtwatch report from torch's Flight Recorder dumps (a job run without dtwatch) — {len(states)} "
                   "rank(s) dumped" + (f", {fmt_ranks(no_dump)} left no dump" if no_dump else "")
                   + (f", {fmt_ranks(unread)} could not be read" if unread else ""))
    else:
        out.append(f"dtwatch report for job {job} — {len(states)} rank(s) seen"
                   + (f", {fmt_ranks(unread)} could not be read" if unread else ""))
    out.append("")
    if damaged:
        out.append("DAMAGED INPUT")
        out.extend(f"  {f.summary}" for f in damaged)
        out.append("")
    if stalls:
        out.append((verdict or "stall").upper())
        for f in stalls:
            out.append(f"  [{f.kind}] {f.summary}")
            show = functools.partial(_site_text, evidence=evidence)
            if f.ranks:  # the same lines as the console's notice, paths as the evidence reader shows them
                out.append(f"      {culprit_line(f, show)}")
            elif f.site:
                out.append(f"      at {show(f.site)}")
            waiting = waiting_line(f, show)
            if waiting:
                out.append(f"      {waiting}")
            if f.onset and not all(s.from_dump for s in states):  # a dump's file time is not the hang's
                out.append(f"      no progress since {now - f.onset:.1f}s before detection")
        if unread:
            out.append(f"  (the diagnosis is of the ranks read: {fmt_ranks(unread)} could not be read)")
    elif unread and not states:
        out.append(f"Nothing to diagnose: {fmt_ranks(unread)} could not be read, and no other rank was found.")
    elif unread:
        out.append(f"No stall among the ranks read; {fmt_ranks(unread)} could not be read, so whether "
                   f"{verb(unread, 'it', 'they')} stalled, or others wait for {verb(unread, 'it', 'them')}, is "
                   "not known.")
    else:
        out.append("No stall.")
    if warns:
        out.append("")
        out.append("WARNINGS")
        first_live = len(warns) - len(warnings)  # findings' own warnings come first
        for i, f in enumerate(warns):
            live = first_live <= i < first_live + live_warnings
            when = f" (issued by the watchdog at {time.strftime('%H:%M:%S', time.localtime(f.detected))})" \
                if live and f.detected else ""
            out.append(f"  [{f.kind}] {f.summary}{when}")
    out.append("")
    out.append("RANKS")
    if unread:
        out.append(f"  {fmt_ranks(unread)}: could not be read (see DAMAGED INPUT)")
    if no_dump:
        out.append(f"  {fmt_ranks(no_dump)}: no Flight Recorder dump")
    for s in sorted(states, key=lambda s: s.rank):
        if s.from_dump:
            out.extend(_dumped_rank(s, dumps or {}, evidence))
            continue
        status = "running" if not s.gone else (endings or {}).get(s.rank) or s.how_it_ended()
        if s.alive and s.heartbeat_age(now) > 5:
            status += f", heartbeat {s.heartbeat_age(now):.0f}s old"
        if s.proc_state == "T":
            status += ", stopped"
        out.append(f"  rank {s.rank} (host {s.host}, pid {s.pid}, local rank {s.local_rank}) step {s.step}: {status}")
        for g in s.groups.values():
            out.append(f"      group {g.name}: entered seq {g.seq}, completed {g.completed}"
                       f"{' (C++-issued seq ' + str(g.cpp_seq) + ')' if g.cpp_seq > g.py_seq else ''}")
        call = s.blocking_call()
        if call is not None:
            out.append(f"      inside {call.op} (group {call.group}, seq {call.seq}, {call.fingerprint}) "
                       f"for {now - call.t_enter:.1f}s from {fmt_site(with_source(call.site, evidence), evidence)}")
        if s.main_site and not s.gone:
            out.append(f"      main thread at {fmt_site(with_source(s.main_site, evidence), evidence)}")
        for ld in s.loaders:
            if ld.get("site"):
                where = f"{ld['site']['file']}:{ld['site']['line']}"
                out.append(f"      DataLoader at {where}: len {ld['length']}, epoch {ld['epochs']}")
    if dumps and dumps.get("cannot_show"):
        out.append("")
        out.append("WHAT THE DUMPS CANNOT SHOW")
        out.extend(f"  {line}" for line in dumps["cannot_show"])
    if bundle_dir:
        out.append("")
        out.append("EVIDENCE")
        out.append(f"  {bundle_dir}/stacks/   py-spy / faulthandler stacks of every rank on this node")
        out.append(f"  {bundle_dir}/fr/       torch Flight Recorder dumps (pickle + readable JSON)")
        out.append(f"  {bundle_dir}/rings/    the ranks' dtwatch rings (dtwatch analyze reads them)")
        out.append(f"  {bundle_dir}/timeline.svg  per-rank sequence progress")
    return "\n".join(out) + "\n"


def _site_text(site: dict | None, evidence: Evidence | None) -> str:
    return fmt_site(with_source(site, evidence), evidence) if site else "an unknown line"


def _dumped_rank(s: RankState, dumps: dict, evidence: Evidence | None) -> list[str]:
    """A rank known from its Flight Recorder dump: its groups' numbers and the entries not completed, with torch's
    own state of each (``scheduled``: enqueued; ``started``: running)."""
    out = [f"  rank {s.rank} (Flight Recorder dump {dumps.get('files', {}).get(str(s.rank), '?')}): "
           "process state not in the dump"]
    for g in s.groups.values():
        out.append(f"      group {g.name}: issued seq {g.seq}, completed {g.completed}")
    for e in dumps.get("in_flight", {}).get(str(s.rank), []):
        sizes = e.get("input_sizes") or []
        what = f"{(e.get('input_dtypes') or ['?'])[0]} {sizes[0]}" if sizes else "no tensor"
        peer = f", peer {e['peer']}" if e.get("peer") is not None else ""
        out.append(f"      in flight: {e['op']} (group {e['group']}, seq {e['seq']}{peer}, {what}) from "
                   f"{fmt_site(with_source(e.get('site'), evidence), evidence)}, torch's state {e.get('state')!r}, "
                   "not completed")
    return out
