"""Webhook alerts: a JSON POST per event, retried with backoff, from a bounded background queue.

Nothing here can block the watchdog's poll loop (and nothing at all runs in the training process).
A receiver that is down costs one warning and an error counter, not a crash.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.request
from collections.abc import Callable

log = logging.getLogger("dtwatch")


class Webhook:
    def __init__(self, url: str, *, retries: int = 3, timeout: float = 5.0, backoff: float = 0.5,
                 on_error: Callable[[], None] | None = None, max_queue: int = 100) -> None:
        self.url, self.retries, self.timeout, self.backoff = url, retries, timeout, backoff
        self.on_error = on_error
        self.queue: queue.Queue[dict | None] = queue.Queue(maxsize=max_queue)
        self.delivered = 0
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="dtwatch-webhook", daemon=True)
        self._thread.start()

    def send(self, event: dict) -> None:
        try:
            self.queue.put_nowait(event)
        except queue.Full:
            self._fail("queue full, event dropped")

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (within ``timeout``), then stop."""
        try:
            self.queue.put(None, timeout=1)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            event = self.queue.get()
            if event is None:
                return
            body = json.dumps(event).encode()
            for attempt in range(self.retries + 1):
                try:
                    req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                        if 200 <= resp.status < 300:
                            self.delivered += 1
                            break
                except Exception as exc:  # noqa: BLE001
                    error = repr(exc)
                else:
                    error = f"HTTP {resp.status}"
                if attempt < self.retries:
                    time.sleep(self.backoff * (2 ** attempt))
            else:
                self._fail(error)

    def _fail(self, why: str) -> None:
        if self.on_error:
            self.on_error()
        if not self._warned:
            self._warned = True
            log.warning(
                "dtwatch: webhook %s failed: %s (further failures are counted in dtwatch_watchdog_errors_total)",
                self.url, why,
            )
