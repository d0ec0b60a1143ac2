"""A node's ranks in compact form, for the cross-node exchange (pure: no I/O).

Two encodings of one node's :class:`~dtwatch.diagnose.rank_state.RankState` list cross the store:

* the **state** (:func:`encode_states` / :func:`decode_states`): what the diagnosis reads of a remote rank,
  trimmed to what it needs: per group the sequence numbers (issued, completed, Python/C++), the last
  :data:`RECENT_KEPT` calls, the in-flight calls, steps, loaders, heartbeat, exit state, the sampled
  main-thread site, the setup facts (as the ring holds them, for the setup checks). Call sites are
  written once per node in a table and referred to by index, times as microseconds from the summary's
  own clock, group members as ranges. It is read only for the ranks a job-level view needs.
* the **digest** (:func:`digest` / :func:`decode_digests`): a few numbers per rank that the aggregator
  scans for every rank of the job on every round (where each rank is, its progress time, loader
  lengths, the call it entered last); see :mod:`dtwatch.watchdog.aggregate`.

Both are JSON in zlib, with a format version: a node running another dtwatch version is skipped, not
misread.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

from dtwatch.diagnose.positions import positions
from dtwatch.diagnose.rank_state import Call, GroupProgress, RankState

FORMAT = 2  # 2: each rank's setup facts
RECENT_KEPT = 16  # recent calls per group (enough to align program order and to see lag)
SEQ_TIMES_KEPT = 16  # (seq, time) changes of each group's counter
STEP_HISTORY_KEPT = 16
MAIN_STACK_KEPT = 8


class SummaryFormatError(ValueError):
    """Bytes that are not a summary this version reads."""


# -- small codecs -----------------------------------------------------------------------------------
class _Sites:
    """A per-summary table of call sites: each distinct site dict is written once."""

    def __init__(self) -> None:
        self.table: list[dict] = []
        self.index: dict[object, int] = {}

    def ref(self, site: dict | None) -> int:
        if site is None:
            return -1
        try:
            key: object = tuple(sorted(site.items()))
            i = self.index.get(key)
        except TypeError:  # an unhashable value
            key = json.dumps(site, sort_keys=True)
            i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.table)
            self.table.append(site)
        return i


def _deref(table: list[dict], i: int) -> dict | None:
    return dict(table[i]) if 0 <= i < len(table) else None


def _t(t: float, base: float) -> int | None:
    """A time as whole microseconds from ``base``; 0.0 (never) stays distinct. Integer arithmetic, so that a
    time decoded and encoded again, against any base, gives the same microsecond."""
    return None if t == 0.0 else round(t * 1e6) - round(base * 1e6)


def _ut(v: int | None, base: float) -> float:
    return 0.0 if v is None else (round(base * 1e6) + v) / 1e6


def encode_members(members: list[int] | None) -> list[list[int]] | None:
    """Sorted member lists as runs ``[start, stop, step]`` (a 1,024-node job's world group is one run)."""
    if members is None:
        return None
    if members and members == list(range(members[0], members[0] + len(members))):
        return [[members[0], members[0] + len(members), 1]]  # the common case, at C speed
    runs: list[list[int]] = []
    for m in members:
        if runs:
            start, stop, step = runs[-1]
            if stop - start == 1 and m > start:
                runs[-1] = [start, m + 1, m - start]
                continue
            if m == stop - 1 + step and m > stop - 1:
                runs[-1][1] = m + 1
                continue
        runs.append([m, m + 1, 1])
    return runs


def decode_members(runs: list[list[int]] | None) -> list[int] | None:
    if runs is None:
        return None
    return [m for start, stop, step in runs for m in range(start, stop, step)]


def _call(c: Call, sites: _Sites, base: float) -> list:
    return [c.op, c.group, c.seq, sites.ref(c.site), _t(c.t_enter, base), _t(c.t_exit, base), c.fingerprint,
            int(c.is_async) | (2 * int(c.enqueued)), c.span,
            -2 if c.user_site is c.site or c.user_site == c.site else sites.ref(c.user_site), c.peer, c.step]


def _uncall(v: list, table: list[dict], base: float) -> Call:
    op, group, seq, site_i, te, tx, fp, flags, span, user_i, peer, step = v
    site = _deref(table, site_i)
    user = site if user_i == -2 else _deref(table, user_i)
    return Call(op=op, group=group, seq=seq, site=site, t_enter=_ut(te, base), t_exit=_ut(tx, base), fingerprint=fp,
                is_async=bool(flags & 1), span=span, user_site=user, peer=peer, enqueued=bool(flags & 2), step=step)


# -- states -----------------------------------------------------------------------------------------
def encode_states(node: str, states: list[RankState], now: float, *, heartbeats: bool = True) -> bytes:
    """One node's ranks, trimmed to what another node's diagnosis reads. Times are written relative to ``now``;
    ``heartbeats=False`` leaves the heartbeat times out (0.0 when decoded), so that ranks whose only change is
    their heartbeat encode to the same bytes (the view's body; the heartbeats travel in its head)."""
    sites = _Sites()
    ranks = []
    for s in states:
        groups = []
        for g in s.groups.values():
            recent = g.recent[-RECENT_KEPT:]
            seq_times = [x for seq, t in g.seq_times[-SEQ_TIMES_KEPT:] for x in (seq, _t(t, now))]
            groups.append([
                g.name, encode_members(g.members), g.seq, g.completed, g.py_seq, g.cpp_seq, _t(g.cpp_seq_time, now),
                int(g.tracked), int(g.complete and len(g.recent) <= RECENT_KEPT), seq_times,
                [_call(c, sites, now) for c in recent],
            ])
        ranks.append([
            s.rank, s.local_rank, s.world_size, s.host, s.pid, s.job_id, _t(s.start_time, now), s.restart_count,
            s.backend, s.alive, s.proc_state, s.exit_state, s.exit_reason, _t(s.exit_time, now),
            _t(s.heartbeat_time, now) if heartbeats else None, s.step, _t(s.step_time, now), sites.ref(s.main_site),
            sites.ref(s.main_top_site),
            _t(s.main_site_since, now), [sites.ref(f) for f in s.main_stack[:MAIN_STACK_KEPT]],
            [[ld.get("index"), sites.ref(ld.get("site")), ld.get("length"), ld.get("epochs"),
              _t(ld.get("time") or 0.0, now), ld.get("step"), sites.ref(ld.get("user_site"))]
             + ([ld["ident"], sites.ref(ld.get("made_site")), ld.get("ended"), ld.get("colls"), ld.get("issued_now")]
                if ld.get("ident") else []) for ld in s.loaders],
            _t(s.last_activity, now), s.stack_signal, s.device_index, s.gpu_uuid,
            [_t(t, now) for t in s.step_times[-STEP_HISTORY_KEPT:]], s.step_seqs[-STEP_HISTORY_KEPT:],
            groups, [_call(c, sites, now) for c in s.open_calls], s.setup or None, s.exit_code,
        ])
    doc = {"format": FORMAT, "node": node, "time": now, "sites": sites.table, "ranks": ranks}
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 6)


def _unloader(table: list, base: float, v: list) -> dict:
    """One loader of an encoded rank: the ring's fields, and where loaders are told apart (``ident``) where
    it was made and what its loop issued (see :func:`dtwatch.diagnose.rank_state._loaders`)."""
    idx, si, length, epochs, t, lstep, user, *told = v
    ld = {"index": idx, "site": _deref(table, si), "length": length, "epochs": epochs, "time": _ut(t, base),
          "step": lstep, "user_site": _deref(table, user)}
    if told:
        ident, made, ended, colls, issued_now = told
        ld.update(ident=ident, made_site=_deref(table, made), ended=ended, colls=colls)
        if issued_now is not None:
            ld["issued_now"] = issued_now
    return ld


@dataclass
class NodeStates:
    node: str
    time: float  # the publishing node's clock when it encoded them
    states: list[RankState]


def _load(data: bytes) -> dict:
    try:
        doc = json.loads(zlib.decompress(data))
    except (zlib.error, ValueError) as exc:
        raise SummaryFormatError(f"not a dtwatch summary: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SummaryFormatError(f"summary format {doc.get('format') if isinstance(doc, dict) else '?'}, "
                                 f"this dtwatch reads {FORMAT}")
    return doc


def decode_states(data: bytes, ranks: set[int] | None = None) -> NodeStates:
    """The ranks of one node's state (only ``ranks`` when given)."""
    doc = _load(data)
    base, table = float(doc["time"]), doc["sites"]
    members_cache: dict[str, list[int] | None] = {}  # one list per distinct member set (read-only for the diagnosis)
    out = []
    for v in doc["ranks"]:
        if ranks is not None and v[0] not in ranks:
            continue
        (rank, local_rank, world_size, host, pid, job_id, start, restarts, backend, alive, proc_state, exit_state,
         exit_reason, exit_time, heartbeat, step, step_time, main_i, top_i, since, stack, loaders, last_activity,
         stack_signal, device_index, gpu_uuid, step_times, step_seqs, groups, open_calls, setup, *more) = v
        gp: dict[str, GroupProgress] = {}
        for name, members, seq, completed, py_seq, cpp_seq, cpp_t, tracked, complete, seq_times, recent in groups:
            key = json.dumps(members)
            if key not in members_cache:
                members_cache[key] = decode_members(members)
            gp[name] = GroupProgress(
                name=name, members=members_cache[key], seq=seq, completed=completed, py_seq=py_seq, cpp_seq=cpp_seq,
                cpp_seq_time=_ut(cpp_t, base), recent=[_uncall(c, table, base) for c in recent], tracked=bool(tracked),
                seq_times=[(seq_times[i], _ut(seq_times[i + 1], base)) for i in range(0, len(seq_times), 2)],
                complete=bool(complete),
            )
        out.append(RankState(
            rank=rank, local_rank=local_rank, world_size=world_size, host=host, pid=pid, job_id=job_id,
            start_time=_ut(start, base), restart_count=restarts, backend=backend, alive=alive, proc_state=proc_state,
            exit_state=exit_state, exit_reason=exit_reason, exit_time=_ut(exit_time, base),
            heartbeat_time=_ut(heartbeat, base), step=step, step_time=_ut(step_time, base),
            groups=gp, open_calls=[_uncall(c, table, base) for c in open_calls], main_site=_deref(table, main_i),
            main_top_site=_deref(table, top_i), main_site_since=_ut(since, base),
            main_stack=[s for s in (_deref(table, i) for i in stack) if s is not None],
            loaders=[_unloader(table, base, v) for v in loaders],
            last_activity=_ut(last_activity, base), stack_signal=stack_signal, device_index=device_index,
            gpu_uuid=gpu_uuid, ring_path="", step_times=[_ut(t, base) for t in step_times], step_seqs=list(step_seqs),
            setup=setup or {}, exit_code=int(more[0]) if more else 0,
        ))
    return NodeStates(str(doc["node"]), base, out)


# -- digests ----------------------------------------------------------------------------------------
BLOCKED, OUTSIDE, GONE = "blocked", "outside", "gone"


@dataclass(frozen=True)
class RankDigest:
    """Where one rank is, in a few numbers: what the aggregator scans for every rank of the job."""

    rank: int
    state: str  # BLOCKED | OUTSIDE | GONE
    wait: tuple | None  # (group, group size, seq, op, fingerprint, "file:line") of the call it waits in
    last_activity: float
    heartbeat: float
    step: int
    loaders: tuple[int, ...]  # lengths of its data loaders
    # per group: (group, group size, seq issued so far, seq of its last Python-issued call, when it entered that call)
    groups: tuple[tuple[str, int, int, int, float], ...]
    ending: tuple[str, str, float] | None = None  # a rank that ended: (exit state, reason, when)

    def position(self) -> tuple:
        """What ranks in the same place share (the class the aggregator counts). Groups are told apart by
        size, not name: every node's tensor-parallel group has a name of its own, and ranks waiting in the
        same line of theirs are in the same place."""
        wait = self.wait[1:] if self.wait is not None else None
        return (self.state, wait, self.loaders, tuple(sorted((size, seq) for _g, size, seq, _py, _t in self.groups)),
                self.ending[:2] if self.ending else None)


def _site_key(site: dict | None) -> str:
    return f"{site.get('file')}:{site.get('line')}" if site else ""


def digest(node: str, states: list[RankState], now: float, *, state_time: float | None = None) -> bytes:
    """The digest of one node's ranks; ``state_time``: when the node last published its state (None: never).
    Positions are judged with this node's ranks only (a C++-issued collective whose peers are elsewhere
    counts as issued): the aggregator compares sequence numbers across nodes."""
    pos = positions(states, now, float("inf"))  # unresponsive or not: judged from the heartbeat, by the reader
    rows = []
    for s in states:
        p = pos[s.rank]
        state = GONE if p.state == "gone" else BLOCKED if p.call is not None and p.state != "gone" else OUTSIDE
        c = p.call if state == BLOCKED else None
        size = {g.name: len(g.members) if g.members else 0 for g in s.groups.values()}
        wait = [c.group, size.get(c.group, 0), c.seq, c.op, c.fingerprint, _site_key(c.user_site or c.site)] \
            if c is not None else None
        groups = [[g.name, size[g.name], g.seq, g.recent[-1].seq, _t(g.recent[-1].t_enter, now)] if g.recent else
                  [g.name, size[g.name], g.seq, 0, None] for g in s.groups.values()]
        ending = [s.exit_state, s.exit_reason[:80], _t(s.exit_time or s.last_activity, now)] if state == GONE else None
        rows.append([s.rank, state, wait, _t(s.last_activity, now), _t(s.heartbeat_time, now), s.step,
                     [ld.get("length") or 0 for ld in s.loaders], groups, ending])
    doc = {"format": FORMAT, "node": node, "time": now, "state": state_time, "ranks": rows}
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 6)


@dataclass
class NodeDigest:
    node: str
    time: float
    state_time: float | None  # when the node last published its state (None: never)
    ranks: list[RankDigest]


def decode_digests(data: bytes) -> NodeDigest:
    doc = _load(data)
    base = float(doc["time"])
    out = [
        RankDigest(rank=r, state=state, wait=tuple(wait) if wait is not None else None,
                   last_activity=_ut(la, base), heartbeat=_ut(hb, base), step=step, loaders=tuple(loaders),
                   groups=tuple((g, size, seq, py, _ut(te, base)) for g, size, seq, py, te in groups),
                   ending=(ending[0], ending[1], _ut(ending[2], base)) if ending else None)
        for r, state, wait, la, hb, step, loaders, groups, ending in doc["ranks"]
    ]
    return NodeDigest(str(doc["node"]), base, doc.get("state"), out)
