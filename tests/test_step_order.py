"""Program order by optimizer step (dtwatch.diagnose.step_order) on hand-built call streams: pure, no torch jobs.

The rule names a call only some ranks make in a step every rank finished. Each case where it must speak has
counter-cases where the calls per step also differ, or seem to, and it must stay silent."""
from __future__ import annotations

from dtwatch.diagnose.align import CPP_KEY, Token
from dtwatch.diagnose.rank_state import Call
from dtwatch.diagnose.step_order import step_parting

TRAIN, EVAL, SHADOW, ARM_A, ARM_B, SAVE = 110, 118, 140, 150, 152, 160


def program(*steps: list[int], start_step: int = 0, first_seq: int = 1) -> list[Token]:
    """One rank's stream: a list of lines per step (each an all_reduce of one shape); 0 is a number issued from
    C++ without a record."""
    out, seq = [], first_seq
    for k, lines in enumerate(steps, start=start_step):
        for line in lines:
            if line == 0:
                out.append(Token(seq, CPP_KEY))
            else:
                site = {"file": "train.py", "line": line}
                call = Call("all_reduce", "0", seq, site, float(seq), float(seq) + 0.1, fingerprint="f32[8,16]",
                            user_site=site, step=k)
                out.append(Token(seq, ("all_reduce", "f32[8,16]", ("train.py", line)), call))
            seq += 1
    return out


def test_an_extra_call_every_step_under_a_rank_test_is_named_with_its_step():
    # Rank 0 evaluates after every step; the shifted pairing leaves no call over, so only the steps tell.
    rank0 = program([TRAIN], *[[EVAL, TRAIN]] * 5, [EVAL, TRAIN])
    rank1 = program(*[[TRAIN]] * 12)
    p = step_parting("0", {0: rank0, 1: rank1}, {0: 6, 1: 12}, under_rank_test=lambda r, t: t.key[2][1] == EVAL)
    assert p is not None and p.ranks == [0] and p.reference == [1] and p.extra and p.decided
    assert p.step == 1 and p.step_calls == {"0": 2, "1": 1}
    assert [t.seq for t in p.calls] == [2] and p.calls[0].key[2] == ("train.py", EVAL)
    assert p.paired_with[1].key[2] == ("train.py", TRAIN)  # what the backend paired it with: rank 1's next step


def test_two_equal_sides_without_a_rank_test_are_not_decided():
    rank0 = program([TRAIN], [EVAL, TRAIN], [EVAL, TRAIN])
    rank1 = program(*[[TRAIN]] * 5)
    p = step_parting("0", {0: rank0, 1: rank1}, {0: 2, 1: 5})
    assert p is not None and not p.decided and p.ranks == [0]


def test_a_call_most_ranks_make_and_one_skips_names_the_skipper():
    made = program(*[[TRAIN, EVAL]] * 4)
    p = step_parting("0", {0: program(*[[TRAIN]] * 6), 1: made, 2: made}, {0: 6, 1: 4, 2: 4})
    assert p is not None and p.ranks == [0] and p.reference == [1, 2] and not p.extra and p.decided
    assert p.calls[0].key[2] == ("train.py", EVAL)


def test_joins_shadow_calls_from_a_rank_that_stopped_stepping_are_not_compared():
    # torch's Join: rank 1 ran out of data after 3 steps and shadows the others' all-reduces from its join hook,
    # at its step 3, which it never finishes.
    rank0 = program(*[[TRAIN]] * 6)
    rank1 = program(*[[TRAIN]] * 3, [SHADOW, SHADOW, SHADOW])
    assert step_parting("0", {0: rank0, 1: rank1}, {0: 6, 1: 3}) is None


def test_both_arms_of_an_if_else_are_one_call_each_step():
    rank0 = program(*[[ARM_A, TRAIN]] * 4)
    rank1 = program(*[[ARM_B, TRAIN]] * 4)
    assert step_parting("0", {0: rank0, 1: rank1}, {0: 4, 1: 4}) is None


def test_a_thread_racing_the_step_counter_is_not_an_extra_call():
    # An asynchronous save issues its calls from a thread: on rank 0 they land before the step counter moves,
    # on rank 1 after. Per step the counts differ, but each side makes the same calls.
    rank0 = program([TRAIN], [TRAIN, SAVE, SAVE], [TRAIN], [TRAIN])
    rank1 = program([TRAIN], [TRAIN], [SAVE, SAVE, TRAIN], [TRAIN])
    assert step_parting("0", {0: rank0, 1: rank1}, {0: 4, 1: 4}) is None
    # And calls whose steps go back down (a thread that read the counter late) make the steps say nothing.
    racing = program([TRAIN], [TRAIN], [TRAIN])
    racing.insert(2, Token(3, ("all_reduce", "f32[8,16]", ("train.py", SAVE)),
                           Call("all_reduce", "0", 3, None, 3.0, step=0)))
    assert step_parting("0", {0: racing, 1: program([TRAIN], [TRAIN], [TRAIN])}, {0: 3, 1: 3}) is None


def test_a_step_not_finished_everywhere_is_not_compared():
    # Rank 0 is inside step 2, where it has made one call so far and rank 1 two.
    rank0 = program([TRAIN, EVAL], [TRAIN, EVAL], [TRAIN])
    rank1 = program([TRAIN, EVAL], [TRAIN, EVAL], [TRAIN, EVAL])
    assert step_parting("0", {0: rank0, 1: rank1}, {0: 2, 1: 3}) is None


def test_a_step_with_a_number_issued_from_cpp_without_a_record_is_not_compared():
    # DDP's gradient all-reduces are C++-issued: in a step holding one, what else the rank made is not known.
    rank0 = program([TRAIN, 0], [TRAIN, 0, EVAL], [TRAIN, 0])
    rank1 = program([TRAIN, 0], [TRAIN, 0], [TRAIN, 0], [TRAIN, 0])
    assert step_parting("0", {0: rank0, 1: rank1}, {0: 3, 1: 4}) is None


def test_a_step_whose_start_left_the_records_is_not_compared():
    # The history begins inside step 4 (rank 1's ring kept one call more than rank 0's): what rank 0 made in step
    # 4 before its oldest record is not known, so the first step compared is 5.
    rank0 = program([TRAIN], [TRAIN], [TRAIN], start_step=4, first_seq=40)
    rank1 = program([SAVE, TRAIN], [TRAIN], [TRAIN], start_step=4, first_seq=39)
    assert step_parting("0", {0: rank0, 1: rank1}, {0: 7, 1: 7}) is None


def test_a_skipped_iteration_of_the_same_loop_is_left_to_the_loop_rules():
    # Rank 1 skipped the backward of one batch (`continue` on a bad loss) after its forward's all_reduce: in that
    # step it made the forward's call twice. The extra call is one rank 0 makes too: not this rule's to tell.
    rank0 = program(*[[TRAIN]] * 5)
    rank1 = program([TRAIN], [TRAIN, TRAIN], [TRAIN], [TRAIN])
    assert step_parting("0", {0: rank0, 1: rank1}, {0: 5, 1: 4}) is None
