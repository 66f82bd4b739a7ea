/* The portable codings' element work (docs/format.md, "Chunk"): the `gaps` position coding
 * (nemo_dcr/codec/positions.py: the first position, then p[i] - p[i-1] - 1, each an unsigned
 * LEB128 varint) and the `add` value coding (nemo_dcr/codec/ordered.py: the zigzag of the
 * difference in the format's monotone order). Both are the references' arithmetic, byte for byte.
 *
 * An `auto` chunk whose `classes` coding costs more than a byte per change (updates of several
 * ulps) tries these codings too and keeps the smallest, so every such chunk pays for them. The
 * references are whole-tensor torch passes: for 4Mi BF16 elements at 1 % the gap varints took
 * 2.9 ms and the differences 0.8 ms, against 3.1 ms for the classes encode itself.
 *
 * The gap varints are written as every writer of format versions 1-3 has written them: one group
 * longer than needed, a continuation bit on the last needed group and a zero group after it
 * (0 is 0x80 0x00). The reference counts a group for values >= 2^63, a bound torch compares as
 * -2^63, so every value gets one more. Readers take any LEB128, and the golden files pin the
 * writers' bytes (docs/format.md, "Chunk"). */
#include <stdint.h>
#include <string.h>

static inline int varint_len(uint64_t v) {
    int n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}

/* the bytes of the gap varints of k increasing positions idx (>= 0), each written one group
 * longer than needed (above); -1 if they do not increase */
int64_t dcr_gaps_len(const int64_t *idx, int64_t k) {
    int64_t total = 0, prev = -1;
    for (int64_t i = 0; i < k; i++) {
        if (idx[i] <= prev) return -1;
        total += varint_len((uint64_t)(idx[i] - prev - 1)) + 1;
        prev = idx[i];
    }
    return total;
}

/* writes the gap varints (dcr_gaps_len bytes) to out; the number written, -1 as dcr_gaps_len */
int64_t dcr_gaps_encode(const int64_t *idx, int64_t k, uint8_t *out) {
    uint8_t *o = out;
    int64_t prev = -1;
    for (int64_t i = 0; i < k; i++) {
        if (idx[i] <= prev) return -1;
        uint64_t v = (uint64_t)(idx[i] - prev - 1);
        while (v >= 0x80) { *o++ = (uint8_t)(v | 0x80); v >>= 7; }
        *o++ = (uint8_t)(v | 0x80);
        *o++ = 0;
        prev = idx[i];
    }
    return (int64_t)(o - out);
}

/* the k positions, each below n, from len bytes of gap varints. 0, or: -1 the bytes do not hold
 * exactly k varints (the last byte included), -2 a varint of more than 10 bytes, -3 a position
 * at or past n (written to *bad). Nothing past k entries of out is written. */
int dcr_gaps_decode(const uint8_t *buf, int64_t len, int64_t k, int64_t n, int64_t *out, int64_t *bad) {
    int64_t j = 0, pos = -1;
    uint64_t v = 0;
    int shift = 0, bytes = 0;
    for (int64_t i = 0; i < len; i++) {
        uint8_t b = buf[i];
        if (++bytes > 10) return -2;
        if (shift < 64) v |= (uint64_t)(b & 0x7F) << shift;
        shift += 7;
        if (b & 0x80) continue;
        if (j == k) return -1;
        /* pos + 1 + v < n, without overflow */
        if (v >= (uint64_t)(n - pos - 1)) {
            *bad = v > (uint64_t)INT64_MAX - (uint64_t)pos - 1 ? -1 : (int64_t)((uint64_t)pos + 1 + v);
            return -3;
        }
        pos += 1 + (int64_t)v;
        out[j++] = pos;
        v = 0; shift = 0; bytes = 0;
    }
    return (j == k && bytes == 0) ? 0 : -1;
}

/* ordered.py's key for width w: floats map to their monotone order, integers stay */
#define KEYS(T, SIGN)                                                                     \
    static inline T key_##T(T u, int fl) { return fl ? ((u & SIGN) ? (T)~u : (T)(u | SIGN)) : u; } \
    static inline T unkey_##T(T k, int fl) { return fl ? ((k & SIGN) ? (T)(k ^ SIGN) : (T)~k) : k; }
KEYS(uint8_t, 0x80u)
KEYS(uint16_t, 0x8000u)
KEYS(uint32_t, 0x80000000u)

/* zigzag of d = key(new) - key(old) (mod 2^bits): 2s for s >= 0, -2s - 1 for s < 0, where s is
 * d read as signed; the inverse adds it back. -(top bit) is all ones for a negative s. */
#define ORDERED(T, TOP)                                                                    \
    static void enc_##T(const T *o, const T *nw, int64_t k, int fl, T *z) {               \
        for (int64_t i = 0; i < k; i++) {                                                  \
            T d = (T)(key_##T(nw[i], fl) - key_##T(o[i], fl));                             \
            z[i] = (T)((T)(d << 1) ^ (T)(0 - (T)(d >> TOP)));                              \
        }                                                                                  \
    }                                                                                      \
    static void dec_##T(const T *o, const T *z, int64_t k, int fl, T *nw) {               \
        for (int64_t i = 0; i < k; i++) {                                                  \
            T s = (T)((T)(z[i] >> 1) ^ (T)(0 - (T)(z[i] & 1)));                            \
            nw[i] = unkey_##T((T)(key_##T(o[i], fl) + s), fl);                             \
        }                                                                                  \
    }
ORDERED(uint8_t, 7)
ORDERED(uint16_t, 15)
ORDERED(uint32_t, 31)

/* ordered.encode (dir 0: old, new -> z) and ordered.decode (dir 1: old, z -> new) on k contiguous
 * values of w = 1, 2 or 4 bytes; -1 for another width */
int dcr_ordered(const void *old, const void *in, int64_t k, int w, int is_float, int dir, void *out) {
    int fl = is_float != 0;
    switch (w) {
    case 1: (dir ? dec_uint8_t : enc_uint8_t)(old, in, k, fl, out); return 0;
    case 2: (dir ? dec_uint16_t : enc_uint16_t)(old, in, k, fl, out); return 0;
    case 4: (dir ? dec_uint32_t : enc_uint32_t)(old, in, k, fl, out); return 0;
    default: return -1;
    }
}
