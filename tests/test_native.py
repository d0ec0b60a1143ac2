"""The native recording path (dtwatch/record/_fastpath.c) against the Python one, on real gloo jobs.

The two must write the same records: the same job (tests/scripts/rec_native.py) runs once on each path and its
rings are compared field by field (times aside; call sites by what they resolve to). The native path's own
contract is checked in-process: the wrapped function still looks like torch's, a call torch refuses raises the
same exception as without dtwatch, and a ring made anew (a new default group) gets its own call sites.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import dtwatch
from dtwatch.record import native
from dtwatch.ring import STATUS_ERROR
from tests.conftest import init_world1

ON_CI = os.environ.get("CI") == "true"
COMPARED = ("op", "seq", "flags", "ntensors", "shape", "numel", "dtype", "peer", "status", "seq_span", "step",
            "group")


def require_native():
    if native.load() is None:
        if ON_CI:
            pytest.fail(f"the native recording path is not built on CI: {native.load_error()}")
        pytest.skip(f"the native recording path is not built here: {native.load_error()}")


def test_the_extension_is_built_and_loads():
    """CI builds it from source (pip install -e .); a machine without a compiler gets the Python path."""
    require_native()
    assert native.load_error() is None


def described(snap):
    """Each record as the fields both paths must agree on, call sites by what they resolve to."""
    out = []
    for r in snap.records_list():
        site, user = r.site, r.user_site
        row = {name: getattr(r, name) for name in COMPARED}
        row["site"] = (os.path.basename(site.file), site.line) if site else None
        row["user_site"] = (os.path.basename(user.file), user.line) if user else None
        out.append(row)
    return out


@pytest.mark.timeout(240)
def test_both_paths_write_the_same_records(torchrun):
    require_native()
    runs = {}
    for mode in ("on", "off"):
        job = torchrun("rec_native.py", 2, env={"DTWATCH_NATIVE": mode})
        runs[mode] = job
        for rank in range(2):
            recorded_by = job.result(rank)["all_reduce"]
            assert recorded_by == ("Recorded" if mode == "on" else "function"), (mode, recorded_by)
    for rank in range(2):
        fast, slow = described(runs["on"].ring(rank)), described(runs["off"].ring(rank))
        assert len(fast) == len(slow), (len(fast), len(slow))
        for i, (a, b) in enumerate(zip(fast, slow, strict=True)):
            assert a == b, f"rank {rank}, record {i}: native {a} != python {b}"
        # Not vacuous: the job's calls are all there, the refused one ended in an error, and the call through the
        # library has the library's line as its site and the user's line as its user site.
        assert any(r["status"] == STATUS_ERROR for r in fast)
        library = [r for r in fast if r["site"] and r["site"][0] == "ops.py"]
        assert library and library[0]["user_site"][0] == "rec_native.py"
        assert sum(1 for r in fast if r["op"] == "all_reduce") >= 6


def test_the_native_wrapper_looks_like_torchs_function(dtwatch_env):
    require_native()
    original = dist.all_reduce
    dtwatch.install(native="on")
    wrapped = dist.all_reduce
    assert type(wrapped).__name__ == "Recorded"
    assert wrapped.__dtwatch_original__ is original and wrapped.__wrapped__ is original
    assert wrapped.__name__ == original.__name__ and wrapped.__doc__ == original.__doc__
    assert inspect.signature(wrapped) == inspect.signature(original)
    dtwatch.uninstall()
    assert dist.all_reduce is original


def test_a_call_torch_refuses_raises_what_torch_raises(dtwatch_env):
    require_native()
    init_world1()
    t = torch.ones(2)
    expected = None
    try:
        dist.all_reduce(t, op="not an op")
    except Exception as exc:  # noqa: BLE001
        expected = (type(exc), re.sub("0x[0-9a-f]+", "", str(exc)))  # the message names an object's address
    assert expected is not None
    dtwatch.install(native="on")
    with pytest.raises(expected[0]) as caught:
        dist.all_reduce(t, op="not an op")
    assert re.sub("0x[0-9a-f]+", "", str(caught.value)) == expected[1]
    # A call dtwatch cannot describe (no tensor) is torch's to refuse; dtwatch only warns, once.
    with pytest.raises(Exception) as none_given:
        dist.all_reduce(None)
    try:
        dist.all_reduce.__dtwatch_original__(None)
    except Exception as exc:  # noqa: BLE001
        assert type(none_given.value) is type(exc)
    dist.all_reduce(t)
    snap = dtwatch.read_ring(next(dtwatch_env.glob("*.ring")))
    statuses = [r.status for r in snap.records_list() if not r.is_marker]
    assert STATUS_ERROR in statuses and statuses[-1] != STATUS_ERROR


def _reduce_here(t):
    dist.all_reduce(t)  # one position for both rings: the cache must not carry its site id over


def test_a_new_ring_gets_its_own_call_sites(dtwatch_env):
    require_native()
    dtwatch.install(native="on")
    line = inspect.getsourcelines(_reduce_here)[1] + 1
    for _ in range(2):  # the default group made twice: a fresh ring (and site table) each time
        init_world1()
        dist.all_reduce(torch.ones(1))  # another site first, so the ids of the two rings differ
        _reduce_here(torch.ones(3))
        snap = dtwatch.read_ring(next(dtwatch_env.glob("*.ring")))
        last = [r for r in snap.records_list() if not r.is_marker][-1]
        assert last.site.line == line and last.site.file.endswith("test_native.py")
        dist.destroy_process_group()


SCRIPT_WITHOUT_EXTENSION = textwrap.dedent("""
    import sys, warnings, logging
    sys.modules["dtwatch.record._fastpath"] = None  # as on a machine that could not build it
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import dtwatch
    from dtwatch.config import ConfigError
    try:
        dtwatch.install(native="on")
    except ConfigError as exc:
        print("ERROR", exc)
    dtwatch.install()  # auto: the Python path, one warning
    import torch.distributed as dist
    print("PATH", type(dist.all_reduce).__name__)
""")


def test_without_the_extension_auto_warns_once_and_on_is_an_error_naming_the_setting(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTWATCH_")}
    env.update(DTWATCH_DIR=str(tmp_path), DTWATCH_WATCHDOG="off")
    proc = subprocess.run([sys.executable, "-c", SCRIPT_WITHOUT_EXTENSION], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR" in proc.stdout and "DTWATCH_NATIVE=on" in proc.stdout and "'off'" in proc.stdout
    assert "PATH function" in proc.stdout
    assert proc.stderr.count("native path cannot load") == 1, proc.stderr


def test_the_sequence_clock_runs_only_while_calls_go_unrecorded(dtwatch_env):
    """Every collective recorded: the default group's counter is never sampled between ticks (waking 100 times a
    second cost a Python-heavy FSDP2 step ~4 %). Collectives nobody recorded (a process group's own method, as
    C++ code issues them): the clock runs and times them."""
    import time

    # Without torch's collective hooks, which would record the group's own method's calls too (torch >= 2.14).
    dtwatch.install(seq_clock_interval=0.005, sample_interval=0.05, collective_hooks="off")
    init_world1()
    t = torch.ones(1)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        dist.all_reduce(t)
        time.sleep(0.002)
    ring = next(dtwatch_env.glob("*.ring"))
    recorded_only = len(dtwatch.read_ring(ring).seq_clock)
    pg = dist.distributed_c10d._get_default_group()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        pg.allreduce([t]).wait()  # not through torch.distributed's functions: no record
        time.sleep(0.002)
    unrecorded = len(dtwatch.read_ring(ring).seq_clock) - recorded_only
    # Full ticks (every 0.05 s) still write what changed: about 20 a second either way; the clock adds ~200.
    assert recorded_only <= 40, recorded_only
    assert unrecorded >= 80, unrecorded
