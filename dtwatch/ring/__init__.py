"""The per-rank collective ring: a fixed-size, memory-mapped file in the run directory.

Every training rank writes one ring (``<run dir>/rank-00003.ring``); the watchdog, ``dtwatch analyze``
and the tests read it from other processes, while the rank runs and after it died (even by SIGKILL:
the data lives in the page cache / file, not in the process).

Reading a ring::

    from dtwatch.ring import read_ring
    snap = read_ring("/tmp/dtwatch/myjob/rank-00001.ring")
    print(snap.rank, snap.world_size, snap.groups[0].name, snap.last_seq("0"))
    for rec in snap.records_list()[-5:]:
        print(rec.op, rec.seq, rec.site, rec.user_site, rec.in_flight)

Format, version 2 (all little-endian; offsets in bytes; version 1 is read too):

* **Header** (``HEADER_SIZE`` = 4096): static identity written once (``_STATIC``: magic ``DTWRING\\0``,
  version, layout offsets and capacities, rank, local rank, world size, pid, start time, host, job id,
  torch version, backend, restart count, device index, GPU UUID), then live fields at
  ``LIVE_OFFSET`` (``_LIVE``: heartbeat time and count, the main thread's current site and innermost
  site and since when, step counter and time of the last step, exit state/code/time/reason, dump
  request/acknowledge counters, table fill counts), then from ``FACTS_OFFSET`` the rank's setup facts
  (a checksummed JSON document, :mod:`dtwatch.ring.setup_facts`).
* **Groups** (``GROUP_SIZE`` = 128 each): process-group name (torch's ``group_name``, the same on every
  rank), description, member count, this rank's rank in the group, where its members lie in the member
  pool, the group's C++ sequence number as last sampled and when it last changed.
* **Sites** (``SITE_SIZE`` = 256 each): call sites referenced by id from records (id = index + 1;
  0 = unknown): line, function, file.
* **Loaders** (``LOADER_SIZE`` = 64 each): DataLoaders this rank iterated: site id of the loop,
  ``len()`` (-1 when unknown), epochs started, time and step of the latest epoch start.
* **Member pool**: int32 global ranks of the groups' members.
* **Sequence clock** (after the records; its offset is in the header's last layout field, 0 in rings
  written before it existed): a u64 count of entries written, then ``SEQ_CLOCK_ENTRIES`` entries of
  ``SEQ_CLOCK`` (time, sequence number, group slot), a ring. The sampler adds one whenever it sees a
  group's sequence counter advance (the default group's read every few milliseconds, the others' at each
  tick). That is when collectives issued from C++
  (DDP's reducer) were issued, which the straggler rule compares across ranks.
* **Records** (``RECORD_SIZE`` = 128 each, ``capacity`` of them, a ring): one per collective call
  (and a marker per step). A record is valid when its leading and trailing stamps are equal and
  non-zero; the stamp is the record's 1-based position in the rank's history, so the newest record is
  the one with the largest stamp. ``t_exit`` is 0.0 while the call is in flight (issued and not completed:
  an ``async_op`` call, or one on a tracked group, ``FLAG_ENQUEUED``, stays in flight after it returned,
  until its work completed); ``status`` 1 = left
  normally, 2 = raised. ``numel`` is -2 for a single tensor of at most 4 dimensions (derive it from
  ``dims``; ``read_ring`` does) and -1 for an object collective. ``seq`` is torch's sequence number of the group for the call
  (``ProcessGroup._get_sequence_number_for_group()`` after issuing it); ``seq_span`` is how many torch
  sequence numbers the call used (object collectives use several; p2p on NCCL none). A step marker
  (``FLAG_MARKER``, op ``step``) carries the step number in ``step`` and the default group's sequence
  number at that moment in ``seq``. ``site`` is the innermost frame outside torch and dtwatch,
  ``user_site`` the innermost frame of the user's own code (outside the standard library and third-party
  libraries as well, see :mod:`dtwatch.record.callsite`): they differ when a library (Lightning, Accelerate)
  issued the collective. Version 1 had no ``user_site`` (its bytes were padding); it reads as ``site``.
"""
from __future__ import annotations

import functools
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dtwatch.ring.setup_facts import FACTS_OFFSET, read_facts

MAGIC = b"DTWRING\0"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no user_site (read as site)
HEADER_SIZE = 4096
RECORD_SIZE = 128
GROUP_SIZE = 128
SITE_SIZE = 256
LOADER_SIZE = 64
LIVE_OFFSET = 512

DEFAULT_CAPACITY = 4096
DEFAULT_GROUPS = 64
DEFAULT_SITES = 1024
DEFAULT_LOADERS = 64
DEFAULT_MEMBERS = 16384

RING_SUFFIX = ".ring"


def ring_filename(rank: int) -> str:
    """File name of the ring of global ``rank`` inside a run directory."""
    return f"rank-{rank:05d}{RING_SUFFIX}"


# ---------------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------------
_STATIC = struct.Struct(
    "<8sIIII"  # magic, version, header_size, record_size, capacity
    "IIIIIIIIII"  # groups off/cap, sites off/cap, loaders off/cap, members off/cap, records off, pad
    "iiiid"  # rank, local_rank, world_size, pid, start_time
    "64s128s32s32s"  # host, job_id, torch_version, backend
    "ii64s"  # restart_count, device_index, gpu_uuid
)
_LIVE = struct.Struct(
    "<dQ"  # heartbeat_time, heartbeat_count
    "IId"  # main_site, main_top_site, main_site_since
    "Qd"  # step, step_time
    "B3xid256s"  # exit_state, exit_code, exit_time, exit_reason
    "QQ"  # dump_request, dump_ack
    "IIII"  # n_groups, n_sites, n_loaders, members_used
)
# Offsets of live fields that are written on their own.
OFF_HEARTBEAT = LIVE_OFFSET + 0  # <dQ
OFF_MAIN_SITE = LIVE_OFFSET + 16  # <IId
OFF_STEP = LIVE_OFFSET + 32  # <Qd
OFF_EXIT = LIVE_OFFSET + 48  # <B3xid256s
OFF_DUMP_REQUEST = LIVE_OFFSET + 320  # <Q
OFF_DUMP_ACK = LIVE_OFFSET + 328  # <Q
OFF_COUNTS = LIVE_OFFSET + 336  # <IIII
OFF_STACK_SIGNAL = LIVE_OFFSET + 352  # <i: signal that makes faulthandler dump stacks (0: none)
OFF_MAIN_STACK = LIVE_OFFSET + 356  # <8I: site ids of the main thread's user frames, innermost first
MAIN_STACK_DEPTH = 8
MAIN_STACK = struct.Struct(f"<{MAIN_STACK_DEPTH}I")
assert _LIVE.size == 352
assert OFF_MAIN_STACK + MAIN_STACK.size <= FACTS_OFFSET  # the setup-facts block follows the live fields

HEARTBEAT = struct.Struct("<dQ")
MAIN_SITE = struct.Struct("<IId")
STEP = struct.Struct("<Qd")
EXIT = struct.Struct("<B3xid256s")
U64 = struct.Struct("<Q")
COUNTS = struct.Struct("<IIII")
I32 = struct.Struct("<i")

# name, desc, size, group_rank, mstart, mcount, cpp_seq, cpp_t, completed_seq, completed_t, tracked
_GROUP = struct.Struct("<32s32siiIIQdQdB15x")
GROUP_CPP_SEQ = struct.Struct("<Qd")
GROUP_CPP_OFFSET = 80
GROUP_COMPLETED = struct.Struct("<QdB")
GROUP_COMPLETED_OFFSET = 96
assert _GROUP.size == GROUP_SIZE
_SITE = struct.Struct("<I60s192s")
assert _SITE.size == SITE_SIZE
_LOADER = struct.Struct("<IiqQdQ24x")  # site, pad(unused), length, epochs, time, step
assert _LOADER.size == LOADER_SIZE

# Record layout. The entry is written with one pack (the per-ndim variants avoid padding the shape in
# Python); the exit with one small pack at +24.
_REC_HEAD = "<QQddIBBBBBBHIQqi4x"  # stamp seq t_enter t_exit seq_span status op dtype ndim flags ntensors group site step numel peer
_REC_HEAD_SIZE = struct.calcsize(_REC_HEAD)
assert _REC_HEAD_SIZE == 72
# The entry pack leaves t_exit, seq_span and status zero (pad bytes are written as zeros): the exit pack
# fills them. Reader convention: an in-flight record spans 1 sequence number.
_REC_ENTRY_HEAD = "<QQd13xBBBBBHIQqi4x"  # stamp seq t_enter [t_exit span status] op dtype ndim flags ntensors group site step numel peer
assert struct.calcsize(_REC_ENTRY_HEAD) == _REC_HEAD_SIZE
RECORD_ENTRY_BY_NDIM = tuple(  # ... dims (n of 4), user_site, 12 pad bytes, stamp2
    struct.Struct(_REC_ENTRY_HEAD + "q" * n + f"{(4 - n) * 8}x" + "I12xQ") for n in range(5)
)
# ``numel`` of a single tensor of at most 4 dimensions is not written (saves a call on the hot path):
# the reader derives it from the dims.
NUMEL_FROM_SHAPE = -2
RECORD_EXIT = struct.Struct("<dIB")  # t_exit, seq_span, status
RECORD_EXIT_OFFSET = 24
assert all(s.size == RECORD_SIZE for s in RECORD_ENTRY_BY_NDIM)

SEQ_CLOCK = struct.Struct("<dQH6x")  # time, seq, group slot
SEQ_CLOCK_DTYPE = np.dtype([("t", "<f8"), ("seq", "<u8"), ("group", "<u2"), ("_pad", "V6")])
SEQ_CLOCK_ENTRIES = 4096
SEQ_CLOCK_BYTES = 8 + SEQ_CLOCK_ENTRIES * SEQ_CLOCK.size
assert SEQ_CLOCK_DTYPE.itemsize == SEQ_CLOCK.size

RECORD_DTYPE = np.dtype(
    [
        ("stamp", "<u8"), ("seq", "<u8"), ("t_enter", "<f8"), ("t_exit", "<f8"),
        ("seq_span", "<u4"), ("status", "u1"), ("op", "u1"), ("dtype", "u1"), ("ndim", "u1"),
        ("flags", "u1"), ("ntensors", "u1"), ("group", "<u2"), ("site", "<u4"), ("step", "<u8"),
        ("numel", "<i8"), ("peer", "<i4"), ("_pad", "<u4"), ("dims", "<i8", (4,)),
        ("user_site", "<u4"), ("_reserved", "V12"), ("stamp2", "<u8"),
    ]
)
assert RECORD_DTYPE.itemsize == RECORD_SIZE

# Record flags.
FLAG_ASYNC = 1
FLAG_OBJECT = 2
FLAG_P2P = 4
FLAG_COALESCED = 8
FLAG_MARKER = 16  # not a collective: a step marker
FLAG_ENQUEUED = 32  # a synchronous call that returned before its work completed (NCCL): see the group's completed_seq

STATUS_IN_FLIGHT, STATUS_OK, STATUS_ERROR = 0, 1, 2

EXIT_RUNNING, EXIT_CLEAN, EXIT_EXCEPTION, EXIT_SIGNAL, EXIT_DETACHED = 0, 1, 2, 3, 4
EXIT_STATE_NAMES = {
    EXIT_RUNNING: "running", EXIT_CLEAN: "exited", EXIT_EXCEPTION: "exception", EXIT_SIGNAL: "signal",
    EXIT_DETACHED: "detached",
}

# Operation codes. The order is part of the format: append only.
OPS = (
    "unknown", "step", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_reduce_coalesced", "all_gather_coalesced", "_all_gather_base", "_reduce_scatter_base",
    "send_object_list", "recv_object_list", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced", "_broadcast_coalesced", "all_gather_single",
    "reduce_scatter_single",
)
OP_CODES = {name: i for i, name in enumerate(OPS)}

# dtype codes. Append only.
DTYPES = (
    "unknown", "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
    "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
    "uint64",
)
DTYPE_CODES = {name: i for i, name in enumerate(DTYPES)}
DTYPE_ITEMSIZE = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "int16": 2, "int32": 4,
    "int64": 8, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}


class RingFormatError(ValueError):
    """The file is not a dtwatch ring this reader understands."""


def _enc(text: str, size: int, keep_tail: bool = False) -> bytes:
    data = text.encode("utf-8", "replace")
    if len(data) > size:
        data = data[-size:] if keep_tail else data[:size]
    return data


def _dec(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


# ---------------------------------------------------------------------------------------------------
# Writer (inside the training process)
# ---------------------------------------------------------------------------------------------------
class RingWriter:
    """Creates and owns one rank's ring. Only the training process writes; tables are append-only.

    The hot path (``dtwatch.record.recorder``) packs records straight into ``self.mm`` with the
    ``RECORD_ENTRY_BY_NDIM`` / ``RECORD_EXIT`` structs; everything here is cold path.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        job_id: str,
        host: str,
        backend: str = "",
        torch_version: str = "",
        restart_count: int = 0,
        device_index: int = -1,
        gpu_uuid: str = "",
        capacity: int = DEFAULT_CAPACITY,
        groups: int = DEFAULT_GROUPS,
        sites: int = DEFAULT_SITES,
        loaders: int = DEFAULT_LOADERS,
        members: int = DEFAULT_MEMBERS,
    ) -> None:
        self.path = Path(path)
        self.capacity = capacity
        self.groups_cap, self.sites_cap, self.loaders_cap, self.members_cap = groups, sites, loaders, members
        self.groups_off = HEADER_SIZE
        self.sites_off = self.groups_off + groups * GROUP_SIZE
        self.loaders_off = self.sites_off + sites * SITE_SIZE
        self.members_off = self.loaders_off + loaders * LOADER_SIZE
        self.records_off = self.members_off + _round_up(members * 4, 4096)
        self.seq_clock_off = self.records_off + capacity * RECORD_SIZE
        self.size = self.seq_clock_off + SEQ_CLOCK_BYTES
        self.seq_clock_count = 0  # written by the sampler thread only
        self._lock = threading.Lock()  # cold-path table appends (main thread and sampler thread)
        self.n_groups = self.n_sites = self.n_loaders = self.members_used = 0

        # Create under a temporary name and rename, so a reader never sees a half-written header and
        # a restarted rank replaces the old file atomically (a reader holding the old one keeps it).
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            os.ftruncate(fd, self.size)
            self.mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.start_time = time.time()
        _STATIC.pack_into(
            self.mm, 0, MAGIC, VERSION, HEADER_SIZE, RECORD_SIZE, capacity,
            self.groups_off, groups, self.sites_off, sites, self.loaders_off, loaders,
            self.members_off, members, self.records_off, self.seq_clock_off,
            rank, local_rank, world_size, os.getpid(), self.start_time,
            _enc(host, 64), _enc(job_id, 128), _enc(torch_version, 32), _enc(backend, 32),
            restart_count, device_index, _enc(gpu_uuid, 64),
        )
        HEARTBEAT.pack_into(self.mm, OFF_HEARTBEAT, self.start_time, 0)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)

    # -- tables ---------------------------------------------------------------------------------
    def add_group(self, name: str, desc: str, members: list[int] | None, group_rank: int,
                  tracked: bool = False) -> int:
        """Append a process group; returns its slot (or -1 when the table is full). ``tracked``: its
        collectives return before they complete, and :meth:`set_group_completed` says what completed."""
        with self._lock:
            if self.n_groups >= self.groups_cap:
                return -1
            slot = self.n_groups
            mstart = mcount = 0
            size = len(members) if members is not None else -1
            if members is not None and self.members_used + len(members) <= self.members_cap:
                mstart, mcount = self.members_used, len(members)
                np.frombuffer(self.mm, dtype="<i4", count=mcount, offset=self.members_off + 4 * mstart)[:] = members
                self.members_used += mcount
            _GROUP.pack_into(
                self.mm, self.groups_off + slot * GROUP_SIZE, _enc(name, 32), _enc(desc, 32), size,
                group_rank, mstart, mcount, 0, time.time(), 0, 0.0, int(tracked),
            )
            self.n_groups += 1
            self._write_counts()
            return slot

    def set_group_cpp_seq(self, slot: int, seq: int, when: float) -> None:
        GROUP_CPP_SEQ.pack_into(self.mm, self.groups_off + slot * GROUP_SIZE + GROUP_CPP_OFFSET, seq, when)

    def add_seq_time(self, slot: int, seq: int, when: float) -> None:
        """The sequence clock: group ``slot`` was seen at ``seq`` at ``when`` (sampler thread only)."""
        i = self.seq_clock_count % SEQ_CLOCK_ENTRIES
        SEQ_CLOCK.pack_into(self.mm, self.seq_clock_off + 8 + i * SEQ_CLOCK.size, when, seq, slot)
        self.seq_clock_count += 1
        U64.pack_into(self.mm, self.seq_clock_off, self.seq_clock_count)

    def set_group_completed(self, slot: int, seq: int, when: float) -> None:
        """A tracked group's collectives up to ``seq`` have completed (seen at ``when``)."""
        GROUP_COMPLETED.pack_into(self.mm, self.groups_off + slot * GROUP_SIZE + GROUP_COMPLETED_OFFSET, seq, when, 1)

    def add_site(self, filename: str, line: int, function: str) -> int:
        """Append a call site; returns its id (index + 1), or 0 when the table is full."""
        with self._lock:
            if self.n_sites >= self.sites_cap:
                return 0
            idx = self.n_sites
            _SITE.pack_into(
                self.mm, self.sites_off + idx * SITE_SIZE, line, _enc(function, 60),
                _enc(filename, 192, keep_tail=True),
            )
            self.n_sites += 1
            self._write_counts()
            return idx + 1

    def add_loader(self, site: int) -> int:
        with self._lock:
            if self.n_loaders >= self.loaders_cap:
                return -1
            idx = self.n_loaders
            _LOADER.pack_into(self.mm, self.loaders_off + idx * LOADER_SIZE, site, 0, -1, 0, 0.0, 0)
            self.n_loaders += 1
            self._write_counts()
            return idx

    def set_loader(self, idx: int, site: int, length: int, epochs: int, when: float, step: int) -> None:
        _LOADER.pack_into(self.mm, self.loaders_off + idx * LOADER_SIZE, site, 0, length, epochs, when, step)

    def _write_counts(self) -> None:
        COUNTS.pack_into(self.mm, OFF_COUNTS, self.n_groups, self.n_sites, self.n_loaders, self.members_used)

    # -- live fields ------------------------------------------------------------------------------
    def heartbeat(self, when: float, count: int) -> None:
        HEARTBEAT.pack_into(self.mm, OFF_HEARTBEAT, when, count)

    def set_main_site(self, site: int, top_site: int, since: float) -> None:
        MAIN_SITE.pack_into(self.mm, OFF_MAIN_SITE, site, top_site, since)

    def set_step(self, step: int, when: float) -> None:
        STEP.pack_into(self.mm, OFF_STEP, step, when)

    def set_exit(self, state: int, code: int, reason: str) -> None:
        EXIT.pack_into(self.mm, OFF_EXIT, state, code, time.time(), _enc(reason, 256))

    def set_main_stack(self, sites: list[int]) -> None:
        padded = (list(sites) + [0] * MAIN_STACK_DEPTH)[:MAIN_STACK_DEPTH]
        MAIN_STACK.pack_into(self.mm, OFF_MAIN_STACK, *padded)

    def write_record(
        self, stamp: int, *, op: str, seq: int = 0, t_enter: float, t_exit: float = 0.0, seq_span: int = 1,
        status: int | None = None, dtype: str = "unknown", shape: tuple[int, ...] = (), numel: int | None = None,
        flags: int = 0, ntensors: int = 1, group_slot: int = 0, site: int = 0, step: int = 0, peer: int = -1,
        user_site: int | None = None,
    ) -> int:
        """Write one record (cold path: step markers, tools and tests). Returns its offset.

        ``stamp`` is the record's 1-based position in this rank's history. ``t_exit`` 0.0 leaves it in
        flight; ``user_site`` None means ``site``. The recorder's hot path packs the same layout itself.
        """
        off = self.records_off + ((stamp - 1) % self.capacity) * RECORD_SIZE
        ndim = len(shape)
        dims = tuple(shape[:4])
        if numel is None:
            numel = NUMEL_FROM_SHAPE if ndim <= 4 and ntensors == 1 else 0
        RECORD_ENTRY_BY_NDIM[len(dims)].pack_into(
            self.mm, off, stamp, seq, t_enter, OP_CODES[op], DTYPE_CODES.get(dtype, 0), min(ndim, 255), flags,
            min(ntensors, 255), group_slot, site, step, numel, peer, *dims,
            site if user_site is None else user_site, stamp,
        )
        if t_exit:
            RECORD_EXIT.pack_into(self.mm, off + RECORD_EXIT_OFFSET, t_exit, seq_span,
                                  STATUS_OK if status is None else status)
        return off

    def set_stack_signal(self, sig: int) -> None:
        I32.pack_into(self.mm, OFF_STACK_SIGNAL, sig)

    def dump_request(self) -> int:
        return U64.unpack_from(self.mm, OFF_DUMP_REQUEST)[0]

    def ack_dump(self, value: int) -> None:
        U64.pack_into(self.mm, OFF_DUMP_ACK, value)

    def close(self) -> None:
        try:
            self.mm.flush()
            self.mm.close()
        except (ValueError, OSError):
            pass


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


# ---------------------------------------------------------------------------------------------------
# Reader (any process)
# ---------------------------------------------------------------------------------------------------
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
    site: Site | None
    length: int
    epochs: int
    time: float
    step: int


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
    return tuple(Site(_dec(fname), line, _dec(func)) for line, func, fname in _SITE.iter_unpack(table))


def read_ring(path: str | os.PathLike, data: bytes | None = None) -> RankSnapshot:
    """Read one ring file (or its bytes) into a :class:`RankSnapshot`. Raises :class:`RingFormatError`."""
    path = str(path)
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    if len(data) < HEADER_SIZE or data[:8] != MAGIC:
        raise RingFormatError(f"{path}: not a dtwatch ring (bad magic)")
    st = _STATIC.unpack_from(data, 0)
    (_, version, header_size, record_size, capacity, groups_off, groups_cap, sites_off, sites_cap,
     loaders_off, loaders_cap, members_off, members_cap, records_off, seq_clock_off, rank, local_rank,
     world_size, pid, start_time, host, job_id, torch_version, backend, restart_count,
     device_index, gpu_uuid) = st
    if version not in READABLE_VERSIONS or header_size != HEADER_SIZE or record_size != RECORD_SIZE:
        raise RingFormatError(f"{path}: ring version {version} (record size {record_size}) is not supported")
    if len(data) < records_off + capacity * RECORD_SIZE:
        raise RingFormatError(f"{path}: truncated ring")
    live = _LIVE.unpack_from(data, LIVE_OFFSET)
    (hb_time, hb_count, main_site, main_top, main_since, step, step_time, exit_state, exit_code,
     exit_time, exit_reason, dump_request, dump_ack, n_groups, n_sites, n_loaders, _members_used) = live
    n_groups, n_sites, n_loaders = min(n_groups, groups_cap), min(n_sites, sites_cap), min(n_loaders, loaders_cap)

    sites = list(_parse_sites(bytes(data[sites_off : sites_off + n_sites * SITE_SIZE])))
    members_all = np.frombuffer(data, dtype="<i4", count=members_cap, offset=members_off)
    groups = []
    for i in range(n_groups):
        (name, desc, size, grank, mstart, mcount, cpp_seq, cpp_t, done_seq, done_t,
         tracked) = _GROUP.unpack_from(data, groups_off + i * GROUP_SIZE)
        members = tuple(members_all[mstart : mstart + mcount].tolist()) if mcount else None
        if members is None and size == world_size:
            members = tuple(range(world_size))
        groups.append(GroupInfo(i, _dec(name), _dec(desc), size, grank, members, cpp_seq, cpp_t,
                                done_seq, done_t, bool(tracked)))

    snap_sites = sites

    def site_of(site_id: int) -> Site | None:
        return snap_sites[site_id - 1] if 0 < site_id <= len(snap_sites) else None

    loaders = []
    for i in range(n_loaders):
        lsite, _p, length, epochs, ltime, lstep = _LOADER.unpack_from(data, loaders_off + i * LOADER_SIZE)
        loaders.append(LoaderInfo(i, site_of(lsite), length, epochs, ltime, lstep))

    recs = np.frombuffer(data, dtype=RECORD_DTYPE, count=capacity, offset=records_off)
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
    seq_clock = np.empty(0, dtype=SEQ_CLOCK_DTYPE)
    if seq_clock_off and len(data) >= seq_clock_off + SEQ_CLOCK_BYTES:
        count = U64.unpack_from(data, seq_clock_off)[0]
        table = np.frombuffer(data, dtype=SEQ_CLOCK_DTYPE, count=SEQ_CLOCK_ENTRIES, offset=seq_clock_off + 8)
        if count <= SEQ_CLOCK_ENTRIES:
            seq_clock = table[:count].copy()
        else:  # a ring: oldest first from the next slot to be written
            start = count % SEQ_CLOCK_ENTRIES
            seq_clock = np.concatenate([table[start:], table[:start]])
    if version == 1:
        valid["user_site"] = valid["site"]
    return RankSnapshot(
        path=path, version=version, rank=rank, local_rank=local_rank, world_size=world_size, pid=pid,
        start_time=start_time, host=_dec(host), job_id=_dec(job_id), torch_version=_dec(torch_version),
        backend=_dec(backend), restart_count=restart_count, device_index=device_index,
        gpu_uuid=_dec(gpu_uuid), heartbeat_time=hb_time, heartbeat_count=hb_count,
        main_site=site_of(main_site), main_top_site=site_of(main_top), main_site_since=main_since,
        step=step, step_time=step_time, exit_state=exit_state, exit_code=exit_code,
        exit_time=exit_time, exit_reason=_dec(exit_reason), dump_request=dump_request,
        dump_ack=dump_ack, stack_signal=I32.unpack_from(data, OFF_STACK_SIGNAL)[0],
        main_stack=[x for x in (site_of(i) for i in MAIN_STACK.unpack_from(data, OFF_MAIN_STACK) if i) if x is not None],
        groups=groups, sites=sites, loaders=loaders, records=valid,  # a copy: never a view of `data`
        seq_clock=seq_clock, facts=read_facts(data),
    )


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
    return sorted(p for p in d.glob(f"rank-*{RING_SUFFIX}") if p.is_file())


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
