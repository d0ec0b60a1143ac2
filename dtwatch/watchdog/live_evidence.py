"""Evidence the poll's own diagnosis may look at, before any incident: py-spy on demand for the ranks a
decision needs (a wedged rank, one outside any collective), how processes ended, and the Flight Recorder
dumps requested early, while a stall is only suspected, so the first diagnosis can name collectives
issued from C++."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import dtwatch.paths as paths
from dtwatch.bundle.file_evidence import FileEvidence
from dtwatch.bundle.files import summarize_flight_record
from dtwatch.bundle.process_endings import process_ending
from dtwatch.diagnose import ViewSample
from dtwatch.diagnose.evidence import main_thread_frames
from dtwatch.diagnose.rank_state import RankState
from dtwatch.ring import request_dump
from dtwatch.watchdog.stacks import pyspy_dump

EARLY_DUMP_INTERVAL = 60.0
"""At most one early request per this many seconds."""


@dataclass
class EarlyDumps:
    """Flight Recorder dumps requested while a stall is suspected (poll thread only)."""

    episode: float | None = None
    """The last progress time of the quiet episode the requests are for."""
    requests: dict[int, int] = field(default_factory=dict)  # rank -> request id
    summaries: dict[int, dict] = field(default_factory=dict)  # rank -> summary, once written
    at: float = 0.0  # when requested


class LiveEvidence:
    def __init__(self, run_dir: str, *, pyspy: bool) -> None:
        self.run_dir = run_dir
        self.pyspy = pyspy
        self.early = EarlyDumps()

    def request_early_dumps(self, local: list[RankState], episode: float, now: float) -> None:
        """Ask this node's ranks for their Flight Recorder once per quiet episode (at most once a minute):
        their sampler threads write it while the main threads are blocked."""
        if self.early.episode == episode or now - self.early.at < EARLY_DUMP_INTERVAL:
            return
        requests = {}
        for s in local:
            if s.alive and not s.gone:
                try:
                    requests[s.rank] = request_dump(s.ring_path)
                except OSError:
                    pass
        self.early = EarlyDumps(episode=episode, requests=requests, at=now)

    def early_flight_records(self) -> dict[int, dict]:
        """Summaries of the early Flight Recorder dumps that have been written so far."""
        early = self.early
        for rank, req in early.requests.items():
            if rank not in early.summaries:
                path = paths.flight_record_file(self.run_dir, rank, req)
                if os.path.exists(path):
                    summary = summarize_flight_record(path)
                    if summary is not None:
                        early.summaries[rank] = summary
        return dict(early.summaries)

    def for_diagnosis(self, local: list[RankState], *, sample: ViewSample | None = None,
                      earlier: list | None = None) -> FileEvidence:
        """What one poll's diagnosis may look at (py-spy runs at most once per rank per poll); ``sample``:
        the other nodes' ranks are a sample of a large job (see :class:`ViewSample`)."""
        by_rank = {s.rank: s for s in local}
        stacks: dict[int, list[dict] | None] = {}

        def stack(rank: int) -> list[dict] | None:
            s = by_rank.get(rank)
            if s is None or not s.alive or not self.pyspy:
                return None
            if rank not in stacks:
                dump = pyspy_dump(rank, s.pid, timeout=5.0)
                stacks[rank] = main_thread_frames(dump.threads) if dump.ok else None
            return stacks[rank]

        def ending(rank: int) -> dict | None:
            s = by_rank.get(rank)
            return process_ending(self.run_dir, rank, s.start_time) if s is not None else None

        return FileEvidence(stacks=stack, endings=ending, sample=sample, earlier=earlier,
                            flight_records=self.early_flight_records() if self.early.requests else None)
