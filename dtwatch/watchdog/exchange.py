"""Cross-node exchange through the job's own c10d store (no new infrastructure).

Every node's watchdog publishes its ranks' states under ``dtwatch/<job>/node/<name>`` and reads the
others'. Keys live under a ``dtwatch/`` prefix, so they never collide with torch's. torch is imported
only when a store is actually used (single-node jobs never need it).
"""
from __future__ import annotations

import json
import logging
import zlib
from datetime import timedelta

from dtwatch.diagnose.state import RankState

log = logging.getLogger("dtwatch")

PUBLISHED_RECENT = 16  # recent calls per group sent to other nodes (enough to compare and to see lag)


class JobStore:
    def __init__(self, host: str, port: int, job_id: str, node: str, timeout: float = 5.0) -> None:
        self.host, self.port, self.job_id, self.node, self.timeout = host, port, job_id, node, timeout
        self.prefix = f"dtwatch/{job_id}"
        self._store = None
        self._registered = False

    def _connect(self):
        if self._store is None:
            from torch.distributed import TCPStore

            self._store = TCPStore(
                self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout),
                wait_for_workers=False,
            )
        return self._store

    def publish(self, states: list[RankState]) -> None:
        store = self._connect()
        if not self._registered:
            idx = store.add(f"{self.prefix}/nodes", 1) - 1
            store.set(f"{self.prefix}/node_name/{idx}", self.node)
            self._registered = True
        payload = []
        for s in states:
            d = s.to_dict()
            for g in d["groups"].values():
                g["recent"] = g["recent"][-PUBLISHED_RECENT:]
            payload.append(d)
        store.set(f"{self.prefix}/node/{self.node}", zlib.compress(json.dumps(payload).encode()))

    def fetch(self) -> list[RankState]:
        """States published by the other nodes."""
        store = self._connect()
        count = store.add(f"{self.prefix}/nodes", 0)
        out: list[RankState] = []
        for i in range(count):
            name_key = f"{self.prefix}/node_name/{i}"
            if not store.check([name_key]):
                continue
            name = store.get(name_key).decode()
            if name == self.node:
                continue
            key = f"{self.prefix}/node/{name}"
            if not store.check([key]):
                continue
            for d in json.loads(zlib.decompress(store.get(key))):
                out.append(RankState.from_dict(d))
        return out
