"""Program-order alignment (dtwatch.diagnose.align) on hand-built call streams: pure, no torch jobs.

Each case is a pattern seen in real code; the counter-cases are programs whose streams differ by line
on every call but mean the same thing, where the alignment must find nothing."""
from __future__ import annotations

from dtwatch.diagnose.align import CPP_KEY, Token, align, interior_edits, parting


def toks(spec: str, start: int = 1) -> list[Token]:
    """``"G G M"`` -> tokens; a letter is a line; ``C`` a call issued from C++; ``b*`` a barrier;
    letters after ``/`` (``G/B``) share op and shape with G but come from line B."""
    out = []
    for k, word in enumerate(spec.split()):
        seq = start + k
        if word == "C":
            out.append(Token(seq, CPP_KEY))
        elif word.endswith("*"):
            out.append(Token(seq, ("barrier", "", ("t.py", ord(word[0])))))
        elif "/" in word:
            shape, line = word.split("/")
            out.append(Token(seq, ("all_reduce", f"f32[{shape}]", ("t.py", ord(line)))))
        else:
            out.append(Token(seq, ("all_reduce", "f32[8]", ("t.py", ord(word)))))
    return out


def test_an_extra_call_that_paired_silently_is_found_with_its_pairing():
    # rank 0 all-reduces a metric of the gradients' shape once; the others' next all_reduce pairs with it,
    # and at the end rank 0 is one call behind: the others wait in the epoch's barrier.
    streams = {0: toks("G G M/M G G G G"), 1: toks("G G G G G G x*"), 2: toks("G G G G G G x*"),
               3: toks("G G G G G G x*")}
    # the metric has the gradients' shape: spell it so
    streams[0] = [t if t.key[2] != ("t.py", ord("M")) else Token(t.seq, ("all_reduce", "f32[8]", ("t.py", ord("M"))))
                  for t in streams[0]]
    p = parting("0", streams, {r: True for r in streams})
    assert p is not None and p.ranks == [0] and p.reference == [1, 2, 3] and p.extra and p.decided
    assert [t.seq for t in p.calls] == [3] and p.calls[0].key[2] == ("t.py", ord("M"))
    assert {r: t.key[2][1] for r, t in p.paired_with.items()} == {1: ord("G"), 2: ord("G"), 3: ord("G")}


def test_a_call_one_rank_skipped_is_named_as_skipped():
    streams = {r: toks("G x* G x* G x* G") for r in range(3)}
    streams[3] = toks("G x* G G x* G x*")  # rank 3 skipped the barrier after its second all_reduce
    p = parting("0", streams, {r: True for r in streams})
    assert p is not None and p.ranks == [3] and not p.extra and p.calls[0].op == "barrier" and p.calls[0].seq == 4


def test_ranks_that_exited_after_the_same_calls_are_the_reference_not_the_culprit():
    # rank 1 made one extra async all_reduce; the others finished their loop and exited cleanly.
    streams = {r: toks("G G G G G") for r in (0, 2, 3)}
    streams[1] = [*toks("G G"), Token(3, ("all_reduce", "f32[8]", ("t.py", 999))), *toks("G G G", start=4)]
    p = parting("0", streams, {0: True, 1: False, 2: True, 3: True})
    assert p is not None and p.ranks == [1] and p.extra and p.calls[0].key[2] == ("t.py", 999)


def test_two_equal_sides_the_rank_test_decides_and_without_one_it_is_not_known():
    a = [*toks("G G"), Token(3, ("all_reduce", "f32[8]", ("t.py", 999))), *toks("G G G", start=4)]
    b = toks("G G G G G x*")
    final = {0: True, 1: True}
    p = parting("0", {0: a, 1: b}, final, under_rank_test=lambda r, t: t.key[2] == ("t.py", 999))
    assert p is not None and p.ranks == [0] and p.extra and p.decided
    p = parting("0", {0: a, 1: b}, final)
    assert p is not None and not p.decided and sorted(p.ranks + p.reference) == [0, 1]


def test_both_arms_of_an_if_else_and_joins_shadow_calls_are_not_partings():
    # if rank == 0: broadcast(t, 0) else: broadcast(t, 0) - every call from another line, none extra.
    streams = {0: toks("A " * 12), 1: [Token(q, ("all_reduce", "f32[8]", ("t.py", 2))) for q in range(1, 13)]}
    assert parting("0", streams, {0: False, 1: False}) is None
    assert parting("0", streams, {0: True, 1: True}) is None
    # torch's Join: a rank out of data shadows the others' all_reduces from the join hook's line.
    shadow = [*toks("G G G"), *[Token(q, ("all_reduce", "f32[8]", ("join.py", 1))) for q in range(4, 9)]]
    assert parting("0", {0: toks("G " * 8), 1: shadow, 2: toks("G " * 8)}, {0: False, 1: False, 2: False}) is None


def test_while_the_ranks_run_a_pairing_that_could_be_either_story_is_not_told():
    # Identical calls around the extra one: live, it could be one call from another line; say nothing yet.
    m = Token(3, ("all_reduce", "f32[8]", ("t.py", 999)))
    streams = {0: [*toks("G G"), m, *toks("G G", start=4)], 1: toks("G G G G G"), 2: toks("G G G G G")}
    assert parting("0", streams, {r: False for r in streams}) is None
    # ...but a loop of distinct calls shows the shift while the job still runs.
    extra = Token(3, ("all_reduce", "f32[8]", ("t.py", 999)))
    streams = {0: [*toks("G x*"), extra], 1: toks("G x* G x*"), 2: toks("G x* G x*")}
    assert parting("0", streams, {r: False for r in streams}) is None  # nothing after it yet
    streams[0] = [*toks("G x*"), extra, *toks("G x* G x*", start=4)]
    p = parting("0", streams, {r: False for r in streams})
    assert p is not None and p.ranks == [0] and p.extra and p.calls == [extra]  # the next iteration shows it


def test_a_python_call_among_cpp_issued_ones_is_an_extra_call():
    streams = {r: toks("C C C C C C") for r in (1, 2, 3)}
    streams[0] = toks("C C G C C C")
    p = parting("0", streams, {r: False for r in streams})
    assert p is not None and p.ranks == [0] and p.extra and p.calls[0].seq == 3
    assert all(t.cpp for t in p.paired_with.values())


def test_two_calls_in_swapped_order_are_one_parting():
    streams = {r: toks("G x* G x* G") for r in (0, 1, 2)}
    streams[3] = toks("G x* x* G G")
    p = parting("0", streams, {r: True for r in streams})
    assert p is not None and p.ranks == [3]


def test_align_prefers_one_extra_call_over_a_shifted_substitution_when_the_end_is_known():
    a, b = toks("G G M/M G G G"), toks("G G G G G x*")
    a[2] = Token(3, ("all_reduce", "f32[8]", ("t.py", 999)))
    _, steps = align(a, b, a_final=True, b_final=True)
    assert interior_edits(steps) and steps[2].kind == "only_a"


# -- the recorded incidents: live warnings ------------------------------------------------------------------
def _fixtures():
    from pathlib import Path

    from dtwatch.report.capture import load_fixture

    return [load_fixture(p) for p in sorted((Path(__file__).parent / "incidents").glob("*.json"))]


def test_no_healthy_control_gives_a_silent_desync_warning():
    from dtwatch.diagnose import RecordedEvidence, silent_desyncs

    checked = 0
    for fx in _fixtures():
        if not (fx.truth or {}).get("healthy"):
            continue
        ev = RecordedEvidence(fx.sources, fx.stacks, fx.flight_records, fx.endings)
        assert silent_desyncs(fx.states, fx.now, set(), ev) == [], fx.name
        checked += 1
    assert checked >= 10


def test_an_extra_call_between_distinct_calls_is_warned_of_while_the_job_runs():
    # metric_extra_long's watchdog warned live (kept in the fixture); its stall diagnosis rests on that warning.
    fx = next(f for f in _fixtures() if f.name == "metric_extra_long")
    assert any(w.get("details", {}).get("program_order") and w.get("ranks") == [0] for w in fx.warnings)


def test_a_schedule_deadlock_names_where_a_rank_left_its_role_peers_order():
    from dtwatch.diagnose import diagnose_fixture

    fx = next(f for f in _fixtures() if f.name == "pp_recv_recv")
    f = diagnose_fixture(fx)[0]
    assert f.details["pattern"] == "p2p_deadlock" and f.ranks == [0, 1]
    # Rank 2 runs stage 1 of the other pipeline correctly: rank 0's 6th p2p call is a recv where rank 2 sent.
    assert f.details["role_differences"] == {"0": {"role_peer": 2, "call_index": 5, "made": "recv",
                                                   "role_peer_made": "send"}}
    assert "network" not in f.summary


def test_lint_leads_are_given_only_where_nothing_on_the_path_explains_the_call():
    # lib_log_rank0_sync: the metric's sync is issued inside the trainer; the lint's rank-conditional log is the
    # lead. lib_early_stopping's loop exit explains its stall: the same file's other rank tests are not named.
    from dtwatch.diagnose import diagnose_fixture
    from tests.scenarios.catalog import HERE, marker_line

    fixtures = {f.name: f for f in _fixtures()}
    led = diagnose_fixture(fixtures["lib_log_rank0_sync"])[0]
    logged = marker_line(HERE / "library.py", "log_rank0")
    assert any(h["line"] == logged for h in led.details["lint_hints"]) and "likely cause" in led.summary
    plain = diagnose_fixture(fixtures["lib_early_stopping"])[0]
    assert "lint_hints" not in plain.details and "likely cause" not in plain.summary
