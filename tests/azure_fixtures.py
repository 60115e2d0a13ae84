"""Azure Blob fixtures on a real Azurite (the emulator, from npm), loaded by the root conftest.

- ``azurite`` (session): one ``azurite-blob`` process on 127.0.0.1 (see tests/azureserver.py).
  A missing Azurite install fails the tests that need it with the command that installs it;
  it is never a skip.
- ``azure_endpoint`` (session): its connection string and a plain SDK client.
- ``azure_container`` (session): one container shared by the session's tests.
- ``azure_store_factory`` / ``azure_store``: stores over a fresh prefix of that container.

Real Azure settings in the environment of whoever runs the tests are removed for the session,
so no test can reach a real account.
"""

from __future__ import annotations

from collections.abc import Iterator

import azureserver
import pytest

from ckptstore.objectstore._azure import AzureStore

_AZURE_VARS = (
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
)


@pytest.fixture(scope="session", autouse=True)
def _azure_test_environment() -> Iterator[None]:
    """No real Azure account or identity is ever used by a test."""
    with pytest.MonkeyPatch.context() as mp:
        for name in _AZURE_VARS:
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[azureserver.Azurite]:
    """A real Azurite Blob service on 127.0.0.1 for the whole session."""
    with azureserver.azurite(tmp_path_factory.mktemp("azurite")) as server:
        yield server


@pytest.fixture(scope="session")
def azure_endpoint(azurite: azureserver.Azurite) -> azureserver.AzureEndpoint:
    return azureserver.AzureEndpoint(azurite)


@pytest.fixture(scope="session")
def azure_container(azure_endpoint: azureserver.AzureEndpoint) -> str:
    name = azureserver.random_container()
    azure_endpoint.raw.get_container_client(name).create_container()
    return name


@pytest.fixture
def azure_store_factory(
    azure_endpoint: azureserver.AzureEndpoint, azure_container: str
) -> Iterator[azureserver.AzureStoreFactory]:
    factory = azureserver.AzureStoreFactory(azure_endpoint, container=azure_container)
    yield factory
    factory.close_all()


@pytest.fixture
def azure_store(azure_store_factory: azureserver.AzureStoreFactory) -> AzureStore:
    return azure_store_factory()
