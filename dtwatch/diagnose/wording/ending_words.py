"""The words of how one rank ended (:mod:`dtwatch.diagnose.exits`, :class:`~dtwatch.diagnose.rank_state.RankState`
and :meth:`~dtwatch.diagnose.context.Context.how_it_ended`), from the facts the ring and the rank's exit file hold:
an exception, an exit status and the call that gave it, a signal, or nothing recorded. Each phrase follows
``rank N``. Nothing here decides which ending it was.

This module imports nothing of the diagnosis: :mod:`~dtwatch.diagnose.rank_state`, which every decision and
words module imports, takes its phrase from here.
"""
from __future__ import annotations

_EXITED_NORMALLY = "exited normally (no exception, exit status or signal was recorded)"

STILL_RUNNING = "is running"  # a rank whose process has not ended

_SIGNALS = {
    "SIGABRT": "was aborted (SIGABRT, raised by native code such as a gloo or NCCL check)",
    "SIGTERM": "was terminated (SIGTERM: the launcher tearing the job down, or a scheduler)",
    "unknown fatal signal": "died of a fatal signal (faulthandler recorded the crash, not which signal)",
}


def ring_ending(exit_state: str, exit_code: int, exit_reason: str, alive: bool | None) -> str:
    """How a rank ended as its ring alone tells it (``exit_state``: running / exited / exception / signal /
    detached; ``exit_reason``: the exception, or what gave the exit status; ``alive``: None where unknown)."""
    if exit_state == "exception":
        return f"raised {exit_reason}"
    if exit_state == "exited" and exit_code:
        return f"exited with status {exit_code} ({exit_reason})" if exit_reason else \
            f"exited with status {exit_code}"
    if exit_state == "exited":
        return _EXITED_NORMALLY
    if exit_state == "detached":
        return "uninstalled dtwatch"
    if alive is False:
        return ("ended without a Python exception or a normal exit (no exit was recorded: a signal such as "
                "SIGKILL, or os._exit)")
    return "running"


def signal_ending(signal: str) -> str:
    """A rank ended by the signal faulthandler recorded (``unknown fatal signal`` where it could not tell which)."""
    return _SIGNALS.get(signal) or f"was killed by {signal}"


def signal_after_exit(exited: str, signal: str) -> str:
    """A rank that ``exited`` (its exit as told) and then got a fatal ``signal`` after its exit handlers ran: its
    interpreter's teardown crashed (a gloo or NCCL destructor), or the launcher ended it then."""
    head = "finished its program normally" if exited == _EXITED_NORMALLY else exited
    return f"{head}, then {signal_ending(signal)} as its interpreter shut down"


def signal_while_running(exited: str, signal: str) -> str:
    """A rank that ``exited`` (as told) after a ``signal`` that came while its Python code ran (a handler of the
    program's own took it: a graceful shutdown on SIGTERM)."""
    head = "exited normally (no exception or exit status was recorded)" if exited == _EXITED_NORMALLY else exited
    return f"{head}, having received {signal} while it ran"


def raised_text(error: str) -> str:
    """``error``: the exception as told, ``ValueError: corrupt sample 1261 (in DataLoader worker process 1)``."""
    return f"raised {error}"


def exit_status_text(code: int) -> str:
    """An exit status recorded without the call that gave it (0: a normal exit)."""
    return f"exited with status {code}" if code else _EXITED_NORMALLY


def exit_status_error(code: int) -> str:
    """An error status as the error of a rank that ended with it (to group ranks that failed alike)."""
    return f"exit status {code}"


def exit_call_text(how: str, argument: object, code: int, handling: str | None) -> str:
    """An exit call: ``how`` is ``sys.exit`` or ``os._exit``, ``argument`` what it was passed, ``code`` the status
    it gave; ``handling``: the exception a framework caught and turned into the exit, as told (None for none)."""
    call = f"{how}({argument})"
    text = f"ended the process with {call}" if how == "os._exit" else f"exited with status {code} through {call}"
    return text if handling is None else f"{text} while handling {handling}"
