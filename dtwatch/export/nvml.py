"""GPU readings per rank from NVML, for the ``dtwatch_gpu_*`` metrics.

Each rank's ring says which GPU the rank uses: ``gpu_uuid`` (torch's device UUID, preferred: it
names one physical GPU whatever ``CUDA_VISIBLE_DEVICES`` and device ordering say) or
``device_index`` (torch's index, mapped through ``CUDA_VISIBLE_DEVICES`` of the watchdog's
environment, which torchrun's ranks inherit from the same launcher; with ``CUDA_DEVICE_ORDER`` left
at CUDA's default the index order may differ from NVML's, which is why the UUID wins)::

    from dtwatch.export.nvml import GpuSampler

    gpu = GpuSampler()                     # no NVML / no GPU: disabled with one info log
    readings = gpu.sample(view.local)      # {rank: {"gpu": 0, "utilization": 0.93, ...}} or {}

The exporters own this: pass one sampler as ``gpu=`` to both :class:`~dtwatch.export.prometheus.PrometheusExporter`
and :class:`~dtwatch.export.otel.OtelExporter`; each calls ``sample(view.local)`` on update, and the sampler
reads NVML at most every ``min_interval`` seconds (answering from its cache in between).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtwatch.diagnose.rank_state import RankState

log = logging.getLogger("dtwatch.export.nvml")


def normalize_uuid(text: str) -> str:
    """``GPU-1a2b...`` (NVML, CUDA_VISIBLE_DEVICES) and ``1a2b...`` (torch) to one comparable form."""
    t = text.strip().lower()
    return t[4:] if t.startswith("gpu-") else t


def physical_index(device_index: int, visible: str | None, uuids: list[str]) -> int | None:
    """NVML index of torch device ``device_index`` given ``CUDA_VISIBLE_DEVICES`` (None: unset).

    Entries may be NVML indices or (prefixes of) GPU UUIDs; MIG instances are not mapped.
    """
    if device_index < 0:
        return None
    if visible is None:
        return device_index if device_index < len(uuids) else None
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if device_index >= len(entries):
        return None
    entry = entries[device_index]
    if entry.isdigit():
        i = int(entry)
        return i if i < len(uuids) else None
    if entry.lower().startswith("gpu-"):
        want = normalize_uuid(entry)
        matches = [i for i, u in enumerate(uuids) if normalize_uuid(u).startswith(want)]
        return matches[0] if len(matches) == 1 else None
    return None


def index_for(state: RankState, visible: str | None, uuids: list[str]) -> int | None:
    """NVML index of the GPU a rank uses: by its UUID when the ring has one, else by device index."""
    if state.gpu_uuid:
        want = normalize_uuid(state.gpu_uuid)
        for i, u in enumerate(uuids):
            if normalize_uuid(u) == want:
                return i
        return None
    return physical_index(state.device_index, visible, uuids)


class GpuSampler:
    """Samples utilisation, memory, power and temperature of the GPUs the local ranks use.

    Never raises: without NVML (no driver, no ``nvidia-ml-py``, no GPU) it is disabled with one
    info log and :meth:`sample` returns ``{}``; a reading a GPU does not support is left out.
    """

    def __init__(self, *, min_interval: float = 5.0, environ: Mapping[str, str] | None = None) -> None:
        if min_interval < 0:
            raise ValueError(f"min_interval must be >= 0 seconds, got {min_interval!r}")
        self.min_interval = min_interval
        env = os.environ if environ is None else environ
        self.visible = env.get("CUDA_VISIBLE_DEVICES")
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._uuids: list[str] = []
        self._cache: dict[int, dict[str, Any]] = {}
        self._cache_key: tuple[tuple[int, int, str], ...] = ()
        self._cache_time = float("-inf")
        self.enabled = self._init()

    def _init(self) -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, driver errors
            log.info("dtwatch: NVML not available (%s); GPU metrics are off", exc)
            return False
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        except Exception as exc:  # noqa: BLE001
            log.info("dtwatch: NVML found no usable GPU (%s); GPU metrics are off", exc)
            _quiet(pynvml.nvmlShutdown)
            return False
        if not self._handles:
            log.info("dtwatch: NVML reports no GPU; GPU metrics are off")
            _quiet(pynvml.nvmlShutdown)
            return False
        self._nvml = pynvml
        return True

    def sample(self, ranks: Iterable[RankState]) -> dict[int, dict[str, Any]]:
        """``{rank: {"gpu", "utilization", "memory_used", "memory_total", "power_watts", "temperature_celsius"}}``."""
        if not self.enabled:
            return {}
        ranks = list(ranks)
        key = tuple(sorted((s.rank, s.device_index, s.gpu_uuid) for s in ranks))
        with self._lock:
            now = time.monotonic()
            if key == self._cache_key and now - self._cache_time < self.min_interval:
                return dict(self._cache)
            by_gpu: dict[int, dict[str, Any]] = {}
            out: dict[int, dict[str, Any]] = {}
            for s in ranks:
                idx = index_for(s, self.visible, self._uuids)
                if idx is None:
                    continue
                if idx not in by_gpu:
                    by_gpu[idx] = self._read(idx)
                out[s.rank] = by_gpu[idx]
            self._cache, self._cache_key, self._cache_time = out, key, now
            return dict(out)

    def _read(self, idx: int) -> dict[str, Any]:
        nv, h = self._nvml, self._handles[idx]
        reading: dict[str, Any] = {"gpu": idx}
        probes = {
            "utilization": lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
            "memory_used": lambda: nv.nvmlDeviceGetMemoryInfo(h).used,
            "memory_total": lambda: nv.nvmlDeviceGetMemoryInfo(h).total,
            "power_watts": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "temperature_celsius": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        }
        for name, probe in probes.items():
            try:
                reading[name] = float(probe())
            except Exception:  # noqa: BLE001 - not supported on this GPU, or a transient NVML error
                pass
        return reading

    def close(self) -> None:
        """Release NVML (idempotent)."""
        with self._lock:
            if self._nvml is not None:
                _quiet(self._nvml.nvmlShutdown)
                self._nvml = None
            self.enabled = False


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _quiet(fn: Any) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass


__all__ = ["GpuSampler", "index_for", "normalize_uuid", "physical_index"]
