"""Merge the steps' ``WORK/result-<step>.json`` into ``OUT/summary.json`` and print the table.

    python summary.py OUT TOTAL_SECONDS STEP,STEP,...
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def load_step(work: Path, name: str) -> dict:
    """A step's result; a step with none (or one that never finished) gets a status saying why."""
    try:
        doc = json.loads((work / f"result-{name}.json").read_text())
    except (OSError, ValueError):
        doc = {"step": name, "status": "NO RESULT", "checks": [], "info": []}
    for why in ("skipped", "timeout", "crashed"):
        if (work / f"{why}-{name}").exists() and doc["status"] in ("INCOMPLETE", "NO RESULT"):
            doc["status"] = {"skipped": "NOT RUN", "timeout": "TIMEOUT", "crashed": "ERROR"}[why]
    if doc["status"] == "INCOMPLETE":
        doc["status"] = "ERROR"
    return doc


def build(steps: list[dict], total_s: float | None, cpu_mode: bool) -> dict:
    """The summary document: every check and key figure by step, and the overall verdict."""
    checks = [{"step": d["step"], **{k: c.get(k) for k in ("check", "result", "advisory", "evidence")}}
              for d in steps for c in d.get("checks", [])]
    counted = [c for c in checks if not c["advisory"]]
    bad_steps = [d["step"] for d in steps if d["status"] not in ("PASS", "SKIP", "INFO")]
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "total_seconds": total_s,
        "cpu_mode": cpu_mode,
        "overall": "FAIL" if bad_steps else "PASS",
        "steps": {d["step"]: d["status"] for d in steps},
        "counts": {r: sum(c["result"] == r for c in counted) for r in ("PASS", "FAIL", "SKIP")},
        "checks": checks,
        "key_info": [{"step": d["step"], "name": i["name"], "value": i["value"]}
                     for d in steps for i in d.get("info", []) if i.get("key")],
        "details": steps,
    }


def render(doc: dict) -> list[str]:
    def cut(text: object, n: int = 150) -> str:
        s = text if isinstance(text, str) else json.dumps(text, default=str)
        return s if len(s) <= n else s[: n - 3] + "..."

    out = ["", "================ SUMMARY ================"]
    if doc["cpu_mode"]:
        out.append("CPU mode: gloo on the CPU; GPU-only checks are SKIP")
    for step, status in doc["steps"].items():
        out.append(f"step {step}: {status}")
        for c in (c for c in doc["checks"] if c["step"] == step):
            out.append(f"  {c['result']:<4} {c['check']}{'  (advisory, not counted)' if c['advisory'] else ''}")
        for i in (i for i in doc["key_info"] if i["step"] == step):
            out.append(f"  INFO {i['name']}: {cut(i['value'])}")
    n = doc["counts"]
    out.append(f"overall: {doc['overall']}  ({n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped; "
               f"{doc['total_seconds']} s)")
    return out


def main() -> None:
    out, total = Path(sys.argv[1]), float(sys.argv[2])
    names = [n for n in sys.argv[3].split(",") if n]
    work = Path(os.environ["GPU_CHECK_WORK"])
    doc = build([load_step(work, n) for n in names], total, os.environ.get("GPU_CHECK_CPU") == "1")
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str))
    print("\n".join(render(doc)), flush=True)


if __name__ == "__main__":
    main()
