"""A damaged input is named, the rest still read (issue 24): what ``dtwatch analyze`` says, case by case, when one
rank's ring or bundle file is cut short, garbled, another rank's, or of another format; and that the ring reader
and the watchdog's poll never raise on one. ``tests/test_reader_fuzz.py`` runs the same checks on many inputs."""
from __future__ import annotations

import shutil
import struct
import time
from pathlib import Path

import pytest

from dtwatch.bundle.files import Bundle
from dtwatch.render.report_text import render_text
from dtwatch.report.analyze import analyze
from dtwatch.ring import RECORD_SIZE, RingFormatError, read_rings, ring_filename
from dtwatch.ring.layout import STATIC
from dtwatch.ring.reader import (
    BAD_MAGIC,
    BAD_RECORDS,
    RANK_MISMATCH,
    SHORT_HEADER,
    SIZE_MISMATCH,
    UNKNOWN_VERSION,
    parse_ring,
    try_read_ring,
)
from dtwatch.watchdog.ring_poll import RingReader
from tests.test_reader_fuzz import HOST, JOB, ODD, WORLD, write_ring


def run_dir_of(tmp_path: Path, *, hung: bool = True) -> Path:
    run_dir = tmp_path / JOB
    run_dir.mkdir()
    now = time.time()
    for rank in range(WORLD):
        write_ring(run_dir, rank, now, hung=hung)
    return run_dir


def report(run_dir: Path) -> tuple[object, str, dict]:
    result = analyze([str(run_dir)])
    text = render_text(result.findings, result.states, now=result.now, warnings=result.warnings,
                       verdict=result.verdict, live_warnings=result.live_warnings)
    return result, text, result.to_dict()


def ring(run_dir: Path, rank: int) -> Path:
    return run_dir / ring_filename(rank)


def test_a_truncated_ring_is_named_and_its_rank_listed_as_unreadable(tmp_path):
    run_dir = run_dir_of(tmp_path)
    with open(ring(run_dir, 1), "r+b") as f:
        f.truncate(5000)
    result, text, doc = report(run_dir)
    assert [s.rank for s in result.states] == [0, 2, 3] and result.unreadable == [1]
    assert text.startswith(f"dtwatch report for job {JOB} — 3 rank(s) seen, rank 1 could not be read\n")
    line = next(line for line in text.splitlines() if str(ring(run_dir, 1)) in line)
    assert "truncated: 5,000 of the" in line and "no other file holds rank 1" in line
    assert "  rank 1: could not be read (see DAMAGED INPUT)" in text
    # The others' diagnosis still runs: rank 2 is in another collective than 0 and 3.
    assert result.stalled and result.findings[0].ranks == [ODD]
    assert "(the diagnosis is of the ranks read: rank 1 could not be read)" in text
    [damaged] = doc["damaged_inputs"]
    assert damaged["path"] == str(ring(run_dir, 1)) and damaged["problem"] == SIZE_MISMATCH
    assert damaged["ranks"] == [1] and damaged["read"] is False and doc["unreadable_ranks"] == [1]
    assert [w["kind"] for w in doc["warnings"]] == ["damaged_input"] and doc["warnings"][0]["ranks"] == [1]


def test_no_stall_is_not_claimed_for_a_rank_that_could_not_be_read(tmp_path):
    run_dir = run_dir_of(tmp_path, hung=False)
    assert "No stall.\n" in report(run_dir)[1]
    ring(run_dir, 1).write_bytes(b"\x00\x13random bytes, not a ring" * 100)
    result, text, _ = report(run_dir)
    assert not result.findings and result.unreadable == [1]
    assert "No stall.\n" not in text
    assert ("No stall among the ranks read; rank 1 could not be read, so whether it stalled, or others wait for it, "
            "is not known.") in text
    assert f"{ring(run_dir, 1)}: not a dtwatch ring (bad magic" in text


def test_the_culprit_unreadable_the_others_are_diagnosed_without_a_claim_about_it(tmp_path):
    run_dir = run_dir_of(tmp_path)
    with open(ring(run_dir, ODD), "r+b") as f:
        f.truncate(5000)
    result, text, _ = report(run_dir)
    assert result.unreadable == [ODD] and ODD not in {s.rank for s in result.states}
    # The others wait in the barrier; whether rank 2 issued it is unknown: the finding says so, and why.
    [f] = result.findings
    assert f.kind == "stalled_collective" and ODD not in f.ranks and f.details["unreadable_ranks"] == [ODD]
    assert f"rank {ODD} wrote a ring that could not be read (damaged: see the damaged inputs), so whether it " \
        "issued this call is not known" in f.summary
    assert "never seen" not in f.summary  # it was seen: its ring is there, damaged


def test_a_torn_record_is_left_out_and_counted_the_rest_of_the_ring_read(tmp_path):
    run_dir = run_dir_of(tmp_path)
    pristine, _ = try_read_ring(ring(run_dir, 1))
    data = bytearray(ring(run_dir, 1).read_bytes())
    records_off = STATIC.unpack(data)["records_off"]
    data[records_off + 5 * RECORD_SIZE + RECORD_SIZE - 1] ^= 0x40  # the trailing stamp of slot 5
    ring(run_dir, 1).write_bytes(bytes(data))
    snap, problem = try_read_ring(ring(run_dir, 1))
    assert snap is not None and problem is not None and problem.read and problem.problem == BAD_RECORDS
    assert problem.dropped == 1 and len(snap.records) == len(pristine.records) - 1
    assert f"1 of {len(pristine.records)} records failed their checks (torn or garbled): left out" in problem.detail
    result, text, doc = report(run_dir)
    assert [s.rank for s in result.states] == [0, 1, 2, 3] and result.unreadable == []
    assert doc["damaged_inputs"][0]["dropped_records"] == 1 and str(ring(run_dir, 1)) in text
    assert "could not be read" not in text


def test_another_ranks_ring_under_a_ranks_name_is_not_taken_for_it(tmp_path):
    run_dir = run_dir_of(tmp_path)
    shutil.copyfile(ring(run_dir, 3), ring(run_dir, 1))
    result, text, _ = report(run_dir)
    [p] = result.problems
    assert p.problem == RANK_MISMATCH and p.ranks == (1, 3) and "its header says rank 3, its name rank 1" in p.detail
    assert result.unreadable == [1] and [s.rank for s in result.states] == [0, 2, 3]
    assert "(rank 3 read from another file; rank 1 from none)" in text


def test_a_world_size_the_other_rings_contradict_is_named(tmp_path):
    run_dir = run_dir_of(tmp_path)
    data = bytearray(ring(run_dir, 1).read_bytes())
    struct.pack_into("<i", data, STATIC.offset("world_size"), WORLD + 1024)  # one flipped bit
    ring(run_dir, 1).write_bytes(bytes(data))
    result, _text, _ = report(run_dir)
    [p] = result.problems
    assert p.problem == "inconsistent" and "world size 1028, 3 other ring(s) of job fuzz-job say 4" in p.detail
    assert result.unreadable == [1]
    assert all("1028" not in f.summary for f in result.findings)  # no "ranks 4-1027 never seen"


@pytest.mark.parametrize("damage, code", [
    (lambda d: b"", SHORT_HEADER), (lambda d: d[:100], SHORT_HEADER), (lambda d: b"PK\x03\x04" + d[4:], BAD_MAGIC),
    (lambda d: d[:8] + struct.pack("<I", 9) + d[12:], UNKNOWN_VERSION),
    (lambda d: d[: STATIC.unpack(d)["records_off"] + 10], SIZE_MISMATCH),
])
def test_parse_ring_is_pure_and_raises_one_error_naming_what_is_wrong(tmp_path, damage, code):
    run_dir = run_dir_of(tmp_path)
    data = ring(run_dir, 1).read_bytes()
    assert parse_ring(data).rank == 1  # bytes alone, no file
    with pytest.raises(RingFormatError) as e:
        parse_ring(damage(data), "some/rank-00001.ring", name_rank=1)
    assert e.value.problem.problem == code and e.value.problem.ranks == (1,) and not e.value.problem.read
    assert str(e.value).startswith("some/rank-00001.ring: ")


def test_a_bundles_damaged_rank_file_is_named_and_its_rank_read_from_the_ring_if_there(tmp_path):
    run_dir = run_dir_of(tmp_path)
    result, _, _ = report(run_dir)
    bundle = Bundle(str(run_dir), "inc-x", HOST)
    bundle.write_findings(result.findings, result.states, {"job_id": JOB, "detected": time.time(), "verdict": "stall"})
    rank_file = bundle.path / "ranks" / "rank-00001.json"
    rank_file.write_text(rank_file.read_text()[:300])
    with_rings = analyze([str(run_dir)])  # rank 1 from its ring
    assert [p.path for p in with_rings.problems] == [str(rank_file)] and with_rings.unreadable == []
    assert with_rings.problems[0].problem == "bad_json" and with_rings.stalled
    for rank in range(WORLD):
        ring(run_dir, rank).unlink()
    alone = analyze([str(run_dir)])  # the bundle alone: rank 1 is in no other file
    assert alone.unreadable == [1] and [s.rank for s in alone.states] == [0, 2, 3] and alone.findings


def test_the_watchdogs_poll_and_read_rings_skip_a_damaged_ring_without_raising(tmp_path):
    run_dir = run_dir_of(tmp_path)
    data = bytearray(ring(run_dir, 1).read_bytes())
    struct.pack_into("<I", data, STATIC.offset("groups_off"), 1 << 30)  # the old reader raised ValueError here
    ring(run_dir, 1).write_bytes(bytes(data))
    ring(run_dir, 2).write_bytes(b"")
    assert sorted(RingReader(str(run_dir), HOST).read()) == [0, 3]
    assert [s.rank for s in read_rings(sorted(run_dir.glob("*.ring")))] == [0, 3]
