"""The :class:`Recorder`: dtwatch's state inside one training process, and its cold paths.

It creates this rank's ring when the default process group appears (:meth:`Recorder.attach`, however
that group came to be) and stops at its end (:meth:`Recorder.detach`); registers process groups in the
ring's group table; writes step markers and DataLoader epochs; stamps the exits of calls that completed
after they returned (:mod:`dtwatch.record.inflight`); hands setup events to its ``SetupFacts``
(:mod:`dtwatch.record.setup_probe`, which sees it as a ``SetupHost``); and writes down how the process
ended (:mod:`dtwatch.record.endings`). The per-call path is :mod:`dtwatch.record.wrapper`; installing it into
``torch.distributed`` is :mod:`dtwatch.record.installation`'s. The background :class:`Sampler` sees the
recorder only as a :class:`~dtwatch.record.sampling_thread.SamplerHost`.
"""
from __future__ import annotations

import errno
import functools
import itertools
import logging
import mmap
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from dtwatch.code_paths import site_file
from dtwatch.config import Config, run_dir
from dtwatch.record.attaching import DefaultGroupPoll, UnattachedProbe
from dtwatch.record.callsite import SiteTable
from dtwatch.record.completion import completion_source, forget_all
from dtwatch.record.data_samplers import LoaderMakes, LoaderRun, LoaderSlot
from dtwatch.record.endings import SignalFiles, exception_facts, exception_summary, write_exit_facts
from dtwatch.record.hooks import CollectiveHooks
from dtwatch.record.hooks import available as hooks_available
from dtwatch.record.inflight import PendingWork, TrackedGroup, poll_tracked
from dtwatch.record.sampling_thread import SampledGroup, Sampler
from dtwatch.ring import (
    EXIT,
    EXIT_CLEAN,
    EXIT_EXCEPTION,
    EXIT_RUNNING,
    FLAG_MARKER,
    OFF_EXIT,
    RECORD_EXIT,
    RECORD_EXIT_OFFSET,
    STATUS_ERROR,
    STATUS_OK,
    U64,
    RingWriter,
    ring_filename,
)
from dtwatch.ring.layout import NO_SEQ

if TYPE_CHECKING:
    from dtwatch.record.setup_probe import SetupFacts

log = logging.getLogger("dtwatch")

NO_GROUP = 0xFFFF  # group slot of records that belong to no process group (step markers)

SeqReader = Callable[[], int]  # a process group's C++ sequence number (collectives it issued)
GroupEntry = tuple[int, SeqReader | None, TrackedGroup | None]  # (ring slot or NO_GROUP, reader, tracked)
ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


class ThreadState(threading.local):
    busy = False  # inside a composite call (object collective, batch p2p): inner calls not recorded


def _no_site(filename: str, line: int, function: str) -> int:
    return 0  # before the ring exists no call is recorded, so no site is ever asked for


class Recorder:
    """State of dtwatch inside one training process. Use :func:`dtwatch.install`, not this class."""

    def __init__(self, config: Config, fastpath: ModuleType | None = None) -> None:
        self.config = config
        self.run_dir = run_dir(config)
        self.host = socket.gethostname()
        self.ring: RingWriter | None = None
        self.mm: mmap.mmap | None = None  # the ring's mapping: set last at attach, None when not recording
        self.records_off = 0
        self.capacity = 1
        self.sites = SiteTable(_no_site)  # the ring's own from attach on
        self.site_positions: dict[tuple[int, int], tuple[int, int]] = {}
        # pg -> (slot, sequence-number reader, TrackedGroup or None); the wrappers' per-call lookup
        self.groups: dict[Any, GroupEntry] = {}
        self.group_list: list[SampledGroup] = []  # groups with a ring slot, for the sampler
        self.tracked: list[TrackedGroup] = []  # groups whose calls return before they complete
        self.default_pg: Any = None
        # The native path's view of the ring (dtwatch.record.native), whose stamp counter every writer then shares.
        self.fastpath = fastpath
        self.native: Any = fastpath.State() if fastpath is not None else None
        self.stamps: Iterator[int] = self.native if self.native is not None else itertools.count(1)
        self.step = 0
        self.explicit_steps = False
        self.pending = PendingWork()  # async work without a future, polled off the training thread
        self.tls = ThreadState()
        self.patched: list[tuple[Any, str, Any, Any]] = []  # (module/class, attr, original, wrapper)
        # This ring's loader table: (loader identity, loop site, user site) -> its entry (see loader_started).
        self.loader_index: dict[tuple[int, int, int], LoaderSlot] = {}
        self.loader_makes = LoaderMakes()  # where each DataLoader was made (DataLoader.__init__)
        self.loader_runs: dict[int, LoaderRun] = {}  # id(iterator) -> the epoch it iterates, until its loop ends
        self.loader_pending: LoaderRun | None = None  # started, its iterator not made yet
        self.sampler: Sampler | None = None
        self.signal_files = SignalFiles()
        self.warned = False
        self.optimizer_hook: RemovableHandle | None = None
        self.prev_excepthook: ExceptHook = sys.excepthook
        self.excepthook: ExceptHook | None = None
        self.lock = threading.Lock()
        self.attach_lock = threading.RLock()  # attach() runs from the main thread, torch's init, or the poll
        self.attaching = False
        self.failed_pg: Any = None  # the default group whose ring could not be created (not retried)
        self.probe: UnattachedProbe | None = None  # while no ring exists
        self.poll: DefaultGroupPoll | None = None  # while no ring exists
        self.stopped = threading.Event()  # set by uninstall()
        self.setup: SetupFacts | None = None  # facts for the setup checks (dtwatch.record.setup_probe)
        self.rank = -1  # this process's rank in the default group (from attach on)
        self.pid = os.getpid()  # a forked child (a DataLoader worker) has another: its exits are not ours
        self.exit_call: dict | None = None  # the latest sys.exit() of this process (its atexit tells it)
        self.unnumbered: set[str] = set()  # backends whose groups report no sequence number (warned once each)
        # torch's collective hooks on every group, where this torch has them and they are not switched off
        self.hooks: CollectiveHooks | None = (
            CollectiveHooks(self) if config.collective_hooks == "auto" and hooks_available() else None
        )

    # -- failure policy -----------------------------------------------------------------------------
    def fail(self, what: str, exc: BaseException | None = None) -> None:
        """dtwatch's own failure: one warning per process, never an exception into training code."""
        if not self.warned:
            self.warned = True
            warnings.warn(f"dtwatch: {what} failed ({exc!r}); recording may be incomplete", RuntimeWarning,
                          stacklevel=3)
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
                backend=backend_name(pg), torch_version=torch.__version__,
                restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                device_index=device_index, gpu_uuid=gpu_uuid, capacity=self.config.ring_records,
            )
        except Exception as exc:  # noqa: BLE001 - any failure here must stay out of training
            self.failed_pg = pg  # not retried for this group; a new default group is tried again
            self.stop_watching_for_group()  # nothing more to learn from this group's collectives
            self.fail(f"creating this rank's ring {path} (this process is not watched by dtwatch)", exc)
            return
        if old is not None:
            if self.native is not None:
                self.native.detach()  # the native wrappers let go of the old mapping before it is closed
            old.close()
        self.sites = SiteTable(ring.add_site)
        self.site_positions = self.sites.positions  # read by the wrappers' fast path
        self.loader_index = {}
        self.records_off, self.capacity = ring.records_off, ring.capacity
        self.ring = ring
        self.rank, self.pid = rank, os.getpid()
        self.default_pg = pg
        self.register_group(pg)
        # Published last: a wrapper that sees ``mm`` set finds everything else in place (the poll thread
        # may attach while the main thread calls a collective).
        if self.native is not None:
            try:
                self.native.default_pg = pg
                self.native.attach(ring.mm, ring.records_off, ring.capacity)
            except Exception as exc:  # noqa: BLE001 - the native wrappers then pass calls through unrecorded
                self.fail("attaching the native recording path to the ring", exc)
        self.mm = ring.mm
        if self.setup is not None:
            self.setup.attached()  # never raises
        self.stop_watching_for_group()
        self.signal_files.install(self.config.stack_signal, self.run_dir, rank, ring.set_stack_signal, self.fail)
        if self.config.allow_ptrace:
            _allow_ptrace(self)
        self.sampler = Sampler(self, ring, self.sites, self.run_dir, self.config.sample_interval,
                               self.config.seq_clock_interval)
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
                self.probe = UnattachedProbe.install(self)
            if self.poll is None or not self.poll.is_alive():
                self.poll = DefaultGroupPoll(self)
                self.poll.start()

    def stop_watching_for_group(self) -> None:
        probe, self.probe = self.probe, None
        if probe is not None:
            probe.remove()
        # The poll thread sees ``mm`` set (or ``stopped``) and ends by itself.

    def detach(self) -> None:
        """Stop recording (default group destroyed, or uninstall); the ring keeps its last state."""
        if self.sampler is not None:
            self.sampler.close()  # stopped, then one last sample of the groups
            self.sampler = None
        self.complete_finished_work(time.time())  # async work already waited on: stamp it before recording stops
        # Cleared in place: the wrappers hold a reference to this dict.
        self.groups.clear()
        self.group_list, self.default_pg, self.tracked = [], None, []
        forget_all()
        self.mm = None  # wrappers pass straight through until attach() runs again
        if self.native is not None:
            self.native.detach()
            self.native.default_pg = None

    def register_group(self, pg: Any) -> GroupEntry:
        """Add ``pg`` to the ring's group table (first use or sampler discovery)."""
        with self.lock:
            known = self.groups.get(pg)
            if known is not None:
                return known
            seqfn: SeqReader | None = getattr(pg, "_get_sequence_number_for_group", None)
            try:
                if seqfn is not None:
                    seqfn()
            except Exception as exc:  # noqa: BLE001 - not supported by this backend: records carry seq 0
                seqfn = None
                backend = backend_name(pg)
                if backend not in self.unnumbered and backend != "fake":  # fake: torch's test backend
                    self.unnumbered.add(backend)
                    log.warning("dtwatch: %s process groups do not report their sequence number (%s); their "
                                "collectives are recorded unnumbered, so the diagnosis cannot line the ranks' calls "
                                "up by number on them", backend, str(exc).splitlines()[0][:160] if str(exc) else
                                type(exc).__name__)
            try:
                members: list[int] | None = list(dist.get_process_group_ranks(pg))
                group_rank = dist.get_rank(pg)
            except Exception:  # noqa: BLE001 - torch cannot list them (yet)
                if pg is self.default_pg:  # attached from inside init_process_group, before torch lists its ranks
                    members, group_rank = list(range(pg.size())), pg.rank()
                else:
                    members, group_rank = None, -1
            desc = str(getattr(pg, "group_desc", "") or "")
            name = group_name(pg)
            source = completion_source(pg, backend_name(pg), seqfn, name)
            slot = self.ring.add_group(name, desc, members, group_rank, tracked=source is not None) if self.ring else -1
            tracked = TrackedGroup(slot, source) if source is not None and slot >= 0 else None
            if tracked is not None:
                self.tracked.append(tracked)
            entry = (slot if slot >= 0 else NO_GROUP, seqfn, tracked)
            self.groups[pg] = entry
            if slot >= 0:
                self.group_list.append((slot, pg, seqfn))
        # torch wants hooks registered at set-up, never while another thread issues collectives on the group
        # (an unlocked std::map): new groups get them as c10d registers them (recorder._patch_group_creation);
        # a group that existed before dtwatch was installed gets them here on the main thread only, never
        # from the sampler's or the attach poll's thread.
        if self.hooks is not None and threading.current_thread() is threading.main_thread():
            self.hooks.add(pg)
        return entry

    def forget_group(self, pg: Any) -> None:
        """``pg`` (not the default group) is being destroyed: stop sampling and tracking it."""
        with self.lock:
            entry = self.groups.pop(pg, None)
            if entry is not None:
                self.group_list = [g for g in self.group_list if g[1] is not pg]
                self.tracked = [t for t in self.tracked if t is not entry[2]]
        if self.hooks is not None:
            self.hooks.remove(pg)

    # -- what the sampler uses (dtwatch.record.sampling_thread.SamplerHost) --------------------------------------
    def sampled_groups(self) -> list[SampledGroup]:
        return list(self.group_list)

    def register_groups(self, pgs: Iterable[Any]) -> None:
        for pg in pgs:
            if pg not in self.groups:
                try:
                    self.register_group(pg)
                except Exception:  # noqa: BLE001 - e.g. a group being destroyed: it is not recorded
                    continue

    def complete_finished_work(self, now: float) -> None:
        """Stamp the exits of calls handed over to :mod:`dtwatch.record.inflight` that completed (the
        sampler's tick; detach and exit once the sampler has stopped)."""
        self.pending.poll(self.finish)
        poll_tracked(list(self.tracked), now, self.ring, self.finish, self.fail)

    # -- steps and loaders --------------------------------------------------------------------------
    def advance_step(self, explicit: bool) -> None:
        if explicit:
            self.explicit_steps = True
        elif self.explicit_steps or not self.config.auto_step:
            return
        self.step += 1
        if self.native is not None:
            self.native.step = self.step
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
        """Note an epoch of ``loader``; returns its slot in the ring's loader table (-1: none).

        A slot is one loader (its identity across ranks: :class:`~dtwatch.record.data_samplers.LoaderMakes`) at
        one loop: a training and an evaluation loader iterated by one ``_run_epoch(loader)`` are two. Its
        entry says what the watchdog needs to tell whether the loop issues collectives: the default group's
        sequence number now, and, when a loop ends, how many collectives the rank issued while it ran."""
        ring = self.ring
        if ring is None:
            return -1
        try:
            length = len(loader)
        except Exception:  # noqa: BLE001 - an iterable dataset has no length
            length = -1
        frame = self.sites.code_frame(sys._getframe(2))  # the loop iterating it, a library's included
        site = self.sites.frame_site(frame) if frame is not None else 0
        # A library's loop (Accelerate's DataLoaderShard.__iter__) iterates every loader of the job: the
        # user's line that led there is part of where it is iterated.
        user = self.sites.user_frame(frame)
        user_site = self.sites.frame_site(user) if user is not None and user is not frame else 0
        del frame, user
        made = self.loader_makes.made(loader)
        entry = self.loader_index.get((made.ident, site, user_site))
        if entry is None:
            slot = ring.add_loader(site, user_site, made.ident)
            if slot < 0:
                return -1
            entry = self.loader_index[(made.ident, site, user_site)] = LoaderSlot(slot)
        shown = self.loader_makes.shown_frame(made)  # may change as more loaders are made at its line
        if shown != entry.shown:
            entry.shown, entry.made_site = shown, ring.add_site(site_file(shown[0]), *shown[1:]) if shown else 0
        entry.epochs += 1
        clock = self.loader_clock()
        ring.set_loader(entry.slot, site, length, entry.epochs, time.time(), self.step, user_site, made.ident,
                        entry.made_site, clock[0])
        self.loader_pending = LoaderRun(ring, entry, entry.epochs, clock)
        return entry.slot

    def loader_iterating(self, iterator: Any) -> None:
        """The epoch just started iterates ``iterator``: its loop ends when the iterator runs out
        (:meth:`loader_exhausted`) or the loop lets go of it (``break``; a weak reference's callback)."""
        run, self.loader_pending = self.loader_pending, None
        if run is None:
            return
        key = id(iterator)
        try:
            run.ref = weakref.ref(iterator, functools.partial(self._loader_let_go, key))
        except TypeError:  # a subclass's own iterator without weak references: its loop's end is not seen
            return
        self.loader_runs[key] = run  # persistent workers: the same iterator again, its previous epoch left

    def loader_exhausted(self, iterator: Any) -> None:
        """``iterator`` raised StopIteration: its epoch's loop ran out of batches. Never raises."""
        try:
            run = self.loader_runs.pop(id(iterator), None)
            if run is not None:
                self._loader_ended(run)
        except Exception as exc:  # noqa: BLE001
            self.fail("noting the end of a DataLoader epoch", exc)

    def _loader_let_go(self, key: int, ref: weakref.ref) -> None:
        try:
            run = self.loader_runs.get(key)
            if run is not None and run.ref is ref and self.loader_runs.pop(key, None) is run:
                self._loader_ended(run)
        except Exception as exc:  # noqa: BLE001 - a weak reference's callback: nothing may escape it
            self.fail("noting the end of a DataLoader epoch", exc)

    def _loader_ended(self, run: LoaderRun) -> None:
        entry = run.entry
        if run.ring is not self.ring or run.epoch <= entry.ended:
            return  # a ring since replaced, or a later epoch of this slot ended first
        entry.ended = run.epoch
        _default, seqs, py = self.loader_clock()
        _default0, seqs0, py0 = run.clock
        # Collectives issued while the loop ran: torch's sequence numbers of every group (those issued
        # from C++ included), or the calls recorded from Python (p2p on NCCL, groups without a number).
        issued = max(sum(max(0, q - seqs0.get(g, 0)) for g, q in seqs.items()), py - py0, 0)
        if run.ring is not None:
            run.ring.set_loader_end(entry.slot, run.epoch, issued)

    def loader_clock(self) -> tuple[int, dict[int, int], int]:
        """Where this rank's collectives stand, read when a DataLoader epoch starts and when its loop ends
        (never per collective): the default group's sequence number (NO_SEQ: unknown), every group's (a few
        hundred ns each), and the calls recorded from Python (the ring's stamps less its step markers)."""
        seqs: dict[int, int] = {}
        for slot, _pg, seqfn in list(self.group_list):
            if seqfn is not None:
                try:
                    seqs[slot] = int(seqfn())
                except Exception:  # noqa: BLE001 - a group being destroyed
                    continue
        default = seqs.get(self.groups.get(self.default_pg, (NO_GROUP, None, None))[0], NO_SEQ)
        return default, seqs, self._next_stamp() - self.step

    def _next_stamp(self) -> int:
        """The stamp the next record will take, read without taking it (1: none recorded yet, or unknown)."""
        if self.native is not None:
            return int(self.native.peek())
        try:
            return int(repr(self.stamps)[6:-1])  # itertools.count's repr is "count(N)"
        except ValueError:
            return 1

    def unrecorded_default_calls(self) -> bool:
        ring, (slot, seqfn, _tracked) = self.ring, self.groups.get(self.default_pg, (NO_GROUP, None, None))
        if ring is None or seqfn is None or slot == NO_GROUP:
            return False
        try:
            return int(seqfn()) > ring.last_call_seq(slot, self._next_stamp() - 1, look_back=128)
        except Exception:  # noqa: BLE001 - a group being torn down, the ring closed: as if there were some
            return True

    # -- calls that complete after they return -------------------------------------------------------
    def finish(self, off: int, stamp: int, status: int, span: int) -> None:
        """Stamp a record's exit, unless the ring has wrapped over it (or was detached) meanwhile."""
        mm = self.mm
        if mm is None:
            return
        try:
            if U64.unpack_from(mm, off)[0] == stamp:
                RECORD_EXIT.pack_into(mm, off + RECORD_EXIT_OFFSET, time.time(), span, status)
        except Exception as exc:  # noqa: BLE001
            self.fail("recording a completion", exc)

    def track_async(self, work: Any, off: int, stamp: int, span: int, use_future: bool = True) -> None:
        """Stamp the record when ``work`` completes: by its future, else polled by the sampler.
        ``use_future=False`` for NCCL, whose futures complete when the work is enqueued."""
        works: Sequence[Any] = work if isinstance(work, (list, tuple)) else [work]
        if len(works) == 1 and use_future:
            try:
                fut = works[0].get_future()

                def done(f: Any) -> None:
                    try:
                        f.value()
                        status = STATUS_OK
                    except Exception:  # noqa: BLE001 - the work's own error: the record says so
                        status = STATUS_ERROR
                    self.finish(off, stamp, status, span)

                fut.add_done_callback(done)
                return
            except Exception:  # noqa: BLE001 - this Work type has no future (e.g. some p2p): the sampler polls it
                pass
        self.pending.hand_over(works, off, stamp, span)

    # -- process end (see dtwatch.record.endings) -----------------------------------------------------
    def on_exit(self) -> None:
        self.stopped.set()  # no attaching while the interpreter shuts down
        sampler = self.sampler
        if sampler is not None:
            try:
                # The sampler thread stops first: it must not touch process groups while the interpreter
                # and torch tear them down (a daemon thread inside torch then can abort the process).
                sampler.close()
                self.complete_finished_work(time.time())
            except Exception:  # noqa: BLE001 - the process is ending: nothing to tell
                pass
        ring = self.ring
        if ring is None or os.getpid() != self.pid or EXIT.unpack_from(ring.mm, OFF_EXIT)[0] != EXIT_RUNNING:
            return
        call = self.exit_call
        if call is None:
            ring.set_exit(EXIT_CLEAN, 0, "process exited normally")
            return
        ring.set_exit(EXIT_CLEAN, call["code"], exit_call_reason(call))
        write_exit_facts(self.run_dir, self.rank, call)

    def on_exception(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        ring = self.ring
        if ring is None or os.getpid() != self.pid:
            return
        ring.set_exit(EXIT_EXCEPTION, 1, exception_summary(exc_type, exc, tb))
        write_exit_facts(self.run_dir, self.rank, {"how": "exception", **exception_facts(exc_type, exc, tb)})

    def on_exit_call(self, facts: dict) -> None:
        """``sys.exit()`` was called (its ``SystemExit`` may still be caught: the atexit handler tells it)
        or ``os._exit()`` (no atexit handler runs after it: told now)."""
        if os.getpid() != self.pid:
            return  # a forked child's exit (a DataLoader worker's os._exit) is not this rank's
        if facts["how"] == "sys.exit":
            if threading.current_thread() is threading.main_thread():  # elsewhere it ends only its thread
                self.exit_call = facts
            return
        ring = self.ring
        if ring is not None and EXIT.unpack_from(ring.mm, OFF_EXIT)[0] == EXIT_RUNNING:
            ring.set_exit(EXIT_CLEAN, facts["code"], exit_call_reason(facts))
            write_exit_facts(self.run_dir, self.rank, facts)


def exit_call_reason(facts: dict) -> str:
    """The ring's exit reason for a ``sys.exit``/``os._exit`` call: ``sys.exit(2) at FILE:LINE``."""
    where = facts["frames"][0] if facts.get("frames") else None
    loc = f" at {where['file']}:{where['line']}" if where else ""
    return f"{facts['how']}({facts.get('argument', facts['code'])}){loc}"[:255]


def group_name(pg: Any) -> str:
    try:
        return dist.distributed_c10d._get_process_group_name(pg)
    except Exception:  # noqa: BLE001 - a group torch has not named (yet)
        return str(getattr(pg, "group_name", "?"))


def backend_name(pg: Any) -> str:
    try:
        return str(dist.get_backend(pg))
    except Exception:  # noqa: BLE001 - torch has not registered the group yet (inside init_process_group)
        try:
            return str(pg.name())
        except Exception:  # noqa: BLE001
            return "?"


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
    except Exception:  # noqa: BLE001 - no usable CUDA: the ring says "no device"
        pass
    return -1, ""
