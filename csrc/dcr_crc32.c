/* CRC-32 (zlib's: the reflected polynomial 0xEDB88320, as zlib.crc32 computes it) by carry-less
 * multiplication. Every chunk's payload is checked with it on both sides; zlib's table code ran at
 * ~4 GB/s here and was a tenth of a keyframe sync's CPU (perf). Folding 64 bytes a step with
 * PCLMULQDQ (Intel, "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction",
 * 2009; the constants and the order of the final reductions as in Linux's crc32-pclmul_asm.S).
 *
 * dcr_crc32 returns -1 where the CPU has no PCLMULQDQ and SSE4.1 (or this is not x86-64): the
 * caller then uses zlib. Buffers shorter than 64 bytes are the caller's too. */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define TGT_CLMUL __attribute__((target("pclmul,sse4.1")))

TGT_CLMUL static inline __m128i fold16(__m128i x, __m128i k, __m128i data) {
    /* x.lo * k.lo ^ x.hi * k.hi ^ data: x moved 128 (or 512) bits further and added to data */
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
}

/* crc: the running state (not inverted); len >= 64 and a multiple of 16 */
TGT_CLMUL static uint32_t crc_fold(uint32_t crc, const uint8_t *p, int64_t len) {
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);  /* fold by 512 bits */
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  /* fold by 128 bits */
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);                  /* 64 -> 32 bits */
    const __m128i pmu = _mm_set_epi64x(0x1f7011641LL, 0x1db710641LL);    /* Barrett: mu, P' */
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
    __m128i x1 = _mm_loadu_si128((const __m128i *)p), x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32)), x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    p += 64;
    len -= 64;
    while (len >= 64) {
        x1 = fold16(x1, k1k2, _mm_loadu_si128((const __m128i *)p));
        x2 = fold16(x2, k1k2, _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = fold16(x3, k1k2, _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = fold16(x4, k1k2, _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        len -= 64;
    }
    x1 = fold16(x1, k3k4, x2);
    x1 = fold16(x1, k3k4, x3);
    x1 = fold16(x1, k3k4, x4);
    while (len >= 16) {
        x1 = fold16(x1, k3k4, _mm_loadu_si128((const __m128i *)p));
        p += 16;
        len -= 16;
    }
    /* 128 -> 64 bits (with 32 zero bits appended), 64 -> 32, then Barrett reduction */
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, k3k4, 0x10));
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 4), _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00));
    __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), pmu, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), pmu, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x1, t), 1);
}

static int have_clmul(void) {
    static int v = -1;
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    }
    return v;
}
#endif

static uint32_t crc_table[256];
static int table_made;

static uint32_t crc_bytes(uint32_t crc, const uint8_t *p, int64_t len) {
    if (!table_made) {  /* idempotent: racing threads write the same values */
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int j = 0; j < 8; j++) c = c & 1 ? (c >> 1) ^ 0xEDB88320u : c >> 1;
            crc_table[i] = c;
        }
        table_made = 1;
    }
    while (len--) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

/* *out = zlib.crc32(p[0:len], value); 0, or -1 (nothing written) where this CPU cannot or the
 * buffer is shorter than 64 bytes. */
int dcr_crc32(const void *p, int64_t len, uint32_t value, uint32_t *out) {
#if defined(__x86_64__) || defined(_M_X64)
    if (len < 64 || !have_clmul()) return -1;
    const uint8_t *b = p;
    int64_t body = len & ~(int64_t)15;
    uint32_t crc = crc_fold(~value, b, body);
    *out = ~crc_bytes(crc, b + body, len - body);
    return 0;
#else
    (void)p; (void)len; (void)value; (void)out; (void)crc_bytes;
    return -1;
#endif
}

/* zlib.crc32(p[0:len], value) of any buffer on any CPU: dcr_crc32 where it runs, else the table
 * (a kernel that checks many small chunks' payloads in one call: dcr_cls_decode_streams_many) */
uint32_t dcr_crc32_any(const void *p, int64_t len, uint32_t value) {
    uint32_t out;
    if (dcr_crc32(p, len, value, &out) == 0) return out;
    return ~crc_bytes(~value, (const uint8_t *)p, len);
}
