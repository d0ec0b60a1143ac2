"""DataLoaders told apart across ranks, and warned about only where their loop issues collectives.

In process (a one-rank gloo group): what the recorder writes into the ring's loader table - which loader
(made where, by which caller), and how many collectives the rank issued while each epoch's loop ran (to
its StopIteration, or to the ``break`` that let go of its iterator). Pure: the warning's decisions on
states. Replayed: the live jobs of ``tests/scenarios/loaders.py`` (captured into ``tests/incidents``).
"""
from __future__ import annotations

import copy
import inspect
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

import dtwatch
from dtwatch.diagnose.loaders import loader_evidence, loader_key, uneven_loader_warnings
from dtwatch.diagnose.rank_state import RankState
from dtwatch.record import installation
from dtwatch.report.capture import load_fixture
from tests.conftest import init_world1

INCIDENTS = Path(__file__).resolve().parent / "incidents"


def here() -> int:
    return inspect.currentframe().f_back.f_lineno


def ring(run_dir: Path):
    return dtwatch.read_ring(run_dir / "rank-00000.ring")


def make_loader(dataset) -> DataLoader:
    return DataLoader(dataset, batch_size=2)


def run_epoch(loader: DataLoader, reduce: bool) -> None:
    for (x,) in loader:
        if reduce:
            dist.all_reduce(x)


RUN_EPOCH_LOOP = inspect.getsourcelines(run_epoch)[1] + 1


# ---------------------------------------------------------------------------------------------------
# the recorder
# ---------------------------------------------------------------------------------------------------
def test_a_train_and_an_eval_loader_made_by_one_helper_are_two_loaders(dtwatch_env):
    # The DDP tutorial's Trainer: one _run_epoch iterates both; one make_loader() line made both.
    assert dtwatch.install() is True
    init_world1()
    train = make_loader(TensorDataset(torch.zeros(8, 2))); train_line = here()  # noqa: E702
    val = make_loader(TensorDataset(torch.zeros(4, 2))); val_line = here()  # noqa: E702
    for _ in range(2):
        run_epoch(train, reduce=True)
        with torch.no_grad():
            run_epoch(val, reduce=False)
        dist.all_gather_object([None], 0.5)  # after the loop: not the loop's
    t, v = ring(dtwatch_env).loaders
    assert t.ident and v.ident and t.ident != v.ident
    assert t.site.line == v.site.line == RUN_EPOCH_LOOP
    # Where each was made: the helper's line is shared, so the caller's line names it.
    assert (t.made_site.file, t.made_site.line) == (__file__, train_line)
    assert (v.made_site.file, v.made_site.line) == (__file__, val_line)
    assert (t.length, t.epochs, t.ended, t.colls) == (4, 2, 2, 4)
    assert (v.length, v.epochs, v.ended, v.colls) == (2, 2, 2, 0)


def test_a_loop_left_by_break_and_a_persistent_iterator_end_where_their_loop_does(dtwatch_env):
    assert dtwatch.install() is True
    init_world1()
    loader = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=2)
    for i, (x,) in enumerate(loader):
        dist.all_reduce(x)
        if i == 1:
            break
    dist.barrier()  # after the loop
    (ld,) = ring(dtwatch_env).loaders
    assert (ld.epochs, ld.ended, ld.colls) == (1, 1, 2)
    # Persistent workers: the same iterator every epoch, never let go; its StopIteration ends each loop.
    persistent = DataLoader(TensorDataset(torch.zeros(6, 2)), batch_size=2, num_workers=1, persistent_workers=True)
    for _ in range(2):
        for (x,) in persistent:
            dist.all_reduce(x)
        dist.barrier()
    ld = ring(dtwatch_env).loaders[1]
    assert (ld.length, ld.epochs, ld.ended, ld.colls) == (3, 2, 2, 3)
    # A first epoch still running: nothing ended yet; the default group's number at its start is kept.
    it = iter(DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2))
    next(it)
    ld = ring(dtwatch_env).loaders[2]
    seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    assert (ld.epochs, ld.ended, ld.colls, ld.seq_start) == (1, 0, 0, seq)
    del it


def test_loaders_made_in_a_loop_differ_and_a_loader_made_again_each_epoch_stays_one(dtwatch_env):
    assert dtwatch.install() is True
    init_world1()
    datasets = [TensorDataset(torch.zeros(8, 2)), TensorDataset(torch.zeros(4, 2))]
    loaders = [DataLoader(ds, batch_size=2) for ds in datasets]  # one line, two loaders
    for loader in loaders:
        run_epoch(loader, reduce=False)
    for _ in range(3):
        again = DataLoader(datasets[0], batch_size=2)  # made again each epoch over the same dataset
        run_epoch(again, reduce=False)
    a, b, c = ring(dtwatch_env).loaders
    assert len({a.ident, b.ident, c.ident}) == 3
    assert (a.length, b.length, c.length, c.epochs) == (4, 2, 4, 3)


def test_a_loaders_identity_is_the_same_in_every_process(tmp_path):
    # Another directory, another hash seed: the same script's loaders get the same identities.
    script = textwrap.dedent("""
        import sys, torch
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
        from dtwatch.record.data_samplers import LoaderMakes
        makes = LoaderMakes()
        def make(ds):
            loader = DataLoader(ds, batch_size=2)
            makes.note(loader, sys._getframe())
            return loader
        train, val = make(TensorDataset(torch.zeros(8, 2))), make(TensorDataset(torch.zeros(4, 2)))
        print(makes.made(train).ident, makes.made(val).ident)
    """)
    got = []
    for i, where in enumerate(("a", "b/c")):
        path = tmp_path / where / "train.py"
        path.parent.mkdir(parents=True)
        path.write_text(script)
        env = {**os.environ, "PYTHONHASHSEED": str(i + 1), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got.append(out.stdout.split())
    assert got[0] == got[1] and got[0][0] != got[0][1]


def test_loader_patches_are_restored_and_a_failure_is_one_warning(dtwatch_env, monkeypatch):
    before = (DataLoader.__init__, DataLoader.__iter__, _BaseDataLoaderIter.__next__)
    assert dtwatch.install() is True
    init_world1()
    rec = installation.active()

    def broken(*_args):
        raise RuntimeError("boom")

    monkeypatch.setattr(rec.loader_makes, "note", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(TensorDataset(torch.arange(6.0).reshape(3, 2)), batch_size=2)
        loader2 = DataLoader(TensorDataset(torch.zeros(2, 2)), batch_size=2)
        assert [b[0].tolist() for b in loader] == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0]]]
        assert len(list(loader2)) == 1
    assert [str(w.message) for w in caught if "dtwatch" in str(w.message)] == [
        "dtwatch: noting where a DataLoader was made failed (RuntimeError('boom')); recording may be incomplete"]
    assert ring(dtwatch_env).loaders[0].ident  # still told apart, by its types
    assert dtwatch.uninstall() is True
    assert (DataLoader.__init__, DataLoader.__iter__, _BaseDataLoaderIter.__next__) == before


# ---------------------------------------------------------------------------------------------------
# the warning's decisions
# ---------------------------------------------------------------------------------------------------
LOOP = {"file": "train.py", "line": 51, "function": "Trainer._run_epoch"}


def states_with(*per_rank: list[dict]) -> list[RankState]:
    base = load_fixture(INCIDENTS / "uneven_ddp_loader.json").states
    out = []
    for rank, loaders in enumerate(per_rank):
        s = copy.deepcopy(base[rank])
        s.loaders = loaders
        out.append(s)
    return out


def entry(index: int, length: int, ident: int = 0, **kw) -> dict:
    d = {"index": index, "site": dict(LOOP), "length": length, "epochs": 1, "time": 100.0 + index, "step": 0,
         "user_site": None}
    if ident:
        d.update(ident=ident, made_site={"file": "train.py", "line": 90 + ident, "function": "main"}, ended=0, colls=0)
    d.update(kw)
    return d


def test_a_train_loader_and_an_eval_loader_at_one_loop_are_not_compared():
    # Rank 0 still evaluates (3 batches) while rank 1 already trains again (12): one loop line.
    train, evaluate = entry(0, 12, ident=1, ended=1, colls=24), entry(1, 3, ident=2, ended=1, colls=0)
    states = states_with([train, {**evaluate, "epochs": 2}], [{**train, "epochs": 2, "issued_now": 1}, evaluate])
    assert loader_key(train) != loader_key(evaluate)
    assert uneven_loader_warnings(states, 200.0) == []
    # What rings without identities said (one entry per loop line, its latest epoch): the false warning.
    old = states_with([entry(0, 3)], [entry(0, 12)])
    (w,) = uneven_loader_warnings(old, 200.0)
    assert w.ranks == [0] and "issues collectives" not in w.summary


def test_an_uneven_loop_warns_only_once_it_issues_collectives():
    # Evaluation shards of 3 + rank batches under no_grad: no collective in the loop, whatever the lengths.
    first = states_with(*[[entry(0, 3 + r, ident=7, issued_now=0)] for r in range(4)])
    assert loader_evidence(first) == [] and uneven_loader_warnings(first, 200.0) == []
    ended = states_with(*[[entry(0, 3 + r, ident=7, ended=1, colls=0, epochs=2, issued_now=0)] for r in range(4)])
    assert uneven_loader_warnings(ended, 200.0) == []
    # One collective at the loop's first batch (DDP broadcasting buffers in an evaluation loop's first forward)
    # is no collective per batch: silent while it runs, and once a rank ended it with fewer than its batches.
    buffers = states_with(*[[entry(0, 24 if r != 1 else 12, ident=7, issued_now=1)] for r in range(4)])
    assert uneven_loader_warnings(buffers, 200.0) == []
    buffers = states_with(*[[entry(0, 24 if r != 1 else 12, ident=7, **({"ended": 1, "colls": 1} if r == 1 else
                                                                        {"issued_now": 2}))] for r in range(4)])
    assert uneven_loader_warnings(buffers, 200.0) == []
    # The same loop with an all_reduce per batch: seen at the second batch, before anybody hangs.
    reducing = states_with(*[[entry(0, 6 if r != 1 else 4, ident=7, issued_now=2)] for r in range(4)])
    (w,) = uneven_loader_warnings(reducing, 200.0)
    assert w.kind == "uneven_iterations" and w.severity == "warning" and w.ranks == [1]
    assert w.summary.startswith("DataLoader made at train.py:97 in main iterated at train.py:51 in Trainer._run_epoch "
                                "has different lengths across ranks {'0': 6, '1': 4, '2': 6, '3': 6} and its loop "
                                "issues collectives (while it ran: 2 on ranks 0-3): rank 1 will leave the loop early")
    # One rank's ended epoch says so for all: rank 1 ran out of batches after 4 all_reduces.
    mixed = states_with(*[[entry(0, 6 if r != 1 else 4, ident=7, **({"ended": 1, "colls": 4} if r == 1 else
                                                                      {"issued_now": 0}))] for r in range(4)])
    (w,) = uneven_loader_warnings(mixed, 200.0)
    assert w.details["loader"]["issued"] == {"0": 0, "1": 4, "2": 0, "3": 0}
    # Every rank ran the epoch's loop to its end with as many collectives (one at its last batch, or Join
    # shadowing the others' calls): they do not follow the batches, and nobody hangs in it.
    even = states_with(*[[entry(0, 6 if r != 1 else 4, ident=7, ended=1, colls=1, epochs=1)] for r in range(4)])
    assert uneven_loader_warnings(even, 200.0) == []
    uneven = states_with(*[[entry(0, 6 if r != 1 else 4, ident=7, ended=1, colls=6 if r != 1 else 4)]
                           for r in range(4)])
    assert [w.ranks for w in uneven_loader_warnings(uneven, 200.0)] == [[1]]


# ---------------------------------------------------------------------------------------------------
# the live jobs, replayed
# ---------------------------------------------------------------------------------------------------
def as_rings_without_identities(states: list[RankState]) -> list[RankState]:
    """What the recorder wrote before loaders were told apart: one entry per loop, its latest epoch."""
    out = []
    for s in states:
        s = copy.deepcopy(s)
        latest: dict[tuple, dict] = {}
        for ld in sorted(s.loaders, key=lambda ld: ld["time"]):
            latest[(ld["site"]["file"], ld["site"]["line"])] = {
                k: v for k, v in ld.items() if k not in ("ident", "made_site", "ended", "colls", "issued_now")}
        s.loaders = list(latest.values())
        out.append(s)
    return out


@pytest.mark.parametrize("name", ["healthy_trainer_two_loaders", "healthy_eval_local_uneven"])
def test_the_healthy_jobs_that_were_warned_about_are_silent(name):
    fx = load_fixture(INCIDENTS / f"{name}.json")
    assert uneven_loader_warnings(fx.states, fx.now) == [], name
    # Captured while the loop line's latest epochs differed: the old rule warned here.
    (old,) = uneven_loader_warnings(as_rings_without_identities(fx.states), fx.now)
    assert old.ranks == [0]


@pytest.mark.parametrize("name, short", [("uneven_eval_reduce", [1]), ("uneven_ddp_loader", [1])])
def test_loops_with_collectives_are_still_warned_about_live_and_in_the_stall(name, short):
    fx = load_fixture(INCIDENTS / f"{name}.json")
    live = [w for w in fx.warnings if w["kind"] == "uneven_iterations"]
    assert len(live) == 1 and live[0]["ranks"] == short and "its loop issues collectives" in live[0]["summary"]
    (w,) = uneven_loader_warnings(fx.states, fx.now)
    assert w.ranks == short
