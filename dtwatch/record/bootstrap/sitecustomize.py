"""Installed on PYTHONPATH by ``dtwatch run``: install dtwatch in each training worker, then chain.

Only processes with a ``RANK`` (torchrun workers and most launchers' workers) install dtwatch, so
the launcher itself and unrelated Python tools are untouched.
"""
import os
import sys


def _chain_next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("DTWATCH_BOOTSTRAP") == "1" and "RANK" in os.environ:
    try:
        import dtwatch.auto  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - never break the worker's start
        sys.stderr.write(f"dtwatch: not installed in this worker: {exc}\n")
try:
    _chain_next_sitecustomize()
except Exception as exc:  # noqa: BLE001
    sys.stderr.write(f"dtwatch: the original sitecustomize failed: {exc}\n")
