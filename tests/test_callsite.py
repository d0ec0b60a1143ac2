"""Call-site classification, the ring's user_site field (and reading version-1 rings), its summaries.

The multi-process behaviour (a collective called through a library in site-packages) is tested in
tests/test_recorder.py::test_call_sites_through_a_library; these are the pure parts.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import pytest
import torch

import dtwatch
from dtwatch.code_paths import INTERNAL, LIBRARY, OTHER, USER, classify_file, site_file
from dtwatch.diagnose.rank_state import Call, RankState, from_snapshot
from dtwatch.record.callsite import SiteTable
from dtwatch.ring import RECORD_DTYPE, RECORD_SIZE, RingWriter, read_ring

pytestmark = pytest.mark.torch_versions  # also run on the oldest torch the README claims (.ci/run)


def test_classify_file():
    assert classify_file(torch.distributed.__file__) == INTERNAL
    assert classify_file(dtwatch.__file__) == INTERNAL
    assert classify_file("<frozen importlib._bootstrap_external>") == INTERNAL
    assert classify_file("<string>") == OTHER
    assert classify_file("<stdin>") == OTHER
    # Code torch generates: a torch.fx graph module (a compiled graph under the eager backends) and inductor's
    # compiled modules are never the user's line, nor is a user file that merely mentions the cache's name.
    assert classify_file("<eval_with_key>.3") == INTERNAL
    assert classify_file("/tmp/torchinductor_alice/xy/cxyz123.py") == INTERNAL
    assert classify_file("/home/alice/torchinductor_notes.py") == USER
    assert classify_file(threading.__file__) == OTHER  # the standard library
    assert classify_file("/opt/venv/lib/python3.11/site-packages/lightning/fabric/fabric.py") == LIBRARY
    assert classify_file("/usr/lib/python3/dist-packages/accelerate/utils/operations.py") == LIBRARY
    assert classify_file("/other/venv/lib/python3.12/site-packages/torch/autograd/graph.py") == INTERNAL
    assert classify_file("/other/venv/lib/python3.12/site-packages/torchvision/ops.py") == LIBRARY
    assert classify_file(__file__) == USER
    assert classify_file("/home/me/site-packages-notes/train.py") == USER  # a directory component, not a substring
    assert classify_file("/home/me/project/train.py") == USER


def test_pseudo_files_keep_their_names():
    assert site_file("<frozen importlib._bootstrap_external>") == "<frozen importlib._bootstrap_external>"
    assert site_file("<string>") == "<string>"
    assert site_file("train.py") == os.path.join(os.getcwd(), "train.py")


def test_frame_sites_of_a_direct_call_and_through_a_library(tmp_path):
    registered: list[tuple[str, int, str]] = []

    def register(file: str, line: int, function: str) -> int:
        registered.append((file, line, function))
        return len(registered)

    table = SiteTable(register)
    lib_file = str(tmp_path / "site-packages" / "lib.py")
    lib: dict = {}
    exec(compile("import sys\ndef call(fn):\n    return fn(sys._getframe())\n", lib_file, "exec"), lib)

    def direct():
        return table.frame_sites(sys._getframe())

    def through_library():
        return lib["call"](table.frame_sites)

    def sites(ids):
        return tuple(registered[i - 1][:2] if i else None for i in ids)

    line = direct.__code__.co_firstlineno + 1
    assert sites(direct()) == ((__file__, line), (__file__, line))
    first = through_library()
    assert sites(first) == ((lib_file, 3), (__file__, through_library.__code__.co_firstlineno + 1))
    assert through_library() == first  # cached: no new sites
    n = len(registered)
    assert direct() == direct() and len(registered) == n


def _ring(tmp_path):
    w = RingWriter(tmp_path / "rank-00000.ring", rank=0, local_rank=0, world_size=1, job_id="j", host="h",
                   capacity=8)
    w.add_group("0", "default", [0], 0)
    lib = w.add_site("/venv/lib/python3.11/site-packages/lib/strategy.py", 10, "barrier")
    user = w.add_site("/job/train.py", 42, "main")
    w.write_record(1, op="barrier", seq=1, t_enter=1.0, t_exit=2.0, site=lib, user_site=user)
    w.write_record(2, op="all_reduce", seq=2, t_enter=3.0, t_exit=4.0, site=user, shape=(4, 3))
    w.mm.flush()
    return w, lib, user


def test_ring_records_carry_the_user_site(tmp_path):
    w, lib, user = _ring(tmp_path)
    snap = read_ring(w.path)
    assert snap.version == 2
    a, b = snap.records_list()
    assert (a.site.line, a.user_site.line, a.user_site.file) == (10, 42, "/job/train.py")
    assert b.user_site == b.site  # written without one: the same as the site
    assert b.shape == (4, 3) and b.numel == 12
    assert a.to_dict()["user_site"] == {"file": "/job/train.py", "line": 42, "function": "main"}


def test_version_1_rings_read_user_site_as_site(tmp_path):
    w, lib, user = _ring(tmp_path)
    # A version-1 ring: the version field says 1 and the user_site bytes are padding (zero).
    w.mm[8:12] = (1).to_bytes(4, "little")
    offset = RECORD_DTYPE.fields["user_site"][1]
    for i in range(2):
        start = w.records_off + i * RECORD_SIZE + offset
        w.mm[start:start + 4] = bytes(4)
    w.mm.flush()
    snap = read_ring(w.path)
    assert snap.version == 1
    assert [(r.site.line, r.user_site.line) for r in snap.records_list()] == [(10, 10), (42, 42)]


def test_state_calls_carry_the_user_site_and_old_dicts_load(tmp_path):
    w, lib, user = _ring(tmp_path)
    state = from_snapshot(read_ring(w.path))
    barrier, all_reduce = state.groups["0"].recent
    assert barrier.site["line"] == 10 and barrier.user_site == {"file": "/job/train.py", "line": 42, "function": "main"}
    assert barrier.user_site_key == ("/job/train.py", 42) and barrier.site_key[1] == 10
    assert all_reduce.user_site == all_reduce.site
    d = json.loads(json.dumps(state.to_dict()))
    assert RankState.from_dict(d).groups["0"].recent == [barrier, all_reduce]
    # A state written before user_site existed.
    for c in d["groups"]["0"]["recent"]:
        del c["user_site"]
    old = RankState.from_dict(d).groups["0"].recent[0]
    assert old.user_site is None and old.user_site_key == ("/venv/lib/python3.11/site-packages/lib/strategy.py", 10)
    assert Call(op="x", group="0", seq=1, site=None, t_enter=0.0).user_site_key is None
