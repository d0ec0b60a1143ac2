"""How the recorder notices the default process group while it has no ring: a probe on the first use
of ``torch.distributed``, and a background poll. Both end once the ring exists."""
from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dtwatch.code_paths import PACKAGE_DIR


class Attachable(Protocol):
    """What the probe and the poll use of the recorder."""

    @property
    def mm(self) -> object:
        """The ring's mapping; None while there is no ring."""

    @property
    def stopped(self) -> threading.Event:
        """Set when recording stops for good (uninstall, exit)."""

    def attach(self) -> None: ...

    def fail(self, what: str, exc: BaseException | None = None) -> None: ...


class UnattachedProbe:
    """Sees every use of ``torch.distributed`` while this process has no ring, and nothing once it has one.

    It wraps c10d's ``_rank_not_in_group``, which every collective (and ``get_rank(group)``) calls first,
    and is removed as soon as the ring exists, so it costs attached training nothing. On a call it
    attaches if a default process group exists by now (however it was created); if collectives run on
    a group while there is no default group (a ``ProcessGroup`` constructed directly), it says once
    that this process is not watched, and why.
    """

    NAME = "_rank_not_in_group"

    def __init__(self, rec: Attachable, original: Callable[[Any], bool]) -> None:
        self.rec, self.original = rec, original
        self.wrapper: Callable[[Any], bool] | None = None
        self.warned = False

    @classmethod
    def install(cls, rec: Attachable) -> UnattachedProbe | None:
        c10d = dist.distributed_c10d
        original = getattr(c10d, cls.NAME, None)
        if original is None or getattr(original, "__dtwatch_probe__", False):
            return None  # another torch: the poll thread still attaches
        probe = cls(rec, original)

        @functools.wraps(original)
        def _rank_not_in_group(group: Any) -> bool:
            probe.seen(group)
            return original(group)

        _rank_not_in_group.__dtwatch_probe__ = True  # type: ignore[attr-defined]  # mypy: no attributes on functions
        probe.wrapper = _rank_not_in_group
        setattr(c10d, cls.NAME, _rank_not_in_group)
        return probe

    def seen(self, group: Any) -> None:
        rec = self.rec
        try:
            if rec.mm is not None:
                return
            if dist.is_initialized():
                rec.attach()
            elif group is not None and not self.warned:
                self.warned = True
                warnings.warn(
                    "dtwatch: torch.distributed is used on a process group while no default process group "
                    "exists (the group was constructed directly, not by init_process_group or "
                    "init_device_mesh); dtwatch records a job once its default process group exists, so "
                    "this process is not watched", RuntimeWarning, stacklevel=_caller_level())
        except Exception as exc:  # noqa: BLE001 - dtwatch's failure: one warning, never into training
            rec.fail("attaching on first use", exc)

    def remove(self) -> None:
        c10d = dist.distributed_c10d
        if getattr(c10d, self.NAME, None) is self.wrapper:
            setattr(c10d, self.NAME, self.original)


_LIBRARY_DIRS = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (torch,)) + (PACKAGE_DIR,)


def _caller_level() -> int:
    """``stacklevel`` for a warning raised here that names the first frame outside torch and dtwatch."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


class DefaultGroupPoll(threading.Thread):
    """Attaches within ``INTERVAL`` of the default group appearing, for jobs that never call a Python
    collective (DDP-only: their collectives are issued from C++) on torches without the c10d hook."""

    INTERVAL = 0.5

    def __init__(self, rec: Attachable) -> None:
        super().__init__(name="dtwatch-attach", daemon=True)
        self.rec = rec

    def run(self) -> None:
        rec = self.rec
        while rec.mm is None and not rec.stopped.wait(self.INTERVAL):
            try:
                rec.attach()
            except Exception as exc:  # noqa: BLE001
                rec.fail("attaching from the poll", exc)
                return
