"""Where the call's own line cannot show the cause: what ``dtwatch lint`` finds in the code that line runs.

A collective a library issues later (Lightning syncs a metric logged with ``sync_dist=True`` at the end of
the epoch, from inside ``trainer.fit``) carries the user's line that called into the library, not the line
that made the ranks differ. When a finding's culprit call went through a library and no rank test was
found on its path, the lint's findings in the user's files on the culprit's stack (collectives under a rank
test, rank-conditional early exits) are named as the likely cause - as a lead, never as the root line.
"""
from __future__ import annotations

from dtwatch.diagnose.context import Context, is_library_path
from dtwatch.diagnose.model import STALL, Finding, Kind
from dtwatch.diagnose.wording.phrases import lint_hint_sentence, sentence

MAX_HINTS = 3
_UNEXPLAINED = (Kind.DESYNC, Kind.RANK_CONDITIONAL)


def with_lint_hints(ctx: Context, findings: list[Finding]) -> list[Finding]:
    for f in findings:
        if f.severity != STALL or not f.ranks or f.kind not in _UNEXPLAINED or f.details.get("conditional_line"):
            continue  # only a call one side makes that nothing on its path explains (not a loop, an exit, a wedge)
        culprit = ctx.pos.get(f.ranks[0])
        call = culprit.call if culprit is not None else None
        if call is None or not call.site or not call.user_site or call.site == call.user_site \
                or not is_library_path(str(call.site.get("file", ""))):
            continue  # the culprit's call is the user's own line (or unknown): its rank test would have been found
        files = []
        for frame in ctx.frames(f.ranks[0], call):
            path = str(frame.get("file", ""))
            if path and not is_library_path(path) and path not in files:
                files.append(path)
        hints = [{"file": path, **h} for path in files for h in ctx.ev.rank_conditional_calls(path)][:MAX_HINTS]
        if not hints:
            continue
        f.details["lint_hints"] = hints
        f.summary = sentence(f.summary, lint_hint_sentence(
            ctx.fmt(ctx.user_site(f.ranks[0], call)), [(ctx.fmt({"file": h["file"], "line": h["line"]}),
                                                        h["condition"], h["code"]) for h in hints]))
    return findings
