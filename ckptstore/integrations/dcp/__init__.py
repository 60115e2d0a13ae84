"""torch.distributed.checkpoint (DCP) on ckptstore: every rank uploads its own blobs, the
coordinator commits one checkpoint row, and nothing is ever pickled.

Use the wrappers (they pick the no-pickle planners and turn DCP's failures into ckptstore's
errors)::

    import ckptstore
    from ckptstore.integrations import dcp as ckpt_dcp

    run = ckptstore.open_run("llama-8b", db=..., store=..., writable=rank == 0)
    ckpt_dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, run, step)
    ckpt_dcp.load(state_dict, run)            # newest committed step, resharded to this layout

Only the coordinator needs the manifest database (DESIGN.md §12). In a torchrun job rank 0
opens the run and the other ranks pass None and the store::

    run = ckptstore.open_run("llama-8b", db=DB, store=STORE) if rank == 0 else None
    ckpt_dcp.save(state_dict, run if rank == 0 else STORE, step)
    ckpt_dcp.load(state_dict, run, store=STORE)   # rank 0 resolves, the others follow

A controller that is no rank plans the load itself and hands every rank the same
:class:`LoadPlan` (picklable; ``to_json``/``from_json`` for any channel)::

    plan = ckpt_dcp.plan_load(run)            # controller: newest committed, metadata checked
    ckpt_dcp.load(state_dict, plan, store=STORE)                     # every rank, no database

and saves without a rank committing: every rank calls :func:`save_shards` (uploads only),
rank 0 returns every receipt, and the controller commits them with its own components::

    receipts = ckpt_dcp.save_shards(state_dict, STORE)               # every rank
    run.save(step, {"trainer": ...}, receipts=receipts)              # the controller

or pass the parts to DCP yourself: ``dcp.save(sd, storage_writer=CkptStoreWriter(run, step),
planner=NoPickleSavePlanner())`` (``CkptStoreWriter(store, commit=False)`` and its
``receipts`` for the upload alone) and ``dcp.load(sd, storage_reader=CkptStoreReader.from_run(
run), planner=NoPickleLoadPlanner())`` (``CkptStoreReader.for_plan(store, plan)`` without a
database).

How a checkpoint is laid out: rank ``r`` stores the items DCP planned for it as the component
``dcp/rank<r>`` (a list: tensors -- chunked, packed, compressed and deduplicated as any
component -- and plain values as JSON text); the coordinator stores DCP's metadata as JSON in
``dcp/metadata`` and commits everything in one transaction in ``finish()``, which DCP calls only
when every rank's writes succeeded. A failed rank commits nothing. A checkpoint committed from
``save_shards``' receipts is the same components, byte for byte.

Loading needs the metadata component's digest (a :class:`LoadPlan` carries it); the rank
components' digests are in the metadata document, and every rank then reads only the blobs
that hold the boxes it asks for. Before anything is read, the metadata is checked as a whole:
every tensor's chunks tile it exactly and its shape is one a tensor can have
(``ckptstore.serialize.tiling``), every chunk and value has one location (``_validate``), and
each rank component, when opened, holds what the metadata places in it. A checkpoint that fails
is treated like a corrupt one: ``IntegrityError``, and ``load`` falls back to the previous
committed checkpoint -- decided by rank 0, the same on every rank (``_load``).

The writer is in ``_writer``, the reader in ``_reader``, the plan in ``_plan``, the wrappers in
``_save`` and ``_load``, the no-pickle planners in ``_planners`` (plain values as JSON:
``_plainvalues``) and the metadata document in ``_metadata``; this module is the public face.
"""

from __future__ import annotations

from ckptstore.integrations.dcp._load import load, plan_load
from ckptstore.integrations.dcp._metadata import METADATA_COMPONENT, rank_component
from ckptstore.integrations.dcp._plan import LoadPlan
from ckptstore.integrations.dcp._planners import (
    NoPickleLoadPlanner,
    NoPickleSavePlanner,
    SnapshotStager,
)
from ckptstore.integrations.dcp._reader import (
    CkptStoreReader,
    is_dcp_checkpoint,
    iter_full_tensors,
    validate_checkpoint,
)
from ckptstore.integrations.dcp._save import save, save_shards
from ckptstore.integrations.dcp._writer import CkptStoreWriter

__all__ = [
    "METADATA_COMPONENT",
    "CkptStoreReader",
    "CkptStoreWriter",
    "LoadPlan",
    "NoPickleLoadPlanner",
    "NoPickleSavePlanner",
    "SnapshotStager",
    "is_dcp_checkpoint",
    "iter_full_tensors",
    "load",
    "plan_load",
    "rank_component",
    "save",
    "save_shards",
    "validate_checkpoint",
]
