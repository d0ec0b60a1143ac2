"""Uneven iterations: ranks that left a loop the others are still in.

Shown by DataLoader lengths, by step counts, or by positions - one side waits (or died) after the end
of a loop, in the same function, that the other side's lines are still inside (the source's loop
structure comes from the evidence); the loop's early exits (``break``/``return``) and their rank tests
are the root-cause lines.
"""
from __future__ import annotations

import re

from dtwatch.diagnose.context import Context, is_library_path
from dtwatch.diagnose.model import STALL, Finding, Kind, Position
from dtwatch.diagnose.rank_state import CPP_OP, Call
from dtwatch.diagnose.wording.loops_words import fewer_calls_summary, left_loop_summary, past_the_loop_summary


# ---------------------------------------------------------------------------------------------------
# uneven iterations
# ---------------------------------------------------------------------------------------------------
def uneven(ctx: Context, short: list[int], waiting: list[int], *, positions_known: bool,
            inside: list[Position] | None = None, side: list[Position] | None = None,
            exited: bool = False) -> Finding | None:
    """``short`` left the loop the others are still in: shown by DataLoader lengths, step counts, or
    positions (``short`` waits after the loop that the others' lines are inside)."""
    loader = next((ld for ld in ctx.loaders if set(ld["short_ranks"]) & set(short)
                   and not set(ld["short_ranks"]) - set(short) - {r for r in ctx.by_rank if ctx.by_rank[r].gone}), None)
    short_steps = [ctx.steps[r] for r in short if r in ctx.steps]
    long_ranks = [r for r in ctx.by_rank if r not in short]
    long_steps = [ctx.steps[r] for r in long_ranks if r in ctx.steps]
    # Fewer optimizer steps alone is evidence only for ranks that ended or wait after the loop (a rank
    # stuck mid-step counts one step less than it will have).
    fewer = bool(short_steps and long_steps and max(short_steps) < min(long_steps)) and \
        (exited or positions_known or max(short_steps) + 1 < min(long_steps))
    if side is not None and ctx.branch(side[0].rank, side[0].call) is not None:
        return None  # the short side's call sits under a rank test: a rank-conditional call, not a loop exit
    loop_fact = after_loop(ctx, side, inside) if positions_known and side and inside else None
    if loop_fact and side and inside and loader is None and not fewer and short_steps and long_steps and \
            min(short_steps) > 0 and min(short_steps) >= max(long_steps):
        # As many optimizer steps on both sides: where the loop makes the number of calls per iteration
        # rank-dependent (no_sync, a rank test's continue), that is the likelier story than an early exit.
        inside_call = inside[0].call
        if inside_call is not None and inside_call.group == (side[0].call.group if side[0].call else None) and \
                per_rank_count(ctx, inside[0].rank, inside_call) is not None:
            return fewer_calls(ctx, sorted(short), sorted(p.rank for p in inside), inside_call.group, inside_call,
                               certain=False, short_call=side[0].call)
    if exited and loader is None and not fewer:
        loop_fact = early_exit_loop(ctx, long_ranks)
        if loop_fact is not None and is_return(loop_fact["exits"][0][1]):
            return None  # it returned from the function, not just the loop: the rank exited (see exited())
    if loader is None and not fewer and loop_fact is None:
        return None
    if loop_fact and side and inside and any(ctx.by_rank[p.rank].from_dump for p in side + inside):
        return past_the_loop_in_dumps(ctx, loop_fact, side, inside, waiting)
    culprits = sorted(set(loader["short_ranks"]) & set(short)) if loader else sorted(short)
    s0 = ctx.by_rank[culprits[0]]
    call = side[0].call if side else ctx.last_call(culprits[0])
    fields, waiting_txt = ctx.waiting(r for r in waiting if r not in culprits)
    exits = (loop_fact.get("exits") or loop_fact["loop"].exits) if loop_fact else ()
    branch = loop_fact.get("branch") if loop_fact else None
    inside_ranks: list[int] = []
    if loop_fact:
        inside_ranks = sorted(p.rank for p in inside) if inside else sorted(r for r in long_ranks if r not in culprits)
    loader_site = (loader.get("user_site") or loader["site"]) if loader else None
    summary = left_loop_summary(
        culprits, waits=ctx.waits(culprits) if side else None, call=call,
        post_loop_site=ctx.user_site(side[0].rank, call) if side else None,
        ended_how=ctx.how_it_ended(s0) if not side and s0.gone else None, outside_site=s0.main_site,
        loop_site=loop_fact["loop_site"] if loop_fact else None,
        inside_site=loop_fact["inside_site"] if loop_fact else None, inside_ranks=inside_ranks,
        inside_known=bool(inside), inside_call=inside[0].call if inside else None, exited=exited,
        waiting=waiting_txt, loader_site=loader_site,
        loader_lengths=loader["lengths"] if loader else None, steps=ctx.steps if fewer else None, exits=exits,
        branch=branch, fmt=ctx.fmt)
    if loader:
        root = loader_site
    elif exits and loop_fact:
        root = {"file": loop_fact["loop_site"]["file"], "line": exits[0][0], "source": exits[0][1]}
    elif loop_fact:
        root = loop_fact["loop_site"]  # the loop the ranks run a different number of times
    else:
        root = ctx.user_site(side[0].rank, call) if side else (call.site if call else None)
    return Finding(
        kind=Kind.UNEVEN_ITERATIONS, severity=STALL, ranks=culprits, summary=summary,
        op=call.op if call else None, group=call.group if call else None, seq=call.seq if call else None,
        site=ctx.site(root),
        details={"steps": {str(r): n for r, n in sorted(ctx.steps.items())}, "loaders": ctx.loaders,
                 "post_loop_site": ctx.site(ctx.user_site(side[0].rank, call)) if side else None,
                 "loop": {"file": loop_fact["loop_site"]["file"], "line": loop_fact["loop"].start,
                          "exits": [list(e) for e in loop_fact["loop"].exits]} if loop_fact else None,
                 "conditional_line": branch},
        **fields,
    )


def past_the_loop_in_dumps(ctx: Context, loop_fact: dict, side: list[Position], inside: list[Position],
                           waiting: list[int]) -> Finding:
    """Ranks known from Flight Recorder dumps alone, some past a loop the others are inside, at the same number. A
    dump has no step counts: that the past side ran fewer iterations, or that the other side made a call inside the
    loop that it did not, both fit. What each side issued at the inside line is counted where the dumps go back to
    the group's first call; the minority deviates."""
    past, within = sorted(p.rank for p in side), sorted(p.rank for p in inside)
    call, in_call = side[0].issued, inside[0].issued
    in_site = ctx.user_site(inside[0].rank, in_call)
    counts = _calls_at_line(ctx, past + within, in_call.group, in_site)
    deviant = None  # the two sides are the same size: which deviates is not known
    if len(past) != len(within):
        deviant = past if len(past) < len(within) else within
    culprits = deviant or sorted(past + within)
    summary = past_the_loop_summary(
        past, within, loop_site=loop_fact["loop_site"], call=call, post_loop_site=ctx.user_site(side[0].rank, call),
        inside_call=in_call, inside_site=in_site, calls_at_line=counts, deviant=deviant, fmt=ctx.fmt)
    fields, _ = ctx.waiting(r for r in waiting if r not in culprits)
    mine = side[0] if culprits == past else inside[0]
    return Finding(
        kind=Kind.UNEVEN_ITERATIONS, severity=STALL, ranks=culprits, summary=summary, op=mine.issued.op,
        group=mine.issued.group, seq=mine.issued.seq, site=ctx.site(loop_fact["loop_site"]),
        details={"from_dump": True, "past_the_loop": past, "inside_the_loop": within, "calls_at_line": counts,
                 "post_loop_site": ctx.site(ctx.user_site(side[0].rank, call)), "inside_site": ctx.site(in_site),
                 "loop": {"file": loop_fact["loop_site"]["file"], "line": loop_fact["loop"].start,
                          "exits": [list(e) for e in loop_fact["loop"].exits]}},
        **fields,
    )


def _calls_at_line(ctx: Context, ranks: list[int], group: str, site: dict | None) -> dict[int, int] | None:
    """How many calls of ``group`` each rank issued at ``site``'s line, where every rank's record of the group
    goes back to its first call; None otherwise."""
    if not site:
        return None
    out = {}
    for r in ranks:
        g = ctx.by_rank[r].groups.get(group)
        if g is None or not g.complete:
            return None
        out[r] = sum(1 for c in g.recent if c.user_site_key == (site.get("file"), site.get("line")))
    return out


def early_exit_loop(ctx: Context, ranks: list[int]) -> dict | None:
    """The loop the other ranks are still in, when it has an early exit (``break``/``return``): the
    ranks that exited normally left through it. Exits under a rank test come first (they are the
    likely cause: per-rank early stopping, ``if rank == 1: return``)."""
    for r in ranks:
        p = ctx.pos.get(r)
        for f in ctx.frames(r, p.call if p is not None else None):
            path = str(f.get("file", ""))
            if is_library_path(path):
                continue
            for loop in ctx.ev.enclosing_loops(path, int(f["line"])):
                if not loop.exits:
                    continue
                exits = sorted(loop.exits, key=lambda e: ctx.ev.rank_branch(path, e[0]) is None)
                branch = ctx.ev.rank_branch(path, exits[0][0])
                return {"loop": loop, "inside_site": f, "exits": exits,
                        "branch": {"file": path, "line": branch[0], "source": branch[1]} if branch else None,
                        "loop_site": {"file": path, "line": loop.start, "function": f.get("function"),
                                      "source": loop.header}}
    return None


def after_loop(ctx: Context, side: list[Position], inside: list[Position]) -> dict | None:
    """Whether ``side`` waits after a loop that ``inside``'s ranks are still in (same file)."""
    call = side[0].call
    if call is not None and call.op == CPP_OP:
        # A call issued from C++ (DDP's gradient all-reduce, inside backward) is only where a sample spanning it
        # puts it: a line sampled before it (the previous step's logging call, after the loop) is not.
        site = ctx.cpp_site(side[0].rank, call)
        return past_loop(ctx, [site] if site else [], inside)
    return past_loop(ctx, ctx.frames(side[0].rank, call), inside)


def past_loop(ctx: Context, outer: list[dict], inside: list[Position]) -> dict | None:
    """Whether the frames ``outer`` are past (after) a loop that ``inside``'s ranks are still in."""
    for q in inside:
        for f_in in ctx.frames(q.rank, q.call):
            path = str(f_in.get("file", ""))
            if is_library_path(path):
                continue
            # The outermost loop around the inside frame that the short side's frame (same function)
            # is past: the loop the short side left (an epoch loop, not only the batch loop in it).
            for loop in reversed(ctx.ev.enclosing_loops(path, int(f_in["line"]))):
                for f_out in outer:
                    if f_out.get("file") == path and f_out.get("function") == f_in.get("function") \
                            and int(f_out["line"]) > loop.end:
                        return {"loop": loop, "inside_site": f_in,
                                "loop_site": {"file": path, "line": loop.start, "function": f_in.get("function"),
                                              "source": loop.header}}
    return None


def is_return(text: str) -> bool:
    return text.startswith("return") or "exit(" in text



# ---------------------------------------------------------------------------------------------------
# equal loops, different numbers of calls
# ---------------------------------------------------------------------------------------------------
_SKIP = re.compile(r"\b(continue|return)\b")
_EXIT_GATE = re.compile(r":\s*(return|break|continue|\S*exit\(.*\))\s*$")


def is_exit_gate(branch: dict) -> bool:
    """A rank test reported as ``if ...: return``: the call runs on the ranks that did *not* take the exit."""
    return bool(_EXIT_GATE.search(str(branch.get("source") or "")))


def per_rank_count(ctx: Context, rank: int, call: Call | None) -> dict | None:
    """A line that makes the number of collectives per iteration differ between ranks, around ``rank``'s
    line: a ``continue``/``return`` under a rank test earlier in its function or in a loop around it, or a
    DDP ``no_sync()`` in such a loop (the gradient all-reduce is skipped where it is entered)."""
    for f in ctx.frames(rank, call):
        path = str(f.get("file", ""))
        if is_library_path(path):
            continue
        text = ctx.ev.source(path)
        if text is None:
            continue
        lines = text.splitlines()
        at = int(f["line"])
        spans = [(_function_start(lines, at), at - 1)]
        spans += [(loop.start, min(loop.end, len(lines))) for loop in ctx.ev.enclosing_loops(path, at)]
        found: list[dict] = []
        for k, (first, last) in enumerate(spans):
            for n in range(first, last + 1):
                code = lines[n - 1].split("#", 1)[0]
                skip = _SKIP.search(code)
                test = ctx.ev.rank_branch(path, n) if skip else None
                # A data-dependent ``continue`` in a loop around the line (not a return from its function).
                plain = skip is not None and skip.group(1) == "continue" and k > 0 and n < at
                if test is not None or "no_sync(" in code or plain:
                    kind = "rank_skip" if test is not None else "no_sync" if "no_sync(" in code else "skip"
                    found.append({"file": path, "line": n, "function": f.get("function"),
                                  "source": lines[n - 1].strip(), "kind": kind})
        if found:
            order = ("rank_skip", "no_sync", "skip")
            return min(found, key=lambda d: order.index(d["kind"]))
    return None


def _function_start(lines: list[str], line: int) -> int:
    """The ``def`` line of the function ``line`` is in (1 at module level)."""
    indent = len(lines[line - 1]) - len(lines[line - 1].lstrip()) if 0 < line <= len(lines) else 0
    for n in range(line - 1, 0, -1):
        text = lines[n - 1]
        stripped = text.lstrip()
        if stripped.startswith(("def ", "async def ")) and len(text) - len(stripped) < indent:
            return n
    return 1


def fewer_calls(ctx: Context, short: list[int], more: list[int], group: str, call: Call, *, certain: bool,
                short_call: Call | None = None) -> Finding:
    """``short`` issued fewer collectives of ``group`` than ``more`` over the same steps: ``short`` ended (or waits
    after the loop, in ``short_call``) while ``more`` wait in ``call``, inside the loop."""
    o = more[0]
    site = ctx.user_site(o, call)
    line = per_rank_count(ctx, o, call)
    calls = {r: ctx.by_rank[r].groups[group].seq for r in short + more}
    steps = {r: ctx.steps.get(r, 0) for r in short + more}
    steps_short = min(steps[r] for r in short)
    steps_more = max(steps[r] for r in more)
    # The deviant: the minority; between equal sides, the side that skipped under a rank test.
    if len(short) != len(more):
        culprits = sorted(short if len(short) < len(more) else more)
    elif line is not None and line["kind"] == "rank_skip":
        culprits = sorted(short)
    else:
        culprits = sorted(short + more)
    summary = fewer_calls_summary(
        short, more, group=group, call=call, site=site, short_call=short_call,
        short_site=ctx.user_site(short[0], short_call), calls=calls, steps=steps,
        ended=all(ctx.by_rank[r].gone for r in short), waits_short=ctx.waits(short), waits_more=ctx.waits(more),
        certain=certain, ahead=steps_short > steps_more + 1, steps_short=steps_short, steps_more=steps_more,
        line=line, deviant_known=len(culprits) < len(short + more), fmt=ctx.fmt)
    waiting = [r for r in short + more if r not in culprits and not ctx.by_rank[r].gone]
    fields, _ = ctx.waiting(waiting)
    # The op is the call one side issued more of (the other skipped it): the one inside the loop.
    return Finding(
        kind=Kind.DESYNC, severity=STALL, ranks=culprits, summary=summary, op=call.op, group=group,
        seq=call.seq, site=ctx.site(line if line is not None else site),
        details={"pattern": "fewer_calls", "calls": {str(r): n for r, n in calls.items()},
                 "steps": {str(r): n for r, n in steps.items()}, "conditional_line": line,
                 "inside_site": ctx.site(site), "stopped_early": False if certain else None,
                 "culprit_side": "both" if len(culprits) == len(short + more) else
                 "short" if set(culprits) <= set(short) else "more"},
        **fields,
    )
