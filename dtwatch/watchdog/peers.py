"""The other nodes' ranks, seen through the cross-node exchange (:mod:`dtwatch.watchdog.exchange`).

This is the watchdog's one caller of the exchange: what it publishes, how often, and how the other
nodes' states join this node's. A change to how nodes exchange states touches this module only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from dtwatch.config import WatchOptions, job_store_address
from dtwatch.diagnose.state import RankState
from dtwatch.watchdog.exchange import JobStore

log = logging.getLogger("dtwatch")


class Peers:
    """Publishes this node's ranks and fetches the others' every ``store_interval`` seconds while anything
    looks suspicious (or an incident is open), five times less often otherwise. Poll thread only."""

    def __init__(self, opts: WatchOptions, on_error: Callable[[str], None]) -> None:
        self.opts = opts
        self.on_error = on_error
        self.remote: list[RankState] = []
        self.last = 0.0
        self.failed = False
        address = job_store_address(opts.store)
        self.store = JobStore(address[0], address[1], opts.job_id, opts.node) if address is not None else None

    def exchange(self, local: list[RankState], now: float, *, urgent: bool) -> None:
        """Publish ``local`` and fetch the other nodes' states when it is time; ``urgent``: an incident is open."""
        if self.store is None or not local:
            return
        if len(local) >= local[0].world_size:
            return  # every rank is on this node
        suspicious = urgent or any(s.open_calls for s in local)
        interval = self.opts.store_interval if suspicious else self.opts.store_interval * 5
        if now - self.last < interval:
            return
        self.last = now
        try:
            self.store.publish(local)
            self.remote = self.store.fetch()
        except Exception as exc:  # noqa: BLE001 - retried at the next interval: the store may not be up yet
            if not self.failed:
                log.warning("dtwatch: cannot reach the job's store %s:%s (%s); diagnosing with this node's ranks only",
                            self.store.host, self.store.port, exc)
            self.failed = True
            self.on_error("store")

    def merge(self, local: list[RankState]) -> list[RankState]:
        """Every rank known: this node's as read now, the others' as last fetched."""
        mine = {s.rank for s in local}
        return sorted(local + [s for s in self.remote if s.rank not in mine], key=lambda s: s.rank)
