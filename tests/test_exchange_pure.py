"""The cross-node exchange's pure parts: compact states and digests, the aggregator's choice of ranks, the lease.

The recorded incidents (real 4-rank runs) check that what crosses the store keeps every diagnosis as it
was; a simulated 1,024-rank job (``benchmarks/scale_job.py``) and incidents scaled up to 256 ranks check
that the ranks the aggregator ships keep the diagnosis of a job too large to ship whole.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from dtwatch.bundle.file_evidence import FileEvidence
from dtwatch.diagnose import RecordedEvidence, ViewSample, diagnose, diagnose_fixture
from dtwatch.diagnose.rank_state import RankState
from dtwatch.report.capture import load_fixture
from dtwatch.watchdog.aggregate import (
    FULL_VIEW_RANKS,
    MAX_VIEW_RANKS,
    SLOW_FACTOR,
    ViewHead,
    exchange_interval,
    named_ranks,
    select_ranks,
    suspect_after,
    verdict_of,
)
from dtwatch.watchdog.election import Lease, LeaseWatch, claim, renew_period, should_take_over, stale_after
from dtwatch.watchdog.summary import (
    BLOCKED,
    OUTSIDE,
    RankDigest,
    SummaryFormatError,
    decode_digests,
    decode_members,
    decode_states,
    digest,
    encode_members,
    encode_states,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from scale_job import RANKS_PER_NODE, SimJob  # noqa: E402

INCIDENTS = sorted((ROOT / "tests" / "incidents").glob("*.json"))


def _key(findings) -> list[tuple]:
    return [(str(f.kind), f.ranks, f.waiting_ranks, f.op, f.group, f.seq, (f.site or {}).get("line"), f.summary)
            for f in findings]


# -- compact states -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", INCIDENTS, ids=[p.stem for p in INCIDENTS])
def test_compact_states_keep_every_recorded_diagnosis(path: Path) -> None:
    """Each rank as another node sees it (encoded, decoded): the same findings, word for word."""
    fx = load_fixture(path)
    states = [s if isinstance(s, RankState) else RankState.from_dict(s) for s in fx.states]
    expected = _key(diagnose_fixture(fx))
    for remote in range(len(states)):  # one rank's node is this one, the others are remote
        crossed = [s if s.rank == states[remote].rank else decode_states(encode_states("n", [s], fx.now)).states[0]
                   for s in states]
        fx2 = copy.copy(fx)
        fx2.states = crossed
        assert _key(diagnose_fixture(fx2)) == expected, f"{path.stem}, rank {remote} local"


def test_compact_states_are_a_fraction_of_the_full_ones() -> None:
    job = SimJob(128, t0=1000.0)
    states = job.states(5, 1100.0)
    import json
    import zlib

    full = len(zlib.compress(json.dumps([s.to_dict() for s in states]).encode()))
    compact = len(encode_states("node5", states, 1100.0))
    assert compact < full / 2, (compact, full)
    assert len(digest("node5", states, 1100.0)) < 400


def test_compact_states_round_trip_the_fields() -> None:
    job = SimJob(4, t0=1000.0)
    before = job.states(2, 1003.37)
    after = decode_states(encode_states("node2", before, 1003.37)).states
    for a, b in zip(before, after, strict=True):
        da, db = a.to_dict(), b.to_dict()
        for d in (da, db):
            d.pop("ring_path")
        assert _close(da, db)


def _close(a, b) -> bool:
    """Equal, floats within the 1 us the encoding keeps."""
    if isinstance(a, float) or isinstance(b, float):
        assert abs(float(a) - float(b)) <= 2e-6, (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b, strict=True):
            _close(x, y)
    else:
        assert a == b, (a, b)
    return True


def test_decode_only_some_ranks_and_reject_other_formats() -> None:
    job = SimJob(2, t0=1000.0)
    blob = encode_states("node1", job.states(1, 1002.0), 1002.0)
    assert [s.rank for s in decode_states(blob, {9, 12}).states] == [9, 12]
    with pytest.raises(SummaryFormatError):
        decode_states(b"not zlib")
    import json
    import zlib

    with pytest.raises(SummaryFormatError):
        decode_states(zlib.compress(json.dumps({"format": 99}).encode()))


@pytest.mark.parametrize("members", [None, [], [3], list(range(8192)), [0, 2, 4, 6, 9, 10, 11, 40], [5, 1, 1, 7],
                                     list(range(0, 64, 8)) + list(range(100, 104))])
def test_members_as_runs(members) -> None:
    runs = encode_members(members)
    assert decode_members(runs) == members
    if members == list(range(8192)):
        assert runs == [[0, 8192, 1]]


# -- digests ------------------------------------------------------------------------------------------
def test_digest_says_where_each_rank_is() -> None:
    job = SimJob(4, t0=1000.0)
    job.hang(11, 1010.0)  # node 1's rank 3
    now = job.hang_time + 3.0
    nd = decode_digests(digest("node1", job.states(1, now), now, state_time=now - 1))
    assert nd.node == "node1" and nd.state_time == pytest.approx(now - 1)
    by = {d.rank: d for d in nd.ranks}
    assert by[11].state == OUTSIDE and by[11].wait is None
    assert by[8].state == BLOCKED and by[8].wait is not None
    assert by[8].wait[0] == "2" and by[8].wait[3] == "all_gather_into_tensor"
    other = {d.rank: d for d in decode_digests(digest("node0", job.states(0, now), now)).ranks}
    assert other[0].state == BLOCKED and other[0].wait is not None
    assert other[0].wait[:4] == ("0", 32, job.hang_step * 2 + 1, "all_reduce")
    # Ranks of different nodes waiting in the same line of their own tensor-parallel groups share a place.
    assert other[1].position() == other[2].position()
    assert by[11].heartbeat == pytest.approx(now, abs=1e-5) and by[11].last_activity < job.hang_time + 0.1


# -- the aggregator's choice ----------------------------------------------------------------------------
def _digests(job: SimJob, now: float) -> list[RankDigest]:
    return [d for n in range(job.nodes) for d in decode_digests(digest(f"node{n}", job.states(n, now), now)).ranks]


def test_a_small_job_ships_every_rank() -> None:
    job = SimJob(FULL_VIEW_RANKS // RANKS_PER_NODE, t0=1000.0)
    sel = select_ranks(_digests(job, 1020.0), 1020.0, 20.0)
    assert sel.ranks == list(range(FULL_VIEW_RANKS)) and sel.total == FULL_VIEW_RANKS and not sel.suspect


def test_a_large_healthy_job_ships_nothing_and_a_hung_one_ships_the_culprit() -> None:
    job = SimJob(128, t0=1000.0)
    now = 1050.0
    healthy = select_ranks(_digests(job, now), now, 20.0)
    assert healthy.ranks == [] and healthy.total == 1024 and not healthy.suspect and healthy.quiet < 1.0
    job.hang(517, now)
    later = job.hang_time + suspect_after(20.0) + 1.0
    sel = select_ranks(_digests(job, later), later, 20.0)
    assert sel.suspect and sel.blocked == 1023
    assert 517 in sel.ranks and set(range(512, 520)) <= set(sel.ranks)  # the culprit and its node's peers
    assert len(sel.ranks) <= 8 + 32 + 1
    states = [job.rank_state(r, later + 20) for r in sel.ranks]
    findings = diagnose(states, later + 20, 20.0).findings
    assert [(f.kind, f.ranks) for f in findings] == [("stuck_outside_collective", [517])]


def test_named_ranks_and_uneven_loaders_are_shipped_while_healthy() -> None:
    job = SimJob(16, t0=1000.0)
    digests = _digests(job, 1050.0)
    sel = select_ranks(digests, 1050.0, 20.0, named=[77, 5000])
    assert 77 in sel.ranks and 5000 not in sel.ranks and not sel.suspect
    short = [RankDigest(d.rank, d.state, d.wait, d.last_activity, d.heartbeat, d.step,
                        (999,) if d.rank in (3, 90) else d.loaders, d.groups) for d in digests]
    sel = select_ranks(short, 1050.0, 20.0)
    assert {3, 90} <= set(sel.ranks) and len(sel.ranks) > 2


def _place_digests(sizes: list[int]) -> list[RankDigest]:
    out, rank = [], 0
    for i, size in enumerate(sizes):
        for _ in range(size):
            out.append(RankDigest(rank, BLOCKED, ("0", 9999, 10 + i, "all_reduce", "fp", "t.py:1"), 0.0, 0.0, 1, (),
                                  (("0", 9999, 10 + i, 10 + i, 0.0),)))
            rank += 1
    return out


@pytest.mark.parametrize("sizes", [[8000, 150, 30, 5, 1], [4000, 3999], [100] * 99, [9000, 9, 9, 8], [70, 2]])
def test_shipped_places_keep_the_order_of_their_sizes(sizes) -> None:
    digests = _place_digests(sizes)
    sel = select_ranks(digests, 100.0, 20.0)
    assert sel.suspect and len(sel.ranks) <= MAX_VIEW_RANKS
    shipped = []
    start = 0
    for size in sizes:
        shipped.append(len([r for r in sel.ranks if start <= r < start + size]))
        start += size
    assert shipped[0] > 0  # the largest place is always there
    pairs = list(zip(sizes, shipped, strict=True))
    for size_a, got_a in pairs:
        for size_b, got_b in pairs:
            if got_a and got_b and size_a > size_b:
                assert got_a > got_b, (sizes, shipped)  # a majority stays a majority
        if size_a <= 8 and len(sel.ranks) < MAX_VIEW_RANKS:
            assert got_a == size_a  # a small place whole


SCALABLE = ["rc_python", "stuck_python", "uneven_python", "mismatch_shape", "exit_exception", "wedged_sigstop",
            "rc_object_gather", "stuck_object", "exit_segfault", "desync_order_swap"]


def _scaled(fx, world: int) -> tuple[list[RankState], set[int]]:
    """The fixture's job as ``world`` ranks: its culprits keep their numbers, every other rank is a copy of
    one of the fixture's other ranks."""
    culprits = set(fx.truth["ranks"])
    states = {s.rank: s for s in fx.states}
    others = [r for r in sorted(states) if r not in culprits]
    out = []
    for r in range(world):
        src = states[r] if r in culprits else states[others[r % len(others)]]
        d = copy.deepcopy(src.to_dict())
        d.update(rank=r, local_rank=r % RANKS_PER_NODE, host=f"node{r // RANKS_PER_NODE}", pid=10_000 + r)
        for g in d["groups"].values():
            g["members"] = list(range(world))
        out.append(RankState.from_dict(d))
    return out, culprits


@pytest.mark.parametrize("name", SCALABLE)
def test_the_shipped_ranks_keep_the_diagnosis_of_a_large_job(name: str) -> None:
    """A recorded incident scaled to 256 ranks: a node that sees its own ranks and the shipped ones names
    the same culprits, kind and line as one that saw all 256."""
    fx = load_fixture(ROOT / "tests" / "incidents" / f"{name}.json")
    world = 256
    states, culprits = _scaled(fx, world)
    ev = RecordedEvidence(fx.sources, fx.stacks, fx.flight_records, fx.endings)
    full = diagnose(copy.deepcopy(states), fx.now, fx.window, ev, assume_stalled=fx.source == "bundle").findings
    assert full and set(full[0].ranks) == culprits, (name, _key(full))
    digests = [d for n in range(world // RANKS_PER_NODE)
               for d in decode_digests(digest(f"node{n}", states[n * 8:(n + 1) * 8], fx.now)).ranks]
    sel = select_ranks(digests, fx.now, fx.window)
    assert len(sel.ranks) < world / 2
    for node in (0, 17):  # any node: its own ranks and the shipped ones (as decoded from the body)
        mine = {s.rank for s in states[node * 8:(node + 1) * 8]}
        shipped = decode_states(encode_states("view", [s for s in states if s.rank in sel.ranks], fx.now)).states
        view = [copy.deepcopy(s) for s in states if s.rank in mine] + [s for s in shipped if s.rank not in mine]
        got = diagnose(sorted(view, key=lambda s: s.rank), fx.now, fx.window, ev,
                       assume_stalled=fx.source == "bundle").findings
        assert [(str(f.kind), f.ranks, f.op, (f.site or {}).get("line")) for f in got[:1]] == \
            [(str(f.kind), f.ranks, f.op, (f.site or {}).get("line")) for f in full[:1]], (name, node, _key(got))


# -- the view's head, the cadence ---------------------------------------------------------------------
def _hung_job_states(culprit: int = 43) -> tuple[SimJob, list[RankState], float]:
    job = SimJob(16, t0=1000.0)
    job.hang(culprit, 1020.0)
    now = job.hang_time + 11
    return job, [s for n in range(job.nodes) for s in job.states(n, now)], now


def test_a_view_without_the_culprit_blames_none_of_its_peers() -> None:
    """Rank 43 hangs in its DataLoader; its 7 tensor-parallel peers wait for it in an all_gather, every other
    rank in the gradient all_reduce. A view without rank 43's state (not shipped, or not yet) must not name a
    peer that waits for it as the rank that skipped the all_reduce: the chain of waits ends at rank 43, and
    what it does is not known."""
    _job, states, now = _hung_job_states()
    full = diagnose(copy.deepcopy(states), now, 10.0).findings
    assert [(f.kind, f.ranks) for f in full] == [("stuck_outside_collective", [43])]
    view = [s for s in states if s.rank != 43]
    for sample, says in ((None, "was never seen"), (ViewSample(128, 127), "is not in this node's view")):
        got = diagnose(copy.deepcopy(view), now, 10.0, FileEvidence(sample=sample)).findings
        assert [(f.kind, f.ranks, f.op, f.group) for f in got] == \
            [("stalled_collective", [], "all_gather_into_tensor", "6")]
        text = got[0].summary
        assert "ranks 0-39,48-127 wait in all_reduce (group 0, seq 83)" in text
        assert "for ranks 40-42,44-47, which are inside all_gather_into_tensor (group 6, seq 83)" in text
        assert f"rank 43 of the job (world size 128) {says}" in text and "skipped" not in text
        assert got[0].details["unseen_ranks"] == [43]
    # The whole node missing: the all_reduce waits for ranks nobody sees.
    got = diagnose([s for s in states if s.rank // 8 != 5], now, 10.0).findings
    assert [(f.kind, f.ranks, f.op) for f in got] == [("stalled_collective", [], "all_reduce")]
    assert got[0].details["unseen_ranks"] == list(range(40, 48))


def test_a_sampled_view_says_its_waiting_ranks_are_those_of_the_view() -> None:
    """A node of a large job sees its own ranks and the shipped ones: the finding names the culprit and says
    that the waiting ranks it lists are those of its view, with the job-wide count from the digests."""
    _job, states, now = _hung_job_states()
    view = [s for s in states if s.rank < 8 or 40 <= s.rank < 48 or s.rank in (64, 65)]
    got = diagnose(view, now, 10.0, FileEvidence(sample=ViewSample(128, 127))).findings
    assert [(f.kind, f.ranks) for f in got] == [("stuck_outside_collective", [43])]
    assert "ranks 0-7,40-42,44-47,64-65 (of the ranks in this node's view; by every node's digest, 127 of the " \
           "job's 128 ranks are inside a collective) wait" in got[0].summary


def test_a_subgroup_collective_everyone_joined_is_the_stall_not_a_skipped_call() -> None:
    """Every member of group 6 is inside its all_gather (none missing) and the rest of the job waits for them
    in the all_reduce: that collective is not completing. No member skipped the all_reduce: it has not got
    there yet."""
    _job, states, now = _hung_job_states()
    by_rank = {s.rank: s for s in states}
    peer, culprit = by_rank[42], by_rank[43]
    culprit.open_calls, culprit.groups = copy.deepcopy(peer.open_calls), copy.deepcopy(peer.groups)
    culprit.main_site = culprit.main_top_site = peer.main_site
    culprit.main_stack, culprit.main_site_since = peer.main_stack, peer.main_site_since
    got = diagnose(states, now, 10.0).findings
    assert [(f.kind, f.ranks, f.op, f.group, f.seq) for f in got] == \
        [("stalled_collective", [], "all_gather_into_tensor", "6", 83)]
    assert "every member of group 6 has joined that call and none is missing" in got[0].summary
    assert got[0].waiting_ranks == list(range(128))  # every rank is blocked, none deviates
    assert got[0].details["blocked_behind"]["op"] == "all_reduce"


def test_head_round_trip_and_verdict() -> None:
    from dtwatch.diagnose import Finding

    f = Finding(kind="rank_conditional", severity="stall", ranks=[0], summary="rank 0 is in all_reduce",
                waiting_ranks=list(range(1, 100)))
    verdict = verdict_of({"id": "inc-1", "verdict": "stall", "findings": [f]})
    assert verdict == {"incident": "inc-1", "kind": "stall", "findings": [
        {"kind": "rank_conditional", "ranks": [0], "waiting_ranks": list(range(1, 17)),
         "summary": "rank 0 is in all_reduce"}]}
    assert verdict_of(None) is None
    head = ViewHead(aggregator="a", term=2, seq=7, time=1.5, nodes=3, ranks=24, suspect=True, quiet=6.0, blocked=23,
                    want=[1, 2], body=4, body_ranks=[0, 5], verdict=verdict)
    assert ViewHead.decode(head.encode()) == head
    assert named_ranks([f.to_dict()]) == [0, 1, 2, 3, 4]
    # A head of an older dtwatch (no "pending") decodes with nothing pending.
    old = {k: v for k, v in json.loads(head.encode()).items() if k != "pending"}
    assert ViewHead.decode(json.dumps(old).encode()).pending == []


def test_a_view_settles_on_the_ranks_it_lacks_but_not_on_the_nodes_own() -> None:
    """The head lists the chosen ranks the body does not hold yet: a node waits for them (at most
    SETTLE_INTERVALS exchange intervals) before it opens a stall, but not for its own ranks, which it reads
    directly."""
    from dtwatch.watchdog.exchange import SETTLE_INTERVALS, Exchange

    job = SimJob(16, t0=1000.0)
    ex = Exchange("127.0.0.1", 1, "job", "node1", interval=2.0)  # no store is reached: only the head is set
    local = job.states(1, 1010.0)
    head = ViewHead(aggregator="a", term=1, seq=1, time=1010.0, nodes=16, ranks=128, suspect=True, quiet=6.0,
                    blocked=127, want=[1, 5], body=1, body_ranks=[0, 43], pending=[8, 9])
    ex.head = head
    ex._track_pending(1010.0, local)
    assert not ex.settling(1010.0)  # ranks 8 and 9 are this node's own
    ex.head = ViewHead(**{**head.__dict__, "pending": [8, 40]})
    ex._track_pending(1010.0, local)
    ex._track_pending(1012.0, local)  # still pending: the clock keeps its start
    assert ex.settling(1012.0) and ex.settling(1010.0 + SETTLE_INTERVALS * 2.0 - 0.1)
    assert not ex.settling(1010.0 + SETTLE_INTERVALS * 2.0)  # waited long enough: taken as it is
    ex.head = ViewHead(**{**head.__dict__, "pending": []})
    ex._track_pending(1013.0, local)
    assert not ex.settling(1013.0)


def test_exchange_interval() -> None:
    assert exchange_interval(2.0, busy=True) == 2.0
    assert exchange_interval(2.0, busy=False) == 2.0 * SLOW_FACTOR
    assert suspect_after(100.0) == 5.0 and suspect_after(8.0) == 2.0


# -- the lease ------------------------------------------------------------------------------------------
def test_lease_codec_and_claims() -> None:
    lease = Lease("node|7", 3, 12)
    assert Lease.decode(lease.encode()) == lease and Lease.decode(lease.encode().encode()) == lease
    assert Lease.decode("") is None and Lease.decode("x|y|z") is None
    assert lease.renewed() == Lease("node|7", 3, 13)
    assert claim(None, "a") == Lease("a", 1, 0) and claim(lease, "b") == Lease("b", 4, 0)


def test_a_follower_takes_over_only_after_the_lease_stood_still() -> None:
    interval = 2.0
    assert stale_after(interval) >= 4 * renew_period(interval)
    watch = LeaseWatch()
    lease = Lease("agg", 1, 5)
    assert watch.observe(lease.encode().encode(), 100.0) == 0.0
    assert not should_take_over(lease, "me", watch.observe(lease.encode().encode(), 101.0), interval)
    # renewed in between: the clock starts again
    assert watch.observe(lease.renewed().encode().encode(), 102.0) == 0.0
    unchanged = watch.observe(lease.renewed().encode().encode(), 102.0 + stale_after(interval))
    assert should_take_over(lease.renewed(), "me", unchanged, interval)
    assert should_take_over(None, "me", 0.0, interval)  # released or never held
    assert should_take_over(Lease("me", 1, 0), "me", 0.0, interval)  # an earlier run of this node
    # Worst case for a follower that looks every `interval`: the lease stops just after a look; two looks later
    # it has stood still for a full interval.
    assert stale_after(interval) <= interval


def test_states_passed_on_encode_to_the_same_bytes() -> None:
    """The aggregator writes the view's body again only when it changed: ranks read from a node's state (encoded
    against that node's clock) and encoded again against another base give the same bytes, heartbeats aside."""
    job = SimJob(2, t0=1000.123456789)
    job.hang(12, 1002.0)
    once = decode_states(encode_states("node1", job.states(1, 1005.987654321), 1005.987654321)).states
    later = decode_states(encode_states("node1", job.states(1, 1009.1234567), 1009.1234567)).states
    body = encode_states("view", once, 3600.0, heartbeats=False)
    assert encode_states("view", later, 3600.0, heartbeats=False) == body
    assert all(s.heartbeat_time == 0.0 for s in decode_states(body).states)
