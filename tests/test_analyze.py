"""``dtwatch analyze`` on real data: the run directory and incident bundle of a real hung job (gloo, 2 ranks,
a real watchdog), and rings written offline by the real writer with no watchdog at all."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from unittest import mock

import pytest

from dtwatch.report.analyze import analyze
from dtwatch.ring import FLAG_MARKER, RingWriter, ring_filename
from dtwatch.ring.layout import EXIT_EXCEPTION
from tests.harness import WORKER, assert_rank_conditional_finding, launch, site_line

SVG = "{http://www.w3.org/2000/svg}"


def dtwatch_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtwatch", *args], capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------------------------------------------
# A real hung job: rank 0 calls all_reduce inside `if rank == 0`, rank 1 waits in the barrier after it.
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hung_job(tmp_path_factory):
    """Run the job until the watchdog's bundle is complete, then end it; yields (run dir, bundle dir, index)."""
    root = tmp_path_factory.mktemp("analyze")
    job = launch(root, "rank_conditional", 2, window=4.0)
    try:
        index = job.wait_incident(timeout=150, complete=True)
    finally:
        job.stop()  # the ranks and the watchdog; the run directory and the bundle stay
    yield job.run_dir, Path(index.pop("_path")), index


def bundle_stall(bundle: Path) -> dict:
    findings = [f for f in json.loads((bundle / "findings.json").read_text()) if f["severity"] == "stall"]
    assert len(findings) == 1, findings
    return findings[0]


@pytest.mark.timeout(180)
def test_json_report_matches_the_bundle(hung_job):
    run_dir, bundle, _index = hung_job
    expected = bundle_stall(bundle)
    proc = dtwatch_cli("analyze", str(run_dir), "--json")
    assert proc.returncode == 1, proc.stderr  # a stall was found
    doc = json.loads(proc.stdout)
    assert doc["stalled"] is True
    assert len(doc["findings"]) == 1
    f = doc["findings"][0]
    assert_rank_conditional_finding(f)
    # ... and it is the bundle's diagnosis, field for field.
    for key in ("kind", "severity", "ranks", "op", "group", "seq", "waiting_ranks", "waiting_op", "waiting_seq"):
        assert f[key] == expected[key], key
    for key in ("file", "line", "function"):
        assert f["site"][key] == expected["site"][key], key
    assert isinstance(f["seq"], int) and f["seq"] == f["waiting_seq"] > 0
    # Per-rank state: both ranks, each inside the collective the finding names.
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert sorted(ranks) == [0, 1]
    assert ranks[0]["current_op"]["op"] == "all_reduce" and ranks[0]["current_op"]["seq"] == f["seq"]
    assert ranks[1]["current_op"]["op"] == "barrier" and ranks[1]["current_op"]["seq"] == f["seq"]
    assert [Path(b) for b in doc["bundles"]] == [bundle]


@pytest.mark.timeout(180)
def test_text_report_starts_with_the_findings(hung_job):
    run_dir, bundle, _index = hung_job
    expected = bundle_stall(bundle)
    proc = dtwatch_cli("analyze", str(run_dir))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"dtwatch report for job {run_dir.name} — 2 rank(s) seen")
    assert lines[1] == ""
    assert lines[2] == "STALL"
    assert lines[3].startswith(f"  [rank_conditional] rank 0 is in all_reduce (group 0, seq {expected['seq']}) at "
                               f"{os.path.relpath(WORKER)}:{site_line('validate_all_reduce')} in validate")
    assert lines.index("RANKS") > 3  # per-rank state comes after the findings
    assert any(line.startswith("  rank 1 ") for line in lines[lines.index("RANKS"):])


@pytest.mark.timeout(180)
def test_svg_timeline_has_a_label_per_rank(hung_job, tmp_path):
    run_dir, _bundle, _index = hung_job
    svg = tmp_path / "timeline.svg"
    proc = dtwatch_cli("analyze", str(run_dir), "--svg", str(svg))
    assert proc.returncode == 1, proc.stderr
    root = ET.parse(svg).getroot()  # well-formed XML
    assert root.tag == f"{SVG}svg"
    texts = ["".join(el.itertext()) for el in root.iter(f"{SVG}text")]
    labels = {r: [t for t in texts if t.startswith(f"rank {r}: ")] for r in (0, 1)}
    assert len(labels[0]) == 1 and labels[0][0].endswith("culprit"), texts
    assert len(labels[1]) == 1 and labels[1][0].endswith("waiting"), texts
    assert labels[0][0].startswith("rank 0: all_reduce seq ") and labels[1][0].startswith("rank 1: barrier seq ")
    assert any("rank_conditional" in t for t in texts)
    assert len(root.findall(f"{SVG}path")) == 2  # one line per rank


@pytest.mark.timeout(180)
def test_two_nodes_with_the_same_bundle_merge_to_one_finding(hung_job, tmp_path):
    run_dir, bundle, _index = hung_job
    merged = tmp_path / run_dir.name
    shutil.copytree(run_dir, merged)
    node_dir = merged / bundle.relative_to(run_dir)
    shutil.copytree(node_dir, node_dir.parent / "second-node")
    proc = dtwatch_cli("analyze", str(merged), "--json")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert sorted(Path(b).name for b in doc["bundles"]) == sorted([bundle.name, "second-node"])  # both were read
    assert len(doc["findings"]) == 1, doc["findings"]
    assert doc["findings"][0]["kind"] == "rank_conditional" and doc["findings"][0]["ranks"] == [0]
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1]


def test_a_directory_without_rings_is_a_usage_error(tmp_path):
    empty = tmp_path / "nothing-here"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a ring\n")
    proc = dtwatch_cli("analyze", str(empty), "--json")
    assert proc.returncode == 2
    assert "no rings, bundles or Flight Recorder dumps found" in proc.stderr
    assert proc.stdout == ""
    missing = dtwatch_cli("analyze", str(tmp_path / "does-not-exist"))
    assert missing.returncode == 2 and "no such path" in missing.stderr


# ---------------------------------------------------------------------------------------------------
# Rings written offline by the real writer, no watchdog: analyze() diagnoses them alone.
# ---------------------------------------------------------------------------------------------------
TRAIN = "/srv/job/train.py"
LINE_STEP, LINE_ODD, LINE_BARRIER = 40, 57, 61
SEQ_HANG = 9  # every rank completed seq 1..8 in the world group


class WriterClock:
    """``time`` as the ring writer sees it: rings are written now, as if the ranks had started earlier."""

    def __init__(self, t: float) -> None:
        self.t = t

    def time(self) -> float:
        return self.t


def write_rings(run_dir: Path, *, odd_rank: int | None, world: int = 4, hang_age: float = 20.0,
                raised: int | None = None) -> float:
    """``world`` rings: 8 completed all_reduces and step markers each, then every rank in a barrier at
    SEQ_HANG, except ``odd_rank``, which is in an all_reduce at the same seq from another line, and ``raised``,
    which ended with an exception before SEQ_HANG. Returns the time the hang started."""
    now = time.time()
    t = now - hang_age - 8 * 0.5
    hang = now - hang_age
    with mock.patch("dtwatch.ring.writer.time", WriterClock(t - 5.0)):  # the processes started before their first call
        for rank in range(world):
            _write_rank(run_dir, rank, world, odd_rank, t, hang, now, raised == rank)
    return hang


def _write_rank(run_dir: Path, rank: int, world: int, odd_rank: int | None, t: float, hang: float, now: float,
                raised: bool = False) -> None:
    w = RingWriter(run_dir / ring_filename(rank), rank=rank, local_rank=rank, world_size=world, job_id=run_dir.name,
                   host="node-offline", backend="gloo", capacity=64)
    site_step = w.add_site(TRAIN, LINE_STEP, "train_step")
    site_odd = w.add_site(TRAIN, LINE_ODD, "evaluate")
    site_barrier = w.add_site(TRAIN, LINE_BARRIER, "main")
    slot = w.add_group("0", "default_pg", list(range(world)), rank)
    stamp = 0
    for seq in range(1, SEQ_HANG):
        te = t + (seq - 1) * 0.5
        stamp += 1
        w.write_record(stamp, op="all_reduce", seq=seq, t_enter=te, t_exit=te + 0.01, dtype="float32",
                       shape=(1024,), group_slot=slot, site=site_step, step=seq - 1)
        stamp += 1
        w.write_record(stamp, op="step", seq=seq, t_enter=te + 0.02, t_exit=te + 0.02, seq_span=0,
                       flags=FLAG_MARKER, ntensors=0, numel=0, group_slot=0xFFFF, step=seq)
        w.set_step(seq, te + 0.02)
    stamp += 1
    if raised:
        w.set_exit(EXIT_EXCEPTION, 1, "RuntimeError: loss is NaN")
        w.close()
        return
    if rank == odd_rank:  # in flight: t_exit stays 0
        w.write_record(stamp, op="all_reduce", seq=SEQ_HANG, t_enter=hang, dtype="float32", shape=(1,),
                       group_slot=slot, site=site_odd, step=SEQ_HANG - 1)
        w.set_main_site(site_odd, site_odd, hang)
    else:
        w.write_record(stamp, op="barrier", seq=SEQ_HANG, t_enter=hang + 0.001 * rank, numel=0,
                       group_slot=slot, site=site_barrier, step=SEQ_HANG - 1)
        w.set_main_site(site_barrier, site_barrier, hang)
    w.set_group_cpp_seq(slot, SEQ_HANG, hang)
    w.heartbeat(now, 100)  # alive: the sampler thread still beats while the main thread waits
    w.close()


def test_offline_rings_alone_name_the_rank_in_the_other_collective(tmp_path):
    run_dir = tmp_path / "offline-job"
    hang = write_rings(run_dir, odd_rank=2)
    assert not list(run_dir.rglob("index.json"))  # no watchdog, no bundle
    result = analyze([str(run_dir)])  # window 0: any rank still inside a collective
    assert result.stalled
    assert [s.rank for s in result.states] == [0, 1, 2, 3]
    assert all(s.alive is None for s in result.states)  # another host's processes: liveness unknown
    assert len(result.findings) == 1, [f.summary for f in result.findings]
    f = result.findings[0]
    # The rings' source file is not on this machine, so no rank test can be seen: the ranks took
    # different paths for a reason not shown (a desync), rank 2 being the odd one out.
    assert f.kind == "desync" and f.severity == "stall"
    assert f.ranks == [2]
    assert (f.op, f.group, f.seq) == ("all_reduce", "0", SEQ_HANG)
    assert f.site is not None and f.waiting_site is not None
    assert (f.site["file"], f.site["line"], f.site["function"]) == (TRAIN, LINE_ODD, "evaluate")
    assert f.waiting_ranks == [0, 1, 3]
    assert (f.waiting_op, f.waiting_group, f.waiting_seq) == ("barrier", "0", SEQ_HANG)
    assert f.waiting_site["line"] == LINE_BARRIER
    assert f.details["skipped_by"] == [0, 1, 3]
    assert f.onset == pytest.approx(hang + 0.003)  # the last progress: rank 3 entering the barrier
    # The CLI reads the same rings the same way.
    proc = dtwatch_cli("analyze", str(run_dir), "--json")
    assert proc.returncode == 1, proc.stderr
    cli = json.loads(proc.stdout)["findings"]
    assert [(c["kind"], c["ranks"], c["seq"], c["site"]["line"]) for c in cli] == [("desync", [2], SEQ_HANG, LINE_ODD)]


def test_rings_alone_give_the_incident_its_verdict_as_the_watchdog_would(tmp_path):
    """No watchdog ran (no bundle): the verdict is decided with the diagnosis, from the rings."""
    stalled = tmp_path / "stalled-job"
    write_rings(stalled, odd_rank=2)
    assert analyze([str(stalled)]).verdict == "stall"
    crashed = tmp_path / "crashed-job"
    write_rings(crashed, odd_rank=None, raised=1)
    result = analyze([str(crashed)])
    assert [f.ranks for f in result.findings][0] == [1], [f.summary for f in result.findings]
    assert result.verdict == "crash"
    proc = dtwatch_cli("analyze", str(crashed), "--json")
    assert json.loads(proc.stdout)["verdict"] == "crash", proc.stdout


def test_offline_rings_all_in_the_same_collective_are_not_a_desync(tmp_path):
    run_dir = tmp_path / "offline-job"
    write_rings(run_dir, odd_rank=None)
    result = analyze([str(run_dir)])
    assert [f.kind for f in result.findings] == ["stalled_collective"]
    assert result.findings[0].ranks == []
    assert (result.findings[0].op, result.findings[0].seq) == ("barrier", SEQ_HANG)


def test_offline_rings_within_the_window_are_not_a_stall(tmp_path):
    run_dir = tmp_path / "offline-job"
    write_rings(run_dir, odd_rank=2, hang_age=20.0)
    assert analyze([str(run_dir)], window=60.0).findings == []  # waiting 20 s < 60 s window
    assert [f.ranks for f in analyze([str(run_dir)], window=10.0).findings] == [[2]]
    proc = dtwatch_cli("analyze", str(run_dir), "--window", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No stall." in proc.stdout


def test_a_crash_in_teardown_after_a_normal_exit_is_told(torchrun):
    """A rank whose program returned and whose process then aborted (a destructor as the interpreter shut
    down): its ring says it exited normally, its signal file that it was aborted; the report says both, in
    that order, and so never contradicts the launcher's SIGABRT."""
    job = torchrun("teardown_abort.py", 2, wait=False)
    assert job.wait(120) != 0, job.output()  # torchrun reports rank 1's SIGABRT
    assert job.ring(1).exit_state_name == "exited"  # the ring alone: a normal exit
    result = analyze([str(job.run_dir)])
    assert result.endings[1].startswith("finished its program normally, then was aborted (SIGABRT"), result.endings
    assert result.endings[1].endswith("as its interpreter shut down")
    # Rank 0 exited before, or was still shutting down when the launcher ended it on rank 1's abort.
    assert result.endings[0] in ("exited normally (no exception, exit status or signal was recorded)",
                                 "finished its program normally, then was terminated (SIGTERM: the launcher tearing "
                                 "the job down, or a scheduler) as its interpreter shut down"), result.endings
    ranks = {r["rank"]: r for r in result.to_dict()["ranks"]}
    assert ranks[1]["ended"] == result.endings[1]
    text = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", str(job.run_dir)], capture_output=True,
                          text=True, timeout=120).stdout
    assert f"step {job.ring(1).step}: {result.endings[1]}" in text, text
