"""Torch's own hang diagnostics, switched on before the process group exists.

torch reads these variables when a process group is created, so they only help when set first.
A value the user set (under any of its spellings) is never overridden; every value dtwatch sets is
logged. Where torch renamed a variable, only the spelling the installed torch reads is set (setting the
old one on a new torch only earns a deprecation warning).
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("dtwatch")

# (spellings, newest first). 3 = on a collective error or timeout, tear the process down without a
# blocking cleanup, so the job fails near its cause instead of waiting out the full timeout (torch's
# default since 2.2; set explicitly so an older default or a stale environment does not silence it).
ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
FR_BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_DUMP_ON_TIMEOUT = ("TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT")
FR_DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
ALL_SETTINGS = (ASYNC_ERROR_HANDLING, FR_BUFFER_SIZE, FR_DUMP_ON_TIMEOUT, FR_DUMP_FILE)


# The first torch that reads a setting's newest spelling. torch 2.7 renamed the Flight Recorder's buffer
# size and dump file from TORCH_NCCL_* to TORCH_FR_*; its dump on timeout is TORCH_FR_DUMP_ON_TIMEOUT by
# 2.14 (in 2.14.1's and 2.15's NCCL library, beside the old name; torch 2.15's nccl2 groups read the new one).
NEWEST_SINCE: dict[tuple[str, ...], tuple[int, int]] = {
    FR_BUFFER_SIZE: (2, 7), FR_DUMP_FILE: (2, 7), FR_DUMP_ON_TIMEOUT: (2, 14),
}


def _torch_version() -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    except ValueError:
        return (99, 0)  # a development build: the newest names
    return major, minor


def apply_torch_env(fr_buffer_size: int, fr_dump_prefix: str, environ: dict[str, str] | None = None) -> list[str]:
    """Set torch's diagnostics variables that are not set yet; returns ``NAME=value (why)`` lines."""
    env = os.environ if environ is None else environ
    version = _torch_version()
    wanted: list[tuple[tuple[str, ...], str, str]] = [  # (spellings, value, why)
        (ASYNC_ERROR_HANDLING, "3", "fail fast on a collective error or timeout"),
    ]
    if fr_buffer_size > 0:
        wanted += [
            (FR_BUFFER_SIZE, str(fr_buffer_size), "Flight Recorder on"),
            (FR_DUMP_ON_TIMEOUT, "1", "dump the Flight Recorder on a timeout"),
            (FR_DUMP_FILE, fr_dump_prefix, "where those dumps go"),
        ]
    changes: list[str] = []
    for names, value, why in wanted:
        user = next((n for n in names if env.get(n)), None)
        if user is not None:
            log.info("dtwatch: keeping your %s=%s", user, env[user])
            continue
        name = names[0] if version >= NEWEST_SINCE.get(names, (0, 0)) else names[-1]
        env[name] = value
        changes.append(f"{name}={value} ({why})")
        log.info("dtwatch: set %s=%s (%s)", name, value, why)
    return changes


def unapplied_settings(environ: dict[str, str] | None = None) -> list[str]:
    """Variables that take effect only for process groups created after they are set."""
    env = os.environ if environ is None else environ
    return [n for names in ALL_SETTINGS for n in names if n in env]


def flight_recorder_on(environ: dict[str, str] | None = None) -> bool:
    """Whether torch's Flight Recorder records this process's NCCL work: a buffer size > 0 under one of
    its spellings. Unset counts as off (torch's default has changed across versions)."""
    env = os.environ if environ is None else environ
    for name in FR_BUFFER_SIZE:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value) > 0
            except ValueError:
                return False
    return False
