"""Setup mistakes that never hang, in real 2-rank torchrun jobs (gloo, CPU) under a real watchdog: each is
warned about once, within the first minute, with its ranks and line, on the job's console, in the
events, by the webhook, on /metrics and in ``dtwatch analyze``; the healthy job raises none."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from dtwatch.diagnose.setup import CHECKS
from tests.harness import SCRIPTS, launch, site_line
from tests.prom_servers import WebhookReceiver, until

WORKER = SCRIPTS / "setup_worker.py"
SETUP_CHECKS = {c.name for c in CHECKS}

# scenario -> (check, finding kind, ranks, marker of the line named, words of the warning)
CASES = {
    "not_distributed": ("not_distributed", "not_distributed", [0, 1], "alone_step", "without a process group"),
    "same_data_sequential": ("same_data", "same_data", [0, 1], "train_loop", "same first batch"),
    "same_data_iterable": ("same_data", "same_data", [0, 1], "train_loop", "IterableDataset is not split by rank"),
    "same_data_random": ("same_data", "same_data", [0, 1], "train_loop", "over the same dataset"),
    "sampler_rank": ("same_data", "same_data", [0, 1], "train_loop", "built with rank=0"),
    "same_shuffle": ("same_shuffle", "same_shuffle", [0, 1], "train_loop", "set_epoch(epoch) is never called"),
    "drop_last": ("drop_last", "uneven_iterations", [1], "train_loop", "different drop_last settings"),
    "config_divergence": ("config_divergence", "config_divergence", [1], "ddp_wrap", "161 on rank 0; 181 on rank 1"),
}


def setup_warnings_of(job) -> list[dict]:
    return [e for e in job.events() if e["event"] == "warning" and e.get("details", {}).get("check") in SETUP_CHECKS]


def run_to_end(job) -> None:
    codes = job.wait_exit(timeout=240)
    assert codes == [0], (job.root / f"{job.job_id}.out").read_text()[-3000:]
    job.watchdog.wait(timeout=30)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", sorted(CASES))
def test_a_setup_mistake_is_warned_once_with_its_ranks_and_line(tmp_path, scenario):
    check, kind, ranks, marker, words = CASES[scenario]
    started = time.time()
    job = launch(tmp_path, scenario, 2, script=WORKER, window=4.0)
    try:
        run_to_end(job)
        warnings = setup_warnings_of(job)
        assert [w["details"]["check"] for w in warnings] == [check], job.watchdog_log()
        w = warnings[0]
        assert w["kind"] == kind and w["severity"] == "warning" and w["ranks"] == ranks
        assert w["site"]["file"] == str(WORKER) and w["site"]["line"] == site_line(marker, WORKER)
        assert words in w["summary"]
        assert w["detected"] - started < 60  # within the first minute of the job
        assert not [e for e in job.events() if e["event"] == "stall"] and job.bundles() == []  # never a stall
        console = (tmp_path / f"{job.job_id}.out").read_text()
        assert len(re.findall(rf"dtwatch: WARNING \[{kind}\]: ", console)) == 1, console[-3000:]
    finally:
        job.stop()


@pytest.mark.timeout(300)
def test_the_warning_reaches_metrics_webhook_and_analyze(tmp_path):
    hook = WebhookReceiver()
    job = launch(tmp_path, "same_shuffle", 2, script=WORKER, window=4.0,
                 watch_args=["--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--webhook", hook.url],
                 extra_env={"EPOCHS": "6", "STEP_PAUSE": "0.2"})
    try:
        ready = job.run_dir / f"watchdog-{socket.gethostname()}.json"
        url = until("the metrics URL", lambda: json.loads(ready.read_text()).get("url"), 60)
        def counted() -> bool:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            return any(line.startswith("dtwatch_findings_total") and 'kind="same_shuffle"' in line
                       and line.rstrip().endswith(" 1.0") for line in text.splitlines())

        until('dtwatch_findings_total{kind="same_shuffle",severity="warning"} 1 on /metrics', counted, 90)
        sent = until("a warning at the webhook", lambda: [p for p in hook.payloads if p.get("status") == "warning"], 30)
        assert len(sent) == 1 and sent[0]["findings"][0]["kind"] == "same_shuffle"
        assert sent[0]["findings"][0]["ranks"] == [0, 1]
        run_to_end(job)
        assert len([p for p in hook.payloads if p.get("status") == "warning"]) == 1  # once per run
        out = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", "--json", str(job.run_dir)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        listed = [w for w in json.loads(out.stdout)["warnings"] if w["kind"] == "same_shuffle"]
        assert len(listed) == 1 and listed[0]["issued"] == "live" and listed[0]["ranks"] == [0, 1]
        text = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", str(job.run_dir)],
                              capture_output=True, text=True, timeout=120).stdout
        assert "[same_shuffle]" in text.split("WARNINGS", 1)[1]
    finally:
        job.stop()
        hook.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["healthy", "healthy_peek"])
def test_the_healthy_job_raises_no_warning(tmp_path, scenario):
    # healthy: DistributedSampler with set_epoch and one drop_last, an evaluation loop over the whole
    # validation set on every rank, and a per-rank shard read with shuffle=True: none of it is a mistake.
    # healthy_peek: the tutorial's next(iter(loader)) before set_epoch at each epoch's start.
    job = launch(tmp_path, scenario, 2, script=WORKER, window=4.0, extra_env={"EPOCHS": "4"})
    try:
        run_to_end(job)
        assert [e for e in job.events() if e["event"] == "warning"] == [], job.events()
        assert job.bundles() == []
        out = subprocess.run([sys.executable, "-m", "dtwatch", "analyze", "--json", str(job.run_dir)],
                             capture_output=True, text=True, timeout=120)
        assert json.loads(out.stdout)["warnings"] == []
    finally:
        job.stop()
