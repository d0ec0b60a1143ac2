"""Flight Recorder entries mapped onto dtwatch's sequence numbers (dtwatch.diagnose.flight, and the diagnosis
naming C++-issued calls).

Unit tests replay fixtures captured from real 2-rank gloo runs of tests/scripts/rec_fr.py (one per torch
version, see tests/fr_fixtures.py); the last test runs that worker for real and names the C++-issued
collectives (DDP's broadcasts and gradient all-reduce) of a finding through the watchdog's code.

What the fixtures show (torch 2.13.0 and 2.14.1, gloo): FR's ``op_id`` equals the group's sequence number
(dtwatch's ``seq``); ``collective_seq_id`` does not count p2p ops, so after the worker's two send/recv
pairs it is two behind.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from dtwatch.bundle.files import summarize_flight_record
from dtwatch.diagnose import RecordedEvidence
from dtwatch.diagnose.context import Context
from dtwatch.diagnose.flight import (
    OP_ID,
    SEQ,
    SeqMapping,
    calibrate,
    default_mapping,
    entry_for,
    op_family,
    summarize_entry,
)
from dtwatch.diagnose.rank_state import CPP_OP, Call, from_snapshot
from tests.conftest import SCRIPTS
from tests.harness import site_line

pytestmark = pytest.mark.torch_versions  # also run on the oldest torch the README claims (.ci/run)

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "flight").glob("*.json"))
SCRIPT = "/job/rec_fr.py"  # the worker's path in the fixtures


def _calls(raw: list[dict]) -> list[Call]:
    return [Call(op=c["op"], group=c["group"], seq=c["seq"], site=None, t_enter=0.0, fingerprint=c["fingerprint"],
                 span=c["span"]) for c in raw]


def cpp_issued(notes: list[dict]) -> list[tuple[str, int, str]]:
    """(group, seq, phase) of every sequence number a DDP phase used, from torch's counter before/after it."""
    out, last = [], {}
    for n in notes:
        before = last.get(n["group"], 0)
        if n["phase"] in ("ddp_init", "forward", "backward"):
            out += [(n["group"], s, n["phase"]) for s in range(before + 1, n["seq"] + 1)]
        last[n["group"]] = n["seq"]
    return out


PHASE_LINE = {phase: site_line(marker, SCRIPTS / "rec_fr.py")
              for phase, marker in (("ddp_init", "ddp"), ("forward", "forward"), ("backward", "backward"))}
EXPECTED_FAMILY = {"ddp_init": {"allgather", "broadcast"}, "forward": {"broadcast"}, "backward": {"allreduce"}}


@pytest.fixture(params=FIXTURES, ids=[p.stem for p in FIXTURES])
def fixture(request) -> dict:
    return json.loads(request.param.read_text())


def test_fixtures_exist_for_the_measured_versions():
    assert {p.stem for p in FIXTURES} >= {"gloo-torch-2.13", "gloo-torch-2.14"}


def test_calibration_on_recorded_runs(fixture):
    entries = [summarize_entry(e) for e in fixture["entries"]]
    mapping = calibrate(entries, _calls(fixture["calls"]), fixture["backend"])
    # gloo: op_id is the group counter; the Python-issued calls before and after DDP confirm it.
    assert (mapping.field, mapping.offset) == (OP_ID, 0)
    assert mapping.evidence >= 4
    assert (default_mapping(fixture["backend"]).field, default_mapping(fixture["backend"]).offset) == (OP_ID, 0)
    # Without any Python-issued call to calibrate on, the default gives the same answer.
    assert calibrate(entries, [], fixture["backend"]) == SeqMapping(OP_ID, 0, 0)


def test_cpp_issued_collectives_are_named_from_the_right_entry(fixture):
    entries = [summarize_entry(e) for e in fixture["entries"]]
    mapping = calibrate(entries, _calls(fixture["calls"]), fixture["backend"])
    phase_line = PHASE_LINE
    issued = cpp_issued(fixture["notes"])
    assert [p for _, _, p in issued].count("backward") == 3  # one gradient all-reduce per step
    assert [p for _, _, p in issued].count("forward") == 2  # DDP's bucket rebuild, second step
    for group, seq, phase in issued:
        e = entry_for(entries, group, seq, mapping)
        assert e is not None, (group, seq)
        assert op_family(e["op"]) in EXPECTED_FAMILY[phase], (seq, phase, e["op"])
        # FR's frames give the user's line that made torch issue it (forward, backward, the DDP wrapper).
        assert e["user_site"] == {"file": SCRIPT, "line": phase_line[phase], "function": "main"}, (seq, phase)
        assert e["site"] == e["user_site"]  # torch's and dtwatch's own frames are skipped
    # collective_seq_id is behind by the two p2p ops: read as dtwatch's seq it names the wrong entries.
    wrong = SeqMapping(SEQ, 0)
    last_backward = max(s for _, s, p in issued if p == "backward")
    assert entry_for(entries, "0", last_backward, wrong)["op"] != "all_reduce"


def test_python_issued_entries_point_at_their_call_lines(fixture):
    entries = [summarize_entry(e) for e in fixture["entries"]]
    mapping = calibrate(entries, _calls(fixture["calls"]), fixture["backend"])
    for c in fixture["calls"]:
        if c["op"] in ("send", "recv"):
            assert entry_for(entries, c["group"], c["seq"], mapping) is None  # gloo's FR logs no p2p
            continue
        e = entry_for(entries, c["group"], c["seq"], mapping)
        assert op_family(e["op"]) == op_family(c["op"]), c
        assert e["user_site"]["file"] == SCRIPT


def _nccl_like_entries() -> list[dict]:
    """Entries numbered as ProcessGroupNCCL does (torch source, 2.3+): the group counter is
    seqCollective_, bumped before the entry is recorded; op_id counts p2p ops as well."""
    ops = [("all_reduce", [[4]]), ("send", [[2]]), ("broadcast", [[3]]), ("all_reduce", [[9]]), ("all_reduce", [[4]])]
    entries, coll, p2p = [], 0, 0
    for op_id, (op, sizes) in enumerate(ops, 1):
        if op == "send":
            p2p += 1
        else:
            coll += 1
        entries.append({"group": "0", "seq": coll, "p2p_seq": p2p, "op_id": op_id, "op": op, "input_sizes": sizes})
    return entries


def test_calibration_follows_the_data_not_the_backend_name():
    entries = _nccl_like_entries()
    # dtwatch's view of that run: seq = the group counter after each Python-issued collective.
    calls = [Call("all_reduce", "0", 1, None, 0.0, fingerprint="all_reduce[float32:4]"),
             Call("broadcast", "0", 2, None, 0.0, fingerprint="broadcast[float32:3]"),
             Call("all_reduce", "0", 4, None, 0.0, fingerprint="all_reduce[float32:4]")]
    assert default_mapping("nccl") == SeqMapping(SEQ, 0)
    assert calibrate(entries, calls, "nccl") == SeqMapping(SEQ, 0, 3)
    assert calibrate(entries, calls, "gloo") == SeqMapping(SEQ, 0, 3)  # the data wins over the default
    assert entry_for(entries, "0", 3, calibrate(entries, calls, ""))["input_sizes"] == [[9]]  # C++-issued
    # A torch that numbered its entries from 0 (before issuing): calibrated to offset +1.
    shifted = [{**e, "seq": e["seq"] - 1, "op_id": None} for e in entries]
    assert calibrate(shifted, calls, "nccl") == SeqMapping(SEQ, 1, 3)
    # Calls that agree with no candidate leave the default.
    assert calibrate(entries, [Call("gather", "0", 1, None, 0.0)], "gloo") == SeqMapping(OP_ID, 0, 0)


@pytest.mark.timeout(150)
def test_watchdog_names_ddp_collectives_from_the_flight_recorder(torchrun):
    # The collective hooks off: on a torch without them (< 2.14) the Flight Recorder is how these get a name.
    job = torchrun("rec_fr.py", 2, env={"DTWATCH_COLLECTIVE_HOOKS": "off"})
    script = str(SCRIPTS / "rec_fr.py")
    for rank in range(2):
        state = from_snapshot(job.ring(rank))
        notes = job.result(rank)["notes"]
        summary = summarize_flight_record(str(job.out_dir / f"rank-{rank}.fr.pkl"))
        assert summary is not None and summary["entries"]
        issued = cpp_issued(notes)
        # The ring alone knows these only as sequence numbers: no Python record has them.
        py_seqs = {c.seq for c in state.groups["0"].recent}
        assert not py_seqs & {s for _, s, _ in issued}
        evidence = RecordedEvidence(flight_records={str(rank): summary})
        for group, seq, phase in issued:
            ctx = Context([state], {}, 0.0, 0.0, evidence)
            named = ctx.named(rank, Call(CPP_OP, group, seq, None, 0.0, fingerprint=CPP_OP))
            assert op_family(named.op) in EXPECTED_FAMILY[phase], (rank, seq, phase, named.op)
            assert named.user_site == {"file": script, "line": PHASE_LINE[phase], "function": "main"}
            entry = ctx.issued_from_cpp[rank]
            assert entry["op_id"] == seq and entry["seq_mapping"]["field"] == "op_id"
            assert entry["seq_mapping"]["evidence"] >= 4
        # A Python-issued call is left as it is.
        python = Call("barrier", "0", 4, None, 0.0, fingerprint="barrier[unknown:]")
        assert Context([state], {}, 0.0, 0.0, evidence).named(rank, python) is python
        assert pickle.loads((job.out_dir / f"rank-{rank}.fr.pkl").read_bytes())["entries"]
