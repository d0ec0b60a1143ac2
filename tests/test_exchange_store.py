"""The cross-node exchange against a real c10d TCPStore, in one process: several nodes' :class:`Exchange`
objects, each with its own connection, on the real clock (short intervals), with simulated rank states
(``benchmarks/scale_job.py``). What runs in the watchdog, minus the rings."""
from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from dtwatch.diagnose import diagnose
from dtwatch.watchdog.aggregate import FULL_VIEW_RANKS
from dtwatch.watchdog.election import Lease, stale_after
from dtwatch.watchdog.exchange import AGGREGATOR, FOLLOWER, Exchange
from tests.harness import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from scale_job import RANKS_PER_NODE, SimJob

INTERVAL = 0.5


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server


def _nodes(store, job: SimJob, job_id: str) -> list[Exchange]:
    return [Exchange("127.0.0.1", store.port, job_id, f"node{n}", interval=INTERVAL, timeout=5.0)
            for n in range(job.nodes)]


def _round(exchanges: list[Exchange], job: SimJob, views: dict, *, skip: frozenset[int] = frozenset(),
           window: float = 30.0) -> None:
    for n, ex in enumerate(exchanges):
        if n in skip:
            continue
        now = time.time()
        view = ex.step(job.states(n, now), now, window=window)
        if view is not None:
            views[n] = view


def _run(exchanges, job, seconds: float, views: dict | None = None, **kw) -> dict:
    views = {} if views is None else views
    end = time.time() + seconds
    while time.time() < end:
        _round(exchanges, job, views, **kw)
        time.sleep(0.05)
    return views


def _close(exchanges) -> None:
    for ex in exchanges:
        ex.close()


def test_a_small_job_every_node_sees_every_other_rank_with_few_requests(store):
    job = SimJob(3, period=0.2, t0=time.time() - 5)
    exchanges = _nodes(store, job, "small")
    try:
        views = _run(exchanges, job, 3 * INTERVAL)
        roles = [ex.role for ex in exchanges]
        assert roles.count(AGGREGATOR) == 1, roles
        for n, ex in enumerate(exchanges):
            mine = set(range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE))
            remote = {s.rank for s in views[n].remote_states()}
            assert remote == set(range(job.world)) - mine, (n, ex.role, sorted(remote))
        # Requests per exchange, measured over further exchanges.
        before = [(ex.stats.requests, ex.last) for ex in exchanges]
        counts = [0] * len(exchanges)
        end = time.time() + 4 * INTERVAL
        while time.time() < end:
            for n, ex in enumerate(exchanges):
                last = ex.last
                now = time.time()
                ex.step(job.states(n, now), now, window=30.0)
                counts[n] += ex.last != last
            time.sleep(0.05)
        for n, ex in enumerate(exchanges):
            per = (ex.stats.requests - before[n][0]) / max(counts[n], 1)
            assert counts[n] >= 2
            limit = 3 if ex.role == FOLLOWER else 8  # aggregator: + nodes, lease, digests, states, view
            assert per <= limit, (ex.role, per)
    finally:
        _close(exchanges)


def test_a_large_job_ships_ranks_only_once_it_stands_still(store):
    job = SimJob(FULL_VIEW_RANKS // RANKS_PER_NODE + 2, period=0.2, t0=time.time() - 5)
    exchanges = _nodes(store, job, "large")
    window = 3.0
    try:
        views = _run(exchanges, job, 3 * INTERVAL, window=window)
        agg = next(n for n, ex in enumerate(exchanges) if ex.role == AGGREGATOR)
        follower = next(n for n in range(job.nodes) if n != agg)
        head = views[follower].head
        assert head is not None and head.ranks == job.world and head.want == [] and head.body_ranks == []
        assert views[follower].remote_states() == []
        sent = exchanges[follower].stats.bytes_out
        _run(exchanges, job, 2 * INTERVAL, views, window=window)
        # While healthy a follower sends its digest only (a few hundred bytes an exchange).
        assert exchanges[follower].stats.bytes_out - sent < 6 * 600
        culprit = (job.nodes - 1) * RANKS_PER_NODE + 5
        job.hang(culprit, time.time())
        _run(exchanges, job, job.hang_time - time.time() + window + 3 * INTERVAL, views, window=window)
        head = views[follower].head
        assert head is not None and head.suspect and culprit in head.body_ranks
        assert head.want is not None and job.nodes - 1 in head.want
        assert len(head.body_ranks) < job.world
        now = time.time()
        states = job.states(follower, now) + views[follower].remote_states()
        findings = diagnose(sorted(states, key=lambda s: s.rank), now, window).findings
        assert [(f.kind, f.ranks) for f in findings] == [("stuck_outside_collective", [culprit])]
        # The remote ranks' heartbeats come with the head: fresh, though the body (a hung job's) stays the same.
        assert all(now - s.heartbeat_time < 3 * INTERVAL for s in views[follower].remote_states())
        body, received = head.body, exchanges[follower].stats.bytes_in
        _run(exchanges, job, 3 * INTERVAL, views, window=window)
        assert views[follower].head is not None and views[follower].head.body == body
        assert exchanges[follower].stats.bytes_in - received < 8 * 2500  # heads only
    finally:
        _close(exchanges)


@pytest.mark.timing  # its bound is in rounds, timed by the wall clock of rounds run in this process: never beside
# the loaded-machine tests (in CI, while the timing session ran, it took 3.9 s for a 3.25 s bound)
def test_a_hung_large_job_ships_only_states_published_since_it_was_asked(store):
    """Every node publishes its state once at its start, before the first head says the view does not want it.
    Once the job hangs, the aggregator must not ship those old states (the ranks where they were back then): it
    ships a node's state only when published with its latest digest, lists the chosen ranks it does not hold
    yet as pending (a watchdog waits for them before it opens an incident), and a node asked for its state
    publishes it as soon as it reads the head."""
    job = SimJob(FULL_VIEW_RANKS // RANKS_PER_NODE + 2, period=0.2, t0=time.time() - 5)
    exchanges = _nodes(store, job, "fresh")
    window = 3.0
    try:
        _run(exchanges, job, 6 * INTERVAL, window=window)  # the start-up states are seconds old now
        agg = next(ex for ex in exchanges if ex.role == AGGREGATOR)
        culprit = (job.nodes - 1) * RANKS_PER_NODE + 5
        job.hang(culprit, time.time())
        pending_seen, complete = False, None
        end = job.hang_time + window + 4 * INTERVAL
        while time.time() < end:
            views: dict = {}
            _round(exchanges, job, views, window=window)
            for view in views.values():
                head = view.head
                if head is None or not head.body_ranks:
                    continue
                shipped = {s.rank: s for s in view.remote_states()} if view.states is None else \
                    {s.rank: s for s in view.states}
                # Every state shipped after the hang was taken after it: in the step the job hangs in.
                stale = sorted(r for r, s in shipped.items() if s.step < job.hang_step)
                assert not stale, f"states from before the hang shipped: ranks {stale}"
                pending_seen |= bool(head.pending)
                if culprit in head.body_ranks and not head.pending and complete is None:
                    complete = time.time()
            time.sleep(0.05)
        assert complete is not None, "the view never held the hung rank with nothing pending"
        assert agg.head is not None and not agg.head.pending and not agg.settling(time.time())
        # hang -> suspect (window / 4) -> head asks -> the node answers at once -> the next round ships it
        assert complete - job.hang_time < window / 4 + 3 * INTERVAL + 1.0
        assert pending_seen or complete - job.hang_time < window / 4 + INTERVAL
    finally:
        _close(exchanges)


def test_a_follower_takes_over_within_two_intervals_when_the_aggregator_stops(store):
    job = SimJob(3, period=0.2, t0=time.time() - 5)
    exchanges = _nodes(store, job, "takeover")
    try:
        views = _run(exchanges, job, 2 * INTERVAL)
        old = next(n for n, ex in enumerate(exchanges) if ex.role == AGGREGATOR)
        beat = exchanges[old].heartbeat
        assert beat is not None
        term = beat.lease.term
        beat.stop.set()  # the aggregator's watchdog stops: no renewal, no release
        stopped = time.time()
        taken = None
        while time.time() - stopped < 4 * INTERVAL + stale_after(INTERVAL):
            _round(exchanges, job, views, skip=frozenset({old}))
            if taken is None and any(ex.role == AGGREGATOR for n, ex in enumerate(exchanges) if n != old):
                taken = time.time() - stopped
            time.sleep(0.05)
        assert taken is not None and taken <= 2 * INTERVAL + 0.3, taken
        new = [n for n, ex in enumerate(exchanges) if n != old and ex.role == AGGREGATOR]
        assert len(new) == 1
        lease = Lease.decode(store.get("dtwatch/takeover/x1/lease"))
        assert lease is not None and lease.holder == f"node{new[0]}" and lease.term == term + 1
        # The new aggregator publishes the view; the third node follows it.
        third = next(n for n in range(3) if n not in (old, new[0]))
        assert views[third].head is not None and views[third].head.aggregator == f"node{new[0]}"
        assert {s.rank for s in views[third].remote_states()} == set(range(job.world)) - set(
            range(third * RANKS_PER_NODE, (third + 1) * RANKS_PER_NODE))
        # The old one comes back (it was only paused): it finds the lease taken and follows.
        _run(exchanges, job, 2 * INTERVAL, views)
        assert exchanges[old].role == FOLLOWER
        assert [ex.role for ex in exchanges].count(AGGREGATOR) == 1
    finally:
        _close(exchanges)


def test_a_clean_exit_hands_the_lease_over_at_once(store):
    job = SimJob(2, period=0.2, t0=time.time() - 5)
    exchanges = _nodes(store, job, "handover")
    try:
        views = _run(exchanges, job, 2 * INTERVAL)
        old = next(n for n, ex in enumerate(exchanges) if ex.role == AGGREGATOR)
        exchanges[old].close()
        other = 1 - old
        _run(exchanges, job, INTERVAL + 0.2, views, skip=frozenset({old}))
        assert exchanges[other].role == AGGREGATOR
    finally:
        _close(exchanges)


def test_serve_a_separate_store_for_the_exchange():
    port = free_port()
    job = SimJob(2, period=0.2, t0=time.time() - 5)
    host = Exchange("127.0.0.1", port, "served", "node0", interval=INTERVAL, serve=True)
    guest = Exchange("127.0.0.1", port, "served", "node1", interval=INTERVAL)
    try:
        views = _run([host, guest], job, 2 * INTERVAL)
        assert {s.rank for s in views[1].remote_states()} == set(range(RANKS_PER_NODE))
        # A second server on the same port cannot start: one warning, and it uses the store found there.
        third = Exchange("127.0.0.1", port, "served", "node2", interval=INTERVAL, serve=True)
        assert third._server is None
    finally:
        _close([host, guest])


def test_an_unreachable_store_raises_and_the_next_exchange_starts_over():
    job = SimJob(2, period=0.2, t0=time.time() - 5)
    ex = Exchange("127.0.0.1", free_port(), "nowhere", "node0", interval=INTERVAL, timeout=1.0)
    now = time.time()
    with pytest.raises(Exception):  # noqa: B017 - torch's own error type for a refused connection
        ex.step(job.states(0, now), now, window=30.0)
    assert ex.index is None and ex.role == FOLLOWER
