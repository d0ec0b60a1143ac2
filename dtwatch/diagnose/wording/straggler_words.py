"""The words of the straggler warning (:mod:`dtwatch.diagnose.straggler`) and of why a look names nobody, from the
verdict's facts."""
from __future__ import annotations


def straggler_summary(rank: int, last: int, steps: int, stepped: bool, lead_s: float, step_s: float | None,
                      noise_s: float, held_s: float) -> str:
    """``rank`` was the last in ``last`` of ``steps`` steps (collectives where nothing marks steps), a median
    ``lead_s`` after the others; ``step_s``: a step's (or a collective's) period; ``held_s``: how long it held."""
    unit = "training steps" if stepped else "collectives"
    step_text = (f"a step takes {step_s * 1000:.0f} ms" if stepped and step_s else
                 f"{step_s * 1000:.0f} ms between collectives" if step_s else "")
    return (f"rank {rank} was the last to issue the collectives of group 0 in {last} of the last {steps} {unit}, "
            f"a median {lead_s * 1000:.0f} ms after every other rank ({step_text}; the scatter between ranks is "
            f"{noise_s * 1000:.0f} ms), and the last at every look for {held_s:.1f} s; the job is progressing")


# Why one look names nobody (the verdict's ``why``, for tests and debugging; never a finding's sentence).
TOO_FEW_STEPS = "too few steps"


def rarely_last(rank: int, last: int, steps: int) -> str:
    """The candidate ``rank`` was the last in only ``last`` of the ``steps`` steps judged."""
    return f"rank {rank} was the last in only {last} of {steps} steps"


def lead_below_margin(rank: int, lead_s: float, margin_s: float) -> str:
    """The candidate's median lead is below the smallest lead named."""
    return f"rank {rank}'s median lead {lead_s * 1000:.1f} ms is below the margin {margin_s * 1000:.1f} ms"


def lead_not_below_step(rank: int, lead_s: float, step_s: float, clock: bool) -> str:
    """The candidate's median lead is a step or more (less a clock interval where ``clock``: a compared time came
    from a rank's sequence clock)."""
    return (f"rank {rank}'s median lead {lead_s * 1000:.1f} ms is not less than a step ({step_s * 1000:.1f} ms"
            + (", less the sequence clock's interval)" if clock else ")"))
