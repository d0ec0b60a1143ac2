"""The words of the uneven DataLoader warning (:mod:`dtwatch.diagnose.loaders`), from the facts the decision
found and stored in the finding's ``details["loader"]``: where the loader is made and iterated, its length on each
rank, the short ranks, and the collectives each rank issued while its loop ran.
"""
from __future__ import annotations

from collections import defaultdict

from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.wording.phrases import fmt_ranks, fmt_site


def loader_place(ld: dict, ev: Evidence | None = None) -> str:
    """Where a loader is iterated: the user's line, and the library's loop it goes through."""
    if ld.get("user_site"):
        return f"{fmt_site(ld['user_site'], ev)} (iterated in {fmt_site(ld['site'], ev)})"
    return fmt_site(ld["site"], ev)


def _issued_text(issued: dict[str, int]) -> str:
    """``4 on rank 1, 6 on ranks 0,2-3``: what each rank issued while the loop ran."""
    by_count: dict[int, list[int]] = defaultdict(list)
    for r, n in issued.items():
        by_count[n].append(int(r))
    return ", ".join(f"{n} on {fmt_ranks(sorted(rs))}" for n, rs in sorted(by_count.items()))


def uneven_loader_summary(ld: dict, ev: Evidence | None = None) -> str:
    """The warning of one loader whose lengths differ across ranks (``ld``: one entry of
    :func:`~dtwatch.diagnose.loaders.loader_evidence`); ``ev`` shows paths relative to the working directory."""
    made = f" made at {fmt_site(ld['made_site'], ev)}" if ld.get("made_site") else ""
    issued = ld.get("issued")
    why = f" and its loop issues collectives (while it ran: {_issued_text(issued)})" if issued else ""
    return (f"DataLoader{made} iterated at {loader_place(ld, ev)} has different lengths across ranks "
            f"{ld['lengths']}{why}: {fmt_ranks(ld['short_ranks'])} will leave the loop early and the others "
            "will hang in their next collective in it (use DistributedSampler with the same drop_last "
            "everywhere, or the Join context manager)")
