"""Step pair: a real 2-rank NCCL job sharing the one GPU, under `dtwatch run --stall-window 5 --fail-fast`:
healthy (no diagnosis), a rank-conditional extra all_reduce, a rank stuck outside collectives."""
from __future__ import annotations

import re
import sys
import time

from common import CPU, WORKERS, Step, analyze_json, console_lines, dtwatch_run, site_line, stall_finding, tracebacks

LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 150
WORKER = WORKERS / "pair.py"
WATCH = ["--stall-window", "5", "--fail-fast", "--fail-fast-grace", "3"]
ENV = {"NCCL_DEBUG": "WARN"}
WHAT = "gloo job (CPU mode)" if CPU else "NCCL job on one GPU (a host id per rank)"


def job(step: Step, mode: str, cap: float, deadline: float):
    return dtwatch_run(f"pair-{mode}", [str(WORKER), mode], 2, step, timeout=min(cap, deadline - time.time() - 2),
                       watch=WATCH, env=ENV)


def finding_view(f: dict) -> dict:
    keys = ("kind", "ranks", "op", "group", "site", "waiting_ranks", "waiting_op", "summary")
    return {k: f.get(k) for k in keys if k in f}


def healthy(step: Step, deadline: float) -> bool:
    rc, text, run_dir = job(step, "healthy", 50, deadline)
    started = "all_reduce works" in text
    step.check(f"2-rank {WHAT} starts", started,
               [ln for ln in text.splitlines() if "worker rank" in ln or "NCCL WARN" in ln][:6])
    doc = analyze_json(run_dir, step) or {}
    f = stall_finding(run_dir)
    step.check("healthy: exit 0 and no diagnosis (no incident, no finding)",
               rc == 0 and not f and doc.get("findings") == [],
               {"exit": rc, "incident finding": finding_view(f), "analyze findings": doc.get("findings"),
                "tracebacks": tracebacks(text)[:3], "console": console_lines(text)[:6]})
    step.info("healthy: warnings (not diagnoses)", [(w.get("kind"), w.get("ranks")) for w in doc.get("warnings", [])])
    return started


def hang(step: Step, deadline: float) -> None:
    rc, text, run_dir = job(step, "hang", 55, deadline)
    f = stall_finding(run_dir)
    line = site_line("hang_all_reduce", WORKER)
    step.check("rank-conditional all_reduce: ended (exit 3), diagnosis names all_reduce and rank 0",
               rc == 3 and f.get("op") == "all_reduce" and f.get("ranks") == [0],
               {"exit": rc, "finding": finding_view(f), "console": console_lines(text)[:6]})
    named = (f.get("site") or {}).get("line") == line or f"pair.py:{line}" in (f.get("summary") or "")
    step.check(f"rank-conditional all_reduce: diagnosis names the conditional call's line (pair.py:{line})", named,
               {"kind": f.get("kind"), "root-cause site": f.get("site"),
                "rank 0's position": (f.get("details") or {}).get("culprit_position")}, advisory=True)


def stuck(step: Step, deadline: float) -> None:
    rc, text, run_dir = job(step, "stuck", 55, deadline)
    f = stall_finding(run_dir)
    line = site_line("stuck_sleep", WORKER)
    step.check("rank stuck outside: ended (exit 3), diagnosis names rank 1, outside any collective",
               rc == 3 and f.get("ranks") == [1] and f.get("kind") == "stuck_outside_collective"
               and re.search(r"(not in|outside) any collective", f.get("summary") or "") is not None,
               {"exit": rc, "finding": finding_view(f), "console": console_lines(text)[:6]})
    step.check("rank stuck outside: diagnosis names the sleeping line",
               (f.get("site") or {}).get("line") == line, {"expected line": line, "site": f.get("site")},
               advisory=True)


def main() -> None:
    step = Step("pair", "2 NCCL ranks on one GPU under dtwatch run: healthy, rank-conditional, stuck outside")
    deadline = step.t0 + LIMIT - 3
    if healthy(step, deadline):
        hang(step, deadline)
        stuck(step, deadline)
    step.done()


if __name__ == "__main__":
    main()
