"""Step overhead: dtwatch's cost per small NCCL all_reduce (torch alone vs with dtwatch), on the default NCCL
process group and, where this torch has nccl2, on the legacy one too."""
from __future__ import annotations

import os
import sys
import time

from backends import legacy_variant, probe_all
from common import CPU, PY, WORKERS, Step, read_json, run

LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 60
CALLS = int(os.environ.get("GPU_CHECK_OVERHEAD_CALLS") or (5000 if CPU else 20000))


def bench(step: Step, name: str, backend: str, env: dict, timeout: float) -> dict | None:
    out = step.dir / f"{backend}{'-env' if env else ''}.json"
    rc, _text = run(f"bench-{backend}{'-env' if env else ''}", [PY, str(WORKERS / "overhead.py"), str(out), backend,
                                                                 str(CALLS)], step, timeout, env, max_lines=30)
    res = read_json(out)
    if res is None:
        step.check(f"[{name}] benchmark ran", False, f"exit {rc}")
        return None
    ring = res["ring"]
    step.check(f"[{name}] every call recorded; ring's last seq is torch's counter; none left in flight",
               ring["records"] >= min(4000, CALLS) and ring["in_flight"] == 0 and ring["last_seq"] == res["torch_seq"]
               and not res["recorder_warned"], {**ring, "torch_seq": res["torch_seq"]})
    ar = res["all_reduce"]
    step.info(f"[{name}] all_reduce of 16 floats, us per call",
              f"torch {ar['torch_us']:.2f}, with dtwatch {ar['dtwatch_us']:.2f}: +{ar['added_us']:.2f} "
              f"(IQR {ar['added_us_iqr']}); with the block's sync {ar['torch_us_with_sync']:.2f} vs "
              f"{ar['dtwatch_us_with_sync']:.2f}; {res['device_backend_class']}, tracked={ring['tracked']}, "
              f"{res.get('recording_path', 'python')} path", key=True)
    py = res.get("all_reduce_python_path")
    if py:
        step.info(f"[{name}] the same through the Python path, us per call",
                  f"torch {py['torch_us']:.2f}, with dtwatch {py['dtwatch_us']:.2f}: +{py['added_us']:.2f} "
                  f"(IQR {py['added_us_iqr']})", key=True)
    return res


def main() -> None:
    step = Step("overhead", "cost per small all_reduce: torch alone vs with dtwatch (nccl2 vs legacy where both)")
    default = ("gloo", "gloo", {}) if CPU else ("nccl", "nccl", {})
    runs = [default]
    if CPU:
        step.skip("nccl2 vs legacy NCCL process group", "no NCCL in CPU mode")
    else:
        legacy = legacy_variant(probe_all(timeout=30))
        if legacy:
            runs.append(legacy)
        else:
            step.info("legacy NCCL process group", "not on this torch (one NCCL process group): one run")
    deadline = step.t0 + LIMIT - 3
    results = {}
    for i, (name, backend, env) in enumerate(runs):
        timeout = (deadline - time.time()) / (len(runs) - i)
        results[name] = bench(step, name, backend, env, timeout)
    if len(runs) == 2 and all(results.values()):
        (a, b) = (results[n]["all_reduce"] for n, _b, _e in runs)
        step.info("nccl2 vs legacy, us per call (torch alone / with dtwatch)",
                  f"{runs[0][0]}: {a['torch_us']:.2f} / {a['dtwatch_us']:.2f}; "
                  f"{runs[1][0]}: {b['torch_us']:.2f} / {b['dtwatch_us']:.2f}", key=True)
    step.done()


if __name__ == "__main__":
    main()
