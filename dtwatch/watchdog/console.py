"""Writing to the console the user watches, from the watchdog, while the ranks' main threads are blocked.

Where that console is depends on how the job was started:

* ``auto`` (the default): the standard error of a live local rank (``/proc/<pid>/fd/2``), which is
  torchrun's terminal, the file torchrun ``--tee``/``--redirects`` writes, or, in Kubernetes with a shared
  PID namespace, the trainer container's log. If no rank is alive any more (a crash), the rank's
  launcher (its parent when first seen, e.g. torchrun) is tried.
* ``stderr``: the watchdog's own standard error (``dtwatch run`` passes this: the watchdog inherits
  the terminal of the command it runs).
* ``off``: nothing.

A terminal or pipe is opened anew for each message, non-blocking, and written with one ``write``
(messages are shorter than ``PIPE_BUF``, so they are not interleaved with the rank's own output); a
full pipe or a refused open is reported to the caller, never waited on. A regular file is written
through a duplicate of the process's own descriptor (``pidfd_getfd``, which needs the ptrace rights
the watchdog has anyway for py-spy), so the process's next write lands after the message instead of
over it; the same duplicate reaches a pipe this process may not open itself (a container log pipe
owned by the runtime), written only while it polls writable.
"""
from __future__ import annotations

import os
import select
import stat
import sys
from dataclasses import dataclass

MODES = ("auto", "stderr", "off")
_SKIP = ("/dev/null",)


@dataclass
class Delivery:
    ok: bool
    where: str  # "stderr of pid 1234" / "watchdog stderr" / ""
    error: str = ""


def write_to_process_stderr(pid: int, text: str) -> Delivery:
    """Append ``text`` to the standard error of process ``pid`` without ever blocking on it."""
    path = f"/proc/{pid}/fd/2"
    try:
        target = os.readlink(path)
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError as exc:
        return Delivery(False, "", f"pid {pid}: {exc.strerror or exc}")
    if target in _SKIP:
        return Delivery(False, "", f"pid {pid}: its stderr is {target}")
    data = text.encode("utf-8", "replace")
    # A file (`torchrun ... > train.log`): through the process's own open file first, so that its offset
    # moves past our text (through a file of our own, its next write would overwrite it). A terminal or
    # pipe: our own non-blocking open first; the process's own descriptor when we may not open it (a
    # container's log pipe belongs to the runtime's user) but may ptrace the process.
    ways = (_write_borrowed, _write_reopened) if regular else (_write_reopened, _write_borrowed)
    errors = []
    for way in ways:
        error = way(pid, path, data, regular)
        if error is None:
            return Delivery(True, f"stderr of pid {pid} ({target})")
        errors.append(error)
    return Delivery(False, "", f"pid {pid}, stderr {target}: " + "; ".join(errors))


def _write_reopened(pid: int, path: str, data: bytes, regular: bool) -> str | None:
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        return f"cannot open it ({exc.strerror or exc})"
    try:
        written = os.write(fd, data)
        return None if written == len(data) else f"it took {written} of {len(data)} bytes (pipe full)"
    except OSError as exc:
        return f"cannot write to it ({exc.strerror or exc})"
    finally:
        os.close(fd)


def _write_borrowed(pid: int, path: str, data: bytes, regular: bool) -> str | None:
    fd = _borrow_fd(pid, 2)
    if fd is None:
        return "cannot borrow its descriptor (pidfd_getfd needs ptrace rights and Linux 5.6)"
    try:
        # The process's descriptor may block: write to a pipe or terminal only what it takes at once.
        for start in range(0, len(data), _PIPE_BUF):
            chunk = data[start:start + _PIPE_BUF]
            if not regular and not select.select([], [fd], [], 0)[1]:
                return "it is not writable now (pipe full or terminal stopped)"
            os.write(fd, chunk)
        return None
    except OSError as exc:
        return f"cannot write to it ({exc.strerror or exc})"
    finally:
        os.close(fd)


_PIPE_BUF = 4096  # a pipe that polls writable takes this much without blocking (Linux PIPE_BUF)
_SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture (added in 5.6)


def _borrow_fd(pid: int, fd: int) -> int | None:
    """A duplicate of process ``pid``'s descriptor ``fd`` (``pidfd_getfd``: needs ptrace rights), or None."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        import ctypes

        pidfd = os.pidfd_open(pid)
    except (OSError, ImportError):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        dup = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        return dup if dup >= 0 else None
    except (OSError, AttributeError):
        return None
    finally:
        os.close(pidfd)


def show(text: str, mode: str, candidates: list[int]) -> Delivery:
    """Write ``text`` to the console chosen by ``mode``; ``candidates`` are PIDs in order of preference."""
    if mode == "off":
        return Delivery(False, "", "console output is off")
    if mode == "stderr":
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
            return Delivery(True, "watchdog stderr")
        except (OSError, ValueError) as exc:
            return Delivery(False, "", f"the watchdog's stderr: {exc}")
    errors = []
    for pid in candidates:
        done = write_to_process_stderr(pid, text)
        if done.ok:
            return done
        errors.append(done.error)
    return Delivery(False, "", "; ".join(errors) or "no live process of the job on this node")
