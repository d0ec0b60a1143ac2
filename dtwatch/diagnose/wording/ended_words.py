"""The words of the findings about ranks that ended while others needed them (:mod:`dtwatch.diagnose.ended`):
a rank that exited, raised or was killed, every rank failing at once, a crash that followed a desync, from the
facts the decisions hand over. ``how`` is a rank's ending as :mod:`.ending_words` tells it; ``fmt`` shows a site
with its source line; ``waiting`` is the phrase for who waits where.
"""
from __future__ import annotations

from collections.abc import Callable

from dtwatch.diagnose.rank_state import Call
from dtwatch.diagnose.wording.phrases import describe, fmt_ranks, sentence, trim, verb

Fmt = Callable[[dict | None], str]

# A call past the end of the ranks that ended was not compared: what the others issued there is not known.
OTHERS_NOT_RECORDED = "what the other ranks issued at that sequence number was not recorded before they ended"

_FIRST_COLLECTIVE = {"in": "in its first collective", "before": "before its first collective"}


def exited_normally(clean: list[int]) -> str:
    """The note of a call only some ranks make, where the others (``clean``) exited normally."""
    return f"{fmt_ranks(clean)} exited normally"


def exited_after_same_calls(clean: list[int], calls: int, group: str, more: list[int]) -> str:
    """``clean`` exited normally after ``calls`` calls of ``group``, all of which ``more`` had made too."""
    return (f"{fmt_ranks(clean)} exited normally after the same {calls} calls of group {group} that "
            f"{fmt_ranks(more)} had made before it")


def exited_summary(rank: int, how: str, at: dict | None, last: Call | None, last_site: dict | None, waiting: str,
                   extra: str, fmt: Fmt, *, loop_site: dict | None = None, exit_site: dict | None = None,
                   branch: dict | None = None, possible_exit: dict | None = None, ddp_unfinished: bool = False,
                   next_waiting: list[int] | None = None) -> str:
    """A rank that ended: ``at`` the line that raised or called the exit; ``last`` its last collective, at
    ``last_site``; ``extra`` what followed. Where it left the loop the others are still in: ``loop_site``, with
    ``exit_site`` the exit it took where no line was recorded, and ``branch`` the rank test over it. Where nothing
    recorded how it ended: ``possible_exit``, an ``os._exit`` that leaves that loop. ``ddp_unfinished``: it raised
    DDP's "Expected to have finished reduction"; ``next_waiting`` the ranks waiting in the call after ``last``."""
    parts = [f"rank {rank} {how}"]
    if at:
        parts.append(f"at {fmt(at)}")
    if possible_exit is not None:
        parts.append(f"the loop at {fmt(loop_site)} that the others are still in can end the process "
                     f"at {fmt(possible_exit)}, which leaves no record, as here")
    elif loop_site is not None and exit_site is not None:
        parts.append(f"it left the loop at {fmt(loop_site)} early, through {fmt(exit_site)}"
                     + (f" under the rank test {fmt(branch)}" if branch else ""))
    elif loop_site is not None:
        parts.append(f"it left the loop at {fmt(loop_site)} early"
                     + (f", under the rank test {fmt(branch)}" if branch else ""))
    parts.append((f"its last collective was {describe(last)}" + (f" at {fmt(last_site)}" if last_site else ""))
                 if last else "it had issued no collective")
    if ddp_unfinished:
        parts.append(_ddp_unfinished(rank, last, next_waiting or []))
    return sentence(*parts, waiting, extra)


def _ddp_unfinished(rank: int, last: Call | None, next_waiting: list[int]) -> str:
    """What DDP's "Expected to have finished reduction" error means for the ranks that wait."""
    waited = ""
    if last is not None and next_waiting:
        waited = (f" (seq {last.seq + 1} of group {last.group}, which {fmt_ranks(next_waiting)} "
                  f"{verb(next_waiting, 'waits', 'wait')} in)")
    return (f"DDP raises this at the forward after a step in which some of rank {rank}'s parameters got no gradient: "
            f"a gradient all-reduce of that step was never issued on rank {rank}{waited}; that step's forward left "
            "those parameters out of the loss (a branch or an early return in forward; if that is intended, pass "
            "find_unused_parameters=True to DistributedDataParallel)")


def crashed_past_loop_summary(rank: int, loop_site: dict | None, inside: list[int], crash_site: dict | None,
                              inside_site: dict | None, exited: str, fmt: Fmt) -> str:
    """``rank`` ended at ``crash_site``, after the loop the ranks ``inside`` were still in (at ``inside_site``);
    ``exited``: the sentence of how it ended."""
    return sentence(
        f"rank {rank} left the loop at {fmt(loop_site)} earlier than {fmt_ranks(inside)}: it was at {fmt(crash_site)}, "
        f"after the loop, while they were still inside it at {fmt(inside_site)}",
        exited,
    )


def teardown(torn: list[int]) -> str:
    """The ranks that ended after the root, by SIGTERM or silently."""
    return f"{fmt_ranks(torn)} then ended too (the launcher's teardown)"


def then_failed(reasons: dict[int, str]) -> str:
    """The ranks that failed on a peer's death after others exited normally, with the error each raised."""
    return "then " + "; ".join(f"rank {r} failed: {trim(why, 160)}" for r, why in sorted(reasons.items()))


def followed_by(summary: str, then: str) -> str:
    """A finding's sentence with what happened after it."""
    return sentence(summary, then)


def then_crashed(summary: str, endings: list[tuple[int, str]]) -> str:
    """A desync's sentence, then how each of the ranks that ended first ended (rank, ``how``)."""
    how = "; ".join(f"rank {r} {ended}" for r, ended in endings)
    return sentence(summary, f"the job then crashed ({how})")


def every_rank_failed_summary(failures: list[tuple[list[int], str, dict | None]], world: int,
                              first_collective: str, cause: str, fmt: Fmt) -> str:
    """Every rank failed on its own: ``failures`` are (the ranks that failed alike, how the first of them ended,
    the line), ``world`` how many ranks there are; ``first_collective``: ``in`` or ``before`` it where that is
    when they failed, else ""; ``cause``: what the errors or the devices say caused it, else ""."""
    parts = []
    for ranks, how, site in failures:
        where = f" at {fmt(site)}" if site else ""
        who = "every rank" if len(ranks) == world else fmt_ranks(ranks)
        parts.append(f"{who} {how}{where}")
    if first_collective:
        parts[0] += f" ({_FIRST_COLLECTIVE[first_collective]})"
    if cause:
        parts.append(cause)
    return sentence(*parts)


def same_gpu_words(shared: list[list[int]], error_says: bool) -> str:
    """Ranks on one GPU: ``shared`` the groups of ranks whose device identities are one GPU's; ``error_says``:
    an error names the cause (NCCL's "Duplicate GPU detected", "Multiple Ranks are using the same GPU")."""
    if shared:
        return ("; ".join(f"{fmt_ranks(r)} share one GPU" for r in shared) + " (set each rank's device from "
                "LOCAL_RANK before its first collective: torch.cuda.set_device(local_rank))")
    if error_says:
        return ("the error says two ranks use the same GPU (set the device from LOCAL_RANK before the first "
                "collective, e.g. torch.cuda.set_device(local_rank))")
    return ""
