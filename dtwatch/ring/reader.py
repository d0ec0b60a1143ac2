"""Reading rings, from any process (the watchdog, ``dtwatch analyze``, tests). See :mod:`dtwatch.ring`."""
from __future__ import annotations

import functools
import mmap
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dtwatch import paths
from dtwatch.ops import OPS
from dtwatch.ring.layout import (
    DTYPE_ITEMSIZE,
    DTYPES,
    EXIT_RUNNING,
    EXIT_STATE_NAMES,
    FLAG_MARKER,
    GROUP,
    GROUP_SIZE,
    HEADER_SIZE,
    LIVE,
    LIVE_OFFSET,
    LOADER,
    LOADER_SIZE,
    MAGIC,
    MEMBER_DTYPE,
    NUMEL_FROM_SHAPE,
    OFF_DUMP_REQUEST,
    READABLE_VERSIONS,
    RECORD_DTYPE,
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


class RingFormatError(ValueError):
    """The file is not a dtwatch ring this reader understands."""


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
    """Read one ring file (or its bytes) into a :class:`RankSnapshot`. Raises :class:`RingFormatError`."""
    path = str(path)
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    if len(data) < HEADER_SIZE or data[: len(MAGIC)] != MAGIC:
        raise RingFormatError(f"{path}: not a dtwatch ring (bad magic)")
    st = STATIC.unpack(data)
    version, record_size, capacity = st["version"], st["record_size"], st["capacity"]
    if version not in READABLE_VERSIONS or st["header_size"] != HEADER_SIZE or record_size != RECORD_SIZE:
        raise RingFormatError(f"{path}: ring version {version} (record size {record_size}) is not supported")
    if len(data) < st["records_off"] + capacity * RECORD_SIZE:
        raise RingFormatError(f"{path}: truncated ring")
    live = LIVE.unpack(data, LIVE_OFFSET)
    n_groups = min(live["n_groups"], st["groups_cap"])
    n_sites = min(live["n_sites"], st["sites_cap"])
    n_loaders = min(live["n_loaders"], st["loaders_cap"])
    world_size = st["world_size"]

    sites_off = st["sites_off"]
    sites = list(_parse_sites(bytes(data[sites_off : sites_off + n_sites * SITE_SIZE])))
    members_all = np.frombuffer(data, dtype=MEMBER_DTYPE, count=st["members_cap"], offset=st["members_off"])
    groups = []
    for i in range(n_groups):
        g = GROUP.unpack(data, st["groups_off"] + i * GROUP_SIZE)
        mstart, mcount, size = g["members_start"], g["members_count"], g["size"]
        members = tuple(members_all[mstart : mstart + mcount].tolist()) if mcount else None
        if members is None and size == world_size:
            members = tuple(range(world_size))
        groups.append(GroupInfo(i, _dec(g["name"]), _dec(g["desc"]), size, g["group_rank"], members, g["cpp_seq"],
                                g["cpp_seq_time"], g["completed_seq"], g["completed_time"], bool(g["tracked"])))

    snap_sites = sites

    def site_of(site_id: int) -> Site | None:
        return snap_sites[site_id - 1] if 0 < site_id <= len(snap_sites) else None

    loaders = []
    for i in range(n_loaders):
        lo = LOADER.unpack(data, st["loaders_off"] + i * LOADER_SIZE)
        loaders.append(LoaderInfo(i, site_of(lo["site"]), lo["length"], lo["epochs"], lo["time"], lo["step"],
                                  site_of(lo["user_site"])))

    valid = _valid_records(np.frombuffer(data, dtype=RECORD_DTYPE, count=capacity, offset=st["records_off"]))
    if version == 1:
        valid["user_site"] = valid["site"]
    return RankSnapshot(
        path=path, version=version, rank=st["rank"], local_rank=st["local_rank"], world_size=world_size,
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
        seq_clock=_read_seq_clock(data, st["seq_clock_off"]), facts=read_facts(data),
    )


def _valid_records(recs: np.ndarray) -> np.ndarray:
    """The valid records of the ring's slots, oldest first, as a copy, normalized."""
    capacity = len(recs)
    # Work on the stamp column and gather the valid records once, in stamp order: one copy of the rows
    # as opaque 128-byte items (numpy copies a structured dtype with sub-array fields field by field,
    # ~25x slower) and an argsort of one column instead of a structured sort.
    stamps = recs["stamp"]
    idx = np.flatnonzero((stamps != 0) & (stamps == recs["stamp2"]))
    if len(idx):
        # Keep the newest `capacity` stamps only (a slot caught mid-overwrite has mismatched stamps).
        st = stamps[idx]
        keep = st > int(st.max()) - capacity
        idx, st = idx[keep], st[keep]
        order = np.argsort(st, kind="stable")
        if len(st) > 1 and not (np.diff(st[order]) > 0).all():
            # Duplicate stamps (never written by the recorder): sort on every field, as before.
            valid = np.sort(recs[idx], order="stamp")
        else:
            valid = recs.view(_RECORD_BYTES)[idx[order]].view(RECORD_DTYPE)
    else:
        valid = np.empty(0, dtype=RECORD_DTYPE)
    _normalize(valid)
    return valid


def _read_seq_clock(data: bytes, seq_clock_off: int) -> np.ndarray:
    """The sequence clock, oldest first (empty in rings written before it existed)."""
    if not seq_clock_off or len(data) < seq_clock_off + SEQ_CLOCK_BYTES:
        return np.empty(0, dtype=SEQ_CLOCK_DTYPE)
    count = SEQ_CLOCK_COUNT.unpack_from(data, seq_clock_off)[0]
    table_off = seq_clock_off + SEQ_CLOCK_COUNT.size
    table = np.frombuffer(data, dtype=SEQ_CLOCK_DTYPE, count=SEQ_CLOCK_ENTRIES, offset=table_off)
    if count <= SEQ_CLOCK_ENTRIES:
        return table[:count].copy()
    start = count % SEQ_CLOCK_ENTRIES  # a ring: oldest first from the next slot to be written
    return np.concatenate([table[start:], table[:start]])


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
    """Read several rings; unreadable ones are skipped (the caller decides whether that matters)."""
    out = []
    for p in paths:
        try:
            out.append(read_ring(p))
        except (OSError, RingFormatError):
            continue
    return out


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
