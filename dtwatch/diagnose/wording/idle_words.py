"""The words of the findings about ranks that are in no collective while others wait
(:mod:`dtwatch.diagnose.idle`): unresponsive ranks and ranks stuck outside a collective, from the facts the
decisions hand over. ``fmt`` shows a site with its source line; ``waiting`` is the phrase for who waits where.
"""
from __future__ import annotations

from collections.abc import Callable

from dtwatch.diagnose.rank_state import Call
from dtwatch.diagnose.wording.phrases import describe, sentence

Fmt = Callable[[dict | None], str]

_PROCESS_STATES = {"T": "stopped (SIGSTOP or a debugger)", "D": "in uninterruptible I/O"}


def unresponsive_summary(rank: int, proc_state: str, heartbeat_age_s: float, seen_from: str, site: dict | None,
                         last: Call | None, waiting: str, fmt: Fmt) -> str:
    """``seen_from``: where its line comes from, ``py-spy`` (a stack), ``last collective`` (``last``, which it
    left after its last sampled line) or ``last sample``."""
    state = _PROCESS_STATES.get(proc_state, "not running Python code (the GIL is held, or it is stuck in native code)")
    if seen_from == "py-spy":
        where = f"py-spy shows it at {fmt(site)}"
    elif seen_from == "last collective":
        where = f"no stack could be taken; it was last seen leaving {describe(last)} at {fmt(site)}"
    else:
        where = f"no stack could be taken; it was last seen at {fmt(site)}"
    return sentence(f"rank {rank} is alive but unresponsive: {state}; its heartbeat is {heartbeat_age_s:.0f}s old",
                    where, waiting)


def stuck_outside_summary(rank: int, site: dict | None, innermost: str, for_s: float, group: str | None,
                          seq: int | None, waiting: str, fmt: Fmt) -> str:
    """``innermost``: the innermost frame's site, shown where it is not ``site`` ("" otherwise)."""
    return sentence(
        f"rank {rank} is not in any collective: it is at {fmt(site)}"
        + (f" (innermost frame {innermost})" if innermost else "") + f", for {for_s:.0f}s",
        f"it has issued up to seq {seq} of group {group}" if seq is not None else "", waiting,
    )


def outside_in_dump_summary(rank: int, last: Call | None, site: dict | None, group: str | None, seq: int | None,
                            behind: bool, unrecorded_p2p: int, waiting: str, fmt: Fmt) -> str:
    """A rank known from its Flight Recorder dump alone, with nothing in flight there (or only a call every peer's
    dump shows completed); ``unrecorded_p2p``: the op numbers gloo's recorder skipped (send/recv it made)."""
    if last is not None and last.in_flight:
        head = (f"rank {rank}'s dump shows {describe(last)} at {fmt(site)} in flight, and every other member's "
                "dump shows it completed (the dumps were written at different moments); it shows nothing later")
    else:
        head = f"rank {rank} has no collective in flight in its Flight Recorder dump" + (
            f": its last recorded one, {describe(last)} at {fmt(site)}, is no longer in flight" if last else
            ": it recorded none")
    parts = [head, f"it has issued up to seq {seq} of group {group}" if behind else "",
             "where it is now is not in a dump (a dump holds no stack)"]
    if unrecorded_p2p:
        calls = "a point-to-point call" if unrecorded_p2p == 1 else "point-to-point calls"
        parts.append(f"gloo's Flight Recorder does not record send/recv, and rank {rank}'s op numbers skip "
                     f"{unrecorded_p2p} ({calls} it made): it may be blocked in one now")
    parts.append(waiting)
    return sentence(*parts)
