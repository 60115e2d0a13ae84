"""``open_run(config=..., identity=...)``: the library refuses only a changed identity, records
every other config change, and names the changed keys and the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptstore.checkpointer import open_run, run_info
from ckptstore.checkpointer.open import changed_keys, identity_changes
from ckptstore.errors import ConfigError
from ckptstore.objectstore import LocalStore

CONFIG: dict[str, Any] = {
    "model": {"layers": 2, "width": 16, "dropout": 0.1},
    "lr": 1e-4,
    "steps": 10,
}
#: What identifies the run: the model, but its dropout may change.
IDENTITY: dict[str, Any] = {"model": {"layers": 2, "width": 16}}


def _saved_run(db_url: str, store: LocalStore) -> None:
    with open_run("id", db=db_url, store=store, config=CONFIG, identity=IDENTITY) as run:
        run.save(1, {"policy": {"w": torch.ones(4)}}).wait()


def test_a_change_outside_the_identity_is_recorded(db_url: str, store: LocalStore) -> None:
    _saved_run(db_url, store)
    changed = {"model": {"layers": 2, "width": 16, "dropout": 0.0}, "lr": 2e-4, "steps": 20}
    with open_run("id", db=db_url, store=store, config=changed, identity=IDENTITY) as run:
        latest = run.latest()
        assert latest is not None
        assert latest.step == 1
    recorded = run_info("id", db=db_url)
    assert recorded is not None
    assert recorded.config == changed


def test_a_changed_identity_is_refused_naming_keys_and_fix(db_url: str, store: LocalStore) -> None:
    _saved_run(db_url, store)
    wider = {**CONFIG, "model": {**CONFIG["model"], "width": 32}, "lr": 5e-4}
    identity = {"model": {"layers": 2, "width": 32}}
    with pytest.raises(ConfigError, match=r"different identity \(changed: model\.width\)") as exc:
        open_run("id", db=db_url, store=store, config=wider, identity=identity)
    assert "fork_from='id@STEP'" in str(exc.value)
    assert "lr" not in str(exc.value)
    recorded = run_info("id", db=db_url)
    assert recorded is not None
    assert recorded.config == CONFIG  # the refused open recorded nothing


def test_without_identity_the_whole_config_identifies_the_run(
    db_url: str, store: LocalStore
) -> None:
    _saved_run(db_url, store)
    with pytest.raises(ConfigError, match=r"different config \(changed: lr, steps\)") as exc:
        open_run("id", db=db_url, store=store, config={**CONFIG, "lr": 1.0, "steps": 3})
    assert "identity=" in str(exc.value)
    with open_run("id", db=db_url, store=store, config={**CONFIG, "lr": 1.0}, identity={}):
        pass  # an empty identity: any change is recorded
    recorded = run_info("id", db=db_url)
    assert recorded is not None
    assert recorded.config == {**CONFIG, "lr": 1.0}


def test_identity_must_be_part_of_config(db_url: str, store: LocalStore) -> None:
    with pytest.raises(ConfigError, match=r"identity must be a part of config.*model\.width"):
        open_run("id", db=db_url, store=store, config=CONFIG, identity={"model": {"width": 8}})
    with pytest.raises(ConfigError, match="pass config"):
        open_run("id", db=db_url, store=store, identity=IDENTITY)
    assert run_info("id", db=db_url) is None  # refused before the database was written


def test_changed_keys_are_dotted_and_identity_compares_only_its_keys() -> None:
    assert changed_keys({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 1, "c": 4}, "e": 5}) == [
        "a.c",
        "d",
        "e",
    ]
    recorded = {"model": {"layers": 2, "width": 16, "dropout": 0.1}, "lr": 1e-4}
    assert identity_changes(recorded, {"model": {"layers": 2, "width": 16}}) == []
    assert identity_changes(recorded, {"model": {"layers": 3}}) == ["model.layers"]
    assert identity_changes(recorded, {"seed": 1}) == ["seed"]  # a key the run never had
    assert identity_changes(None, {"model": {"layers": 2}}) == ["model"]
