"""Which NCCL process groups this torch has: the default one, and the legacy one where nccl2 exists.

From torch 2.15 backend "nccl" means the new nccl2 process group; ``TORCH_DIST_USE_NCCL2=0`` or backend
"nccl-legacy" gives the old one. Each variant is tried in a process of its own (``workers/probe.py``);
the answers are kept in ``WORK/backends.json`` so later steps do not probe again.
"""
from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

from common import CPU, PY, WORK, WORKERS, read_json

# (name, backend, extra environment)
GPU_VARIANTS = [
    ("nccl", "nccl", {}),
    ("nccl, TORCH_DIST_USE_NCCL2=0", "nccl", {"TORCH_DIST_USE_NCCL2": "0"}),
    ("nccl-legacy", "nccl-legacy", {}),
]
CPU_VARIANTS = [("gloo", "gloo", {}), ("nccl", "nccl", {})]
CACHE = WORK / "backends.json"


def variants() -> list[tuple[str, str, dict]]:
    return CPU_VARIANTS if CPU else GPU_VARIANTS


def probe_one(backend: str, env: dict, timeout: float) -> dict:
    try:
        p = subprocess.run([PY, str(WORKERS / "probe.py"), backend], env={**os.environ, **env}, timeout=timeout,
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"backend_asked": backend, "ok": False, "error": f"no answer within {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {"backend_asked": backend, "ok": False, "error": f"exit {p.returncode}: {(p.stderr or p.stdout)[-400:]}"}


def probe_all(timeout: float = 40) -> dict[str, dict]:
    """Every variant's probe result, by name (cached)."""
    cached = read_json(CACHE)
    if cached:
        return cached
    with ThreadPoolExecutor(len(variants())) as pool:
        futures = {name: pool.submit(probe_one, backend, env, timeout) for name, backend, env in variants()}
        results = {name: f.result() for name, f in futures.items()}
    CACHE.write_text(json.dumps(results, indent=1))
    return results


def identity(res: dict) -> tuple:
    return res.get("get_backend"), res.get("pg_class"), res.get("device_backend_class")


def legacy_variant(results: dict[str, dict]) -> tuple[str, str, dict] | None:
    """The variant that gives the old NCCL process group where this torch also has nccl2, else None.

    Backend "nccl-legacy" initialising is proof enough; ``TORCH_DIST_USE_NCCL2=0`` counts where it makes a
    process group other than the default one (another backend name or class)."""
    default = results.get("nccl") or {}
    if CPU or not default.get("ok"):
        return None
    by_name = {name: (name, backend, env) for name, backend, env in GPU_VARIANTS}
    if (results.get("nccl-legacy") or {}).get("ok"):
        return by_name["nccl-legacy"]
    env_name = GPU_VARIANTS[1][0]
    res = results.get(env_name) or {}
    if res.get("ok") and identity(res) != identity(default):
        return by_name[env_name]
    return None
