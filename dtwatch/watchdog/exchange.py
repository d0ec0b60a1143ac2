"""Cross-node exchange through a c10d store, with a load that grows linearly with the number of nodes.

The store is the job's own TCPStore (no new infrastructure) or, with ``--store`` pointing elsewhere, a
separate one (``--serve-store`` makes the watchdog on that host serve it), so that dtwatch's traffic
can be moved off the store the job depends on. Keys live under ``dtwatch/<job>/x1/``.

Each exchange, every node:

1. publishes its *digest* (where its ranks are, in a few numbers) and, when the view asks for it, its
   *state* (what the diagnosis reads of a remote rank) - one ``multi_set``, see :mod:`.summary`;
2. reads the lease and the view's head - one ``multi_get``, see :mod:`.election` and :mod:`.aggregate` -
   and the view's body (ranks' states) only when it changed.

One node holds the lease and aggregates: it reads every digest in batches (``multi_get``), decides which
ranks the nodes need (:func:`~dtwatch.watchdog.aggregate.select_ranks`), reads the states of those ranks'
nodes and publishes the head and the body. Per exchange round that is about ``2N + N/batch`` requests
for N nodes (each node used to read every other node's key, ``4N`` requests per node). torch is imported
only when a store is used (single-node jobs never need one).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from dtwatch.diagnose.rank_state import RankState
from dtwatch.watchdog.aggregate import (
    FULL_VIEW_RANKS,
    ViewHead,
    exchange_interval,
    named_ranks,
    select_ranks,
    verdict_of,
)
from dtwatch.watchdog.election import Lease, LeaseWatch, claim, renew_period, should_take_over
from dtwatch.watchdog.summary import (
    NodeDigest,
    RankDigest,
    SummaryFormatError,
    decode_digests,
    decode_states,
    digest,
    encode_states,
)

log = logging.getLogger("dtwatch")

BATCH = 256  # keys per multi_get
SETTLE_INTERVALS = 3  # how long a view that lacks chosen ranks is waited for, in exchange intervals
AGGREGATOR, FOLLOWER = "aggregator", "follower"


@dataclass
class StoreStats:
    requests: int = 0
    bytes_out: int = 0
    bytes_in: int = 0


class StoreClient:
    """A c10d TCPStore client that counts the requests it makes and the bytes it moves."""

    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.stats = StoreStats()
        self._store: Any = None

    def _s(self) -> Any:
        if self._store is None:
            from torch.distributed import TCPStore

            self._store = TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout),
                                   wait_for_workers=False)
        return self._store

    def connect(self) -> None:
        self._s()

    def set(self, key: str, value: bytes) -> None:
        self._s().set(key, value)
        self.stats.requests += 1
        self.stats.bytes_out += len(value)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        store = self._s()
        try:
            store.multi_set(list(keys), list(values))
            self.stats.requests += 1
        except (AttributeError, NotImplementedError):  # a store without the batched calls (torch < 2.1)
            for k, v in zip(keys, values, strict=True):
                store.set(k, v)
            self.stats.requests += len(keys)
        self.stats.bytes_out += sum(len(v) for v in values)

    def get(self, key: str) -> bytes:
        value = bytes(self._s().get(key))
        self.stats.requests += 1
        self.stats.bytes_in += len(value)
        return value

    def multi_get(self, keys: Sequence[str], batch: int = BATCH) -> list[bytes]:
        """Values of existing keys (a missing key would block until the timeout), ``batch`` keys a request."""
        store = self._s()
        out: list[bytes] = []
        for i in range(0, len(keys), batch):
            chunk = list(keys[i:i + batch])
            try:
                values = [bytes(v) for v in store.multi_get(chunk)]
                self.stats.requests += 1
            except (AttributeError, NotImplementedError):
                values = [bytes(store.get(k)) for k in chunk]
                self.stats.requests += len(chunk)
            self.stats.bytes_in += sum(len(v) for v in values)
            out.extend(values)
        return out

    def add(self, key: str, amount: int) -> int:
        self.stats.requests += 1
        return int(self._s().add(key, amount))

    def check(self, keys: Sequence[str]) -> bool:
        self.stats.requests += 1
        return bool(self._s().check(list(keys)))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value = bytes(self._s().compare_set(key, expected, desired))
        self.stats.requests += 1
        self.stats.bytes_out += len(desired)
        self.stats.bytes_in += len(value)
        return value


def serve_store(host: str, port: int) -> Any | None:
    """Serve a TCPStore for dtwatch's own traffic on ``port`` (``--serve-store``); None if it cannot."""
    from torch.distributed import TCPStore

    try:
        server = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    except Exception as exc:  # noqa: BLE001 - port taken (another node serves it) or not bindable
        log.warning("dtwatch: cannot serve the exchange store on port %s (%s); using the store found there", port, exc)
        return None
    log.info("dtwatch: serving the exchange store on port %s", port)
    return server


@dataclass
class View:
    """What one exchange brought: the head of the job's view and the remote ranks' states."""

    head: ViewHead | None
    body: bytes | None = None  # encoded states (a follower decodes them only when asked)
    exclude: set[int] = field(default_factory=set)  # this node's ranks
    states: list[RankState] | None = None

    def remote_states(self) -> list[RankState]:
        if self.states is None:
            self.states = [] if not self.body else \
                [s for s in decode_states(self.body).states if s.rank not in self.exclude]
            beats = dict(zip(self.head.body_ranks, self.head.beats, strict=False)) if self.head is not None else {}
            for s in self.states:
                s.heartbeat_time = beats.get(s.rank, s.heartbeat_time)
        return self.states


class _Heartbeat(threading.Thread):
    """The holder's lease renewals, on their own connection and thread: a slow poll (py-spy, a large
    diagnosis) must not let the lease lapse."""

    def __init__(self, client: StoreClient, key: str, lease: Lease, period: float) -> None:
        super().__init__(name="dtwatch-lease", daemon=True)
        self.client, self.key, self.lease, self.period = client, key, lease, period
        self.stop = threading.Event()
        self.lost = False

    def run(self) -> None:
        while not self.stop.wait(self.period):
            nxt = self.lease.renewed()
            try:
                got = self.client.compare_set(self.key, self.lease.encode(), nxt.encode())
            except Exception as exc:  # noqa: BLE001 - unreachable store: the others cannot see it either
                log.debug("dtwatch: lease renewal failed: %r", exc)
                continue
            if got != nxt.encode().encode():
                self.lost = True
                return
            self.lease = nxt

    def release(self) -> None:
        """Stop renewing and hand the lease back (another node claims it at its next exchange)."""
        self.stop.set()
        self.join(timeout=2 * self.period + 1)
        if not self.lost:
            try:
                self.client.compare_set(self.key, self.lease.encode(), "")
            except Exception:  # noqa: BLE001
                pass


class Exchange:
    """This node's side of the exchange; :meth:`step` once per watchdog poll."""

    def __init__(self, host: str, port: int, job_id: str, node: str, *, interval: float = 2.0, serve: bool = False,
                 timeout: float = 5.0, batch: int = BATCH, full_view: int = FULL_VIEW_RANKS) -> None:
        self.host, self.port, self.job_id, self.node = host, port, job_id, node
        self.interval, self.timeout, self.batch, self.full_view = interval, timeout, batch, full_view
        self.prefix = f"dtwatch/{job_id}/x1"
        self.client = StoreClient(host, port, timeout)
        self._server = serve_store(host, port) if serve else None
        self.role = FOLLOWER
        self.index: int | None = None
        self.head: ViewHead | None = None
        self.last = float("-inf")  # when this node last exchanged (published)
        self.last_read = float("-inf")  # when it last read the view
        self.lease_watch = LeaseWatch()
        self.view_ready = False
        self.want_me = True  # publish the state until a head says otherwise
        self.state_time: float | None = None
        self.own_digest: bytes = b""
        self.body_seq = 0
        self.body: bytes | None = None
        self.heartbeat: _Heartbeat | None = None
        self.ready: set[int] = set()  # node indices whose digest exists
        self.published_verdict: dict | None = None
        self.head_seq = 0
        self.body_out = 0
        self.body_sent = b""
        self.skipped_formats = 0
        self.pending_since: float | None = None  # when the view's head first said it lacks chosen ranks

    # -- keys ---------------------------------------------------------------------------------------
    def _k(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _digest_key(self, i: int) -> str:
        return f"{self.prefix}/node/{i}/digest"

    def _state_key(self, i: int) -> str:
        return f"{self.prefix}/node/{i}/state"

    @property
    def suspect(self) -> bool:
        return bool(self.head and self.head.suspect)

    @property
    def stats(self) -> StoreStats:
        return self.client.stats

    def settling(self, now: float) -> bool:
        """Whether the view still lacks ranks the aggregator chose for it, and has for less than
        :data:`SETTLE_INTERVALS` exchange intervals (their nodes publish at their next exchange; one that
        does not by then is not coming soon, and the view is taken as it is)."""
        return self.pending_since is not None and now - self.pending_since < SETTLE_INTERVALS * self.interval

    def _track_pending(self, now: float, local: list[RankState]) -> None:
        """The view lacks ranks chosen for it that this node does not hold itself (its own it reads directly)."""
        mine = {s.rank for s in local}
        if self.head is None or not any(r not in mine for r in self.head.pending):
            self.pending_since = None
        elif self.pending_since is None:
            self.pending_since = now

    # -- one exchange -------------------------------------------------------------------------------
    def step(self, local: list[RankState], now: float, *, window: float, incident: dict | None = None,
             warnings: Iterable[Any] = ()) -> View | None:
        """Exchange if it is time (see :func:`~dtwatch.watchdog.aggregate.exchange_interval`; the aggregator
        also as soon as its verdict changes). While the job looks suspect a follower also reads the view
        between its exchanges (at every poll, at most four times an interval), so that what it needs reaches
        it sooner. Returns None when it was not time. Store errors propagate (the caller warns once); the
        next exchange starts over (the store may have been restarted)."""
        view = self._step(local, now, window=window, incident=incident, warnings=warnings)
        if view is not None:
            self._track_pending(now, local)
        return view

    def _step(self, local: list[RankState], now: float, *, window: float, incident: dict | None = None,
              warnings: Iterable[Any] = ()) -> View | None:
        """One exchange, if due (see :meth:`step`)."""
        verdict = verdict_of(incident)
        busy = any(s.open_calls for s in local) or incident is not None or self.suspect
        changed = self.role == AGGREGATOR and verdict != self.published_verdict
        # The aggregator reads again soon while its view lacks chosen ranks (their nodes publish them as soon as
        # they read the head that asks for them).
        filling = self.role == AGGREGATOR and self.settling(now) and now - self.last >= self.interval / 2
        due = now - self.last >= exchange_interval(self.interval, busy=busy) or changed or filling
        peek = self.role == FOLLOWER and self.suspect and self.view_ready and now - self.last_read >= self.interval / 4
        if not (due or peek):
            return None
        self.last_read = now
        try:
            if not due:
                view = self._follow_and_answer(local, now)  # the head (and a changed body) only
                if self.role == FOLLOWER:
                    return view
                # it has just taken the lease over: publish and aggregate now
            self.last = now
            self._publish(local, now)
            if self.role == AGGREGATOR and not self._still_holds():
                log.info("dtwatch: another node took over the aggregation of %s; following it", self.job_id)
                self._follow_from_now()
            if self.role == FOLLOWER:
                view = self._follow_and_answer(local, now)
                if self.role == FOLLOWER:
                    return view
            return self._aggregate(local, now, window, verdict, warnings)
        except Exception:
            self._start_over()
            raise

    def close(self) -> None:
        """Hand the lease back if this node holds it (a clean exit: another node takes over at once)."""
        if self.heartbeat is not None:
            self.heartbeat.release()
            self.heartbeat = None

    def _start_over(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop.set()
            self.heartbeat = None
        self.role, self.index, self.view_ready, self.want_me = FOLLOWER, None, False, True
        self.lease_watch.reset()
        self.ready.clear()

    def _still_holds(self) -> bool:
        """Whether the lease is still this node's (a paused aggregator may have been replaced meanwhile)."""
        if self.heartbeat is None or self.heartbeat.lost:
            return False
        seen = Lease.decode(self.client.get(self._k("lease")))
        mine = self.heartbeat.lease
        return seen is not None and (seen.holder, seen.term) == (mine.holder, mine.term)

    def _follow_from_now(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop.set()
            self.heartbeat = None
        self.role = FOLLOWER
        self.lease_watch.reset()

    # -- every node ---------------------------------------------------------------------------------
    def _publish(self, local: list[RankState], now: float) -> None:
        if self.index is None:
            self.index = self.client.add(self._k("nodes"), 1) - 1
        if self._state_wanted(local):
            state = encode_states(self.node, local, now)
            self.state_time = now
            self.own_digest = digest(self.node, local, now, state_time=now)
            self.client.multi_set([self._digest_key(self.index), self._state_key(self.index)], [self.own_digest, state])
        else:
            self.own_digest = digest(self.node, local, now, state_time=self.state_time)
            self.client.set(self._digest_key(self.index), self.own_digest)

    def _state_wanted(self, local: list[RankState]) -> bool:
        """Whether this node publishes its ranks' state with its digest. A follower: while the view asks for it.
        The aggregator reads its own ranks directly, but publishes them while the view holds them too, so that a
        node taking over from it has them as fresh as its last digest."""
        if self.role == FOLLOWER:
            return self.want_me
        head = self.head
        return head is None or head.want is None or not {s.rank for s in local}.isdisjoint(head.body_ranks)

    def _follow(self, local: list[RankState]) -> View:
        lease_key, view_key = self._k("lease"), self._k("view")
        if not self.view_ready:
            first = claim(None, self.node).encode()
            raw_lease = self.client.compare_set(lease_key, "", first)  # claims a free lease, else shows the holder's
            if raw_lease == first.encode():
                self._lead(Lease.decode(raw_lease))
                return View(None)
            if not self.client.check([view_key]):
                self._maybe_take_over(raw_lease, prompt=True)
                return View(None)
            self.view_ready = True
        asked = time.monotonic()
        raw_lease, raw_head = self.client.multi_get([lease_key, view_key])
        if self._maybe_take_over(raw_lease, prompt=time.monotonic() - asked < renew_period(self.interval)):
            return View(None)
        head = ViewHead.decode(raw_head)
        self.head = head
        self.want_me = head.want is None or (self.index is not None and self.index in head.want)
        if not head.body_ranks:
            self.body, self.body_seq = None, head.body
        elif head.body != self.body_seq:
            self.body, self.body_seq = self.client.get(self._k("body")), head.body
        return View(head, self.body, {s.rank for s in local})

    def _follow_and_answer(self, local: list[RankState], now: float) -> View:
        """Read the view; a head that now wants this node's state gets it at once (the aggregator's next round
        reads it) rather than at this node's next exchange, an interval later."""
        wanted = self.want_me
        view = self._follow(local)
        if self.role == FOLLOWER and self.want_me and not wanted:
            self._publish(local, now)
        return view

    def _maybe_take_over(self, raw_lease: bytes, *, prompt: bool) -> bool:
        """Claim the lease if it stood still for too long, on this node's monotonic clock. An answer that took
        longer than a renewal period says the store itself was slow (a burst of connections, a busy job):
        the holder's renewals waited in the same queue, so the clock starts again instead."""
        if not prompt:
            self.lease_watch.reset()
        unchanged = self.lease_watch.observe(raw_lease, time.monotonic())
        seen = Lease.decode(raw_lease)
        if not should_take_over(seen, self.node, unchanged, self.interval):
            return False
        mine = claim(seen, self.node).encode()
        got = self.client.compare_set(self._k("lease"), raw_lease.decode(errors="replace"), mine)
        if got != mine.encode():
            return False
        self._lead(Lease.decode(got), f"{seen.holder} stopped renewing its lease" if seen is not None else "")
        return True

    def _lead(self, lease: Lease | None, why: str = "") -> None:
        assert lease is not None
        log.info("dtwatch: %s aggregates the cross-node exchange of %s (term %d)%s", self.node, self.job_id,
                 lease.term, f": {why}" if why else "")
        self.role = AGGREGATOR
        self.ready.clear()
        self.head_seq = max(self.head_seq, self.head.seq if self.head else 0)
        self.body_out = max(self.body_out, self.head.body if self.head else 0)
        client = StoreClient(self.host, self.port, self.timeout)
        client.connect()  # here, so that a store that cannot be reached fails this exchange (retried) at once
        self.heartbeat = _Heartbeat(client, self._k("lease"), lease, renew_period(self.interval))
        self.heartbeat.start()

    # -- the aggregator -----------------------------------------------------------------------------
    def _aggregate(self, local: list[RankState], now: float, window: float, verdict: dict | None,
                   warnings: Iterable[Any]) -> View:
        client = self.client
        count = client.add(self._k("nodes"), 0)
        new = [i for i in range(count) if i not in self.ready and i != self.index]
        if new:
            if client.check([self._digest_key(i) for i in new]):
                self.ready.update(new)
            else:  # some node registered and has not published yet (a moment at its start)
                self.ready.update(i for i in new if client.check([self._digest_key(i)]))
        indices = sorted(self.ready)
        nodes: dict[str, tuple[int, NodeDigest]] = {}
        for i, blob in zip(indices, client.multi_get([self._digest_key(i) for i in indices], self.batch), strict=True):
            try:
                nd = decode_digests(blob)
            except SummaryFormatError as exc:
                if self.skipped_formats == 0:
                    log.warning("dtwatch: skipping a node's exchange data: %s", exc)
                self.skipped_formats += 1
                continue
            if nd.node == self.node:
                continue  # an earlier run of this node's watchdog
            if nd.node not in nodes or nodes[nd.node][1].time < nd.time:
                nodes[nd.node] = (i, nd)
        owner: dict[int, int] = {}
        newest: dict[int, tuple[float, RankDigest]] = {}
        for i, nd in nodes.values():
            for d in nd.ranks:
                if d.rank not in newest or newest[d.rank][0] < nd.time:
                    newest[d.rank], owner[d.rank] = (nd.time, d), i
        mine = {s.rank for s in local}
        for d in decode_digests(self.own_digest).ranks:
            newest[d.rank] = (now, d)
            owner.pop(d.rank, None)
        findings = list((verdict or {}).get("findings") or [])
        findings += [w.to_dict() if hasattr(w, "to_dict") else dict(w) for w in list(warnings)[-20:]]
        sel = select_ranks([d for _t, d in newest.values()], now, window, named_ranks(findings),
                           full_view=self.full_view)
        chosen = set(sel.ranks)
        full = sel.total <= self.full_view
        want = sorted({owner[r] for r in chosen if r in owner})
        # Only a state published with the node's latest digest: a node publishes its state only while the view
        # wants it, so an older one (from an earlier suspect spell) shows the ranks where they were back then.
        fresh = {i for i, nd in nodes.values() if nd.state_time is not None and nd.state_time >= nd.time}
        have = [i for i in want if i in fresh]
        remote: list[RankState] = []
        for blob in client.multi_get([self._state_key(i) for i in have], self.batch) if have else []:
            try:
                remote += [s for s in decode_states(blob, chosen).states if s.rank not in mine]
            except SummaryFormatError:
                continue
        for s in remote:  # the digests are newer than the states read (those only while wanted)
            s.heartbeat_time = max(s.heartbeat_time, newest[s.rank][1].heartbeat)
        self.head_seq += 1
        body_states = sorted([s for s in local if s.rank in chosen] + remote, key=lambda s: s.rank)
        # The body is written only when it changed: times relative to the hour, heartbeats in the head.
        body = encode_states("view", body_states, now - now % 3600, heartbeats=False) if body_states else b""
        if body and body != self.body_sent:
            self.body_out += 1
        head = ViewHead(
            aggregator=self.node, term=self.heartbeat.lease.term if self.heartbeat else 0, seq=self.head_seq,
            time=now, nodes=len(nodes) + 1, ranks=sel.total, suspect=sel.suspect, quiet=round(sel.quiet, 3),
            blocked=sel.blocked, want=None if full else want, body=self.body_out if body else 0,
            body_ranks=[s.rank for s in body_states], verdict=verdict,
            beats=[round(s.heartbeat_time, 3) for s in body_states],
            pending=sorted(chosen - {s.rank for s in body_states}),
        )
        if body and body != self.body_sent:
            client.multi_set([self._k("view"), self._k("body")], [head.encode(), body])
            self.body_sent = body
        else:
            client.set(self._k("view"), head.encode())
        self.head, self.published_verdict = head, verdict
        return View(head, states=remote)
