"""Diagnosing a job that ran without dtwatch from torch's own Flight Recorder dumps (dtwatch.diagnose.fr_states).

Fast unit tests replay fixtures captured from real 2-4 rank gloo jobs of ``tests/scripts/fr_job.py`` run with no
dtwatch at all (``tests/frdump_fixtures.py``), one per fault, through the same diagnosis as a watched job. Each
fixture keeps the worker's source as it was, so the lines the entries name are read from it. Counter-cases (the
healthy dumps, dumps of ranks all in one call, a rank with no dump that is not the culprit) check that the rules
stay silent, and that no sentence claims what a dump does not show.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from dtwatch.diagnose import RecordedEvidence, diagnose
from dtwatch.diagnose.fr_states import (
    FLIGHT_RECORDER,
    Dump,
    dump_problem,
    job_facts,
    p2p_gaps,
    parse_ranks,
    split_name,
    states_from_dumps,
)
from dtwatch.report.fr_dumps import dump_facts

FIXTURES = Path(__file__).parent / "fixtures" / "frdumps"
SCRIPT = "/job/fr_job.py"  # the worker's path in the fixtures
FAULTS = ("healthy", "rank_conditional", "uneven", "subgroup_skip", "p2p", "mismatch", "crash", "stuck")
# Words no finding may say from a dump alone: a dump shows no process, no stack, no steps, no loaders, and the
# ranks it lacks were not "never seen" by a watchdog. (C++-issued calls would be gaps read as DDP's.)
UNSUPPORTED = re.compile(r"exited|dtwatch sees|never seen|no ring|still running|unresponsive|heartbeat|C\+\+|DDP|"
                         r"steps so far|DataLoader|was killed|died|crashed (at|in|with)|for \d+(\.\d+)?s\b")


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def fixture_names(fault: str) -> list[str]:
    return sorted(p.name for p in FIXTURES.glob(f"{fault}-torch-*.json"))


def line_of(fixture: dict, marker: str) -> int:
    """The line of the worker (as captured) that holds ``marker``."""
    for i, text in enumerate(fixture["source"].splitlines(), 1):
        if marker in text:
            return i
    raise KeyError(marker)


def dumps_of(fixture: dict, drop: tuple[int, ...] = ()) -> list[Dump]:
    out = []
    for rank, doc in fixture["dumps"].items():
        if int(rank) in drop:
            continue
        newest = max((e.get("time_created_ns") or 0 for e in doc["entries"]), default=0) / 1e9
        out.append(Dump(int(rank), doc, f"fr_trace_rank_{rank}", newest + 5.0))
    return out


def run(fixture: dict, dumps: list[Dump] | None = None):
    """The diagnosis of the fixture's dumps, as ``dtwatch analyze`` makes it (source from the fixture)."""
    dumps = dumps if dumps is not None else dumps_of(fixture)
    states, facts = states_from_dumps(dumps)
    ev = RecordedEvidence(sources={SCRIPT: {"text": fixture["source"]}},
                          dump_facts={str(d.rank): dump_facts(d) for d in dumps})
    now = max(s.heartbeat_time for s in states)
    return diagnose(states, now, 0.0, ev, heartbeat_stale=float("inf"), assume_stalled=True), states, facts


def only_finding(fixture: dict):
    result, states, facts = run(fixture)
    assert result.stalled
    assert len(result.findings) == 1, [f.summary for f in result.findings]
    f = result.findings[0]
    assert not UNSUPPORTED.search(f.summary), f.summary
    return f, states, facts


def test_the_corpus_covers_every_fault_on_two_torch_versions():
    for fault in FAULTS:
        versions = {n.rsplit("-torch-", 1)[1].removesuffix(".json") for n in fixture_names(fault)}
        assert {"2.13", "2.15"} <= versions, (fault, versions)


@pytest.fixture(params=[n for f in FAULTS for n in fixture_names(f)])
def any_fixture(request) -> dict:
    return load(request.param)


def test_every_dump_is_a_dump_and_becomes_a_state_marked_as_from_a_dump(any_fixture):
    fx = any_fixture
    for doc in fx["dumps"].values():
        assert dump_problem(doc) is None
    states, facts = states_from_dumps(dumps_of(fx))
    assert facts.world_size == fx["world"] and facts.no_dump == fx["no_dump"]
    for s in states:
        assert s.origin == FLIGHT_RECORDER and s.from_dump
        assert s.alive is None and not s.gone and s.pid == 0 and s.step == -1 and s.main_site is None
        for g in s.groups.values():
            assert [c.seq for c in g.recent] == list(range(g.recent[0].seq, g.seq + 1))  # no gap read as C++
            assert all(c.site is None or c.user_site is not None for c in g.recent)


def test_healthy_dumps_give_no_finding():
    for name in fixture_names("healthy"):
        result, states, _ = run(load(name))
        assert not result.stalled and result.findings == [], name
        assert all(not s.open_calls for s in states)


def test_rank_conditional_names_rank_0_its_extra_call_and_the_rank_test():
    for name in fixture_names("rank_conditional"):
        fx = load(name)
        f, _, _ = only_finding(fx)
        assert (f.kind, f.ranks, f.op, f.group) == ("rank_conditional", [0], "all_reduce", "0"), f.summary
        assert f.site["line"] == line_of(fx, "# metric reduced only on rank 0")
        assert f.details["conditional_line"]["line"] == line_of(fx, 'FAULT == "rank_conditional" and rank == 0')
        assert f.details["program_order"] and f.seq == 3  # where the programs parted, not where they hang (seq 5)
        assert f.waiting_ranks == [1, 2, 3] and f.waiting_op == "barrier"


def test_uneven_iterations_are_told_by_positions_and_counts_never_as_a_loop_exit():
    for name in fixture_names("uneven"):
        fx = load(name)
        f, _, _ = only_finding(fx)
        # Rank 0 ran one more step: ranks 1-3 wait in the barrier after the loop that rank 0 is still inside, and
        # rank 0 issued the loop's all-reduce once more. A dump has no step counts: that ranks 1-3 "left the loop
        # early" is not claimed (an extra call inside the loop on rank 0 would look the same); the minority is named.
        assert (f.kind, f.ranks, f.op) == ("uneven_iterations", [0], "all_reduce"), f.summary
        assert f.details["past_the_loop"] == [1, 2, 3] and f.details["inside_the_loop"] == [0]
        assert f.details["calls_at_line"] == {0: 5, 1: 4, 2: 4, 3: 4}
        assert f.site["line"] == line_of(fx, "for step in range(steps)")
        assert f.details["post_loop_site"]["line"] == line_of(fx, "# end of training")
        assert "left the loop" not in f.summary and "is not known" in f.summary


def test_subgroup_skip_names_the_member_that_skipped_the_subgroups_call():
    for name in fixture_names("subgroup_skip"):
        fx = load(name)
        f, states, facts = only_finding(fx)
        assert (f.kind, f.ranks, f.op, f.group) == ("rank_conditional", [2], "all_reduce", "1"), f.summary
        assert f.site["line"] == line_of(fx, "# subgroup all-reduce")
        assert f.waiting_ranks == [0, 1, 3] and f.details["made_before"]  # rank 3 waits in group 0 behind it
        # gloo's dumps name no group in pg_config: the subgroup's members are the ranks whose dumps use it.
        assert facts.members["1"] == [0, 1, 2] and facts.members_inferred == ["1"]


def test_p2p_names_the_rank_with_no_call_in_flight_and_says_gloo_does_not_record_send_recv():
    for name in fixture_names("p2p"):
        fx = load(name)
        f, states, _ = only_finding(fx)
        # Rank 1 skipped a recv; rank 0 is blocked in its send, which gloo's recorder leaves out. From the dumps,
        # rank 0 is the rank rank 1 waits for, with no call in flight: said so, with the send/recv caveat.
        assert (f.kind, f.ranks) == ("stuck_outside_collective", [0]), f.summary
        assert "does not record send/recv" in f.summary and "may be blocked in one" in f.summary
        assert "where it is now is not in a dump" in f.summary
        assert f.details["p2p_unrecorded"] == {"0": 2}
        assert p2p_gaps(fx["dumps"]["1"]["entries"]) == {"0": 2}


def test_mismatch_names_the_minority_shape_at_the_shared_line():
    for name in fixture_names("mismatch"):
        fx = load(name)
        f, _, _ = only_finding(fx)
        assert (f.kind, f.ranks, f.op, f.seq) == ("mismatch", [1], "all_reduce", 3), f.summary
        assert f.site["line"] == line_of(fx, "# gradient all-reduce")
        assert f.details["fingerprints"] == {"all_reduce[float32:5]": [1], "all_reduce[float32:4]": [0, 2, 3]}


def test_a_crashed_rank_is_the_rank_with_no_dump_that_the_others_wait_for():
    for name in fixture_names("crash"):
        fx = load(name)
        f, _, facts = only_finding(fx)
        assert facts.no_dump == [2]
        assert (f.kind, f.ranks, f.op) == ("stalled_collective", [2], "all_reduce"), f.summary
        assert f.details["no_dump"] == [2] and f.waiting_ranks == [0, 1, 3]
        assert f.waiting_site["line"] == line_of(fx, "# gradient all-reduce")
        # No dump is not a death: the sentence names what the dumps cannot tell.
        assert "left no Flight Recorder dump" in f.summary and "is not known" in f.summary
        assert f.site is None  # the others' line is where they wait, not the cause


def test_a_rank_stuck_outside_collectives_is_named_without_a_place():
    for name in fixture_names("stuck"):
        fx = load(name)
        f, _, _ = only_finding(fx)
        assert (f.kind, f.ranks) == ("stuck_outside_collective", [1]), f.summary
        assert "where it is now is not in a dump" in f.summary and f.site is None
        assert f.details["last_recorded"]["seq"] == 2 and f.waiting_ranks == [0, 2, 3]
        assert "send/recv" not in f.summary  # rank 1 made no point-to-point call: no such hint


# ---------------------------------------------------------------------------------------------------
# counter-cases: rules that must stay silent, or say less
# ---------------------------------------------------------------------------------------------------
def test_every_rank_in_one_collective_names_no_culprit():
    fx = copy.deepcopy(load(fixture_names("healthy")[0]))
    for doc in fx["dumps"].values():
        doc["entries"][-1]["retired"] = False  # the final barrier, in flight on every rank
    f, _, _ = only_finding(fx)
    assert (f.kind, f.ranks, f.op) == ("stalled_collective", [], "barrier")
    assert "none is missing" in f.summary and "no Flight Recorder dump" not in f.summary


def test_dumps_written_at_different_moments_of_a_healthy_job_give_no_finding():
    fx = copy.deepcopy(load(fixture_names("healthy")[0]))
    fx["dumps"]["0"]["entries"][-1]["retired"] = False  # rank 0 dumped while in the barrier the others had left
    result, _, _ = run(fx)
    assert not result.stalled and result.findings == []


def test_a_rank_shown_in_flight_in_its_dump_is_never_said_to_have_none():
    fx = copy.deepcopy(load(fixture_names("healthy")[0]))
    fx["dumps"]["0"]["entries"][-1]["retired"] = False  # rank 0: in the barrier (seq 5) when it dumped
    later = copy.deepcopy(fx["dumps"]["1"]["entries"][-1])  # rank 1 dumped later: it completed seq 5 and
    later.update(collective_seq_id=6, op_id=6, retired=False, profiling_name="gloo:all_reduce")  # issued seq 6
    later["time_created_ns"] += 10**9
    fx["dumps"]["1"]["entries"].append(later)
    result, _, _ = run(fx)
    by_rank = {tuple(f.ranks): f.summary for f in result.findings}
    assert sorted(by_rank) == [(0,), (2,), (3,)]  # rank 1 waits at seq 6 for all three
    assert "shows barrier (group 0, seq 5)" in by_rank[(0,)] and "different moments" in by_rank[(0,)]
    assert "no collective in flight" not in by_rank[(0,)]
    assert all("has no collective in flight" in by_rank[(r,)] for r in (2, 3))
    assert not any(UNSUPPORTED.search(text) for text in by_rank.values())


def test_a_rank_without_a_dump_is_not_blamed_when_nobody_waits():
    fx = load(fixture_names("healthy")[0])
    result, _, facts = run(fx, dumps_of(fx, drop=(3,)))
    assert facts.no_dump == [3]  # gloo's pg_config lists rank 3 even though its name is empty
    assert not result.stalled and result.findings == []


def test_a_stuck_rank_that_left_no_dump_is_named_as_such_not_as_dead():
    fx = load(fixture_names("stuck")[0])
    result, _, facts = run(fx, dumps_of(fx, drop=(1,)))
    assert facts.no_dump == [1]
    (f,) = result.findings
    assert (f.kind, f.ranks) == ("stalled_collective", [1])
    assert not UNSUPPORTED.search(f.summary), f.summary
    assert not re.search(r"rank 1 (crashed|died|exited|ended)", f.summary)


def test_dumps_without_frames_name_the_deviant_but_no_line():
    fx = copy.deepcopy(load(fixture_names("rank_conditional")[0]))
    for doc in fx["dumps"].values():
        for e in doc["entries"]:
            e["frames"] = []  # as torch's JSON dumps are
    f, _, _ = only_finding(fx)
    # Without lines every all_reduce looks alike: where rank 0's extra one was cannot be placed; the ranks
    # part where they stand (rank 0 in all_reduce, the others in barrier), and no rank test is claimed.
    assert f.ranks == [0] and f.kind == "desync" and f.site is None
    assert "rank test" not in f.summary and "an unknown line" in f.summary


def test_a_healthy_rank_among_faulty_ones_is_never_the_culprit():
    for fault in ("rank_conditional", "mismatch", "subgroup_skip"):
        for name in fixture_names(fault):
            f, _, _ = only_finding(load(name))
            assert 3 not in f.ranks, (name, f.ranks)  # rank 3 ran the program as written in every one of these


# ---------------------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------------------
def test_profiling_names_split_into_backend_op_and_peer():
    assert split_name("gloo:all_reduce") == ("gloo", "all_reduce", -1)
    assert split_name("nccl:send 0->3") == ("nccl", "send", 3)
    assert split_name("nccl:recv 2<-1") == ("nccl", "recv", 1)
    assert split_name("nccl:_allgather_base") == ("nccl", "_allgather_base", -1)


def test_pg_config_ranks_parse_as_text_or_list_never_by_eval():
    assert parse_ranks("[0, 1, 2]") == [0, 1, 2] and parse_ranks([3, 1]) == [3, 1] and parse_ranks("") == []
    assert parse_ranks("__import__('os').system('true')") is None and parse_ranks("[-1]") is None
    assert parse_ranks("[0, 1099511627775]") is None  # a garbled rank: never a world of 2**40 ranks to list


def test_nccl_style_dumps_use_named_groups_states_and_p2p_entries():
    """NCCL's dumps (from torch's source: named pg_config, completed states, send/recv entries): no GPU here."""
    def entry(seq, name, state, p2p=False):
        return {"process_group": ["0", "default_pg"], "collective_seq_id": seq, "p2p_seq_id": 1 if p2p else 0,
                "op_id": seq, "profiling_name": name, "input_sizes": [[8]], "input_dtypes": ["BFloat16"],
                "state": state, "retired": state == "completed", "is_p2p": p2p, "time_created_ns": seq * 10**6,
                "frames": []}
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
    docs = {0: {"version": "2.10", "pg_config": cfg, "entries": [entry(1, "nccl:all_reduce", "completed"),
                                                                   entry(2, "nccl:all_reduce", "started")]},
            1: {"version": "2.10", "pg_config": cfg, "entries": [entry(1, "nccl:all_reduce", "completed"),
                                                                   entry(1, "nccl:send 1->0", "scheduled", True)]}}
    for doc in docs.values():
        assert dump_problem(doc) is None
    facts = job_facts([Dump(r, d) for r, d in docs.items()])
    assert facts.world_size == 3 and facts.world_known and facts.no_dump == [2]
    states, _ = states_from_dumps([Dump(r, d) for r, d in docs.items()])
    s0, s1 = states
    assert s0.backend == "nccl" and [c.seq for c in s0.open_calls] == [2]
    assert s0.groups["0"].completed == 1 and s0.open_calls[0].fingerprint == "all_reduce[bfloat16:8]"
    (send,) = s1.open_calls
    assert (send.op, send.peer, send.group) == ("send", 0, "0:p2p")
    assert s1.groups["0"].seq == 1  # a send does not advance the group's collective numbers


@pytest.mark.parametrize("doc, why", [
    ([], "a list"), ({"entries": []}, "no version"), ({"version": 2, "entries": []}, "not a string"),
    ({"version": "2.10", "entries": {}}, "not a list"), ({"version": "2.10", "entries": [1]}, "entry 0"),
    ({"version": "2.10", "entries": [{"process_group": ["0", ""], "profiling_name": "x"}]}, "collective_seq_id"),
    ({"version": "2.10", "entries": [{"process_group": "0", "collective_seq_id": 1, "profiling_name": "x"}]},
     "process_group"),
])
def test_what_is_not_a_dump_is_said(doc, why):
    assert why in (dump_problem(doc) or "")


def test_garbled_entries_are_refused_by_the_check_or_read_without_raising():
    """Every field of a real entry replaced by values of other types: either the check names the dump, or the
    states are made and diagnosed without an exception (a damaged dump never stops the analysis)."""
    fx = load(fixture_names("rank_conditional")[0])
    odd = [None, "x", -1, 2**70, 1.5, [], {}, [["a"]], [[1, "b"]], True, [{"filename": 3}]]
    for key in sorted({k for e in fx["dumps"]["0"]["entries"] for k in e}):
        for value in odd:
            bad = copy.deepcopy(fx)
            bad["dumps"]["0"]["entries"][-1][key] = value
            if dump_problem(bad["dumps"]["0"]) is not None:
                continue
            result, states, _ = run(bad)  # must not raise
            assert states[0].rank == 0 and isinstance(result.findings, list), (key, value)
