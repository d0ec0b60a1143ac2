"""Call sites: where a collective was called from, interned as small integer ids in the ring.

Every frame's code is classified once by its file name (cached) by :mod:`dtwatch.code_paths`.

A collective gets two sites: ``site``, the innermost frame outside torch and dtwatch (through a wrapper
library, the library's line that called torch), and ``user_site``, the innermost ``USER`` frame (the
user's line that called into the library). For a direct call from user code both are the same.

Resolution is on the hot path, so it is cached: the site ids of a ``USER`` position, by code object and
instruction offset (``f_lineno`` scans the code's line table on every access, ~1 us late in a long
function; ``f_lasti`` is free), are one dict entry, ``positions[(id(code), f_lasti)] -> (site, user
site)``: a direct call from user code costs one frame hop and one lookup. A call from inside a library
or torch cannot be cached by its immediate caller (the user line above it varies), so it walks the
frames, one cached classification per frame, and resolves the two frames it stops at from caches.
The caches are keyed by ``id(code)``, not by the code object: hashing a code object is not cached by
CPython and costs ~1.5 us for a typical training function (it hashes its constants each time). Every
code object keyed is kept alive in ``_codes``, so an id is never reused for another one.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType

from dtwatch.code_paths import INTERNAL, LIBRARY, USER, classify_file, site_file


class SiteTable:
    """Maps frames to site ids registered through ``register(file, line, function) -> id``."""

    def __init__(self, register: Callable[[str, int, str], int]) -> None:
        self._register = register
        self._kinds: dict[str, int] = {}  # co_filename -> INTERNAL / OTHER / LIBRARY / USER
        self._ids: dict[tuple[int, int], int] = {}  # (id(code), line) -> site id
        self.positions: dict[tuple[int, int], tuple[int, int]] = {}  # USER (id(code), f_lasti) -> (site, user site)
        self._other_positions: dict[tuple[int, int], int] = {}  # the same for OTHER / LIBRARY frames -> site
        self._codes: dict[int, CodeType] = {}  # keeps the code objects above alive
        self._lock = threading.Lock()

    def kind(self, code: CodeType) -> int:
        filename = code.co_filename
        kind = self._kinds.get(filename)
        if kind is None:
            kind = self._kinds[filename] = classify_file(filename)
        return kind

    def caller_sites(self, depth: int) -> tuple[int, int]:
        """``(site, user site)`` of the caller ``depth`` frames up (see :meth:`frame_sites`)."""
        return self.frame_sites(sys._getframe(depth + 1))

    def frame_sites(self, f: FrameType | None) -> tuple[int, int]:
        """``(site, user site)`` of a call made in frame ``f`` (hot path when not a direct call).

        ``site``: the first frame outside torch/dtwatch; ``user site``: the first user frame, or ``site``
        when the stack has none (e.g. code run from a ``<string>``). 0 = unknown.
        """
        kinds, positions, others = self._kinds, self.positions, self._other_positions
        site = 0
        # Per frame: one attribute chain and one dict hit (file names cache their hash); ~100 ns of the
        # ~130 ns a frame costs is CPython materialising the frame object for f_back.
        while f is not None:
            code = f.f_code
            kind = kinds.get(code.co_filename)
            if kind is None:
                kind = self.kind(code)
            if kind == USER:
                ids = positions.get((id(code), f.f_lasti))
                if ids is None:
                    ids = self._user_position(f)
                return (site, ids[1]) if site else ids
            if kind != INTERNAL and not site:
                site = others.get((id(code), f.f_lasti)) or self._other_position(f)
            f = f.f_back
        return site, site

    def walk(self, f: FrameType | None) -> list[tuple[CodeType, int, int, int]]:
        """What resolving a call made in ``f`` looks at, for the native path's cache: ``(code, f_lasti, kind, site)``
        of each frame up to the first user frame, ``site`` being the registered id of that position where
        :meth:`frame_sites` uses it (the first frame outside torch and dtwatch, and the user frame), else 0.
        Registers what is new, as :meth:`frame_sites` does."""
        out: list[tuple[CodeType, int, int, int]] = []
        outside = False
        while f is not None:
            code, lasti = f.f_code, f.f_lasti
            kind = self.kind(code)
            if kind == USER:
                ids = self.positions.get((id(code), lasti)) or self._user_position(f)
                out.append((code, lasti, kind, ids[0]))
                break
            site = 0
            if kind != INTERNAL and not outside:
                site = self._other_positions.get((id(code), lasti)) or self._other_position(f)
                outside = True
            out.append((code, lasti, kind, site))
            f = f.f_back
        return out

    def _user_position(self, f: FrameType) -> tuple[int, int]:
        site = self._new_site(f)
        ids = (site, site)
        if site:  # 0 = table full: do not cache, so nothing wrong sticks
            self.positions[(id(f.f_code), f.f_lasti)] = ids
        return ids

    def _other_position(self, f: FrameType) -> int:
        site = self._new_site(f)
        if site:
            self._other_positions[(id(f.f_code), f.f_lasti)] = site
        return site

    def frame_site(self, frame: FrameType) -> int:
        site = self._ids.get((id(frame.f_code), frame.f_lineno))
        return site if site is not None else self._new_site(frame)

    def user_frame(self, frame: FrameType | None) -> FrameType | None:
        """First frame, innermost first, of user code (not torch, dtwatch, the standard library,
        pseudo-files or a third-party library)."""
        while frame is not None:
            if self.kind(frame.f_code) == USER:
                return frame
            frame = frame.f_back
        return None

    def code_frame(self, frame: FrameType | None) -> FrameType | None:
        """First frame, innermost first, of user or library code (not torch, dtwatch, the standard
        library or pseudo-files): where a library's loop or wait sits when the user's code called it."""
        while frame is not None:
            if self.kind(frame.f_code) >= LIBRARY:
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
                site = self._register(site_file(code.co_filename), line or 0, name)
                if site:  # 0 = table full: do not cache, so nothing wrong sticks
                    self._codes[key] = code
                    self._ids[(key, line)] = site
        return site
