"""Comparing a diagnosis with a scenario's truth: one verdict per column (kind, ranks, op, line, text).

Shared by ``benchmarks/scenarios.py`` (live runs) and ``tests/test_incidents.py`` (replayed fixtures).
Findings are dicts (``Finding.to_dict()``); paths in them may be absolute (live) or relative (fixtures).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Where a finding may name the root-cause line: its site, the user's frame of it, or the branch/loop.
SITE_KEYS = ("site", "user_site")
DETAIL_SITE_KEYS = ("conditional_line", "user_site", "root_cause", "branch", "branch_line", "loop_line", "desync_site")


@dataclass
class Verdict:
    ok: dict[str, bool] = field(default_factory=dict)  # column -> right?
    shown: dict[str, str] = field(default_factory=dict)  # column -> what the diagnosis said
    notes: list[str] = field(default_factory=list)

    @property
    def right(self) -> bool:
        return all(self.ok.values())

    def failures(self) -> list[str]:
        return [f"{col}: got {self.shown.get(col, '')}" for col, ok in self.ok.items() if not ok]


def stall_findings(findings: list[dict]) -> list[dict]:
    return [f for f in findings if f.get("severity") == "stall"]


def _same_file(found: str, truth_file: str) -> bool:
    found = found.replace("\\", "/")
    return found == truth_file or found.endswith("/" + truth_file)


def candidate_sites(f: dict) -> list[tuple[str, dict]]:
    """(where, site) pairs a finding offers as its line, the culprit's site first."""
    out = []
    for key in SITE_KEYS:
        site = f.get(key)
        if isinstance(site, dict):
            out.append((key, site))
            if isinstance(site.get("user_site"), dict):
                out.append((f"{key}.user_site", site["user_site"]))
    details = f.get("details") or {}
    for key in DETAIL_SITE_KEYS:
        site = details.get(key)
        if isinstance(site, dict):
            out.append((f"details.{key}", site))
    return [(w, s) for w, s in out if s.get("file") and s.get("line")]


def finding_text(f: dict) -> str:
    return " ".join(str(f.get(k) or "") for k in ("summary", "text", "headline"))


def _fmt_site(site: dict | None) -> str:
    if not site:
        return "-"
    return f"{str(site.get('file', '')).rsplit('/', 1)[-1]}:{site.get('line')}"


def judge(findings: list[dict], truth: dict) -> Verdict:
    """The first stall finding against the truth; a healthy truth wants no stall finding at all."""
    v = Verdict()
    stalls = stall_findings(findings)
    if truth.get("healthy"):
        v.ok["stall"] = not stalls
        v.shown["stall"] = "none" if not stalls else f"{stalls[0].get('kind')} {stalls[0].get('ranks')}"
        return v
    if not stalls:
        for col in ("kind", "ranks", "op", "line"):
            v.ok[col], v.shown[col] = False, "no stall finding"
        return v
    f = stalls[0]
    kinds_ok = [truth["kind"], *truth.get("kinds_ok", [])]
    v.ok["kind"], v.shown["kind"] = f.get("kind") in kinds_ok, str(f.get("kind"))
    v.ok["ranks"], v.shown["ranks"] = sorted(f.get("ranks") or []) == sorted(truth["ranks"]), str(sorted(f.get("ranks") or []))
    # Ranks that were only victims (e.g. torn down by the launcher) must not appear as culprits elsewhere.
    others = sorted({r for x in stalls[1:] for r in (x.get("ranks") or []) if r not in truth["ranks"]})
    if others:
        v.ok["ranks"] = False
        v.shown["ranks"] += f" + other findings blame {others}"
    if truth.get("op") is not None:
        v.ok["op"] = f.get("op") == truth["op"]
    v.shown["op"] = str(f.get("op"))
    lines = set(truth.get("lines") or [truth["line"]])
    matched = [(w, s) for w, s in candidate_sites(f) if _same_file(str(s["file"]), truth["file"]) and int(s["line"]) in lines]
    v.ok["line"] = bool(matched)
    v.shown["line"] = f"{matched[0][0]}={_fmt_site(matched[0][1])}" if matched else \
        ", ".join(f"{w}={_fmt_site(s)}" for w, s in candidate_sites(f)) or "-"
    text = finding_text(f).lower()
    missing = [p for p in truth.get("present", []) if p.lower() not in text]
    every = " ".join(finding_text(x) for x in stalls).lower()
    wrong = [p for p in truth.get("absent", []) if p.lower() in every]
    v.ok["text"] = not missing and not wrong
    v.shown["text"] = "; ".join([f"missing {p!r}" for p in missing] + [f"says {p!r}" for p in wrong]) or "ok"
    return v
