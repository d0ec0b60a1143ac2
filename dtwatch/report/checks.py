"""``dtwatch checks``: the setup checks, what each finds and what it costs (``--json`` for machines)."""
from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any


def checks_document(measured: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    from dtwatch.diagnose.setup import CHECKS, SETTLE_S
    from dtwatch.record.setup_probe import GRACE_S

    doc: dict[str, Any] = {
        "checks": [c.to_dict() for c in CHECKS],
        "severity": "warning",
        "reported": "once per check per run: on the job's console, in the watchdog's events and log, by the webhook, "
                    "as dtwatch_findings_total{kind=...,severity=\"warning\"}, and by dtwatch analyze",
        "constants": {"not_distributed_grace_s": GRACE_S, "config_settle_s": SETTLE_S},
    }
    if measured is not None:
        doc["measured"] = measured
    return doc


def render_text(doc: dict[str, Any]) -> str:
    lines = []
    for c in doc["checks"]:
        lines.append(f"{c['name']}  (finding kind: {c['kind']})")
        for label, key in (("finds", "finds"), ("evidence", "evidence"), ("training thread", "rank_cost"),
                           ("background", "background_cost"), ("watchdog", "watchdog_cost"), ("opt out", "opt_out"),
                           ("limits", "limits")):
            lines += textwrap.wrap(c[key], 110, initial_indent=f"  {label + ':':<17}", subsequent_indent=" " * 19)
        lines.append("")
    lines.append("Reported " + doc["reported"] + ".")
    if "measured" in doc:
        lines.append("")
        lines.append("Measured in this process (median):")
        for name, m in doc["measured"].items():
            lines.append(f"  {name:<26} {m['us']:>9.1f} us  [{m['thread']}] {m['input']}")
    return "\n".join(lines) + "\n"


def cmd_checks(args: argparse.Namespace) -> int:
    measured = None
    if args.measure:
        from dtwatch.record.setup_cost import measure

        measured = measure()
    doc = checks_document(measured)
    print(json.dumps(doc, indent=2) if args.json else render_text(doc), end="\n" if args.json else "")
    return 0


def add_checks_parser(sub: Any) -> None:
    p = sub.add_parser("checks", help="list the setup checks (mistakes that never hang) and what each costs",
                       description="The setup checks the watchdog runs on every job: what each finds, from which facts "
                                   "the ranks record, and what gathering them costs on the training thread, in the "
                                   "background and in the watchdog.")
    p.add_argument("--json", action="store_true", help="print JSON: {checks: [...], constants, measured?}")
    p.add_argument("--measure", action="store_true",
                   help="also time the rank-side work of each setup event in this process (about a second)")
    p.set_defaults(func=cmd_checks)
