"""Configuration of the recorder (:class:`Config`) and of the watchdog (:class:`WatchOptions`).

One model for both: an argument beats a ``DTWATCH_*`` environment variable, which beats the default.
One policy for bad values:

* a bad argument is an error naming the option and what is allowed: :class:`ConfigError` from
  ``install()`` or the dataclasses, an argparse error naming the flag (exit status 2) on the command line;
* a malformed environment value is refused with one warning naming the variable and the allowed values,
  and the default is used instead: a typo in a pod spec must not take training, or its watchdog, down.

Each option is described once (:class:`Option`: its variable, how text is parsed, what is allowed); the
tables :data:`OPTIONS` (recorder) and :data:`WATCH_OPTIONS` (watchdog) drive validation, the environment
and the command line's argument types alike.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import dtwatch.paths as paths

log = logging.getLogger("dtwatch")

ENV_PREFIX = "DTWATCH_"
ENV_ENABLED = "DTWATCH_ENABLED"
"""``0`` makes ``import dtwatch.auto`` do nothing."""
ENV_BOOTSTRAP = "DTWATCH_BOOTSTRAP"
"""Set by ``dtwatch run`` for its command: the bootstrap ``sitecustomize`` installs dtwatch in each worker
(the bootstrap spells it itself: it must not import dtwatch in processes that are not workers)."""


class ConfigError(ValueError):
    """An option has a value dtwatch does not accept."""


@dataclass(frozen=True)
class Option:
    """One option: its environment variable (None: argument only), how text is parsed, what is allowed."""

    env: str | None
    parse: Callable[[str], Any]
    check: Callable[[Any], bool]
    allowed: str

    def from_text(self, text: str) -> Any:
        """The value of ``text``; ValueError when it is malformed or not allowed."""
        try:
            value = self.parse(text)
        except (ValueError, TypeError):
            raise ValueError(text) from None
        if not self.check(value):
            raise ValueError(text)
        return value


# -- parsers and checks -------------------------------------------------------------------------------
def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def parse_signal(text: str) -> int:
    t = text.strip().upper()
    if t in ("OFF", "NONE", "0", ""):
        return 0
    name = t if t.startswith("SIG") else "SIG" + t
    sig = getattr(signal, name, None)
    if not isinstance(sig, signal.Signals):
        raise ValueError(text)
    return int(sig)


def parse_port(text: str) -> int | None:
    """A TCP port; ``off`` (None) for no endpoint."""
    t = text.strip().lower()
    return None if t in ("off", "none", "-1") else int(t)


def parse_store(text: str) -> str:
    t = text.strip()
    return "none" if t.lower() == "none" else t


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _seconds(low: float, high: float, env: str | None, *, optional: bool = False) -> Option:
    def check(v: Any) -> bool:
        return (optional and v is None) or (_is_num(v) and low <= v <= high)

    return Option(env, float, check, f"seconds from {low:g} to {high:g}")


def _text(env: str | None, allowed: str, ok: Callable[[str], bool] = bool) -> Option:
    return Option(env, str, lambda v: isinstance(v, str) and ok(v), allowed)


_JOB_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_STORE_RE = re.compile(r"^.+:(\d{1,5})$")


def _job_id_ok(v: Any) -> bool:
    return isinstance(v, str) and (v == "" or bool(_JOB_ID_RE.match(v)))


def _store_ok(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    m = _STORE_RE.match(v)
    return v in ("", "none") or (m is not None and int(m.group(1)) <= 65535)


def default_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "dtwatch")


_DIR = _text("DTWATCH_DIR", "a directory path")
_JOB_ID = Option("DTWATCH_JOB_ID", str, _job_id_ok, "1-128 characters from A-Z a-z 0-9 . _ -")


# -- resolution ---------------------------------------------------------------------------------------
def environment_values(options: Mapping[str, Option], environ: Mapping[str, str] | None = None,
                       skip: Iterable[str] = ()) -> dict[str, Any]:
    """The options set in the environment (empty counts as unset). A malformed value is left out with one
    warning naming the variable and the allowed values, so the default applies."""
    env = os.environ if environ is None else environ
    skipped = set(skip)
    values: dict[str, Any] = {}
    for name, opt in options.items():
        if name in skipped or opt.env is None:
            continue
        raw = env.get(opt.env)
        if raw is None or raw == "":
            continue
        try:
            values[name] = opt.from_text(raw)
        except ValueError:
            log.warning("dtwatch: ignoring %s=%r: allowed %s; using the default", opt.env, raw, opt.allowed)
    return values


def environment_value(options: Mapping[str, Option], name: str, default: Any,
                      environ: Mapping[str, str] | None = None) -> Any:
    """One option from the environment, with the same policy as :func:`environment_values`."""
    return environment_values({name: options[name]}, environ).get(name, default)


def check_values(options: Mapping[str, Option], values: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` naming the first option whose value is not allowed."""
    for name, value in values.items():
        opt = options.get(name)
        if opt is not None and not opt.check(value):
            raise ConfigError(f"dtwatch option {name}={value!r} is invalid: allowed {opt.allowed}")


# -- the recorder -------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Config:
    """Recorder options. Every field can also be set with ``DTWATCH_<FIELD>`` (upper case)."""

    dir: str = field(default_factory=default_dir)
    """Root of run directories; each job writes to ``<dir>/<job_id>/``."""
    job_id: str = ""
    """Identifies the job (same on every rank and node). Default: torchrun's run id, else MASTER_ADDR/PORT."""
    ring_records: int = 4096
    """Records kept per rank (a ring); 128 bytes each."""
    sample_interval: float = 0.1
    """Seconds between heartbeats / C++ sequence samples of the in-process sampler thread."""
    seq_clock_interval: float = 0.01
    """Seconds between the sampler's reads of the default group's sequence counter, which time
    collectives issued from C++ (DDP) for the straggler warning, while the group runs collectives dtwatch did not
    record (recorded calls are timed by their records); 0: only every ``sample_interval``."""
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
    collective_hooks: str = "auto"
    """``auto``: on torch >= 2.14, also record the collectives no ``torch.distributed`` Python function issued
    (functional collectives, tensor parallel, compiled graphs, DDP's reducer) from torch's collective hooks;
    ``off``: the wrapper only (such calls are then seen as sequence numbers, named from a Flight Recorder dump)."""
    native: str = "auto"
    """The recording path of the collectives that pass one tensor or none (see :mod:`dtwatch.record.native`):
    ``auto``: the native extension where it loads, else the Python path with one warning; ``on``: the native
    one, or an error at install saying why it cannot load; ``off``: the Python path."""
    allow_ptrace: bool = False
    """Let any process of the same user ptrace this rank (``PR_SET_PTRACER_ANY``), so a watchdog sidecar's
    py-spy works on hosts with Yama ``ptrace_scope=1``. Linux only; off by default."""

    def __post_init__(self) -> None:
        check_values(OPTIONS, {f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Build from arguments (validated strictly) over environment values (refused with a warning)."""
        unknown = set(overrides) - set(OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown dtwatch option(s) {sorted(unknown)}; allowed: {', '.join(sorted(OPTIONS))}"
            )
        values = environment_values(OPTIONS, environ, skip=overrides)
        for name, value in overrides.items():
            if name == "stack_signal" and isinstance(value, str):
                try:
                    value = parse_signal(value)
                except ValueError:
                    raise ConfigError(
                        f"dtwatch option stack_signal={value!r} is invalid: allowed {OPTIONS[name].allowed}"
                    ) from None
            values[name] = value
        return cls(**values)


OPTIONS: dict[str, Option] = {
    "dir": _DIR,
    "job_id": _JOB_ID,
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
    "torch_env": Option("DTWATCH_TORCH_ENV", parse_bool, _is_bool, "1/0, true/false"),
    "fr_buffer_size": Option(
        "DTWATCH_FR_BUFFER_SIZE", int, lambda v: _is_int(v) and 0 <= v <= 1_000_000,
        "an integer from 0 (off) to 1000000",
    ),
    "stack_signal": Option(
        "DTWATCH_STACK_SIGNAL", parse_signal,
        lambda v: _is_int(v) and (v == 0 or v in {int(s) for s in signal.Signals}),
        "a signal name such as SIGUSR2, or 'off'",
    ),
    "auto_step": Option("DTWATCH_AUTO_STEP", parse_bool, _is_bool, "1/0, true/false"),
    "watchdog_args": _text("DTWATCH_WATCHDOG_ARGS", "watchdog command-line arguments", lambda v: True),
    "batch_fingerprint": Option("DTWATCH_BATCH_FINGERPRINT", parse_bool, _is_bool, "1/0, true/false"),
    "allow_ptrace": Option("DTWATCH_ALLOW_PTRACE", parse_bool, _is_bool, "1/0, true/false"),
    "collective_hooks": Option("DTWATCH_COLLECTIVE_HOOKS", str.lower, lambda v: v in ("auto", "off"),
                               "'auto' or 'off'"),
    "native": Option("DTWATCH_NATIVE", str.lower, lambda v: v in ("auto", "on", "off"), "'auto', 'on' or 'off'"),
}

ENABLED = Option(ENV_ENABLED, parse_bool, _is_bool, "1/0, true/false")


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``DTWATCH_ENABLED`` (default on): whether ``import dtwatch.auto`` installs dtwatch."""
    return bool(environment_value({"enabled": ENABLED}, "enabled", True, environ))


def default_job_id(environ: Mapping[str, str] | None = None) -> str:
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


def run_dir(config: Config, environ: Mapping[str, str] | None = None) -> str:
    """``<dir>/<job_id>``: where this job's rings, stacks, dumps and incidents live on this node."""
    return paths.run_dir(config.dir, config.job_id or default_job_id(environ))


# -- the watchdog -------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class WatchOptions:
    """Watchdog options (``dtwatch watch``); see :func:`watch_options` for how they are resolved."""

    dir: str = field(default_factory=default_dir)
    """Root of run directories (``DTWATCH_DIR``); the job's rings are in ``<dir>/<job_id>``."""
    job_id: str
    node: str = field(default_factory=socket.gethostname)
    stall_window: float | None = None
    """Fixed stall window in seconds; None adapts it to the job within [window_floor, window_ceiling]."""
    window_floor: float = 20.0
    window_ceiling: float = 600.0
    window_multiplier: float = 10.0
    startup_window: float = 120.0
    """Window before every rank finished a first step (loading, compiling, first rendezvous)."""
    poll_interval: float = 1.0
    """Seconds between looks at the rings (detection takes up to the window plus one poll)."""
    metrics_addr: str = "0.0.0.0"
    metrics_port: int | None = 9464
    """None: no Prometheus endpoint; 0: any free port."""
    webhook: str = ""
    fail_fast: bool = False
    store: str = ""
    """HOST:PORT of the job's c10d store for cross-node comparison; "" = from MASTER_ADDR/PORT; "none" = off."""
    idle_exit: float = 30.0
    """Exit when all ranks are gone and nothing new appeared for this long; 0 = never."""
    rank_wait: float = 3600.0
    """Exit if no rank has appeared this long after start; 0 = wait forever. The default outlasts torch's
    30-minute rendezvous timeout: a ring appears only once the default process group exists."""
    exit_with_launcher: bool = False
    """Standard input is a pipe held by the launcher (``dtwatch run``): once it closes (the command ended,
    or the launcher died, even by SIGKILL), exit as soon as no rank of this node is alive."""
    console: str = "auto"
    """Where diagnoses and warnings are shown: ``auto`` (a live local rank's stderr), ``stderr`` (ours), ``off``."""
    fail_fast_grace: float = 5.0
    """Seconds between SIGTERM and SIGKILL when --fail-fast ends the ranks and the processes they started."""
    pyspy: bool = True
    otlp_endpoint: str = ""
    heartbeat_stale: float | None = None
    store_interval: float = 2.0
    """Seconds between cross-node exchanges while a rank is in a collective (5x that otherwise)."""
    serve_store: bool = False
    """Serve a TCPStore for dtwatch's exchange at ``store``'s port on this node (traffic off the job's store)."""
    full_view_ranks: int = 64
    """Jobs of up to this many ranks: every node's diagnosis sees every rank; beyond, the ranks that stand out
    and a sample of the others (see :mod:`dtwatch.watchdog.aggregate`). The aggregator's value decides."""

    def __post_init__(self) -> None:
        check_values(WATCH_OPTIONS, {f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def run_dir(self) -> str:
        return paths.run_dir(self.dir, self.job_id)


_YEAR = 86400 * 365
WATCH_OPTIONS: dict[str, Option] = {
    "dir": _DIR,
    "job_id": _JOB_ID,
    "node": _text("DTWATCH_NODE", "a node name without '/'", lambda v: bool(v) and "/" not in v),
    "stall_window": _seconds(0.5, 86400, "DTWATCH_STALL_WINDOW", optional=True),
    "window_floor": _seconds(0.5, 86400, None),
    "window_ceiling": _seconds(0.5, 86400, None),
    "poll_interval": _seconds(0.05, 60, None),
    "metrics_addr": _text("DTWATCH_METRICS_ADDR", "a bind address such as 0.0.0.0"),
    "metrics_port": Option("DTWATCH_METRICS_PORT", parse_port, lambda v: v is None or (_is_int(v) and 0 <= v <= 65535),
                           "a port from 0 to 65535 (0 = any free port) or 'off'"),
    "webhook": _text("DTWATCH_WEBHOOK", "a URL", lambda v: True),
    "fail_fast": Option("DTWATCH_FAIL_FAST", parse_bool, _is_bool, "1/0, true/false"),
    "store": Option("DTWATCH_STORE", parse_store, _store_ok, "HOST:PORT or 'none'"),
    "idle_exit": _seconds(0, _YEAR, "DTWATCH_IDLE_EXIT"),
    "rank_wait": _seconds(0, _YEAR, "DTWATCH_RANK_WAIT"),
    "console": Option("DTWATCH_CONSOLE", lambda t: t.strip().lower(), lambda v: v in ("auto", "stderr", "off"),
                      "'auto', 'stderr' or 'off'"),
    "fail_fast_grace": _seconds(0, 600, None),
    "otlp_endpoint": _text(None, "a URL", lambda v: True),
    "pyspy": Option(None, parse_bool, _is_bool, "1/0, true/false"),
    "exit_with_launcher": Option(None, parse_bool, _is_bool, "1/0, true/false"),
    "store_interval": _seconds(0.1, 600, None),
    "serve_store": Option(None, parse_bool, _is_bool, "1/0, true/false"),
    "full_view_ranks": Option("DTWATCH_FULL_VIEW_RANKS", int, lambda v: _is_int(v) and 1 <= v <= 65_536,
                              "a number of ranks from 1 to 65536"),
}


def watch_options(arguments: Mapping[str, Any], *, environ: Mapping[str, str] | None = None,
                  defaults: Mapping[str, Any] | None = None) -> WatchOptions:
    """The watchdog's options: ``arguments`` (only those given; validated strictly) > the environment
    (a malformed value warns and falls back) > ``defaults`` > the dataclass's defaults. The job id
    defaults to :func:`default_job_id`."""
    unknown = set(arguments) - {f.name for f in fields(WatchOptions)}
    if unknown:
        raise ConfigError(f"unknown watchdog option(s) {sorted(unknown)}")
    values: dict[str, Any] = {"job_id": default_job_id(environ), **(defaults or {})}
    values.update(environment_values(WATCH_OPTIONS, environ, skip=arguments))
    values.update(arguments)
    return WatchOptions(**values)


def job_store_address(store: str, environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """Where the job's c10d store is: ``store`` (HOST:PORT), else torch's MASTER_ADDR/MASTER_PORT;
    None when it is ``none`` or unknown."""
    env = os.environ if environ is None else environ
    if not store and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        store = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    if not store or store == "none":
        return None
    host, _, port = store.rpartition(":")
    try:
        return host, int(port)
    except ValueError:
        log.warning("dtwatch: ignoring the job's store address %r: allowed HOST:PORT", store)
        return None
