"""Decoding many canonical Huffman streams at once with numpy: the reference float codec's
(:mod:`ckptstore.cas.fpref`) inner loop, which a per-symbol Python loop would make hopeless.

A stream is a chain: each code starts where the previous one ends. numpy can only follow many
chains side by side, so every stream is cut into segments of a few hundred bits and each
segment is walked by its own lane, all lanes in lockstep. A segment's true entry (the first code
that starts in it) is unknown until the segment before it is decoded, but it is one of the 11
bit positions at the segment's start, since no code is longer than 11 bits. So a short *sync*
walk first follows all 11 candidates to the first code at or past :data:`SYNC_BITS` into the
segment. Huffman codes resynchronise within a few codes, so nearly always all 11 arrive at the
same position and one *main* lane decodes the segment from there; a code that does not
resynchronise (a fixed-length one, say) gets one lane per distinct arrival, at most 11. Each
main lane runs on to the next segment's sync point, where it lands exactly on one of that
segment's lanes; following these links from each stream's start (pointer doubling) picks the
lanes on the true chain. A lookup takes up to four codes that fit in 11 bits (as the C
decoder's table does), and a lane's last lookup is cut back to the codes that start before its
stop, so that every stop is exact to the code.

Work and memory are bounded by the input: a stream whose length cannot hold its symbol count is
refused before it is walked, a stream that yields more than its count (plus the few codes its
zero padding can hold) is refused as soon as that is known, and lanes go in chunks whose step
buffers stay under :data:`CHUNK_BUDGET` bytes however the codes are shaped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.intp]
ByteArray = npt.NDArray[np.uint8]
EntryArray = npt.NDArray[np.uint64]
WordArray = npt.NDArray[np.integer[Any]]

#: Codes are at most this long; a lookup reads this many bits.
CODE_BITS = 11
TABLE_SIZE = 1 << CODE_BITS
_WINDOW = TABLE_SIZE - 1
#: Codes one lookup decodes at most.
_PER_LOOKUP = 4
#: A stream's last byte holds fewer than 8 padding bits, so at most 7 codes past its count.
_PAD_CODES = 7
#: Bytes of symbols one chunk's lanes may hold: each lane gets room for as many codes as its
#: bits hold at the code's shortest length, so even 1-bit codes keep a chunk this small.
CHUNK_BUDGET = 64 << 20
#: Segments walked together at most.
_CHUNK_SEGMENTS = 4096
#: How far into a segment its candidate entries are followed before they are compared.
SYNC_BITS = 24
#: Segment lengths in bits: long enough that the sync walk is a small share of the work, short
#: enough that an input gives numpy thousands of lanes at once.
_SEG_MIN, _SEG_MAX, _TARGET_LANES = 256, 1024, 4096
_U64 = np.uint64
_BITREV = np.zeros(TABLE_SIZE, np.intp)
for _bit in range(CODE_BITS):
    _BITREV |= ((np.arange(TABLE_SIZE) >> _bit) & 1) << (CODE_BITS - 1 - _bit)


class StreamError(ValueError):
    """Stream ``index`` does not decode to exactly its symbol count; the message says how."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


def canonical(lengths: ByteArray) -> tuple[IntArray, IntArray, IntArray]:
    """The symbols with a code in canonical order (by length, then symbol), their lengths,
    and their codes left-aligned to 11 bits: a canonical code is the sum of the Kraft shares
    of the codes before it, which is what the C side's construction computes."""
    present = np.flatnonzero(lengths)
    order = present[np.argsort(lengths[present], kind="stable")]
    lens = lengths[order].astype(np.intp)
    share = TABLE_SIZE >> lens
    return order, lens, np.cumsum(share) - share


def lsb_codes(lengths: ByteArray) -> IntArray:
    """Per symbol, its canonical code bit-reversed (a stream is read least significant bit
    first, so a code's first bit is its lowest); 0 where the symbol has no code."""
    order, _, left = canonical(lengths)
    codes = np.zeros(256, np.intp)
    codes[order] = _BITREV[left]
    return codes


def kraft_complete(lengths: ByteArray) -> bool:
    """Whether ``lengths`` (each 0-11, 0 = no code) form a complete prefix code."""
    present = lengths[lengths > 0].astype(np.intp)
    return int(np.sum(TABLE_SIZE >> present)) == TABLE_SIZE


def lookup_table(lengths: ByteArray) -> EntryArray:
    """Per 11-bit window (a stream's next bits, first bit lowest; ``lengths`` complete), the
    codes it starts with, as many as fit and at most four: bits 0-3 their total length, 4-6
    their number, 8-23 each one's length (4 bits apiece), 32-63 their symbols (first lowest)."""
    order, lens, _ = canonical(lengths)
    single = np.repeat(order | (lens << 8), TABLE_SIZE >> lens)[_BITREV]
    window = np.arange(TABLE_SIZE)
    used = np.zeros(TABLE_SIZE, np.intp)
    count = np.zeros(TABLE_SIZE, np.intp)
    packed = np.zeros(TABLE_SIZE, np.intp)
    symbols = np.zeros(TABLE_SIZE, np.intp)
    fits = np.ones(TABLE_SIZE, bool)
    for k in range(_PER_LOOKUP):
        # Bits past the window read as zero: a code that fits in the real bits decodes right
        # regardless (a prefix code), and one that does not fit is left to the next lookup.
        one = single[window >> used]
        fits &= used + (one >> 8) <= CODE_BITS
        length = (one >> 8) * fits
        packed |= length << (8 + 4 * k)
        symbols |= ((one & 0xFF) * fits) << (8 * k)
        used += length
        count += fits
    return (symbols.astype(_U64) << _U64(32)) | (packed | (count << 4) | used).astype(_U64)


def _last_lookup(entry: EntryArray, start: IntArray, stop: IntArray) -> tuple[IntArray, IntArray]:
    """For lanes whose last lookup (``entry``, taken at ``start``) crossed ``stop``: how many
    of its codes start before ``stop``, and where the first one that does not starts."""
    count = ((entry >> _U64(4)) & _U64(7)).astype(np.intp)
    lens = [((entry >> _U64(8 + 4 * k)) & _U64(15)).astype(np.intp) for k in range(_PER_LOOKUP)]
    taken = np.ones(start.size, np.intp)
    at = start + lens[0]
    for k in range(1, _PER_LOOKUP):
        taken += (k < count) & (at < stop)
        at += lens[k]
    end = start.copy()
    for k in range(_PER_LOOKUP):
        end += lens[k] * (k < taken)
    return taken, end


@dataclass
class Tables:
    """Lookup tables for the codes in use, back to back (see :func:`lookup_table`), and two
    fields of them apart, so that a walk's step takes no unpacking: the symbols, and the step
    ``bits + (codes << 32)`` that moves a lane's packed position and output cursor at once."""

    entry: EntryArray
    symbols: npt.NDArray[np.uint32]
    step: IntArray

    @classmethod
    def of(cls, entries: list[EntryArray]) -> Tables:
        """The tables of ``entries`` (each from :func:`lookup_table`)."""
        entry = np.concatenate(entries)
        step = (entry & _U64(15)) | (((entry >> _U64(4)) & _U64(7)) << _U64(32))
        return cls(entry, (entry >> _U64(32)).astype(np.uint32), step.astype(np.intp))


def walk(
    words: WordArray,
    tables: Tables,
    pos: IntArray,
    stop: IntArray,
    base: IntArray,
    out: npt.NDArray[np.uint32] | None = None,
    cursor: IntArray | None = None,
) -> tuple[IntArray, IntArray]:
    """Follow each lane's codes from ``pos`` to the first one that starts at or past ``stop``,
    with table ``base + window`` (``words[i]`` holds bytes i..i+2 of the bits; positions are
    below 2**32); return where each stopped and how many codes it took. With ``out`` (a
    byte-strided u32 view of a byte buffer) lane ``i`` writes its symbols from byte
    ``cursor[i]`` on: each lookup writes four and the next one overwrites those past its count."""
    end = pos.copy()
    count = np.zeros(pos.size, np.intp)
    start = np.zeros(pos.size, np.intp) if cursor is None else cursor
    live = np.flatnonzero(pos < stop)
    p, s, b = pos[live], stop[live], base[live]
    # The position in the low 32 bits, the output cursor above: one add moves both.
    packed = p | (start[live] << 32)
    while live.size:
        i = b + ((words[p >> 3] >> (p & 7)) & _WINDOW)
        if out is not None:
            out[packed >> 32] = tables.symbols[i]
        packed += tables.step[i]
        p = packed & 0xFFFFFFFF
        done = p >= s
        if done.any():
            lanes, last = live[done], tables.entry[i[done]]
            used = (last & _U64(15)).astype(np.intp)
            taken, end[lanes] = _last_lookup(last, p[done] - used, s[done])
            full = ((last >> _U64(4)) & _U64(7)).astype(np.intp)
            count[lanes] = (packed[done] >> 32) - full + taken - start[lanes]
            keep = ~done
            live, packed, p, s, b = live[keep], packed[keep], p[keep], s[keep], b[keep]
    return end, count


@dataclass
class _Segments:
    """The streams cut into segments (arrays over segments, streams in order)."""

    stream: IntArray
    #: Index within the stream (0 = the stream's first segment, whose entry is known).
    index: IntArray
    #: First bit, and the sync point: where its candidate entries are compared.
    begin: IntArray
    sync: IntArray
    #: Where the segment's lanes stop: the next segment's sync point, or the stream's end.
    stop: IntArray
    last: npt.NDArray[np.bool_]


def _segments(start: IntArray, bits: IntArray, streams: IntArray, seg_bits: int) -> _Segments:
    """The segments of ``streams``, each ``seg_bits`` long but a stream's last."""
    per = -(-bits[streams] // seg_bits)
    stream = np.repeat(streams, per)
    index = np.arange(stream.size) - np.repeat(np.cumsum(per) - per, per)
    begin = start[stream] + index * seg_bits
    end = start[stream] + bits[stream]
    sync = np.where(index == 0, begin, np.minimum(begin + SYNC_BITS, end))
    last = index == np.repeat(per, per) - 1
    stop = np.where(last, end, np.append(sync[1:], 0))
    return _Segments(stream, index, begin, sync, stop, last)


@dataclass
class _Chunk:
    """One chunk's lanes: a lane is a segment and the position it starts decoding at."""

    first: int
    seg: IntArray
    key: IntArray
    #: (segment - first) * 16 + (key - sync): sorted, unique, what links lanes.
    code: IntArray


@dataclass
class StreamDecoder:
    """Decodes streams of canonical Huffman codes laid out in ``data`` (see module doc).

    Stream ``i`` starts at bit ``start[i]`` (a byte boundary), is ``nbytes[i]`` long, holds
    ``count[i]`` codes of ``codes[code[i]]`` (lengths per symbol, complete), and must end in its
    last byte with zero padding bits. ``data`` must end with at least 8 zero bytes past them.
    """

    data: ByteArray
    start: IntArray
    nbytes: IntArray
    count: IntArray
    code: IntArray
    codes: npt.NDArray[np.uint8]
    _shortest: IntArray = field(init=False)
    _longest: IntArray = field(init=False)
    _total: IntArray = field(init=False)
    _end: IntArray = field(init=False)

    def __post_init__(self) -> None:
        lengths = self.codes.astype(np.intp)
        shortest = np.where(lengths > 0, lengths, CODE_BITS).min(axis=1, initial=CODE_BITS)
        self._shortest = shortest[self.code]
        self._longest = lengths.max(axis=1, initial=0)[self.code]
        self._total = np.zeros(self.count.size, np.intp)
        self._end = np.zeros(self.count.size, np.intp)

    def decode(self) -> ByteArray:
        """Every stream's symbols, stream after stream; :class:`StreamError` naming the first
        stream found not to decode exactly."""
        bits = self.nbytes * 8
        self._check_lengths(bits)
        streams = np.flatnonzero(self.count > 0)
        # Segments of whole bytes keep codes of 1, 2, 4 or 8 bits in phase with their stream.
        seg_bits = int(np.clip(int(bits.sum()) // _TARGET_LANES, _SEG_MIN, _SEG_MAX)) & ~7
        segs = _segments(self.start, bits, streams, seg_bits)
        parts: list[ByteArray] = []
        first, carry = 0, 0
        while first < segs.stream.size:
            first, carry = self._chunk(segs, first, carry, parts)
        symbols = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        return self._finish(symbols, bits, streams)

    def _check_lengths(self, bits: IntArray) -> None:
        """Refuse streams whose length cannot hold their count (before any is walked): its
        codes are the shortest to the longest long, and it ends in its last code's byte."""
        n = self.count
        lo, hi = n * self._shortest, n * self._longest
        bad = np.flatnonzero(np.where(n > 0, (lo > bits) | (hi <= bits - 8), bits > 0))
        if bad.size:
            i = int(bad[0])
            raise StreamError(
                i, f"stream of {self.nbytes[i]} bytes cannot hold {n[i]} codes of its table"
            )

    def _chunk(
        self, segs: _Segments, first: int, carry: int, parts: list[ByteArray]
    ) -> tuple[int, int]:
        """Decode the segments from ``first`` on (as many as the budget allows; ``carry`` is
        where the first one's entry lies, if it is not its stream's first); returns the next
        segment to decode and where its entry lies."""
        limit = min(segs.stream.size, first + _CHUNK_SEGMENTS)
        span = np.arange(first, limit)
        origin = int(segs.begin[first]) & ~7
        raw = self.data[origin >> 3 : (int(segs.stop[span].max()) >> 3) + 3]
        raw = raw.astype(np.uint32)
        words = raw[:-2] | (raw[1:-1] << 8) | (raw[2:] << 16)
        used, local = np.unique(self.code[segs.stream[span]], return_inverse=True)
        tables = Tables.of([lookup_table(self.codes[c]) for c in used])
        base = local.reshape(-1) * TABLE_SIZE
        lanes = self._lanes(segs, span, carry, words, tables, base, origin)
        # Room for each lane's symbols: its codes are at least the shortest long, and its
        # last lookup writes four bytes.
        room = (segs.stop[lanes.seg] - lanes.key) // self._shortest[segs.stream[lanes.seg]] + 5
        over = np.flatnonzero(np.cumsum(room) > CHUNK_BUDGET)
        end = max(first + 1, int(lanes.seg[over[0]])) if over.size else limit
        keep = lanes.seg < end
        seg, key, room = lanes.seg[keep], lanes.key[keep], room[keep]
        cursor = np.cumsum(room) - room
        buffer = np.empty(int(room.sum()) + 4, np.uint8)
        out = np.ndarray((buffer.size - 3,), "<u4", buffer, strides=(1,))
        stop, count = walk(
            words, tables, key - origin, segs.stop[seg] - origin, base[seg - first], out, cursor
        )
        stop += origin
        chosen = self._chosen(segs, _Chunk(first, seg, key, lanes.code[keep]), stop, end)
        count = count[chosen]
        # A lane holds a few hundred symbols: slicing each out beats an index per symbol.
        parts += [
            buffer[a : a + n] for a, n in zip(cursor[chosen].tolist(), count.tolist(), strict=True)
        ]
        stream = segs.stream[seg[chosen]]
        self._total += np.bincount(stream, count, self.count.size).astype(np.intp)
        over = np.flatnonzero(self._total > self.count + _PAD_CODES)
        if over.size:
            i = int(over[0])
            raise StreamError(i, f"stream holds more codes than its {self.count[i]} symbols")
        at_end = segs.last[seg[chosen]]
        self._end[stream[at_end]] = stop[chosen[at_end]]
        return end, int(stop[chosen[-1]])

    def _lanes(
        self,
        segs: _Segments,
        span: IntArray,
        carry: int,
        words: WordArray,
        tables: Tables,
        base: IntArray,
        origin: int,
    ) -> _Chunk:
        """The lanes of the segments in ``span``: one per distinct arrival of the sync walk
        from the 11 candidate entries (one only where the entry is known)."""
        first = int(span[0])
        index = segs.index[span]
        unknown = span[(index > 0) & (span != first)]
        cand = np.repeat(unknown, CODE_BITS)
        pos = segs.begin[cand] + np.tile(np.arange(CODE_BITS), unknown.size) - origin
        sync = segs.sync[cand] - origin
        # A candidate whose first code ends on another candidate arrives where that one does:
        # only those whose first code reaches past the candidates (or that start at or past
        # the sync point, arriving where they are) need walking.
        at = np.minimum(pos, sync)
        entry = tables.entry[base[cand - first] + ((words[at >> 3] >> (at & 7)) & _WINDOW)]
        reach = pos + ((entry >> _U64(8)) & _U64(15)).astype(np.intp)
        root = (reach > segs.begin[cand] + (CODE_BITS - 1) - origin) | (pos >= sync)
        cand = cand[root]
        arrival, _ = walk(words, tables, pos[root], sync[root], base[cand - first])
        known = span[(index == 0) & (span != first)]
        seg = np.concatenate([[first], known, cand])
        entry_at = carry if segs.index[first] > 0 else int(segs.begin[first])
        key = np.concatenate([[entry_at], segs.begin[known], arrival + origin])
        code = np.unique((seg - first) * 16 + (key - segs.sync[seg]))
        seg = first + code // 16
        return _Chunk(first, seg, segs.sync[seg] + code % 16, code)

    def _chosen(self, segs: _Segments, lanes: _Chunk, end: IntArray, stop_seg: int) -> IntArray:
        """The lanes on the true chains: from each stream's first segment (or the chunk's
        first, whose entry is known), each lane leads to the next segment's lane it lands on."""
        n = lanes.seg.size
        if n == stop_seg - lanes.first:  # one lane per segment: all of them
            return np.arange(n)
        nxt = lanes.seg + 1
        linked = np.flatnonzero(~segs.last[lanes.seg] & (nxt < stop_seg))
        want = (nxt[linked] - lanes.first) * 16 + (end[linked] - segs.sync[nxt[linked]])
        target = np.searchsorted(lanes.code, want)
        if not np.array_equal(lanes.code[np.minimum(target, n - 1)], want):
            raise RuntimeError("fphuff reference decoder: a lane lost its chain (a bug)")
        succ = np.full(n + 1, n)
        succ[linked] = target
        chosen = np.zeros(n + 1, bool)
        chosen[np.flatnonzero((lanes.seg == lanes.first) | (segs.index[lanes.seg] == 0))] = True
        for _ in range((stop_seg - lanes.first).bit_length()):
            chosen[succ[np.flatnonzero(chosen)]] = True
            succ = succ[succ]
        return np.flatnonzero(chosen[:n])

    def _finish(self, symbols: ByteArray, bits: IntArray, streams: IntArray) -> ByteArray:
        """Check that each stream ends right after its count's code and drop the codes its
        padding bits made (each stream decodes to its first end past its last byte)."""
        n, total = self.count, self._total
        short = np.flatnonzero((n > 0) & (total < n))
        if short.size:
            i = int(short[0])
            raise StreamError(i, f"stream ends after {total[i]} of its {n[i]} codes")
        extra = total[streams] - n[streams]
        first_extra = np.cumsum(total[streams]) - extra
        owner = np.repeat(np.arange(streams.size), extra)
        drop = first_extra[owner] + np.arange(owner.size) - (np.cumsum(extra) - extra)[owner]
        pad = np.bincount(
            owner, self.codes[self.code[streams[owner]], symbols[drop]], streams.size
        ).astype(np.intp)
        last_end = self._end[streams] - pad
        stream_end = self.start[streams] + bits[streams]
        bad = np.flatnonzero((last_end <= stream_end - 8) | (last_end > stream_end))
        if bad.size:
            i = int(streams[bad[0]])
            raise StreamError(i, "stream does not end in the byte its last code ends in")
        spare = self.data[(stream_end >> 3) - 1].astype(np.intp) >> (last_end & 7)
        bad = np.flatnonzero((last_end & 7 > 0) & (spare > 0))
        if bad.size:
            i = int(streams[bad[0]])
            raise StreamError(i, "stream's padding bits after its last code are not zero")
        return np.delete(symbols, drop)
