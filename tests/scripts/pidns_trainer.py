"""Stand-in trainer for the shared-PID-namespace tests (tests/test_helm.py).

    python pidns_trainer.py READY_FILE [LIFETIME_SECONDS]

Writes its PID, as its own PID namespace numbers it, to READY_FILE, then blocks inside
``dtwatch_pidns_blocked_in_collective`` (the name the tests look for in py-spy's dump) until it is
killed or LIFETIME_SECONDS (default 60) have passed, so a failed test never leaves it behind.
"""
from __future__ import annotations

import os
import sys
import time


def dtwatch_pidns_blocked_in_collective(ready_file: str, lifetime: float) -> None:
    tmp = f"{ready_file}.tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, ready_file)
    deadline = time.monotonic() + lifetime
    while time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    dtwatch_pidns_blocked_in_collective(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
