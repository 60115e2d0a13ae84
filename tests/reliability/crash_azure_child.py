"""The saving process of the Azure crash tests (test_crash_points_azure.py): crash_child.py
unchanged, with job stores of kind ``azure`` opened on the job's Azurite container and the kill
points of an Azure upload.

Every blob goes up as staged blocks here (``block_threshold=1``), so ``put.partial.*`` kills a
process with half a block's body on the wire (crash_child's hook on the request body reader,
which Azure's blocks share with S3's parts), and ``put.partN`` while block N of a big blob is
being staged. (A store's small blobs go in one Put Blob, whose ``bytes`` body no hook can cut
short; the service stores a Put Blob whole or not at all.)

Run as crash_child.py is: ``python crash_azure_child.py serve`` or ``run JOB_JSON``.
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from typing import Any

import crash_child as base

from ckptstore.objectstore import ObjectStore
from ckptstore.objectstore._azure import AzureStore
from ckptstore.objectstore._azure_blocks import BlockUploads

_open_job_store = base.open_job_store
_install_s3 = base._install_s3


def open_job_store(spec: dict[str, Any]) -> ObjectStore:
    if spec["kind"] != "azure":
        return _open_job_store(spec)
    block_size = base.MULTIPART_BYTES if spec.get("multipart") else 4 * base.MiB
    return AzureStore(
        spec["container"],
        spec["prefix"],
        connection_string=spec["connection_string"],
        retry=base.FAST_RETRY,
        block_threshold=1,
        block_size=block_size,
    )


def install_azure(switch: base.Switch) -> None:
    """crash_child's request-body hook (``put.partial``), and ``put.partN`` at block N."""
    _install_s3(switch)
    put_blocks, stage = BlockUploads._put_blocks, BlockUploads._stage
    #: The blob kind each upload stores, by key: its blocks are staged on the store's threads,
    #: where the switch does not know the kind the putting thread set.
    kinds: dict[str, str] = {}

    def _put_blocks(self: BlockUploads, key: str, *rest: Any) -> bool:
        kinds[key] = switch.kind
        return put_blocks(self, key, *rest)

    staged: dict[tuple[str, int], threading.Event] = defaultdict(threading.Event)

    def _stage(self: BlockUploads, key: str, blob: Any, block: str, *rest: Any) -> None:
        number = int(block.rsplit("-", 1)[1]) + 1
        point = f"put.part{number}"
        # Blocks are staged at once: killed "at block N", block N-1 is in the service first.
        if switch.matches(point) and number > 1 and not staged[key, number - 1].wait(30):
            switch.log(f"block {number - 1} of {key} never got staged")
        switch.hit(point)
        with switch.storing(kinds.get(key, "")):
            stage(self, key, blob, block, *rest)
        staged[key, number].set()

    BlockUploads._put_blocks = _put_blocks  # type: ignore[method-assign]
    BlockUploads._stage = _stage  # type: ignore[method-assign]


base.open_job_store = open_job_store
base._install_s3 = install_azure

if __name__ == "__main__":
    sys.exit(base.main(sys.argv[1:]))
