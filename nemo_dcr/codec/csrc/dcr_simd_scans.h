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
 *   NEQ(o, nw)       mask of the 64 elements that differ between o and nw
 *   NTH(e, at)       the index of bit number `at` (from 0) among the set bits of e
 * and undefines them at its end, so the next inclusion starts from nothing.
 */
#define DCR_CAT2(a, b) a##b
#define DCR_CAT(a, b) DCR_CAT2(a, b)
#define F(name) DCR_CAT(name, SFX)

/* pass A of the encoder: the changed positions */
TGT static int64_t F(find_changes)(const uint16_t *o, const uint16_t *nw, int64_t n,
                                   int64_t **cidx, uint64_t **rank, int64_t *cap) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i += 64) {
        uint64_t m;
        if (i + 64 <= n) {
            m = NEQ(o + i, nw + i);
        } else {
            m = 0;
            for (int64_t j = i; j < n; j++) if (o[j] != nw[j]) m |= 1ULL << (j - i);
        }
        while (m) {
            if (push_change(cidx, rank, cap, &k, i + __builtin_ctzll(m), 0)) return -1;
            m &= m - 1;
        }
    }
    return k;
}

/* pass B of the encoder (cls: each change's class). Returns 0, or -2 when more than MAXA
 * classes have changes (use the scalar pass). */
TGT static int F(rank)(const uint16_t *o, int64_t n, int mant, int lo, int hi, const int64_t *cidx,
                       const uint8_t *cls, int64_t k, uint64_t *rank) {
    int slot[256], act[MAXA], A = 0;
    for (int c = 0; c < 256; c++) slot[c] = -1;
    for (int64_t j = 0; j < k; j++) {
        int c = cls[j];
        if (slot[c] < 0) { if (A == MAXA) return -2; slot[c] = A; act[A++] = c; }
    }
    uint64_t cnt[MAXA] = {0};
    ACT_T vact[MAXA];
    for (int a = 0; a < A; a++) vact[a] = ACT(act[a]);
    const CTX_T ctx = CTX(mant, lo, hi);
    int64_t j = 0, i;
    for (i = 0; i + 64 <= n && j < k; i += 64) {
        BLK_T cb = CLASSES(&ctx, o + i);
        for (; j < k && cidx[j] < i + 64; j++) {  /* this block's changes: members before them */
            int b = (int)(cidx[j] - i), s = slot[cls[j]];
            uint64_t e = EQ(cb, vact[s]);
            rank[j] = cnt[s] + (uint64_t)__builtin_popcountll(e & ((1ULL << b) - 1));
        }
        for (int a = 0; a < A; a++) cnt[a] += (uint64_t)__builtin_popcountll(EQ(cb, vact[a]));
    }
    for (; i < n && j < k; i++) {  /* the tail, scalar */
        int s = slot[class_of(o[i], 0x7FFF, mant, lo, hi)];
        if (cidx[j] == i) rank[j++] = cnt[s];
        if (s >= 0) cnt[s]++;
    }
    return 0;
}

/* the decoder's scan. table: the active classes (table order), start: where each class's
 * changes begin in the class-ordered rk/dv. Returns the number of changes written, -2 (use the
 * scalar scan) or -3 (a rank past its class). */
TGT static int64_t F(scan_decode)(const uint16_t *o, int64_t n, int mant, int lo, int hi, const int64_t *table,
                                  int64_t ntab, const int64_t *start, const uint64_t *rk, const uint64_t *dv,
                                  int64_t *idx_out, uint16_t *new_out) {
    if (ntab > MAXA) return -2;
    const uint64_t mask = 0xFFFF, sign = 0x8000;
    /* the live classes, compacted (a class leaves when its last change is out): its class, how
     * many of its members to skip before its next change, and where its changes are */
    ACT_T vact[MAXA];
    int cls[MAXA];
    uint64_t rem[MAXA];
    int64_t next[MAXA], endc[MAXA];
    int L = (int)ntab;
    for (int a = 0; a < L; a++) {
        int c = (int)table[TAB * a];
        cls[a] = c; vact[a] = ACT(c);
        next[a] = start[c]; endc[a] = start[c] + table[TAB * a + 1]; rem[a] = rk[next[a]];
    }
    const CTX_T ctx = CTX(mant, lo, hi);
    int64_t out = 0, i;
#define DCR_DROP(x) do { L--; cls[x] = cls[L]; vact[x] = vact[L]; rem[x] = rem[L]; next[x] = next[L]; endc[x] = endc[L]; } while (0)
    for (i = 0; i + 64 <= n && L; i += 64) {
        BLK_T cb = CLASSES(&ctx, o + i);
        int64_t first = out;
        for (int x = 0; x < L; x++) {
            uint64_t e = EQ(cb, vact[x]);
            uint64_t pc = (uint64_t)__builtin_popcountll(e);
            if (__builtin_expect(pc <= rem[x], 1)) { rem[x] -= pc; continue; }
            uint64_t at = rem[x];  /* index among the class's members in this block */
            for (;;) {
                int b = NTH(e, at);
                int64_t jj = next[x]++;
                uint64_t u = o[i + b];
                idx_out[out] = i + b;
                new_out[out] = (uint16_t)unkey((key_of(u, mask, sign) + dv[jj]) & mask, mask, sign);
                out++;
                if (next[x] == endc[x]) break;
                at += 1 + (rk[next[x]] - rk[jj] - 1);
                if (at >= pc) { rem[x] = at - pc; break; }
            }
            if (next[x] == endc[x]) {  /* done: stop counting it */
                DCR_DROP(x);
                x--;
            }
        }
        /* the block's changes came class by class: put them in position order */
        for (int64_t p = first + 1; p < out; p++) {
            int64_t ix = idx_out[p]; uint16_t v = new_out[p]; int64_t q = p - 1;
            while (q >= first && idx_out[q] > ix) { idx_out[q + 1] = idx_out[q]; new_out[q + 1] = new_out[q]; q--; }
            idx_out[q + 1] = ix; new_out[q + 1] = v;
        }
    }
    for (; i < n && L; i++) {  /* the tail, scalar */
        uint64_t u = o[i];
        int c = class_of(u, 0x7FFF, mant, lo, hi);
        for (int x = 0; x < L; x++) {
            if (cls[x] != c) continue;
            if (rem[x]) { rem[x]--; break; }
            int64_t jj = next[x]++;
            idx_out[out] = i;
            new_out[out] = (uint16_t)unkey((key_of(u, mask, sign) + dv[jj]) & mask, mask, sign);
            out++;
            if (next[x] == endc[x]) DCR_DROP(x);
            else rem[x] = rk[next[x]] - rk[jj] - 1;
            break;
        }
    }
#undef DCR_DROP
    return L ? -3 : out;
}

#undef F
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
