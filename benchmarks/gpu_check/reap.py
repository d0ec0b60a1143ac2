"""``python reap.py MARK...``: end, by PID, every process whose environment holds GPU_CHECK_MARK=MARK."""
import sys

from common import reap, say

if __name__ == "__main__":
    for mark in sys.argv[1:]:
        pids = reap(mark)
        if pids:
            say(f"  reaped {mark}: {pids}")
