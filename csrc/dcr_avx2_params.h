/* The AVX2 scans' parameters of dcr_simd_scans.h, which undefines them after each inclusion:
 * included before each of dcr_classes.c's two AVX2 inclusions (they differ in SFX, TGT and NTH
 * alone: the bit selection with and without pdep). */
#define CTX_T ctx256
#define CTX(m, l, h) ctx_avx2(m, l, h)
#define BLK_T blk256
#define CLASSES(x, p) classes_avx2(x, p)
#define ACT_T __m256i
#define ACT(c) _mm256_set1_epi8((char)(c))
#define EQ(cb, a) eq_avx2(cb, a)
#define LDB(p) ld_avx2(p)
#define BLOCK_OF(cum, r) block_of_avx2(cum, r)
#define STB(p, cb) st_avx2(p, cb)
#define NEQ(o, nw) neq_avx2(o, nw)
#define CLAMPB(x, cb) clamp_avx2(x, cb)
#define WBLK(d, s, m) wblk_avx2(d, s, m)
