"""The mutation engine: damaged, forged and re-encoded variants of valid float-codec payloads.

Each call picks a sample and applies one to three mutations: bit flips and byte overwrites,
truncations, extensions, insertions and deletions; forged fields found by
:func:`fuzz.payloads.layout` (a mode byte, a symbol range, a code length nibble, a stream's
byte length, a stream's bits or padding, a raw plane's or constant's data); whole blocks
dropped, duplicated or swapped; out-of-range and inconsistent parameters (raw length, huge
declared sizes, itemsize, block size); splices of two payloads. Some mutations are exact by
construction and say what the decode must return: an edit of a raw plane's or a constant's
data changes known bytes of known elements, a constant plane rewritten raw or a reused code
sent again changes nothing, dropping the last blocks with the raw length that matches them
keeps a prefix, a one-block payload decodes the same under any larger block size.
"""

from __future__ import annotations

import bisect
import itertools
import random
import struct
from dataclasses import dataclass, field

from fuzz.payloads import MODE_AGAIN, MODE_CONST, MODE_HUFF, MODE_RAW, Field, Sample, merge, split

#: (first element, end element, plane, new byte): the elements' plane bytes an edit sets.
Edit = tuple[int, int, int, int]
INTERESTING = (0, 1, 2, 3, 4, 7, 8, 0x0F, 0x10, 0x7F, 0x80, 0xF0, 0xFE, 0xFF)
SIZES = (0, 1, 7, 8, 9, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


@dataclass(slots=True)
class Mutant:
    """One input to the decoder, and what it must decode to when a mutation knows."""

    payload: bytes
    raw_len: int
    itemsize: int
    block_log2: int
    #: The sample it was made from.
    source: str = ""
    tags: list[str] = field(default_factory=list)
    #: The bytes the decode must return once ``edits`` apply; None: not known (any decode
    #: that succeeds must then agree with the reference decoder).
    base: bytes | None = None
    edits: list[Edit] = field(default_factory=list)
    #: Whether field offsets of the sample still hold (no byte was inserted or removed).
    aligned: bool = True

    def expected(self) -> bytes | None:
        """The exact bytes a successful decode must give, if a mutation knows them."""
        if self.base is None or not self.edits:
            return self.base
        planes = split(self.base, self.itemsize)
        for start, end, plane, value in self.edits:
            planes[start:end, plane] = value
        return merge(planes, self.itemsize)


class Engine:
    """Draws mutants of ``samples`` with its own seeded random generator."""

    def __init__(self, samples: list[Sample], seed: int) -> None:
        self.samples = samples
        self.rng = random.Random(seed)
        self._offsets = {id(s): [f.offset for f in s.fields] for s in samples}
        self._ops = [
            (self._flip, 14),
            (self._overwrite, 8),
            (self._resize, 10),
            (self._forge, 36),
            (self._exact, 8),
            (self._blocks, 6),
            (self._params, 10),
            (self._splice, 4),
        ]
        self._choices = [op for op, _ in self._ops]
        self._cumulative = list(itertools.accumulate(w for _, w in self._ops))

    def __call__(self) -> Mutant:
        """A mutant of a sample."""
        rng = self.rng
        sample = rng.choice(self.samples)
        m = Mutant(sample.payload, len(sample.raw), sample.itemsize, sample.block_log2, sample.name)
        m.base = sample.raw
        (op,) = rng.choices(self._choices, cum_weights=self._cumulative)
        op(sample, m)
        for _ in range(rng.choice((0, 0, 0, 0, 1, 2))):  # stack a few more small ones
            rng.choice((self._flip, self._overwrite))(sample, m)
        if _same_input(sample, m):  # the mutations cancelled out, or changed nothing
            m.base, m.edits = sample.raw, []
        return m

    # -- byte level ------------------------------------------------------------------------

    def _set(self, sample: Sample, m: Mutant, at: int, value: int, tag: str) -> None:
        """Set payload byte ``at``; track the data edit it makes, if it is one."""
        data = bytearray(m.payload)
        data[at] = value
        m.payload = bytes(data)
        m.tags.append(tag)
        edit = self._data_edit(sample, m, at, value) if m.aligned else None
        if edit is None:
            m.base = None
        else:
            m.edits.append(edit)

    def _data_edit(self, sample: Sample, m: Mutant, at: int, value: int) -> Edit | None:
        """The elements byte ``at`` of a raw or constant plane holds, if it lies in one."""
        i = bisect.bisect_right(self._offsets[id(sample)], at) - 1
        if i < 0:
            return None
        f = sample.fields[i]
        if not f.offset <= at < f.offset + f.length:
            return None
        if f.kind == "raw":
            element = f.first + at - f.offset
            return (element, element + 1, f.plane, value)
        if f.kind == "const":
            count = len(sample.raw) // sample.itemsize
            return (f.first, min(count, f.first + (1 << sample.block_log2)), f.plane, value)
        return None

    def _flip(self, sample: Sample, m: Mutant) -> None:
        if not m.payload:
            return self._resize(sample, m)
        for _ in range(self.rng.choice((1, 1, 1, 2, 3, 4))):
            at = self.rng.randrange(len(m.payload))
            self._set(sample, m, at, m.payload[at] ^ (1 << self.rng.randrange(8)), "flip")
        return None

    def _overwrite(self, sample: Sample, m: Mutant) -> None:
        if not m.payload:
            return self._resize(sample, m)
        for _ in range(self.rng.choice((1, 1, 2, 3))):
            at = self.rng.randrange(len(m.payload))
            value = self.rng.choice((*INTERESTING, self.rng.randrange(256)))
            self._set(sample, m, at, value, "overwrite")
        return None

    def _replace(self, m: Mutant, start: int, end: int, new: bytes, tag: str) -> None:
        """Replace ``payload[start:end]`` with ``new``: the layout no longer holds."""
        m.payload = m.payload[:start] + new + m.payload[end:]
        m.tags.append(tag)
        m.base, m.aligned = None, m.aligned and end - start == len(new)

    def _resize(self, sample: Sample, m: Mutant) -> None:
        rng, n = self.rng, len(m.payload)
        kind = rng.choice(("truncate", "truncate", "extend", "insert", "delete"))
        at = rng.choice((rng.randint(0, n), n, max(0, n - rng.randint(1, 8))))
        if kind == "truncate":
            self._replace(m, at, n, b"", "truncate")
        elif kind == "extend":
            tail = rng.choice((b"\0", bytes(rng.randint(1, 64)), rng.randbytes(rng.randint(1, 64))))
            self._replace(m, n, n, tail, "extend")
        elif kind == "insert":
            self._replace(m, at, at, rng.randbytes(rng.choice((1, 2, 4, 32))), "insert")
        else:
            self._replace(m, at, min(n, at + rng.choice((1, 2, 4, 32))), b"", "delete")

    # -- one field forged ------------------------------------------------------------------

    def _forge(self, sample: Sample, m: Mutant) -> None:
        if not sample.fields:
            return self._resize(sample, m)
        f = self.rng.choice(sample.fields)
        return getattr(self, f"_forge_{f.kind}")(sample, m, f)

    def _forge_mode(self, sample: Sample, m: Mutant, f: Field) -> None:
        value = self.rng.choice((MODE_RAW, MODE_HUFF, MODE_CONST, MODE_AGAIN, 4, 0x80, 0xFF))
        self._set(sample, m, f.offset, value, "mode")

    def _forge_const(self, sample: Sample, m: Mutant, f: Field) -> None:
        self._set(sample, m, f.offset, self.rng.randrange(256), "const")

    def _forge_raw(self, sample: Sample, m: Mutant, f: Field) -> None:
        if not f.length:
            return self._forge_mode(sample, m, f)
        for _ in range(self.rng.choice((1, 1, 2, 5))):
            at = f.offset + self.rng.randrange(f.length)
            self._set(sample, m, at, self.rng.randrange(256), "raw data")
        return None

    def _forge_range(self, sample: Sample, m: Mutant, f: Field) -> None:
        rng = self.rng
        lo, hi = m.payload[f.offset], m.payload[f.offset + 1]
        lo, hi = rng.choice(
            (
                (hi, lo),
                (lo, lo),
                (lo, min(255, hi + 1)),
                (max(0, lo - 1), hi),
                (lo + 1, hi),
                (lo, hi - 1),
                (0, 255),
                (rng.randrange(256), rng.randrange(256)),
            )
        )
        self._replace(m, f.offset, f.offset + 2, bytes((lo, hi)), "range")

    def _forge_nibbles(self, sample: Sample, m: Mutant, f: Field) -> None:
        rng = self.rng
        at = f.offset + rng.randrange(f.length)
        shift = rng.choice((0, 4))
        value = rng.choice((0, 1, 11, 12, 15, rng.randrange(16)))
        byte = (m.payload[at] & ~(0xF << shift)) | (value << shift)
        self._replace(m, at, at + 1, bytes((byte,)), "code length")

    def _forge_sizes(self, sample: Sample, m: Mutant, f: Field) -> None:
        rng = self.rng
        sizes = list(struct.unpack_from("<8I", m.payload, f.offset))
        i, j = rng.randrange(8), rng.randrange(8)
        choice = rng.randrange(4)
        if choice == 0:  # bytes moved between streams: same total, every stream misaligned
            step = rng.choice((1, 2, 7, 8)) if sizes[i] else 0
            step = min(step, sizes[i])
            sizes[i], sizes[j] = sizes[i] - step, sizes[j] + step
        elif choice == 1:
            sizes[i], sizes[j] = sizes[j], sizes[i]
        elif choice == 2:
            sizes[i] = (sizes[i] + rng.choice((-8, -2, -1, 1, 2, 8, 1 << 20))) % (1 << 32)
        else:
            sizes[i] = rng.choice((*SIZES, len(m.payload), len(m.payload) - f.offset))
        self._replace(m, f.offset, f.offset + 32, struct.pack("<8I", *sizes), "stream sizes")

    def _forge_stream(self, sample: Sample, m: Mutant, f: Field) -> None:
        if not f.length:
            return self._forge_sizes(sample, m, _sizes_before(sample, f))
        rng, end = self.rng, f.offset + f.length
        choice = rng.randrange(3)
        if choice == 0:
            at = f.offset + rng.randrange(f.length)
            self._set(sample, m, at, m.payload[at] ^ (1 << rng.randrange(8)), "stream bit")
        elif choice == 1:  # a bit after the last code, in the padding the decoder must check
            self._set(sample, m, end - 1, m.payload[end - 1] | 0x80, "stream padding")
        else:
            self._replace(m, f.offset, end, bytes(f.length), "stream zeroed")
        return None

    # -- exact by construction --------------------------------------------------------------

    def _exact(self, sample: Sample, m: Mutant) -> None:
        consts = [f for f in sample.fields if f.kind == "const"]
        agains = [f for f in sample.fields if f.kind == "mode" and m.payload[f.offset] == 3]
        count = len(sample.raw) // sample.itemsize
        blocks = max(1, (count + (1 << sample.block_log2) - 1) >> sample.block_log2)
        choice = self.rng.randrange(4)
        if choice == 0 and consts:  # a constant plane written out raw
            f = self.rng.choice(consts)
            n = min(1 << sample.block_log2, count - f.first)
            plane = bytes((MODE_RAW,)) + m.payload[f.offset : f.offset + 1] * n
            self._replace(m, f.offset - 1, f.offset + 1, plane, "const as raw")
        elif choice == 1 and agains:  # a reused code sent again
            f = self.rng.choice(agains)
            table = _previous_table(sample, m.payload, f)
            self._replace(m, f.offset, f.offset + 1, bytes((MODE_HUFF,)) + table, "code resent")
        elif choice == 2 and blocks > 1:  # the last blocks dropped, with the matching length
            keep = self.rng.randrange(blocks)
            starts = [g.offset for g in sample.fields if g.kind == "mode" and g.plane == 0]
            cut = starts[keep] if keep < len(starts) else len(m.payload)
            elements = keep << sample.block_log2
            m.payload, m.raw_len = m.payload[:cut], elements * sample.itemsize
            m.tags.append("last blocks dropped")
            m.base = sample.raw[: m.raw_len]
            return
        elif blocks == 1:  # any larger block size holds the one block
            m.block_log2 = self.rng.randint(sample.block_log2, 24)
            m.tags.append("larger block")
            return
        else:
            return self._blocks(sample, m)
        m.base, m.aligned = sample.raw, False
        return None

    # -- blocks, parameters, splices ---------------------------------------------------------

    def _blocks(self, sample: Sample, m: Mutant) -> None:
        starts = [f.offset for f in sample.fields if f.kind == "mode" and f.plane == 0]
        if len(starts) < 2:
            return self._params(sample, m)
        spans = list(zip(starts, [*starts[1:], len(m.payload)], strict=True))
        rng, p = self.rng, m.payload
        (a0, a1), (b0, b1) = sorted(rng.sample(spans, 2))
        choice = rng.randrange(3)
        if choice == 0:
            new, tag = p[:a0] + p[a1:], "block dropped"
        elif choice == 1:
            new, tag = p[:a1] + p[a0:a1] + p[a1:], "block repeated"
        else:
            new, tag = p[:a0] + p[b0:b1] + p[a1:b0] + p[a0:a1] + p[b1:], "blocks swapped"
        self._replace(m, 0, len(p), new, tag)
        return None

    def _params(self, sample: Sample, m: Mutant) -> None:
        rng, w = self.rng, sample.itemsize
        choice = rng.randrange(3)
        m.base = None
        if choice == 0:
            block_bytes = w << sample.block_log2
            passes_length_check = (len(m.payload) // 2 // w) * block_bytes
            m.raw_len = rng.choice(
                (
                    m.raw_len + w,
                    m.raw_len - w,
                    m.raw_len + block_bytes,
                    max(0, m.raw_len - block_bytes),
                    0,
                    w * rng.randint(1, 4096),
                    passes_length_check,
                    passes_length_check + w,
                    (1 << rng.randint(20, 62)) // w * w,
                    -w,
                )
            )
            m.tags.append("raw length")
        elif choice == 1:
            m.itemsize = rng.choice((0, 1, 2, 3, 4, 5, 8, 16))
            m.tags.append("itemsize")
        else:
            m.block_log2 = rng.choice((-1, 0, 7, 8, 9, 10, 12, 24, 25, 31))
            m.tags.append("block size")

    def _splice(self, sample: Sample, m: Mutant) -> None:
        other = self.rng.choice(self.samples).payload
        cut = self.rng.randint(0, len(m.payload))
        start = self.rng.randint(0, len(other))
        self._replace(m, cut, len(m.payload), other[start:], "splice")


def _same_input(sample: Sample, m: Mutant) -> bool:
    """Whether ``m`` decodes as ``sample`` does: the same payload and parameters, or a block
    size changed between two that both hold every element in one block."""
    if (m.payload, m.raw_len, m.itemsize) != (sample.payload, len(sample.raw), sample.itemsize):
        return False
    count = len(sample.raw) // sample.itemsize
    smaller = min(m.block_log2, sample.block_log2)
    one_block = smaller >= 8 and m.block_log2 <= 24 and count <= 1 << smaller
    return m.block_log2 == sample.block_log2 or one_block


def _sizes_before(sample: Sample, stream: Field) -> Field:
    """The stream-sizes field of the plane that ``stream`` belongs to."""
    return next(
        f for f in reversed(sample.fields) if f.kind == "sizes" and f.offset < stream.offset
    )


def _previous_table(sample: Sample, payload: bytes, again: Field) -> bytes:
    """The range and lengths the code a mode-3 plane reuses was sent with."""
    head = [
        f
        for f in sample.fields
        if f.kind in ("range", "nibbles") and f.plane == again.plane and f.offset < again.offset
    ]
    rng, nibbles = head[-2], head[-1]
    return payload[rng.offset : nibbles.offset + nibbles.length]
