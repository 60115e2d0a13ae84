"""Mutations of a JSON document, for the parsers of stored JSON (component index, DCP metadata).

Half the mutants are structural: a node anywhere in the parsed document replaced by a hostile
value (a wrong type, a negative, huge or fractional number, NaN, an integer of thousands of
digits, nesting thousands deep, a long or unpaired-surrogate string, thousands of chunks or
segments, another node of the document), a key or element deleted, duplicated or added, two
values swapped. The rest are damaged text: bit flips, overwrites with JSON punctuation,
truncations and insertions. Values that ``json.dumps`` cannot write (huge integers, deep
nesting, a lone surrogate) go in as text through a placeholder.
"""

from __future__ import annotations

import json
import random
from typing import Any

_HOLE = "\x00hole\x00"
#: JSON texts no writer produces but a bucket can hold.
HOSTILE_TEXT = (
    "1" + "0" * 5000,
    "1" + "0" * 400,
    "-" + "9" * 30,
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    "-0",
    "0.5",
    "1e-400",
    "[" * 5_000 + "]" * 5_000,
    "{" + '"a":{' * 5_000 + "}" * 5_001,
    '"\\ud800"',
    '"' + "x" * 50_000 + '"',
    "[" + ",".join(["0"] * 5_000) + "]",
    "[" + ",".join(["9" * 4000] * 3) + "]",  # a product of thousands of digits
    "[" + ",".join(f"[[{i}],[1]]" for i in range(5_000)) + "]",  # many chunks
    "[" + ",".join(f'["b3:{i:064x}",{i},1]' for i in range(5_000)) + "]",  # many segments
)
HOSTILE_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    2**31,
    2**32,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    1.5,
    "",
    "..",
    "../../etc/passwd",
    "b3:" + "0" * 64,
    "b3:" + "g" * 64,
    "float32",
    "bfloat16",
    "uint8",
    "object",
    "complex64",
    [],
    {},
    [[]],
    [None],
    {"": None},
    [0, 0],
    [-1],
    [2**62, 2**62],
)


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every node (the root is ``()``)."""
    out = [path]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _nodes(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _nodes(value, (*path, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


class JsonMutator:
    """Mutants of the seed documents ``seeds`` (JSON texts), with a seeded generator."""

    def __init__(self, seeds: list[str], seed: int) -> None:
        self.seeds = seeds
        self.rng = random.Random(seed)
        self._paths = {text: _nodes(json.loads(text)) for text in seeds}

    def __call__(self) -> str:
        """One mutant document (text)."""
        text = self.rng.choice(self.seeds)
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            if text in self._paths and self.rng.random() < 0.6:
                text = self._structural(text)
            else:
                text = self._textual(text)
        return text

    def _structural(self, text: str) -> str:
        rng = self.rng
        doc = json.loads(text)
        path = rng.choice(self._paths[text])
        hole: str | None = None
        if not path or rng.random() < 0.45:
            other = _get(doc, rng.choice(self._paths[text]))
            choice = rng.randrange(4)
            if choice == 0:
                hole = rng.choice(HOSTILE_TEXT)
                value: Any = _HOLE
            elif choice == 1:
                value = json.loads(json.dumps(other))
            else:
                value = rng.choice(HOSTILE_VALUES)
            doc = self._put(doc, path, value)
        else:
            parent, key = _get(doc, path[:-1]), path[-1]
            choice = rng.randrange(4)
            if choice == 0:
                del parent[key]
            elif choice == 1 and isinstance(parent, list):
                parent.insert(key, json.loads(json.dumps(parent[key])))
            elif choice == 2:
                parent_nodes = [
                    p for p in self._paths[text] if len(p) == len(path) and p[:-1] == path[:-1]
                ]
                other = rng.choice(parent_nodes)[-1]
                parent[key], parent[other] = parent[other], parent[key]
            elif isinstance(parent, dict):
                parent[rng.choice(("extra", "", "__class__", "format"))] = parent[key]
        out = json.dumps(doc, allow_nan=True)
        return out if hole is None else out.replace(json.dumps(_HOLE), hole, 1)

    @staticmethod
    def _put(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
        if not path:
            return value
        _get(doc, path[:-1])[path[-1]] = value
        return doc

    def _textual(self, text: str) -> str:
        rng = self.rng
        if not text:
            return rng.choice(("{", "[]", "null", "0"))
        at = rng.randrange(len(text))
        choice = rng.randrange(4)
        if choice == 0:
            return text[:at] + chr(ord(text[at]) ^ (1 << rng.randrange(7))) + text[at + 1 :]
        if choice == 1:
            return text[:at] + rng.choice('{}[]:,"\\0-e.') + text[at + 1 :]
        if choice == 2:
            return text[:at]
        return text[:at] + rng.choice(('"', "[", "{", ",", "0" * 50, "\\u", "\ud800")) + text[at:]
