/* The ggml types the kernels read (ids, block layouts, the x types' scheme, tables), scalar helpers and
 * the scalar dequantizer (bit-exact with ggml's).
 * Part of the one translation unit cpu_moe.c: included there, in order, never compiled alone. */

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
};

/* dense type index used by the kernel tables */
enum { I_F32, I_F16, I_BF16, I_Q4_0, I_Q8_0, I_Q4_K, I_Q5_K, I_Q6_K, I_IQ4_NL, I_MXFP4, I_IQ4_XS, I_Q3_K, I_Q2_K,
       I_IQ4_KS, I_IQ4_K, I_IQ3_K, I_IQ2_K, I_IQ5_K, I_IQ2_KS, I_IQ2_KL, I_IQ3_XXS, N_TYPES };
/* M(type index) for every type: one case of a per-type switch each */
#define EACH_TYPE(M) M(I_F32) M(I_F16) M(I_BF16) M(I_Q4_0) M(I_Q8_0) M(I_Q4_K) M(I_Q5_K) M(I_Q6_K) M(I_IQ4_NL) \
    M(I_MXFP4) M(I_IQ4_XS) M(I_Q3_K) M(I_Q2_K) M(I_IQ4_KS) M(I_IQ4_K) M(I_IQ3_K) M(I_IQ2_K) \
    M(I_IQ5_K) M(I_IQ2_KS) M(I_IQ2_KL) M(I_IQ3_XXS)

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
                      ((ti) == I_IQ2_K || (ti) == I_IQ2_KS) ? 5 : ((ti) == I_IQ2_KL || (ti) == I_IQ3_XXS) ? 6 : 7)
#define X_OFF(ti) ((ti) == I_Q2_K ? 0 : 1 << X_OFF_SH(ti))
#define X_MIN(ti) ((ti) == I_Q2_K)
#define X_HDR(ti) ((ti) == I_IQ4_KS ? 4 : ((ti) == I_IQ2_KS || (ti) == I_IQ2_KL) ? 2 : 0)
#define X_NIB(ti) ((ti) == I_IQ4_XS || (ti) == I_IQ4_KS || (ti) == I_IQ4_K)      /* q in nibbles, else crumbs */
#define X_NIB64(ti) ((ti) == I_IQ5_K)          /* per 64: 32 bytes, low nibbles first, high nibbles next */
#define X_QS(ti) (((ti) == I_IQ4_K || (ti) == I_IQ5_K) ? 16 : (ti) == I_Q3_K ? 32 : (ti) == I_Q2_K ? 16 : \
                  (ti) == I_IQ3_K ? 14 : (ti) == I_IQ2_K ? 12 : (ti) == I_IQ2_KS ? 6 : 8)   /* where q starts */
#define X_QH(ti) ((ti) == I_Q3_K ? 0 : (ti) == I_IQ5_K ? 144 : 78)  /* Q3_K, IQ3_K, IQ5_K: the top bit's planes */
#define X_3BIT(ti) ((ti) == I_Q3_K || (ti) == I_IQ3_K)
#define X_TAB(ti) ((ti) != I_Q3_K && (ti) != I_Q2_K && (ti) != I_IQ2_KL && (ti) != I_IQ3_XXS)   /* u from XTAB */
#define X_EXTRA(ti) ((ti) >= I_IQ4_KS && (ti) != I_IQ2_KL && (ti) != I_IQ3_XXS)             /* a table per sub-block */
/* IQ3_XXS: a byte per 4 weights indexes a grid of magnitudes, 7-bit sign codes (the 8th sign: their parity) per 8 */
#define X_GRID(ti) ((ti) == I_IQ3_XXS)
/* IQ2_KL: a 5-bit index per pair of weights (nibbles of 16-byte runs, bit s of qh[l] on top) into 32 pairs of
 * values: u of both, + 64, as one u16 */
#define X_PAIRS(ti) ((ti) == I_IQ2_KL)
/* IQ3_XXS's grid (ggml's iq3xxs_grid): 4 magnitudes a byte */
static const uint32_t IQ3XXS_GRID[256] __attribute__((aligned(64))) = {
    0x04040404, 0x04040414, 0x04040424, 0x04040c0c, 0x04040c1c, 0x04040c3e, 0x04041404, 0x04041414,
    0x04041c0c, 0x04042414, 0x04043e1c, 0x04043e2c, 0x040c040c, 0x040c041c, 0x040c0c04, 0x040c0c14,
    0x040c140c, 0x040c142c, 0x040c1c04, 0x040c1c14, 0x040c240c, 0x040c2c24, 0x040c3e04, 0x04140404,
    0x04140414, 0x04140424, 0x04140c0c, 0x04141404, 0x04141414, 0x04141c0c, 0x04141c1c, 0x04141c3e,
    0x04142c0c, 0x04142c3e, 0x04143e2c, 0x041c040c, 0x041c043e, 0x041c0c04, 0x041c0c14, 0x041c142c,
    0x041c3e04, 0x04240c1c, 0x04241c3e, 0x04242424, 0x04242c3e, 0x04243e1c, 0x04243e2c, 0x042c040c,
    0x042c043e, 0x042c1c14, 0x042c2c14, 0x04341c2c, 0x04343424, 0x043e0c04, 0x043e0c24, 0x043e0c34,
    0x043e241c, 0x043e340c, 0x0c04040c, 0x0c04041c, 0x0c040c04, 0x0c040c14, 0x0c04140c, 0x0c04141c,
    0x0c041c04, 0x0c041c14, 0x0c041c24, 0x0c04243e, 0x0c042c04, 0x0c0c0404, 0x0c0c0414, 0x0c0c0c0c,
    0x0c0c1404, 0x0c0c1414, 0x0c14040c, 0x0c14041c, 0x0c140c04, 0x0c140c14, 0x0c14140c, 0x0c141c04,
    0x0c143e14, 0x0c1c0404, 0x0c1c0414, 0x0c1c1404, 0x0c1c1c0c, 0x0c1c2434, 0x0c1c3434, 0x0c24040c,
    0x0c24042c, 0x0c242c04, 0x0c2c1404, 0x0c2c1424, 0x0c2c2434, 0x0c2c3e0c, 0x0c34042c, 0x0c3e1414,
    0x0c3e2404, 0x14040404, 0x14040414, 0x14040c0c, 0x14040c1c, 0x14041404, 0x14041414, 0x14041434,
    0x14041c0c, 0x14042414, 0x140c040c, 0x140c041c, 0x140c042c, 0x140c0c04, 0x140c0c14, 0x140c140c,
    0x140c1c04, 0x140c341c, 0x140c343e, 0x140c3e04, 0x14140404, 0x14140414, 0x14140c0c, 0x14140c3e,
    0x14141404, 0x14141414, 0x14141c3e, 0x14142404, 0x14142c2c, 0x141c040c, 0x141c0c04, 0x141c0c24,
    0x141c3e04, 0x141c3e24, 0x14241c2c, 0x14242c1c, 0x142c041c, 0x142c143e, 0x142c240c, 0x142c3e24,
    0x143e040c, 0x143e041c, 0x143e0c34, 0x143e242c, 0x1c04040c, 0x1c040c04, 0x1c040c14, 0x1c04140c,
    0x1c04141c, 0x1c042c04, 0x1c04342c, 0x1c043e14, 0x1c0c0404, 0x1c0c0414, 0x1c0c1404, 0x1c0c1c0c,
    0x1c0c2424, 0x1c0c2434, 0x1c14040c, 0x1c14041c, 0x1c140c04, 0x1c14142c, 0x1c142c14, 0x1c143e14,
    0x1c1c0c0c, 0x1c1c1c1c, 0x1c241c04, 0x1c24243e, 0x1c243e14, 0x1c2c0404, 0x1c2c0434, 0x1c2c1414,
    0x1c2c2c2c, 0x1c340c24, 0x1c341c34, 0x1c34341c, 0x1c3e1c1c, 0x1c3e3404, 0x24040424, 0x24040c3e,
    0x24041c2c, 0x24041c3e, 0x24042c1c, 0x24042c3e, 0x240c3e24, 0x24141404, 0x24141c3e, 0x24142404,
    0x24143404, 0x24143434, 0x241c043e, 0x241c242c, 0x24240424, 0x24242c0c, 0x24243424, 0x242c142c,
    0x242c241c, 0x242c3e04, 0x243e042c, 0x243e0c04, 0x243e0c14, 0x243e1c04, 0x2c040c14, 0x2c04240c,
    0x2c043e04, 0x2c0c0404, 0x2c0c0434, 0x2c0c1434, 0x2c0c2c2c, 0x2c140c24, 0x2c141c14, 0x2c143e14,
    0x2c1c0414, 0x2c1c2c1c, 0x2c240c04, 0x2c24141c, 0x2c24143e, 0x2c243e14, 0x2c2c0414, 0x2c2c1c0c,
    0x2c342c04, 0x2c3e1424, 0x2c3e2414, 0x34041424, 0x34042424, 0x34042434, 0x34043424, 0x340c140c,
    0x340c340c, 0x34140c3e, 0x34143424, 0x341c1c04, 0x341c1c34, 0x34242424, 0x342c042c, 0x342c2c14,
    0x34341c1c, 0x343e041c, 0x343e140c, 0x3e04041c, 0x3e04042c, 0x3e04043e, 0x3e040c04, 0x3e041c14,
    0x3e042c14, 0x3e0c1434, 0x3e0c2404, 0x3e140c14, 0x3e14242c, 0x3e142c14, 0x3e1c0404, 0x3e1c0c2c,
    0x3e1c1c1c, 0x3e1c3404, 0x3e24140c, 0x3e24240c, 0x3e2c0404, 0x3e2c0414, 0x3e2c1424, 0x3e341c04,
};
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
    [I_IQ2_KL] = {T_IQ2_KL, 256, 86, 2}, [I_IQ3_XXS] = {T_IQ3_XXS, 256, 98},
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
        case I_IQ3_XXS: {
            uint32_t aux;
            memcpy(&aux, b + 66 + 4 * (i / 2), 4);
            S[i] = d * ((float)(aux >> 28) + 0.5f) * 0.5f;
            break;
        }
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

/* the 8 sign bits of IQ3_XXS's code k (0..3) of sub-block s: the code, its parity on top */
static inline int xxs_signs(const uint8_t *b, int s, int k) {
    uint32_t aux;
    memcpy(&aux, b + 66 + 4 * s, 4);
    const int c = (aux >> 7 * k) & 127;
    return c | (__builtin_popcount(c) & 1) << 7;
}

static inline int x_value(int ti, const uint8_t *b, int e) {
    if (X_GRID(ti)) {
        const int g = (IQ3XXS_GRID[b[2 + e / 4]] >> 8 * (e % 4)) & 0xFF;
        return xxs_signs(b, e / 32, e % 32 / 8) >> (e % 8) & 1 ? 64 - g : 64 + g;
    }
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
