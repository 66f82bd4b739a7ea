/* The vector element scans of the classes coding, for 2-byte dtypes, 64 elements per block:
 * the 64 classes of a block, one compare per *active* class (a class with changes) gives that
 * class's members in the block as a 64-bit mask, and popcounts keep the per-class counts and
 * locate ranks inside the block. Their results are the scalar scans' (dcr_classes.c), which the
 * tests check on every path.
 *
 * Written once, included by dcr_classes.c once per instruction set (AVX-512BW, AVX2), which
 * defines before each inclusion:
 *   SFX              the suffix of the functions' names
 *   TGT              their target attribute
 *   CTX_T, CTX       the per-scan constants: CTX(mant, lo, hi)
 *   BLK_T, CLASSES   the classes of one block: CLASSES(&ctx, p), clamped to lo..hi
 *   ACT_T, ACT       one class to compare with: ACT(c)
 *   EQ(cb, act)      mask of the block's members of that class (bit b: element b)
 *   LDB(p), STB(p,cb) load / store a block's classes as 64 bytes at p (64-byte aligned)
 *   BLOCK_OF(cum, r) how many of the 64 int16 cum[0..63] (nondecreasing, < 0x7FFF) are <= r
 *   NEQ(o, nw)       mask of the 64 elements that differ between o and nw
 *   NTH(e, at)       the index of bit number `at` (from 0) among the set bits of e
 * and undefines them at its end, so the next inclusion starts from nothing. With DCR_SELECT_ONLY
 * defined only the scans that select a bit by NTH are made (the decoder's scan, run_select).
 */
#define DCR_CAT2(a, b) a##b
#define DCR_CAT(a, b) DCR_CAT2(a, b)
#define F(name) DCR_CAT(name, SFX)
#ifndef DSEG_FIND
#define DSEG_FIND 4096  /* how often find_changes sets its slots */
#endif

#ifndef DCR_SELECT_ONLY
/* pass A of the encoder: the changes (found_t: positions, old and new bits), and each whole
 * block's classes before its changes, unclamped, into ca (n bytes, 64-aligned): pass B counts
 * them there instead of reading the base a second time from memory (a third of the encode's
 * reads). wb (o itself, or NULL): a block's changes then written into it (WBLK), the block in L1.
 * The elements after the last whole block are left to pass B, which reads them in the base.
 * Its state is kept in locals: stores through f's arrays may alias f itself, and push_change
 * reloaded f's fields for every change. A block's first `slots` changes are written to fixed
 * places without a branch on how many it has (a slot past them gets a scratch copy of the
 * block's last element, overwritten later; 64 places are always free): a loop per block ended
 * on a different count each time, a misprediction for about every other block at 1 %. `slots`
 * follows the changes a block of the last segment held (2, 4 or 8, so that a block rarely has
 * more; those take the loop). */
#define DCR_SLOT(s) do { const int64_t at = i + __builtin_ctzll(m | (1ULL << 63)); \
                         ix[k + (s)] = at; ov[k + (s)] = o[at]; nv[k + (s)] = nw[at]; m &= m - 1; } while (0)
TGT static int64_t F(find_changes)(const uint16_t *o, const uint16_t *nw, int64_t n, int mant, found_t *f,
                                   uint8_t *ca, uint16_t *wb) {
    int64_t k = f->k, i = 0, seg = 0;
    int64_t *ix = f->idx;
    uint16_t *ov = (uint16_t *)f->ov, *nv = (uint16_t *)f->nv;
    const CTX_T all = CTX(mant, 0, 255);  /* (no clamp: the class range is not known yet) */
    int slots = 2;
    for (; i + 64 <= n; i += 64) {
        if (__builtin_expect(f->cap - k < 64, 0)) {
            if (found_grow(f, k + 64)) { f->k = k; return -1; }
            ix = f->idx; ov = (uint16_t *)f->ov; nv = (uint16_t *)f->nv;
        }
        STB(ca + i, CLASSES(&all, o + i));
        uint64_t m = NEQ(o + i, nw + i);
        const uint64_t changed = m;
        const int c = __builtin_popcountll(m);
        DCR_SLOT(0); DCR_SLOT(1);
        if (slots > 2) { DCR_SLOT(2); DCR_SLOT(3); }
        if (slots > 4) { DCR_SLOT(4); DCR_SLOT(5); DCR_SLOT(6); DCR_SLOT(7); }
        if (__builtin_expect(c > slots, 0))
            for (int s = slots; m; s++) DCR_SLOT(s);
        if (wb) WBLK(wb + i, nw + i, changed);  /* (after the slots: they read the old bits there) */
        k += c;
        if (((i + 64) & (DSEG_FIND - 1)) == 0) {  /* a segment's changes a block: the next's slots */
            const int64_t per = (k - seg) * 64;  /* x DSEG_FIND / 64 */
            slots = per < DSEG_FIND ? 2 : per < 5 * DSEG_FIND / 2 ? 4 : 8;
            seg = k;
        }
    }
    f->k = k;
    for (; i < n; i++)
        if (o[i] != nw[i] && push_change(f, i, o[i], nw[i])) return -1;
    return f->k;
}
#undef DCR_SLOT
#endif

#ifndef DSEG
#define DSEG 4096
#endif
/* The members of one, two or four classes (act[0..g-1]; DCR_GROUP gives g) in each of a
 * segment's nb blocks of classes cb, counted in one pass: one load of a block feeds each class's
 * compare (a pass per class spent more on the loop and the load than on the compare). Row h of
 * cum (g consecutive rows) gets cum[h][b + 1], the class's members in blocks 0..b, and
 * cum[h][0] = 0; tt[h] the segment's total. Both scans count this way: the encoder's rank pass
 * and the decoder's scan. */
#define DCR_COUNT(h) cum[h][b + 1] = (int16_t)(t##h += (uint32_t)__builtin_popcountll(EQ(v, a##h)))
TGT static inline __attribute__((always_inline)) void F(count_classes)(const uint8_t *cb, int nb, const ACT_T *act,
                                                                        int g, int16_t (*cum)[DSEG / 64 + 1],
                                                                        uint32_t *tt) {
    if (g == 4) {
        const ACT_T a0 = act[0], a1 = act[1], a2 = act[2], a3 = act[3];
        uint32_t t0 = 0, t1 = 0, t2 = 0, t3 = 0;
        cum[0][0] = cum[1][0] = cum[2][0] = cum[3][0] = 0;
        for (int b = 0; b < nb; b++) { const BLK_T v = LDB(cb + 64 * b); DCR_COUNT(0); DCR_COUNT(1); DCR_COUNT(2); DCR_COUNT(3); }
        tt[0] = t0; tt[1] = t1; tt[2] = t2; tt[3] = t3;
    } else if (g == 2) {
        const ACT_T a0 = act[0], a1 = act[1];
        uint32_t t0 = 0, t1 = 0;
        cum[0][0] = cum[1][0] = 0;
        for (int b = 0; b < nb; b++) { const BLK_T v = LDB(cb + 64 * b); DCR_COUNT(0); DCR_COUNT(1); }
        tt[0] = t0; tt[1] = t1;
    } else {
        const ACT_T a0 = act[0];
        uint32_t t0 = 0;
        cum[0][0] = 0;
        for (int b = 0; b < nb; b++) { const BLK_T v = LDB(cb + 64 * b); DCR_COUNT(0); }
        tt[0] = t0;
    }
}
#undef DCR_COUNT
/* how many of the `left` classes still to count go in one pass */
#define DCR_GROUP(left) ((left) >= 4 ? 4 : (left) >= 2 ? 2 : 1)

/* A segment's classes (nb blocks from os) into cb, and meanwhile the base bits after it (`ahead`
 * bytes of them, at most a segment's) asked for, two cache lines a block, so that they arrive
 * while this segment is counted: a scan is otherwise a burst of DRAM reads, then L1-only work
 * with no read in flight. Into the L2 cache, not L1: the decoder's non-temporal prefetches (into
 * L1 alone, then nowhere) were evicted by the segment's own work and read from DRAM again: a
 * delta sync spent 39-40 ms of CPU with them against 31-32 into every level, and a publisher's
 * diff, whose rank pass had none, ~5 % more (45M BF16 at 1 %, Intel Xeon; docs/results.md,
 * format 4, second turn). Into L2 alone a delta sync then spent 4-12 % less CPU than into every
 * level (45M BF16 at 1 % and 3 %; Zen 4, four alternated pairs of builds, docs/results.md, "A
 * scan's prefetches into L2"). The reason is not measured; L1 is 32 KiB there, and a segment
 * ahead (8 KiB) shares it with the segment being counted, its class buffer and the outputs. */
TGT static inline __attribute__((always_inline)) void F(segment_classes)(const uint16_t *os, int nb, int64_t ahead,
                                                                          const CTX_T *ctx, uint8_t *cb) {
    const char *nxt = (const char *)(os + DSEG);
    const int pf = ahead > 0 ? (int)(ahead < DSEG * 2 ? ahead : DSEG * 2) : 0;
    for (int b = 0; b < nb; b++) {
        if (128 * b < pf) {
            __builtin_prefetch(nxt + 128 * b, 0, 2);
            __builtin_prefetch(nxt + 128 * b + 64, 0, 2);
        }
        STB(cb + 64 * b, CLASSES(ctx, os + 64 * b));
    }
}

#ifndef DCR_SELECT_ONLY
/* pass B of the encoder (cls: each change's class). Returns 0, or -2 when more than MAXA
 * classes have changes (use the scalar pass).
 *
 * Segment by segment (DSEG elements, whole blocks), as the decoder's scan: the segment's classes
 * (clamped from pass A's, ca; or, where ca is NULL, computed from the base bits) go into a byte
 * buffer (L1-resident), each active class's members counted block
 * by block, four classes a pass (count_classes; cum: members in the blocks before each), and then
 * each change of the segment gets its rank without a branch: the members of its class before its
 * segment, before its block, and before it in its block. Placing the changes while walking the
 * blocks (a "does this block hold the next change" test per block, with ~0.6 changes per block at
 * 1 %) mispredicted about once per block and cost more than the counting. wb (o itself, or
 * NULL): each change's new bits (nv) written there once its segment's classes are made, where
 * pass A has not (ca NULL; and the elements after the last whole block, in the tail loop). */
TGT static int F(rank)(const uint16_t *o, const uint8_t *ca, int64_t n, int mant, int lo, int hi,
                       const int64_t *cidx, const uint8_t *cls, int64_t k, uint64_t *rank, uint16_t *wb,
                       const uint16_t *nv) {
    int slot[256], act[MAXA], A = 0;
    for (int c = 0; c < 256; c++) slot[c] = -1;
    for (int64_t j = 0; j < k; j++) {
        int c = cls[j];
        if (slot[c] < 0) { if (A == MAXA) return -2; slot[c] = A; act[A++] = c; }
    }
    uint64_t before[MAXA] = {0};  /* members in the segments done */
    ACT_T vact[MAXA];
    for (int a = 0; a < A; a++) vact[a] = ACT(act[a]);
    const CTX_T ctx = CTX(mant, lo, hi);
    uint8_t cb[DSEG] __attribute__((aligned(64)));  /* the segment's classes */
    int16_t cum[MAXA][DSEG / 64 + 1];               /* per active class: members before each block */
    uint32_t tot[MAXA];                             /* per active class: members in the segment */
    int64_t j = 0, i = 0;
    while (i + 64 <= n && j < k) {
        const int nb = (int)((n - i) / 64 < DSEG / 64 ? (n - i) / 64 : DSEG / 64);  /* whole blocks */
        const uint16_t *os = o + i;
        if (ca) {  /* pass A's classes, clamped */
            for (int b = 0; b < nb; b++) STB(cb + 64 * b, CLAMPB(&ctx, LDB(ca + i + 64 * b)));
        } else {
            F(segment_classes)(os, nb, (n - i - DSEG) * 2, &ctx, cb);
        }
        for (int a0 = 0; a0 < A; ) {
            const int g = DCR_GROUP(A - a0);
            F(count_classes)(cb, nb, vact + a0, g, cum + a0, tot + a0);
            a0 += g;
        }
        const int64_t end = i + 64 * (int64_t)nb;
        for (; j < k && cidx[j] < end; j++) {
            const int p = (int)(cidx[j] - i), b = p >> 6, s = slot[cls[j]];
            const uint64_t e = EQ(LDB(cb + 64 * b), vact[s]);
            rank[j] = before[s] + (uint64_t)cum[s][b] + (uint64_t)__builtin_popcountll(e & ((1ULL << (p & 63)) - 1));
            if (wb && !ca) wb[cidx[j]] = nv[j];  /* its segment's classes are in cb: its base bits are read */
        }
        for (int a = 0; a < A; a++) before[a] += tot[a];
        i = end;
    }
    for (; i < n && j < k; i++) {  /* the tail, scalar */
        int s = slot[class_of(o[i], 0x7FFF, mant, lo, hi)];
        if (cidx[j] == i) {
            if (wb) wb[i] = nv[j];
            rank[j++] = before[s];
        }
        if (s >= 0) before[s]++;
    }
    return 0;
}
#endif

/* the decoder's scan. table: the active classes (table order), start: where each class's
 * changes begin in the class-ordered rk/dv. Returns the number of changes written, -2 (use the
 * scalar scan) or -3 (a rank past its class).
 *
 * Segment by segment (DSEG elements, whole blocks): the segment's classes are computed once
 * into a byte buffer (L1-resident). Then one pass over the buffer per four live classes (one
 * load of a block feeds four compares) counts each one's members block by block (cum: members
 * in the blocks before each), and each of a class's changes that falls in the segment is placed
 * without a branch: its block by counting the entries of cum not above its rank (BLOCK_OF: a
 * few vector compares), its bit by NTH. Last, the segment's change marks give each change its
 * place in position order. The only unpredictable branch is the end of a class's changes in a
 * segment (walking block by block with a "does this block hold the change" test, as before,
 * cost about three mispredictions per change and most of the decode's time).
 *
 * wb (o itself, or NULL): each change's new bits are also written there as it is placed, while
 * its segment is in L1 (a scatter afterwards found the chunk out of L2 and cost more). Every
 * read of a segment's base bits comes before its first write. On -3 nothing stays written. */
TGT static int64_t F(scan_decode)(const uint16_t *o, int64_t n, int mant, int lo, int hi, const int64_t *table,
                                  int64_t ntab, const int64_t *start, const uint64_t *rk, const uint64_t *dv,
                                  int64_t *idx_out, uint16_t *new_out, uint16_t *old_out, uint16_t *wb) {
    if (ntab > MAXA) return -2;
    const uint64_t mask = 0xFFFF, sign = 0x8000;
    /* the live classes, compacted (a class leaves when its last change is out): its class, its
     * members in the segments done (in the scalar tail: its members still to skip before its
     * next change), and where its changes are */
    ACT_T vact[MAXA];
    int cls[MAXA];
    uint64_t before[MAXA];
    int64_t next[MAXA], endc[MAXA];
    int L = (int)ntab;
    for (int a = 0; a < L; a++) {
        int c = (int)table[TAB * a];
        cls[a] = c; vact[a] = ACT(c);
        next[a] = start[c]; endc[a] = start[c] + table[TAB * a + 1]; before[a] = 0;
    }
    const CTX_T ctx = CTX(mant, lo, hi);
    uint8_t cb[DSEG] __attribute__((aligned(64)));  /* the segment's classes */
    /* a class's members before each block: cum[b] for block b; cum + 1 is what BLOCK_OF reads */
    int16_t cum[4][DSEG / 64 + 1] __attribute__((aligned(64)));
    uint64_t marks[DSEG / 64];                      /* the segment's changes */
    uint32_t pre[DSEG / 64];                        /* changes before each block */
    uint16_t sp[DSEG], sd[DSEG];                    /* the segment's changes: place, difference */
    int64_t out = 0, i = 0;
#define DCR_DROP(x) do { L--; cls[x] = cls[L]; vact[x] = vact[L]; before[x] = before[L]; next[x] = next[L]; endc[x] = endc[L]; } while (0)
    while (i + 64 <= n && L) {
        const int nb = (int)((n - i) / 64 < DSEG / 64 ? (n - i) / 64 : DSEG / 64);  /* whole blocks */
        const uint16_t *os = o + i;
        F(segment_classes)(os, nb, (n - i - DSEG) * 2, &ctx, cb);
        memset(marks, 0, (size_t)nb * 8);
        for (int h = 0; h < 4; h++)
            for (int b = nb + 1; b <= DSEG / 64; b++) cum[h][b] = 0x7FFF;  /* past the segment: never <= a rank */
        int ns = 0;
        for (int x0 = 0; x0 < L; ) {  /* the live classes up to four at a time */
            const int g = DCR_GROUP(L - x0);
            uint32_t tt[4];
            F(count_classes)(cb, nb, vact + x0, g, cum, tt);
            for (int h = 0; h < g; h++) {
                const int x = x0 + h;
                const ACT_T a = vact[x];
                const int16_t *cu = cum[h];
                const uint32_t t = tt[h];
                int64_t j = next[x];
                const int64_t e = endc[x];
                const uint64_t base = before[x];
                while (j < e && rk[j] - base < t) {
                    uint32_t r = (uint32_t)(rk[j] - base);  /* the change is the class's r-th member here */
                    int b = BLOCK_OF(cu + 1, r);
                    int p = 64 * b + NTH(EQ(LDB(cb + 64 * b), a), r - cu[b]);
                    marks[b] |= 1ULL << (p & 63);
                    sp[ns] = (uint16_t)p;
                    sd[ns++] = (uint16_t)dv[j];  /* (the difference mod 2^16: its new bits come in the pass below) */
                    j++;
                }
                next[x] = j;
                before[x] = base + t;
            }
            x0 += g;
        }
        for (int x = 0; x < L; x++)  /* a class whose last change is out: no longer counted */
            if (next[x] == endc[x]) { DCR_DROP(x); x--; }
        uint32_t c = 0;
        for (int b = 0; b < nb; b++) { pre[b] = c; c += (uint32_t)__builtin_popcountll(marks[b]); }
        for (int q = 0; q < ns; q++) {  /* each change to its place in position order, its new bits */
            /* (made here, not as the change is placed: its base bits are read once, for both) */
            int p = sp[q], b = p >> 6;
            int64_t at = out + pre[b] + __builtin_popcountll(marks[b] & ((1ULL << (p & 63)) - 1));
            const uint16_t u = os[p], nv = (uint16_t)unkey((key_of(u, mask, sign) + sd[q]) & mask, mask, sign);
            idx_out[at] = i + p;
            new_out[at] = nv;
            if (old_out) old_out[at] = u;
            if (wb) wb[i + p] = nv;
        }
        out += ns;
        i += 64 * (int64_t)nb;
    }
    for (int x = 0; x < L; x++) {  /* the tail's state: members to skip before the next change */
        if (rk[next[x]] < before[x]) {  /* (cannot happen: a change found earlier) */
            if (wb) for (int64_t q = 0; q < out; q++) wb[idx_out[q]] = old_out[q];
            return -3;
        }
        before[x] = rk[next[x]] - before[x];
    }
    for (; i < n && L; i++) {  /* the tail, scalar */
        uint64_t u = o[i];
        int c = class_of(u, 0x7FFF, mant, lo, hi);
        for (int x = 0; x < L; x++) {
            if (cls[x] != c) continue;
            if (before[x]) { before[x]--; break; }
            int64_t jj = next[x]++;
            idx_out[out] = i;
            new_out[out] = (uint16_t)unkey((key_of(u, mask, sign) + dv[jj]) & mask, mask, sign);
            if (old_out) old_out[out] = (uint16_t)u;
            if (wb) wb[i] = new_out[out];
            out++;
            if (next[x] == endc[x]) DCR_DROP(x);
            else before[x] = rk[next[x]] - rk[jj] - 1;
            break;
        }
    }
#undef DCR_DROP
    if (L && wb) for (int64_t q = 0; q < out; q++) wb[idx_out[q]] = old_out[q];
    return L ? -3 : out;
}

/* A receiver's runs (dcr_cls_run_counts, dcr_cls_run_select; scalar loops in dcr_classes.c):
 * a run of n elements at p, anywhere, 64 a block and the rest scalar. Per block, its classes once
 * (clamped to lo..hi), then one compare and popcount per class (counts) or per class with an
 * element still asked for (select): ~10x the scalar loops' 1.3-1.9 ns an element, whose
 * per-element table update was a dependency chain. Both leave the scalar loops' results. */

/* Both ask for the run's bits a segment (DSEG elements) ahead of the block they read, two cache
 * lines a block into every level: the count pass of a TP=2 group's rows (bench/ranks.py's
 * model) 13.3-14.5 -> 11.2-11.9 ms a version, by -DDCR_NO_RUN_PREFETCH builds alternated
 * (docs/results.md, format 4, third turn). Not into L2 alone, as the scans' (segment_classes):
 * there a TP=2 group's delta sync did not move beyond its noise (three alternated pairs of
 * builds, "A scan's prefetches into L2"), so they stay as measured. */
#ifndef DCR_NO_RUN_PREFETCH
#define DCR_RUN_AHEAD(p, i, n) do { if ((i) + DSEG + 64 <= (n)) { __builtin_prefetch((p) + (i) + DSEG, 0, 3); \
                                    __builtin_prefetch((p) + (i) + DSEG + 32, 0, 3); } } while (0)
#else
#define DCR_RUN_AHEAD(p, i, n) do { } while (0)
#endif

#ifndef DCR_SELECT_ONLY
/* counts[c - lo] += the run's elements of class c, for lo <= c <= hi (hi - lo < MAXA) */
TGT static void F(run_count)(const uint16_t *p, int64_t n, int mant, int lo, int hi, uint32_t *counts) {
    const int nc = hi - lo + 1;
    ACT_T vact[MAXA];
    uint32_t t[MAXA];
    for (int c = 0; c < nc; c++) { vact[c] = ACT(lo + c); t[c] = 0; }
    const CTX_T ctx = CTX(mant, lo, hi);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        DCR_RUN_AHEAD(p, i, n);
        const BLK_T v = CLASSES(&ctx, p + i);
        for (int c = 0; c < nc; c++) t[c] += (uint32_t)__builtin_popcountll(EQ(v, vact[c]));
    }
    for (; i < n; i++) t[class_of(p[i], 0x7FFF, mant, lo, hi) - lo]++;
    for (int c = 0; c < nc; c++) counts[c] += t[c];
}
#endif

/* run_select's loop (dcr_classes.c): cnt/want/next indexed by class - lo; the classes with an
 * element still asked for are compared, each block's members of a class found by NTH. Returns
 * the requests left unserved (0: all found). hi - lo < MAXA. */
TGT static int64_t F(run_select)(const uint16_t *p, int64_t n, int mant, int lo, int hi, uint32_t *cnt,
                                 uint32_t *want, int64_t *next, const int64_t *endc, const int64_t *within,
                                 int64_t left, int64_t *out) {
    const int nc = hi - lo + 1;
    ACT_T vact[MAXA];
    int live[MAXA], L = 0;  /* the classes still asked for */
    for (int c = 0; c < nc; c++) if (want[c] != UINT32_MAX) { live[L] = c; vact[L++] = ACT(lo + c); }
    const CTX_T ctx = CTX(mant, lo, hi);
    int64_t i = 0;
    for (; i + 64 <= n && left; i += 64) {
        DCR_RUN_AHEAD(p, i, n);
        const BLK_T v = CLASSES(&ctx, p + i);
        for (int x = 0; x < L; x++) {
            const int c = live[x];
            const uint64_t e = EQ(v, vact[x]);
            const uint32_t pc = (uint32_t)__builtin_popcountll(e);
            while (want[c] != UINT32_MAX && want[c] - cnt[c] < pc) {  /* (want >= cnt: each below was served) */
                const int64_t q = next[c]++;
                out[q] = i + NTH(e, want[c] - cnt[c]);
                want[c] = next[c] < endc[c] ? (uint32_t)within[next[c]] : UINT32_MAX;
                left--;
            }
            cnt[c] += pc;
            if (want[c] == UINT32_MAX) { L--; live[x] = live[L]; vact[x] = vact[L]; x--; }
        }
    }
    for (; i < n && left; i++) {  /* the tail, as the scalar loop */
        const int c = class_of(p[i], 0x7FFF, mant, lo, hi) - lo;
        if (__builtin_expect(cnt[c]++ == want[c], 0)) {
            const int64_t q = next[c]++;
            out[q] = i;
            want[c] = next[c] < endc[c] ? (uint32_t)within[next[c]] : UINT32_MAX;
            left--;
        }
    }
    return left;
}

#undef F
#undef DCR_RUN_AHEAD
#undef DCR_GROUP
#undef DCR_CAT
#undef DCR_CAT2
#undef SFX
#undef TGT
#undef CTX_T
#undef CTX
#undef BLK_T
#undef CLASSES
#undef ACT_T
#undef ACT
#undef EQ
#undef NEQ
#undef NTH
#undef LDB
#undef STB
#undef BLOCK_OF
#undef CLAMPB
#undef WBLK
