"""Whether a process on this machine is alive, and its scheduler state, as ``/proc`` says.

The watchdog and ``dtwatch analyze`` read it for ranks on their machine and hand it to
:func:`dtwatch.diagnose.rank_state.from_snapshot`; the diagnosis itself reads nothing.
"""
from __future__ import annotations

import os


def process_state(pid: int) -> tuple[bool, str]:
    """(alive, /proc state letter) of a local process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
        letter = raw[raw.rindex(")") + 2]
        return letter not in ("Z", "X"), letter
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True, ""
    except ProcessLookupError:
        return False, ""
    except PermissionError:
        return True, ""
