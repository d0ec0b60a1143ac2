"""The recorded-incident corpus: how many incidents per kind, how many the diagnosis gets right, and how
long replaying all of them takes (the corpus is meant to be replayed on every change).

    python benchmarks/incidents.py [--json -]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dtwatch.diagnose import diagnose_fixture
from dtwatch.report.capture import load_fixture
from tests.scenarios.judge import judge


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(REPO / "tests" / "incidents"), help="fixtures directory")
    ap.add_argument("--json", help="write the results as JSON ('-': stdout)")
    args = ap.parse_args()
    fixtures = [load_fixture(p) for p in sorted(Path(args.dir).glob("*.json"))]
    start = time.perf_counter()
    results = [(fx, [f.to_dict() for f in diagnose_fixture(fx)]) for fx in fixtures]
    replay_s = time.perf_counter() - start
    rows = []
    for fx, findings in results:
        truth = fx.truth or {}
        verdict = judge(findings, truth)
        kind = "healthy" if truth.get("healthy") else truth.get("kind", "?")
        rows.append({"name": fx.name, "kind": kind, "tags": truth.get("tags", []), "right": verdict.right,
                     "failures": verdict.failures()})
    per_kind = Counter(r["kind"] for r in rows)
    right_kind = Counter(r["kind"] for r in rows if r["right"])
    out = {"incidents": len(rows), "right": sum(r["right"] for r in rows), "replay_s": round(replay_s, 3),
           "per_kind": {k: {"incidents": n, "right": right_kind[k]} for k, n in sorted(per_kind.items())},
           "rows": rows}
    print(f"{'kind':28} {'incidents':>9} {'right':>6}", file=sys.stderr)
    for k, v in out["per_kind"].items():
        print(f"{k:28} {v['incidents']:>9} {v['right']:>6}", file=sys.stderr)
    print(f"{'all':28} {out['incidents']:>9} {out['right']:>6}   replayed in {replay_s:.2f} s", file=sys.stderr)
    for r in rows:
        if not r["right"]:
            print(f"  wrong: {r['name']}: {'; '.join(r['failures'])}", file=sys.stderr)
    if args.json:
        text = json.dumps(out, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
