"""The words of findings the recorded incidents do not reach: each says only what its facts hold (pure)."""
from __future__ import annotations

from dtwatch.diagnose.rank_state import Call
from dtwatch.diagnose.wording.compare_words import waits_behind_summary
from dtwatch.diagnose.wording.loops_words import past_the_loop_summary
from dtwatch.diagnose.wording.order_words import seen_earlier_summary


def _fmt(site: dict | None) -> str:
    return f"{site['file']}:{site['line']}" if site else "<unknown line>"


_TRAIN = {"file": "train.py", "line": 40, "function": "main"}
_MODEL = {"file": "model.py", "line": 12, "function": "forward"}


def _call(op: str, group: str, seq: int) -> Call:
    return Call(op, group, seq, _TRAIN, 1.0)


def test_ranks_waited_for_are_placed_in_the_stalled_call_only_where_they_are_in_it():
    some = waits_behind_summary([0, 1], _call("all_reduce", "0", 9), _TRAIN, [2, 3], [2],
                                _call("all_gather", "1", 4), _MODEL, [], False, "", _fmt)
    assert "for ranks 2-3; rank 2 is inside all_gather" in some
    assert "which" not in some.split(";")[0]  # rank 3 is not said to be inside it
    every = waits_behind_summary([0, 1], _call("all_reduce", "0", 9), _TRAIN, [2, 3], [2, 3],
                                 _call("all_gather", "1", 4), _MODEL, [], False, "", _fmt)
    assert "for ranks 2-3, which are inside all_gather" in every
    one = waits_behind_summary([0], _call("all_reduce", "0", 9), _TRAIN, [1], [1], _call("barrier", "1", 2),
                               _MODEL, [], False, "", _fmt)
    assert "for rank 1, which is inside barrier" in one


def test_a_desync_seen_earlier_is_given_a_time_only_where_one_was_recorded():
    earlier = "group 0 seq 8: rank 0 issued all_reduce, while rank 1 issued all_gather and their results are mixed."
    timed = seen_earlier_summary(earlier, "10:42:07")
    assert "this was seen at 10:42:07 while the job ran" in timed and "results are mixed" not in timed
    untimed = seen_earlier_summary(earlier, None)
    assert "this was seen while the job ran" in untimed and " at " not in untimed.split("this was seen")[1][:5]


def test_calls_counted_at_an_unknown_line_are_not_given_a_line_number():
    kwargs = dict(loop_site=_TRAIN, call=_call("barrier", "0", 20), post_loop_site=_MODEL,
                  inside_call=_call("all_reduce", "0", 19), calls_at_line={0: 5, 1: 4}, deviant=[1], fmt=_fmt)
    known = past_the_loop_summary([1], [0], inside_site=_MODEL, **kwargs)
    assert "the call at line 12 was issued 4 times by rank 1, 5 times by rank 0" in known
    unknown = past_the_loop_summary([1], [0], inside_site=None, **kwargs)
    assert "that call was issued 4 times by rank 1" in unknown and "line ?" not in unknown


def test_a_damaged_dump_names_the_type_found_with_its_article():
    from dtwatch.diagnose.wording.dump_words import dump_fault, entry_fault

    assert entry_fault(0, "not_a_dict", found="int") == "entry 0 is an int, not a dict"
    assert dump_fault("entries_not_a_list", found="dict") == "its entries are a dict, not a list"


def test_what_a_finding_adds_later_joins_its_sentence():
    """Where the call went on without the rank (sync points) and the lint's leads (hints) are parts of the
    finding's one sentence, never a second sentence starting in lower case."""
    import re
    from pathlib import Path

    from dtwatch.diagnose import diagnose_fixture
    from dtwatch.report.capture import load_fixture

    joined = 0
    for path in sorted((Path(__file__).parent / "incidents").glob("*.json")):
        for f in diagnose_fixture(load_fixture(path)):
            text = re.sub(r"`[^`]*`", "``", f.summary).replace("e.g. ", "")
            assert not re.search(r"\. [a-z]", text), f"{path.stem}: {f.summary}"
            joined += "; the collective was issued by a library" in text or "was issued asynchronously" in text
    assert joined >= 3  # the recorded incidents reach both additions


def test_a_collective_every_member_joined_names_no_cause_it_cannot_see():
    from dtwatch.diagnose.wording.compare_words import stalled_summary

    text = stalled_summary(_call("all_reduce", "0", 9), _TRAIN, [0, 1], "are in", [], False, "", _fmt)
    assert "all ranks are inside all_reduce" in text and "the collective itself is not completing" in text
    assert "is not in the ranks' records" in text  # the network or transport is a candidate, never the finding
    behind = waits_behind_summary([0], _call("all_reduce", "0", 9), _TRAIN, [1], [1], _call("barrier", "1", 2),
                                  _MODEL, [], False, "", _fmt)
    assert "and the others wait behind it; what holds it" in behind and "is not in the ranks' records" in behind
