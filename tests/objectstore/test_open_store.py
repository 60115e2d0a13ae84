"""open_store: URL forms of the built-in backends, their errors, and the scheme table itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore.errors import CkptStoreError, ConfigError, ObjectNotFoundError
from ckptstore.objectstore import (
    LocalStore,
    ObjectStore,
    S3Store,
    StoreURL,
    backends,
    open_store,
    register_backend,
    registry,
)
from ckptstore.testing.factories import S3Endpoint, S3StoreFactory

#: An endpoint nothing answers on: these stores are opened, never used.
NOWHERE = "http://127.0.0.1:9/never-used"


@pytest.fixture
def opened() -> Iterator[list[ObjectStore]]:
    stores: list[ObjectStore] = []
    yield stores
    for store in stores:
        store.close()


def test_open_store_plain_path(tmp_path: Path, opened: list[ObjectStore]) -> None:
    store = open_store(str(tmp_path / "a" / "b"))
    opened.append(store)
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "a" / "b"
    assert store.root.is_dir()
    assert store.url == (tmp_path / "a" / "b").as_uri()


def test_open_store_path_object_and_relative_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path / "p")
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "p"
    monkeypatch.chdir(tmp_path)
    rel = open_store("rel/dir")
    assert isinstance(rel, LocalStore)
    assert rel.root == tmp_path / "rel" / "dir"


@pytest.mark.parametrize("form", ["file://{path}", "file://localhost{path}", " file://{path} "])
def test_open_store_file_url(tmp_path: Path, form: str) -> None:
    store = open_store(form.format(path=tmp_path / "x y"))
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "x y"


def test_open_store_file_url_is_percent_decoded(tmp_path: Path) -> None:
    store = open_store((tmp_path / "with space").as_uri())
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "with space"


def test_open_store_passes_options(tmp_path: Path) -> None:
    store = open_store(tmp_path, fsync=False)
    assert isinstance(store, LocalStore)
    assert store.put("k", b"v") is True


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [
        ("s3://bucket/prefix", "bucket", "prefix"),
        ("s3://bucket/a/b/c/", "bucket", "a/b/c"),
        ("s3://bucket", "bucket", ""),
        ("s3://bucket/", "bucket", ""),
        ("S3://bucket/p", "bucket", "p"),
        ("s3://my.bucket-1/runs/exp%2D1", "my.bucket-1", "runs/exp-1"),
    ],
)
def test_open_store_s3_url(
    url: str, bucket: str, prefix: str, opened: list[ObjectStore], moto_endpoint: S3Endpoint
) -> None:
    # A ready client keeps this fast; options reaching the constructor is tested below.
    store = open_store(url, client=moto_endpoint.client())
    opened.append(store)
    assert isinstance(store, S3Store)
    assert store.bucket == bucket
    assert store.prefix == prefix
    assert store.url == (f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")


def test_open_store_s3_options_reach_the_client(opened: list[ObjectStore]) -> None:
    store = open_store("s3://bucket/p", endpoint_url="http://127.0.0.1:9", read_timeout=7.0)
    opened.append(store)
    assert isinstance(store, S3Store)
    assert store.endpoint == "http://127.0.0.1:9"
    assert store.client.meta.config.read_timeout == 7.0
    # Local servers rarely resolve bucket subdomains: path style whenever an endpoint is set.
    assert store.client.meta.config.s3["addressing_style"] == "path"


def test_open_store_s3_works_end_to_end(moto_store_factory: S3StoreFactory) -> None:
    factory = moto_store_factory
    with open_store(f"s3://{factory.bucket}/{factory.prefix}") as store:
        assert store.put("k", b"via-url") is True
    raw = factory.raw_client.get_object(Bucket=factory.bucket, Key=factory.full_key("k"))
    assert raw["Body"].read() == b"via-url"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("ftp://bucket/x", "scheme 'ftp'"),
        ("gs://", "no bucket"),
        ("gs://bucket/../x", "invalid object key"),
        ("gs://Bad_Bucket/x", "invalid GCS bucket name"),
        ("http://example.com/x", "scheme 'http'"),
        ("s3://", "no bucket"),
        ("s3:///prefix", "no bucket"),
        ("file://host/x", "host 'host'"),
        ("s3://bucket/../x", "invalid object key"),
        ("s3://bucket/a//b", "invalid object key"),
    ],
)
def test_open_store_rejects_bad_urls(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        open_store(url)
    assert isinstance(info.value, CkptStoreError)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("bucket", "rule"),
    [
        ("ab", "3-63 characters"),
        ("a" * 64, "3-63 characters"),
        ("My-Bucket", "lowercase letters"),
        ("my_bucket", "lowercase letters"),
        ("-bucket", "start and end"),
        ("bucket.", "start and end"),
        ("bücket", "lowercase letters"),
        ("bucket:9000", "lowercase letters"),
        ("user@bucket", "lowercase letters"),
        ("my..bucket", "'..'"),
        ("192.168.1.10", "IP address"),
    ],
)
def test_invalid_bucket_names_are_refused_at_open(bucket: str, rule: str) -> None:
    """A configuration error naming the rule, before any request (and for S3Store too)."""
    with pytest.raises(ConfigError, match="invalid S3 bucket name") as info:
        open_store(f"s3://{bucket}/prefix", endpoint_url=NOWHERE)
    assert rule in str(info.value)
    assert "--store" in str(info.value)
    with pytest.raises(ConfigError, match="invalid S3 bucket name"):
        S3Store(bucket, endpoint_url=NOWHERE)


@pytest.mark.parametrize("bucket", ["abc", "a" * 63, "my.bucket-1", "1.2.3", "0-b"])
def test_valid_bucket_names_are_accepted(bucket: str, opened: list[ObjectStore]) -> None:
    store = open_store(f"s3://{bucket}/p", endpoint_url=NOWHERE)
    opened.append(store)
    assert isinstance(store, S3Store)
    assert store.bucket == bucket


def test_an_escape_sequence_in_a_bucket_name_is_not_echoed_raw() -> None:
    with pytest.raises(ConfigError) as info:
        open_store("s3://bad\x1b[31mname/p")
    assert "\x1b" not in str(info.value)
    assert "bad\\x1b[31mname" in str(info.value)


@pytest.mark.parametrize("form", ["str", "path", "uri"])
def test_open_store_without_create_refuses_a_missing_directory(tmp_path: Path, form: str) -> None:
    missing = tmp_path / "no" / "such" / "store"
    url: str | Path = {"str": str(missing), "path": missing, "uri": missing.as_uri()}[form]
    with pytest.raises(ConfigError, match="no object store at") as info:
        open_store(url, create=False)
    assert str(missing) in str(info.value)
    assert "--store" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_open_store_without_create_opens_an_existing_directory(tmp_path: Path) -> None:
    with LocalStore(tmp_path / "store") as made:
        made.put("cas/k", b"v")
    before = sorted(p.name for p in (tmp_path / "store").rglob("*"))
    with open_store(tmp_path / "store", create=False) as store:
        assert store.get("cas/k") == b"v"
        assert list(store.list("cas/")) != []
        with pytest.raises(ObjectNotFoundError):
            store.get("other/k")
    assert sorted(p.name for p in (tmp_path / "store").rglob("*")) == before


# -- the scheme table -------------------------------------------------------------------------


@pytest.fixture
def scratch_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations in a test go to a copy of the table, dropped afterwards."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))


def test_the_built_in_backends_are_registered_in_order() -> None:
    table = backends()
    assert list(table) == ["", "file", "s3", "gs", "az"]
    assert [b.description for b in table.values()] == [
        "a directory path",
        "file:///abs/path",
        "s3://bucket/prefix",
        "gs://bucket/prefix",
        "az://container/prefix",
    ]
    with pytest.raises(TypeError):
        table["ftp"] = table["s3"]  # type: ignore[index]


@pytest.mark.usefixtures("scratch_table")
def test_a_registered_backend_opens_its_urls(tmp_path: Path) -> None:
    calls: list[tuple[Any, ...]] = []

    def open_box(url: StoreURL, *, create: bool, **options: Any) -> ObjectStore:
        calls.append((url.text, url.parts.scheme, url.parts.netloc, url.path, create, options))
        return LocalStore(tmp_path / url.parts.netloc, create=create, **options)

    register_backend("box+test", open_box, description="box+test://name/path")
    with open_store(" BOX+test://shelf/a%20b ", fsync=False) as store:
        assert store.put("k", b"v") is True
    with open_store("box+test://shelf/a%20b", create=False) as store:
        assert store.get("k") == b"v"
    assert calls == [
        ("BOX+test://shelf/a%20b", "box+test", "shelf", "/a b", True, {"fsync": False}),
        ("box+test://shelf/a%20b", "box+test", "shelf", "/a b", False, {}),
    ]
    with pytest.raises(ConfigError) as info:
        open_store("ftp://bucket/x")
    assert str(info.value) == (
        "unsupported store URL scheme 'ftp' in 'ftp://bucket/x': use a directory path, "
        "file:///abs/path, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix "
        "or box+test://name/path"
    )


@pytest.mark.usefixtures("scratch_table")
@pytest.mark.parametrize(
    ("scheme", "match"),
    [
        ("s3", "already registered"),
        ("", "already registered"),
        ("g", "one letter is a Windows drive"),
        ("GS", "lowercase"),
        ("1x", "starting with a letter"),
        ("g s", "lowercase"),
    ],
)
def test_register_backend_refuses_a_taken_or_invalid_scheme(scheme: str, match: str) -> None:
    before = dict(backends())
    with pytest.raises(ConfigError, match=match):
        register_backend(scheme, registry._BACKENDS["s3"].opener, description="x://")
    assert dict(backends()) == before


def test_empty_url_error_lists_the_registered_forms() -> None:
    with pytest.raises(ConfigError) as info:
        open_store("  ")
    assert (
        "a directory path, file:///abs/path, s3://bucket/prefix, gs://bucket/prefix "
        "or az://container/prefix"
    ) in str(info.value)
