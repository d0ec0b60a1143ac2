"""What every decision of one diagnosis shares: the ranks' states and positions, the evidence, and
the questions asked of them (the user's line of a call, the rank test it runs under, what a rank
issued at a sequence number, who a blocked rank waits for, how a rank ended)."""
from __future__ import annotations

import os
import re
from collections.abc import Iterable

from dtwatch.code_paths import is_user_file
from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.exits import Told, tell
from dtwatch.diagnose.flight import SEQ, SeqMapping, calibrate, entry_for
from dtwatch.diagnose.loaders import loader_evidence
from dtwatch.diagnose.model import PEER_ERRORS, Finding, Position
from dtwatch.diagnose.positions import cpp_blocked_call
from dtwatch.diagnose.rank_state import CPP_OP, Call, RankState
from dtwatch.diagnose.wording.ending_words import (
    STILL_RUNNING,
    ring_ending,
    signal_after_exit,
    signal_ending,
    signal_while_running,
)
from dtwatch.diagnose.wording.phrases import CPP_PREFIX, fmt_site, verb, with_source
from dtwatch.diagnose.wording.waiting_words import not_seen_waiting_phrase, others_phrase, waiting_phrase

P2P = ("send", "recv", "isend", "irecv")
MATCHING_P2P = {"send": "recv", "isend": "recv", "recv": "send", "irecv": "send"}


def is_library_path(path: str) -> bool:
    """Third-party or standard-library code, torch or dtwatch (not the user's): the user's line is
    outside these. Recorded paths may be sanitised (``<site-packages>/...``, relative)."""
    if not path or path.startswith("<"):
        return True
    if os.path.isabs(path) and not is_user_file(path):
        return True
    parts = path.replace("\\", "/").split("/")
    if not os.path.isabs(path) and parts[0] == "dtwatch":
        return True  # dtwatch's own frames, as a captured incident names them (relative to the project)
    return (
        "site-packages" in parts or "dist-packages" in parts or "<site-packages>" in parts or "<stdlib>" in parts
        or any(p.startswith("python3") and i > 0 and parts[i - 1] == "lib" for i, p in enumerate(parts))
    )


class Context:
    """What every finding of one diagnosis shares: states, positions, evidence, loader and step facts."""

    def __init__(self, states: list[RankState], pos: dict[int, Position], onset: float, now: float,
                 evidence: Evidence) -> None:
        self.states, self.pos, self.onset, self.now, self.ev = states, pos, onset, now, evidence
        self.by_rank = {s.rank: s for s in states}
        self.loaders = loader_evidence(states, evidence)
        self.steps = {s.rank: s.step for s in states}
        self.world = max((s.world_size for s in states), default=0)  # the job's world size, as the ranks report it
        self._fr_mappings: dict = {}
        self._endings: dict[int, dict | None] = {}
        self.past = False  # describing calls the ranks made earlier (completed), not where they are now
        self.issued_from_cpp: dict[int, dict] = {}  # rank -> the FR entry that named its C++-issued call
        self.pos = {r: (Position(p.rank, p.state, self.named(r, p.call), p.site) if p.call is not None else p)
                    for r, p in pos.items()}

    # -- collectives issued from C++ ---------------------------------------------------------------
    def fr_entry(self, rank: int, group: str, seq: int) -> dict | None:
        """The rank's Flight Recorder entry for ``group``'s call number ``seq``, with the numbering
        calibrated on the rank's own Python-issued calls (dtwatch.diagnose.flight)."""
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
    def presence(self, ranks: list[int]) -> str:
        """How ``ranks`` relate to the call they are blocked on: ``is in`` / ``are in`` when they wait in it;
        ``issued`` for calls made earlier, or ones that returned before completing (async work, NCCL),
        where the rank waits elsewhere (see :mod:`.sync_points`)."""
        if self.past:
            return "made"
        calls = [self.pos[r].call for r in ranks if r in self.pos]
        if calls and all(c is not None and c.is_async and c.in_flight for c in calls):
            return "issued"
        if self.ended(ranks):
            return verb(ranks, "was", "were") + " in"  # until its process ended
        return verb(ranks, "is", "are") + " in"

    def ended(self, ranks: Iterable[int]) -> bool:
        """Every one of ``ranks`` has ended (what they were in is told in the past tense)."""
        ranks = list(ranks)
        return bool(ranks) and all(r in self.by_rank and self.by_rank[r].gone for r in ranks)

    def waits(self, ranks: list[int]) -> str:
        """``waits``/``wait``, or ``waited`` for ranks that have all ended since."""
        return "waited" if self.ended(ranks) else verb(ranks, "waits", "wait")

    def site(self, site: dict | None) -> dict | None:
        return with_source(site, self.ev)

    def fmt(self, site: dict | None) -> str:
        return fmt_site(self.site(site), self.ev)

    def user_site(self, rank: int, call: Call | None) -> dict | None:
        """The user's line for a call: where user code called into torch or a library."""
        if call is None:
            return None
        if call.op == CPP_OP:
            return self.cpp_site(rank, call)
        user = call.user_site
        return user or call.site

    def cpp_site(self, rank: int, call: Call) -> dict | None:
        """The user's line a collective issued from C++ (DDP, FSDP) was issued under: the main thread's
        sampled line, when the sampler saw it there from before the call was issued (``main_site_since``)
        until after (the latest sample, ``heartbeat_time``); else py-spy's stack of a live rank blocked in
        it. None when no sample spans the call: a line sampled earlier is from the past (the rank's
        constructor, a print before the loop), not the call's."""
        s = self.by_rank[rank]
        spans = s.main_site_since <= call.t_enter <= s.heartbeat_time + 1e-6
        # A running rank still waiting in the call: where its main thread was sampled since the call was
        # issued is where it waits for it (DDP's backward).
        waits = not s.gone and call.in_flight and call.t_enter <= s.heartbeat_time + 1e-6
        if s.main_site and (spans or waits):
            stack = list(s.main_stack) or [s.main_site]
            return stack[0]
        if s.gone and s.exit_state in ("exception", "exited"):
            # It failed inside its last collective on a peer's death ("Connection closed by peer"): the line
            # of the user's code its error was raised under is that call's.
            told, last = self.told(s), self.last_call(rank)
            if told.frames and last is not None and (last.group, last.seq) == (call.group, call.seq) \
                    and any(w in told.error.lower() for w in PEER_ERRORS):
                return dict(told.frames[0])
        if not s.gone and self.pos.get(rank) is not None and self.pos[rank].call is call:
            frames = [f for f in (self.ev.stack(rank) or []) if not is_library_path(str(f.get("file", "")))]
            if frames:
                return frames[0]
        return None

    def frames(self, rank: int, call: Call | None) -> list[dict]:
        """The user-code lines a rank is at, innermost first: the call's user line and library line,
        then the sampled main-thread stack (py-spy's, when taken, for a rank that is not sampling)."""
        s = self.by_rank[rank]
        out: list[dict] = []
        if s.gone:  # where it was as it ended: the line that raised or exited, faulthandler's stack of a signal
            out += list(self.told(s).frames)
            frames = (self.ending(rank) or {}).get("frames") or []
            out += [f for f in frames if not is_library_path(str(f.get("file", "")))]
        if call is not None and call.op != CPP_OP:
            for site in (call.user_site, call.site):
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
        """The rank-conditional ``if`` that the call (or the code path to it) runs under. Where the test was
        found on a helper's line (a function only ever called under it), an outer frame at the test itself
        names the call that entered the helper."""
        found_at: dict | None = None
        for f in self.frames(rank, call):
            if is_library_path(str(f.get("file", ""))):
                continue
            found = self.ev.rank_branch(str(f["file"]), int(f["line"]))
            if not found:
                continue
            line, text = found
            here = {"file": f["file"], "line": line, "function": f.get("function"), "source": text,
                    "call_line": f["line"]}
            if found_at is None or (here["file"] == found_at["file"] and line == found_at["line"]):
                found_at = here  # the outermost frame under the same test: the line that entered the helper
            else:
                break
        return found_at

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
            peer = call.peer
            peers = ([peer] if peer is not None and peer >= 0
                     else [m for m in self.members(rank, call.group) if m != rank])
            # A recv is matched by the peer's send to this rank (and a send by a recv): a recv facing a recv
            # waits for a call the peer has not posted.
            want = ("recv", "irecv") if call.op in ("send", "isend") else ("send", "isend")
            out = []
            for m in peers:
                counted = self._p2p_counts(rank, m, call, want)
                if counted is not None:
                    if counted[1] < counted[0]:
                        out.append(m)
                    continue
                pm = self.pos.get(m)
                mc = pm.call if pm is not None else None
                posted = [mc] if mc is not None else []
                posted += self.by_rank[m].open_calls if m in self.by_rank else []
                if not any(c.op in want and c.peer in (rank, -1) for c in posted):
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

    def _p2p_counts(self, rank: int, m: int, call: Call, want: tuple[str, ...]) -> tuple[int, int] | None:
        """Where both ranks' records of the group go back to its start: how many messages in ``call``'s
        direction ``rank`` has posted up to and including ``call``, and how many matching ones ``m`` posted.
        A send left in flight (isend, waited on later) may have been matched already, so counts decide."""
        mine, theirs = self.by_rank[rank].groups.get(call.group), (self.by_rank[m].groups.get(call.group)
                                                                    if m in self.by_rank else None)
        if mine is None or theirs is None or not (mine.complete and theirs.complete):
            return None
        same = ("recv", "irecv") if call.op in ("recv", "irecv") else ("send", "isend")
        posted = sum(1 for c in mine.recent if c.op in same and c.peer == m and c.t_enter <= call.t_enter)
        matched = sum(1 for c in theirs.recent if c.op in want and c.peer == rank)
        return posted, matched

    def others(self, ranks: list[int]) -> str:
        """``ranks`` as a finding lists the ranks besides its culprits. In a sample of a large job, which of the
        ranks not shipped to this node are in the same place is not known here, only how many are inside a
        collective: the list says so."""
        sample = self.ev.view_sample()
        if sample is None:
            return others_phrase(ranks)
        return others_phrase(ranks, sample.blocked, sample.ranks)

    def waiting(self, ranks: Iterable[int]) -> tuple[dict, str]:
        """Finding fields and a phrase for the ranks that wait on the culprits. A rank that ended waits for
        nothing: the ranks still running are named; when none is, the ones that ended, in the past tense."""
        ranks = sorted(set(ranks))
        running = [r for r in ranks if r not in self.by_rank or not self.by_rank[r].gone]
        ended = bool(ranks) and not running
        ranks = running or ranks
        calls = [p for p in (self.pending(r) for r in ranks) if p is not None]
        first = min(calls, key=lambda p: p.issued.t_enter) if calls else None
        site = self.user_site(first.rank, first.call) if first else None
        fields = dict(
            waiting_ranks=ranks, waiting_op=first.issued.op if first else None,
            waiting_group=first.issued.group if first else None, waiting_seq=first.issued.seq if first else None,
            waiting_site=self.site(site) if first else None, onset=self.onset, detected=self.now,
        )
        if not ranks:
            return fields, ""
        names = self.others(ranks)
        if first is None:
            from_dumps = all(r in self.by_rank and self.by_rank[r].from_dump for r in ranks)
            return fields, not_seen_waiting_phrase(names, ranks, ended, from_dumps)
        where = {(self.pos[r].issued.group, self.pos[r].issued.seq, self.pos[r].issued.op) for r in ranks
                 if self.pos.get(r) is not None and self.pos[r].call is not None}
        returned = first.issued.is_async and first.issued.in_flight  # NCCL's model: the rank waits elsewhere
        waits_at = self.by_rank[first.rank].main_site if returned else None
        if waits_at is not None and (waits_at.get("file"), waits_at.get("line")) == first.issued.user_site_key:
            waits_at = None  # it waits at the line that issued it
        return fields, waiting_phrase(names, ranks, ended, first.call, site, returned, waits_at, len(where) > 1,
                                      self.fmt)

    def pending(self, rank: int) -> Position | None:
        """The call ``rank`` waits in: its position's call, unless that is one it completed before it came to
        wait (a rank still running when a peer ended is placed at its latest call); then, or with no call, one
        issued from C++ (DDP) that a member has not issued yet."""
        p = self.pos.get(rank)
        s = self.by_rank.get(rank)
        if p is not None and p.call is not None and (p.state != "gone" or s is None or p.call.in_flight):
            return p
        if s is None:
            return None
        # A C++-issued call some member never issued cannot have completed: the rank waited in it (and a rank
        # that ended since waited in it until it failed on the lost peer).
        cpp = cpp_blocked_call(s, self.by_rank)
        if cpp is not None:
            return Position(rank, "blocked", cpp, s.main_site)
        # A rank that ended since: its latest call is the one it failed in (a peer error raised inside it).
        return p if s.gone and p is not None and p.call is not None else None

    def ending(self, rank: int) -> dict | None:
        """What the rank's process wrote as it ended (:meth:`Evidence.ending`), read once."""
        if rank not in self._endings:
            self._endings[rank] = self.ev.ending(rank)
        return self._endings[rank]

    def told(self, s: RankState) -> Told:
        """How ``s`` ended, with the user's line that raised or called the exit (:mod:`.exits`)."""
        return tell(s, self.ending(s.rank), is_library_path)

    def how_it_ended(self, s: RankState) -> str:
        return ending_text(s, self.ending(s.rank))


def ending_text(s: RankState, ending: dict | None) -> str:
    """How rank ``s`` ended, from its ring and what its process wrote as it ended (``ending``:
    :meth:`~dtwatch.diagnose.evidence.Evidence.ending`): the exception or exit it recorded, and a fatal signal
    after a normal exit (faulthandler still runs once the exit handlers have: a crash in the interpreter's
    teardown, or the launcher's SIGTERM then); else a signal in place of an exit, or nothing recorded."""
    if s.exit_state in ("exception", "exited"):
        told = tell(s, ending, is_library_path).text
        sig = (ending or {}).get("signal") if s.exit_state == "exited" and not s.exit_code else None
        if sig and not (ending or {}).get("frames"):
            return signal_after_exit(told, str(sig))  # no Python frame ran: after the exit handlers
        if sig == "SIGTERM":
            return signal_while_running(told, str(sig))  # its own handler let it exit
        return told  # (a fatal signal while Python ran kills the process before any exit is recorded)
    ending = ending if s.exit_state == "running" else None
    sig = (ending or {}).get("signal")
    if sig:
        return signal_ending(str(sig))
    if s.gone and (ending or {}).get("exit"):
        return tell(s, ending, is_library_path).text  # os._exit: the file was written, the ring not
    return ring_ending(s.exit_state, s.exit_code, s.exit_reason, s.alive) if s.gone else STILL_RUNNING


_FR_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def fr_frames(entry: dict) -> list[dict]:
    """A Flight Recorder entry's frames ("name (file:line)", innermost first) as sites."""
    out = []
    for text in entry.get("frames") or []:
        m = _FR_FRAME.match(str(text))
        if m:
            out.append({"file": m.group("file"), "line": int(m.group("line")), "function": m.group("function")})
    return out


def with_cpp_entries(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """Findings that involve C++-issued calls carry the Flight Recorder entries that named them."""
    for f in findings:
        for r in sorted(set(f.ranks) | set(f.waiting_ranks)):
            if r in ctx.issued_from_cpp:
                f.details.setdefault("issued_from_cpp", {})[str(r)] = ctx.issued_from_cpp[r]
    return findings
