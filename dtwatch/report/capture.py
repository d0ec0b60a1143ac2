"""``dtwatch capture SRC -o FIXTURE.json``: pack a real incident into one compact, sanitised JSON file.

A fixture holds what the diagnosis reasons about (every rank's :class:`~dtwatch.diagnose.rank_state.RankState`, the
clock, the stall window) and the evidence it may read (source lines, py-spy stacks, Flight Recorder
summaries), so that an incident can be replayed through the diagnosis in milliseconds, attached to a bug
report, or kept as a regression test::

    from dtwatch.report.capture import load_fixture
    fx = load_fixture("tests/incidents/subgroup_skip.json")
    print(fx.name, fx.now - fx.onset, [s.rank for s in fx.states])

``SRC`` is an incident bundle (``<run dir>/incidents/<id>/<node>``; an incident directory merges its
nodes) or a run directory (live or finished: its rings are read now, and there are no findings).

Format 1, one JSON object (keys sorted, one top-level key and one rank state per line)::

    format, name, source ("bundle" | "run_dir"), now, window, onset (float | null),
    states        [RankState.to_dict(), ...] by rank; recent calls trimmed per group
    sources       {file: {"text": full text}} for user files,
                  {file: {"lines": {"N": text}}} for library files (the referenced lines +-3)
    stacks        {"<rank>": py-spy threads (locals dropped, helper threads cut to their ends)}
    flight_records {"<rank>": Flight Recorder summary (latest entries per group)}
    endings       {"<rank>": how the process ended when it could not say so itself (faulthandler:
                  the fatal signal or SIGTERM, the main thread's frames)}
    findings_at_capture [Finding.to_dict(), ...] (what the watchdog said at the time)
    truth         {...} | null (what really happened, for the incident corpus)

Sanitising: a path under ``relative_to`` becomes relative to it, a path in site-packages
``<site-packages>/pkg/...``, in the standard library ``<stdlib>/...``, any other absolute path
``<abs>/basename``; host names become ``node0``, ``node1``... (in rank order); ring paths keep only
their file name. Process ids are kept.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtwatch.bundle.files import bundle_findings
from dtwatch.bundle.process_endings import process_ending
from dtwatch.diagnose.rank_state import UNKNOWN_PROCESS, Call, RankState, from_snapshot
from dtwatch.paths import BUNDLE_FINDINGS, BUNDLE_INDEX, EXIT_OK, EXIT_USAGE, is_events_file
from dtwatch.process_liveness import process_state
from dtwatch.report.events import warnings_in
from dtwatch.ring import RingFormatError, find_rings, read_ring

FORMAT = 1
DEFAULT_RECENT = 16  # recent calls kept per group (and step markers kept)
DEFAULT_FR_ENTRIES = 8  # Flight Recorder entries kept per group (the latest: where the ranks stopped)
LIBRARY_CONTEXT = 3  # lines kept around each referenced line of a library file
SITE_PACKAGES, STDLIB, ABSOLUTE = "<site-packages>", "<stdlib>", "<abs>"

_DTWATCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
_STDLIB_DIRS = tuple(sorted(
    {os.path.normpath(p) for p in (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")) if p},
    key=len, reverse=True,
))
_PACKAGES_RE = re.compile(r"/(?:site|dist)-packages/(.+)")
_STDLIB_RE = re.compile(r"/lib/python\d+(?:\.\d+)?/(.+)")
# An absolute path inside free text: starts at a '/' not preceded by a path character, has 2+ parts.
_ABS_PATH_RE = re.compile(r"(?<![\w./<>~-])/(?:[\w.+@~-]+/)+[\w.+@~-]*")
_FR_FRAME_RE = re.compile(r"\((?P<file>[^()]+):(?P<line>\d+)\)$")


# ---------------------------------------------------------------------------------------------------
# the fixture as loaded
# ---------------------------------------------------------------------------------------------------
@dataclass
class Fixture:
    """A captured incident, ready to replay through the diagnosis."""

    name: str
    states: list[RankState]
    now: float
    window: float
    onset: float | None
    sources: dict[str, dict] = field(default_factory=dict)
    stacks: dict[str, Any] = field(default_factory=dict)
    flight_records: dict[str, dict] = field(default_factory=dict)
    endings: dict[str, dict] = field(default_factory=dict)
    truth: dict | None = None
    findings_at_capture: list[dict] = field(default_factory=list)
    source: str = "bundle"
    warnings: list[dict] = field(default_factory=list)  # what the watchdogs warned of before the incident

    def source_line(self, file: str, line: int) -> str:
        """The text of ``line`` of ``file`` as captured ("" when it was not kept)."""
        src = self.sources.get(file)
        if not src:
            return ""
        if "text" in src:
            lines = src["text"].splitlines()
            return lines[line - 1] if 0 < line <= len(lines) else ""
        return src.get("lines", {}).get(str(line), "")

    def source_text(self, file: str) -> str | None:
        """The whole file, when it was kept whole (user code)."""
        src = self.sources.get(file)
        return src.get("text") if src else None


def _state_from_dict(d: dict) -> RankState:
    """RankState.from_dict, tolerant of call fields this version of dtwatch does not know (or lacks)."""
    known = set(Call.__dataclass_fields__)

    def calls(items: list[dict]) -> list[dict]:
        return [{k: v for k, v in c.items() if k in known} for c in items]

    d = dict(d)
    d["groups"] = {k: {**g, "recent": calls(g.get("recent", []))} for k, g in d.get("groups", {}).items()}
    d["open_calls"] = calls(d.get("open_calls", []))
    return RankState.from_dict(d)


def fixture_from_dict(data: dict) -> Fixture:
    if data.get("format") != FORMAT:
        raise ValueError(f"unsupported fixture format {data.get('format')!r}; this dtwatch reads format {FORMAT}")
    return Fixture(
        name=data["name"], states=[_state_from_dict(s) for s in data["states"]], now=float(data["now"]),
        window=float(data["window"]), onset=None if data.get("onset") is None else float(data["onset"]),
        sources=data.get("sources", {}), stacks=data.get("stacks", {}), flight_records=data.get("flight_records", {}),
        endings=data.get("endings", {}),
        truth=data.get("truth"), findings_at_capture=data.get("findings_at_capture", []),
        source=data.get("source", "bundle"), warnings=data.get("warnings", []),
    )


def load_fixture(path: str | os.PathLike) -> Fixture:
    return fixture_from_dict(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------------------------------------
# reading what to capture
# ---------------------------------------------------------------------------------------------------
@dataclass
class Raw:
    """What was read from a bundle or run directory, before trimming and sanitising."""

    source: str
    now: float
    window: float
    onset: float | None
    states: list[dict]
    stacks: dict[str, Any] = field(default_factory=dict)
    flight_records: dict[str, dict] = field(default_factory=dict)
    findings: list[dict] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    endings: dict[str, dict] = field(default_factory=dict)
    warnings: list[dict] = field(default_factory=list)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def bundle_dirs(src: Path) -> list[Path]:
    """The node bundles of ``src``: itself, or the node directories of an incident directory."""
    if (src / BUNDLE_INDEX).is_file():
        return [src]
    return sorted(p.parent for p in src.glob("*/index.json"))


def read_bundles(dirs: list[Path]) -> Raw:
    states: dict[int, dict] = {}
    raw = Raw("bundle", 0.0, 0.0, None, [])
    for b in dirs:
        index = _read_json(b / BUNDLE_INDEX)
        node = index.get("node", "")
        raw.nodes.append(node)
        raw.now = max(raw.now, float(index.get("detected", 0.0)))
        raw.window = max(raw.window, float(index.get("window", 0.0)))
        if index.get("onset") is not None:
            raw.onset = float(index["onset"]) if raw.onset is None else min(raw.onset, float(index["onset"]))
        findings_file = b / BUNDLE_FINDINGS
        for f in (bundle_findings(b) if findings_file.is_file() else index.get("findings", [])):
            if f not in raw.findings:
                raw.findings.append(f)
        for rf in sorted((b / "ranks").glob("rank-*.json")):
            s = _read_json(rf)
            # The node that owns a rank knows its liveness; prefer that node's copy (as `analyze` does).
            if s["rank"] not in states or (s.get("host") == node and s.get("alive") is not None):
                states[s["rank"]] = s
        for kind, target in (("stacks", raw.stacks), ("fr", raw.flight_records)):
            for jf in sorted((b / kind).glob("rank-*.json")):
                target[str(int(jf.stem.split("-")[1]))] = _read_json(jf)
    raw.states = [states[r] for r in sorted(states)]
    run_dir = dirs[0].parents[2] if dirs and len(dirs[0].parents) > 2 else None  # <run dir>/incidents/<id>/<node>
    raw.endings = read_endings(run_dir, raw.states) if run_dir is not None else {}
    if run_dir is not None:
        raw.warnings = live_warnings(run_dir, raw.now)
    for b in dirs:  # what the watchdog kept, for bundles copied away from their run directory
        for jf in sorted((b / "endings").glob("rank-*.json")):
            raw.endings.setdefault(str(int(jf.stem.split("-")[1])), _read_json(jf))
    return raw


def live_warnings(run_dir: Path, before: float) -> list[dict]:
    """The warnings the watchdogs issued while the job ran, up to ``before`` (their events files), once each."""
    files = [p for p in sorted(run_dir.glob("*")) if is_events_file(p.name)]
    return [w for w in warnings_in(files) if float(w.get("detected") or 0.0) <= before]


def read_endings(run_dir: Path, states: list[dict]) -> dict[str, dict]:
    """How each rank's process ended, from faulthandler's files in the run directory (fatal signal with
    every thread's stack, or SIGTERM), for ranks whose process wrote one."""
    out = {}
    for s in states:
        ending = process_ending(str(run_dir), int(s["rank"]), float(s.get("start_time", 0.0)))
        if ending is not None:
            out[str(s["rank"])] = {**ending, "text": ending.get("text", "")[-1500:]}
    return out


def read_run_dir(run_dir: Path, *, window: float, now: float | None = None) -> Raw:
    """Every rank's state from its ring, as of now (the newest process of a restarted rank)."""
    host = socket.gethostname()
    by_rank: dict[int, RankState] = {}
    for path in find_rings(run_dir):
        try:
            snap = read_ring(path)
        except (OSError, RingFormatError):
            continue
        s = from_snapshot(snap, process=process_state(snap.pid) if snap.host == host else UNKNOWN_PROCESS)
        if s.rank not in by_rank or s.start_time > by_rank[s.rank].start_time:
            by_rank[s.rank] = s
    states = [by_rank[r].to_dict() for r in sorted(by_rank)]
    return Raw("run_dir", time.time() if now is None else now, window, None, states,
               nodes=sorted({s["host"] for s in states}), endings=read_endings(run_dir, states))


def read_source(src: str | os.PathLike, *, window: float = 0.0, now: float | None = None) -> Raw:
    path = Path(src)
    if not path.is_dir():
        raise FileNotFoundError(f"{src}: not a directory (give an incident bundle or a run directory)")
    dirs = bundle_dirs(path)
    if dirs:
        return read_bundles(dirs)
    raw = read_run_dir(path, window=window, now=now)
    if not raw.states:
        raise FileNotFoundError(f"{src}: no incident bundle (index.json) and no rings (rank-*.ring) here")
    return raw


# ---------------------------------------------------------------------------------------------------
# trimming
# ---------------------------------------------------------------------------------------------------
def trim_state(s: dict, recent: int) -> dict:
    s = dict(s)
    s["groups"] = {name: {**g, "recent": g.get("recent", [])[-recent:]} for name, g in s.get("groups", {}).items()}
    for key in ("step_times", "step_seqs"):
        s[key] = s.get(key, [])[-recent:]
    return s


FRAME_KEYS = ("name", "filename", "line", "module")  # py-spy frame fields kept (the others are derived or empty)
MAIN_THREAD_FRAMES = 64  # frames kept of the main thread's stack
OTHER_THREAD_FRAMES = (8, 4)  # innermost and outermost frames kept of every other thread's stack


def trim_stacks(threads: Any) -> Any:
    """py-spy threads with the frame fields that matter; deep stacks of helper threads cut in the middle."""
    if not isinstance(threads, list):
        return threads
    out = []
    for t in threads:
        frames = [{k: fr[k] for k in FRAME_KEYS if fr.get(k) is not None} for fr in t.get("frames", [])]
        inner, outer = (MAIN_THREAD_FRAMES, 0) if t.get("thread_name") == "MainThread" else OTHER_THREAD_FRAMES
        kept = frames if len(frames) <= inner + outer else frames[:inner] + (frames[-outer:] if outer else [])
        thread = {**t, "frames": kept}
        if len(kept) < len(frames):
            thread["frames_omitted"] = len(frames) - len(kept)
        out.append(thread)
    return out


def trim_flight_record(summary: dict, per_group: int) -> dict:
    entries = summary.get("entries", []) or []
    kept: list[dict] = []
    by_group: dict[str, int] = {}
    for e in reversed(entries):
        g = str(e.get("group"))
        if by_group.get(g, 0) < per_group:
            by_group[g] = by_group.get(g, 0) + 1
            kept.append(e)
    return {**summary, "entries": kept[::-1]}


# ---------------------------------------------------------------------------------------------------
# sanitising
# ---------------------------------------------------------------------------------------------------
class Sanitiser:
    """Turns this machine's paths and host names into portable ones (pure: no file access)."""

    def __init__(self, relative_to: str, hosts: list[str]) -> None:
        roots = {os.path.normpath(os.path.abspath(relative_to)), os.path.normpath(os.path.realpath(relative_to))}
        self.roots = sorted(roots, key=len, reverse=True)
        self.hosts: dict[str, str] = {}
        for h in hosts:
            if h and h not in self.hosts:
                self.hosts[h] = f"node{len(self.hosts)}"
        # A host name is replaced inside free text only when it is long enough not to be an ordinary word.
        words = [h for h in self.hosts if len(h) >= 4]
        longest_first = sorted(words, key=len, reverse=True)
        self._host_re = re.compile(r"\b(" + "|".join(map(re.escape, longest_first)) + r")\b") if words else None

    def path(self, path: str) -> str:
        if not path.startswith("/"):
            return path
        norm = os.path.normpath(path)
        m = _PACKAGES_RE.search(norm)
        if m:
            return f"{SITE_PACKAGES}/{m.group(1)}"
        for d in _STDLIB_DIRS:
            if norm.startswith(d + os.sep):
                return f"{STDLIB}/{norm[len(d) + 1:]}"
        m = _STDLIB_RE.search(norm)
        if m:
            return f"{STDLIB}/{m.group(1)}"
        for root in self.roots:
            if norm == root:
                return "."
            if norm.startswith(root.rstrip(os.sep) + os.sep):
                return os.path.relpath(norm, root)
        return f"{ABSOLUTE}/{os.path.basename(norm)}"

    def text(self, text: str) -> str:
        if text.startswith("/") and _ABS_PATH_RE.fullmatch(text):
            out = self.path(text)
        else:
            out = _ABS_PATH_RE.sub(lambda m: self.path(m.group(0)), text)
        if out in self.hosts:
            return self.hosts[out]
        if self._host_re is not None:
            out = self._host_re.sub(lambda m: self.hosts[m.group(0)], out)
        return out

    def value(self, v: Any, key: str = "") -> Any:
        if isinstance(v, str):
            if key in ("host", "node") and v in self.hosts:
                return self.hosts[v]
            if key == "ring_path":
                return os.path.basename(v)
            return self.text(v)
        if isinstance(v, dict):
            return {k: self.value(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [self.value(x, key) for x in v]
        return v

    @staticmethod
    def is_library(original: str, sanitised: str) -> bool:
        """Library code (site-packages, the standard library, torch, dtwatch): only referenced lines are kept."""
        if sanitised.startswith(ABSOLUTE):
            return False
        return sanitised.startswith((SITE_PACKAGES, STDLIB, "<")) or \
            os.path.normpath(original).startswith(_DTWATCH_DIR + os.sep)


# ---------------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------------
def referenced_lines(*trees: Any) -> dict[str, set[int]]:
    """Every (file, line) that a site, stack frame or Flight Recorder frame in ``trees`` points at."""
    out: dict[str, set[int]] = {}

    def add(file: Any, line: Any) -> None:
        if isinstance(file, str) and file.endswith(".py") and isinstance(line, int) and line > 0:
            out.setdefault(file, set()).add(line)

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            if "line" in v:
                add(v.get("file") or v.get("filename"), v.get("line"))
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str):
            m = _FR_FRAME_RE.search(v)
            if m:
                add(m.group("file"), int(m.group("line")))

    for t in trees:
        walk(t)
    return out


def _read_lines(path: str) -> list[str] | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return None


def collect_sources(refs: dict[str, set[int]], san: Sanitiser) -> dict[str, dict]:
    sources: dict[str, dict] = {}
    for original in sorted(refs):
        name = san.path(original)
        if name in sources:
            continue  # a name collision (two "<abs>/x.py"): the first file wins
        lines = _read_lines(original)
        if lines is None:
            continue
        if not san.is_library(original, name):
            sources[name] = {"text": san.text("\n".join(lines) + "\n")}
            continue
        kept = sorted({n for line in refs[original]
                       for n in range(line - LIBRARY_CONTEXT, line + LIBRARY_CONTEXT + 1) if 0 < n <= len(lines)})
        sources[name] = {"lines": {str(n): san.text(lines[n - 1]) for n in kept}}
    return sources


# ---------------------------------------------------------------------------------------------------
# capture
# ---------------------------------------------------------------------------------------------------
def capture(src: str | os.PathLike, *, name: str | None = None, relative_to: str | None = None,
            recent: int = DEFAULT_RECENT, fr_entries: int = DEFAULT_FR_ENTRIES, window: float = 0.0,
            now: float | None = None, truth: dict | None = None) -> dict:
    """The fixture (format 1) of the incident bundle or run directory ``src``, as a JSON-ready dict.

    ``window`` and ``now`` apply to run directories (a bundle records its own); ``truth`` is stored as
    given (paths in it are sanitised like the rest).
    """
    raw = read_source(src, window=window, now=now)
    states = [trim_state(s, recent) for s in raw.states]
    stacks = {r: trim_stacks(t) for r, t in sorted(raw.stacks.items(), key=lambda kv: int(kv[0]))}
    frs = {
        r: trim_flight_record(fr, fr_entries) for r, fr in sorted(raw.flight_records.items(), key=lambda kv: int(kv[0]))
    }
    hosts = [s.get("host", "") for s in states] + raw.nodes + [socket.gethostname()]
    san = Sanitiser(relative_to or os.getcwd(), hosts)
    refs = referenced_lines(states, stacks, frs, raw.findings, raw.endings)
    return {
        "format": FORMAT,
        "name": name or Path(src).resolve().name,
        "source": raw.source,
        "now": raw.now,
        "window": raw.window,
        "onset": raw.onset,
        "states": san.value(states),
        "sources": collect_sources(refs, san),
        "stacks": san.value(stacks),
        "flight_records": san.value(frs),
        "endings": san.value(raw.endings),
        "findings_at_capture": san.value(raw.findings),
        "warnings": san.value(raw.warnings),
        "truth": san.value(truth) if truth is not None else None,
    }


def dumps_fixture(data: dict) -> str:
    """Deterministic, compact JSON: sorted keys, one top-level key (and one rank state) per line."""
    def enc(v: Any) -> str:
        return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    parts = []
    for key in sorted(data):
        if key == "states":
            body = "[\n" + ",\n".join(enc(s) for s in data[key]) + "\n]" if data[key] else "[]"
        else:
            body = enc(data[key])
        parts.append(f"{enc(key)}:{body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_fixture(data: dict, path: str | os.PathLike) -> int:
    """Write the fixture atomically; returns its size in bytes."""
    text = dumps_fixture(data)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return len(text.encode("utf-8"))


def main_capture(src: str, out: str, *, name: str | None, relative_to: str | None, recent: int, fr_entries: int,
                 window: float, truth_file: str | None) -> int:
    """The ``dtwatch capture`` verb; returns the exit status."""
    try:
        truth = json.loads(Path(truth_file).read_text()) if truth_file else None
        data = capture(src, name=name, relative_to=relative_to, recent=recent, fr_entries=fr_entries,
                       window=window, truth=truth)
    except (OSError, ValueError) as exc:
        print(f"dtwatch capture: {exc}", file=sys.stderr)
        return EXIT_USAGE
    size = write_fixture(data, out)
    print(f"dtwatch capture: {out}: {data['source']} '{data['name']}', {len(data['states'])} ranks, "
          f"{len(data['sources'])} source files, {size / 1024:.1f} KiB")
    return EXIT_OK
