"""Reading rings, from any process (the watchdog, ``dtwatch analyze``, tests). See :mod:`dtwatch.ring`.

:func:`parse_ring` reads a ring's bytes and does no I/O; :func:`read_ring` and :func:`try_read_ring` read a
file. A ring that is not one (another format, random bytes, an empty file), is cut short or whose header does
not hold together raises :class:`RingFormatError`, whose :class:`InputProblem` says which file and what is
wrong; nothing else escapes the parse. A ring read in part (records that fail their checks, a cut sequence
clock) is read all the same, its snapshot's ``problem`` saying what was left out.
"""
from __future__ import annotations

import functools
import mmap
import os
import re
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import dtwatch.paths as paths
from dtwatch.ops import OPS
from dtwatch.ring.layout import (
    DTYPE_ITEMSIZE,
    DTYPES,
    EXIT_RUNNING,
    EXIT_STATE_NAMES,
    FACTS_HEAD,
    FACTS_OFFSET,
    FLAG_HOOKED,
    FLAG_MARKER,
    GROUP,
    GROUP_SIZE,
    HEADER_SIZE,
    LIVE,
    LIVE_OFFSET,
    LOADER,
    LOADER_SIZE,
    MAGIC,
    MAX_SEQ,
    MAX_SEQ_SPAN,
    MEMBER_DTYPE,
    NO_SEQ,
    NUMEL_FROM_SHAPE,
    OFF_DUMP_REQUEST,
    READABLE_VERSIONS,
    RECORD,
    RECORD_DTYPE,
    RECORD_FLAGS,
    RECORD_SIZE,
    SEQ_CLOCK_BYTES,
    SEQ_CLOCK_COUNT,
    SEQ_CLOCK_DTYPE,
    SEQ_CLOCK_ENTRIES,
    SITE,
    SITE_SIZE,
    STATIC,
    U64,
)
from dtwatch.ring.setup_facts import read_facts

# What can be wrong with an input file (InputProblem.problem).
SHORT_HEADER = "short_header"  # shorter than a ring's header (empty, too)
BAD_MAGIC = "bad_magic"  # not a dtwatch ring (another format, random bytes)
UNKNOWN_VERSION = "unknown_version"
BAD_HEADER = "bad_header"  # a ring, but its header's fields do not hold together
SIZE_MISMATCH = "size_mismatch"  # longer or shorter than its header says
RANK_MISMATCH = "rank_mismatch"  # its header's rank is not the one in its name
BAD_RECORDS = "bad_records"  # records that fail their checks (torn or garbled): left out
MALFORMED = "malformed"  # failed to parse in a way no check above caught (a reader bug to report)
IO_ERROR = "io_error"  # the file could not be read at all
MAX_WORLD = 1 << 24  # a world size beyond this is a garbled header, not a job


@dataclass(frozen=True)
class InputProblem:
    """What was wrong with one input file (a ring, a file of an incident bundle). ``read``: it was used all the
    same, less what ``detail`` names; otherwise nothing of it was, and the ``ranks`` it held (from its header, else
    its name; empty when neither says) are unknown unless another file holds them."""

    path: str
    problem: str  # a code above (a bundle's files: bad_json, bad_content)
    detail: str
    ranks: tuple[int, ...] = ()
    read: bool = False
    dropped: int = 0  # records that failed their checks and were left out

    def line(self) -> str:
        return f"{self.path}: {self.detail}" + ("" if self.read else "; not read")

    def to_dict(self) -> dict:
        return {"path": self.path, "problem": self.problem, "detail": self.detail, "ranks": list(self.ranks),
                "read": self.read, "dropped_records": self.dropped}


class RingFormatError(ValueError):
    """The file is not a dtwatch ring this reader understands; ``problem`` says which file and why."""

    def __init__(self, problem: InputProblem) -> None:
        super().__init__(problem.line())
        self.problem = problem


_RANK_NAME = re.compile(r"rank-(\d+)" + re.escape(paths.RING_SUFFIX))


def rank_of_name(path: str | os.PathLike) -> int | None:
    """The rank a ring's file name gives (``rank-00003.ring``: 3); None for another name."""
    m = _RANK_NAME.fullmatch(os.path.basename(str(path)))
    return int(m.group(1)) if m else None


def _dec(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


@dataclass(frozen=True)
class Site:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "function": self.function}


@dataclass(frozen=True)
class GroupInfo:
    slot: int
    name: str
    desc: str
    size: int
    group_rank: int
    members: tuple[int, ...] | None
    cpp_seq: int
    cpp_seq_time: float
    # Groups whose collectives return before they complete (NCCL, gloo_async): the last sequence number
    # known completed, and when that was seen. Untracked groups: 0, 0.0 (completion = the call returned).
    completed_seq: int = 0
    completed_time: float = 0.0
    tracked: bool = False


@dataclass(frozen=True)
class LoaderInfo:
    index: int
    site: Site | None  # the loop iterating it (a library's included)
    length: int
    epochs: int
    time: float
    step: int
    user_site: Site | None = None  # the user's line that led to a library's loop (None: the loop is the user's)
    # Which loader (0: a ring written before loaders were told apart), where it was made, the default group's
    # sequence number when its latest epoch started (NO_SEQ: unknown), the latest epoch whose loop ended and the
    # collectives this rank issued while it ran (see dtwatch.ring.layout.LOADER).
    ident: int = 0
    made_site: Site | None = None
    seq_start: int = NO_SEQ
    ended: int = 0
    colls: int = 0


@dataclass(frozen=True)
class Record:
    """One collective call (or step marker) as read back from a ring."""

    stamp: int
    seq: int
    seq_span: int
    op: str
    group: str
    site: Site | None
    t_enter: float
    t_exit: float
    status: int
    flags: int
    dtype: str
    shape: tuple[int, ...]
    numel: int
    ntensors: int
    peer: int
    step: int
    user_site: Site | None = None  # the user's line that led to the call (== site for a direct call)

    @property
    def in_flight(self) -> bool:
        return self.t_exit == 0.0

    @property
    def is_marker(self) -> bool:
        return bool(self.flags & FLAG_MARKER)

    # Issued by torch itself (functional, compiled, DDP's reducer), recorded from its hooks: see record.hooks.
    hooked = property(lambda self: bool(self.flags & FLAG_HOOKED))

    @property
    def last_seq(self) -> int:
        """The last torch sequence number this call used."""
        return self.seq + max(self.seq_span, 1) - 1

    @property
    def nbytes(self) -> int:
        return max(self.numel, 0) * DTYPE_ITEMSIZE.get(self.dtype, 0)

    def fingerprint(self) -> str:
        """What must agree across ranks for the same sequence number: op, dtype, shape."""
        shape = "x".join(str(d) for d in self.shape) if self.numel >= 0 else "object"
        return f"{self.op}[{self.dtype}:{shape}]"

    def to_dict(self) -> dict:
        return {
            "stamp": self.stamp, "seq": self.seq, "seq_span": self.seq_span, "op": self.op,
            "group": self.group, "site": self.site.to_dict() if self.site else None,
            "t_enter": self.t_enter, "t_exit": self.t_exit, "status": self.status,
            "flags": self.flags, "dtype": self.dtype, "shape": list(self.shape),
            "numel": self.numel, "ntensors": self.ntensors, "peer": self.peer, "step": self.step,
            "user_site": self.user_site.to_dict() if self.user_site else None,
        }


@dataclass
class RankSnapshot:
    """Everything one ring says about its rank at the moment it was read."""

    path: str
    version: int
    rank: int
    local_rank: int
    world_size: int
    pid: int
    start_time: float
    host: str
    job_id: str
    torch_version: str
    backend: str
    restart_count: int
    device_index: int
    gpu_uuid: str
    heartbeat_time: float
    heartbeat_count: int
    main_site: Site | None  # the main thread's innermost frame of user or library code (sampled)
    main_top_site: Site | None  # the main thread's innermost frame, whatever its code
    main_site_since: float
    step: int
    step_time: float
    exit_state: int
    exit_code: int
    exit_time: float
    exit_reason: str
    dump_request: int
    dump_ack: int
    stack_signal: int
    main_stack: list[Site]  # the main thread's user frames (no library, no stdlib), innermost first
    groups: list[GroupInfo]
    sites: list[Site]
    loaders: list[LoaderInfo]
    records: np.ndarray  # RECORD_DTYPE, valid records only, oldest first
    read_time: float = field(default_factory=time.time)
    # SEQ_CLOCK_DTYPE: when the sampler saw each group's counter advance, oldest first (empty: none kept)
    seq_clock: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=SEQ_CLOCK_DTYPE))
    facts: dict = field(default_factory=dict)  # the rank's setup facts (dtwatch.ring.setup_facts)
    problem: InputProblem | None = None  # read in part: what was left out (records that failed their checks)

    # -- lookups ----------------------------------------------------------------------------------
    def site(self, site_id: int) -> Site | None:
        return self.sites[site_id - 1] if 0 < site_id <= len(self.sites) else None

    def group(self, name: str) -> GroupInfo | None:
        for g in self.groups:
            if g.name == name:
                return g
        return None

    def record(self, row: np.void) -> Record:
        ndim = int(row["ndim"])
        numel = int(row["numel"])
        gslot = int(row["group"])
        return Record(
            stamp=int(row["stamp"]), seq=int(row["seq"]), seq_span=int(row["seq_span"]),
            op=OPS[row["op"]] if row["op"] < len(OPS) else "unknown",
            group=self.groups[gslot].name if gslot < len(self.groups) else str(gslot),
            site=self.site(int(row["site"])), t_enter=float(row["t_enter"]),
            t_exit=float(row["t_exit"]), status=int(row["status"]), flags=int(row["flags"]),
            dtype=DTYPES[row["dtype"]] if row["dtype"] < len(DTYPES) else "unknown",
            shape=tuple(int(d) for d in row["dims"][: min(ndim, 4)]) if numel >= 0 else (),
            numel=numel, ntensors=int(row["ntensors"]), peer=int(row["peer"]), step=int(row["step"]),
            user_site=self.site(int(row["user_site"])),
        )

    def records_list(self, last: int | None = None) -> list[Record]:
        rows = self.records if last is None else self.records[-last:]
        return [self.record(r) for r in rows]

    def collectives(self) -> np.ndarray:
        """Records that are collectives (not step markers)."""
        return self.records[(self.records["flags"] & FLAG_MARKER) == 0]

    def group_records(self, name: str) -> np.ndarray:
        g = self.group(name)
        if g is None:
            return self.records[:0]
        recs = self.collectives()
        return recs[recs["group"] == g.slot]

    def last_seq(self, group: str) -> int:
        """Last sequence number this rank issued in ``group`` (Python- or C++-issued)."""
        g = self.group(group)
        if g is None:
            return 0
        recs = self.group_records(group)
        last_py = int((recs["seq"] + np.maximum(recs["seq_span"], 1) - 1).max()) if len(recs) else 0
        return max(last_py, g.cpp_seq)

    def last_completed_seq(self, group: str) -> int:
        """Last sequence number known completed in ``group`` (from Python-issued calls)."""
        recs = self.group_records(group)
        done = recs[recs["t_exit"] != 0.0]
        return int((done["seq"] + np.maximum(done["seq_span"], 1) - 1).max()) if len(done) else 0

    def open_records(self) -> list[Record]:
        """Collectives this rank is inside right now (entered, not left), oldest first."""
        recs = self.collectives()
        return [self.record(r) for r in recs[recs["t_exit"] == 0.0]]

    @property
    def alive_by_heartbeat(self) -> bool:
        return self.exit_state == EXIT_RUNNING

    @property
    def exit_state_name(self) -> str:
        return EXIT_STATE_NAMES.get(self.exit_state, str(self.exit_state))


_RECORD_BYTES = np.dtype((np.void, RECORD_SIZE))


@functools.lru_cache(maxsize=32)
def _parse_sites(table: bytes) -> tuple[Site, ...]:
    """The call-site table (its used part). Cached on its bytes: it is append-only and the watchdog
    reads every ring twice a second (Sites are immutable, so sharing them is safe)."""
    return tuple(Site(_dec(fname), line, _dec(func)) for line, func, fname in SITE.struct.iter_unpack(table))


def read_ring(path: str | os.PathLike, data: bytes | None = None) -> RankSnapshot:
    """Read one ring file (or its bytes) into a :class:`RankSnapshot`. Raises :class:`RingFormatError` (and
    ``OSError`` when the file cannot be read); a ring read in part has its snapshot's ``problem`` set."""
    path = str(path)
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    return parse_ring(data, path, name_rank=rank_of_name(path))


def try_read_ring(path: str | os.PathLike) -> tuple[RankSnapshot | None, InputProblem | None]:
    """Read one ring file, never raising: (snapshot, what was left out of it or None), or (None, why not)."""
    try:
        snap = read_ring(path)
    except RingFormatError as e:
        return None, e.problem
    except OSError as e:
        return None, _fail(str(path), IO_ERROR, f"could not be read ({e.strerror or e})", rank_of_name(path)).problem
    return snap, snap.problem


def parse_ring(data: bytes | memoryview, path: str = "", *, name_rank: int | None = None) -> RankSnapshot:
    """A ring's bytes as a :class:`RankSnapshot` (no I/O); ``name_rank``: the rank its file name gives, which its
    header must agree with. Raises :class:`RingFormatError`, and nothing else, for bytes it cannot read."""
    try:
        return _parse(data, path, name_rank)
    except RingFormatError:
        raise
    except (ValueError, IndexError, OverflowError, TypeError, struct.error) as e:  # a check is missing: say so
        raise _fail(path, MALFORMED, f"could not be parsed ({type(e).__name__}: {e})", name_rank) from e


def _fail(path: str, problem: str, detail: str, *ranks: int | None) -> RingFormatError:
    return RingFormatError(InputProblem(path, problem, detail, tuple(sorted({r for r in ranks if r is not None}))))


def _parse(data: bytes | memoryview, path: str, name_rank: int | None) -> RankSnapshot:
    size = len(data)
    head = bytes(data[: len(MAGIC)])
    if size == 0:
        raise _fail(path, SHORT_HEADER, "empty file (0 bytes)", name_rank)
    if head != MAGIC[: len(head)]:
        raise _fail(path, BAD_MAGIC, f"not a dtwatch ring (bad magic: it starts with {head!r}, a ring with "
                    f"{MAGIC!r})", name_rank)
    if size < HEADER_SIZE:
        raise _fail(path, SHORT_HEADER, f"short header: {size:,} bytes, less than a ring's header "
                    f"({HEADER_SIZE:,})", name_rank)
    st = STATIC.unpack(data)
    version, record_size, capacity = st["version"], st["record_size"], st["capacity"]
    if version not in READABLE_VERSIONS:
        raise _fail(path, UNKNOWN_VERSION, f"ring version {version}, which this reader does not know (it reads "
                    f"{', '.join(map(str, READABLE_VERSIONS))})", name_rank)
    if st["header_size"] != HEADER_SIZE or record_size != RECORD_SIZE:
        raise _fail(path, BAD_HEADER, f"bad header: header size {st['header_size']} and record size {record_size}, "
                    f"version {version} has {HEADER_SIZE} and {RECORD_SIZE}", name_rank)
    rank, world_size = st["rank"], st["world_size"]
    if not (0 < world_size <= MAX_WORLD and 0 <= rank < world_size):
        raise _fail(path, BAD_HEADER, f"bad header: rank {rank} of world size {world_size}", name_rank)
    if name_rank is not None and name_rank != rank:
        raise _fail(path, RANK_MISMATCH, f"its header says rank {rank}, its name rank {name_rank}", rank, name_rank)
    end, layout_error = _layout_end(st)
    if layout_error:
        raise _fail(path, BAD_HEADER, f"bad header: {layout_error}", rank)
    records_end = st["records_off"] + capacity * RECORD_SIZE
    if size < records_end:
        raise _fail(path, SIZE_MISMATCH, f"truncated: {size:,} of the {end:,} bytes its header says", rank)
    live = LIVE.unpack(data, LIVE_OFFSET)
    header_error = _live_error(data, st, live)
    if header_error:
        raise _fail(path, BAD_HEADER, f"bad header: {header_error}", rank)
    n_groups, n_sites, n_loaders = live["n_groups"], live["n_sites"], live["n_loaders"]
    sites_off = st["sites_off"]
    sites = list(_parse_sites(bytes(data[sites_off : sites_off + n_sites * SITE_SIZE])))
    members_all = np.frombuffer(data, dtype=MEMBER_DTYPE, count=st["members_cap"], offset=st["members_off"])
    groups = []
    for i in range(n_groups):
        g = GROUP.unpack(data, st["groups_off"] + i * GROUP_SIZE)
        mstart, mcount, size_ = g["members_start"], g["members_count"], g["size"]
        members = tuple(members_all[mstart : mstart + mcount].tolist()) if mcount else None
        if members is None and size_ == world_size:
            members = tuple(range(world_size))
        groups.append(GroupInfo(i, _dec(g["name"]), _dec(g["desc"]), size_, g["group_rank"], members, g["cpp_seq"],
                                g["cpp_seq_time"], g["completed_seq"], g["completed_time"], bool(g["tracked"])))

    def site_of(site_id: int) -> Site | None:
        return sites[site_id - 1] if 0 < site_id <= len(sites) else None

    loaders = []
    for i in range(n_loaders):
        lo = LOADER.unpack(data, st["loaders_off"] + i * LOADER_SIZE)
        loaders.append(LoaderInfo(i, site_of(lo["site"]), lo["length"], lo["epochs"], lo["time"], lo["step"],
                                  site_of(lo["user_site"]), lo["ident"], site_of(lo["made_site"]), lo["seq_start"],
                                  lo["ended"], lo["colls"]))

    slots = np.frombuffer(data, dtype=RECORD_DTYPE, count=capacity, offset=st["records_off"])
    valid, dropped = _valid_records(slots, st["sites_cap"])
    if version == 1:
        valid["user_site"] = valid["site"]
    notes = [f"truncated in its sequence clock ({size:,} of the {end:,} bytes its header says): read without it"
             if size < end else f"{size - end:,} bytes longer than its header says ({end:,}): the excess ignored"
             ] if size != end else []
    seq_clock, clock_dropped = _read_seq_clock(data, st["seq_clock_off"], st["groups_cap"])  # none when cut
    if dropped:
        notes.append(f"{dropped} of {dropped + len(valid)} records failed their checks (torn or garbled): left out")
    if clock_dropped:
        notes.append(f"{clock_dropped} sequence clock entries failed their checks and were left out")
    facts = read_facts(data)
    if not facts and FACTS_HEAD.unpack(data, FACTS_OFFSET)["length"]:  # (0 while the rank rewrites them)
        notes.append("its setup facts fail their checksum: left out")
    problem = None
    if notes:
        code = SIZE_MISMATCH if size != end else BAD_RECORDS
        problem = InputProblem(path, code, "; ".join(notes), (rank,), read=True, dropped=dropped)
    return RankSnapshot(
        path=path, version=version, rank=rank, local_rank=st["local_rank"], world_size=world_size,
        pid=st["pid"], start_time=st["start_time"], host=_dec(st["host"]), job_id=_dec(st["job_id"]),
        torch_version=_dec(st["torch_version"]), backend=_dec(st["backend"]), restart_count=st["restart_count"],
        device_index=st["device_index"], gpu_uuid=_dec(st["gpu_uuid"]), heartbeat_time=live["heartbeat_time"],
        heartbeat_count=live["heartbeat_count"], main_site=site_of(live["main_site"]),
        main_top_site=site_of(live["main_top_site"]), main_site_since=live["main_site_since"],
        step=live["step"], step_time=live["step_time"], exit_state=live["exit_state"],
        exit_code=live["exit_code"], exit_time=live["exit_time"], exit_reason=_dec(live["exit_reason"]),
        dump_request=live["dump_request"], dump_ack=live["dump_ack"], stack_signal=live["stack_signal"],
        main_stack=[s for s in (site_of(i) for i in live["main_stack"] if i) if s is not None],
        groups=groups, sites=sites, loaders=loaders, records=valid,  # a copy: never a view of `data`
        seq_clock=seq_clock, facts=facts, problem=problem,
    )


def _layout_end(st: dict) -> tuple[int, str]:
    """Where the ring ends by its header, and what in its layout does not hold together ("" when all does): the
    tables in order, each where the one before ends, then the records (page-aligned), then the sequence clock."""
    at = HEADER_SIZE
    for name, entry in (("groups", GROUP_SIZE), ("sites", SITE_SIZE), ("loaders", LOADER_SIZE),
                        ("members", MEMBER_DTYPE.itemsize)):
        if st[f"{name}_off"] != at:
            return 0, f"the {name} table is at {st[f'{name}_off']:,}, where the table before it ends is {at:,}"
        at += st[f"{name}_cap"] * entry
    if not 0 <= st["records_off"] - at < 4096 or st["records_off"] % 4096 != st["members_off"] % 4096:
        return 0, f"the records are at {st['records_off']:,}, the member pool ends at {at:,}"
    if st["capacity"] < 1:
        return 0, "a capacity of 0 records"
    records_end = st["records_off"] + st["capacity"] * RECORD_SIZE
    if st["seq_clock_off"] not in (0, records_end):
        return 0, f"the sequence clock is at {st['seq_clock_off']:,}, the records end at {records_end:,}"
    return (st["seq_clock_off"] + SEQ_CLOCK_BYTES if st["seq_clock_off"] else records_end), ""


def _live_error(data: bytes | memoryview, st: dict, live: dict) -> str:
    """What in the header's live part, its identity or the used tables cannot be ("" when nothing)."""
    for name, cap in (("n_groups", "groups_cap"), ("n_sites", "sites_cap"), ("n_loaders", "loaders_cap"),
                      ("members_used", "members_cap")):
        if live[name] > st[cap]:
            return f"{name} {live[name]}, more than the table's {st[cap]}"
    if live["exit_state"] not in EXIT_STATE_NAMES:
        return f"exit state {live['exit_state']}"
    groups = np.frombuffer(data, GROUP.dtype, count=live["n_groups"], offset=st["groups_off"])
    loaders = np.frombuffer(data, LOADER.dtype, count=live["n_loaders"], offset=st["loaders_off"])
    times = {"start_time": st["start_time"], **{k: live[k] for k in ("heartbeat_time", "main_site_since",
             "step_time", "exit_time")}, "a group's time": groups[["cpp_seq_time", "completed_time"]].tolist(),
             "a DataLoader's time": loaders["time"]}
    bad = [name for name, v in times.items() if not np.isfinite(np.asarray(v, dtype=float)).all()]
    return f"{bad[0]} is not a number" if bad else ""


_DIMS = np.arange(4)  # dims past a record's ndim are zero; so are the bytes of its padding and reserved fields
_ZERO_SPANS = [(RECORD.offset(f.name), RECORD.offset(f.name) + f.size) for f in RECORD.fields if f.is_padding]


def _valid_records(recs: np.ndarray, sites_cap: int) -> tuple[np.ndarray, int]:
    """The records that pass their checks, oldest first, as a copy, normalized; and how many written slots fail
    them: equal leading and trailing stamps, in the slot the stamp gives, among the newest ``capacity``, codes a
    writer writes, finite times, plausible numbers and spans, zero padding and unused dims (a torn slot fails)."""
    capacity = len(recs)
    # Gather the candidates by their stamp columns once, in stamp order, as opaque 128-byte items (numpy copies a
    # structured dtype with sub-array fields field by field, ~25x slower), and check them there.
    stamps, stamps2 = recs["stamp"], recs["stamp2"]
    used = np.flatnonzero(stamps | stamps2)
    idx = used[stamps[used] == stamps2[used]]
    st = stamps[idx]
    keep = ((st - np.uint64(1)) % np.uint64(capacity)).astype(np.int64) == idx  # in the slot its stamp gives
    if len(idx):
        keep &= st > int(st.max()) - capacity  # distinct, then: each stamp lies in its own slot
    idx, st = idx[keep], st[keep]
    cand = recs.view(_RECORD_BYTES)[idx[np.argsort(st)]].view(RECORD_DTYPE)
    raw = cand.view(np.uint8).reshape(len(cand), RECORD_SIZE)
    ok = ((cand["op"] < len(OPS)) & (cand["dtype"] < len(DTYPES)) & (cand["status"] <= 2)
          & ((cand["flags"] & ~np.uint8(RECORD_FLAGS)) == 0) & np.isfinite(cand["t_enter"])
          & np.isfinite(cand["t_exit"]) & (cand["site"] <= sites_cap) & (cand["user_site"] <= sites_cap)
          & (cand["seq"] < MAX_SEQ) & (cand["seq_span"] <= MAX_SEQ_SPAN)
          & (cand["numel"] >= NUMEL_FROM_SHAPE) & ~((cand["dims"] != 0) & (_DIMS >= cand["ndim"][:, None])).any(axis=1))
    for lo, hi in _ZERO_SPANS:
        ok &= ~raw[:, lo:hi].any(axis=1)
    valid = cand if ok.all() else cand[ok]
    _normalize(valid)
    return valid, len(used) - len(valid)


def _read_seq_clock(data: bytes | memoryview, seq_clock_off: int, groups_cap: int) -> tuple[np.ndarray, int]:
    """The sequence clock, oldest first (empty in rings written before it existed), and how many of its
    entries failed their checks (a time that is not a number, a group slot past the table, a garbled number)."""
    if not seq_clock_off or len(data) < seq_clock_off + SEQ_CLOCK_BYTES:
        return np.empty(0, dtype=SEQ_CLOCK_DTYPE), 0
    count = SEQ_CLOCK_COUNT.unpack_from(data, seq_clock_off)[0]
    table_off = seq_clock_off + SEQ_CLOCK_COUNT.size
    table = np.frombuffer(data, dtype=SEQ_CLOCK_DTYPE, count=SEQ_CLOCK_ENTRIES, offset=table_off)
    if count <= SEQ_CLOCK_ENTRIES:
        clock = table[:count].copy()
    else:
        start = count % SEQ_CLOCK_ENTRIES  # a ring: oldest first from the next slot to be written
        clock = np.concatenate([table[start:], table[:start]])
    ok = np.isfinite(clock["t"]) & (clock["group"] < groups_cap) & (clock["seq"] < MAX_SEQ)
    return (clock, 0) if ok.all() else (clock[ok], int((~ok).sum()))


def _normalize(recs: np.ndarray) -> None:
    """Fill in what the hot path leaves out: numel of <= 4-D tensors, the span of in-flight calls."""
    numel = recs["numel"]
    derive = np.flatnonzero(numel == NUMEL_FROM_SHAPE)
    if len(derive):
        ndim = recs["ndim"][derive].astype(np.int64)
        dims = recs["dims"][derive]
        used = np.arange(4)[None, :] < ndim[:, None]
        numel[derive] = np.where(used, dims, 1).prod(axis=1)
    span = recs["seq_span"]
    span[np.flatnonzero((span == 0) & (recs["t_exit"] == 0.0))] = 1


def find_rings(directory: str | os.PathLike) -> list[Path]:
    """Ring files directly inside a run directory, by rank order."""
    d = Path(directory)
    return sorted(p for p in d.glob(paths.RING_GLOB) if p.is_file())


def read_rings(paths: Iterable[str | os.PathLike]) -> list[RankSnapshot]:
    """Read several rings; unreadable ones are skipped (:func:`try_read_ring` says why)."""
    return [s for s in (try_read_ring(p)[0] for p in paths) if s is not None]


def request_dump(path: str | os.PathLike) -> int:
    """Ask the rank owning ring ``path`` to dump its Flight Recorder (its sampler thread acts on it).

    Returns the new request number; the rank acknowledges by setting ``dump_ack`` to it.
    """
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), HEADER_SIZE)
        try:
            value = U64.unpack_from(mm, OFF_DUMP_REQUEST)[0] + 1
            U64.pack_into(mm, OFF_DUMP_REQUEST, value)
        finally:
            mm.close()
    return value
