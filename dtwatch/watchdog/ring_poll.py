"""Reading this node's rings each poll: who is there, who was replaced, what completed since last time."""
from __future__ import annotations

import logging
import socket

import numpy as np

from dtwatch.ring import FLAG_MARKER, RankSnapshot, find_rings
from dtwatch.ring.reader import try_read_ring
from dtwatch.watchdog.proctree import parent_pid

log = logging.getLogger("dtwatch")


class RingReader:
    """The rings of one node's ranks in a run directory. Owned by the poll thread; other threads only
    read ``identity`` and ``parents``, which each poll replaces whole (never edits), so a reader on another
    thread always sees one consistent mapping."""

    def __init__(self, run_dir: str, node: str) -> None:
        self.run_dir, self.node = run_dir, node
        self.identity: dict[int, tuple[int, float]] = {}  # rank -> (pid, start_time) of its current process
        self.restarts: dict[int, int] = {}  # rank -> times its process was replaced
        self.parents: dict[int, int] = {}  # rank -> its parent (launcher) when first seen
        self.processed: dict[int, int] = {}  # rank -> highest stamp looked at
        self.in_flight: dict[int, set[int]] = {}  # rank -> stamps seen in flight, handed over when they complete
        self.damaged: dict[str, str] = {}  # ring path -> what was wrong with it when last said (said once)

    def read(self) -> dict[int, RankSnapshot]:
        """This node's rings as they are now, by rank (a restarted rank's newest process)."""
        snaps: dict[int, RankSnapshot] = {}
        identity, parents = dict(self.identity), dict(self.parents)  # replaced whole below: see the class
        for path in find_rings(self.run_dir):
            snap, problem = try_read_ring(path)
            if snap is None:  # damaged (not a torn record: those are read at the next poll): said once
                if problem is not None and self.damaged.get(str(path)) != problem.problem:
                    log.warning("dtwatch WARNING [damaged_input]: %s", problem.line())
                self.damaged[str(path)] = problem.problem if problem is not None else ""
                continue
            self.damaged.pop(str(path), None)
            if snap.host != self.node and snap.host != socket.gethostname():
                continue
            ident = (snap.pid, snap.start_time)
            old = identity.get(snap.rank)
            if old is not None and old != ident:
                self.restarts[snap.rank] = self.restarts.get(snap.rank, 0) + 1
                self.processed[snap.rank] = 0
                self.in_flight[snap.rank] = set()
            if old != ident:
                ppid = parent_pid(snap.pid)
                if ppid is not None:
                    parents[snap.rank] = ppid
            identity[snap.rank] = ident
            snaps[snap.rank] = snap
        self.identity, self.parents = identity, parents
        return snaps

    def take_new_records(self, snaps: dict[int, RankSnapshot]) -> dict[int, np.ndarray]:
        """Records completed since the last poll, per rank. A record still in flight is handed over once it
        completes, however many later records completed before it (an irecv may stay posted for long)."""
        out = {}
        for rank, snap in snaps.items():
            recs = snap.records
            last, waiting = self.processed.get(rank, 0), self.in_flight.get(rank, set())
            stamps = recs["stamp"]
            fresh = (stamps > last) | np.isin(stamps, list(waiting))
            done = recs[fresh & (recs["t_exit"] != 0.0)]
            self.in_flight[rank] = set(int(x) for x in stamps[fresh & (recs["t_exit"] == 0.0)])
            if len(recs):
                self.processed[rank] = max(last, int(stamps.max()))
            out[rank] = done
        return out


def collective_durations(new_records: dict[int, np.ndarray]) -> np.ndarray:
    """Durations of the collectives among ``new_records`` (step markers left out)."""
    if not new_records:
        return np.empty(0)
    return np.concatenate([
        (r["t_exit"] - r["t_enter"])[(r["flags"] & FLAG_MARKER) == 0] for r in new_records.values()
    ])
