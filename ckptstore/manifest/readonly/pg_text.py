"""``ckptstore sql`` on PostgreSQL, layers 1 and 2: the statement kind, and the grammar.

1. Statement kind, checked before connecting (:class:`ConfigError`): one query only, ``SELECT``,
   ``WITH ... SELECT``, ``VALUES``, ``TABLE`` or ``EXPLAIN`` of one of them without ``ANALYZE``.
   A top-level ``;`` with anything after it is refused. The lexer follows PostgreSQL's lexical
   structure (strings, quoted names, dollar quotes, nested comments) just far enough to find
   keywords and top-level semicolons.
2. Grammar: the text is sent as ``SELECT * FROM (<query>) AS ckptstore_query`` through the
   extended protocol, which takes exactly one statement. Whatever the text does (closing the
   parenthesis itself, comments, dollar quotes), the server parses one ``SELECT`` or fails:
   ``COPY``, ``DO``, ``SET`` and data-modifying ``WITH`` cannot appear in a subquery. An
   ``EXPLAIN`` is rebuilt from the options we understand, around the same wrapped query.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptstore.errors import ConfigError
from ckptstore.manifest.readonly.refusals import (
    ANALYZE,
    PG_ACCEPTED,
    one_statement_only,
    refuse_kind,
)

_QUERY_KEYWORDS = ("SELECT", "WITH", "VALUES", "TABLE")
#: EXPLAIN options that only describe the plan. ANALYZE (which runs the query) is not one.
_EXPLAIN_OPTIONS = frozenset(
    {
        "verbose",
        "costs",
        "settings",
        "buffers",
        "wal",
        "timing",
        "summary",
        "format",
        "generic_plan",
        "memory",
        "serialize",
    }
)
_OPTION_VALUE = re.compile(r"[a-z0-9_]+")


@dataclass(frozen=True, slots=True)
class PgStatement:
    """A checked query: the statement sent, and the query it wraps (for an ``EXPLAIN``, the
    explained one), which the calls layer parses on its own before the statement runs."""

    text: str
    query: str


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # word, string, ident, dollar, param, number, op
    text: str
    start: int


_PG_LEXEME = re.compile(
    r"""
    (?P<space>[ \t\n\r\f\v]+)
  | (?P<comment>--[^\n\r]*)
  | (?P<block>/\*)
  | (?P<string>[eE]'(?:[^'\\]|\\.|'')*'
              | (?:[bBxXnN]|[uU]&)?'(?:[^']|'')*')
  | (?P<ident>(?:[uU]&)?"(?:[^"]|"")*")
  | (?P<dollar>\$(?:[A-Za-z_\x80-\U0010ffff][A-Za-z0-9_\x80-\U0010ffff]*)?\$)
  | (?P<param>\$[0-9]+)
  | (?P<word>[A-Za-z_\x80-\U0010ffff][A-Za-z0-9_$\x80-\U0010ffff]*)
  | (?P<number>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)
  | (?P<op>.)
    """,
    re.VERBOSE | re.DOTALL,
)


def _pg_tokens(text: str) -> tuple[list[_Token], bool]:
    """PostgreSQL's lexical structure, enough to find keywords and top-level semicolons.

    Returns (tokens without whitespace and comments, complete); ``complete`` is False when the
    text ends inside a string, quoted name or comment.
    """
    tokens: list[_Token] = []
    pos = 0
    while pos < len(text):
        match = _PG_LEXEME.match(text, pos)
        assert match is not None  # `op` matches any character
        kind = match.lastgroup or "op"
        if kind == "block":
            end = _block_comment_end(text, pos)
            if end < 0:
                return tokens, False
            pos = end
            continue
        if kind == "dollar":
            close = text.find(match.group(), match.end())
            if close < 0:
                return tokens, False
            tokens.append(_Token("string", text[pos : close + len(match.group())], pos))
            pos = close + len(match.group())
            continue
        if kind == "op" and match.group() in "'\"":
            return tokens, False  # a quote the string/ident patterns could not close
        if kind not in ("space", "comment"):
            tokens.append(_Token(kind, match.group(), pos))
        pos = match.end()
    return tokens, True


def _block_comment_end(text: str, start: int) -> int:
    """End of the (nested, as PostgreSQL nests them) block comment at ``start``; -1 if open."""
    depth, pos = 0, start
    while pos < len(text):
        if text.startswith("/*", pos):
            depth, pos = depth + 1, pos + 2
        elif text.startswith("*/", pos):
            depth, pos = depth - 1, pos + 2
            if depth == 0:
                return pos
        else:
            pos += 1
    return -1


def _keyword(token: _Token | None) -> str:
    if token is None or token.kind != "word" or not token.text.isascii():
        return "" if token is None else token.text
    return token.text.upper()


def wrap_as_select(query: str) -> str:
    """The grammar layer: ``query`` as a subquery of one ``SELECT``.

    The newlines keep a trailing ``--`` comment in ``query`` from swallowing the parenthesis.
    """
    return f"SELECT * FROM (\n{query}\n) AS ckptstore_query"


def postgres_statement(query: str) -> PgStatement:
    """The statement actually sent for ``query``: checked (layer 1) and wrapped (layer 2)."""
    tokens, complete = _pg_tokens(query)
    if not complete:
        raise ConfigError(
            "the query ends inside a string, quoted name or comment; close it (`ckptstore sql` "
            "runs one complete query)"
        )
    tokens, end = _without_trailing_semicolons(tokens, len(query))
    query = query[:end]
    first = tokens[0] if tokens else None
    keyword = _keyword(first)
    if keyword == "EXPLAIN":
        prefix, index = _explain_prefix(tokens)
        body = tokens[index] if index < len(tokens) else None
        if _keyword(body) not in _QUERY_KEYWORDS:
            raise refuse_kind(_keyword(body), PG_ACCEPTED)
        assert body is not None
        explained = query[body.start :]
        return PgStatement(f"{prefix} {wrap_as_select(explained)}", explained)
    if keyword not in _QUERY_KEYWORDS:
        raise refuse_kind(keyword, PG_ACCEPTED)
    return PgStatement(wrap_as_select(query), query)


def _without_trailing_semicolons(tokens: list[_Token], length: int) -> tuple[list[_Token], int]:
    """Drop trailing ``;`` (a habit, harmless); refuse one with a statement after it."""
    end = len(tokens)
    while end and tokens[end - 1].text == ";" and tokens[end - 1].kind == "op":
        end -= 1
    if any(t.kind == "op" and t.text == ";" for t in tokens[:end]):
        raise one_statement_only(PG_ACCEPTED)
    return tokens[:end], tokens[end].start if end < len(tokens) else length


def _explain_prefix(tokens: list[_Token]) -> tuple[str, int]:
    """Parse ``EXPLAIN [VERBOSE]`` or ``EXPLAIN (option [value], ...)``; rebuild it from the
    options we know. Returns (prefix, index of the explained query's first token)."""
    index = 1
    nxt = _keyword(tokens[index]) if index < len(tokens) else ""
    if nxt in ANALYZE:
        raise refuse_kind(nxt, PG_ACCEPTED)
    if nxt == "VERBOSE":
        return "EXPLAIN VERBOSE", index + 1
    if index >= len(tokens) or tokens[index].text != "(":
        return "EXPLAIN", index
    options: list[str] = []
    index += 1
    while True:
        name, value, index = _explain_option(tokens, index)
        options.append(f"{name} {value}".strip())
        closing = tokens[index].text if index < len(tokens) else ""
        index += 1
        if closing == ")":
            return f"EXPLAIN ({', '.join(options)})", index
        if closing != ",":
            raise ConfigError("cannot read the EXPLAIN options: write EXPLAIN (option value, ...)")


def _explain_option(tokens: list[_Token], index: int) -> tuple[str, str, int]:
    token = tokens[index] if index < len(tokens) else _Token("op", "", -1)
    name = _keyword(token)
    if name in ANALYZE:
        raise refuse_kind(name, PG_ACCEPTED)
    if token.kind != "word" or name.lower() not in _EXPLAIN_OPTIONS:
        raise ConfigError(
            f"unsupported EXPLAIN option {token.text!r}; `ckptstore sql` accepts "
            f"{', '.join(sorted(_EXPLAIN_OPTIONS))}"
        )
    index += 1
    if index < len(tokens) and tokens[index].kind in ("word", "number", "string"):
        value = tokens[index].text.strip("'").lower()
        if not _OPTION_VALUE.fullmatch(value):
            raise ConfigError(f"unsupported value {tokens[index].text!r} for EXPLAIN {name}")
        return name, value, index + 1
    return name, "", index
