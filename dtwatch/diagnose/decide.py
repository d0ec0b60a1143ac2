"""The decisions: from every rank's position, who is the culprit and what they did.

Principles (see the package docstring): name the deviant, not the victim; compare the ranks' program
order (group, sequence number, op, call site) to find where they diverged; recognise ranks that left
a loop early by where they are as much as by counts; state how a rank ended as it was; never claim
more than the evidence shows. Sentences come from :mod:`.text`; nothing here does I/O (all outside
facts come through the :class:`~.evidence.Evidence` passed in).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable

from ..flight import SEQ, SeqMapping, calibrate, entry_for
from ..state import CPP_OP, Call, RankState
from .evidence import Evidence
from .model import PEER_ERRORS, STALL, Finding, Kind, Position
from .positions import StallCheck
from .text import CPP_PREFIX, describe, fmt_ranks, fmt_site, op_name, sentence, trim, verb, with_source
from .warn import loader_evidence

P2P = ("send", "recv", "isend", "irecv")
_MATCHING_P2P = {"send": "recv", "isend": "recv", "recv": "send", "irecv": "send"}
_AT_LINE = re.compile(r"(?s)^(?P<reason>.*) at (?P<file>\S+):(?P<line>\d+)$")  # "... at FILE:LINE" (the last)


def is_library_path(path: str) -> bool:
    """Third-party or standard-library code (not the user's): the user's line is outside these."""
    if not path or path.startswith("<"):
        return True
    parts = path.replace("\\", "/").split("/")
    return "site-packages" in parts or "dist-packages" in parts or "<site-packages>" in parts or \
        "<stdlib>" in parts or any(p.startswith("python3") and i > 0 and parts[i - 1] == "lib" for i, p in enumerate(parts))


class Context:
    """What every finding of one diagnosis shares: states, positions, evidence, loader and step facts."""

    def __init__(self, states: list[RankState], pos: dict[int, Position], onset: float, now: float,
                 evidence: Evidence) -> None:
        self.states, self.pos, self.onset, self.now, self.ev = states, pos, onset, now, evidence
        self.by_rank = {s.rank: s for s in states}
        self.loaders = loader_evidence(states)
        self.steps = {s.rank: s.step for s in states}
        self._fr_mappings: dict = {}
        self.past = False  # describing calls the ranks made earlier (completed), not where they are now
        self.issued_from_cpp: dict[int, dict] = {}  # rank -> the FR entry that named its C++-issued call
        self.pos = {r: (Position(p.rank, p.state, self.named(r, p.call), p.site) if p.call is not None else p)
                    for r, p in pos.items()}

    # -- collectives issued from C++ ---------------------------------------------------------------
    def fr_entry(self, rank: int, group: str, seq: int) -> dict | None:
        """The rank's Flight Recorder entry for ``group``'s call number ``seq``, with the numbering
        calibrated on the rank's own Python-issued calls (dtwatch.flight)."""
        summary = self.ev.flight_record(rank)
        entries = (summary or {}).get("entries") or []
        if not entries:
            return None
        mapping = self._fr_mappings.get(rank)
        if mapping is None:
            s = self.by_rank[rank]
            calls = [c for g in s.groups.values() for c in g.recent]
            mapping = self._fr_mappings[rank] = calibrate(entries, calls, s.backend)
        found = entry_for(entries, group, seq, mapping)
        if found is None and mapping.field not in entries[0]:
            # Summaries written before op_id was kept: collective_seq_id (right while the group had no p2p).
            found = entry_for(entries, group, seq, SeqMapping(SEQ))
        return found

    def named(self, rank: int, call: Call | None) -> Call | None:
        """A call issued from C++ (DDP/FSDP), named and placed from the rank's Flight Recorder entry for
        the same group and sequence number (its op, sizes and the user's line in its frames)."""
        if call is None or call.op != CPP_OP:
            return call
        entry = self.fr_entry(rank, call.group, call.seq)
        if entry is None:
            return call
        op = str(entry.get("op") or "") or CPP_OP
        sizes = entry.get("input_sizes") or []
        shape = "x".join(str(d) for d in sizes[0]) if sizes and isinstance(sizes[0], list) else "?"
        dtype = (entry.get("input_dtypes") or ["?"])[0]
        user = entry.get("user_site") or next((f for f in fr_frames(entry) if not is_library_path(f["file"])), None)
        self.issued_from_cpp[rank] = {**entry, "seq_mapping": self._fr_mappings[rank].to_dict()}
        return Call(op=op, group=call.group, seq=call.seq, site=user or call.site, t_enter=call.t_enter,
                    fingerprint=f"{CPP_PREFIX}{op}[{dtype}:{shape}]", user_site=user or call.site)

    # -- sites ------------------------------------------------------------------------------------
    def site(self, site: dict | None) -> dict | None:
        return with_source(site, self.ev)

    def fmt(self, site: dict | None) -> str:
        return fmt_site(self.site(site), self.ev)

    def user_site(self, rank: int, call: Call | None) -> dict | None:
        """The user's line for a call: where user code called into torch or a library."""
        if call is None:
            return None
        if call.op == CPP_OP:
            frames = self.frames(rank, None)
            return frames[0] if frames else None
        user = getattr(call, "user_site", None)
        return user or call.site

    def frames(self, rank: int, call: Call | None) -> list[dict]:
        """The user-code lines a rank is at, innermost first: the call's user line and library line,
        then the sampled main-thread stack (py-spy's, when taken, for a rank that is not sampling)."""
        s = self.by_rank[rank]
        out: list[dict] = []
        if s.gone:  # where it was when it died (faulthandler's record of the fatal signal or SIGTERM)
            out += [f for f in (self.ev.ending(rank) or {}).get("frames") or [] if not is_library_path(str(f.get("file", "")))]
        if call is not None and call.op != CPP_OP:
            for site in (getattr(call, "user_site", None), call.site):
                if site:
                    out.append(site)
        stack = list(s.main_stack) or ([s.main_site] if s.main_site else [])
        out += [f for f in stack if f]
        seen, unique = set(), []
        for f in out:
            key = (f.get("file"), f.get("line"))
            if key not in seen:
                seen.add(key)
                unique.append(f)
        return unique

    def branch(self, rank: int, call: Call | None) -> dict | None:
        """The rank-conditional ``if`` that the call (or the code path to it) runs under."""
        for f in self.frames(rank, call):
            if is_library_path(str(f.get("file", ""))):
                continue
            found = self.ev.rank_branch(str(f["file"]), int(f["line"]))
            if found:
                line, text = found
                return {"file": f["file"], "line": line, "function": f.get("function"), "source": text,
                        "call_line": f["line"]}
        return None

    # -- calls ------------------------------------------------------------------------------------
    def call_at(self, rank: int, group: str, seq: int) -> Call | None:
        """What ``rank`` issued as sequence number ``seq`` of ``group``, if known."""
        p = self.pos.get(rank)
        if p is not None and p.call is not None and p.call.group == group and p.call.seq == seq:
            return p.call
        s = self.by_rank[rank]
        g = s.groups.get(group)
        if g is None:
            return None
        for c in reversed(g.recent):
            if c.seq <= seq < c.seq + max(1, c.span):
                return c
        covered = not g.recent or min(c.seq for c in g.recent) <= seq
        if g.cpp_seq >= seq and covered:  # not a Python-issued call: DDP/FSDP issued it from C++
            return Call(op=CPP_OP, group=group, seq=seq, site=s.main_site, t_enter=g.cpp_seq_time, fingerprint=CPP_OP)
        return None

    def last_call(self, rank: int) -> Call | None:
        """The rank's latest collective, Python-issued or issued from C++ (DDP/FSDP)."""
        s = self.by_rank[rank]
        last = s.last_call()
        for g in s.groups.values():
            if g.cpp_seq > g.py_seq and (last is None or g.cpp_seq_time > last.t_enter):
                last = Call(op=CPP_OP, group=g.name, seq=g.cpp_seq, site=s.main_site, t_enter=g.cpp_seq_time,
                            fingerprint=CPP_OP)
        return last

    def members(self, rank: int, group: str) -> list[int]:
        g = self.by_rank[rank].groups.get(group)
        if g is not None and g.members:
            return list(g.members)
        return sorted(self.by_rank)

    def missing(self, rank: int, call: Call) -> list[int]:
        """The ranks ``rank`` waits for in ``call``: members that have not issued it."""
        if call.op in P2P:
            peer = getattr(call, "peer", -1)
            peers = [peer] if peer is not None and peer >= 0 else [m for m in self.members(rank, call.group) if m != rank]
            out = []
            for m in peers:
                pm = self.pos.get(m)
                mc = pm.call if pm is not None else None
                if mc is None or mc.op not in P2P or getattr(mc, "peer", rank) not in (rank, -1, None):
                    out.append(m)
            return out
        out = []
        for m in self.members(rank, call.group):
            if m == rank or m not in self.by_rank:
                continue
            g = self.by_rank[m].groups.get(call.group)
            if g is None or g.seq < call.seq:
                out.append(m)
        return out

    def waiting(self, ranks: Iterable[int]) -> tuple[dict, str]:
        """Finding fields and a phrase for the ranks that wait on the culprits."""
        ranks = sorted(set(ranks))
        calls = [self.pos[r] for r in ranks if r in self.pos and self.pos[r].call is not None]
        first = min(calls, key=lambda p: p.call.t_enter) if calls else None
        site = self.user_site(first.rank, first.call) if first else None
        fields = dict(
            waiting_ranks=ranks, waiting_op=first.call.op if first else None,
            waiting_group=first.call.group if first else None, waiting_seq=first.call.seq if first else None,
            waiting_site=self.site(site) if first else None, onset=self.onset, detected=self.now,
        )
        if not ranks:
            return fields, ""
        if first is None:
            return fields, f"{fmt_ranks(ranks)} {verb(ranks, 'waits', 'wait')} for it"
        where = {(self.pos[r].call.group, self.pos[r].call.seq, self.pos[r].call.op) for r in ranks
                 if self.pos.get(r) is not None and self.pos[r].call is not None}
        text = f"{fmt_ranks(ranks)} {verb(ranks, 'waits', 'wait')} in {describe(first.call)} at {self.fmt(site)}"
        if len(where) > 1:
            text = f"{fmt_ranks(ranks)} wait, the first in {describe(first.call)} at {self.fmt(site)}"
        return fields, text

    def how_it_ended(self, s: RankState) -> str:
        if s.exit_state == "exception":
            return f"raised {trim(_strip_location(s.exit_reason), 240)}"
        if s.exit_state == "exited":
            return "exited normally (returned or called sys.exit)"
        if s.exit_state == "detached":
            return "uninstalled dtwatch"
        ending = self.ev.ending(s.rank)
        if ending and ending.get("signal"):
            sig = ending["signal"]
            if sig == "SIGABRT":
                return "was aborted (SIGABRT, raised by native code such as a gloo or NCCL check)"
            if sig == "SIGTERM":
                return "was terminated (SIGTERM: the launcher tearing the job down, or a scheduler)"
            return f"was killed by {sig}"
        if s.alive is False:
            return "ended without a Python exception or a normal exit (killed by a signal; which one was not recorded)"
        return "is running"


_FR_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def fr_frames(entry: dict) -> list[dict]:
    """A Flight Recorder entry's frames ("name (file:line)", innermost first) as sites."""
    out = []
    for text in entry.get("frames") or []:
        m = _FR_FRAME.match(str(text))
        if m:
            out.append({"file": m.group("file"), "line": int(m.group("line")), "function": m.group("function")})
    return out


def _strip_location(reason: str) -> str:
    m = _AT_LINE.match(reason or "")
    return m.group("reason") if m else (reason or "")


def exception_site(s: RankState) -> dict | None:
    """The line an exception was raised at, from the exit reason ("... at FILE:LINE")."""
    m = _AT_LINE.match(s.exit_reason or "")
    if not m:
        return None
    return {"file": m.group("file"), "line": int(m.group("line"))}


# ---------------------------------------------------------------------------------------------------
# stalls
# ---------------------------------------------------------------------------------------------------
def classify(states: list[RankState], check: StallCheck, now: float, evidence: Evidence) -> list[Finding]:
    """Explain a stall. ``check`` must say ``stalled``."""
    ctx = Context(states, check.positions, check.last_progress, now, evidence)
    return _with_cpp_entries(ctx, _classify(ctx, check))


def _with_cpp_entries(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """Findings that involve C++-issued calls carry the Flight Recorder entries that named them."""
    for f in findings:
        for r in sorted(set(f.ranks) | set(f.waiting_ranks)):
            if r in ctx.issued_from_cpp:
                f.details.setdefault("issued_from_cpp", {})[str(r)] = ctx.issued_from_cpp[r]
    return findings


def _classify(ctx: Context, check: StallCheck) -> list[Finding]:
    pos = ctx.pos
    waiting = sorted(check.blocked)

    gone = [p.rank for p in pos.values() if p.state == "gone"]
    if gone:
        return _gone(ctx, gone, waiting)

    wedged = [p for p in pos.values() if p.state == "unresponsive"]
    if wedged:
        return [_unresponsive(ctx, p, waiting) for p in wedged]

    blocked = [pos[r] for r in check.blocked if pos[r].call is not None]
    # The ranks went out of step earlier, at a call they all completed (paired with a different call):
    # that first divergence is the root cause, the stall only its symptom.
    diverged = _first_divergence(ctx, blocked)
    if diverged is not None:
        return [diverged]
    needed = {m for p in blocked for m in ctx.missing(p.rank, p.call)}
    outside = [p.rank for p in pos.values() if p.state == "outside" and p.rank in needed]
    if outside:
        return _outside(ctx, outside, waiting)
    return _blocked(ctx, blocked, waiting)


def _first_divergence(ctx: Context, blocked: list[Position]) -> Finding | None:
    """Program-order alignment: the first sequence number, before where the ranks now wait, at which
    the members of a group issued different collectives (another op, or the same op with another shape)
    and the calls still completed. Only what is known on every member counts (Python-issued calls, and
    C++-issued ones named by the Flight Recorder)."""
    waiting = sorted(p.rank for p in blocked)
    live = [s for s in ctx.states if not s.gone]
    groups = sorted({g for s in live for g in s.groups})
    for group in groups:
        members = [s.rank for s in live if group in s.groups]
        if len(members) < 2:
            continue
        upto = min(ctx.by_rank[m].groups[group].completed for m in members)
        known: set[int] = set()
        for m in members:
            known |= {c.seq for c in ctx.by_rank[m].groups[group].recent if c.seq <= upto}
            summary = ctx.ev.flight_record(m) or {}
            for e in summary.get("entries") or []:
                for key in ("op_id", "seq"):
                    if isinstance(e.get(key), int) and e[key] <= upto:
                        known.add(int(e[key]))
        for seq in sorted(known):
            calls = {m: ctx.named(m, ctx.call_at(m, group, seq)) for m in members}
            if any(c is None or c.op == CPP_OP or c.op in P2P for c in calls.values()):
                continue
            if len({_op_shape(c) for c in calls.values()}) < 2:
                continue
            sides: dict[tuple, list[Position]] = defaultdict(list)
            for m, c in calls.items():
                sides[_op_shape(c)].append(Position(m, "blocked", c, None))
            now_pos = ctx.pos
            ctx.pos = {**ctx.pos, **{m: Position(m, "blocked", c, None) for m, c in calls.items()}}
            ctx.past = True
            try:
                f = _desync(ctx, group, seq, list(sides.values()), members)
            finally:
                ctx.pos, ctx.past = now_pos, False
            fields, waiting_txt = ctx.waiting(waiting)
            f.summary = sentence(f.summary, "those calls were paired with each other and completed, so the ranks "
                                 "went on out of step", f"now {waiting_txt}" if waiting_txt else "")
            f.details["diverged_at"] = {"group": group, "seq": seq}
            for k, v in fields.items():
                setattr(f, k, v)
            return f
    return None


def _op_shape(c: Call) -> tuple:
    """What must agree across ranks at one sequence number: the op, and the shape where both sides
    state it the same way (Python-issued fingerprints)."""
    from ..flight import op_family

    return (op_family(c.op), c.fingerprint if not c.fingerprint.startswith(CPP_PREFIX) else "")


def _unresponsive(ctx: Context, p: Position, waiting: list[int]) -> Finding:
    s = ctx.by_rank[p.rank]
    fields, waiting_txt = ctx.waiting(r for r in waiting if r != p.rank)
    state = {"T": "stopped (SIGSTOP or a debugger)", "D": "in uninterruptible I/O"}.get(s.proc_state, "not running Python code (the GIL is held, or it is stuck in native code)")
    stack = ctx.ev.stack(p.rank)
    user = next((f for f in (stack or []) if not is_library_path(str(f.get("file", "")))), None)
    if user is not None:
        where, site, source = f"py-spy shows it at {ctx.fmt(user)}", user, "py-spy"
    else:
        where, site, source = f"it was last seen at {ctx.fmt(s.main_site)}", s.main_site, "last sample"
    summary = sentence(
        f"rank {p.rank} is alive but unresponsive: {state}; its heartbeat is {s.heartbeat_age(ctx.now):.0f}s old",
        where, waiting_txt,
    )
    return Finding(
        kind=Kind.UNRESPONSIVE, severity=STALL, ranks=[p.rank], summary=summary,
        op=p.call.op if p.call else None, group=p.call.group if p.call else None,
        seq=p.call.seq if p.call else None, site=ctx.site(site),
        details={"proc_state": s.proc_state, "heartbeat_age_s": round(s.heartbeat_age(ctx.now), 1),
                 "main_top_site": s.main_top_site, "site_from": source, "pid": s.pid, "host": s.host},
        **fields,
    )


def _outside(ctx: Context, outside: list[int], waiting: list[int]) -> list[Finding]:
    f = _uneven(ctx, outside, waiting, positions_known=False)
    if f:
        return [f]
    findings = []
    fields, waiting_txt = ctx.waiting(waiting)
    first_group = fields["waiting_group"]
    for r in outside:
        s = ctx.by_rank[r]
        stack = ctx.ev.stack(r)
        top_user = next((f for f in (stack or []) if not is_library_path(str(f.get("file", "")))), None)
        site = top_user or s.main_site
        seq = s.groups[first_group].seq if first_group in s.groups else None
        behind = f"it has issued up to seq {seq} of group {first_group}" if seq is not None else ""
        summary = sentence(
            f"rank {r} is not in any collective: it is at {ctx.fmt(site)}"
            + (f" (innermost frame {fmt_site(s.main_top_site, ctx.ev)})" if s.main_top_site and s.main_top_site != site else "")
            + f", for {ctx.now - s.main_site_since:.0f}s",
            behind, waiting_txt,
        )
        findings.append(Finding(
            kind=Kind.STUCK_OUTSIDE, severity=STALL, ranks=[r], summary=summary,
            site=ctx.site(site), group=first_group, seq=seq,
            details={"main_top_site": s.main_top_site, "main_stack": s.main_stack, "step": s.step}, **fields,
        ))
    return findings


# ---------------------------------------------------------------------------------------------------
# every rank has issued something: compare them
# ---------------------------------------------------------------------------------------------------
def _blocked(ctx: Context, blocked: list[Position], waiting: list[int]) -> list[Finding]:
    # 1. Ranks at the same group and sequence number in different calls: they took different paths.
    # (p2p calls pair with their peer's matching call, not by sequence number: they are followed below.)
    points: dict[tuple[str, int], list[Position]] = defaultdict(list)
    for p in blocked:
        if p.call.op not in P2P:
            points[(p.call.group, p.call.seq)].append(p)
    for (group, seq), here in sorted(points.items(), key=lambda kv: min(p.call.t_enter for p in kv[1])):
        # Members that already passed this point: what they issued there (their call completed on their
        # side, e.g. gloo finished a send of the wrong size) counts too.
        there = {p.rank for p in here}
        for m in ctx.members(here[0].rank, group):
            g = ctx.by_rank[m].groups.get(group) if m in ctx.by_rank and m not in there else None
            if g is not None and g.seq > seq:
                c = ctx.named(m, ctx.call_at(m, group, seq))
                if c is not None and c.op not in P2P:
                    here = here + [Position(m, "passed", c, None)]
        sides = _sides(ctx, here)
        if len(sides) > 1:
            return [_desync(ctx, group, seq, list(sides.values()), waiting)]

    # 2. Someone waits for ranks that have not issued the call: follow who waits for whom.
    edges = [(p, m) for p in blocked for m in ctx.missing(p.rank, p.call)]
    if edges:
        return [_wait_cycle(ctx, edges, waiting)]

    # 3. Everyone seen is in the same collective and nobody seen is missing.
    p = min(blocked, key=lambda q: q.call.t_enter)
    fields, _ = ctx.waiting(waiting)
    site = ctx.user_site(p.rank, p.call)
    world = max(s.world_size for s in ctx.states)
    unseen = sorted(set(ctx.members(p.rank, p.call.group)) - set(ctx.by_rank)) if ctx.by_rank[p.rank].groups.get(
        p.call.group) and ctx.by_rank[p.rank].groups[p.call.group].members else sorted(set(range(world)) - set(ctx.by_rank))
    if unseen:
        seen = sorted(ctx.by_rank)
        parts = [f"{fmt_ranks(seen)} (every rank dtwatch sees) {verb(seen, 'is', 'are')} inside {describe(p.call)} at "
                 f"{ctx.fmt(site)}",
                 f"{fmt_ranks(unseen)} of the job (world size {world}) {verb(unseen, 'was', 'were')} never seen: no ring "
                 "(started without dtwatch, or on a node whose watchdog this one cannot reach), so whether "
                 f"{'it' if len(unseen) == 1 else 'they'} issued this call is not known"]
    else:
        parts = [f"all ranks are inside {describe(p.call)} at {ctx.fmt(site)} and none is missing",
                 "the collective itself is not completing (network, transport, or a peer outside this job)"]
    return [Finding(
        kind=Kind.STALLED_COLLECTIVE, severity=STALL, ranks=[], summary=sentence(*parts),
        op=p.call.op, group=p.call.group, seq=p.call.seq, site=ctx.site(site),
        details={"unseen_ranks": unseen}, **fields,
    )]


def _sides(ctx: Context, here: list[Position]) -> dict[tuple, list[Position]]:
    """Positions at one point grouped by what they issued. A C++-issued call the Flight Recorder did not
    name on some rank (a dead rank cannot dump it) is compared as "issued from C++" on every rank."""
    unnamed = any(p.call.op == CPP_OP for p in here)
    sides: dict[tuple, list[Position]] = defaultdict(list)
    for p in here:
        sig = _signature(ctx, p)
        if unnamed and p.call.fingerprint.startswith(CPP_PREFIX):
            sig = (CPP_OP,)
        sides[sig].append(p)
    return dict(sides)


def _signature(ctx: Context, p: Position) -> tuple:
    c = p.call
    if c.op == CPP_OP:
        return (CPP_OP,)
    if c.fingerprint.startswith(CPP_PREFIX):
        return (c.fingerprint,)  # DDP/FSDP's own call: the same on every rank whatever line led there
    user = ctx.user_site(p.rank, c)
    return (c.fingerprint, (user or {}).get("file"), (user or {}).get("line"))


def _desync(ctx: Context, group: str, seq: int, sides: list[list[Position]], waiting: list[int]) -> Finding:
    """Ranks at the same point of a group in different calls."""
    sides = sorted(sides, key=lambda side: (len(side), min(p.rank for p in side)))
    # Same line, different op/dtype/shape: the ranks disagree on the arguments of one call.
    python = [side for side in sides if side[0].call.op != CPP_OP]
    by_line: dict[tuple, list[list[Position]]] = defaultdict(list)
    for side in python:
        by_line[tuple(sorted(filter(None, [side[0].call.site_key, _key(ctx.user_site(side[0].rank, side[0].call))])))].append(side)
    for line_sides in by_line.values():
        if len(line_sides) > 1:
            return _mismatch(ctx, group, seq, line_sides, waiting)

    # A side that left the loop the others are still in: uneven iterations.
    for side in (sides if not ctx.past else []):
        ranks = [p.rank for p in side]
        others = [p for s2 in sides if s2 is not side for p in s2]
        f = _uneven(ctx, ranks, [r for r in waiting if r not in ranks], positions_known=True, inside=others, side=side)
        if f:
            return f

    # The same calls in a different order.
    swap = _order_swap(ctx, group, sides)
    if swap:
        return _swapped(ctx, group, seq, swap, sides, waiting)

    # One side runs a collective the others do not: the side under a rank-conditional branch.
    # One side makes a call the other does not. The deviant is the smaller side; between equal sides,
    # the one under a rank test. If the deviant is under no rank test but the others are (``if rank != 0:
    # dist.broadcast_object_list(...)``), the others' branch left it out: it skipped their call.
    branches = {id(side): ctx.branch(side[0].rank, side[0].call) for side in sides}
    scored = sorted(sides, key=lambda side: (len(side), branches[id(side)] is None, side[0].call.op == CPP_OP,
                                             min(p.rank for p in side)))
    culprit = scored[0]
    others = [p for side in sides if side is not culprit for p in side]
    tie = len(scored) > 1 and len(scored[1]) == len(culprit)
    if branches[id(culprit)] is None and not tie and not ctx.past:
        majority = scored[-1]
        if branches[id(majority)] is not None:
            return _skipped(ctx, culprit, majority, waiting)
    return _conditional(ctx, culprit, others, waiting)


def _skipped(ctx: Context, side: list[Position], majority: list[Position], waiting: list[int]) -> Finding:
    """``side`` did not make the call the majority is in, because the majority's rank test left it out."""
    ranks = sorted(p.rank for p in side)
    call = majority[0].call
    site = ctx.user_site(majority[0].rank, call)
    branch = ctx.branch(majority[0].rank, call)
    mine = side[0].call
    mine_site = ctx.user_site(side[0].rank, mine)
    maj_ranks = sorted(p.rank for p in majority)
    fields, _ = ctx.waiting(maj_ranks)
    summary = sentence(
        f"{fmt_ranks(ranks)} did not call {describe(call)} that {fmt_ranks(maj_ranks)} "
        f"{verb(maj_ranks, 'waits', 'wait')} in at {ctx.fmt(site)}",
        f"that call is under the rank test {ctx.fmt(branch)}",
        f"{fmt_ranks(ranks)} went on to {describe(mine)} at {ctx.fmt(mine_site)}",
    )
    return Finding(
        kind=Kind.RANK_CONDITIONAL, severity=STALL, ranks=ranks, summary=summary,
        op=call.op, group=call.group, seq=call.seq, site=ctx.site(site),
        details={"pattern": "skipped_call", "conditional_line": branch,
                 "culprit_position": {"op": mine.op, "group": mine.group, "seq": mine.seq, "site": ctx.site(mine_site)},
                 "skipped_by": ranks},
        **fields,
    )


def _key(site: dict | None) -> tuple | None:
    return (site.get("file"), site.get("line")) if site else None


def _mismatch(ctx: Context, group: str, seq: int, sides: list[list[Position]], waiting: list[int]) -> Finding:
    ordered = sorted(sides, key=lambda side: (len(side), min(p.rank for p in side)))
    minority = sorted(p.rank for p in ordered[0])
    culprit = ordered[0][0]
    site = ctx.user_site(culprit.rank, culprit.call)
    fields, waiting_txt = ctx.waiting(r for r in waiting if r not in minority)
    prints = "; ".join(f"{fmt_ranks(p.rank for p in side)}: {side[0].call.fingerprint}" for side in ordered)
    return Finding(
        kind=Kind.MISMATCH, severity=STALL, ranks=minority,
        summary=sentence(f"group {group} seq {seq}: the ranks call {ctx.fmt(site)} with different arguments ({prints})",
                         f"{fmt_ranks(minority)} {verb(minority, 'is', 'are')} the minority"),
        op=culprit.call.op, group=group, seq=seq, site=ctx.site(site),
        details={"fingerprints": {side[0].call.fingerprint: sorted(p.rank for p in side) for side in ordered}}, **fields,
    )


def _order_swap(ctx: Context, group: str, sides: list[list[Position]]) -> tuple | None:
    """Two sides each in a call the other side made earlier in this group (same lines, other order)."""
    if len(sides) != 2 or any(side[0].call.op == CPP_OP for side in sides):
        return None
    a, b = sides
    key_a, key_b = _key(ctx.user_site(a[0].rank, a[0].call)), _key(ctx.user_site(b[0].rank, b[0].call))

    def history(rank: int) -> set:
        g = ctx.by_rank[rank].groups.get(group)
        return {_key(ctx.user_site(rank, c)) for c in (g.recent if g else []) if c.t_exit}

    if key_b in history(a[0].rank) and key_a in history(b[0].rank):
        return (a, b)
    return None


def _swapped(ctx: Context, group: str, seq: int, swap: tuple, sides: list[list[Position]], waiting: list[int]) -> Finding:
    minority, majority = swap
    branch = ctx.branch(minority[0].rank, minority[0].call)
    ranks = sorted(p.rank for p in minority)
    others = sorted(p.rank for p in majority)
    site_m = ctx.user_site(minority[0].rank, minority[0].call)
    site_o = ctx.user_site(majority[0].rank, majority[0].call)
    fields, _ = ctx.waiting(others)
    summary = sentence(
        f"{fmt_ranks(ranks)} and {fmt_ranks(others)} issue the same collectives of group {group} in a different order: "
        f"at seq {seq}, {fmt_ranks(ranks)} {verb(ranks, 'is', 'are')} in {op_name(minority[0].call)} at {ctx.fmt(site_m)}, "
        f"while {fmt_ranks(others)} {verb(others, 'is', 'are')} in {op_name(majority[0].call)} at {ctx.fmt(site_o)}; "
        "both lines ran on every rank earlier",
        f"the branch {ctx.fmt(branch)} decides the order on {fmt_ranks(ranks)}" if branch else "",
    )
    return Finding(
        kind=Kind.DESYNC, severity=STALL, ranks=ranks, summary=summary,
        op=minority[0].call.op, group=group, seq=seq, site=ctx.site(site_m),
        details={"pattern": "order_swap", "other_site": ctx.site(site_o), "conditional_line": branch}, **fields,
    )


def _conditional(ctx: Context, side: list[Position], others_pos: list[Position], waiting: list[int],
                 note: str | None = None) -> Finding:
    """A collective only some ranks call (``side``) at a point where the others are in another call."""
    call = side[0].call
    ranks = sorted(p.rank for p in side)
    others = sorted({p.rank for p in others_pos} | {r for r, p in ctx.pos.items() if r not in ranks and p.state != "gone"})
    fields, waiting_txt = ctx.waiting(others)
    branch = ctx.branch(side[0].rank, call)
    site = ctx.user_site(side[0].rank, call)
    details: dict = {"conditional_line": branch, "pattern": "extra_call"}
    members = ctx.members(side[0].rank, call.group)
    if len(members) < len(ctx.by_rank):
        details["subgroup_members"] = members
    details["skipped_by"] = sorted(set(members) - set(ranks))
    if call.site and site and _key(call.site) != _key(site):
        details["library_site"] = ctx.site(call.site)
    decided = branch is not None or len(side) < len(others_pos)
    being = "issued" if ctx.past else f"{verb(ranks, 'is', 'are')} in"
    head = (f"{fmt_ranks(ranks)} {being} {describe(call)} at {ctx.fmt(site)}"
            + (f" (through {ctx.fmt(call.site)})" if "library_site" in details else ""))
    parts = [head]
    if branch is not None:
        parts.append(f"it is reached through the rank-conditional branch {ctx.fmt(branch)}")
    if others_pos:
        other_ranks = sorted(p.rank for p in others_pos)
        parts.append(f"at the same point {fmt_ranks(other_ranks)} "
                     f"{'issued' if ctx.past else verb(other_ranks, 'is', 'are') + ' in'} "
                     f"{describe(others_pos[0].call)} at {ctx.fmt(ctx.user_site(others_pos[0].rank, others_pos[0].call))}")
    else:
        parts.append(f"{fmt_ranks(details['skipped_by'])} of group {call.group} did not call it")
    if waiting_txt and not others_pos:
        parts.append(waiting_txt)
    if not decided:
        parts.append("the two sides are the same size and no rank-conditional branch was found, so which side "
                     "deviates is not known")
    if note:
        parts.append(note)
    return Finding(
        kind=Kind.RANK_CONDITIONAL, severity=STALL, ranks=ranks, summary=sentence(*parts),
        op=call.op, group=call.group, seq=call.seq, site=ctx.site(site), details=details, **fields,
    )


# ---------------------------------------------------------------------------------------------------
# waits across groups and p2p
# ---------------------------------------------------------------------------------------------------
def _wait_cycle(ctx: Context, edges: list[tuple[Position, int]], waiting: list[int]) -> Finding:
    """Blocked ranks wait for ranks that are themselves blocked elsewhere. The deviant is the rank that
    moved past a call its peers issued; a call its peers made under a rank-conditional branch that it
    never made is the peers' extra call instead."""
    def order(edge: tuple[Position, int]) -> tuple:
        p, m = edge
        p2p = p.call.op in P2P
        return (not p2p, len(ctx.members(p.rank, p.call.group)), p.call.t_enter, p.rank, m)

    p, m = sorted(edges, key=order)[0]
    call = p.call
    site = ctx.user_site(p.rank, call)
    pm = ctx.pos.get(m)
    m_call = pm.call if pm is not None else None
    if pm is not None and m_call is not None:
        # The missing rank waits after the loop the waiter is still in: it ran fewer iterations.
        f = _uneven(ctx, [m], [r for r in waiting if r != m], positions_known=True, inside=[p], side=[pm])
        if f:
            return f
    g = ctx.by_rank[m].groups.get(call.group)
    made_before = site is not None and g is not None and any(
        _key(ctx.user_site(m, c)) == _key(site) for c in g.recent)
    branch = ctx.branch(p.rank, call)
    waiters = sorted({q.rank for q, mm in edges if mm == m and q.call.group == call.group})
    members = ctx.members(p.rank, call.group)
    absent = [r for r in members if r not in waiters and r != p.rank]
    issued_by = len(set(waiters) | {p.rank})
    if call.op not in P2P and not made_before and m_call is not None and (
            issued_by < len(absent) or (issued_by == len(absent) and branch is not None)):
        # Fewer members made the call than did not (or as many, and theirs is under a rank test):
        # the waiters made an extra call.
        side = [ctx.pos[r] for r in waiters]
        return _conditional(ctx, side, [], waiting)
    if call.op in P2P:
        # The line of the matching call in the culprit's own history: the call it skipped this time.
        g_m = ctx.by_rank[m].groups.get(call.group)
        expected_ops = ("send", "isend") if call.op in ("recv", "irecv") else ("recv", "irecv")
        mine = [c for c in (g_m.recent if g_m else []) if c.op in expected_ops
                and getattr(c, "peer", p.rank) in (p.rank, -1, None)]
        if mine:
            made_before = True
            site = ctx.user_site(m, mine[-1])
            branch = ctx.branch(m, mine[-1]) or branch
    m_site = ctx.user_site(m, m_call)
    expected = _MATCHING_P2P.get(call.op, call.op)
    parts = [
        f"rank {m} did not issue {'the ' + expected + ' matching the ' + call.op if call.op in P2P else call.op} "
        f"(group {call.group}, seq {call.seq}) that {fmt_ranks(waiters)} {verb(waiters, 'waits', 'wait')} in"
        + (f"; rank {m} makes it at {ctx.fmt(site)}" if call.op in P2P and made_before else f" at {ctx.fmt(site)}"),
    ]
    if made_before:
        parts.append(f"rank {m} made that call at the same line earlier, so it skipped it this time")
    if m_call is not None:
        its_missing = ctx.missing(m, m_call)
        parts.append(f"rank {m} went on to {describe(m_call)} at {ctx.fmt(m_site)}"
                     + (f", where it waits for {fmt_ranks(its_missing)}" if its_missing else ""))
    if not made_before:
        parts.append(f"rank {m} either skipped the call or makes it later in a different order")
    fields, _ = ctx.waiting(r for r in waiting if r != m)
    return Finding(
        kind=Kind.RANK_CONDITIONAL, severity=STALL, ranks=[m], summary=sentence(*parts),
        op=expected if call.op in P2P else call.op, group=call.group, seq=call.seq, site=ctx.site(site),
        details={"pattern": "skipped_call", "skipped_call_site": ctx.site(site), "conditional_line": branch,
                 "culprit_position": {"op": m_call.op, "group": m_call.group, "seq": m_call.seq,
                                      "site": ctx.site(m_site)} if m_call else None,
                 "made_before": made_before, "waiting_in": describe(call),
                 "subgroup_members": ctx.members(p.rank, call.group)},
        **fields,
    )


# ---------------------------------------------------------------------------------------------------
# uneven iterations
# ---------------------------------------------------------------------------------------------------
def _uneven(ctx: Context, short: list[int], waiting: list[int], *, positions_known: bool,
            inside: list[Position] | None = None, side: list[Position] | None = None,
            exited: bool = False) -> Finding | None:
    """``short`` left the loop the others are still in: shown by DataLoader lengths, step counts, or
    positions (``short`` waits after the loop that the others' lines are inside)."""
    loader = next((ld for ld in ctx.loaders if set(ld["short_ranks"]) & set(short)
                   and not set(ld["short_ranks"]) - set(short) - {r for r in ctx.by_rank if ctx.by_rank[r].gone}), None)
    short_steps = [ctx.steps[r] for r in short if r in ctx.steps]
    long_ranks = [r for r in ctx.by_rank if r not in short]
    long_steps = [ctx.steps[r] for r in long_ranks if r in ctx.steps]
    # Fewer optimizer steps alone is evidence only for ranks that ended or wait after the loop (a rank
    # stuck mid-step counts one step less than it will have).
    fewer = bool(short_steps and long_steps and max(short_steps) < min(long_steps)) and \
        (exited or positions_known or max(short_steps) + 1 < min(long_steps))
    if side is not None and ctx.branch(side[0].rank, side[0].call) is not None:
        return None  # the short side's call sits under a rank test: a rank-conditional call, not a loop exit
    loop_fact = _after_loop(ctx, side, inside) if positions_known and side and inside else None
    if exited and loader is None and not fewer:
        loop_fact = _early_exit_loop(ctx, long_ranks)
        if loop_fact is not None and _is_return(loop_fact["exits"][0][1]):
            return None  # it returned from the function, not just the loop: the rank exited (see exited())
    if loader is None and not fewer and loop_fact is None:
        return None
    culprits = sorted(set(loader["short_ranks"]) & set(short)) if loader else sorted(short)
    s0 = ctx.by_rank[culprits[0]]
    call = side[0].call if side else ctx.last_call(culprits[0])
    fields, waiting_txt = ctx.waiting(r for r in waiting if r not in culprits)
    where = ""
    if side:
        where = f"{verb(culprits, 'waits', 'wait')} in {describe(call)} at {ctx.fmt(ctx.user_site(side[0].rank, call))}"
    elif s0.gone:
        where = f"then {ctx.how_it_ended(s0)}"
    else:
        where = f"{verb(culprits, 'is', 'are')} outside any collective, at {ctx.fmt(s0.main_site)}"
    parts = [f"{fmt_ranks(culprits)} left the loop earlier than the others and {where}"]
    if loop_fact:
        inner_site = loop_fact["inside_site"]
        inside_ranks = sorted(p.rank for p in inside) if inside else sorted(r for r in long_ranks if r not in culprits)
        in_call = f"in {describe(inside[0].call)} " if inside else ""
        tense = verb(inside_ranks, "is", "are") if not exited else verb(inside_ranks, "was", "were")
        parts.append(f"{fmt_ranks(inside_ranks)} {tense} still inside the loop at "
                     f"{ctx.fmt(loop_fact['loop_site'])}, {in_call}at {ctx.fmt(inner_site)}")
    elif waiting_txt:
        parts.append(waiting_txt)
    if loader:
        parts.append(f"the DataLoader iterated at {ctx.fmt(loader['site'])} has different lengths per rank: "
                     + ", ".join(f"rank {r}: {n}" for r, n in loader["lengths"].items()))
    elif fewer:
        parts.append("steps so far: " + ", ".join(f"rank {r}: {n}" for r, n in sorted(ctx.steps.items())))
    exits = (loop_fact.get("exits") or loop_fact["loop"].exits) if loop_fact else ()
    branch = loop_fact.get("branch") if loop_fact else None
    if not loader and exits:
        parts.append("the loop can be left early at " + ", ".join(f"line {ln} `{text}`" for ln, text in exits[:3]))
        if branch:
            parts.append(f"the first is under the rank test {ctx.fmt(branch)}")
    if loader:
        root = loader["site"]
    elif exits:
        root = {"file": loop_fact["loop_site"]["file"], "line": exits[0][0], "source": exits[0][1]}
    elif loop_fact:
        root = loop_fact["loop_site"]  # the loop the ranks run a different number of times
    else:
        root = ctx.user_site(side[0].rank, call) if side else (call.site if call else None)
    return Finding(
        kind=Kind.UNEVEN_ITERATIONS, severity=STALL, ranks=culprits, summary=sentence(*parts),
        op=call.op if call else None, group=call.group if call else None, seq=call.seq if call else None,
        site=ctx.site(root),
        details={"steps": {str(r): n for r, n in sorted(ctx.steps.items())}, "loaders": ctx.loaders,
                 "post_loop_site": ctx.site(ctx.user_site(side[0].rank, call)) if side else None,
                 "loop": {"file": loop_fact["loop_site"]["file"], "line": loop_fact["loop"].start,
                          "exits": [list(e) for e in loop_fact["loop"].exits]} if loop_fact else None,
                 "conditional_line": branch},
        **fields,
    )


def _early_exit_loop(ctx: Context, ranks: list[int]) -> dict | None:
    """The loop the other ranks are still in, when it has an early exit (``break``/``return``): the
    ranks that exited normally left through it. Exits under a rank test come first (they are the
    likely cause: per-rank early stopping, ``if rank == 1: return``)."""
    for r in ranks:
        p = ctx.pos.get(r)
        for f in ctx.frames(r, p.call if p is not None else None):
            path = str(f.get("file", ""))
            if is_library_path(path):
                continue
            for loop in ctx.ev.enclosing_loops(path, int(f["line"])):
                if not loop.exits:
                    continue
                exits = sorted(loop.exits, key=lambda e: ctx.ev.rank_branch(path, e[0]) is None)
                branch = ctx.ev.rank_branch(path, exits[0][0])
                return {"loop": loop, "inside_site": f, "exits": exits,
                        "branch": {"file": path, "line": branch[0], "source": branch[1]} if branch else None,
                        "loop_site": {"file": path, "line": loop.start, "function": f.get("function"),
                                      "source": loop.header}}
    return None


def _after_loop(ctx: Context, side: list[Position], inside: list[Position]) -> dict | None:
    """Whether ``side`` waits after a loop that ``inside``'s ranks are still in (same file)."""
    return _past_loop(ctx, ctx.frames(side[0].rank, side[0].call), inside)


def _past_loop(ctx: Context, outer: list[dict], inside: list[Position]) -> dict | None:
    """Whether the frames ``outer`` are past (after) a loop that ``inside``'s ranks are still in."""
    for q in inside:
        for f_in in ctx.frames(q.rank, q.call):
            path = str(f_in.get("file", ""))
            if is_library_path(path):
                continue
            # The outermost loop around the inside frame that the short side's frame (same function)
            # is past: the loop the short side left (an epoch loop, not only the batch loop in it).
            for loop in reversed(ctx.ev.enclosing_loops(path, int(f_in["line"]))):
                for f_out in outer:
                    if f_out.get("file") == path and f_out.get("function") == f_in.get("function") \
                            and int(f_out["line"]) > loop.end:
                        return {"loop": loop, "inside_site": f_in,
                                "loop_site": {"file": path, "line": loop.start, "function": f_in.get("function"),
                                              "source": loop.header}}
    return None


# ---------------------------------------------------------------------------------------------------
# ranks that ended
# ---------------------------------------------------------------------------------------------------
def _gone(ctx: Context, gone: list[int], waiting: list[int]) -> list[Finding]:
    by_rank = ctx.by_rank
    clean = [r for r in gone if by_rank[r].exit_state == "exited"]
    if len(clean) == len(gone):
        f = _uneven(ctx, clean, waiting, positions_known=False, exited=True)
        if f:
            return [f]
        blocked = [ctx.pos[r] for r in waiting if ctx.pos[r].call is not None]
        first = min(blocked, key=lambda p: p.call.t_enter) if blocked else None
        if first is not None and first.call.op not in P2P and ctx.branch(first.rank, first.call):
            side = [p for p in blocked if p.key() == first.key()]
            return [_conditional(ctx, side, [], waiting, f"{fmt_ranks(clean)} exited normally")]
    roots = _roots(ctx, [by_rank[r] for r in gone]) or gone
    return [exited(ctx, r, [x for x in waiting if x not in roots]) for r in sorted(roots)]


def _is_return(text: str) -> bool:
    return text.startswith("return") or "exit(" in text


def exited(ctx: Context, r: int, others: list[int], extra: str = "") -> Finding:
    s = ctx.by_rank[r]
    last = ctx.last_call(r)
    fields, waiting_txt = ctx.waiting(others)
    raised_at = exception_site(s) if s.exit_state == "exception" else None
    site = raised_at or ctx.user_site(r, last)
    parts = [f"rank {r} {ctx.how_it_ended(s)}"]
    details: dict = {}
    if raised_at:
        parts.append(f"at {ctx.fmt(raised_at)}")
    elif s.exit_state == "exited":
        # Returned from inside the loop the others are still in: name that return and its rank test.
        fact = _early_exit_loop(ctx, [x for x in ctx.by_rank if x != r])
        if fact is not None and _is_return(fact["exits"][0][1]):
            line, text = fact["exits"][0]
            site = {"file": fact["loop_site"]["file"], "line": line, "function": fact["loop_site"].get("function"),
                    "source": text}
            parts.append(f"it left the loop at {ctx.fmt(fact['loop_site'])} early, through {ctx.fmt(site)}"
                         + (f" under the rank test {ctx.fmt(fact['branch'])}" if fact["branch"] else ""))
            details["conditional_line"] = fact["branch"]
    parts.append(f"its last collective was {describe(last)} at {ctx.fmt(ctx.user_site(r, last))}" if last
                 else "it had issued no collective")
    parts += [waiting_txt, extra]
    return Finding(
        kind=Kind.RANK_EXITED, severity=STALL, ranks=[r], summary=sentence(*parts),
        op=last.op if last else None, group=last.group if last else None, seq=last.seq if last else None,
        site=ctx.site(site),
        details={"exit_state": s.exit_state, "exit_reason": s.exit_reason, "pid": s.pid, "host": s.host,
                 "ending": ctx.ev.ending(r), "last_call_site": ctx.site(ctx.user_site(r, last)), **details}, **fields,
    )


def _crashed_past_loop(ctx: Context, r: int, others: list[int], extra: str) -> Finding | None:
    """A rank that ended after leaving the loop the others were still in (it crashed in the code after
    the loop, e.g. a checkpoint whose collectives met the others' training step): uneven iterations."""
    stack = (ctx.ev.ending(r) or {}).get("frames") or []
    outer = [f for f in stack if not is_library_path(str(f.get("file", "")))]
    fact = _past_loop(ctx, outer, [ctx.pos[o] for o in others if o in ctx.pos]) if outer else None
    if fact is None:
        return None
    f = exited(ctx, r, others, extra)
    loop_txt = f"{ctx.fmt(fact['loop_site'])}"
    inside = sorted(others)
    f.kind = Kind.UNEVEN_ITERATIONS
    f.summary = sentence(
        f"rank {r} left the loop at {loop_txt} earlier than {fmt_ranks(inside)}: it was at {ctx.fmt(outer[0])}, "
        f"after the loop, while they were still inside it at {ctx.fmt(fact['inside_site'])}",
        f.summary,
    )
    f.site = ctx.site(fact["loop_site"])
    f.details["crash_site"] = ctx.site(outer[0])
    f.details["loop"] = {"file": fact["loop_site"]["file"], "line": fact["loop"].start,
                         "exits": [list(e) for e in fact["loop"].exits]}
    return f


def _end_time(s: RankState) -> float:
    return s.exit_time or s.heartbeat_time


def _secondary(s: RankState) -> bool:
    return s.exit_state == "exception" and any(w in s.exit_reason.lower() for w in PEER_ERRORS)


def _roots(ctx: Context, ended: list[RankState]) -> list[int]:
    """The ranks whose end started it: a raise, else a fatal signal recorded (not SIGTERM), else the
    earliest silent death. Ranks that ended later by SIGTERM or silently are the launcher's teardown."""
    crashed = [s for s in ended if s.exit_state != "exited" and not _secondary(s)]
    if not crashed:
        return []
    raised = [s for s in crashed if s.exit_state == "exception"]
    fatal = [s for s in crashed if (ctx.ev.ending(s.rank) or {}).get("signal") not in (None, "SIGTERM")]
    pool = raised or fatal or [s for s in crashed if (ctx.ev.ending(s.rank) or {}).get("signal") != "SIGTERM"] or crashed
    first = min(_end_time(s) for s in pool)
    return sorted(s.rank for s in pool if _end_time(s) <= first + 1.0)


def exit_findings(states: list[RankState], now: float, evidence: Evidence) -> list[Finding]:
    """Ranks that ended while others still needed them, diagnosed as soon as it happens (no window).

    The root is the earliest rank that ended abnormally, not counting exceptions caused by a peer's
    death (connection reset, communicator aborted, timeouts) nor ranks the launcher tore down. If only
    clean exits remain, a rank that exited normally while a peer then failed on it is the root (it
    returned early, or ran fewer iterations). Every rank ending at once (preemption, Ctrl-C) is not a
    finding. A crash that follows a desync is reported as the desync.
    """
    ended = [s for s in states if s.gone]
    if not ended or len(states) < 2:
        return []
    pos = {s.rank: Position(s.rank, "gone", s.last_call(), None) for s in states}
    ctx = Context(states, pos, min(_end_time(s) for s in ended), now, evidence)
    roots = _roots(ctx, ended)
    if roots:
        desync = _crash_desync(ctx, roots)
        if desync:
            return desync
        if len(roots) == len(states):
            return []  # everything ended at once: preemption, Ctrl-C, a node lost; nothing to single out
        others = [s.rank for s in states if s.rank not in roots]
        torn = sorted(s.rank for s in ended if s.rank not in roots and not _secondary(s) and s.exit_state != "exited")
        extra = f"{fmt_ranks(torn)} then ended too (the launcher's teardown)" if torn else ""
        return [_crashed_past_loop(ctx, r, others, extra) or exited(ctx, r, others, extra) for r in roots]
    clean = sorted(s.rank for s in ended if s.exit_state == "exited")
    failed = [s.rank for s in states if _secondary(s)]
    if clean and failed:
        reasons = {s.rank: s.exit_reason for s in states if _secondary(s)}
        extra = "then " + "; ".join(f"rank {r} failed: {trim(why, 160)}" for r, why in sorted(reasons.items()))
        f = _uneven(ctx, clean, failed, positions_known=False, exited=True)
        if f:
            f.summary = sentence(f.summary, extra)
            return [f]
        return [exited(ctx, r, failed, extra) for r in clean]
    return []


def _crash_desync(ctx: Context, roots: list[int]) -> list[Finding]:
    """A crash that followed a desync: at the root's last (group, seq), ranks had issued different calls
    (a Python collective on one rank meeting DDP's C++-issued all-reduce on the others included)."""
    last = ctx.last_call(roots[0])
    if last is None:
        return []
    calls = {s.rank: ctx.named(s.rank, ctx.call_at(s.rank, last.group, last.seq)) for s in ctx.states}
    if any(c is None for c in calls.values()):
        return []
    sides = _sides(ctx, [Position(r, "blocked", c, ctx.by_rank[r].main_site) for r, c in calls.items()])
    if len(sides) < 2:
        return []
    ctx.pos = {r: Position(r, "blocked", c, ctx.by_rank[r].main_site) for r, c in calls.items()}
    f = _desync(ctx, last.group, last.seq, list(sides.values()), sorted(calls))
    how = "; ".join(f"rank {r} {ctx.how_it_ended(ctx.by_rank[r])}" for r in roots)
    f.summary = f.summary.rstrip(".") + f"; the job then crashed ({how})."
    f.details["ended_by"] = {str(s.rank): ctx.how_it_ended(s) for s in ctx.states}
    return _with_cpp_entries(ctx, [f])
