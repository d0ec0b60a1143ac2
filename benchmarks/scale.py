#!/usr/bin/env python
"""The cross-node exchange at scale: one real TCPStore, N simulated node watchdogs, before and after.

    python benchmarks/scale.py                          # N = 16, 128, 1024; before and after; a table
    python benchmarks/scale.py --nodes 16,128 --json -  # the rows as JSON on stdout (the table on stderr)
    python benchmarks/scale.py --exchange after --nodes 4096

For each N and each exchange, from scratch: a TCPStore server process (the job's store on the rank-0
host), a probe process that times the job's own use of that store (one ``set``, one ``get`` and one
``add`` in a row every 10 ms, as rendezvous and barriers do), then N simulated node watchdogs: node 0 in
a process of its own, nodes 1..N-1 spread over ``--procs`` processes, each node with its own store
connection; the nodes of a process take turns in its one thread, by their next due time (an OS thread per
node - a thousand of them - swamps a small machine with wake-ups and lock hand-offs). Each node simulates
8 ranks (``scale_job.py``: a training loop whose ranks are always inside some collective) and exchanges at
the watchdog's real cadence (a poll every second; an exchange every 2 s while a rank is in a collective,
10 s otherwise).

* ``after``: :class:`dtwatch.watchdog.exchange.Exchange`, the watchdog's own code. Node 0 starts first
  and holds the lease (the aggregator); every poll it also runs the diagnosis on its ranks and the
  view's, as the watchdog does, and opens an incident when it finds the stall. The other nodes read the
  head every exchange and the body when it changes; they do not decode the body (a real node's own CPU,
  not the store's; on this machine it would be the simulation's).
* ``before``: the exchange as it was (:class:`OldExchange`, kept here only to measure it): each node
  publishes its ranks' full states and reads every other node's key, four round trips per node. Node 0
  decodes what it reads and diagnoses all ranks every poll, as the watchdog did; the others only read.

Phases: the probe starts; the nodes start, connect and exchange once, then ``--warmup`` s; the healthy
phase (``--healthy`` s): the nodes pause and run in turns of ``--ab`` s (paused nodes keep their
connections and do nothing; the lease holder keeps renewing), so that the probe's figures without and
with dtwatch's traffic are taken under the same background load; then one rank hangs in its DataLoader
and every node watches for the verdict, for ``--window`` + ``--cap`` s.

Row fields (``--json``): ``store_requests_per_poll`` and ``bytes_per_poll`` - requests and bytes (values
sent and received) of one exchange of every node, summed over the nodes, during the healthy phase (the
aggregator's lease renewals counted per 2-second interval); ``aggregator_cpu_pct`` - CPU of node 0's
process (the aggregator, after; one node's watchdog exchange and diagnosis, before) over the last running
turn and the hung phase, in % of one core; ``verdict_latency_s`` - from the hang to the moment the last node
has the verdict, null if not every node had it by the cap. Every watchdog diagnoses for itself every
poll, so a node has it at the first poll where it holds the hung rank's state and the stall window has
passed since the job's last progress (node 0 runs that diagnosis; for the others it is not run, only
timed - ``after``: a body holding the hung rank, from a head that says how long the job has been
quiet; ``before``: a read of every node's post-hang state) - or, ``after``, where it read the
aggregator's verdict first (the time for that alone is printed under the table);
``probe_p50_ms``/``probe_p99_ms`` - the probe's set+get+add while the nodes run (healthy turns, less
their first 1.5 s, and the hung phase); ``probe_p99_ms_without`` - the same while they are paused.

Every node has connected and exchanged once before anything is measured: the store server looks up
each new client's name in its only thread, and where reverse DNS is slow every client waits (see
``RES_OPTIONS`` below).

The store and the probe are pinned to CPU 0, the simulated nodes to CPU 1 (when there are two), so the
simulation competes with the store as other machines would: through the network, not for its CPU. On a
shared machine other people's work still adds noise; compare rows from one run.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
import zlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ warnings about client host names, per connection
# The TCPStore server looks up the name of each connecting client, in its only thread: where reverse DNS times
# out (glibc's default: 5 s; on some machines for about one connection in 30) every client of the
# store waits that long. Connections are made before anything is measured; this only shortens the start.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scale_job import RANKS_PER_NODE, SimJob

from dtwatch.watchdog.aggregate import exchange_interval

JOB_ID = "scale"
INTERVAL = 2.0  # the watchdog's store_interval
POLL = 1.0  # the watchdog's poll_interval
PUBLISHED_RECENT = 16  # what the old exchange trimmed each group's recent calls to
ROUND_CHUNK = 8  # node reads of an old exchange round per turn


# -- the exchange as it was, kept only to be measured --------------------------------------------------
class OldExchange:
    """Every node publishes its ranks' full states under its name and reads every other node's key, one
    at a time: check and get the name, check and get the states (torch's TCPStore ``get`` blocks on a
    missing key)."""

    def __init__(self, client, node: str) -> None:
        self.client, self.node = client, node
        self.prefix = f"dtwatch/{JOB_ID}"
        self.registered = False

    @staticmethod
    def payload(states) -> bytes:
        out = []
        for s in states:
            d = s.to_dict()
            for g in d["groups"].values():
                g["recent"] = g["recent"][-PUBLISHED_RECENT:]
            out.append(d)
        return zlib.compress(json.dumps(out).encode())

    def publish(self, payload: bytes) -> None:
        if not self.registered:
            idx = self.client.add(f"{self.prefix}/nodes", 1) - 1
            self.client.set(f"{self.prefix}/node_name/{idx}", self.node.encode())
            self.registered = True
        self.client.set(f"{self.prefix}/node/{self.node}", payload)

    def rounds(self, decode: bool) -> Generator[None, None, list]:
        """One read of every other node's states; yields after each node (the caller takes turns with other
        nodes), returns the states read when decoding them."""
        from dtwatch.diagnose.rank_state import RankState

        count = self.client.add(f"{self.prefix}/nodes", 0)
        states = []
        for i in range(count):
            yield None
            name_key = f"{self.prefix}/node_name/{i}"
            if not self.client.check([name_key]):
                continue
            name = self.client.get(name_key).decode()
            if name == self.node:
                continue
            key = f"{self.prefix}/node/{name}"
            if not self.client.check([key]):
                continue
            blob = self.client.get(key)
            if decode:
                states += [RankState.from_dict(d) for d in json.loads(zlib.decompress(blob))]
        return states


# -- processes ----------------------------------------------------------------------------------------
def _pin(cpu: int) -> None:
    try:
        if len(os.sched_getaffinity(0)) > 1 and cpu < (os.cpu_count() or 1):
            os.sched_setaffinity(0, {cpu})
    except (AttributeError, OSError):
        pass


def store_main(port_q, stop) -> None:
    _pin(0)
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    port_q.put(server.port)
    stop.wait()


def probe_main(port: int, out_q, ready_q, stop, period: float) -> None:
    _pin(0)
    from datetime import timedelta

    from torch.distributed import TCPStore

    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=300))
    samples = []
    next_t = time.time()
    i = 0
    while not stop.is_set():
        t = time.time()
        a = time.perf_counter()
        client.set(f"job/probe/{i % 64}", "x" * 64)
        client.get(f"job/probe/{i % 64}")
        client.add("job/probe/barrier", 1)
        samples.append((t, time.perf_counter() - a))
        i += 1
        if i == 100:
            ready_q.put(t)  # connected and warm
        next_t += period
        time.sleep(max(0.0, next_t - time.time()))
    out_q.put(("probe", samples))


@dataclass
class Config:
    mode: str
    nodes: int
    port: int
    t0: float
    window: float
    culprit: int


def _verdict_names(head, culprit: int) -> bool:
    verdict = head.verdict if head is not None else None
    if not verdict:
        return False
    return any(culprit in f.get("ranks", []) for f in verdict.get("findings", []))


class SimNode:
    """One simulated node's watchdog, advanced by :meth:`tick` from its process's event loop: a poll every
    second (only the polls where something can be due are simulated), the exchange at the watchdog's cadence.
    A round of the old exchange is advanced a few node reads per tick, so that the nodes of one process take
    turns at the store as the nodes of a job would."""

    def __init__(self, n: int, cfg: Config, hang_at, lead: bool) -> None:
        from dtwatch.watchdog.exchange import Exchange, StoreClient

        self.n, self.cfg, self.hang_at, self.lead = n, cfg, hang_at, lead
        self.job = SimJob(cfg.nodes, t0=cfg.t0)
        self.log: list[tuple[float, int, int]] = []  # per exchange: (time, requests, bytes)
        self.rec: dict[str, Any] = {"log": self.log, "verdict": None, "rounds": [], "published": None,
                                    "partial": None, "errors": 0, "error": "", "role": "", "term": 0,
                                    "read_verdict": None, "own": None, "incident": None}
        self.phase = random.Random(n).random() * POLL
        self.ex: Exchange | None = None
        self.old: OldExchange | None = None
        if cfg.mode == "after":
            self.ex = Exchange("127.0.0.1", cfg.port, JOB_ID, f"node{n}", interval=INTERVAL, timeout=300.0)
            self.client = self.ex.client
        else:
            self.client = StoreClient("127.0.0.1", cfg.port, timeout=300.0)
            self.old = OldExchange(self.client, f"node{n}")
        self.payload, self.payload_hung, self.last = b"", False, float("-inf")
        self.round: Iterator | None = None
        self.round_start = (0.0, 0, 0)
        self.incident: dict | None = None
        self.remote: list = []
        self.local: list = []
        self.next_diagnosis = 0.0
        self.started = False

    def tick_at(self, t: float) -> float:
        """The first poll of this node at or after ``t``."""
        return math.ceil((t - self.phase) / POLL) * POLL + self.phase

    def _traffic(self) -> tuple[int, int]:
        return self.client.stats.requests, self.client.stats.bytes_in + self.client.stats.bytes_out

    def tick(self, now: float) -> float:
        """Do what is due now; returns when to be called again."""
        if self.hang_at.value and self.job.hung is None:
            self.job.hang(self.cfg.culprit, self.hang_at.value)
        try:
            return self._after(now) if self.ex is not None else self._before(now)
        except Exception as exc:  # noqa: BLE001 - as the watchdog: counted, tried again at the next poll
            self.rec["errors"] += 1
            self.rec["error"] = repr(exc)
            self.round = None
            return self.tick_at(now + POLL)

    def _after(self, now: float) -> float:
        from dtwatch.watchdog.exchange import AGGREGATOR

        ex = self.ex
        assert ex is not None
        leading = self.lead or ex.role == AGGREGATOR  # node 0 diagnoses every poll; so does whoever took over
        due = now - ex.last >= INTERVAL
        if leading or due or (ex.suspect and now - ex.last_read >= INTERVAL / 4):
            if leading or due or ex.suspect or not self.local:
                self.local = self.job.states(self.n, now)  # a read between exchanges may publish (asked to)
            r0, b0 = self._traffic()
            view = ex.step(self.local, now, window=self.cfg.window, incident=self.incident)
            if view is not None:
                r1, b1 = self._traffic()
                self.log.append((now, r1 - r0, b1 - b0))
                self.started = True
                if self.rec["read_verdict"] is None and _verdict_names(view.head, self.cfg.culprit):
                    self.rec["read_verdict"] = time.time()
                head = view.head
                if head is not None:
                    self.rec["term"] = max(self.rec["term"], head.term)
                    # Its own diagnosis (the watchdog's, every poll, on its ranks and the body's) declares the
                    # stall now: it holds the hung rank's state and the window has passed since the job's last
                    # progress. Simulated followers do not run it (a thousand of them on one core would be the
                    # bottleneck); the tests check that it names the hung rank from exactly this.
                    if (self.rec["own"] is None and head.suspect and self.cfg.culprit in head.body_ranks
                            and ex.body_seq == head.body and now >= head.time - head.quiet + self.cfg.window
                            and not ex.settling(now)):
                        self.rec["own"] = time.time()
                first = [t for t in (self.rec["read_verdict"], self.rec["own"]) if t is not None]
                if first and self.rec["verdict"] is None:
                    self.rec["verdict"] = min(first)
                if leading:
                    self.remote = view.remote_states()
            if leading:
                self._diagnose(now)
            self.rec["role"] = ex.role
        if leading or ex.suspect:
            return self.tick_at(now + POLL * 0.999)
        return self.tick_at(max(now + POLL * 0.999, ex.last + INTERVAL))

    def _before(self, now: float) -> float:
        old = self.old
        assert old is not None
        if self.round is None:
            self.local = self.job.states(self.n, now) if self.lead or now - self.last >= INTERVAL else []
            busy = any(s.open_calls for s in self.local)  # the old cadence: 2 s while a rank is in a collective
            if self.local and now - self.last >= exchange_interval(INTERVAL, busy=busy):
                self.last = now
                hung = self.job.hung is not None and now >= self.job.hang_time
                if not self.payload or hung != self.payload_hung:
                    self.payload, self.payload_hung = OldExchange.payload(self.local), hung
                r0, b0 = self._traffic()
                old.publish(self.payload)
                if hung and self.rec["published"] is None:
                    self.rec["published"] = time.time()
                self.started = True
                self.round = old.rounds(decode=self.lead)
                self.round_start = (time.time(), r0, b0)
        if self.lead and now >= self.next_diagnosis:
            self._diagnose(now)
            self.next_diagnosis = self.tick_at(now + POLL * 0.999)
        if self.round is None:
            return self.tick_at(now + POLL * 0.999)
        for _ in range(ROUND_CHUNK):
            try:
                next(self.round)
            except StopIteration as done:
                started, r0, b0 = self.round_start
                r1, b1 = self._traffic()
                self.rec["rounds"].append((started, time.time()))
                self.log.append((self.last, r1 - r0, b1 - b0))
                if self.lead:
                    self.remote = done.value
                self.round = None
                return self.tick_at(now + POLL * 0.999)
        return now if not self.lead else min(time.time(), self.next_diagnosis)  # the round goes on

    def _diagnose(self, now: float) -> None:
        """What the watchdog does every poll with its ranks and the others'."""
        from dtwatch.bundle.file_evidence import FileEvidence
        from dtwatch.bundle.files import incident_id
        from dtwatch.diagnose import (
            diagnose,
            entry_lags,
            straggler_warning,
            uneven_loader_warnings,
        )
        from dtwatch.watchdog.incident import Step, next_step

        states = sorted(self.local + self.remote, key=lambda s: s.rank)
        head = self.ex.head if self.ex is not None else None
        sample = head.sample() if head is not None else None  # as the watchdog's Peers tells its diagnosis
        result = diagnose(states, now, self.cfg.window, FileEvidence(sample=sample))
        straggler_warning(entry_lags(states), now)
        uneven_loader_warnings(states, now)
        settling = self.ex is not None and self.ex.settling(now)
        if self.incident is None and \
                next_step(None, result, states, now, self.cfg.window, view_settling=settling) is Step.OPEN:
            self.incident = {"id": incident_id(result.findings[0], states), "verdict": "stall",
                             "findings": result.findings}
            first = result.findings[0]
            self.rec["incident"] = {"time": time.time(), "kind": str(first.kind), "ranks": first.ranks[:16],
                                    "summary": first.summary[:400], "view_ranks": len(states)}
            if self.ex is not None and any(self.cfg.culprit in f.ranks for f in result.findings):
                self.rec["verdict"] = self.rec["verdict"] or time.time()
                self.rec["read_verdict"] = self.rec["read_verdict"] or time.time()

    def snapshot(self) -> dict:
        rec = dict(self.rec)
        if self.round is not None:  # a round still under way: (start, requests, bytes) so far
            started, r0, b0 = self.round_start
            r1, b1 = self._traffic()
            rec["partial"] = (started, r1 - r0, b1 - b0)
        return rec

    def close(self) -> None:
        if self.ex is not None:
            self.ex.close()


def nodes_main(cfg: Config, node_ids: list[int], lead: bool, hang_at, stop, paused, out_q, ready_q) -> None:
    """One process of simulated nodes: one thread, the nodes taking turns by their next due time."""
    _pin(1)
    import heapq
    import logging
    import resource

    logging.basicConfig(level=logging.INFO if os.environ.get("SCALE_DEBUG") else logging.WARNING,
                        format="%(asctime)s %(processName)s %(message)s")
    nodes = {n: SimNode(n, cfg, hang_at, lead) for n in node_ids}
    heap = [(nodes[n].phase + time.time(), n) for n in node_ids]
    heapq.heapify(heap)
    cpu: list[tuple[float, float, int, int]] = []  # (time, process CPU s, lease renewal requests, bytes)
    next_sample = time.time()
    ready = False
    while not stop.is_set():
        wake, n = heapq.heappop(heap)
        delay = wake - time.time()
        if delay > 0:
            stop.wait(delay)
        now = time.time()
        if paused.is_set():  # on its poll grid, doing nothing (the lease holder's renewals go on)
            heapq.heappush(heap, (nodes[n].tick_at(now + POLL * 0.999), n))
            continue
        heapq.heappush(heap, (nodes[n].tick(now), n))
        if not ready and all(node.started for node in nodes.values()):
            ready_q.put(len(node_ids))  # every node connected and through its first exchange
            ready = True
        if lead and now >= next_sample:
            next_sample = now + 0.5
            ru = resource.getrusage(resource.RUSAGE_SELF)
            beat = getattr(nodes[node_ids[0]].ex, "heartbeat", None)
            stats = beat.client.stats if beat is not None else None
            cpu.append((now, ru.ru_utime + ru.ru_stime, stats.requests if stats else 0,
                        stats.bytes_in + stats.bytes_out if stats else 0))
    out_q.put(("nodes", {"out": {n: node.snapshot() for n, node in nodes.items()}, "cpu": cpu}))
    for node in nodes.values():
        node.close()


# -- one row --------------------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def run_row(mode: str, nodes: int, args, say) -> dict:
    ctx = mp.get_context("spawn")
    stop_store, stop_probe, stop_nodes, paused = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    port_q, out_q, ready_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    hang_at = ctx.Value("d", 0.0)
    store = ctx.Process(target=store_main, args=(port_q, stop_store), daemon=True)
    store.start()
    port = port_q.get(timeout=60)
    probe = ctx.Process(target=probe_main, args=(port, out_q, ready_q, stop_probe, 0.01), daemon=True)
    probe.start()
    ready_q.get(timeout=120)
    culprit = (nodes // 2) * RANKS_PER_NODE + 3
    cfg = Config(mode, nodes, port, time.time() - 60.0, args.window, culprit)
    procs = [ctx.Process(target=nodes_main, args=(cfg, [0], True, hang_at, stop_nodes, paused, out_q, ready_q),
                         daemon=True)]
    procs[0].start()
    ready_q.get(timeout=120)
    time.sleep(1.5 * POLL)  # node 0 exchanges first: it holds the lease
    rest = list(range(1, nodes))
    k = max(1, min(args.procs, len(rest)))
    for i in range(k):
        p = ctx.Process(target=nodes_main, args=(cfg, rest[i::k], False, hang_at, stop_nodes, paused, out_q, ready_q),
                        daemon=True)
        p.start()
        procs.append(p)
    for _ in range(k):
        ready_q.get(timeout=300)
    time.sleep(args.warmup)
    # Healthy phase: the nodes pause and run in turns, so that the probe's figures without and with dtwatch's
    # traffic are taken under the same background load (the machine is shared). Samples right after a switch
    # are left out (nodes resuming catch up on the exchanges they skipped).
    windows: list[tuple[float, float, str]] = []
    t_h0 = time.time()
    for _ in range(max(1, round(args.healthy / (2 * args.ab)))):
        paused.set()
        a = time.time()
        time.sleep(args.ab)
        paused.clear()
        windows.append((a + 0.5, time.time(), "without"))
        b = time.time()
        time.sleep(args.ab)
        windows.append((b + 1.5, time.time(), "with"))
    t_h1 = time.time()
    cpu_from = windows[-1][0] - 1.5
    store_cpu0 = _proc_cpu(store.pid or 0)
    hang_at.value = t_h1
    job = SimJob(nodes, t0=cfg.t0)
    job.hang(culprit, t_h1)
    hang_time = job.hang_time
    windows.append((t_h1, hang_time + args.window + args.cap, "with"))
    deadline = hang_time + args.window + args.cap
    say(f"  {mode} N={nodes}: hang at +{hang_time - t_h0:.1f}s; waiting {deadline - time.time():.0f}s for the verdict")
    time.sleep(max(0.0, deadline - time.time()))  # the nodes record when they saw it; stopping early would cut that
    t_end = time.time()
    store_cpu = (_proc_cpu(store.pid or 0) - store_cpu0) / (t_end - t_h1) * 100
    stop_nodes.set()
    results: dict = {}
    lead_cpu: list = []
    for _ in procs:
        kind, data = out_q.get(timeout=120)
        results.update(data["out"])
        lead_cpu = data["cpu"] or lead_cpu
    stop_probe.set()
    kind, samples = out_q.get(timeout=60)
    stop_store.set()
    for p in [*procs, probe, store]:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return summarize(mode, nodes, results, [c for c in lead_cpu if c[0] >= cpu_from], samples, windows,
                     (t_h0, t_h1), hang_time, t_end, store_cpu, args)


def summarize(mode, nodes, results, lead_cpu, samples, windows, healthy, hang_time, t_end, store_cpu, args) -> dict:
    t_h0, t_h1 = healthy
    req_per_exchange, bytes_per_exchange = [], []
    planned = 0
    for rec in results.values():
        rows = [(r, b) for t, r, b in rec["log"] if t_h0 <= t < t_h1]
        if rows:
            req_per_exchange.append(sum(r for r, _b in rows) / len(rows))
            bytes_per_exchange.append(sum(b for _r, b in rows) / len(rows))
        elif mode == "before":
            # No round finished in the healthy phase (the store could not serve them): what one round asks for.
            planned += 1
            req_per_exchange.append(2 + 4 * (nodes - 1))
            got = rec["partial"]  # (start, requests, bytes) of the round under way: 4 requests per node read
            per_node = got[2] / max(1.0, (got[1] - 2) / 4) if got else 0.0
            bytes_per_exchange.append(per_node * (nodes - 1))
    requests = sum(req_per_exchange) / len(req_per_exchange) * nodes if req_per_exchange else None
    nbytes = sum(bytes_per_exchange) / len(bytes_per_exchange) * nodes if bytes_per_exchange else None
    cpu_rows = lead_cpu
    cpu_pct = lease_req = lease_bytes = None
    if len(cpu_rows) >= 2:
        (ta, ca, ra, ba), (tb, cb, rb, bb) = cpu_rows[0], cpu_rows[-1]
        cpu_pct = (cb - ca) / (tb - ta) * 100
        lease_req, lease_bytes = (rb - ra) / (tb - ta) * INTERVAL, (bb - ba) / (tb - ta) * INTERVAL
        if requests is not None and mode == "after":
            requests += lease_req
            nbytes = (nbytes or 0) + lease_bytes
    # The verdict on every node.
    read = None
    if mode == "after":
        seen = [rec["verdict"] for rec in results.values()]
        latency = max(seen) - hang_time if seen and all(seen) else None
        reads = [rec.get("read_verdict") for rec in results.values()]
        read = max(reads) - hang_time if reads and all(reads) else None
    else:
        published = [rec["published"] for rec in results.values()]
        latency = None
        if published and all(published):
            everyone = max(published)
            times: list[float] = []
            for rec in results.values():
                done = [end for start, end in rec["rounds"] if start >= everyone]
                if done:
                    times.append(max(done[0], hang_time + args.window))
            if len(times) == len(results):
                latency = max(times) - hang_time
    verdicts = sum(1 for rec in results.values() if (rec["verdict"] if mode == "after" else rec["rounds"]))
    if os.environ.get("SCALE_SAVE"):  # the raw figures, for a closer look
        raw = {"samples": samples, "t": [windows, healthy, hang_time, t_end], "nodes": results,
               "verdicts": {n: r["verdict"] for n, r in results.items()}}
        Path(os.environ["SCALE_SAVE"]).write_text(json.dumps(raw))
    errors = [rec["error"] for rec in results.values() if rec["errors"]]
    if os.environ.get("SCALE_DEBUG"):
        for n in sorted(results)[:6]:
            rec = results[n]
            exchanges = [(round(t - t_h0, 1), r, b) for t, r, b in rec["log"]][:20]
            print(n, rec["role"], rec["errors"], rec["error"][:200], rec["verdict"], exchanges, file=sys.stderr)
    with_ = [dt * 1000 for t, dt in samples if any(a <= t <= b for a, b, kind in windows if kind == "with")]
    without = [dt * 1000 for t, dt in samples if any(a <= t <= b for a, b, kind in windows if kind == "without")]
    return {
        "nodes": nodes, "exchange": mode,
        "store_requests_per_poll": round(requests) if requests is not None else None,
        "bytes_per_poll": round(nbytes) if nbytes is not None else None,
        "aggregator_cpu_pct": round(cpu_pct, 1) if cpu_pct is not None else None,
        "verdict_latency_s": round(latency, 2) if latency is not None else None,
        "probe_p50_ms": _r(_pct(with_, 0.5)), "probe_p99_ms": _r(_pct(with_, 0.99)),
        "probe_p99_ms_without": _r(_pct(without, 0.99)),
        "_notes": {"store_cpu_pct": round(store_cpu, 1),
                   "lease_terms": max(rec.get("term", 0) for rec in results.values()), "probe_samples": len(with_),
                   "aggregator_verdict_read_by_all_s": round(read, 2) if read is not None else None,
                   "nodes_with_errors": len(errors),
                   "an_error": errors[0] if errors else "",
                   "probe_samples_without": len(without),
                   "nodes_planned_not_measured": planned, "nodes_with_verdict_or_rounds": verdicts,
                   "probe_p50_ms_without": _r(_pct(without, 0.5)),
                   "lease_requests_per_interval": round(lease_req, 1) if lease_req is not None else None,
                   "cap_s": round(hang_time + args.window + args.cap - hang_time, 1),
                   "aggregator_incident": _incident_of(results, hang_time)},
    }


def _incident_of(results: dict, hang_time: float) -> dict | None:
    """The first incident node 0 opened (after: the aggregator's, which every node reads): when, and whom it
    names, so that a verdict that names someone else is seen, not only a missing one."""
    rec = results.get(0) or results.get("0") or {}
    inc = rec.get("incident")
    if not inc:
        return None
    return {"after_s": round(inc["time"] - hang_time, 2), "kind": inc["kind"], "ranks": inc["ranks"],
            "view_ranks": inc["view_ranks"], "summary": inc["summary"]}


def _r(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


# -- report ---------------------------------------------------------------------------------------------
def render(rows: list[dict], args) -> str:
    head = ["nodes", "exchange", "requests/poll", "bytes/poll", "agg CPU %", "verdict s", "probe p50 ms",
            "probe p99 ms", "p99 without", "store CPU %"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        n = r["_notes"]
        verdict = f"{r['verdict_latency_s']:.1f}" if r["verdict_latency_s"] is not None else f"none by {n['cap_s']:.0f}"
        lines.append(" | ".join(str(x) for x in [
            r["nodes"], r["exchange"], _fmt(r["store_requests_per_poll"]), _fmt(r["bytes_per_poll"]),
            _fmt(r["aggregator_cpu_pct"]), verdict, _fmt(r["probe_p50_ms"]), _fmt(r["probe_p99_ms"]),
            _fmt(r["probe_p99_ms_without"]), _fmt(n["store_cpu_pct"])]))
    lines.append("")
    lines.append(f"stall window {args.window:g} s (target: verdict on every node within window + 5 s = "
                 f"{args.window + 5:g} s); probe: set+get+add every 10 ms; poll = one exchange of every node")
    for r in rows:
        n = r["_notes"]
        if r["exchange"] == "after" and (r["verdict_latency_s"] is None or n["lease_terms"] > 1
                                         or n["nodes_with_errors"]):
            lines.append(f"N={r['nodes']} after: {n['nodes_with_verdict_or_rounds']} nodes had the verdict; lease "
                         f"terms {n['lease_terms']}; nodes with store errors {n['nodes_with_errors']} "
                         f"{n['an_error'][:80]}")
        inc = n.get("aggregator_incident")
        if r["exchange"] == "after":
            lines.append(f"N={r['nodes']} after: the aggregator's incident, " + (
                f"{inc['after_s']:.1f} s after the hang, from a view of {inc['view_ranks']} ranks: {inc['kind']} "
                f"naming {inc['ranks'] or 'no rank'}" if inc else "none opened"))
        if n.get("aggregator_verdict_read_by_all_s") is not None:
            lines.append(f"N={r['nodes']} {r['exchange']}: the aggregator's verdict read by every node after "
                         f"{n['aggregator_verdict_read_by_all_s']:.1f} s")
        if n["nodes_planned_not_measured"]:
            lines.append(f"N={r['nodes']} {r['exchange']}: {n['nodes_planned_not_measured']} nodes finished no "
                         "exchange in the healthy phase: their requests/bytes are what one exchange asks for")
    return "\n".join(lines)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}" if x < 100 else f"{x:.0f}"
    return f"{x:,}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="16,128,1024", help="comma-separated node counts (default 16,128,1024)")
    ap.add_argument("--exchange", default="before,after", help="before, after or both (default)")
    ap.add_argument("--window", type=float, default=10.0, help="stall window in seconds (default 10)")
    ap.add_argument("--ab", type=float, default=4.0,
                    help="healthy phase: seconds the nodes pause, then run, in turns (default 4)")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds after every node started (default 4)")
    ap.add_argument("--healthy", type=float, default=16.0, help="seconds of healthy training measured (default 16)")
    ap.add_argument("--cap", type=float, default=15.0, help="seconds after window to wait for the verdict (default 15)")
    ap.add_argument("--procs", type=int, default=6, help="processes for the simulated nodes 1..N-1 (default 6)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE ('-' = stdout)")
    args = ap.parse_args()
    out = sys.stderr if args.json == "-" else sys.stdout

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows = []
    for nodes in [int(x) for x in args.nodes.split(",") if x]:
        for mode in [m for m in args.exchange.split(",") if m]:
            say(f"N={nodes} {mode} ...")
            t = time.time()
            rows.append(run_row(mode, nodes, args, say))
            say(f"  done in {time.time() - t:.0f}s: {json.dumps({k: v for k, v in rows[-1].items() if k != '_notes'})}")
    print(render(rows, args), file=out, flush=True)
    if args.json:
        doc = json.dumps({"rows": [{k: v for k, v in r.items() if k != "_notes"} for r in rows]}, indent=2)
        if args.json == "-":
            print(doc)
        else:
            Path(args.json).write_text(doc + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
