"""``delete`` of many keys at once, what GC's sweep sends (issue 25), on every backend: of
2,100 keys (over three S3 DeleteObjects requests), some never written, every named object is
gone and every other one is untouched, checked in the directory or the bucket directly.
(That no request names more than 1,000 keys is the conformance suite's
``test_delete_batches_hold_at_most_1000_keys``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore.errors import ConfigError
from ckptstore.objectstore import LocalStore
from ckptstore.testing.factories import LocalStoreFactory, S3StoreFactory, StoreFactory

KEPT = [f"cas/{i % 256:02x}/kept-{i:05d}" for i in range(100)]
DOOMED = [f"cas/{i % 256:02x}/doomed-{i:05d}" for i in range(2100)]
NEVER_WRITTEN = [f"cas/{i % 256:02x}/never-{i:05d}" for i in range(40)]


def test_delete_removes_exactly_the_named_objects(store_factory: StoreFactory) -> None:
    store = store_factory()
    for key in KEPT + DOOMED:
        store.put(key, b"x")
    store.delete(iter(DOOMED + NEVER_WRITTEN))  # any iterable; missing keys are fine
    assert raw_keys(store_factory) == set(KEPT)


def raw_keys(factory: StoreFactory) -> set[str]:
    """The keys of the objects at the factory's location, read around the store."""
    if isinstance(factory, LocalStoreFactory):
        return {
            path.relative_to(factory.root).as_posix()
            for path in factory.root.rglob("*")
            if path.is_file()
        }
    assert isinstance(factory, S3StoreFactory)
    start = len(factory.prefix) + 1
    return {key[start:] for key in factory.bucket_keys(prefix=f"{factory.prefix}/")}


def test_a_bad_key_among_many_is_refused_after_the_good_ones_go(tmp_path: Path) -> None:
    # Many keys are deleted on several threads: an invalid key in one thread's run raises
    # ConfigError once every thread has finished, and no thread stopped the others.
    store = LocalStore(tmp_path / "store")
    for key in DOOMED:
        store.put(key, b"x")
    bad = "cas/../outside"
    with pytest.raises(ConfigError, match="invalid object key"):
        store.delete([*DOOMED[:1000], bad, *DOOMED[1000:]])
    left = {p.relative_to(store.root).as_posix() for p in store.root.rglob("*") if p.is_file()}
    # Only the bad key's own run stopped at it: the rest of that run's keys may remain.
    assert len(left) < len(DOOMED) // 4
    assert all(key in DOOMED for key in left)
