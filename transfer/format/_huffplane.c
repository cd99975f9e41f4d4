/* Static canonical Huffman coder for the byte planes of float chunks (FORMAT.md, "Plane codec 2").
 *
 * Why our own coder: the compressible plane of a bf16 chunk (sign and exponent bytes) has no
 * repeats worth a match, so all that zstd does for it is Huffman-code its literals, and zstd pays
 * for a match finder, a fresh table every 128 KiB block and a full histogram on the way. This
 * coder builds one length-limited code per plane from a 1/16 sample and writes it with a table
 * that codes two symbols per lookup, into four independent bit streams: the encoder works them two
 * at a time (two dependency chains whose state stays in registers; four spilled), the decoder all
 * four at once, in batches of rounds whose bounds are checked once. It codes a bf16 exponent plane
 * much faster than libzstd, to the same size, and decodes it a little faster (up to three symbols per
 * lookup); bench/planecoder.py measures both side by side.
 *
 * Memory safety does not depend on the payload being well formed: every write is bounded by the
 * caller's buffer and reads past a stream's end see zero bits. A malformed payload decodes to
 * wrong bytes or an error; the chunk's BLAKE3 check (and the AEAD tag before it) catch both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the bit streams are read and written as little-endian 64-bit words"
#endif

#define MAXBITS 12                      /* longest code: two pairs and 7 pending bits fit 64 bits */
#define NSTREAMS 4
#define LENGTHS_BYTES 128               /* 256 code lengths, 4 bits each */
#define HEADER_BYTES (1 + LENGTHS_BYTES + 4 * (NSTREAMS - 1))
#define SAMPLE_BLOCK 1024               /* bytes counted out of every SAMPLE_STRIDE */
#define SAMPLE_STRIDE 16384

#if defined(__x86_64__) && defined(__GNUC__)
#define WITH_AVX2_CLONE __attribute__((target_clones("avx2", "default")))  /* picked at load time */
#else
#define WITH_AVX2_CLONE
#endif

static inline uint64_t load64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void store64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void store32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline uint32_t load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t load16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ------------------------------------------------------------------ per-thread workspace */

typedef struct {
    uint8_t lengths[256];     /* code the pair table below was built for */
    int have_pairs;
    /* (s0 | s1 << 8) -> the two codes' bits and their total length, in two arrays: loads are
     * cheaper than the masks and shifts that unpacking one packed entry would cost the hot loop */
    uint32_t pair_code[65536];
    uint8_t pair_len[65536];
    uint8_t *scratch;         /* the four streams before they are packed behind the header */
    size_t scratch_cap;
} workspace;

static pthread_key_t workspace_key;

static void free_workspace(void *p) {
    workspace *ws = p;
    if (ws) { free(ws->scratch); free(ws); }
}

static workspace *get_workspace(size_t scratch_need) {
    workspace *ws = pthread_getspecific(workspace_key);
    if (!ws) {
        ws = calloc(1, sizeof *ws);
        if (!ws || pthread_setspecific(workspace_key, ws)) { free(ws); return NULL; }
    }
    if (ws->scratch_cap < scratch_need) {
        uint8_t *grown = realloc(ws->scratch, scratch_need);
        if (!grown) return NULL;
        ws->scratch = grown;
        ws->scratch_cap = scratch_need;
    }
    return ws;
}

/* ------------------------------------------------------------------ building the code */

static void sample_counts(const uint8_t *p, size_t n, uint32_t counts[256]) {
    uint32_t c[4][256];
    memset(c, 0, sizeof c);
    size_t block = n <= 4 * SAMPLE_STRIDE ? n : SAMPLE_BLOCK;
    size_t stride = n <= 4 * SAMPLE_STRIDE ? n : SAMPLE_STRIDE;
    for (size_t off = 0; off < n; off += stride) {
        size_t end = off + block < n ? off + block : n, i = off;
        for (; i + 4 <= end; i += 4) { c[0][p[i]]++; c[1][p[i + 1]]++; c[2][p[i + 2]]++; c[3][p[i + 3]]++; }
        for (; i < end; i++) c[0][p[i]]++;
    }
    for (int s = 0; s < 256; s++) counts[s] = c[0][s] + c[1][s] + c[2][s] + c[3][s];
}

/* The exact range of the low 7 bits of every byte: one vectorized pass. Every byte of the plane
 * lies in it (in either sign half), so giving its symbols a code is enough, and a plane of float
 * exponents spans a few dozen symbols, not 256: their codes cost almost no code space. */
WITH_AVX2_CLONE
static void low7_range(const uint8_t *p, size_t n, int *low, int *high) {
    uint8_t mn = 0x7F, mx = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t v = p[i] & 0x7F;
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    *low = mn;
    *high = mx;
}

static int by_weight(const void *a, const void *b) {
    const uint64_t *x = a, *y = b;  /* (weight << 8 | symbol): sorts by weight, ties by symbol */
    return (*x > *y) - (*x < *y);
}

/* Huffman code lengths for the symbols with a weight (two-queue construction over sorted leaves). */
static int build_lengths_once(const uint64_t weight[256], uint8_t lengths[256]) {
    uint64_t key[256], w[511];
    int16_t parent[511];
    uint8_t depth[511];
    int m = 0;  /* symbols with a weight: only they get a code */
    memset(lengths, 0, 256);
    for (int s = 0; s < 256; s++) if (weight[s]) key[m++] = weight[s] << 8 | (uint64_t)s;
    if (m == 1) { lengths[key[0] & 0xFF] = 1; return 1; }
    qsort(key, m, sizeof key[0], by_weight);
    for (int i = 0; i < m; i++) w[i] = key[i] >> 8;
    int leaf = 0, inner = m, root = 2 * m - 2;
    for (int next = m; next <= root; next++) {
        int pick[2];
        for (int k = 0; k < 2; k++) {
            if (leaf < m && (inner >= next || w[leaf] <= w[inner])) pick[k] = leaf++;
            else pick[k] = inner++;
        }
        w[next] = w[pick[0]] + w[pick[1]];
        parent[pick[0]] = parent[pick[1]] = (int16_t)next;
    }
    depth[root] = 0;
    int longest = 0;
    for (int i = root - 1; i >= 0; i--) {
        depth[i] = depth[parent[i]] + 1;
        if (i < m) {
            lengths[key[i] & 0xFF] = depth[i];
            if (depth[i] > longest) longest = depth[i];
        }
    }
    return longest;
}

/* Every symbol in the plane's range gets a code (weight: sampled count + 1), so a sample that missed
 * a rare byte still codes it. Too long a code is fixed by halving the weights, which flattens the
 * tail and keeps the head. */
static void build_lengths(const uint32_t counts[256], int low7, int high7, uint8_t lengths[256]) {
    uint64_t weight[256];
    for (int s = 0; s < 256; s++) weight[s] = (uint64_t)counts[s] + ((s & 0x7F) >= low7 && (s & 0x7F) <= high7);
    while (build_lengths_once(weight, lengths) > MAXBITS)
        for (int s = 0; s < 256; s++) if (weight[s]) weight[s] = (weight[s] + 1) >> 1;
}

static uint32_t reverse_bits(uint32_t code, int len) {
    uint32_t r = 0;
    for (int i = 0; i < len; i++) { r = r << 1 | (code & 1); code >>= 1; }
    return r;
}

/* Canonical codes (shorter first, then by symbol), bit-reversed for an LSB-first stream.
 * Returns 0, or -1 when the lengths over-subscribe the code space (a malformed header). */
static int canonical_codes(const uint8_t lengths[256], uint32_t codes[256]) {
    uint32_t count[MAXBITS + 1] = {0}, next[MAXBITS + 2];
    for (int s = 0; s < 256; s++) count[lengths[s]]++;
    count[0] = 0;
    uint32_t code = 0, space = 0;
    for (int len = 1; len <= MAXBITS; len++) {
        code = (code + count[len - 1]) << 1;
        next[len] = code;
        space += count[len] << (MAXBITS - len);
    }
    if (space > (1u << MAXBITS)) return -1;
    for (int s = 0; s < 256; s++)
        codes[s] = lengths[s] ? reverse_bits(next[lengths[s]]++, lengths[s]) : 0;
    return 0;
}

/* Stream s codes plane bytes [s*q, s*q + count[s]) (FORMAT.md): q = n / 4, the last stream the rest. */
static size_t stream_layout(size_t n, size_t count[NSTREAMS]) {
    size_t q = n / NSTREAMS;
    for (int s = 0; s < NSTREAMS; s++) count[s] = s < NSTREAMS - 1 ? q : n - (NSTREAMS - 1) * q;
    return q;
}

/* ------------------------------------------------------------------ encoding */

typedef struct { uint8_t *p; uint64_t acc; unsigned nbits; } bit_writer;

#define PUT(bw, code, len) do { (bw).acc |= (uint64_t)(code) << (bw).nbits; (bw).nbits += (len); } while (0)
/* Store all whole bytes; the partial one is stored too and rewritten by the next flush. */
#define FLUSH(bw) do { store64((bw).p, (bw).acc); (bw).p += (bw).nbits >> 3; \
    (bw).acc >>= (bw).nbits & 56; (bw).nbits &= 7; } while (0)

/* The hot loop, two streams at a time: two chains keep the core busy, and two writers' state fits
 * the registers where four writers' did not. Four symbols per stream per round: two pair lookups
 * (≤ 48 bits) on top of ≤ 7 pending bits. */
static void encode_two(const uint8_t *a, const uint8_t *b, size_t rounds, const uint32_t *pair_code,
                       const uint8_t *pair_len, bit_writer *wa, bit_writer *wb) {
    bit_writer x = *wa, y = *wb;
    for (size_t i = 0; i < 4 * rounds; i += 4) {
        uint16_t a0 = load16(a + i), a1 = load16(a + i + 2), b0 = load16(b + i), b1 = load16(b + i + 2);
        PUT(x, pair_code[a0], pair_len[a0]);
        PUT(y, pair_code[b0], pair_len[b0]);
        PUT(x, pair_code[a1], pair_len[a1]);
        PUT(y, pair_code[b1], pair_len[b1]);
        FLUSH(x);
        FLUSH(y);
    }
    *wa = x;
    *wb = y;
}

/* Encode `n` bytes of `plane` into `out` (capacity `cap`); returns the payload length, or -1 when
 * it would not fit in `cap`, or -2 when out of memory. */
static Py_ssize_t encode_plane(const uint8_t *plane, size_t n, uint8_t *out, size_t cap) {
    size_t count[NSTREAMS], q = stream_layout(n, count);
    /* worst case MAXBITS per symbol, plus room for the last 8-byte store of each stream */
    size_t room = (count[NSTREAMS - 1] * MAXBITS + 7) / 8 + 16;
    workspace *ws = get_workspace(room * NSTREAMS);
    if (!ws) return -2;

    uint32_t counts[256], codes[256];
    uint8_t lengths[256];
    int low7, high7;
    sample_counts(plane, n, counts);
    low7_range(plane, n, &low7, &high7);
    build_lengths(counts, low7, high7, lengths);
    canonical_codes(lengths, codes);
    if (!ws->have_pairs || memcmp(ws->lengths, lengths, 256) != 0) {
        /* Only pairs of coded bytes are ever looked up (every byte in the plane has a code), and a
         * plane of exponents codes a few dozen values: filling just their pairs, not all 65536,
         * keeps the table's cost per chunk small. Consecutive chunks of one tensor often sample to
         * the same code: then the table is kept as it is. */
        uint8_t coded[256];
        int m = 0;
        for (int sym = 0; sym < 256; sym++) if (lengths[sym]) coded[m++] = (uint8_t)sym;
        for (int a = 0; a < m; a++) {
            uint32_t hi = coded[a];
            for (int b = 0; b < m; b++) {
                uint32_t lo = coded[b];
                ws->pair_code[hi << 8 | lo] = codes[lo] | codes[hi] << lengths[lo];
                ws->pair_len[hi << 8 | lo] = (uint8_t)(lengths[lo] + lengths[hi]);
            }
        }
        memcpy(ws->lengths, lengths, 256);
        ws->have_pairs = 1;
    }
    const uint32_t *pair_code = ws->pair_code;
    const uint8_t *pair_len = ws->pair_len;

    bit_writer bw[NSTREAMS];
    for (int s = 0; s < NSTREAMS; s++) bw[s] = (bit_writer){ws->scratch + s * room, 0, 0};
    const uint8_t *src[NSTREAMS];
    for (int s = 0; s < NSTREAMS; s++) src[s] = plane + s * q;

    size_t rounds = q / 4;
    encode_two(src[0], src[1], rounds, pair_code, pair_len, &bw[0], &bw[1]);
    encode_two(src[2], src[3], rounds, pair_code, pair_len, &bw[2], &bw[3]);
    size_t used[NSTREAMS], total = HEADER_BYTES;
    for (int s = 0; s < NSTREAMS; s++) {
        for (size_t i = 4 * rounds; i < count[s]; i++) {
            uint8_t sym = src[s][i];
            PUT(bw[s], codes[sym], lengths[sym]);
            FLUSH(bw[s]);
        }
        used[s] = (size_t)(bw[s].p - (ws->scratch + s * room)) + (bw[s].nbits > 0);
        total += used[s];
    }
    if (total > cap) return -1;

    out[0] = MAXBITS;
    for (int i = 0; i < LENGTHS_BYTES; i++) out[1 + i] = (uint8_t)(lengths[2 * i] | lengths[2 * i + 1] << 4);
    for (int s = 0; s < NSTREAMS - 1; s++) store32(out + 1 + LENGTHS_BYTES + 4 * s, (uint32_t)used[s]);
    uint8_t *o = out + HEADER_BYTES;
    for (int s = 0; s < NSTREAMS; s++) { memcpy(o, ws->scratch + s * room, used[s]); o += used[s]; }
    return (Py_ssize_t)total;
}

/* ------------------------------------------------------------------ decoding */

/* `past` counts the zero bytes read beyond the end (p itself never moves past it) */
typedef struct { const uint8_t *p, *end; uint64_t buf; unsigned bits; size_t past; } bit_reader;
#define HAS8(br) ((size_t)((br).end - (br).p) >= 8)

/* At least 56 bits in buf, where 8 bytes of input are known to be left. */
#define REFILL_FAST(buf, bits, p) do { (buf) |= load64(p) << (bits); (p) += (63 - (bits)) >> 3; (bits) |= 56; } while (0)

/* At least 56 bits in buf; reads past the end see zeros. */
static inline void refill(bit_reader *br) {
    if (HAS8(*br)) {
        REFILL_FAST(br->buf, br->bits, br->p);
    } else {
        while (br->bits <= 56) {
            uint64_t byte = 0;
            if (br->p < br->end) byte = *br->p++;
            else br->past++;
            br->buf |= byte << br->bits;
            br->bits += 8;
        }
    }
}

#define TABLE_SIZE (1u << MAXBITS)
#define BAD_SINGLE 0x8000u
#define BAD_MULTI 0x80000000u

/* One symbol per lookup (the tails): sym | len << 8, BAD_SINGLE where no code starts. */
#define DECODE1(br, dst, table, bad) do { uint32_t e_ = (table)[(br).buf & (TABLE_SIZE - 1)]; \
    (dst) = (uint8_t)e_; (bad) |= e_ << 16; unsigned l_ = (e_ >> 8) & 0x1F; (br).buf >>= l_; (br).bits -= l_; } while (0)

/* Up to three symbols per lookup: sym0 | sym1 << 8 | sym2 << 16 | count << 24 | bits << 26. The
 * four-byte store's last byte is garbage that the next store overwrites. */
#define DECODE3(buf, bits, o, table, bad) do { uint32_t e_ = (table)[(buf) & (TABLE_SIZE - 1)]; \
    store32((o), e_); (o) += (e_ >> 24) & 3; (bad) |= e_; \
    unsigned l_ = (e_ >> 26) & 0xF; (buf) >>= l_; (bits) -= l_; } while (0)

static void build_multi(const uint16_t single[TABLE_SIZE], uint32_t multi[TABLE_SIZE]) {
    for (uint32_t i = 0; i < TABLE_SIZE; i++) {
        uint32_t e = single[i];
        if (e & BAD_SINGLE) { multi[i] = BAD_MULTI | 1u << 24 | 1u << 26; continue; }
        uint32_t used = (e >> 8) & 0x1F, entry = e & 0xFF, count = 1;
        while (count < 3) {
            uint32_t next = single[i >> used];
            uint32_t len = (next >> 8) & 0x1F;
            if ((next & BAD_SINGLE) || used + len > MAXBITS) break;
            entry |= (next & 0xFF) << (8 * count);
            used += len;
            count++;
        }
        multi[i] = entry | count << 24 | used << 26;
    }
}

/* Rounds a stream can take with no bounds check: a round stores at most 16 bytes ahead and moves
 * 12 symbols on, and its refill reads 8 bytes and moves at most 7 on. */
static inline size_t safe_rounds(const bit_reader *br, size_t pos, size_t count) {
    if (pos + 16 > count || !HAS8(*br)) return 0;
    size_t by_output = (count - pos - 16) / 12 + 1, by_input = ((size_t)(br->end - br->p) - 8) / 7 + 1;
    return by_output < by_input ? by_output : by_input;
}

/* The hot loop: all four streams, bounds checked once per batch of safe rounds (so the loop body
 * holds only each stream's bit buffer, bit count, input and output pointers). */
static void decode_four(bit_reader br[NSTREAMS], uint8_t *dst[NSTREAMS], size_t pos[NSTREAMS],
                        const size_t count[NSTREAMS], const uint32_t *multi, uint32_t *bad_out) {
    uint32_t bad = 0;
    for (;;) {
        size_t rounds = SIZE_MAX;
        for (int s = 0; s < NSTREAMS; s++) {
            size_t r = safe_rounds(&br[s], pos[s], count[s]);
            if (r < rounds) rounds = r;
        }
        if (rounds == 0) break;
        uint64_t b0 = br[0].buf, b1 = br[1].buf, b2 = br[2].buf, b3 = br[3].buf;
        unsigned n0 = br[0].bits, n1 = br[1].bits, n2 = br[2].bits, n3 = br[3].bits;
        const uint8_t *p0 = br[0].p, *p1 = br[1].p, *p2 = br[2].p, *p3 = br[3].p;
        uint8_t *o0 = dst[0] + pos[0], *o1 = dst[1] + pos[1], *o2 = dst[2] + pos[2], *o3 = dst[3] + pos[3];
        for (size_t r = 0; r < rounds; r++) {
            REFILL_FAST(b0, n0, p0); REFILL_FAST(b1, n1, p1); REFILL_FAST(b2, n2, p2); REFILL_FAST(b3, n3, p3);
            for (int k = 0; k < 4; k++) {
                DECODE3(b0, n0, o0, multi, bad); DECODE3(b1, n1, o1, multi, bad);
                DECODE3(b2, n2, o2, multi, bad); DECODE3(b3, n3, o3, multi, bad);
            }
        }
        br[0].buf = b0; br[1].buf = b1; br[2].buf = b2; br[3].buf = b3;
        br[0].bits = n0; br[1].bits = n1; br[2].bits = n2; br[3].bits = n3;
        br[0].p = p0; br[1].p = p1; br[2].p = p2; br[3].p = p3;
        pos[0] = (size_t)(o0 - dst[0]); pos[1] = (size_t)(o1 - dst[1]);
        pos[2] = (size_t)(o2 - dst[2]); pos[3] = (size_t)(o3 - dst[3]);
    }
    *bad_out |= bad;
}

static const char *decode_plane(const uint8_t *payload, size_t len, uint8_t *out, size_t n) {
    if (len < HEADER_BYTES) return "huff plane is shorter than its header";
    if (payload[0] < 1 || payload[0] > MAXBITS) return "huff plane names an unknown code length limit";
    uint8_t lengths[256];
    for (int i = 0; i < LENGTHS_BYTES; i++) {
        lengths[2 * i] = payload[1 + i] & 0x0F;
        lengths[2 * i + 1] = payload[1 + i] >> 4;
    }
    for (int s = 0; s < 256; s++) if (lengths[s] > payload[0]) return "huff plane has a code longer than its limit";
    uint32_t codes[256];
    if (canonical_codes(lengths, codes) != 0) return "huff plane's code lengths over-subscribe the code space";
    uint16_t single[TABLE_SIZE];
    uint32_t multi[TABLE_SIZE];
    for (size_t i = 0; i < TABLE_SIZE; i++) single[i] = BAD_SINGLE | 1u << 8;
    for (int s = 0; s < 256; s++)
        if (lengths[s])
            for (uint32_t k = codes[s]; k < TABLE_SIZE; k += 1u << lengths[s])
                single[k] = (uint16_t)(s | lengths[s] << 8);
    build_multi(single, multi);

    size_t count[NSTREAMS], q = stream_layout(n, count), sizes[NSTREAMS], pos[NSTREAMS], body = len - HEADER_BYTES, sum = 0;
    for (int s = 0; s < NSTREAMS - 1; s++) { sizes[s] = load32(payload + 1 + LENGTHS_BYTES + 4 * s); sum += sizes[s]; }
    if (sum > body) return "huff plane's stream sizes exceed its payload";
    sizes[NSTREAMS - 1] = body - sum;
    bit_reader br[NSTREAMS];
    const uint8_t *p = payload + HEADER_BYTES;
    uint8_t *dst[NSTREAMS];
    for (int s = 0; s < NSTREAMS; s++) {
        br[s] = (bit_reader){p, p + sizes[s], 0, 0, 0};
        p += sizes[s];
        dst[s] = out + s * q;
        pos[s] = 0;
    }
    uint32_t bad = 0;
    /* A round is four lookups per stream (≤ 48 bits, ≤ 12 symbols, stores reach 16 bytes ahead):
     * all four streams while every one has room for rounds, then each stream's remaining rounds,
     * then symbol by symbol, with every read bounded. */
    decode_four(br, dst, pos, count, multi, &bad);
    for (int s = 0; s < NSTREAMS; s++) {
        uint8_t *o = dst[s] + pos[s];
        for (size_t rounds; (rounds = safe_rounds(&br[s], (size_t)(o - dst[s]), count[s])) > 0;)
            for (size_t r = 0; r < rounds; r++) {
                REFILL_FAST(br[s].buf, br[s].bits, br[s].p);
                for (int k = 0; k < 4; k++) DECODE3(br[s].buf, br[s].bits, o, multi, bad);
            }
        for (pos[s] = (size_t)(o - dst[s]); pos[s] < count[s]; pos[s]++) {
            refill(&br[s]);
            DECODE1(br[s], dst[s][pos[s]], single, bad);
        }
    }
    if (bad & BAD_MULTI) return "huff plane holds a bit pattern that is no code";
    for (int s = 0; s < NSTREAMS; s++) {
        size_t consumed = ((size_t)(br[s].p - (br[s].end - sizes[s])) + br[s].past) * 8 - br[s].bits;
        if (consumed > sizes[s] * 8) return "huff plane's stream ends before its symbols do";
    }
    return NULL;
}

/* ------------------------------------------------------------------ splitting into planes */

#if defined(__x86_64__)
#include <immintrin.h>
/* bf16/fp16: 64 bytes of elements into 32 low and 32 high bytes per step */
__attribute__((target("avx2")))
static size_t split2_avx2(const uint8_t *data, size_t n, uint8_t *lo, uint8_t *hi) {
    const __m256i evens_then_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                     0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(data + 2 * i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(data + 2 * i + 32));
        /* per 128-bit lane: 8 low bytes then 8 high bytes; then the lanes' halves regrouped */
        a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, evens_then_odds), 0xD8);
        b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, evens_then_odds), 0xD8);
        _mm256_storeu_si256((__m256i *)(lo + i), _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256((__m256i *)(hi + i), _mm256_permute2x128_si256(a, b, 0x31));
    }
    return i;
}
#endif

/* Byte j of every k-byte element into out[j*n .. (j+1)*n): all planes in one pass over the data,
 * where numpy needs one pass per plane. */
static void split_planes(const uint8_t *data, size_t n, size_t k, uint8_t *out) {
    if (k == 2) {
        uint8_t *lo = out, *hi = out + n;
        size_t i = 0;
#if defined(__x86_64__)
        if (__builtin_cpu_supports("avx2")) i = split2_avx2(data, n, lo, hi);
#endif
        for (; i < n; i++) { lo[i] = data[2 * i]; hi[i] = data[2 * i + 1]; }
    } else if (k == 4) {
        uint8_t *p0 = out, *p1 = out + n, *p2 = out + 2 * n, *p3 = out + 3 * n;
        for (size_t i = 0; i < n; i++) {
            p0[i] = data[4 * i]; p1[i] = data[4 * i + 1]; p2[i] = data[4 * i + 2]; p3[i] = data[4 * i + 3];
        }
    } else {
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < k; j++) out[j * n + i] = data[k * i + j];
    }
}

#if defined(__x86_64__)
/* bf16/fp16: 32 low and 32 high bytes into 32 elements per step */
__attribute__((target("avx2")))
static size_t merge2_avx2(const uint8_t *lo, const uint8_t *hi, size_t n, uint8_t *out) {
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i l = _mm256_loadu_si256((const __m256i *)(lo + i));
        __m256i h = _mm256_loadu_si256((const __m256i *)(hi + i));
        __m256i a = _mm256_unpacklo_epi8(l, h), b = _mm256_unpackhi_epi8(l, h);  /* per 128-bit lane */
        _mm256_storeu_si256((__m256i *)(out + 2 * i), _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256((__m256i *)(out + 2 * i + 32), _mm256_permute2x128_si256(a, b, 0x31));
    }
    return i;
}
#endif

/* The inverse of split_planes, from k separate plane buffers of n bytes each. */
static void merge_planes(const uint8_t *const *planes, size_t n, size_t k, uint8_t *out) {
    if (k == 2) {
        size_t i = 0;
#if defined(__x86_64__)
        if (__builtin_cpu_supports("avx2")) i = merge2_avx2(planes[0], planes[1], n, out);
#endif
        for (; i < n; i++) { out[2 * i] = planes[0][i]; out[2 * i + 1] = planes[1][i]; }
    } else if (k == 4) {
        for (size_t i = 0; i < n; i++) {
            out[4 * i] = planes[0][i]; out[4 * i + 1] = planes[1][i];
            out[4 * i + 2] = planes[2][i]; out[4 * i + 3] = planes[3][i];
        }
    } else {
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < k; j++) out[k * i + j] = planes[j][i];
    }
}

/* ------------------------------------------------------------------ Python */

#define MAX_PLANES 16

static PyObject *py_merge(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Ow*:merge", &seq, &out)) return NULL;
    PyObject *items = PySequence_Fast(seq, "merge: planes must be a sequence of buffers");
    if (!items) { PyBuffer_Release(&out); return NULL; }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(items), got = 0;
    Py_buffer views[MAX_PLANES];
    const uint8_t *planes[MAX_PLANES];
    const char *err = NULL;
    if (k < 1 || k > MAX_PLANES) err = "merge: between 1 and 16 planes";
    for (; !err && got < k; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, got), &views[got], PyBUF_SIMPLE) != 0) break;
        planes[got] = views[got].buf;
        if (views[got].len != views[0].len) err = "merge: the planes differ in length";
    }
    if (!err && !PyErr_Occurred() && out.len < views[0].len * k) err = "merge: the output is shorter than the planes";
    if (!err && !PyErr_Occurred()) {
        Py_BEGIN_ALLOW_THREADS
        merge_planes(planes, (size_t)views[0].len, (size_t)k, out.buf);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t j = 0; j < got; j++) PyBuffer_Release(&views[j]);
    Py_DECREF(items);
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    if (err) { PyErr_SetString(PyExc_ValueError, err); return NULL; }
    Py_RETURN_NONE;
}

static PyObject *py_split(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, out;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "y*nw*:split", &data, &k, &out)) return NULL;
    const char *err = NULL;
    if (k < 1 || data.len % k) err = "split: the data is not a whole number of k-byte elements";
    else if (out.len < data.len) err = "split: the output is shorter than the data";
    else if ((const uint8_t *)out.buf < (const uint8_t *)data.buf + data.len && (const uint8_t *)data.buf < (const uint8_t *)out.buf + out.len)
        err = "split: the output overlaps the data";
    if (!err) {
        Py_BEGIN_ALLOW_THREADS
        split_planes(data.buf, (size_t)(data.len / k), (size_t)k, out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (err) { PyErr_SetString(PyExc_ValueError, err); return NULL; }
    Py_RETURN_NONE;
}


static PyObject *py_encode(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer plane, out;
    if (!PyArg_ParseTuple(args, "y*w*:encode", &plane, &out)) return NULL;
    Py_ssize_t n;
    Py_BEGIN_ALLOW_THREADS
    n = plane.len > 0 ? encode_plane(plane.buf, (size_t)plane.len, out.buf, (size_t)out.len) : -1;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&plane);
    PyBuffer_Release(&out);
    if (n == -2) return PyErr_NoMemory();
    return PyLong_FromSsize_t(n);
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer payload, out;
    if (!PyArg_ParseTuple(args, "y*w*:decode", &payload, &out)) return NULL;
    const char *err;
    Py_BEGIN_ALLOW_THREADS
    err = decode_plane(payload.buf, (size_t)payload.len, out.buf, (size_t)out.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&payload);
    PyBuffer_Release(&out);
    if (err) { PyErr_SetString(PyExc_ValueError, err); return NULL; }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"merge", py_merge, METH_VARARGS,
     "merge(planes, out) -> None: the inverse of split, from a sequence of k equally long plane buffers."},
    {"split", py_split, METH_VARARGS,
     "split(data, k, out) -> None: byte j of every k-byte element of `data` into out[j*n:(j+1)*n]."},
    {"encode", py_encode, METH_VARARGS,
     "encode(plane, out) -> int: code the bytes of `plane` into `out`; the length, or -1 if `out` is too small."},
    {"decode", py_decode, METH_VARARGS,
     "decode(payload, out) -> None: decode a plane into `out` (its length is the symbol count); ValueError if malformed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_huffplane", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__huffplane(void) {
    if (pthread_key_create(&workspace_key, free_workspace) != 0) return PyErr_NoMemory();
    PyObject *m = PyModule_Create(&module);
    if (m) {
        PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES);
        PyModule_AddIntConstant(m, "MAXBITS", MAXBITS);
    }
    return m;
}
