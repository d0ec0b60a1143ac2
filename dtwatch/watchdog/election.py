"""Which node aggregates: a lease in the store (pure decisions; the store calls are in :mod:`.exchange`).

The lease is one key, ``term|beat|holder``. The first node to ``compare_set`` it from nothing holds it
(term 1). The holder renews it often (every :func:`renew_period`), by ``compare_set`` from the value it
wrote last to the next beat; a renewal that finds another value means it lost the lease and it follows
from then on. Every other node looks at the lease each time it exchanges and notes, on its own clock,
since when the value has not changed (:class:`LeaseWatch`): clocks of different machines are never
compared. Once unchanged for :func:`stale_after` (longer than several renewals), the holder is taken to
be gone and the node claims the next term by ``compare_set`` from the value it saw: only one claimant
can win. A look that the store answered slowly restarts that clock: the holder's renewals were queued
behind the same stall, and a slow store must not make every node claim the lease. A node looks at the
lease at every exchange, so a dead aggregator is replaced within two exchange intervals.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    holder: str
    term: int
    beat: int

    def encode(self) -> str:
        return f"{self.term}|{self.beat}|{self.holder}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Lease | None:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        parts = text.split("|", 2)
        if len(parts) != 3:
            return None
        try:
            return cls(parts[2], int(parts[0]), int(parts[1]))
        except ValueError:
            return None

    def renewed(self) -> Lease:
        return Lease(self.holder, self.term, self.beat + 1)


def claim(seen: Lease | None, me: str) -> Lease:
    """The lease ``me`` asks for: the term after the one seen."""
    return Lease(me, (seen.term if seen is not None else 0) + 1, 0)


def renew_period(interval: float) -> float:
    """How often the holder renews: several times per fast exchange interval."""
    return max(0.05, min(1.0, interval / 4))


def stale_after(interval: float) -> float:
    """How long the lease may stay unchanged before its holder is taken to be gone (four renewals at least)."""
    return max(interval, 4 * renew_period(interval))


class LeaseWatch:
    """A follower's view of the lease, on its own clock."""

    def __init__(self) -> None:
        self.value: bytes | None = None
        self.since = 0.0

    def observe(self, raw: bytes, now: float) -> float:
        """Note the value seen now; returns for how long it has been unchanged."""
        if raw != self.value:
            self.value, self.since = raw, now
        return now - self.since

    def reset(self) -> None:
        self.value, self.since = None, 0.0


def should_take_over(lease: Lease | None, me: str, unchanged_for: float, interval: float) -> bool:
    """Whether ``me`` should claim the lease: the holder is someone else and has not renewed for too long.
    (``me`` holding a lease it did not renew - a restarted watchdog of the same node - claims it at once.)"""
    if lease is None:
        return True
    if lease.holder == me:
        return True
    return unchanged_for >= stale_after(interval)
