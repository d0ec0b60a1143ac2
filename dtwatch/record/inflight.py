"""Calls that returned before they completed, until they are seen completed.

The training thread hands them over and goes on; a polling thread (the sampler's tick; ``detach`` and
the process's exit once the sampler has stopped) later stamps their exits:

* async work without a usable future (:class:`PendingWork`), checked with ``Work.is_completed()``;
* calls on a completion-tracked group (:class:`TrackedGroup`: NCCL, ``gloo_async``), completed once the
  group's completed watermark (:mod:`dtwatch.record.completion`) reaches their last sequence number.

Stamping goes through a :data:`Finish` callback (the recorder's), which first checks that the record
still belongs to the call: the ring may have wrapped over it meanwhile.
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dtwatch.record.completion import CompletionSource
from dtwatch.ring import STATUS_OK, RingWriter

Finish = Callable[[int, int, int, int], None]  # (record offset, stamp, status, seq span)
Fail = Callable[[str, BaseException], None]

PendingCall = tuple[Sequence[Any], int, int, int]  # (works, record offset, stamp, seq span)


class PendingWork:
    """Async work without a future, on its way from the training threads to the thread that polls it.

    Why nothing handed over is lost: the training side only appends to a ``deque`` and the polling side
    only ``popleft``s from it; CPython makes both atomic (deques are thread-safe for appends and pops at
    opposite ends), so a call appended during a poll is taken by that poll or the next, and the training
    thread never waits. The polling side takes ``_lock``: the sampler's tick and ``detach`` or the exit
    may poll at the same time, and the work already checked (``_checked``) belongs to one poll at a time.
    """

    def __init__(self) -> None:
        self._handed: collections.deque[PendingCall] = collections.deque()
        self._checked: list[PendingCall] = []
        self._lock = threading.Lock()

    def hand_over(self, works: Sequence[Any], off: int, stamp: int, span: int) -> None:
        """Training thread: never blocks."""
        self._handed.append((works, off, stamp, span))

    def poll(self, finish: Finish) -> None:
        """Stamp the work that completed; keep the rest for the next poll."""
        with self._lock:
            while self._handed:
                self._checked.append(self._handed.popleft())
            if not self._checked:
                return
            still = []
            for works, off, stamp, span in self._checked:
                try:
                    done = all(w is None or w.is_completed() for w in works)
                except Exception:  # noqa: BLE001 - a Work that cannot say: stop waiting for it
                    done = True
                if done:
                    finish(off, stamp, STATUS_OK, span)
                else:
                    still.append((works, off, stamp, span))
            self._checked = still


class TrackedGroup:
    """A group whose collectives return before they complete (NCCL, gloo_async): its completion source,
    and its calls that returned and have not been seen completed, in issue order."""

    __slots__ = ("slot", "source", "enqueued", "completed")

    def __init__(self, slot: int, source: CompletionSource) -> None:
        self.slot, self.source = slot, source
        # (last seq the call used, record offset, stamp, span); appended by the training thread after the
        # call returned (the wrapper appends directly: the hot path), drained by the poller (a deque: the
        # two never race).
        self.enqueued: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self.completed = -1


def poll_tracked(groups: Sequence[TrackedGroup], now: float, ring: RingWriter | None, finish: Finish,
                 fail: Fail) -> None:
    """Ask each tracked group what completed; stamp its calls up to there."""
    for tracked in groups:
        try:
            done = tracked.source.completed(now)
        except Exception as exc:  # noqa: BLE001 - e.g. the group was destroyed meanwhile
            fail("reading which collectives completed", exc)
            continue
        if done is None:
            continue
        if done != tracked.completed and ring is not None:
            tracked.completed = done
            ring.set_group_completed(tracked.slot, done, now)
        queue = tracked.enqueued
        while queue and queue[0][0] <= done:
            _last_seq, off, stamp, span = queue.popleft()
            finish(off, stamp, STATUS_OK, span)
