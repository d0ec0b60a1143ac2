"""The words that :mod:`dtwatch.diagnose.order` adds to a program-order finding at a stall (how the ranks that
ended ended, who waits now), and the words of a silent desync seen while the job ran whose calls have left the
records since, from the facts the decisions hand over. The parting's own sentence is
:func:`dtwatch.diagnose.wording.phrases.parting_summary`.
"""
from __future__ import annotations

from dtwatch.diagnose.wording.phrases import fmt_ranks, sentence

# What a parting seen live adds (the results were mixed while the job ran); dropped once the job stalled.
_LIVE = " and their results are mixed"


def at_stall_summary(summary: str, ended: dict[str, list[int]], waiting: str) -> str:
    """A parting's ``summary``, then how the ranks that ended did (``ended``: how -> ranks, in the order they
    ended), then ``waiting``, the phrase for who waits where now ("" where none does)."""
    then = [f"{fmt_ranks(rs)} then {how}" for how, rs in ended.items()]
    return sentence(summary, *then, f"now {waiting}" if waiting else "")


def seen_earlier_summary(earlier: str, when: str | None) -> str:
    """A silent desync's summary ``earlier``, seen at ``when`` (a clock time; None: not recorded) while the job
    ran."""
    body = earlier.replace(_LIVE, "").rstrip(". ")
    seen = f"this was seen at {when} while the job ran" if when else "this was seen while the job ran"
    return sentence(body, f"{seen}; the records of those calls have been overwritten since, so whether the ranks "
                    "came back in step after it is not known")
