"""The shared phrases of a diagnosis (ranks, sites, calls, exception texts) and the sentences of the program-order
and silent-desync findings, from decided facts.

Rules: culprit first (rank, op, their line, the branch or loop that made them differ), then who
waits where, then evidence. Full sentences; text taken from elsewhere (exception messages) is cut at
a sentence or word boundary, never mid-word. Paths are shown relative to the working directory when
they lie under it.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from dtwatch.diagnose.evidence import Evidence
from dtwatch.diagnose.rank_state import CPP_OP, Call

if TYPE_CHECKING:
    from dtwatch.diagnose.align import Parting, Token


def with_source(site: dict | None, evidence: Evidence | None = None) -> dict | None:
    """The site plus the text of its line, when ``evidence`` can read the source."""
    if not site:
        return site
    out = dict(site)
    if not out.get("source") and evidence is not None:
        out["source"] = evidence.line(str(site.get("file", "")), int(site.get("line", 0) or 0))
    return out


def fmt_site(site: dict | None, evidence: Evidence | None = None) -> str:
    if not site:
        return "an unknown line"
    path = str(site.get("file"))
    shown = evidence.display_path(path) if evidence is not None else path  # none: as recorded
    text = f"{shown}:{site.get('line')}" + (f" in {site['function']}" if site.get("function") else "")
    src = site.get("source")
    return f"{text} `{src}`" if src else text


def fmt_ranks(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    if not rs:
        return "no rank"
    parts, start, prev = [], rs[0], rs[0]
    for r in [*rs[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    word = "rank" if len(rs) == 1 else "ranks"
    return f"{word} {','.join(parts)}"


def verb(ranks: Iterable[int], singular: str, plural: str) -> str:
    """``waits``/``wait``: agree with fmt_ranks(ranks)."""
    return singular if len(set(ranks)) == 1 else plural


CPP_PREFIX = "cpp:"  # fingerprint prefix of a C++-issued call named from the Flight Recorder


def op_name(call: Call | None) -> str:
    if call is None:
        return "no collective"
    if call.op == CPP_OP:
        return "a collective issued from C++ (DDP/FSDP)"
    if call.fingerprint.startswith(CPP_PREFIX):
        return f"{call.op} (issued from C++ by DDP/FSDP)"
    return call.op


def describe(call: Call | None) -> str:
    if call is None:
        return "no collective"
    if call.fingerprint.startswith(CPP_PREFIX):
        return f"{call.op} (group {call.group}, seq {call.seq}, issued from C++ by DDP/FSDP)"
    return f"{op_name(call)} (group {call.group}, seq {call.seq})"


def waits_elsewhere(ranks: list[int], call: Call, where: str) -> str:
    """Ranks blocked on a call that returned (or was issued asynchronously) wait at another line."""
    how = ("returned before it completed (the NCCL execution model)" if call.enqueued
           else "was issued asynchronously and has not completed")
    who = fmt_ranks(ranks)
    return (f"the {call.op} (group {call.group}, seq {call.seq}) of {who} {how}; {who} now "
            f"{verb(ranks, 'waits', 'wait')} at {where}")


_SILENT_PATTERNS = {
    "python_vs_cpp": "a collective issued from Python met one issued from C++ (DDP/FSDP)",
    "op_mismatch": "different collectives met",
    "shape_mismatch": "the same collective with different shapes met",
    "shifted": "the same collective from different lines at different steps met: one side is a call ahead of the other",
}


def _side(ranks: list[int], call: Call | None, path: Callable[[str], str]) -> str:
    if call is None:
        return f"{fmt_ranks(ranks)} issued a collective from C++ (DDP/FSDP)"
    where = call.user_site or call.site
    at = f" at {path(where['file'])}:{where['line']}" if where else ""
    lib = call.site
    if lib and where and (lib["file"], lib["line"]) != (where["file"], where["line"]):
        at += f" (through {path(lib['file'])}:{lib['line']})"
    step = f" (step {call.step})" if call.step >= 0 else ""
    shape = call.fingerprint[len(call.op):] if call.fingerprint.startswith(call.op) else ""
    return f"{fmt_ranks(ranks)} issued {call.op}{shape}{at}{step}"


def silent_desync_summary(group: str, seq: int, deviant: list[int], d_call: Call | None, others: list[int],
                          o_call: Call | None, pattern: str, known: bool,
                          path: Callable[[str], str] = str) -> str:
    """A silent desync: calls at one sequence number differ, and completed paired with each other."""
    parts = [
        f"group {group} seq {seq}: {_side(deviant, d_call, path)}, while {_side(others, o_call, path)}",
        f"{_SILENT_PATTERNS[pattern]}; the calls completed paired with each other, so their results are mixed, "
        "and nothing hangs yet",
        f"{fmt_ranks(deviant)} {verb(deviant, 'deviates', 'deviate')}" if known else
        "the two sides are the same size and no rank test was found, so which side deviates is not known",
    ]
    return sentence(*parts)


def trim(text: str, limit: int = 300) -> str:
    """``text`` cut to at most ``limit`` characters at a sentence end, else a word boundary (with
    an ellipsis); never mid-word."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    head = text[:limit]
    ends = [m.end() for m in re.finditer(r"[.!?;](\s|$)", head)]
    if ends and ends[-1] > limit // 3:
        return head[: ends[-1]].rstrip()
    cut = head.rsplit(" ", 1)[0] if " " in head else head
    return cut.rstrip(" ,;:") + " ..."


def sentence(*parts: str) -> str:
    """Parts joined with '; ' and ended with a full stop."""
    body = "; ".join(p.strip().rstrip(".;") for p in parts if p and p.strip())
    return body + "." if body else ""


def _call_words(token: Token, site_txt: str) -> str:
    if token.call is None:
        return f"a collective issued from C++ (DDP/FSDP) (seq {token.seq})"
    return f"{token.call.op} (seq {token.call.seq}) at {site_txt}"


def parting_summary(p: Parting, *, branch: dict | None, fmt: Callable[[dict | None], str], call_site: dict | None,
                    paired_site: dict | None, live: bool = False) -> str:
    """Where the ranks' programs parted (:class:`dtwatch.diagnose.align.Parting`): the extra or skipped
    call, the rank test it runs under, what the backend paired it with, and what that did."""
    ranks, ref, calls = list(p.ranks), list(p.reference), list(p.calls)
    group, extra, decided = p.group, p.extra, p.decided
    first = calls[0]
    paired = next(iter(p.paired_with.values()), None)
    what = _call_words(first, fmt(call_site))
    more = f" and {len(calls) - 1} more call{'s' if len(calls) > 2 else ''} after it" if len(calls) > 1 else ""
    owner, other = (ranks, ref) if extra else (ref, ranks)
    if decided and extra:
        head = (f"{fmt_ranks(owner)} made an extra call in group {group}: {what}{more}, which "
                f"{fmt_ranks(other)} did not make")
    elif decided:
        head = (f"{fmt_ranks(other)} did not make {what}{more} in group {group}, which {fmt_ranks(owner)} "
                f"{verb(owner, 'makes', 'make')}")
    else:
        head = (f"{fmt_ranks(owner)} and {fmt_ranks(other)} parted in group {group}: {fmt_ranks(owner)} made "
                f"{what}{more}, which {fmt_ranks(other)} did not make")
    parts = [head]
    if p.step is not None:
        by_n: dict[int, list[int]] = {}
        for r, n in p.step_calls.items():
            by_n.setdefault(n, []).append(int(r))
        made = " and ".join(f"{fmt_ranks(rs)} issued {n} call{'s' if n != 1 else ''}"
                            for n, rs in sorted(by_n.items(), reverse=True))
        when = "before the first optimizer step" if p.step == 0 else \
            f"between optimizer steps {p.step} and {p.step + 1}"
        parts.append(f"{when}, which every rank went past, {made} of group {group}")
    if branch is not None:
        parts.append(f"{'it is' if decided else 'that call is'} reached through the rank test {fmt(branch)}")
    if paired is not None:
        paired_txt = (f"{fmt_ranks(other)}'s {paired.call.op} at {fmt(paired_site)}" if paired.call is not None
                      else f"{fmt_ranks(other)}'s collective issued from C++ (DDP/FSDP)")
        parts.append(f"the backend paired it with {paired_txt} (seq {first.seq}), so the ranks went on "
                     f"out of step in group {group} from there" + (" and their results are mixed" if live else ""))
    if not decided:
        parts.append("the two sides are the same size and no rank test was found, so whether one side made an "
                     "extra call or the other skipped it is not known")
    return sentence(*parts)


def lint_hint_sentence(entry: str, hints: list[tuple[str, str, str]]) -> str:
    """The lint's rank-conditional collectives in code that a library entry point runs (see diagnose/hints.py)."""
    listed = "; ".join(f"{where} under `{cond}`" + (" (an early exit that skips one)" if code == "DTW002" else "")
                       for where, cond, code in hints)
    return sentence(f"the collective was issued by a library inside {entry}, so its own line cannot show the "
                    f"cause; dtwatch lint finds collectives reached under a rank test in that code: {listed}",
                    "a call there that only some ranks make is the likely cause")
