"""Configuration of the recorder and the watchdog: arguments, DTWATCH_* environment, and torch's diagnostics
variables.

Arguments are validated strictly (:class:`dtwatch.ConfigError`; on the command line an argparse error naming
the flag, exit status 2); environment values are refused with one warning and replaced by the default; an
argument beats the environment. dtwatch sets torch's
Flight Recorder / async-error variables only where the user did not, and says so.
"""
from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
import torch.distributed as dist

import dtwatch
from dtwatch.cli import RUN_DEFAULTS
from dtwatch.config import Config, WatchOptions, default_job_id, enabled, job_store_address
from dtwatch.paths import EXIT_USAGE
from dtwatch.record import recorder
from dtwatch.record.torchenv import apply_torch_env
from tests.conftest import init_world1

FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")


def dtwatch_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dtwatch" and r.levelno >= logging.WARNING]


def assert_not_installed():
    assert not dtwatch.is_installed()
    assert not hasattr(dist.all_reduce, "__dtwatch_original__")


# ---------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "option", "allowed"),
    [
        ({"ring_records": 3}, "ring_records", "an integer from 64 to 1048576"),
        ({"ring_records": 2_000_000}, "ring_records", "an integer from 64 to 1048576"),
        ({"ring_records": True}, "ring_records", "an integer from 64 to 1048576"),
        ({"watchdog": "sometimes"}, "watchdog", "'auto' or 'off'"),
        ({"sample_interval": -1}, "sample_interval", "seconds from 0.01 to 10"),
        ({"sample_interval": "fast"}, "sample_interval", "seconds from 0.01 to 10"),
        ({"fr_buffer_size": -5}, "fr_buffer_size", "an integer from 0 (off) to 1000000"),
        ({"stack_signal": "SIGNOPE"}, "stack_signal", "a signal name such as SIGUSR2, or 'off'"),
        ({"job_id": "a/b"}, "job_id", "1-128 characters from A-Z a-z 0-9 . _ -"),
        ({"torch_env": "yes"}, "torch_env", "1/0, true/false"),
        ({"dir": ""}, "dir", "a directory path"),
    ],
)
def test_bad_argument_raises_config_error(dtwatch_env, options, option, allowed):
    with pytest.raises(dtwatch.ConfigError) as exc:
        dtwatch.install(**options)
    message = str(exc.value)
    assert f"{option}=" in message and allowed in message
    assert repr(options[option]) in message
    assert isinstance(exc.value, ValueError)
    assert_not_installed()


def test_unknown_option_raises_config_error(dtwatch_env):
    with pytest.raises(dtwatch.ConfigError) as exc:
        dtwatch.install(ring_size=4096)
    message = str(exc.value)
    assert "ring_size" in message
    for name in ("ring_records", "sample_interval", "watchdog", "fr_buffer_size"):
        assert name in message  # the allowed names are listed
    assert_not_installed()


# ---------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("var", "value", "field", "allowed"),
    [
        ("DTWATCH_RING_RECORDS", "lots", "ring_records", "an integer from 64 to 1048576"),
        ("DTWATCH_RING_RECORDS", "10", "ring_records", "an integer from 64 to 1048576"),
        ("DTWATCH_SAMPLE_INTERVAL", "0", "sample_interval", "seconds from 0.01 to 10"),
        ("DTWATCH_SAMPLE_INTERVAL", "nan", "sample_interval", "seconds from 0.01 to 10"),
        ("DTWATCH_WATCHDOG", "sometimes", "watchdog", "'auto' or 'off'"),
        ("DTWATCH_TORCH_ENV", "maybe", "torch_env", "1/0, true/false"),
        ("DTWATCH_STACK_SIGNAL", "SIGNOPE", "stack_signal", "a signal name such as SIGUSR2, or 'off'"),
        ("DTWATCH_JOB_ID", "bad/id", "job_id", "1-128 characters from A-Z a-z 0-9 . _ -"),
    ],
)
def test_bad_environment_value_warns_once_and_uses_default(caplog, var, value, field, allowed):
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        config = Config.from_env(environ={var: value})
    (warning,) = dtwatch_warnings(caplog)
    assert var in warning and repr(value) in warning and allowed in warning
    assert getattr(config, field) == getattr(Config(), field)


def test_bad_environment_value_through_install(dtwatch_env, monkeypatch, caplog):
    monkeypatch.setenv("DTWATCH_RING_RECORDS", "lots")
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        assert dtwatch.install() is True  # a typo in the environment never stops training
    (warning,) = dtwatch_warnings(caplog)
    assert "DTWATCH_RING_RECORDS" in warning and "an integer from 64 to 1048576" in warning
    init_world1()
    rec = recorder.active()
    assert rec.config.ring_records == 4096 and rec.capacity == 4096


def test_argument_beats_environment(dtwatch_env, monkeypatch, caplog):
    monkeypatch.setenv("DTWATCH_RING_RECORDS", "128")
    monkeypatch.setenv("DTWATCH_SAMPLE_INTERVAL", "0.5")
    monkeypatch.setenv("DTWATCH_WATCHDOG", "sometimes")  # invalid, but overridden: no warning
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        assert dtwatch.install(ring_records=256, watchdog="off") is True
    assert dtwatch_warnings(caplog) == []
    rec = recorder.active()
    assert rec.config.ring_records == 256  # argument
    assert rec.config.sample_interval == 0.5  # environment, where no argument was given
    init_world1()
    assert rec.capacity == 256  # the ring really has that many slots


def test_environment_values_are_parsed(dtwatch_env):
    config = Config.from_env(environ={
        "DTWATCH_RING_RECORDS": "1024", "DTWATCH_WATCHDOG": "OFF", "DTWATCH_TORCH_ENV": "no",
        "DTWATCH_STACK_SIGNAL": "usr1", "DTWATCH_SAMPLE_INTERVAL": "0.25",
    })
    assert (config.ring_records, config.watchdog, config.torch_env, config.sample_interval) == \
        (1024, "off", False, 0.25)
    assert config.stack_signal == int(signal.SIGUSR1)


# ---------------------------------------------------------------------------------------------------
# torch's diagnostics variables
# ---------------------------------------------------------------------------------------------------
def test_unset_torch_variables_are_set_and_logged(dtwatch_env, caplog):
    with caplog.at_level(logging.INFO, logger="dtwatch"):
        assert dtwatch.install() is True
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(dtwatch_env / "fr" / "torch-fr-rank-")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ  # this torch reads the new spelling only
    messages = [r.getMessage() for r in caplog.records if r.name == "dtwatch"]
    for name, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"), ("TORCH_FR_BUFFER_SIZE", "2000"),
                        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")):
        assert any(f"set {name}={value}" in m for m in messages), name
    assert dtwatch_warnings(caplog) == []  # installed before init_process_group: nothing to warn about


def test_fr_buffer_size_zero_leaves_flight_recorder_off(dtwatch_env):
    assert dtwatch.install(fr_buffer_size=0) is True
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    for name in FR_VARS + ("TORCH_NCCL_TRACE_BUFFER_SIZE",):
        assert name not in os.environ


def test_torch_env_false_sets_nothing(dtwatch_env):
    assert dtwatch.install(torch_env=False) is True
    for name in FR_VARS + ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        assert name not in os.environ


@pytest.mark.parametrize("user_var", ["TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"])
def test_user_flight_recorder_size_is_never_overridden(dtwatch_env, monkeypatch, caplog, user_var):
    monkeypatch.setenv(user_var, "77")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    with caplog.at_level(logging.INFO, logger="dtwatch"):
        assert dtwatch.install(fr_buffer_size=5000) is True
    assert os.environ[user_var] == "77"
    other = ({"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"} - {user_var}).pop()
    assert other not in os.environ  # no second spelling added next to the user's
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    messages = [r.getMessage() for r in caplog.records if r.name == "dtwatch"]
    assert any(f"keeping your {user_var}=77" in m for m in messages)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # the unset ones are still set


def test_apply_torch_env_on_a_given_environment():
    env = {"TORCH_FR_BUFFER_SIZE": "10"}
    changes = apply_torch_env(300, "/x/fr-", environ=env)
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": "/x/fr-",
    }
    assert [c.split("=", 1)[0] for c in changes] == [
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"]


def test_install_after_init_warns_naming_unapplied_settings(dtwatch_env, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's, set before init: it applied
    init_world1()
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        assert dtwatch.install() is True
    (warning,) = dtwatch_warnings(caplog)
    assert "installed after init_process_group" in warning
    named = warning.split("not to the existing ones: ", 1)[1].split(". ", 1)[0].split(", ")
    assert named == ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"]
    # The process group exists already, so the ring is there at once and records.
    dist.all_reduce(torch.ones(1))
    snap = dtwatch.read_ring(dtwatch_env / "rank-00000.ring")
    assert [r.op for r in snap.records_list()] == ["all_reduce"]


# ---------------------------------------------------------------------------------------------------
# The watchdog's options: the same model (argument > DTWATCH_* > default) and the same policy
# ---------------------------------------------------------------------------------------------------
def watch_opts(argv: list[str], environ: dict[str, str]):
    from dtwatch.cli import build_parser
    from dtwatch.config import watch_options

    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k in WatchOptions.__dataclass_fields__}
    return watch_options(given, environ=environ, defaults=RUN_DEFAULTS if argv[0] == "run" else None)


@pytest.mark.parametrize(
    ("var", "value", "field", "allowed"),
    [
        ("DTWATCH_STALL_WINDOW", "soon", "stall_window", "seconds from 0.5 to 86400"),
        ("DTWATCH_STALL_WINDOW", "0.1", "stall_window", "seconds from 0.5 to 86400"),
        ("DTWATCH_METRICS_PORT", "70000", "metrics_port", "a port from 0 to 65535 (0 = any free port) or 'off'"),
        ("DTWATCH_FAIL_FAST", "maybe", "fail_fast", "1/0, true/false"),
        ("DTWATCH_CONSOLE", "tty", "console", "'auto', 'stderr' or 'off'"),
        ("DTWATCH_IDLE_EXIT", "-1", "idle_exit", "seconds from 0 to 3.1536e+07"),
        ("DTWATCH_RANK_WAIT", "forever", "rank_wait", "seconds from 0 to 3.1536e+07"),
        ("DTWATCH_STORE", "master", "store", "HOST:PORT or 'none'"),
        ("DTWATCH_NODE", "a/b", "node", "a node name without '/'"),
        ("DTWATCH_JOB_ID", "bad/id", "job_id", "1-128 characters from A-Z a-z 0-9 . _ -"),
    ],
)
def test_bad_watchdog_environment_value_warns_once_and_uses_default(caplog, var, value, field, allowed):
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        opts = watch_opts(["watch", "--job-id", "j"] if field != "job_id" else ["watch"], {var: value})
    (warning,) = dtwatch_warnings(caplog)
    assert var in warning and repr(value) in warning and allowed in warning
    if field == "job_id":
        assert opts.job_id == default_job_id({})
    else:
        assert getattr(opts, field) == getattr(WatchOptions(job_id="j"), field)


@pytest.mark.parametrize(
    ("argv", "flag", "allowed"),
    [
        (["watch", "--stall-window", "soon"], "--stall-window", "seconds from 0.5 to 86400"),
        (["watch", "--metrics-port", "http"], "--metrics-port", "a port from 0 to 65535"),
        (["watch", "--console", "tty"], "--console", "'auto', 'stderr' or 'off'"),
        (["watch", "--store", "master"], "--store", "HOST:PORT or 'none'"),
        (["watch", "--poll-interval", "0"], "--poll-interval", "seconds from 0.05 to 60"),
        (["run", "--fail-fast-grace", "1000", "--", "true"], "--fail-fast-grace", "seconds from 0 to 600"),
    ],
)
def test_bad_watchdog_argument_is_a_usage_error_naming_the_flag(capsys, argv, flag, allowed):
    from dtwatch.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and allowed in err and repr(argv[2]) in err


def test_watchdog_argument_beats_environment_beats_default(caplog):
    env = {"DTWATCH_STALL_WINDOW": "30", "DTWATCH_METRICS_PORT": "off", "DTWATCH_CONSOLE": "sometimes",
           "DTWATCH_FAIL_FAST": "1", "DTWATCH_IDLE_EXIT": "7", "DTWATCH_NODE": "n7", "DTWATCH_JOB_ID": "from-env"}
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        opts = watch_opts(["watch", "--stall-window", "12", "--console", "off"], env)
    assert dtwatch_warnings(caplog) == []  # DTWATCH_CONSOLE is bad, but the argument wins: not even read
    assert (opts.stall_window, opts.console) == (12.0, "off")  # arguments
    assert (opts.metrics_port, opts.fail_fast, opts.idle_exit, opts.node, opts.job_id) == \
        (None, True, 7.0, "n7", "from-env")  # environment
    assert (opts.rank_wait, opts.window_floor, opts.poll_interval) == (3600.0, 20.0, 1.0)  # defaults


def test_run_has_its_own_defaults_and_reads_the_same_environment():
    opts = watch_opts(["run", "--", "true"], {})
    assert (opts.job_id, opts.metrics_port, opts.console) == ("", 0, "stderr")
    opts = watch_opts(["run", "--", "true"], {"DTWATCH_METRICS_PORT": "9999", "DTWATCH_CONSOLE": "auto"})
    assert (opts.metrics_port, opts.console) == (9999, "auto")
    opts = watch_opts(["run", "--metrics-port", "off", "--", "true"], {"DTWATCH_METRICS_PORT": "9999"})
    assert opts.metrics_port is None


def test_bad_watch_options_in_code_raise_config_error():
    with pytest.raises(dtwatch.ConfigError) as exc:
        WatchOptions(job_id="j", stall_window=0.0)
    assert "stall_window=0.0" in str(exc.value) and "seconds from 0.5 to 86400" in str(exc.value)


def test_job_store_address():
    assert job_store_address("h:29500", {}) == ("h", 29500)
    assert job_store_address("", {"MASTER_ADDR": "m", "MASTER_PORT": "1234"}) == ("m", 1234)
    assert job_store_address("none", {"MASTER_ADDR": "m", "MASTER_PORT": "1234"}) is None
    assert job_store_address("", {}) is None


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("1", True), ("", True)])
def test_dtwatch_enabled(caplog, value, on):
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        assert enabled({"DTWATCH_ENABLED": value}) is on
    assert dtwatch_warnings(caplog) == []


def test_malformed_dtwatch_enabled_warns_and_stays_on(caplog):
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        assert enabled({"DTWATCH_ENABLED": "perhaps"}) is True
    (warning,) = dtwatch_warnings(caplog)
    assert "DTWATCH_ENABLED" in warning and "1/0, true/false" in warning
