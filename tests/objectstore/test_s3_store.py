"""S3Store: the shared conformance suite on moto in-process and, as integration tests, on real
S3 endpoints (SeaweedFS's `weed mini` and moto's server), each checked in the bucket through a
plain boto3 client."""

from __future__ import annotations

import pytest

from ckptstore.objectstore import ObjectStore
from ckptstore.testing.factories import S3StoreFactory
from ckptstore.testing.store import S3StoreTests


class MotoRace(S3StoreTests):
    """moto checks If-None-Match and then stores the object without a lock between the two, so
    two racing conditional PUTs of one key can both succeed there (seen once in a CI run, on the
    in-process moto): the race is checked against SeaweedFS (TestSeaweedStore), a real server."""

    @pytest.mark.skip(reason="moto's conditional PUT is not atomic (see MotoRace)")
    def test_concurrent_puts_of_one_key_create_it_exactly_once(
        self, store: ObjectStore, factory: S3StoreFactory
    ) -> None:
        super().test_concurrent_puts_of_one_key_create_it_exactly_once(store, factory)


class TestMotoStore(MotoRace):
    @pytest.fixture
    def factory(self, moto_store_factory: S3StoreFactory) -> S3StoreFactory:
        return moto_store_factory

    @pytest.mark.slow
    def test_delete_of_more_than_1000_existing_objects(self, factory: S3StoreFactory) -> None:
        store = factory()
        keys = [f"cas/{i:04d}" for i in range(1001)]
        for key in keys:
            self.raw_put(factory, key, b"x")
        assert len(self.raw_keys(factory)) == 1001
        requests: list[int] = []
        store.client.meta.events.register(
            "before-parameter-build.s3.DeleteObjects",
            lambda params, **kw: requests.append(len(params["Delete"]["Objects"])),
        )
        store.delete(keys)
        assert requests == [1000, 1]
        assert self.raw_keys(factory) == set()


@pytest.mark.integration
class TestSeaweedStore(S3StoreTests):
    # SeaweedFS serialises conditional writes of one key with ~1 s waits; 8 racers suffice.
    race_writers = 8

    @pytest.fixture
    def factory(self, seaweed_store_factory: S3StoreFactory) -> S3StoreFactory:
        return seaweed_store_factory


@pytest.mark.integration
class TestMotoServerStore(MotoRace):
    @pytest.fixture
    def factory(self, moto_server_store_factory: S3StoreFactory) -> S3StoreFactory:
        return moto_server_store_factory
