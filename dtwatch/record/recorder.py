"""The in-process recorder: one wrapper path for every ``torch.distributed`` collective.

``install()`` replaces each function listed in :mod:`dtwatch.ops` (in ``torch.distributed`` and
``torch.distributed.distributed_c10d``) with a wrapper made by :func:`_make_wrapper`. The wrapper writes
one fixed-size record into this rank's ring before calling the original and stamps its exit after;
nothing else happens on that path: no lock, no I/O, no allocation beyond a few small objects.
Work that can wait (heartbeat, C++ sequence numbers of DDP/FSDP-issued collectives, async completion
polling, Flight Recorder dumps) runs in :mod:`dtwatch.record.sampler`'s thread.

The recorder never changes arguments or results and never raises into the caller: a failure of its
own disables recording for that call and produces one warning per process.
"""
from __future__ import annotations

import atexit
import collections
import errno
import faulthandler
import functools
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtwatch import ring as ringfmt
from dtwatch.config import Config, run_dir
from dtwatch.ops import NOTHING, OBJECT, OP_KINDS, P2P_OPS, TENSOR, OpSpec, bind
from dtwatch.record.callsite import SiteTable
from dtwatch.record.completion import CompletionSource, completion_source, forget_all
from dtwatch.ring import (
    FLAG_ASYNC,
    FLAG_ENQUEUED,
    FLAG_MARKER,
    FLAG_OBJECT,
    FLAG_P2P,
    NUMEL_FROM_SHAPE,
    RECORD_ENTRY_BY_NDIM,
    RECORD_EXIT,
    RECORD_EXIT_OFFSET,
    RECORD_SIZE,
    STATUS_ERROR,
    STATUS_OK,
    RingWriter,
    ring_filename,
)

log = logging.getLogger("dtwatch")

NO_GROUP = 0xFFFF  # group slot of records that belong to no process group (step markers)

_DTYPE_CODES: dict[torch.dtype, int] = {}
for _name, _code in ringfmt.DTYPE_CODES.items():
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _DTYPE_CODES[_dt] = _code


class _ThreadState(threading.local):
    busy = False  # inside a composite call (object collective, batch p2p): inner calls not recorded


def _group_name(pg: Any) -> str:
    try:
        return dist.distributed_c10d._get_process_group_name(pg)
    except Exception:
        return str(getattr(pg, "group_name", "?"))


class TrackedGroup:
    """A group whose collectives return before they complete (NCCL, gloo_async): its completion source,
    and its calls that returned and have not been seen completed, in issue order."""

    __slots__ = ("slot", "source", "enqueued", "completed")

    def __init__(self, slot: int, source: CompletionSource) -> None:
        self.slot, self.source = slot, source
        # (last seq the call used, record offset, stamp, span); appended by the training thread after the
        # call returned, drained by the sampler (a deque: the two never race).
        self.enqueued: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self.completed = -1


class Recorder:
    """State of dtwatch inside one training process. Use :func:`dtwatch.install`, not this class."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.run_dir = run_dir(config)
        self.host = socket.gethostname()
        self.ring: RingWriter | None = None
        self.mm: Any = None
        self.records_off = 0
        self.capacity = 1
        self.sites: SiteTable | None = None
        self.site_positions: dict[tuple[int, int], tuple[int, int]] = {}
        # pg -> (slot, sequence-number reader, TrackedGroup or None); the wrappers' per-call lookup
        self.groups: dict[Any, tuple[int, Callable[[], int] | None, TrackedGroup | None]] = {}
        self.group_list: list[tuple[int, Any, Callable[[], int] | None]] = []  # for the sampler
        self.tracked: list[TrackedGroup] = []  # groups whose calls return before they complete
        self.default_pg: Any = None
        self.stamps = itertools.count(1)
        self.step = 0
        self.explicit_steps = False
        # Async work without a future: (works, record offset, stamp, span). Appended by training threads
        # (a deque: appends never race the sampler's drain), moved to ``polled`` and checked there.
        self.pending: collections.deque[tuple[list, int, int, int]] = collections.deque()
        self.polled: list[tuple[list, int, int, int]] = []
        self.poll_lock = threading.Lock()
        self.tls = _ThreadState()
        self.patched: list[tuple[Any, str, Any, Any]] = []  # (module/class, attr, original, wrapper)
        self.loader_index: dict[int, tuple[int, int]] = {}  # site -> (loader slot, epochs)
        self.sampler: Any = None
        self.stack_file: Any = None
        self.ending_files: list[Any] = []
        self.warned = False
        self.optimizer_hook: Any = None
        self.prev_excepthook: Any = None
        self.excepthook: Any = None
        self.lock = threading.Lock()
        self.attach_lock = threading.RLock()  # attach() runs from the main thread, torch's init, or the poll
        self.attaching = False
        self.failed_pg: Any = None  # the default group whose ring could not be created (not retried)
        self.probe: Any = None  # _UnattachedProbe while no ring exists
        self.poll: Any = None  # _DefaultGroupPoll while no ring exists
        self.stopped = threading.Event()  # set by uninstall()
        self.setup: Any = None  # SetupFacts: facts for the setup checks (dtwatch.record.setup_facts)

    # -- failure policy -----------------------------------------------------------------------------
    def fail(self, what: str, exc: BaseException | None = None) -> None:
        """dtwatch's own failure: one warning per process, never an exception into training code."""
        if not self.warned:
            self.warned = True
            warnings.warn(f"dtwatch: {what} failed ({exc!r}); recording may be incomplete", RuntimeWarning, stacklevel=3)
        log.debug("dtwatch: %s failed", what, exc_info=exc)

    # -- ring and groups (cold path) ------------------------------------------------------------------
    def attach(self) -> None:
        """Create this rank's ring once the default process group exists (again after a re-init).

        Called however that group came to be: from torch's own ``_update_default_pg`` (every
        ``init_process_group``, under any name it was imported by: ``init_device_mesh``, Lightning,
        Accelerate, DeepSpeed), from ``init_process_group``'s wrapper, on the first use of
        ``torch.distributed`` while no ring exists, from a background poll, and from ``install()``.
        Idempotent and thread-safe.
        """
        if self.mm is not None or not dist.is_available() or not dist.is_initialized():
            return
        with self.attach_lock:
            if self.mm is not None or self.stopped.is_set() or self.attaching:
                return  # attaching: re-entered through torch.distributed calls made while attaching
            self.attaching = True
            try:
                self._attach_locked()
            finally:
                self.attaching = False

    def _attach_locked(self) -> None:
        old = self.ring  # the default group was destroyed and created again: start a fresh ring
        pg = dist.distributed_c10d._get_default_group()
        if pg is self.failed_pg:
            return
        path = "?"
        try:
            rank, world = pg.rank(), pg.size()
            path = os.path.join(self.run_dir, ring_filename(rank))
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            device_index, gpu_uuid = _device_identity()
            ring = RingWriter(
                path, rank=rank, local_rank=local_rank,
                world_size=world, job_id=os.path.basename(self.run_dir), host=self.host,
                backend=_backend_name(pg), torch_version=torch.__version__,
                restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                device_index=device_index, gpu_uuid=gpu_uuid, capacity=self.config.ring_records,
            )
        except Exception as exc:  # noqa: BLE001 - any failure here must stay out of training
            self.failed_pg = pg  # not retried for this group; a new default group is tried again
            self._stop_watching_for_group()  # nothing more to learn from this group's collectives
            self.fail(f"creating this rank's ring {path} (this process is not watched by dtwatch)", exc)
            return
        if old is not None:
            old.close()
        self.sites = SiteTable(ring.add_site)
        self.site_positions = self.sites.positions  # read by the wrappers' fast path
        self.loader_index = {}
        self.records_off, self.capacity = ring.records_off, ring.capacity
        self.ring = ring
        self.default_pg = pg
        self.register_group(pg)
        # Published last: a wrapper that sees ``mm`` set finds everything else in place (the poll thread
        # may attach while the main thread calls a collective).
        self.mm = ring.mm
        if self.setup is not None:
            self.setup.attached()
        self._stop_watching_for_group()
        self._install_stack_dump()
        if self.config.allow_ptrace:
            _allow_ptrace(self)
        from dtwatch.record.sampler import Sampler

        self.sampler = Sampler(self)
        self.sampler.start()
        if self.config.watchdog == "auto" and local_rank == 0:
            from dtwatch.record.launcher import start_watchdog_async

            start_watchdog_async(self.run_dir, self.host, self.config.watchdog_args)

    def watch_for_group(self) -> None:
        """While no ring exists: attach on the first use of torch.distributed and from a 0.5 s poll."""
        if self.mm is not None or self.stopped.is_set():
            return
        with self.attach_lock:
            if self.probe is None:
                self.probe = _UnattachedProbe.install(self)
            if self.poll is None or not self.poll.is_alive():
                self.poll = _DefaultGroupPoll(self)
                self.poll.start()

    def _stop_watching_for_group(self) -> None:
        probe, self.probe = self.probe, None
        if probe is not None:
            probe.remove()
        # The poll thread sees ``mm`` set (or ``stopped``) and ends by itself.

    def detach(self) -> None:
        """Stop recording (default group destroyed, or uninstall); the ring keeps its last state."""
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler.sample_groups(time.time())  # C++-issued collectives since the last tick
            self.sampler = None
        self.poll_pending()  # async work already waited on: stamp it before recording stops
        self.poll_completions(time.time())
        # Cleared in place: the wrappers hold a reference to this dict.
        self.groups.clear()
        self.group_list, self.default_pg, self.tracked = [], None, []
        forget_all()
        self.mm = None  # wrappers pass straight through until attach() runs again

    def register_group(self, pg: Any) -> tuple[int, Callable[[], int] | None, TrackedGroup | None]:
        """Add ``pg`` to the ring's group table (first use or sampler discovery)."""
        with self.lock:
            known = self.groups.get(pg)
            if known is not None:
                return known
            seqfn = getattr(pg, "_get_sequence_number_for_group", None)
            try:
                seqfn()
            except Exception:
                seqfn = None  # e.g. not supported by this backend: records carry seq 0
            try:
                members = list(dist.get_process_group_ranks(pg))
                group_rank = dist.get_rank(pg)
            except Exception:
                if pg is self.default_pg:  # attached from inside init_process_group, before torch lists its ranks
                    members, group_rank = list(range(pg.size())), pg.rank()
                else:
                    members, group_rank = None, -1
            desc = str(getattr(pg, "group_desc", "") or "")
            name = _group_name(pg)
            source = completion_source(pg, _backend_name(pg), seqfn, name)
            slot = self.ring.add_group(name, desc, members, group_rank, tracked=source is not None) if self.ring else -1
            tracked = TrackedGroup(slot, source) if source is not None and slot >= 0 else None
            if tracked is not None:
                self.tracked.append(tracked)
            entry = (slot if slot >= 0 else NO_GROUP, seqfn, tracked)
            self.groups[pg] = entry
            if slot >= 0:
                self.group_list.append((slot, pg, seqfn))
            return entry

    # -- steps and loaders --------------------------------------------------------------------------
    def advance_step(self, explicit: bool) -> None:
        if explicit:
            self.explicit_steps = True
        elif self.explicit_steps or not self.config.auto_step:
            return
        self.step += 1
        ring, mm = self.ring, self.mm
        if ring is None or mm is None:
            if ring is None and self.setup is not None:
                self.setup.step_without_group(self.step)  # never raises
            return
        try:
            now = time.time()
            # The marker's seq is the default group's torch sequence number at the step: progress of jobs
            # whose collectives are issued from C++ (DDP, FSDP), one C++ read per step.
            slot, seqfn, _tracked = self.groups.get(self.default_pg, (NO_GROUP, None, None))
            ring.write_record(next(self.stamps), op="step", seq=seqfn() if seqfn is not None else 0, t_enter=now,
                              t_exit=now, seq_span=0, flags=FLAG_MARKER, ntensors=0, numel=0, group_slot=slot,
                              step=self.step)
            ring.set_step(self.step, now)
        except Exception as exc:  # noqa: BLE001
            self.fail("recording a step", exc)

    def loader_started(self, loader: Any) -> int:
        """Note an epoch of ``loader``; returns its slot in the ring's loader table (-1: none)."""
        if self.ring is None or self.sites is None:
            return -1
        try:
            length = len(loader)
        except Exception:
            length = -1
        frame = self.sites.code_frame(sys._getframe(2))  # the loop iterating it, a library's included
        site = self.sites.frame_site(frame) if frame is not None else 0
        slot, epochs = self.loader_index.get(site, (-1, 0))
        if slot < 0:
            slot = self.ring.add_loader(site)
            if slot < 0:
                return -1
        self.loader_index[site] = (slot, epochs + 1)
        self.ring.set_loader(slot, site, length, epochs + 1, time.time(), self.step)
        return slot

    # -- async completion -----------------------------------------------------------------------------
    def finish(self, off: int, stamp: int, status: int, span: int) -> None:
        """Stamp a record's exit, unless the ring has wrapped over it (or was detached) meanwhile."""
        mm = self.mm
        if mm is None:
            return
        try:
            if ringfmt.U64.unpack_from(mm, off)[0] == stamp:
                RECORD_EXIT.pack_into(mm, off + RECORD_EXIT_OFFSET, time.time(), span, status)
        except Exception as exc:  # noqa: BLE001
            self.fail("recording a completion", exc)

    def track_async(self, work: Any, off: int, stamp: int, span: int, use_future: bool = True) -> None:
        """Stamp the record when ``work`` completes: by its future, else polled by the sampler.
        ``use_future=False`` for NCCL, whose futures complete when the work is enqueued."""
        works = work if isinstance(work, (list, tuple)) else [work]
        if len(works) == 1 and use_future:
            try:
                fut = works[0].get_future()

                def done(f: Any) -> None:
                    try:
                        f.value()
                        status = STATUS_OK
                    except Exception:
                        status = STATUS_ERROR
                    self.finish(off, stamp, status, span)

                fut.add_done_callback(done)
                return
            except Exception:
                pass  # this Work type has no future (e.g. some p2p): the sampler polls it
        self.pending.append((works, off, stamp, span))

    def poll_pending(self) -> None:
        """Stamp async work that completed (sampler thread; also at detach and exit)."""
        with self.poll_lock:
            while self.pending:
                self.polled.append(self.pending.popleft())
            if not self.polled:
                return
            still = []
            for works, off, stamp, span in self.polled:
                try:
                    done = all(w is None or w.is_completed() for w in works)
                except Exception:
                    done = True
                if done:
                    self.finish(off, stamp, STATUS_OK, span)
                else:
                    still.append((works, off, stamp, span))
            self.polled = still

    def poll_completions(self, now: float) -> None:
        """Ask each tracked group what completed; stamp its calls up to there (sampler thread)."""
        ring = self.ring
        for tracked in list(self.tracked):
            try:
                done = tracked.source.completed(now)
            except Exception as exc:  # noqa: BLE001 - e.g. the group was destroyed meanwhile
                self.fail("reading which collectives completed", exc)
                continue
            if done is None:
                continue
            if done != tracked.completed and ring is not None:
                tracked.completed = done
                ring.set_group_completed(tracked.slot, done, now)
            queue = tracked.enqueued
            while queue and queue[0][0] <= done:
                _last_seq, off, stamp, span = queue.popleft()
                self.finish(off, stamp, STATUS_OK, span)

    # -- process end -------------------------------------------------------------------------------
    def on_exit(self) -> None:
        self.stopped.set()  # no attaching while the interpreter shuts down
        sampler = self.sampler
        if sampler is not None:
            try:
                # The sampler thread stops first: it must not touch process groups while the interpreter
                # and torch tear them down (a daemon thread inside torch then can abort the process).
                sampler.stop()
                sampler.sample_groups(time.time())  # C++-issued collectives since the last tick
                self.poll_pending()
                self.poll_completions(time.time())
            except Exception:
                pass
        ring = self.ring
        if ring is not None and ringfmt.EXIT.unpack_from(ring.mm, ringfmt.OFF_EXIT)[0] == ringfmt.EXIT_RUNNING:
            ring.set_exit(ringfmt.EXIT_CLEAN, 0, "process exited normally")

    def on_exception(self, exc_type: type, exc: BaseException, tb: Any) -> None:
        ring = self.ring
        if ring is None:
            return
        where = ""
        while tb is not None:
            where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
            tb = tb.tb_next
        ring.set_exit(ringfmt.EXIT_EXCEPTION, 1, f"{exc_type.__name__}: {exc}{where}")

    def _install_stack_dump(self) -> None:
        sig = self.config.stack_signal
        if not sig or self.ring is None or self.stack_file is not None:
            return
        try:
            if signal.getsignal(sig) not in (signal.SIG_DFL, None):
                log.warning("dtwatch: signal %s already has a handler; faulthandler stack dumps are off", sig)
                return
            path = os.path.join(self.run_dir, "stacks", f"rank-{dist.get_rank():05d}.txt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.stack_file = open(path, "a", buffering=1)
            faulthandler.register(sig, file=self.stack_file, all_threads=True, chain=False)
            self.ring.set_stack_signal(sig)
        except Exception as exc:  # noqa: BLE001
            self.fail("registering faulthandler", exc)
        self._record_endings()

    def _record_endings(self) -> None:
        """How this process ends when it cannot say so itself: faulthandler writes the fatal signal
        (SIGABRT from a gloo size check, SIGSEGV) and the Python stack to one file, and a SIGTERM (the
        launcher tearing the job down) to another, from C signal handlers that run even while the main
        thread is blocked in a collective. SIGTERM is chained to the handler that was there before."""
        from dtwatch.watchdog.stacks import ending_files

        if faulthandler.is_enabled():
            return  # the user's own faulthandler already reports fatal signals; leave it alone
        try:
            fatal, term = ending_files(self.run_dir, dist.get_rank())
            os.makedirs(os.path.dirname(fatal), exist_ok=True)
            self.ending_files = [open(fatal, "w"), open(term, "w")]
            faulthandler.enable(file=self.ending_files[0], all_threads=True)
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                faulthandler.register(signal.SIGTERM, file=self.ending_files[1], all_threads=False, chain=True)
        except Exception as exc:  # noqa: BLE001
            self.fail("registering faulthandler for fatal signals", exc)


def _allow_ptrace(rec: Recorder) -> None:
    """prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY): Yama then lets same-user processes (py-spy) attach."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_ptracer, ptracer_any = 0x59616D61, ctypes.c_ulong(-1)
        if libc.prctl(pr_set_ptracer, ptracer_any, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL:
                return  # no Yama in this kernel: ptrace is not restricted by it, nothing to allow
            raise OSError(err, "prctl(PR_SET_PTRACER) failed")
    except Exception as exc:  # noqa: BLE001 - not Linux, or no Yama: py-spy may still work
        rec.fail("allowing ptrace (DTWATCH_ALLOW_PTRACE)", exc)


def _device_identity() -> tuple[int, str]:
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            idx = torch.cuda.current_device()
            uuid = str(getattr(torch.cuda.get_device_properties(idx), "uuid", ""))
            return idx, uuid
        local = os.environ.get("LOCAL_RANK")
        if torch.cuda.is_available() and local is not None:
            return int(local) % max(torch.cuda.device_count(), 1), ""
    except Exception:
        pass
    return -1, ""


def _backend_name(pg: Any) -> str:
    try:
        return str(dist.get_backend(pg))
    except Exception:  # noqa: BLE001 - torch has not registered the group yet (inside init_process_group)
        try:
            return str(pg.name())
        except Exception:  # noqa: BLE001
            return "?"


class _UnattachedProbe:
    """Sees every use of ``torch.distributed`` while this process has no ring, and nothing once it has one.

    It wraps c10d's ``_rank_not_in_group``, which every collective (and ``get_rank(group)``) calls first,
    and is removed as soon as the ring exists, so it costs attached training nothing. On a call it
    attaches if a default process group exists by now (however it was created); if collectives run on
    a group while there is no default group (a ``ProcessGroup`` constructed directly), it says once
    that this process is not watched, and why.
    """

    NAME = "_rank_not_in_group"

    def __init__(self, rec: Recorder, original: Callable) -> None:
        self.rec, self.original = rec, original
        self.wrapper: Callable | None = None
        self.warned = False

    @classmethod
    def install(cls, rec: Recorder) -> _UnattachedProbe | None:
        c10d = dist.distributed_c10d
        original = getattr(c10d, cls.NAME, None)
        if original is None or getattr(original, "__dtwatch_probe__", False):
            return None  # another torch: the poll thread still attaches
        probe = cls(rec, original)

        @functools.wraps(original)
        def _rank_not_in_group(group: Any) -> bool:
            probe.seen(group)
            return original(group)

        _rank_not_in_group.__dtwatch_probe__ = True  # type: ignore[attr-defined]
        probe.wrapper = _rank_not_in_group
        setattr(c10d, cls.NAME, _rank_not_in_group)
        return probe

    def seen(self, group: Any) -> None:
        rec = self.rec
        try:
            if rec.mm is not None:
                return
            if dist.is_initialized():
                rec.attach()
            elif group is not None and not self.warned:
                self.warned = True
                warnings.warn(
                    "dtwatch: torch.distributed is used on a process group while no default process group "
                    "exists (the group was constructed directly, not by init_process_group or "
                    "init_device_mesh); dtwatch records a job once its default process group exists, so "
                    "this process is not watched", RuntimeWarning, stacklevel=_caller_level())
        except Exception as exc:  # noqa: BLE001
            rec.fail("attaching on first use", exc)

    def remove(self) -> None:
        c10d = dist.distributed_c10d
        if getattr(c10d, self.NAME, None) is self.wrapper:
            setattr(c10d, self.NAME, self.original)


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["dtwatch"]))


def _caller_level() -> int:
    """``stacklevel`` for a warning raised here that names the first frame outside torch and dtwatch."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


class _DefaultGroupPoll(threading.Thread):
    """Attaches within ``INTERVAL`` of the default group appearing, for jobs that never call a Python
    collective (DDP-only: their collectives are issued from C++) on torches without the c10d hook."""

    INTERVAL = 0.5

    def __init__(self, rec: Recorder) -> None:
        super().__init__(name="dtwatch-attach", daemon=True)
        self.rec = rec

    def run(self) -> None:
        rec = self.rec
        while rec.mm is None and not rec.stopped.wait(self.INTERVAL):
            try:
                rec.attach()
            except Exception as exc:  # noqa: BLE001
                rec.fail("attaching from the poll", exc)
                return


def _make_wrapper(rec: Recorder, original: Callable, spec: OpSpec) -> Callable:
    """The one recording path. Everything specific to an op is in ``spec``, bound here once."""
    op, payload, flags = spec.code, spec.kind.payload, spec.kind.flags
    ppos, pname = spec.payload_pos, spec.kind.payload_arg
    gpos, apos, peer_pos, peer_name = spec.group_pos, spec.async_pos, spec.peer_pos, spec.kind.peer_arg
    always_async, composite, spans = spec.kind.always_async, spec.kind.composite, spec.spans_several
    is_p2p = bool(flags & FLAG_P2P)
    # Which synchronous calls return before completing on a tracked group: collectives, except a barrier
    # (it blocks the CPU on NCCL too) and object collectives (they copy the result to the CPU, which
    # synchronises). Synchronous p2p ops are stamped when they return: their completion is not tracked.
    tracked_sync = not (is_p2p or flags & FLAG_OBJECT or spec.name in ("barrier", "monitored_barrier"))
    tls, groups, dtypes = rec.tls, rec.groups, _DTYPE_CODES
    entries, exit_pack, now, getframe = RECORD_ENTRY_BY_NDIM, RECORD_EXIT.pack_into, time.time, sys._getframe

    @functools.wraps(original)
    def dtwatch_recorded(*args: Any, **kwargs: Any) -> Any:
        mm = rec.mm
        if mm is None or tls.busy:
            return original(*args, **kwargs)
        off = -1
        try:
            nargs = len(args)
            group = args[gpos] if 0 <= gpos < nargs else kwargs.get("group")
            ntensors, peer = 1, -1
            if payload == TENSOR:
                t = args[ppos] if ppos < nargs else kwargs.get(pname)
                shape = t.shape
                ndim, dt = len(shape), dtypes.get(t.dtype, 0)
                numel = NUMEL_FROM_SHAPE if ndim <= 4 else t.numel()  # the reader derives it from the dims
            elif payload == NOTHING:
                shape, ndim, numel, dt = (), 0, 0, 0
            elif payload == OBJECT:
                shape, ndim, numel, dt = (), 0, -1, 0
            else:  # TENSOR_LIST / P2P_OPS: describe the first, count them all
                items = args[ppos] if ppos < nargs else kwargs.get(pname)
                ntensors = len(items)
                if payload == P2P_OPS:
                    ts = [x.tensor for x in items]
                    if items:
                        group = items[0].group  # batch_isend_irecv runs on its ops' group
                else:
                    ts = items
                shape = ts[0].shape if ts else ()
                ndim, dt = len(shape), dtypes.get(ts[0].dtype, 0) if ts else 0
                numel = sum(x.numel() for x in ts)
            if peer_pos >= 0:
                p = args[peer_pos] if peer_pos < nargs else kwargs.get(peer_name)
                peer = p if p is not None else -1
            if ndim > 4:
                shape = tuple(shape[:4])
            if group is None:
                group = rec.default_pg
            ginfo = groups.get(group)
            if ginfo is None:
                ginfo = rec.register_group(group)
            slot, seqfn, tracked = ginfo
            seq0 = seqfn() if seqfn is not None else 0
            is_async = always_async or (apos >= 0 and bool(args[apos] if apos < nargs else kwargs.get("async_op")))
            # On a tracked group (NCCL) a synchronous collective returns before it completes; its record
            # stays in flight until the group's completions pass it (see dtwatch.record.completion).
            enqueued = tracked is not None and tracked_sync and not is_async
            # Call sites (see dtwatch.record.callsite): a direct call from user code is one dict hit giving both
            # the site and the user's site (the same line); a call from inside torch (FSDP) or a library
            # (Lightning, Accelerate) walks out to the first frame outside torch/dtwatch and to the first
            # user frame.
            caller = getframe(1)
            sites = rec.site_positions.get((id(caller.f_code), caller.f_lasti))
            if sites is None:
                sites = rec.sites.frame_sites(caller)
            del caller
            site, user_site = sites
            stamp = next(rec.stamps)
            off = rec.records_off + ((stamp - 1) % rec.capacity) * RECORD_SIZE
            entries[ndim if ndim < 4 else 4].pack_into(
                mm, off, stamp, seq0 + 1, now(), op, dt, ndim if ndim < 256 else 255,
                flags | FLAG_ASYNC if is_async else flags | FLAG_ENQUEUED if enqueued else flags, ntensors if ntensors < 256 else 255, slot, site,
                rec.step, numel, peer, *shape, user_site, stamp,
            )
        except Exception as exc:  # noqa: BLE001 - recording must never break the collective
            rec.fail(f"recording {spec.name}", exc)
            off = -1
        if composite:
            tls.busy = True
        try:
            result = original(*args, **kwargs)
        except BaseException:
            if off >= 0:
                rec.finish(off, stamp, STATUS_ERROR, 1)
            raise
        finally:
            if composite:
                tls.busy = False
        if off >= 0:
            try:
                span = seqfn() - seq0 if spans and seqfn is not None else 1
                if is_async:
                    if result is None:  # not a member of the group: nothing was issued
                        rec.finish(off, stamp, STATUS_OK, span)
                    elif tracked is not None and not is_p2p:  # completes when the group's watermark passes it
                        tracked.enqueued.append((seq0 + span, off, stamp, span))
                    else:
                        rec.track_async(result, off, stamp, span, use_future=tracked is None)
                elif enqueued:
                    tracked.enqueued.append((seq0 + span, off, stamp, span))
                else:
                    exit_pack(mm, off + RECORD_EXIT_OFFSET, now(), span, STATUS_OK)
            except Exception as exc:  # noqa: BLE001
                rec.fail(f"recording the end of {spec.name}", exc)
        return result

    dtwatch_recorded.__dtwatch_original__ = original  # type: ignore[attr-defined]
    return dtwatch_recorded


# ---------------------------------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------------------------------
_ACTIVE: Recorder | None = None
_INSTALL_LOCK = threading.Lock()


def active() -> Recorder | None:
    return _ACTIVE


def _patch(rec: Recorder, owner: Any, attr: str, wrapper: Any) -> None:
    original = getattr(owner, attr)
    setattr(owner, attr, wrapper)
    rec.patched.append((owner, attr, original, wrapper))


def install(**options: Any) -> bool:
    """Start recording in this process. Idempotent; returns False if dtwatch was already installed.

    Options (each also ``DTWATCH_<NAME>`` in the environment; arguments win): see :class:`Config`.
    Safe without torchrun and before ``init_process_group``: the ring is created when the default
    process group appears.
    """
    global _ACTIVE
    config = Config.from_env(**options)  # raises ConfigError on a bad argument
    with _INSTALL_LOCK:
        if _ACTIVE is not None:
            warnings.warn("dtwatch.install() called twice; keeping the first installation", RuntimeWarning, stacklevel=2)
            return False
        if not dist.is_available():
            log.warning("dtwatch: torch.distributed is not available in this torch build; nothing to record")
            return False
        rec = Recorder(config)
        _apply_env(rec)
        c10d = dist.distributed_c10d
        for name in OP_KINDS:
            original = getattr(c10d, name, None)
            if original is None or getattr(original, "__dtwatch_original__", None) is not None:
                continue
            spec = bind(name, original)
            if spec is None:
                log.warning("dtwatch: torch.distributed.%s has an unexpected signature; not recorded", name)
                continue
            wrapper = _make_wrapper(rec, original, spec)
            _patch(rec, c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                _patch(rec, dist, name, wrapper)
        _patch_lifecycle(rec)
        _patch_iteration(rec)
        try:
            from dtwatch.record.wraps import start_setup_facts

            rec.setup = start_setup_facts(rec, functools.partial(_patch, rec))
        except Exception as exc:  # noqa: BLE001
            rec.fail("hooking setup functions (DDP/FSDP wraps, set_device)", exc)
        rec.prev_excepthook = sys.excepthook

        def excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
            try:
                rec.on_exception(exc_type, exc, tb)
            except Exception:
                pass
            rec.prev_excepthook(exc_type, exc, tb)

        rec.excepthook = excepthook
        sys.excepthook = excepthook
        atexit.register(rec.on_exit)
        _ACTIVE = rec
        rec.attach()  # no-op until the default process group exists
        rec.watch_for_group()  # no-op once attached
        return True


def uninstall() -> bool:
    """Stop recording and restore every patched function (only where it is still dtwatch's)."""
    global _ACTIVE
    with _INSTALL_LOCK:
        rec = _ACTIVE
        if rec is None:
            return False
        rec.stopped.set()
        rec._stop_watching_for_group()
        for owner, attr, original, wrapper in reversed(rec.patched):
            if getattr(owner, attr, None) is wrapper:
                setattr(owner, attr, original)
            else:
                log.warning("dtwatch: %s.%s was replaced by someone else; leaving it", getattr(owner, "__name__", owner), attr)
        rec.patched.clear()
        if rec.optimizer_hook is not None:
            rec.optimizer_hook.remove()
        if sys.excepthook is rec.excepthook:
            sys.excepthook = rec.prev_excepthook
        atexit.unregister(rec.on_exit)
        if rec.config.stack_signal and rec.stack_file is not None:
            try:
                faulthandler.unregister(rec.config.stack_signal)
            except Exception:
                pass
        if rec.ending_files:
            try:
                faulthandler.disable()
                faulthandler.unregister(signal.SIGTERM)
            except Exception:
                pass
        rec.detach()
        if rec.setup is not None:
            rec.setup.close()
        if rec.ring is not None:
            rec.ring.set_exit(ringfmt.EXIT_DETACHED, 0, "dtwatch uninstalled")
        rec.mm = None
        _ACTIVE = None
        return True


def _apply_env(rec: Recorder) -> None:
    if not rec.config.torch_env:
        return
    from dtwatch.record.torchenv import apply_torch_env

    prefix = os.path.join(rec.run_dir, "fr", "torch-fr-rank-")
    initialised = dist.is_initialized()
    changes = apply_torch_env(rec.config.fr_buffer_size, prefix)
    if initialised and changes:
        log.warning(
            "dtwatch: installed after init_process_group; these settings apply only to process groups "
            "created from now on, not to the existing ones: %s. Import dtwatch.auto (or call "
            "dtwatch.install()) before init_process_group.", ", ".join(c.split("=", 1)[0] for c in changes),
        )
    elif changes:
        try:
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
        except OSError:
            pass


def _patch_lifecycle(rec: Recorder) -> None:
    """Attach when the default process group appears and detach when it goes, by whatever route.

    ``_update_default_pg`` is the c10d function every creation and destruction of the default group
    passes through, called by its module-global name, so hooking it covers callers that imported
    ``init_process_group`` by name before dtwatch was installed (``torch.distributed.device_mesh``).
    The public ``init_process_group`` / ``destroy_process_group`` are wrapped as well: on a torch
    without that hook they are the route, and ``destroy`` must stop the sampler before the groups go.
    """
    c10d = dist.distributed_c10d
    init_original = c10d.init_process_group
    destroy_original = c10d.destroy_process_group
    update_original = getattr(c10d, "_update_default_pg", None)

    @functools.wraps(init_original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = init_original(*args, **kwargs)
        try:
            rec.attach()
        except Exception as exc:  # noqa: BLE001
            rec.fail("attaching after init_process_group", exc)
        return result

    @functools.wraps(destroy_original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = args[0] if args else kwargs.get("group")
        if group is None or group is rec.default_pg:
            rec.detach()  # stop sampling groups that are going away
        else:
            with rec.lock:
                entry = rec.groups.pop(group, None)
                if entry is not None:
                    rec.group_list = [g for g in rec.group_list if g[1] is not group]
                    rec.tracked = [t for t in rec.tracked if t is not entry[2]]
        result = destroy_original(*args, **kwargs)
        try:
            rec.watch_for_group()  # a job may create its default group again
        except Exception as exc:  # noqa: BLE001
            rec.fail("watching for a new process group", exc)
        return result

    for owner in (c10d, dist):
        if getattr(owner, "init_process_group", None) is init_original:
            _patch(rec, owner, "init_process_group", init_process_group)
        if getattr(owner, "destroy_process_group", None) is destroy_original:
            _patch(rec, owner, "destroy_process_group", destroy_process_group)

    if update_original is not None:
        @functools.wraps(update_original)
        def _update_default_pg(pg: Any) -> Any:
            result = update_original(pg)
            try:
                if pg is not rec.default_pg and rec.mm is not None:
                    rec.detach()  # destroyed, or replaced (shrink): the old group's ring ends here
                if pg is None:
                    rec.watch_for_group()
                else:
                    rec.attach()
            except Exception as exc:  # noqa: BLE001
                rec.fail("following the default process group", exc)
            return result

        _patch(rec, c10d, "_update_default_pg", _update_default_pg)


def _patch_iteration(rec: Recorder) -> None:
    from torch.utils.data import DataLoader

    iter_original = DataLoader.__iter__

    @functools.wraps(iter_original)
    def __iter__(self: Any) -> Any:
        slot = -1
        try:
            slot = rec.loader_started(self)
        except Exception as exc:  # noqa: BLE001
            rec.fail("recording a DataLoader epoch", exc)
        iterator = iter_original(self)
        if slot >= 0 and rec.setup is not None:
            try:
                rec.setup.loader_epoch(self, slot, iterator)  # sampler facts; first batch fingerprinted
            except Exception as exc:  # noqa: BLE001
                rec.fail("noting a DataLoader's setup", exc)
        return iterator

    _patch(rec, DataLoader, "__iter__", __iter__)
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        rec.optimizer_hook = register_optimizer_step_post_hook(lambda *_: rec.advance_step(explicit=False))
    except Exception as exc:  # noqa: BLE001
        rec.fail("hooking optimizer steps", exc)


def step() -> None:
    """Mark the end of a training step (turns off counting optimizer steps for this process)."""
    rec = _ACTIVE
    if rec is not None:
        rec.advance_step(explicit=True)
