"""The words of the mismatched-arguments finding (:mod:`dtwatch.diagnose.mismatch`): ranks at the same call with
different arguments, and which side deviates, from the facts the decision hands over. ``fmt`` shows a site with its
source line. Nothing here decides.
"""
from __future__ import annotations

from collections.abc import Callable

from dtwatch.diagnose.wording.phrases import fmt_ranks, sentence, verb

Fmt = Callable[[dict | None], str]


def mismatch_summary(group: str, seq: int, site: dict | None, sides: list[tuple[list[int], str]],
                     deviant: list[int], *, undecided: bool, rank_test: dict | None, usual: str | None,
                     fmt: Fmt) -> str:
    """The ranks call ``site`` (``group``, ``seq``) with different arguments: ``sides`` (ranks, fingerprint), the
    deviant side first. ``deviant``: the ranks named; ``undecided``: sides of equal size that nothing tells apart
    (all their ranks named). Between equal sides, why one deviates: its call alone runs under ``rank_test``, or
    every tied rank called the line with ``usual`` before; neither: it is the minority."""
    prints = "; ".join(f"{fmt_ranks(ranks)}: {fingerprint}" for ranks, fingerprint in sides)
    if undecided:
        verdict = (f"each side has as many ranks as the other and no rank test or earlier call at this line tells "
                   f"which deviates: {fmt_ranks(deviant)} are named, which of them is wrong is not known")
    elif rank_test is not None:
        verdict = (f"{fmt_ranks(deviant)} {verb(deviant, 'deviates', 'deviate')}: its call runs under the rank test "
                   f"{fmt(rank_test)}")
    elif usual is not None:
        verdict = (f"{fmt_ranks(deviant)} {verb(deviant, 'deviates', 'deviate')}: every rank of both sides called "
                   f"this line with {usual} before")
    else:
        verdict = f"{fmt_ranks(deviant)} {verb(deviant, 'is', 'are')} the minority"
    return sentence(f"group {group} seq {seq}: the ranks call {fmt(site)} with different arguments ({prints})",
                    verdict)
