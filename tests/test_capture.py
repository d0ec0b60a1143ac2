"""``dtwatch capture``: a real 2-rank hang's bundle and run directory packed into a sanitised fixture."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dtwatch.report.capture import Sanitiser, capture, dumps_fixture, fixture_from_dict, load_fixture, write_fixture
from tests.harness import REPO, WORKER, launch, site_line

WORKER_REL = str(WORKER.relative_to(REPO))


@pytest.fixture(scope="module")
def hang(tmp_path_factory):
    """hang_worker's rank_conditional scenario under a real watchdog: (job, bundle path), job stopped."""
    root = tmp_path_factory.mktemp("capture")
    job = launch(root, "rank_conditional", 2, window=4.0)
    try:
        index = job.wait_incident(90)
    finally:
        job.stop()
    return job, index["_path"]


def test_bundle_fixture_round_trips_with_sanitised_paths(hang, tmp_path):
    job, bundle = hang
    out = tmp_path / "incident.json"
    data = capture(bundle, name="rank_conditional", relative_to=str(REPO), truth={"kind": "rank_conditional"})
    size = write_fixture(data, out)
    text = out.read_text()

    # Sanitised: no absolute path of this machine, no host name, ring paths reduced to a file name.
    for forbidden in (str(job.root), str(REPO), "/tmp/", "/work/", "/root/", "/home/"):
        assert forbidden not in text, forbidden
    assert not re.search(r'"/[\w.-]+/', text), "an absolute path survived"
    host = socket.gethostname()
    assert all(s["host"] == "node0" for s in data["states"])
    if len(host) >= 4:
        assert host not in text
    assert {s["ring_path"] for s in data["states"]} == {"rank-00000.ring", "rank-00001.ring"}

    # Compact and deterministic.
    # A 2-rank bundle. Each group keeps up to 256 (seq, time) pairs, and the recorded calls' entries time the
    # sequence numbers too, so a bundle carries them even while the sequence clock is quiet.
    assert size < 80_000, size
    assert dumps_fixture(capture(bundle, name="rank_conditional", relative_to=str(REPO),
                                 truth={"kind": "rank_conditional"})) == text

    # Round trip: the loaded states serialise back to what was written.
    fx = load_fixture(out)
    assert fx.name == "rank_conditional" and fx.source == "bundle" and fx.truth == {"kind": "rank_conditional"}
    assert [s.to_dict() for s in fx.states] == data["states"]
    index = json.loads((Path(bundle) / "index.json").read_text())
    assert fx.now == index["detected"] and fx.window == index["window"] and fx.onset == index["onset"]

    # The culprit's call site is the worker's line, relative to the repository, with its text kept.
    r0 = next(s for s in fx.states if s.rank == 0)
    call = r0.blocking_call()
    assert call is not None and call.op == "all_reduce"
    assert call.site["file"] == WORKER_REL and call.site["line"] == site_line("validate_all_reduce")
    assert fx.source_text(WORKER_REL) == WORKER.read_text()
    assert "dist.all_reduce(loss)" in fx.source_line(WORKER_REL, site_line("validate_all_reduce"))

    # Library files keep only the referenced lines (+-3), under portable names.
    libs = {k: v for k, v in fx.sources.items() if k.startswith(("<site-packages>/", "<stdlib>/"))}
    assert any(k.startswith("<site-packages>/torch/") for k in libs)
    assert all("lines" in v and "text" not in v for v in libs.values())

    # Evidence: py-spy stacks and Flight Recorder summaries per rank, and the findings of the time.
    assert set(fx.stacks) == {"0", "1"}
    main = next(t for t in fx.stacks["0"] if t["thread_name"] == "MainThread")
    assert any(fr.get("filename") == WORKER_REL for fr in main["frames"])
    assert set(fx.flight_records) <= {"0", "1"}
    assert fx.findings_at_capture and fx.findings_at_capture[0]["kind"] == "rank_conditional"
    assert fx.findings_at_capture[0]["site"]["file"] == WORKER_REL


def test_recent_calls_are_trimmed_to_the_option(hang):
    _job, bundle = hang
    data = capture(bundle, relative_to=str(REPO), recent=2)
    assert all(len(g["recent"]) <= 2 for s in data["states"] for g in s["groups"].values())
    assert all(len(s["step_times"]) <= 2 for s in data["states"])


def test_run_directory_is_read_from_the_rings(hang, tmp_path):
    job, _bundle = hang
    data = capture(job.run_dir, relative_to=str(REPO), window=7.0, now=123.0)
    assert data["source"] == "run_dir" and data["now"] == 123.0 and data["window"] == 7.0
    assert data["onset"] is None and data["findings_at_capture"] == []
    assert [s["rank"] for s in data["states"]] == [0, 1]
    fx = fixture_from_dict(json.loads(dumps_fixture(data)))
    assert fx.states[0].blocking_call().site["line"] == site_line("validate_all_reduce")
    assert str(job.root) not in dumps_fixture(data)


def test_cli_writes_the_fixture(hang, tmp_path):
    _job, bundle = hang
    out = tmp_path / "cli.json"
    proc = subprocess.run([sys.executable, "-m", "dtwatch", "capture", bundle, "-o", str(out), "--name", "x",
                           "--relative-to", str(REPO)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "2 ranks" in proc.stdout
    assert load_fixture(out).name == "x"
    bad = subprocess.run([sys.executable, "-m", "dtwatch", "capture", str(tmp_path / "nope"), "-o", str(out)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "not a directory" in bad.stderr


@pytest.mark.parametrize("path, expected", [
    ("/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", "<site-packages>/torch/distributed/c10d.py"),
    ("/usr/lib/python3/dist-packages/foo/bar.py", "<site-packages>/foo/bar.py"),
    ("/opt/py/lib/python3.11/threading.py", "<stdlib>/threading.py"),
    ("/srv/proj/train/main.py", "train/main.py"),
    ("/home/alice/other/x.py", "<abs>/x.py"),
    ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap>"),
    ("relative/already.py", "relative/already.py"),
])
def test_sanitiser_paths(path, expected):
    assert Sanitiser("/srv/proj", []).path(path) == expected


def test_sanitiser_text_and_hosts():
    san = Sanitiser("/srv/proj", ["gpu-host-17", "gpu-host-18"])
    text = "rank 1 at /srv/proj/train.py:12 on gpu-host-18 (see /home/alice/x/log.txt)"
    assert san.text(text) == "rank 1 at train.py:12 on node1 (see <abs>/log.txt)"
    assert san.value({"host": "gpu-host-17", "ring_path": "/tmp/a/b/rank-00003.ring"}) == \
        {"host": "node0", "ring_path": "rank-00003.ring"}
    assert san.text(san.text(text)) == san.text(text)  # idempotent
