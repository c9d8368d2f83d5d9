/* The ggml types the kernels read (ids, block layouts, the x types' scheme, tables), scalar helpers and
 * the scalar dequantizer (bit-exact with ggml's).
 * Part of cpu_moe.c (every unit): included there, in order, never compiled alone. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HM_AVX2 1
#include <immintrin.h>
#else
#define HM_AVX2 0
#endif
#if HM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HM_AVX512 1
#else
#define HM_AVX512 0
#endif

#define HM_INLINE static inline __attribute__((always_inline))

/* Shared by the units (cpu_moe.c): hidden, so neither exported nor reached through the GOT (addressed as a static
 * is). HM_STATE: state set at run time (settings, tables built at load) that exists once: the main unit defines
 * it, the kernel units refer to it. */
#define HM_HIDDEN __attribute__((visibility("hidden")))
#if HM_MAIN
#define HM_STATE(decl, init) HM_HIDDEN decl = init
#else
#define HM_STATE(decl, init) extern HM_HIDDEN decl
#endif

/* Software prefetch, bytes ahead of the rows being computed in each thread's weight stream.
 * Hardware prefetchers stop at 4 KiB pages and keep too few misses in flight for one core to
 * stream at its share of bandwidth on high-latency (virtualized, many-core) memory. */
#ifndef HM_PF_DIST
#define HM_PF_DIST 16384   /* measured: 8-32 KiB all good on SPR; 16-32 KiB needed on the 2-vCPU VM */
#endif
#ifndef HM_PF_LOC
#define HM_PF_LOC 3        /* __builtin_prefetch locality: 3 = L1, 2 = L2 */
#endif

/* ggml type ids */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
    T_IQ4_NL = 20, T_BF16 = 30, T_MXFP4 = 39, T_Q2_K = 10, T_Q3_K = 11, T_IQ4_XS = 23, T_IQ2_K = 137, T_IQ3_K = 138,
    T_IQ4_K = 139, T_IQ4_KS = 144, T_IQ5_K = 140, T_IQ2_KS = 145, T_IQ2_KL = 157, T_IQ3_XXS = 18,
    T_IQ3_S = 21, T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ1_S = 19, T_IQ1_M = 29, T_IQ2_KT = 153, T_IQ3_KT = 154,
    T_IQ4_KT = 155,
};

/* dense type index used by the kernel tables */
enum { I_F32, I_F16, I_BF16, I_Q4_0, I_Q8_0, I_Q4_K, I_Q5_K, I_Q6_K, I_IQ4_NL, I_MXFP4, I_IQ4_XS, I_Q3_K, I_Q2_K,
       I_IQ4_KS, I_IQ4_K, I_IQ3_K, I_IQ2_K, I_IQ5_K, I_IQ2_KS, I_IQ2_KL, I_IQ3_XXS,
       I_IQ3_S, I_IQ2_XXS, I_IQ2_XS, I_IQ1_S, I_IQ1_M, I_IQ2_KT, I_IQ3_KT, I_IQ4_KT, N_TYPES };
/* M(type index) for every type: one case of a per-type switch each */
#define EACH_TYPE(M) M(I_F32) M(I_F16) M(I_BF16) M(I_Q4_0) M(I_Q8_0) M(I_Q4_K) M(I_Q5_K) M(I_Q6_K) M(I_IQ4_NL) \
    M(I_MXFP4) M(I_IQ4_XS) M(I_Q3_K) M(I_Q2_K) M(I_IQ4_KS) M(I_IQ4_K) M(I_IQ3_K) M(I_IQ2_K) \
    M(I_IQ5_K) M(I_IQ2_KS) M(I_IQ2_KL) M(I_IQ3_XXS) M(I_IQ3_S) M(I_IQ2_XXS) M(I_IQ2_XS) M(I_IQ1_S) M(I_IQ1_M) \
    M(I_IQ2_KT) M(I_IQ3_KT) M(I_IQ4_KT)

/* The "x types" (IQ4_XS, Q3_K, Q2_K and ik_llama.cpp's IQ4_KS, IQ4_K, IQ3_K, IQ2_K, IQ5_K, IQ2_KS): 256-element
 * super-blocks whose weights are w = S_i (u - X_OFF) - M_i, u an unsigned byte, S_i and M_i (Q2_K only) per
 * 16-element sub-block i. u is an index q (4 bits in nibbles, 2 bits in crumbs plus a third from a bit plane, or
 * IQ5_K's nibbles plus a fifth bit) or a table's value at q + X_OFF (XTAB: two tables, a per-sub-block "extra" bit
 * picks one). One scale routine
 * (x_scales) and one unpacker per width (x_u32, x_u64) give every path its values: fp32 (w = fma(u, S, X_OFF S),
 * or S u - M: ggml's roundings), the integer path (the u bytes straight into vpdpbusd) and the dequantizer.
 * IQ4_KS rows begin with a float32 scale, IQ2_KS rows with an fp16 one (X_HDR bytes), that the row's super-blocks
 * share. */
#define IS_X(ti) ((ti) >= I_IQ4_XS)
#define X_OFF_SH(ti) ((ti) == I_Q3_K ? 2 : (ti) == I_Q2_K ? 0 : (ti) == I_IQ3_K ? 6 : \
                      ((ti) == I_IQ2_K || (ti) == I_IQ2_KS) ? 5 : ((ti) == I_IQ2_KL || X_GRID(ti)) ? 6 : 7)
#define X_OFF(ti) ((ti) == I_Q2_K ? 0 : 1 << X_OFF_SH(ti))
#define X_MIN(ti) ((ti) == I_Q2_K)
#define X_HDR(ti) (((ti) == I_IQ4_KS || X_KT(ti)) ? 4 : ((ti) == I_IQ2_KS || (ti) == I_IQ2_KL) ? 2 : 0)
#define X_NIB(ti) ((ti) == I_IQ4_XS || (ti) == I_IQ4_KS || (ti) == I_IQ4_K)      /* q in nibbles, else crumbs */
#define X_NIB64(ti) ((ti) == I_IQ5_K)          /* per 64: 32 bytes, low nibbles first, high nibbles next */
#define X_QS(ti) (((ti) == I_IQ4_K || (ti) == I_IQ5_K) ? 16 : (ti) == I_Q3_K ? 32 : (ti) == I_Q2_K ? 16 : \
                  (ti) == I_IQ3_K ? 14 : (ti) == I_IQ2_K ? 12 : (ti) == I_IQ2_KS ? 6 : 8)   /* where q starts */
#define X_QH(ti) ((ti) == I_Q3_K ? 0 : (ti) == I_IQ5_K ? 144 : 78)  /* Q3_K, IQ3_K, IQ5_K: the top bit's planes */
#define X_3BIT(ti) ((ti) == I_Q3_K || (ti) == I_IQ3_K)
#define X_TAB(ti) ((ti) != I_Q3_K && (ti) != I_Q2_K && !X_PAIRS(ti) && !X_GRID(ti) && !X_KT(ti))   /* u from XTAB */
#define X_EXTRA(ti) ((ti) >= I_IQ4_KS && X_TAB(ti))                               /* a table per sub-block */
/* The grid types (ggml's i-quants): an index per 4 or 8 weights picks their magnitudes from a grid (cpu_grids.h),
 * signs per weight (IQ3_XXS, IQ2_XXS, IQ2_XS: 7-bit codes per 8, the 8th sign their parity; IQ3_S: sign bytes);
 * u = 64 +- the magnitude. IQ1_S and IQ1_M: grid values v of -1, 0, 1 plus a delta of +-1/8 per 32 (IQ1_S) or per
 * 8 (IQ1_M), u = 64 + 8 v +- 1 and S = the scale / 8 (exact), so S (u - 64) = dl (v +- 1/8) as ggml rounds it. */
/* The trellis types (ik_llama.cpp's IQ2_KT, IQ3_KT, IQ4_KT; quant/ref_trellis.py): an index per 8 (IQ4_KT: 4)
 * weights seeds a generator whose steps give the values v (-126..126; IQ3_KT: |v| and a sign bit per weight);
 * u = 128 + v, S = the row's f32 scale times a per-32 code. */
#define X_KT(ti) ((ti) == I_IQ2_KT || (ti) == I_IQ3_KT || (ti) == I_IQ4_KT)
#define KT_KA 0xCBAC1FEDu
#define X_GRID(ti) ((ti) == I_IQ3_XXS || (ti) == I_IQ3_S || (ti) == I_IQ2_XXS || (ti) == I_IQ2_XS || \
                    (ti) == I_IQ1_S || (ti) == I_IQ1_M)
/* IQ2_KL: a 5-bit index per pair of weights (nibbles of 16-byte runs, bit s of qh[l] on top) into 32 pairs of
 * values: u of both, + 64, as one u16 */
#define X_PAIRS(ti) ((ti) == I_IQ2_KL)
#include "cpu_grids.h"
static const uint16_t KL_PAIRS[32] __attribute__((aligned(64))) = {
    0x2901, 0x4d01, 0x0118, 0x3618, 0x4d18, 0x6f18, 0x1829, 0x2929, 0x4129, 0x4d29, 0x5c29, 0x0136, 0x4136, 0x4d36,
    0x6f36, 0x2941, 0x3641, 0x4141, 0x4d41, 0x5c41, 0x184d, 0x294d, 0x364d, 0x414d, 0x4d4d, 0x015c, 0x295c, 0x415c,
    0x5c5c, 0x6f5c, 0x296f, 0x4d6f};
/* types whose int8 tiles take signed values and a scale per 16 elements (no mins) */
#define SB16(ti) ((ti) == I_Q6_K || (IS_X(ti) && !X_MIN(ti)))
/* types in 256-element super-blocks */
#define IS_K(ti) (((ti) >= I_Q4_K && (ti) <= I_Q6_K) || IS_X(ti))

typedef struct {
    int id;   /* ggml id */
    int qk;   /* elements per block */
    int ts;   /* bytes per block */
    int hdr;  /* bytes of a row's header */
} tinfo;

static const tinfo TINFO[N_TYPES] = {
    [I_F32] = {T_F32, 1, 4},        [I_F16] = {T_F16, 1, 2},    [I_BF16] = {T_BF16, 1, 2},
    [I_Q4_0] = {T_Q4_0, 32, 18},    [I_Q8_0] = {T_Q8_0, 32, 34}, [I_Q4_K] = {T_Q4_K, 256, 144},
    [I_Q5_K] = {T_Q5_K, 256, 176},  [I_Q6_K] = {T_Q6_K, 256, 210},
    [I_IQ4_NL] = {T_IQ4_NL, 32, 18}, [I_MXFP4] = {T_MXFP4, 32, 17},
    [I_IQ4_XS] = {T_IQ4_XS, 256, 136}, [I_Q3_K] = {T_Q3_K, 256, 110}, [I_Q2_K] = {T_Q2_K, 256, 84},
    [I_IQ4_KS] = {T_IQ4_KS, 256, 136, 4}, [I_IQ4_K] = {T_IQ4_K, 256, 144}, [I_IQ3_K] = {T_IQ3_K, 256, 110},
    [I_IQ2_K] = {T_IQ2_K, 256, 76}, [I_IQ5_K] = {T_IQ5_K, 256, 176}, [I_IQ2_KS] = {T_IQ2_KS, 256, 70, 2},
    [I_IQ2_KL] = {T_IQ2_KL, 256, 86, 2}, [I_IQ3_XXS] = {T_IQ3_XXS, 256, 98}, [I_IQ3_S] = {T_IQ3_S, 256, 110},
    [I_IQ2_XXS] = {T_IQ2_XXS, 256, 66}, [I_IQ2_XS] = {T_IQ2_XS, 256, 74}, [I_IQ1_S] = {T_IQ1_S, 256, 50},
    [I_IQ1_M] = {T_IQ1_M, 256, 56}, [I_IQ2_KT] = {T_IQ2_KT, 256, 68, 4}, [I_IQ3_KT] = {T_IQ3_KT, 256, 100, 4},
    [I_IQ4_KT] = {T_IQ4_KT, 256, 128, 4},
};

static int type_index(int id) {
    for (int i = 0; i < N_TYPES; i++)
        if (TINFO[i].id == id) return i;
    return -1;
}

static inline int64_t blk_bytes(int ti, int64_t n) { return n / TINFO[ti].qk * TINFO[ti].ts; }
static inline int64_t row_bytes(int ti, int64_t n) { return TINFO[ti].hdr + blk_bytes(ti, n); }

static const float KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const float KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const float KV_Q4_0[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
static const uint8_t KU8_IQ4NL[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
/* the x types' u tables (value + X_OFF), [extra bit][q] */
static const uint8_t XTAB[N_TYPES][2][32] __attribute__((aligned(16))) = {
    [I_IQ4_XS] = {{1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241},
                  {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241}},
    [I_IQ4_KS] = {{1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241},
                  {5, 28, 49, 67, 83, 97, 110, 122, 133, 145, 157, 170, 185, 201, 221, 245}},
    [I_IQ4_K] = {{1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241},
                 {5, 28, 49, 67, 83, 97, 110, 122, 133, 145, 157, 170, 185, 201, 221, 245}},
    [I_IQ3_K] = {{1, 24, 41, 54, 65, 77, 92, 111}, {5, 28, 45, 58, 69, 81, 96, 115}},
    [I_IQ2_K] = {{1, 19, 33, 49}, {6, 24, 38, 54}},
    [I_IQ2_KS] = {{1, 19, 33, 49}, {6, 24, 38, 54}},
    [I_IQ5_K] = {{2, 14, 25, 36, 45, 54, 63, 71, 78, 85, 92, 98, 104, 110, 116, 122,
                  127, 133, 139, 145, 151, 157, 164, 171, 179, 187, 196, 205, 215, 225, 237, 249},
                 {4, 16, 27, 38, 47, 56, 65, 73, 80, 87, 94, 100, 106, 112, 118, 124,
                  129, 135, 141, 147, 153, 159, 166, 173, 181, 189, 198, 207, 217, 227, 239, 251}},
};

/* ------------------------------------------------------------------ scalar helpers */

static inline float f32_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* IEEE half -> float, exact (normals, subnormals, inf, nan) */
static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0x1F) return f32_bits(sign | 0x7F800000u | (man << 13));
    if (exp == 0) {                        /* zero or subnormal: man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return f32_bits(sign | ((exp + 112) << 23) | (man << 13));
}

static inline float bf16_to_f32(uint16_t h) { return f32_bits((uint32_t)h << 16); }

/* ggml_e8m0_to_fp32_half */
static inline float e8m0_half(uint8_t e) {
    return f32_bits(e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23));
}

/* Q4_K / Q5_K 6-bit scale and min of sub-block j */
static inline void k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* the scale in an x-type row's header (IQ4_KS), else 1 */
static inline float x_rowscale(int ti, const uint8_t *row) {
    float d = 1.0f;
    if (X_HDR(ti) == 4) memcpy(&d, row, 4);
    if (X_HDR(ti) == 2) d = fp16_to_f32(rd16(row));
    return d;
}

/* IQ1_M's fp16 super-block scale: the top nibbles of its four u16 scale words */
static inline uint16_t iq1m_d(const uint8_t *b) {
    return (uint16_t)((rd16(b + 48) >> 12) | ((rd16(b + 50) >> 8) & 0xF0) | ((rd16(b + 52) >> 4) & 0xF00) |
                      (rd16(b + 54) & 0xF000));
}

/* the per-16 scales S and mins M (zero but for Q2_K) of x-type super-block b (rd: x_rowscale), as ggml
 * computes them */
static inline void x_scales(int ti, const uint8_t *b, float rd, float *S, float *M) {
    for (int i = 0; i < 16; i++) M[i] = 0.0f;
    const float d = fp16_to_f32(rd16(b));
    for (int i = 0; i < 16; i++) {
        const int lo = (b[(ti == I_IQ4_K ? 8 : ti == I_IQ3_K ? 6 : 4) + i / 2] >> 4 * (i % 2)) & 0xF;
        switch (ti) {
        case I_IQ4_XS: {
            const int ib = i / 2, ls = ((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xF) | (((rd16(b + 2) >> 2 * ib) & 3) << 4);
            S[i] = d * (float)(ls - 32);
            break;
        }
        case I_Q3_K: {
            const uint8_t *sc = b + 96;
            const int l4 = i < 8 ? sc[i] & 0xF : sc[i - 8] >> 4, hi = (sc[8 + i % 4] >> 2 * (i / 4)) & 3;
            S[i] = fp16_to_f32(rd16(b + 108)) * (float)((l4 | hi << 4) - 32);
            break;
        }
        case I_Q2_K:
            S[i] = fp16_to_f32(rd16(b + 80)) * (float)(b[i] & 0xF);
            M[i] = fp16_to_f32(rd16(b + 82)) * (float)(b[i] >> 4);
            break;
        case I_IQ4_KS: S[i] = rd * (float)((b[i / 2] & 254) - 127); break;
        case I_IQ4_K: S[i] = d * (float)((lo | ((b[4 + i / 4] >> 2 * (i % 4)) & 3) << 4) - 32); break;
        case I_IQ3_K: S[i] = d * (float)((2 * lo + 1) * ((rd16(b + 4) >> i) & 1 ? -1 : 1)); break;
        case I_IQ2_K: S[i] = d * (float)(lo - 8); break;
        case I_IQ5_K: S[i] = d * (float)((((b[8 + i / 2] >> 4 * (i % 2)) & 0xF) | ((b[4 + i / 4] >> 2 * (i % 4)) & 3) << 4) - 32);
            break;
        case I_IQ2_KS: {
            const int s = i / 2, ls = ((b[2 + s / 2] >> 4 * (s % 2)) & 0xF) | ((rd16(b) >> (8 + s)) & 1) << 4;
            S[i] = rd * (float)(ls - 16);
            break;
        }
        case I_IQ3_XXS: case I_IQ2_XXS: {   /* the top 4 bits of each sub-block's u32 */
            uint32_t aux;
            memcpy(&aux, b + (ti == I_IQ3_XXS ? 66 + 4 * (i / 2) : 6 + 8 * (i / 2)), 4);
            S[i] = d * ((float)(aux >> 28) + 0.5f) * (ti == I_IQ3_XXS ? 0.5f : 0.25f);
            break;
        }
        case I_IQ2_XS: S[i] = d * (0.5f + (float)((b[66 + i / 2] >> 4 * (i % 2)) & 0xF)) * 0.25f; break;
        case I_IQ3_S: S[i] = d * (float)(1 + 2 * ((b[106 + i / 4] >> 4 * (i / 2 % 2)) & 0xF)); break;
        case I_IQ1_S: S[i] = d * (float)(2 * ((rd16(b + 34 + 2 * (i / 2)) >> 12) & 7) + 1) * 0.125f; break;
        case I_IQ2_KT: S[i] = rd * KV_IQ4NL[(b[i / 2 % 4] >> 4 * (i / 8)) & 0xF]; break;
        case I_IQ3_KT: S[i] = rd * (float)((b[i / 2 % 4] >> 4 * (i / 8)) & 0xF); break;
        case I_IQ4_KT: {
            uint32_t shb;
            memcpy(&shb, b + 4 * (i / 2), 4);
            S[i] = rd * (float)((int)((shb & 0xFF) >> 1) - 64);
            break;
        }
        case I_IQ1_M: S[i] = fp16_to_f32(iq1m_d(b)) * (float)(2 * ((rd16(b + 48 + 2 * (i / 4)) >> 3 * (i % 4)) & 7) + 1) *
                             0.125f;
            break;
        case I_IQ2_KL: {   /* nibble s/4 of byte s%4, bits 2s of the u16 at b */
            const int s = i / 2, ls = ((b[2 + s % 4] >> 4 * (s / 4)) & 0xF) | ((rd16(b) >> 2 * s) & 3) << 4;
            S[i] = rd * (float)(ls - 32);
            break;
        }
        }
    }
}

/* bit i: sub-block i (of 16 elements) takes table 1 of XTAB */
static inline int x_extra16(int ti, const uint8_t *b) {
    int m = 0;
    if (ti == I_IQ4_KS)
        for (int k = 0; k < 8; k++) m |= (b[k] & 1) * 3 << 2 * k;
    else if (ti == I_IQ2_KS)
        for (int k = 0; k < 8; k++) m |= (b[0] >> k & 1) * 3 << 2 * k;
    else
        m = X_EXTRA(ti) ? rd16(b + 2) : 0;
    return m;
}

/* element e (0..255) of x-type super-block b: its index q, and its unsigned byte u */
static inline int x_q(int ti, const uint8_t *b, int e) {
    if (X_NIB64(ti)) {
        const int q = b[X_QS(ti) + 32 * (e / 64) + e % 32];
        return (e % 64 < 32 ? q & 0xF : q >> 4) | ((b[X_QH(ti) + e % 32] >> (e / 32)) & 1) << 4;
    }
    if (X_NIB(ti)) {
        const int q = b[X_QS(ti) + 16 * (e / 32) + e % 16];
        return e % 32 < 16 ? q & 0xF : q >> 4;
    }
    const int n = e / 128, j = e % 128 / 32, l = e % 32;
    const int v = (b[X_QS(ti) + 32 * n + l] >> 2 * j) & 3;
    return X_3BIT(ti) ? v | ((b[X_QH(ti) + l] >> (4 * n + j)) & 1) << 2 : v;
}

/* a 7-bit sign code as its 8 sign bits: the code, its parity on top */
static inline int code_signs(int c) { return c | (__builtin_popcount(c) & 1) << 7; }

/* the 8 sign bits of IQ3_XXS's / IQ2_XXS's code k (0..3) of sub-block s */
static inline int xxs_signs(int ti, const uint8_t *b, int s, int k) {
    uint32_t aux;
    memcpy(&aux, b + (ti == I_IQ3_XXS ? 66 + 4 * s : 6 + 8 * s), 4);
    return code_signs((aux >> 7 * k) & 127);
}

/* 8 sign codes, 7 bits in each byte of `codes` -> the 64 sign bits: each code, its parity on top (SWAR) */
static inline uint64_t codes_neg(uint64_t codes) {
    uint64_t p = codes ^ (codes >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    return codes | (p & 0x0101010101010101ull) << 7;
}

/* element e (0..255) of grid-type super-block b as u */
static inline int grid_value(int ti, const uint8_t *b, int e) {
    const int k = e / 8, l = e % 8;                     /* its group of 8, its place there */
    int g, sg;                                          /* the magnitude, its sign bits */
    switch (ti) {
    case I_IQ3_XXS:
        g = (IQ3XXS_GRID[b[2 + e / 4]] >> 8 * (e % 4)) & 0xFF;
        sg = xxs_signs(ti, b, e / 32, k % 4);
        break;
    case I_IQ3_S:
        g = (IQ3S_GRID[b[2 + e / 4] | ((b[66 + e / 32] >> (e / 4 % 8)) & 1) << 8] >> 8 * (e % 4)) & 0xFF;
        sg = b[74 + k];
        break;
    case I_IQ2_XXS:
        g = (IQ2XXS_GRID[b[2 + 8 * (e / 32) + k % 4]] >> 8 * l) & 0xFF;
        sg = xxs_signs(ti, b, e / 32, k % 4);
        break;
    case I_IQ2_XS:
        g = (IQ2XS_GRID[rd16(b + 2 + 2 * k) & 511] >> 8 * l) & 0xFF;
        sg = code_signs(rd16(b + 2 + 2 * k) >> 9);
        break;
    case I_IQ1_S: {                                     /* 64 + 8 v, then the sub-block's delta */
        const int qh = rd16(b + 34 + 2 * (e / 32));
        const int u = (IQ1S_GRID[b[2 + k] | ((qh >> 3 * (k % 4)) & 7) << 8] >> 8 * l) & 0xFF;
        return qh & 0x8000 ? u - 1 : u + 1;
    }
    default: {                                          /* IQ1_M: a nibble per group, 3 index bits and the delta's sign */
        const int nib = (b[32 + k / 2] >> 4 * (k % 2)) & 0xF;
        const int u = (IQ1S_GRID[b[k] | (nib & 7) << 8] >> 8 * l) & 0xFF;
        return nib & 8 ? u - 1 : u + 1;
    }
    }
    return sg >> l & 1 ? 64 - g : 64 + g;
}

/* the trellis' value (-126..126) after n (1..8) steps from x (index + offset) */
static inline int kt_value(uint32_t x, int n) {
    for (int i = 0; i < n; i++) x *= KT_KA;
    x &= 0x3F3F3F3Fu;
    return (int)((x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)) - 126;
}

/* element e (0..255) of trellis-type super-block b as u */
static inline int kt_u(int ti, const uint8_t *b, int e) {
    if (ti == I_IQ4_KT) {   /* group j of 4: 8 index bits, 4 from a nibble of qh, 3 from its 32-block's u32 */
        uint32_t shb;
        memcpy(&shb, b + 4 * (e / 32), 4);
        const int j = e / 4;
        const uint32_t idx = b[32 + j] | ((b[96 + j % 32] >> 4 * (j / 32)) & 0xFu) << 8 | ((shb >> (8 + 3 * (j % 8))) & 7u) << 12;
        return 128 + kt_value(4096 + 32768 * (shb & 1) + idx, e % 4 + 1);
    }
    const int v = kt_value(4096u + rd16(b + 4 + 2 * (e / 8)), e % 8 + 1);   /* a u16 index per 8 */
    if (ti == I_IQ2_KT) return 128 + v;
    return (b[68 + e % 32] >> (e / 32)) & 1 ? 128 - abs(v) : 128 + abs(v);   /* IQ3_KT: |v|, sign bits */
}

static inline int x_value(int ti, const uint8_t *b, int e) {
    if (X_GRID(ti)) return grid_value(ti, b, e);
    if (X_KT(ti)) return kt_u(ti, b, e);
    if (X_PAIRS(ti)) {
        const int s = e / 32, l = e % 32 / 2;
        const int idx = ((b[6 + 16 * (s / 2) + l] >> 4 * (s % 2)) & 0xF) | ((b[70 + l] >> s) & 1) << 4;
        return (KL_PAIRS[idx] >> 8 * (e % 2)) & 0xFF;
    }
    const int q = x_q(ti, b, e);
    return X_TAB(ti) ? XTAB[ti][(x_extra16(ti, b) >> (e / 16)) & 1][q] : q;
}

/* float -> bf16, round to nearest even (quiet NaN kept) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 64);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1)) >> 16);
}

/* Dequantize elements [off, off + n) of one row (off, n multiples of the block size) into
 * out. Same float operations as ggml's reference dequantizers, so bit-exact with them. */
static void deq_scalar(int ti, const uint8_t *row, int64_t off, int n, float *out) {
    const int qk = TINFO[ti].qk, ts = TINFO[ti].ts;
    const uint8_t *b = row + TINFO[ti].hdr + off / qk * ts;
    const float rd = IS_X(ti) ? x_rowscale(ti, row) : 1.0f;
    switch (ti) {
    case I_F32: memcpy(out, row + off * 4, (size_t)n * 4); return;
    case I_F16: for (int i = 0; i < n; i++) out[i] = fp16_to_f32(rd16(row + (off + i) * 2)); return;
    case I_BF16: for (int i = 0; i < n; i++) out[i] = bf16_to_f32(rd16(row + (off + i) * 2)); return;
    }
    for (int o = 0; o < n; o += qk, b += ts, out += qk) {
        if (IS_X(ti)) {   /* S (u - off) and S u - M: one rounding each as in ggml (S u is exact) */
            float S[16], M[16];
            x_scales(ti, b, rd, S, M);
            for (int e = 0; e < 256; e++)
                out[e] = X_MIN(ti) ? S[e / 16] * (float)x_value(ti, b, e) - M[e / 16]
                                   : S[e / 16] * (float)(x_value(ti, b, e) - X_OFF(ti));
            continue;
        }
        switch (ti) {
        case I_Q4_0: case I_IQ4_NL: case I_MXFP4: {
            const float *kv = ti == I_Q4_0 ? KV_Q4_0 : ti == I_IQ4_NL ? KV_IQ4NL : KV_MXFP4;
            const float d = ti == I_MXFP4 ? e8m0_half(b[0]) : fp16_to_f32(rd16(b));
            const uint8_t *qs = b + (ti == I_MXFP4 ? 1 : 2);
            for (int l = 0; l < 16; l++) {
                out[l] = d * kv[qs[l] & 0xF];
                out[l + 16] = d * kv[qs[l] >> 4];
            }
            break;
        }
        case I_Q8_0: {
            const float d = fp16_to_f32(rd16(b));
            for (int l = 0; l < 32; l++) out[l] = d * (float)(int8_t)b[2 + l];
            break;
        }
        case I_Q4_K: case I_Q5_K: {
            const float d = fp16_to_f32(rd16(b)), dmin = fp16_to_f32(rd16(b + 2));
            const uint8_t *qh = b + 16, *qs = b + (ti == I_Q5_K ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                k_scale_min(j, b + 4, &sc, &m);
                const float s = d * (float)sc, mm = dmin * (float)m;
                const uint8_t *q = qs + 32 * (j >> 1);
                for (int l = 0; l < 32; l++) {
                    int v = (j & 1) ? q[l] >> 4 : q[l] & 0xF;
                    if (ti == I_Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                    out[32 * j + l] = s * (float)v - mm;
                }
            }
            break;
        }
        case I_Q6_K: {
            const float d = fp16_to_f32(rd16(b + 208));
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                float *y = out + 128 * h;
                for (int l = 0; l < 32; l++) {
                    const int is = 8 * h + l / 16;
                    const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * (float)sc[is] * (float)q1;
                    y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                    y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                    y[l + 96] = d * (float)sc[is + 6] * (float)q4;
                }
            }
            break;
        }
        }
    }
}
