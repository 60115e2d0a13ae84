"""Which Megatron checkpoint a load reads, chosen by rank 0 alone, the same one on every rank.

As ``ckpt_dcp.load`` does, only the coordinator (rank 0) opens the manifest (DESIGN.md §12).
The other ranks need no Run: a store is enough (``load(sd, None, store=url)``). Sequence:

1. Every rank says whether its arguments do (a Run on rank 0; a Run or a store elsewhere), so a
   misconfigured rank fails every rank at once instead of leaving the others waiting.
2. Rank 0 picks the checkpoint: the step asked for, or the newest committed one whose metadata
   holds as a whole (:meth:`Source.validate`: the layout tiles every tensor, each rank
   component holds what the layout places in it -- indexes only, no tensor data). One that
   fails is marked corrupt (a writer does; a read-only run changes nothing and names the
   command that would) and the previous one is taken. Rank 0 broadcasts its choice
   (:mod:`._choice`: the checkpoint's record and its checked meta) or the error that stopped it.
3. Every rank loads that checkpoint from its store. Damage found while reading data (an
   ``IntegrityError`` on any rank: a blob that fails its digest, a shard missing from its
   component) is agreed on after the load, which is past Megatron's last collective, so no
   rank is left waiting in one: rank 0 marks the checkpoint corrupt (quarantining the damaged
   blob) and every rank falls back together -- unless the rank that found it reads another
   store URL than rank 0's run, whose word condemns nothing. Any other failure is raised on
   every rank -- on a rank that failed, its own error; on the others, one naming the rank
   that failed -- and marks nothing. A step asked for is never fallen back past.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, ConfigError, IntegrityError
from ckptstore.extending import CheckpointInfo, MissingBlobError, ObjectStore, Run, mark_corrupt
from ckptstore.integrations._common.megatron_layout import META
from ckptstore.integrations._common.megatron_source import Source
from ckptstore.integrations.megatron._choice import (
    choice_to_json,
    error_from_json,
    error_to_json,
    source_from_json,
)
from ckptstore.integrations.megatron._commit import describe

log = logging.getLogger("ckptstore.integrations.megatron")

#: Loads one checkpoint into the caller's sharded state dict (on every rank: collective).
Attempt = Callable[[Source], Any]
#: What a rank tells the others about its load: None if it loaded, else its failure.
Outcome = dict[str, Any] | None


#: Why rank 0 cannot take part without a Run.
RANK0_NEEDS_RUN = (
    "rank 0 chooses the checkpoint to load and needs the Run (open_run(name, writable=False) "
    "is enough; a writer also marks a damaged checkpoint corrupt); the other ranks may pass "
    "None and store=<the run's store>"
)


def load_chosen(
    run: Run | None,
    store: ObjectStore | None,
    step: int | None,
    attempt: Attempt,
    *,
    fallback: bool,
    problem: str | None,
) -> Any:
    """What ``attempt`` returns for checkpoint ``step`` (None: the newest committed one that
    holds up), loaded on every rank (see the module). ``store`` is what this rank reads (rank
    0: its run's); ``problem`` what is wrong with this rank's arguments, if anything.
    ``CheckpointNotFoundError`` when no checkpoint is left; without ``fallback``, the first
    failure is raised."""
    if _rank() == 0 and run is None:
        problem = RANK0_NEEDS_RUN
    _agree_on_arguments(problem)
    assert store is not None  # a rank without one had a problem, raised on every rank
    skipped: list[int] = []
    before: int | None = None
    while True:
        chosen, opened = _choose(run, step, before, fallback, skipped)
        failure: Exception | None = None
        try:
            loaded = attempt(opened if opened is not None else source_from_json(store, chosen))
        except Exception as exc:  # every rank must hear of it before any rank raises
            loaded, failure = None, exc
        info = None if opened is None else opened.info
        if not _fall_back(run, info, store, failure, fallback and step is None):
            if skipped:
                log.warning(
                    "loaded step %d after skipping corrupt %s", chosen["info"]["step"], skipped
                )
            return loaded
        before = chosen["info"]["step"]
        skipped.append(before)


def _agree_on_arguments(problem: str | None) -> None:
    """Raise ConfigError on every rank when any rank's arguments do not do."""
    problems = [
        f"rank {o['rank']}: {o['problem']}"
        for o in _gather({"rank": _rank(), "problem": problem})
        if o is not None and o["problem"] is not None
    ]
    if problems:
        raise ConfigError(f"Megatron load: {'; '.join(problems)}")


def _choose(
    run: Run | None, step: int | None, before: int | None, fallback: bool, skipped: list[int]
) -> tuple[dict[str, Any], Source | None]:
    """Rank 0's choice as sent to every rank (:func:`choice_to_json`), and on rank 0 the
    checkpoint itself, opened. Rank 0 picks and checks it; the others learn it and the steps
    it skipped, or the error that stopped it."""
    if _rank() == 0:
        assert run is not None  # rank 0 without a Run had a problem, raised on every rank
        try:
            source = _pick(run, step, before, fallback, skipped)
            chosen = choice_to_json(source)
        except Exception as exc:
            _share({"error": error_to_json(exc)})
            raise
        _share({"error": None, "choice": chosen, "skipped": skipped})
        return chosen, source
    verdict = _share(None)
    if verdict["error"] is not None:
        raise error_from_json(verdict["error"])
    skipped[:] = verdict["skipped"]
    return verdict["choice"], None


def _pick(
    run: Run, step: int | None, before: int | None, fallback: bool, skipped: list[int]
) -> Source:
    """Rank 0: checkpoint ``step`` opened, or the newest committed one below ``before`` whose
    metadata holds (see the module); ``CheckpointNotFoundError`` when none is left."""
    if step is not None:
        loaded = run.load(step, components=[META])
        return Source(run.store, loaded.info, loaded.state[META])
    source = _newest_valid(run, before, fallback, skipped)
    if source is None:
        detail = f"; skipped corrupt steps {skipped}" if skipped else ""
        raise CheckpointNotFoundError(
            f"run {run.name!r} has no committed checkpoint to load{detail}"
        )
    return source


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
            mark_corrupt(run, info, exc)
            skipped.append(info.step)
            before = info.step
            continue
        return source


def _fall_back(
    run: Run | None,
    info: CheckpointInfo | None,
    store: ObjectStore,
    failure: Exception | None,
    fallback: bool,
) -> bool:
    """Whether every rank falls back past the checkpoint just loaded (``info``, on rank 0):
    its data is damaged. False when every rank loaded it. Raises on every rank when the load
    failed otherwise (see the module)."""
    outcomes = _gather(_outcome(failure, store))
    decided = None
    if _rank() == 0:
        assert run is not None
        assert info is not None
        decided = _decide(run, info, outcomes, fallback)
    verdict = _share(decided)
    if verdict["action"] == "loaded":
        return False
    if verdict["action"] == "fall back":
        return True
    if failure is not None:
        raise failure
    raise CkptStoreError(verdict["error"])


def _outcome(failure: Exception | None, store: ObjectStore) -> Outcome:
    if failure is None:
        return None
    damage = failure if isinstance(failure, IntegrityError) else None
    return {
        "rank": _rank(),
        "store": store.url,
        "damage": damage is not None,
        "missing": isinstance(failure, MissingBlobError),
        "digest": None if damage is None else damage.digest,
        "message": str(failure),
        "error": describe(failure),
    }


def _decide(
    run: Run, info: CheckpointInfo, outcomes: list[Outcome], fallback: bool
) -> dict[str, Any]:
    """Rank 0: every rank loaded; or some found damage in rank 0's store (and none failed
    otherwise), so the checkpoint is condemned and all fall back; or the load fails everywhere."""
    failed = [o for o in outcomes if o is not None]
    if not failed:
        return {"action": "loaded"}
    where = f"the Megatron load of run {run.name!r} step {info.step}"
    elsewhere = [o for o in failed if o["damage"] and o["store"] != run.store.url]
    if elsewhere:
        first = elsewhere[0]
        return {
            "action": "raise",
            "error": f"{where} failed on rank {first['rank']}, which reads the store "
            f"{first['store']}, not rank 0's {run.store.url}: {first['error']}. Nothing was "
            "marked corrupt; give every rank the run's store (or check this one with "
            f"`ckptstore verify {run.name}@{info.step}`)",
        }
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
        mark_corrupt(run, info, damage)
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
