"""Every failure of ``python -m trainer.grpo`` is one ``error:`` line with a documented status.

0 finished or stopped early; 2 the configuration or the run must be fixed (ConfigurationError,
ResumeError, ckptstore's ConfigError); 1 a failure at run time (the store failing under a save,
anything unexpected). The traceback comes only with ``--traceback``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_helpers import checkout_env, small_overrides

from ckptstore.errors import (
    ConfigError,
    ForeignDatabaseError,
    IntegrityError,
    SaveError,
    SchemaError,
    StoreNotFoundError,
)
from trainer.errors import ConfigurationError, ResumeError
from trainer.failures import error_line, exit_code, known_error
from trainer.grpo import main
from trainer.watchdog import StallError

pytestmark = pytest.mark.timeout(300)


def _local(root: Path, **extra: object) -> list[str]:
    return small_overrides(root, backend="local", **extra)


def test_a_store_failing_under_a_mid_run_save_is_one_line_exit_1(tmp_path: Path) -> None:
    # The store's blob directory is replaced by a file once the run has committed a save: the
    # next save fails. The old trainer exited 2 (README: configuration and resume errors).
    args = _local(tmp_path, **{"grpo.max_num_steps": 100_000, "data.train.num_prompts": 100_000})
    child = subprocess.Popen(
        [sys.executable, "-m", "trainer.grpo", *args],
        env=checkout_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("saved step"):
                break
        cas = tmp_path / "store" / "cas"
        shutil.move(cas, tmp_path / "cas.moved")
        cas.write_text("not a directory")
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert str(tmp_path / "store") in lines[0]  # it names the store


def test_an_unexpected_failure_is_one_line_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _local(
        tmp_path,
        **{
            "grpo.max_num_steps": 8,
            "async_rl.sampler.name": "custom",
            "async_rl.sampler.custom_class": "failing_sampler:FailAfterTwoSaves",
        },
    )
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "error: RuntimeError: sampler bug at version 3 (an unexpected failure; re-run with "
        "--traceback to see where; a re-run resumes from the newest committed checkpoint)"
    ], err
    # With --traceback: the traceback first, then the same one line.
    assert main(["--traceback", *args]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "sampler bug at version 3" in err
    assert err.strip().splitlines()[-1].startswith("error: RuntimeError: sampler bug")


def test_configuration_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert main(_local(tmp_path, **{"checkpointing.save_period": 0})) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: checkpointing.save_period=0 must be at least 1"
    ]
    # A store URL ckptstore cannot use is ckptstore's ConfigError: fix the location, exit 2.
    assert main(_local(tmp_path, **{"checkpointing.store": "ftp://nowhere/store"})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ")
    assert "ftp://nowhere/store" in err[0]
    assert time.monotonic() - started < 60


def test_the_exit_status_of_each_kind_of_failure() -> None:
    must_fix = [
        ConfigurationError("x"),
        ResumeError("x"),
        ConfigError("x"),
        SchemaError("x"),
        ForeignDatabaseError("x"),
    ]
    assert [exit_code(known_error(e)) for e in must_fix] == [2] * 5
    run_time = [SaveError("x"), StoreNotFoundError("x"), IntegrityError("x"), StallError("x")]
    assert [exit_code(known_error(e)) for e in run_time] == [1] * 4
    wrapped = RuntimeError("a wrapper")
    wrapped.__cause__ = ResumeError("the saved policy does not fit")
    assert known_error(wrapped) is wrapped.__cause__
    assert exit_code(known_error(OSError("unexpected"))) == 1
    assert error_line(ValueError("a\nb"), None).startswith("ValueError: a (an unexpected")
