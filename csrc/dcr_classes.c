/* The "classes" chunk coding of nemo-dcr: C kernels, byte-for-byte identical to the PyTorch
 * reference in nemo_dcr/codec/classes.py (which defines the format; docs/format.md describes it).
 *
 * Positions are coded per class of the *base* value (its exponent field), as Rice-coded gaps
 * between the ranks of changed elements among the elements of that class; values as the sign of
 * the change in the format's monotone order (one raw bit) and, per class, which changes moved by
 * more than one step (Rice-coded gaps) and by how much (Rice-coded excess). Both sides compute
 * the classes from the base, so the context costs nothing to send.
 *
 * Plain C99, no dependencies: built into the package by setup.py (a shared library, not a Python
 * extension module) and called with ctypes (nemo_dcr/codec/native.py). Every input is validated;
 * a malformed stream returns a negative code, never reads out of bounds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <cpuid.h>
#define DCR_X86 1
#endif

#define QMAX 32      /* unary part longer than this: escape */
#define ESC_BITS 48  /* escaped values are sent in this many bits */
#define TAB 6        /* table row: class, changes, kp, bigs, kb, ke */

enum { E_TABLE = -1, E_STREAM = -2, E_TRAILING = -3, E_RANK = -4, E_VALUE = -5, E_NOMEM = -6, E_ARGS = -7, E_RANGE = -8, E_CRC = -9 };

/* ------------------------------------------------------------------ bit writer (LSB first) */
/* The buffer always has 8 bytes of room past len (w_room): a put stores the whole accumulator
 * with one unaligned 8-byte store and advances len by the whole bytes in it; the bytes past len
 * are scratch, rewritten by the next put. One capacity check per code instead of one per byte. */
typedef struct { uint8_t *buf; int64_t len, cap; uint64_t acc; int nbits; int oom; } writer;

static void w_init(writer *w, int64_t cap) {
    w->cap = cap < 64 ? 64 : cap; w->len = 0; w->acc = 0; w->nbits = 0;
    w->buf = (uint8_t *)malloc((size_t)w->cap); w->oom = w->buf == NULL;
}
/* room for `bytes` more bytes plus the 8-byte store; 0 when out of memory */
static inline int w_room(writer *w, int64_t bytes) {
    if (__builtin_expect(w->oom, 0)) return 0;
    if (__builtin_expect(w->cap - w->len < bytes + 8, 0)) {
        int64_t nc = w->cap * 2 > w->len + bytes + 64 ? w->cap * 2 : w->len + bytes + 64;
        uint8_t *nb = (uint8_t *)realloc(w->buf, (size_t)nc);
        if (!nb) { w->oom = 1; return 0; }
        w->buf = nb; w->cap = nc;
    }
    return 1;
}
/* v < 2^len (the callers mask), len <= 56, and w_room for (len + 7) / 8 bytes done */
static inline void w_put_r(writer *w, uint64_t v, int len) {
    w->acc |= v << w->nbits; w->nbits += len;  /* nbits <= 7 before: < 64 after */
    memcpy(w->buf + w->len, &w->acc, 8);
    int nb = w->nbits >> 3;
    w->len += nb; w->nbits &= 7;
    w->acc >>= 8 * nb;  /* nb <= 7: a defined shift */
}
static void w_put(writer *w, uint64_t v, int len) { /* len <= 56 */
    if (w_room(w, 8)) w_put_r(w, v, len);
}
static void w_finish(writer *w) { if (w->nbits) w_put(w, 0, 8 - w->nbits); }

/* a Rice code, w_room for 16 bytes done (a code is at most QMAX + ESC_BITS = 80 bits) */
static inline void w_rice_r(writer *w, uint64_t v, int k) {
    uint64_t q = v >> k;
    if (q < QMAX) {
        int len = (int)q + 1 + k;
        if (len <= 56) { w_put_r(w, (1ULL << q) | ((v & ((1ULL << k) - 1)) << (q + 1)), len); return; }
        w_put_r(w, 1ULL << q, (int)q + 1);
        w_put_r(w, v & ((1ULL << k) - 1), k);
    } else { w_put_r(w, 0, QMAX); w_put_r(w, v & ((1ULL << ESC_BITS) - 1), ESC_BITS); }
}
static inline void w_rice(writer *w, uint64_t v, int k) { if (w_room(w, 16)) w_rice_r(w, v, k); }

/* count Rice codes of parameter k (vals), written through a local copy of the writer, with room
 * for a batch's longest codes made once: a store through the buffer of a writer reached by a
 * pointer may alias the writer itself, and a loop of w_rice(w, ...) reloaded and stored its
 * fields for every code; a local's fields stay in registers (nothing stored through its buffer
 * can reach it). */
#define W_BATCH 1024
static void w_rice_run(writer *w, const uint64_t *vals, int64_t count, int k) {
    for (int64_t i = 0; i < count; ) {
        const int64_t e = count - i < W_BATCH ? count : i + W_BATCH;
        if (!w_room(w, (e - i) * 10 + 16)) return;
        writer l = *w;
        for (; i < e; i++) w_rice_r(&l, vals[i], k);
        *w = l;
    }
}

static uint64_t rice_cost(uint64_t v, int k) { uint64_t q = v >> k; return q < QMAX ? q + 1 + (uint64_t)k : QMAX + ESC_BITS; }
static void rice_costs(const uint64_t *vals, int64_t count, const int ks[4], uint64_t c[4]);

static int bitlength(uint64_t m) { int b = 0; while (m) { b++; m >>= 1; } return b; }

/* the Rice parameter: the cheapest of bitlength(mean)-2 .. bitlength(mean)+1 within [0, 31],
 * the smallest on a tie. vals[i] for i < count, count >= 1. The four candidates' costs are
 * summed in one pass (a candidate outside [0, 31] is costed as 0 and skipped). */
static int choose_k_gen(const uint64_t *vals, int64_t count) {
    uint64_t s = 0; for (int64_t i = 0; i < count; i++) s += vals[i];
    const int k0 = bitlength(s / (uint64_t)count);
    int ks[4]; for (int d = 0; d < 4; d++) { int k = k0 - 2 + d; ks[d] = k < 0 ? 0 : (k > 31 ? 31 : k); }
    uint64_t c[4];
    rice_costs(vals, count, ks, c);
    int best = -1; uint64_t bestc = 0;
    for (int d = 0; d < 4; d++) {
        int k = k0 - 2 + d;
        if (k < 0 || k > 31) continue;
        if (best < 0 || c[d] < bestc) { best = k; bestc = c[d]; }
    }
    return best;
}

/* ------------------------------------------------------------------ bit reader */
/* A stream read least significant bit first, through a window: its next `have` bits in `v`
 * (zeros above them), loaded as one unaligned 8-byte load at the position's byte, shifted by its
 * bit (57..64 bits; within 8 bytes of the end the bytes are put together one by one, never read
 * past it). A code is taken from the window while it holds the whole code: the chain from one
 * code to the next is count trailing zeros, add, shift (the codes here average 2-3 bits, so a
 * window lasts ~20 of them). The reader before topped a 64-bit accumulator up after every
 * code, by a load whose address waited on the code before: the streams' decode of a 4Mi-element
 * BF16 chunk at 1-5 % took 6.9-7.2 ns a change, now 4.2-4.3 (docs/results.md, issue 25, "the
 * streams' decode through a window"). `end`: the position just past the window; the position is
 * end - have. */
typedef struct { const uint8_t *p; int64_t len, fast, end; uint64_t v; int have, err; } reader;
/* An 8-byte load is the stream's next bytes in bit order on a little-endian host only; elsewhere
 * (and built with -DDCR_READ_BYTEWISE, which the tests use to check that path here) every window
 * is put together byte by byte. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ && !defined(DCR_READ_BYTEWISE)
#define R_LOADS 1
#else
#define R_LOADS 0
#endif

static void r_init(reader *r, const uint8_t *p, int64_t len) {
    r->p = p; r->len = len; r->end = 0; r->v = 0; r->have = 0; r->err = 0;
    r->fast = R_LOADS ? 8 * (len - 8) : -1;  /* up to this position 8 bytes can be loaded at its byte */
}
static inline int64_t r_pos(const reader *r) { return r->end - r->have; }
/* The window loaded afresh at the position. */
static inline void r_load(reader *r) {
    const int64_t pos = r_pos(r);
    const int sh = (int)(pos & 7);
    uint64_t v;
    if (__builtin_expect(pos <= r->fast, 1)) {
        memcpy(&v, r->p + (pos >> 3), 8);
        r->have = 64 - sh;
    } else {
        int n = 0;
        v = 0;
        for (int64_t i = pos >> 3; i < r->len && n < 64; i++, n += 8) v |= (uint64_t)r->p[i] << n;
        r->have = n - sh;  /* (the position never passes the end: at most 8 bytes remain here) */
    }
    r->v = v >> sh;
    r->end = pos + r->have;
}
static inline void r_skip(reader *r, int len) { r->v >>= len; r->have -= len; }  /* len <= have, < 64 */
static inline uint64_t r_get(reader *r, int len) { /* len <= 56 */
    if (!len) return 0;
    if (r->have < len) {
        r_load(r);
        if (r->have < len) { r->err = 1; return 0; }
    }
    const uint64_t v = r->v & ((1ULL << len) - 1);
    r_skip(r, len);
    return v;
}
static inline uint64_t r_rice(reader *r, int k) {
    uint64_t v = r->v;
    if (__builtin_expect((v & ((1ULL << QMAX) - 1)) != 0, 1)) {
        /* the unary part ends within the window (zeros above it): q + 1 <= have */
        const int q = __builtin_ctzll(v), len = q + 1 + k;
        if (__builtin_expect(len <= r->have, 1)) {  /* the whole code is in the window */
            r_skip(r, len);
            return ((uint64_t)q << k) | ((v >> (q + 1)) & ((1ULL << k) - 1));
        }
    }
    r_load(r);
    v = r->v;
    if (__builtin_expect((v & ((1ULL << QMAX) - 1)) != 0, 1)) {
        const int q = __builtin_ctzll(v);
        r_skip(r, q + 1);
        return ((uint64_t)q << k) | r_get(r, k);
    }
    if (r->have < QMAX) { r->err = 1; return 0; }
    r_skip(r, QMAX);
    return r_get(r, ESC_BITS);
}
/* every bit read, the stream ends in that byte, padding bits are zero */
static int r_done(reader *r, int64_t len) {
    if (r->err) return E_STREAM;
    if ((r_pos(r) + 7) / 8 != len) return E_TRAILING;
    r_load(r);
    return r->v ? E_TRAILING : 0;  /* (what is left: the last byte's padding) */
}

/* ------------------------------------------------------------------ monotone order */
static inline uint64_t load_u(const void *p, int64_t i, int w) {
    if (w == 2) return ((const uint16_t *)p)[i];
    if (w == 4) return ((const uint32_t *)p)[i];
    return ((const uint8_t *)p)[i];
}
static inline void store_u(void *p, int64_t i, int w, uint64_t v) {
    if (w == 2) ((uint16_t *)p)[i] = (uint16_t)v;
    else if (w == 4) ((uint32_t *)p)[i] = (uint32_t)v;
    else ((uint8_t *)p)[i] = (uint8_t)v;
}
/* key: negative values (sign set) count down, flipped whole (mask - u = u ^ mask); others up,
 * sign set (u | sign = u ^ sign). Written as xors with a mask of the sign bit, without a branch:
 * the decoder's scans run them once per change, and the signs of changed values are random. */
static inline uint64_t key_of(uint64_t u, uint64_t mask, uint64_t sign) {
    return u ^ (sign | ((0 - (uint64_t)((u & sign) != 0)) & (mask ^ sign)));
}
static inline uint64_t unkey(uint64_t k, uint64_t mask, uint64_t sign) {
    return k ^ (sign | ((0 - (uint64_t)((k & sign) == 0)) & (mask ^ sign)));
}

/* The changes pass A finds: positions, and their old and new bits (w bytes each), gathered while
 * the scan has them in L1 (read later at scattered positions, they would miss the cache: the
 * chunk is larger than L2 and pass B streams the base again). Grown by doubling. */
typedef struct { int64_t *idx; uint8_t *ov, *nv; int64_t k, cap; int w; } found_t;

static int found_init(found_t *f, int w) {
    f->k = 0; f->cap = 1024; f->w = w;
    f->idx = (int64_t *)malloc((size_t)f->cap * 8);
    f->ov = (uint8_t *)malloc((size_t)f->cap * (size_t)w);
    f->nv = (uint8_t *)malloc((size_t)f->cap * (size_t)w);
    return f->idx && f->ov && f->nv ? 0 : -1;
}
static void found_free(found_t *f) { free(f->idx); free(f->ov); free(f->nv); f->idx = NULL; f->ov = f->nv = NULL; }

/* room for at least `need` changes in all; nonzero when out of memory (f unchanged then) */
static int found_grow(found_t *f, int64_t need) {
    if (need <= f->cap) return 0;
    int64_t nc2 = f->cap * 2 > need ? f->cap * 2 : need;
    int64_t *a = (int64_t *)realloc(f->idx, (size_t)nc2 * 8);
    if (a) f->idx = a;
    uint8_t *o = (uint8_t *)realloc(f->ov, (size_t)nc2 * (size_t)f->w);
    if (o) f->ov = o;
    uint8_t *v = (uint8_t *)realloc(f->nv, (size_t)nc2 * (size_t)f->w);
    if (v) f->nv = v;
    if (!a || !o || !v) return 1;
    f->cap = nc2;
    return 0;
}

/* append change i (old bits uo, new bits un); nonzero when out of memory */
static inline int push_change(found_t *f, int64_t i, uint64_t uo, uint64_t un) {
    if (__builtin_expect(f->k == f->cap, 0) && found_grow(f, f->k + 1)) return 1;
    f->idx[f->k] = i;
    store_u(f->ov, f->k, f->w, uo);
    store_u(f->nv, f->k, f->w, un);
    f->k++;
    return 0;
}

/* an element's class: its exponent field, clamped to the chunk's class range [lo, hi] */
static inline int class_of(uint64_t u, uint64_t absmask, int mant, int lo, int hi) {
    int c = (int)((u & absmask) >> mant);
    return c < lo ? lo : (c > hi ? hi : c);
}

/* pass A of the encoder, scalar: the changes */
static inline __attribute__((always_inline)) int64_t find_changes(
        const void *oldp, const void *newp, int64_t n, const int w, found_t *f) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t uo = load_u(oldp, i, w), un = load_u(newp, i, w);
        if (__builtin_expect(uo != un, 0) && push_change(f, i, uo, un)) return -1;
    }
    return f->k;
}

/* pass B of the encoder, scalar: each change's rank among the elements of its class. The
 * per-class counts go to 4 interleaved tables (no store-to-load stall between neighbours of one
 * class); a rank is their sum. w is a constant at each call site. wb (oldp itself, or NULL):
 * each change's new bits (nv) written there once its element is read, as the vector passes do. */
static inline __attribute__((always_inline)) void rank_scalar(
        const void *oldp, int64_t n, const int w, int mant, int lo, int hi, const int64_t *cidx, int64_t k,
        uint64_t *rank, void *wb, const void *nv) {
    const uint64_t absmask = (1ULL << (8 * w - 1)) - 1;
    uint32_t cnt[4][256];
    memset(cnt, 0, sizeof cnt);
    int64_t j = 0;
    for (int64_t i = 0; i < n && j < k; i++) {
        int c = class_of(load_u(oldp, i, w), absmask, mant, lo, hi);
        if (__builtin_expect(cidx[j] == i, 0)) {
            if (wb) store_u(wb, i, w, load_u(nv, j, w));
            rank[j++] = (uint64_t)cnt[0][c] + cnt[1][c] + cnt[2][c] + cnt[3][c];
        }
        cnt[i & 3][c]++;
    }
}

/* the decoder's scan: the element whose class count reaches the class's next rank is changed */
static inline __attribute__((always_inline)) int64_t scan_decode(
        const void *oldp, int64_t n, const int w, int mant, int lo, int hi, uint32_t *cnt, uint32_t *want,
        int64_t *next, const int64_t *endc, const uint64_t *rk, const uint64_t *dv, int64_t *idx_out, void *new_out,
        void *old_out, void *wb) {
    const uint64_t mask = (w == 4) ? 0xFFFFFFFFULL : ((1ULL << (8 * w)) - 1), sign = 1ULL << (8 * w - 1);
    const uint64_t absmask = sign - 1;
    int64_t out = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t u = load_u(oldp, i, w);
        int c = class_of(u, absmask, mant, lo, hi);
        if (__builtin_expect(cnt[c]++ == want[c], 0)) {
            int64_t j = next[c]++;
            want[c] = next[c] < endc[c] ? (uint32_t)rk[next[c]] : UINT32_MAX;
            idx_out[out] = i;
            const uint64_t nv = unkey((key_of(u, mask, sign) + dv[j]) & mask, mask, sign);
            store_u(new_out, out, w, nv);
            if (old_out) store_u(old_out, out, w, u);
            if (wb) store_u(wb, i, w, nv);  /* element i is read, and never again */
            out++;
        }
    }
    return out;
}


/* ------------------------------------------------------------------ vector scans (16-bit)
 * For 2-byte dtypes the element scans run 64 elements at a time (dcr_simd_scans.h says how),
 * with AVX-512BW or AVX2, whichever the CPU has, chosen at run time; other widths, chunks with
 * more than MAXA active classes, and dcr_set_simd(0) take the scalar scans above. */
#define MAXA 64
static int simd_enabled = 1;
/* 1: the best the CPU has (the default), 0: the scalar scans, 2: AVX2 at most (the classes scans
 * and the state digest's builds), 3: as 2, the AVX2 decoder's bit selection without pdep (what a
 * core whose pdep is slow runs: so that a machine with a fast one tests that path too) */
void dcr_set_simd(int on) { simd_enabled = on; }
/* what the setting leaves of the best instruction set v the CPU has (2 AVX-512, 1 AVX2, 0 none):
 * one rule for the classes scans and the state digest's builds */
static inline int simd_cap(int v) { return simd_enabled >= 2 && v > 1 ? 1 : (simd_enabled ? v : 0); }

#ifdef DCR_X86
/* 2: AVX-512BW (+BMI2 for pdep), 1: AVX2, 0: neither (or dcr_set_simd(0)) */
static int simd_isa(void) {
    static int v = -1;  /* (dcr_set_simd(2): AVX2 at most, so the tests reach that path here too) */
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt") ? 2
            : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt") ? 1 : 0;
    }
    return simd_cap(v);
}
#endif

/* What the classes scans of 2-byte dtypes run now: 2 AVX-512BW, 1 AVX2, 0 scalar (the CPU's
 * features and dcr_set_simd; `nemo-dcr --version` names it). */
int dcr_simd_level(void) {
#ifdef DCR_X86
    return simd_isa();
#else
    return 0;
#endif
}

/* The sources this library was built from (setup.py's source_hash): a source checkout rebuilds
 * a library whose sources it no longer has. */
#ifndef DCR_SOURCE_HASH
#define DCR_SOURCE_HASH "unknown"
#endif
const char *dcr_source_hash(void) { return DCR_SOURCE_HASH; }

#ifdef DCR_X86

/* AVX-512BW: a block's classes are one vector of 64 bytes */
typedef struct { __m512i absm, vlo, vhi; __m128i sh; } ctx512;
__attribute__((target("avx512f,avx512bw")))
static inline ctx512 ctx_avx512(int mant, int lo, int hi) {
    ctx512 x = {_mm512_set1_epi16(0x7FFF), _mm512_set1_epi8((char)lo), _mm512_set1_epi8((char)hi), _mm_cvtsi32_si128(mant)};
    return x;
}
/* packus interleaves 128-bit lanes: quadwords come out as c0[0], c1[0], c0[1], c1[1], ... */
__attribute__((target("avx512f,avx512bw")))
static inline __m512i classes_avx512(const ctx512 *x, const uint16_t *p) {
    __m512i c0 = _mm512_srl_epi16(_mm512_and_si512(_mm512_loadu_si512((const void *)p), x->absm), x->sh);
    __m512i c1 = _mm512_srl_epi16(_mm512_and_si512(_mm512_loadu_si512((const void *)(p + 32)), x->absm), x->sh);
    __m512i b = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), _mm512_packus_epi16(c0, c1));
    return _mm512_max_epu8(_mm512_min_epu8(b, x->vhi), x->vlo);
}
__attribute__((target("avx512f,avx512bw")))
static inline uint64_t neq_avx512(const uint16_t *o, const uint16_t *nw) {
    __m512i a0 = _mm512_loadu_si512((const void *)o), a1 = _mm512_loadu_si512((const void *)(o + 32));
    __m512i b0 = _mm512_loadu_si512((const void *)nw), b1 = _mm512_loadu_si512((const void *)(nw + 32));
    return (uint64_t)_mm512_cmpneq_epi16_mask(a0, b0) | ((uint64_t)_mm512_cmpneq_epi16_mask(a1, b1) << 32);
}
__attribute__((target("avx512f,avx512bw,popcnt")))
static inline int block_of_avx512(const int16_t *cum, uint32_t r) {
    __m512i v = _mm512_set1_epi16((short)r);
    return __builtin_popcountll((uint64_t)_mm512_cmple_epi16_mask(_mm512_loadu_si512((const void *)cum), v))
         + __builtin_popcountll((uint64_t)_mm512_cmple_epi16_mask(_mm512_loadu_si512((const void *)(cum + 32)), v));
}
__attribute__((target("avx512f,avx512bw")))
static inline __m512i clamp_avx512(const ctx512 *x, __m512i b) { return _mm512_max_epu8(_mm512_min_epu8(b, x->vhi), x->vlo); }
/* a block's changes (mask m) copied from s into d by two masked stores: the others untouched */
__attribute__((target("avx512f,avx512bw")))
static inline void wblk_avx512(uint16_t *d, const uint16_t *s, uint64_t m) {
    _mm512_mask_storeu_epi16((void *)d, (__mmask32)m, _mm512_loadu_si512((const void *)s));
    _mm512_mask_storeu_epi16((void *)(d + 32), (__mmask32)(m >> 32), _mm512_loadu_si512((const void *)(s + 32)));
}
#define SFX _avx512
#define TGT __attribute__((target("avx512f,avx512bw,bmi2,popcnt")))
#define CTX_T ctx512
#define CTX(m, l, h) ctx_avx512(m, l, h)
#define BLK_T __m512i
#define CLASSES(x, p) classes_avx512(x, p)
#define ACT_T __m512i
#define ACT(c) _mm512_set1_epi8((char)(c))
#define EQ(cb, a) ((uint64_t)_mm512_cmpeq_epi8_mask(cb, a))
#define LDB(p) _mm512_load_si512((const void *)(p))
#define BLOCK_OF(cum, r) block_of_avx512(cum, r)
#define STB(p, cb) _mm512_store_si512((void *)(p), cb)
#define NEQ(o, nw) neq_avx512(o, nw)
#define CLAMPB(x, cb) clamp_avx512(x, cb)
#define WBLK(d, s, m) wblk_avx512(d, s, m)
#define NTH(e, at) __builtin_ctzll(_pdep_u64(1ULL << (at), e))
#include "dcr_simd_scans.h"  /* which undefines the parameters above */

/* AVX2: a block's classes are two vectors of 32 bytes. A rank inside a block is found without
 * pdep (nth_bit), which is microcoded (slow) on the AMD cores before Zen 3; the scans that select
 * a bit are built a second time with pdep for the cores where it is fast (below). */
typedef struct { __m256i absm, vlo, vhi; __m128i sh; } ctx256;
typedef struct { __m256i a, b; } blk256;
__attribute__((target("avx2")))
static inline ctx256 ctx_avx2(int mant, int lo, int hi) {
    ctx256 x = {_mm256_set1_epi16(0x7FFF), _mm256_set1_epi8((char)lo), _mm256_set1_epi8((char)hi), _mm_cvtsi32_si128(mant)};
    return x;
}
/* packus works per 128-bit lane: quadwords come out as c0[0], c1[0], c0[1], c1[1] */
__attribute__((target("avx2")))
static inline __m256i classes32_avx2(const ctx256 *x, const uint16_t *p) {
    __m256i c0 = _mm256_srl_epi16(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), x->absm), x->sh);
    __m256i c1 = _mm256_srl_epi16(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 16)), x->absm), x->sh);
    __m256i b = _mm256_permute4x64_epi64(_mm256_packus_epi16(c0, c1), 0xD8);
    return _mm256_max_epu8(_mm256_min_epu8(b, x->vhi), x->vlo);
}
__attribute__((target("avx2")))
static inline blk256 classes_avx2(const ctx256 *x, const uint16_t *p) {
    blk256 r = {classes32_avx2(x, p), classes32_avx2(x, p + 32)};
    return r;
}
__attribute__((target("avx2")))
static inline uint64_t eq_avx2(blk256 cb, __m256i a) {
    return (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(cb.a, a))
        | ((uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(cb.b, a)) << 32);
}
/* 32 16-bit compares to 32 mask bits: pack the 0/-1 words to bytes, undo packs' lane order */
__attribute__((target("avx2")))
static inline uint32_t eq32_avx2(const uint16_t *o, const uint16_t *nw) {
    __m256i e0 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)o), _mm256_loadu_si256((const __m256i *)nw));
    __m256i e1 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(o + 16)),
                                    _mm256_loadu_si256((const __m256i *)(nw + 16)));
    return (uint32_t)_mm256_movemask_epi8(_mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), 0xD8));
}
__attribute__((target("avx2")))
static inline uint64_t neq_avx2(const uint16_t *o, const uint16_t *nw) {
    return ~((uint64_t)eq32_avx2(o, nw) | ((uint64_t)eq32_avx2(o + 32, nw + 32) << 32));
}
__attribute__((target("avx2")))
static inline blk256 clamp_avx2(const ctx256 *x, blk256 b) {
    blk256 r = {_mm256_max_epu8(_mm256_min_epu8(b.a, x->vhi), x->vlo), _mm256_max_epu8(_mm256_min_epu8(b.b, x->vhi), x->vlo)};
    return r;
}
/* a block with changes (m) copied whole from s into d (its other elements are equal in both);
 * a block without is not written (its lines stay clean) */
__attribute__((target("avx2")))
static inline void wblk_avx2(uint16_t *d, const uint16_t *s, uint64_t m) {
    if (m) for (int q = 0; q < 4; q++)
        _mm256_storeu_si256((__m256i *)(d + 16 * q), _mm256_loadu_si256((const __m256i *)(s + 16 * q)));
}
__attribute__((target("avx2")))
static inline blk256 ld_avx2(const uint8_t *p) {
    blk256 r = {_mm256_load_si256((const __m256i *)p), _mm256_load_si256((const __m256i *)(p + 32))};
    return r;
}
__attribute__((target("avx2")))
static inline void st_avx2(uint8_t *p, blk256 cb) {
    _mm256_store_si256((__m256i *)p, cb.a);
    _mm256_store_si256((__m256i *)(p + 32), cb.b);
}
/* cmpgt(cum, r) bytes are 2 per entry: the entries above r, twice, from 64 */
__attribute__((target("avx2,popcnt")))
static inline int block_of_avx2(const int16_t *cum, uint32_t r) {
    __m256i v = _mm256_set1_epi16((short)r);
    uint64_t gt = 0;
    for (int q = 0; q < 4; q++)
        gt += (uint64_t)__builtin_popcount((uint32_t)_mm256_movemask_epi8(
            _mm256_cmpgt_epi16(_mm256_loadu_si256((const __m256i *)(cum + 16 * q)), v)));
    return 64 - (int)(gt / 2);
}
/* NTH without pdep: the bytes' running popcounts (one multiply) give the byte that holds set bit
 * number `at` (how many bytes' sums are not above it), three popcount halvings the bit in that
 * byte. No branch: clearing `at` lower set bits in a loop (what this build did before) ended its
 * loop on a different count for every change, a misprediction each (a 45M BF16 delta's decode
 * on Zen 3: 0.69-0.71 ns an element with the loop, 0.65-0.66 with this; docs/results.md, format
 * 4, ninth turn). */
__attribute__((target("popcnt")))
static inline int nth_bit(uint64_t e, uint64_t at) {
    uint64_t b = e - ((e >> 1) & 0x5555555555555555ULL);
    b = (b & 0x3333333333333333ULL) + ((b >> 2) & 0x3333333333333333ULL);
    b = (b + (b >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    const uint64_t pre = b * 0x0101010101010101ULL;  /* byte i: the set bits of bytes 0..i (<= 64) */
    /* bit 7 of byte i is set where pre[i] <= at: the bytes wholly before the bit */
    const uint64_t le = ((at * 0x0101010101010101ULL | 0x8080808080808080ULL) - pre) & 0x8080808080808080ULL;
    const int sh = 8 * __builtin_popcountll(le);
    uint64_t x = (e >> sh) & 0xFF, r = at - (((pre << 8) >> sh) & 0xFF);
    int pos = sh;
    for (int w = 4; w >= 1; w >>= 1) {  /* (unrolled: w is constant in each step) */
        const uint64_t c = (uint64_t)__builtin_popcountll(x & ((1ULL << w) - 1));
        const uint64_t up = r >= c;  /* the bit is above this half */
        const int step = w & -(int)up;
        x >>= step; pos += step; r -= c & (0 - up);
    }
    return pos;
}
#define SFX _avx2
#define TGT __attribute__((target("avx2,popcnt")))
#include "dcr_avx2_params.h"
#define NTH(e, at) nth_bit(e, at)
#include "dcr_simd_scans.h"  /* which undefines the parameters above */

/* The AVX2 scans that select a bit (the decoder's, run_select) again, by pdep, for the cores
 * where pdep is one fast instruction (Intel from Haswell on, AMD from Zen 3 on; fast_pdep): on
 * Zen 3 a 45M BF16 delta's decode took 0.53-0.59 ns an element so, 0.65-0.66 with nth_bit
 * (docs/results.md, format 4, ninth turn). The scans that select no bit (the encoder's,
 * run_count) are not built twice. */
#define DCR_SELECT_ONLY
#define SFX _avx2p
#define TGT __attribute__((target("avx2,popcnt,bmi2")))
#include "dcr_avx2_params.h"
#define NTH(e, at) __builtin_ctzll(_pdep_u64(1ULL << (at), e))
#include "dcr_simd_scans.h"
#undef DCR_SELECT_ONLY

/* pdep is microcoded on the AMD cores before Zen 3 (and Hygon's, built on Zen 1): tens to
 * hundreds of cycles, growing with the mask's set bits. Elsewhere one instruction. */
static int fast_pdep(void) {
    static int v = -1;
    if (v < 0) {
        unsigned a = 0, b = 0, c = 0, d = 0;
        int slow = 0;
        if (__get_cpuid(0, &a, &b, &c, &d)) {
            const int amd = (b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163)   /* "AuthenticAMD" */
                         || (b == 0x6f677948 && d == 0x65476e6e && c == 0x656e6975);  /* "HygonGenuine" */
            if (amd && __get_cpuid(1, &a, &b, &c, &d)) {
                unsigned family = (a >> 8) & 0xF;
                if (family == 0xF) family += (a >> 20) & 0xFF;
                slow = family < 0x19;
            }
        }
        __builtin_cpu_init();
        v = __builtin_cpu_supports("bmi2") && !slow;
    }
    return v;
}
/* whether the AVX2 scans that select a bit take their pdep build now: the one rule the decoder's
 * and run_select's dispatch and dcr_simd_pdep (what --version says) all read */
static inline int avx2_pdep(void) { return simd_enabled != 3 && fast_pdep(); }
#endif

/* Whether the 2-byte decoder's scans select a block's bit by pdep now (AVX-512; AVX2 where pdep
 * is fast, unless dcr_set_simd(3)): `nemo-dcr --version` says so beside dcr_simd_level. */
int dcr_simd_pdep(void) {
#ifdef DCR_X86
    const int isa = simd_isa();
    return isa == 2 || (isa == 1 && avx2_pdep());
#else
    return 0;
#endif
}

/* c[d]: the bits of vals[0..count-1] as Rice codes of parameter ks[d] (0 <= ks[d] <= 31), the
 * four summed in one pass; with AVX2 four values at a time (a code's cost is its quotient, or a
 * constant past QMAX, plus 1 + k: one shift, compare and blend a value and parameter). The values
 * are below 2^63 (rank gaps and magnitudes): the signed compare holds. */
#ifdef DCR_X86
__attribute__((target("avx2")))
static void rice_costs_avx2(const uint64_t *vals, int64_t count, const int ks[4], uint64_t c[4]) {
    __m256i acc[4], alt[4];
    __m128i sh[4];
    const __m256i lim = _mm256_set1_epi64x(QMAX - 1);
    for (int d = 0; d < 4; d++) {
        acc[d] = _mm256_setzero_si256();
        alt[d] = _mm256_set1_epi64x(QMAX + ESC_BITS - 1 - ks[d]);  /* + 1 + k: an escape's bits */
        sh[d] = _mm_cvtsi32_si128(ks[d]);
    }
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(vals + i));
        for (int d = 0; d < 4; d++) {
            const __m256i q = _mm256_srl_epi64(v, sh[d]);
            acc[d] = _mm256_add_epi64(acc[d], _mm256_blendv_epi8(q, alt[d], _mm256_cmpgt_epi64(q, lim)));
        }
    }
    for (int d = 0; d < 4; d++) {
        uint64_t t[4];
        _mm256_storeu_si256((__m256i *)t, acc[d]);
        c[d] = t[0] + t[1] + t[2] + t[3] + (uint64_t)i * (uint64_t)(1 + ks[d]);
        for (int64_t j = i; j < count; j++) c[d] += rice_cost(vals[j], ks[d]);
    }
}
#endif
static void rice_costs(const uint64_t *vals, int64_t count, const int ks[4], uint64_t c[4]) {
#ifdef DCR_X86
    if (simd_isa() >= 1) { rice_costs_avx2(vals, count, ks, c); return; }
#endif
    uint64_t c0 = 0, c1 = 0, c2 = 0, c3 = 0;
    for (int64_t i = 0; i < count; i++) {
        uint64_t v = vals[i];
        c0 += rice_cost(v, ks[0]); c1 += rice_cost(v, ks[1]); c2 += rice_cost(v, ks[2]); c3 += rice_cost(v, ks[3]);
    }
    c[0] = c0; c[1] = c1; c[2] = c2; c[3] = c3;
}

/* ------------------------------------------------------------------ encode, once placed */
/* The coding of k changes once each is placed: ex[j] its class (< nc), rank[j] its rank among
 * the chunk's elements of that class, oldv[j]/newv[j] its old and new bits (w bytes each);
 * position order. What dcr_cls_encode ends with, and all the device path leaves to the host. */
static int encode_placed(int64_t k, int nc, int w, const uint8_t *ex, const uint64_t *rank,
                         const void *oldv, const void *newv,
                         int64_t *table, int64_t *ntab, uint8_t **pos_out, int64_t *plen,
                         uint8_t **val_out, int64_t *vlen) {
    const uint64_t mask = (w == 4) ? 0xFFFFFFFFULL : ((1ULL << (8 * w)) - 1), sign = 1ULL << (8 * w - 1);
    /* pass C: counting sort of the changes by class (stable: index order within a class) */
    int64_t ccount[257]; memset(ccount, 0, sizeof ccount);
    for (int64_t j = 0; j < k; j++) ccount[ex[j] + 1]++;
    for (int c = 0; c < nc; c++) ccount[c + 1] += ccount[c];
    int64_t fill[256]; memcpy(fill, ccount, sizeof fill);
    uint64_t *gap = (uint64_t *)malloc((size_t)(k ? k : 1) * 8);   /* rank gaps, class order */
    uint64_t *mag = (uint64_t *)malloc((size_t)(k ? k : 1) * 8);   /* |difference|, class order */
    uint8_t *neg = (uint8_t *)malloc((size_t)(k ? k : 1));
    uint64_t *tmp = (uint64_t *)malloc((size_t)(k ? k : 1) * 8);
    if (!gap || !mag || !neg || !tmp) { free(gap); free(mag); free(neg); free(tmp); return E_NOMEM; }
    for (int64_t j = 0; j < k; j++) {
        uint64_t uo = load_u(oldv, j, w), un = load_u(newv, j, w);
        int64_t at = fill[ex[j]]++;
        uint64_t d = (key_of(un, mask, sign) - key_of(uo, mask, sign)) & mask;
        /* without a branch: the signs of the differences are random (a branch mispredicted
         * half the time cost more than the rest of this loop) */
        const uint64_t ng = (d & sign) != 0, m = 0 - ng;
        neg[at] = (uint8_t)ng;
        mag[at] = ((mask + 1 - d) & m) | (d & ~m);
        gap[at] = rank[j];
    }
    /* rank -> gap within each class */
    for (int c = 0; c < nc; c++)
        for (int64_t j = ccount[c + 1] - 1; j > ccount[c]; j--) gap[j] = gap[j] - gap[j - 1] - 1;
    writer pw, vw;
    w_init(&pw, k + 16); w_init(&vw, k / 4 + 16);
    {   /* the sign bits, 8 at a time (the stream starts byte-aligned) */
        int64_t j = 0;
        for (; j + 8 <= k; j += 8) {
            uint64_t byte = 0;
            for (int b = 0; b < 8; b++) byte |= (uint64_t)neg[j + b] << b;
            w_put(&vw, byte, 8);
        }
        for (; j < k; j++) w_put(&vw, neg[j], 1);
    }
    int64_t rows = 0;
    for (int c = 0; c < nc; c++) {
        int64_t a = ccount[c], kc = ccount[c + 1] - a;
        if (!kc) continue;
        int64_t *row = table + TAB * rows++;
        int kp = choose_k_gen(gap + a, kc);
        w_rice_run(&pw, gap + a, kc, kp);
        int64_t bc = 0, last = -1;
        for (int64_t j = 0; j < kc; j++) {  /* branch-free: which magnitudes are >= 2 is random */
            const int big = mag[a + j] >= 2;
            tmp[bc] = (uint64_t)(j - last - 1);
            bc += big;
            last = big ? j : last;
        }
        int kb = 0, ke = 0;
        if (bc) {
            kb = choose_k_gen(tmp, bc);
            w_rice_run(&vw, tmp, bc, kb);
            int64_t b = 0;
            for (int64_t j = 0; j < kc; j++) { tmp[b] = mag[a + j] - 2; b += mag[a + j] >= 2; }
            ke = choose_k_gen(tmp, bc);
            w_rice_run(&vw, tmp, bc, ke);
        }
        row[0] = c; row[1] = kc; row[2] = kp; row[3] = bc; row[4] = kb; row[5] = ke;
    }
    free(gap); free(mag); free(neg); free(tmp);
    w_finish(&pw); w_finish(&vw);
    if (pw.oom || vw.oom) { free(pw.buf); free(vw.buf); return E_NOMEM; }
    *ntab = rows; *pos_out = pw.buf; *plen = pw.len; *val_out = vw.buf; *vlen = vw.len;
    return 0;
}

/* The device path's entry: cls/rank (int64, as the device pass found them), old/new the k
 * changes' bits (w bytes each), position order. Returns k, or a negative error. */
int64_t dcr_cls_encode_ranked(const int64_t *cls, const int64_t *rank, const void *oldv, const void *newv,
                              int64_t k, int w, int mant, int64_t *table, int64_t *ntab, uint8_t **pos_out,
                              int64_t *plen, uint8_t **val_out, int64_t *vlen) {
    if (!(w == 1 || w == 2 || w == 4) || mant < 0 || mant >= 8 * w - 1 || k < 0) return E_ARGS;
    int ebits = 8 * w - 1 - mant; if (ebits > 8) return E_ARGS;
    const int nc = 1 << ebits;
    uint8_t *ex = (uint8_t *)malloc((size_t)(k ? k : 1));
    if (!ex) return E_NOMEM;
    for (int64_t j = 0; j < k; j++) {
        if (cls[j] < 0 || cls[j] >= nc || rank[j] < 0) { free(ex); return E_ARGS; }
        ex[j] = (uint8_t)cls[j];
    }
    int e = encode_placed(k, nc, w, ex, (const uint64_t *)rank, oldv, newv, table, ntab, pos_out, plen,
                          val_out, vlen);
    free(ex);
    return e < 0 ? e : k;
}

/* ------------------------------------------------------------------ encode */
void dcr_free(void *p) { free(p); }

/* old/new: n elements of w bytes (1, 2, 4); mant: mantissa bits. Writes the table
 * (ntab rows of TAB int64) and mallocs the two streams, the changed positions (k int64,
 * increasing) and the changes' old and new bits (k elements of w bytes each); free them with
 * dcr_free.
 * Returns the number of changed elements, or a negative error. */
int64_t dcr_cls_encode_wb(const void *oldp, const void *newp, int64_t n, int w, int mant,
                          int64_t *table, int64_t *ntab, uint8_t **pos_out, int64_t *plen,
                          uint8_t **val_out, int64_t *vlen, int64_t **idx_out, void **old_out, void **new_out,
                          void *wb);
int64_t dcr_cls_encode(const void *oldp, const void *newp, int64_t n, int w, int mant,
                       int64_t *table, int64_t *ntab, uint8_t **pos_out, int64_t *plen,
                       uint8_t **val_out, int64_t *vlen, int64_t **idx_out, void **old_out, void **new_out) {
    return dcr_cls_encode_wb(oldp, newp, n, w, mant, table, ntab, pos_out, plen, val_out, vlen, idx_out, old_out,
                             new_out, NULL);
}

/* the f.k changes found put back to their old bits in wb (NULL: nothing was written): on an
 * error, or before the scalar pass B reads the base. A change not written yet gets the bits it
 * has. */
static void undo_wb(void *wb, const found_t *f) {
    if (wb) for (int64_t j = 0; j < f->k; j++) store_u(wb, f->idx[j], f->w, load_u(f->ov, j, f->w));
}

/* dcr_cls_encode, and with wb (oldp itself, or NULL) each change's new bits written into the base
 * once its element is read, while its block is in L1 (by pass A where it runs vector code, else by
 * pass B): the publisher's snapshot brought to the target in the same pass (a scatter afterwards
 * found the chunk out of L2: ~1-2 ms of a 64M BF16 encode at 1 %). On an error nothing stays
 * written. */
int64_t dcr_cls_encode_wb(const void *oldp, const void *newp, int64_t n, int w, int mant,
                          int64_t *table, int64_t *ntab, uint8_t **pos_out, int64_t *plen,
                          uint8_t **val_out, int64_t *vlen, int64_t **idx_out, void **old_out, void **new_out,
                          void *wb) {
    if (wb && wb != oldp) return E_ARGS;
    if (!(w == 1 || w == 2 || w == 4) || mant < 0 || mant >= 8 * w - 1 || n < 0 || n >= (1LL << 32)) return E_ARGS;
    int ebits = 8 * w - 1 - mant; if (ebits > 8) return E_ARGS;
    const int nc = 1 << ebits;
    const uint64_t sign = 1ULL << (8 * w - 1);
    const uint64_t absmask = sign - 1;
    found_t f;
    if (found_init(&f, w)) { found_free(&f); return E_NOMEM; }
    int simd = 0;
#ifdef DCR_X86
    simd = w == 2 ? simd_isa() : 0;
#endif
    /* pass A: the changes (and, by the vector passes, the classes of the whole blocks into ca,
     * and the changes of those blocks written into wb) */
    int64_t got;
    void *ca_mem = NULL;
    uint8_t *ca = NULL;
#ifdef DCR_X86
    if (simd) {
        ca_mem = malloc((size_t)n + 64);
        if (!ca_mem) { found_free(&f); return E_NOMEM; }
        ca = (uint8_t *)(((uintptr_t)ca_mem + 63) & ~(uintptr_t)63);
    }
    if (simd == 2) got = find_changes_avx512((const uint16_t *)oldp, (const uint16_t *)newp, n, mant, &f, ca, (uint16_t *)wb);
    else if (simd == 1) got = find_changes_avx2((const uint16_t *)oldp, (const uint16_t *)newp, n, mant, &f, ca, (uint16_t *)wb);
    else
#endif
    got = w == 2 ? find_changes(oldp, newp, n, 2, &f)
        : w == 4 ? find_changes(oldp, newp, n, 4, &f)
        : find_changes(oldp, newp, n, 1, &f);
    if (got < 0) { if (ca) undo_wb(wb, &f); free(ca_mem); found_free(&f); return E_NOMEM; }
    const int64_t k = got;
    const int64_t *cidx = f.idx;
    uint64_t *rank = (uint64_t *)malloc((size_t)(k ? k : 1) * 8);
    uint8_t *ex = (uint8_t *)malloc((size_t)(k ? k : 1));  /* each change's exponent */
    if (!rank || !ex) { free(rank); free(ex); if (ca) undo_wb(wb, &f); free(ca_mem); found_free(&f); return E_NOMEM; }
    /* the class range: exponents with fewer than max(4, k/256) changes at either end are merged
     * into the nearest one with more (fewer classes to count, almost no bytes lost) */
    int lo = 0, hi = 0;
    {
        int64_t ke[256]; memset(ke, 0, sizeof ke);
        for (int64_t j = 0; j < k; j++) ke[ex[j] = (uint8_t)((load_u(f.ov, j, w) & absmask) >> mant)]++;
        int64_t t = k >> 8 > 4 ? k >> 8 : 4;
        int first = -1, last = -1, sfirst = -1, slast = -1;
        for (int c = 0; c < nc; c++) {
            if (ke[c]) { if (first < 0) first = c; last = c; }
            if (ke[c] >= t) { if (sfirst < 0) sfirst = c; slast = c; }
        }
        lo = sfirst >= 0 ? sfirst : (first >= 0 ? first : 0);
        hi = sfirst >= 0 ? slast : (last >= 0 ? last : 0);
    }
    for (int64_t j = 0; j < k; j++) ex[j] = (uint8_t)(ex[j] < lo ? lo : (ex[j] > hi ? hi : ex[j]));  /* -> class */
    /* pass B: ranks within the classes */
    int rb = -2;
#ifdef DCR_X86
    if (simd == 2) rb = rank_avx512((const uint16_t *)oldp, ca, n, mant, lo, hi, cidx, ex, k, rank,
                                    (uint16_t *)wb, (const uint16_t *)f.nv);
    else if (simd == 1) rb = rank_avx2((const uint16_t *)oldp, ca, n, mant, lo, hi, cidx, ex, k, rank,
                                       (uint16_t *)wb, (const uint16_t *)f.nv);
#endif
    if (rb == -2) {  /* (the vector passes refuse before they read or write anything) */
        if (ca) undo_wb(wb, &f);  /* the scalar pass reads the base's old bits: pass A's writes undone */
        if (w == 2) rank_scalar(oldp, n, 2, mant, lo, hi, cidx, k, rank, wb, f.nv);
        else if (w == 4) rank_scalar(oldp, n, 4, mant, lo, hi, cidx, k, rank, wb, f.nv);
        else rank_scalar(oldp, n, 1, mant, lo, hi, cidx, k, rank, wb, f.nv);
    }
    free(ca_mem);
    int e = encode_placed(k, nc, w, ex, rank, f.ov, f.nv, table, ntab, pos_out, plen, val_out, vlen);
    free(rank); free(ex);
    if (e < 0) {
        undo_wb(wb, &f);
        found_free(&f);
        return e;
    }
    *idx_out = f.idx; *old_out = f.ov; *new_out = f.nv;
    return k;
}

/* ------------------------------------------------------------------ decode */
/* old: the base chunk (n elements). Writes the k changed positions (increasing) to idx_out,
 * their new bits to new_out and, when old_out is not NULL, their base bits to old_out (what the
 * receiver's pre-image check hashes: the scan reads them anyway). Returns 0 or a negative error. */
/* The two streams of a classes chunk of n elements decoded, without the base: each change's rank
 * among the chunk's elements of its class (rk) and its difference key(new) - key(old) mod 2^(8w)
 * (dv), both in class order (the table's rows in turn, each class's changes by rank); start[c]:
 * where class c's changes begin (-1 for a class without). Everything but "is each rank below
 * its class's member count" (that needs the base) is checked. rk and dv: k entries each. */
static int decode_streams(int64_t n, int w, int mant, const int64_t *table, int64_t ntab,
                          const uint8_t *pos, int64_t plen, const uint8_t *val, int64_t vlen, int64_t k,
                          int64_t *start, uint64_t *rk, uint64_t *dv) {
    if (!(w == 1 || w == 2 || w == 4) || mant < 0 || mant >= 8 * w - 1 || n < 0 || n >= (1LL << 32) || k < 0 || k > n) return E_ARGS;
    int ebits = 8 * w - 1 - mant; if (ebits > 8) return E_ARGS;
    const int nc = 1 << ebits;
    const uint64_t mask = (w == 4) ? 0xFFFFFFFFULL : ((1ULL << (8 * w)) - 1), sign = 1ULL << (8 * w - 1);
    int64_t total = 0; int prev = -1;
    for (int c = 0; c <= nc; c++) start[c] = -1;
    for (int64_t r = 0; r < ntab; r++) {
        const int64_t *row = table + TAB * r;
        if (row[0] <= prev || row[0] >= nc || row[1] < 1 || row[1] > k - total || row[2] < 0 || row[2] > 31
            || row[3] < 0 || row[3] > row[1] || row[4] < 0 || row[4] > 31 || row[5] < 0 || row[5] > 31) return E_TABLE;
        prev = (int)row[0]; start[prev] = total; total += row[1];
    }
    if (total != k) return E_TABLE;
    uint64_t *mg = dv;                                              /* |difference|, then the difference */
    uint8_t *ng = (uint8_t *)malloc((size_t)(k ? k : 1));          /* difference < 0 */
    if (!ng) return E_NOMEM;
    reader pr, vr; r_init(&pr, pos, plen); r_init(&vr, val, vlen);
    if (k <= 8 * vlen) {  /* the k sign bits open the (byte-aligned) stream: read them in place */
        /* eight a byte: the byte in each of eight lanes, each lane's own bit kept, made 0 or 1 */
        for (int64_t b = 0; R_LOADS && b < k >> 3; b++) {  /* (lanes in memory order: little-endian) */
            uint64_t x = ((uint64_t)val[b] * 0x0101010101010101ULL) & 0x8040201008040201ULL;
            x = ((x + 0x7F7F7F7F7F7F7F7FULL) >> 7) & 0x0101010101010101ULL;
            memcpy(ng + 8 * b, &x, 8);
        }
        for (int64_t j = R_LOADS ? k & ~(int64_t)7 : 0; j < k; j++) ng[j] = (uint8_t)((val[j >> 3] >> (j & 7)) & 1);
        vr.end = k;  /* the window empty at bit k: the value codes follow the signs */
    } else {
        for (int64_t j = 0; j < k; j++) ng[j] = (uint8_t)r_get(&vr, 1);
    }
    /* Per class, its ranks (pos stream) and its value codes (val stream: the gaps between its
     * "big" changes, those of |difference| >= 2, then each big's excess) are decoded in one loop:
     * the two streams' readers are two dependency chains the core runs side by side, and the
     * excesses go to the bigs by their recorded indices, without a branch per change on whether
     * it is big (as random as the values). Errors keep their order: within a class a rank past
     * the chunk is reported before a bad value code, and a class's errors before the next's. */
    uint32_t *bi = (uint32_t *)malloc((size_t)(k ? k : 1) * 4);  /* a class's bigs, by index */
    if (!bi) { free(ng); return E_NOMEM; }
    int rc = 0;
    for (int64_t r = 0; r < ntab && !rc; r++) {
        const int64_t *row = table + TAB * r;
        const int64_t a = start[row[0]], kc = row[1], bc = row[3];
        const int kp = (int)row[2], kb = (int)row[4], ke = (int)row[5];
        for (int64_t j = 0; j < kc; j++) mg[a + j] = 1;
        uint64_t acc = (uint64_t)-1;  /* rank = previous rank + 1 + gap; a gap is < 2^48: no overflow */
        int64_t at = -1, vsteps = 2 * bc;  /* value codes still to read (0 after a bad one) */
        const int64_t steps = kc > vsteps ? kc : vsteps;
        int bad_v = 0;
        for (int64_t s = 0; s < steps; s++) {
            if (s < kc) {
                acc += 1 + r_rice(&pr, kp);
                if (acc >= (uint64_t)n) { rc = E_RANK; break; }
                rk[a + s] = acc;
            }
            if (s < bc && s < vsteps) {
                uint64_t g = r_rice(&vr, kb);
                if (g >= (uint64_t)(kc - at - 1)) { bad_v = 1; vsteps = 0; continue; }
                at += 1 + (int64_t)g;
                bi[s] = (uint32_t)at;
                mg[a + at] = 0;  /* big: its excess follows */
            } else if (s < vsteps) {
                const int64_t j = bi[s - bc];
                uint64_t m = r_rice(&vr, ke) + 2;
                /* (bitwise, not || and &&: the compiler branched on the sign, as random as the values) */
                if (__builtin_expect((m > sign) | ((ng[a + j] == 0) & (m == sign)), 0)) { bad_v = 1; vsteps = 0; continue; }
                mg[a + j] = m;
            }
        }
        if (!rc && bad_v) rc = E_VALUE;
    }
    free(bi);
    if (!rc) rc = pr.err || vr.err ? E_STREAM : 0;
    if (!rc) rc = r_done(&pr, plen);
    if (!rc) rc = r_done(&vr, vlen);
    if (!rc)
        for (int64_t j = 0; j < k; j++) {  /* the signed difference, mod 2^(8w); no branch: signs are random */
            uint64_t sg = -(uint64_t)ng[j];
            mg[j] = ((mg[j] ^ sg) - sg) & mask;
        }
    free(ng);
    return rc;
}

/* decode_streams for a caller that places the changes itself (the device receiver): cls_out,
 * rank_out, d_out get each change's class, rank within the class and difference, class order. */
int dcr_cls_decode_streams(int64_t n, int w, int mant, const int64_t *table, int64_t ntab,
                           const uint8_t *pos, int64_t plen, const uint8_t *val, int64_t vlen, int64_t k,
                           int64_t *cls_out, int64_t *rank_out, int64_t *d_out) {
    int64_t start[257];
    int rc = decode_streams(n, w, mant, table, ntab, pos, plen, val, vlen, k, start,
                            (uint64_t *)rank_out, (uint64_t *)d_out);
    if (rc) return rc;
    for (int64_t r = 0; r < ntab; r++) {
        const int64_t *row = table + TAB * r;
        for (int64_t j = start[row[0]]; j < start[row[0]] + row[1]; j++) cls_out[j] = row[0];
    }
    return 0;
}

static int decode_placed(const void *oldp, void *wb, int64_t n, int w, int mant, const int64_t *table, int64_t ntab,
                         const uint8_t *pos, int64_t plen, const uint8_t *val, int64_t vlen, int64_t k,
                         int64_t *idx_out, void *new_out, void *old_out, int64_t off) {
    if (!(w == 1 || w == 2 || w == 4) || mant < 0 || mant >= 8 * w - 1 || k < 0) return E_ARGS;
    if (8 * w - 1 - mant > 8) return E_ARGS;
    if (wb && !old_out) return E_ARGS;  /* (what undoes the writes of a chunk that does not decode) */
    const int nc = 1 << (8 * w - 1 - mant);
    int64_t start[257];
    uint64_t *rk = (uint64_t *)malloc((size_t)(k ? k : 1) * 8);   /* ranks, class order */
    uint64_t *dv = (uint64_t *)malloc((size_t)(k ? k : 1) * 8);   /* differences, class order */
    if (!rk || !dv) { free(rk); free(dv); return E_NOMEM; }
    int rc = decode_streams(n, w, mant, table, ntab, pos, plen, val, vlen, k, start, rk, dv);
    if (rc) { free(rk); free(dv); return rc; }
    int64_t next[256], endc[256]; uint32_t want[256], cnt[256];
    for (int c = 0; c < nc; c++) { cnt[c] = 0; next[c] = endc[c] = 0; want[c] = UINT32_MAX; }
    for (int64_t r = 0; r < ntab; r++) {
        const int64_t *row = table + TAB * r; int c = (int)row[0];
        next[c] = start[c]; endc[c] = start[c] + row[1]; want[c] = (uint32_t)rk[next[c]];
    }
    /* the class range is the table's first and last class */
    int lo = ntab ? (int)table[0] : 0, hi = ntab ? (int)table[TAB * (ntab - 1)] : 0;
    int64_t out = -2, scalar = 1;
#ifdef DCR_X86
    int isa = w == 2 ? simd_isa() : 0;
    if (isa == 2)
        out = scan_decode_avx512((const uint16_t *)oldp, n, mant, lo, hi, table, ntab, start, rk, dv, idx_out,
                                 (uint16_t *)new_out, (uint16_t *)old_out, (uint16_t *)wb);
    else if (isa == 1)
        out = (avx2_pdep() ? scan_decode_avx2p : scan_decode_avx2)(
            (const uint16_t *)oldp, n, mant, lo, hi, table, ntab, start, rk, dv, idx_out, (uint16_t *)new_out,
            (uint16_t *)old_out, (uint16_t *)wb);
#endif
    if (out != -2) scalar = 0;
    else out = w == 2 ? scan_decode(oldp, n, 2, mant, lo, hi, cnt, want, next, endc, rk, dv, idx_out, new_out, old_out, wb)
            : w == 4 ? scan_decode(oldp, n, 4, mant, lo, hi, cnt, want, next, endc, rk, dv, idx_out, new_out, old_out, wb)
            : scan_decode(oldp, n, 1, mant, lo, hi, cnt, want, next, endc, rk, dv, idx_out, new_out, old_out, wb);
    free(rk); free(dv);
    if (out == -3) return E_RANK;  /* (the vector scans undid their writes) */
    rc = out == k ? 0 : E_RANK;
    if (scalar) for (int c = 0; c < nc && !rc; c++) if (next[c] != endc[c]) rc = E_RANK;
    if (rc && wb)  /* the base as it was: each change written holds its old bits again */
        for (int64_t q = 0; q < out; q++) store_u(wb, idx_out[q], w, load_u(old_out, q, w));
    if (!rc && off)  /* positions in the caller's frame (the chunk's start in its tensor added) */
        for (int64_t q = 0; q < out; q++) idx_out[q] += off;
    return rc;
}

/* off: added to every position written to idx_out (a caller's chunk start: its positions in
 * the tensor, without a pass of its own over them afterwards) */
int dcr_cls_decode_old(const void *oldp, int64_t n, int w, int mant, const int64_t *table, int64_t ntab,
                       const uint8_t *pos, int64_t plen, const uint8_t *val, int64_t vlen, int64_t k,
                       int64_t *idx_out, void *new_out, void *old_out, int64_t off) {
    return decode_placed(oldp, NULL, n, w, mant, table, ntab, pos, plen, val, vlen, k, idx_out, new_out, old_out, off);
}

/* dcr_cls_decode_old that also writes each change's new bits into the base (basep, n elements)
 * as the scan places it, while the bits around it are in L1. old_out is required: a chunk that
 * turns out not to decode gets its old bits back, so an error leaves the base as it was. The
 * caller's checks of the old bits come after (it undoes the writes itself when they fail). */
int dcr_cls_decode_into(void *basep, int64_t n, int w, int mant, const int64_t *table, int64_t ntab,
                        const uint8_t *pos, int64_t plen, const uint8_t *val, int64_t vlen, int64_t k,
                        int64_t *idx_out, void *new_out, void *old_out, int64_t off) {
    return decode_placed(basep, basep, n, w, mant, table, ntab, pos, plen, val, vlen, k, idx_out, new_out, old_out, off);
}

/* dcr_cls_decode_old without the base bits */
int dcr_cls_decode(const void *oldp, int64_t n, int w, int mant, const int64_t *table, int64_t ntab,
                   const uint8_t *pos, int64_t plen, const uint8_t *val, int64_t vlen, int64_t k,
                   int64_t *idx_out, void *new_out) {
    return dcr_cls_decode_old(oldp, n, w, mant, table, ntab, pos, plen, val, vlen, k, idx_out, new_out, NULL, 0);
}

uint32_t dcr_crc32_any(const void *p, int64_t len, uint32_t value);  /* dcr_crc32.c */

/* dcr_cls_decode_streams of many chunks in one call (a receiver group's chunks of a version,
 * sync/chunk_gather.py: thousands from an FSDP trainer's shards, where each call's arguments cost
 * more than its decode). Chunk i: n[i] elements of w[i] bytes, mant[i]; its table rows tab_off[i]
 * .. tab_off[i + 1] - 1 of table; its payload at the address payload[i], the position stream's
 * plen[i] bytes then the value stream's vlen[i], checked first against its CRC-32 crc[i]; its
 * changes k_off[i] .. k_off[i + 1] - 1 of the outputs. Returns 0, or the first failing chunk's
 * code with *failed its index (E_CRC: the checksum). */
int dcr_cls_decode_streams_many(int64_t calls, const int64_t *n, const int32_t *w, const int32_t *mant,
                                const int64_t *tab_off, const int64_t *table, const int64_t *payload,
                                const int64_t *plen, const int64_t *vlen, const uint32_t *crc,
                                const int64_t *k_off, int64_t *cls_out, int64_t *rank_out, int64_t *d_out,
                                int64_t *failed) {
    for (int64_t i = 0; i < calls; i++) {
        *failed = i;
        if (tab_off[i] < 0 || tab_off[i + 1] < tab_off[i] || k_off[i] < 0 || k_off[i + 1] < k_off[i]
            || plen[i] < 0 || vlen[i] < 0)
            return E_ARGS;
        const uint8_t *p = (const uint8_t *)(intptr_t)payload[i];
        if (dcr_crc32_any(p, plen[i] + vlen[i], 0) != crc[i]) return E_CRC;
        const int64_t j = k_off[i];
        int rc = dcr_cls_decode_streams(n[i], w[i], mant[i], table + TAB * tab_off[i], tab_off[i + 1] - tab_off[i], p,
                                        plen[i], p + plen[i], vlen[i], k_off[i + 1] - j, cls_out + j, rank_out + j,
                                        d_out + j);
        if (rc) return rc;
    }
    *failed = -1;
    return 0;
}

/* ------------------------------------------------------------------ a receiver's runs of a chunk
 * A receiver rank that holds only part of a classes chunk (sync/chunk_gather.py) holds it as runs:
 * run r is n[r] consecutive elements of the chunk at base + start[r] (elements of width w). The
 * group places the chunk's changes from every rank's class counts per run (dcr_cls_run_counts);
 * each rank then finds the elements it was asked for: the within-th element of a class in a run
 * (dcr_cls_run_select). Each is one pass over the runs' elements where they are, with no index
 * array or sort (torch's took ~10 us per element held; docs/results.md, twenty-fifth turn). */

/* which of the vector loops (dcr_simd_scans.h) a receiver's runs take: 2 AVX-512BW, 1 AVX2, 0 the
 * scalar ones below (other widths, more than MAXA classes, dcr_set_simd(0)); runs shorter than
 * a block take the scalar ones in any case */
static int run_isa(int w, int nc) {
#ifdef DCR_X86
    return w == 2 && nc <= MAXA ? simd_isa() : 0;
#else
    (void)w; (void)nc;
    return 0;
#endif
}

static inline __attribute__((always_inline)) void run_count(const uint8_t *p, int64_t n, const int w, int mant,
                                                            int lo, int hi, uint32_t (*cnt)[256]) {
    const uint64_t absmask = (1ULL << (8 * w - 1)) - 1;
    for (int64_t i = 0; i < n; i++) cnt[i & 3][class_of(load_u(p, i, w), absmask, mant, lo, hi) - lo]++;
}

/* counts[r * (hi - lo + 1) + c - lo]: run r's elements of class c (clamped to [lo, hi]); the runs
 * lie in base's nbase elements (-7 otherwise) */
int dcr_cls_run_counts(const void *base, int64_t nbase, int w, int mant, int lo, int hi, const int64_t *start,
                       const int64_t *n, int64_t nruns, uint32_t *counts) {
    if ((w != 1 && w != 2 && w != 4) || mant < 0 || mant >= 8 * w - 1 || lo < 0 || hi < lo || hi > 255 || nruns < 0)
        return -7;
    const int nc = hi - lo + 1;
    uint32_t cnt[4][256];  /* four interleaved tables, as rank_scalar: no stall between neighbours of a class */
    const int isa = run_isa(w, nc);
    for (int64_t r = 0; r < nruns; r++) {
        if (start[r] < 0 || n[r] < 0 || n[r] > UINT32_MAX || start[r] > nbase - n[r]) return -7;
        const uint8_t *p = (const uint8_t *)base + start[r] * w;
#ifdef DCR_X86
        if (isa && n[r] >= 64) {
            uint32_t *row = counts + r * nc;
            memset(row, 0, (size_t)nc * sizeof(uint32_t));
            if (isa == 2) run_count_avx512((const uint16_t *)p, n[r], mant, lo, hi, row);
            else run_count_avx2((const uint16_t *)p, n[r], mant, lo, hi, row);
            continue;
        }
#endif
        for (int t = 0; t < 4; t++) memset(cnt[t], 0, (size_t)nc * sizeof(uint32_t));
        if (w == 2) run_count(p, n[r], 2, mant, lo, hi, cnt);
        else if (w == 4) run_count(p, n[r], 4, mant, lo, hi, cnt);
        else run_count(p, n[r], 1, mant, lo, hi, cnt);
        for (int c = 0; c < nc; c++) counts[r * nc + c] = cnt[0][c] + cnt[1][c] + cnt[2][c] + cnt[3][c];
    }
    return 0;
}

static inline __attribute__((always_inline)) int64_t run_select(
        const uint8_t *p, int64_t n, const int w, int mant, int lo, int hi, uint32_t *cnt, uint32_t *want,
        int64_t *next, const int64_t *endc, const int64_t *within, int64_t left, int64_t *out) {
    const uint64_t absmask = (1ULL << (8 * w - 1)) - 1;
    for (int64_t i = 0; i < n && left; i++) {
        int c = class_of(load_u(p, i, w), absmask, mant, lo, hi) - lo;
        if (__builtin_expect(cnt[c]++ == want[c], 0)) {
            int64_t q = next[c]++;
            out[q] = i;
            want[c] = next[c] < endc[c] ? (uint32_t)within[next[c]] : UINT32_MAX;
            left--;
        }
    }
    return left;
}

/* Requests j = 0..k-1, sorted by (run, cls, within), cls counted from lo: out[j] = the offset in
 * run[j] of its within[j]-th element (from 0) of class lo + cls[j]. -4: a run holds fewer
 * elements of a class than asked for (the counts the requests came from were not these bits);
 * -7: requests out of range or order, or a run outside base's nbase elements. */
int dcr_cls_run_select(const void *base, int64_t nbase, int w, int mant, int lo, int hi, const int64_t *start,
                       const int64_t *n, int64_t nruns, const int64_t *run, const int64_t *cls, const int64_t *within,
                       int64_t k, int64_t *out) {
    if ((w != 1 && w != 2 && w != 4) || mant < 0 || mant >= 8 * w - 1 || lo < 0 || hi < lo || hi > 255 || nruns < 0
        || k < 0)
        return -7;
    const int nc = hi - lo + 1;
    uint32_t cnt[256], want[256];
    int64_t next[256], endc[256];
    const int isa = run_isa(w, nc);
    for (int64_t j = 0; j < k;) {
        const int64_t r = run[j];
        if (r < 0 || r >= nruns || start[r] < 0 || n[r] < 0 || n[r] > UINT32_MAX || start[r] > nbase - n[r]) return -7;
        for (int c = 0; c < nc; c++) { cnt[c] = 0; want[c] = UINT32_MAX; next[c] = endc[c] = 0; }
        int64_t e = j;
        for (; e < k && run[e] == r; e++) {
            const int64_t c = cls[e], v = within[e];
            if (c < 0 || c >= nc || v < 0) return -7;
            if (e > j && (c < cls[e - 1] || (c == cls[e - 1] && v <= within[e - 1]))) return -7;
            if (v >= n[r]) return -4;
            if (e == j || c != cls[e - 1]) { next[c] = e; want[c] = (uint32_t)v; }
            endc[c] = e + 1;
        }
        if (e < k && run[e] < r) return -7;
        const uint8_t *p = (const uint8_t *)base + start[r] * w;
        int64_t left;
#ifdef DCR_X86
        if (isa == 2 && n[r] >= 64)
            left = run_select_avx512((const uint16_t *)p, n[r], mant, lo, hi, cnt, want, next, endc, within, e - j, out);
        else if (isa == 1 && n[r] >= 64)
            left = (avx2_pdep() ? run_select_avx2p : run_select_avx2)(
                (const uint16_t *)p, n[r], mant, lo, hi, cnt, want, next, endc, within, e - j, out);
        else
#endif
        if (w == 2) left = run_select(p, n[r], 2, mant, lo, hi, cnt, want, next, endc, within, e - j, out);
        else if (w == 4) left = run_select(p, n[r], 4, mant, lo, hi, cnt, want, next, endc, within, e - j, out);
        else left = run_select(p, n[r], 1, mant, lo, hi, cnt, want, next, endc, within, e - j, out);
        if (left) return -4;
        j = e;
    }
    return 0;
}

/* A receiver group's chunks of one version at once: call i of dcr_cls_run_counts (or _select)
 * on base[i] (an address: a rank's bits of chunk i's tensor), its runs run_off[i] ..
 * run_off[i + 1] - 1 of start / n, its counts from counts + cnt_off[i] (and its requests
 * req_off[i] .. req_off[i + 1] - 1, numbered in its own runs), with its own width, mantissa and
 * class range. One call from Python for a version's thousands of small chunks, where one each
 * cost ~40 us of argument handling around a few us of counting (docs/results.md, twenty-sixth
 * turn). Returns 0, or the first failing call's code with *failed its index. */
int dcr_cls_run_counts_many(int64_t calls, const int64_t *base, const int64_t *nbase, const int32_t *w,
                            const int32_t *mant, const int32_t *lo, const int32_t *hi, const int64_t *run_off,
                            const int64_t *start, const int64_t *n, const int64_t *cnt_off, uint32_t *counts,
                            int64_t *failed) {
    for (int64_t i = 0; i < calls; i++) {
        int rc = run_off[i] < 0 || run_off[i + 1] < run_off[i] || cnt_off[i] < 0 ? -7
                 : dcr_cls_run_counts((const void *)(intptr_t)base[i], nbase[i], w[i], mant[i], lo[i], hi[i],
                                      start + run_off[i], n + run_off[i], run_off[i + 1] - run_off[i],
                                      counts + cnt_off[i]);
        if (rc) { *failed = i; return rc; }
    }
    return 0;
}

/* A receiver group's chunks' changes placed from the runs' class counts (sync/chunk_gather.py), every
 * chunk of a version in one call. Call i: runs run_off[i] .. run_off[i + 1] - 1, whose counts are
 * rows of ncls[i] at counts + cnt_off[i] (ncounts in all), order[run_off[i] + r] the row of its
 * r-th run in chunk order; its changes chg_off[i] .. chg_off[i + 1] - 1, each a class cls[j] (from
 * the chunk's lo) and a rank[j] among the chunk's elements of that class, in chunk order. Out:
 * run_out[j], the run (chunk order) holding change j, and within_out[j], its place among that
 * run's elements of its class. A class's changes come in rank order (the stream's): one walk over
 * its runs serves them all (a change out of that order walks again from the first run), where
 * numpy's cumulative sum and search went over every class count of every chunk. -4 (*failed:
 * the call): a class out of range or a rank past its class's members (the counts are not of the
 * base the chunk was coded against); -7: arguments out of range. */
int dcr_cls_place_many(int64_t calls, const int64_t *run_off, const int64_t *ncls, const int64_t *cnt_off,
                       const uint32_t *counts, int64_t ncounts, const int64_t *order, const int64_t *chg_off,
                       const int64_t *cls, const int64_t *rank, int64_t *run_out, int64_t *within_out,
                       int64_t *failed) {
    for (int64_t i = 0; i < calls; i++) {
        const int64_t R = run_off[i + 1] - run_off[i], C = ncls[i];
        *failed = i;
        if (run_off[i] < 0 || R < 0 || C < 0 || cnt_off[i] < 0 || (C && R > (ncounts - cnt_off[i]) / C)
            || chg_off[i] < 0 || chg_off[i + 1] < chg_off[i])
            return -7;
        const int64_t *ord = order + run_off[i];
        for (int64_t r = 0; r < R; r++) if (ord[r] < 0 || ord[r] >= R) return -7;
        const uint32_t *cnt = counts + cnt_off[i];
        int64_t cur = -1, prev = -1, r = 0, acc = 0;
        for (int64_t j = chg_off[i]; j < chg_off[i + 1]; j++) {
            const int64_t c = cls[j], q = rank[j];
            if (c < 0 || c >= C || q < 0) return -4;
            if (c != cur || q < prev) { cur = c; r = 0; acc = 0; }
            for (; r < R; r++) {
                const int64_t v = cnt[ord[r] * C + c];
                if (acc + v > q) break;
                acc += v;
            }
            if (r == R) return -4;
            run_out[j] = r;
            within_out[j] = q - acc;
            prev = q;
        }
    }
    *failed = -1;
    return 0;
}

/* ... and the bits there: bits[j] = the base element request j found (zero-extended) */
int dcr_cls_run_select_many(int64_t calls, const int64_t *base, const int64_t *nbase, const int32_t *w,
                            const int32_t *mant, const int32_t *lo, const int32_t *hi, const int64_t *run_off,
                            const int64_t *start, const int64_t *n, const int64_t *req_off, const int64_t *run,
                            const int64_t *cls, const int64_t *within, int64_t *out, uint32_t *bits,
                            int64_t *failed) {
    for (int64_t i = 0; i < calls; i++) {
        const int64_t r0 = run_off[i], q0 = req_off[i], k = req_off[i + 1] - q0;
        int rc = r0 < 0 || run_off[i + 1] < r0 || q0 < 0 || k < 0 ? -7
                 : dcr_cls_run_select((const void *)(intptr_t)base[i], nbase[i], w[i], mant[i], lo[i], hi[i],
                                      start + r0, n + r0, run_off[i + 1] - r0, run + q0, cls + q0, within + q0, k,
                                      out + q0);
        if (rc) { *failed = i; return rc; }
        const uint8_t *b = (const uint8_t *)(intptr_t)base[i];
        for (int64_t j = q0; j < q0 + k; j++) {
            const int64_t at = start[r0 + run[j]] + out[j];  /* within the base: the select checked the run */
            bits[j] = (uint32_t)load_u(b, at, w[i]);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ state digest
 * The per-element arithmetic of the sharding-independent state digest; its definition, and the
 * PyTorch reference this must equal bit for bit, are in nemo_dcr/state/statedigest.py (spec:
 * docs/format.md, "State digest"). Per lane l:
 *   u = mix(mix(lo32(i) ^ s1) ^ s2 ^ hi32(i)),  r_l = clamp(mix(u ^ t_l) >> 1, 1, P - 1),
 *   contrib_l = r_l * (C_l + sum_j x_j K_l^j)  (mod P),
 * summed over elements. Everything is exact unsigned arithmetic: mix is mod 2^32 (what the
 * reference's "multiply then mask" computes), and sums of r * limb (< 2^47) are reduced mod P
 * every SD_BLOCK terms (< 2^60). hi32(i) is xored always: it is 0 whenever the reference omits it. */
#define SD_P 2147483647ULL
#define SD_BLOCK 4096

static inline uint32_t sd_mix(uint32_t h) {
    h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x31848BABu; h ^= h >> 16; return h;
}
/* mix >> 1 is at most P: clamping it to [1, P - 1] moves 0 to 1 and P to P - 1 and nothing
 * else, as min/max (one vector instruction each) */
static inline uint32_t sd_weight(uint32_t u, uint32_t t) {
    uint32_t r = sd_mix(u ^ t) >> 1;
    r = r < 1u ? 1u : r;
    return r > (uint32_t)SD_P - 1 ? (uint32_t)SD_P - 1 : r;
}
static inline uint64_t sd_mod(uint64_t x) { return x % SD_P; }

/* The element loop, written so that compilers vectorise it: 32-bit index mixing, 32x32->64-bit
 * products, one accumulator per lane and limb. IDX is the canonical index of element i. With
 * OLD (the change variant), a second array y of old bits is summed beside x against the same
 * weights (s: new limbs, d: old limbs): the index mixing, most of the work, is done once for
 * both sides of a change. */
#define SD_LIMB(l, j, NLIMB, LIMB, OLD)                                                       \
    if (NLIMB > j) { s##l##j##_ += (uint64_t)r * (uint32_t)(LIMB(x, j));                      \
                     if (OLD) d##l##j##_ += (uint64_t)r * (uint32_t)(LIMB(y, j)); }
#define SD_LANE(l, NLIMB, LIMB, OLD)                                                          \
    { uint32_t r = sd_weight(u, t##l); s##l##r_ += r;                                         \
      SD_LIMB(l, 0, NLIMB, LIMB, OLD) SD_LIMB(l, 1, NLIMB, LIMB, OLD)                         \
      SD_LIMB(l, 2, NLIMB, LIMB, OLD) SD_LIMB(l, 3, NLIMB, LIMB, OLD) }
#define SD_ACC(l)                                                                             \
    uint64_t s##l##r_ = 0, s##l##0_ = 0, s##l##1_ = 0, s##l##2_ = 0, s##l##3_ = 0;            \
    uint64_t d##l##0_ = 0, d##l##1_ = 0, d##l##2_ = 0, d##l##3_ = 0;
#define SD_FOLD(l, OLD)                                                                       \
    { uint64_t sv[5] = {s##l##r_, s##l##0_, s##l##1_, s##l##2_, s##l##3_};                    \
      uint64_t dv[5] = {0, d##l##0_, d##l##1_, d##l##2_, d##l##3_};                           \
      for (int j = 0; j < 5; j++) {                                                           \
          acc[l][j] = sd_mod(acc[l][j] + sd_mod(sv[j]));                                      \
          if (OLD) old[l][j] = sd_mod(old[l][j] + sd_mod(dv[j]));                             \
      } }
#define SD_LOOP(NLIMB, LIMB, IDX, OLD)                                                        \
    for (int64_t b0 = 0; b0 < n; b0 += SD_BLOCK) {                                            \
        int64_t b1 = b0 + SD_BLOCK < n ? b0 + SD_BLOCK : n;                                   \
        SD_ACC(0) SD_ACC(1) SD_ACC(2) SD_ACC(3)                                               \
        for (int64_t i = b0; i < b1; i++) {                                                   \
            uint64_t g = (IDX);                                                               \
            uint32_t u = sd_mix(sd_mix((uint32_t)g ^ s1) ^ s2 ^ (uint32_t)(g >> 32));         \
            SD_LANE(0, NLIMB, LIMB, OLD) SD_LANE(1, NLIMB, LIMB, OLD)                         \
            SD_LANE(2, NLIMB, LIMB, OLD) SD_LANE(3, NLIMB, LIMB, OLD)                         \
        }                                                                                     \
        SD_FOLD(0, OLD) SD_FOLD(1, OLD) SD_FOLD(2, OLD) SD_FOLD(3, OLD)                       \
    }
#define SD_FN(NAME, ATTR, T, NLIMB, LIMB, OLD)                                                \
    ATTR static void NAME(const T *x, const T *y, const int64_t *gidx, int64_t start, int64_t n, uint32_t s1, \
                          uint32_t s2, const uint32_t *t, uint64_t acc[4][5], uint64_t old[4][5]) { \
        uint32_t t0 = t[0], t1 = t[1], t2 = t[2], t3 = t[3];                                  \
        (void)y; (void)old;                                                                   \
        if (gidx) { SD_LOOP(NLIMB, LIMB, (uint64_t)gidx[i], OLD) }                            \
        else { SD_LOOP(NLIMB, LIMB, (uint64_t)(start + i), OLD) }                             \
    }
/* limb j (from 0) of element i of the array a */
#define L_W1(a, j) a[i]
#define L_W2(a, j) a[i]
#define L_W4(a, j) (((uint64_t)a[i] >> (16 * (j))) & 0xFFFFu)
#define L_W8(a, j) ((a[i] >> (16 * (j))) & 0xFFFFu)
typedef void (*sd_fn)(const void *, const void *, const int64_t *, int64_t, int64_t, uint32_t, uint32_t,
                      const uint32_t *, uint64_t acc[4][5], uint64_t old[4][5]);
/* one plain build per width, and on x86-64 an AVX2 and an AVX-512 one (512-bit vectors: the
 * compiler's default for AVX-512 code is 256), chosen at run time like the classes scans; each
 * width in the one-side variant (sd_) and the change variant (sdc_: new and old bits) */
#define SD_ALL1(V, SUFFIX, ATTR, OLD)                                                         \
    SD_FN(V##_w1##SUFFIX, ATTR, uint8_t, 1, L_W1, OLD)                                        \
    SD_FN(V##_w2##SUFFIX, ATTR, uint16_t, 1, L_W2, OLD)                                       \
    SD_FN(V##_w4##SUFFIX, ATTR, uint32_t, 2, L_W4, OLD)                                       \
    SD_FN(V##_w8##SUFFIX, ATTR, uint64_t, 4, L_W8, OLD)                                       \
    __attribute__((unused)) static const sd_fn V##_table##SUFFIX[4] = {(sd_fn)V##_w1##SUFFIX, (sd_fn)V##_w2##SUFFIX, \
                                               (sd_fn)V##_w4##SUFFIX, (sd_fn)V##_w8##SUFFIX};
#define SD_ALL(SUFFIX, ATTR) SD_ALL1(sd, SUFFIX, ATTR, 0) SD_ALL1(sdc, SUFFIX, ATTR, 1)
SD_ALL(_plain, )
#ifdef DCR_X86
SD_ALL(_avx2, __attribute__((target("avx2"))))
SD_ALL(_avx512, __attribute__((target("avx512f,avx512bw,prefer-vector-width=512"))))
/* 1-, 2- and 4-byte elements, written out (dcr_sd_vec.h says how), for AVX-512 and for AVX2 */
__attribute__((target("avx512f,avx512bw"))) static inline __attribute__((always_inline)) __m512i sdv_limb_avx512(
        const int W, const void *p, int j, __m512i m16) {
    if (W == 1) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (W == 2) return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    const __m512i v = _mm512_loadu_si512(p);
    return j ? _mm512_srli_epi32(v, 16) : _mm512_and_si512(v, m16);
}
#define SFX _avx512
#define TGT __attribute__((target("avx512f,avx512bw")))
#define VEC __m512i
#define NV 16
#define SET1(x) _mm512_set1_epi32((int)(uint32_t)(x))
#define ZERO _mm512_setzero_si512()
#define IOTA _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define XOR _mm512_xor_si512
#define ADD64 _mm512_add_epi64
#define SRL32 _mm512_srli_epi32
#define SRL64 _mm512_srli_epi64
#define MULLO _mm512_mullo_epi32
#define MULU _mm512_mul_epu32
#define MINU _mm512_min_epu32
#define MAXU _mm512_max_epu32
#define COUNT(g, k, lo, hi)                                                                            \
    do {                                                                                               \
        const __m512i base_ = SET1(g);                                                                 \
        lo = _mm512_add_epi32(base_, (k)->iota);                                                       \
        hi = _mm512_mask_add_epi32(SET1((g) >> 32), _mm512_cmplt_epu32_mask(lo, base_), SET1((g) >> 32), \
                                   (k)->one);                                                          \
    } while (0)
#define GIDX(p, lo, hi)                                                                                \
    do {                                                                                               \
        const __m512i g0_ = _mm512_loadu_si512((const void *)(p));                                     \
        const __m512i g1_ = _mm512_loadu_si512((const void *)((p) + 8));                               \
        lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(g0_)), _mm512_cvtepi64_epi32(g1_), 1); \
        hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_srli_epi64(g0_, 32))), \
                                _mm512_cvtepi64_epi32(_mm512_srli_epi64(g1_, 32)), 1);                 \
    } while (0)
#define LIMB sdv_limb_avx512
#define SUM64(v) ((uint64_t)_mm512_reduce_add_epi64(v))
#include "dcr_sd_vec.h"  /* which undefines the parameters above */

__attribute__((target("avx2"))) static inline __attribute__((always_inline)) __m256i sdv_limb_avx2(
        const int W, const void *p, int j, __m256i m16) {
    if (W == 1) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    if (W == 2) return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return j ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, m16);
}
__attribute__((target("avx2"))) static inline uint64_t sdv_sum64_avx2(__m256i v) {
    const __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint64_t)_mm_cvtsi128_si64(s) + (uint64_t)_mm_extract_epi64(s, 1);
}
#define SFX _avx2
#define TGT __attribute__((target("avx2")))
#define VEC __m256i
#define NV 8
#define SET1(x) _mm256_set1_epi32((int)(uint32_t)(x))
#define ZERO _mm256_setzero_si256()
#define IOTA _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
#define XOR _mm256_xor_si256
#define ADD64 _mm256_add_epi64
#define SRL32 _mm256_srli_epi32
#define SRL64 _mm256_srli_epi64
#define MULLO _mm256_mullo_epi32
#define MULU _mm256_mul_epu32
#define MINU _mm256_min_epu32
#define MAXU _mm256_max_epu32
/* (no unsigned compare in AVX2: lo < base unsigned is a signed compare with the sign bits
 * flipped, -1 where the low half carried, and subtracting -1 adds the carry) */
#define COUNT(g, k, lo, hi)                                                                            \
    do {                                                                                               \
        const __m256i base_ = SET1(g), flip_ = SET1(0x80000000u);                                      \
        lo = _mm256_add_epi32(base_, (k)->iota);                                                       \
        hi = _mm256_sub_epi32(SET1((g) >> 32), _mm256_cmpgt_epi32(_mm256_xor_si256(base_, flip_),      \
                                                                   _mm256_xor_si256(lo, flip_)));      \
    } while (0)
/* (each 64-bit index's halves gathered: low halves to the low 128 bits, high to the high) */
#define GIDX(p, lo, hi)                                                                                \
    do {                                                                                               \
        const __m256i pick_ = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);                               \
        const __m256i a_ = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(p)), pick_); \
        const __m256i b_ = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)((p) + 4)), pick_); \
        lo = _mm256_permute2x128_si256(a_, b_, 0x20);                                                  \
        hi = _mm256_permute2x128_si256(a_, b_, 0x31);                                                  \
    } while (0)
#define LIMB sdv_limb_avx2
#define SUM64 sdv_sum64_avx2
#include "dcr_sd_vec.h"  /* which undefines the parameters above */

static const sd_fn sd_table_avx512v[4] = {sdv1_avx512, sdv2_avx512, sdv4_avx512, (sd_fn)sd_w8_avx512};
static const sd_fn sdc_table_avx512v[4] = {sdcv1_avx512, sdcv2_avx512, sdcv4_avx512, (sd_fn)sdc_w8_avx512};
static const sd_fn sd_table_avx2v[4] = {sdv1_avx2, sdv2_avx2, sdv4_avx2, (sd_fn)sd_w8_avx2};
static const sd_fn sdc_table_avx2v[4] = {sdcv1_avx2, sdcv2_avx2, sdcv4_avx2, (sd_fn)sdc_w8_avx2};
static int sd_isa(void) {  /* 2: AVX-512, 1: AVX2, 0: plain */
    static int isa = -1;
    if (isa < 0) {
        __builtin_cpu_init();
        isa = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 2
            : __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return isa;
}
static const sd_fn *sd_table(int change) {
    /* dcr_set_simd(0): the plain build; dcr_set_simd(2): AVX2 at most, as for the classes scans,
     * so that the tests reach every build on an AVX-512 machine (this asked only "any SIMD?") */
    const int isa = simd_cap(sd_isa());
    if (isa == 2) return change ? sdc_table_avx512v : sd_table_avx512v;
    if (isa == 1) return change ? sdc_table_avx2v : sd_table_avx2v;
    return change ? sdc_table_plain : sd_table_plain;
}
#else
static const sd_fn *sd_table(int change) { return change ? sdc_table_plain : sd_table_plain; }
#endif
/* which build of the state digest's loop the calls take now (dcr_set_simd and the CPU): 2 the
 * AVX-512 kernels, 1 the AVX2 build, 0 the plain one; the tests check that each was reached */
int dcr_sd_build(void) {
    const sd_fn *t = sd_table(0);
#ifdef DCR_X86
    if (t == sd_table_avx512v) return 2;
    if (t == sd_table_avx2v) return 1;
#endif
    return t == sd_table_plain ? 0 : -1;
}

#include "dcr_sd_blocked.h"

/* the element loop of width w over x (and y: the change variant) -> the sums, m the limbs;
 * defn: which definition's weights (1 or 2, docs/format.md "State digest") */
static int sd_run(const void *x, const void *y, int w, const int64_t *gidx, int64_t start, int64_t n, uint32_t s1,
                  uint32_t s2, const uint32_t *t, uint64_t acc[4][5], uint64_t old[4][5], int *m, int defn) {
    int k = w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : w == 8 ? 3 : -1;
    if (n < 0 || start < 0 || k < 0 || (defn != 1 && defn != 2)) return E_ARGS;
    *m = w == 8 ? 4 : w == 4 ? 2 : 1;
    if (defn == 2) {
        if (gidx == NULL && y == NULL) sdb_range(x, w, *m, start, n, s1, s2, t, acc);
        else sdb_each(x, y, w, gidx, start, n, s1, s2, t, acc, old);
    } else
        sd_table(y != NULL)[k](x, y, gidx, start, n, s1, s2, t, acc, old);
    return 0;
}

/* bits: n elements of w bytes (1, 2, 4, 8), contiguous. Canonical indices: gidx[i] when gidx is
 * not NULL, else start + i. keys: s1, s2, t[4], kpow[4][4] (K_l^j mod P), c[4] (C_l).
 * out[l]: the lane's sum of contributions, in [0, P). Returns 0, or E_ARGS. */
static void sd_out(uint64_t acc[4][5], int m, const uint64_t *kpow, const uint64_t *c, uint64_t *out) {
    for (int l = 0; l < 4; l++) {
        uint64_t v = sd_mod(sd_mod(c[l]) * acc[l][0]);  /* both < 2^31: product < 2^62 */
        for (int j = 0; j < m; j++) v = sd_mod(v + sd_mod(kpow[4 * l + j]) * acc[l][j + 1]);
        out[l] = v;
    }
}

int dcr_sd_contrib(const void *bits, int w, const int64_t *gidx, int64_t start, int64_t n, uint32_t s1,
                   uint32_t s2, const uint32_t *t, const uint64_t *kpow, const uint64_t *c, uint64_t *out, int defn) {
    uint64_t acc[4][5] = {{0}};
    int m, rc = sd_run(bits, NULL, w, gidx, start, n, s1, s2, t, acc, NULL, &m, defn);
    if (rc) return rc;
    sd_out(acc, m, kpow, c, out);
    return 0;
}

/* dcr_sd_contrib of n_runs runs of len elements each, one after the other in bits (run r at
 * element r * len), run r at the canonical indices gstart[r], gstart[r] + 1, ...: a shard that
 * is a run of the canonical tensor per row (a column shard, a tensor-parallel engine's
 * row-parallel weight) summed by the counting kernel, run by run, where an index per element
 * (gidx) cost an int64 array made in torch and read back: 10x the time. Returns 0, or E_ARGS
 * (nothing summed: out untouched). */
int dcr_sd_contrib_runs(const void *bits, int w, const int64_t *gstart, int64_t n_runs, int64_t len, uint32_t s1,
                        uint32_t s2, const uint32_t *t, const uint64_t *kpow, const uint64_t *c, uint64_t *out, int defn) {
    uint64_t acc[4][5] = {{0}};
    int m = 1;
    if (n_runs < 0 || len < 0 || (n_runs > 0 && gstart == NULL) || (w != 1 && w != 2 && w != 4 && w != 8)
        || (defn != 1 && defn != 2))
        return E_ARGS;
    for (int64_t r = 0; r < n_runs; r++)
        if (gstart[r] < 0) return E_ARGS;
    for (int64_t r = 0; r < n_runs; r++)
        sd_run((const char *)bits + (size_t)(r * len) * (size_t)w, NULL, w, NULL, gstart[r], len, s1, s2, t, acc,
               NULL, &m, defn);  /* (cannot fail: every argument it checks is checked above) */
    sd_out(acc, m, kpow, c, out);
    return 0;
}

/* dcr_sd_contrib of n ranges in one call, each with keys of its own: range i is counts[i]
 * contiguous elements of widths[i] bytes at address ptrs[i], at the canonical indices starts[i],
 * starts[i] + 1, ...; its keys s1[i], s2[i], t[4 i..], kpow[16 i..], c[4 i..]; its sums
 * out[4 i..]. Many small tensors' digests summed on a worker with one call a job
 * (statedigest.many_contrib: a keyframe's, as it is encoded and as a follower writes it): a call
 * per tensor took the GIL back for each, from the thread encoding or from the other worker.
 * Returns 0, or E_ARGS (nothing summed: out untouched). */
int dcr_sd_contrib_many(int64_t n, const uint64_t *ptrs, const int32_t *widths, const int64_t *counts,
                        const int64_t *starts, const uint32_t *s1, const uint32_t *s2, const uint32_t *t,
                        const uint64_t *kpow, const uint64_t *c, uint64_t *out, int defn) {
    if (defn != 1 && defn != 2) return E_ARGS;
    if (n < 0 || (n > 0 && (ptrs == NULL || widths == NULL || counts == NULL || starts == NULL))) return E_ARGS;
    for (int64_t i = 0; i < n; i++) {
        int w = widths[i];
        if (counts[i] < 0 || starts[i] < 0 || (w != 1 && w != 2 && w != 4 && w != 8)
            || (counts[i] > 0 && ptrs[i] == 0))
            return E_ARGS;
    }
    for (int64_t i = 0; i < n; i++) {
        uint64_t acc[4][5] = {{0}};
        int m;
        sd_run((const void *)(uintptr_t)ptrs[i], NULL, widths[i], NULL, starts[i], counts[i], s1[i], s2[i],
               t + 4 * i, acc, NULL, &m, defn);  /* (cannot fail: every argument it checks is checked above) */
        sd_out(acc, m, kpow + 16 * i, c + 4 * i, out + 4 * i);
    }
    return 0;
}

/* lo and hi of n >= 1 int64 values: the state digest's range check of its canonical indices
 * (statedigest._out_of_range). In C, and short, so that it is called without giving the GIL up
 * (native.held()): torch.aminmax and the two values it hands back gave it up three times a chunk. */
int dcr_i64_range(const int64_t *x, int64_t n, int64_t *lo, int64_t *hi) {
    if (n < 1) return E_ARGS;
    int64_t a = x[0], b = x[0];
    for (int64_t i = 1; i < n; i++) {
        a = x[i] < a ? x[i] : a;
        b = x[i] > b ? x[i] : b;
    }
    *lo = a;
    *hi = b;
    return 0;
}

/* The change of the state digest when the n elements at those canonical indices go from the
 * bits old_bits to new_bits: out[l] = (contrib_l(new) - contrib_l(old)) mod P, what two
 * dcr_sd_contrib calls and a subtraction give, with each index mixed once instead of twice.
 * The C_l term is the same on both sides and cancels. Returns 0, or E_ARGS. */
int dcr_sd_change(const void *new_bits, const void *old_bits, int w, const int64_t *gidx, int64_t start, int64_t n,
                  uint32_t s1, uint32_t s2, const uint32_t *t, const uint64_t *kpow, uint64_t *out, int defn) {
    uint64_t acc[4][5] = {{0}}, old[4][5] = {{0}};
    if (old_bits == NULL) return E_ARGS;
    int m, rc = sd_run(new_bits, old_bits, w, gidx, start, n, s1, s2, t, acc, old, &m, defn);
    if (rc) return rc;
    for (int l = 0; l < 4; l++) {
        uint64_t v = 0;
        for (int j = 0; j < m; j++)  /* each limb sum's new - old, in [0, P): the product < 2^62 */
            v = sd_mod(v + sd_mod(kpow[4 * l + j]) * ((acc[l][j + 1] + SD_P - old[l][j + 1]) % SD_P));
        out[l] = v;
    }
    return 0;
}

/* dcr_sd_change of the n >= 1 changes at gidx, the indices first checked to lie in [0, numel):
 * E_RANGE, nothing summed, when one does not. One call where a chunk's changes made two (their
 * range, then their sum): a model of many small tensors makes one or two a tensor. */
int dcr_sd_change_in(const void *new_bits, const void *old_bits, int w, const int64_t *gidx, int64_t n,
                     int64_t numel, uint32_t s1, uint32_t s2, const uint32_t *t, const uint64_t *kpow, uint64_t *out, int defn) {
    int64_t lo, hi;
    if (gidx == NULL || dcr_i64_range(gidx, n, &lo, &hi) != 0) return E_ARGS;
    if (lo < 0 || hi >= numel) return E_RANGE;
    return dcr_sd_change(new_bits, old_bits, w, gidx, 0, n, s1, s2, t, kpow, out, defn);
}

/* dcr_sd_change_in, added into acc: a running sum's LANES lanes (each in [0, P), kept so) held
 * in C memory by its Python owner, who calls this keeping the GIL (native.held: one caller at a
 * time), so that a chunk's change costs one call and no object. acc is left as it was on error. */
int dcr_sd_change_acc(const void *new_bits, const void *old_bits, int w, const int64_t *gidx, int64_t n,
                      int64_t numel, uint32_t s1, uint32_t s2, const uint32_t *t, const uint64_t *kpow, uint64_t *acc, int defn) {
    uint64_t out[4];
    int rc = dcr_sd_change_in(new_bits, old_bits, w, gidx, n, numel, s1, s2, t, kpow, out, defn);
    if (rc) return rc;
    for (int l = 0; l < 4; l++) acc[l] = sd_mod(sd_mod(acc[l]) + out[l]);
    return 0;
}
