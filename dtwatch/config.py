"""Configuration of the in-process recorder: argument > ``DTWATCH_*`` environment > default.

A bad argument raises :class:`ConfigError` naming the option and what is allowed. A malformed
environment value is refused with one warning naming the variable and the allowed values, and the
default is used instead (a typo in a pod spec must not take training down).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

log = logging.getLogger("dtwatch")

ENV_PREFIX = "DTWATCH_"


class ConfigError(ValueError):
    """An option has a value dtwatch does not accept."""


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _parse_signal(text: str) -> int:
    t = text.strip().upper()
    if t in ("OFF", "NONE", "0", ""):
        return 0
    name = t if t.startswith("SIG") else "SIG" + t
    sig = getattr(signal, name, None)
    if not isinstance(sig, signal.Signals):
        raise ValueError(text)
    return int(sig)


_JOB_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass(frozen=True)
class Option:
    env: str
    parse: Callable[[str], Any]
    check: Callable[[Any], bool]
    allowed: str


@dataclass(kw_only=True)
class Config:
    """Recorder options. Every field can also be set with ``DTWATCH_<FIELD>`` (upper case)."""

    dir: str = field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "dtwatch"))
    """Root of run directories; each job writes to ``<dir>/<job_id>/``."""
    job_id: str = ""
    """Identifies the job (same on every rank and node). Default: torchrun's run id, else MASTER_ADDR/PORT."""
    ring_records: int = 4096
    """Records kept per rank (a ring); 128 bytes each."""
    sample_interval: float = 0.1
    """Seconds between heartbeats / C++ sequence samples of the in-process sampler thread."""
    seq_clock_interval: float = 0.01
    """Seconds between the sampler's reads of the default group's sequence counter, which time
    collectives issued from C++ (DDP) for the straggler warning; 0: only every ``sample_interval``."""
    watchdog: str = "auto"
    """``auto``: the first rank of a node starts the node's watchdog if none runs; ``off``: never."""
    torch_env: bool = True
    """Turn on async error handling and torch's Flight Recorder before the process group exists."""
    fr_buffer_size: int = 2000
    """Flight Recorder entries per process group (torch's ``TORCH_FR_BUFFER_SIZE``); 0 leaves it off."""
    stack_signal: int = int(signal.SIGUSR2)
    """Signal on which faulthandler writes all threads' Python stacks to the run directory (0: off)."""
    auto_step: bool = True
    """Count optimizer steps as training steps (until ``dtwatch.step()`` is called explicitly)."""
    watchdog_args: str = ""
    """Extra arguments passed to an auto-started watchdog (e.g. ``--stall-window 30``)."""
    batch_fingerprint: bool = True
    """Hash the first batch of a DataLoader's first training epochs (its leading bytes, in a background thread)
    so the watchdog can tell ranks that train on the same data (the ``same_data`` check); off: no batch is read."""
    allow_ptrace: bool = False
    """Let any process of the same user ptrace this rank (``PR_SET_PTRACER_ANY``), so a watchdog sidecar's
    py-spy works on hosts with Yama ``ptrace_scope=1``. Linux only; off by default."""

    def __post_init__(self) -> None:
        for f in fields(self):
            opt = OPTIONS[f.name]
            value = getattr(self, f.name)
            if not opt.check(value):
                raise ConfigError(f"dtwatch option {f.name}={value!r} is invalid: allowed {opt.allowed}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Config:
        """Build from arguments (validated strictly) over environment values (refused with a warning)."""
        environ = os.environ if environ is None else environ
        unknown = set(overrides) - set(OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown dtwatch option(s) {sorted(unknown)}; allowed: {', '.join(sorted(OPTIONS))}"
            )
        values: dict[str, Any] = {}
        for name, opt in OPTIONS.items():
            if name in overrides:
                continue
            raw = environ.get(opt.env)
            if raw is None or raw == "":
                continue
            try:
                value = opt.parse(raw)
                if not opt.check(value):
                    raise ValueError(raw)
            except (ValueError, TypeError):
                log.warning("dtwatch: ignoring %s=%r: allowed %s; using the default", opt.env, raw, opt.allowed)
                continue
            values[name] = value
        for name, value in overrides.items():
            if name == "stack_signal" and isinstance(value, str):
                try:
                    value = _parse_signal(value)
                except ValueError:
                    raise ConfigError(
                        f"dtwatch option stack_signal={value!r} is invalid: allowed {OPTIONS[name].allowed}"
                    ) from None
            values[name] = value
        return cls(**values)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


OPTIONS: dict[str, Option] = {
    "dir": Option("DTWATCH_DIR", str, lambda v: isinstance(v, str) and v != "", "a directory path"),
    "job_id": Option(
        "DTWATCH_JOB_ID", str, lambda v: isinstance(v, str) and (v == "" or bool(_JOB_ID_RE.match(v))),
        "1-128 characters from A-Z a-z 0-9 . _ -",
    ),
    "ring_records": Option(
        "DTWATCH_RING_RECORDS", int, lambda v: _is_int(v) and 64 <= v <= 1_048_576,
        "an integer from 64 to 1048576",
    ),
    "sample_interval": Option(
        "DTWATCH_SAMPLE_INTERVAL", float, lambda v: _is_num(v) and 0.01 <= v <= 10,
        "seconds from 0.01 to 10",
    ),
    "seq_clock_interval": Option(
        "DTWATCH_SEQ_CLOCK_INTERVAL", float, lambda v: _is_num(v) and (v == 0 or 0.002 <= v <= 1),
        "0 (off) or seconds from 0.002 to 1",
    ),
    "watchdog": Option("DTWATCH_WATCHDOG", str.lower, lambda v: v in ("auto", "off"), "'auto' or 'off'"),
    "torch_env": Option("DTWATCH_TORCH_ENV", _parse_bool, lambda v: isinstance(v, bool), "1/0, true/false"),
    "fr_buffer_size": Option(
        "DTWATCH_FR_BUFFER_SIZE", int, lambda v: _is_int(v) and 0 <= v <= 1_000_000,
        "an integer from 0 (off) to 1000000",
    ),
    "stack_signal": Option(
        "DTWATCH_STACK_SIGNAL", _parse_signal,
        lambda v: _is_int(v) and (v == 0 or v in {int(s) for s in signal.Signals}),
        "a signal name such as SIGUSR2, or 'off'",
    ),
    "auto_step": Option("DTWATCH_AUTO_STEP", _parse_bool, lambda v: isinstance(v, bool), "1/0, true/false"),
    "watchdog_args": Option("DTWATCH_WATCHDOG_ARGS", str, lambda v: isinstance(v, str), "watchdog command-line arguments"),
    "allow_ptrace": Option("DTWATCH_ALLOW_PTRACE", _parse_bool, lambda v: isinstance(v, bool), "1/0, true/false"),
    "batch_fingerprint": Option("DTWATCH_BATCH_FINGERPRINT", _parse_bool, lambda v: isinstance(v, bool),
                                "1/0, true/false"),
}


def default_job_id(environ: dict[str, str] | None = None) -> str:
    """The job's id as every rank and node derives it without coordination."""
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return sanitize_job_id(run_id)
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        return sanitize_job_id(f"{addr}-{port}")
    return f"local-{os.getppid()}"


def sanitize_job_id(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text)[:128]
    return cleaned or "job"


def run_dir(config: Config, environ: dict[str, str] | None = None) -> str:
    """``<dir>/<job_id>``: where this job's rings, stacks, dumps and incidents live on this node."""
    return os.path.join(config.dir, config.job_id or default_job_id(environ))
