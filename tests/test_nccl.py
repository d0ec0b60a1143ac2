"""The NCCL execution model on real GPUs: a collective returns before it completes, and the rank waits
later, where it synchronises. Skipped where fewer than 2 CUDA devices are visible (CI has none; the
same semantics are tested on CPU with dtwatch.testing's gloo_async backend in test_watchdog.py)."""
from __future__ import annotations

import pytest
import torch

from tests.harness import SCRIPTS, launch, site_line

SCRIPT = SCRIPTS / "nccl_hang.py"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices")


@pytest.mark.timeout(240)
def test_rank_conditional_all_reduce_on_nccl_names_the_call_and_the_sync_point(tmp_path):
    job = launch(tmp_path, "rank_conditional", 2, window=4.0, script=SCRIPT)
    try:
        index = job.wait_incident(timeout=150)
        f = next(f for f in index["findings"] if f["severity"] == "stall")
        assert f["kind"] == "rank_conditional" and f["ranks"] == [0]
        assert f["op"] == "all_reduce" and f["site"]["line"] == site_line("nccl_all_reduce", SCRIPT)
        assert f["waiting_ranks"] == [1] and f["waiting_op"] == "barrier"
        assert f["details"]["waits_at"]["0"]["line"] == site_line("nccl_sync", SCRIPT)
        assert "returned before it completed" in f["summary"]
    finally:
        job.stop()


@pytest.mark.timeout(240)
def test_healthy_ddp_on_nccl_raises_no_stall(tmp_path):
    job = launch(tmp_path, "healthy_ddp", 2, window=4.0, script=SCRIPT)
    try:
        assert job.wait_exit(timeout=180) == [0], job.watchdog_log()
        job.watchdog.wait(timeout=30)
        assert job.bundles() == []
    finally:
        job.stop()
