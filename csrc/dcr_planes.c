/* Byte planes (nemo_dcr/codec/planes.py, docs/format.md): k values of w bytes stored as w planes
 * of k bytes, least significant byte first. Every portable value stream and every keyframe chunk
 * goes through these, both ways; the PyTorch/numpy reference made several passes and temporaries
 * of a chunk (split) or a strided numpy copy (join, ~70x slower than this on 2 MiB of BF16).
 *
 * Plain loops over a constant width, which the compiler vectorises at the baseline ISA (-O3, no
 * -march): memory-bound at about 2x a memcpy. Planes follow the bytes in memory, so this is the
 * reference's arithmetic (byte p = (v >> 8p) & 0xFF) on a little-endian host only; elsewhere the
 * functions return -1 and the reference runs. */
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define DCR_PLANES_LE 1
#endif

#define SPLIT(W) static void split_w##W(const uint8_t *restrict s, int64_t k, uint8_t *restrict d) { \
    for (int64_t i = 0; i < k; i++) for (int p = 0; p < W; p++) d[p * k + i] = s[i * W + p]; }
#define JOIN(W) static void join_w##W(const uint8_t *restrict s, int64_t k, uint8_t *restrict d) { \
    for (int64_t i = 0; i < k; i++) for (int p = 0; p < W; p++) d[i * W + p] = s[p * k + i]; }
SPLIT(2)
SPLIT(4)
JOIN(2)
JOIN(4)
JOIN(8)

/* 8 x 8 bytes transposed in registers: byte c of r[j] goes to byte j of r[c] (three rounds of
 * block swaps). The plain loop is not vectorised for 8 planes and ran at the reference's speed. */
static inline void transpose8(uint64_t r[8]) {
    for (int j = 0; j < 4; j++) {
        uint64_t t = ((r[j] >> 32) ^ r[j + 4]) & 0x00000000FFFFFFFFull; r[j] ^= t << 32; r[j + 4] ^= t;
    }
    for (int j = 0; j < 8; j += (j & 1) ? 3 : 1) {  /* 0, 1, 4, 5 */
        uint64_t t = ((r[j] >> 16) ^ r[j + 2]) & 0x0000FFFF0000FFFFull; r[j] ^= t << 16; r[j + 2] ^= t;
    }
    for (int j = 0; j < 8; j += 2) {
        uint64_t t = ((r[j] >> 8) ^ r[j + 1]) & 0x00FF00FF00FF00FFull; r[j] ^= t << 8; r[j + 1] ^= t;
    }
}

static void split_w8(const uint8_t *restrict s, int64_t k, uint8_t *restrict d) {
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        uint64_t r[8];
        memcpy(r, s + i * 8, 64);
        transpose8(r);
        for (int p = 0; p < 8; p++) memcpy(d + p * k + i, &r[p], 8);
    }
    for (; i < k; i++) for (int p = 0; p < 8; p++) d[p * k + i] = s[i * 8 + p];
}

typedef void (*planes_fn)(const uint8_t *restrict, int64_t, uint8_t *restrict);
static const planes_fn SPLITS[9] = {[2] = split_w2, [4] = split_w4, [8] = split_w8};
static const planes_fn JOINS[9] = {[2] = join_w2, [4] = join_w4, [8] = join_w8};

static int run(const planes_fn *fns, const void *src, int64_t k, int w, void *dst) {
#ifdef DCR_PLANES_LE
    if (k < 0 || w < 1 || w > 8) return -1;
    if (w == 1) {
        if (k) memcpy(dst, src, (size_t)k);
        return 0;
    }
    if (!fns[w]) return -1;
    fns[w](src, k, dst);
    return 0;
#else
    (void)fns; (void)src; (void)k; (void)w; (void)dst;
    return -1;
#endif
}

/* src: k values of w bytes; dst: w * k bytes, plane 0 (least significant bytes) first. 0, or -1
 * for a width it does not take (the caller runs the reference). */
int dcr_planes_split(const void *src, int64_t k, int w, void *dst) { return run(SPLITS, src, k, w, dst); }

/* The inverse: src w planes of k bytes, dst k values of w bytes. */
int dcr_planes_join(const void *src, int64_t k, int w, void *dst) { return run(JOINS, src, k, w, dst); }

/* join of the values at [start, start + m) of the k in planes src (each plane k bytes apart) */
#define JOIN_RANGE(W) static void join_range_w##W(const uint8_t *restrict s, int64_t k, int64_t start, int64_t m, \
                                                  uint8_t *restrict d) { \
    for (int64_t i = 0; i < m; i++) for (int p = 0; p < W; p++) d[i * W + p] = s[p * k + start + i]; }
JOIN_RANGE(2)
JOIN_RANGE(4)
JOIN_RANGE(8)
typedef void (*join_range_fn)(const uint8_t *restrict, int64_t, int64_t, int64_t, uint8_t *restrict);
static const join_range_fn JOIN_RANGES[9] = {[2] = join_range_w2, [4] = join_range_w4, [8] = join_range_w8};

/* The join of only some of the k values, each run straight to where a receiver holds it: run i's
 * values [cstart[i], cstart[i] + length[i]) to dst's elements [lstart[i], + length[i]) (dst:
 * dst_n values of w bytes). A keyframe chunk into a receiver holding its region in part (a TP
 * engine's columns of a trainer rank's rows, state/runs.py): one call, where the join of the
 * whole chunk into a temporary and a copy of the runs out of it took ~3x as long per chunk. Every
 * run is checked to lie inside both before the first write: -1 (nothing written) for one that
 * does not, or a width it does not take (the caller runs the reference). */
int dcr_planes_join_runs(const void *src, int64_t k, int w, void *dst, int64_t dst_n, const int64_t *cstart,
                         const int64_t *lstart, const int64_t *length, int64_t n_runs) {
#ifdef DCR_PLANES_LE
    if (k < 0 || dst_n < 0 || n_runs < 0 || w < 1 || w > 8 || (w > 1 && !JOIN_RANGES[w])) return -1;
    for (int64_t i = 0; i < n_runs; i++) {
        int64_t c = cstart[i], l = lstart[i], m = length[i];
        if (m < 0 || c < 0 || l < 0 || c > k - m || l > dst_n - m) return -1;
    }
    for (int64_t i = 0; i < n_runs; i++) {
        uint8_t *d = (uint8_t *)dst + lstart[i] * w;
        if (w == 1) memcpy(d, (const uint8_t *)src + cstart[i], (size_t)length[i]);
        else JOIN_RANGES[w](src, k, cstart[i], length[i], d);
    }
    return 0;
#else
    (void)src; (void)k; (void)w; (void)dst; (void)dst_n; (void)cstart; (void)lstart; (void)length; (void)n_runs;
    return -1;
#endif
}

/* Runs of w-byte elements copied between two arrays: run i's length[i] elements from
 * src[sstart[i]] on to dst[dstart[i]] on (state/runs.py: a chunk's runs gathered from a
 * receiver's memory, or written into it). One call a chunk, where numpy's copy of a chunk's runs
 * (its check that they are alike, then a strided copy) cost ~50 us of Python and numpy calls a
 * chunk of 256 runs. Every run checked to lie inside both arrays first: -1, nothing copied. */
int dcr_copy_runs(void *dst, int64_t dst_n, const void *src, int64_t src_n, int w, const int64_t *dstart,
                  const int64_t *sstart, const int64_t *length, int64_t n_runs) {
    if (dst_n < 0 || src_n < 0 || n_runs < 0 || w < 1 || w > 8) return -1;
    for (int64_t i = 0; i < n_runs; i++) {
        int64_t d = dstart[i], s = sstart[i], m = length[i];
        if (m < 0 || d < 0 || s < 0 || d > dst_n - m || s > src_n - m) return -1;
    }
    for (int64_t i = 0; i < n_runs; i++)
        memcpy((uint8_t *)dst + dstart[i] * w, (const uint8_t *)src + sstart[i] * w, (size_t)(length[i] * w));
    return 0;
}
