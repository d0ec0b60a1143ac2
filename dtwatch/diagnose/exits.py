"""How a rank ended, told as it was: an exception with its message and the user's line that raised it
(a DataLoader worker's original exception and line), an exit status and the call that gave it (and the
exception a framework turned into it), ``os._exit``, a signal, or nothing recorded.

The facts are the ring's exit state and the rank's exit file (``ending["exit"]``, written as the process
ended: :mod:`dtwatch.record.endings`), whichever is there; the file has the whole message and every
frame, the ring 256 bytes. Pure: no I/O. The words are in :mod:`dtwatch.diagnose.wording.ending_words`.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.wording.ending_words import (
    exit_call_text,
    exit_status_error,
    exit_status_text,
    raised_text,
    ring_ending,
)
from dtwatch.exception_text import Raised, raised, short_message

_AT_LINE = re.compile(r"(?s)^(?P<reason>.*) at (?P<file>\S+):(?P<line>\d+)$")  # "... at FILE:LINE" (the last)
_TYPE_MESSAGE = re.compile(r"(?s)^(?P<type>[A-Za-z_][\w.]*): ?(?P<message>.*)$")
_KILLING = ("KeyboardInterrupt",)  # an exception every rank gets when the job is interrupted


@dataclass(frozen=True)
class Told:
    """One rank's ending, for a sentence: ``rank 1 {text}``."""

    text: str  # "raised ValueError: corrupt sample 1261 (in DataLoader worker process 1)"
    site: dict | None  # the user's line that raised or called the exit; None when not known
    frames: tuple[dict, ...] = ()  # the user's frames there, innermost first
    error: str = ""  # "ValueError: corrupt sample 1261": the error, for grouping ranks that raised the same
    failed: bool = False  # an error ended it: an exception, or an exit status other than 0


def tell(s: RankState, ending: dict | None, is_library: Callable[[str], bool]) -> Told:
    """How ``s`` ended (``ending`` as :meth:`Evidence.ending` gives it; ``is_library(path)`` tells library
    frames from the user's)."""
    facts = (ending or {}).get("exit") or {}
    how = facts.get("how")
    if s.exit_state == "exception":
        told = _exception(facts if how == "exception" else {}, s.exit_reason)
        site, frames = _user_site(told.frames, is_library)
        return Told(raised_text(told.text()), site, frames, told.text(), failed=True)
    if s.exit_state == "exited" and how in ("sys.exit", "os._exit"):
        return _exit_call(facts, is_library)
    if s.exit_state == "exited":  # an exit status (0: a normal exit), the call that gave it not known
        code = s.exit_code
        return Told(exit_status_text(code), None, error=exit_status_error(code) if code else "", failed=bool(code))
    if s.exit_state == "running" and how == "os._exit":  # the ring could not be written, the file was
        return _exit_call(facts, is_library)
    return Told(ring_ending(s.exit_state, s.exit_code, s.exit_reason, s.alive), None)


def _exception(facts: dict, reason: str) -> Raised:
    if facts:
        return raised(str(facts.get("type") or "Exception"), str(facts.get("message") or ""),
                      list(facts.get("frames") or []))
    m = _AT_LINE.match(reason or "")
    text, frames = (m.group("reason"), [{"file": m.group("file"), "line": int(m.group("line"))}]) if m else \
        (reason or "", [])
    tm = _TYPE_MESSAGE.match(text)
    if not tm:
        return Raised(type=text or "an exception", message="", frames=tuple(frames))
    return raised(tm.group("type"), tm.group("message"), frames)


def _user_site(frames: tuple[dict, ...] | list[dict],
               is_library: Callable[[str], bool]) -> tuple[dict | None, tuple[dict, ...]]:
    """The innermost frame of the user's code (the line that raised or called), and the user's frames."""
    user = tuple(f for f in frames if f.get("file") and not is_library(str(f["file"])))
    return (dict(user[0]) if user else None), user


def _exit_call(facts: dict, is_library: Callable[[str], bool]) -> Told:
    code = int(facts.get("code") or 0)
    site, frames = _user_site(list(facts.get("frames") or []), is_library)
    how, argument = str(facts["how"]), facts.get("argument", code)
    handling = facts.get("handling")
    if handling:
        told = raised(str(handling.get("type") or "Exception"), str(handling.get("message") or ""),
                      list(handling.get("frames") or []))
        h_site, h_frames = _user_site(told.frames, is_library)
        # A framework caught the error and ended the process (Hydra: "Error executing job"): the error is
        # what happened, and its line is the one that raised.
        return Told(exit_call_text(how, argument, code, told.text()), h_site or site, h_frames or frames, told.text(),
                    failed=True)
    return Told(exit_call_text(how, argument, code, None), site, frames, exit_status_error(code) if code else "",
                failed=bool(code))


def same_error(a: Told, b: Told) -> bool:
    """Two ranks that failed the same way (their messages may differ only in rank numbers and addresses)."""
    return _shape(a.error) == _shape(b.error)


def _shape(error: str) -> str:
    return re.sub(r"\d+", "N", short_message(error, 120))


def interrupted(told: Told) -> bool:
    """An ending every rank shares when the job is interrupted (Ctrl-C), not an error of the program."""
    return any(told.error.startswith(k) for k in _KILLING)
