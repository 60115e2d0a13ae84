"""A checkpoint record as JSON (``checkpoint_info_to_json`` / ``checkpoint_info_from_json``): what a
coordinator hands ranks that never open the manifest (DESIGN.md §12). A real committed record
crosses unchanged; any other document is refused by name, the field and the cure named.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore
from ckptstore import extending
from ckptstore.errors import ConfigError
from ckptstore.manifest.records import (
    CheckpointInfo,
    ComponentInfo,
    checkpoint_info_from_json,
    checkpoint_info_to_json,
    field_names,
)

WHAT = "test transfer"
SAME_VERSION = "plan and load with the same ckptstore version"


@pytest.fixture(scope="module")
def info(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CheckpointInfo]:
    """A checkpoint committed to a SQLite manifest: two components, training info, metrics."""
    root: Path = tmp_path_factory.mktemp("records-json")
    with ckptstore.open_run("json", db=root / "m.db", store=root / "store") as run:
        yield run.save(
            7,
            {"policy": {"w": torch.ones(3)}, "optimizer": {"step": torch.tensor(7)}},
            training_info={"iteration": 7, "tags": ["a", "b"], "nested": {"lr": 0.001}},
            metrics={"loss": 0.25, "accuracy": 1},
        ).wait()


def sent(info: CheckpointInfo) -> dict[str, Any]:
    """The record as another process receives it: through JSON text."""
    doc: dict[str, Any] = json.loads(json.dumps(checkpoint_info_to_json(info)))
    return doc


def test_a_committed_record_crosses_json_unchanged(info: CheckpointInfo) -> None:
    assert info.status == "committed"
    assert {c.name for c in info.components} == {"policy", "optimizer"}
    assert isinstance(info.created_at, dt.datetime)
    assert isinstance(info.committed_at, dt.datetime)
    assert isinstance(info.save_seconds, float)
    received = checkpoint_info_from_json(sent(info), what=WHAT)
    assert received == info
    assert received.committed_at == info.committed_at
    assert all(isinstance(c, ComponentInfo) for c in received.components)
    assert received.training_info == {"iteration": 7, "tags": ["a", "b"], "nested": {"lr": 0.001}}
    assert received.metrics == {"loss": 0.25, "accuracy": 1}


def test_the_document_holds_every_field_as_plain_json(info: CheckpointInfo) -> None:
    doc = checkpoint_info_to_json(info)
    assert list(doc) == field_names(CheckpointInfo)
    assert [list(c) for c in doc["components"]] == [field_names(ComponentInfo)] * 2
    assert doc["committed_at"] == info.committed_at.isoformat()  # type: ignore[union-attr]
    assert json.loads(json.dumps(doc)) == doc
    doc["training_info"]["nested"]["lr"] = 1.0  # the document shares nothing with the record
    assert info.training_info == {"iteration": 7, "tags": ["a", "b"], "nested": {"lr": 0.001}}


def test_the_floor_offers_the_same_functions() -> None:
    assert extending.checkpoint_info_to_json is checkpoint_info_to_json
    assert extending.checkpoint_info_from_json is checkpoint_info_from_json


def test_json_numbers_and_nulls_read_as_their_fields(info: CheckpointInfo) -> None:
    doc = sent(info)
    doc.update(save_seconds=2, blocked_seconds=None, committed_at=None, metrics=None, error=None)
    received = checkpoint_info_from_json(doc, what=WHAT)
    assert received.save_seconds == 2.0
    assert isinstance(received.save_seconds, float)
    assert (received.blocked_seconds, received.committed_at, received.metrics) == (None,) * 3


def edit_component(field: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(doc: dict[str, Any]) -> Any:
        doc["components"][1][field] = value
        return doc

    return edit


def drop(field: str) -> Callable[[dict[str, Any]], Any]:
    def edit(doc: dict[str, Any]) -> Any:
        del doc[field]
        return doc

    return edit


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (lambda d: [d], ["checkpoint must be a JSON object, got list", SAME_VERSION]),
        (drop("metrics"), ["checkpoint lacks ['metrics'] and has unknown []", SAME_VERSION]),
        (lambda d: {**d, "extra": 1}, ["checkpoint lacks [] and has unknown ['extra']"]),
        (lambda d: {**d, "step": "7"}, ["checkpoint.step is '7', not int", SAME_VERSION]),
        (lambda d: {**d, "step": True}, ["checkpoint.step is True, not int"]),
        (lambda d: {**d, "step": -1}, ["checkpoint.step: step must be between 0 and 2**63-1"]),
        (lambda d: {**d, "run": None}, ["checkpoint.run is None, not str"]),
        (lambda d: {**d, "save_seconds": "1.5"}, ["checkpoint.save_seconds is '1.5'"]),
        (lambda d: {**d, "created_at": "yesterday"}, ["checkpoint.created_at is 'yesterday'"]),
        (lambda d: {**d, "created_at": 1700000000}, ["checkpoint.created_at is 1700000000"]),
        (lambda d: {**d, "training_info": [1]}, ["checkpoint.training_info is [1]"]),
        (lambda d: {**d, "components": {}}, ["checkpoint.components is {}"]),
        (lambda d: {**d, "components": [1]}, ["checkpoint.components[0] must be a JSON object"]),
        (edit_component("entries", "2"), ["checkpoint.components[1].entries is '2', not int"]),
        (
            edit_component("extra", 0),
            ["checkpoint.components[1] lacks [] and has unknown ['extra']", SAME_VERSION],
        ),
    ],
)
def test_a_malformed_document_is_refused_by_name(
    info: CheckpointInfo, edit: Callable[[dict[str, Any]], Any], needles: list[str]
) -> None:
    doc = edit(copy.deepcopy(sent(info)))
    with pytest.raises(ConfigError) as caught:
        checkpoint_info_from_json(doc, what=WHAT)
    message = str(caught.value)
    assert message.startswith(f"{WHAT}: ")
    for needle in needles:
        assert needle in message
