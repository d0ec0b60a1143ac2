"""Step nvml: the watchdog's /metrics shows the busy GPU's NVML series (dtwatch_gpu_*) with the rank's labels."""
from __future__ import annotations

import re
import sys
import time

from common import CPU, WORKERS, Step, dtwatch_run, free_port, scrape

LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 40
BUSY_S = 8 if CPU else 15
SAMPLE = re.compile(r'^(dtwatch_\w+)\{([^}]*)\}\s+(\S+)')
GPU_SERIES = ("dtwatch_gpu_utilization_ratio", "dtwatch_gpu_memory_used_bytes", "dtwatch_gpu_memory_total_bytes",
              "dtwatch_gpu_power_watts", "dtwatch_gpu_temperature_celsius")


def parse(text: str) -> dict[str, tuple[dict, float]]:
    """Sample name -> (labels, value): the last sample of each name."""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            out[m.group(1)] = (dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))), float(m.group(3)))
    return out


def watch(step: Step, url: str, job) -> dict:
    """Scrape once a second until the GPU series show a busy GPU, the job ends, or time runs out."""
    deadline = min(time.time() + BUSY_S + 15, step.t0 + LIMIT - 8)
    best: dict = {}
    while time.time() < deadline and job.p.poll() is None:
        text = scrape(url)
        if text:
            samples = parse(text)
            (step.dir / "metrics.txt").write_text(text)
            if "dtwatch_rank_up" in samples:
                best = samples
            util = samples.get("dtwatch_gpu_utilization_ratio")
            if util and util[1] > 0 and samples.get("dtwatch_gpu_memory_used_bytes", ({}, 0))[1] >= 2e9:
                break
            if CPU and best and time.time() - job.t0 > 5:
                break
        time.sleep(1.0)
    return best


def main() -> None:
    step = Step("nvml", "NVML: dtwatch_gpu_* series with the rank's labels on the watchdog's /metrics")
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    job = dtwatch_run("nvml", [str(WORKERS / "busy.py"), str(BUSY_S)], 1, step, timeout=0,
                      watch=["--metrics-addr", "127.0.0.1", "--metrics-port", str(port)], background=True)
    samples = watch(step, url, job)
    job.wait(max(step.t0 + LIMIT - 4 - time.time(), 1))
    job.show(30)
    up = samples.get("dtwatch_rank_up", ({}, 0))
    step.check("/metrics serves the rank's series (dtwatch_rank_up 1, rank=\"0\")",
               up[1] == 1 and up[0].get("rank") == "0",
               {"url": url, "dtwatch_rank_up": up, "series": len(samples)})
    gpu = {name: samples[name] for name in GPU_SERIES if name in samples}
    step.info("dtwatch_gpu_* samples (labels, value)", gpu)
    if CPU:
        step.skip("all five dtwatch_gpu_* series present, labelled rank=\"0\" and gpu", "no NVML in CPU mode")
        step.skip("GPU values sane while busy", "no NVML in CPU mode")
        step.done()
        return
    labels = next(iter(gpu.values()))[0] if gpu else {}
    step.check("all five dtwatch_gpu_* series present, labelled rank=\"0\" and gpu",
               len(gpu) == len(GPU_SERIES) and labels.get("rank") == "0" and "gpu" in labels,
               {"missing": [n for n in GPU_SERIES if n not in gpu], "labels": labels})
    v = {name.removeprefix("dtwatch_gpu_"): value for name, (_labels, value) in gpu.items()}
    sane = (0 < v.get("utilization_ratio", 0) <= 1 and v.get("memory_total_bytes", 0) > 16e9
            and 2e9 <= v.get("memory_used_bytes", 0) <= v.get("memory_total_bytes", 0)
            and 20 < v.get("power_watts", 0) < 1500 and 10 < v.get("temperature_celsius", 0) < 110)
    step.check("GPU values sane while busy (0 < util <= 1, used >= the 2 GB held, 20-1500 W, 10-110 C)", sane, v)
    step.done()


if __name__ == "__main__":
    main()
