"""Every observed rank is inside the same collective, and none of them is missing from it.

    python stalled.py unobserved_peer     (under torchrun, 4 ranks)

The job's process group has a fifth member, rank 4, that dtwatch does not observe (a helper process
started by rank 0 without dtwatch, as a peer on a node without a watchdog would be). After a few
all_reduces it stops taking part, so ranks 0-3 all wait inside the same all_reduce: from what dtwatch
sees, the collective itself does not complete.
"""
import ctypes
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from common import HANG_STEP, finish, mark_onset

WORLD = 5
PEER_RANK = 4
PEER_LIFETIME = 300.0  # the helper never outlives a forgotten job by more than this


def peer() -> None:
    """Rank 4: exits with its parent (rank 0); takes part in the first steps, then stops."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    dist.init_process_group("gloo", rank=PEER_RANK, world_size=WORLD)
    t = torch.ones(4)
    for _ in range(1, HANG_STEP):
        dist.all_reduce(t)
    time.sleep(PEER_LIFETIME)  # site:peer_stops


def main() -> None:
    rank = int(os.environ["RANK"])
    helper = None
    if rank == 0:
        env = dict(os.environ, RANK=str(PEER_RANK), LOCAL_RANK=str(PEER_RANK), DTWATCH_ENABLED="0")
        helper = subprocess.Popen([sys.executable, __file__, "--peer"], env=env)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    t = torch.ones(4)
    for step in range(1, 10):
        if step == HANG_STEP:
            mark_onset()
        dist.all_reduce(t)  # site:stalled_all_reduce
    finish()
    if helper is not None:
        helper.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["--peer"]:
        peer()
    else:
        main()
