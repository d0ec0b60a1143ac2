"""The other nodes' ranks, seen through the cross-node exchange (:mod:`dtwatch.watchdog.exchange`).

This is the watchdog's one caller of the exchange: what it publishes, how often, and how the other
nodes' states join this node's. A change to how nodes exchange states touches this module only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from dtwatch.config import WatchOptions, job_store_address
from dtwatch.diagnose.evidence import ViewSample
from dtwatch.diagnose.rank_state import RankState
from dtwatch.watchdog.exchange import Exchange
from dtwatch.watchdog.incident import OpenIncident

log = logging.getLogger("dtwatch")


class Peers:
    """Publishes this node's summary and reads the job's view through one elected aggregator, at most every
    ``store_interval`` seconds while anything looks suspicious (or an incident is open), less often
    otherwise (see :meth:`Exchange.step`). Poll thread only."""

    def __init__(self, opts: WatchOptions, on_error: Callable[[str], None]) -> None:
        self.opts = opts
        self.on_error = on_error
        self.remote: list[RankState] = []
        self.failed = False
        address = job_store_address(opts.store)
        self.store = (Exchange(address[0], address[1], opts.job_id, opts.node, interval=opts.store_interval,
                               serve=opts.serve_store, full_view=opts.full_view_ranks)
                      if address is not None else None)

    def exchange(self, local: list[RankState], now: float, *, window: float, incident: OpenIncident | None,
                 warnings: Iterable[Any] = ()) -> None:
        """Publish ``local`` and read the job's view when it is time; ``incident``: this node's open one."""
        if self.store is None or not local:
            return
        if len(local) >= local[0].world_size:
            return  # every rank is on this node
        try:
            view = self.store.step(local, now, window=window, incident=_verdict_source(incident), warnings=warnings)
            if view is not None:
                self.remote = view.remote_states()
        except Exception as exc:  # noqa: BLE001 - retried at the next interval: the store may not be up yet
            if not self.failed:
                log.warning("dtwatch: cannot reach the job's store %s:%s (%s); diagnosing with this node's ranks only",
                            self.store.host, self.store.port, exc)
            self.failed = True
            self.on_error("store")

    @property
    def sample(self) -> ViewSample | None:
        """What the other nodes' ranks are a sample of, in a large job (from the view's latest head)."""
        head = self.store.head if self.store is not None else None
        return head.sample() if head is not None else None

    def settling(self, now: float) -> bool:
        """Whether the view still lacks other nodes' ranks it is about to hold (see :meth:`Exchange.settling`)."""
        return self.store is not None and self.store.settling(now)

    def merge(self, local: list[RankState]) -> list[RankState]:
        """Every rank known: this node's as read now, the others' as last fetched."""
        mine = {s.rank for s in local}
        return sorted(local + [s for s in self.remote if s.rank not in mine], key=lambda s: s.rank)

    def close(self) -> None:
        """Hand the aggregator's lease back at once (another node takes over without waiting it out)."""
        if self.store is not None:
            self.store.close()


def _verdict_source(incident: OpenIncident | None) -> dict | None:
    """The open incident as the exchange's verdict reads it (its id, verdict and current findings)."""
    if incident is None:
        return None
    return {"id": incident.incident.id, "verdict": incident.incident.verdict, "findings": list(incident.findings)}
