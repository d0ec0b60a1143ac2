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

The package: :mod:`~dtwatch.ring.layout` describes the format once (each structure a table of fields, from
which the structs, numpy dtypes and offsets are derived), :mod:`~dtwatch.ring.writer` writes a ring inside
the training process, :mod:`~dtwatch.ring.reader` reads it anywhere. The names below are importable from
``dtwatch.ring`` itself.

Format, version 2 (all little-endian; offsets in bytes; version 1 is read too):

* **Header** (``HEADER_SIZE`` = 4096): static identity written once (``STATIC``: magic ``DTWRING\\0``,
  version, layout offsets and capacities, rank, local rank, world size, pid, start time, host, job id,
  torch version, backend, restart count, device index, GPU UUID), then live fields at
  ``LIVE_OFFSET`` (``LIVE``: heartbeat time and count, the main thread's current site and innermost
  site and since when, step counter and time of the last step, exit state/code/time/reason, dump
  request/acknowledge counters, table fill counts, the signal that makes faulthandler dump stacks, the
  site ids of the main thread's user frames), then from ``FACTS_OFFSET`` the rank's setup facts
  (``FACTS_HEAD``: length and crc32, then a JSON document; :mod:`~dtwatch.ring.setup_facts`).
* **Groups** (``GROUP_SIZE`` = 128 each): process-group name (torch's ``group_name``, the same on every
  rank), description, member count, this rank's rank in the group, where its members lie in the member
  pool, the group's C++ sequence number as last sampled and when it last changed.
* **Sites** (``SITE_SIZE`` = 256 each): call sites referenced by id from records (id = index + 1;
  0 = unknown): line, function, file.
* **Loaders** (``LOADER_SIZE`` = 64 each): DataLoaders this rank iterated, one entry per loader and loop:
  site id of the loop, ``len()`` (-1 when unknown), epochs started, time and step of the latest epoch start;
  which loader (``ident``, the same on every rank; 0 in rings written before it, whose loaders are told
  apart by their loop only) and the site that made it; the default group's sequence number at the latest
  epoch start; the latest epoch whose loop ended and the collectives the rank issued while it ran.
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
  until its work completed); ``status`` 1 = left normally, 2 = raised. ``numel`` is -2 for a single
  tensor of at most 4 dimensions (derive it from ``dims``; ``read_ring`` does) and -1 for an object
  collective. ``seq`` is torch's sequence number of the group for the call
  (``ProcessGroup._get_sequence_number_for_group()`` after issuing it); ``seq_span`` is how many torch
  sequence numbers the call used (object collectives use several; p2p on NCCL none). A step marker
  (``FLAG_MARKER``, op ``step``) carries the step number in ``step`` and the default group's sequence
  number at that moment in ``seq``. ``site`` is the innermost frame outside torch and dtwatch,
  ``user_site`` the innermost frame of the user's own code (outside the standard library and third-party
  libraries as well, see :mod:`dtwatch.record.callsite`): they differ when a library (Lightning, Accelerate)
  issued the collective. Version 1 had no ``user_site`` (its bytes were padding); it reads as ``site``.
"""
from __future__ import annotations

from dtwatch.ops import (
    FLAG_COALESCED,
    FLAG_OBJECT,
    FLAG_P2P,
    OP_CODES,
    OPS,
)
from dtwatch.ring.layout import (
    COUNTS,
    DTYPE_CODES,
    DTYPE_ITEMSIZE,
    DTYPES,
    EXIT,
    EXIT_CLEAN,
    EXIT_DETACHED,
    EXIT_EXCEPTION,
    EXIT_RUNNING,
    EXIT_SIGNAL,
    EXIT_STATE_NAMES,
    FACTS_CAPACITY,
    FACTS_END,
    FACTS_HEAD,
    FACTS_OFFSET,
    FLAG_ASYNC,
    FLAG_ENQUEUED,
    FLAG_HOOKED,
    FLAG_MARKER,
    GROUP_SIZE,
    HEADER_SIZE,
    HEARTBEAT,
    I32,
    LIVE_OFFSET,
    LOADER_SIZE,
    MAGIC,
    MAIN_SITE,
    MAIN_STACK,
    MAIN_STACK_DEPTH,
    NUMEL_FROM_SHAPE,
    OFF_COUNTS,
    OFF_DUMP_ACK,
    OFF_DUMP_REQUEST,
    OFF_EXIT,
    OFF_HEARTBEAT,
    OFF_MAIN_SITE,
    OFF_MAIN_STACK,
    OFF_STACK_SIGNAL,
    OFF_STEP,
    READABLE_VERSIONS,
    RECORD_DTYPE,
    RECORD_ENTRY_BY_NDIM,
    RECORD_EXIT,
    RECORD_EXIT_OFFSET,
    RECORD_SIZE,
    RING_SUFFIX,
    SEQ_CLOCK,
    SEQ_CLOCK_BYTES,
    SEQ_CLOCK_DTYPE,
    SEQ_CLOCK_ENTRIES,
    SITE_SIZE,
    STATUS_ERROR,
    STATUS_IN_FLIGHT,
    STATUS_OK,
    STEP,
    U64,
    VERSION,
    ring_filename,
)
from dtwatch.ring.reader import (
    GroupInfo,
    LoaderInfo,
    RankSnapshot,
    Record,
    RingFormatError,
    Site,
    find_rings,
    read_ring,
    read_rings,
    request_dump,
)
from dtwatch.ring.setup_facts import encode_facts, read_facts, write_facts
from dtwatch.ring.writer import (
    DEFAULT_CAPACITY,
    DEFAULT_GROUPS,
    DEFAULT_LOADERS,
    DEFAULT_MEMBERS,
    DEFAULT_SITES,
    RingWriter,
)

__all__ = [
    "COUNTS",
    "DEFAULT_CAPACITY",
    "DEFAULT_GROUPS",
    "DEFAULT_LOADERS",
    "DEFAULT_MEMBERS",
    "DEFAULT_SITES",
    "DTYPES",
    "DTYPE_CODES",
    "DTYPE_ITEMSIZE",
    "EXIT",
    "EXIT_CLEAN",
    "EXIT_DETACHED",
    "EXIT_EXCEPTION",
    "EXIT_RUNNING",
    "EXIT_SIGNAL",
    "EXIT_STATE_NAMES",
    "FACTS_CAPACITY",
    "FACTS_END",
    "FACTS_HEAD",
    "FACTS_OFFSET",
    "FLAG_ASYNC",
    "FLAG_COALESCED",
    "FLAG_ENQUEUED",
    "FLAG_HOOKED",
    "FLAG_MARKER",
    "FLAG_OBJECT",
    "FLAG_P2P",
    "GROUP_SIZE",
    "GroupInfo",
    "HEADER_SIZE",
    "HEARTBEAT",
    "I32",
    "LIVE_OFFSET",
    "LOADER_SIZE",
    "LoaderInfo",
    "MAGIC",
    "MAIN_SITE",
    "MAIN_STACK",
    "MAIN_STACK_DEPTH",
    "NUMEL_FROM_SHAPE",
    "OFF_COUNTS",
    "OFF_DUMP_ACK",
    "OFF_DUMP_REQUEST",
    "OFF_EXIT",
    "OFF_HEARTBEAT",
    "OFF_MAIN_SITE",
    "OFF_MAIN_STACK",
    "OFF_STACK_SIGNAL",
    "OFF_STEP",
    "OPS",
    "OP_CODES",
    "READABLE_VERSIONS",
    "RECORD_DTYPE",
    "RECORD_ENTRY_BY_NDIM",
    "RECORD_EXIT",
    "RECORD_EXIT_OFFSET",
    "RECORD_SIZE",
    "RING_SUFFIX",
    "RankSnapshot",
    "Record",
    "RingFormatError",
    "RingWriter",
    "SEQ_CLOCK",
    "SEQ_CLOCK_BYTES",
    "SEQ_CLOCK_DTYPE",
    "SEQ_CLOCK_ENTRIES",
    "SITE_SIZE",
    "STATUS_ERROR",
    "STATUS_IN_FLIGHT",
    "STATUS_OK",
    "STEP",
    "Site",
    "U64",
    "VERSION",
    "encode_facts",
    "find_rings",
    "read_facts",
    "read_ring",
    "read_rings",
    "request_dump",
    "ring_filename",
    "write_facts",
]
