"""Cross-rank diagnosis: from every rank's state, decide whether the job is stalled and say why.

The same pure functions serve the live watchdog and ``dtwatch analyze``.

**Stall.** A rank is *blocked* when it is inside a synchronous Python-issued collective, or when its
latest operation in a group was issued from C++ (DDP's reducer, FSDP) and its main thread has not
moved since. The job is stalled when some rank is blocked and nothing anywhere has progressed (no
collective entered or left, no step, no C++ sequence number advanced) for longer than the stall
window. A quiet period where every rank is outside collectives (eval or checkpointing on all ranks) is
never a stall: nobody is blocked.

**Why.** Each rank gets a *position*: gone (exited or died), unresponsive (heartbeat stale or
stopped), blocked at (group, seq, op, site, fingerprint), or outside any collective (at the sampled
main-thread site). The kinds, in the order they are tested:

* ``rank_exited`` — a rank ended (raised, was killed, or returned early) while others wait.
* ``unresponsive`` — a rank's process is alive but wedged: its in-process heartbeat stopped.
* ``uneven_iterations`` — ranks ran different numbers of steps / their DataLoaders have different
  lengths, and the short ranks left the loop (exited, or wait at a post-loop collective).
* ``stuck_outside_collective`` — a live rank is not in any collective while the others wait for it.
* ``mismatch`` — ranks are in the same group at the same sequence number from the same line, with
  different op, dtype or shape.
* ``rank_conditional`` — ranks wait in different collectives from different lines (incl. a subgroup
  collective some members skipped): the culprit side is the one whose line sits in a rank-conditional
  branch (static check), else the minority.
* ``stalled_collective`` — every rank is inside the same collective and none is missing (transport).

Warnings without a stall: ``uneven_iterations`` as soon as DataLoader lengths differ at an epoch's
start, and ``straggler`` when one rank is consistently the last to enter collectives.
"""
from __future__ import annotations

import linecache
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

from .state import CPP_OP, Call, RankState

STALL, WARNING = "stall", "warning"
KINDS = (
    "rank_conditional", "uneven_iterations", "stuck_outside_collective", "rank_exited", "mismatch",
    "unresponsive", "straggler", "stalled_collective",
)
# Exceptions that are the consequence of a peer's death, not a cause (gloo and NCCL wording).
PEER_ERRORS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "read error", "write error",
    "communicator was aborted", "nccl communicator", "socket closed", "connection refused",
    "timed out", "timeout", "keyboardinterrupt",
)


@dataclass
class Finding:
    kind: str
    severity: str
    ranks: list[int]  # the culprits
    summary: str
    op: str | None = None
    group: str | None = None
    seq: int | None = None
    site: dict | None = None  # the culprit's call site (file, line, function, source)
    waiting_ranks: list[int] = field(default_factory=list)
    waiting_op: str | None = None
    waiting_group: str | None = None
    waiting_seq: int | None = None
    waiting_site: dict | None = None
    onset: float = 0.0
    detected: float = 0.0
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def key(self) -> tuple:
        return (self.kind, tuple(self.ranks), self.group, self.seq)


@dataclass
class Position:
    """Where one rank is, for the purpose of comparing ranks."""

    rank: int
    state: str  # "gone" | "unresponsive" | "blocked" | "outside"
    call: Call | None = None
    site: dict | None = None

    def key(self) -> tuple:
        c = self.call
        if c is None:
            return (self.state,)
        return (c.group, c.seq, c.op, c.site_key, c.fingerprint)


def with_source(site: dict | None) -> dict | None:
    """The site plus the text of its line, when the file is readable here."""
    if not site:
        return site
    out = dict(site)
    if "source" not in out:
        text = linecache.getline(site.get("file", ""), int(site.get("line", 0) or 0)).strip()
        out["source"] = text
    return out


def fmt_site(site: dict | None) -> str:
    if not site:
        return "an unknown line"
    text = f"{site.get('file')}:{site.get('line')} in {site.get('function')}"
    src = site.get("source")
    return f"{text} `{src}`" if src else text


def fmt_ranks(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    if not rs:
        return "none"
    # compress runs: 0-3,5
    parts, start, prev = [], rs[0], rs[0]
    for r in rs[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    word = "rank" if len(rs) == 1 else "ranks"
    return f"{word} {','.join(parts)}"


def _describe(call: Call | None) -> str:
    if call is None:
        return "no collective"
    op = "a collective issued from C++ (DDP/FSDP)" if call.op == CPP_OP else call.op
    return f"{op} (group {call.group}, seq {call.seq})"


# ---------------------------------------------------------------------------------------------------
# positions
# ---------------------------------------------------------------------------------------------------
def cpp_blocked_call(s: RankState, by_rank: dict[int, RankState]) -> Call | None:
    """A collective issued from C++ (DDP/FSDP) that the rank must be waiting in.

    The rank's latest operation in a group was issued from C++ and cannot have completed: some member of
    the group has not issued that sequence number yet, or sits inside a different (Python) collective at
    that same number. If every member has issued it and nobody disagrees, it completed.
    """
    best: Call | None = None
    for g in s.groups.values():
        if g.cpp_seq == 0 or g.cpp_seq <= g.py_seq:
            continue
        peers = [by_rank[m] for m in (g.members or []) if m in by_rank and m != s.rank and g.name in by_rank[m].groups]
        behind = any(p.groups[g.name].seq < g.cpp_seq for p in peers)
        disagrees = any(
            c.group == g.name and c.seq == g.cpp_seq for p in peers for c in p.open_calls if not c.is_async
        )
        if not (behind or disagrees):
            continue
        call = Call(op=CPP_OP, group=g.name, seq=g.cpp_seq, site=s.main_site, t_enter=g.cpp_seq_time,
                    fingerprint=CPP_OP)
        if best is None or call.t_enter > best.t_enter:
            best = call
    return best


def positions(states: list[RankState], now: float, heartbeat_stale: float) -> dict[int, Position]:
    by_rank = {s.rank: s for s in states}
    out: dict[int, Position] = {}
    for s in states:
        if s.gone:
            out[s.rank] = Position(s.rank, "gone", s.last_call(), s.main_site)
        elif s.proc_state == "T" or (s.alive is not False and s.heartbeat_age(now) > heartbeat_stale):
            out[s.rank] = Position(s.rank, "unresponsive", s.blocking_call(), s.main_site)
        else:
            call = s.blocking_call() or cpp_blocked_call(s, by_rank)
            out[s.rank] = Position(s.rank, "blocked" if call else "outside", call, s.main_site)
    return out


# ---------------------------------------------------------------------------------------------------
# stall decision
# ---------------------------------------------------------------------------------------------------
@dataclass
class StallCheck:
    stalled: bool
    last_progress: float
    blocked: list[int]
    positions: dict[int, Position]


def check_stall(states: list[RankState], now: float, window: float, heartbeat_stale: float | None = None) -> StallCheck:
    hb = heartbeat_stale if heartbeat_stale is not None else max(5.0, window / 2)
    pos = positions(states, now, hb)
    last_progress = max((s.last_activity for s in states), default=now)
    blocked = sorted(r for r, p in pos.items() if p.state == "blocked" or (p.state == "unresponsive" and p.call))
    any_live = any(p.state != "gone" for p in pos.values())
    stalled = bool(blocked) and any_live and now - last_progress > window
    return StallCheck(stalled, last_progress, blocked, pos)


def settle_completed(states: list[RankState], pos: dict[int, Position]) -> None:
    """What each rank has completed, per group, using the cross-rank view.

    A rank's own ring knows completion only for Python-issued calls. With every rank's position known,
    everything a rank issued in a group has completed, except the call it is blocked in.
    """
    for s in states:
        p = pos.get(s.rank)
        for g in s.groups.values():
            if p is not None and p.call is not None and p.call.group == g.name and p.state != "gone":
                g.completed = max(g.completed, min(g.seq, p.call.seq - 1))
            elif not any(c.group == g.name for c in s.open_calls):
                g.completed = max(g.completed, g.seq)


# ---------------------------------------------------------------------------------------------------
# classification
# ---------------------------------------------------------------------------------------------------
LintCheck = Callable[[str, int], bool]


def _default_lint(path: str, line: int) -> bool:
    try:
        from .lint import is_rank_conditional_line
    except ImportError:
        return False
    try:
        return bool(is_rank_conditional_line(path, line))
    except Exception:
        return False


def conditional_evidence(s: RankState, call: Call | None, lint: LintCheck) -> dict | None:
    """The first line, in the call site and then the main thread's stack, inside a rank-conditional branch."""
    sites = ([call.site] if call is not None and call.site and call.op != CPP_OP else []) + list(s.main_stack)
    for site in sites:
        if site and lint(site["file"], int(site["line"])):
            return with_source(site)
    return None


def loader_evidence(states: list[RankState]) -> list[dict]:
    """DataLoaders (same line on every rank) whose latest lengths differ across ranks."""
    by_site: dict[tuple, dict[int, int]] = defaultdict(dict)
    sites: dict[tuple, dict] = {}
    for s in states:
        for ld in s.loaders:
            if not ld.get("site") or ld.get("length", -1) < 0:
                continue
            key = (ld["site"]["file"], ld["site"]["line"])
            by_site[key][s.rank] = ld["length"]
            sites[key] = ld["site"]
    out = []
    for key, lengths in by_site.items():
        if len(set(lengths.values())) > 1:
            shortest = min(lengths.values())
            out.append({
                "site": with_source(sites[key]), "lengths": {str(r): n for r, n in sorted(lengths.items())},
                "short_ranks": sorted(r for r, n in lengths.items() if n == shortest),
                "long_ranks": sorted(r for r, n in lengths.items() if n != shortest),
            })
    return out


class _Context:
    """What every finding of one diagnosis shares: positions, loader and step evidence, timing."""

    def __init__(self, states: list[RankState], pos: dict[int, Position], onset: float, now: float, lint: LintCheck) -> None:
        self.states, self.pos, self.onset, self.now, self.lint = states, pos, onset, now, lint
        self.by_rank = {s.rank: s for s in states}
        self.loaders = loader_evidence(states)
        self.steps = {s.rank: s.step for s in states}

    def waiting(self, ranks: Iterable[int]) -> tuple[dict, str]:
        """Finding fields and a phrase for the ranks that wait on the culprits."""
        ranks = sorted(set(ranks))
        calls = [self.pos[r] for r in ranks if r in self.pos and self.pos[r].call is not None]
        first = min(calls, key=lambda p: p.call.t_enter) if calls else None
        fields = dict(
            waiting_ranks=ranks, waiting_op=first.call.op if first else None,
            waiting_group=first.call.group if first else None, waiting_seq=first.call.seq if first else None,
            waiting_site=with_source(first.call.site) if first else None, onset=self.onset, detected=self.now,
        )
        text = (f"{fmt_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in {_describe(first.call)} at "
                f"{fmt_site(with_source(first.call.site))}") if first else f"{fmt_ranks(ranks)} wait"
        return fields, text

    def uneven(self, candidates: list[int], others: list[int], how: str) -> Finding | None:
        """Uneven iterations if the candidates' DataLoaders are the short ones, or they ran fewer steps."""
        loader = next((ld for ld in self.loaders if set(ld["short_ranks"]) & set(candidates)), None)
        cand_steps = [self.steps[r] for r in candidates if r in self.steps]
        other_steps = [self.steps[r] for r in others if r in self.steps]
        if loader is None and not (cand_steps and other_steps and max(cand_steps) < min(other_steps)):
            return None
        culprits = sorted(set(loader["short_ranks"]) & set(candidates)) if loader else sorted(candidates)
        last = self.by_rank[culprits[0]].last_call()
        fields, waiting_txt = self.waiting(r for r in others if r not in culprits)
        counts = (f"DataLoader at {fmt_site(loader['site'])} has lengths {loader['lengths']}" if loader
                  else "steps: " + ", ".join(f"rank {r}={n}" for r, n in sorted(self.steps.items())))
        return Finding(
            kind="uneven_iterations", severity=STALL, ranks=culprits,
            summary=f"{fmt_ranks(culprits)} ran fewer iterations and {how}; {waiting_txt}. {counts}",
            op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
            site=loader["site"] if loader else with_source(last.site if last else None),
            details={"steps": {str(r): n for r, n in sorted(self.steps.items())}, "loaders": self.loaders}, **fields,
        )

    def exited(self, r: int, others: list[int], extra: str = "") -> Finding:
        s = self.by_rank[r]
        last = s.last_call()
        fields, waiting_txt = self.waiting(others)
        return Finding(
            kind="rank_exited", severity=STALL, ranks=[r],
            summary=f"rank {r} {s.how_it_ended()}; its last collective was {_describe(last)} at "
                    f"{fmt_site(with_source(last.site if last else None))}; {waiting_txt}{extra}",
            op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
            site=with_source(last.site if last else None),
            details={"exit_state": s.exit_state, "exit_reason": s.exit_reason, "pid": s.pid, "host": s.host}, **fields,
        )


def classify(
    states: list[RankState], check: StallCheck, now: float, lint: LintCheck | None = None
) -> list[Finding]:
    """Explain a stall. ``check`` must say ``stalled``."""
    ctx = _Context(states, check.positions, check.last_progress, now, lint or _default_lint)
    pos, by_rank = ctx.pos, ctx.by_rank
    blocked = [pos[r] for r in check.blocked if pos[r].call is not None]
    waiting = sorted(check.blocked)

    gone = [p.rank for p in pos.values() if p.state == "gone"]
    if gone:
        clean = [r for r in gone if by_rank[r].exit_state == "exited"]
        if len(clean) == len(gone):
            f = ctx.uneven(clean, waiting, "left the loop, then the process exited")
            if f:
                return [f]
            first = min(blocked, key=lambda p: p.call.t_enter) if blocked else None
            if first and conditional_evidence(by_rank[first.rank], first.call, ctx.lint):
                return [_conditional(ctx, [p for p in blocked if p.key() == first.key()], f"{fmt_ranks(clean)} exited normally")]
        return [ctx.exited(r, waiting) for r in sorted(gone)]

    wedged = [p for p in pos.values() if p.state == "unresponsive"]
    if wedged:
        findings = []
        for p in wedged:
            s = by_rank[p.rank]
            fields, waiting_txt = ctx.waiting(r for r in waiting if r != p.rank)
            state = {"T": "stopped (SIGSTOP/debugger)", "D": "in uninterruptible I/O"}.get(s.proc_state, "not running Python")
            findings.append(Finding(
                kind="unresponsive", severity=STALL, ranks=[p.rank],
                summary=f"rank {p.rank} is alive but unresponsive ({state}; heartbeat {s.heartbeat_age(now):.0f}s old), "
                        f"last seen at {fmt_site(with_source(s.main_site))}; {waiting_txt}",
                op=p.call.op if p.call else None, group=p.call.group if p.call else None,
                seq=p.call.seq if p.call else None, site=with_source(s.main_site),
                details={"proc_state": s.proc_state, "heartbeat_age_s": round(s.heartbeat_age(now), 1),
                         "main_top_site": s.main_top_site, "pid": s.pid, "host": s.host},
                **fields,
            ))
        return findings

    outside = [p.rank for p in pos.values() if p.state == "outside"]
    if outside:
        f = ctx.uneven(outside, waiting, "are outside any collective")
        if f:
            return [f]
        findings = []
        fields, waiting_txt = ctx.waiting(waiting)
        first_group = fields["waiting_group"]
        for r in outside:
            s = by_rank[r]
            findings.append(Finding(
                kind="stuck_outside_collective", severity=STALL, ranks=[r],
                summary=f"rank {r} is not in any collective: it is at {fmt_site(with_source(s.main_site))}"
                        f" (innermost frame {fmt_site(s.main_top_site)}) since {now - s.main_site_since:.0f}s; {waiting_txt}",
                site=with_source(s.main_site), group=first_group,
                seq=s.groups[first_group].seq if first_group in s.groups else None,
                details={"main_top_site": s.main_top_site, "main_stack": s.main_stack, "step": s.step}, **fields,
            ))
        return findings

    return _compare(ctx, blocked, waiting)


def _compare(ctx: _Context, blocked: list[Position], waiting: list[int]) -> list[Finding]:
    """Every rank has a call; explain why they do not complete together."""
    parts: dict[tuple, list[Position]] = defaultdict(list)
    for p in blocked:
        parts[p.key()].append(p)
    if len(parts) == 1:
        p = blocked[0]
        fields, _ = ctx.waiting(waiting)
        return [Finding(
            kind="stalled_collective", severity=STALL, ranks=[],
            summary=f"all ranks are inside {_describe(p.call)} at {fmt_site(with_source(p.call.site))} and none is "
                    "missing: the collective itself is not completing (network, transport or a peer outside this job)",
            op=p.call.op, group=p.call.group, seq=p.call.seq, site=with_source(p.call.site), **fields,
        )]
    # Same group, seq and line, different op/dtype/shape: a mismatch.
    by_point: dict[tuple, dict[str, list[Position]]] = defaultdict(lambda: defaultdict(list))
    for p in blocked:
        by_point[(p.call.group, p.call.seq, p.call.site_key)][p.call.fingerprint].append(p)
    for (group, seq, _site), fps in by_point.items():
        real = {fp: ps for fp, ps in fps.items() if fp != CPP_OP}
        if len(real) > 1:
            ordered = sorted(real.items(), key=lambda kv: (len(kv[1]), min(p.rank for p in kv[1])))
            minority = sorted(p.rank for p in ordered[0][1])
            culprit = ordered[0][1][0]
            fields, _ = ctx.waiting(r for r in waiting if r not in minority)
            return [Finding(
                kind="mismatch", severity=STALL, ranks=minority,
                summary=f"group {group} seq {seq}: ranks disagree on the collective at {fmt_site(with_source(culprit.call.site))}: "
                        + "; ".join(f"{fmt_ranks(p.rank for p in ps)}: {fp}" for fp, ps in ordered),
                op=culprit.call.op, group=group, seq=seq, site=with_source(culprit.call.site),
                details={"fingerprints": {fp: sorted(p.rank for p in ps) for fp, ps in ordered}}, **fields,
            )]
    # Different lines: the ranks took different code paths. Uneven iterations, or a rank-conditional call.
    sides = sorted(parts.values(), key=len)
    for side in sides:
        ranks = [p.rank for p in side]
        f = ctx.uneven(ranks, [r for r in waiting if r not in ranks],
                       f"wait in {_describe(side[0].call)} at {fmt_site(with_source(side[0].call.site))}")
        if f:
            return [f]
    return [_conditional(ctx, min(sides, key=lambda side: _conditional_score(ctx, side)))]


def _side_evidence(ctx: _Context, side: list[Position]) -> dict | None:
    return conditional_evidence(ctx.by_rank[side[0].rank], side[0].call, ctx.lint)


def _conditional_score(ctx: _Context, side: list[Position]) -> tuple:
    """Culprit side first: a rank-conditional line, then the minority, then a Python call, then low ranks."""
    c = side[0].call
    return (_side_evidence(ctx, side) is None, len(side), c is None or c.op == CPP_OP, min(p.rank for p in side))


def _crash_desync(ctx: _Context, states: list[RankState], roots: list[int]) -> list[Finding]:
    """A crash that followed a desync: every rank's last call is the same group and sequence number, but
    they disagree on op, dtype, shape or line (gloo aborts on a size mismatch instead of hanging)."""
    last = {s.rank: s.last_call() for s in states}
    if any(c is None for c in last.values()) or len({(c.group, c.seq) for c in last.values()}) != 1:
        return []
    if len({(c.fingerprint, c.site_key) for c in last.values()}) == 1:
        return []
    ctx.pos = {r: Position(r, "blocked", c, ctx.by_rank[r].main_site) for r, c in last.items()}
    findings = _compare(ctx, list(ctx.pos.values()), sorted(last))
    for f in findings:
        how = "; ".join(f"rank {r} {ctx.by_rank[r].how_it_ended()}" for r in roots)
        f.summary += f"; the job then crashed ({how})"
        f.details["ended_by"] = {str(s.rank): s.how_it_ended() for s in states}
    return findings


def exit_findings(states: list[RankState], now: float, lint: LintCheck | None = None) -> list[Finding]:
    """Ranks that ended while others still needed them, diagnosed as soon as it happens (no window).

    The root is the earliest rank that ended abnormally, not counting exceptions caused by a peer's
    death (connection reset, communicator aborted, timeouts). If only clean exits remain, a rank that
    exited normally while a peer then failed on it is the root (it returned early, or ran fewer
    iterations). Every rank ending at once (preemption, Ctrl-C) is not a finding.
    """
    ended = [s for s in states if s.gone]
    if not ended or len(states) < 2:
        return []

    def end_time(s: RankState) -> float:
        return s.exit_time or s.heartbeat_time

    def secondary(s: RankState) -> bool:
        return s.exit_state == "exception" and any(w in s.exit_reason.lower() for w in PEER_ERRORS)

    crashed = [s for s in ended if s.exit_state != "exited" and not secondary(s)]
    ctx = _Context(states, {s.rank: Position(s.rank, "gone", s.last_call(), s.main_site) for s in states},
                   min(end_time(s) for s in ended), now, lint or _default_lint)
    if crashed:
        # A rank that raised is a certain cause; one that died silently (SIGKILL, abort) may also be a
        # victim of the launcher tearing the job down (torchrun SIGTERMs the others within ~0.1 s).
        raised = [s for s in crashed if s.exit_state == "exception"]
        pool = raised or crashed
        first = min(end_time(s) for s in pool)
        roots = sorted(s.rank for s in pool if end_time(s) <= first + 1.0)
        desync = _crash_desync(ctx, states, roots)
        if desync:
            return desync
        if len(roots) == len(states):
            return []  # everything ended at once: preemption, Ctrl-C, a node lost; nothing to single out
        others = [s.rank for s in states if s.rank not in roots]
        return [ctx.exited(r, others) for r in roots]
    clean = sorted(s.rank for s in ended if s.exit_state == "exited")
    failed = [s.rank for s in states if secondary(s)]
    if clean and failed:
        f = ctx.uneven(clean, failed, "left the loop, then the process exited")
        if f:
            return [f]
        reasons = {s.rank: s.exit_reason for s in states if secondary(s)}
        extra = "; then " + "; ".join(f"rank {r} failed: {why[:160]}" for r, why in sorted(reasons.items()))
        return [ctx.exited(r, failed, extra) for r in clean]
    return []


def _conditional(ctx: _Context, side: list[Position], note: str | None = None) -> Finding:
    """A collective only some ranks call (``side``); the report names them and who skipped it."""
    call = side[0].call
    ranks = sorted(p.rank for p in side)
    first = ctx.by_rank[ranks[0]]
    others = sorted(r for r, p in ctx.pos.items() if r not in ranks and p.state != "gone")
    fields, waiting_txt = ctx.waiting(others)
    branch = _side_evidence(ctx, side)
    details: dict = {"conditional_line": branch}
    group = first.groups.get(call.group) if call else None
    members = group.members if group else None
    if members and len(members) < first.world_size:
        details["subgroup_members"] = members
    details["skipped_by"] = sorted(set(members) - set(ranks)) if members else others
    summary = (
        f"{fmt_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} in {_describe(call)} at "
        f"{fmt_site(with_source(call.site if call else None))} — called only by {fmt_ranks(ranks)}; "
        f"{fmt_ranks(details['skipped_by'])} of group {call.group if call else '?'} never called it"
    )
    if others:
        summary += f" ({waiting_txt})"
    if branch is not None:
        summary += f"; the call is reached from a rank-conditional branch at {fmt_site(branch)}"
    if note:
        summary += f"; {note}"
    return Finding(
        kind="rank_conditional", severity=STALL, ranks=ranks, summary=summary,
        op=call.op if call else None, group=call.group if call else None, seq=call.seq if call else None,
        site=with_source(call.site if call else None), details=details, **fields,
    )


# ---------------------------------------------------------------------------------------------------
# warnings without a stall
# ---------------------------------------------------------------------------------------------------
def uneven_loader_warnings(states: list[RankState], now: float) -> list[Finding]:
    out = []
    for ld in loader_evidence(states):
        out.append(Finding(
            kind="uneven_iterations", severity=WARNING, ranks=ld["short_ranks"],
            summary=f"DataLoader at {fmt_site(ld['site'])} has different lengths across ranks {ld['lengths']}: "
                    f"{fmt_ranks(ld['short_ranks'])} will leave the loop early and the others will hang in their next "
                    "collective (use DistributedSampler with the same drop_last everywhere, or the Join context manager)",
            site=ld["site"], detected=now, onset=now, details={"loader": ld},
        ))
    return out


@dataclass
class EntryLags:
    """How late each rank enters recent world-group collectives, relative to the first rank."""

    medians: dict[int, float]  # rank -> median seconds behind the first rank
    last_counts: dict[int, int]  # rank -> how many of the compared collectives it entered last
    compared: int  # collectives every live rank has in its recent history


def entry_lags(states: list[RankState]) -> EntryLags:
    entries: dict[int, dict[int, float]] = defaultdict(dict)  # seq -> rank -> t_enter
    live = [s for s in states if not s.gone]
    for s in live:
        g = s.groups.get("0")
        for c in (g.recent if g else []):
            entries[c.seq][s.rank] = c.t_enter
    full = [v for v in entries.values() if len(v) == len(live) > 0]
    lags: dict[int, list[float]] = defaultdict(list)
    last_counts: dict[int, int] = defaultdict(int)
    for v in full:
        first = min(v.values())
        for r, t in v.items():
            lags[r].append(t - first)
        last_counts[max(v, key=v.get)] += 1
    return EntryLags({r: statistics.median(x) for r, x in lags.items()}, dict(last_counts), len(full))


def straggler_warning(lags: EntryLags, now: float, min_lag: float = 0.05, min_share: float = 0.6) -> Finding | None:
    """One rank consistently last to enter the world group's collectives, while the job progresses."""
    if lags.compared < 8 or len(lags.medians) < 2:
        return None
    medians = lags.medians
    slow = max(medians, key=medians.get)
    share = lags.last_counts.get(slow, 0) / lags.compared
    if medians[slow] < min_lag or share < min_share:
        return None
    others = sorted(v for r, v in medians.items() if r != slow)
    return Finding(
        kind="straggler", severity=WARNING, ranks=[slow],
        summary=f"rank {slow} is the last to enter {share:.0%} of recent collectives, a median {medians[slow]*1000:.0f} ms "
                f"behind the first rank (others: {statistics.median(others)*1000:.0f} ms); the job is progressing",
        detected=now, onset=now,
        details={"median_lag_s": {str(r): round(v, 4) for r, v in sorted(medians.items())}, "last_share": round(share, 3)},
    )
