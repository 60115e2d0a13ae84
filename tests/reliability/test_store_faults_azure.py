"""Object-store faults on Azure (test_store_faults.py's torture on Azurite): every request
between the AzureStore and a real Azurite goes through :class:`FaultProxy`, which answers some
of them with 503 or 500, a reset connection (before or after Azurite acted), a body cut short, a
slow answer or no answer at all. Every committed checkpoint then loads back bit-exact through
the faults and straight from Azurite, and ``verify`` re-hashes every blob there (family
``store faults``). The stress tier adds big tensors that go up as staged blocks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import test_store_faults as s3faults
from azureserver import AzureStoreFactory, Azurite
from faultproxy import KINDS, FaultProxy

from ckptstore.objectstore._azure import AzureStore
from ckptstore.testing.factories import MiB

#: Blocks above 4 MiB, 4 MiB each: the stress tier's 8 MiB tensor goes up in two blocks.
BLOCKS = {"block_threshold": 4 * MiB, "block_size": 4 * MiB}


@pytest.fixture
def proxy(azurite: Azurite) -> Iterator[FaultProxy]:
    with FaultProxy(f"http://127.0.0.1:{azurite.port}", seed=7) as faulty:
        yield faulty
    assert faulty.errors == [], f"the fault proxy itself failed: {faulty.errors}"


def faulty_store(factory: AzureStoreFactory, proxy: FaultProxy, **options: Any) -> AzureStore:
    """A store that reaches Azurite through the proxy, with the connection string's key."""
    return factory(
        account_url=f"{proxy.endpoint_url}/{factory.endpoint.server.account_url.rsplit('/', 1)[1]}",
        connection_string=factory.endpoint.connection_string,
        retry=s3faults.RETRY,
        read_timeout=s3faults.READ_TIMEOUT,
        connect_timeout=s3faults.CONNECT_TIMEOUT,
        **options,
    )


def test_saves_and_loads_through_ten_percent_transient_faults_on_azure(
    sqlite_url: str,
    proxy: FaultProxy,
    azure_store_factory: AzureStoreFactory,
    reliability_report: Any,
) -> None:
    figures = s3faults.torture_saves(
        db=sqlite_url,
        proxy=proxy,
        store=faulty_store(azure_store_factory, proxy),
        direct=azure_store_factory(),
        steps=10,
        rate=0.10,
    )
    reliability_report.add("store faults", **figures)
    assert figures["lost"] == 0
    assert set(proxy.injected) <= set(KINDS)
    assert proxy.hanging == 0


@pytest.mark.stress
@pytest.mark.timeout(240)
def test_stress_saves_through_faults_with_staged_blocks_on_azure(
    sqlite_url: str,
    proxy: FaultProxy,
    azure_store_factory: AzureStoreFactory,
    reliability_report: Any,
) -> None:
    figures = s3faults.torture_saves(
        db=sqlite_url,
        proxy=proxy,
        store=faulty_store(azure_store_factory, proxy, **BLOCKS),
        direct=azure_store_factory(**BLOCKS),
        steps=40,
        rate=0.10,
        big_every=5,
        big=s3faults.BIG,
    )
    reliability_report.add("store faults", **figures)
    assert figures["lost"] == 0
    assert proxy.hanging == 0
