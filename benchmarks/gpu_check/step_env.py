"""Step env: the machine, torch, NCCL and its process groups (nccl2 / legacy), dtwatch importing and installing."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

from backends import identity, legacy_variant, probe_all
from common import CPU, DTWATCH, REPO, Step


def sh(cmd: list[str], timeout: float = 20) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        return (p.stdout + p.stderr).strip() + ("" if p.returncode == 0 else f" [exit {p.returncode}]")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc!r}"


def machine(step: Step) -> None:
    step.info("nvidia-smi", sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,compute_mode",
                                "--format=csv,noheader"]) if shutil.which("nvidia-smi") else "not on PATH")
    step.info("python", sys.version.split()[0])
    step.info("NCCL/torch environment", {k: v for k, v in os.environ.items()
                                         if k.startswith(("NCCL_", "TORCH_NCCL", "TORCH_FR", "TORCH_DIST", "CUDA_"))})
    for mod in ("pynvml", "prometheus_client", "numpy"):
        try:
            m = __import__(mod)
            step.info(f"module {mod}", getattr(m, "__version__", "") or "present")
        except ImportError as exc:
            step.info(f"module {mod}", f"MISSING: {exc}")
    spy = shutil.which("py-spy")
    step.info("py-spy", f"{sh([spy, '--version'])}" if spy else "not on PATH (stacks fall back to faulthandler)",
              key=True)


def torch_facts(step: Step) -> None:
    import torch
    import torch.distributed as dist

    step.info("torch", {"version": torch.__version__, "cuda": torch.version.cuda,
                        "cuda_available": torch.cuda.is_available(), "devices": torch.cuda.device_count()}, key=True)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        step.info("GPU 0", f"{props.name}, {props.total_memory / 2**30:.1f} GiB", key=True)
    try:
        nccl = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001 - the CPU build has no NCCL
        nccl = f"unavailable ({type(exc).__name__})"
    step.info("torch.cuda.nccl.version()", nccl, key=True)
    step.info("backends", {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(),
                           "known names": list(dist.Backend.backend_list)})
    if CPU:
        step.skip("CUDA visible and NCCL available")
    else:
        step.check("CUDA visible and NCCL available", torch.cuda.is_available() and dist.is_nccl_available(),
                   {"cuda": torch.cuda.is_available(), "nccl": dist.is_nccl_available()})


def process_groups(step: Step) -> None:
    results = probe_all()
    for name, res in results.items():
        step.info(f"1-rank group, backend {name}", res)
    default = "gloo" if CPU else "nccl"
    res = results.get(default) or {}
    step.check(f"1-rank {default} group initialises and all_reduces", bool(res.get("ok")) and res.get("all_reduce")
               == [1.0] * 4, {k: res.get(k) for k in ("get_backend", "pg_class", "device_backend_class", "error")})
    step.check(f"{default} group has torch's sequence counter (what dtwatch numbers calls by)",
               isinstance(res.get("seq_counter"), int), res.get("seq_counter"))
    if CPU:
        step.skip("which NCCL process groups this torch has (nccl2 / legacy)", "no NCCL in CPU mode")
        return
    legacy = legacy_variant(results)
    step.info("nccl2 and a legacy NCCL process group on this torch",
              f"yes: legacy via {legacy[0]!r} ({identity(results[legacy[0]])}); default {identity(res)}"
              if legacy else f"no: one NCCL process group ({identity(res)})", key=True)


def dtwatch_installs(step: Step) -> None:
    import torch
    import torch.distributed as dist

    import dtwatch

    where = os.path.dirname(os.path.abspath(dtwatch.__file__))
    step.check("dtwatch imports from this checkout", where == str(REPO / "dtwatch"),
               f"dtwatch {dtwatch.__version__} from {os.path.relpath(where, REPO)}")
    warned: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warned.append(record.getMessage())

    logging.getLogger("dtwatch").addHandler(Catch())
    os.environ.update(DTWATCH_WATCHDOG="off", DTWATCH_DIR=str(step.dir / "dtw"), DTWATCH_STACK_SIGNAL="off")
    from dtwatch.ops import OP_KINDS
    from dtwatch.record import installation

    ok = dtwatch.install()
    rec = installation.active()
    wrapped = {attr for owner, attr, _o, _w in (rec.patched if rec else []) if owner is dist.distributed_c10d}
    present = [n for n in OP_KINDS if getattr(dist.distributed_c10d, n, None) is not None]
    missing = [n for n in present if n not in wrapped]
    step.check(f"dtwatch.install() on torch {torch.__version__}: every collective wrapped, no warning",
               ok and not missing and not warned,
               {"installed": ok, "wrapped": len(wrapped), "not wrapped": missing, "warnings": warned})
    dtwatch.uninstall()
    out = sh([*DTWATCH, "--version"])
    step.check("`python -m dtwatch --version`", out.startswith("dtwatch"), out)


def main() -> None:
    step = Step("env", "machine, torch, NCCL process groups, dtwatch on this torch")
    machine(step)
    torch_facts(step)
    process_groups(step)
    dtwatch_installs(step)
    step.done()


if __name__ == "__main__":
    main()
