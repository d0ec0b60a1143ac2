"""dtwatch: makes hung and desynchronised PyTorch distributed jobs explain themselves.

In a training script::

    import dtwatch.auto          # first line: installs from DTWATCH_* environment variables
    # or
    import dtwatch
    dtwatch.install(stall_window=...)   # before torch.distributed.init_process_group

Zero-edit: ``dtwatch run -- torchrun --nproc-per-node 4 train.py``.
"""
from __future__ import annotations

from dtwatch.config import Config, ConfigError
from dtwatch.ring import RankSnapshot, Record, RingFormatError, Site, find_rings, read_ring, read_rings
from dtwatch.version import __version__


def install(**options):
    """Start recording this process's collectives. Idempotent. See :class:`dtwatch.Config` for options."""
    from dtwatch.record.installation import install as _install

    return _install(**options)


def uninstall():
    """Stop recording and restore every function dtwatch replaced."""
    from dtwatch.record.installation import uninstall as _uninstall

    return _uninstall()


def is_installed() -> bool:
    from dtwatch.record.installation import active

    return active() is not None


def step() -> None:
    """Mark the end of a training step (explicit use turns off counting optimizer steps)."""
    from dtwatch.record.installation import step as _step

    _step()


__all__ = [
    "Config",
    "ConfigError",
    "RankSnapshot",
    "Record",
    "RingFormatError",
    "Site",
    "__version__",
    "find_rings",
    "install",
    "is_installed",
    "read_ring",
    "read_rings",
    "step",
    "uninstall",
]
