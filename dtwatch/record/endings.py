"""How this process's end gets written down, also when the process cannot say so itself.

* the ring's exit state: a normal exit, or the uncaught exception and the line that raised it
  (:func:`exception_summary`), written by the recorder's ``atexit`` handler and ``sys.excepthook``;
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
import logging
import os
import signal
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from dtwatch import paths

log = logging.getLogger("dtwatch")


def stack_dump_file(run_dir: str, rank: int) -> str:
    """Where the stack-dump signal writes the rank's Python stacks."""
    return paths.stack_file(run_dir, rank)


def ending_files(run_dir: str, rank: int) -> tuple[str, str]:
    """Where a rank's faulthandler writes on a fatal signal, and on SIGTERM."""
    return paths.ending_files(run_dir, rank)


def exception_summary(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> str:
    """``Type: message at file:line``, the line being where the exception was raised (innermost frame)."""
    where = ""
    while tb is not None:
        where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{exc_type.__name__}: {exc}{where}"


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
