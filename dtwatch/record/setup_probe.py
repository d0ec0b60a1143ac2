"""The rank's setup facts: what the setup checks (:mod:`dtwatch.diagnose.setup`) compare across ranks.

Gathered at setup time only (the default group appears, a model is wrapped, ``torch.cuda.set_device``,
a DataLoader starts an epoch, an optimizer steps while no process group exists), never on a
collective's path, and written into the ring's facts block (:mod:`dtwatch.ring.setup_facts`) by a
background thread (the training thread only updates the document). The document (JSON)::

    v         1
    torch     torch.__version__
    world     the default group's size (WORLD_SIZE before it exists)
    cvd       CUDA_VISIBLE_DEVICES as this process saw it (None: unset)
    device    the accelerator this rank uses: {type, index, uuid, count, how, site} (count: the GPUs the
              process sees; how: set_device / wrap / current), absent on CPU-only ranks
    gpu_share NCCL's switches for ranks sharing a GPU on purpose, where set: {multi_rank:
              NCCL_MULTI_RANK_GPU_ENABLE, hostid: NCCL_HOSTID}
    wraps     per DDP/FSDP wrap line: {kind, site, group, calls, params, trainable, dtypes, policy, t}
              (sums over the calls at that line; group: the process group or mesh it shards over)
    loaders   per DataLoader slot of the ring's loader table: what dtwatch.record.data_samplers says at the
              latest epoch noted (the first EPOCHS_KEPT, then any that changes it), plus iters (epochs
              started), epochs ([seed, epoch] of the sampler at each epoch noted), fp ({iteration:
              fingerprint of its first batch}, the first FINGERPRINTS_KEPT epochs), dsig (dataset signature);
              sid tells which sampler object it iterates (one loader may be iterated at several lines)
    fp_off    true when batch fingerprints are off (``DTWATCH_BATCH_FINGERPRINT=0``)
    no_pg     {since, site, steps, world, rank, local_rank}: optimizer steps ran for GRACE_S with
              WORLD_SIZE > 1 and no default process group (then the ring is made without one)

Everything here runs under the recorder's failure policy: one warning, never an exception into
training code.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dtwatch.code_paths import LIBRARY, USER, classify_file, site_file
from dtwatch.config import Config
from dtwatch.record.data_samplers import describe_loader, training_now
from dtwatch.record.fingerprint import BackgroundWorker, dataset_signature, fingerprint
from dtwatch.ring import EXIT, EXIT_CLEAN, EXIT_RUNNING, OFF_EXIT, RingWriter, ring_filename
from dtwatch.ring.layout import FACTS_CAPACITY
from dtwatch.ring.setup_facts import encode_facts, write_facts

log = logging.getLogger("dtwatch")

GRACE_S = 10.0  # optimizer steps without a process group for this long (WORLD_SIZE > 1): not distributed
EPOCHS_KEPT = 4  # epochs of a loader noted in full: sampler (seed, epoch) pairs kept
FINGERPRINTS_KEPT = 3  # first-batch fingerprints taken per loader (its first epochs)
LOADERS_KEPT = 16
DEVICE_EVIDENCE = {"current": 0, "set_device": 1, "wrap": 2}
# What a loader's facts say apart from its sampler's progress: a change is noted in any epoch.
_STABLE_FACTS = ("sampler", "dist", "srank", "sreplicas", "shuffle", "drop_last", "dlen", "iterable", "train")


class SetupHost(Protocol):
    """What the setup facts use of the recorder (:class:`dtwatch.record.recorder.Recorder`), and all they use."""

    @property
    def config(self) -> Config: ...

    @property
    def run_dir(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def mm(self) -> Any:
        """The ring's mapping; None while there is no ring."""

    @property
    def default_pg(self) -> Any:
        """The default process group (None while there is none)."""

    def fail(self, what: str, exc: BaseException | None = None) -> None:
        """dtwatch's own failure: one warning per process."""


def caller_site(frame: FrameType | None) -> dict | None:
    """The user's line that led to ``frame`` (else the innermost library line): {file, line, function}."""
    fallback = None
    while frame is not None:
        kind = classify_file(frame.f_code.co_filename)
        if kind == USER or (kind == LIBRARY and fallback is None):
            site = {"file": site_file(frame.f_code.co_filename), "line": frame.f_lineno,
                    "function": getattr(frame.f_code, "co_qualname", frame.f_code.co_name)}
            if kind == USER:
                return site
            fallback = site
        frame = frame.f_back
    return fallback


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


class _Alone:
    """Optimizer steps with WORLD_SIZE > 1 and no default process group, since ``first``."""

    def __init__(self, first: float, site: dict | None, world: int) -> None:
        self.first, self.site, self.world = first, site, world
        self.ring: RingWriter | None = None


class SetupFacts:
    """Owns the facts document of one recorder and writes it into the ring (cold path only)."""

    def __init__(self, rec: SetupHost) -> None:
        self.rec = rec
        self.lock = threading.Lock()
        self.doc: dict[str, Any] = {"v": 1, "torch": torch.__version__, "world": _env_int("WORLD_SIZE"),
                                    "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "wraps": [], "loaders": {}}
        # Sharing a GPU on purpose: NCCL >= 2.30 allows it with NCCL_MULTI_RANK_GPU_ENABLE=1; older NCCL when
        # each rank sets its own NCCL_HOSTID.
        share = {k: os.environ[v] for k, v in (("multi_rank", "NCCL_MULTI_RANK_GPU_ENABLE"), ("hostid", "NCCL_HOSTID"))
                 if os.environ.get(v)}
        if share:
            self.doc["gpu_share"] = share
        if not rec.config.batch_fingerprint:
            self.doc["fp_off"] = True
        self.models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # wrapped models (train/eval mode)
        self.worker = BackgroundWorker()
        self.alone: _Alone | None = None
        self.alone_checked = False
        self.written = 0  # documents written (tests)
        self.flush_pending = False
        self.closers: list[Callable[[], None]] = []  # undo what is not a recorder patch (import hooks)

    # -- writing -------------------------------------------------------------------------------------
    def _target(self) -> Any:
        if self.rec.mm is not None:
            return self.rec.mm
        alone = self.alone
        return alone.ring.mm if alone is not None and alone.ring is not None else None

    def write(self) -> None:
        """Write the document into the ring, if there is one (else it waits in memory for the ring)."""
        with self.lock:
            mm = self._target()
            if mm is None:
                return
            payload = _fit(self.doc)
            if write_facts(mm, payload):
                self.written += 1

    def changed(self) -> None:
        """The document changed on the training thread: the background worker encodes and writes it (one
        pending write at a time; it writes the latest document)."""
        with self.lock:
            if self.flush_pending:
                return
            self.flush_pending = True
        self.worker.submit(self._flush)

    def _flush(self) -> None:
        with self.lock:
            self.flush_pending = False
        self.write()

    def attached(self) -> None:
        """The recorder made this rank's ring (the default group exists): base facts, then everything
        gathered before. A ring made for a job without a process group is replaced by it. Never raises."""
        try:
            self._attached()
        except Exception as exc:  # noqa: BLE001
            self.rec.fail("writing the setup facts", exc)

    def _attached(self) -> None:
        pg = self.rec.default_pg
        with self.lock:
            self.doc["world"] = pg.size() if pg is not None else self.doc.get("world")
            self.doc["loaders"] = {}  # the new ring's loader table starts empty
            self.doc.pop("no_pg", None)
            alone, self.alone = self.alone, None
        if alone is not None and alone.ring is not None:
            alone.ring.close()
        current = _current_device()
        if current is not None and "device" not in self.doc:
            self.set_device(current, "current", None)
        self.write()

    # -- devices and wraps -----------------------------------------------------------------------------
    def set_device(self, device: dict, how: str, site: dict | None) -> None:
        """Note the device this rank uses. The wrapped model's parameters say it best, then the main
        thread's ``set_device``, then the device current when the group appeared: a weaker fact never
        replaces a stronger one."""
        with self.lock:
            known = self.doc.get("device")
            if known is not None and DEVICE_EVIDENCE[known.get("how")] > DEVICE_EVIDENCE[how]:
                return
            self.doc["device"] = {**device, "how": how, "site": site}
        self.changed()

    def wrapped(self, kind: str, modules: list[torch.nn.Module], group: str, policy: str, site: dict | None) -> None:
        """A model was wrapped by DDP / FSDP / fully_shard at ``site`` (before the wrapper's own work)."""
        params = trainable = 0
        dtypes: set[str] = set()
        device = None
        for m in modules:
            self.models.add(m)
            for p in m.parameters():
                n = p.numel()
                params += n
                trainable += n if p.requires_grad else 0
                dtypes.add(str(p.dtype).replace("torch.", ""))
                if device is None:
                    device = p.device
        with self.lock:
            wraps = self.doc["wraps"]
            key = (site or {}).get("file"), (site or {}).get("line"), kind, group
            entry = next((w for w in wraps if (w["site"] or {}).get("file") == key[0]
                          and (w["site"] or {}).get("line") == key[1] and w["kind"] == kind and w["group"] == group),
                         None)
            if entry is None:
                entry = {"kind": kind, "site": site, "group": group, "calls": 0, "params": 0, "trainable": 0,
                         "dtypes": [], "policy": policy}
                wraps.append(entry)
                del wraps[:-8]
            entry["calls"] += 1
            entry["params"] += params
            entry["trainable"] += trainable
            entry["dtypes"] = sorted(set(entry["dtypes"]) | dtypes)
            entry["policy"] = policy
            entry["t"] = time.time()
        if device is not None and device.type not in ("cpu", "meta"):
            self.set_device(_device_fact(device), "wrap", site)
        else:
            self.changed()

    # -- DataLoader epochs -------------------------------------------------------------------------------
    def loader_epoch(self, loader: Any, slot: int, iterator: Any) -> Any:
        """A DataLoader started an epoch (``slot`` in the ring's loader table). Returns ``iterator``, whose
        first batch is handed to the background worker to be fingerprinted.

        The first ``EPOCHS_KEPT`` epochs of a loader are noted in full (the checks decide on them); after
        that an epoch costs the attribute reads only, unless what they say changed."""
        facts = describe_loader(loader, training_now(list(self.models)))
        key = str(slot)
        with self.lock:
            loaders = self.doc["loaders"]
            first_time = key not in loaders
            prev = loaders.get(key, {})
            iters = prev.get("iters", 0) + 1
            if iters > EPOCHS_KEPT and all(prev.get(k) == facts[k] for k in _STABLE_FACTS):
                prev["iters"] = iters  # written with the next change
                return iterator
            epochs = (prev.get("epochs", []) + [[facts["seed"], facts["epoch"]]])[-EPOCHS_KEPT:]
            entry = {**facts, "iters": iters, "epochs": epochs, "fp": prev.get("fp", {}), "t": time.time()}
            if "dsig" in prev:
                entry["dsig"] = prev["dsig"]
            loaders[key] = entry
            for old in sorted(loaders, key=int)[:-LOADERS_KEPT]:
                del loaders[old]
        self.changed()
        if first_time and facts["dist"] is False:
            self.worker.submit(self._dataset_signature, key, getattr(loader, "dataset", None))
        if self.rec.config.batch_fingerprint and facts["train"] and iters <= FINGERPRINTS_KEPT:
            _on_first_batch(iterator, lambda batch: self.worker.submit(self._fingerprint, key, iters, batch))
        return iterator

    def _fingerprint(self, key: str, iteration: int, batch: Any) -> None:
        fp = fingerprint(batch)
        with self.lock:
            entry = self.doc["loaders"].get(key)
            if entry is None or fp is None:
                return
            fps = {**entry.get("fp", {}), str(iteration): fp}
            entry["fp"] = dict(sorted(fps.items(), key=lambda kv: int(kv[0]))[-FINGERPRINTS_KEPT:])
        self.write()

    def _dataset_signature(self, key: str, dataset: Any) -> None:
        sig = dataset_signature(dataset) if dataset is not None else None
        with self.lock:
            entry = self.doc["loaders"].get(key)
            if entry is None:
                return
            entry["dsig"] = sig
        self.write()

    # -- optimizer steps without a process group ---------------------------------------------------------
    def step_without_group(self, step: int) -> None:
        """An optimizer step while this process has no ring. With WORLD_SIZE > 1 and still no default
        group ``GRACE_S`` after the first such step, make a ring without a group (and start the node's
        watchdog as an attached rank would), so the job can be told each rank trains alone. Never raises."""
        try:
            self._step_without_group(step)
        except Exception as exc:  # noqa: BLE001
            self.rec.fail("noting optimizer steps without a process group", exc)

    def _step_without_group(self, step: int) -> None:
        alone = self.alone
        if alone is None:
            if self.alone_checked:
                return
            self.alone_checked = True
            world = _env_int("WORLD_SIZE")
            if world is None or world <= 1:
                return
            self.alone = _Alone(time.time(), caller_site(sys._getframe(2)), world)
            return
        now = time.time()
        if alone.ring is not None:
            alone.ring.set_step(step, now)
            alone.ring.heartbeat(now, step)
            return
        if now - alone.first < GRACE_S or (dist.is_available() and dist.is_initialized()):
            return
        self._open_alone_ring(alone, step, now)

    def _open_alone_ring(self, alone: _Alone, step: int, now: float) -> None:
        rec = self.rec
        rank, local = _env_int("RANK") or 0, _env_int("LOCAL_RANK") or 0
        path = os.path.join(rec.run_dir, ring_filename(rank))
        alone.ring = RingWriter(
            path, rank=rank, local_rank=local, world_size=alone.world, job_id=os.path.basename(rec.run_dir),
            host=rec.host, backend="none", torch_version=torch.__version__,
            restart_count=_env_int("TORCHELASTIC_RESTART_COUNT") or 0, capacity=64, groups=1, sites=1, loaders=1,
            members=1,
        )
        with self.lock:
            self.doc["no_pg"] = {"since": alone.first, "site": alone.site, "steps": step, "world": alone.world,
                                 "rank": rank, "local_rank": local}
        self.write()
        alone.ring.set_step(step, now)
        alone.ring.heartbeat(now, step)
        atexit.register(_mark_exited, alone.ring)
        log.warning("dtwatch: WORLD_SIZE=%d but no process group after %.0f s of optimizer steps; this rank "
                    "runs alone", alone.world, now - alone.first)
        if rec.config.watchdog == "auto" and local == 0:
            from dtwatch.record.launcher import start_watchdog_async

            start_watchdog_async(rec.run_dir, rec.host, rec.config.watchdog_args)

    def close(self) -> None:
        for undo in self.closers:
            undo()
        self.worker.stop()
        alone = self.alone
        if alone is not None and alone.ring is not None:
            atexit.unregister(_mark_exited)
            _mark_exited(alone.ring)
            alone.ring.close()


def _mark_exited(ring: RingWriter) -> None:
    try:
        if EXIT.unpack_from(ring.mm, OFF_EXIT)[0] == EXIT_RUNNING:
            ring.set_exit(EXIT_CLEAN, 0, "process exited normally")
    except (ValueError, OSError):
        pass  # already closed


def _on_first_batch(iterator: Any, hand_over: Any) -> None:
    """Call ``hand_over(batch)`` with the iterator's first batch, then get out of the way: an instance
    attribute shadows the iterator's ``_next_data`` for one call and removes itself (later batches cost
    nothing)."""
    next_data = getattr(type(iterator), "_next_data", None)
    state = getattr(iterator, "__dict__", None)
    if next_data is None or state is None or "_next_data" in state:
        return  # not torch's iterator protocol, or already waiting for its first batch

    def first_batch() -> Any:
        try:
            del iterator._next_data
        except AttributeError:
            pass
        data = next_data(iterator)
        try:
            hand_over(data)
        except Exception as exc:  # noqa: BLE001
            log.debug("dtwatch: fingerprinting a batch failed: %r", exc)
        return data

    iterator._next_data = first_batch


def _fit(doc: dict[str, Any]) -> bytes:
    """The document encoded within the block's capacity: older fingerprints, then loaders, are dropped."""
    payload = encode_facts(doc)
    if len(payload) <= FACTS_CAPACITY:
        return payload
    trimmed = {**doc, "loaders": {k: {**v, "fp": dict(list(v.get("fp", {}).items())[-1:])}
                                  for k, v in doc["loaders"].items()}}
    keys = sorted(trimmed["loaders"], key=int)
    while True:
        payload = encode_facts(trimmed)
        if len(payload) <= FACTS_CAPACITY or not keys:
            break
        trimmed["loaders"].pop(keys.pop())
        trimmed["truncated"] = True
    if len(payload) > FACTS_CAPACITY:
        payload = encode_facts({"v": 1, "torch": doc.get("torch"), "world": doc.get("world"), "truncated": True})
    return payload


def _device_fact(device: torch.device) -> dict:
    fact: dict[str, Any] = {"type": device.type, "index": device.index, "uuid": ""}
    if device.type == "cuda":
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            fact["index"] = index
            fact["uuid"] = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
            fact["count"] = torch.cuda.device_count()  # the GPUs this process sees
        except Exception:  # noqa: BLE001 - no driver in this process: the index is what is known
            pass
    return fact


def _current_device() -> dict | None:
    """The CUDA device this process uses, when it has initialised CUDA (never initialises it)."""
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return _device_fact(torch.device("cuda", torch.cuda.current_device()))
    except Exception:  # noqa: BLE001
        pass
    return None
