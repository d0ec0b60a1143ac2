"""dtwatch attaches however the default process group is created (real torchrun jobs, gloo, 2 ranks).

Each route runs tests/scripts/init_routes.py; the rings are read back from this process. A route that
needs a third-party library (Accelerate, Lightning) is skipped when it is not installed, except under
CI, which installs both (the test extras) and fails instead.
"""
from __future__ import annotations

import importlib.util

import pytest

from dtwatch.record import hooks
from tests.test_recorder import collectives, site_lines
from tests.tools import ON_CI

pytestmark = pytest.mark.torch_versions  # also run on the oldest torch the README claims (.ci/run)

LINES = site_lines("init_routes.py")
NEEDS = {"accelerate": "accelerate", "lightning_fabric": "lightning"}


def run_route(torchrun, route: str):
    module = NEEDS.get(route)
    if module and importlib.util.find_spec(module) is None:
        if ON_CI:
            pytest.fail(f"{module} is not installed (pip install -e '.[test]' installs it)")
        pytest.skip(f"{module} is not installed")
    return torchrun("init_routes.py", 2, timeout=150, args=[route], env={"ACCELERATE_USE_CPU": "1"})


def route_calls(snap) -> list:
    return [r for r in collectives(snap) if r.site.line in (LINES["route_all_reduce"], LINES["route_barrier"])]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("route", [
    "init_process_group", "imported_by_name", "init_device_mesh", "install_after_init", "explicit_groups",
    "accelerate", "lightning_fabric", "without_c10d_hook",
])
def test_ring_for_every_route(torchrun, route):
    job = run_route(torchrun, route)
    for rank in (0, 1):
        note = job.result(rank)
        assert note["attached"], note
        snap = job.ring(rank)
        assert (snap.rank, snap.world_size) == (rank, 2)
        default = next(g for g in snap.groups if g.name == "0")
        assert default.members == (0, 1)
        calls = [(r.op, r.site.line) for r in route_calls(snap)]
        one_pass = [("all_reduce", LINES["route_all_reduce"])] * 3 + [("barrier", LINES["route_barrier"])]
        if route == "without_c10d_hook":
            # Nothing hooked the group's creation: the first use of torch.distributed attached (on torch
            # 2.13 that is init_process_group's own get_rank(); otherwise the first collective, which
            # itself is then not recorded).
            assert calls == (one_pass if note["attached_before_first_use"] else one_pass[1:])
        elif route == "explicit_groups":
            assert calls == one_pass * 2
            assert [r.group for r in route_calls(snap)] == ["1"] * 4 + ["0"] * 4  # the new group, then WORLD
        else:
            assert calls == one_pass
        seqs = [r.seq for r in route_calls(snap) if r.group == route_calls(snap)[0].group]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # torch's own numbering, none missed


@pytest.mark.timeout(180)
def test_collectives_issued_only_from_cpp_attach_through_the_poll(torchrun):
    job = run_route(torchrun, "cpp_only_without_hook")
    for rank in (0, 1):
        note = job.result(rank)
        assert note["attached"], note
        snap = job.ring(rank)
        assert [r for r in collectives(snap) if not r.hooked] == []  # nothing went through Python
        default = next(g for g in snap.groups if g.name == "0")
        # The sampler follows the group's C++ sequence number: within a tick of the end.
        assert default.cpp_seq >= note["default_seq"] - 2 > 10
        # Where torch calls its collective hooks, the calls issued after the ring appeared are recorded there,
        # one record per number, none past torch's own counter.
        seqs = [r.seq for r in collectives(snap) if r.hooked and r.group == "0"]
        if hooks.available():
            assert seqs and seqs == list(range(seqs[0], seqs[-1] + 1)) and seqs[-1] <= note["default_seq"]
        else:
            assert seqs == []


@pytest.mark.timeout(180)
def test_group_constructed_without_default_group_warns_once(torchrun):
    job = run_route(torchrun, "constructed_group_no_default")
    for rank in (0, 1):
        note = job.result(rank)
        assert note["attached"] is False and note["ring"] is None
        assert len(note["warnings"]) == 1, note
        assert "no default process group exists" in note["warnings"][0]
        assert "this process is not watched" in note["warnings"][0]
    assert not list(job.run_dir.glob("*.ring"))


def test_ring_that_cannot_be_created_is_one_warning_and_training_goes_on(dtwatch_env, tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist

    import dtwatch
    from dtwatch.record import installation
    from tests.conftest import init_world1

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("DTWATCH_DIR", str(blocker))  # the run directory would have to be inside a file
    assert dtwatch.install() is True
    with pytest.warns(RuntimeWarning) as caught:
        init_world1()
        t = torch.ones(2)
        for _ in range(3):
            dist.all_reduce(t)
    mine = [str(w.message) for w in caught if "dtwatch" in str(w.message)]
    assert len(mine) == 1, mine
    assert f"creating this rank's ring {blocker}" in mine[0] and "not watched by dtwatch" in mine[0]
    assert t.eq(1).all() and installation.active().mm is None
    assert not getattr(dist.distributed_c10d._rank_not_in_group, "__dtwatch_probe__", False)  # no cost per call
