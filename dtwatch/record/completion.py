"""What completed, for process groups whose collectives return before they complete.

On gloo a synchronous collective returns when it has completed, so the recorder stamps its exit then.
On NCCL it returns once enqueued on the GPU stream, and completes later, or never. The same holds for
``async_op=True`` work everywhere. For such groups the recorder leaves the record in flight
(``FLAG_ENQUEUED``). The sampler then asks the group's :class:`CompletionSource`, off the training
thread, for its *completed watermark*: the highest sequence number such that it and everything before it
in the group have completed. Records at or below the watermark are stamped completed.

Sources, per backend (chosen once per group by :func:`completion_source`):

* ``gloo_async`` (:mod:`dtwatch.testing`): the group reports its active collectives itself, every tick;
* NCCL (``nccl``; on torch >= 2.15 also ``nccl2``, ``nccl-legacy``, ``nccl-lazy``): torch's Flight Recorder,
  active entries only (``onlyActive=True``, without stack traces), one dump per process at most every
  ``NCCL_POLL_INTERVAL`` seconds, shared by all groups. The legacy group records into NCCL's own recorder
  (``_dump_nccl_trace``); torch 2.15's nccl2 through a Flight Recorder hook into the generic one
  (``_dump_fr_trace``): both are read. It needs the Flight Recorder on (``TORCH_FR_BUFFER_SIZE`` /
  ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0, which dtwatch sets unless told not to). Without it, where the dump
  cannot be read (a torch without ``onlyActive``), or where no recorder has ever listed a group's
  collectives (so "none active" would mean "not recorded", not "completed"), completion falls back to
  "the call returned", as on gloo, with one warning that names what is missing;
* any other backend: none (its calls complete when they return).

The watermark of a group is computed from the number of collectives issued, read *before* looking at
the active entries. Then each collective counted is either listed as active or has completed, and the
watermark is ``min(active seq) - 1``, or the number issued when nothing is active.
"""
from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Callable, Iterable
from typing import Any

from dtwatch.record.torchenv import flight_recorder_on

log = logging.getLogger("dtwatch")

NCCL_POLL_INTERVAL = 1.0  # seconds between Flight Recorder dumps for NCCL completion


def watermark(issued: int, active: Iterable[int]) -> int:
    """The completed watermark of a group with ``issued`` collectives, of which ``active`` are not done."""
    return min(active, default=issued + 1) - 1


def watermarks(issued: dict[str, int], entries: list[dict]) -> dict[str, int]:
    """Per group name: the completed watermark, from the collectives issued (read before the dump) and
    the Flight Recorder's active entries (``process_group`` = (name, desc), ``collective_seq_id``;
    point-to-point entries are numbered apart and skipped)."""
    active: dict[str, list[int]] = {}
    for e in entries:
        if e.get("is_p2p") or e.get("collective_seq_id") is None:
            continue
        name = str((e.get("process_group") or ["?"])[0])
        active.setdefault(name, []).append(int(e["collective_seq_id"]))
    return {name: watermark(n, active.get(name, ())) for name, n in issued.items()}


def never_listed(names: set[str], entries: list[dict]) -> set[str]:
    """Those of the group ``names`` that no Flight Recorder entry (active or not) belongs to."""
    return names - {str((e.get("process_group") or ["?"])[0]) for e in entries}


class CompletionSource:
    """Answers "up to which sequence number has this group completed?" (None: no news this time)."""

    def __init__(self, pg: Any, seqfn: Callable[[], int]) -> None:
        self.pg, self.seqfn = pg, seqfn

    def completed(self, now: float) -> int | None:
        raise NotImplementedError


class SelfReported(CompletionSource):
    """A group that lists its own active collectives (``in_flight() -> (issued, [(seq, op), ...])``)."""

    def completed(self, now: float) -> int | None:
        issued, active = self.pg.in_flight()
        return watermark(issued, (seq for seq, _op in active))


class _NcclActiveEntries:
    """This process's active NCCL Flight Recorder entries, re-read at most every ``NCCL_POLL_INTERVAL``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fetched = float("-inf")
        self.sources: list[FlightRecorderActive] = []
        self.answers: dict[int, int] = {}  # id(source) -> watermark at the last fetch
        self.warned = False
        self.blind: set[str] = set()  # groups no recorder lists: completed when they return

    def refresh(self, now: float) -> None:
        if now - self.fetched < NCCL_POLL_INTERVAL:
            return
        self.fetched = now
        issued = {}
        for src in self.sources:
            try:
                issued[id(src)] = src.seqfn()
            except Exception:  # noqa: BLE001 - a group being destroyed
                continue
        entries = _dump_entries(only_active=True)
        blind = self.blind_groups(issued)
        if blind - self.blind:
            log.warning("dtwatch: torch's Flight Recorder lists no collective of process group(s) %s although they "
                        "issued some; their collectives count as completed when they return (a hang is then placed "
                        "where the rank waits, not at the collective)", ", ".join(sorted(blind - self.blind)))
            self.blind |= blind
        if entries is None:
            # No Flight Recorder to read (an older torch, or it is off after all): fall back to "a call
            # has completed when it returned", so nothing stays in flight for ever.
            if not self.warned:
                self.warned = True
                log.warning("dtwatch: cannot read NCCL's Flight Recorder; collectives count as completed when "
                            "they return (a hang is then placed where the rank waits, not at the collective)")
            self.answers = dict(issued)
            return
        names = {id(src): src.name for src in self.sources}
        marks = watermarks({names[k]: n for k, n in issued.items()}, entries)
        self.answers = {k: n if names[k] in self.blind else marks[names[k]] for k, n in issued.items()}

    def blind_groups(self, issued: dict[int, int]) -> set[str]:
        """Names of groups that issued collectives none of torch's recorders has listed (checked once per
        group, on a full dump, once it has issued one): on such a group an empty active list says nothing."""
        unchecked = {src.name for src in self.sources if not src.checked and issued.get(id(src), 0) > 0}
        if not unchecked:
            return set()
        everything = _dump_entries(only_active=False)
        if everything is None:
            return set()  # no recorder at all: the caller's fallback says so
        for src in self.sources:
            if src.name in unchecked:
                src.checked = True
        return never_listed(unchecked, everything)


def _dump_entries(only_active: bool) -> list[dict] | None:
    """The entries of every Flight Recorder this torch keeps (NCCL's own, and the generic one that gloo and
    torch 2.15's nccl2 feed), merged; None where none can be read."""
    import torch._C._distributed_c10d as c10d_c

    found: list[dict] | None = None
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        fn = getattr(c10d_c, name, None)
        if fn is None:
            continue
        try:
            data = fn(includeCollectives=True, includeStackTraces=False, onlyActive=only_active)
            found = (found or []) + list(pickle.loads(data).get("entries") or [])
        except Exception as exc:  # noqa: BLE001 - e.g. an older torch without these arguments
            log.debug("dtwatch: reading the Flight Recorder (%s) failed: %r", name, exc)
    return found


_NCCL = _NcclActiveEntries()


class FlightRecorderActive(CompletionSource):
    """An NCCL group, by torch's Flight Recorder (see the module doc)."""

    def __init__(self, pg: Any, seqfn: Callable[[], int], name: str) -> None:
        super().__init__(pg, seqfn)
        self.name = name
        self.checked = False  # a full dump has listed (or not) this group's collectives
        with _NCCL.lock:
            _NCCL.sources.append(self)

    def completed(self, now: float) -> int | None:
        with _NCCL.lock:
            _NCCL.refresh(now)
            return _NCCL.answers.get(id(self))


def is_nccl(backend: str) -> bool:
    """Whether a group's backend is one of torch's NCCL groups (torch 2.15: ``nccl`` is nccl2; ``nccl2``,
    ``nccl-legacy`` and ``nccl-lazy`` name them explicitly)."""
    return backend.lower().startswith("nccl")


def completion_source(pg: Any, backend: str, seqfn: Callable[[], int] | None, name: str) -> CompletionSource | None:
    """The source of completions for ``pg``, or None where a call has completed when it returns."""
    if seqfn is None:
        return None
    if callable(getattr(pg, "in_flight", None)):
        return SelfReported(pg, seqfn)
    if is_nccl(backend) and flight_recorder_on():
        return FlightRecorderActive(pg, seqfn, name)
    return None


def forget_all() -> None:
    """Drop the NCCL sources (the recorder detached: its groups are gone)."""
    with _NCCL.lock:
        _NCCL.sources.clear()
        _NCCL.answers.clear()
        _NCCL.blind.clear()
        _NCCL.fetched = float("-inf")


__all__ = ["CompletionSource", "completion_source", "is_nccl", "never_listed", "watermark", "watermarks",
           "NCCL_POLL_INTERVAL", "forget_all"]
