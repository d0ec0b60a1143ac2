"""The stall window: how long a rank may wait without progress before a stall is declared."""
from __future__ import annotations

import numpy as np

from dtwatch.config import WatchOptions
from dtwatch.diagnose.rank_state import RankState


class StallWindow:
    """Fixed, or ``multiplier`` x the longest collective seen, clamped to [floor, ceiling]; at least the
    start-up window until every rank finished a first step (loading, compiling, first rendezvous)."""

    def __init__(self, opts: WatchOptions) -> None:
        self.fixed = opts.stall_window
        self.floor, self.ceiling, self.multiplier = opts.window_floor, opts.window_ceiling, opts.window_multiplier
        self.startup = opts.startup_window
        self.longest = 0.0
        self.started = False

    def observe(self, durations: np.ndarray, states: list[RankState]) -> None:
        if len(durations):
            self.longest = max(self.longest, float(durations.max()))
        if not self.started and states and all(s.step >= 1 for s in states):
            self.started = True

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return self.fixed
        adaptive = min(max(self.multiplier * self.longest, self.floor), self.ceiling)
        return adaptive if self.started else max(adaptive, self.startup)
