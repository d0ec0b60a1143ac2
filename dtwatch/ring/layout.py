"""The ring's binary format, described once: each structure is a table of fields (name, type, count).

The struct formats the writer packs with, the numpy dtypes the reader views records through, every
field's offset and each structure's size are derived from these tables; nothing is counted by hand.
Reordering a field changes the file format: ``tests/test_ring_layout.py`` pins every offset.

All structures are little-endian and packed (no alignment padding but the explicit ``x`` fields).
See :mod:`dtwatch.ring` for what the fields mean.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import dtwatch.paths as paths
from dtwatch.ops import FLAG_COALESCED, FLAG_OBJECT, FLAG_P2P

# struct code -> numpy type of one item ("s": bytes, "x": padding are sized by the field's count).
_NUMPY_TYPES = {"B": "u1", "H": "<u2", "I": "<u4", "i": "<i4", "Q": "<u8", "q": "<i8", "d": "<f8"}


@dataclass(frozen=True)
class Field:
    """``count`` items of struct code ``type``: a number, ``s`` (``count`` bytes of text) or ``x``
    (``count`` bytes of padding, always written as zeros)."""

    name: str
    type: str
    count: int = 1

    @property
    def size(self) -> int:
        return struct.calcsize("<" + self.code())

    @property
    def is_padding(self) -> bool:
        return self.type == "x"

    @property
    def is_array(self) -> bool:
        """Several numbers (packed and unpacked as a sequence); text is one bytes value."""
        return self.count > 1 and self.type not in ("s", "x")

    def code(self, items: int | None = None) -> str:
        """This field's struct code; ``items`` < count packs only the first items and pads the rest."""
        if not self.is_array or items is None or items == self.count:
            return f"{self.count}{self.type}" if self.count != 1 else self.type
        unused = (self.count - items) * struct.calcsize("<" + self.type)
        given = "" if items == 0 else self.type if items == 1 else f"{items}{self.type}"
        return given + f"{unused}x"

    def numpy_type(self) -> tuple[str, str] | tuple[str, str, tuple[int]]:
        if self.type == "s":
            return (self.name, f"S{self.count}")
        if self.is_padding:
            return (self.name, f"V{self.count}")
        if self.is_array:
            return (self.name, _NUMPY_TYPES[self.type], (self.count,))
        return (self.name, _NUMPY_TYPES[self.type])


class Layout:
    """A fixed-size structure: its fields in order, packed. Offsets are from the structure's start."""

    def __init__(self, *fields: Field) -> None:
        self.fields = fields
        self.offsets: dict[str, int] = {}
        self._by_name = {f.name: f for f in fields}
        position = 0
        for f in fields:
            if f.name in self.offsets:
                raise ValueError(f"field {f.name!r} twice")
            self.offsets[f.name] = position
            position += f.size
        self.size = position
        self.struct = self.span()
        self.dtype = np.dtype([f.numpy_type() for f in fields])
        self._values = [f for f in fields if not f.is_padding]  # what the whole struct packs, in order
        # Where each field's items lie in the struct's flat tuple of values: (name, start, stop or None).
        self._slots: list[tuple[str, int, int | None]] = []
        start = 0
        for f in self._values:
            self._slots.append((f.name, start, start + f.count if f.is_array else None))
            start += f.count if f.is_array else 1
        self._names = [f.name for f in self._values]
        self._plain = all(stop is None for _, _, stop in self._slots)

    def offset(self, name: str) -> int:
        return self.offsets[name]

    def field(self, name: str) -> Field:
        return self._by_name[name]

    def span(self, first: str | None = None, last: str | None = None, *, skip: Iterable[str] = (),
             items: Mapping[str, int] | None = None) -> struct.Struct:
        """A struct for the fields ``first`` to ``last`` (inclusive; default: all), to pack at
        ``offset(first)``. Fields in ``skip`` become padding (zeros); ``items`` packs only the first
        items of an array field (``{"dims": 2}``)."""
        names = list(self.offsets)
        lo = names.index(first) if first is not None else 0
        hi = names.index(last) if last is not None else len(names) - 1
        skipped, counts = set(skip), dict(items or {})
        codes: list[str] = []
        pad = 0
        for f in self.fields[lo : hi + 1]:
            if f.is_padding or f.name in skipped:
                pad += f.size
                continue
            if pad:
                codes.append(f"{pad}x")
                pad = 0
            codes.append(f.code(counts.get(f.name)))
        if pad:
            codes.append(f"{pad}x")
        return struct.Struct("<" + "".join(codes))

    def unpack(self, buffer: Any, offset: int = 0) -> dict[str, Any]:
        """Every field but padding, by name; array fields as tuples, text fields as raw bytes."""
        flat = self.struct.unpack_from(buffer, offset)
        if self._plain:
            return dict(zip(self._names, flat, strict=True))
        return {name: flat[start] if stop is None else flat[start:stop] for name, start, stop in self._slots}

    def pack_into(self, buffer: Any, offset: int, **values: Any) -> None:
        """Write every field but padding, given by name (array fields as sequences)."""
        missing = [f.name for f in self._values if f.name not in values]
        unknown = set(values) - {f.name for f in self._values}
        if missing or unknown:
            raise TypeError(f"pack_into: missing {missing}, unknown {sorted(unknown)}")
        flat: list[Any] = []
        for f in self._values:
            if f.is_array:
                flat.extend(values[f.name])
            else:
                flat.append(values[f.name])
        self.struct.pack_into(buffer, offset, *flat)


# ---------------------------------------------------------------------------------------------------
# The file: header (static part, then live part), tables, member pool, records, sequence clock.
# ---------------------------------------------------------------------------------------------------
MAGIC = b"DTWRING\0"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no user_site (read as site)
HEADER_SIZE = 4096
LIVE_OFFSET = 512  # where the live part of the header starts
RING_SUFFIX = paths.RING_SUFFIX


def ring_filename(rank: int) -> str:
    """File name of the ring of global ``rank`` inside a run directory."""
    return paths.ring_name(rank)


# Written once, at offset 0.
STATIC = Layout(
    Field("magic", "s", 8), Field("version", "I"), Field("header_size", "I"), Field("record_size", "I"),
    Field("capacity", "I"),
    Field("groups_off", "I"), Field("groups_cap", "I"), Field("sites_off", "I"), Field("sites_cap", "I"),
    Field("loaders_off", "I"), Field("loaders_cap", "I"), Field("members_off", "I"), Field("members_cap", "I"),
    Field("records_off", "I"), Field("seq_clock_off", "I"),  # seq_clock_off: 0 in rings written before it
    Field("rank", "i"), Field("local_rank", "i"), Field("world_size", "i"), Field("pid", "i"),
    Field("start_time", "d"),
    Field("host", "s", 64), Field("job_id", "s", 128), Field("torch_version", "s", 32), Field("backend", "s", 32),
    Field("restart_count", "i"), Field("device_index", "i"), Field("gpu_uuid", "s", 64),
)

MAIN_STACK_DEPTH = 8
# Updated while the rank runs, at LIVE_OFFSET; fields written together are adjacent.
LIVE = Layout(
    Field("heartbeat_time", "d"), Field("heartbeat_count", "Q"),
    Field("main_site", "I"), Field("main_top_site", "I"), Field("main_site_since", "d"),
    Field("step", "Q"), Field("step_time", "d"),
    Field("exit_state", "B"), Field("_exit_pad", "x", 3), Field("exit_code", "i"), Field("exit_time", "d"),
    Field("exit_reason", "s", 256),
    Field("dump_request", "Q"), Field("dump_ack", "Q"),
    Field("n_groups", "I"), Field("n_sites", "I"), Field("n_loaders", "I"), Field("members_used", "I"),
    Field("stack_signal", "i"),  # signal that makes faulthandler dump stacks (0: none)
    Field("main_stack", "I", MAIN_STACK_DEPTH),  # site ids of the main thread's user frames, innermost first
)


def _live(first: str, last: str | None = None) -> tuple[int, struct.Struct]:
    """Absolute offset and struct of the live fields ``first`` to ``last``, written on their own."""
    return LIVE_OFFSET + LIVE.offset(first), LIVE.span(first, last or first)


OFF_HEARTBEAT, HEARTBEAT = _live("heartbeat_time", "heartbeat_count")
OFF_MAIN_SITE, MAIN_SITE = _live("main_site", "main_site_since")
OFF_STEP, STEP = _live("step", "step_time")
OFF_EXIT, EXIT = _live("exit_state", "exit_reason")
OFF_DUMP_REQUEST, U64 = _live("dump_request")
OFF_DUMP_ACK, _ = _live("dump_ack")
OFF_COUNTS, COUNTS = _live("n_groups", "members_used")
OFF_STACK_SIGNAL, I32 = _live("stack_signal")
OFF_MAIN_STACK, MAIN_STACK = _live("main_stack")

# The rank's setup facts, in the header's tail after the live fields (written at setup time, never per
# collective): this head, then ``length`` bytes of UTF-8 JSON (see :mod:`dtwatch.ring.setup_facts`).
FACTS_OFFSET = 1024
FACTS_END = HEADER_SIZE
FACTS_HEAD = Layout(Field("length", "I"), Field("crc32", "I"))  # length 0: no facts (or being rewritten)
FACTS_CAPACITY = FACTS_END - FACTS_OFFSET - FACTS_HEAD.size

# One per process group.
GROUP = Layout(
    Field("name", "s", 32), Field("desc", "s", 32), Field("size", "i"), Field("group_rank", "i"),
    Field("members_start", "I"), Field("members_count", "I"),  # where its members lie in the member pool
    Field("cpp_seq", "Q"), Field("cpp_seq_time", "d"),  # the C++ sequence number as last sampled, and when
    Field("completed_seq", "Q"), Field("completed_time", "d"), Field("tracked", "B"),  # see set_group_completed
    Field("_pad", "x", 15),
)
GROUP_SIZE = GROUP.size
GROUP_CPP_OFFSET, GROUP_CPP_SEQ = GROUP.offset("cpp_seq"), GROUP.span("cpp_seq", "cpp_seq_time")
GROUP_COMPLETED_OFFSET, GROUP_COMPLETED = GROUP.offset("completed_seq"), GROUP.span("completed_seq", "tracked")

# One per call site (id = index + 1; 0 = unknown). The file name keeps its tail when cut.
SITE = Layout(Field("line", "I"), Field("function", "s", 60), Field("file", "s", 192))
SITE_SIZE = SITE.size

# One per DataLoader and loop this rank iterated it at. The fields from ``ident`` on took the place of 24
# reserved bytes (zero in rings written before them: ``ident`` 0 says a ring does not tell loaders apart).
LOADER = Layout(
    Field("site", "I"),  # the loop iterating it (a library's included)
    Field("user_site", "I"),  # the user's line that led there, when the loop is a library's (0: none, or older)
    Field("length", "q"),  # -1 when unknown
    Field("epochs", "Q"), Field("time", "d"), Field("step", "Q"),  # epochs started; time and step of the latest
    # Which loader, the same on every rank (see dtwatch.record.data_samplers.LoaderMakes); never 0 when written.
    Field("ident", "I"),
    Field("made_site", "I"),  # the user's line that made it (0: unknown)
    Field("seq_start", "Q"),  # the default group's sequence number when the latest epoch started (NO_SEQ: unknown)
    # The latest epoch whose loop ended (ran out of batches, or was left) and the collectives this rank
    # issued while it ran (0, 0: none ended yet). Written apart from the fields above (LOADER_END).
    Field("ended", "I"), Field("colls", "I"),
)
LOADER_SIZE = LOADER.size
NO_SEQ = (1 << 64) - 1  # seq_start when the default group's sequence number could not be read
LOADER_START = LOADER.span("site", "seq_start")  # written when an epoch starts
LOADER_END_OFFSET, LOADER_END = LOADER.offset("ended"), LOADER.span("ended", "colls")  # when its loop ends

MEMBER_DTYPE = np.dtype("<i4")  # the member pool: global ranks of the groups' members

# One per collective call (or step marker), in a ring of ``capacity``.
RECORD = Layout(
    Field("stamp", "Q"),  # the record's 1-based position in the rank's history; equal to stamp2 when valid
    Field("seq", "Q"), Field("t_enter", "d"),
    Field("t_exit", "d"), Field("seq_span", "I"), Field("status", "B"),  # written when the call ends
    Field("op", "B"), Field("dtype", "B"), Field("ndim", "B"), Field("flags", "B"), Field("ntensors", "B"),
    Field("group", "H"), Field("site", "I"), Field("step", "Q"), Field("numel", "q"), Field("peer", "i"),
    Field("_pad", "x", 4), Field("dims", "q", 4), Field("user_site", "I"), Field("_reserved", "x", 12),
    Field("stamp2", "Q"),
)
RECORD_SIZE = RECORD.size
RECORD_DTYPE = RECORD.dtype
# The hot path writes a record in two packs. The entry: everything but the exit fields (left zero),
# one struct per number of dims given (0 to 4; unused dims stay zero). The exit: one small pack.
_EXIT_FIELDS = ("t_exit", "seq_span", "status")
RECORD_ENTRY_BY_NDIM = tuple(RECORD.span(skip=_EXIT_FIELDS, items={"dims": n}) for n in range(5))
RECORD_EXIT_OFFSET, RECORD_EXIT = RECORD.offset(_EXIT_FIELDS[0]), RECORD.span(_EXIT_FIELDS[0], _EXIT_FIELDS[-1])
# ``numel`` of a single tensor of at most 4 dimensions is not written (saves a call on the hot path):
# the reader derives it from the dims.
NUMEL_FROM_SHAPE = -2

# After the records: a count of entries written, then a ring of SEQ_CLOCK_ENTRIES of SEQ_CLOCK_LAYOUT.
SEQ_CLOCK_HEAD = Layout(Field("count", "Q"))
SEQ_CLOCK_COUNT = SEQ_CLOCK_HEAD.struct
SEQ_CLOCK_LAYOUT = Layout(Field("t", "d"), Field("seq", "Q"), Field("group", "H"), Field("_pad", "x", 6))
SEQ_CLOCK = SEQ_CLOCK_LAYOUT.struct
SEQ_CLOCK_DTYPE = SEQ_CLOCK_LAYOUT.dtype
SEQ_CLOCK_ENTRIES = 4096
SEQ_CLOCK_BYTES = SEQ_CLOCK_HEAD.size + SEQ_CLOCK_ENTRIES * SEQ_CLOCK.size

# Record flags: bits of the call's own here; the op's own (FLAG_OBJECT = 2, FLAG_P2P = 4, FLAG_COALESCED = 8)
# are in dtwatch.ops, with the table of ops.
FLAG_ASYNC = 1  # async_op=True, or always asynchronous (isend)
FLAG_MARKER = 16  # not a collective: a step marker
FLAG_ENQUEUED = 32  # a synchronous call that returned before its work completed (NCCL): see the group's completed_seq
FLAG_HOOKED = 64  # recorded by torch's collective hook: issued without a torch.distributed Python call
# Every bit a writer sets; a reader refuses a record with any other.
RECORD_FLAGS = FLAG_ASYNC | FLAG_OBJECT | FLAG_P2P | FLAG_COALESCED | FLAG_MARKER | FLAG_ENQUEUED | FLAG_HOOKED

STATUS_IN_FLIGHT, STATUS_OK, STATUS_ERROR = 0, 1, 2

EXIT_RUNNING, EXIT_CLEAN, EXIT_EXCEPTION, EXIT_SIGNAL, EXIT_DETACHED = 0, 1, 2, 3, 4
EXIT_STATE_NAMES = {
    EXIT_RUNNING: "running", EXIT_CLEAN: "exited", EXIT_EXCEPTION: "exception", EXIT_SIGNAL: "signal",
    EXIT_DETACHED: "detached",
}

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

# What a reader takes for garbled rather than a job's (the format has no checksums): a group's sequence number
# beyond 10^12 collectives, and a call taking more numbers than this (a batch of p2p ops on gloo takes one per op).
MAX_SEQ = 1 << 40
MAX_SEQ_SPAN = 1 << 16
