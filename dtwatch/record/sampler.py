"""The recorder's background thread: everything that can run a little later than the collective.

Every ``seq_clock_interval`` seconds (10 ms) it reads each process group's C++ sequence number and
notes when it advanced (the ring's sequence clock). Every ``sample_interval`` seconds it also writes a
heartbeat, samples the sequence numbers (this is how collectives issued from C++ by DDP's reducer or FSDP become visible), notes where
the main thread is, stamps the exit of async work that has completed and, for groups whose collectives
return before they complete (NCCL), of calls their completion source reports done (dtwatch.record.completion), registers process groups created
since the last look, and answers the watchdog's Flight Recorder dump requests.

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
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from dtwatch import paths
from dtwatch.ring import MAIN_STACK_DEPTH

if TYPE_CHECKING:
    from dtwatch.record.recorder import Recorder

log = logging.getLogger("dtwatch")

GROUP_SCAN_EVERY = 10  # ticks between scans for new process groups


class Sampler(threading.Thread):
    def __init__(self, rec: Recorder) -> None:
        super().__init__(name="dtwatch-sampler", daemon=True)
        self.rec = rec
        self.interval = rec.config.sample_interval
        self._stop_event = threading.Event()
        self.main_ident = threading.main_thread().ident
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

    def run(self) -> None:
        # Between full ticks, only the default group's sequence counter is read, every
        # ``seq_clock_interval`` (a microsecond): when it advances is when DDP's reducer issued its
        # collectives. Other groups (a job may have hundreds) are read at the full tick.
        clock = self.rec.config.seq_clock_interval
        next_tick = 0.0
        while not self._stop_event.is_set():
            try:
                now = time.time()
                if now >= next_tick:
                    next_tick = now + self.interval
                    self.tick()
                elif clock:
                    self.sample_groups(now, only=self.rec.default_pg)
            except Exception as exc:  # noqa: BLE001 - never let the thread die silently
                self.rec.fail("sampling", exc)
            self._stop_event.wait(min(clock, self.interval) if clock else self.interval)

    def tick(self) -> None:
        rec, ring = self.rec, self.rec.ring
        if ring is None:
            return
        now = time.time()
        self.ticks += 1
        if self.ticks % GROUP_SCAN_EVERY == 1:
            self.scan_groups()
        self.sample_groups(now)
        rec.poll_pending()
        rec.poll_completions(now)
        self.sample_main_thread(now)
        request = ring.dump_request()
        if request != self.dumps_done and (self.dumper is None or not self.dumper.is_alive()):
            # torch's dump can take seconds (it inspects in-flight work): its own thread, so the
            # heartbeat goes on and a slow dump never reads as a wedged rank.
            self.dumps_done = request
            rank = dist.get_rank() if dist.is_initialized() else -1

            def dump(request: int = request) -> None:
                try:
                    dump_flight_recorder(rec.run_dir, rank, request)
                    ring.ack_dump(request)
                except Exception as exc:  # noqa: BLE001 - e.g. the ring closed meanwhile
                    rec.fail("dumping the Flight Recorder", exc)

            self.dumper = threading.Thread(target=dump, name="dtwatch-fr-dump", daemon=True)
            self.dumper.start()
        ring.heartbeat(now, self.ticks)

    def sample_groups(self, now: float, only: object = None) -> None:
        """Write each group's C++ sequence number where it changed (also called once at the end);
        ``only``: just that process group."""
        ring = self.rec.ring
        if ring is None:
            return
        for slot, pg, seqfn in list(self.rec.group_list):
            if seqfn is None or (only is not None and pg is not only):
                continue
            try:
                seq = seqfn()
            except Exception:
                continue
            if self.last_seq.get(slot) != seq:
                self.last_seq[slot] = seq
                ring.set_group_cpp_seq(slot, seq, now)
                ring.add_seq_time(slot, seq, now)

    def scan_groups(self) -> None:
        try:
            pgs = list(dist.distributed_c10d._world.pg_map.keys())
        except Exception:
            return
        for pg in pgs:
            if pg not in self.rec.groups:
                try:
                    self.rec.register_group(pg)
                except Exception:
                    continue

    def sample_main_thread(self, now: float) -> None:
        sites = self.rec.sites
        frame = sys._current_frames().get(self.main_ident)
        if frame is None or sites is None:
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
        if (where, top) != self.last_sites:
            self.last_sites = (where, top)
            self.rec.ring.set_main_site(where, top, now)
        if stack != self.last_stack:
            self.last_stack = stack
            self.rec.ring.set_main_stack(stack)


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
