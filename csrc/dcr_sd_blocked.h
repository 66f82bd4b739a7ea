/* The state digest's second definition (definition 2, docs/format.md "State digest"): an
 * element's weight is a product of its block's weight and a fixed table's entry for its place in
 * the block,
 *   r_l(i) = a_l(i >> 10) * g_l(i & 1023)  (mod P),
 * a_l(b) the first definition's weight of the index b (the same keys, the same mixes) and
 * g_l(j) = clamp(mix(mix(j ^ SDB_G0) ^ SDB_GT[l]) >> 1, 1, P - 1) the same for every tensor.
 * Both factors are in [1, P) and P is prime, so r_l is never 0 mod P: what the single-change
 * guarantee needs. Why: the first definition mixes every element's index (six 32-bit mixes an
 * element, ~3.3 cycles on AVX-512, at the vector ports' limit: docs/results.md, "Format version
 * 4, third turn"), which makes a whole-state digest 3-4x a memcpy. Here an element costs one
 * 32x32->64-bit product per lane and limb against a table that stays in the L1 cache, and the
 * mixes are paid once per 1024 elements.
 *
 * The sums are those of the first definition's loop (acc[l][0] = sum r, acc[l][1 + j] = sum r *
 * limb j, mod P), so everything after the loop (sd_out, the change's difference) is shared.
 * Contiguous ranges go block by block: a block's sum_j g_l(j) x_j (< 1024 * 2^31 * 2^16 = 2^57)
 * then one product by a_l(b). Indices given one by one (gidx) and changes are summed against the
 * table while consecutive indices stay in one block, and the block's sums times its a_l when the
 * block changes (sdb_each).
 *
 * Included once by dcr_classes.c after the first definition's loop (it uses sd_mix, sd_weight,
 * sd_mod, SD_P, simd_cap and sd_isa). */
#define SDB_SHIFT 10
#define SDB_N (1 << SDB_SHIFT)
#define SDB_G0 0x9E3779B9u
static const uint32_t SDB_GT[4] = {0x85EBCA6Bu, 0xC2B2AE35u, 0x27D4EB2Fu, 0x165667B1u};

/* the table g_l(j), lane by lane (a contiguous range's vectors) and side by side (sdb_gi: an
 * element's four entries in one load, for indices one by one), and its lanes' sums over a whole
 * block; made once, when the library loads */
static uint32_t sdb_g[4][SDB_N];
static uint32_t sdb_gi[SDB_N][4] __attribute__((aligned(16)));
static uint64_t sdb_gsum[4];
__attribute__((constructor)) static void sdb_init(void) {
    for (int l = 0; l < 4; l++) {
        uint64_t s = 0;
        for (uint32_t j = 0; j < SDB_N; j++) s += sdb_gi[j][l] = sdb_g[l][j] = sd_weight(sd_mix(j ^ SDB_G0), SDB_GT[l]);
        sdb_gsum[l] = s;
    }
}
/* the table, for the tests and the reference's check of it: out[4][1024] */
void dcr_sdb_table(uint32_t *out) { memcpy(out, sdb_g, sizeof sdb_g); }
/* which build of this definition's loops the calls take now (dcr_set_simd and the CPU): 1 the
 * AVX2 one (on AVX-512 cores too), 0 the plain one; as dcr_sd_build for the first definition */
int dcr_sdb_build(void) {
#ifdef DCR_X86
    return simd_cap(sd_isa()) >= 1;
#else
    return 0;
#endif
}

static inline void sdb_block_weights(uint64_t b, uint32_t s1, uint32_t s2, const uint32_t *t, uint64_t a[4]) {
    const uint32_t u = sd_mix(sd_mix((uint32_t)b ^ s1) ^ s2 ^ (uint32_t)(b >> 32));
    for (int l = 0; l < 4; l++) a[l] = sd_weight(u, t[l]);
}
/* x mod P for x < 2^62, by P = 2^31 - 1 (two folds, one subtraction) */
static inline uint64_t sdb_mod(uint64_t x) {
    x = (x & SD_P) + (x >> 31);
    x = (x & SD_P) + (x >> 31);
    return x >= SD_P ? x - SD_P : x;
}

/* one block's sums s[l][j] += sum over the block's n elements of g_l(j0 + k) * limb j of x[k],
 * plainly: one function a width, each lane's table a row and the limbs constants, so that the
 * compiler vectorises it for the baseline instruction set (the vector build below does whole
 * groups of 8, this the rest) */
#define SDB_BLOCK_PLAIN(NAME, T, M, LIMB)                                                            \
    static void NAME(const void *xv, int j0, int n, uint64_t s[4][4]) {                              \
        const T *x = (const T *)xv;                                                                  \
        const uint32_t *g0 = sdb_g[0] + j0, *g1 = sdb_g[1] + j0, *g2 = sdb_g[2] + j0, *g3 = sdb_g[3] + j0; \
        for (int j = 0; j < M; j++) {                                                                \
            uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;                                                 \
            for (int i = 0; i < n; i++) {                                                            \
                const uint64_t v = LIMB(x, j);                                                       \
                a0 += (uint64_t)g0[i] * v; a1 += (uint64_t)g1[i] * v;                                \
                a2 += (uint64_t)g2[i] * v; a3 += (uint64_t)g3[i] * v;                                \
            }                                                                                        \
            s[0][j] += a0; s[1][j] += a1; s[2][j] += a2; s[3][j] += a3;                              \
        }                                                                                            \
    }
/* (a 4-byte element's limbs cut in 32-bit arithmetic: L_W4's 64-bit shift kept the compiler from
 * vectorising the loop, 2.5x the time) */
#define SDB_L4(a, j) (((uint32_t)a[i] >> (16 * (j))) & 0xFFFFu)
SDB_BLOCK_PLAIN(sdb_block_plain_w1, uint8_t, 1, L_W1)
SDB_BLOCK_PLAIN(sdb_block_plain_w2, uint16_t, 1, L_W2)
SDB_BLOCK_PLAIN(sdb_block_plain_w4, uint32_t, 2, SDB_L4)
SDB_BLOCK_PLAIN(sdb_block_plain_w8, uint64_t, 4, L_W8)
static void sdb_block_plain(const void *x, int w, int j0, int n, uint64_t s[4][4]) {
    (w == 1 ? sdb_block_plain_w1 : w == 2 ? sdb_block_plain_w2 : w == 4 ? sdb_block_plain_w4
                                                                     : sdb_block_plain_w8)(x, j0, n, s);
}

#ifdef DCR_X86
/* The same in AVX2, 8 elements a group for 1-, 2- and 4-byte elements: their limbs as eight
 * 32-bit lanes, the table's eight entries as loaded; vpmuludq multiplies the low halves of each
 * 64-bit lane (the even elements), a 32-bit shift of both brings the odd ones there. A 64-bit
 * lane sums 2 products a group, < 2^47 each, 256 at most a block. On an AVX-512 core this build
 * is taken too: 512-bit vectors were not faster on the AMD core it was written on (the products
 * are the limit, and its 512-bit operations are two 256-bit halves); not measured elsewhere. */
#define SDB_LIMBS_AVX2(W, p, v)                                                                      \
    do {                                                                                             \
        if (W == 1) v[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)));              \
        else if (W == 2) v[0] = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p)));       \
        else {                                                                                       \
            const __m256i e_ = _mm256_loadu_si256((const __m256i *)(p));                             \
            v[0] = _mm256_and_si256(e_, _mm256_set1_epi32(0xFFFF));                                  \
            v[1] = _mm256_srli_epi32(e_, 16);                                                        \
        }                                                                                            \
    } while (0)
#define SDB_BLOCK_AVX2(NAME, T, W, M)                                                                \
    __attribute__((target("avx2"))) static void NAME(const void *xv, int j0, int n, uint64_t s[4][4]) { \
        const T *x = (const T *)xv;                                                                  \
        const int n8 = n & ~7;                                                                       \
        __m256i acc[4][M];                                                                           \
        for (int l = 0; l < 4; l++)                                                                  \
            for (int j = 0; j < M; j++) acc[l][j] = _mm256_setzero_si256();                          \
        for (int k = 0; k < n8; k += 8) {                                                            \
            __m256i v[2], vo[2];                                                                     \
            SDB_LIMBS_AVX2(W, x + k, v);                                                             \
            for (int j = 0; j < M; j++) vo[j] = _mm256_srli_epi64(v[j], 32);                         \
            for (int l = 0; l < 4; l++) {                                                            \
                const __m256i ge = _mm256_loadu_si256((const __m256i *)(sdb_g[l] + j0 + k));        \
                const __m256i go = _mm256_srli_epi64(ge, 32);                                        \
                for (int j = 0; j < M; j++)                                                          \
                    acc[l][j] = _mm256_add_epi64(acc[l][j], _mm256_add_epi64(_mm256_mul_epu32(ge, v[j]), \
                                                                             _mm256_mul_epu32(go, vo[j]))); \
            }                                                                                        \
        }                                                                                            \
        for (int l = 0; l < 4; l++)                                                                  \
            for (int j = 0; j < M; j++) s[l][j] += sdv_sum64_avx2(acc[l][j]);                        \
        sdb_block_plain(x + n8, W, j0 + n8, n - n8, s);                                              \
    }
SDB_BLOCK_AVX2(sdb_block_avx2_w1, uint8_t, 1, 1)
SDB_BLOCK_AVX2(sdb_block_avx2_w2, uint16_t, 2, 1)
SDB_BLOCK_AVX2(sdb_block_avx2_w4, uint32_t, 4, 2)
/* 8-byte elements four a group, in 64-bit lanes as they are: limb j is (x >> 16 j) & 0xFFFF in
 * each lane, against the group's four table entries widened to 64 bits */
__attribute__((target("avx2"))) static void sdb_block_avx2_w8(const void *xv, int j0, int n, uint64_t s[4][4]) {
    const uint64_t *x = (const uint64_t *)xv;
    const int n4 = n & ~3;
    const __m256i m16 = _mm256_set1_epi64x(0xFFFF);
    __m256i acc[4][4];
    for (int l = 0; l < 4; l++)
        for (int j = 0; j < 4; j++) acc[l][j] = _mm256_setzero_si256();
    for (int k = 0; k < n4; k += 4) {
        const __m256i e = _mm256_loadu_si256((const __m256i *)(x + k));
        const __m256i v[4] = {_mm256_and_si256(e, m16), _mm256_and_si256(_mm256_srli_epi64(e, 16), m16),
                              _mm256_and_si256(_mm256_srli_epi64(e, 32), m16), _mm256_srli_epi64(e, 48)};
        for (int l = 0; l < 4; l++) {
            const __m256i g = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(sdb_g[l] + j0 + k)));
            for (int j = 0; j < 4; j++) acc[l][j] = _mm256_add_epi64(acc[l][j], _mm256_mul_epu32(g, v[j]));
        }
    }
    for (int l = 0; l < 4; l++)
        for (int j = 0; j < 4; j++) s[l][j] += sdv_sum64_avx2(acc[l][j]);
    sdb_block_plain(x + n4, 8, j0 + n4, n - n4, s);
}
#endif

/* the sums of n elements at canonical indices start, start + 1, ...: block by block */
static void sdb_range(const void *x, int w, int m, int64_t start, int64_t n, uint32_t s1, uint32_t s2,
                      const uint32_t *t, uint64_t acc[4][5]) {
#ifdef DCR_X86
    const int vec = simd_cap(sd_isa()) >= 1;
#endif
    for (int64_t i = 0; i < n;) {
        const uint64_t gi = (uint64_t)(start + i), b = gi >> SDB_SHIFT;
        const int j0 = (int)(gi & (SDB_N - 1));
        const int len = n - i < SDB_N - j0 ? (int)(n - i) : SDB_N - j0;
        uint64_t s[4][4] = {{0}}, a[4];
        const void *xb = (const char *)x + (size_t)i * (size_t)w;
#ifdef DCR_X86
        if (vec)
            (w == 1 ? sdb_block_avx2_w1 : w == 2 ? sdb_block_avx2_w2 : w == 4 ? sdb_block_avx2_w4
                                                                         : sdb_block_avx2_w8)(xb, j0, len, s);
        else
#endif
            sdb_block_plain(xb, w, j0, len, s);
        sdb_block_weights(b, s1, s2, t, a);
        for (int l = 0; l < 4; l++) {
            uint64_t gs = 0;
            if (len == SDB_N) gs = sdb_gsum[l];
            else for (int k = 0; k < len; k++) gs += sdb_g[l][j0 + k];
            acc[l][0] = sd_mod(acc[l][0] + sdb_mod(a[l] * sd_mod(gs)));
            for (int j = 0; j < m; j++) acc[l][j + 1] = sd_mod(acc[l][j + 1] + sdb_mod(a[l] * sd_mod(s[l][j])));
        }
        i += len;
    }
}

/* the sums of n elements one index each (gidx, or start + i), new bits x and, for a change, old
 * bits y (old[][]). Consecutive indices in one block are summed against the table alone, and the
 * block's sums times its a_l when the block changes (or after SDB_N terms: each product < 2^47,
 * so < 2^57 whatever the indices): a chunk's changes, in order, are ~10 a block at 1 %, so the
 * mixes and the reductions are paid once a block, not once an element. */
static inline void sdb_flush(uint64_t b, uint32_t s1, uint32_t s2, const uint32_t *t, int m, uint64_t sr[4],
                             uint64_t sx[4][4], uint64_t sy[4][4], int with_old, uint64_t acc[4][5],
                             uint64_t old[4][5]) {
    uint64_t a[4];
    sdb_block_weights(b, s1, s2, t, a);
    for (int l = 0; l < 4; l++) {
        acc[l][0] = sd_mod(acc[l][0] + sdb_mod(a[l] * sd_mod(sr[l])));
        sr[l] = 0;
        for (int j = 0; j < m; j++) {
            acc[l][j + 1] = sd_mod(acc[l][j + 1] + sdb_mod(a[l] * sd_mod(sx[l][j])));
            sx[l][j] = 0;
            if (with_old) {
                old[l][j + 1] = sd_mod(old[l][j + 1] + sdb_mod(a[l] * sd_mod(sy[l][j])));
                sy[l][j] = 0;
            }
        }
    }
}
#define SDB_EACH(NAME, T, M, LIMB)                                                                   \
    static void NAME(const void *xv, const void *yv, const int64_t *gidx, int64_t start, int64_t n,   \
                     uint32_t s1, uint32_t s2, const uint32_t *t, uint64_t acc[4][5], uint64_t old[4][5]) { \
        const T *x = (const T *)xv, *y = (const T *)yv;                                              \
        uint64_t sr[4] = {0}, sx[4][4] = {{0}}, sy[4][4] = {{0}}, cur = 0;                           \
        int run = 0;                                                                                 \
        for (int64_t i = 0; i < n; i++) {                                                            \
            const uint64_t gi = gidx ? (uint64_t)gidx[i] : (uint64_t)(start + i), b = gi >> SDB_SHIFT; \
            if (run && (b != cur || run == SDB_N)) {                                                 \
                sdb_flush(cur, s1, s2, t, M, sr, sx, sy, y != NULL, acc, old);                       \
                run = 0;                                                                             \
            }                                                                                        \
            cur = b;                                                                                 \
            run++;                                                                                   \
            const uint32_t *g = sdb_gi[gi & (SDB_N - 1)];                                            \
            for (int l = 0; l < 4; l++) {                                                            \
                const uint64_t gl = g[l];                                                            \
                sr[l] += gl;                                                                         \
                for (int j = 0; j < M; j++) {                                                        \
                    sx[l][j] += gl * (uint64_t)LIMB(x, j);                                           \
                    if (y) sy[l][j] += gl * (uint64_t)LIMB(y, j);                                    \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        if (run) sdb_flush(cur, s1, s2, t, M, sr, sx, sy, y != NULL, acc, old);                      \
    }
SDB_EACH(sdb_each_w1, uint8_t, 1, L_W1)
SDB_EACH(sdb_each_w2, uint16_t, 1, L_W2)
SDB_EACH(sdb_each_w4, uint32_t, 2, L_W4)
SDB_EACH(sdb_each_w8, uint64_t, 4, L_W8)

#ifdef DCR_X86
/* The same with the four lanes as one vector of 64-bit lanes: an element's four table entries
 * one load, each limb's four products one vpmuludq; and a block's end in vectors too (its four
 * a_l mixed in 32-bit lanes; sums reduced by folds, x mod P = (x & P) + (x >> 31) up to a
 * multiple of P, exact at the end). The plain loop above spent ~10 ns a change, mostly in a
 * block's reductions (docs/results.md, "Format version 4, tenth turn"). */
__attribute__((target("avx2"))) static inline __m256i sdb_fold(__m256i v) {  /* < 2^63 -> < 2^33, same mod P */
    return _mm256_add_epi64(_mm256_and_si256(v, _mm256_set1_epi64x((long long)SD_P)), _mm256_srli_epi64(v, 31));
}
__attribute__((target("avx2"))) static inline __m128i sdb_mix4(__m128i h) {
    h = _mm_xor_si128(h, _mm_srli_epi32(h, 16));
    h = _mm_mullo_epi32(h, _mm_set1_epi32((int)0x7FEB352Du));
    h = _mm_xor_si128(h, _mm_srli_epi32(h, 15));
    h = _mm_mullo_epi32(h, _mm_set1_epi32((int)0x31848BABu));
    return _mm_xor_si128(h, _mm_srli_epi32(h, 16));
}
/* block b's four a_l as 64-bit lanes */
__attribute__((target("avx2"))) static inline __m256i sdb_weights4(uint64_t b, uint32_t s1, uint32_t s2, __m128i vt) {
    const uint32_t u = sd_mix(sd_mix((uint32_t)b ^ s1) ^ s2 ^ (uint32_t)(b >> 32));
    __m128i r = _mm_srli_epi32(sdb_mix4(_mm_xor_si128(_mm_set1_epi32((int)u), vt)), 1);
    r = _mm_min_epu32(_mm_max_epu32(r, _mm_set1_epi32(1)), _mm_set1_epi32((int)(SD_P - 1)));
    return _mm256_cvtepu32_epi64(r);
}
/* a block's sums times its a_l, folded into the running ones: *acc += a * (*s mod P), *s = 0 */
__attribute__((target("avx2"))) static inline void sdb_fold_in(__m256i a, __m256i *s, __m256i *acc) {
    *acc = sdb_fold(_mm256_add_epi64(*acc, sdb_fold(_mm256_mul_epu32(a, sdb_fold(*s)))));
    *s = _mm256_setzero_si256();
}
/* a block's end: its sums of g (vr, needed of the new side only: a change's sum of r cancels),
 * of g * new limbs (vx) and of g * old limbs (vy, with OLD) times its a_l */
#define SDB_FLUSH4(M, OLD)                                                                           \
    do {                                                                                             \
        const __m256i a_ = sdb_weights4(cur, s1, s2, vt);                                            \
        sdb_fold_in(a_, &vr, &ax[0]);                                                                \
        for (int j = 0; j < M; j++) {                                                                \
            sdb_fold_in(a_, &vx[j], &ax[1 + j]);                                                     \
            if (OLD) sdb_fold_in(a_, &vy[j], &ay[1 + j]);                                            \
        }                                                                                            \
        run = 0;                                                                                     \
    } while (0)
#define SDB_EACH4(NAME, T, M, LIMB)                                                                  \
    __attribute__((target("avx2"))) static void NAME(const void *xv, const void *yv, const int64_t *gidx, \
            int64_t start, int64_t n, uint32_t s1, uint32_t s2, const uint32_t *t, uint64_t acc[4][5],  \
            uint64_t old[4][5]) {                                                                    \
        const T *x = (const T *)xv, *y = (const T *)yv;                                              \
        const __m128i vt = _mm_loadu_si128((const __m128i *)t);                                     \
        __m256i vr = _mm256_setzero_si256(), vx[4], vy[4], ax[5], ay[5];                             \
        for (int j = 0; j < 5; j++) ax[j] = ay[j] = _mm256_setzero_si256();                          \
        for (int j = 0; j < 4; j++) vx[j] = vy[j] = _mm256_setzero_si256();                          \
        uint64_t cur = 0;                                                                            \
        int run = 0;                                                                                 \
        for (int64_t i = 0; i < n; i++) {                                                            \
            const uint64_t gi = gidx ? (uint64_t)gidx[i] : (uint64_t)(start + i), b = gi >> SDB_SHIFT; \
            if (run && (b != cur || run == SDB_N)) SDB_FLUSH4(M, y != NULL);                         \
            cur = b;                                                                                 \
            run++;                                                                                   \
            const __m256i g = _mm256_cvtepu32_epi64(_mm_load_si128((const __m128i *)sdb_gi[gi & (SDB_N - 1)])); \
            vr = _mm256_add_epi64(vr, g);                                                            \
            for (int j = 0; j < M; j++) {                                                            \
                vx[j] = _mm256_add_epi64(vx[j], _mm256_mul_epu32(g, _mm256_set1_epi64x((long long)LIMB(x, j)))); \
                if (y) vy[j] = _mm256_add_epi64(vy[j], _mm256_mul_epu32(g, _mm256_set1_epi64x((long long)LIMB(y, j)))); \
            }                                                                                        \
        }                                                                                            \
        if (run) SDB_FLUSH4(M, y != NULL);                                                           \
        uint64_t lx[5][4], ly[5][4];                                                                 \
        for (int j = 0; j < 5; j++) {                                                                \
            _mm256_storeu_si256((__m256i *)lx[j], ax[j]);                                            \
            _mm256_storeu_si256((__m256i *)ly[j], ay[j]);                                            \
        }                                                                                            \
        for (int l = 0; l < 4; l++)                                                                  \
            for (int j = 0; j <= M; j++) {                                                           \
                acc[l][j] = sd_mod(acc[l][j] + sd_mod(lx[j][l]));                                    \
                if (y) old[l][j] = sd_mod(old[l][j] + sd_mod(ly[j][l]));                             \
            }                                                                                        \
    }
SDB_EACH4(sdb_each4_w1, uint8_t, 1, L_W1)
SDB_EACH4(sdb_each4_w2, uint16_t, 1, L_W2)
SDB_EACH4(sdb_each4_w4, uint32_t, 2, L_W4)
SDB_EACH4(sdb_each4_w8, uint64_t, 4, L_W8)
#endif

static void sdb_each(const void *x, const void *y, int w, const int64_t *gidx, int64_t start, int64_t n,
                     uint32_t s1, uint32_t s2, const uint32_t *t, uint64_t acc[4][5], uint64_t old[4][5]) {
#ifdef DCR_X86
    if (simd_cap(sd_isa()) >= 1) {
        (w == 1 ? sdb_each4_w1 : w == 2 ? sdb_each4_w2 : w == 4 ? sdb_each4_w4 : sdb_each4_w8)(
            x, y, gidx, start, n, s1, s2, t, acc, old);
        return;
    }
#endif
    (w == 1 ? sdb_each_w1 : w == 2 ? sdb_each_w2 : w == 4 ? sdb_each_w4 : sdb_each_w8)(
        x, y, gidx, start, n, s1, s2, t, acc, old);
}
