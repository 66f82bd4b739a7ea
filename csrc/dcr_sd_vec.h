/* The state digest's element loop for 1-, 2- and 4-byte elements (FP8 and bytes; BF16 and
 * FP16, most of a model; FP32), written out for vector units: what the compiler made of SD_LOOP
 * (dcr_classes.c) spent most of its instructions moving 32-bit values in and out of 64-bit
 * lanes. Here NV elements a group in 32-bit lanes: the index mixing and each lane's weight r as
 * 32-bit vectors, and the sums in 64-bit lanes, the even elements' r * limb by one vpmuludq
 * (which reads the low half of each 64-bit lane) and the odd ones' after a 32-bit shift; a
 * 4-byte element is two 16-bit limbs, as L_W4 cuts it. Two rewrites that change no result save
 * 10 of the ~105 instructions per group: a lane's mix opens with h ^= h >> 16 on h = u ^ t,
 * which is (u ^ u >> 16) ^ (t ^ t >> 16), so the u half is done once for the four lanes and the
 * t half is a constant; and the sum of r adds each 64-bit lane whole (r_even + 2^32 r_odd)
 * beside the odd halves it needs anyway for the products, the even ones recovered at the
 * block's end. Four groups a step: each group's index mix and lane mixes are a chain of ~10
 * dependent multiplies, ~90 cycles, and one group at a time left the out-of-order window short
 * of independent work (the kernel ran at about twice its instruction count's time); four chains
 * side by side made it 1.7x (BF16, bytes) to 2.6x (FP32) faster on AVX-512, eight spill
 * registers and are slower (docs/results.md, "Format version 4, seventh turn"). Same sums as
 * SD_LOOP, element for element (the block's adds in another order); the tail (n % NV) goes to
 * the plain loop.
 *
 * Written once, included by dcr_classes.c once per instruction set (AVX-512BW, AVX2), which
 * defines before each inclusion:
 *   SFX, TGT            the suffix of the functions' names, their target attribute
 *   VEC, NV             the vector type, its 32-bit lanes
 *   SET1(x), ZERO       a vector of x in every 32-bit lane, of zeros
 *   IOTA                0, 1, ..., NV - 1
 *   XOR, ADD64, SRL32(v, k), SRL64(v, k), MULLO, MULU, MINU, MAXU
 *                       the lane operations (MULU: vpmuludq; MINU, MAXU: unsigned 32-bit)
 *   COUNT(g, k, lo, hi) lo, hi: the low and high halves of g + 0 .. g + NV - 1 (uint64 g;
 *                       k: the keys, for iota and one)
 *   GIDX(p, lo, hi)     lo, hi: the halves of the NV int64 at p
 *   LIMB(W, p, j, m16)  limb j of NV elements of W bytes at p (m16: 0xFFFF in every lane)
 *   SUM64(v)            the sum of v's 64-bit lanes (uint64)
 * and undefines them at its end, so the next inclusion starts from nothing.
 */
#define DCR_SDCAT2(a, b) a##b
#define DCR_SDCAT(a, b) DCR_SDCAT2(a, b)
#define FS(name) DCR_SDCAT(name, SFX)
#define SDV_GROUPS 4

/* one call's keys as vectors, and one block's sums (sw: r's 64-bit lanes whole, so: their odd
 * halves; sx, sy: r * limb j of the new and of the old bits) */
typedef struct {
    VEC m1, m2, vs1, vs2, one, pm1, iota, low16, vt[4];
} FS(sdv_keys);
typedef struct {
    VEC sw[4], so[4], sx[4][2], sy[4][2];
} FS(sdv_sums);

TGT static inline VEC FS(sdv_mix)(VEC h, VEC m1, VEC m2) {
    h = XOR(h, SRL32(h, 16));
    h = MULLO(h, m1);
    h = XOR(h, SRL32(h, 15));
    h = MULLO(h, m2);
    return XOR(h, SRL32(h, 16));
}

/* G groups of NV elements from i on (G, W and OLD constants: the loops unroll) */
TGT static inline __attribute__((always_inline)) void FS(sdv_groups)(
        const int G, const int W, const char *x, const char *y, const int64_t *gidx, int64_t start, int64_t i,
        const FS(sdv_keys) *k, FS(sdv_sums) *s, const int OLD) {
    const int NL = W == 4 ? 2 : 1;
    VEC v[SDV_GROUPS], xl[SDV_GROUPS][2], yl[SDV_GROUPS][2];
    for (int q = 0; q < G; q++) {
        const int64_t j = i + NV * q;
        VEC lo, hi;
        if (gidx) GIDX(gidx + j, lo, hi);
        else COUNT((uint64_t)(start + j), k, lo, hi);  /* a carry past 2^32 goes to the high half */
        VEC u = FS(sdv_mix)(XOR(lo, k->vs1), k->m1, k->m2);
        u = FS(sdv_mix)(XOR(XOR(u, k->vs2), hi), k->m1, k->m2);
        v[q] = XOR(u, SRL32(u, 16));  /* every lane's first mix step */
        for (int m = 0; m < NL; m++) {
            xl[q][m] = LIMB(W, x + j * W, m, k->low16);
            if (OLD) yl[q][m] = LIMB(W, y + j * W, m, k->low16);
        }
    }
    for (int q = 0; q < G; q++)
        for (int l = 0; l < 4; l++) {
            VEC h = MULLO(XOR(v[q], k->vt[l]), k->m1);  /* sdv_mix after its first step */
            h = MULLO(XOR(h, SRL32(h, 15)), k->m2);
            h = XOR(h, SRL32(h, 16));
            const VEC r = MINU(MAXU(SRL32(h, 1), k->one), k->pm1);
            const VEC ro = SRL64(r, 32);
            s->sw[l] = ADD64(s->sw[l], r);
            s->so[l] = ADD64(s->so[l], ro);
            for (int m = 0; m < NL; m++) {
                s->sx[l][m] = ADD64(s->sx[l][m], ADD64(MULU(r, xl[q][m]), MULU(ro, SRL64(xl[q][m], 32))));
                if (OLD) s->sy[l][m] = ADD64(s->sy[l][m], ADD64(MULU(r, yl[q][m]), MULU(ro, SRL64(yl[q][m], 32))));
            }
        }
}

TGT static inline __attribute__((always_inline)) void FS(sdv_run)(
        const int W, const void *xp, const void *yp, const int64_t *gidx, int64_t start, int64_t n, uint32_t s1,
        uint32_t s2, const uint32_t *t, uint64_t acc[4][5], uint64_t old[4][5], const int OLD) {
    const int NL = W == 4 ? 2 : 1;
    const char *x = (const char *)xp, *y = (const char *)yp;
    const int64_t nv = n - n % NV;
    FS(sdv_keys) k;
    k.m1 = SET1(0x7FEB352Du);
    k.m2 = SET1(0x31848BABu);
    k.vs1 = SET1(s1);
    k.vs2 = SET1(s2);
    k.one = SET1(1u);
    k.pm1 = SET1((uint32_t)(SD_P - 1));
    k.low16 = SET1(0xFFFFu);
    k.iota = IOTA;
    for (int l = 0; l < 4; l++)  /* each lane's key with its mix's first step applied: t ^ t >> 16 (see above) */
        k.vt[l] = SET1(t[l] ^ t[l] >> 16);
    for (int64_t b0 = 0; b0 < nv; b0 += SD_BLOCK) {
        const int64_t b1 = b0 + SD_BLOCK < nv ? b0 + SD_BLOCK : nv;
        FS(sdv_sums) s;
        for (int l = 0; l < 4; l++)
            s.sw[l] = s.so[l] = s.sx[l][0] = s.sx[l][1] = s.sy[l][0] = s.sy[l][1] = ZERO;
        int64_t i = b0;
        for (; i + NV * SDV_GROUPS <= b1; i += NV * SDV_GROUPS)
            FS(sdv_groups)(SDV_GROUPS, W, x, y, gidx, start, i, &k, &s, OLD);
        for (; i < b1; i += NV) FS(sdv_groups)(1, W, x, y, gidx, start, i, &k, &s, OLD);
        /* a block's sums: r < 2^31 over SD_BLOCK / NV <= 512 elements per 64-bit lane half (< 2^40;
         * sw wraps mod 2^64, and sw - 2^32 so is the even halves' sum exactly), r * limb < 2^47
         * over 2 * 512 (< 2^57) */
        for (int l = 0; l < 4; l++) {
            const uint64_t odd = SUM64(s.so[l]);
            const uint64_t even = SUM64(s.sw[l]) - (odd << 32);
            acc[l][0] = sd_mod(acc[l][0] + sd_mod(even + odd));
            for (int m = 0; m < NL; m++) {
                acc[l][m + 1] = sd_mod(acc[l][m + 1] + sd_mod(SUM64(s.sx[l][m])));
                if (OLD) old[l][m + 1] = sd_mod(old[l][m + 1] + sd_mod(SUM64(s.sy[l][m])));
            }
        }
    }
    if (n > nv) {
        const int w = W == 1 ? 0 : W == 2 ? 1 : 2;
        (OLD ? sdc_table_plain : sd_table_plain)[w](x + nv * W, OLD ? y + nv * W : NULL, gidx ? gidx + nv : NULL,
                                                    start + nv, n - nv, s1, s2, t, acc, old);
    }
}

#define DCR_SDV_FN(NAME, W, OLD)                                                                      \
    TGT static void FS(NAME)(const void *x, const void *y, const int64_t *gidx, int64_t start, int64_t n, \
                             uint32_t s1, uint32_t s2, const uint32_t *t, uint64_t acc[4][5],          \
                             uint64_t old[4][5]) {                                                    \
        FS(sdv_run)(W, x, OLD ? y : NULL, gidx, start, n, s1, s2, t, acc, old, OLD);                 \
    }
DCR_SDV_FN(sdv1, 1, 0)
DCR_SDV_FN(sdv2, 2, 0)
DCR_SDV_FN(sdv4, 4, 0)
DCR_SDV_FN(sdcv1, 1, 1)
DCR_SDV_FN(sdcv2, 2, 1)
DCR_SDV_FN(sdcv4, 4, 1)

#undef DCR_SDV_FN
#undef SDV_GROUPS
#undef FS
#undef DCR_SDCAT
#undef DCR_SDCAT2
#undef SFX
#undef TGT
#undef VEC
#undef NV
#undef SET1
#undef ZERO
#undef IOTA
#undef XOR
#undef ADD64
#undef SRL32
#undef SRL64
#undef MULLO
#undef MULU
#undef MINU
#undef MAXU
#undef COUNT
#undef GIDX
#undef LIMB
#undef SUM64
