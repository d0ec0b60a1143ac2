"""``dtwatch analyze DIR`` on torch's own Flight Recorder dumps of a job that ran without dtwatch.

The files are torch's own bytes: dumps of a real 4-rank gloo job (``tests/scripts/fr_job.py``, rank 0 reduces a
metric under ``if rank == 0``) written by torch without Python frames (so they hold no path of the machine that
ran it), as a pickle (``_dump_fr_trace``) and as JSON (``_dump_fr_trace_json``); see tests/frdump_fixtures.py.
Bad files beside them (cut short, foreign, of another format version, one that would run code) are each named
once and left out, and the rest is analysed. The last test runs a real faulty job without dtwatch, collects
its dumps, and runs ``dtwatch analyze DIR --json`` on them.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtwatch.bundle.safe_pickle import load_plain
from dtwatch.report.analyze import _scan, analyze
from dtwatch.report.fr_dumps import BAD_DUMP, MIXED_VERSION, NOT_A_DUMP, UNSAFE, dump_kind, rank_of
from tests.conftest import SCRIPTS
from tests.frdump_fixtures import PREFIX, run_job

FIXTURES = Path(__file__).parent / "fixtures" / "frdumps"
RAW_PICKLE = FIXTURES / "raw-pickle-torch-2.13"
RAW_JSON = FIXTURES / "raw-json-torch-2.13"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.run([sys.executable, "-m", "dtwatch", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


@pytest.fixture
def dumps(tmp_path) -> Path:
    d = tmp_path / "dumps"
    shutil.copytree(RAW_PICKLE, d)
    return d


def test_torch_dump_files_are_recognised_by_content():
    for p in RAW_PICKLE.iterdir():
        assert dump_kind(p.read_bytes()[:4096], p.name) == "pickle"
    for p in RAW_JSON.iterdir():
        assert dump_kind(p.read_bytes()[:4096], p.name) == "json"
    assert dump_kind(b"\x80\x04K\x01.", "data.pkl") is None  # a pickle of something else, named like nothing
    assert dump_kind(b'{"loss": 1.0}', "metrics.json") is None and dump_kind(b"PK\x03\x04", "model.pt") is None
    assert rank_of("nccl_trace_rank_12") == 12 and rank_of("trace-3.json") == 3 and rank_of("rank-00007.2.pkl") == 7


def test_a_directory_of_torch_dumps_is_diagnosed(dumps):
    proc = cli("analyze", str(dumps), "--json")
    assert proc.returncode == 1, proc.stderr  # a stall was found
    doc = json.loads(proc.stdout)
    (f,) = doc["findings"]
    # Written without frames: the lines are not in these dumps, so the extra call cannot be placed; rank 0 stands
    # apart from the others where they wait (all_reduce against their barrier).
    assert (f["kind"], f["ranks"], f["op"], f["seq"]) == ("desync", [0], "all_reduce", 5)
    fr = doc["flight_recorder"]
    assert sorted(fr["files"]) == ["0", "1", "2", "3"] and fr["no_dump"] == [] and fr["world_size"] == 4
    assert fr["in_flight"]["1"] == [{"op": "barrier", "group": "0", "seq": 5, "state": "scheduled", "input_sizes": [],
                                     "input_dtypes": [], "peer": None, "site": None}]
    assert any("no Python frames" in line for line in fr["cannot_show"])
    assert any("dtwatch run -- torchrun" in line for line in fr["cannot_show"])
    assert [r["state"] for r in doc["ranks"]] == ["unknown (Flight Recorder dump)"] * 4
    assert all(r["pid"] is None and r["host"] is None for r in doc["ranks"])
    assert doc["damaged_inputs"] == [] and doc["warnings"] == []


def test_json_dumps_read_as_the_pickles_do(tmp_path):
    a, b = analyze([str(RAW_PICKLE)]), analyze([str(RAW_JSON)])
    assert [(f.kind, f.ranks, f.op, f.seq) for f in a.findings] == [(f.kind, f.ranks, f.op, f.seq) for f in b.findings]
    assert [s.groups["0"].seq for s in a.states] == [s.groups["0"].seq for s in b.states] == [5, 5, 5, 5]
    # Both in one directory: the pickles are used, their JSON twins listed, nothing is warned about.
    both = tmp_path / "both"
    shutil.copytree(RAW_PICKLE, both)
    for p in RAW_JSON.iterdir():
        shutil.copy(p, both / f"json_{p.name}")
    c = analyze([str(both)])
    assert c.dumps is not None and sorted(c.dumps.files.values()) == sorted(str(both / p.name)
                                                                             for p in RAW_PICKLE.iterdir())
    assert len(c.dumps.unused) == 4 and c.problems == []


def test_the_text_report_says_what_a_dump_cannot_show(dumps, tmp_path):
    (dumps / f"{PREFIX}2").unlink()  # rank 2 left no dump
    html = tmp_path / "report.html"
    proc = cli("analyze", str(dumps), "--html", str(html))
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    assert out.startswith("dtwatch report from torch's Flight Recorder dumps (a job run without dtwatch) — 3 rank(s) "
                          "dumped, rank 2 left no dump")
    assert "  rank 2: no Flight Recorder dump" in out
    assert "torch's state 'scheduled', not completed" in out
    tail = out.split("WHAT THE DUMPS CANNOT SHOW", 1)[1]
    assert "rank 2 left no dump: whether it crashed, hung or could not write one is not in the dumps" in tail
    assert "Next time, run the job under dtwatch" in tail and "dtwatch run -- torchrun --nproc-per-node N" in tail
    assert "running" not in out and "pid" not in out and "heartbeat" not in out
    assert html.read_text().startswith("<!doctype html>") and "WHAT THE DUMPS CANNOT SHOW" in html.read_text()


class _Writes:
    """Unpickling this would create a file (what a crafted dump would do: run any code)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_bad_dumps_are_named_once_and_the_rest_is_analysed(dumps, tmp_path):
    ran = tmp_path / "this-file-means-code-ran"
    cut = (dumps / f"{PREFIX}3").read_bytes()
    (dumps / f"{PREFIX}3").write_bytes(cut[: len(cut) // 2])  # cut short
    hostile = {"version": "2.10", "pg_config": {}, "entries": [_Writes(str(ran))]}
    (dumps / f"{PREFIX}2").write_bytes(pickle.dumps(hostile, protocol=2))  # would run code
    (dumps / "notes.json").write_text(json.dumps({"entries": [1, 2], "version": "mine"}))  # foreign
    older = load_plain((dumps / f"{PREFIX}1").read_bytes())
    older["version"] = "2.9"
    (dumps / f"{PREFIX}1").write_bytes(pickle.dumps(older, protocol=2))  # of another torch
    (dumps / "batch.pkl").write_bytes(pickle.dumps([1, 2, 3]))  # not a dump at all: not looked at
    (dumps / "README").write_text("dumps of the job\n")

    result = analyze([str(dumps)])
    assert not ran.exists()  # nothing in any file was run
    by_file = {Path(p.path).name: p for p in result.problems}
    assert sorted(by_file) == sorted([f"{PREFIX}1", f"{PREFIX}2", f"{PREFIX}3", "notes.json"])
    assert by_file[f"{PREFIX}3"].problem == BAD_DUMP and "cut short or garbled" in by_file[f"{PREFIX}3"].detail
    assert by_file[f"{PREFIX}2"].problem == UNSAFE and "io.open" in by_file[f"{PREFIX}2"].detail
    assert "nothing in it was run" in by_file[f"{PREFIX}2"].detail
    assert by_file["notes.json"].problem == NOT_A_DUMP and "entry 0" in by_file["notes.json"].detail
    assert by_file[f"{PREFIX}1"].problem == MIXED_VERSION and "'2.9'" in by_file[f"{PREFIX}1"].detail
    # One warning per bad file, naming it; the ranks they held are unreadable, not "never dumped".
    damaged = [w for w in result.warnings if w.kind == "damaged_input"]
    assert len(damaged) == 4 and all(str(dumps) in w.summary for w in damaged)
    assert result.unreadable == [1, 2, 3] and [s.rank for s in result.states] == [0]
    assert result.dumps is not None and result.dumps.no_dump == []  # they dumped: their files are damaged
    assert not any("left no dump" in line for line in result.dumps.limits)
    (f,) = result.findings  # rank 0 alone, in flight: what waits on ranks it cannot see is said as unknown
    assert f.details.get("unreadable_ranks") == [1, 2, 3] and "could not be read" in f.summary


def test_a_run_directorys_and_a_bundles_own_dumps_are_not_read_as_a_job_without_dtwatch(tmp_path):
    run_dir = tmp_path / "job"
    (run_dir / "fr").mkdir(parents=True)
    (run_dir / "rank-00000.ring").write_bytes(b"")
    shutil.copy(RAW_PICKLE / f"{PREFIX}0", run_dir / "fr" / "torch-fr-rank-0")
    bundle = run_dir / "incidents" / "inc-1" / "node"
    (bundle / "fr").mkdir(parents=True)
    (bundle / "index.json").write_text("{}")
    (bundle / "findings.json").write_text("[]")
    shutil.copy(RAW_PICKLE / f"{PREFIX}1", bundle / "fr" / "rank-00001.pkl")
    inputs = _scan([str(run_dir)])
    assert inputs.others == [] and inputs.bundles == [bundle] and inputs.rings == [run_dir / "rank-00000.ring"]


@pytest.mark.timeout(240)
def test_a_real_job_without_dtwatch_is_diagnosed_from_its_dumps(tmp_path):
    """A real 2-rank gloo job, no dtwatch anywhere: rank 0 reduces a metric under ``if rank == 0``; each rank dumps
    its Flight Recorder as it hangs; ``dtwatch analyze DIR --json`` names rank 0, its line and the rank test."""
    out = tmp_path / "dumps"
    proc = run_job(sys.executable, "rank_conditional", out, nproc=2)
    files = sorted(p.name for p in out.glob(PREFIX + "*"))
    assert files == [f"{PREFIX}0", f"{PREFIX}1"], proc.stderr[-2000:]
    report = cli("analyze", str(out), "--json", cwd=tmp_path)
    assert report.returncode == 1, report.stderr
    doc = json.loads(report.stdout)
    (f,) = doc["findings"]
    source = (SCRIPTS / "fr_job.py").read_text().splitlines()
    extra = next(i for i, text in enumerate(source, 1) if "# metric reduced only on rank 0" in text)
    test = next(i for i, text in enumerate(source, 1) if 'FAULT == "rank_conditional" and rank == 0' in text)
    assert (f["kind"], f["ranks"], f["op"]) == ("rank_conditional", [0], "all_reduce"), f["summary"]
    assert f["site"]["file"] == str(SCRIPTS / "fr_job.py") and f["site"]["line"] == extra
    assert f["details"]["conditional_line"]["line"] == test
    assert f["waiting_ranks"] == [1] and f["waiting_op"] == "barrier"
    assert doc["flight_recorder"]["no_dump"] == [] and doc["flight_recorder"]["world_size"] == 2
