"""The multi-rank commit of a Megatron save: every rank uploads, rank 0 commits or nobody does.

Sequence (every rank, in the order Megatron calls the strategy):

1. Each rank stores the main replicas of its shards as ``megatron/rank<r>`` through a
   :class:`~ckptstore.extending.ShardWriter` and keeps an :class:`Outcome`: its receipt
   and layout, or the error that stopped it. An async save does this in Megatron's background
   process, which hands the outcome back as a JSON file (never a pickle).
2. :func:`finish_save` (inside ``save``, or in an async request's finalize function, which
   Megatron runs on all ranks) gathers every outcome on every rank.
3. Rank 0 commits all receipts plus ``megatron/meta`` and ``megatron/common`` in one
   transaction -- only if every rank succeeded -- and broadcasts the result; every rank raises
   the same ``SaveError`` otherwise, so nothing partial is ever committed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ckptstore.errors import SaveError
from ckptstore.extending import (
    ObjectStore,
    Run,
    ShardWriter,
    open_store,
    receipt_from_json,
    receipt_to_json,
)
from ckptstore.integrations._common.megatron_layout import COMMON, META, Layout, meta_state


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """How a background process reopens the store (an open store does not cross a fork)."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(store: ObjectStore) -> StoreSpec:
        """The spec of an open store (an S3 store keeps its explicit endpoint)."""
        endpoint = getattr(store, "endpoint", None)
        return StoreSpec(store.url, {"endpoint_url": endpoint} if endpoint else {})

    def open(self) -> ObjectStore:
        """A new store over the same location."""
        return open_store(self.url, create=False, **self.options)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one rank's upload produced: a receipt (None: nothing to store) or an error."""

    rank: int
    layout: str = Layout().to_json()
    receipt: dict[str, Any] | None = None
    error: str | None = None

    def to_json(self) -> str:
        """The outcome as JSON text (what the ranks exchange)."""
        return json.dumps(
            {"rank": self.rank, "layout": self.layout, "receipt": self.receipt, "error": self.error}
        )

    @staticmethod
    def from_json(text: str) -> Outcome:
        """The outcome :meth:`to_json` wrote."""
        doc = json.loads(text)
        return Outcome(doc["rank"], doc["layout"], doc["receipt"], doc["error"])


def describe(exc: BaseException) -> str:
    """One line naming an exception's type and message."""
    return f"{type(exc).__name__}: {exc}"


def upload(
    spec: StoreSpec | ObjectStore, component: str, state: dict[str, Any], rank: int, layout: str
) -> Outcome:
    """Store one rank's shards (a new writer each time: this may run in a forked process)."""
    if not state:
        return Outcome(rank, layout)
    try:
        store = spec if isinstance(spec, ObjectStore) else spec.open()
        with ShardWriter(store) as writer:
            receipt = writer.write(component, state)
        if not isinstance(spec, ObjectStore):
            store.close()
    except Exception as exc:
        return Outcome(rank, layout, error=describe(exc) + _shard_named(str(exc), layout))
    return Outcome(rank, layout, receipt_to_json(receipt))


def _shard_named(message: str, layout: str) -> str:
    """Which Megatron key a serializer error's path (``o0/...``, ``t3``) belongs to, if any."""
    head = message.split(":", 1)[0].split("/", 1)[0]
    parsed = Layout.from_json(layout, "save")
    keys = {t.path: f"ShardedTensor {t.key!r}" for t in parsed.tensors}
    keys.update({o.path: f"ShardedObject {o.key!r}" for o in parsed.objects})
    return f" (in {keys[head]})" if head in keys else ""


def upload_to_file(
    spec: StoreSpec, component: str, state: dict[str, Any], rank: int, layout: str, path: str
) -> None:
    """Megatron's async function: upload, then leave the outcome as JSON at ``path``."""
    outcome = upload(spec, component, state, rank, layout)
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as out:
        out.write(outcome.to_json())
    os.replace(partial, path)


def read_outcome(path: str, rank: int) -> Outcome:
    """The outcome an async upload left at ``path``, or an error outcome if it left none."""
    try:
        with open(path, encoding="utf-8") as src:
            return Outcome.from_json(src.read())
    except FileNotFoundError:
        return Outcome(
            rank, error="the background upload process exited without a result (was it killed?)"
        )


@dataclass(slots=True)
class Commit:
    """What rank 0 adds to the receipts: the step, its own components and the row's values."""

    step: int
    run: Run | None
    common: Any = None
    training_info: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    #: Why rank 0 cannot commit before any upload (e.g. a common state that is not plain).
    error: str | None = None
    #: Whether every rank component must differ from the previous checkpoint's (Run.save's
    #: stale-state guard over ``megatron/rank<r>``).
    expect_changed: bool = False


def finish_save(local: Outcome, commit: Commit, config: dict[str, Any]) -> int:
    """Gather every rank's outcome; rank 0 commits if all succeeded. Collective: call it on
    every rank. Returns the committed checkpoint's id; raises SaveError on every rank if any
    rank (or the commit) failed."""
    world = dist.get_world_size()
    texts: list[Any] = [None] * world
    dist.all_gather_object(texts, local.to_json())
    outcomes = [Outcome.from_json(text) for text in texts]
    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        verdict[0] = _commit_all(outcomes, commit, config, world)
    dist.broadcast_object_list(verdict, src=0)
    result: dict[str, Any] = json.loads(verdict[0])
    if result["error"] is not None:
        raise SaveError(result["error"])
    return int(result["checkpoint_id"])


def _commit_all(outcomes: list[Outcome], commit: Commit, config: dict[str, Any], world: int) -> str:
    """Rank 0's half of :func:`finish_save`: the verdict as JSON text."""
    failed = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error is not None]
    where = f"Megatron save of step {commit.step}"
    if failed:
        error = f"{where} failed, nothing was committed ({'; '.join(failed)}); save again"
        return json.dumps({"error": error})
    try:
        if commit.run is None or commit.run.epoch is None:
            raise SaveError(
                "rank 0 commits and needs a writable Run: pass open_run(name, writable=True) "
                "on rank 0 (a store, or None and store=, is enough on the other ranks)"
            )
        layout = Layout()
        for outcome in outcomes:
            layout = layout.merged(Layout.from_json(outcome.layout, where))
        receipts = [receipt_from_json(o.receipt) for o in outcomes if o.receipt is not None]
        components = {META: meta_state(layout, world, config), **_common(commit)}
        info = commit.run.save(
            commit.step,
            components,
            receipts=receipts,
            training_info=commit.training_info,
            metrics=commit.metrics,
            expect_changed=[r.component for r in receipts] if commit.expect_changed else (),
        ).wait()
    except Exception as exc:
        return json.dumps({"error": f"{where} failed at the commit: {describe(exc)}"})
    return json.dumps({"error": None, "checkpoint_id": info.id})


def _common(commit: Commit) -> dict[str, Any]:
    """The common component, if rank 0 has a common state dict."""
    return {} if commit.common is None else {COMMON: commit.common}
