"""Incident bundles: one directory per incident per node, mergeable by ``dtwatch analyze``.

Layout (``<run dir>/incidents/<incident id>/<node>/``)::

    index.json            incident id, job, node, window, onset, detection time, findings, files
    findings.json         the findings as diagnosed and sent (written first, within the stall window + a poll)
    evidence.json         what the evidence added: the findings made again with it, the files (written last)
    report.txt            the human report (findings first, then per-rank state, then evidence)
    ranks/rank-00001.json the rank's state (dtwatch.diagnose.state.RankState) at detection
    rings/rank-00001.ring a copy of the rank's ring
    stacks/rank-00001.txt py-spy (Python + native) or faulthandler stacks; .json with py-spy's JSON
    fr/rank-00001.pkl     torch's Flight Recorder dump; fr/rank-00001.json a readable summary
    timeline.svg          per-rank sequence progress around the incident

The findings are written before any evidence is collected, so a slow py-spy or a wedged rank never
delays the diagnosis, and never rewritten: evidence files are added after, then ``evidence.json``, and
``index.json`` is rewritten at the end, its ``findings`` the final ones (``refined``: the evidence changed
them). :func:`bundle_findings` reads a bundle's final findings.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

from dtwatch import paths
from dtwatch.diagnose import Finding
from dtwatch.diagnose.flight import summarize_entry
from dtwatch.diagnose.state import RankState


def incident_id(finding: Finding, states: list[RankState]) -> str:
    """The same id on every node for the same incident: group, seq and the job's restart generation."""
    restart = max((s.restart_count for s in states), default=0)
    group = finding.group if finding.group is not None else (finding.waiting_group or "x")
    seq = finding.seq if finding.seq is not None else (finding.waiting_seq or 0)
    return f"inc-r{restart}-g{group}-s{seq}-{finding.kind}"


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


class Bundle:
    def __init__(self, run_dir: str, inc_id: str, node: str) -> None:
        self.path = Path(paths.bundle_dir(run_dir, inc_id, node))
        self.path.mkdir(parents=True, exist_ok=True)
        self.id = inc_id
        self.node = node
        self.files: dict[str, str] = {}

    def write_findings(self, findings: list[Finding], states: list[RankState], meta: dict) -> None:
        """The findings as diagnosed (written once), every rank's state, and the first index."""
        self.add_json(paths.BUNDLE_FINDINGS, [f.to_dict() for f in findings])
        for s in states:
            _write_json(self.path / paths.bundle_rank_file("ranks", s.rank, ".json"), s.to_dict())
        self.meta = {"incident_id": self.id, "node": self.node, **meta}
        self.write_index(findings)

    def write_index(self, findings: list[Finding], complete: bool = False, **extra: Any) -> None:
        _write_json(self.path / paths.BUNDLE_INDEX, {
            **self.meta, "findings": [f.to_dict() for f in findings], "files": self.files,
            "evidence_complete": complete, "written": time.time(), **extra,
        })

    def add_text(self, rel: str, text: str) -> None:
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        self.files[rel] = rel

    def add_json(self, rel: str, data: Any) -> None:
        _write_json(self.path / rel, data)
        self.files[rel] = rel

    def copy(self, src: str, rel: str) -> None:
        dst = self.path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(src, dst)
            self.files[rel] = rel
        except OSError:
            pass


def bundle_findings(bundle: str | os.PathLike) -> list[dict]:
    """A bundle's final findings: as the evidence revised them once it is in, else as diagnosed."""
    b = Path(bundle)
    try:
        return list(json.loads((b / paths.BUNDLE_EVIDENCE).read_text())["findings"])
    except (OSError, ValueError, KeyError, TypeError):
        return list(json.loads((b / paths.BUNDLE_FINDINGS).read_text()))


def summarize_flight_record(path: str) -> dict | None:
    """Readable summary of a torch Flight Recorder pickle: per entry the fields that matter."""
    try:
        with open(path, "rb") as f:
            data = pickle.load(f)
    except Exception:  # noqa: BLE001 - a damaged or foreign pickle can raise anything
        return None
    entries = [summarize_entry(e) for e in data.get("entries", [])]
    return {"version": data.get("version"), "pg_config": data.get("pg_config"), "entries": entries}
