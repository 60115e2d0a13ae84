"""Loading the newest Megatron checkpoint that holds up, the same one on every rank.

As ``ckpt_dcp.load`` does, only the coordinator (rank 0) asks the manifest which checkpoint is
the newest. Before anything is loaded it checks that checkpoint's metadata as a whole
(:meth:`Source.validate`: the layout tiles every tensor, each rank component holds what the
layout places in it -- indexes only, no tensor data); when the check fails, it marks the
checkpoint corrupt (a writer does; a read-only run changes nothing and names the command that
would) and takes the previous one. Then it tells the other ranks which step to load, or why
there is none.

Every rank then loads that step. Damage found while reading data (an ``IntegrityError`` on any
rank: a blob that fails its digest, a shard missing from its component) is agreed on after the
load, which is past Megatron's last collective, so no rank is left waiting in one: rank 0 marks
the checkpoint corrupt (quarantining the damaged blob) and every rank falls back together. Any
other failure is raised on every rank -- on a rank that failed, its own error; on the others,
one naming the rank that failed -- and marks nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, IntegrityError
from ckptstore.floor import CheckpointInfo, MissingBlobError, Run, mark_corrupt
from ckptstore.integrations._common.megatron_source import Source
from ckptstore.integrations.megatron._commit import describe

log = logging.getLogger("ckptstore.integrations.megatron")

#: Loads one checkpoint into the caller's sharded state dict (on every rank: collective).
Attempt = Callable[[Source], Any]
#: What a rank tells the others about its load: None if it loaded, else its failure.
Outcome = dict[str, Any] | None


def load_newest(run: Run, attempt: Attempt, *, fallback: bool) -> Any:
    """What ``attempt`` returns for the newest committed checkpoint that holds up, loaded on
    every rank (see the module); without ``fallback``, the first failure is raised.
    ``CheckpointNotFoundError`` when no checkpoint is left."""
    skipped: list[int] = []
    before: int | None = None
    while True:
        info, source = _choose(run, before, fallback, skipped)
        if info is None:
            detail = f"; skipped corrupt steps {skipped}" if skipped else ""
            raise CheckpointNotFoundError(
                f"run {run.name!r} has no committed checkpoint to load{detail}"
            )
        failure: Exception | None = None
        try:
            loaded = attempt(source if source is not None else Source(run.store, info))
        except Exception as exc:  # every rank must hear of it before any rank raises
            loaded, failure = None, exc
        if not _fall_back(run, info, failure, fallback):
            if skipped:
                log.warning(
                    "run %r: loaded step %d after skipping corrupt %s", run.name, info.step, skipped
                )
            return loaded
        skipped.append(info.step)
        before = info.step


def _choose(
    run: Run, before: int | None, fallback: bool, skipped: list[int]
) -> tuple[CheckpointInfo | None, Source | None]:
    """The checkpoint every rank loads next (None: none is left) and, on rank 0, its checked
    source. Rank 0 picks and checks it; the others learn its step and the steps it skipped."""
    if _rank() == 0:
        try:
            source = _newest_valid(run, before, fallback, skipped)
        except Exception as exc:
            _share({"error": describe(exc)})
            raise
        step = None if source is None else source.info.step
        _share({"error": None, "step": step, "skipped": skipped})
        return (None, None) if source is None else (source.info, source)
    verdict = _share(None)
    if verdict["error"] is not None:
        raise CkptStoreError(
            f"rank 0 could not choose a checkpoint of run {run.name!r} to load: {verdict['error']}"
        )
    skipped[:] = verdict["skipped"]
    if verdict["step"] is None:
        return None, None
    return run.checkpoint(verdict["step"]), None


def _newest_valid(
    run: Run, before: int | None, fallback: bool, skipped: list[int]
) -> Source | None:
    """Rank 0: the newest committed checkpoint below ``before`` whose metadata holds, opened;
    those that fail are marked corrupt (see the module) and added to ``skipped``."""
    while True:
        info = run.latest(before_step=before)
        if info is None:
            return None
        try:
            source = Source(run.store, info)
            source.validate()
        except IntegrityError as exc:
            if not fallback:
                raise
            _condemn(run, info, exc)
            skipped.append(info.step)
            before = info.step
            continue
        return source


def _condemn(run: Run, info: CheckpointInfo, exc: IntegrityError) -> None:
    """Rank 0: the checkpoint failed verification -- marked corrupt by a writer, reported by
    a reader -- unless the store is the wrong one (``StoreNotFoundError``)."""
    mark_corrupt(run, info, exc)


def _fall_back(run: Run, info: CheckpointInfo, failure: Exception | None, fallback: bool) -> bool:
    """Whether every rank falls back past ``info`` (its data is damaged); False when every
    rank loaded it. Raises on every rank when the load failed otherwise (see the module)."""
    outcomes = _gather(_outcome(failure))
    verdict = _share(_decide(run, info, outcomes, fallback) if _rank() == 0 else None)
    if verdict["action"] == "loaded":
        return False
    if verdict["action"] == "fall back":
        return True
    if failure is not None:
        raise failure
    raise CkptStoreError(verdict["error"])


def _outcome(failure: Exception | None) -> Outcome:
    if failure is None:
        return None
    damage = failure if isinstance(failure, IntegrityError) else None
    return {
        "rank": _rank(),
        "damage": damage is not None,
        "missing": isinstance(failure, MissingBlobError),
        "digest": None if damage is None else damage.digest,
        "message": str(failure),
        "error": describe(failure),
    }


def _decide(
    run: Run, info: CheckpointInfo, outcomes: list[Outcome], fallback: bool
) -> dict[str, Any]:
    """Rank 0: every rank loaded; or some found damage (and none failed otherwise), so the
    checkpoint is condemned and all fall back; or the load fails everywhere."""
    failed = [o for o in outcomes if o is not None]
    if not failed:
        return {"action": "loaded"}
    where = f"the Megatron load of run {run.name!r} step {info.step}"
    other = [o for o in failed if not o["damage"]]
    if other or not fallback:
        first = (other or failed)[0]
        return {
            "action": "raise",
            "error": f"{where} failed on rank {first['rank']}: {first['error']}",
        }
    first = failed[0]
    damage = (MissingBlobError if first["missing"] else IntegrityError)(
        f"rank {first['rank']}: {first['message']}"
    )
    damage.digest = first["digest"]
    try:
        _condemn(run, info, damage)
    except CkptStoreError as exc:  # the store is the wrong one: nothing was marked
        return {"action": "raise", "error": f"{where} failed: {exc}"}
    return {"action": "fall back"}


def _share(payload: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's ``payload`` (JSON), on every rank."""
    if not _distributed():
        assert payload is not None
        return payload
    box: list[Any] = [json.dumps(payload) if _rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    shared: dict[str, Any] = json.loads(box[0])
    return shared


def _gather(outcome: Outcome) -> list[Outcome]:
    """Every rank's outcome, on every rank."""
    if not _distributed():
        return [outcome]
    texts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, json.dumps(outcome))
    return [json.loads(text) for text in texts]


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
