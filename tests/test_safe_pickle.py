"""Flight Recorder files are read without running code (dtwatch.bundle.safe_pickle).

A real dump (torch's own, from a one-rank gloo group in a subprocess) reads the same through the restricted
unpickler as through pickle; a planted pickle whose ``__reduce__`` would write a file is refused, names the
file, and writes nothing, while the real dump beside it is still summarised.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from dtwatch.bundle.files import summarize_flight_record
from dtwatch.bundle.safe_pickle import UnsafePickleError, load_plain

DUMP_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
    import torch, torch.distributed as dist
    import torch._C._distributed_c10d as c10d_c
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.TCPStore("127.0.0.1", 0, 1, True))
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    fn = getattr(c10d_c, "_dump_fr_trace", None) or getattr(c10d_c, "_dump_nccl_trace")
    with open(sys.argv[1], "wb") as f:
        f.write(fn())
    dist.destroy_process_group()
""")


class WritesAFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def real_dump(tmp_path):
    path = tmp_path / "rank-00000.1.pkl"
    proc = subprocess.run([sys.executable, "-c", DUMP_SCRIPT, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return path


def test_a_real_dump_reads_the_same_as_through_pickle(real_dump):
    data = real_dump.read_bytes()
    plain = load_plain(data, str(real_dump))
    assert plain == pickle.loads(data)
    assert [e["profiling_name"] for e in plain["entries"]][-2:] == ["gloo:all_reduce", "gloo:broadcast"]
    summary = summarize_flight_record(str(real_dump))
    assert summary is not None and len(summary["entries"]) >= 2


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path, real_dump, caplog):
    planted = tmp_path / "written-by-the-pickle"
    hostile = tmp_path / "rank-00001.1.pkl"
    hostile.write_bytes(pickle.dumps({"version": "2.10", "entries": [WritesAFile(str(planted))]}))
    with pytest.raises(UnsafePickleError, match=r"rank-00001\.1\.pkl: refused: the pickle asks for io\.open"):
        load_plain(hostile.read_bytes(), str(hostile))
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        assert summarize_flight_record(str(hostile)) is None
    assert not os.path.exists(planted)
    assert any("rank-00001.1.pkl" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    assert summarize_flight_record(str(real_dump)) is not None  # the rest is still read
