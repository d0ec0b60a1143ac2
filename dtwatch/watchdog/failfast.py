"""--fail-fast: end this node's ranks and everything they started, so torchrun / Kubernetes can restart
the job instead of waiting out the collective timeout."""
from __future__ import annotations

import logging
import os

from dtwatch.diagnose.rank_state import RankState
from dtwatch.render.notice import render_fail_fast
from dtwatch.watchdog.outputs import Outputs
from dtwatch.watchdog.proctree import Termination, identity, running, terminate_trees, tree

log = logging.getLogger("dtwatch")


def end_ranks(local: list[RankState], current: dict[int, tuple[int, float]], outputs: Outputs, *,
              grace: float) -> Termination | None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, for the ranks of ``local`` still running as the same
    process (``current``: rank -> (pid, start time) now) and their descendants; None when none was alive.
    Says so on the console, in the log and in the events file."""
    live = [s for s in local if running(s.pid) and current.get(s.rank, (s.pid, 0.0))[0] == s.pid]
    if not live:
        log.info("dtwatch: --fail-fast: no rank of this node is alive any more; nothing to end")
        return None
    ranks = [s.rank for s in live]
    roots = [p for p in (identity(s.pid) for s in live) if p is not None]
    started = len(tree(roots, frozenset({os.getpid()}))) - len(live)
    log.error("dtwatch: --fail-fast: terminating this node's ranks %s and their descendants", ranks)
    outputs.show(render_fail_fast(ranks, max(started, 0)), what="the --fail-fast notice")
    done = terminate_trees([s.pid for s in live], grace=grace)
    if not done.roots:
        return None
    log.error("dtwatch: --fail-fast: ended ranks %s (pids %s) and %d descendant(s) %s; SIGKILL needed for %s%s",
              ranks, done.roots, len(done.descendants), done.descendants, done.killed or "none",
              f"; STILL ALIVE: {done.survivors}" if done.survivors else "")
    outputs.event({"event": "fail_fast", "ranks": ranks, "pids": done.roots, "descendants": done.descendants,
                   "killed": done.killed, "survivors": done.survivors})
    return done
