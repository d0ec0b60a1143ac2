"""Configuration of the recorder: arguments, DTWATCH_* environment, and torch's diagnostics variables.

Arguments are validated strictly (:class:`dtwatch.ConfigError`); environment values are refused with
one warning and replaced by the default; an argument beats the environment. dtwatch sets torch's
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
from dtwatch.config import Config
from dtwatch.record import installation
from dtwatch.record.torchenv import apply_torch_env
from tests.conftest import init_world1

# torch 2.14 reads the Flight Recorder's dump on timeout as TORCH_FR_DUMP_ON_TIMEOUT (2.15's nccl2 only so);
# older releases as TORCH_NCCL_DUMP_ON_TIMEOUT.
DUMP_ON_TIMEOUT = ("TORCH_FR_DUMP_ON_TIMEOUT" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 14)
                   else "TORCH_NCCL_DUMP_ON_TIMEOUT")
FR_VARS = ("TORCH_FR_BUFFER_SIZE", DUMP_ON_TIMEOUT, "TORCH_FR_DUMP_TEMP_FILE")


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
        ({"batch_fingerprint": 1}, "batch_fingerprint", "1/0, true/false"),
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
        ("DTWATCH_BATCH_FINGERPRINT", "sometimes", "batch_fingerprint", "1/0, true/false"),
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
    rec = installation.active()
    assert rec.config.ring_records == 4096 and rec.capacity == 4096


def test_argument_beats_environment(dtwatch_env, monkeypatch, caplog):
    monkeypatch.setenv("DTWATCH_RING_RECORDS", "128")
    monkeypatch.setenv("DTWATCH_SAMPLE_INTERVAL", "0.5")
    monkeypatch.setenv("DTWATCH_WATCHDOG", "sometimes")  # invalid, but overridden: no warning
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        assert dtwatch.install(ring_records=256, watchdog="off") is True
    assert dtwatch_warnings(caplog) == []
    rec = installation.active()
    assert rec.config.ring_records == 256  # argument
    assert rec.config.sample_interval == 0.5  # environment, where no argument was given
    init_world1()
    assert rec.capacity == 256  # the ring really has that many slots


def test_environment_values_are_parsed(dtwatch_env):
    config = Config.from_env(environ={
        "DTWATCH_RING_RECORDS": "1024", "DTWATCH_WATCHDOG": "OFF", "DTWATCH_TORCH_ENV": "no",
        "DTWATCH_STACK_SIGNAL": "usr1", "DTWATCH_SAMPLE_INTERVAL": "0.25",
    })
    got = (config.ring_records, config.watchdog, config.torch_env, config.sample_interval)
    assert got == (1024, "off", False, 0.25)
    assert config.stack_signal == int(signal.SIGUSR1)


# ---------------------------------------------------------------------------------------------------
# torch's diagnostics variables
# ---------------------------------------------------------------------------------------------------
def test_unset_torch_variables_are_set_and_logged(dtwatch_env, caplog):
    with caplog.at_level(logging.INFO, logger="dtwatch"):
        assert dtwatch.install() is True
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert os.environ[DUMP_ON_TIMEOUT] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(dtwatch_env / "fr" / "torch-fr-rank-")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ  # this torch reads the new spelling only
    messages = [r.getMessage() for r in caplog.records if r.name == "dtwatch"]
    for name, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"), ("TORCH_FR_BUFFER_SIZE", "2000"),
                        (DUMP_ON_TIMEOUT, "1")):
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
    assert os.environ[DUMP_ON_TIMEOUT] == "1"  # the unset ones are still set


def test_apply_torch_env_on_a_given_environment():
    env = {"TORCH_FR_BUFFER_SIZE": "10"}
    changes = apply_torch_env(300, "/x/fr-", environ=env)
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", DUMP_ON_TIMEOUT: "1",
        "TORCH_FR_DUMP_TEMP_FILE": "/x/fr-",
    }
    assert [c.split("=", 1)[0] for c in changes] == [
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", DUMP_ON_TIMEOUT, "TORCH_FR_DUMP_TEMP_FILE"]


def test_install_after_init_warns_naming_unapplied_settings(dtwatch_env, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's, set before init: it applied
    init_world1()
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        assert dtwatch.install() is True
    (warning,) = dtwatch_warnings(caplog)
    assert "installed after init_process_group" in warning
    named = warning.split("not to the existing ones: ", 1)[1].split(". ", 1)[0].split(", ")
    assert named == ["TORCH_FR_BUFFER_SIZE", DUMP_ON_TIMEOUT, "TORCH_FR_DUMP_TEMP_FILE"]
    # The process group exists already, so the ring is there at once and records.
    dist.all_reduce(torch.ones(1))
    snap = dtwatch.read_ring(dtwatch_env / "rank-00000.ring")
    assert [r.op for r in snap.records_list()] == ["all_reduce"]


def test_watchdog_options_name_the_setting_and_what_is_allowed(caplog):
    from dtwatch.config import watch_options

    with pytest.raises(dtwatch.ConfigError) as exc:
        watch_options({"full_view_ranks": 0}, environ={})
    assert "full_view_ranks=0" in str(exc.value) and "a number of ranks from 1 to 65536" in str(exc.value)
    assert watch_options({}, environ={"DTWATCH_FULL_VIEW_RANKS": "256"}).full_view_ranks == 256
    with caplog.at_level(logging.WARNING, logger="dtwatch"):
        opts = watch_options({}, environ={"DTWATCH_FULL_VIEW_RANKS": "lots"})
    assert opts.full_view_ranks == 64
    (warning,) = dtwatch_warnings(caplog)
    assert "DTWATCH_FULL_VIEW_RANKS" in warning and "a number of ranks from 1 to 65536" in warning
