"""dtwatch.testing's gloo_async backend, in real 2-rank torchrun jobs: NCCL's CPU-side execution model
(collectives return before they complete, wait() does not block, barriers and synchronize() do) with
gloo's results, and DDP and FSDP2 computing the same numbers as on gloo."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import SCRIPTS, free_port

pytestmark = pytest.mark.torch_versions  # also run on the oldest torch the README claims (.ci/run)

SCRIPT = SCRIPTS / "gloo_async_semantics.py"


def run(tmp_path, backend: str) -> list[dict]:
    env = dict(os.environ, SEMANTICS_BACKEND=backend, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(SCRIPT), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"{backend}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(200)
def test_gloo_async_has_nccls_cpu_semantics_and_gloos_results(tmp_path):
    ranks = run(tmp_path, "gloo_async")
    reference = run(tmp_path, "gloo")
    r0, r1 = ranks
    assert r0["backend"] == "gloo_async"
    # Rank 0 issued first and did not wait for rank 1 (1 s late) in the call, but in synchronize().
    assert r0["all_reduce_returned_s"] < 0.3 and r0["synchronized_s"] > 0.7
    assert r0["wait_returned_s"] < 0.3
    assert r0["barrier_s"] > 0.7
    for r in ranks:
        assert r["all_reduce"] == [3.0] * 4 and r["all_reduce_async"] == [6.0] * 4
        assert r["work_completed"] is True
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["all_gather_into_tensor"] == [0.0] * 4 + [1.0] * 4
        assert r["reduce_scatter_tensor"] == [2.0, 2.0]
        assert r["in_flight_after_sync"] == [] and r["issued"] >= 6
    # DDP and FSDP2 compute what they compute on gloo (their own waits block: they read results at once).
    for mine, ref in zip(ranks, reference, strict=True):
        assert mine["ddp_losses"] == ref["ddp_losses"]
        assert mine["fsdp_losses"] == ref["fsdp_losses"]
