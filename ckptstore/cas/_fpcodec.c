/* The float codec's byte work (ckptstore.cas.fpcodec): split, Huffman, merge.

Each element is rotated left by one bit, so that the sign moves to bit 0 and the highest byte
holds the exponent's top eight bits (all of bf16's and fp32's exponent; fp16's five exponent bits
and its top three mantissa bits). The rotated elements are cut into byte planes; the exponent
plane is Huffman-coded per block, and so is any other plane the caller names (one that a sample
showed to shrink); the rest are stored raw. Blocks of ``1 << block_log2`` elements keep the
decoder's scratch memory small and let every block pick its own code.

Stored per block, for each plane k = 0 (lowest byte) .. itemsize-1 (exponent byte):

    mode u8    0 raw, 1 Huffman, 2 constant, 3 Huffman with the plane's previous code
    raw:       the plane's bytes
    constant:  the one byte value
    Huffman:   first and last symbol (u8 each), their code lengths (4 bits each, low nibble
               first, 0 = absent), the byte lengths of the 8 interleaved streams (u32 LE each),
               then the streams
    again:     the byte lengths of the 8 streams, then the streams, coded with the lengths the
               plane's last Huffman (mode 1) block sent

A stream holds the canonical Huffman codes of its eighth of the plane, least significant bit
first. Decoding peeks 11 bits and takes up to four symbols from one table entry, and runs the
eight streams in the same loop so their table loads overlap: that is where the speed comes from.

Everything read from a payload is bounds-checked; a payload that does not decode exactly raises
ValueError, which the Python side turns into IntegrityError. The whole work runs without the GIL.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the float codec reads elements and bit streams as little-endian words"
#endif

/* Codes are at most CODE_BITS long; the decoder peeks TABLE_BITS at a time, so that one peek
   usually holds two of fp16's 5-6 bit codes (and four of bf16's 2-3 bit ones). */
#define CODE_BITS 11
#ifndef TABLE_BITS
#define TABLE_BITS 11
#endif
#define TABLE_SIZE (1u << TABLE_BITS)
#define TABLE_MASK (TABLE_SIZE - 1)
/* Interleaved streams per coded plane: eight independent chains of table lookups keep the
   core busy while each waits for its table load. */
#define STREAMS 8
/* A table entry holds at most four symbols (one u32 store writes them). */
#define ENTRY_SYMS 4
/* Lookups of at most TABLE_BITS bits each that fit in the 57 bits a refill guarantees. */
#define LOOKUPS_PER_REFILL (57 / TABLE_BITS)
#define MAX_PLANES 8
#define MIN_BLOCK_LOG2 8
#define MAX_BLOCK_LOG2 24
/* Sample for the plane estimate: this many windows of this many elements. */
#define SAMPLE_WINDOWS 16
#define SAMPLE_WINDOW 4096

enum { MODE_RAW = 0, MODE_HUFF = 1, MODE_CONST = 2, MODE_HUFF_AGAIN = 3 };

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline void store_le64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

static inline uint32_t load_le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline void store_le32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* ---- planes ------------------------------------------------------------------------------ */

/* Rotate each of the n elements left by one bit and scatter its bytes into planes[0..w-1]. */
static void split_planes(const uint8_t *in, size_t n, int w, uint8_t *const *planes) {
    if (w == 2) {
        uint8_t *p0 = planes[0], *p1 = planes[1];
        for (size_t i = 0; i < n; i++) {
            uint16_t v;
            memcpy(&v, in + 2 * i, 2);
            v = (uint16_t)((v << 1) | (v >> 15));
            p0[i] = (uint8_t)v;
            p1[i] = (uint8_t)(v >> 8);
        }
    } else if (w == 4) {
        uint8_t *p0 = planes[0], *p1 = planes[1], *p2 = planes[2], *p3 = planes[3];
        for (size_t i = 0; i < n; i++) {
            uint32_t v;
            memcpy(&v, in + 4 * i, 4);
            v = (v << 1) | (v >> 31);
            p0[i] = (uint8_t)v;
            p1[i] = (uint8_t)(v >> 8);
            p2[i] = (uint8_t)(v >> 16);
            p3[i] = (uint8_t)(v >> 24);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint64_t v;
            memcpy(&v, in + 8 * i, 8);
            v = (v << 1) | (v >> 63);
            for (int k = 0; k < 8; k++) planes[k][i] = (uint8_t)(v >> (8 * k));
        }
    }
}

/* The inverse of split_planes: gather the planes' bytes and rotate each element back. */
static void merge_planes(const uint8_t *const *planes, size_t n, int w, uint8_t *out) {
    if (w == 2) {
        const uint8_t *p0 = planes[0], *p1 = planes[1];
        for (size_t i = 0; i < n; i++) {
            uint16_t v = (uint16_t)(p0[i] | (p1[i] << 8));
            v = (uint16_t)((v >> 1) | (v << 15));
            memcpy(out + 2 * i, &v, 2);
        }
    } else if (w == 4) {
        const uint8_t *p0 = planes[0], *p1 = planes[1], *p2 = planes[2], *p3 = planes[3];
        for (size_t i = 0; i < n; i++) {
            uint32_t v = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) |
                         ((uint32_t)p3[i] << 24);
            v = (v >> 1) | (v << 31);
            memcpy(out + 4 * i, &v, 4);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint64_t v = 0;
            for (int k = 0; k < 8; k++) v |= (uint64_t)planes[k][i] << (8 * k);
            v = (v >> 1) | (v << 63);
            memcpy(out + 8 * i, &v, 8);
        }
    }
}

/* The streams' shares of n symbols: stream s holds [start[s], start[s + 1]). */
static void stream_bounds(size_t n, size_t start[STREAMS + 1]) {
    size_t q = (n + STREAMS - 1) / STREAMS;
    for (int s = 0; s <= STREAMS; s++) start[s] = (size_t)s * q < n ? (size_t)s * q : n;
}

/* Per-stream symbol counts. The streams' counters advance together so that runs of one symbol
   (exponents repeat a lot) do not serialise on a single counter. */
static void histogram(const uint8_t *p, size_t n, uint32_t h[STREAMS][256]) {
    size_t start[STREAMS + 1];
    stream_bounds(n, start);
    memset(h, 0, sizeof(uint32_t) * STREAMS * 256);
    size_t common = start[STREAMS] - start[STREAMS - 1];
    for (size_t i = 0; i < common; i++) {
#pragma GCC unroll 16
        for (int s = 0; s < STREAMS; s++) h[s][p[start[s] + i]]++;
    }
    for (int s = 0; s < STREAMS; s++)
        for (size_t i = start[s] + common; i < start[s + 1]; i++) h[s][p[i]]++;
}

/* ---- Huffman code construction ------------------------------------------------------------ */

static int cmp_u64(const void *x, const void *y) {
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return (a > b) - (a < b);
}

/* The optimal code lengths of at most CODE_BITS bits for the symbols with nonzero counts (at
   least two), by package-merge: level 1 lists the symbols by count; each further level merges
   them with the pairs ("packages") of the level below. The first 2n - 2 items of the top level
   are the cheapest way to pay for a complete code; a symbol's length is how many of them
   contain it, counted level by level downwards. */
static void huff_lengths(const uint32_t count[256], uint8_t len[256]) {
    static const int16_t PACKAGE = -1;
    uint64_t keyed[256], leaf_weight[256];
    uint64_t weight[CODE_BITS][512];
    int16_t item[CODE_BITS][512];
    int size[CODE_BITS];
    int n = 0;
    memset(len, 0, 256);
    for (int s = 0; s < 256; s++)
        if (count[s]) keyed[n++] = ((uint64_t)count[s] << 8) | (uint64_t)s;
    if (n < 2) return; /* callers code only planes with two or more symbols */
    qsort(keyed, (size_t)n, sizeof keyed[0], cmp_u64);
    for (int i = 0; i < n; i++) {
        leaf_weight[i] = keyed[i] >> 8;
        weight[0][i] = leaf_weight[i];
        item[0][i] = (int16_t)(keyed[i] & 0xff);
    }
    size[0] = n;
    for (int level = 1; level < CODE_BITS; level++) {
        int packages = size[level - 1] / 2, leaf = 0, pkg = 0, out = 0;
        while (leaf < n || pkg < packages) {
            uint64_t pw = pkg < packages ? weight[level - 1][2 * pkg] +
                                               weight[level - 1][2 * pkg + 1]
                                         : 0;
            if (pkg >= packages || (leaf < n && leaf_weight[leaf] <= pw)) {
                weight[level][out] = leaf_weight[leaf];
                item[level][out++] = (int16_t)(keyed[leaf++] & 0xff);
            } else {
                weight[level][out] = pw;
                item[level][out++] = PACKAGE;
                pkg++;
            }
        }
        size[level] = out;
    }
    int take = 2 * n - 2;
    for (int level = CODE_BITS - 1; level >= 0 && take > 0; level--) {
        int packages = 0;
        for (int i = 0; i < take; i++) {
            if (item[level][i] == PACKAGE)
                packages++;
            else
                len[item[level][i]]++;
        }
        take = 2 * packages;
    }
}

static inline uint32_t reverse_bits(uint32_t code, int nbits) {
    uint32_t r = 0;
    for (int i = 0; i < nbits; i++) r |= ((code >> i) & 1u) << (nbits - 1 - i);
    return r;
}

/* Canonical codes for len (which must satisfy Kraft), bit-reversed for an LSB-first stream. */
static void canonical_codes(const uint8_t len[256], uint32_t code[256]) {
    uint32_t per_len[CODE_BITS + 1] = {0}, next[CODE_BITS + 1];
    for (int s = 0; s < 256; s++) per_len[len[s]]++;
    per_len[0] = 0;
    uint32_t c = 0;
    for (int l = 1; l <= CODE_BITS; l++) {
        c = (c + per_len[l - 1]) << 1;
        next[l] = c;
    }
    for (int s = 0; s < 256; s++)
        code[s] = len[s] ? reverse_bits(next[len[s]]++, len[s]) : 0;
}

/* Whether lengths (each 0..CODE_BITS) make a complete prefix code: every TABLE_BITS-bit
   window then decodes, and two or more symbols are present. */
static int lengths_complete(const uint8_t len[256]) {
    uint32_t kraft = 0;
    for (int s = 0; s < 256; s++)
        if (len[s]) kraft += TABLE_SIZE >> len[s];
    return kraft == TABLE_SIZE;
}

/* ---- encoding ------------------------------------------------------------------------------ */

/* Codes for n symbols, LSB first, into dst; returns the end. Writes up to 7 bytes past the end
   (the caller leaves room: the next stream, or the output's slack, overwrites them). */
static uint8_t *encode_stream(const uint8_t *src, size_t n, const uint32_t table[256],
                              uint8_t *dst) {
    uint64_t acc = 0;
    unsigned bits = 0;
    size_t i = 0;
    /* Four codes of at most 11 bits on top of at most 7 pending bits stay under 64. */
    for (; i + 4 <= n; i += 4) {
        for (int k = 0; k < 4; k++) {
            uint32_t e = table[src[i + k]];
            acc |= (uint64_t)(e & 0xffff) << bits;
            bits += e >> 16;
        }
        store_le64(dst, acc);
        dst += bits >> 3;
        acc >>= bits & ~7u;
        bits &= 7;
    }
    for (; i < n; i++) {
        uint32_t e = table[src[i]];
        acc |= (uint64_t)(e & 0xffff) << bits;
        bits += e >> 16;
        store_le64(dst, acc);
        dst += bits >> 3;
        acc >>= bits & ~7u;
        bits &= 7;
    }
    if (bits) {
        store_le64(dst, acc);
        dst += 1;
    }
    return dst;
}

/* The bytes per stream that coding a block's symbols (per-stream counts h) with lengths len
   takes, and their sum; UINT64_MAX if len lacks a code for a symbol that occurs. */
static uint64_t coded_size(const uint32_t h[STREAMS][256], const uint8_t len[256],
                           uint64_t stream_bytes[STREAMS]) {
    uint64_t sum = 0;
    for (int s = 0; s < STREAMS; s++) {
        uint64_t bits = 0;
        for (int c = 0; c < 256; c++) {
            if (h[s][c] && !len[c]) return UINT64_MAX;
            bits += (uint64_t)h[s][c] * len[c];
        }
        stream_bytes[s] = (bits + 7) / 8;
        sum += stream_bytes[s];
    }
    return sum;
}

/* What one plane's code is across blocks: its lengths, once a block has sent them. */
typedef struct {
    uint8_t len[256];
    int sent;
} plane_code;

/* One plane of one block, stored at dst in the layout the file comment gives (mode first);
   returns the end. `try_huff` says whether to consider a code at all. A block reuses the code
   the plane's previous Huffman block sent when that is no larger than sending its own: for
   i.i.d. data every block after the first does, which spares the decoder a table build. */
static uint8_t *encode_plane(const uint8_t *plane, size_t n, int try_huff, plane_code *prev,
                             uint8_t *dst) {
    if (n && try_huff) {
        uint32_t h[STREAMS][256];
        histogram(plane, n, h);
        uint32_t total[256];
        int distinct = 0;
        for (int s = 0; s < 256; s++) {
            total[s] = 0;
            for (int k = 0; k < STREAMS; k++) total[s] += h[k][s];
            distinct += total[s] != 0;
        }
        if (distinct == 1) {
            dst[0] = MODE_CONST;
            dst[1] = plane[0];
            return dst + 2;
        }
        uint8_t len[256];
        huff_lengths(total, len);
        int lo = 0, hi = 255;
        while (!len[lo]) lo++;
        while (!len[hi]) hi--;
        uint64_t own_bytes[STREAMS], again_bytes[STREAMS];
        uint64_t own = 3 + (uint64_t)(hi - lo + 2) / 2 + 4 * STREAMS + coded_size(h, len, own_bytes);
        uint64_t again = prev->sent ? coded_size(h, prev->len, again_bytes) : UINT64_MAX;
        if (again != UINT64_MAX) again += 1 + 4 * STREAMS;
        int reuse = again <= own;
        if ((reuse ? again : own) <= n) {
            const uint8_t *code_len = reuse ? prev->len : len;
            const uint64_t *stream_bytes = reuse ? again_bytes : own_bytes;
            uint32_t code[256], table[256];
            canonical_codes(code_len, code);
            for (int s = 0; s < 256; s++) table[s] = code[s] | ((uint32_t)code_len[s] << 16);
            uint8_t *p = dst;
            if (reuse) {
                *p++ = MODE_HUFF_AGAIN;
            } else {
                *p++ = MODE_HUFF;
                *p++ = (uint8_t)lo;
                *p++ = (uint8_t)hi;
                for (int c = lo; c <= hi; c += 2)
                    *p++ = (uint8_t)(len[c] | ((c + 1 <= hi ? len[c + 1] : 0) << 4));
                memcpy(prev->len, len, 256);
                prev->sent = 1;
            }
            for (int s = 0; s < STREAMS; s++) {
                store_le32(p, (uint32_t)stream_bytes[s]);
                p += 4;
            }
            size_t start[STREAMS + 1];
            stream_bounds(n, start);
            for (int s = 0; s < STREAMS; s++)
                p = encode_stream(plane + start[s], start[s + 1] - start[s], table, p);
            return p;
        }
    }
    dst[0] = MODE_RAW;
    memcpy(dst + 1, plane, n);
    return dst + 1 + n;
}

/* ---- decoding ------------------------------------------------------------------------------ */

/* Tables for one code: single-symbol entries (symbol | length << 8) for the careful tail, and
   multi-symbol entries: the bits they take in the low byte (where a shift finds its count, which
   keeps the lookup-to-lookup dependency short), their number in the next, and up to four
   symbols in the high 32 bits. */
typedef struct {
    uint16_t one[TABLE_SIZE];
    uint64_t multi[TABLE_SIZE];
} decode_table;

static void build_decode_table(const uint8_t len[256], decode_table *t) {
    uint32_t code[256];
    canonical_codes(len, code);
    for (int s = 0; s < 256; s++) {
        if (!len[s]) continue;
        for (uint32_t j = code[s]; j < TABLE_SIZE; j += 1u << len[s])
            t->one[j] = (uint16_t)(s | (len[s] << 8));
    }
    for (uint32_t j = 0; j < TABLE_SIZE; j++) {
        uint32_t syms = 0, used = 0, rest = j;
        int count = 0;
        while (count < ENTRY_SYMS) {
            uint16_t e = t->one[rest];
            uint32_t l = e >> 8;
            if (used + l > TABLE_BITS) break;
            syms |= (uint32_t)(e & 0xff) << (8 * count);
            count++;
            used += l;
            rest >>= l;
        }
        t->multi[j] = used | ((uint64_t)count << 8) | ((uint64_t)syms << 32);
    }
}

/* One table lookup of a stream whose next bits are in buf (at least TABLE_BITS of them valid):
   store the entry's symbols at out (all four bytes; the caller leaves room), then advance out
   and buf past what the entry decoded. */
#define LOOKUP(multi, buf, out)                                                                  \
    do {                                                                                       \
        uint64_t e_ = (multi)[(buf) & TABLE_MASK];                                             \
        (buf) >>= e_ & 63;                                                                     \
        store_le32((out), (uint32_t)(e_ >> 32));                                               \
        (out) += (e_ >> 8) & 0xff;                                                             \
    } while (0)

/* The next 64 bits of a stream at bit pos (at least 57 of them valid), with a sentinel bit on
   top. A round's peeks end by bit LOOKUPS_PER_REFILL * TABLE_BITS <= 57, below the sentinel,
   and the bits the round consumed are the sentinel's distance from bit 63 (ROUND_BITS): that
   keeps the bit count out of the per-lookup work. */
#define REFILL(src, pos) ((load_le64((src) + ((pos) >> 3)) >> ((pos) & 7)) | (1ull << 63))
#define ROUND_BITS(buf) ((uint64_t)__builtin_clzll(buf))

/* Symbols one refill can decode at most: five lookups of at most four symbols. */
#define FAST_OUT (ENTRY_SYMS * LOOKUPS_PER_REFILL)

/* How many refill-and-five-lookups rounds a stream can surely take without reading past
   in_end or writing past out_end: a round reads 8 bytes at most 7 bytes past the previous
   round's, and writes at most FAST_OUT symbols. */
static inline size_t safe_rounds(const uint8_t *src, uint64_t pos, const uint8_t *in_end,
                                 const uint8_t *out, const uint8_t *out_end) {
    size_t in_left = (size_t)(in_end - (src + (pos >> 3)));
    size_t out_left = (size_t)(out_end - out);
    if (in_left < 8 || out_left < FAST_OUT) return 0;
    size_t by_in = (in_left - 8) / 7 + 1, by_out = (out_left - FAST_OUT) / FAST_OUT + 1;
    return by_in < by_out ? by_in : by_out;
}

/* Decode the rest of one stream (bits [pos, 8 * (in_end - src)) of src) into [out, out_end):
   fast while it surely can, then a symbol at a time with every read checked. Returns 0 unless
   the stream ends exactly where its last code does. */
static int finish_stream(const uint8_t *src, uint64_t pos, const uint8_t *in_end, uint8_t *out,
                         uint8_t *out_end, const decode_table *t) {
    for (size_t rounds; (rounds = safe_rounds(src, pos, in_end, out, out_end));) {
        for (size_t i = 0; i < rounds; i++) {
            uint64_t buf = REFILL(src, pos);
            for (int k = 0; k < LOOKUPS_PER_REFILL; k++) LOOKUP(t->multi, buf, out);
            pos += ROUND_BITS(buf);
        }
    }
    uint64_t end_bits = (uint64_t)(in_end - src) * 8;
    while (out < out_end) {
        if (pos >= end_bits) return 0;
        const uint8_t *at = src + (pos >> 3);
        uint64_t word = 0;
        size_t avail = (size_t)(in_end - at);
        memcpy(&word, at, avail < 8 ? avail : 8);
        uint16_t e = t->one[(word >> (pos & 7)) & TABLE_MASK];
        *out++ = (uint8_t)e;
        pos += e >> 8;
    }
    /* The stream must end in its last code's byte, and the bits after that code be zero (as
       the encoder leaves them), so that no bit of a payload is free to change. */
    if ((pos + 7) / 8 * 8 != end_bits) return 0;
    return pos % 8 == 0 || (in_end[-1] >> (pos % 8)) == 0;
}

/* Decode the STREAMS streams at src (byte lengths sizes[]) into n symbols at out. The streams
   advance together, each held in locals, so that their table loads overlap. */
static int decode_streams(const uint8_t *src, const uint32_t sizes[STREAMS], uint8_t *out,
                          size_t n, const decode_table *t) {
    size_t start[STREAMS + 1];
    stream_bounds(n, start);
    const uint8_t *in_end[STREAMS];
    uint64_t pos[STREAMS];
    uint8_t *o[STREAMS];
    uint64_t offset = 0;
    for (int s = 0; s < STREAMS; s++) {
        pos[s] = offset * 8;
        offset += sizes[s];
        in_end[s] = src + offset;
        o[s] = out + start[s];
    }
    const uint64_t *multi = t->multi;
    for (;;) {
        size_t rounds = SIZE_MAX;
        for (int s = 0; s < STREAMS; s++) {
            size_t r = safe_rounds(src, pos[s], in_end[s], o[s], out + start[s + 1]);
            rounds = r < rounds ? r : rounds;
        }
        if (!rounds) break;
        uint64_t p[STREAMS], b[STREAMS];
        uint8_t *q[STREAMS];
#pragma GCC unroll 16
        for (int s = 0; s < STREAMS; s++) p[s] = pos[s], q[s] = o[s];
        for (size_t i = 0; i < rounds; i++) {
#pragma GCC unroll 16
            for (int s = 0; s < STREAMS; s++) b[s] = REFILL(src, p[s]);
#pragma GCC unroll 8
            for (int k = 0; k < LOOKUPS_PER_REFILL; k++) {
#pragma GCC unroll 16
                for (int s = 0; s < STREAMS; s++) LOOKUP(multi, b[s], q[s]);
            }
#pragma GCC unroll 16
            for (int s = 0; s < STREAMS; s++) p[s] += ROUND_BITS(b[s]);
        }
#pragma GCC unroll 16
        for (int s = 0; s < STREAMS; s++) pos[s] = p[s], o[s] = q[s];
    }
    for (int s = 0; s < STREAMS; s++) {
        const uint8_t *base = s ? in_end[s - 1] : src;
        if (!finish_stream(base, pos[s] - (uint64_t)(base - src) * 8, in_end[s], o[s],
                           out + start[s + 1], t))
            return 0;
    }
    return 1;
}

typedef struct {
    const uint8_t *pos, *end;
} cursor;

static inline int take(cursor *c, size_t n, const uint8_t **out) {
    if ((size_t)(c->end - c->pos) < n) return 0;
    *out = c->pos;
    c->pos += n;
    return 1;
}

/* One plane's decode table across blocks: built by a block that sends a code, used again by
   the blocks that reuse it. */
typedef struct {
    decode_table table;
    int built;
} plane_table;

/* One plane of one block from the cursor. A raw plane is pointed at in place; the others are
   written to scratch. Returns 0 on any inconsistency. */
static int decode_plane(cursor *c, size_t n, uint8_t *scratch, plane_table *pt,
                        const uint8_t **plane) {
    const uint8_t *p;
    if (!take(c, 1, &p)) return 0;
    int mode = *p;
    switch (mode) {
    case MODE_RAW:
        return take(c, n, plane);
    case MODE_CONST:
        if (!take(c, 1, &p)) return 0;
        memset(scratch, *p, n);
        *plane = scratch;
        return 1;
    case MODE_HUFF: {
        const uint8_t *range, *nibbles;
        if (!take(c, 2, &range) || range[0] >= range[1]) return 0;
        int lo = range[0], hi = range[1];
        if (!take(c, (size_t)(hi - lo + 2) / 2, &nibbles)) return 0;
        uint8_t len[256] = {0};
        for (int s = lo; s <= hi; s++) {
            len[s] = (nibbles[(s - lo) / 2] >> (4 * ((s - lo) & 1))) & 0xf;
            if (len[s] > CODE_BITS) return 0;
        }
        if ((hi - lo) % 2 == 0 && nibbles[(hi - lo) / 2] >> 4) return 0; /* unused nibble */
        if (!lengths_complete(len)) return 0;
        build_decode_table(len, &pt->table);
        pt->built = 1;
        break;
    }
    case MODE_HUFF_AGAIN:
        if (!pt->built) return 0;
        break;
    default:
        return 0;
    }
    const uint8_t *sizes_at, *streams;
    if (!take(c, 4 * STREAMS, &sizes_at)) return 0;
    uint32_t sizes[STREAMS];
    uint64_t total = 0;
    for (int s = 0; s < STREAMS; s++) {
        sizes[s] = load_le32(sizes_at + 4 * s);
        total += sizes[s];
    }
    if (!take(c, (size_t)total, &streams)) return 0;
    if (!decode_streams(streams, sizes, scratch, n, &pt->table)) return 0;
    *plane = scratch;
    return 1;
}

/* Ask for transparent huge pages over a fresh output buffer before it is first written: the
   kernel otherwise faults it in 4 KiB at a time, which for a 64 MiB blob costs about as much
   as decoding it. Only the 2 MiB-aligned interior qualifies; failure just leaves small pages. */
static void prefer_huge_pages(void *buf, size_t len) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t start = ((uintptr_t)buf + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)buf + len) & ~(huge - 1);
    if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)buf;
    (void)len;
#endif
}

/* ---- Python entry points ------------------------------------------------------------------- */

static int plane_count(int itemsize) {
    return itemsize == 2 || itemsize == 4 || itemsize == 8 ? itemsize : 0;
}

static const char *ITEMSIZE_ERROR = "itemsize must be 2, 4 or 8";

PyDoc_STRVAR(estimate_doc,
             "estimate(raw, itemsize) -> (mask, gain)\n\n"
             "From a sample: the planes worth a Huffman code (bit k for plane k; the exponent\n"
             "plane always) and the fraction of raw bytes entropy coding them would save.");

static PyObject *py_estimate(PyObject *self, PyObject *args) {
    Py_buffer raw;
    int itemsize;
    double plane_min_gain;
    if (!PyArg_ParseTuple(args, "y*id", &raw, &itemsize, &plane_min_gain)) return NULL;
    int w = plane_count(itemsize);
    if (!w || raw.len % itemsize) {
        PyBuffer_Release(&raw);
        PyErr_SetString(PyExc_ValueError, ITEMSIZE_ERROR);
        return NULL;
    }
    size_t n = (size_t)raw.len / (size_t)w;
    uint32_t (*h)[256] = calloc(MAX_PLANES, sizeof *h);
    if (!h) {
        PyBuffer_Release(&raw);
        return PyErr_NoMemory();
    }
    uint64_t sampled = 0;
    Py_BEGIN_ALLOW_THREADS;
    size_t windows = n <= (size_t)SAMPLE_WINDOWS * SAMPLE_WINDOW ? 1 : SAMPLE_WINDOWS;
    size_t width = windows == 1 ? n : SAMPLE_WINDOW;
    size_t stride = windows == 1 ? 0 : (n - width) / (windows - 1);
    const uint8_t *in = raw.buf;
    for (size_t k = 0; k < windows; k++) {
        const uint8_t *at = in + (k * stride) * (size_t)w;
        for (size_t i = 0; i < width; i++) {
            uint64_t v = 0;
            memcpy(&v, at + i * (size_t)w, (size_t)w);
            v = ((v << 1) | (v >> (8 * w - 1))) & (w == 8 ? ~0ull : (1ull << (8 * w)) - 1);
            for (int p = 0; p < w; p++) h[p][(v >> (8 * p)) & 0xff]++;
        }
        sampled += width;
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&raw);
    long mask = 0;
    double saved_bits = 0;
    for (int p = 0; p < w && sampled; p++) {
        double bits = 0;
        for (int s = 0; s < 256; s++)
            if (h[p][s]) {
                double q = (double)h[p][s] / (double)sampled;
                bits -= q * log2(q);
            }
        if (p == w - 1 || 8.0 - bits >= 8.0 * plane_min_gain) {
            mask |= 1L << p;
            saved_bits += 8.0 - bits;
        }
    }
    free(h);
    return Py_BuildValue("(ld)", mask, n ? saved_bits / (8.0 * w) : 0.0);
}

PyDoc_STRVAR(encode_doc,
             "encode(raw, itemsize, mask, block_log2) -> bytes\n\n"
             "The payload for raw: blocks of 1 << block_log2 elements, the planes in mask\n"
             "Huffman-coded where that is smaller, the others raw.");

static PyObject *py_encode(PyObject *self, PyObject *args) {
    Py_buffer raw;
    int itemsize, block_log2;
    long mask;
    if (!PyArg_ParseTuple(args, "y*ili", &raw, &itemsize, &mask, &block_log2)) return NULL;
    int w = plane_count(itemsize);
    if (!w || raw.len % itemsize || block_log2 < MIN_BLOCK_LOG2 || block_log2 > MAX_BLOCK_LOG2) {
        PyBuffer_Release(&raw);
        PyErr_SetString(PyExc_ValueError, "itemsize must be 2, 4 or 8 and block_log2 8-24");
        return NULL;
    }
    size_t n = (size_t)raw.len / (size_t)w, block = (size_t)1 << block_log2;
    size_t blocks = (n + block - 1) / block;
    size_t first = n < block ? n : block;
    size_t cap = (size_t)raw.len + blocks * (size_t)w + 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
    uint8_t *scratch = malloc((size_t)w * first + 1);
    if (!out || !scratch) {
        Py_XDECREF(out);
        free(scratch);
        PyBuffer_Release(&raw);
        return PyErr_NoMemory();
    }
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS;
    prefer_huge_pages(dst, cap);
    uint8_t *planes[MAX_PLANES];
    plane_code codes[MAX_PLANES];
    for (int k = 0; k < w; k++) {
        planes[k] = scratch + (size_t)k * first;
        codes[k].sent = 0;
    }
    const uint8_t *in = raw.buf;
    for (size_t b = 0; b < blocks; b++) {
        size_t count = n - b * block < block ? n - b * block : block;
        split_planes(in + b * block * (size_t)w, count, w, planes);
        for (int k = 0; k < w; k++)
            dst = encode_plane(planes[k], count, (mask >> k) & 1, &codes[k], dst);
    }
    Py_END_ALLOW_THREADS;
    free(scratch);
    PyBuffer_Release(&raw);
    Py_ssize_t used = (Py_ssize_t)(dst - (uint8_t *)PyBytes_AS_STRING(out));
    if (_PyBytes_Resize(&out, used) < 0) return NULL;
    return out;
}

PyDoc_STRVAR(decode_doc,
             "decode(payload, raw_len, itemsize, block_log2) -> bytearray\n\n"
             "The raw_len bytes payload encodes; ValueError if it does not decode exactly.");

static PyObject *py_decode(PyObject *self, PyObject *args) {
    Py_buffer payload;
    Py_ssize_t raw_len;
    int itemsize, block_log2;
    if (!PyArg_ParseTuple(args, "y*nii", &payload, &raw_len, &itemsize, &block_log2))
        return NULL;
    int w = plane_count(itemsize);
    if (!w || raw_len < 0 || raw_len % itemsize || block_log2 < MIN_BLOCK_LOG2 ||
        block_log2 > MAX_BLOCK_LOG2) {
        PyBuffer_Release(&payload);
        PyErr_SetString(PyExc_ValueError,
                        "payload parameters are invalid (itemsize 2, 4 or 8, block_log2 8-24, "
                        "raw length a multiple of the itemsize)");
        return NULL;
    }
    size_t n = (size_t)raw_len / (size_t)w, block = (size_t)1 << block_log2;
    size_t blocks = (n + block - 1) / block;
    size_t first = n < block ? n : block;
    /* Every plane of every block takes at least two bytes (a mode and a value or more): a
       payload too short for that is refused before raw_len bytes are allocated for it. */
    if ((size_t)payload.len / 2 / (size_t)w < blocks) {
        PyBuffer_Release(&payload);
        PyErr_Format(PyExc_ValueError,
                     "payload of %zd bytes is too short for %zd raw bytes (truncated)",
                     payload.len, raw_len);
        return NULL;
    }
    /* Scratch is bounded by raw_len: one block's planes (at most the raw bytes) and a table. */
    PyObject *out = PyByteArray_FromStringAndSize(NULL, raw_len);
    uint8_t *scratch = malloc((size_t)w * first + 1);
    plane_table *tables = calloc((size_t)w, sizeof *tables);
    if (!out || !scratch || !tables) {
        Py_XDECREF(out);
        free(scratch);
        free(tables);
        PyBuffer_Release(&payload);
        return PyErr_NoMemory();
    }
    uint8_t *dst = (uint8_t *)PyByteArray_AS_STRING(out);
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS;
    prefer_huge_pages(dst, (size_t)raw_len);
    cursor c = {payload.buf, (const uint8_t *)payload.buf + payload.len};
    const uint8_t *planes[MAX_PLANES];
    for (size_t b = 0; b < blocks && ok; b++) {
        size_t count = n - b * block < block ? n - b * block : block;
        for (int k = 0; k < w && ok; k++)
            ok = decode_plane(&c, count, scratch + (size_t)k * first, &tables[k], &planes[k]);
        if (ok) merge_planes(planes, count, w, dst + b * block * (size_t)w);
    }
    if (ok && c.pos != c.end) ok = 0;
    Py_END_ALLOW_THREADS;
    free(scratch);
    free(tables);
    PyBuffer_Release(&payload);
    if (!ok) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_ValueError,
                        "payload does not decode: a block header, code table or bit stream is "
                        "inconsistent, truncated or followed by extra bytes");
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"estimate", py_estimate, METH_VARARGS, estimate_doc},
    {"encode", py_encode, METH_VARARGS, encode_doc},
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ckptstore.cas._fpcodec",
    .m_doc = "The float codec's C half: byte planes, Huffman coding, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fpcodec(void) { return PyModule_Create(&module); }
