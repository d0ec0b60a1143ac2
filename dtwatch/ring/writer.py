"""Writing a rank's ring, inside the training process. See :mod:`dtwatch.ring` for the format."""
from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from dtwatch.ops import OP_CODES
from dtwatch.ring.layout import (
    COUNTS,
    DTYPE_CODES,
    EXIT,
    FLAG_MARKER,
    GROUP,
    GROUP_COMPLETED,
    GROUP_COMPLETED_OFFSET,
    GROUP_CPP_OFFSET,
    GROUP_CPP_SEQ,
    GROUP_SIZE,
    HEADER_SIZE,
    HEARTBEAT,
    I32,
    LIVE,
    LOADER,
    LOADER_END,
    LOADER_END_OFFSET,
    LOADER_SIZE,
    LOADER_START,
    MAGIC,
    MAIN_SITE,
    MAIN_STACK,
    MAIN_STACK_DEPTH,
    MEMBER_DTYPE,
    NO_SEQ,
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
    RECORD,
    RECORD_ENTRY_BY_NDIM,
    RECORD_EXIT,
    RECORD_EXIT_OFFSET,
    RECORD_SIZE,
    SEQ_CLOCK,
    SEQ_CLOCK_BYTES,
    SEQ_CLOCK_COUNT,
    SEQ_CLOCK_ENTRIES,
    SITE,
    SITE_SIZE,
    STATIC,
    STATUS_OK,
    STEP,
    U64,
    VERSION,
    Layout,
)

DEFAULT_CAPACITY = 4096
DEFAULT_GROUPS = 64
DEFAULT_SITES = 1024
DEFAULT_LOADERS = 64
DEFAULT_MEMBERS = 16384

class RingWriter:
    """Creates and owns one rank's ring. Only the training process writes; tables are append-only.

    The hot path (``dtwatch.record.installation``) packs records straight into ``self.mm`` with the
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
        self.records_off = self.members_off + _round_up(members * MEMBER_DTYPE.itemsize, 4096)  # page-aligned
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
        STATIC.pack_into(
            self.mm, 0, magic=MAGIC, version=VERSION, header_size=HEADER_SIZE, record_size=RECORD_SIZE,
            capacity=capacity, groups_off=self.groups_off, groups_cap=groups, sites_off=self.sites_off,
            sites_cap=sites, loaders_off=self.loaders_off, loaders_cap=loaders, members_off=self.members_off,
            members_cap=members, records_off=self.records_off, seq_clock_off=self.seq_clock_off,
            rank=rank, local_rank=local_rank, world_size=world_size, pid=os.getpid(), start_time=self.start_time,
            host=_text(STATIC, "host", host), job_id=_text(STATIC, "job_id", job_id),
            torch_version=_text(STATIC, "torch_version", torch_version),
            backend=_text(STATIC, "backend", backend), restart_count=restart_count, device_index=device_index,
            gpu_uuid=_text(STATIC, "gpu_uuid", gpu_uuid),
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
                pool_off = self.members_off + MEMBER_DTYPE.itemsize * mstart
                np.frombuffer(self.mm, dtype=MEMBER_DTYPE, count=mcount, offset=pool_off)[:] = members
                self.members_used += mcount
            GROUP.pack_into(
                self.mm, self.groups_off + slot * GROUP_SIZE, name=_text(GROUP, "name", name),
                desc=_text(GROUP, "desc", desc), size=size, group_rank=group_rank, members_start=mstart,
                members_count=mcount, cpp_seq=0, cpp_seq_time=time.time(), completed_seq=0, completed_time=0.0,
                tracked=int(tracked),
            )
            self.n_groups += 1
            self._write_counts()
            return slot

    def set_group_cpp_seq(self, slot: int, seq: int, when: float) -> None:
        GROUP_CPP_SEQ.pack_into(self.mm, self.groups_off + slot * GROUP_SIZE + GROUP_CPP_OFFSET, seq, when)

    def add_seq_time(self, slot: int, seq: int, when: float) -> None:
        """The sequence clock: group ``slot`` was seen at ``seq`` at ``when`` (sampler thread only)."""
        i = self.seq_clock_count % SEQ_CLOCK_ENTRIES
        SEQ_CLOCK.pack_into(self.mm, self.seq_clock_off + SEQ_CLOCK_COUNT.size + i * SEQ_CLOCK.size, when, seq, slot)
        self.seq_clock_count += 1
        SEQ_CLOCK_COUNT.pack_into(self.mm, self.seq_clock_off, self.seq_clock_count)

    def set_group_completed(self, slot: int, seq: int, when: float) -> None:
        """A tracked group's collectives up to ``seq`` have completed (seen at ``when``)."""
        GROUP_COMPLETED.pack_into(self.mm, self.groups_off + slot * GROUP_SIZE + GROUP_COMPLETED_OFFSET, seq, when, 1)

    def add_site(self, filename: str, line: int, function: str) -> int:
        """Append a call site; returns its id (index + 1), or 0 when the table is full."""
        with self._lock:
            if self.n_sites >= self.sites_cap:
                return 0
            idx = self.n_sites
            SITE.pack_into(
                self.mm, self.sites_off + idx * SITE_SIZE, line=line, function=_text(SITE, "function", function),
                file=_text(SITE, "file", filename, keep_tail=True),
            )
            self.n_sites += 1
            self._write_counts()
            return idx + 1

    def add_loader(self, site: int, user_site: int = 0, ident: int = 0) -> int:
        with self._lock:
            if self.n_loaders >= self.loaders_cap:
                return -1
            idx = self.n_loaders
            LOADER.pack_into(self.mm, self.loaders_off + idx * LOADER_SIZE, site=site, user_site=user_site,
                             length=-1, epochs=0, time=0.0, step=0, ident=ident, made_site=0, seq_start=NO_SEQ,
                             ended=0, colls=0)
            self.n_loaders += 1
            self._write_counts()
            return idx

    def set_loader(self, idx: int, site: int, length: int, epochs: int, when: float, step: int,
                   user_site: int = 0, ident: int = 0, made_site: int = 0, seq_start: int = NO_SEQ) -> None:
        """An epoch of loader ``idx`` started (what its latest ended epoch issued stays: :meth:`set_loader_end`)."""
        LOADER_START.pack_into(self.mm, self.loaders_off + idx * LOADER_SIZE, site, user_site, length, epochs, when,
                               step, ident, made_site, seq_start)

    def set_loader_end(self, idx: int, epoch: int, colls: int) -> None:
        """Epoch ``epoch`` of loader ``idx`` ended; this rank issued ``colls`` collectives while its loop ran."""
        LOADER_END.pack_into(self.mm, self.loaders_off + idx * LOADER_SIZE + LOADER_END_OFFSET,
                             min(epoch, 0xFFFFFFFF), min(colls, 0xFFFFFFFF))

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
        EXIT.pack_into(self.mm, OFF_EXIT, state, code, time.time(), _text(LIVE, "exit_reason", reason))

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

    def last_call_seq(self, slot: int, newest_stamp: int, look_back: int = 64) -> int:
        """The last sequence number used by the newest recorded call (not a step marker) on group ``slot`` among
        the ``look_back`` records before ``newest_stamp`` (0: none there). Read by the sampler's thread while the
        training threads write: a record being written (its two stamps differ) is skipped."""
        oldest = max(1, newest_stamp - min(look_back, self.capacity) + 1)
        mm = self.mm
        for stamp in range(newest_stamp, oldest - 1, -1):
            off = self.records_off + ((stamp - 1) % self.capacity) * RECORD_SIZE
            first, seq, span, flags, group, second = _CALL_SEQ.unpack_from(mm, off)
            if first != stamp or second != stamp or flags & FLAG_MARKER or group != slot:
                continue
            return int(seq) + max(int(span), 1) - 1
        return 0

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


# What last_call_seq reads of a record, in one unpack (the other fields skipped): stamp, seq, seq_span, flags,
# group, stamp2.
_CALL_SEQ = RECORD.span(skip=[f.name for f in RECORD.fields
                              if f.name not in ("stamp", "seq", "seq_span", "flags", "group", "stamp2")])


def _text(layout: Layout, name: str, text: str, keep_tail: bool = False) -> bytes:
    """``text`` as UTF-8, cut to the size of text field ``name`` (keeping its tail: file names)."""
    size = layout.field(name).count
    data = text.encode("utf-8", "replace")
    if len(data) > size:
        data = data[-size:] if keep_tail else data[:size]
    return data


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align
