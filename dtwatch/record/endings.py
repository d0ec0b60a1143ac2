"""How this process's end gets written down, also when the process cannot say so itself.

* the ring's exit state: a normal exit, or the uncaught exception and the line that raised it
  (:func:`exception_summary`), written by the recorder's ``atexit`` handler and ``sys.excepthook``;
* ``rank-R.exit.json`` (:func:`write_exit_facts`): how the process ended, whole, where the ring's 256
  bytes cannot hold it: an uncaught exception's type, message and frames; ``sys.exit(n)`` (with the
  exception being handled when a framework turned one into an exit status, as Hydra does) or
  ``os._exit(n)`` with the line that called it (:func:`exit_call_facts`);
* ``<run dir>/stacks/rank-R.txt``: faulthandler appends every thread's stack when the stack signal
  (``DTWATCH_STACK_SIGNAL``) arrives, the watchdog's way to see a rank blocked inside C++;
* ``rank-R.fatal.txt`` / ``rank-R.term.txt`` (:func:`ending_files`): faulthandler writes a fatal signal
  (SIGABRT from a gloo size check, SIGSEGV) and the Python stack to the first, a SIGTERM (the launcher
  tearing the job down) to the second, from C signal handlers that run even while the main thread is
  blocked in a collective. The watchdog reads them for a rank that ended without a word in its ring.

This module does not import torch: the watchdog uses :func:`ending_files` too.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, TextIO

import dtwatch.paths as paths
from dtwatch.exception_text import fit_utf8, raised

log = logging.getLogger("dtwatch")


def stack_dump_file(run_dir: str, rank: int) -> str:
    """Where the stack-dump signal writes the rank's Python stacks."""
    return paths.stack_file(run_dir, rank)


def ending_files(run_dir: str, rank: int) -> tuple[str, str]:
    """Where a rank's faulthandler writes on a fatal signal, and on SIGTERM."""
    return paths.ending_files(run_dir, rank)


MAX_MESSAGE = 16384  # characters of an exception's message kept in the exit file
MAX_FRAMES = 48  # frames kept per traceback or call stack
REASON_BYTES = 255  # the ring's exit reason field, less its terminating zero


def exception_facts(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> dict[str, Any]:
    """An exception for the exit file: type, message, frames (innermost first). Never raises."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a __str__ of user code
        message = repr(exc)
    frames = [{"file": f.filename, "line": f.lineno or 0, "function": f.name}
              for f in traceback.extract_tb(tb)][::-1][:MAX_FRAMES]
    return {"type": exc_type.__name__, "message": message[:MAX_MESSAGE], "frames": frames}


def exception_summary(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> str:
    """``Type: message at file:line`` for the ring's exit reason: the message cut at a sentence and its key
    lines kept (:func:`dtwatch.exception_text.short_message`), a DataLoader worker's original exception
    told as such; the line is where it was raised (the worker's innermost frame; else the traceback's)."""
    facts = exception_facts(exc_type, exc, tb)
    told = raised(facts["type"], facts["message"], facts["frames"])
    where = told.frames[0] if told.frames else None
    loc = f" at {where['file']}:{where['line']}" if where else ""
    room = REASON_BYTES - len(loc.encode("utf-8"))
    return fit_utf8(told.text(limit=max(40, room // 2)), room) + loc


def call_frames(frame: FrameType | None) -> list[dict[str, Any]]:
    """A call stack (innermost first) as the exit file keeps frames."""
    out: list[dict[str, Any]] = []
    while frame is not None and len(out) < MAX_FRAMES:
        out.append({"file": frame.f_code.co_filename, "line": frame.f_lineno, "function": frame.f_code.co_name})
        frame = frame.f_back
    return out


def exit_call_facts(how: str, code: object, frame: FrameType | None) -> dict[str, Any]:
    """``sys.exit(code)`` or ``os._exit(code)`` called at ``frame``: the status the process ends with, the
    call's stack, and the exception being handled there, if any (a framework's error exit)."""
    if code is None:
        status = 0
    elif isinstance(code, int) and not isinstance(code, bool):
        status = code
    else:
        status = 1  # sys.exit("message") prints it and ends with status 1
    facts: dict[str, Any] = {"how": how, "code": status, "argument": repr(code)[:200], "frames": call_frames(frame)}
    exc_type, exc, tb = sys.exc_info()
    if exc_type is not None and exc is not None:
        facts["handling"] = exception_facts(exc_type, exc, tb)
    return facts


def write_exit_facts(run_dir: str, rank: int, facts: dict[str, Any]) -> None:
    """Write ``rank-R.exit.json`` (replacing an older one). Never raises: the process is ending."""
    try:
        path = paths.exit_file(run_dir, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(facts, f)
        os.replace(tmp, path)
    except Exception as exc:  # noqa: BLE001 - dtwatch's own failure: the ring still says how it ended
        log.debug("dtwatch: writing the exit file failed: %r", exc)


class SignalFiles:
    """The faulthandler registrations this process made (stack signal, fatal signals, SIGTERM), so that
    uninstalling undoes exactly those. The files stay open to the end: the handlers write from C."""

    def __init__(self) -> None:
        self.stack_signal = 0
        self.stack_file: TextIO | None = None
        self.ending_files: list[TextIO] = []

    def install(self, sig: int, run_dir: str, rank: int, set_stack_signal: Callable[[int], None],
                fail: Callable[[str, BaseException], None]) -> None:
        """Register the stack signal's handler (``set_stack_signal`` tells the ring it is there), then the
        fatal-signal and SIGTERM reports. Nothing when ``sig`` is 0 or this already ran."""
        if not sig or self.stack_file is not None:
            return
        try:
            if signal.getsignal(sig) not in (signal.SIG_DFL, None):
                log.warning("dtwatch: signal %s already has a handler; faulthandler stack dumps are off", sig)
                return
            path = stack_dump_file(run_dir, rank)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.stack_file = open(path, "a", buffering=1)  # written by faulthandler until exit
            faulthandler.register(sig, file=self.stack_file, all_threads=True, chain=False)
            self.stack_signal = sig
            set_stack_signal(sig)
        except Exception as exc:  # noqa: BLE001 - dtwatch's failure: one warning, never into training
            fail("registering faulthandler", exc)
        self._record_endings(run_dir, rank, fail)

    def _record_endings(self, run_dir: str, rank: int, fail: Callable[[str, BaseException], None]) -> None:
        if faulthandler.is_enabled():
            return  # the user's own faulthandler already reports fatal signals; leave it alone
        try:
            fatal, term = ending_files(run_dir, rank)
            os.makedirs(os.path.dirname(fatal), exist_ok=True)
            self.ending_files = [open(fatal, "w"), open(term, "w")]
            faulthandler.enable(file=self.ending_files[0], all_threads=True)
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                # Chained: the handler that was there before (the default: terminate) still runs.
                faulthandler.register(signal.SIGTERM, file=self.ending_files[1], all_threads=False, chain=True)
        except Exception as exc:  # noqa: BLE001
            fail("registering faulthandler for fatal signals", exc)

    def remove(self) -> None:
        """Undo the registrations (uninstall); the files stay as written."""
        if self.stack_signal and self.stack_file is not None:
            try:
                faulthandler.unregister(self.stack_signal)
            except Exception:  # noqa: BLE001 - nothing to undo
                pass
        if self.ending_files:
            try:
                faulthandler.disable()
                faulthandler.unregister(signal.SIGTERM)
            except Exception:  # noqa: BLE001
                pass
