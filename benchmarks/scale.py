#!/usr/bin/env python
"""The cross-node exchange at scale: one real TCPStore, N simulated node watchdogs, before and after.

    python benchmarks/scale.py                          # N = 16, 128, 1024; before and after; a table
    python benchmarks/scale.py --nodes 16,128 --json -  # the rows as JSON on stdout (the table on stderr)
    python benchmarks/scale.py --exchange after --nodes 4096

For each N and each exchange, from scratch: a TCPStore server process (the job's store on the rank-0
host), a probe process that times the job's own use of that store (one ``set``, one ``get`` and one
``add`` in a row every 10 ms, as rendezvous and barriers do), then N simulated node watchdogs: node 0 in
a process of its own, nodes 1..N-1 as threads in ``--procs`` processes, each node with its own store
connection. Each node simulates 8 ranks (``scale_job.py``: a training loop whose ranks are inside
collectives most of the time) and exchanges at the watchdog's real cadence (a poll every second; an
exchange every 2 s while a rank is in a collective, 10 s otherwise).

* ``after``: :class:`dtwatch.watchdog.exchange.Exchange`, the watchdog's own code. Node 0 starts first
  and holds the lease (the aggregator); every poll it also runs the diagnosis on its ranks and the
  view's, as the watchdog does, and opens an incident when it finds the stall. The other nodes read the
  head every exchange and the body when it changes; they do not decode the body (a real node's own CPU,
  not the store's; on this machine it would be the simulation's).
* ``before``: the exchange as it was (:class:`OldExchange`, kept here only to measure it): each node
  publishes its ranks' full states and reads every other node's key, four round trips per node. Node 0
  decodes what it reads and diagnoses all ranks every poll, as the watchdog did; the others only read.

Phases: ``--baseline`` s of the probe alone (``probe_p99_ms_without``); the nodes start and warm up;
``--healthy`` s of normal training (requests and bytes per poll); then one rank hangs in its DataLoader
and every node watches for the verdict, until all have it or ``--window`` + ``--cap`` s have passed.
The probe's figures cover the healthy and the hung phases.

Row fields (``--json``): ``store_requests_per_poll`` and ``bytes_per_poll`` - requests and bytes (values
sent and received) of one exchange of every node, summed over the nodes, during the healthy phase (the
aggregator's lease renewals counted per 2-second interval); ``aggregator_cpu_pct`` - CPU of node 0's
process (the aggregator, after; one node's watchdog exchange and diagnosis, before) from the healthy
phase to the end, in % of one core; ``verdict_latency_s`` - from the hang to the moment the last node
holds the verdict (after: it read a head whose verdict names the hung rank; before: it finished reading
every node's post-hang state and the window had passed - the diagnosis itself not counted), null if
not every node had it by the cap; ``probe_p50_ms``/``probe_p99_ms`` - the probe's set+get+add with the
nodes running; ``probe_p99_ms_without`` - the same, before they started.

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
import multiprocessing as mp
import os
import random
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ warnings about client host names, per connection
# The TCPStore server looks up the name of each connecting client, in its only thread: where reverse DNS times
# out (as on the machine this was written on: glibc's 5 s, for about one connection in 30) every client of the
# store waits that long. Connections are made before anything is measured; this only shortens the start.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scale_job import RANKS_PER_NODE, SimJob

JOB_ID = "scale"
INTERVAL = 2.0  # the watchdog's store_interval
POLL = 1.0  # the watchdog's poll_interval
PUBLISHED_RECENT = 16  # what the old exchange trimmed each group's recent calls to


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

    def fetch(self, stop, decode: bool):
        """Yields after each node read (so a stop interrupts a long round); returns the states when decoding."""
        from dtwatch.diagnose.state import RankState

        count = self.client.add(f"{self.prefix}/nodes", 0)
        states = []
        for i in range(count):
            if stop.is_set():
                return None
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


def node_loop(n: int, cfg: Config, hang_at, stop, lead: bool, out: dict, live: dict, started_q) -> None:
    """One simulated node's watchdog: a poll every second, the exchange at its cadence."""
    from dtwatch.diagnose import diagnose, entry_lags, straggler_warning, uneven_loader_warnings
    from dtwatch.report.bundle import incident_id
    from dtwatch.watchdog.aggregate import exchange_interval
    from dtwatch.watchdog.exchange import AGGREGATOR, Exchange, StoreClient

    job = SimJob(cfg.nodes, t0=cfg.t0)
    log: list[tuple[float, int, int]] = []  # per exchange: (time, requests, bytes)
    rec = out[n] = {"log": log, "verdict": None, "rounds": [], "published": None, "partial": None, "errors": 0,
                    "error": "", "role": "", "term": 0}
    next_poll = time.time() + random.Random(n).random() * POLL
    ex: Exchange | None = None
    old: OldExchange | None = None
    if cfg.mode == "after":
        ex = live[n] = Exchange("127.0.0.1", cfg.port, JOB_ID, f"node{n}", interval=INTERVAL, timeout=300.0)
        client = ex.client
    else:
        client = live[n] = StoreClient("127.0.0.1", cfg.port, timeout=300.0)
        old = OldExchange(client, f"node{n}")
    payload, payload_hung, last = b"", False, float("-inf")
    incident = None
    remote: list = []
    local: list = []
    while not stop.is_set():
        time.sleep(max(0.0, next_poll - time.time()))
        next_poll += POLL
        now = time.time()
        if hang_at.value and job.hung is None:
            job.hang(cfg.culprit, hang_at.value)
        if ex is not None:
            leading = lead or ex.role == AGGREGATOR  # node 0 diagnoses every poll; so does whoever took over
            due = now - ex.last >= INTERVAL
            if not (leading or due or (ex.suspect and now - ex.last_read >= INTERVAL / 4)):
                if not ex.suspect:  # sleep through the polls where nothing can be due (fewer wake-ups to simulate)
                    while next_poll < ex.last + INTERVAL:
                        next_poll += POLL
                continue
            if leading or due or not local:
                local = job.states(n, now)  # a read between exchanges uses only the ranks' numbers
            r0, b0 = client.stats.requests, client.stats.bytes_in + client.stats.bytes_out
            try:
                view = ex.step(local, now, window=cfg.window, incident=incident)
            except Exception as exc:  # noqa: BLE001 - as the watchdog: counted, tried again at the next poll
                rec["errors"] += 1
                rec["error"] = repr(exc)
                continue
            if view is not None:
                if not log:
                    started_q.put(n)
                log.append((now, client.stats.requests - r0, client.stats.bytes_in + client.stats.bytes_out - b0))
                if rec["verdict"] is None and _verdict_names(view.head, cfg.culprit):
                    rec["verdict"] = time.time()
                if view.head is not None:
                    rec["term"] = max(rec["term"], view.head.term)
                if leading:
                    remote = view.remote_states()
        elif old is not None:
            local = job.states(n, now) if lead or now - last >= INTERVAL else []
            busy = any(s.open_calls for s in local)  # the old cadence: 2 s while a rank is in a collective, else 10 s
            if local and now - last >= exchange_interval(INTERVAL, busy=busy):
                last = now
                hung = job.hung is not None and now >= job.hang_time
                if not payload or hung != payload_hung:
                    payload, payload_hung = OldExchange.payload(local), hung
                r0, b0 = client.stats.requests, client.stats.bytes_in + client.stats.bytes_out
                old.publish(payload)
                if hung and rec["published"] is None:
                    rec["published"] = time.time()
                started = time.time()
                rec["partial"] = (started, r0, b0)
                if not rec["rounds"] and not log:
                    started_q.put(n)
                fetched = old.fetch(stop, decode=lead)
                if fetched is None:
                    break
                rec["partial"] = None
                rec["rounds"].append((started, time.time()))
                log.append((now, client.stats.requests - r0, client.stats.bytes_in + client.stats.bytes_out - b0))
                if lead:
                    remote = fetched
        if lead or (ex is not None and ex.role == AGGREGATOR):  # what the watchdog does every poll with its ranks
            # and the others'
            states = sorted(local + remote, key=lambda s: s.rank)
            result = diagnose(states, now, cfg.window)
            straggler_warning(entry_lags(states), now)
            uneven_loader_warnings(states, now)
            if incident is None and result.stalled and result.findings:
                incident = {"id": incident_id(result.findings[0], states), "verdict": "stall",
                            "findings": result.findings}
                if ex is not None and any(cfg.culprit in f.ranks for f in result.findings):
                    rec["verdict"] = rec["verdict"] or time.time()
    if ex is not None:
        rec["role"] = ex.role
        ex.close()


def _snapshot(out: dict, live: dict) -> dict:
    """The nodes' records, copied (threads may still run); a round still under way as (start, requests, bytes)."""
    snap = {}
    for n, rec in list(out.items()):
        d = {k: (list(v) if isinstance(v, list) else v) for k, v in list(rec.items())}
        client = live.get(n)
        stats = getattr(client, "stats", None)
        if d["partial"] is not None and stats is not None:
            started, r0, b0 = d["partial"]
            d["partial"] = (started, stats.requests - r0, stats.bytes_in + stats.bytes_out - b0)
        snap[n] = d
    return snap


def nodes_main(cfg: Config, node_ids: list[int], lead: bool, hang_at, stop, out_q, ready_q) -> None:
    _pin(1)
    import logging
    import resource

    logging.basicConfig(level=logging.INFO if os.environ.get("SCALE_DEBUG") else logging.WARNING,
                        format="%(asctime)s %(processName)s %(threadName)s %(message)s")
    if os.environ.get("SCALE_DEBUG_SLOWOPS"):
        sys.path.insert(0, os.path.dirname(os.environ["SCALE_DEBUG_SLOWOPS"]))
        __import__("slowops")
    out: dict = {}
    live: dict = {}
    import queue

    started_q: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=node_loop, args=(n, cfg, hang_at, stop, lead, out, live, started_q),
                                daemon=True) for n in node_ids]
    for t in threads:
        t.start()
    for _ in node_ids:  # every node connected and through its first exchange before anything is measured
        started_q.get(timeout=300)
    cpu: list[tuple[float, float, int, int]] = []  # (time, process CPU s, lease renewal requests, bytes)
    lease_req = lease_bytes = 0
    ready_q.put(len(node_ids))
    while not stop.wait(0.5):
        if lead:
            ru = resource.getrusage(resource.RUSAGE_SELF)
            beat = getattr(live.get(0), "heartbeat", None)
            if beat is not None:
                stats = beat.client.stats
                lease_req, lease_bytes = stats.requests, stats.bytes_in + stats.bytes_out
            cpu.append((time.time(), ru.ru_utime + ru.ru_stime, lease_req, lease_bytes))
    deadline = time.time() + 20
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.time()))
    out_q.put(("nodes", {"out": _snapshot(out, live), "cpu": cpu}))


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
    stop_store, stop_probe, stop_nodes = ctx.Event(), ctx.Event(), ctx.Event()
    port_q, out_q, ready_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    hang_at = ctx.Value("d", 0.0)
    store = ctx.Process(target=store_main, args=(port_q, stop_store), daemon=True)
    store.start()
    port = port_q.get(timeout=60)
    probe = ctx.Process(target=probe_main, args=(port, out_q, ready_q, stop_probe, 0.01), daemon=True)
    probe.start()
    ready_q.get(timeout=120)
    t_base0 = time.time()
    time.sleep(args.baseline)
    t_base1 = time.time()
    culprit = (nodes // 2) * RANKS_PER_NODE + 3
    cfg = Config(mode, nodes, port, time.time() - 60.0, args.window, culprit)
    procs = [ctx.Process(target=nodes_main, args=(cfg, [0], True, hang_at, stop_nodes, out_q, ready_q), daemon=True)]
    procs[0].start()
    ready_q.get(timeout=120)
    time.sleep(1.5 * POLL)  # node 0 exchanges first: it holds the lease
    rest = list(range(1, nodes))
    k = max(1, min(args.procs, len(rest)))
    for i in range(k):
        p = ctx.Process(target=nodes_main, args=(cfg, rest[i::k], False, hang_at, stop_nodes, out_q, ready_q),
                        daemon=True)
        p.start()
        procs.append(p)
    for _ in range(k):
        ready_q.get(timeout=300)
    time.sleep(args.warmup)
    t_h0 = time.time()
    store_cpu0 = _proc_cpu(store.pid or 0)
    time.sleep(args.healthy)
    t_h1 = time.time()
    hang_at.value = t_h1
    job = SimJob(nodes, t0=cfg.t0)
    job.hang(culprit, t_h1)
    hang_time = job.hang_time
    deadline = hang_time + args.window + args.cap
    say(f"  {mode} N={nodes}: hang at +{hang_time - t_h0:.1f}s; waiting {deadline - time.time():.0f}s for the verdict")
    time.sleep(max(0.0, deadline - time.time()))  # the nodes record when they saw it; stopping early would cut that
    t_end = time.time()
    store_cpu = (_proc_cpu(store.pid or 0) - store_cpu0) / (t_end - t_h0) * 100
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
    return summarize(mode, nodes, results, lead_cpu, samples, (t_base0, t_base1), (t_h0, t_h1), hang_time, t_end,
                     store_cpu, args)


def summarize(mode, nodes, results, lead_cpu, samples, base, healthy, hang_time, t_end, store_cpu, args) -> dict:
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
    cpu_rows = [c for c in lead_cpu if c[0] >= t_h0]
    cpu_pct = lease_req = lease_bytes = None
    if len(cpu_rows) >= 2:
        (ta, ca, ra, ba), (tb, cb, rb, bb) = cpu_rows[0], cpu_rows[-1]
        cpu_pct = (cb - ca) / (tb - ta) * 100
        lease_req, lease_bytes = (rb - ra) / (tb - ta) * INTERVAL, (bb - ba) / (tb - ta) * INTERVAL
        if requests is not None and mode == "after":
            requests += lease_req
            nbytes = (nbytes or 0) + lease_bytes
    # The verdict on every node.
    if mode == "after":
        seen = [rec["verdict"] for rec in results.values()]
        latency = max(seen) - hang_time if seen and all(seen) else None
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
        raw = {"samples": samples, "t": [base, healthy, hang_time, t_end],
               "verdicts": {n: r["verdict"] for n, r in results.items()}}
        Path(os.environ["SCALE_SAVE"]).write_text(json.dumps(raw))
    errors = [rec["error"] for rec in results.values() if rec["errors"]]
    if os.environ.get("SCALE_DEBUG"):
        for n in sorted(results)[:6]:
            rec = results[n]
            exchanges = [(round(t - t_h0, 1), r, b) for t, r, b in rec["log"]][:20]
            print(n, rec["role"], rec["errors"], rec["error"][:200], rec["verdict"], exchanges, file=sys.stderr)
    with_ = [dt * 1000 for t, dt in samples if t_h0 <= t <= t_end]
    without = [dt * 1000 for t, dt in samples if base[0] <= t <= base[1]]
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
                   "nodes_with_errors": len(errors),
                   "an_error": errors[0] if errors else "",
                   "probe_samples_without": len(without),
                   "nodes_planned_not_measured": planned, "nodes_with_verdict_or_rounds": verdicts,
                   "probe_p50_ms_without": _r(_pct(without, 0.5)),
                   "lease_requests_per_interval": round(lease_req, 1) if lease_req is not None else None,
                   "cap_s": round(hang_time + args.window + args.cap - hang_time, 1)},
    }


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
    ap.add_argument("--baseline", type=float, default=8.0, help="seconds of the probe alone (default 8)")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds after every node started (default 4)")
    ap.add_argument("--healthy", type=float, default=12.0, help="seconds of healthy training measured (default 12)")
    ap.add_argument("--cap", type=float, default=15.0, help="seconds after window to wait for the verdict (default 15)")
    ap.add_argument("--procs", type=int, default=4, help="processes for the simulated nodes 1..N-1 (default 4)")
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
