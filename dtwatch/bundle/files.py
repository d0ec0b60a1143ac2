"""Incident bundles: one directory per incident per node, mergeable by ``dtwatch analyze``.

Layout (``<run dir>/incidents/<incident id>/<node>/``)::

    index.json            incident id, job, node, window, onset, detection time, findings, files
    findings.json         the findings as diagnosed and sent (written first, within the stall window + a poll)
    evidence.json         what the evidence added: the findings made again with it, the files (written last)
    report.txt            the human report (findings first, then per-rank state, then evidence)
    ranks/rank-00001.json the rank's state (dtwatch.diagnose.rank_state.RankState) at detection
    rings/rank-00001.ring a copy of the rank's ring
    stacks/rank-00001.txt py-spy (Python + native) or faulthandler stacks; .json with py-spy's JSON
    fr/rank-00001.pkl     torch's Flight Recorder dump; fr/rank-00001.json a readable summary
    timeline.svg          per-rank sequence progress around the incident

The findings are written before any evidence is collected, so a slow py-spy or a wedged rank never
delays the diagnosis, and never rewritten: evidence files are added after, then ``evidence.json``, and
``index.json`` is rewritten at the end, its ``findings`` the final ones (``refined``: the evidence changed
them). :func:`bundle_findings` reads a bundle's final findings; :func:`read_bundle` reads a whole bundle for
``dtwatch analyze``, naming each of its files that is damaged (cut short, not JSON, not what it should hold)
and reading the rest (the parsing, :func:`parse_bundle_file`, does no I/O).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import shutil
import time
import types
import typing
from pathlib import Path
from typing import Any

import dtwatch.paths as paths
from dtwatch.bundle.safe_pickle import UnsafePickleError, load_plain
from dtwatch.diagnose import Finding
from dtwatch.diagnose.flight import summarize_entry
from dtwatch.diagnose.rank_state import RankState
from dtwatch.ring.reader import IO_ERROR, InputProblem

log = logging.getLogger("dtwatch")

BAD_JSON = "bad_json"  # not JSON (cut short, garbled)
BAD_CONTENT = "bad_content"  # JSON, but not what the file holds (a field missing or of the wrong type, another rank)


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
            data = load_plain(f, path)  # never runs code a crafted file names (report.safe_pickle)
    except UnsafePickleError as exc:
        log.warning("dtwatch: %s", exc)
        return None
    except Exception:  # noqa: BLE001 - a damaged or foreign pickle can raise anything
        return None
    if not isinstance(data, dict):
        return None
    entries = [summarize_entry(e) for e in data.get("entries", [])]
    return {"version": data.get("version"), "pg_config": data.get("pg_config"), "entries": entries}


@dataclasses.dataclass(frozen=True)
class BundleRead:
    """What of one bundle could be read, and what was wrong with its files."""

    path: str
    index: dict
    findings: tuple[Finding, ...]
    """The final findings: from ``evidence.json``, else ``findings.json``, else the index's copy."""
    states: tuple[RankState, ...]
    problems: tuple[InputProblem, ...]


_RANK_FILE = re.compile(r"rank-(\d+)\.json")


class BundleFileError(ValueError):
    """A bundle's file is not what it should be; ``problem`` says which and why."""

    def __init__(self, problem: InputProblem) -> None:
        super().__init__(problem.line())
        self.problem = problem


def read_bundle(bundle: str | os.PathLike) -> BundleRead:
    """Every file of a bundle that ``dtwatch analyze`` uses; a damaged one is named and left out, never raised."""
    b = Path(bundle)
    problems: list[InputProblem] = []

    def load(rel: str) -> Any:
        try:
            return parse_bundle_file(rel, (b / rel).read_bytes(), str(b / rel))
        except OSError as e:
            problems.append(InputProblem(str(b / rel), IO_ERROR, f"could not be read ({e.strerror or e})",
                                         _ranks_of(rel)))
        except BundleFileError as e:
            problems.append(e.problem)
        return None

    index = load(paths.BUNDLE_INDEX) or {}
    diagnosed = load(paths.BUNDLE_FINDINGS)  # read (and named when damaged) even when the evidence's are used
    findings = load(paths.BUNDLE_EVIDENCE) if (b / paths.BUNDLE_EVIDENCE).exists() else None
    if findings is None:
        findings = diagnosed
    if findings is None:  # both named above: the index's copy of the final findings, if it holds one
        try:
            findings = _findings(index.get("findings", []), "")
        except (KeyError, TypeError, ValueError, AttributeError):
            findings = []
    states = [s for s in (load(f"ranks/{f.name}") for f in sorted((b / "ranks").glob("rank-*.json"))) if s]
    return BundleRead(str(b), index, tuple(findings), tuple(states), tuple(problems))


def parse_bundle_file(rel: str, data: bytes, path: str = "") -> Any:
    """One bundle file's bytes (``rel``: its path in the bundle), checked: the index (a dict), the findings
    (``findings.json``, ``evidence.json``: Findings) or a rank's state (``ranks/rank-00003.json``: a RankState
    of that rank). Raises :class:`BundleFileError`."""
    path = path or rel
    ranks = _ranks_of(rel)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        detail = "empty file (0 bytes)" if not data else f"not JSON ({str(e)[:80]})"
        raise BundleFileError(InputProblem(path, BAD_JSON, detail, ranks)) from e
    try:
        if rel == paths.BUNDLE_INDEX:
            if not isinstance(doc, dict) or "incident_id" not in doc or not _fits(doc.get("detected", 0.0), float):
                raise TypeError("not an incident index")
            return doc
        if rel in (paths.BUNDLE_FINDINGS, paths.BUNDLE_EVIDENCE):
            return _findings(doc["findings"] if rel == paths.BUNDLE_EVIDENCE else doc, path)
        state = RankState.from_dict(doc)
        _check_types(state, "")
        if ranks and state.rank != ranks[0]:
            raise TypeError(f"it holds rank {state.rank}, its name says rank {ranks[0]}")
        return state
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BundleFileError(InputProblem(path, BAD_CONTENT, f"not a bundle's {_what(rel)} ({_reason(e)})",
                                           ranks)) from e


def _findings(doc: Any, path: str) -> list[Finding]:
    if not isinstance(doc, list):
        raise TypeError("not a list of findings")
    out = [Finding.from_dict(f) for f in doc]
    for f in out:
        _check_types(f, "finding ")
    return out


def _ranks_of(rel: str) -> tuple[int, ...]:
    m = _RANK_FILE.fullmatch(os.path.basename(rel))
    return (int(m.group(1)),) if m else ()


def _what(rel: str) -> str:
    return {paths.BUNDLE_INDEX: "index", paths.BUNDLE_FINDINGS: "findings",
            paths.BUNDLE_EVIDENCE: "evidence"}.get(rel, "rank state")


def _reason(e: Exception) -> str:
    return f"no field {e}" if isinstance(e, KeyError) else str(e)[:120]


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_types(obj: Any, where: str) -> None:
    """Every field of dataclass ``obj`` (and of the dataclasses in it) holds what its annotation says; a call
    site is a dict with a file and a line. Raises TypeError naming the first that does not."""
    cls: Any = type(obj)
    for name, tp in _hints(cls).items():
        value = getattr(obj, name)
        if not _fits(value, tp):
            raise TypeError(f"{where}{name} is {type(value).__name__} {str(value)[:40]}")
        if "site" in name and isinstance(value, dict) and not (
                isinstance(value.get("file"), str) and isinstance(value.get("line"), int)):
            raise TypeError(f"{where}{name} has no file and line")


def _fits(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, tp):
            return False
        _check_types(value, f"{tp.__name__} ")
        return True
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(_fits(v, args[0]) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict) and (not args or all(_fits(k, args[0]) and _fits(v, args[1])
                                                            for k, v in value.items()))
    return isinstance(value, tp)
