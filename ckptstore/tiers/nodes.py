"""Node names and tier directories: what ``{node}`` in a ``local_dir`` becomes."""

from __future__ import annotations

import os
import re
import socket
import string
from pathlib import Path

from ckptstore.errors import ConfigError
from ckptstore.names import printable

#: The environment variable that names this process's node (default: the host name).
NODE_ENV = "CKPTSTORE_NODE"
#: The one placeholder ``local_dir`` may contain.
NODE_FIELD = "node"
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def check_node_name(name: object, *, what: str = "node name") -> str:
    """``name`` if it can name a node (and a directory): 1-255 letters, digits, ``._-``,
    starting with a letter or digit; else ``ConfigError`` naming ``what``."""
    if not isinstance(name, str) or not _NODE_RE.fullmatch(name):
        raise ConfigError(
            f"invalid {what} {printable(str(name))!r}: use 1-255 letters, digits, '.', '_' and "
            "'-', starting with a letter or digit"
        )
    return name


def node_name() -> str:
    """This process's node: ``$CKPTSTORE_NODE``, else the host name (its first label, made
    safe: anything but ``[A-Za-z0-9._-]`` becomes ``-``)."""
    given = os.environ.get(NODE_ENV)
    if given is not None:
        return check_node_name(given, what=f"${NODE_ENV}")
    host = socket.gethostname().split(".")[0] or "localhost"
    return check_node_name(re.sub(r"[^A-Za-z0-9._-]", "-", host).lstrip("._-") or "localhost")


def check_local_dir(template: object) -> str:
    """``template`` if it is a usable ``local_dir``: a non-empty path whose only ``{...}`` field
    is ``{node}``."""
    if not isinstance(template, str | os.PathLike) or not os.fspath(template):
        raise ConfigError(f"local_dir={template!r} must be a directory path")
    text = os.fspath(template)
    try:
        fields = [f for _, f, spec, conv in string.Formatter().parse(text) if f is not None]
    except ValueError as exc:
        raise ConfigError(
            f"local_dir={printable(text)!r}: {exc}; write braces only as '{{node}}'"
        ) from None
    if any(f != NODE_FIELD for f in fields):
        raise ConfigError(
            f"local_dir={printable(text)!r} has the field(s) {sorted(set(fields) - {NODE_FIELD})}; "
            "the only one it may contain is {node} (the node's name)"
        )
    return text


def tier_root(template: str, node: str) -> Path:
    """The directory of ``node``'s tier under ``template`` (``{node}`` replaced)."""
    return Path(check_local_dir(template).format(node=check_node_name(node))).expanduser()
