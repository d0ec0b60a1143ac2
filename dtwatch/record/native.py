"""Which recording path a wrapped collective takes: the native one (``_fastpath.c``) or the Python one.

The native path is the Python wrapper (:mod:`dtwatch.record.wrapper`) in C, for the ops that pass one
tensor or none (``all_reduce``, ``broadcast``, ``reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``, ``barrier``, ``send``/``recv``/``isend``/``irecv``, ...): the calls training issues by the
hundred per step. It writes the same record, byte for byte (``tests/test_native.py`` compares the two paths
call by call); lists of tensors, objects and p2p batches stay on the Python path.

Chosen once, at install (``Config.native``, ``DTWATCH_NATIVE``):

* ``auto`` (default): native where the extension loads; otherwise the Python path and one warning saying why;
* ``on``: native, or a :class:`~dtwatch.config.ConfigError` at install naming the setting and the reason
  (for an image that must not silently run the slower path);
* ``off``: the Python path.

The extension is built from source with the machine's C compiler by ``pip install`` (``setup.py``; it is
optional there: without a compiler the package installs, and ``auto`` warns).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dtwatch.config import ConfigError
from dtwatch.ops import FLAG_P2P, NOTHING, TENSOR, OpSpec
from dtwatch.ring import FLAG_ASYNC, FLAG_ENQUEUED, NUMEL_FROM_SHAPE, STATUS_ERROR, STATUS_OK
from dtwatch.ring.layout import RECORD

if TYPE_CHECKING:
    from dtwatch.record.recorder import Recorder

log = logging.getLogger("dtwatch")

NATIVE_PAYLOADS = (TENSOR, NOTHING)  # what the native path records; the rest go through the Python wrapper

_loaded: ModuleType | None = None
_load_error: str | None = None


def load() -> ModuleType | None:
    """The configured extension module, or None (the reason in :func:`load_error`). Loaded once."""
    global _loaded, _load_error
    if _loaded is not None or _load_error is not None:
        return _loaded
    try:
        from dtwatch.record import _fastpath  # type: ignore[attr-defined]  # built by setup.py
        from dtwatch.record.wrapper import DTYPE_CODES_BY_TORCH

        offsets = {f.name: (RECORD.offset(f.name), f.size) for f in RECORD.fields}
        _fastpath.configure(offsets, RECORD.size, dict(DTYPE_CODES_BY_TORCH), NUMEL_FROM_SHAPE, FLAG_ASYNC,
                            FLAG_ENQUEUED, STATUS_OK, STATUS_ERROR)
    except ImportError as exc:
        _load_error = f"the extension is not built ({exc}); pip install builds it where a C compiler is found"
    except Exception as exc:  # noqa: BLE001 - a layout this build does not write, or a broken build
        _load_error = f"{type(exc).__name__}: {exc}"
    else:
        _loaded = _fastpath
    return _loaded


def load_error() -> str | None:
    load()
    return _load_error


def choose(mode: str) -> ModuleType | None:
    """The extension to record with under ``Config.native`` = ``mode`` (see the module doc)."""
    if mode == "off":
        return None
    module = load()
    if module is None:
        if mode == "on":
            raise ConfigError(f"native='on' (DTWATCH_NATIVE=on) asks for dtwatch's native recording path, which "
                              f"cannot load: {_load_error}. Allowed: 'auto', 'on', 'off'")
        log.warning("dtwatch: recording through the Python path (about 1-2 us more per collective): the native "
                    "path cannot load: %s. DTWATCH_NATIVE=off silences this.", _load_error)
    return module


def make_native_wrapper(module: ModuleType | None, rec: Recorder, original: Callable[..., Any],
                        spec: OpSpec) -> Callable[..., Any] | None:
    """The native wrapper of ``original``, or None where the op takes the Python path."""
    kind = spec.kind
    if module is None or rec.native is None or kind.payload not in NATIVE_PAYLOADS:
        return None
    payload_name = kind.payload_arg if kind.payload == TENSOR else None
    wrapper = module.Recorded(
        original, rec, rec.native, rec.groups, spec.code, kind.flags, spec.payload_pos, payload_name, spec.group_pos,
        spec.async_pos, spec.peer_pos, kind.peer_arg, kind.always_async, spec.spans_several,
        bool(kind.flags & FLAG_P2P), spec.returns_before_completion, spec.name,
    )
    functools.update_wrapper(wrapper, original)  # __name__, __doc__, __wrapped__ (for inspect.signature), ...
    return wrapper


__all__ = ["NATIVE_PAYLOADS", "choose", "load", "load_error", "make_native_wrapper"]
