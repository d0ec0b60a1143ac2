"""The words of the straggler warning (:mod:`dtwatch.diagnose.straggler`), from the verdict's facts."""
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
