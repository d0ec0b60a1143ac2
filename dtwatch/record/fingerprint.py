"""Cheap fingerprints of a batch and of a dataset, hashed off the training thread.

The setup checks compare the first batch of each epoch across ranks: identical first batches mean
every rank trains on the same data. A fingerprint hashes the structure (types, dtypes, shapes) and
the leading bytes of each CPU tensor, array or string of a batch (``LEAF_BYTES`` each, ``TOTAL_BYTES``
in all), so its cost is bounded whatever the batch size. Tensors on an accelerator are not read (that
would synchronise the device from another thread): a batch with no readable content has no fingerprint.

:class:`BackgroundWorker` runs the hashing in a daemon thread that sleeps on a queue; the training
thread only hands it a reference to the batch.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

log = logging.getLogger("dtwatch")

LEAF_BYTES = 8 * 1024  # the leading rows of a batch tell ranks' data apart; reading more only costs
TOTAL_BYTES = 32 * 1024
MAX_LEAVES = 64
MAX_DEPTH = 6


class _Hasher:
    def __init__(self) -> None:
        self.h = hashlib.blake2b(digest_size=8)
        self.budget = TOTAL_BYTES
        self.leaves = 0
        self.content = 0  # leaves whose bytes were hashed

    def text(self, s: str) -> None:
        self.h.update(s.encode("utf-8", "replace"))

    def raw(self, data: bytes | memoryview) -> None:
        self.h.update(data)
        self.budget -= len(data)
        self.content += 1

    def feed(self, obj: Any, depth: int = 0) -> None:
        self.leaves += 1
        if self.leaves > MAX_LEAVES or depth > MAX_DEPTH:
            return
        if isinstance(obj, torch.Tensor):
            self.tensor(obj)
        elif isinstance(obj, np.ndarray):
            self.text(f"A{obj.dtype}{obj.shape}")
            flat = obj.reshape(-1)
            n = min(flat.size, max(self.budget, 0) // max(obj.itemsize, 1), LEAF_BYTES // max(obj.itemsize, 1))
            if n > 0 and obj.dtype != object:
                self.raw(np.ascontiguousarray(flat[:n]).tobytes())
        elif isinstance(obj, (str, bytes)):
            data = obj.encode("utf-8", "replace") if isinstance(obj, str) else obj
            self.text(f"S{len(data)}")
            self.raw(data[: max(0, min(LEAF_BYTES, self.budget))])
        elif isinstance(obj, (bool, int, float, complex)) or obj is None:
            self.text(f"N{obj!r}")
            self.content += obj is not None
        elif isinstance(obj, Mapping):
            self.text(f"M{len(obj)}")
            for key in sorted(obj, key=str):
                self.text(f"K{key}")
                self.feed(obj[key], depth + 1)
        elif isinstance(obj, (list, tuple)):
            self.text(f"L{len(obj)}")
            for item in obj:
                self.feed(item, depth + 1)
        else:
            self.text(f"O{type(obj).__qualname__}")

    def tensor(self, t: torch.Tensor) -> None:
        self.text(f"T{t.dtype}{tuple(t.shape)}")
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or self.budget <= 0:
            return
        size = t.element_size()
        n = min(t.numel(), LEAF_BYTES // size, self.budget // size)
        if n <= 0:
            return
        try:
            flat = t.detach().reshape(-1)[:n].contiguous()
            self.raw(flat.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError, ValueError):
            return  # an exotic tensor (e.g. a subclass): its structure is hashed, not its bytes


def fingerprint(obj: Any) -> str | None:
    """16 hex digits identifying a batch's structure and leading content; None without readable content."""
    h = _Hasher()
    h.feed(obj)
    return h.h.hexdigest() if h.content else None


def dataset_signature(dataset: Any) -> str | None:
    """A fingerprint of a dataset whose content can be read without running user code: a
    ``TensorDataset`` (its tensors' leading bytes), a Hugging Face ``datasets.Dataset`` (its own
    ``_fingerprint``), a ``Subset`` of either (plus its leading indices). None for anything else."""
    from torch.utils.data import Subset, TensorDataset

    if isinstance(dataset, TensorDataset):
        fp = fingerprint(tuple(dataset.tensors))
        return f"tensors:{fp}" if fp else None
    if isinstance(dataset, Subset):
        inner = dataset_signature(dataset.dataset)
        if inner is None:
            return None
        return f"subset:{fingerprint([int(i) for i in list(dataset.indices[:1024])])}:{inner}"
    hf = getattr(type(dataset), "__module__", "") or ""
    if hf.startswith("datasets."):
        fp = getattr(dataset, "_fingerprint", None)
        return f"hf:{fp}" if isinstance(fp, str) and fp else None
    return None


class BackgroundWorker:
    """Runs small jobs in one daemon thread, started on first use; sleeps on its queue otherwise."""

    def __init__(self, name: str = "dtwatch-facts") -> None:
        self.name = name
        self.jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self.thread is None or not self.thread.is_alive():
            with self.lock:
                if self.thread is None or not self.thread.is_alive():
                    self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self.thread.start()
        self.jobs.put((fn, args))

    def stop(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            self.jobs.put(None)

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until the jobs submitted so far have run (tests, benchmarks); False on timeout."""
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - never into training; the facts stay without it
                log.debug("dtwatch: background job %r failed: %r", fn, exc)
