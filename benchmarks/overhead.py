#!/usr/bin/env python
"""What dtwatch's in-process recorder costs: per wrapped collective, and per DDP training step.

    python benchmarks/overhead.py              # table
    python benchmarks/overhead.py --json out.json
    python benchmarks/overhead.py --quick      # fewer repetitions (smoke run)

(a) Per call, in this process, on a one-rank gloo group (a real process group with real sequence
    numbers; torch's "fake" backend is cheaper but has no sequence numbers, so dtwatch would skip part
    of its work there and the figure would flatter it). For each op the unwrapped original and the
    dtwatch wrapper are timed in alternating blocks (order flipped every block, GC off) and the median
    ns per call of each is reported. "Hot path alone" wraps a no-op with ``_make_wrapper`` so the
    collective's own cost is excluded: that is the figure to compare with the <= 1 us target.

(b) Per DDP step: 2 ranks via torchrun on CPU, a ~1M-parameter MLP, batch 64, a DataLoader with a
    DistributedSampler, SGD, and one Python all_reduce of the loss per step (as logging code does).
    Inside the same processes, blocks of steps alternate between dtwatch installed and uninstalled
    (order flipped every pair), so both modes see the same machine state. Reported: median step time
    of each mode and the % difference (target <= 0.5%), plus the median and spread of the per-pair
    differences as a noise indicator. torch's Flight Recorder is on in both modes (dtwatch turns it on
    before init_process_group; it cannot be switched per block) and is not part of this figure.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------------------------------------
# (a) per call
# ---------------------------------------------------------------------------------------------------
def _alternate(fa, fb, blocks: int, n: int) -> tuple[list[float], list[float]]:
    """ns per call of fa and fb, measured in alternating blocks of n calls (order flipped each block)."""
    times = _alternate_modes({"a": (_nothing, fa), "b": (_nothing, fb)}, blocks, n)
    return times["a"], times["b"]


def _nothing() -> None:
    return None


def _alternate_modes(modes: dict[str, tuple[Callable[[], None], Callable[[], Any]]], blocks: int,
                     n: int) -> dict[str, list[float]]:
    """ns per call of each mode's function, in blocks of n calls; each block first runs the mode's set-up (e.g.
    registering torch's collective hooks), outside the timing. The order of the modes turns every block."""
    out: dict[str, list[float]] = {name: [] for name in modes}
    names = list(modes)
    clock = time.perf_counter_ns
    for name in names:  # warm-up
        setup, fn = modes[name]
        setup()
        for _ in range(min(n, 200)):
            fn()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for b in range(blocks):
            k = b % len(names)
            for name in names[k:] + names[:k]:
                setup, fn = modes[name]
                setup()
                t0 = clock()
                for _ in range(n):
                    fn()
                out[name].append((clock() - t0) / n)
    finally:
        if gc_was:
            gc.enable()
    return out


def _row(base: list[float], wrapped: list[float]) -> dict:
    b, w = statistics.median(base), statistics.median(wrapped)
    pair = [wi - bi for bi, wi in zip(base, wrapped, strict=True)]
    q = statistics.quantiles(pair, n=4) if len(pair) >= 4 else [min(pair), 0, max(pair)]
    return {
        "baseline_ns": round(b, 1), "wrapped_ns": round(w, 1), "added_us": round((w - b) / 1000, 3),
        "ratio": round(w / b, 3), "added_us_iqr": [round(q[0] / 1000, 3), round(q[2] / 1000, 3)],
        "blocks": len(base),
    }


def _rows(times: dict[str, list[float]]) -> dict:
    """Each path's row against torch alone (``times["torch"]``), and torch's own ns per call."""
    base = times["torch"]
    rows = {path: _row(base, t) for path, t in times.items() if path != "torch"}
    return {"torch_ns": round(statistics.median(base), 1), **rows}


def _long_function_caller(fn, arg):
    """A zero-argument callable whose call of ``fn(arg)`` sits at the end of a 60-statement function."""
    body = "\n".join(f"        v{i} = {i} * 1.5 + len('value {i}')" for i in range(60))
    src = f"def caller():\n    if never:\n{body}\n    return fn(arg)\n"
    scope = {"never": False, "fn": fn, "arg": arg, "len": len}
    # A file name of user code (a "<...>" pseudo-file is not user code to dtwatch); it need not exist.
    exec(compile(src, os.path.join(tempfile.gettempdir(), "train_long_function.py"), "exec"), scope)
    return scope["caller"]


def _through_library_caller(fn, arg, depth: int = 2):
    """A zero-argument callable (user code) that calls ``fn(arg)`` through ``depth`` frames of a
    third-party library (a file under ``site-packages``), as ``fabric.barrier()`` reaches ``torch.distributed``."""
    lib_src = "".join(f"def level{i}(fn, arg):\n    return level{i + 1}(fn, arg)\n\n" for i in range(depth - 1))
    lib_src += f"def level{depth - 1}(fn, arg):\n    return fn(arg)\n"
    lib: dict = {}
    lib_file = os.path.join(tempfile.gettempdir(), "site-packages", "wrapperlib", "strategy.py")
    exec(compile(lib_src, lib_file, "exec"), lib)
    scope = {"barrier": lib["level0"], "fn": fn, "arg": arg}
    exec(compile("def caller():\n    return barrier(fn, arg)\n",
                 os.path.join(tempfile.gettempdir(), "train_with_library.py"), "exec"), scope)
    return scope["caller"]


def _original(wrapper: Any) -> Callable[..., Any]:
    """The torch function a dtwatch wrapper replaced (kept on the wrapper as ``__dtwatch_original__``)."""
    return wrapper.__dtwatch_original__


def bench_per_call(blocks: int, calls: int, noop_calls: int, backend: str = "gloo") -> dict:
    import torch
    import torch.distributed as dist

    import dtwatch
    from dtwatch.ops import OpSpec, bind
    from dtwatch.record import installation, native

    def spec_of(name: str, fn: Callable[..., Any]) -> OpSpec:
        spec = bind(name, fn)
        assert spec is not None, f"dtwatch does not understand the signature of {name}"
        return spec

    warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor is deprecated in new torch
    os.environ.setdefault("DTWATCH_WATCHDOG", "off")
    os.environ.setdefault("DTWATCH_STACK_SIGNAL", "off")
    tmp = tempfile.mkdtemp(prefix="dtwatch-bench-")
    os.environ["DTWATCH_DIR"] = tmp
    os.environ["DTWATCH_JOB_ID"] = "per-call"
    assert dtwatch.install(), "dtwatch was already installed in this process"
    if backend == "gloo_async":
        import dtwatch.testing
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.TCPStore("127.0.0.1", 0, 1, True))
    c10d = dist.distributed_c10d
    rec = installation.active()
    assert rec is not None, "dtwatch.install() left no active recorder"
    fastpath = native.load() if rec.config.native != "off" else None
    t = torch.ones(1)
    out = torch.empty(1)

    def library(depth: int) -> Callable[[Callable[..., Any]], Callable[[], Any]]:
        return lambda f: _through_library_caller(f, t, depth)

    # (case, the op whose wrapper it times, how a call is made from the function under test)
    cases: list[tuple[str, str, Callable[[Callable[..., Any]], Callable[[], Any]]]] = [
        ("all_reduce", "all_reduce", lambda f: (lambda: f(t))),
        ("all_reduce, async + wait", "all_reduce", lambda f: (lambda: f(t, async_op=True).wait())),
        ("all_reduce via 2 library frames", "all_reduce", library(2)),
        ("all_reduce via 6 library frames", "all_reduce", library(6)),
        ("barrier", "barrier", lambda f: (lambda: f())),
        ("broadcast", "broadcast", lambda f: (lambda: f(t, 0))),
        ("all_gather_into_tensor", "all_gather_into_tensor", lambda f: (lambda: f(out, t))),
        ("all_gather_object", "all_gather_object", lambda f: (lambda: f([None], 1))),
    ]
    result: dict = {"collective": {}, "hot_path": {}, "backend": backend,
                    "completion_tracked": bool(getattr(rec, "tracked", None)),
                    "native_loaded": fastpath is not None, "native_load_error": native.load_error()}
    # torch >= 2.14: dtwatch registers torch's collective hooks on the group (dtwatch.record.hooks), which torch
    # then calls for every collective, the wrapped ones too. "Torch alone" is timed with them removed.
    hooks, pg = rec.hooks, c10d._get_default_group()
    result["collective_hooks"] = hooks is not None

    def hooks_on() -> None:
        if hooks is not None:
            hooks.add(pg)

    def hooks_off() -> None:
        if hooks is not None:
            hooks.remove(pg)

    def paths(name: str, fn: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
        """The native and the Python wrapper of ``fn`` as op ``name`` (the native one where the op takes it)."""
        spec = spec_of(name, _original(getattr(dist, name)))
        found = {"native": native.make_native_wrapper(fastpath, rec, fn, spec),
                 "python": installation._make_wrapper(rec, fn, spec)}
        return {path: w for path, w in found.items() if w is not None}

    def noop(*args: Any, **kwargs: Any) -> Any:
        return None

    for case, name, make in cases:
        original = _original(getattr(dist, name))
        modes = {"torch": (hooks_off, make(original))}
        modes.update({path: (hooks_on, make(w)) for path, w in paths(name, original).items()})
        times = _alternate_modes(modes, blocks, calls)
        result["collective"][case] = _rows(times)
        if case.startswith("all_reduce,"):
            continue
        hot = _alternate_modes({"torch": (hooks_off, make(noop))} | {
            path: (hooks_off, make(w)) for path, w in paths(name, noop).items()}, blocks, noop_calls)
        result["hot_path"][case] = _rows(hot)
    if hooks is not None:
        result["hooks"] = bench_hooks(hooks_on, hooks_off, t, pg, blocks, calls)
    hooks_on()
    # The other per-step costs of a training loop: the optimizer-step hook (a step marker), and the
    # sampler thread's tick (it runs every sample_interval seconds and takes the GIL while it works).
    base, hooked = _alternate(lambda: None, lambda: rec.advance_step(explicit=False), blocks, noop_calls)
    result["step_hook"] = _row(base, hooked)
    sampler = rec.sampler
    assert sampler is not None, "the recorder runs no sampler thread"
    base, ticked = _alternate(lambda: None, sampler.tick, blocks, max(calls // 4, 20))
    result["sampler_tick"] = _row(base, ticked)
    result["sampler_tick"]["interval_s"] = rec.config.sample_interval
    result["sampler_tick"]["duty_pct"] = round(
        result["sampler_tick"]["added_us"] / 1e6 / rec.config.sample_interval * 100, 4)
    # Call sites in real training code sit late in long functions; site resolution must not cost more
    # there (CPython neither caches a code object's hash nor makes f_lineno cheap late in a function).
    late = _alternate_modes({"torch": (hooks_off, _long_function_caller(noop, t))} | {
        path: (hooks_off, _long_function_caller(w, t)) for path, w in paths("all_reduce", noop).items()},
        blocks, noop_calls)
    result["hot_path"]["all_reduce, late in a 60-line function"] = _rows(late)
    # A DataLoader epoch starting: dtwatch's __iter__ wrapper notes the loader (and its setup facts, and hands
    # the first batch to a background thread to be fingerprinted); timed as iterator creation + first batch.
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(torch.randn(1024, 64), torch.randint(0, 10, (1024,)))
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    iter_original = next(o for owner, attr, o, _w in rec.patched if owner is DataLoader and attr == "__iter__")
    base, wrapped = _alternate(lambda: next(iter_original(loader)), lambda: next(iter(loader)), blocks,
                               max(calls // 8, 10))
    result["loader_epoch"] = _row(base, wrapped)
    records = len(dtwatch.read_ring(os.path.join(tmp, "per-call", "rank-00000.ring")).records)
    assert records > 0, "the wrapped calls did not record"
    dtwatch.uninstall()
    dist.destroy_process_group()
    assert not hasattr(c10d.all_reduce, "__dtwatch_original__")
    return result


def bench_hooks(hooks_on: Callable[[], None], hooks_off: Callable[[], None], t: Any, pg: Any, blocks: int,
                calls: int) -> dict:
    """What torch's collective hooks cost per call, against the wrapper, in one run (all_reduce of one float):
    torch alone; the wrapper without hooks; the wrapper with the hooks registered (the default: the pre-hook
    leaves a wrapped call); a call only the hook records (torch's own function, unwrapped: what a DDP reducer
    or a functional collective costs); and a functional all_reduce (issue + wait) without and with the hooks."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    wrapper = dist.all_reduce
    original = _original(wrapper)
    times = _alternate_modes({
        "torch": (hooks_off, lambda: original(t)),
        "wrapper": (hooks_off, lambda: wrapper(t)),
        "wrapper+hooks": (hooks_on, lambda: wrapper(t)),
        "hook": (hooks_on, lambda: original(t)),
        "functional": (hooks_off, lambda: funcol.all_reduce(t, "sum", pg).wait()),
        "functional+hook": (hooks_on, lambda: funcol.all_reduce(t, "sum", pg).wait()),
    }, blocks, calls)
    return {
        "wrapper, no hooks": _row(times["torch"], times["wrapper"]),
        "wrapper, hooks registered (default)": _row(times["torch"], times["wrapper+hooks"]),
        "hook alone (unwrapped call)": _row(times["torch"], times["hook"]),
        "functional all_reduce, hook": _row(times["functional"], times["functional+hook"]),
    }


# ---------------------------------------------------------------------------------------------------
# (b) DDP step (worker side, run under torchrun)
# ---------------------------------------------------------------------------------------------------
FSDP_LAYERS = 32


def ddp_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import dtwatch

    dtwatch.install()  # before init_process_group, as a user would (torch's FR is on from here on)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model: torch.nn.Module
    if args.model == "fsdp2":
        # FSDP2 with many small layers: each layer's all_gather (forward and backward) and reduce_scatter is a
        # Python-issued collective, ~100 per step, the case where a per-call cost shows.
        from torch.distributed.fsdp import fully_shard

        layers = [torch.nn.Linear(64, 64) for _ in range(FSDP_LAYERS)]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 10))
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        features = 64
    else:
        model = DDP(torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        ))
        features = 512
    params = sum(p.numel() for p in model.parameters()) * (world if args.model == "fsdp2" else 1)
    batch = 64
    n_samples = batch * args.steps * world
    data = TensorDataset(torch.randn(n_samples, features), torch.randint(0, 10, (n_samples,)))
    sampler: DistributedSampler[int] = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    epoch = 0

    def block() -> tuple[list[float], list[float]]:
        """One pass over the loader: wall and CPU seconds per step."""
        nonlocal epoch
        sampler.set_epoch(epoch)
        epoch += 1
        times: list[float] = []
        cpu: list[float] = []
        prev, prev_cpu = time.perf_counter(), time.process_time()
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            logged = loss.detach()
            dist.all_reduce(logged)  # a Python collective per step, as loss logging does
            now, now_cpu = time.perf_counter(), time.process_time()
            times.append(now - prev)
            cpu.append(now_cpu - prev_cpu)
            prev, prev_cpu = now, now_cpu
        return times, cpu

    def set_mode(on: bool) -> None:
        if on and not dtwatch.is_installed():
            dtwatch.install()
        elif not on and dtwatch.is_installed():
            dtwatch.uninstall()
        getattr(dist.barrier, "__dtwatch_original__", dist.barrier)()  # lines the ranks up, unrecorded

    for _ in range(args.warmup_blocks):
        block()
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpu_times: dict[str, list[float]] = {"on": [], "off": []}
    block_medians: dict[str, list[float]] = {"on": [], "off": []}
    gc.collect()
    for b in range(args.blocks):
        order = ("on", "off") if b % 2 == 0 else ("off", "on")
        for mode in order:
            set_mode(mode == "on")
            t, c = block()
            times[mode] += t
            cpu_times[mode] += c
            block_medians[mode].append(statistics.median(t))
    set_mode(True)
    recorded = 0
    if rank == 0:
        ring = os.path.join(os.environ["DTWATCH_DIR"], os.environ["DTWATCH_JOB_ID"], "rank-00000.ring")
        snap = dtwatch.read_ring(ring)
        recorded = len(snap.records)
        with open(args.out, "w") as f:
            json.dump({"params": params, "batch": batch, "world": world, "times": times, "cpu_times": cpu_times,
                       "block_medians": block_medians, "records_last_ring": recorded}, f)
    dist.destroy_process_group()


@contextlib.contextmanager
def exporters_running(run_root: str, job_id: str) -> Iterator[dict[str, int]]:
    """A real watchdog for the job with its Prometheus endpoint scraped every second and OTLP/HTTP export
    to a local sink (every span and metric export is accepted), as in production with exporters on."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    stats = {"otlp_posts": 0, "scrapes": 0}

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            stats["otlp_posts"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *a) -> None:
            pass

    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTWATCH_", "OTEL_"))}
    env.update(OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink.server_address[1]}")
    os.makedirs(os.path.join(run_root, job_id), exist_ok=True)
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "dtwatch", "watch", "--dir", run_root, "--job-id", job_id, "--metrics-port", "0",
         "--metrics-addr", "127.0.0.1", "--idle-exit", "0", "--store", "none"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    ready = os.path.join(run_root, job_id, f"watchdog-{socket.gethostname()}.json")
    deadline = time.time() + 30
    while not os.path.exists(ready) and time.time() < deadline:
        time.sleep(0.05)
    url = json.load(open(ready)).get("url")
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(1.0):
            try:
                urllib.request.urlopen(url, timeout=5).read()
                stats["scrapes"] += 1
            except OSError:
                pass

    threading.Thread(target=scrape, daemon=True).start()
    try:
        yield stats
    finally:
        stop.set()
        watchdog.terminate()
        watchdog.wait(timeout=30)
        sink.shutdown()


def _exporters(run_root: str, job_id: str, on: bool) -> contextlib.AbstractContextManager[dict[str, int]]:
    return exporters_running(run_root, job_id) if on else contextlib.nullcontext({})


def bench_ddp(blocks: int, steps: int, warmup_blocks: int, timeout: float, exporters: bool = False,
              model: str = "ddp", extra_env: dict[str, str] | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="dtwatch-bench-ddp-") as tmp, \
            _exporters(tmp, "ddp", exporters) as export_stats:
        out = os.path.join(tmp, "ddp.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DTWATCH_", "TORCH_FR", "TORCH_NCCL"))}
        env.update(DTWATCH_DIR=tmp, DTWATCH_JOB_ID="ddp", DTWATCH_WATCHDOG="off", DTWATCH_STACK_SIGNAL="off",
                   OMP_NUM_THREADS="1", LOGLEVEL="WARNING")
        env.update(extra_env or {})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(HERE), "--ddp-worker", "--out", out, "--blocks", str(blocks), "--steps", str(steps),
               "--warmup-blocks", str(warmup_blocks), "--model", model]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise SystemExit(f"DDP benchmark failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            raw = json.load(f)
    on, off = raw["times"]["on"], raw["times"]["off"]
    m_on, m_off = statistics.median(on), statistics.median(off)
    c_on, c_off = statistics.median(raw["cpu_times"]["on"]), statistics.median(raw["cpu_times"]["off"])
    pairs = [(a - b) / b * 100 for a, b in zip(raw["block_medians"]["on"], raw["block_medians"]["off"], strict=True)]
    q = statistics.quantiles(pairs, n=4) if len(pairs) >= 4 else [min(pairs), 0, max(pairs)]
    return {
        "model": model, "params": raw["params"], "batch": raw["batch"], "ranks": raw["world"],
        "blocks_per_mode": blocks,
        "steps_per_block": steps, "steps_per_mode": len(on),
        "median_step_ms_on": round(m_on * 1000, 3), "median_step_ms_off": round(m_off * 1000, 3),
        "overhead_pct": round((m_on - m_off) / m_off * 100, 3),
        "median_cpu_ms_on": round(c_on * 1000, 3), "median_cpu_ms_off": round(c_off * 1000, 3),
        "cpu_overhead_pct": round((c_on - c_off) / c_off * 100, 3),
        "paired_block_overhead_pct_median": round(statistics.median(pairs), 3),
        "paired_block_overhead_pct_iqr": [round(q[0], 3), round(q[2], 3)],
        "records_in_ring": raw["records_last_ring"],
        "exporters": dict(export_stats) if exporters else None,
    }


# ---------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------
def print_table(res: dict) -> None:
    env = res["environment"]
    print(f"dtwatch recorder overhead  (torch {env['torch']}, Python {env['python']}, {env['cpus']} CPUs, "
          f"{env['machine']})")
    print()
    pc = res["per_call"]
    print(f"(a) per call, one-rank {pc['backend']} group; median over alternating blocks. Added: what dtwatch adds "
          "to torch alone (us, and as % of torch's own per-call time), by the native path and by the Python path")
    if not pc["native_loaded"]:
        print(f"  (the native path did not load: {pc['native_load_error']})")
    header = f"  {'':<34} {'torch us':>9} {'native +us':>11} {'(%)':>7} {'python +us':>11} {'(%)':>7}"
    for title, key in (("wrapped collective (collective included)", "collective"),
                       ("hot path alone (wrapper around a no-op; target <= 0.5 us native, <= 1 us via 6 frames)",
                        "hot_path")):
        print(f" {title}")
        print(header)
        for case, r in pc[key].items():
            cells = []
            for path in ("native", "python"):
                row = r.get(path)
                pct = f"{(row['wrapped_ns'] - row['baseline_ns']) / row['baseline_ns'] * 100:.0f}%" if row and \
                    key == "collective" else ""
                cells.append(f"{row['added_us']:>11.3f} {pct:>7}" if row else f"{'-':>11} {'':>7}")
            print(f"  {case:<34} {r['torch_ns'] / 1000:>9.2f} {cells[0]} {cells[1]}")
    hooks = res["per_call"].get("hooks")
    if hooks:
        print(" torch's collective hooks (torch >= 2.14), all_reduce of one float, against torch alone")
        print(header)
        for what, r in hooks.items():
            lo, hi = r["added_us_iqr"]
            print(f"  {what}")
            print(f"  {'':<24} {r['baseline_ns']:>12.0f} {r['wrapped_ns']:>11.0f} {r['added_us']:>9.3f} "
                  f"{r['ratio']:>6.2f}   [{lo:.3f}, {hi:.3f}]")
    h, t = res["per_call"]["step_hook"], res["per_call"]["sampler_tick"]
    print(f" other costs: optimizer-step hook {h['added_us']:.3f} us per step; sampler tick {t['added_us']:.1f} us "
          f"every {t['interval_s']} s = {t['duty_pct']:.3f} % of one core")
    ld = res["per_call"].get("loader_epoch")
    if ld:
        lo, hi = ld["added_us_iqr"]
        print(f" a DataLoader epoch starting (iterator + first batch): {ld['baseline_ns'] / 1000:.1f} us, "
              f"+{ld['added_us']:.1f} us with dtwatch (IQR [{lo:.1f}, {hi:.1f}])")
    exporting = " with a watchdog exporting (Prometheus scraped 1/s, OTLP/HTTP)"
    for key, label in (("ddp", ""), ("fsdp2", ""), ("ddp_exporters", exporting)):
        d = res.get(key)
        if not d:
            continue
        print()
        what = "DDP" if key != "fsdp2" else f"FSDP2 ({FSDP_LAYERS} small layers, each fully_shard-ed)"
        print(f"(b) {what} training step, {d['ranks']} ranks (torchrun, gloo, CPU), {d['params'] / 1e6:.2f}M params, "
              f"batch {d['batch']}, {d['steps_per_mode']} steps per mode in {d['blocks_per_mode']} "
              f"alternating blocks{label}")
        print(f"  median step, dtwatch installed : {d['median_step_ms_on']:.3f} ms")
        print(f"  median step, dtwatch removed   : {d['median_step_ms_off']:.3f} ms")
        target = "1" if key == "fsdp2" else "0.5"
        print(f"  overhead                       : {d['overhead_pct']:+.2f} %   (target <= {target} %)")
        lo, hi = d["paired_block_overhead_pct_iqr"]
        print(f"  per block pair (noise)         : median {d['paired_block_overhead_pct_median']:+.2f} %, "
              f"IQR [{lo:+.2f}, {hi:+.2f}] %")
        if "estimated_overhead_pct" in d:
            print(f"  estimate from (a)              : {d['estimated_overhead_pct']:+.3f} %   "
                  "(1 wrapped all_reduce + step hook per step, plus the sampler's duty)")
        if d.get("exporters"):
            print(f"  exporters during the run       : {d['exporters']['scrapes']} scrapes, "
                  f"{d['exporters']['otlp_posts']} OTLP posts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout only)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, noisier)")
    ap.add_argument("--blocks", type=int, default=None, help="(a) alternating blocks per op (default 40)")
    ap.add_argument("--calls", type=int, default=None, help="(a) calls per block, collectives (default 400)")
    ap.add_argument("--noop-calls", type=int, default=None, help="(a) calls per block, hot path (default 5000)")
    ap.add_argument("--ddp-blocks", type=int, default=None, help="(b) blocks per mode (default 40)")
    ap.add_argument("--ddp-steps", type=int, default=None, help="(b) steps per block (default 15)")
    ap.add_argument("--no-ddp", action="store_true", help="skip (b)")
    ap.add_argument("--no-fsdp", action="store_true", help="skip (b)'s FSDP2 step")
    ap.add_argument("--backend", choices=("gloo", "gloo_async"), default="gloo",
                    help="(a) the one-rank group's backend: gloo_async (dtwatch.testing, NCCL's execution "
                         "model) times the completion-tracked path")
    ap.add_argument("--exporters", action="store_true",
                    help="also run (b) with a real watchdog exporting (Prometheus scraped, OTLP/HTTP to a local sink)")
    # worker side of (b)
    ap.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=("ddp", "fsdp2"), default="ddp", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=30, help=argparse.SUPPRESS)
    ap.add_argument("--warmup-blocks", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ddp_worker:
        args.blocks = args.blocks or 12
        ddp_worker(args)
        return

    quick = args.quick
    blocks = args.blocks or (10 if quick else 40)
    calls = args.calls or (100 if quick else 400)
    noop_calls = args.noop_calls or (1000 if quick else 5000)
    ddp_blocks = args.ddp_blocks or (4 if quick else 40)
    ddp_steps = args.ddp_steps or (10 if quick else 15)

    import torch

    res: dict = {
        "environment": {
            "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "per_call": bench_per_call(blocks, calls, noop_calls, args.backend),
    }
    if not args.no_ddp:
        d = res["ddp"] = bench_ddp(ddp_blocks, ddp_steps, 1 if quick else 2, timeout=600)
        pc = res["per_call"]
        row = pc["collective"]["all_reduce"]
        per_step_us = row.get("native", row["python"])["added_us"] + pc["step_hook"]["added_us"]
        d["estimated_overhead_pct"] = round(
            per_step_us / 1000 / d["median_step_ms_off"] * 100 + pc["sampler_tick"]["duty_pct"], 4)
        if not args.no_fsdp:
            res["fsdp2"] = bench_ddp(ddp_blocks, ddp_steps, 1 if quick else 2, timeout=900, model="fsdp2")
        if args.exporters:
            # Exporters live in the watchdog process: the training process's cost must not change.
            res["ddp_exporters"] = bench_ddp(ddp_blocks, ddp_steps, 1 if quick else 2, timeout=600, exporters=True)
    print_table(res)
    if args.json:
        text = json.dumps(res, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
