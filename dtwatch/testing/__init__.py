"""Tools for reproducing distributed hangs on a machine without GPUs.

Importing this module registers the ``gloo_async`` backend: gloo underneath, NCCL's CPU-side execution
model on top (collectives return before they complete; see :mod:`dtwatch.testing.gloo_async`)::

    import dtwatch.testing
    torch.distributed.init_process_group("gloo_async")
    ...
    dtwatch.testing.synchronize()   # where a GPU job would call torch.cuda.synchronize()
"""
from __future__ import annotations

from dtwatch.testing.gloo_async import BACKEND_NAME, GlooAsyncGroup, register, synchronize

register()

__all__ = ["BACKEND_NAME", "GlooAsyncGroup", "register", "synchronize"]
