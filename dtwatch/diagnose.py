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
# The main thread's site must have been still for this long after a C++-issued collective for the
# rank to count as blocked in it.
CPP_BLOCK_SLACK = 1.0


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
    """A collective issued from C++ that the rank appears to wait in (no Python record covers it)."""
    best: Call | None = None
    for g in s.groups.values():
        if g.cpp_seq <= g.py_seq or g.cpp_seq == 0:
            continue
        if s.main_site_since > g.cpp_seq_time + CPP_BLOCK_SLACK:
            continue  # the main thread moved on after issuing it
        others = [by_rank[m].groups[g.name].seq for m in (g.members or []) if m in by_rank and m != s.rank and g.name in by_rank[m].groups]
        if others and min(others) >= g.cpp_seq and all(
            by_rank[m].groups[g.name].completed >= g.cpp_seq for m in (g.members or []) if m in by_rank and m != s.rank
        ):
            continue  # everyone got past it
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


def classify(
    states: list[RankState], check: StallCheck, now: float, lint: LintCheck | None = None
) -> list[Finding]:
    """Explain a stall. ``check`` must say ``stalled``."""
    lint = lint or _default_lint
    pos = check.positions
    by_rank = {s.rank: s for s in states}
    blocked = [pos[r] for r in check.blocked if pos[r].call is not None]
    waiting = sorted(r for r in check.blocked)
    first_wait = min(blocked, key=lambda p: p.call.t_enter) if blocked else None
    base = dict(
        waiting_ranks=waiting,
        waiting_op=first_wait.call.op if first_wait else None,
        waiting_group=first_wait.call.group if first_wait else None,
        waiting_seq=first_wait.call.seq if first_wait else None,
        waiting_site=with_source(first_wait.call.site) if first_wait else None,
        onset=check.last_progress, detected=now,
    )
    waiting_txt = (
        f"{fmt_ranks(waiting)} wait in {_describe(first_wait.call)} at {fmt_site(with_source(first_wait.call.site))}"
        if first_wait else "the others wait"
    )
    loaders = loader_evidence(states)
    steps = {s.rank: s.step for s in states}

    def iteration_finding(short: list[int], waiting_ranks: list[int], how: str) -> Finding | None:
        short_steps = {steps[r] for r in short}
        long_steps = {steps[r] for r in waiting_ranks if r in steps}
        loader = next((ld for ld in loaders if set(ld["short_ranks"]) & set(short)), None)
        if loader is None and not (short_steps and long_steps and max(short_steps) < min(long_steps)):
            return None
        culprits = loader["short_ranks"] if loader else short
        sd = by_rank[culprits[0]]
        last = sd.last_call()
        site = loader["site"] if loader else with_source(last.site if last else None)
        counts = (
            f"DataLoader at {fmt_site(loader['site'])} has lengths {loader['lengths']}"
            if loader else f"steps: {', '.join(f'rank {r}={steps[r]}' for r in sorted(steps))}"
        )
        return Finding(
            kind="uneven_iterations", severity=STALL, ranks=culprits,
            summary=f"{fmt_ranks(culprits)} ran fewer iterations and {how}; {waiting_txt}. {counts}",
            op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
            site=site, details={"steps": {str(r): n for r, n in sorted(steps.items())}, "loaders": loaders}, **base,
        )

    findings: list[Finding] = []
    gone = [p for p in pos.values() if p.state == "gone"]
    if gone:
        crashed = [p.rank for p in gone if by_rank[p.rank].exit_state != "exited"]
        clean = [p.rank for p in gone if by_rank[p.rank].exit_state == "exited"]
        if clean and not crashed:
            f = iteration_finding(clean, waiting, "exited the loop and the process")
            if f:
                return [f]
            if first_wait and conditional_evidence(by_rank[first_wait.rank], first_wait.call, lint):
                return [_conditional(first_wait, blocked, pos, by_rank, base, f"{fmt_ranks(clean)} exited normally", lint=lint)]
        for r in crashed + clean:
            s = by_rank[r]
            last = s.last_call()
            findings.append(Finding(
                kind="rank_exited", severity=STALL, ranks=[r],
                summary=f"rank {r} {s.how_it_ended()}; its last collective was {_describe(last)} at "
                        f"{fmt_site(with_source(last.site if last else None))}; {waiting_txt}",
                op=last.op if last else None, group=last.group if last else None,
                seq=last.seq if last else None, site=with_source(last.site if last else None),
                details={"exit_state": s.exit_state, "exit_reason": s.exit_reason, "pid": s.pid, "host": s.host},
                **base,
            ))
        return findings

    wedged = [p for p in pos.values() if p.state == "unresponsive"]
    if wedged:
        for p in wedged:
            s = by_rank[p.rank]
            where = fmt_site(with_source(s.main_site))
            state = {"T": "stopped (SIGSTOP/debugger)", "D": "in uninterruptible I/O"}.get(s.proc_state, "not running Python")
            findings.append(Finding(
                kind="unresponsive", severity=STALL, ranks=[p.rank],
                summary=f"rank {p.rank} is alive but unresponsive ({state}; heartbeat {s.heartbeat_age(now):.0f}s old), "
                        f"last seen at {where}; {waiting_txt}",
                op=p.call.op if p.call else None, group=p.call.group if p.call else None,
                seq=p.call.seq if p.call else None, site=with_source(s.main_site),
                details={"proc_state": s.proc_state, "heartbeat_age_s": round(s.heartbeat_age(now), 1),
                         "main_top_site": s.main_top_site, "pid": s.pid, "host": s.host},
                **base,
            ))
        return findings

    outside = [p for p in pos.values() if p.state == "outside"]
    if outside:
        short = [p.rank for p in outside]
        f = iteration_finding(short, waiting, "are outside any collective")
        if f:
            return [f]
        for p in outside:
            s = by_rank[p.rank]
            findings.append(Finding(
                kind="stuck_outside_collective", severity=STALL, ranks=[p.rank],
                summary=f"rank {p.rank} is not in any collective: it is at {fmt_site(with_source(s.main_site))}"
                        f" (innermost frame {fmt_site(s.main_top_site)}) since {now - s.main_site_since:.0f}s; {waiting_txt}",
                site=with_source(s.main_site),
                group=first_wait.call.group if first_wait else None,
                seq=(s.groups[first_wait.call.group].seq if first_wait and first_wait.call.group in s.groups else None),
                details={"main_top_site": s.main_top_site, "step": s.step}, **base,
            ))
        return findings

    # Everyone is blocked. Group ranks by where they are.
    parts: dict[tuple, list[Position]] = defaultdict(list)
    for p in blocked:
        parts[p.key()].append(p)
    if len(parts) == 1:
        p = blocked[0]
        return [Finding(
            kind="stalled_collective", severity=STALL, ranks=[],
            summary=f"all ranks are inside {_describe(p.call)} at {fmt_site(with_source(p.call.site))} and none is "
                    "missing: the collective itself is not completing (network, transport or a peer outside this job)",
            op=p.call.op, group=p.call.group, seq=p.call.seq, site=with_source(p.call.site), **base,
        )]
    # Same group and seq, same line, different fingerprint: a mismatch.
    by_point: dict[tuple, dict[str, list[Position]]] = defaultdict(lambda: defaultdict(list))
    for p in blocked:
        by_point[(p.call.group, p.call.seq, p.call.site_key)][p.call.fingerprint].append(p)
    for (group, seq, _site), fps in by_point.items():
        real = {fp: ps for fp, ps in fps.items() if fp != CPP_OP}
        if len(real) > 1:
            ordered = sorted(real.items(), key=lambda kv: (len(kv[1]), min(p.rank for p in kv[1])))
            minority = ordered[0][1]
            culprit = minority[0]
            return [Finding(
                kind="mismatch", severity=STALL, ranks=sorted(p.rank for p in minority),
                summary=f"group {group} seq {seq}: ranks disagree on the collective at {fmt_site(with_source(culprit.call.site))}: "
                        + "; ".join(f"{fmt_ranks(p.rank for p in ps)}: {fp}" for fp, ps in ordered),
                op=culprit.call.op, group=group, seq=seq, site=with_source(culprit.call.site),
                details={"fingerprints": {fp: sorted(p.rank for p in ps) for fp, ps in ordered}}, **base,
            )]
    # Different lines: the ranks took different code paths. Uneven iterations, or a rank-conditional call.
    groups_of = sorted(parts.values(), key=len)
    for part in groups_of[:-1]:
        others = [p.rank for q in groups_of if q is not part for p in q]
        f = iteration_finding([p.rank for p in part], others, f"wait in {_describe(part[0].call)} at {fmt_site(with_source(part[0].call.site))}")
        if f:
            return [f]
    return [_conditional(None, blocked, pos, by_rank, base, None, lint=lint, parts=groups_of)]


def _conditional(
    culprit_pos: Position | None, blocked: list[Position], pos: dict[int, Position], by_rank: dict[int, RankState],
    base: dict, note: str | None, lint: LintCheck | None = None, parts: list[list[Position]] | None = None,
) -> Finding:
    """A collective only some ranks call. Pick the side whose line is rank-conditional, else the minority."""
    lint = lint or _default_lint
    if parts is None:
        parts = [[p for p in blocked if p.key() == culprit_pos.key()]] if culprit_pos else [blocked]
    def evidence(part: list[Position]) -> dict | None:
        return conditional_evidence(by_rank[part[0].rank], part[0].call, lint)

    def score(part: list[Position]) -> tuple:
        c = part[0].call
        return (evidence(part) is None, len(part), c is None or c.op == CPP_OP, min(p.rank for p in part))

    chosen = min(parts, key=score)
    call = chosen[0].call
    ranks = sorted(p.rank for p in chosen)
    others = sorted(r for r in pos if r not in ranks and pos[r].state != "gone")
    other_calls = [pos[r].call for r in others if pos[r].call is not None]
    other = other_calls[0] if other_calls else None
    branch = evidence(chosen)
    details: dict = {"conditional_line": branch}
    group_members = by_rank[ranks[0]].groups.get(call.group).members if call and call.group in by_rank[ranks[0]].groups else None
    skipped = sorted(set(group_members or []) - set(ranks)) if group_members else others
    if group_members and len(group_members) < by_rank[ranks[0]].world_size:
        details["subgroup_members"] = group_members
    details["skipped_by"] = skipped
    summary = (
        f"{fmt_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} in {_describe(call)} at {fmt_site(with_source(call.site if call else None))}"
        f" — called only by {fmt_ranks(ranks)}; {fmt_ranks(skipped)} of group {call.group if call else '?'} never called it"
    )
    if other is not None:
        summary += f" ({fmt_ranks(others)} {'is' if len(others) == 1 else 'are'} in {_describe(other)} at {fmt_site(with_source(other.site))})"
    if branch is not None:
        summary += f"; the call is reached from a rank-conditional branch at {fmt_site(branch)}"
    if note:
        summary += f"; {note}"
    base = dict(base)
    if other is not None:
        base.update(waiting_ranks=others, waiting_op=other.op, waiting_group=other.group, waiting_seq=other.seq,
                    waiting_site=with_source(other.site))
    return Finding(
        kind="rank_conditional", severity=STALL, ranks=ranks, summary=summary,
        op=call.op if call else None, group=call.group if call else None, seq=call.seq if call else None,
        site=with_source(call.site if call else None), details=details, **base,
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


def _entry_lags(states: list[RankState]) -> tuple[dict[int, list[float]], dict[int, int], int]:
    """Per rank: delays entering recent world-group collectives behind the first rank; times last; count."""
    entries: dict[int, dict[int, float]] = defaultdict(dict)  # seq -> rank -> t_enter
    live = [s for s in states if not s.gone]
    for s in live:
        g = s.groups.get("0")
        for c in (g.recent if g else []):
            entries[c.seq][s.rank] = c.t_enter
    full = [v for v in entries.values() if len(v) == len(live) > 1]
    lags: dict[int, list[float]] = defaultdict(list)
    last_counts: dict[int, int] = defaultdict(int)
    for v in full:
        first = min(v.values())
        for r, t in v.items():
            lags[r].append(t - first)
        last_counts[max(v, key=v.get)] += 1
    return lags, last_counts, len(full)


def straggler_lags(states: list[RankState]) -> dict[int, float]:
    """Median delay per rank entering world-group collectives behind the first rank (seconds)."""
    lags, _, _ = _entry_lags(states)
    return {r: statistics.median(x) for r, x in lags.items()}


def straggler_warning(states: list[RankState], now: float, min_lag: float = 0.05, min_share: float = 0.6) -> Finding | None:
    """One rank consistently last to enter the world group's collectives, while the job progresses."""
    lags, last_counts, n = _entry_lags(states)
    if n < 8:
        return None
    medians = {r: statistics.median(x) for r, x in lags.items()}
    slow = max(medians, key=medians.get)
    share = last_counts[slow] / n
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
