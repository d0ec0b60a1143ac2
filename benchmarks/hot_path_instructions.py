#!/usr/bin/env python
"""Instructions per call of dtwatch's recording hot path, counted by valgrind (not timed).

    python benchmarks/hot_path_instructions.py            # table (about 2 minutes per row on 2 cores)
    python benchmarks/hot_path_instructions.py --json out.json

``benchmarks/overhead.py`` times the hot path in alternating blocks; on a shared or loaded machine those timings
move by tens of percent. Instruction counts do not: callgrind counts the same total for the same binary, inputs
and environment whatever else the machine runs, so a change's before and after can be compared across runs.

Each row runs in its own process under ``valgrind --tool=callgrind``, collecting only inside ``functools.reduce``,
whose one step runs the loop (so torch's import and dtwatch's set-up are not counted, and the step's own cost, the
same in every row, cancels): CALLS calls of a no-op wrapped as
``all_reduce`` by the native wrapper, by the Python wrapper, and the no-op alone, each called directly and
through 6 library frames. Added per call = (instructions of a path - instructions of the no-op alone) / CALLS.
Instructions are not time (a cache miss costs no instruction), so this complements the timings, not replaces them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
PATHS = ("torch", "native", "python")  # "torch": the no-op alone
CASES = {"direct": 0, "via 6 library frames": 6}


def worker(path: str, depth: int, calls: int) -> None:
    """Set up a one-rank gloo group with dtwatch installed, then run the loop inside functools.reduce (what is
    counted)."""
    import functools

    import torch
    import torch.distributed as dist

    import dtwatch
    from dtwatch.ops import bind
    from dtwatch.record import installation, native

    os.environ["DTWATCH_DIR"] = tempfile.mkdtemp(prefix="dtwatch-instr-")
    os.environ["DTWATCH_JOB_ID"] = "instructions"
    assert dtwatch.install(), "dtwatch was already installed"
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.TCPStore("127.0.0.1", 0, 1, True))
    rec = installation.active()
    assert rec is not None
    original = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)
    spec = bind("all_reduce", original)
    assert spec is not None

    def noop(*args: object, **kwargs: object) -> None:
        return None

    if path == "native":
        fastpath = native.load()
        assert fastpath is not None, native.load_error()
        fn = native.make_native_wrapper(fastpath, rec, noop, spec)
    elif path == "python":
        fn = installation._make_wrapper(rec, noop, spec)
    else:
        fn = noop
    t = torch.ones(1)
    scope: dict = {"fn": fn, "t": t}
    if depth:
        # A library's frames (a file under site-packages) between the caller and the wrapped function.
        lib = "".join(f"def level{i}(fn, t):\n    return level{i + 1}(fn, t)\n\n" for i in range(depth - 1))
        lib += f"def level{depth - 1}(fn, t):\n    return fn(t)\n"
        exec(compile(lib, os.path.join(tempfile.gettempdir(), "site-packages", "lib", "layers.py"), "exec"), scope)
        line = "level0(fn, t)"
    else:
        line = "fn(t)"
    user_file = os.path.join(tempfile.gettempdir(), "train_instructions.py")
    warm = compile(f"for _ in range(100):\n    {line}\n", user_file, "exec")
    loop = compile(f"for _ in range({calls}):\n    {line}\n", user_file, "exec")
    exec(warm, scope)  # registers the call site (a miss goes to Python once)
    functools.reduce(lambda _acc, _item: exec(loop, scope), [None, None])  # one step: the loop runs once
    dtwatch.uninstall()
    dist.destroy_process_group()


def count(path: str, depth: int, calls: int) -> int:
    out = tempfile.NamedTemporaryFile(prefix="callgrind-", delete=False)
    out.close()
    env = {**os.environ, "PYTHONHASHSEED": "0", "DTWATCH_WATCHDOG": "off", "DTWATCH_STACK_SIGNAL": "off"}
    cmd = ["valgrind", "--tool=callgrind", "--toggle-collect=functools_reduce", f"--callgrind-out-file={out.name}",
           sys.executable, str(HERE), "--worker", path, str(depth), str(calls)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(out.name)
    found = re.search(r"Collected : ([\d,]+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"{path} ({depth} frames) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="calls counted per row (default 2000)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        path, depth, calls = args.worker
        worker(path, int(depth), int(calls))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    import torch

    result: dict = {"torch": torch.__version__, "python": sys.version.split()[0], "calls": args.calls, "rows": {}}
    print(f"dtwatch hot path, instructions per call (callgrind; torch {result['torch']}, Python {result['python']}, "
          f"{args.calls} calls per row)")
    print(f"  {'case':<24}{'no-op alone':>12}{'native +':>12}{'python +':>12}")
    for case, depth in CASES.items():
        per = {p: count(p, depth, args.calls) / args.calls for p in PATHS}
        row = {"noop": round(per["torch"]), "native_added": round(per["native"] - per["torch"]),
               "python_added": round(per["python"] - per["torch"])}
        result["rows"][case] = row
        print(f"  {case:<24}{row['noop']:>12}{row['native_added']:>12}{row['python_added']:>12}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
