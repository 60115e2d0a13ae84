"""The object-store contract on real S3 endpoints: SeaweedFS (`weed mini`) and moto's server."""

from __future__ import annotations

import pytest
from store_contract import S3StoreContract, S3StoreFactory

pytestmark = pytest.mark.integration


class TestSeaweedStore(S3StoreContract):
    # SeaweedFS serialises conditional writes of one key with ~1 s waits; 8 racers suffice.
    race_writers = 8

    @pytest.fixture
    def factory(self, seaweed_store_factory: S3StoreFactory) -> S3StoreFactory:
        return seaweed_store_factory


class TestMotoServerStore(S3StoreContract):
    @pytest.fixture
    def factory(self, moto_server_store_factory: S3StoreFactory) -> S3StoreFactory:
        return moto_server_store_factory
