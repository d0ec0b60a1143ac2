"""Call sites: the first frame outside torch and dtwatch, interned as small integer ids in the ring.

Resolution is on the hot path, so both steps are cached: whether a code object is internal, and the
site id (by code object and instruction offset: ``f_lineno`` scans the code's line table on every
access, ~1 us late in a long function; ``f_lasti`` is free). A call from user code costs one frame
hop and two dict lookups.
The caches are keyed by ``id(code)``, not by the code object: hashing a code object is not cached by
CPython and costs ~1.5 us for a typical training function (it hashes its constants each time). Every
code object keyed is kept alive in ``_codes``, so an id is never reused for another one.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import threading
from types import CodeType, FrameType
from typing import Callable

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DTWATCH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple(
    {os.path.abspath(p) + os.sep for p in (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")) if p}
)


def _is_internal_file(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR) or filename.startswith(_DTWATCH_DIR) or filename.startswith("<frozen")


class SiteTable:
    """Maps frames to site ids registered through ``register(file, line, function) -> id``."""

    def __init__(self, register: Callable[[str, int, str], int]) -> None:
        self._register = register
        self._internal: dict[int, bool] = {}  # id(code) -> torch/dtwatch?
        self._user: dict[int, bool] = {}  # for the sampler: also skips the standard library
        self._ids: dict[tuple[int, int], int] = {}  # (id(code), line) -> site id
        self.positions: dict[tuple[int, int], int] = {}  # (id(code), f_lasti) -> site id (hot path)
        self._codes: dict[int, CodeType] = {}  # keeps the code objects above alive
        self._lock = threading.Lock()

    def caller_site(self, depth: int) -> int:
        """Site id of the first frame outside torch/dtwatch, starting ``depth`` frames up (hot path)."""
        f = sys._getframe(depth + 1)
        internal = self._internal
        while f is not None:
            key = id(f.f_code)
            flag = internal.get(key)
            if flag is None:
                code = f.f_code
                self._codes[key] = code
                flag = internal[key] = _is_internal_file(os.path.abspath(code.co_filename))
            if not flag:
                break
            f = f.f_back
        if f is None:
            return 0
        pos = (key, f.f_lasti)
        site = self.positions.get(pos)
        if site is None:
            site = self._new_site(f)
            if site:
                self.positions[pos] = site
        return site

    def frame_site(self, frame: FrameType) -> int:
        site = self._ids.get((id(frame.f_code), frame.f_lineno))
        return site if site is not None else self._new_site(frame)

    def user_frame(self, frame: FrameType | None) -> FrameType | None:
        """First frame, innermost first, that is not torch, dtwatch or the standard library."""
        user = self._user
        while frame is not None:
            code = frame.f_code
            key = id(code)
            flag = user.get(key)
            if flag is None:
                path = os.path.abspath(code.co_filename)
                self._codes[key] = code
                flag = user[key] = not (_is_internal_file(path) or path.startswith(_STDLIB_DIRS))
            if flag:
                return frame
            frame = frame.f_back
        return None

    def _new_site(self, frame: FrameType) -> int:
        code, line = frame.f_code, frame.f_lineno
        key = id(code)
        with self._lock:
            site = self._ids.get((key, line))
            if site is None:
                name = getattr(code, "co_qualname", code.co_name)
                site = self._register(os.path.abspath(code.co_filename), line or 0, name)
                if site:  # 0 = table full: do not cache, so nothing wrong sticks
                    self._codes[key] = code
                    self._ids[(key, line)] = site
        return site
