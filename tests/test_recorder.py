"""The in-process recorder against real torch.distributed (gloo, CPU).

Multi-process tests launch real torchrun jobs (workers in tests/scripts/rec_*.py) and read the rings
from this process with :func:`dtwatch.read_ring`; ground truth comes from torch itself (the group
sequence counters the workers write, and torch's Flight Recorder). In-process tests use a one-rank gloo
group in the test process.

Flight Recorder on gloo, as measured here: it logs collectives only (no send/recv/batch p2p); its
``op_id`` is the group's sequence number, i.e. exactly dtwatch's ``seq``, and its ``collective_seq_id``
counts collectives only, so ``collective_seq_id == seq - (sequence numbers used by p2p ops earlier in
the group)``. Object collectives appear as their inner collectives (all_gather_object: two
all_gathers, at ``seq`` and ``seq + 1``).
"""
from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import dtwatch
from dtwatch.ops import OP_KINDS
from dtwatch.record import hooks, installation
from dtwatch.ring import FLAG_ASYNC, FLAG_COALESCED, FLAG_OBJECT, FLAG_P2P, STATUS_ERROR, STATUS_OK
from tests.conftest import SCRIPTS, init_world1, wait_for

pytestmark = pytest.mark.torch_versions  # also run on the oldest torch the README claims (.ci/run)

c10d = dist.distributed_c10d


def site_lines(script: str) -> dict[str, int]:
    """``# site:<name>`` markers of a worker script -> 1-based line numbers."""
    lines = {}
    for i, line in enumerate((SCRIPTS / script).read_text().splitlines(), 1):
        m = re.search(r"#\s*site:(\w+)", line)
        if m:
            assert m.group(1) not in lines, f"duplicate marker {m.group(1)}"
            lines[m.group(1)] = i
    return lines


def collectives(snap) -> list:
    return [r for r in snap.records_list() if not r.is_marker]


def here() -> int:
    """Line number of the caller (for call sites of in-process collectives)."""
    return inspect.currentframe().f_back.f_lineno


# ---------------------------------------------------------------------------------------------------
# 1. DDP training loop
# ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_ddp_training_loop(torchrun):
    job = torchrun("rec_ddp.py", 2)
    lines = site_lines("rec_ddp.py")
    script = str(SCRIPTS / "rec_ddp.py")
    for rank in range(2):
        res, snap = job.result(rank), job.ring(rank)
        assert (snap.rank, snap.world_size, snap.backend) == (rank, 2, "gloo")
        assert snap.exit_state_name == "exited"
        group = snap.group(res["group"])
        assert group is not None and group.members == (0, 1) and group.group_rank == rank

        # Sequence numbers: the ring's view of the default group equals torch's counter at the end, and
        # the sampled C++ counter alone covers the DDP reducer's all-reduces (issued from C++).
        assert snap.last_seq(res["group"]) == res["seq"]
        assert group.cpp_seq == res["seq"]

        # Steps and the DataLoader.
        assert res["steps"] == 10 and snap.step == res["steps"]
        markers = [r for r in snap.records_list() if r.is_marker]
        assert [m.step for m in markers] == list(range(1, res["steps"] + 1))
        # Each marker carries the default group's torch sequence number at that step: DDP's C++-issued
        # all-reduces show up as steady progress (one bucket all-reduce per step, plus DDP's bucket rebuild).
        seqs = [m.seq for m in markers]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert 0 < seqs[0] and seqs[-1] <= res["seq"]  # the worker may issue collectives after its last step
        assert len(snap.loaders) == 1
        loader = snap.loaders[0]
        assert loader.length == res["len_loader"] == 5
        assert loader.epochs == res["epochs"] == 2
        assert (loader.site.file, loader.site.line) == (script, lines["loader"])
        assert loader.step == res["len_loader"]  # the second epoch started after 5 steps

        # The only Python-issued collectives: one loss all_reduce per epoch.
        py = [r for r in collectives(snap) if not r.hooked]
        assert [(r.op, r.site.file, r.site.line, r.step) for r in py] == [
            ("all_reduce", script, lines["epoch_loss"], 5), ("all_reduce", script, lines["epoch_loss"], 10)]
        assert all(not r.in_flight and r.status == STATUS_OK and r.shape == (1,) for r in py)
        # Where torch calls its collective hooks (>= 2.14), DDP's own calls are recorded too, each once, named,
        # under the user's line that led to them; elsewhere the sampled counter above is all there is of them.
        hooked = [r for r in collectives(snap) if r.hooked]
        if hooks.available():
            grads = [r for r in hooked if r.site.line == lines["backward"]]
            assert len(grads) == res["steps"] and {r.op for r in grads} == {"all_reduce"}
            assert sorted(r.seq for r in hooked + py) == list(range(1, res["seq"] + 1))
        else:
            assert hooked == []

        # Flight Recorder: no p2p here, so every sequence number of the group is an FR entry whose
        # op_id and collective_seq_id both equal dtwatch's seq.
        fr = [e for e in job.flight_recorder(rank)["entries"] if e["process_group"][0] == res["group"]]
        op_ids = [e["op_id"] for e in fr]
        assert op_ids == list(range(1, res["seq"] + 1))
        assert [e["collective_seq_id"] for e in fr] == op_ids
        by_id = {e["op_id"]: e for e in fr}
        for r in py:
            assert by_id[r.seq]["profiling_name"] == "gloo:all_reduce"
            assert by_id[r.seq]["input_sizes"] == [[1]]
        cpp = [e for e in fr if e["op_id"] not in {r.seq for r in py}]
        cpp_allreduce = [e["op_id"] for e in cpp if e["profiling_name"] == "gloo:all_reduce"]
        assert len(cpp_allreduce) == res["steps"]  # DDP: one gradient bucket, one all_reduce per backward
        assert max(cpp_allreduce) <= group.cpp_seq and max(e["op_id"] for e in cpp) <= group.cpp_seq


# ---------------------------------------------------------------------------------------------------
# 2. Mixed Python collectives, p2p and a subgroup
# ---------------------------------------------------------------------------------------------------
# site -> (op, dtype, shape, numel, ntensors, seq_span, flags that must be set)
EXPECTED = {
    "all_reduce": ("all_reduce", "float32", (4, 3), 12, 1, 1, 0),
    "all_gather": ("all_gather", "int64", (5,), 5, 1, 1, 0),
    "all_gather_into_tensor": ("all_gather_into_tensor", "float32", (6,), 6, 1, 1, 0),
    "all_gather_single": ("all_gather_single", "float32", (2, 3), 6, 1, 1, 0),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", "float32", (8, 3), 24, 1, 1, 0),
    "reduce_scatter_single": ("reduce_scatter_single", "float64", (8,), 8, 1, 1, 0),
    "broadcast": ("broadcast", "float64", (7,), 7, 1, 1, 0),
    "reduce": ("reduce", "float32", (4, 3), 12, 1, 1, 0),
    "gather": ("gather", "float32", (2,), 2, 1, 1, 0),
    "scatter": ("scatter", "float32", (3,), 3, 1, 1, 0),
    "all_to_all_single": ("all_to_all_single", "float32", (8,), 8, 1, 1, 0),
    "barrier": ("barrier", "unknown", (), 0, 1, 1, 0),
    "all_gather_object": ("all_gather_object", "unknown", (), -1, 1, 2, FLAG_OBJECT),
    "broadcast_object_list": ("broadcast_object_list", "unknown", (), -1, 1, 2, FLAG_OBJECT),
    "send": ("send", "float32", (8,), 8, 1, 1, FLAG_P2P),
    "recv": ("recv", "float32", (8,), 8, 1, 1, FLAG_P2P),
    "isend": ("isend", "int32", (3, 2), 6, 1, 1, FLAG_P2P | FLAG_ASYNC),
    "irecv": ("irecv", "int32", (3, 2), 6, 1, 1, FLAG_P2P | FLAG_ASYNC),
    "batch_isend_irecv": ("batch_isend_irecv", "float32", (5,), 10, 2, 2, FLAG_P2P | FLAG_COALESCED | FLAG_ASYNC),
    "async_all_reduce": ("all_reduce", "float32", (16,), 16, 1, 1, FLAG_ASYNC),
    "between": ("broadcast", "float32", (1,), 1, 1, 1, 0),
    "sub_all_reduce": ("all_reduce", "float32", (2, 2), 4, 1, 1, 0),
    "sub_broadcast": ("broadcast", "float32", (2, 2), 4, 1, 1, 0),
    "sub_batch_isend_irecv": ("batch_isend_irecv", "int64", (3,), 6, 2, 2, FLAG_P2P | FLAG_COALESCED | FLAG_ASYNC),
    "sub_all_gather_object": ("all_gather_object", "unknown", (), -1, 1, 2, FLAG_OBJECT),
    "final": ("all_reduce", "float32", (1,), 1, 1, 1, 0),
}
ASYNC_SITES = {"isend", "irecv", "batch_isend_irecv", "async_all_reduce", "sub_batch_isend_irecv"}


def expected_sites(rank: int) -> list[str]:
    new_names = hasattr(dist, "all_gather_single")  # torch >= 2.13
    sites = [
        "all_reduce", "all_gather", "all_gather_into_tensor", *(["all_gather_single"] if new_names else []),
        "reduce_scatter_tensor", *(["reduce_scatter_single"] if new_names else []), "broadcast", "reduce",
        "gather", "scatter", "all_to_all_single", "barrier", "all_gather_object", "broadcast_object_list",
    ]
    sites += ["send", "irecv"] if rank % 2 == 0 else ["recv", "isend"]
    sites += ["batch_isend_irecv", "async_all_reduce", "between"]
    if rank in (0, 1):
        sites += ["sub_all_reduce", "sub_broadcast", "sub_batch_isend_irecv", "sub_all_gather_object"]
    return sites + ["final"]


@pytest.mark.timeout(150)
def test_mixed_collectives(torchrun):
    job = torchrun("rec_mixed.py", 4)
    lines = site_lines("rec_mixed.py")
    script = str(SCRIPTS / "rec_mixed.py")
    for rank in range(4):
        res, snap = job.result(rank), job.ring(rank)
        assert snap.exit_state_name == "exited"
        recs = collectives(snap)
        notes = res["notes"]
        # One record per call, in call order: object collectives, batch p2p and send/recv are recorded
        # once (their inner all_gather/broadcast/isend/irecv calls are not).
        assert [n["site"] for n in notes] == expected_sites(rank)
        assert [(r.op, r.site.line) for r in recs] == [(EXPECTED[n["site"]][0], lines[n["site"]]) for n in notes]

        last_in_group: dict[str, int] = {}
        for rec, note in zip(recs, notes, strict=True):
            site = note["site"]
            op, dtype, shape, numel, ntensors, span, flags = EXPECTED[site]
            where = f"rank {rank} {site}"
            assert (rec.site.file, rec.site.line, rec.site.function) == (script, lines[site], "main"), where
            assert rec.group == note["group"], where
            # seq: consecutive per group; the call used exactly the numbers torch's counter moved by.
            assert rec.seq == last_in_group.get(rec.group, 0) + 1, where
            assert rec.seq_span == span and rec.last_seq == note["seq_after"], where
            last_in_group[rec.group] = rec.last_seq
            assert (rec.dtype, rec.shape, rec.numel, rec.ntensors) == (dtype, shape, numel, ntensors), where
            assert rec.flags & flags == flags, where
            if site not in ASYNC_SITES:
                assert not rec.flags & FLAG_ASYNC, where
            if site in ("send", "recv", "isend", "irecv"):
                assert rec.peer == rank ^ 1, where
            # Everything completed, async work included (stamped when it finished).
            assert not rec.in_flight and rec.status == STATUS_OK and rec.t_exit >= rec.t_enter, where
        assert snap.open_records() == []
        assert last_in_group == res["counters"]
        for name, counter in res["counters"].items():
            assert snap.last_seq(name) == counter
        sub_groups = [g for g in snap.groups if g.members == (0, 1)]
        assert (len(sub_groups) == 1) == (rank in (0, 1))

        # Flight Recorder (gloo logs collectives only): op_id == seq for each sequence number a
        # non-p2p record used, and collective_seq_id == seq - p2p sequence numbers used before it.
        fr = job.flight_recorder(rank)["entries"]
        for name in res["counters"]:
            entries = [e for e in fr if e["process_group"][0] == name]
            group_recs = [r for r in recs if r.group == name]
            expected_ids = [r.seq + k for r in group_recs if not r.flags & FLAG_P2P for k in range(r.seq_span)]
            assert [e["op_id"] for e in entries] == expected_ids, (rank, name)
            for e in entries:
                p2p_before = sum(r.seq_span for r in group_recs if r.flags & FLAG_P2P and r.seq < e["op_id"])
                assert e["collective_seq_id"] == e["op_id"] - p2p_before, (rank, name, e["op_id"])
            if name == "0":
                assert max(e["collective_seq_id"] for e in entries) < res["counters"][name]  # p2p present
        by_id = {e["op_id"]: e for e in fr if e["process_group"][0] == "0"}
        first_all_reduce = recs[0]
        assert by_id[first_all_reduce.seq]["profiling_name"] == "gloo:all_reduce"
        assert by_id[first_all_reduce.seq]["input_sizes"] == [[4, 3]]


# ---------------------------------------------------------------------------------------------------
# 3. A rank killed while blocked in a collective; exit states
# ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_killed_rank_and_exit_states(torchrun):
    job = torchrun("rec_kill.py", 4, wait=False)
    lines = site_lines("rec_kill.py")
    script = str(SCRIPTS / "rec_kill.py")

    def blocked():
        s0, s1, s3 = job.ring(0), job.ring(1), job.ring(3)
        ok = (len(s0.open_records()) == 1 and len(s1.open_records()) == 1 and s3.exit_state_name == "exited"
              and s0.main_site is not None and s0.main_site.line == lines["stuck0"]
              and s1.main_site is not None and s1.main_site.line == lines["stuck1"])
        return (s0, s1) if ok else None

    s0, s1 = wait_for(blocked, 120, "ranks 0 and 1 blocked in their all_reduce")

    # Rank 0, seen while it waits: an all_reduce in flight, first collective of group [0, 2], its site.
    (stuck0,) = s0.open_records()
    g02 = next(g for g in s0.groups if g.members == (0, 2))
    assert (stuck0.op, stuck0.group, stuck0.seq, stuck0.shape) == ("all_reduce", g02.name, 1, (5,))
    assert (stuck0.site.file, stuck0.site.line) == (script, lines["stuck0"])
    assert s0.last_completed_seq("0") == 2 and s0.last_seq("0") == 2
    assert s0.exit_state_name == "running"

    # Kill rank 1 (pid from its ring; checked to be our worker) while it is blocked.
    (stuck1,) = s1.open_records()
    cmdline = Path(f"/proc/{s1.pid}/cmdline")
    if "rec_kill.py" not in (cmdline.read_text() if cmdline.exists() else ""):
        late = job.ring(1)  # it ended before the test killed it: say how, with the job's output
        raise AssertionError(f"rank 1 (pid {s1.pid}) ended before it was killed; its ring says "
                             f"{late.exit_state_name} {late.exit_reason!r}; job output:\n{job.output()}")
    os.kill(s1.pid, signal.SIGKILL)
    rc = job.wait(90)  # torchrun sees the death and SIGTERMs the others
    assert rc != 0
    with pytest.raises(ProcessLookupError):
        os.kill(s1.pid, 0)

    # The killed rank's ring is intact: same records, the last one the in-flight all_reduce.
    k1 = job.ring(1)
    assert k1.exit_state_name == "running" and k1.exit_reason == ""
    recs = k1.records_list()
    assert [r.stamp for r in recs] == list(range(1, len(recs) + 1))
    assert [(r.op, r.site.line) for r in recs] == [
        ("all_reduce", lines["warmup"]), ("barrier", lines["sync"]), ("all_reduce", lines["stuck1"])]
    last = recs[-1]
    g12 = next(g for g in k1.groups if g.members == (1, 2))
    assert last == stuck1 and last.in_flight and (last.group, last.seq) == (g12.name, 1)
    assert last.shape == (2, 2) and last.site.file == script

    # Rank 0 was blocked to the end: that all_reduce never completed normally.
    k0 = job.ring(0)
    end0 = next(r for r in k0.records_list() if r.stamp == stuck0.stamp)
    assert end0.in_flight or end0.status == STATUS_ERROR

    # Exit states: rank 2 raised (from its SIGTERM handler), rank 3 returned normally.
    k2, k3 = job.ring(2), job.ring(3)
    assert k2.exit_state_name == "exception"
    assert k2.exit_reason.startswith("StoppedError: rank 2 stopped by the launcher's SIGTERM")
    assert k3.exit_state_name == "exited" and k3.exit_reason == "process exited normally"
    assert k3.open_records() == [] and k3.last_seq("0") == 2


# ---------------------------------------------------------------------------------------------------
# 4. Results are bitwise identical with and without dtwatch
# ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_results_identical_with_and_without_dtwatch(torchrun):
    on = torchrun("rec_determinism.py", 2, env={"DTWATCH_ENABLED": "1"})
    off = torchrun("rec_determinism.py", 2, env={"DTWATCH_ENABLED": "0"})
    # The comparison means something only if one run recorded and the other did not.
    assert len([r for r in collectives(on.ring(1)) if not r.hooked]) == 5
    assert not off.run_dir.exists() or not list(off.run_dir.glob("*.ring"))
    for rank in range(2):
        a = torch.load(on.out_dir / f"rank-{rank}.pt")
        b = torch.load(off.out_dir / f"rank-{rank}.pt")
        assert a.keys() == b.keys() and len(a) == 21
        for key in a:
            assert torch.equal(a[key], b[key]), f"rank {rank}: {key} differs with dtwatch on"


# ---------------------------------------------------------------------------------------------------
# 5. In process: install / uninstall
# ---------------------------------------------------------------------------------------------------
def _patch_targets():
    targets = [(c10d, n) for n in OP_KINDS if hasattr(c10d, n)] + [(dist, n) for n in OP_KINDS if hasattr(dist, n)]
    targets += [(m, n) for m in (c10d, dist) for n in ("init_process_group", "destroy_process_group")]
    return targets + [(c10d, "_update_default_pg"), (DataLoader, "__iter__")]


def test_uninstall_restores_every_original(dtwatch_env):
    # Every op dtwatch knows that this torch has (torch < 2.13 lacks the *_single spellings).
    assert len([n for n in OP_KINDS if hasattr(c10d, n)]) >= len(OP_KINDS) - 3
    targets = _patch_targets()
    before = {(id(o), n): getattr(o, n) for o, n in targets}
    probed = c10d._rank_not_in_group
    assert dtwatch.install() is True
    for owner, name in targets:
        now = getattr(owner, name)
        assert now is not before[(id(owner), name)], name
        assert now.__wrapped__ is before[(id(owner), name)], name
    assert c10d._rank_not_in_group.__wrapped__ is probed  # watching for a default group
    init_world1()
    assert c10d._rank_not_in_group is probed  # attached: the probe is gone
    t = torch.ones(3)
    dist.all_reduce(t)
    assert dtwatch.uninstall() is True
    for owner, name in targets:
        assert getattr(owner, name) is before[(id(owner), name)], f"{owner.__name__}.{name} not restored"
    assert dtwatch.uninstall() is False
    # Nothing is recorded any more; the ring says dtwatch detached.
    dist.all_reduce(t)
    snap = dtwatch.read_ring(dtwatch_env / "rank-00000.ring")
    assert [r.op for r in collectives(snap)] == ["all_reduce"]
    assert snap.exit_state_name == "detached"


def test_install_twice_warns_and_does_not_double_wrap(dtwatch_env):
    original = dist.all_reduce
    assert dtwatch.install() is True
    wrapped = dist.all_reduce
    with pytest.warns(RuntimeWarning, match="twice"):
        assert dtwatch.install() is False
    assert dist.all_reduce is wrapped and c10d.all_reduce is wrapped
    assert wrapped.__dtwatch_original__ is original
    init_world1()
    dist.all_reduce(torch.ones(2))
    snap = dtwatch.read_ring(dtwatch_env / "rank-00000.ring")
    assert [(r.op, r.seq) for r in collectives(snap)] == [("all_reduce", 1)]


def test_uninstall_leaves_functions_someone_else_replaced(dtwatch_env, caplog):
    original = c10d.all_reduce
    assert dtwatch.install() is True

    def theirs(*args, **kwargs):
        return original(*args, **kwargs)

    c10d.all_reduce = theirs
    try:
        with caplog.at_level("WARNING", logger="dtwatch"):
            assert dtwatch.uninstall() is True
        assert c10d.all_reduce is theirs  # left alone
        assert dist.all_reduce is original  # still dtwatch's there: restored
        assert any("all_reduce was replaced by someone else" in r.getMessage() for r in caplog.records)
    finally:
        c10d.all_reduce = original


def test_install_before_init_then_ring_appears(dtwatch_env):
    assert dtwatch.install() is True
    assert not list(dtwatch_env.glob("*.ring"))
    init_world1()
    ring = dtwatch_env / "rank-00000.ring"
    assert ring.is_file()
    t = torch.full((2, 3), 2.0)
    dist.all_reduce(t); line = here()  # noqa: E702
    assert t.eq(2.0).all()  # one rank: the sum is the tensor itself
    snap = dtwatch.read_ring(ring)
    assert (snap.rank, snap.world_size, snap.backend, snap.pid) == (0, 1, "gloo", os.getpid())
    (rec,) = collectives(snap)
    assert (rec.op, rec.group, rec.seq, rec.shape, rec.dtype) == ("all_reduce", "0", 1, (2, 3), "float32")
    assert (rec.site.file, rec.site.line) == (__file__, line)
    assert not rec.in_flight


def test_loaders_iterated_in_one_library_loop_are_told_apart_by_the_users_line(dtwatch_env, tmp_path, monkeypatch):
    # Accelerate's DataLoaderShard.__iter__ iterates every loader of a job at one line: the user's line
    # that led there tells the training loader (4 batches) from the validation one (2).
    libdir = tmp_path / "venv" / "lib" / "site-packages"
    libdir.mkdir(parents=True)
    (libdir / "looplib.py").write_text("def each(loader):\n    for batch in loader:\n        yield batch\n")
    monkeypatch.syspath_prepend(str(libdir))
    import looplib

    assert dtwatch.install() is True
    init_world1()
    train = DataLoader(torch.zeros(8, 2), batch_size=2)
    val = DataLoader(torch.zeros(4, 2), batch_size=2)
    for _ in range(2):
        list(looplib.each(train)); train_line = here()  # noqa: E702
        list(looplib.each(val)); val_line = here()  # noqa: E702
    snap = dtwatch.read_ring(dtwatch_env / "rank-00000.ring")
    got = [(ld.site.file, ld.site.line, ld.user_site.file, ld.user_site.line, ld.length, ld.epochs)
           for ld in snap.loaders]
    lib = str(libdir / "looplib.py")
    assert got == [(lib, 2, __file__, train_line, 4, 2), (lib, 2, __file__, val_line, 2, 2)]
    # A loop in the user's own code has no separate user line.
    for _ in train:
        pass
    assert dtwatch.read_ring(dtwatch_env / "rank-00000.ring").loaders[-1].user_site is None
    sys.modules.pop("looplib", None)


def test_reinit_after_destroy_records_into_a_fresh_ring(dtwatch_env):
    assert dtwatch.install() is True
    init_world1()
    dist.all_reduce(torch.ones(1))
    dist.barrier()
    dist.destroy_process_group()
    ring = dtwatch_env / "rank-00000.ring"
    assert [r.seq for r in collectives(dtwatch.read_ring(ring))] == [1, 2]
    init_world1()
    dist.all_reduce(torch.ones(4))
    snap = dtwatch.read_ring(ring)
    assert [(r.op, r.group, r.seq, r.shape) for r in collectives(snap)] == [("all_reduce", "0", 1, (4,))]
    assert [g.name for g in snap.groups] == ["0"]
    beats = snap.heartbeat_count
    wait_for(lambda: dtwatch.read_ring(ring).heartbeat_count > beats, 5, "the sampler to run again")


def test_collectives_untouched_without_process_group(dtwatch_env):
    excepthook = sys.excepthook
    assert dtwatch.install() is True
    assert sys.excepthook is installation.active().excepthook
    t = torch.ones(2)
    with pytest.raises(Exception) as wrapped_exc:
        dist.all_reduce(t)
    with pytest.raises(Exception) as plain_exc:
        dist.all_reduce.__dtwatch_original__(t)
    assert type(wrapped_exc.value) is type(plain_exc.value)
    assert str(wrapped_exc.value) == str(plain_exc.value)
    assert t.eq(1).all()
    assert installation.active().mm is None
    assert not dtwatch_env.exists() or not list(dtwatch_env.glob("*.ring"))
    assert dtwatch.uninstall() is True
    assert sys.excepthook is excepthook


@pytest.mark.timeout(60)
def test_import_auto_without_process_group_is_harmless(tmp_path):
    code = textwrap.dedent("""
        import dtwatch.auto
        import dtwatch, torch, torch.distributed as dist
        from torch.utils.data import DataLoader
        assert dtwatch.is_installed()
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for (x,) in DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 3)), batch_size=2):
            opt.zero_grad(); model(x).sum().backward(); opt.step()
        assert not dist.is_initialized()
        try:
            dist.barrier()
        except ValueError as exc:
            print("barrier:", exc)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTWATCH_", "TORCH_FR", "TORCH_NCCL"))}
    env.update(DTWATCH_DIR=str(tmp_path / "dtwatch"), DTWATCH_WATCHDOG="off")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "ok"
    assert "barrier: Default process group has not been initialized" in proc.stdout
    assert "dtwatch" not in proc.stderr
    assert not list((tmp_path / "dtwatch").rglob("*.ring"))


# ---------------------------------------------------------------------------------------------------
# 6. Call sites through a third-party library: the library's line and the user's line
# ---------------------------------------------------------------------------------------------------
# A stand-in for a training library (Lightning's strategy, Accelerate's utilities): the test writes it
# into a directory named site-packages, which makes it third-party code to dtwatch.
WRAPPERLIB = '''\
"""A minimal training library: collectives issued on the user's behalf."""
import os
import time

import torch.distributed as dist


def barrier():
    _strategy_barrier()


def _strategy_barrier():
    dist.barrier()  # site:barrier


def all_reduce_mean(t):
    dist.all_reduce(t)  # site:all_reduce
    t /= dist.get_world_size()


def gather_objects(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)  # site:object
    return out


def start_all_reduce(t):
    return dist.all_reduce(t, async_op=True)  # site:async


def run_callback(fn, *args):
    return fn(*args)


def wait_for_file(path):
    while not os.path.exists(path):
        time.sleep(0.02)  # site:wait
'''


def _marker_lines(text: str) -> dict[str, int]:
    return {m.group(1): i for i, line in enumerate(text.splitlines(), 1) if (m := re.search(r"#\s*site:(\w+)", line))}


@pytest.mark.timeout(150)
def test_call_sites_through_a_library(torchrun, tmp_path):
    libdir = tmp_path / "venv" / "lib" / "site-packages"
    libdir.mkdir(parents=True)
    (libdir / "wrapperlib.py").write_text(WRAPPERLIB)
    lib_file, lib = str(libdir / "wrapperlib.py"), _marker_lines(WRAPPERLIB)
    script, user = str(SCRIPTS / "rec_callsite.py"), site_lines("rec_callsite.py")
    # No empty entry: it would put the job's working directory on sys.path, where the run directory
    # `dtwatch/` would shadow an editable install of the package (a namespace package wins over it).
    job = torchrun("rec_callsite.py", 2, wait=False,
                   env={"PYTHONPATH": os.pathsep.join(p for p in [str(libdir), os.environ.get("PYTHONPATH")] if p)})

    # While a rank waits inside the library, the sampler places it at the library's line (main_site)
    # and lists the user's lines that led there (main_stack), innermost first.
    def waiting_in_library(rank):
        s = job.ring(rank)
        at_wait = s.main_site is not None and (s.main_site.file, s.main_site.line) == (lib_file, lib["wait"])
        return s if at_wait else None

    for rank in range(2):
        s = wait_for(lambda rank=rank: waiting_in_library(rank), 120,
                     f"rank {rank} waiting in wrapperlib.wait_for_file")
        assert s.main_site.function == "wait_for_file"
        assert (s.main_top_site.file, s.main_top_site.line) == (lib_file, lib["wait"])
        assert [(x.file, x.line) for x in s.main_stack[:1]] == [(script, user["lib_wait"])]
        assert all(x.file != lib_file for x in s.main_stack)
    (job.out_dir / "release").touch()
    assert job.wait(90) == 0, job.output()

    # (op, site (file, line), user site (file, line), flags that must be set), in call order.
    def at(file, line):
        return (file, line)

    expected = [
        ("all_reduce", at(script, user["direct"]), at(script, user["direct"]), 0),
        ("barrier", at(lib_file, lib["barrier"]), at(script, user["lib_barrier"]), 0),
        ("all_reduce", at(lib_file, lib["all_reduce"]), at(script, user["mean_a"]), 0),
        ("all_reduce", at(lib_file, lib["all_reduce"]), at(script, user["mean_b"]), 0),
        ("all_reduce", at(lib_file, lib["all_reduce"]), at(script, user["helper"]), 0),
        ("all_gather_object", at(lib_file, lib["object"]), at(script, user["lib_object"]), FLAG_OBJECT),
        ("all_reduce", at(lib_file, lib["async"]), at(script, user["lib_async"]), FLAG_ASYNC),
        ("all_reduce", at(script, user["callback"]), at(script, user["callback"]), 0),
        ("all_gather_object", at(script, user["direct_object"]), at(script, user["direct_object"]), FLAG_OBJECT),
        ("all_reduce", at(script, user["direct_async"]), at(script, user["direct_async"]), FLAG_ASYNC),
        ("all_reduce", at("<string>", 1), at(script, user["exec_string"]), 0),
        ("barrier", at(script, user["final"]), at(script, user["final"]), 0),
    ]
    for rank in range(2):
        snap = job.ring(rank)
        recs = collectives(snap)
        got = [(r.op, (r.site.file, r.site.line), (r.user_site.file, r.user_site.line)) for r in recs]
        assert got == [e[:3] for e in expected], rank
        for r, (_, _, _, flags) in zip(recs, expected, strict=True):
            assert r.flags & flags == flags and not r.in_flight
        # Pseudo-files keep their name: never joined to the working directory as if they were files.
        # (The sampler may also have caught the main thread in a frozen module, e.g. importing: "<frozen ...>".)
        assert all(s.file.startswith("<") or os.path.isabs(s.file) and "<" not in s.file for s in snap.sites), \
            snap.sites

        # The summary the watchdog reasons about carries both sites, and survives a JSON round trip.
        from dtwatch.diagnose.rank_state import RankState, from_snapshot

        state = from_snapshot(snap)
        calls = state.groups["0"].recent
        assert [(c.site["line"], c.user_site["line"]) for c in calls] == [(e[1][1], e[2][1]) for e in expected]
        assert calls[1].user_site == {"file": script, "line": user["lib_barrier"], "function": "main"}
        assert calls[4].user_site["function"] == "metric_step"
        again = RankState.from_dict(json.loads(json.dumps(state.to_dict())))
        assert again.groups["0"].recent == calls
