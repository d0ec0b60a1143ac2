"""``import dtwatch.auto``: install dtwatch configured from ``DTWATCH_*`` environment variables.

Put it first in a training script (before ``init_process_group``). Set ``DTWATCH_ENABLED=0`` to
turn it off without editing the script. It never raises: a failure is one warning.
"""
import warnings as _warnings

try:
    from dtwatch.config import enabled as _enabled

    if _enabled():
        from dtwatch.record.installation import install as _install

        _install()
except Exception as _exc:  # noqa: BLE001 - an import in a training script must not fail
    _warnings.warn(f"dtwatch: not installed: {_exc}", RuntimeWarning, stacklevel=2)
