"""Which collectives become spans, per rank, so thousands of collectives per second cannot flood a backend.

1. *Step stride.* Step ``k`` is kept when ``k % stride == 0`` with
   ``stride = every_n_steps * 2**ceil(log2(rate / max_spans_per_second))`` (the second factor is 1
   while the rank's collective rate is at most the cap). Defaults keep every step while the rate is
   low; above it, whole steps are kept (complete, comparable) and the same steps on every rank (a
   power-of-two stride is shared by ranks whose rates differ by less than 2x).
2. *Hard cap.* A token bucket of ``max_spans_per_second`` per rank (burst ``burst_seconds`` worth)
   bounds the collective spans of kept steps (plus one step span per step that has any); a step too
   large for it is truncated (its first collectives kept) and its step span says ``dtwatch.spans_dropped``.
3. *Always kept*, from a second bucket of the same size: collectives slower than
   ``slow_threshold`` seconds, collectives that raised, every collective of a rank that is part of an
   open stall incident, and - once per call - the collectives such ranks are still inside, as spans
   ending "now" with ``dtwatch.in_flight=true`` and status ERROR. They keep their step as parent
   (a step span is created for them if their step was not sampled; a late completion of a step
   older than the last 16 becomes a root span in that step's trace).

Also honoured: ``OTEL_TRACES_SAMPLER`` (the SDK applies it to step spans; children follow; with
job-wide traces a ratio sampler picks the same steps on every rank).

The decisions here are pure (numbers and index arrays in, index arrays out); :mod:`.spans` applies them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dtwatch.export.otel.otel_config import OtelConfigError


@dataclass(kw_only=True)
class SpanSampling:
    """Which collectives become spans (see the module docstring for the whole policy)."""

    every_n_steps: int = 1
    """Keep the spans of one step in N (on every rank the same steps); 1 keeps all while the rate is low."""
    max_spans_per_second: float = 20.0
    """Per rank: above this collective rate the step stride doubles until it fits; also the hard cap.
    A span costs the watchdog ~80-110 us of CPU in the SDK (measured), so 20/s at 8 ranks is ~1.5% of a core."""
    burst_seconds: float = 5.0
    """The hard cap's bucket holds this many seconds' worth of spans."""
    slow_threshold: float = 1.0
    """Collectives at least this slow (seconds) are always kept (from their own bucket)."""
    job_wide_traces: bool = True
    """Step k of every rank shares one trace id derived from (job id, restart count, k)."""

    def most_spans_at_once(self) -> int:
        """The most spans one rank can end in one update: both buckets full (step spans take routine tokens)."""
        return 2 * math.ceil(self.max_spans_per_second * self.burst_seconds)

    def __post_init__(self) -> None:
        n = self.every_n_steps
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise OtelConfigError(f"every_n_steps must be an integer >= 1, got {n!r}")
        for name in ("max_spans_per_second", "burst_seconds", "slow_threshold"):
            value = getattr(self, name)
            if not _positive_number(value):
                raise OtelConfigError(f"{name} must be a positive number, got {value!r}")


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and math.isfinite(value)


class TokenBucket:
    """``rate`` tokens per second, at most ``capacity`` saved up; time comes from the caller."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.tokens = capacity
        self.last: float | None = None

    def refill(self, now: float) -> None:
        if self.last is not None and now > self.last:
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now if self.last is None else max(self.last, now)

    def take(self, n: int) -> int:
        """Grant up to ``n`` tokens; returns how many."""
        granted = max(0, min(n, int(self.tokens)))
        self.tokens -= granted
        return granted


class StepStride:
    """Rule 1: the step stride, from a smoothed estimate of the rank's collective rate."""

    def __init__(self, sampling: SpanSampling) -> None:
        self.sampling = sampling
        self.rate: float | None = None
        self.last_now: float | None = None

    @property
    def first(self) -> bool:
        """True until the first observation (which measures its rate over the records' own time span)."""
        return self.last_now is None

    def observe(self, n: int, now: float, records_span: float = 0.0) -> None:
        """``n`` collectives completed since the last call; ``records_span``: their time span (first call only)."""
        dt = max(records_span, 1.0) if self.last_now is None else max(now - self.last_now, 1e-3)
        self.last_now = now
        rate = n / dt
        self.rate = rate if self.rate is None else 0.5 * self.rate + 0.5 * rate

    def stride(self) -> int:
        cap = self.sampling.max_spans_per_second
        factor = 1
        if self.rate is not None and self.rate > cap:
            factor = 2 ** math.ceil(math.log2(self.rate / cap))
        return self.sampling.every_n_steps * factor


def select_calls(
    calls: np.ndarray, in_kept_step: np.ndarray, urgent: np.ndarray, routine: TokenBucket, priority: TokenBucket
) -> np.ndarray:
    """Rules 2 and 3: of ``calls`` (record indices), the routine ones of kept steps within the routine
    bucket and the ``urgent`` ones (any step) within the priority bucket, earliest first in each."""
    usual = calls[in_kept_step & ~urgent]
    pressing = calls[urgent]
    usual = usual[: routine.take(len(usual))]
    pressing = pressing[: priority.take(len(pressing))]
    return np.concatenate((usual, pressing))
