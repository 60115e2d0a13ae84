"""Which backend opens which store URL: a table from URL scheme to opener, read by open_store.

Adding a backend takes a module with the store class and an :class:`Opener`, and one call::

    register_backend("gs", open_gcs_url, description="gs://bucket/prefix")

after which ``open_store("gs://bucket/prefix")``, ``--store`` and ``$CKPTSTORE_STORE`` accept
such URLs, and the error for an unknown scheme lists the new one. The built-in backends are
registered by :mod:`ckptstore.objectstore` itself: ``""`` (a plain path), ``file`` and ``s3``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol
from urllib.parse import SplitResult, unquote, urlsplit

from ckptstore.errors import ConfigError
from ckptstore.names import printable
from ckptstore.objectstore.base import ObjectStore

__all__ = ["Backend", "Opener", "StoreURL", "backends", "open_store", "register_backend"]

_SCHEME_RE = re.compile(r"[a-z][a-z0-9+.-]+", re.ASCII)


@dataclass(frozen=True, slots=True)
class StoreURL:
    """A store URL as :func:`open_store` parsed it, handed to the backend's opener."""

    #: The URL as given, surrounding whitespace removed. Quote it with
    #: :func:`ckptstore.names.printable` in messages: it comes from the user.
    text: str
    #: ``urlsplit(text)``; ``parts.scheme`` is lowercase.
    parts: SplitResult

    @property
    def path(self) -> str:
        """The URL's path, percent-decoded."""
        return unquote(self.parts.path)


class Opener(Protocol):
    """Turns a parsed URL into an open store of one backend."""

    def __call__(self, url: StoreURL, *, create: bool, **options: Any) -> ObjectStore:
        """Open the store at ``url``; raise :class:`ConfigError` for a URL it cannot use.

        ``create=False`` must create nothing: a store that does not exist is a ConfigError
        (or, for a backend that cannot tell at open time, an error on first use).
        ``options`` are the backend's own keyword arguments, as given to :func:`open_store`.
        """
        ...


@dataclass(frozen=True, slots=True)
class Backend:
    """One row of the table: a URL scheme and what opens it."""

    scheme: str
    opener: Opener
    #: The URL form for users, as error messages show it: ``"s3://bucket/prefix"``.
    description: str


_BACKENDS: dict[str, Backend] = {}


def register_backend(scheme: str, opener: Opener, *, description: str) -> None:
    """Make ``open_store`` open URLs of ``scheme`` (``""``: a plain path) with ``opener``."""
    if scheme and not _SCHEME_RE.fullmatch(scheme):
        raise ConfigError(
            f"cannot register store URL scheme {scheme!r}: use lowercase letters, digits, "
            "'+', '-' and '.', starting with a letter and at least two characters long "
            "(one letter is a Windows drive)"
        )
    if scheme in _BACKENDS:
        raise ConfigError(
            f"store URL scheme {scheme!r} is already registered "
            f"({_BACKENDS[scheme].description}); register another scheme"
        )
    _BACKENDS[scheme] = Backend(scheme=scheme, opener=opener, description=description)


def backends() -> Mapping[str, Backend]:
    """The registered backends by scheme, in registration order (a read-only view)."""
    return MappingProxyType(_BACKENDS)


def open_store(url: str | Path, *, create: bool = True, **options: Any) -> ObjectStore:
    """Open the store at ``url`` with the backend registered for its scheme.

    ``url`` is a local path, ``file:///abs/path``, ``s3://bucket/prefix`` or a URL of another
    registered scheme. ``create=False`` opens only a store that exists: a missing local
    directory is a :class:`ConfigError` and nothing is created (an S3 store never creates its
    bucket). ``options`` go to the backend's constructor (e.g. ``endpoint_url=`` for S3).
    """
    if isinstance(url, Path):
        text = os.fspath(url)
        return _backend("", text).opener(
            StoreURL(text, SplitResult("", "", text, "", "")), create=create, **options
        )
    text = str(url).strip()
    if not text:
        raise ConfigError(f"empty store URL (--store / $CKPTSTORE_STORE): give {_choices()}")
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # e.g. an unclosed '[' of an IPv6 host
        raise ConfigError(f"invalid store URL '{printable(text)}': {exc}") from None
    # One letter is a Windows drive (C:\...), not a scheme.
    scheme = parts.scheme.lower() if len(parts.scheme) > 1 else ""
    parts = parts._replace(scheme=scheme)
    return _backend(scheme, text).opener(StoreURL(text, parts), create=create, **options)


def _backend(scheme: str, text: str) -> Backend:
    try:
        return _BACKENDS[scheme]
    except KeyError:
        what = f"scheme '{printable(scheme)}'" if scheme else "plain path"
        raise ConfigError(
            f"unsupported store URL {what} in '{printable(text)}': use {_choices()}"
        ) from None


def _choices() -> str:
    """The registered URL forms as a phrase: ``"a directory path, ... or s3://bucket/prefix"``."""
    *rest, last = [backend.description for backend in _BACKENDS.values()] or ["a store URL"]
    return f"{', '.join(rest)} or {last}" if rest else last
