"""The recorder's background thread: everything that can run a little later than the collective.

Every ``seq_clock_interval`` seconds (10 ms) it reads each process group's C++ sequence number and
notes when it advanced (the ring's sequence clock). Every ``sample_interval`` seconds it also writes a
heartbeat, samples the sequence numbers (this is how collectives issued from C++ by DDP's reducer or
FSDP become visible), notes where the main thread is, has the recorder stamp the exit of work that
completed since (async work, and calls on groups whose collectives return before they complete:
:mod:`dtwatch.record.inflight`), registers process groups created since the last look, and answers the
watchdog's Flight Recorder dump requests.

Where the main thread is, in the ring's terms (frame kinds as in :mod:`dtwatch.record.callsite`):

* ``main_top_site``: its innermost frame, whatever the code (often torch's, when blocked in a collective);
* ``main_site``: its innermost frame of user *or library* code: the line it waits at, even inside
  Lightning's loop, like a collective's ``site``;
* ``main_stack``: up to ``MAIN_STACK_DEPTH`` frames of the user's own code, innermost first (no
  library, standard library or pseudo-file frames): the user's lines that led there, like a
  collective's ``user_site``. Its first entry equals ``main_site`` when no library is in between.

While the main thread is blocked inside a collective (C++ releases the GIL) this thread keeps going,
so the ring says exactly where the rank waits. If it stops (the GIL is held by a wedged extension, or
the process is stopped), the heartbeat goes stale and the watchdog reports the rank unresponsive.

The sampler knows the recorder only as a :class:`SamplerHost`; the recorder uses the sampler only through
``start()``, ``close()`` and ``tick()``.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch.distributed as dist

import dtwatch.paths as paths
from dtwatch.record.callsite import SiteTable
from dtwatch.ring import MAIN_STACK_DEPTH, RingWriter

log = logging.getLogger("dtwatch")

GROUP_SCAN_EVERY = 10  # ticks between scans for new process groups

SampledGroup = tuple[int, Any, Callable[[], int] | None]  # (ring slot, process group, its sequence-number reader)


class SamplerHost(Protocol):
    """What the sampler uses of the recorder, and all it uses."""

    @property
    def default_pg(self) -> Any:
        """The default process group (None once detached)."""

    def sampled_groups(self) -> list[SampledGroup]:
        """A snapshot of the registered groups that have a ring slot."""

    def register_groups(self, pgs: Iterable[Any]) -> None:
        """Register those of ``pgs`` not registered yet (groups torch created without a Python call)."""

    def complete_finished_work(self, now: float) -> None:
        """Stamp the exit of the work handed over by the training threads that has completed since."""

    def unrecorded_default_calls(self) -> bool:
        """Whether the default group ran collectives since its newest recorded call (issued from C++, e.g. DDP's
        reducer on a torch without collective hooks): what the sequence clock is for."""

    def fail(self, what: str, exc: BaseException | None = None) -> None:
        """dtwatch's own failure: one warning per process."""


SEQ_CLOCK_HOLD = 5.0  # seconds the sequence clock keeps running after the last tick that saw unrecorded calls


class Sampler(threading.Thread):
    def __init__(self, host: SamplerHost, ring: RingWriter, sites: SiteTable, run_dir: str, interval: float,
                 seq_clock_interval: float) -> None:
        super().__init__(name="dtwatch-sampler", daemon=True)
        self.host, self.ring, self.sites, self.run_dir = host, ring, sites, run_dir
        self.interval, self.seq_clock_interval = interval, seq_clock_interval
        self._stop_event = threading.Event()
        main_ident = threading.main_thread().ident
        self.main_ident = main_ident if main_ident is not None else -1  # the main thread has always started
        self.last_sites = (0, 0)
        self.last_stack: list[int] = []
        self.last_seq: dict[int, int] = {}
        self.dumps_done = 0
        self.dumper: threading.Thread | None = None
        self.ticks = 0

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2 * self.interval + 1)

    def close(self) -> None:
        """Stop the thread, then sample the groups once more (C++-issued collectives since the last tick)."""
        self.stop()
        self.sample_groups(time.time())

    def run(self) -> None:
        # Between full ticks, only the default group's sequence counter is read, every
        # ``seq_clock_interval`` (a microsecond): when it advances is when DDP's reducer issued its
        # collectives. Other groups (a job may have hundreds) are read at the full tick.
        # The clock runs only while the full ticks see collectives nobody recorded (and SEQ_CLOCK_HOLD after):
        # waking a hundred times a second costs a Python-heavy step (FSDP2's) a few percent in GIL hand-overs, and
        # where every collective is recorded (the wrapper, torch's collective hooks) the records time them.
        clock = self.seq_clock_interval
        next_tick, clock_until, now = 0.0, 0.0, 0.0
        while not self._stop_event.is_set():
            try:
                now = time.time()
                if now >= next_tick:
                    next_tick = now + self.interval
                    self.tick()
                    if clock and self.host.unrecorded_default_calls():
                        clock_until = now + SEQ_CLOCK_HOLD
                elif clock and now < clock_until:
                    self.sample_groups(now, only=self.host.default_pg)
            except Exception as exc:  # noqa: BLE001 - never let the thread die silently
                self.host.fail("sampling", exc)
            self._stop_event.wait(min(clock, self.interval) if clock and now < clock_until else self.interval)

    def tick(self) -> None:
        host, ring = self.host, self.ring
        now = time.time()
        self.ticks += 1
        if self.ticks % GROUP_SCAN_EVERY == 1:
            self.scan_groups()
        self.sample_groups(now)
        host.complete_finished_work(now)
        self.sample_main_thread(now)
        request = ring.dump_request()
        if request != self.dumps_done and (self.dumper is None or not self.dumper.is_alive()):
            # torch's dump can take seconds (it inspects in-flight work): its own thread, so the
            # heartbeat goes on and a slow dump never reads as a wedged rank.
            self.dumps_done = request
            rank = dist.get_rank() if dist.is_initialized() else -1
            run_dir = self.run_dir

            def dump(request: int = request) -> None:
                try:
                    dump_flight_recorder(run_dir, rank, request)
                    ring.ack_dump(request)
                except Exception as exc:  # noqa: BLE001 - e.g. the ring closed meanwhile
                    host.fail("dumping the Flight Recorder", exc)

            self.dumper = threading.Thread(target=dump, name="dtwatch-fr-dump", daemon=True)
            self.dumper.start()
        ring.heartbeat(now, self.ticks)

    def sample_groups(self, now: float, only: object = None) -> None:
        """Write each group's C++ sequence number where it changed (also called once at the end);
        ``only``: just that process group."""
        ring = self.ring
        for slot, pg, seqfn in self.host.sampled_groups():
            if seqfn is None or (only is not None and pg is not only):
                continue
            try:
                seq = seqfn()
            except Exception:  # noqa: BLE001 - e.g. a group being destroyed: read it next time
                continue
            if self.last_seq.get(slot) != seq:
                self.last_seq[slot] = seq
                ring.set_group_cpp_seq(slot, seq, now)
                ring.add_seq_time(slot, seq, now)

    def scan_groups(self) -> None:
        try:
            pgs = list(dist.distributed_c10d._world.pg_map.keys())
        except Exception:  # noqa: BLE001 - torch's private table moved: groups are still registered on use
            return
        self.host.register_groups(pgs)

    def sample_main_thread(self, now: float) -> None:
        sites = self.sites
        frame = sys._current_frames().get(self.main_ident)
        if frame is None:
            return
        top = sites.frame_site(frame)
        code = sites.code_frame(frame)
        where = sites.frame_site(code) if code is not None else 0
        stack: list[int] = []
        user_frame = sites.user_frame(code)
        while user_frame is not None and len(stack) < MAIN_STACK_DEPTH:
            stack.append(sites.frame_site(user_frame))
            user_frame = sites.user_frame(user_frame.f_back)
        del frame, code, user_frame
        # The stack before the site: a reader copies the live block in address order (the site first),
        # so one that sees this sample's site also sees this sample's stack, never the previous one's.
        if stack != self.last_stack:
            self.last_stack = stack
            self.ring.set_main_stack(stack)
        if (where, top) != self.last_sites:
            self.last_sites = (where, top)
            self.ring.set_main_site(where, top, now)


def dump_flight_recorder(run_dir: str, rank: int, request: int) -> str | None:
    """Write torch's Flight Recorder for this process to ``<run dir>/fr/rank-R.N.pkl``; path or None.

    torch keeps one recorder per kind of backend: ``_dump_nccl_trace`` (CUDA builds: NCCL's) and
    ``_dump_fr_trace`` (gloo's; on older torch the only one). Both are read and their entries merged."""
    import pickle

    import torch._C._distributed_c10d as c10d_c

    dumps = []
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        fn = getattr(c10d_c, name, None)
        if fn is None:
            continue
        try:
            dumps.append(pickle.loads(fn()))
        except Exception as exc:  # noqa: BLE001 - e.g. Flight Recorder disabled
            log.debug("dtwatch: %s failed: %r", name, exc)
    if not dumps:
        return None
    merged = next((d for d in dumps if d.get("entries")), dumps[0])
    if len(dumps) > 1:
        merged = dict(merged)
        merged["entries"] = [e for d in dumps for e in (d.get("entries") or [])]
    data = pickle.dumps(merged)
    path = paths.flight_record_file(run_dir, rank, request)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("dtwatch: could not write the Flight Recorder dump %s: %s", path, exc)
        return None
    return path
