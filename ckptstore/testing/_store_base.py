"""The base that every part of the conformance suite (:mod:`ckptstore.testing.store`) builds on:
what a backend's test class provides (the ``factory`` fixture, the raw accessors) and the class
attributes that tune the suite for a backend.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Generic, TypeVar

import pytest

from ckptstore.objectstore import ObjectStore
from ckptstore.testing.factories import MULTIPART_OPTIONS, StoreFactory

F = TypeVar("F", bound=StoreFactory[ObjectStore])


class StoreSuite(abc.ABC, Generic[F]):
    """What the suite's tests use of a backend's test class: the ``factory`` fixture (defined by
    the backend's subclass), the ``store`` fixture over it, and the three ``raw_*`` accessors
    (abstract: a subclass that lacks one cannot be instantiated, so its tests fail instead of
    passing vacuously)."""

    #: Options for a store that uploads big objects in parts (a backend ignores what it lacks).
    multipart_options: ClassVar[dict[str, Any]] = MULTIPART_OPTIONS
    #: Threads racing to create one key.
    race_writers: ClassVar[int] = 16

    @pytest.fixture
    def store(self, factory: F) -> ObjectStore:
        """A store over the factory's location."""
        return factory()

    @abc.abstractmethod
    def raw_get(self, factory: F, key: str) -> bytes | None:
        """The stored bytes of ``key`` read without the store, or None if absent."""

    @abc.abstractmethod
    def raw_put(self, factory: F, key: str, data: bytes) -> None:
        """Store ``data`` as ``key`` without the store, as another writer would have."""

    @abc.abstractmethod
    def raw_keys(self, factory: F) -> set[str]:
        """Every stored name under the store's root (keys relative to it), temp files included."""
