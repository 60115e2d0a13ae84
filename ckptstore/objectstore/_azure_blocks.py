"""AzureStore's block half: a blob of at least ``block_threshold`` bytes goes up as staged blocks,
several at once, and becomes visible only when its block list is committed with
``If-None-Match: *`` (Put Block List), so two writers of one blob never tear it.

Azure keeps one set of uncommitted blocks per blob *name*, shared by every writer of that name:
the SDK's own uploader names blocks by their offset, so two writers racing on one name would
overwrite each other's blocks and either could commit a mix of both. Here every upload names its
blocks with a random tag of its own, so a commit can only ever name the blocks it staged itself.
A loser's blocks are discarded by the winner's commit. A writer killed mid-upload leaves its
blocks uncommitted (Azure discards them after a week; they cost storage until then):
:meth:`~BlockUploads.sweep_incomplete` deletes those older than GC's grace.

Each block's body is read straight from the caller's buffers (no copy), and at most
``max_concurrency`` blocks are in flight per store: the memory an upload holds beyond the
caller's buffers is the HTTP client's send buffers, whatever the blob's size.

:class:`BlockUploads` is a base of :class:`~ckptstore.objectstore._azure.AzureStore`, which sets
the attributes declared here and runs every request through ``_call``.
"""

from __future__ import annotations

import abc
import contextlib
import datetime as dt
import functools
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError
from azure.storage.blob import BlobBlock

from ckptstore.errors import ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore._azure_errors import error_code, is_exists_answer
from ckptstore.objectstore._s3_body import _PartsReader, _slice_parts
from ckptstore.objectstore.base import ObjectStore

if TYPE_CHECKING:
    from azure.storage.blob import BlobClient, ContainerClient

T = TypeVar("T")
#: Azure's limit on the blocks of one blob.
MAX_BLOCKS = 50_000


def block_ids(count: int) -> list[str]:
    """``count`` block ids of one upload: a random tag and the block's number, all of one length
    (Azure requires that of the blocks of a blob; the SDK base64-encodes them)."""
    tag = uuid.uuid4().hex
    return [f"{tag}-{n:06d}" for n in range(count)]


def list_page(
    client: ContainerClient, name_prefix: str, token: str | None, include: list[str] | None = None
) -> tuple[list[Any], str | None]:
    """One page of blobs whose names start with ``name_prefix``, and the next page's token."""
    pages: Any = client.list_blobs(
        name_starts_with=name_prefix, include=include, results_per_page=5000
    ).by_page(continuation_token=token)
    items = list(next(pages))
    return items, pages.continuation_token


class BlockUploads(ObjectStore):
    """Staged-block uploads for an Azure store that sets the attributes below."""

    prefix: str
    client: ContainerClient
    block_size: int
    #: Threads that stage the blocks of one blob at once (shared by the store's puts).
    _blocks_pool: ThreadPoolExecutor

    @abc.abstractmethod
    def _call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request with retries; a final failure becomes one of our errors."""

    def _put_blocks(
        self, key: str, blob: BlobClient, parts: Sequence[memoryview], size: int
    ) -> bool:
        """Create ``key`` from staged blocks unless it exists; True if this call made it."""
        # A HEAD first: for a big blob it is far cheaper than uploading and being refused.
        if self.exists(key):
            return False
        # Equal blocks: 64 MiB and a 600-byte header in 16 MiB blocks is 5 blocks of 12.8 MiB,
        # not 4 full ones and a 600-byte request.
        count = min(MAX_BLOCKS, -(-size // self.block_size))
        step = -(-size // count)
        ranges = [(o, min(o + step, size)) for o in range(0, size, step)]
        ids = block_ids(len(ranges))
        futures = [
            self._blocks_pool.submit(self._stage, key, blob, block, parts, r)
            for block, r in zip(ids, ranges, strict=True)
        ]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return self._commit(key, blob, ids)

    def _stage(
        self,
        key: str,
        blob: BlobClient,
        block: str,
        parts: Sequence[memoryview],
        byte_range: tuple[int, int],
    ) -> None:
        pieces = _slice_parts(parts, *byte_range)
        length = byte_range[1] - byte_range[0]
        number = int(block.rsplit("-", 1)[1]) + 1
        # A new reader per attempt: a retry sends the whole block again from its start.
        self._call(
            f"uploading block {number} of",
            key,
            lambda: blob.stage_block(block, _PartsReader(pieces), length=length),
        )

    def _commit(self, key: str, blob: BlobClient, ids: list[str]) -> bool:
        """Commit the staged blocks ``ids`` as ``key`` if no blob of that name exists yet."""
        try:
            self._call(
                "committing the blocks of",
                key,
                lambda: blob.commit_block_list(
                    [BlobBlock(block) for block in ids], match_condition=MatchConditions.IfMissing
                ),
            )
        except ObjectStoreError as exc:
            if is_exists_answer(exc):
                return False
            cause = exc.__cause__
            # Another writer's commit of this name discards the uncommitted blocks of every
            # writer of it; where the service checks the block list before the condition, the
            # loser hears "InvalidBlockList" rather than "exists".
            if (
                isinstance(cause, HttpResponseError)
                and error_code(cause) == "InvalidBlockList"
                and self.exists(key)
            ):
                return False
            raise
        return True

    # -- what killed writers leave ------------------------------------------------------------

    def sweep_incomplete(self, older_than: float, *, dry_run: bool = False) -> tuple[int, int]:
        """Delete the uncommitted blocks of uploads under this store's prefix that began more
        than ``older_than`` seconds ago (their writer died). A blob committed meanwhile is never
        touched: each delete is conditional on the name not having changed since the cutoff."""
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=older_than)
        root = f"{self.prefix}/" if self.prefix else ""
        # Uncommitted names first, then the committed ones: a blob committed in between is in
        # the second listing, so it is left alone.
        pending = {b.name: b for b in self._listing(root, ["uncommittedblobs"])}
        committed = {b.name for b in self._listing(root, None)}
        stale = [
            name
            for name, blob in pending.items()
            if name not in committed and blob.last_modified < cutoff
        ]
        size = 0
        for name in stale:
            blob = self.client.get_blob_client(name)
            key = name[len(root) :]
            with contextlib.suppress(ObjectNotFoundError):
                _, uncommitted = self._call(
                    "listing the uncommitted blocks of",
                    key,
                    functools.partial(blob.get_block_list, "uncommitted"),
                )
                size += sum(int(b.size) for b in uncommitted)
            if not dry_run:
                self._delete_stale(key, blob, cutoff)
        return len(stale), size

    def _listing(self, root: str, include: list[str] | None) -> Iterator[Any]:
        token: str | None = None
        while True:
            items, token = self._call(
                "listing", root, functools.partial(list_page, self.client, root, token, include)
            )
            yield from items
            if not token:
                return

    def _delete_stale(self, key: str, blob: BlobClient, cutoff: dt.datetime) -> None:
        try:
            self._call(
                "deleting the uncommitted blocks of",
                key,
                functools.partial(blob.delete_blob, if_unmodified_since=cutoff),
            )
        except ObjectNotFoundError:
            pass  # committed and deleted, or discarded, meanwhile
        except ObjectStoreError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, HttpResponseError) and cause.status_code == 412):
                raise  # 412: written since the cutoff (committed by a live writer): kept
