"""Per-rank state as the watchdog and the analyzer see it: a small, JSON-serialisable summary of a ring.

A :class:`RankState` is what crosses node boundaries (through the job's c10d store), what an incident
bundle keeps per rank, and what :mod:`dtwatch.diagnose` reasons about. It is derived from a
:class:`~dtwatch.ring.RankSnapshot` plus what the node knows about the process (alive, stopped).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from dtwatch.diagnose.wording.ending_words import ring_ending
from dtwatch.ring import DTYPES, FLAG_ASYNC, FLAG_ENQUEUED, FLAG_MARKER, OPS, RankSnapshot, Site
from dtwatch.ring.layout import NO_SEQ

RECENT_PER_GROUP = 64  # recent calls kept per group, for cross-rank comparison and straggler lag
STEP_HISTORY = 64  # recent step markers kept (timeline, step rate)
CPP_OP = "cpp_collective"  # a collective issued from C++ (DDP reducer, FSDP): seen only as a seq


@dataclass
class Call:
    """One collective call of a rank, as compared across ranks."""

    op: str
    group: str
    seq: int
    site: dict | None
    t_enter: float
    t_exit: float = 0.0
    fingerprint: str = ""
    is_async: bool = False
    span: int = 1
    # The user's own line that led to the call (outside torch, the standard library and third-party
    # libraries); the same as ``site`` for a direct call, the line that called into the library (e.g.
    # ``fabric.save(...)``) when a library issued it. None: unknown (states written before it existed).
    user_site: dict | None = None
    peer: int = -1  # p2p calls: the other rank (dst/src as passed); -1 for collectives
    # A synchronous call that returned before its work completed (NCCL's model): in flight until the
    # group's completions pass it. ``is_async`` is true for it too: the rank runs on and waits later.
    enqueued: bool = False
    step: int = -1  # the rank's step counter when it issued the call (-1: unknown)

    @property
    def in_flight(self) -> bool:
        return self.t_exit == 0.0

    @property
    def site_key(self) -> tuple[str, int] | None:
        return (self.site["file"], self.site["line"]) if self.site else None

    @property
    def user_site_key(self) -> tuple[str, int] | None:
        """(file, line) of the user's line, falling back to ``site`` where it is unknown."""
        s = self.user_site or self.site
        return (s["file"], s["line"]) if s else None


@dataclass
class GroupProgress:
    name: str
    members: list[int] | None
    seq: int  # last sequence number issued (Python or C++)
    completed: int  # last sequence number known completed (Python-issued calls; tracked groups: all)
    py_seq: int  # last sequence number issued from Python
    cpp_seq: int  # torch's counter as last sampled
    cpp_seq_time: float  # when that sample last changed
    recent: list[Call] = field(default_factory=list)
    # Collectives return before they complete (NCCL, gloo_async) and the rank reports what completed:
    # ``completed`` then counts C++-issued collectives too.
    tracked: bool = False
    # When the rank's sampler saw the group's counter reach each value: (seq, time), oldest first (the
    # ring's sequence clock, the last SEQ_TIMES_KEPT changes). Times collectives issued from C++.
    seq_times: list[tuple[int, float]] = field(default_factory=list)
    # ``recent`` holds every Python-issued call of the group since the process started (the ring has not
    # wrapped and kept them all): a number it does not cover was issued from C++.
    complete: bool = False


@dataclass
class RankState:
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    job_id: str
    start_time: float
    restart_count: int
    backend: str
    alive: bool | None  # None: unknown (another node's process, not reported)
    proc_state: str  # /proc state letter ("R", "S", "D", "T", "Z") or ""
    exit_state: str  # running / exited / exception / signal / detached
    exit_reason: str
    exit_time: float
    heartbeat_time: float
    step: int
    step_time: float
    groups: dict[str, GroupProgress]
    open_calls: list[Call]  # entered and not left, oldest first
    main_site: dict | None  # innermost frame of user or library code of the main thread (sampled)
    main_top_site: dict | None  # innermost frame of the main thread (sampled)
    main_site_since: float
    main_stack: list[dict]  # the main thread's user frames (not library), innermost first (sampled)
    loaders: list[dict]
    last_activity: float  # latest enter/exit/step/seq change seen
    stack_signal: int = 0
    device_index: int = -1
    gpu_uuid: str = ""
    ring_path: str = ""
    step_times: list[float] = field(default_factory=list)  # recent step marker times
    step_seqs: list[int] = field(default_factory=list)  # the default group's seq at those steps
    setup: dict = field(default_factory=dict)  # the rank's setup facts (dtwatch.record.setup_probe)
    exit_code: int = 0  # the status an exit call gave (sys.exit(n), os._exit(n)); 0 otherwise
    # Where the state comes from: "" a dtwatch ring; "flight_recorder" torch's own Flight Recorder dump of a job
    # that ran without dtwatch (dtwatch.diagnose.fr_states): no pid, host, liveness, stack, steps or loaders.
    origin: str = ""

    # -- derived ---------------------------------------------------------------------------------
    @property
    def gone(self) -> bool:
        """The process is known to have ended."""
        return self.alive is False or self.exit_state in ("exited", "exception", "signal")

    @property
    def from_dump(self) -> bool:
        """Made from a Flight Recorder dump alone: where the rank is outside collectives, and whether its process
        still runs, are not known."""
        return self.origin == "flight_recorder"

    @property
    def clean_exit(self) -> bool:
        """Ended with status 0 and no exception: returned, or ``sys.exit(0)``."""
        return self.exit_state == "exited" and not self.exit_code

    def heartbeat_age(self, now: float) -> float:
        return max(0.0, now - self.heartbeat_time)

    def blocking_call(self) -> Call | None:
        """The newest synchronous call the rank is inside, if any."""
        sync = [c for c in self.open_calls if not c.is_async]
        return sync[-1] if sync else None

    def how_it_ended(self) -> str:
        """What the ring itself knows, in words (the diagnosis adds the signal faulthandler recorded, if any:
        :meth:`dtwatch.diagnose.context.Context.how_it_ended`)."""
        return ring_ending(self.exit_state, self.exit_code, self.exit_reason, self.alive)

    def last_call(self) -> Call | None:
        calls = [c for g in self.groups.values() for c in g.recent]
        return max(calls, key=lambda c: c.t_enter) if calls else None

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RankState:
        d = dict(d)
        d["groups"] = {
            k: GroupProgress(**{**g, "recent": [Call(**c) for c in g.get("recent", [])]})
            for k, g in d["groups"].items()
        }
        d["open_calls"] = [Call(**c) for c in d.get("open_calls", [])]
        d.setdefault("main_stack", [])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def _site(s: Site | None) -> dict | None:
    return s.to_dict() if s is not None else None


UNKNOWN_PROCESS: tuple[bool | None, str] = (None, "")
"""``process`` of a rank on another machine (or one whose process is not to be asked): alive unknown."""


def from_snapshot(snap: RankSnapshot, *, process: tuple[bool | None, str] = UNKNOWN_PROCESS,
                  recent: int = RECENT_PER_GROUP) -> RankState:
    """Summarise a ring. ``process``: (alive, /proc state letter) as the caller read them for a process on its
    machine (:func:`dtwatch.process_liveness.process_state`); this module reads nothing."""
    # Column-wise: the watchdog runs this for every rank on every poll, so rows are selected by index
    # on single columns (no copies of the 128-byte records) and only the calls kept become Python
    # objects, field by field from ``tolist()`` (the same values ``RankSnapshot.record`` gives).
    recs = snap.records
    is_marker = (recs["flags"] & FLAG_MARKER) != 0
    call_idx = np.flatnonzero(~is_marker)
    t_enter, t_exit = recs["t_enter"], recs["t_exit"]
    call_exit = t_exit[call_idx]
    last_activity = max(
        [snap.start_time, snap.step_time]
        + ([float(t_enter[call_idx].max()), float(call_exit.max())] if len(call_idx) else [])
        + [g.cpp_seq_time for g in snap.groups if g.cpp_seq]
        + [g.completed_time for g in snap.groups if g.tracked]
    )
    sites, groups_info = snap.sites, snap.groups
    n_sites, n_groups, n_ops, n_dtypes = len(sites), len(groups_info), len(OPS), len(DTYPES)
    site_dicts: dict[int, dict | None] = {}
    fingerprints: dict[tuple, str] = {}
    rows_of = recs.view(np.dtype((np.void, recs.dtype.itemsize))) if len(recs) else recs

    def calls_at(idx: np.ndarray) -> list[Call]:
        if not len(idx):
            return []
        rows = rows_of[idx].view(recs.dtype)  # gathered as opaque items: much faster than field by field
        out = []
        for op, gslot, seq, site_id, te, tx, dt, ndim, numel, dims, flags, span, user_id, peer, step in zip(
            rows["op"].tolist(), rows["group"].tolist(), rows["seq"].tolist(), rows["site"].tolist(),
            rows["t_enter"].tolist(), rows["t_exit"].tolist(), rows["dtype"].tolist(), rows["ndim"].tolist(),
            rows["numel"].tolist(), rows["dims"].tolist(), rows["flags"].tolist(), rows["seq_span"].tolist(),
            rows["user_site"].tolist(), rows["peer"].tolist(), rows["step"].tolist(), strict=True,
        ):
            name = OPS[op] if op < n_ops else "unknown"
            key = (name, dt, numel >= 0, *dims[: min(ndim, 4)])
            fp = fingerprints.get(key)
            if fp is None:
                dtype = DTYPES[dt] if dt < n_dtypes else "unknown"
                shape = "x".join(str(d) for d in dims[: min(ndim, 4)]) if numel >= 0 else "object"
                fp = fingerprints[key] = f"{name}[{dtype}:{shape}]"
            if site_id in site_dicts:
                site = site_dicts[site_id]
            else:
                site = site_dicts[site_id] = sites[site_id - 1].to_dict() if 0 < site_id <= n_sites else None
            site = dict(site) if site is not None else None
            if user_id == site_id:  # a direct call: one dict for both (never mutated by readers)
                user = site
            else:
                if user_id in site_dicts:
                    user = site_dicts[user_id]
                else:
                    user = site_dicts[user_id] = sites[user_id - 1].to_dict() if 0 < user_id <= n_sites else None
                user = dict(user) if user is not None else None
            out.append(Call(
                name, groups_info[gslot].name if gslot < n_groups else str(gslot), seq, site, te, tx, fp,
                bool(flags & (FLAG_ASYNC | FLAG_ENQUEUED)) or name in ("isend", "irecv", "batch_isend_irecv"), span,
                user, peer, bool(flags & FLAG_ENQUEUED), step,
            ))
        return out

    groups: dict[str, GroupProgress] = {}
    clock = snap.seq_clock
    unwrapped = not len(recs) or int(recs["stamp"][0]) == 1
    call_group = recs["group"][call_idx]
    seq_col, span_col = recs["seq"], recs["seq_span"]
    for g in groups_info:
        mine = call_idx[call_group == g.slot]
        ends = seq_col[mine].astype(np.int64) + span_col[mine].astype(np.int64) - 1
        py_seq = int(ends.max()) if len(mine) else 0
        done = ends[t_exit[mine] != 0.0]
        completed = int(done.max()) if len(done) else 0
        groups[g.name] = GroupProgress(
            name=g.name, members=list(g.members) if g.members is not None else None,
            seq=max(py_seq, g.cpp_seq), completed=max(completed, g.completed_seq) if g.tracked else completed,
            py_seq=py_seq, cpp_seq=g.cpp_seq, cpp_seq_time=g.cpp_seq_time, recent=calls_at(mine[-recent:]),
            tracked=g.tracked, seq_times=_seq_times(clock, g.slot, seq_col[mine], t_enter[mine]),
            complete=unwrapped and len(mine) <= recent,
        )
    open_idx = call_idx[call_exit == 0.0]
    alive, letter = process
    return RankState(
        rank=snap.rank, local_rank=snap.local_rank, world_size=snap.world_size, host=snap.host,
        pid=snap.pid, job_id=snap.job_id, start_time=snap.start_time, restart_count=snap.restart_count,
        backend=snap.backend, alive=alive, proc_state=letter, exit_state=snap.exit_state_name,
        exit_reason=snap.exit_reason, exit_time=snap.exit_time, heartbeat_time=snap.heartbeat_time,
        step=snap.step, step_time=snap.step_time, groups=groups,
        open_calls=calls_at(open_idx), main_site=_site(snap.main_site),
        main_top_site=_site(snap.main_top_site), main_site_since=snap.main_site_since,
        main_stack=[s.to_dict() for s in snap.main_stack],
        loaders=_loaders(snap, t_enter[call_idx], groups[groups_info[0].name].seq if groups_info else 0),
        last_activity=last_activity, stack_signal=snap.stack_signal, device_index=snap.device_index,
        gpu_uuid=snap.gpu_uuid, ring_path=snap.path,
        step_times=[float(t) for t in t_enter[is_marker][-STEP_HISTORY:]],
        step_seqs=[int(q) for q in recs["seq"][is_marker][-STEP_HISTORY:]], setup=snap.facts,
        exit_code=snap.exit_code if snap.exit_state_name == "exited" else 0,
    )


def _loaders(snap: RankSnapshot, call_times: np.ndarray, default_seq: int) -> list[dict]:
    """The ring's loader table. Where it tells loaders apart (``ident``): where each was made, the latest
    epoch whose loop ended and the collectives the rank issued while it ran (``ended``, ``colls``), and for
    a latest epoch still running those seen since it started (``issued_now``: calls recorded from Python
    since then, or the default group's sequence number past where it stood, C++-issued calls included)."""
    out = []
    for ld in snap.loaders:
        d = {"index": ld.index, "site": _site(ld.site), "length": ld.length, "epochs": ld.epochs,
             "time": ld.time, "step": ld.step, "user_site": _site(ld.user_site)}
        if ld.ident:
            d.update(ident=ld.ident, made_site=_site(ld.made_site), ended=ld.ended, colls=ld.colls)
            if ld.ended < ld.epochs:
                since = int(np.count_nonzero(call_times >= ld.time))
                if ld.seq_start != NO_SEQ:
                    since = max(since, default_seq - ld.seq_start)
                d["issued_now"] = since
        out.append(d)
    return out


SEQ_TIMES_KEPT = 256


SEQ_TIME_RESOLUTION = 0.005  # seconds: the recorded calls' entries kept as the sequence clock would sample them


def _seq_times(clock: np.ndarray, slot: int, seqs: np.ndarray, entered: np.ndarray) -> list[tuple[int, float]]:
    """(seq, when the rank's counter was first seen at or past it), newest SEQ_TIMES_KEPT, oldest first: the sequence
    clock's samples, and the entries of the group's recorded calls (the clock runs only while calls go unrecorded),
    these thinned to the newest call of every SEQ_TIME_RESOLUTION so the kept pairs span as long as the clock's."""
    mine = clock[clock["group"] == slot] if len(clock) else clock
    times = np.concatenate([mine["t"].astype(np.float64), entered.astype(np.float64)]) if len(mine) else \
        entered.astype(np.float64)
    values = np.concatenate([mine["seq"].astype(np.int64), seqs.astype(np.int64)]) if len(mine) else \
        seqs.astype(np.int64)
    if not len(times):
        return []
    order = np.lexsort((values, times))
    times, values = times[order], values[order]
    bucket = np.floor(times / SEQ_TIME_RESOLUTION)
    last = np.append(bucket[1:] != bucket[:-1], True)  # the newest pair of each bucket
    times, values = times[last][-SEQ_TIMES_KEPT:], values[last][-SEQ_TIMES_KEPT:]
    return list(zip(values.tolist(), times.tolist(), strict=True))


def op_name(code: int) -> str:
    return OPS[code] if 0 <= code < len(OPS) else "unknown"
