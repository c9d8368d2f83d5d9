/* hybridmoe CPU kernels: grouped quantized MoE FFN, quantized matmul, dequantize.
 *
 * Plain C11 + OpenMP, compiled at first use with -O3 -march=native (see cpu.py) and called
 * through ctypes. Weights stay in their GGUF block layout and are read once per call.
 *
 * Math, fp32 path (all types): each 32-element unit of a weight row is decoded in registers
 * to fp32 (for the 4-bit types with a permute into a 16-entry table that already holds
 * scale * value) and multiplied with fp32 activations by FMA: exact up to fp32 rounding.
 * Integer path (Q4_0/Q4_K/Q5_K rows used by a single token, i.e. decode; hm_set_int8):
 * vpdpbusd on nibbles and two-term int8 activations (~15 bits), see "integer path" below.
 * Why these and not int16 / plain int8 activations: docs/cpu-kernels.md.
 *
 * Paths: AVX-512 (F/BW/VL; VNNI + GFNI for the integer path) intrinsics when the compiler
 * targets them; AVX2 (+ FMA, F16C) intrinsics for the streaming kernels and the dequantizer on
 * CPUs without AVX-512 (fp32 path only); otherwise a portable path (scalar dequantize of 256
 * elements into an L1 buffer, then dot loops the compiler vectorizes, e.g. for NEON).
 * hm_set_simd(level) selects a lower path at run time (tests use it).
 *
 * Threads: OpenMP, `num_threads(n)` per call (never omp_set_num_threads, which would change
 * torch's thread count: both share torch's libgomp when torch is loaded first).
 */
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

/* ------------------------------------------------------------------ row x token kernels
 *
 * A kernel computes res[r * NT + t] = dot(row w[r], x[t]) for R weight rows and NT
 * activation rows of length K. The weight unit is decoded once and used for all NT tokens;
 * R rows are interleaved so that several independent FMA chains hide latency.
 * pf (may be NULL, or hold NULLs): two regions further ahead in the caller's stream, each
 * max(R/2, 1) rows long (contiguous); they are prefetched at the pace the R rows are read:
 * spread evenly (no bursts that fill the miss buffers), branch-free, and never past the
 * caller's range.
 */
typedef void (*kern_fn)(const uint8_t *const *w, const uint8_t *const *pf, int64_t K,
                        const float *const *x, float *res);

#define CHUNK 256

/* portable: dequantize 256 elements per row into an L1 buffer, then 16-lane dot loops */
static void kern_generic(int ti, int R, int NT, const uint8_t *const *w, const uint8_t *const *pf,
                         int64_t K, const float *const *x, float *res) {
    float buf[CHUNK] __attribute__((aligned(64)));
    float acc[4][4][16];
    const int PR = R > 1 ? R / 2 : 1;
    memset(acc, 0, sizeof(acc));
    for (int64_t off = 0; off < K; off += CHUNK) {
        const int n = (int)(K - off < CHUNK ? K - off : CHUNK);
        for (int i = 0; i < 2; i++)
            if (pf && pf[i])
                for (int64_t b = PR * row_bytes(ti, off); b < PR * row_bytes(ti, off + n); b += 64)
                    __builtin_prefetch(pf[i] + b, 0, HM_PF_LOC);
        for (int r = 0; r < R; r++) {
            deq_scalar(ti, w[r], off, n, buf);
            for (int t = 0; t < NT; t++) {
                const float *xt = x[t] + off;
                float *a = acc[r][t];
                for (int i = 0; i < n; i += 16)
                    for (int l = 0; l < 16; l++) a[l] += buf[i + l] * xt[i + l];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) {
            float s = 0;
            for (int l = 0; l < 16; l++) s += acc[r][t][l];
            res[r * NT + t] = s;
        }
}

/* the block holding 32-element unit `unit` of a row */
HM_INLINE const uint8_t *unit_block(const int ti, const uint8_t *row, int64_t unit) {
    if (ti == I_F32 || ti == I_F16 || ti == I_BF16) return row + unit * 32 * TINFO[ti].ts;
    if (IS_K(ti)) return row + (unit >> 3) * TINFO[ti].ts;
    return row + unit * TINFO[ti].ts;
}

/* the two prefetch regions of a kernel's R rows (dot_rows' pf, or its own first row), PR rows each */
typedef struct { const uint8_t *a, *b; int pr; } pfreg;

HM_INLINE pfreg pf_regions(const int R, const uint8_t *const *w, const uint8_t *const *pf) {
    return (pfreg){pf && pf[0] ? pf[0] : w[0], pf && pf[1] ? pf[1] : w[0], R > 1 ? R / 2 : 1};
}

/* prefetch what the rows read in the loop step of `step` bytes at row offset o */
HM_INLINE void prefetch_step(const pfreg p, const int64_t o, const int step) {
#pragma GCC unroll 8
    for (int b = 0; b < p.pr * step; b += 64) {
        __builtin_prefetch(p.a + p.pr * o + b, 0, HM_PF_LOC);
        __builtin_prefetch(p.b + p.pr * o + b, 0, HM_PF_LOC);
    }
}

/* A kernel FN(ti, R, NT, ...) instantiated for every type and (R rows, NT tokens) shape dot_rows asks for,
 * and the table NAME[type][R][NT] of the instances (prefix P). */
#define KSHAPE(P, FN, TI, R, NT) \
    static void P##_##TI##_##R##_##NT(const uint8_t *const *w, const uint8_t *const *pf, int64_t K, \
                                      const float *const *x, float *res) { FN(TI, R, NT, w, pf, K, x, res); }
#define KSHAPES(P, FN, TI) \
    KSHAPE(P, FN, TI, 4, 1) KSHAPE(P, FN, TI, 4, 2) KSHAPE(P, FN, TI, 2, 1) KSHAPE(P, FN, TI, 2, 2) \
    KSHAPE(P, FN, TI, 2, 3) KSHAPE(P, FN, TI, 2, 4) KSHAPE(P, FN, TI, 1, 1) KSHAPE(P, FN, TI, 1, 2) \
    KSHAPE(P, FN, TI, 1, 3) KSHAPE(P, FN, TI, 1, 4)
#define KTROW(P, TI) { {0}, \
    {0, P##_##TI##_1_1, P##_##TI##_1_2, P##_##TI##_1_3, P##_##TI##_1_4}, \
    {0, P##_##TI##_2_1, P##_##TI##_2_2, P##_##TI##_2_3, P##_##TI##_2_4}, {0}, \
    {0, P##_##TI##_4_1, P##_##TI##_4_2, 0, 0} }
#define KTABLE(NAME, P, FN) \
    KSHAPES(P, FN, I_F32) KSHAPES(P, FN, I_F16) KSHAPES(P, FN, I_BF16) KSHAPES(P, FN, I_Q4_0) \
    KSHAPES(P, FN, I_Q8_0) KSHAPES(P, FN, I_Q4_K) KSHAPES(P, FN, I_Q5_K) KSHAPES(P, FN, I_Q6_K) \
    KSHAPES(P, FN, I_IQ4_NL) KSHAPES(P, FN, I_MXFP4) KSHAPES(P, FN, I_IQ4_XS) KSHAPES(P, FN, I_Q3_K) \
    KSHAPES(P, FN, I_Q2_K) KSHAPES(P, FN, I_IQ4_KS) KSHAPES(P, FN, I_IQ4_K) KSHAPES(P, FN, I_IQ3_K) \
    KSHAPES(P, FN, I_IQ2_K) KSHAPES(P, FN, I_IQ5_K) KSHAPES(P, FN, I_IQ2_KS) KSHAPES(P, FN, I_IQ2_KL) \
    KSHAPES(P, FN, I_IQ3_XXS) \
    static const kern_fn NAME[N_TYPES][5][5] = { \
        [I_F32] = KTROW(P, I_F32), [I_F16] = KTROW(P, I_F16), [I_BF16] = KTROW(P, I_BF16), \
        [I_Q4_0] = KTROW(P, I_Q4_0), [I_Q8_0] = KTROW(P, I_Q8_0), [I_Q4_K] = KTROW(P, I_Q4_K), \
        [I_Q5_K] = KTROW(P, I_Q5_K), [I_Q6_K] = KTROW(P, I_Q6_K), [I_IQ4_NL] = KTROW(P, I_IQ4_NL), \
        [I_MXFP4] = KTROW(P, I_MXFP4), [I_IQ4_XS] = KTROW(P, I_IQ4_XS), [I_Q3_K] = KTROW(P, I_Q3_K), \
        [I_Q2_K] = KTROW(P, I_Q2_K), [I_IQ4_KS] = KTROW(P, I_IQ4_KS), [I_IQ4_K] = KTROW(P, I_IQ4_K), \
        [I_IQ3_K] = KTROW(P, I_IQ3_K), [I_IQ2_K] = KTROW(P, I_IQ2_K), [I_IQ5_K] = KTROW(P, I_IQ5_K), \
        [I_IQ2_KS] = KTROW(P, I_IQ2_KS), [I_IQ2_KL] = KTROW(P, I_IQ2_KL), [I_IQ3_XXS] = KTROW(P, I_IQ3_XXS), };

#if HM_AVX2

/* fp16 -> fp32 lookup (256 KiB): a block scale becomes one scalar load that the multiply
 * broadcasts from memory, instead of insert + convert + broadcast shuffles per block */
static float g_f16[65536];

__attribute__((constructor)) static void init_f16_table(void) {
    for (uint32_t i = 0; i < 65536; i++) g_f16[i] = fp16_to_f32((uint16_t)i);
}

#define F16(p) g_f16[rd16(p)]

/* Per-row scales of one K-quant super-block: w = q * s[j] - m[j] for 32-element unit j
 * (Q4_K/Q5_K), or for 16-element sub-block j (Q6_K, 16 of each, m = 32 s). */
typedef struct { float s[16], m[16]; } kscale;

HM_INLINE void prep_k(const int ti, const uint8_t *b, float rd, kscale *ks) {
    if (IS_X(ti)) {   /* w = fma(u, s, -m): m = off s (exact) or Q2_K's min */
        float M[16];
        x_scales(ti, b, rd, ks->s, M);
        for (int i = 0; i < 16; i++) ks->m[i] = (float)X_OFF(ti) * ks->s[i] + M[i];
    } else if (ti == I_Q4_K || ti == I_Q5_K) {
        /* unpack the 12 packed bytes into 8 scales and 8 mins at once (SWAR on 32-bit words) */
        uint32_t a, c, e;
        memcpy(&a, b + 4, 4); memcpy(&c, b + 8, 4); memcpy(&e, b + 12, 4);
        const uint64_t sc = (a & 0x3F3F3F3Fu) | (uint64_t)((e & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
        const uint64_t mn = (c & 0x3F3F3F3Fu) | (uint64_t)(((e >> 4) & 0x0F0F0F0Fu) | ((c >> 2) & 0x30303030u)) << 32;
        const __m256 fs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
        const __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
        _mm256_storeu_ps(ks->s, _mm256_mul_ps(fs, _mm256_broadcast_ss(&F16(b))));
        _mm256_storeu_ps(ks->m, _mm256_mul_ps(fm, _mm256_broadcast_ss(&F16(b + 2))));
    } else { /* Q6_K */
        for (int h = 0; h < 2; h++) {
            const __m256 s = _mm256_mul_ps(_mm256_broadcast_ss(&F16(b + 208)), _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h)))));
            _mm256_storeu_ps(ks->s + 8 * h, s);
            _mm256_storeu_ps(ks->m + 8 * h, _mm256_mul_ps(s, _mm256_set1_ps(32.0f)));
        }
    }
}

/* AVX2 kernels (CPUs without AVX-512: most desktop Intel, AMD before Zen 4). The same row x token
 * scheme as the AVX-512 kernels below, 8 lanes a vector: a 32-element unit becomes four fp32
 * vectors. 4-bit values go through a 16-entry int8 table (vpshufb), so the weight's value, then its
 * scale, are the same float operations as ggml's reference dequantizers. */

/* int8 values of each 4-bit code (MXFP4: twice the FP4 value; its scale is halved) */
static const int8_t KV8_Q4_0[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
static const int8_t KV8_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KV8_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* unit u (32 elements) of x-type super-block b as unsigned bytes (16-bit shifts: the masks drop what crosses
 * bytes) */
HM_INLINE __m256i x_u32(const int ti, const uint8_t *b, const int u) {
    __m256i q;
    if (X_GRID(ti)) {
        uint8_t v[32] __attribute__((aligned(32)));
        for (int e = 0; e < 32; e++) v[e] = (uint8_t)x_value(ti, b, 32 * u + e);
        return _mm256_load_si256((const __m256i *)v);
    }
    if (X_PAIRS(ti)) {   /* sub-block u: 16 pairs */
        uint16_t pr[16] __attribute__((aligned(32)));
        for (int l = 0; l < 16; l++)
            pr[l] = KL_PAIRS[((b[6 + 16 * (u / 2) + l] >> 4 * (u % 2)) & 0xF) | ((b[70 + l] >> u) & 1) << 4];
        return _mm256_load_si256((const __m256i *)pr);
    }
    if (X_NIB64(ti)) {   /* nibble u&1 of 32 bytes, bit u of qh[l] -> bit 4 */
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(b + X_QS(ti) + 32 * (u >> 1)));
        q = _mm256_and_si256(u & 1 ? _mm256_srli_epi16(qs, 4) : qs, _mm256_set1_epi8(0x0F));
        __m256i h = _mm256_loadu_si256((const __m256i *)(b + X_QH(ti)));
        h = u <= 4 ? _mm256_slli_epi16(h, 4 - u) : _mm256_srli_epi16(h, u - 4);
        q = _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
        const int ex = x_extra16(ti, b) >> 2 * u;
        /* 32-entry tables: two vpshufb and a blend on bit 4 */
        const uint8_t *t0 = XTAB[ti][ex & 1], *t1 = XTAB[ti][(ex >> 1) & 1];
        const __m256i lo = _mm256_set_m128i(_mm_load_si128((const __m128i *)t1), _mm_load_si128((const __m128i *)t0));
        const __m256i hi = _mm256_set_m128i(_mm_load_si128((const __m128i *)(t1 + 16)),
                                            _mm_load_si128((const __m128i *)(t0 + 16)));
        const __m256i sel = _mm256_cmpeq_epi8(_mm256_and_si256(q, _mm256_set1_epi8(0x10)), _mm256_set1_epi8(0x10));
        return _mm256_blendv_epi8(_mm256_shuffle_epi8(lo, q), _mm256_shuffle_epi8(hi, q), sel);
    }
    if (X_NIB(ti)) {
        const __m128i m0f = _mm_set1_epi8(0x0F), qs = _mm_loadu_si128((const __m128i *)(b + X_QS(ti) + 16 * u));
        q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m0f), _mm_and_si128(qs, m0f));
    } else {
        const int n = u >> 2, j = u & 3;
        q = _mm256_loadu_si256((const __m256i *)(b + X_QS(ti) + 32 * n));
        q = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3));
        if (X_3BIT(ti)) {   /* bit 4n + j of qh[l] -> bit 2 */
            const int k = 4 * n + j;
            __m256i h = _mm256_loadu_si256((const __m256i *)(b + X_QH(ti)));
            h = k >= 2 ? _mm256_srli_epi16(h, k - 2) : _mm256_slli_epi16(h, 2 - k);
            q = _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi8(4)));
        }
    }
    if (!X_TAB(ti)) return q;
    const int ex = x_extra16(ti, b) >> 2 * u;   /* the tables of this unit's two sub-blocks */
    const __m256i tab = _mm256_set_m128i(_mm_load_si128((const __m128i *)XTAB[ti][(ex >> 1) & 1]),
                                         _mm_load_si128((const __m128i *)XTAB[ti][ex & 1]));
    return _mm256_shuffle_epi8(tab, q);
}

/* 32 bytes -> 4 x 8 floats, as signed or unsigned integers */
HM_INLINE void bytes_to_ps(__m256i v, int sgn, __m256 *w) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    const __m128i p[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(p[i]) : _mm256_cvtepu8_epi32(p[i]));
}

/* 32 elements (unit u of the block or super-block at b) -> four fp32 vectors */
HM_INLINE void unpack32_avx2(const int ti, const uint8_t *b, const int u, const kscale *ks, __m256 *w) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    switch (ti) {
    case I_F32:
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps((const float *)b + 32 * u + 8 * i);
        return;
    case I_F16:
        for (int i = 0; i < 4; i++) w[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 64 * u + 16 * i)));
        return;
    case I_BF16:
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 64 * u + 16 * i))), 16));
        return;
    case I_Q4_0: case I_IQ4_NL: case I_MXFP4: {
        const int8_t *kv = ti == I_Q4_0 ? KV8_Q4_0 : ti == I_IQ4_NL ? KV8_IQ4NL : KV8_MXFP4;
        const float d = ti == I_MXFP4 ? e8m0_half(b[0]) : F16(b);
        const __m128i tab = _mm_loadu_si128((const __m128i *)kv);
        const __m128i qs = _mm_loadu_si128((const __m128i *)(b + (ti == I_MXFP4 ? 1 : 2)));
        const __m128i lo = _mm_and_si128(qs, _mm256_castsi256_si128(m0f));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm256_castsi256_si128(m0f));
        bytes_to_ps(_mm256_set_m128i(_mm_shuffle_epi8(tab, hi), _mm_shuffle_epi8(tab, lo)), 1, w);
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(w[i], _mm256_set1_ps(d));
        return;
    }
    case I_Q8_0:
        bytes_to_ps(_mm256_loadu_si256((const __m256i *)(b + 2)), 1, w);
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(_mm256_set1_ps(F16(b)), w[i]);
        return;
    case I_Q4_K: case I_Q5_K: {
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + (ti == I_Q5_K ? 48 : 16) + 32 * (u >> 1)));
        if (u & 1) q = _mm256_srli_epi16(q, 4);
        q = _mm256_and_si256(q, m0f);
        if (ti == I_Q5_K) {   /* 5th bit: bit u of qh[l] -> bit 4 (16-bit shifts: the mask drops what crosses bytes) */
            __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
            h = u < 4 ? _mm256_slli_epi16(h, 4 - u) : u > 4 ? _mm256_srli_epi16(h, u - 4) : h;
            q = _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
        }
        bytes_to_ps(q, 0, w);
        for (int i = 0; i < 4; i++) w[i] = _mm256_fmsub_ps(w[i], _mm256_set1_ps(ks->s[u]), _mm256_set1_ps(ks->m[u]));
        return;
    }
    case I_Q6_K: {
        /* unit u: half n = u/4; v = u%4 picks ql offset (v&1)*32, nibble v>>1, qh bits 2v -> bits 4..5 */
        const int n = u >> 2, v = u & 3, sh = 4 - 2 * v;
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32 * (v & 1)));
        __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
        if (v >> 1) q = _mm256_srli_epi16(q, 4);
        h = sh > 0 ? _mm256_slli_epi16(h, sh) : sh < 0 ? _mm256_srli_epi16(h, -sh) : h;
        q = _mm256_or_si256(_mm256_and_si256(q, m0f), _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
        bytes_to_ps(q, 0, w);
        /* s * (q - 32) with one rounding, as ggml's d * sc * (q - 32); 16-element sub-blocks */
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_fmsub_ps(w[i], _mm256_set1_ps(ks->s[2 * u + i / 2]), _mm256_set1_ps(ks->m[2 * u + i / 2]));
        return;
    }
    case I_IQ4_XS: case I_Q3_K: case I_Q2_K: case I_IQ4_KS: case I_IQ4_K: case I_IQ3_K: case I_IQ2_K:
    case I_IQ5_K: case I_IQ2_KS: case I_IQ2_KL: case I_IQ3_XXS:
        bytes_to_ps(x_u32(ti, b, u), 0, w);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_fmsub_ps(w[i], _mm256_set1_ps(ks->s[2 * u + i / 2]), _mm256_set1_ps(ks->m[2 * u + i / 2]));
        return;
    }
}

HM_INLINE void kern_avx2(const int ti, const int R, const int NT, const uint8_t *const *w,
                         const uint8_t *const *pf, int64_t K, const float *const *x, float *res) {
    enum { NA = 2 };
    const int na = R * NT > 4 ? 1 : NA;   /* accumulators per (row, token): 16 vector registers */
    __m256 acc[4][4][NA];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    const int sup = IS_K(ti) ? 8 : 1;
    const int step = (ti == I_F32 || ti == I_F16 || ti == I_BF16) ? 32 * TINFO[ti].ts : TINFO[ti].ts;
    const pfreg pr = pf_regions(R, w, pf);
    const uint8_t *wb[4];                 /* where the blocks start (x types: after a row header) */
    float rd[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        wb[r] = w[r] + TINFO[ti].hdr;
        rd[r] = IS_X(ti) ? x_rowscale(ti, w[r]) : 1.0f;
    }
    const int64_t rb = K / (32 * sup) * step;
    kscale ks[4];
    for (int64_t o = 0, e0 = 0; o < rb; o += step, e0 += 32 * sup) {
        prefetch_step(pr, o, step);
        if (IS_K(ti))
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) prep_k(ti, wb[r] + o, rd[r], &ks[r]);
#pragma GCC unroll 8
        for (int u = 0; u < sup; u++) {
            __m256 wv[4][4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) unpack32_avx2(ti, wb[r] + o, u, &ks[r], wv[r]);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++)
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const __m256 xv = _mm256_loadu_ps(x[t] + e0 + 32 * u + 8 * i);
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        acc[r][t][i % na] = _mm256_fmadd_ps(wv[r][i], xv, acc[r][t][i % na]);
                }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const __m256 a = na > 1 ? _mm256_add_ps(acc[r][t][0], acc[r][t][1]) : acc[r][t][0];
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            res[r * NT + t] = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
        }
}

KTABLE(KTAB2, k2, kern_avx2)

/* 8 floats -> 8 bf16, round to nearest even, NaN kept quiet (as torch's .to(bfloat16)) */
static inline __m128i bf16_pack8(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                 _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(b, _mm256_set1_epi32(0x400000)),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* one row of K elements -> fp32 or bf16 */
static void deq_row_avx2(int wi, const uint8_t *row, int64_t k0, int64_t K, void *dst, int to_bf16) {
    const float rd = IS_X(wi) ? x_rowscale(wi, row) : 1.0f;
    row += TINFO[wi].hdr + blk_bytes(wi, k0);
#define DEQ2_CASE(TI) case TI: \
    for (int64_t g = 0; g < K / 32; g += IS_K(TI) ? 8 : 1) { \
        const uint8_t *b = unit_block(TI, row, g); \
        kscale ks; \
        if (IS_K(TI)) prep_k(TI, b, rd, &ks); \
        for (int u = 0; u < (IS_K(TI) ? 8 : 1); u++) { \
            __m256 wv[4]; \
            unpack32_avx2(TI, b, u, &ks, wv); \
            const int64_t e0 = (g + u) * 32; \
            for (int i = 0; i < 4; i++) { \
                if (to_bf16) _mm_storeu_si128((__m128i *)((uint16_t *)dst + e0 + 8 * i), bf16_pack8(wv[i])); \
                else _mm256_storeu_ps((float *)dst + e0 + 8 * i, wv[i]); \
            } \
        } \
    } \
    break;
    switch (wi) { EACH_TYPE(DEQ2_CASE) }
#undef DEQ2_CASE
}
#endif /* HM_AVX2 */

#if HM_AVX512

/* 32 elements (unit u of the block or super-block at b) -> two fp32 vectors */
HM_INLINE void unpack32(const int ti, const uint8_t *b, const int u, const kscale *ks,
                        __m512 *w0, __m512 *w1) {
    const __m512i m0f = _mm512_set1_epi32(0x0F);
    switch (ti) {
    case I_F32:
        *w0 = _mm512_loadu_ps((const float *)b + 32 * u);
        *w1 = _mm512_loadu_ps((const float *)b + 32 * u + 16);
        return;
    case I_F16:
        *w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 64 * u)));
        *w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 64 * u + 32)));
        return;
    case I_BF16:
        *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 64 * u))), 16));
        *w1 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 64 * u + 32))), 16));
        return;
    case I_Q4_0: case I_IQ4_NL: case I_MXFP4: {
        /* table of scale * value, indexed by nibble (vpermps reads only the low 4 bits) */
        const float *kv = ti == I_Q4_0 ? KV_Q4_0 : ti == I_IQ4_NL ? KV_IQ4NL : KV_MXFP4;
        const float d = ti == I_MXFP4 ? e8m0_half(b[0]) : F16(b);
        const __m512 tab = _mm512_mul_ps(_mm512_loadu_ps(kv), _mm512_set1_ps(d));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (ti == I_MXFP4 ? 1 : 2))));
        *w0 = _mm512_permutexvar_ps(q, tab);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tab);
        return;
    }
    case I_Q8_0: {
        const __m512 d = _mm512_set1_ps(F16(b));
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))));
        return;
    }
    case I_Q4_K: case I_Q5_K: {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 vs = _mm512_set1_ps(ks->s[u]), vm = _mm512_set1_ps(ks->m[u]);
        const uint8_t *q = b + (ti == I_Q5_K ? 48 : 16) + 32 * (u >> 1);
        __m512i qa = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        __m512i qb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
        if (u & 1) { qa = _mm512_srli_epi32(qa, 4); qb = _mm512_srli_epi32(qb, 4); }
        const __m512 tab = _mm512_fmsub_ps(iota, vs, vm);     /* s * q - m for q = 0..15 */
        if (ti == I_Q4_K) {
            *w0 = _mm512_permutexvar_ps(qa, tab);
            *w1 = _mm512_permutexvar_ps(qb, tab);
        } else {
            /* 5th bit: bit u of qh[l], moved to bit 4; 32-entry table in two registers */
            const __m512 tab_hi = _mm512_fmsub_ps(_mm512_add_ps(iota, _mm512_set1_ps(16)), vs, vm);
            __m512i ha = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)));
            __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32)));
            if (u <= 4) { ha = _mm512_slli_epi32(ha, 4 - u); hb = _mm512_slli_epi32(hb, 4 - u); }
            else { ha = _mm512_srli_epi32(ha, u - 4); hb = _mm512_srli_epi32(hb, u - 4); }
            /* bit select: low 4 bits from the nibble, the rest from the shifted qh */
            qa = _mm512_ternarylogic_epi32(qa, ha, m0f, 0xE4);
            qb = _mm512_ternarylogic_epi32(qb, hb, m0f, 0xE4);
            *w0 = _mm512_permutex2var_ps(tab, qa, tab_hi);
            *w1 = _mm512_permutex2var_ps(tab, qb, tab_hi);
        }
        return;
    }
    case I_Q6_K: {
        /* unit u: half n = u/4; v = u%4 picks ql offset (v&1)*32, nibble v>>1, qh bits 2v */
        const int n = u >> 2, v = u & 3;
        const uint8_t *ql = b + 64 * n + 32 * (v & 1), *qh = b + 128 + 32 * n;
        __m512i qa = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ql));
        __m512i qb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 16)));
        __m512i ha = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
        __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16)));
        if (v >> 1) { qa = _mm512_srli_epi32(qa, 4); qb = _mm512_srli_epi32(qb, 4); }
        const int sh = 4 - 2 * v;  /* bits 2v..2v+1 of qh -> bits 4..5 */
        if (sh > 0) { ha = _mm512_slli_epi32(ha, sh); hb = _mm512_slli_epi32(hb, sh); }
        else if (sh < 0) { ha = _mm512_srli_epi32(ha, -sh); hb = _mm512_srli_epi32(hb, -sh); }
        const __m512i m3f = _mm512_set1_epi32(0x3F);
        qa = _mm512_and_si512(_mm512_ternarylogic_epi32(qa, ha, m0f, 0xE4), m3f);
        qb = _mm512_and_si512(_mm512_ternarylogic_epi32(qb, hb, m0f, 0xE4), m3f);
        /* s * (q - 32) with one rounding, as ggml's d * sc * (q - 32) */
        *w0 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(qa), _mm512_set1_ps(ks->s[2 * u]), _mm512_set1_ps(ks->m[2 * u]));
        *w1 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(qb), _mm512_set1_ps(ks->s[2 * u + 1]), _mm512_set1_ps(ks->m[2 * u + 1]));
        return;
    }
    case I_IQ4_XS: case I_Q3_K: case I_Q2_K: case I_IQ4_KS: case I_IQ4_K: case I_IQ3_K: case I_IQ2_K:
    case I_IQ5_K: case I_IQ2_KS: case I_IQ2_KL: case I_IQ3_XXS: {
        const __m256i q = x_u32(ti, b, u);
        *w0 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q))),
                              _mm512_set1_ps(ks->s[2 * u]), _mm512_set1_ps(ks->m[2 * u]));
        *w1 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1))),
                              _mm512_set1_ps(ks->s[2 * u + 1]), _mm512_set1_ps(ks->m[2 * u + 1]));
        return;
    }
    }
}

HM_INLINE void kern_avx(const int ti, const int R, const int NT, const uint8_t *const *w,
                        const uint8_t *const *pf, int64_t K, const float *const *x, float *res) {
    __m512 acc[4][4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
    const int sup = IS_K(ti) ? 8 : 1;  /* units per block */
    /* bytes per step of the loop below (a block, a K super-block, or 32 floats); all rows
     * advance by the same offset o */
    const int step = (ti == I_F32 || ti == I_F16 || ti == I_BF16) ? 32 * TINFO[ti].ts : TINFO[ti].ts;
    const pfreg pr = pf_regions(R, w, pf);
    const uint8_t *wb[4];                 /* where the blocks start (x types: after a row header) */
    float rd[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        wb[r] = w[r] + TINFO[ti].hdr;
        rd[r] = IS_X(ti) ? x_rowscale(ti, w[r]) : 1.0f;
    }
    const int64_t rb = K / (32 * sup) * step;
    kscale ks[4];
    for (int64_t o = 0, e0 = 0; o < rb; o += step, e0 += 32 * sup) {
        prefetch_step(pr, o, step);
        if (IS_K(ti)) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) prep_k(ti, wb[r] + o, rd[r], &ks[r]);
            /* read the scales back from memory: broadcasts from memory are load-port work,
             * broadcasts from registers would compete with the permutes for shuffle ports */
            __asm__ volatile("" : : "r"(ks) : "memory");
        }
#pragma GCC unroll 8
        for (int u = 0; u < sup; u++) {
            __m512 wv[4][2];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) unpack32(ti, wb[r] + o, u, &ks[r], &wv[r][0], &wv[r][1]);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                __m512 xa = _mm512_loadu_ps(x[t] + e0 + 32 * u), xb = _mm512_loadu_ps(x[t] + e0 + 32 * u + 16);
                /* keep x in registers for all R rows: folded memory operands would reload it
                 * per row and saturate the load ports */
                __asm__("" : "+v"(xa), "+v"(xb));
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    acc[r][t][0] = _mm512_fmadd_ps(wv[r][0], xa, acc[r][t][0]);
                    acc[r][t][1] = _mm512_fmadd_ps(wv[r][1], xb, acc[r][t][1]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            res[r * NT + t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1]));
}

KTABLE(KTAB, k, kern_avx)
#endif /* HM_AVX512 */

/* the vector kernels in use: 2 AVX-512, 1 AVX2, 0 portable C (hm_set_simd lowers it for tests) */
#define SIMD_BEST (HM_AVX512 ? 2 : HM_AVX2 ? 1 : 0)
static int g_simd = SIMD_BEST;

/* res[R][NT] = rows w[0..R) . x[0..NT); R in {1,2,4}, NT in 1..4 (R == 4 only with NT <= 2) */
static inline void dot_rows(int ti, int R, int NT, const uint8_t *const *w, const uint8_t *const *pf,
                            int64_t K, const float *const *x, float *res) {
#if HM_AVX512
    if (g_simd == 2) { KTAB[ti][R][NT](w, pf, K, x, res); return; }
#endif
#if HM_AVX2
    if (g_simd == 1) { KTAB2[ti][R][NT](w, pf, K, x, res); return; }
#endif
    kern_generic(ti, R, NT, w, pf, K, x, res);
}

/* ------------------------------------------------------------------ integer path (one token)
 *
 * For a weight row used by a single token (decode: each expert sees one token), the 4-bit
 * types run on integer dot products (vpdpbusd: 64 multiply-adds per instruction) instead of
 * fp32 FMAs (16 per instruction). Activations are quantized per 32-block in two int8 terms,
 * x ~ d/256 * (256 q1 + q2), q1 = round(x/d), q2 = round(256 (x/d - q1)), d = max|x|/127:
 * about 15 bits, so the rounding error stays near int16's (~3e-5 of the block max) rather
 * than int8's. The two dot products combine exactly in int32: A = (w.q1 << 8) + w.q2.
 * Nibbles are unpacked with one GF(2) affine byte op (gf2p8affineqb) per 64 weights.
 */
#if HM_AVX512 && defined(__AVX512VNNI__) && defined(__GFNI__)
#define HM_VNNI 1
#else
#define HM_VNNI 0
#endif
/* the same on 256 bits, for CPUs with AVX-VNNI and GFNI but no AVX-512 (Intel client cores since
 * Alder Lake): Q4_0, Q4_K, Q5_K and Q6_K */
#if HM_AVX2 && defined(__AVXVNNI__) && defined(__GFNI__)
#define HM_AVXVNNI 1
#else
#define HM_AVXVNNI 0
#endif
/* the integer path in use: AVX-512 VNNI on the AVX-512 path, AVX-VNNI on the AVX2 one */
#define INT8_512 (HM_VNNI && g_simd == 2)
#define INT8_256 (HM_AVXVNNI && g_simd == 1)

/* activations of one row, quantized: see quant_x8 */
typedef struct {
    int8_t *q1, *q2;      /* [K] */
    float *xs;            /* [K/64][16]: d/256 of block 2p in lanes 0-7, of block 2p+1 in 8-15 */
    int32_t *c1, *c2;     /* [K/64][16]: -8 * sum(q1), -8 * sum(q2) of each block in lanes 0 / 8 */
    float *sxf;           /* [K/32]: sum of the quantized x of each block */
    float *sx16;          /* [K/16]: the same per 16 elements (Q6_K's sub-blocks) */
    /* for the canonical integer dot products (below): */
    float *xsb;           /* [K/32]: d/256 of each block */
    int32_t *sxi;         /* [K/32]: sum of X = 256 q1 + q2 over each block (exact) */
    int32_t *sxi4;        /* [K/16][4]: the same per 16 elements, each 4 times (Q6_K: a 128-bit lane each) */
} xq8;

static size_t xq8_bytes(int64_t K) {
    return (size_t)K * 2 + (size_t)(K / 64) * 64 * 3 + (size_t)(K / 32) * 4 + (size_t)(K / 16) * 4 +
           (size_t)(K / 32) * 8 + (size_t)(K / 16) * 16 + 64 * 9;
}

static void xq8_init(xq8 *q, void *mem, int64_t K) {
    uintptr_t p = ((uintptr_t)mem + 63) & ~(uintptr_t)63;
    q->q1 = (int8_t *)p; p += (size_t)K;
    q->q2 = (int8_t *)p; p += (size_t)K;
    q->xs = (float *)p; p += (size_t)(K / 64) * 64;
    q->c1 = (int32_t *)p; p += (size_t)(K / 64) * 64;
    q->c2 = (int32_t *)p; p += (size_t)(K / 64) * 64;
    q->sxf = (float *)p; p += (size_t)(K / 32) * 4;
    q->sx16 = (float *)p; p += (size_t)(K / 16) * 4;
    p = (p + 63) & ~(uintptr_t)63;
    q->xsb = (float *)p; p += (size_t)(K / 32) * 4;
    q->sxi = (int32_t *)p; p += (size_t)(K / 32) * 4;
    p = (p + 63) & ~(uintptr_t)63;
    q->sxi4 = (int32_t *)p;
}

/* the canonical record of block b: d/256, the exact block sum of X, the per-16 sums (all paths) */
static inline void xq8_sums(const xq8 *q, int64_t b, float xs, int t1, int t2, const int g1[2], const int g2[2]) {
    q->xsb[b] = xs;
    q->sxi[b] = 256 * t1 + t2;
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4; i++) q->sxi4[(2 * b + h) * 4 + i] = 256 * g1[h] + g2[h];
}

/* Activation terms of the integer path: 2 (default), x ~ d/256 (256 q1 + q2), about 15 bits; 1: q2 = 0, plain
 * int8 as ggml's q8_0 (the same formulas with q2 = 0, so every kernel stays canonical; the kernels then skip the
 * second term's products: int8 AMX tiles ~1.45x faster a block, docs/cpu-kernels.md). hm_set_act_terms. */
static int g_xterms = 2;

/* quantize blocks [b0, b1) of 32 elements of x (b0, b1 even) */
static void quant_x8(const float *x, int64_t b0, int64_t b1, const xq8 *q) {
    const float t2 = g_xterms > 1 ? 1.0f : 0.0f;        /* the second term, or none */
#if HM_VNNI
    if (INT8_512) {
        for (int64_t b = b0; b < b1; b++) {
            const float *xb = x + 32 * b;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d = amax / 127, id = amax > 0 ? 127 / amax : 0;
            __m512i s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
            int h1[2], h2[2];
            for (int h = 0; h < 2; h++) {
                const __m512 v = _mm512_mul_ps(h ? v1 : v0, _mm512_set1_ps(id));
                const __m512 r1 = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                __m512 r2 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, r1), _mm512_set1_ps(256)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r2 = _mm512_mul_ps(_mm512_min_ps(_mm512_max_ps(r2, _mm512_set1_ps(-127)), _mm512_set1_ps(127)),
                                   _mm512_set1_ps(t2));
                const __m512i i1 = _mm512_cvtps_epi32(r1), i2 = _mm512_cvtps_epi32(r2);
                _mm_storeu_si128((__m128i *)(q->q1 + 32 * b + 16 * h), _mm512_cvtepi32_epi8(i1));
                _mm_storeu_si128((__m128i *)(q->q2 + 32 * b + 16 * h), _mm512_cvtepi32_epi8(i2));
                s1 = _mm512_add_epi32(s1, i1);
                s2 = _mm512_add_epi32(s2, i2);
                h1[h] = _mm512_reduce_add_epi32(i1);
                h2[h] = _mm512_reduce_add_epi32(i2);
            }
            for (int h = 0; h < 2; h++) q->sx16[2 * b + h] = d / 256 * (float)(256 * h1[h] + h2[h]);
            const int t1 = _mm512_reduce_add_epi32(s1), t2 = _mm512_reduce_add_epi32(s2);
            xq8_sums(q, b, d / 256, t1, t2, h1, h2);
            const int64_t p = b / 2, l = (b & 1) * 8;
            _mm256_storeu_ps(q->xs + 16 * p + l, _mm256_set1_ps(d / 256));
            _mm256_storeu_si256((__m256i *)(q->c1 + 16 * p + l), _mm256_setr_epi32(-8 * t1, 0, 0, 0, 0, 0, 0, 0));
            _mm256_storeu_si256((__m256i *)(q->c2 + 16 * p + l), _mm256_setr_epi32(-8 * t2, 0, 0, 0, 0, 0, 0, 0));
            q->sxf[b] = d / 256 * (float)(256 * t1 + t2);
        }
        return;
    }
#endif
#if HM_AVXVNNI
    if (INT8_256) {
        for (int64_t b = b0; b < b1; b++) {
            const float *xb = x + 32 * b;
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            const float d = amax / 127, id = amax > 0 ? 127 / amax : 0;
            __m256i i1[4], i2[4], s1 = _mm256_setzero_si256(), s2 = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256 vi = _mm256_mul_ps(v[i], _mm256_set1_ps(id));
                const __m256 r1 = _mm256_round_ps(vi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                __m256 r2 = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(vi, r1), _mm256_set1_ps(256)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r2 = _mm256_mul_ps(_mm256_min_ps(_mm256_max_ps(r2, _mm256_set1_ps(-127)), _mm256_set1_ps(127)),
                                   _mm256_set1_ps(t2));
                i1[i] = _mm256_cvtps_epi32(r1);
                i2[i] = _mm256_cvtps_epi32(r2);
                s1 = _mm256_add_epi32(s1, i1[i]);
                s2 = _mm256_add_epi32(s2, i2[i]);
            }
            const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            const __m256i q1 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(
                _mm256_packs_epi32(i1[0], i1[1]), _mm256_packs_epi32(i1[2], i1[3])), order);
            const __m256i q2 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(
                _mm256_packs_epi32(i2[0], i2[1]), _mm256_packs_epi32(i2[2], i2[3])), order);
            _mm256_storeu_si256((__m256i *)(q->q1 + 32 * b), q1);
            _mm256_storeu_si256((__m256i *)(q->q2 + 32 * b), q2);
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s1), _mm256_extracti128_si256(s1, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
            const int t1 = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
            t = _mm_add_epi32(_mm256_castsi256_si128(s2), _mm256_extracti128_si256(s2, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
            const int t2 = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
            const int64_t p = b / 2, l = (b & 1) * 8;
            _mm256_storeu_ps(q->xs + 16 * p + l, _mm256_set1_ps(d / 256));
            _mm256_storeu_si256((__m256i *)(q->c1 + 16 * p + l), _mm256_setr_epi32(-8 * t1, 0, 0, 0, 0, 0, 0, 0));
            _mm256_storeu_si256((__m256i *)(q->c2 + 16 * p + l), _mm256_setr_epi32(-8 * t2, 0, 0, 0, 0, 0, 0, 0));
            q->sxf[b] = d / 256 * (float)(256 * t1 + t2);
            int gg1[2], gg2[2];
            for (int h = 0; h < 2; h++) {              /* per 16 elements: i1[2h], i1[2h + 1] */
                int32_t u1[8], u2[8];
                _mm256_storeu_si256((__m256i *)u1, _mm256_add_epi32(i1[2 * h], i1[2 * h + 1]));
                _mm256_storeu_si256((__m256i *)u2, _mm256_add_epi32(i2[2 * h], i2[2 * h + 1]));
                int g1 = 0, g2 = 0;
                for (int j = 0; j < 8; j++) { g1 += u1[j]; g2 += u2[j]; }
                q->sx16[2 * b + h] = d / 256 * (float)(256 * g1 + g2);
                gg1[h] = g1;
                gg2[h] = g2;
            }
            xq8_sums(q, b, d / 256, t1, t2, gg1, gg2);
        }
        return;
    }
#endif
    for (int64_t b = b0; b < b1; b++) {
        const float *xb = x + 32 * b;
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float d = amax / 127, id = amax > 0 ? 127 / amax : 0;
        int s1 = 0, s2 = 0, g1[2] = {0, 0}, g2[2] = {0, 0};
        for (int i = 0; i < 32; i++) {
            const float v = xb[i] * id, r1 = rintf(v);
            float r2 = rintf((v - r1) * 256);
            r2 = (r2 > 127 ? 127 : r2 < -127 ? -127 : r2) * t2;
            q->q1[32 * b + i] = (int8_t)r1;
            q->q2[32 * b + i] = (int8_t)r2;
            s1 += (int)r1;
            s2 += (int)r2;
            g1[i / 16] += (int)r1;
            g2[i / 16] += (int)r2;
        }
        for (int h = 0; h < 2; h++) q->sx16[2 * b + h] = d / 256 * (float)(256 * g1[h] + g2[h]);
        xq8_sums(q, b, d / 256, s1, s2, g1, g2);
        const int64_t p = b / 2, l = (b & 1) * 8;
        for (int i = 0; i < 8; i++) {
            q->xs[16 * p + l + i] = d / 256;
            q->c1[16 * p + l + i] = i ? 0 : -8 * s1;
            q->c2[16 * p + l + i] = i ? 0 : -8 * s2;
        }
        q->sxf[b] = d / 256 * (float)(256 * s1 + s2);
    }
}

/* ------------------------------------------------------------------ canonical integer dot products
 *
 * On the integer path the result of (weight row) . (one token's activations) is defined, bit for bit, by
 * cdot_ref below, and every kernel that computes it reproduces it exactly: the streaming kernels for any
 * number of tokens (decode, small batches) and the AMX tile kernels of prompts. So a token's results do
 * not depend on which other tokens share its batch, and a prompt split anywhere gives the same logits.
 * With X = 256 q1 + q2 the quantized activations (quant_x8: xs_b = d/256 per 32-block b):
 * - 32-weight block types (Q4_0: v = q - 8; Q8_0: v = q; IQ4_NL, MXFP4: v = the table's integer; scale dw):
 *     I_b = sum v X over the block (exact int32), acc = fma((float)I_b, dw_b * xs_b, acc), b ascending.
 * - Q4_K, Q5_K (sub-block j of 32 in a super-block; S_j = d sc_j, M_j = dmin m_j, v = q unsigned):
 *     acc = fma((float)I_b, S_j * xs_b, acc), accm = fma(M_j, sx_b, accm) (sx_b = xs_b sum X, quant_x8's sxf),
 *     two chains, b ascending; the result is acc - accm.
 * - Q6_K (sub-block i of 16, S_i = d sc_i, v = q - 32):
 *     I_i = sum v X over the 16, acc = fma((float)I_i, S_i * xs_(i/2), acc).
 * - x types (IQ4_XS, Q3_K, Q2_K, IQ4_KS, IQ4_K, IQ3_K, IQ2_K; sub-block i of 16, v = u - X_OFF, S_i, M_i as x_scales):
 *     I_i = sum v X over the 16, acc = fma((float)I_i, S_i * xs_(i/2), acc), Q2_K: accm = fma(M_i, sx16_i, accm)
 *     (sx16_i = xs sum X over the 16, quant_x8's sx16); the result is acc - accm.
 * One chain per (row, token) over the blocks in order: the integers are exact however a kernel sums them
 * (lanes, tiles), and the float steps are the same few roundings in the same order everywhere.
 */
static inline int b32_value(int ti, const uint8_t *blk, int l) {
    if (ti == I_Q8_0) return (int8_t)blk[2 + l];
    const uint8_t *qs = blk + (ti == I_MXFP4 ? 1 : 2);
    const int n = l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4;
    return ti == I_Q4_0 ? n - 8 : ti == I_IQ4_NL ? (int)KV_IQ4NL[n] : (int)KV_MXFP4[n];
}

static inline float b32_scale(int ti, const uint8_t *blk) {
    return ti == I_MXFP4 ? e8m0_half(blk[0]) : fp16_to_f32(rd16(blk));
}

/* the scales of K-quant super-block b: S[16], M[16] as prep_k computes them (Q4_K/Q5_K: 8 of each) */
static void kq_scales(int ti, const uint8_t *b, float *S, float *M) {
    if (ti == I_Q6_K) {
        const float d = fp16_to_f32(rd16(b + 208));
        for (int i = 0; i < 16; i++) { S[i] = d * (float)(int8_t)b[192 + i]; M[i] = 32.0f * S[i]; }
        return;
    }
    const float d = fp16_to_f32(rd16(b)), dmin = fp16_to_f32(rd16(b + 2));
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k_scale_min(j, b + 4, &sc, &m);
        S[j] = (float)sc * d;
        M[j] = (float)m * dmin;
    }
}

/* element e (0..255) of K-quant super-block b as the integer the canonical sums take (v above) */
static inline int kq_value(int ti, const uint8_t *b, int e) {
    if (ti == I_Q6_K) {
        const int h = e / 128, r = e % 128, g4 = r / 32, l = r % 32;
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const int lo = (g4 & 1) ? ql[l + 32] : ql[l];
        return ((g4 & 2 ? lo >> 4 : lo & 0xF) | (((qh[l] >> (2 * g4)) & 3) << 4)) - 32;
    }
    const int j = e / 32, l = e % 32;
    const uint8_t *qs = b + (ti == I_Q5_K ? 48 : 16) + 32 * (j >> 1);
    int v = (j & 1) ? qs[l] >> 4 : qs[l] & 0xF;
    if (ti == I_Q5_K) v |= ((b[16 + l] >> j) & 1) << 4;
    return v;
}

/* the canonical integer-path result for one row (K elements) and one quantized token */
static float cdot_ref(int ti, const uint8_t *row, int64_t K, const xq8 *q) {
    float acc = 0.0f;
    if (!IS_K(ti)) {
        for (int64_t b = 0; b < K / 32; b++) {
            const uint8_t *blk = row + b * TINFO[ti].ts;
            int32_t I = 0;
            for (int l = 0; l < 32; l++) I += b32_value(ti, blk, l) * (256 * q->q1[32 * b + l] + q->q2[32 * b + l]);
            acc = fmaf((float)I, b32_scale(ti, blk) * q->xsb[b], acc);
        }
        return acc;
    }
    float accm = 0.0f;
    if (IS_X(ti)) {
        const float rd = x_rowscale(ti, row);
        for (int64_t s = 0; s < K / 256; s++) {
            const uint8_t *b = row + TINFO[ti].hdr + s * TINFO[ti].ts;
            float S[16], M[16];
            x_scales(ti, b, rd, S, M);
            for (int i = 0; i < 16; i++) {
                const int64_t e0 = 256 * s + 16 * i;
                int32_t I = 0;
                for (int l = 0; l < 16; l++)
                    I += (x_value(ti, b, 16 * i + l) - X_OFF(ti)) * (256 * q->q1[e0 + l] + q->q2[e0 + l]);
                acc = fmaf((float)I, S[i] * q->xsb[e0 / 32], acc);
                if (X_MIN(ti)) accm = fmaf(M[i], q->sx16[e0 / 16], accm);
            }
        }
        return acc - accm;
    }
    for (int64_t s = 0; s < K / 256; s++) {
        const uint8_t *b = row + s * TINFO[ti].ts;
        float S[16], M[16];
        kq_scales(ti, b, S, M);
        const int n = ti == I_Q6_K ? 16 : 8, len = 256 / n;
        for (int i = 0; i < n; i++) {
            int32_t I = 0;
            const int64_t e0 = 256 * s + len * i, blk = e0 / 32;
            for (int l = 0; l < len; l++) I += kq_value(ti, b, len * i + l) * (256 * q->q1[e0 + l] + q->q2[e0 + l]);
            acc = fmaf((float)I, S[i] * q->xsb[blk], acc);
            if (ti != I_Q6_K) accm = fmaf(M[i], q->sxf[blk], accm);
        }
    }
    return acc - accm;
}

/* gf2p8affineqb matrices (one per qword): byte 7-i of a qword selects the input bits that
 * form output bit i. LO keeps bits 0-3, HI moves bits 4-7 down, BIT(k) moves bit k to bit 4. */
#define GF_LO 0x0102040800000000ull
#define GF_HI 0x1020408000000000ull
#define GF_BIT(k) ((uint64_t)(1u << (k)) << 24)
#define GF_2BITS(k) (GF_BIT(k) | (uint64_t)(1u << ((k) + 1)) << 16)   /* bits k, k+1 -> bits 4, 5 */
#define GF_2LOW(k) ((uint64_t)(1u << (k)) << 56 | (uint64_t)(1u << ((k) + 1)) << 48)   /* bits k, k+1 -> 0, 1 */
#define GF_TO2(k) ((uint64_t)(1u << (k)) << 40)                                       /* bit k -> bit 2 */

typedef void (*kq_fn)(const uint8_t *const *w, const uint8_t *const *pf, int64_t K, const xq8 *xq, float *res);
/* an integer-path kernel FN(ti, R, ...) for every type and R of 1, 2, 4 rows, and the table NAME[type][R] */
#define KQSHAPE(P, FN, TI, R) \
    static void P##_##TI##_##R(const uint8_t *const *w, const uint8_t *const *pf, int64_t K, const xq8 *xq, \
                               float *res) { FN(TI, R, w, pf, K, xq, res); }
#define KQSHAPES(P, FN, TI) KQSHAPE(P, FN, TI, 1) KQSHAPE(P, FN, TI, 2) KQSHAPE(P, FN, TI, 4)
#define KQROW(P, TI) {0, P##_##TI##_1, P##_##TI##_2, 0, P##_##TI##_4}
#define KQTABLE(NAME, P, FN) \
    KQSHAPES(P, FN, I_Q4_0) KQSHAPES(P, FN, I_Q4_K) KQSHAPES(P, FN, I_Q5_K) KQSHAPES(P, FN, I_Q6_K) \
    KQSHAPES(P, FN, I_IQ4_NL) KQSHAPES(P, FN, I_MXFP4) \
    static const kq_fn NAME[N_TYPES][5] = { \
        [I_Q4_0] = KQROW(P, I_Q4_0), [I_Q4_K] = KQROW(P, I_Q4_K), [I_Q5_K] = KQROW(P, I_Q5_K), \
        [I_Q6_K] = KQROW(P, I_Q6_K), [I_IQ4_NL] = KQROW(P, I_IQ4_NL), [I_MXFP4] = KQROW(P, I_MXFP4), };

/* The 32-weight block types on the integer path: 16 bytes of nibbles after a scale, each nibble an entry of a
 * table of small integers (Q4_0: q - 8). vpdpbusd wants the weights unsigned, so the tables are offset by
 * 8 << B32_SHIFT and the offset is taken off with the blocks' -8 sum(q) << B32_SHIFT (c1, c2). */
#define IS_B32(ti) ((ti) == I_Q4_0 || (ti) == I_IQ4_NL || (ti) == I_MXFP4)
#define B32_SHIFT(ti) ((ti) == I_IQ4_NL ? 4 : (ti) == I_MXFP4 ? 1 : 0)          /* offsets 128, 16, 8 */
#define B32_QS(ti) ((ti) == I_MXFP4 ? 1 : 2)                                   /* where the nibbles start */
static const uint8_t KU8_MXFP4[16] = {16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4};
#if HM_AVX2
static float g_e8m0[256];                 /* MXFP4's block scales */
__attribute__((constructor)) static void init_e8m0_table(void) {
    for (int i = 0; i < 256; i++) g_e8m0[i] = e8m0_half((uint8_t)i);
}
/* a block's scale, as a float in memory (broadcast loads) */
#define B32_D(ti, b) ((ti) == I_MXFP4 ? &g_e8m0[(b)[0]] : &F16(b))
#endif

static int q8_type(int ti, int64_t K) {
    return K % 64 == 0 && (INT8_512 || INT8_256) &&
           (IS_B32(ti) || ti == I_Q4_K || ti == I_Q5_K || ti == I_Q6_K || ((ti == I_Q8_0 || IS_X(ti)) && INT8_512));
}

#if HM_VNNI

/* 4 rows' int32 lanes a[r] (16 lanes of 4 weights) -> per 128-bit lane L: [the 4 rows' sums over lane L's 16
 * weights]. Exact integers: the order of these additions does not matter. */
HM_INLINE __m512i rows4_lanes(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i p01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i p23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(p01, p23), _mm512_unpackhi_epi64(p01, p23));
}

/* the offset of the unsigned bytes the 32-block types' dot products take: u = v + off */
#define QC_OFF(ti) ((ti) == I_Q4_0 ? 8 : (ti) == I_MXFP4 ? 16 : 128)

/* 64 weights (the blocks at b0 and b0 + ts) of a 32-block type as unsigned bytes v + QC_OFF */
HM_INLINE __m512i qc_b32(const int ti, const uint8_t *b0, const int ts) {
    if (ti == I_Q8_0) {
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                             _mm256_loadu_si256((const __m256i *)(b0 + ts + 2)), 1);
        return _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80));
    }
    const __m512i mq40 = _mm512_set_epi64(GF_HI, GF_HI, GF_LO, GF_LO, GF_HI, GF_HI, GF_LO, GF_LO);
    /* 128-bit lanes [qs0, qs0, qs1, qs1] -> nibbles [lo0, hi0, lo1, hi1] = 64 weights in order */
    __m512i q = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b0 + B32_QS(ti))));
    q = _mm512_mask_broadcast_i32x4(q, 0xFF00, _mm_loadu_si128((const __m128i *)(b0 + ts + B32_QS(ti))));
    q = _mm512_gf2p8affine_epi64_epi8(q, mq40, 0);
    if (ti != I_Q4_0)
        q = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(
            ti == I_IQ4_NL ? KU8_IQ4NL : KU8_MXFP4))), q);
    return q;
}

/* sum over 4 weights of u (256 q1 + q2) per lane, exact (one term: q2 = 0, its products skipped) */
HM_INLINE __m512i qc_dot(__m512i u, __m512i x1, __m512i x2) {
    const __m512i a = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x1), 8);
    return g_xterms > 1 ? _mm512_dpbusd_epi32(a, u, x2) : a;
}

/* x_extra16 in a few vector ops */
HM_INLINE int x_extra16v(const int ti, const uint8_t *b) {
    if (ti != I_IQ4_KS && ti != I_IQ2_KS) return X_EXTRA(ti) ? rd16(b + 2) : 0;
    /* per 32 (IQ4_KS: bit 0 of the 8 scale bytes; IQ2_KS: the low byte at b), each twice for the sub-blocks of 16 */
    const unsigned m = ti == I_IQ2_KS ? b[0] :
        (unsigned)_mm_movemask_epi8(_mm_slli_epi16(_mm_loadl_epi64((const __m128i *)b), 7)) & 0xFF;
#if defined(__BMI2__)
    return (int)(_pdep_u32(m, 0x5555u) * 3);
#else
    int r = 0;
    for (int k = 0; k < 8; k++) r |= (int)((m >> k) & 1) * 3 << 2 * k;
    return r;
#endif
}

/* 4 bits -> a byte mask of the 128-bit lanes they stand for */
HM_INLINE __mmask64 lanes_mask(unsigned b4) {
    return (((uint64_t)(b4 & 1) | (uint64_t)(b4 & 2) << 15 | (uint64_t)(b4 & 4) << 30 | (uint64_t)(b4 & 8) << 45) *
            0xFFFFu);
}

/* chunk c (elements 64c..64c+63) of x-type super-block b as unsigned bytes, in element order (ex: x_extra16) */
HM_INLINE __m512i x_u64(const int ti, const uint8_t *b, const int c, const int ex) {
    __m512i q;
    if (X_GRID(ti)) {   /* sub-blocks 2c, 2c + 1: 16 grid entries (vpgatherdd), then 64 +- the magnitude */
        const __m512i g = _mm512_i32gather_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * c))),
                                                 (const void *)IQ3XXS_GRID, 4);
        uint64_t neg = 0;
#if defined(__BMI2__)
        {   /* the 8 codes (7 bits each, 4 in each sub-block's u32) spread to bytes, each byte's parity on top */
            uint32_t a0, a1;
            memcpy(&a0, b + 66 + 8 * c, 4);
            memcpy(&a1, b + 70 + 8 * c, 4);
            const uint64_t codes = _pdep_u64(a0, 0x7F7F7F7Full) | _pdep_u64(a1, 0x7F7F7F7Full) << 32;
            uint64_t p = codes ^ (codes >> 4);
            p ^= p >> 2;
            p ^= p >> 1;
            neg = codes | (p & 0x0101010101010101ull) << 7;
        }
#else
        for (int k = 0; k < 8; k++) neg |= (uint64_t)xxs_signs(b, 2 * c + k / 4, k % 4) << 8 * k;
#endif
        const __m512i o = _mm512_set1_epi8(64);
        return _mm512_mask_sub_epi8(_mm512_add_epi8(o, g), (__mmask64)neg, o, g);
    }
    if (X_PAIRS(ti)) {   /* sub-blocks 2c, 2c + 1: 32 pair indices -> 32 u16 of two u each (vpermw) */
        const __m128i m4 = _mm_set1_epi8(0x0F), b4 = _mm_set1_epi8(0x10);
        const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 6 + 16 * c));
        const __m128i qh = _mm_loadu_si128((const __m128i *)(b + 70));
        const __m128i i0 = _mm_or_si128(_mm_and_si128(qs, m4), _mm_and_si128(_mm_slli_epi16(_mm_srli_epi16(qh, 2 * c), 4), b4));
        const __m128i i1 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), m4),
                                        _mm_and_si128(_mm_slli_epi16(_mm_srli_epi16(qh, 2 * c + 1), 4), b4));
        const __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(i1, i0));
        return _mm512_permutexvar_epi16(idx, _mm512_load_si512((const void *)KL_PAIRS));
    }
    if (X_NIB64(ti)) {   /* [qs, qs] -> [low nibbles, high nibbles], bits 2c, 2c + 1 of qh -> bit 4 */
        const __m512i mqk = _mm512_set_epi64(GF_HI, GF_HI, GF_HI, GF_HI, GF_LO, GF_LO, GF_LO, GF_LO);
        const __m512i mh = _mm512_set_epi64(GF_BIT(2 * c + 1), GF_BIT(2 * c + 1), GF_BIT(2 * c + 1), GF_BIT(2 * c + 1),
                                            GF_BIT(2 * c), GF_BIT(2 * c), GF_BIT(2 * c), GF_BIT(2 * c));
        q = _mm512_gf2p8affine_epi64_epi8(_mm512_broadcast_i64x4(_mm256_loadu_si256(
            (const __m256i *)(b + X_QS(ti) + 32 * c))), mqk, 0);
        q = _mm512_or_si512(q, _mm512_gf2p8affine_epi64_epi8(_mm512_broadcast_i64x4(_mm256_loadu_si256(
            (const __m256i *)(b + X_QH(ti)))), mh, 0));
        /* 32-entry tables, two per extra bit: four vpshufb, merged by bit 4 and the lanes' extra bits */
        const __mmask64 h = _mm512_test_epi8_mask(q, _mm512_set1_epi8(0x10)), e = lanes_mask((unsigned)(ex >> 4 * c) & 0xF);
#define XT(k, o) _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)(XTAB[ti][k] + (o))))
        __m512i u = _mm512_shuffle_epi8(XT(0, 0), q);
        u = _mm512_mask_shuffle_epi8(u, h & ~e, XT(0, 16), q);
        u = _mm512_mask_shuffle_epi8(u, ~h & e, XT(1, 0), q);
        return _mm512_mask_shuffle_epi8(u, h & e, XT(1, 16), q);
#undef XT
    }
    if (X_NIB(ti)) {   /* 32-blocks 2c, 2c + 1: [qs0, qs0, qs1, qs1] -> nibbles [lo0, hi0, lo1, hi1] */
        const __m512i mq40 = _mm512_set_epi64(GF_HI, GF_HI, GF_LO, GF_LO, GF_HI, GF_HI, GF_LO, GF_LO);
        q = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b + X_QS(ti) + 32 * c)));
        q = _mm512_mask_broadcast_i32x4(q, 0xFF00, _mm_loadu_si128((const __m128i *)(b + X_QS(ti) + 16 + 32 * c)));
        q = _mm512_gf2p8affine_epi64_epi8(q, mq40, 0);
    } else {
        /* units 2(c&1), 2(c&1) + 1 of half c/2: the same 32 bytes of 2-bit fields, bit pairs j0, j0 + 1 */
        const int n = c >> 1, j0 = 2 * (c & 1);
        const __m512i m2 = _mm512_set_epi64(GF_2LOW(2 * j0 + 2), GF_2LOW(2 * j0 + 2), GF_2LOW(2 * j0 + 2),
            GF_2LOW(2 * j0 + 2), GF_2LOW(2 * j0), GF_2LOW(2 * j0), GF_2LOW(2 * j0), GF_2LOW(2 * j0));
        q = _mm512_gf2p8affine_epi64_epi8(_mm512_broadcast_i64x4(_mm256_loadu_si256(
            (const __m256i *)(b + X_QS(ti) + 32 * n))), m2, 0);
        if (X_3BIT(ti)) {
            const int k = 4 * n + j0;   /* qh bits k, k + 1 -> bit 2 */
            const __m512i mh = _mm512_set_epi64(GF_TO2(k + 1), GF_TO2(k + 1), GF_TO2(k + 1), GF_TO2(k + 1),
                                                GF_TO2(k), GF_TO2(k), GF_TO2(k), GF_TO2(k));
            q = _mm512_or_si512(q, _mm512_gf2p8affine_epi64_epi8(
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + X_QH(ti)))), mh, 0));
        }
    }
    if (!X_TAB(ti)) return q;
    const __m512i u = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)XTAB[ti][0])), q);
    if (!X_EXTRA(ti)) return u;
    return _mm512_mask_shuffle_epi8(u, lanes_mask((unsigned)(ex >> 4 * c) & 0xF),
                                    _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)XTAB[ti][1])), q);
}

/* 8 bytes of nibbles -> the 16 nibbles in order (low, high of byte 0, ...) as int32 */
HM_INLINE __m512i nibbles16(const uint8_t *p) {
    const __m128i x = _mm_loadl_epi64((const __m128i *)p), m4 = _mm_set1_epi8(0x0F);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
}

/* x_scales of super-block b in vectors: S (and M, Q2_K's mins) of the 16 sub-blocks, the same floats */
HM_INLINE void x_scales16(const int ti, const uint8_t *b, const float rd, __m512 *S, __m512 *M) {
    *M = _mm512_setzero_ps();
    switch (ti) {
    case I_Q2_K: {
        const __m128i v = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(0x0F);
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b + 80)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, m4))));
        *M = _mm512_mul_ps(_mm512_set1_ps(F16(b + 82)),
                           _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m4))));
        return;
    }
    case I_Q3_K: {
        /* low 4 bits: s[i] & 15 (i < 8), s[i - 8] >> 4; bits 4-5: bits 2(i/4) of s[8 + i%4] */
        const __m128i x = _mm_loadl_epi64((const __m128i *)(b + 96)), m4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4));
        uint32_t hw;
        memcpy(&hw, b + 104, 4);
        const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)hw), _mm_setr_epi32(0, 2, 4, 6)),
                                         _mm_set1_epi8(3));
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)));
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b + 108)), _mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32))));
        return;
    }
    case I_IQ4_K: case I_IQ5_K: {   /* bits 4-5: bits 2(i%4) of sh[i/4] */
        uint32_t hw;
        memcpy(&hw, b + 4, 4);
        const __m512i sh = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)hw),
                                                                 _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)));
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(sh, _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6,
                                                                                      0, 2, 4, 6)), _mm512_set1_epi32(3));
        const __m512i ls = _mm512_or_si512(nibbles16(b + 8), _mm512_slli_epi32(hi, 4));
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b)), _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
        return;
    }
    case I_IQ3_K: {   /* (2 ls + 1), negated where bit i of the u16 at b + 4 is set */
        const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(nibbles16(b + 6), 1), _mm512_set1_epi32(1));
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b)), _mm512_cvtepi32_ps(
            _mm512_mask_sub_epi32(v, (__mmask16)rd16(b + 4), _mm512_setzero_si512(), v)));
        return;
    }
    case I_IQ2_K:
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b)), _mm512_cvtepi32_ps(_mm512_sub_epi32(nibbles16(b + 4), _mm512_set1_epi32(8))));
        return;
    }
    /* IQ4_XS, IQ4_KS, IQ2_KS, IQ2_KL, IQ3_XXS: 8 scales of 32, each twice */
    __m256 s8;
    if (ti == I_IQ3_XXS) {   /* d (ls + 0.5) 0.5, ls the top 4 bits of each sub-block's u32 */
        const __m256 ls = _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(b + 66)), 28));
        s8 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(F16(b)), _mm256_add_ps(ls, _mm256_set1_ps(0.5f))),
                           _mm256_set1_ps(0.5f));
    } else if (ti == I_IQ2_KL) {   /* nibble s/4 of byte 2 + s%4, bits 4-5 from bits 2s of the u16 at b */
        uint32_t lw;
        memcpy(&lw, b + 2, 4);
        const __m128i x = _mm_cvtsi32_si128((int)lw), m4 = _mm_set1_epi8(0x0F);
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_unpacklo_epi32(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(rd16(b)),
                                                              _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                            _mm256_set1_epi32(3));
        s8 = _mm256_mul_ps(_mm256_set1_ps(rd), _mm256_cvtepi32_ps(
            _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32))));
    } else if (ti == I_IQ2_KS) {   /* nibbles at b + 2, bit 4 from bits 8-15 of the u16 at b */
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(rd16(b)),
                                                              _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)),
                                            _mm256_set1_epi32(1));
        uint32_t lw;
        memcpy(&lw, b + 2, 4);
        const __m128i x = _mm_cvtsi32_si128((int)lw), m4 = _mm_set1_epi8(0x0F);
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(16));
        s8 = _mm256_mul_ps(_mm256_set1_ps(rd), _mm256_cvtepi32_ps(ls));
    } else if (ti == I_IQ4_KS) {
        const __m256i ls = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_loadl_epi64((const __m128i *)b),
                                                                               _mm_set1_epi8((char)254))),
                                            _mm256_set1_epi32(127));
        s8 = _mm256_mul_ps(_mm256_set1_ps(rd), _mm256_cvtepi32_ps(ls));
    } else {   /* IQ4_XS: low 4 bits from the nibbles at b + 4, bits 4-5 from the u16 at b + 2 */
        uint32_t lw;
        memcpy(&lw, b + 4, 4);
        const __m128i x = _mm_cvtsi32_si128((int)lw), m4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
        const __m128i hi = _mm_and_si128(_mm_srlv_epi16(_mm_set1_epi16((short)rd16(b + 2)),
                                                        _mm_setr_epi16(0, 2, 4, 6, 8, 10, 12, 14)), _mm_set1_epi16(3));
        const __m256i ls = _mm256_sub_epi32(_mm256_cvtepu16_epi32(_mm_or_si128(lo, _mm_slli_epi16(hi, 4))),
                                            _mm256_set1_epi32(32));
        s8 = _mm256_mul_ps(_mm256_set1_ps(F16(b)), _mm256_cvtepi32_ps(ls));
    }
    *S = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castps256_ps512(s8));
}

/* 4 rows' 16 values v[r] -> o[c] = [values 4c..4c+3 of rows 0-3]: lane 4L + r holds v[r][4c + L] */
HM_INLINE void rows4_T(const __m512 *v, __m512 *o) {
    const __m512 t0 = _mm512_unpacklo_ps(v[0], v[1]), t1 = _mm512_unpackhi_ps(v[0], v[1]);
    const __m512 t2 = _mm512_unpacklo_ps(v[2], v[3]), t3 = _mm512_unpackhi_ps(v[2], v[3]);
    const __m512 u0 = _mm512_shuffle_ps(t0, t2, 0x44), u1 = _mm512_shuffle_ps(t0, t2, 0xEE);
    const __m512 u2 = _mm512_shuffle_ps(t1, t3, 0x44), u3 = _mm512_shuffle_ps(t1, t3, 0xEE);
    const __m512 v0 = _mm512_shuffle_f32x4(u0, u1, 0x44), v1 = _mm512_shuffle_f32x4(u2, u3, 0x44);
    const __m512 v2 = _mm512_shuffle_f32x4(u0, u1, 0xEE), v3 = _mm512_shuffle_f32x4(u2, u3, 0xEE);
    o[0] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    o[1] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
    o[2] = _mm512_shuffle_f32x4(v2, v3, 0x88);
    o[3] = _mm512_shuffle_f32x4(v2, v3, 0xDD);
}

/* res[r * NT + t] = cdot_ref(row w[r], token xq[t]) for R rows (1, 2 or 4) and NT tokens (1-4), bit for bit:
 * the weights of a step are unpacked once for all NT tokens; per token the rows' lane sums are reduced to
 * block sums (rows4_lanes) and the float chain runs over the rows in an xmm (one lane a row). */
HM_INLINE void kern_qc(const int ti, const int R, const int NT, const uint8_t *const *w, const uint8_t *const *pf,
                       int64_t K, const xq8 *const *xq, float *res) {
    __m128 acc[4], accm[4];                              /* accm: the K-quants' mins */
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = accm[t] = _mm_setzero_ps();
    const __m512i z = _mm512_setzero_si512();
    const int ts = TINFO[ti].ts;
    const int step = IS_K(ti) ? ts : 2 * ts;            /* bytes per iteration: 64 or 256 weights */
    const pfreg pr = pf_regions(R, w, pf);
    const int64_t rb = IS_K(ti) ? K / 256 * ts : K / 32 * ts;
    for (int64_t o = 0, e = 0; o < rb; o += step, e += IS_K(ti) ? 256 : 64) {
        prefetch_step(pr, o, step);
        if (!IS_K(ti)) {
            __m512i qv[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) qv[r] = qc_b32(ti, w[r] + o, ts);
            const __m128 dw0 = _mm_setr_ps(*B32_D(ti, w[0] + o), R > 1 ? *B32_D(ti, w[1] + o) : 0.0f,
                                           R > 2 ? *B32_D(ti, w[2] + o) : 0.0f, R > 3 ? *B32_D(ti, w[3] + o) : 0.0f);
            const __m128 dw1 = _mm_setr_ps(*B32_D(ti, w[0] + o + ts), R > 1 ? *B32_D(ti, w[1] + o + ts) : 0.0f,
                                           R > 2 ? *B32_D(ti, w[2] + o + ts) : 0.0f,
                                           R > 3 ? *B32_D(ti, w[3] + o + ts) : 0.0f);
            const int64_t b = e / 32;
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const xq8 *q = xq[t];
                const __m512i x1 = _mm512_load_si512(q->q1 + e), x2 = _mm512_load_si512(q->q2 + e);
                __m512i l4 = rows4_lanes(qc_dot(qv[0], x1, x2), R > 1 ? qc_dot(qv[1], x1, x2) : z,
                                         R > 2 ? qc_dot(qv[2], x1, x2) : z, R > 3 ? qc_dot(qv[3], x1, x2) : z);
                l4 = _mm512_add_epi32(l4, _mm512_shuffle_i32x4(l4, l4, 0xB1));     /* lanes 0: block b, 2: b + 1 */
                const __m128i i0 = _mm_sub_epi32(_mm512_castsi512_si128(l4), _mm_set1_epi32(QC_OFF(ti) * q->sxi[b]));
                const __m128i i1 = _mm_sub_epi32(_mm512_extracti32x4_epi32(l4, 2),
                                                 _mm_set1_epi32(QC_OFF(ti) * q->sxi[b + 1]));
                acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(i0), _mm_mul_ps(dw0, _mm_set1_ps(q->xsb[b])), acc[t]);
                acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(i1), _mm_mul_ps(dw1, _mm_set1_ps(q->xsb[b + 1])), acc[t]);
            }
        } else if (IS_X(ti)) {
            /* scales (and Q2_K's mins) as [sub-block i][row] */
            __m512 Sr[4], Mr[4], Sc[4], Mc[4];
            int ex[4];
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                if (r < R) {
                    x_scales16(ti, w[r] + TINFO[ti].hdr + o, X_HDR(ti) ? x_rowscale(ti, w[r]) : 1.0f, &Sr[r], &Mr[r]);
                    ex[r] = x_extra16v(ti, w[r] + TINFO[ti].hdr + o);
                } else {
                    Sr[r] = Mr[r] = _mm512_setzero_ps();
                }
            }
            rows4_T(Sr, Sc);
            if (X_MIN(ti)) {
                float Mm[16][4] __attribute__((aligned(64)));
                rows4_T(Mr, Mc);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) _mm512_store_ps(Mm[4 * c], Mc[c]);
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++)
#pragma GCC unroll 16
                    for (int i = 0; i < 16; i++)
                        accm[t] = _mm_fmadd_ps(_mm_load_ps(Mm[i]), _mm_set1_ps(xq[t]->sx16[e / 16 + i]), accm[t]);
            }
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const int64_t j = e + 64 * c;
                __m512i qv[4];
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) qv[r] = x_u64(ti, w[r] + TINFO[ti].hdr + o, c, ex[r]);
                const __m512 sv = Sc[c];                            /* [sub-block 4c + L][row] */
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const xq8 *q = xq[t];
                    const __m512i x1 = _mm512_load_si512(q->q1 + j), x2 = _mm512_load_si512(q->q2 + j);
                    __m512i l4 = rows4_lanes(qc_dot(qv[0], x1, x2), R > 1 ? qc_dot(qv[1], x1, x2) : z,
                                             R > 2 ? qc_dot(qv[2], x1, x2) : z, R > 3 ? qc_dot(qv[3], x1, x2) : z);
                    if (X_OFF(ti))
                        l4 = _mm512_sub_epi32(l4, _mm512_slli_epi32(_mm512_load_si512(q->sxi4 + j / 4), X_OFF_SH(ti)));
                    const __m512 f = _mm512_cvtepi32_ps(l4);
                    const __m512 sc = _mm512_mul_ps(sv, _mm512_load_ps(q->xs + 16 * (j / 64)));
                    acc[t] = _mm_fmadd_ps(_mm512_castps512_ps128(f), _mm512_castps512_ps128(sc), acc[t]);
                    acc[t] = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 1), _mm512_extractf32x4_ps(sc, 1), acc[t]);
                    acc[t] = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 2), _mm512_extractf32x4_ps(sc, 2), acc[t]);
                    acc[t] = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 3), _mm512_extractf32x4_ps(sc, 3), acc[t]);
                }
            }
        } else if (ti == I_Q6_K) {
            float Sm[16][4] __attribute__((aligned(64)));
            kscale ks[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) prep_k(ti, w[r] + o, 1.0f, &ks[r]);
            for (int i = 0; i < 16; i++)
                for (int r = 0; r < 4; r++) Sm[i][r] = r < R ? ks[r].s[i] : 0.0f;
            const __m512i m4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 2
            for (int n = 0; n < 2; n++) {                 /* halves of 128 weights: ql 64 bytes, qh 32 */
#pragma GCC unroll 2
                for (int c = 0; c < 2; c++) {             /* weights 0-63 (low nibbles), 64-127 (high) */
                    const int64_t j = e + 128 * n + 64 * c;
                    const __m512i mh = _mm512_set_epi64(GF_2BITS(4 * c + 2), GF_2BITS(4 * c + 2), GF_2BITS(4 * c + 2),
                        GF_2BITS(4 * c + 2), GF_2BITS(4 * c), GF_2BITS(4 * c), GF_2BITS(4 * c), GF_2BITS(4 * c));
                    __m512i qv[4];
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const uint8_t *bb = w[r] + o;
                        __m512i ql = _mm512_loadu_si512((const void *)(bb + 64 * n));
                        ql = _mm512_and_si512(c ? _mm512_srli_epi16(ql, 4) : ql, m4);
                        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(bb + 128 + 32 * n)));
                        qv[r] = _mm512_or_si512(ql, _mm512_gf2p8affine_epi64_epi8(qh, mh, 0));
                    }
                    const __m512 sv = _mm512_load_ps(&Sm[8 * n + 4 * c][0]);   /* [sub-block i0 + L][row] */
#pragma GCC unroll 4
                    for (int t = 0; t < NT; t++) {
                        const xq8 *q = xq[t];
                        const __m512i x1 = _mm512_load_si512(q->q1 + j), x2 = _mm512_load_si512(q->q2 + j);
                        __m512i l4 = rows4_lanes(qc_dot(qv[0], x1, x2), R > 1 ? qc_dot(qv[1], x1, x2) : z,
                                                 R > 2 ? qc_dot(qv[2], x1, x2) : z, R > 3 ? qc_dot(qv[3], x1, x2) : z);
                        l4 = _mm512_sub_epi32(l4, _mm512_slli_epi32(_mm512_load_si512(q->sxi4 + j / 4), 5));
                        const __m512 f = _mm512_cvtepi32_ps(l4);
                        const __m512 sc = _mm512_mul_ps(sv, _mm512_load_ps(q->xs + 16 * (j / 64)));
                        acc[t] = _mm_fmadd_ps(_mm512_castps512_ps128(f), _mm512_castps512_ps128(sc), acc[t]);
                        acc[t] = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 1), _mm512_extractf32x4_ps(sc, 1), acc[t]);
                        acc[t] = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 2), _mm512_extractf32x4_ps(sc, 2), acc[t]);
                        acc[t] = _mm_fmadd_ps(_mm512_extractf32x4_ps(f, 3), _mm512_extractf32x4_ps(sc, 3), acc[t]);
                    }
                }
            }
        } else {                                          /* Q4_K, Q5_K: 8 sub-blocks of 32 */
            kscale ks[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) prep_k(ti, w[r] + o, 1.0f, &ks[r]);
            /* scales and mins as [sub-block j][row]: lanes 4j + r */
            float Sj[8][4] __attribute__((aligned(64))), Mj[8][4] __attribute__((aligned(64)));
            {
                const __m512i lo = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
                const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
                const __m256 zs = _mm256_setzero_ps();
                const __m512 s01 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(ks[0].s)),
                                                      R > 1 ? _mm256_loadu_ps(ks[1].s) : zs, 1);
                const __m512 s23 = _mm512_insertf32x8(_mm512_castps256_ps512(R > 2 ? _mm256_loadu_ps(ks[2].s) : zs),
                                                      R > 3 ? _mm256_loadu_ps(ks[3].s) : zs, 1);
                const __m512 m01 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(ks[0].m)),
                                                      R > 1 ? _mm256_loadu_ps(ks[1].m) : zs, 1);
                const __m512 m23 = _mm512_insertf32x8(_mm512_castps256_ps512(R > 2 ? _mm256_loadu_ps(ks[2].m) : zs),
                                                      R > 3 ? _mm256_loadu_ps(ks[3].m) : zs, 1);
                _mm512_store_ps(&Sj[0][0], _mm512_permutex2var_ps(s01, lo, s23));
                _mm512_store_ps(&Sj[4][0], _mm512_permutex2var_ps(s01, hi, s23));
                _mm512_store_ps(&Mj[0][0], _mm512_permutex2var_ps(m01, lo, m23));
                _mm512_store_ps(&Mj[4][0], _mm512_permutex2var_ps(m01, hi, m23));
            }
            const __m512i mqk = _mm512_set_epi64(GF_HI, GF_HI, GF_HI, GF_HI, GF_LO, GF_LO, GF_LO, GF_LO);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {                 /* sub-blocks 2c (low nibbles), 2c + 1 (high) */
                __m512i qv[4];
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const uint8_t *bb = w[r] + o;
                    __m512i qq = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(bb + (ti == I_Q5_K ? 48 : 16) + 32 * c)));
                    qq = _mm512_gf2p8affine_epi64_epi8(qq, mqk, 0);
                    if (ti == I_Q5_K) {   /* 5th bit: bit 2c (2c+1) of qh[l] -> bit 4 */
                        const __m512i mh = _mm512_set_epi64(GF_BIT(2 * c + 1), GF_BIT(2 * c + 1), GF_BIT(2 * c + 1),
                            GF_BIT(2 * c + 1), GF_BIT(2 * c), GF_BIT(2 * c), GF_BIT(2 * c), GF_BIT(2 * c));
                        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(bb + 16)));
                        qq = _mm512_or_si512(qq, _mm512_gf2p8affine_epi64_epi8(h, mh, 0));
                    }
                    qv[r] = qq;
                }
                const __m128 s0 = _mm_load_ps(Sj[2 * c]), s1 = _mm_load_ps(Sj[2 * c + 1]);
                const __m128 m0 = _mm_load_ps(Mj[2 * c]), m1 = _mm_load_ps(Mj[2 * c + 1]);
                const int64_t jj = e + 64 * c, b = jj / 32;
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const xq8 *q = xq[t];
                    const __m512i x1 = _mm512_load_si512(q->q1 + jj), x2 = _mm512_load_si512(q->q2 + jj);
                    __m512i l4 = rows4_lanes(qc_dot(qv[0], x1, x2), R > 1 ? qc_dot(qv[1], x1, x2) : z,
                                             R > 2 ? qc_dot(qv[2], x1, x2) : z, R > 3 ? qc_dot(qv[3], x1, x2) : z);
                    l4 = _mm512_add_epi32(l4, _mm512_shuffle_i32x4(l4, l4, 0xB1));
                    acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm512_castsi512_si128(l4)), _mm_mul_ps(s0, _mm_set1_ps(q->xsb[b])),
                                          acc[t]);
                    accm[t] = _mm_fmadd_ps(m0, _mm_set1_ps(q->sxf[b]), accm[t]);
                    acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm512_extracti32x4_epi32(l4, 2)),
                                          _mm_mul_ps(s1, _mm_set1_ps(q->xsb[b + 1])), acc[t]);
                    accm[t] = _mm_fmadd_ps(m1, _mm_set1_ps(q->sxf[b + 1]), accm[t]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        float v[4];
        _mm_storeu_ps(v, IS_K(ti) && ti != I_Q6_K ? _mm_sub_ps(acc[t], accm[t]) : acc[t]);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) res[r * NT + t] = v[r];
    }
}

typedef void (*kqc_fn)(const uint8_t *const *w, const uint8_t *const *pf, int64_t K, const xq8 *const *xq, float *res);
#define KQCSHAPE(TI, R, NT) \
    static void kqc_##TI##_##R##_##NT(const uint8_t *const *w, const uint8_t *const *pf, int64_t K, \
                                      const xq8 *const *xq, float *res) { kern_qc(TI, R, NT, w, pf, K, xq, res); }
#define KQCSHAPES(TI) KQCSHAPE(TI, 1, 1) KQCSHAPE(TI, 1, 2) KQCSHAPE(TI, 1, 3) KQCSHAPE(TI, 1, 4) \
    KQCSHAPE(TI, 2, 1) KQCSHAPE(TI, 2, 2) KQCSHAPE(TI, 2, 3) KQCSHAPE(TI, 2, 4) \
    KQCSHAPE(TI, 4, 1) KQCSHAPE(TI, 4, 2) KQCSHAPE(TI, 4, 3) KQCSHAPE(TI, 4, 4)
#define KQCROW(TI) { {0}, {0, kqc_##TI##_1_1, kqc_##TI##_1_2, kqc_##TI##_1_3, kqc_##TI##_1_4}, \
    {0, kqc_##TI##_2_1, kqc_##TI##_2_2, kqc_##TI##_2_3, kqc_##TI##_2_4}, {0}, \
    {0, kqc_##TI##_4_1, kqc_##TI##_4_2, kqc_##TI##_4_3, kqc_##TI##_4_4} }
KQCSHAPES(I_Q4_0) KQCSHAPES(I_Q8_0) KQCSHAPES(I_Q4_K) KQCSHAPES(I_Q5_K) KQCSHAPES(I_Q6_K) KQCSHAPES(I_IQ4_NL)
KQCSHAPES(I_MXFP4) KQCSHAPES(I_IQ4_XS) KQCSHAPES(I_Q3_K) KQCSHAPES(I_Q2_K) KQCSHAPES(I_IQ4_KS) KQCSHAPES(I_IQ4_K)
KQCSHAPES(I_IQ3_K) KQCSHAPES(I_IQ2_K) KQCSHAPES(I_IQ5_K) KQCSHAPES(I_IQ2_KS) KQCSHAPES(I_IQ2_KL) KQCSHAPES(I_IQ3_XXS)
static const kqc_fn KQC[N_TYPES][5][5] = {
    [I_Q4_0] = KQCROW(I_Q4_0), [I_Q8_0] = KQCROW(I_Q8_0), [I_Q4_K] = KQCROW(I_Q4_K), [I_Q5_K] = KQCROW(I_Q5_K),
    [I_Q6_K] = KQCROW(I_Q6_K), [I_IQ4_NL] = KQCROW(I_IQ4_NL), [I_MXFP4] = KQCROW(I_MXFP4),
    [I_IQ4_XS] = KQCROW(I_IQ4_XS), [I_Q3_K] = KQCROW(I_Q3_K), [I_Q2_K] = KQCROW(I_Q2_K),
    [I_IQ4_KS] = KQCROW(I_IQ4_KS), [I_IQ4_K] = KQCROW(I_IQ4_K), [I_IQ3_K] = KQCROW(I_IQ3_K),
    [I_IQ2_K] = KQCROW(I_IQ2_K), [I_IQ5_K] = KQCROW(I_IQ5_K), [I_IQ2_KS] = KQCROW(I_IQ2_KS),
    [I_IQ2_KL] = KQCROW(I_IQ2_KL), [I_IQ3_XXS] = KQCROW(I_IQ3_XXS), };
#endif /* HM_VNNI */

#if HM_AVXVNNI
/* kern_q8 on 256 bits (AVX-VNNI, GFNI): one 32-weight block (Q4_0) or 32 weights of a K super-block per
 * vector */
HM_INLINE void kern_q8_256(const int ti, const int R, const uint8_t *const *w, const uint8_t *const *pf,
                           int64_t K, const xq8 *xq, float *res) {
    __m256 acc[4], accm[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    const int ts = TINFO[ti].ts;
    const int step = IS_B32(ti) ? 2 * ts : ts;           /* bytes per iteration: 64 or 256 weights */
    const pfreg pr = pf_regions(R, w, pf);
    const int64_t rb = IS_B32(ti) ? K / 32 * ts : K / 256 * ts;
    const __m256i mq40 = _mm256_set_epi64x((long long)GF_HI, (long long)GF_HI, (long long)GF_LO, (long long)GF_LO);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t o = 0, e = 0; o < rb; o += step, e += IS_B32(ti) ? 64 : 256) {
        prefetch_step(pr, o, step);
        if (IS_B32(ti)) {
            const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(
                ti == I_IQ4_NL ? KU8_IQ4NL : KU8_MXFP4)));
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {                 /* the two blocks of this step */
                const int64_t p = e / 64;
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq->q1 + e + 32 * h));
                const __m256i x2 = _mm256_loadu_si256((const __m256i *)(xq->q2 + e + 32 * h));
                const __m256i c1 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(xq->c1 + 16 * p + 8 * h)),
                                                     B32_SHIFT(ti));
                const __m256i c2 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(xq->c2 + 16 * p + 8 * h)),
                                                     B32_SHIFT(ti));
                const __m256 xs = _mm256_loadu_ps(xq->xs + 16 * p + 8 * h);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const uint8_t *bl = w[r] + o + h * ts;
                    /* [qs, qs] -> [low nibbles: weights 0-15, high nibbles: 16-31] */
                    __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(bl + B32_QS(ti))));
                    q = _mm256_gf2p8affine_epi64_epi8(q, mq40, 0);
                    if (ti != I_Q4_0) q = _mm256_shuffle_epi8(tab, q);  /* nibble -> table value + offset */
                    __m256i a = _mm256_dpbusd_avx_epi32(c1, q, x1);       /* c1, c2: the offset */
                    a = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(a, 8), q, x2);
                    a = _mm256_add_epi32(a, c2);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(_mm256_broadcast_ss(B32_D(ti, bl)), xs),
                                             acc[r]);
                }
            }
        } else if (ti == I_Q6_K) {                        /* as kern_q8's Q6_K, 32 weights a vector */
            kscale ks[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                prep_k(ti, w[r] + o, 1.0f, &ks[r]);
                accm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(ks[r].m), _mm256_loadu_ps(xq->sx16 + e / 16), accm[r]);
                accm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(ks[r].m + 8), _mm256_loadu_ps(xq->sx16 + e / 16 + 8),
                                          accm[r]);
            }
#pragma GCC unroll 2
            for (int n = 0; n < 2; n++) {                 /* halves of 128 weights: ql 64 bytes, qh 32 */
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) {             /* ql[0..31] lo, ql[32..63] lo, ql[0..31] hi, ql[32..63] hi */
                    const int64_t j = e + 128 * n + 32 * g;
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq->q1 + j));
                    const __m256i x2 = _mm256_loadu_si256((const __m256i *)(xq->q2 + j));
                    const __m256 xs = _mm256_loadu_ps(xq->xs + 16 * (j / 64) + 8 * ((j / 32) & 1));
                    const __m256i mh = _mm256_set1_epi64x((long long)GF_2BITS(2 * g));
                    const __m256i si = _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                                         2 * g + 1);
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const uint8_t *b = w[r] + o;
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32 * (g & 1)));
                        const __m256i nib = _mm256_and_si256(g < 2 ? raw : _mm256_srli_epi16(raw, 4), m4);
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
                        const __m256i q = _mm256_or_si256(nib, _mm256_gf2p8affine_epi64_epi8(qh, mh, 0));
                        __m256i a = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, x1);
                        a = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(a, 8), q, x2);
                        const __m256 ws = _mm256_permutevar8x32_ps(_mm256_loadu_ps(ks[r].s + 8 * n), si);
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(ws, xs), acc[r]);
                    }
                }
            }
        } else {                                          /* Q4_K, Q5_K: 8 sub-blocks of 32 */
            const __m256 sx = _mm256_loadu_ps(xq->sxf + e / 32);
            kscale ks[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                prep_k(ti, w[r] + o, 1.0f, &ks[r]);
                accm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(ks[r].m), sx, accm[r]);   /* the mins */
            }
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {            /* sub-block 2c (low nibbles), 2c + 1 (high) */
                    const int64_t j = e + 64 * c + 32 * h, p = j / 64;
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq->q1 + j));
                    const __m256i x2 = _mm256_loadu_si256((const __m256i *)(xq->q2 + j));
                    const __m256 xs = _mm256_loadu_ps(xq->xs + 16 * p + 8 * h);
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const uint8_t *b = w[r] + o;
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (ti == I_Q5_K ? 48 : 16) + 32 * c));
                        __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, m4);
                        if (ti == I_Q5_K)   /* 5th bit: bit 2c + h of qh[l] -> bit 4 */
                            q = _mm256_or_si256(q, _mm256_gf2p8affine_epi64_epi8(
                                _mm256_loadu_si256((const __m256i *)(b + 16)),
                                _mm256_set1_epi64x((long long)GF_BIT(2 * c + h)), 0));
                        __m256i a = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, x1);
                        a = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(a, 8), q, x2);
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a),
                                                 _mm256_mul_ps(_mm256_broadcast_ss(&ks[r].s[2 * c + h]), xs), acc[r]);
                    }
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        __m256 v = _mm256_sub_ps(acc[r], accm[r]);
        __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        v4 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        res[r] = _mm_cvtss_f32(_mm_add_ss(v4, _mm_movehdup_ps(v4)));
    }
}

KQTABLE(KQTAB2, kq2, kern_q8_256)
#endif /* HM_AVXVNNI */

/* Types (bit per type index) whose single-token rows take the integer path (where this CPU and path have
 * one for them: q8_type). Measured on Sapphire Rapids (16 threads, share of read bandwidth): Q4_K 58-64% ->
 * 82-83%, Q5_K 50-57% -> 79-98%, Q4_0 70-74% -> 79-84% (there the fp32 decode is bound by the one shuffle
 * port); Q6_K 0.452 / 0.458 -> 0.403 / 0.384 ms a T=1 call (2026-11-25). */
#define INT8_DEFAULT_256_ ((1u << I_Q4_0) | (1u << I_Q4_K) | (1u << I_Q5_K) | (1u << I_Q6_K) | (1u << I_MXFP4))
/* AVX-512 VNNI: every quantized type, Q8_0 and IQ4_NL too, so that every batch size computes the canonical
 * integer products (cdot_ref): prompts then give the same results however they are split. */
#define INT8_DEFAULT_512 (INT8_DEFAULT_256_ | (1u << I_Q8_0) | (1u << I_IQ4_NL) | (1u << I_IQ4_XS) | (1u << I_Q3_K) | \
                          (1u << I_Q2_K) | (1u << I_IQ4_KS) | (1u << I_IQ4_K) | (1u << I_IQ3_K) | (1u << I_IQ2_K) | \
                          (1u << I_IQ5_K) | (1u << I_IQ2_KS) | (1u << I_IQ2_KL) | \
                          (1u << I_IQ3_XXS))
/* AVX-VNNI (dev VM, 1 thread, T=1, GB/s fp32 -> integer): Q4_0 7.2 -> 12.4, Q4_K 7.3 -> 11.2, Q5_K 8.4 -> 11.6,
 * Q6_K 7.4 -> 12.1, MXFP4 6.3 -> 11.3, IQ4_NL 6.8 -> 11.3. On AVX-512 (the same VM; MXFP4 not yet on SPR)
 * IQ4_NL's fp32 path is as fast (11.4 vs 11.6) and stays; MXFP4 9.7 -> 11.9 (2 threads: 17.2 -> 21.5). */
#define INT8_DEFAULT_256 (INT8_DEFAULT_256_ | (1u << I_IQ4_NL))
static unsigned g_int8;                   /* the types set_int8 chose, unless g_int8_default */
static int g_int8_default = 1;            /* the measured defaults of the path in use */
#define INT8_MASK (g_int8_default ? (g_simd == 2 ? INT8_DEFAULT_512 : INT8_DEFAULT_256) : g_int8)
/* rows shared by several tokens take the integer path too (the canonical products, any batch size): where the
 * AVX-512 VNNI kernels run (the AVX-VNNI path keeps fp32 for those, and its own order for single tokens), unless
 * hm_set_exact(0) asked for the earlier large-batch paths (bf16 tiles; results then depend on the batch) */
static int g_exact = 1;
#define QC_MULTI (INT8_512 && g_exact)

/* rows w[0..R) . one token: the integer path when xq is given, else fp32 */
static inline void dot_rows1(int ti, int R, const uint8_t *const *w, const uint8_t *const *pf, int64_t K,
                             const float *x, const xq8 *xq, float *res) {
#if HM_VNNI
    if (xq && g_simd == 2) { KQC[ti][R][1](w, pf, K, &xq, res); return; }
#endif
#if HM_AVXVNNI
    if (xq && g_simd == 1) { KQTAB2[ti][R](w, pf, K, xq, res); return; }
#endif
    (void)xq;
    dot_rows(ti, R, 1, w, pf, K, &x, res);
}

/* Canonical integer products (cdot_ref) of R rows (1, 2, 4) and NT tokens (1-4), res[r * NT + t]: the
 * kernel where this CPU has one for the canonical form (AVX-512 VNNI), else the scalar reference (exact,
 * slow: only reached when a test forces it). */
static inline void dot_rows_q(int ti, int R, int NT, const uint8_t *const *w, const uint8_t *const *pf, int64_t K,
                              const xq8 *const *xq, float *res) {
#if HM_VNNI
    if (g_simd == 2) { KQC[ti][R][NT](w, pf, K, xq, res); return; }
#endif
    (void)pf;
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) res[r * NT + t] = cdot_ref(ti, w[r], K, xq[t]);
}

/* ------------------------------------------------------------------ thread-local workspace */

static __thread void *ws_ptr;
static __thread size_t ws_size;

static void *workspace(size_t n) {
    if (n > ws_size) {
        free(ws_ptr);
        n = (n + 4095) & ~(size_t)4095;
        if (posix_memalign(&ws_ptr, 64, n)) { ws_ptr = NULL; ws_size = 0; return NULL; }
        ws_size = n;
    }
    return ws_ptr;
}

static inline void split(int64_t n, int nth, int tid, int64_t align, int64_t *lo, int64_t *hi) {
    /* contiguous, near-equal ranges whose starts are multiples of align */
    int64_t nb = (n + align - 1) / align;
    int64_t a = nb * tid / nth, b = nb * (tid + 1) / nth;
    *lo = a * align < n ? a * align : n;
    *hi = b * align < n ? b * align : n;
}

/* exp(x) in branch-free float code the compiler vectorizes: 2^n * e^r, |r| <= ln2/2, degree-6
 * Taylor polynomial (relative error ~2e-7, far below the bf16 rounding that follows) */
static inline float exp_vec(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = __builtin_fmaf(n, -0.693145751953125f, x);      /* ln2 split in two parts */
    r = __builtin_fmaf(n, -1.428606765330187e-06f, r);
    float p = 1.0f / 720;
    p = __builtin_fmaf(p, r, 1.0f / 120);
    p = __builtin_fmaf(p, r, 1.0f / 24);
    p = __builtin_fmaf(p, r, 1.0f / 6);
    p = __builtin_fmaf(p, r, 0.5f);
    p = __builtin_fmaf(p, r, 1.0f);
    p = __builtin_fmaf(p, r, 1.0f);
    return p * f32_bits((uint32_t)((int32_t)n + 127) << 23);
}

#if HM_AVX512
/* exp_vec on 16 lanes: the same operations in the same order as the scalar exp_vec, lane by lane */
static inline __m512 exp_vec16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

/* silu by exp_vec: the same bits in every kernel (streaming, tile, decode step), scalar or vectorized */
static inline float silu(float g) { return g / (1.0f + exp_vec(-g)); }

/* ------------------------------------------------------------------ tracing (profiling only)
 * hm_trace(1): each thread of the streaming MoE kernel stamps, per call, when it entered the parallel
 * region, finished stage 1, left the barrier and finished stage 2 (CLOCK_MONOTONIC seconds, the clock of
 * Python's time.perf_counter), so a profiler can split a call into thread start-up, work, and waiting. */
#define HM_TR_MAX 256
static int g_trace, g_tr_n;
static double g_tr[HM_TR_MAX][4];
static inline double hm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#define HM_STAMP(tid, i) do { if (g_trace && (tid) < HM_TR_MAX) g_tr[tid][i] = hm_now(); } while (0)
int hm_trace(int on) { g_trace = on; return g_tr_n; }
int hm_trace_get(double *dst) {   /* the last call's [n threads][4] stamps; returns n */
    memcpy(dst, g_tr, sizeof(double) * 4 * (size_t)g_tr_n);
    return g_tr_n;
}

/* ------------------------------------------------------------------ MoE FFN
 *
 * out[t] = sum_j wts[t,j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t,j] (ids < 0 skip).
 *
 * Stage 1: work units are (active expert, pair of rows of F); threads claim chunks of 32
 *   consecutive units (64 rows of gate and of up) from a shared counter. Gate and up rows of a
 *   unit are decoded together and used for every token routed to the expert. Output: h[pair, F]
 *   (fp32).
 * Stage 2 (after one barrier): threads claim chunks of 32 output rows of H; a chunk walks all
 *   active experts, so out[t, h] is summed by one thread in ascending expert order:
 *   deterministic, no atomics on floats, and the same for any thread count or schedule.
 * Each thread prefetches its own stream HM_PF_DIST bytes ahead, across expert boundaries and
 * into the next chunk it has claimed.
 * Returns 0, or -1 on bad arguments (an expert id >= E, an unsupported type or shape).
 */
static inline void prefetch_range(const uint8_t *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, HM_PF_LOC);
}

/* pick R x NT kernel shapes for m tokens and run rows[0..R) (R is 4 or 1) */
static inline void rows_x_tokens(int ti, int R, int m, const uint8_t *const *rows,
                                 const uint8_t *const *pf, int64_t K, const float *const *xs, float *res) {
    /* pf: two regions of 2 rows for R == 4 (1 row for R == 1) */
    if (R == 4 && m > 2) {
        const int64_t rb = row_bytes(ti, K);
        const uint8_t *p0[2] = {pf ? pf[0] : NULL, pf && pf[0] ? pf[0] + rb : NULL};
        const uint8_t *p1[2] = {pf ? pf[1] : NULL, pf && pf[1] ? pf[1] + rb : NULL};
        dot_rows(ti, 2, m, rows, pf ? p0 : NULL, K, xs, res);
        dot_rows(ti, 2, m, rows + 2, pf ? p1 : NULL, K, xs, res + 2 * m);
    } else {
        dot_rows(ti, R, m, rows, pf, K, xs, res);
    }
}

/* The expert activation between gate/up and down. 0: silu(g) * u (Qwen3, DeepSeek, llama). 1: gpt-oss's
 * "swiglu_oai": g, u take their biases, g is clamped from above and u on both sides at `limit`, then
 * g * sigmoid(alpha g) * (u + 1); down takes its bias too. Biases are float32 [E, F] (gate, up), [E, H]. */
typedef struct {
    int kind;
    float alpha, limit;
    const float *bg, *bu, *bd;
} moe_act;

static const moe_act ACT_SILU = {0, 0.0f, 0.0f, NULL, NULL, NULL};

static inline float act_h(const moe_act *A, float g, float u, int64_t e, int64_t F, int64_t f) {
    if (!A->kind) return silu(g) * u;
    g += A->bg[e * F + f];
    u += A->bu[e * F + f];
    g = g < A->limit ? g : A->limit;
    u = u < -A->limit ? -A->limit : u > A->limit ? A->limit : u;
    return g / (1.0f + exp_vec(-A->alpha * g)) * (u + 1.0f);
}

static inline float down_bias(const moe_act *A, int64_t e, int64_t H, int64_t r) {
    return A->bd ? A->bd[e * H + r] : 0.0f;
}

/* the checks both MoE entry points make: known types, block-aligned H and F, expert ids < E */
static int moe_args_ok(int gi, int di, int64_t T, int64_t H, int64_t F, int64_t k, const int32_t *ids, int64_t E) {
    if (gi < 0 || di < 0 || T < 0 || H % 32 || F % 32 || H % TINFO[gi].qk || F % TINFO[di].qk || k < 1)
        return 0;
    for (int64_t p = 0; p < T * k; p++)
        if (ids[p] >= E) return 0;
    return 1;
}

/* routing: counting sort of the P = T k (token, slot) pairs by expert, stable in token order. Fills act
 * (active experts, ascending), off [na + 1] (their pair offsets), ptok / pw [P] (token and router weight
 * of each sorted pair); slot [E] and pos [E] are scratch. Returns na. */
static int route_pairs(const int32_t *ids, const float *wts, int64_t P, int64_t k, int64_t E,
                       int32_t *slot, int32_t *act, int64_t *off, int64_t *pos, int32_t *ptok, float *pw) {
    memset(slot, 0, (size_t)E * 4);
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0) slot[ids[p]]++;
    int na = 0;
    off[0] = 0;
    for (int64_t e = 0; e < E; e++)
        if (slot[e]) { act[na] = (int32_t)e; off[na + 1] = off[na] + slot[e]; slot[e] = na++; }
    for (int a = 0; a < na; a++) pos[a] = off[a];
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] < 0) continue;
        const int64_t s = pos[slot[ids[p]]]++;
        ptok[s] = (int32_t)(p / k);
        pw[s] = wts[p];
    }
    return na;
}

/* What the stages of one moe_ffn_act call share. */
typedef struct {
    const float *x, *pw;
    float *h, *out;
    const int32_t *act, *ptok;
    const int64_t *off;
    const uint8_t *gate, *up, *down;
    char *xqm, *hqm;
    const moe_act *A;
    int64_t T, H, F, rbg, rbd, units, xqb, hqb;
    int gi, di, q8g, q8d, na;
} moe_ctx;

/* Stage 1 on global units [g0, g1) (unit g = active expert g / units, rows 2 (g % units) and + 1 of gate
 * and up), prefetching lead units ahead, across into the thread's next range [n0, n1). cold: prefetch the
 * first lead units first (the thread's first range). */
static void stage1_range(const moe_ctx *c, int64_t g0, int64_t g1, int64_t n0, int64_t n1, int cold) {
    const int64_t units = c->units, F = c->F, H = c->H, rbg = c->rbg;
    const int64_t lead = (HM_PF_DIST + 4 * rbg - 1) / (4 * rbg);
    for (int64_t g = g0; cold && g < g1 && g < g0 + lead; g++) {
        const int64_t ep = c->act[g / units], fp = 2 * (g % units);
        prefetch_range(c->gate + (ep * F + fp) * rbg, 2 * rbg);
        prefetch_range(c->up + (ep * F + fp) * rbg, 2 * rbg);
    }
    for (int64_t g = g0; g < g1; g++) {
        /* the unit lead ahead: its 2 gate rows (region 0) and 2 up rows (region 1) */
        const uint8_t *pf[4] = {NULL, NULL, NULL, NULL};
        int64_t gl = g + lead;
        const int pfok = gl < g1 || (gl = n0 + (gl - g1)) < n1;
        if (pfok) {
            const int64_t ep = c->act[gl / units], fp = 2 * (gl % units);
            pf[0] = c->gate + (ep * F + fp) * rbg; pf[1] = c->up + (ep * F + fp) * rbg;
            pf[2] = pf[0] + rbg; pf[3] = pf[1] + rbg;
        }
        const int a = (int)(g / units);
        const int64_t f = 2 * (g % units), e = c->act[a], s0 = c->off[a], n = c->off[a + 1] - c->off[a];
        const uint8_t *G = c->gate + e * F * rbg, *U = c->up + e * F * rbg;
        const uint8_t *rows[4] = {G + f * rbg, G + (f + 1) * rbg, U + f * rbg, U + (f + 1) * rbg};
        for (int64_t tt = 0; tt < n; tt += 4) {
            const int m = (int)(n - tt < 4 ? n - tt : 4);
            const float *xs[4];
            float res[16];
            for (int i = 0; i < m; i++) xs[i] = c->x + (int64_t)c->ptok[s0 + tt + i] * H;
            const uint8_t *const *pft = tt ? NULL : pf;   /* prefetch on the first pass only */
            if (n == 1) {
                xq8 q;
                if (c->q8g) xq8_init(&q, c->xqm + c->ptok[s0] * c->xqb, H);
                dot_rows1(c->gi, 4, rows, pft, H, xs[0], c->q8g ? &q : NULL, res);
            } else if (c->q8g && QC_MULTI) {                      /* g f, g f+1, u f, u f+1 x m tokens */
                xq8 qq[4];
                const xq8 *qp[4];
                for (int i = 0; i < m; i++) {
                    xq8_init(&qq[i], c->xqm + c->ptok[s0 + tt + i] * c->xqb, H);
                    qp[i] = &qq[i];
                }
                dot_rows_q(c->gi, 4, m, rows, pft, H, qp, res);
            } else if (m <= 2) {
                dot_rows(c->gi, 4, m, rows, pft, H, xs, res);   /* g f, g f+1, u f, u f+1 */
            } else {
                const uint8_t *r0[2] = {rows[0], rows[2]}, *r1[2] = {rows[1], rows[3]};
                const uint8_t *p0[2] = {pf[0], pf[1]}, *p1[2] = {pf[2], pf[3]};
                float tmp[8];
                dot_rows(c->gi, 2, m, r0, tt ? NULL : p0, H, xs, tmp);     /* g f, u f */
                for (int i = 0; i < m; i++) { res[i] = tmp[i]; res[2 * m + i] = tmp[m + i]; }
                dot_rows(c->gi, 2, m, r1, tt ? NULL : p1, H, xs, tmp);     /* g f+1, u f+1 */
                for (int i = 0; i < m; i++) { res[m + i] = tmp[i]; res[3 * m + i] = tmp[m + i]; }
            }
            for (int i = 0; i < m; i++) {
                float *hp = c->h + (s0 + tt + i) * F + f;
                hp[0] = act_h(c->A, res[0 * m + i], res[2 * m + i], e, F, f);
                hp[1] = act_h(c->A, res[1 * m + i], res[3 * m + i], e, F, f + 1);
            }
        }
        if (c->q8d && (g % units) % 32 == 31) {   /* a 64-row block of h is complete */
            const int64_t b0 = (f + 2 - 64) / 32;
            for (int64_t i = 0; i < n; i++) {
                xq8 q;
                xq8_init(&q, c->hqm + (s0 + i) * c->hqb, F);
                quant_x8(c->h + (s0 + i) * F, b0, b0 + 2, &q);
            }
        }
    }
}

/* Stage 2 on output rows [h0, h1) of H, every active expert in ascending order (groups of 4 rows,
 * expert-major: group q = expert q / ng, rows h0 + 4 (q % ng)); prefetching lead groups ahead, across
 * into the thread's next range [n0, n1). */
static void stage2_range(const moe_ctx *c, int64_t h0, int64_t h1, int64_t n0, int64_t n1, int cold) {
    const int64_t H = c->H, F = c->F, rbd = c->rbd, na = c->na;
    for (int64_t t = 0; t < c->T; t++)
        if (h1 > h0) memset(c->out + t * H + h0, 0, (size_t)(h1 - h0) * 4);
    const int64_t ng = (h1 - h0 + 3) / 4, nq = na * ng, ngn = (n1 - n0 + 3) / 4, nqn = na * ngn;
    const int64_t lead = (HM_PF_DIST + 4 * rbd - 1) / (4 * rbd);
    for (int64_t q = 0; cold && q < nq && q < lead; q++) {
        const int64_t rp = h0 + 4 * (q % ng), np = h1 - rp < 4 ? h1 - rp : 4;
        prefetch_range(c->down + (c->act[q / ng] * H + rp) * rbd, np * rbd);
    }
    for (int64_t q = 0; q < nq; q++) {
        /* the group lead ahead (here or in the next range): its first rows, as far as it has rows */
        const uint8_t *pfg = NULL;
        int64_t pfn = 0;
        if (q + lead < nq) {
            const int64_t ql = q + lead, rp = h0 + 4 * (ql % ng);
            pfg = c->down + (c->act[ql / ng] * H + rp) * rbd;
            pfn = h1 - rp < 4 ? h1 - rp : 4;
        } else if (q + lead - nq < nqn) {
            const int64_t ql = q + lead - nq, rp = n0 + 4 * (ql % ngn);
            pfg = c->down + (c->act[ql / ngn] * H + rp) * rbd;
            pfn = n1 - rp < 4 ? n1 - rp : 4;
        }
        const int a = (int)(q / ng);
        const int64_t r = h0 + 4 * (q % ng), nr = h1 - r < 4 ? h1 - r : 4;
        const int64_t e = c->act[a], s0 = c->off[a], n = c->off[a + 1] - c->off[a];
        const uint8_t *D = c->down + e * H * rbd;
        for (int64_t r1 = r; r1 < r + nr;) {
            const int R = r + nr - r1 >= 4 ? 4 : 1;
            const uint8_t *rows[4] = {D + r1 * rbd, D + (r1 + 1) * rbd, D + (r1 + 2) * rbd, D + (r1 + 3) * rbd};
            /* regions: rows 0-1 and 2-3 of the lookahead group (R == 4), or its row r1 - r */
            const int64_t c0 = r1 - r;
            const uint8_t *pf[2] = {c0 < pfn ? pfg + c0 * rbd : NULL,
                                    R == 4 && c0 + 2 < pfn ? pfg + (c0 + 2) * rbd : NULL};
            for (int64_t tt = 0; tt < n; tt += 4) {
                const int m = (int)(n - tt < 4 ? n - tt : 4);
                const float *xs[4];
                float res[16];
                for (int i = 0; i < m; i++) xs[i] = c->h + (s0 + tt + i) * F;
                if (n == 1) {
                    xq8 hq;
                    if (c->q8d) xq8_init(&hq, c->hqm + s0 * c->hqb, F);
                    dot_rows1(c->di, R, rows, pf, F, xs[0], c->q8d ? &hq : NULL, res);
                } else if (c->q8d && QC_MULTI) {
                    xq8 qq[4];
                    const xq8 *qp[4];
                    for (int i = 0; i < m; i++) {
                        xq8_init(&qq[i], c->hqm + (s0 + tt + i) * c->hqb, F);
                        qp[i] = &qq[i];
                    }
                    dot_rows_q(c->di, R, m, rows, tt ? NULL : pf, F, qp, res);
                } else {
                    rows_x_tokens(c->di, R, m, rows, tt ? NULL : pf, F, xs, res);
                }
                for (int i = 0; i < m; i++) {
                    const int64_t sp = s0 + tt + i;
                    float *o = c->out + (int64_t)c->ptok[sp] * H + r1;
                    for (int cc = 0; cc < R; cc++)                 /* the tile kernels' combine, op for op */
                        o[cc] = fmaf(c->pw[sp], c->A->bd ? res[cc * m + i] + down_bias(c->A, e, H, r1 + cc)
                                                         : res[cc * m + i], o[cc]);
                }
            }
            r1 += R;
        }
    }
}

/* Work is claimed in chunks from a shared counter, so a thread that runs slow (a busy or descheduled
 * vCPU) takes fewer: a static split left the slowest thread 30-50% behind the mean on the GPU machine's
 * VMs (profile_decode.py handoff). Each chunk still streams long runs of rows, and each thread claims
 * its next chunk when it starts one, so its prefetch runs on into it. Which thread computes a value never
 * changes the value: the result is bitwise the same for any thread count and any schedule. */
#ifndef S1_CHUNK
#define S1_CHUNK 32   /* units: 64 rows of gate and of up (whole 64-row blocks of h for the integer path) */
#endif
#ifndef S2_CHUNK
#define S2_CHUNK 32   /* output rows of H (a multiple of 4) */
#endif

static inline int64_t claim(int64_t *ctr) { return __atomic_fetch_add(ctr, 1, __ATOMIC_RELAXED); }

/* [lo, hi) of chunk c of C items out of N (empty, at N, for a chunk past the end: none left to claim) */
static inline void chunk_range(int64_t c, int64_t C, int64_t N, int64_t *lo, int64_t *hi) {
    *lo = c * C < N ? c * C : N;
    *hi = (c + 1) * C < N ? (c + 1) * C : N;
}

/* One thread's share of a stage: claim chunks of C items out of N from *ctr until none are left, and run
 * each as range(c, lo, hi, next lo, next hi, cold): the thread's next chunk is claimed before this one
 * runs, so the range can prefetch its rows; cold marks the thread's first chunk. */
typedef void (*stage_fn)(const moe_ctx *, int64_t, int64_t, int64_t, int64_t, int);
static inline void run_chunks(stage_fn range, const moe_ctx *c, int64_t *ctr, int64_t C, int64_t N) {
    const int64_t nc = (N + C - 1) / C;
    int64_t cur = claim(ctr), nxt = claim(ctr);
    for (int cold = 1; cur < nc; cold = 0, cur = nxt, nxt = claim(ctr)) {
        int64_t lo, hi, n0, n1;
        chunk_range(cur, C, N, &lo, &hi);
        chunk_range(nxt, C, N, &n0, &n1);
        range(c, lo, hi, n0, n1, cold);
    }
}

/* The expert kernel's serial part: arguments checked, the workspace (this thread's) laid out, the pairs routed;
 * *c the context its team runs (moe_team). Returns 0, 1 for no tokens (nothing to run), -1 for bad arguments,
 * -2 without memory. */
static int moe_prep(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *wts,
                    int64_t k, const uint8_t *gate, const uint8_t *up, int gtype, int64_t F, int64_t E,
                    const uint8_t *down, int dtype, float *out, const moe_act *A, moe_ctx *c) {
    const int gi = type_index(gtype), di = type_index(dtype);
    if (!moe_args_ok(gi, di, T, H, F, k, ids, E)) return -1;
    const int64_t P = T * k;
    if (T == 0) return 1;
    const int64_t rbg = row_bytes(gi, H), rbd = row_bytes(di, F);
    /* integer path for experts that see one token: x (and h) quantized once */
    const int q8g = (INT8_MASK >> gi & 1) && q8_type(gi, H);
    const int q8d = (INT8_MASK >> di & 1) && q8_type(di, F);
    const size_t xqb = q8g ? (xq8_bytes(H) + 63) & ~(size_t)63 : 0, hqb = q8d ? (xq8_bytes(F) + 63) & ~(size_t)63 : 0;

    size_t need = (size_t)E * 4 * 2 + (size_t)(E + 1) * 8 * 2 + (size_t)P * 8 + 64 * 4 + (size_t)P * F * 4 +
                  (size_t)T * xqb + (size_t)P * hqb + 64;
    char *ws = workspace(need);
    if (!ws) return -2;
    int32_t *slot = (int32_t *)ws;             /* [E] expert -> active index */
    int32_t *act = slot + E;                   /* [E] active experts, ascending */
    int64_t *off = (int64_t *)(((uintptr_t)(act + E) + 63) & ~(uintptr_t)63); /* [E+1] pair offsets */
    int64_t *pos = off + E + 1;                /* [E+1] fill cursor */
    int32_t *ptok = (int32_t *)(pos + E + 1);  /* [P] token of sorted pair */
    float *pw = (float *)(ptok + P);           /* [P] its router weight */
    float *h = (float *)(((uintptr_t)(pw + P) + 63) & ~(uintptr_t)63);      /* [P, F] */
    char *xqm = (char *)(((uintptr_t)(h + P * F) + 63) & ~(uintptr_t)63);  /* [T] quantized x */
    char *hqm = xqm + (size_t)T * xqb;                                      /* [P] quantized h */

    const int na = route_pairs(ids, wts, P, k, E, slot, act, off, pos, ptok, pw);
    *c = (moe_ctx){.x = x, .pw = pw, .h = h, .out = out, .act = act, .ptok = ptok, .off = off, .gate = gate,
                   .up = up, .down = down, .xqm = xqm, .hqm = hqm, .A = A, .T = T, .H = H, .F = F, .rbg = rbg,
                   .rbd = rbd, .units = F / 2, .xqb = (int64_t)xqb, .hqb = (int64_t)hqb, .gi = gi, .di = di,
                   .q8g = q8g, .q8d = q8d, .na = na};
    return 0;
}

/* One thread's part of the expert kernel inside a parallel region (every thread of the team calls it, with
 * ctr[2] shared and 0 at the start): x quantized, stage 1 in chunks of S1_CHUNK units (when h is quantized,
 * F % 64 == 0, so chunks are 64-row aligned in every expert), a barrier, stage 2 in chunks of S2_CHUNK rows of H */
static void moe_team(const moe_ctx *c, int64_t *ctr) {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    HM_STAMP(tid, 0);
    if (tid == 0) g_tr_n = nt < HM_TR_MAX ? nt : HM_TR_MAX;
    if (c->q8g) {   /* ---- stage 0: quantize x */
        int64_t t0, t1;
        split(c->T, nt, tid, 1, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) {
            xq8 q;
            xq8_init(&q, c->xqm + t * c->xqb, c->H);
            quant_x8(c->x + t * c->H, 0, c->H / 32, &q);
        }
#pragma omp barrier
    }
    run_chunks(stage1_range, c, &ctr[0], S1_CHUNK, (int64_t)c->na * c->units);   /* ---- stage 1 */
    HM_STAMP(tid, 1);
#pragma omp barrier
    HM_STAMP(tid, 2);
    run_chunks(stage2_range, c, &ctr[1], S2_CHUNK, c->H);                        /* ---- stage 2 */
    HM_STAMP(tid, 3);
}

static int moe_ffn_act(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *wts,
                       int64_t k, const uint8_t *gate, const uint8_t *up, int gtype, int64_t F, int64_t E,
                       const uint8_t *down, int dtype, float *out, int nthreads, const moe_act *A) {
    moe_ctx c;
    const int rc = moe_prep(x, T, H, ids, wts, k, gate, up, gtype, F, E, down, dtype, out, A, &c);
    if (rc) return rc > 0 ? 0 : rc;
    int64_t ctr[2] = {0, 0};
    const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
#pragma omp parallel num_threads(nth)
    moe_team(&c, ctr);
    return 0;
}

/* out[T, N] = x[T, K] @ W[N, K]^T, W as GGUF rows; each thread a contiguous range of rows. Types on the
 * integer path: every token's x quantized once (in parallel), then the canonical products. */
int hm_qmatmul(const float *x, int64_t T, int64_t K, const uint8_t *w, int wtype, int64_t N,
               float *out, int nthreads) {
    const int wi = type_index(wtype);
    if (wi < 0 || K % 32 || K % TINFO[wi].qk || T < 0 || N < 0) return -1;
    const int64_t rb = row_bytes(wi, K);
    const int q8 = T >= 1 && (INT8_MASK >> wi & 1) && q8_type(wi, K) && (T == 1 || QC_MULTI);
    const size_t xqb = (xq8_bytes(K) + 63) & ~(size_t)63;
    char *mem = NULL;
    if (q8) {
        mem = workspace((size_t)T * xqb + 64);
        if (!mem) return -2;
        mem = (char *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    }
    int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
#pragma omp parallel num_threads(nth)
    {
        if (q8) {
            int64_t t0, t1;
            split(T, omp_get_num_threads(), omp_get_thread_num(), 1, &t0, &t1);
            for (int64_t t = t0; t < t1; t++) {
                xq8 q;
                xq8_init(&q, mem + t * xqb, K);
                quant_x8(x + t * K, 0, K / 32, &q);
            }
#pragma omp barrier
        }
        int64_t n0, n1;
        split(N, omp_get_num_threads(), omp_get_thread_num(), 4, &n0, &n1);
        const int64_t lead = (HM_PF_DIST + rb - 1) / rb;
        /* tokens in chunks whose activations stay in L2 while the rows stream past them once a chunk (many
         * tokens: one pass of the rows over all of x read x from memory for every 4 rows) */
        const int64_t tc = ((int64_t)1 << 19) / (K * 4) / 4 * 4, TC = tc < 4 ? 4 : tc;   /* 512 KiB of x */
        for (int64_t c0 = 0; c0 < T; c0 += TC) {
        const int64_t c1 = c0 + TC < T ? c0 + TC : T;
        prefetch_range(w + n0 * rb, (n1 - n0 < lead ? n1 - n0 : lead) * rb);   /* cold start */
        for (int64_t r = n0; r < n1;) {
            const int R = n1 - r >= 4 ? 4 : 1;
            const uint8_t *rows[4] = {w + r * rb, w + (r + 1) * rb, w + (r + 2) * rb, w + (r + 3) * rb};
            const uint8_t *pf[2] = {r + lead < n1 ? rows[0] + lead * rb : NULL,
                                    R == 4 && r + 2 + lead < n1 ? rows[2] + lead * rb : NULL};
            for (int64_t tt = c0; tt < c1; tt += 4) {
                const int m = (int)(c1 - tt < 4 ? c1 - tt : 4);
                const float *xs[4];
                float res[16];
                for (int i = 0; i < m; i++) xs[i] = x + (tt + i) * K;
                if (q8) {
                    xq8 qq[4];
                    const xq8 *qp[4];
                    for (int i = 0; i < m; i++) {
                        xq8_init(&qq[i], mem + (tt + i) * xqb, K);
                        qp[i] = &qq[i];
                    }
                    if (T == 1) dot_rows1(wi, R, rows, pf, K, x, qp[0], res);
                    else dot_rows_q(wi, R, m, rows, tt > c0 ? NULL : pf, K, qp, res);
                } else {
                    rows_x_tokens(wi, R, m, rows, tt > c0 ? NULL : pf, K, xs, res);
                }
                for (int i = 0; i < m; i++)
                    for (int c = 0; c < R; c++) out[(tt + i) * N + r + c] = res[c * m + i];
            }
            r += R;
        }
        }
    }
    return 0;
}

/* Tests: out[T, N] by the canonical reference (cdot_ref) for integer-path types, x quantized per token
 * as every kernel quantizes it; -1 for a type or K the integer path does not take. */
int hm_qdot_ref(const float *x, int64_t T, int64_t K, const uint8_t *w, int wtype, int64_t N, float *out) {
    const int wi = type_index(wtype);
    if (wi < 0 || wi < I_Q4_0 || K % 64 || K % TINFO[wi].qk) return -1;
    const size_t xqb = (xq8_bytes(K) + 63) & ~(size_t)63;
    char *mem = malloc(xqb + 64);
    if (!mem) return -2;
    xq8 q;
    xq8_init(&q, mem, K);
    const int64_t rb = row_bytes(wi, K);
    for (int64_t t = 0; t < T; t++) {
        quant_x8(x + t * K, 0, K / 32, &q);
        for (int64_t n = 0; n < N; n++) out[t * N + n] = cdot_ref(wi, w + n * rb, K, &q);
    }
    free(mem);
    return 0;
}

#if HM_AVX512
/* 16 floats -> 16 bf16, round to nearest even (as torch's .to(bfloat16)) */
static inline __m256i bf16_pack(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i b = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                 _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
    /* NaN: keep quiet NaN */
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(b, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}
#endif

#if HM_AVX512
/* 32 floats -> 32 bf16 at p */
static inline void store_bf16x32(uint16_t *p, __m512 lo, __m512 hi) {
#if defined(__AVX512BF16__)
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
    _mm256_storeu_si256((__m256i *)p, bf16_pack(lo));
    _mm256_storeu_si256((__m256i *)(p + 16), bf16_pack(hi));
#endif
}
#endif

/* ------------------------------------------------------------------ dequantize
 * rows [nrows, row_bytes(K)] -> dst [nrows, K] as bf16 (to_bf16 = 1) or fp32; dst rows are
 * ldd elements apart. Used by the large-batch path (dequantize, then a bf16 GEMM). */
static void deq_row(int wi, const uint8_t *row, int64_t k0, int64_t K, void *dst, int to_bf16) {
#if HM_AVX2
    if (g_simd == 1) { deq_row_avx2(wi, row, k0, K, dst, to_bf16); return; }
#endif
#if HM_AVX512
    if (g_simd == 2) {
        const float rd = IS_X(wi) ? x_rowscale(wi, row) : 1.0f;
        row += TINFO[wi].hdr + blk_bytes(wi, k0);
        float *df = (float *)dst;
        uint16_t *db = (uint16_t *)dst;
        if (wi == I_Q4_K && to_bf16) {   /* two units share each 32 bytes of nibbles: extend them once */
            const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int64_t g = 0; g < K / 256; g++) {
                const uint8_t *b = row + g * TINFO[I_Q4_K].ts;
                kscale ks;
                prep_k(I_Q4_K, b, 1.0f, &ks);
                for (int p = 0; p < 4; p++) {
                    const __m512i qa = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 + 32 * p)));
                    const __m512i qb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32 + 32 * p)));
                    const __m512 t0 = _mm512_fmsub_ps(iota, _mm512_set1_ps(ks.s[2 * p]), _mm512_set1_ps(ks.m[2 * p]));
                    const __m512 t1 = _mm512_fmsub_ps(iota, _mm512_set1_ps(ks.s[2 * p + 1]), _mm512_set1_ps(ks.m[2 * p + 1]));
                    uint16_t *d = db + g * 256 + 64 * p;
                    store_bf16x32(d, _mm512_permutexvar_ps(qa, t0), _mm512_permutexvar_ps(qb, t0));
                    store_bf16x32(d + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(qa, 4), t1),
                                  _mm512_permutexvar_ps(_mm512_srli_epi32(qb, 4), t1));
                }
            }
            return;
        }
        /* one loop per type (a switch per block inside one loop ran at half the speed) */
#define DEQ_CASE(TI) case TI: \
            for (int64_t g = 0; g < K / 32; g += IS_K(TI) ? 8 : 1) { \
                const uint8_t *b = unit_block(TI, row, g); \
                kscale ks; \
                if (IS_K(TI)) prep_k(TI, b, rd, &ks); \
                for (int u = 0; u < (IS_K(TI) ? 8 : 1); u++) { \
                    __m512 w0, w1; \
                    unpack32(TI, b, u, &ks, &w0, &w1); \
                    const int64_t e0 = (g + u) * 32; \
                    if (to_bf16) store_bf16x32(db + e0, w0, w1); \
                    else { _mm512_storeu_ps(df + e0, w0); _mm512_storeu_ps(df + e0 + 16, w1); } \
                } \
            } \
            break;
        switch (wi) { EACH_TYPE(DEQ_CASE) }
#undef DEQ_CASE
        return;
    }
#endif
    float buf[CHUNK];
    for (int64_t off = 0; off < K; off += CHUNK) {
        const int n = (int)(K - off < CHUNK ? K - off : CHUNK);
        if (to_bf16) {
            deq_scalar(wi, row, k0 + off, n, buf);
            for (int i = 0; i < n; i++) ((uint16_t *)dst)[off + i] = f32_to_bf16(buf[i]);
        } else {
            deq_scalar(wi, row, k0 + off, n, (float *)dst + off);
        }
    }
}


/* w2 != NULL: dst rows [nrows, 2 nrows) come from w2 (gate and up into one [2F, H] buffer) */
int hm_dequant(const uint8_t *w, const uint8_t *w2, int wtype, int64_t nrows, int64_t K, void *dst,
               int64_t ldd, int to_bf16, int nthreads) {
    const int wi = type_index(wtype);
    if (wi < 0 || K % 32 || K % TINFO[wi].qk || nrows < 0 || ldd < K) return -1;
    const int64_t rb = row_bytes(wi, K), esz = to_bf16 ? 2 : 4, n = w2 ? 2 * nrows : nrows;
    int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
#pragma omp parallel num_threads(nth)
    {
        int64_t r0, r1;
        split(n, omp_get_num_threads(), omp_get_thread_num(), 1, &r0, &r1);
        const int64_t lead = (HM_PF_DIST + rb - 1) / rb;
        int64_t rp = r0;
        for (int64_t r = r0; r < r1; r++) {
            for (; rp < r1 && rp <= r + lead; rp++)
                prefetch_range(rp < nrows ? w + rp * rb : w2 + (rp - nrows) * rb, rb);
            const uint8_t *src = r < nrows ? w + r * rb : w2 + (r - nrows) * rb;
            deq_row(wi, src, 0, K, (char *)dst + r * ldd * esz, to_bf16);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ large-batch helpers
 * The dequantize + bf16 GEMM path (cpu.py) runs torch.mm per expert; these do the elementwise
 * steps around it in one call each. */

static inline float bf16f(uint16_t v) { return bf16_to_f32(v); }

/* branch-free f32_to_bf16 (vectorizable) */
static inline uint16_t bf16_rne(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    const uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1)) >> 16, q = (b >> 16) | 64;
    return (uint16_t)((b & 0x7FFFFFFFu) > 0x7F800000u ? q : r);
}

/* h[i, f] = silu(gu[i, f]) * gu[i, F + f] for rows i < n; gu, h bf16 (row strides 2F and F) */
int hm_silu_mul_bf16(const uint16_t *gu, int64_t n, int64_t F, uint16_t *h, int nthreads) {
    int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *g = gu + i * 2 * F, *u = g + F;
        uint16_t *hi = h + i * F;
        for (int64_t f = 0; f < F; f++) {
            const float gf = bf16f(g[f]);
            hi[f] = bf16_rne(gf / (1.0f + exp_vec(-gf)) * bf16f(u[f]));
        }
    }
    return 0;
}

/* out[t] = sum_j w[t, j] * y[slot[t, j]] (bf16 rows of H), j ascending, slot < 0 skipped:
 * deterministic, each token's row written by one thread */
int hm_combine_bf16(const uint16_t *y, const int64_t *slot, const float *w, int64_t T, int64_t k,
                    int64_t H, float *out, int nthreads) {
    int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        memset(o, 0, (size_t)H * 4);
        for (int64_t j = 0; j < k; j++) {
            const int64_t s = slot[t * k + j];
            if (s < 0) continue;
            const uint16_t *yr = y + s * H;
            const float wj = w[t * k + j];
            for (int64_t c = 0; c < H; c++) o[c] += wj * bf16f(yr[c]);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ grouped bf16 tile GEMM
 * hm_moe_tile: the MoE FFN for large batches (prompt processing on the CPU), one call per layer,
 * every weight byte read once, as 16 x 16 x 32 bf16 tile products with fp32 accumulation:
 *   stage 0: pairs sorted by expert; each expert's tokens in blocks of 16, packed as bf16 pairs:
 *            the B operand of a tile product, [K/2][16 tokens] of (x[2q], x[2q+1]).
 *   stage 1: units (expert, TILE_S1_STEPS x 16 rows of F), 16 rows a step: 16 gate and 16 up rows
 *            dequantized to bf16 rows (the A operands, cache-resident), multiplied with every token
 *            block of the expert; h = act(g, u), packed the same way for stage 2.
 *   stage 2: units of TILE_S2_ROWS output rows of H, 32 a step: for every active expert, its down
 *            rows dequantized, multiplied with its h blocks, out[t] += w * y in ascending expert
 *            order: one writer per output element, deterministic for any thread count.
 *   Units are claimed from counters one ahead; each step prefetches the next one's data (pfq).
 * Tile products: AMX (TDPBF16PS) where the CPU has it and Linux grants the tile state, else
 * AVX512-BF16 (vdpbf16ps, one broadcast weight pair x 16 tokens), else portable C.
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && HM_AVX512
#define HM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HM_AMX 0
#endif
#if HM_AVX512 && defined(__AVX512BF16__)
#define HM_DPBF16 1
#else
#define HM_DPBF16 0
#endif

enum { TILE_C = 1, TILE_BF16 = 2, TILE_AMX = 3 };
static int g_tile = -1;            /* -1: not decided yet (the best available on first use) */

static int tile_best(void) {
#if HM_AMX
    /* Linux hands out the AMX tile-data state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA) */
    if (syscall(SYS_arch_prctl, 0x1023, 18) == 0) return TILE_AMX;
#endif
    return HM_DPBF16 ? TILE_BF16 : TILE_C;
}

/* What a thread's next tile step reads from beyond its own cache, prefetched into L2 a few lines at a time
 * from inside the current step's dequantization and tile products: the next step's weight rows (gate
 * and up rows, or down rows: from RAM) and, where the next step is another expert's, its token or h
 * blocks (written by other cores). Before, rows were prefetched only while others were dequantized, so
 * the weight stream stopped while the products ran (docs/cpu-kernels.md). */
typedef struct { const uint8_t *p[3]; int64_t n[3], i; int r; } pfq;

static inline pfq pfq_of(const uint8_t *a, int64_t na, const uint8_t *b, int64_t nb, const uint8_t *c, int64_t nc) {
    pfq q = {{a, b, c}, {a ? na : 0, b ? nb : 0, c ? nc : 0}, 0, 0};
    for (int r = 0; r < 3; r++)
        if (q.p[r]) {   /* from the first line's start: every line of the range is touched */
            const int64_t lead = (int64_t)((uintptr_t)q.p[r] & 63);
            q.p[r] -= lead;
            q.n[r] += lead;
        }
    return q;
}
static inline int64_t pfq_left(const pfq *q) {
    int64_t n = -q->i;
    for (int r = q->r; r < 3; r++) n += q->n[r];
    return (n + 63) / 64;
}
static inline void pfq_run(pfq *q, int64_t lines) {
    while (lines > 0 && q->r < 3) {
        if (q->i >= q->n[q->r]) { q->r++; q->i = 0; continue; }
        __builtin_prefetch(q->p[q->r] + q->i, 0, 2);
        q->i += 64;
        lines--;
    }
}

/* C[j][0] (+)= A0 . B_j, C[j][1] (+)= A1 . B_j for token blocks j < nb: A0, A1 16 bf16 rows of K
 * (lda elements apart), B_j = B + j * bstride (uint32 pairs [K/2][16]), C [nb][2][16][16] fp32
 * with C[..][m][n] = sum_k A[m][k] x_n[k]; acc: add to C, else overwrite it. Each issues `lines`
 * lines of pq spread over its work. */
static void tile_c(const uint16_t *A0, const uint16_t *A1, int64_t lda, const uint32_t *B,
                   int64_t bstride, int nb, int64_t K, float *C, int acc, pfq *pq, int64_t lines) {
    pfq_run(pq, lines);
    for (int j = 0; j < nb; j++)
        for (int a = 0; a < 2; a++) {
            const uint16_t *A = a ? A1 : A0;
            float *c = C + ((int64_t)j * 2 + a) * 256;
            for (int m = 0; m < 16; m++)
                for (int n = 0; n < 16; n++) {
                    float s = acc ? c[m * 16 + n] : 0.0f;
                    for (int64_t q = 0; q < K / 2; q++) {
                        const uint32_t b = B[j * bstride + q * 16 + n];
                        s += bf16_to_f32(A[m * lda + 2 * q]) * bf16_to_f32((uint16_t)b) +
                             bf16_to_f32(A[m * lda + 2 * q + 1]) * bf16_to_f32((uint16_t)(b >> 16));
                    }
                    c[m * 16 + n] = s;
                }
        }
}

#if HM_DPBF16
/* 8 weight rows x 2 token blocks per pass: 16 accumulators, one broadcast weight pair feeds two
 * vdpbf16ps; a lone last block takes 16 rows x 1 */
static void tile_bf16(const uint16_t *A0, const uint16_t *A1, int64_t lda, const uint32_t *B,
                      int64_t bstride, int nb, int64_t K, float *C, int acc, pfq *pq, int64_t lines) {
    const int64_t per = (lines + 4 * ((nb + 1) / 2) - 1) / (4 * ((nb + 1) / 2));   /* lines a pass */
    for (int j = 0; j < nb; j += 2) {
        const uint32_t *B0 = B + j * bstride, *B1 = B0 + bstride;
        for (int a = 0; a < 2; a++) {
            const uint32_t *A = (const uint32_t *)(a ? A1 : A0);
            float *c = C + ((int64_t)j * 2 + a) * 256;
            if (j + 1 < nb) {
                for (int m0 = 0; m0 < 16; m0 += 8) {
                    pfq_run(pq, per);
                    __m512 s0[8], s1[8];
                    for (int m = 0; m < 8; m++) {
                        s0[m] = acc ? _mm512_loadu_ps(c + (m0 + m) * 16) : _mm512_setzero_ps();
                        s1[m] = acc ? _mm512_loadu_ps(c + 512 + (m0 + m) * 16) : _mm512_setzero_ps();
                    }
                    for (int64_t q = 0; q < K / 2; q++) {
                        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B0 + q * 16);
                        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B1 + q * 16);
                        for (int m = 0; m < 8; m++) {
                            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)A[(m0 + m) * lda / 2 + q]);
                            s0[m] = _mm512_dpbf16_ps(s0[m], w, b0);
                            s1[m] = _mm512_dpbf16_ps(s1[m], w, b1);
                        }
                    }
                    for (int m = 0; m < 8; m++) {
                        _mm512_storeu_ps(c + (m0 + m) * 16, s0[m]);
                        _mm512_storeu_ps(c + 512 + (m0 + m) * 16, s1[m]);
                    }
                }
            } else {
                pfq_run(pq, 2 * per);
                __m512 s0[16];
                for (int m = 0; m < 16; m++) s0[m] = acc ? _mm512_loadu_ps(c + m * 16) : _mm512_setzero_ps();
                for (int64_t q = 0; q < K / 2; q++) {
                    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B0 + q * 16);
                    for (int m = 0; m < 16; m++)
                        s0[m] = _mm512_dpbf16_ps(s0[m], (__m512bh)_mm512_set1_epi32((int)A[m * lda / 2 + q]), b0);
                }
                for (int m = 0; m < 16; m++) _mm512_storeu_ps(c + m * 16, s0[m]);
            }
        }
    }
}
#endif

#if HM_AMX
typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static void amx_config(void) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    /* GCC does not see _tile_loadconfig read the struct: once inlined, the field stores were dropped */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* tiles: 0-3 accumulators (block j x A0, A1; block j+1 x A0, A1), 4-5 A0/A1, 6-7 B_j/B_j+1 */
static void tile_amx(const uint16_t *A0, const uint16_t *A1, int64_t lda, const uint32_t *B,
                     int64_t bstride, int nb, int64_t K, float *C, int acc, pfq *pq, int64_t lines) {
    const int64_t sa = lda * 2, steps = K / 32 * ((nb + 1) / 2);
    const int64_t per = (lines + steps - 1) / steps;   /* prefetched lines per k step */
    int j = 0;
    for (; j + 2 <= nb; j += 2) {
        const uint32_t *B0 = B + j * bstride, *B1 = B0 + bstride;
        float *c = C + (int64_t)j * 512;
        if (acc) {
            _tile_loadd(0, c, 64); _tile_loadd(1, c + 256, 64); _tile_loadd(2, c + 512, 64); _tile_loadd(3, c + 768, 64);
        } else {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        }
        for (int64_t kc = 0; kc < K / 32; kc++) {
            _tile_loadd(4, A0 + kc * 32, sa);
            _tile_loadd(5, A1 + kc * 32, sa);
            _tile_loadd(6, B0 + kc * 256, 64);
            _tile_loadd(7, B1 + kc * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
            pfq_run(pq, per);
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
    if (j < nb) {
        const uint32_t *B0 = B + j * bstride;
        float *c = C + (int64_t)j * 512;
        if (acc) { _tile_loadd(0, c, 64); _tile_loadd(1, c + 256, 64); }
        else { _tile_zero(0); _tile_zero(1); }
        for (int64_t kc = 0; kc < K / 32; kc++) {
            _tile_loadd(4, A0 + kc * 32, sa);
            _tile_loadd(5, A1 + kc * 32, sa);
            _tile_loadd(6, B0 + kc * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            pfq_run(pq, per);
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
    }
}
#endif

static inline void tile_product(int mode, const uint16_t *A0, const uint16_t *A1, int64_t lda, const uint32_t *B,
                                int64_t bstride, int nb, int64_t K, float *C, int acc, pfq *pq, int64_t lines) {
#if HM_AMX
    if (mode == TILE_AMX) { tile_amx(A0, A1, lda, B, bstride, nb, K, C, acc, pq, lines); return; }
#endif
#if HM_DPBF16
    if (mode == TILE_BF16) { tile_bf16(A0, A1, lda, B, bstride, nb, K, C, acc, pq, lines); return; }
#endif
    (void)mode;
    tile_c(A0, A1, lda, B, bstride, nb, K, C, acc, pq, lines);
}

#ifndef TILE_KC
#define TILE_KC 2048   /* K elements a pass: a multiple of every block size (K-quants: 256) */
#endif
#define TILE_LDA (TILE_KC + 32)   /* elements between the bf16 rows of a pass: rows 4 KiB apart would share
                                   * one L1 set, and a tile load reads 16 of them */

/* One tile step: C[j] = [16 rows of w0; 16 rows of w1] . B_j for the nb token blocks, the rows (rb bytes
 * each) quantized, K long. In passes of up to TILE_KC (so the scratch stays 130 KB for any K): each pass
 * dequantizes its slice of the 32 rows into Ac and accumulates its products. Passes of 256 and 512
 * (operands in L1) measured no faster on Sapphire Rapids at the Qwen3-30B-A3B shape than whole rows.
 * Issues all of pq, in even parts over the passes, half in the dequantization and half in the products. */
static void tile_step(int mode, int ti, const uint8_t *w0, const uint8_t *w1, int64_t rb, int64_t K,
                      const uint32_t *B, int64_t bstride, int nb, uint16_t *Ac, float *C, pfq *pq) {
    const int64_t passes = (K + TILE_KC - 1) / TILE_KC, lines = (pfq_left(pq) + passes - 1) / passes;
    for (int64_t k0 = 0; k0 < K; k0 += TILE_KC) {
        const int64_t kc = K - k0 < TILE_KC ? K - k0 : TILE_KC;
        for (int m = 0; m < 32; m++) {
            pfq_run(pq, (lines + 63) / 64);
            deq_row(ti, m < 16 ? w0 + m * rb : w1 + (m - 16) * rb, k0, kc, Ac + m * TILE_LDA, 1);
        }
        tile_product(mode, Ac, Ac + 16 * TILE_LDA, TILE_LDA, B + k0 / 2 * 16, bstride, nb, kc, C, k0 > 0, pq,
                     lines / 2);
    }
    pfq_run(pq, pfq_left(pq));
}

/* a row of K floats -> K/2 bf16 pairs (x[2q], x[2q+1]) */
static inline void bf16_pairs(uint32_t *dst, const float *x, int64_t K) {
    int64_t i = 0;
#if HM_AVX512 && defined(__AVX512BF16__)
    for (; i + 32 <= K; i += 32)
        _mm512_storeu_si512(dst + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
#endif
    for (; i < K; i += 2) dst[i / 2] = (uint32_t)bf16_rne(x[i]) | (uint32_t)bf16_rne(x[i + 1]) << 16;
}

/* token block dst ([Q][16] bf16 pairs: the B operand) from rows tok[0..cn) of xp (Q pairs each); tokens
 * cn..15 are zero. In 16 x 16 pieces: one line of each of 16 rows in, 16 whole lines out. */
static void pack_tokens(uint32_t *dst, const uint32_t *xp, const int32_t *tok, int cn, int64_t Q) {
    uint32_t tmp[16][16] __attribute__((aligned(64)));
    for (int n = cn; n < 16; n++) memset(tmp[n], 0, sizeof tmp[n]);
    for (int64_t q0 = 0; q0 < Q; q0 += 16) {
        for (int n = 0; n < cn; n++) memcpy(tmp[n], xp + (int64_t)tok[n] * Q + q0, sizeof tmp[n]);
        for (int q = 0; q < 16; q++)
            for (int n = 0; n < 16; n++) dst[(q0 + q) * 16 + n] = tmp[n][q];
    }
}

/* out[tok] += w * (C rows + bias) for the (up to 16) tokens of one block: C [2][16 rows][16 tokens] */
static inline void add_block_rows(float *out, int64_t H, int64_t r0, const float *c, const int32_t *tok,
                                  const float *w, int cn, const float *bias) {
    for (int n = 0; n < cn; n++) {
        float *o = out + (int64_t)tok[n] * H + r0;
#if HM_AVX512
        const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208,
                                              224, 240);
        __m512 y0 = _mm512_i32gather_ps(col, c + n, 4), y1 = _mm512_i32gather_ps(col, c + 256 + n, 4);
        if (bias) {
            y0 = _mm512_add_ps(y0, _mm512_loadu_ps(bias));
            y1 = _mm512_add_ps(y1, _mm512_loadu_ps(bias + 16));
        }
        const __m512 wv = _mm512_set1_ps(w[n]);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(wv, y0, _mm512_loadu_ps(o)));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(wv, y1, _mm512_loadu_ps(o + 16)));
#else
        for (int m = 0; m < 32; m++)
            o[m] += w[n] * (c[(m >> 4) * 256 + (m & 15) * 16 + n] + (bias ? bias[m] : 0.0f));
#endif
    }
}

/* ------------------------------------------------------------------ exact int8 tiles (AMX-INT8)
 * The canonical integer products (cdot_ref) of many tokens at once, for prompts: per 32-block (Q6_K: per
 * 16-element sub-block) one tile product of 16 weight rows x 16 tokens for each of the two activation terms
 * (TDPBSSD; TDPBUSD for the K-quants' unsigned values), exact int32 block sums, then the float chain of each
 * (row, token) in vector registers, block by block in cdot_ref's order. So prompts compute bit for bit what
 * decode computes, whatever the batch. The weights are unpacked to int8 only (no dequantization to bf16),
 * but a tile product of K = 32 is half as full as bf16's, there are two terms, and every block's sums go
 * through memory into the float chain (docs/cpu-kernels.md has the measurements). */
#if HM_AMX && defined(__AMX_INT8__)
#define HM_AMX8 1
#else
#define HM_AMX8 0
#endif

/* Per-token quantized rows, contiguous (the tokens of a call, or the pairs' h): q1, q2 [T][K] int8,
 * xsb, sxf [T][K/32] (quant_x8's d/256 and sum-of-x per block). */
typedef struct { int8_t *q1, *q2; float *xsb, *sxf; int64_t K; } qrows;

static size_t qrows_bytes(int64_t T, int64_t K) { return (size_t)T * (size_t)(K * 2 + K / 32 * 8) + 256; }

static void qrows_init(qrows *r, void *mem, int64_t T, int64_t K) {
    uintptr_t p = ((uintptr_t)mem + 63) & ~(uintptr_t)63;
    r->q1 = (int8_t *)p; p += (size_t)(T * K);
    r->q2 = (int8_t *)p; p += (size_t)(T * K);
    r->xsb = (float *)p; p += (size_t)(T * K / 32) * 4;
    r->sxf = (float *)p;
    r->K = K;
}

/* row t of r = x (K floats) quantized by quant_x8, the function every path quantizes with; tmp: xq8_bytes(K) */
static void qrows_quant(const qrows *r, int64_t t, const float *x, void *tmp) {
    const int64_t K = r->K;
    xq8 q;
    xq8_init(&q, tmp, K);
    q.q1 = r->q1 + t * K;
    q.q2 = r->q2 + t * K;
    quant_x8(x, 0, K / 32, &q);
    memcpy(r->xsb + t * (K / 32), q.xsb, (size_t)(K / 32) * 4);
    memcpy(r->sxf + t * (K / 32), q.sxf, (size_t)(K / 32) * 4);
}

/* A token block of the int8 tiles, tb_bytes(K): 16 tokens' [q1 as B tiles: K/4][16][4] [q2: the same]
 * [xs: K/32][16] [sx: K/32][16]; tokens cn..15 are zero */
static inline int64_t tb_bytes(int64_t K) { return K * 36; }

static void pack_tb(uint8_t *tb, const qrows *r, const int32_t *tok, int cn) {
    const int64_t K = r->K, nb = K / 32;
    pack_tokens((uint32_t *)tb, (const uint32_t *)r->q1, tok, cn, K / 4);
    pack_tokens((uint32_t *)(tb + 16 * K), (const uint32_t *)r->q2, tok, cn, K / 4);
    float *xs = (float *)(tb + 32 * K), *sx = xs + nb * 16;
    for (int64_t b = 0; b < nb; b++)
        for (int n = 0; n < 16; n++) {
            xs[b * 16 + n] = n < cn ? r->xsb[tok[n] * nb + b] : 0.0f;
            sx[b * 16 + n] = n < cn ? r->sxf[tok[n] * nb + b] : 0.0f;
        }
}

#if HM_AMX8
/* tiles: 0, 1 (and 5, 6 for the next block) a block's two sums (C1 = A.q1, C2 = A.q2); 2 the weights A (16
 * rows x 32 or 16 bytes); 3, 4 the tokens' q1, q2 (8 or 4 rows of 16 tokens x 4 bytes) */
static void amx8_config(int q6) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[5] = cfg.rows[6] = 16;
    cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[5] = cfg.colsb[6] = 64;
    cfg.rows[2] = 16;
    cfg.colsb[2] = q6 ? 16 : 32;
    cfg.rows[3] = cfg.rows[4] = q6 ? 4 : 8;
    cfg.colsb[3] = cfg.colsb[4] = 64;
    __asm__ volatile("" : : "r"(&cfg) : "memory");   /* keep the field stores (see amx_config) */
    _tile_loadconfig(&cfg);
}
#endif

#define A8_LDA (TILE_KC + 64)     /* bytes between the int8 weight rows of a pass */

/* One weight row's elements [k0, k0 + kc) as the int8 values the tiles multiply (signed v; Q4_K/Q5_K:
 * unsigned q) into A, its block scales into ws[(block - k0/32) * 32] (Q6_K: per 16, [(i - k0/16) * 32]) and,
 * for Q4_K/Q5_K, its mins into wm[block * 32] (absolute block index; the min chain runs after all passes).
 * The same unpacking as the streaming kernel's (kern_qc), so the same integers. */
static void a8_unpack_row(int ti, const uint8_t *row, int64_t k0, int64_t kc, int8_t *A, float *ws, float *wm) {
#if HM_VNNI
    const int ts = TINFO[ti].ts;
    if (!IS_K(ti)) {
        const __m512i off = _mm512_set1_epi8((char)QC_OFF(ti));
        for (int64_t e = 0; e < kc; e += 64) {
            const uint8_t *b = row + (k0 + e) / 32 * ts;
            _mm512_storeu_si512(A + e, _mm512_sub_epi8(qc_b32(ti, b, ts), off));
            ws[(e / 32) * 32] = *B32_D(ti, b);
            ws[(e / 32 + 1) * 32] = *B32_D(ti, b + ts);
        }
        return;
    }
    for (int64_t e = 0; e < kc; e += 256) {
        const uint8_t *b = row + (k0 + e) / 256 * ts;
        kscale ks;
        prep_k(ti, b, 1.0f, &ks);
        if (IS_X(ti)) {   /* u - X_OFF, scales per 16 */
            const uint8_t *xb = row + TINFO[ti].hdr + (k0 + e) / 256 * ts;
            float S[16] __attribute__((aligned(64)));
            __m512 Sv, Mv;
            x_scales16(ti, xb, X_HDR(ti) ? x_rowscale(ti, row) : 1.0f, &Sv, &Mv);
            _mm512_store_ps(S, Sv);
            for (int i = 0; i < 16; i++) ws[(e / 16 + i) * 32] = S[i];
            const int ex = x_extra16v(ti, xb);
            for (int c = 0; c < 4; c++)
                _mm512_storeu_si512(A + e + 64 * c, _mm512_sub_epi8(x_u64(ti, xb, c, ex), _mm512_set1_epi8((char)X_OFF(ti))));
            continue;
        }
        if (ti == I_Q6_K) {
            const __m512i m4 = _mm512_set1_epi8(0x0F), o32 = _mm512_set1_epi8(32);
            for (int i = 0; i < 16; i++) ws[(e / 16 + i) * 32] = ks.s[i];
            for (int n = 0; n < 2; n++)
                for (int c = 0; c < 2; c++) {
                    const __m512i mh = _mm512_set_epi64(GF_2BITS(4 * c + 2), GF_2BITS(4 * c + 2), GF_2BITS(4 * c + 2),
                        GF_2BITS(4 * c + 2), GF_2BITS(4 * c), GF_2BITS(4 * c), GF_2BITS(4 * c), GF_2BITS(4 * c));
                    __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * n));
                    ql = _mm512_and_si512(c ? _mm512_srli_epi16(ql, 4) : ql, m4);
                    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n)));
                    _mm512_storeu_si512(A + e + 128 * n + 64 * c,
                                        _mm512_sub_epi8(_mm512_or_si512(ql, _mm512_gf2p8affine_epi64_epi8(qh, mh, 0)), o32));
                }
            continue;
        }
        const int64_t j0 = (k0 + e) / 32;
        for (int j = 0; j < 8; j++) {
            ws[(e / 32 + j) * 32] = ks.s[j];
            wm[(j0 + j) * 32] = ks.m[j];
        }
        const __m512i mqk = _mm512_set_epi64(GF_HI, GF_HI, GF_HI, GF_HI, GF_LO, GF_LO, GF_LO, GF_LO);
        for (int c = 0; c < 4; c++) {
            __m512i qq = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + (ti == I_Q5_K ? 48 : 16) + 32 * c)));
            qq = _mm512_gf2p8affine_epi64_epi8(qq, mqk, 0);
            if (ti == I_Q5_K) {
                const __m512i mh = _mm512_set_epi64(GF_BIT(2 * c + 1), GF_BIT(2 * c + 1), GF_BIT(2 * c + 1),
                    GF_BIT(2 * c + 1), GF_BIT(2 * c), GF_BIT(2 * c), GF_BIT(2 * c), GF_BIT(2 * c));
                qq = _mm512_or_si512(qq, _mm512_gf2p8affine_epi64_epi8(
                    _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16))), mh, 0));
            }
            _mm512_storeu_si512(A + e + 64 * c, qq);
        }
    }
#else
    (void)ti; (void)row; (void)k0; (void)kc; (void)A; (void)ws; (void)wm;
#endif
}

#if HM_AMX8
/* block b's tile products into tiles c1, c2 (0, 1 or 5, 6); one activation term: c1 only */
#define A8_PRODUCTS(c1, c2) do { \
        _tile_zero(c1); \
        _tile_loadd(2, A + len * b, A8_LDA); \
        _tile_loadd(3, B1 + len * 16 * ba, 64); \
        if (two) { _tile_zero(c2); _tile_loadd(4, B2 + len * 16 * ba, 64); } \
        if (us) { _tile_dpbusd(c1, 2, 3); if (two) _tile_dpbusd(c2, 2, 4); } \
        else { _tile_dpbssd(c1, 2, 3); if (two) _tile_dpbssd(c2, 2, 4); } \
    } while (0)

/* c[16 rows][16 tokens] (+)= the canonical chain of 16 unpacked weight rows (A, A8_LDA apart; scales ws, 32
 * apart per block) and token block tb over the pass's blocks: elements [k0, k0 + kc) of K. Software-pipelined:
 * block b's products run (tiles 0, 1 or 5, 6 in turn) while block b - 1's sums are stored and go into the
 * float chain; a block's loads, products and store otherwise wait on each other in turn. (Double-buffering
 * the operand tiles instead, the sums single: 10% slower in the model, 2026-11-25.) */
static void a8_chain(int ti, const int8_t *A, const float *ws, const uint8_t *tb, int64_t K, int64_t k0, int64_t kc,
                     float *c, int acc_in, pfq *pq, int64_t per) {
    const int q6 = SB16(ti), us = ti == I_Q4_K || ti == I_Q5_K;
    const int two = g_xterms > 1;                          /* one term: q2 = 0, its tiles skipped */
    const int8_t *B1 = (const int8_t *)tb, *B2 = B1 + 16 * K;
    const float *xs = (const float *)(tb + 32 * K);
    int32_t cb[2][16][16] __attribute__((aligned(64)));
    __m512 acc[16];
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) acc[m] = acc_in ? _mm512_loadu_ps(c + 16 * m) : _mm512_setzero_ps();
    const int64_t len = q6 ? 16 : 32, nbk = kc / len;
    for (int64_t b = 0; b <= nbk; b++) {
        if (b < nbk) {
            const int64_t ba = k0 / len + b;               /* block (sub-block) index within K */
            if (b & 1) A8_PRODUCTS(5, 6);
            else A8_PRODUCTS(0, 1);
        }
        if (b == 0) continue;
        const int64_t bp = b - 1, bpa = k0 / len + bp;     /* the previous block: store, then its float chain */
        if (bp & 1) { _tile_stored(5, cb[0], 64); if (two) _tile_stored(6, cb[1], 64); }
        else { _tile_stored(0, cb[0], 64); if (two) _tile_stored(1, cb[1], 64); }
        pfq_run(pq, per);
        const __m512 xv = _mm512_loadu_ps(xs + 16 * (q6 ? bpa / 2 : bpa));
        const float *wb = ws + bp * 32;
        if (two) {
#pragma GCC unroll 16
            for (int m = 0; m < 16; m++) {
                const __m512i i = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cb[0][m]), 8),
                                                   _mm512_load_si512(cb[1][m]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(_mm512_set1_ps(wb[m]), xv), acc[m]);
            }
        } else {
#pragma GCC unroll 16
            for (int m = 0; m < 16; m++) {
                const __m512i i = _mm512_slli_epi32(_mm512_load_si512(cb[0][m]), 8);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(_mm512_set1_ps(wb[m]), xv), acc[m]);
            }
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) _mm512_storeu_ps(c + 16 * m, acc[m]);
}
#undef A8_PRODUCTS
#endif

/* One int8 tile step: C[j][g] ([16 rows][16 tokens] floats, g = 0: the 16 rows at w0, 1: at w1) = the
 * canonical products of those rows (rb bytes each, K long) with token blocks j < nb (tbs bytes apart).
 * Passes of TILE_KC (scratch A: 32 x A8_LDA bytes, ws: 32 x TILE_KC/16 floats, wm: 32 x K/32 floats). */
static void tile_step_q8(int ti, const uint8_t *w0, const uint8_t *w1, int64_t rb, int64_t K, const uint8_t *tb,
                         int64_t tbs, int nb, int8_t *A, float *ws, float *wm, float *C, pfq *pq) {
#if HM_AMX8
    /* the next step's lines are prefetched while the tiles run, none while this step's rows are unpacked (its
     * own loads from memory then): spread evenly over the chains' blocks (bursts every 8 blocks slowed them) */
    const int64_t calls = (int64_t)nb * 2 * (K / 16) + 1;
    const int64_t per = (pfq_left(pq) + calls - 1) / calls;
    for (int64_t k0 = 0; k0 < K; k0 += TILE_KC) {
        const int64_t kc = K - k0 < TILE_KC ? K - k0 : TILE_KC;
        for (int m = 0; m < 32; m++)
            a8_unpack_row(ti, m < 16 ? w0 + m * rb : w1 + (m - 16) * rb, k0, kc, A + m * A8_LDA, ws + m, wm + m);
        for (int j = 0; j < nb; j++)
            for (int g = 0; g < 2; g++)
                a8_chain(ti, A + g * 16 * A8_LDA, ws + 16 * g, tb + j * tbs, K, k0, kc, C + (j * 2 + g) * 256, k0 > 0,
                         pq, per);
    }
    if (ti == I_Q4_K || ti == I_Q5_K)                     /* the mins' chain, then acc - accm */
        for (int j = 0; j < nb; j++) {
            const float *sx = (const float *)(tb + j * tbs + 32 * K) + K / 32 * 16;
            for (int g = 0; g < 2; g++) {
                __m512 am[16];
                for (int m = 0; m < 16; m++) am[m] = _mm512_setzero_ps();
                for (int64_t b = 0; b < K / 32; b++) {
                    const __m512 sv = _mm512_loadu_ps(sx + 16 * b);
#pragma GCC unroll 16
                    for (int m = 0; m < 16; m++) am[m] = _mm512_fmadd_ps(_mm512_set1_ps(wm[b * 32 + 16 * g + m]), sv, am[m]);
                }
                float *c = C + (j * 2 + g) * 256;
                for (int m = 0; m < 16; m++) _mm512_storeu_ps(c + 16 * m, _mm512_sub_ps(_mm512_loadu_ps(c + 16 * m), am[m]));
            }
        }
    pfq_run(pq, pfq_left(pq));
#else
    (void)ti; (void)w0; (void)w1; (void)rb; (void)K; (void)tb; (void)tbs; (void)nb; (void)A; (void)ws; (void)wm;
    (void)C; (void)pq;
#endif
}

/* per-thread scratch of tile_step_q8 for rows of K: A, ws, wm, C for nbmax token blocks, and quant_x8's */
static size_t a8_scratch(int64_t K, int64_t nbmax) {
    return ((size_t)32 * A8_LDA + (size_t)32 * (TILE_KC / 16) * 4 + (size_t)32 * (K / 32) * 4 +
            (size_t)nbmax * 2048 + xq8_bytes(K) + 5 * 64 + 63) & ~(size_t)63;
}

typedef struct { int8_t *A; float *ws, *wm, *C; void *xq; } a8_bufs;

static a8_bufs a8_layout(char *p, int64_t K, int64_t nbmax) {
    a8_bufs b;
    uintptr_t q = ((uintptr_t)p + 63) & ~(uintptr_t)63;
    b.A = (int8_t *)q; q += (size_t)32 * A8_LDA;
    b.ws = (float *)q; q += (size_t)32 * (TILE_KC / 16) * 4;
    q = (q + 63) & ~(uintptr_t)63;
    b.wm = (float *)q; q += (size_t)32 * (K / 32) * 4;
    q = (q + 63) & ~(uintptr_t)63;
    b.C = (float *)q; q += (size_t)nbmax * 2048;
    b.xq = (void *)((q + 63) & ~(uintptr_t)63);
    return b;
}

/* whether rows of this type and length are computed alike for any number of tokens (the large-batch paths
 * must not take the bf16 tiles for them): float weights (fp32 products everywhere), and the integer path's
 * types where its canonical kernels run */
static int canon_type(int ti, int64_t K) {
    return ti < I_Q4_0 ? g_exact : QC_MULTI && (INT8_MASK >> ti & 1) && q8_type(ti, K);
}

/* whether the int8 tiles take rows of this type and length now: AMX-INT8 in use, the type on the integer
 * path (the canonical products) */
static int tile_q8(int mode, int ti, int64_t K) {
#if HM_AMX8
    return mode == TILE_AMX && QC_MULTI && (INT8_MASK >> ti & 1) && q8_type(ti, K) && !X_MIN(ti);
#else
    (void)mode; (void)ti; (void)K;
    return 0;
#endif
}

#ifndef TILE_S1_STEPS
#define TILE_S1_STEPS 8   /* 16-row steps of F a stage-1 unit covers: its token blocks are fetched once */
#endif
#ifndef TILE_S2_ROWS
#define TILE_S2_ROWS 32   /* rows of H a stage-2 unit covers (a multiple of 32): with 64, the last units
                             * left threads idle for 1.9-2.4 ms of a 16-18 ms call (T=512, 16 threads) */
#endif
#if HM_AMX8
/* hm_tile_mm on the int8 tiles (tile_q8): x quantized per token, packed into token blocks, 32-row units
 * claimed one ahead; each (row, token) written once, as the streaming kernel writes it. */
static int tile_mm_q8(const float *x, int64_t T, int64_t K, const uint8_t *w, int wi, int64_t N, float *out, int nth) {
    const int64_t rb = row_bytes(wi, K), NB = (T + 15) / 16, tbs = tb_bytes(K), NU = N / 32;
    /* token blocks in groups of at most 1 MiB, so a group stays in L2 while every 32-row unit passes over it
     * (all of T=512's blocks at K=2048, 2.3 MB, came from L3 for each unit: 120 against 50 cycles a block) */
    const int64_t TG = tbs * NB <= (1 << 20) ? NB : ((1 << 20) / tbs > 1 ? (1 << 20) / tbs : 1);
    const int64_t NG = (NB + TG - 1) / TG, NW = NG * NU;
    const size_t scratch = a8_scratch(K, TG);
    char *ws = workspace((size_t)NB * tbs + qrows_bytes(T, K) + (size_t)T * 4 + 64 * 4 + (size_t)nth * scratch);
    if (!ws) return -2;
    uint8_t *xb = (uint8_t *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);           /* [NB] token blocks */
    char *qm = (char *)(xb + NB * tbs);
    qrows xr;
    qrows_init(&xr, qm, T, K);
    int32_t *tok = (int32_t *)(qm + qrows_bytes(T, K));                          /* [T] 0.. */
    char *scr = (char *)(((uintptr_t)(tok + T) + 63) & ~(uintptr_t)63);
    int64_t ctr = 0;
#pragma omp parallel num_threads(nth)
    {
        const int tid = omp_get_thread_num();
        const a8_bufs bf = a8_layout(scr + (size_t)tid * scratch, K, TG);
        amx8_config(SB16(wi));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            qrows_quant(&xr, t, x + t * K, bf.xq);
            tok[t] = (int32_t)t;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < NB; b++)
            pack_tb(xb + b * tbs, &xr, tok + b * 16, T - b * 16 < 16 ? (int)(T - b * 16) : 16);
        int64_t u = claim(&ctr), un = claim(&ctr);             /* work item: (token group u / NU, unit u % NU) */
        if (u < NW) {
            pfq q = pfq_of(w + u % NU * 32 * rb, 32 * rb, NULL, 0, NULL, 0);
            pfq_run(&q, pfq_left(&q));
        }
        for (; u < NW; u = un, un = claim(&ctr)) {
            const int64_t r0 = u % NU * 32, j0 = u / NU * TG, nj = NB - j0 < TG ? NB - j0 : TG;
            pfq q = pfq_of(un < NW ? w + un % NU * 32 * rb : NULL, un < NW ? 32 * rb : 0, NULL, 0, NULL, 0);
            tile_step_q8(wi, w + r0 * rb, w + (r0 + 16) * rb, rb, K, xb + j0 * tbs, tbs, (int)nj, bf.A, bf.ws, bf.wm,
                         bf.C, &q);
            for (int64_t j = 0; j < nj; j++)
                for (int n = 0; n < 16 && (j0 + j) * 16 + n < T; n++) {
                    float *o = out + ((j0 + j) * 16 + n) * N + r0;
                    const float *c = bf.C + j * 512 + n;
                    for (int m = 0; m < 32; m++) o[m] = c[(m >> 4) * 256 + (m & 15) * 16];
                }
        }
        _tile_release();
    }
    return 0;
}

/* moe_tile_act on the int8 tiles (both types on tile_q8): stage 0 quantizes x per token and packs each
 * expert's token blocks; stage 1 computes gate and up (int8 tiles), h = act(g, u) in float32 per pair; stage
 * 1b quantizes each pair's h and packs the h blocks; stage 2 as the bf16 kernel's (down rows, out += w y in
 * ascending expert order). Every (row, token) value is the streaming kernel's, bit for bit. */
static int moe_tile_q8(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *wts, int64_t k,
                       const uint8_t *gate, const uint8_t *up, int gi, int64_t F, int64_t E, const uint8_t *down,
                       int di, float *out, int nth, const moe_act *A) {
    const int64_t P = T * k, rbg = row_bytes(gi, H), rbd = row_bytes(di, F);
    const int64_t nb_cap = P / 16 + (E < P ? E : P), nbmax_cap = (P + 15) / 16;
    const int64_t tbx = tb_bytes(H), tbh = tb_bytes(F), KM = H > F ? H : F;
    const size_t scratch = a8_scratch(KM, nbmax_cap);
    const size_t need = 64 * 6 + (size_t)E * 4 * 2 + (size_t)(E + 1) * 8 * 3 + (size_t)P * 8 + (size_t)P * F * 4 +
                        (size_t)nb_cap * (tbx + tbh) + qrows_bytes(T, H) + qrows_bytes(P, F) + (size_t)P * 4 +
                        (size_t)nth * scratch;
    char *wsp = workspace(need);
    if (!wsp) return -2;
    int32_t *slot = (int32_t *)wsp;
    int32_t *act = slot + E;
    int64_t *off = (int64_t *)(((uintptr_t)(act + E) + 63) & ~(uintptr_t)63);
    int64_t *boff = off + E + 1;
    int64_t *pos = boff + E + 1;
    int32_t *ptok = (int32_t *)(pos + E + 1);
    float *pw = (float *)(ptok + P);
    int32_t *pidx = (int32_t *)(pw + P);                                     /* [P] 0.. (the pairs' h rows) */
    float *h = (float *)(((uintptr_t)(pidx + P) + 63) & ~(uintptr_t)63);     /* [P, F] float32 */
    uint8_t *xb = (uint8_t *)(((uintptr_t)(h + P * F) + 63) & ~(uintptr_t)63);
    uint8_t *hb = xb + nb_cap * tbx;
    char *xq = (char *)(hb + nb_cap * tbh);
    qrows xr, hr;
    qrows_init(&xr, xq, T, H);
    qrows_init(&hr, xq + qrows_bytes(T, H), P, F);
    char *scr = (char *)(((uintptr_t)(xq + qrows_bytes(T, H) + qrows_bytes(P, F)) + 63) & ~(uintptr_t)63);
    const int na = route_pairs(ids, wts, P, k, E, slot, act, off, pos, ptok, pw);
    int64_t NB = 0;
    boff[0] = 0;
    for (int a = 0; a < na; a++) boff[a + 1] = NB += (off[a + 1] - off[a] + 15) / 16;
    const int64_t fu = F / 16, fgn = (fu + TILE_S1_STEPS - 1) / TILE_S1_STEPS;
    const int64_t NU = (int64_t)na * fgn, NV = (H + TILE_S2_ROWS - 1) / TILE_S2_ROWS;
    int64_t ctr1 = 0, ctr2 = 0;
#pragma omp parallel num_threads(nth)
    {
        const int tid = omp_get_thread_num();
        const a8_bufs bf = a8_layout(scr + (size_t)tid * scratch, KM, nbmax_cap);
        /* ---- stage 0: x quantized per token; each expert's token blocks */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) qrows_quant(&xr, t, x + t * H, bf.xq);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) pidx[p] = (int32_t)p;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < NB; b++) {
            int a = 0;
            while (boff[a + 1] <= b) a++;
            const int64_t i0 = off[a] + (b - boff[a]) * 16, cn = off[a + 1] - i0;
            pack_tb(xb + b * tbx, &xr, ptok + i0, cn < 16 ? (int)cn : 16);
        }
        /* ---- stage 1: units (expert, TILE_S1_STEPS x 16 rows of F), claimed one ahead (as moe_tile_act) */
        amx8_config(SB16(gi));
        {
            int64_t u = claim(&ctr1), un = claim(&ctr1);
            if (u < NU) {
                const int64_t e = act[u / fgn], f0 = (u % fgn) * 16 * TILE_S1_STEPS;
                pfq q = pfq_of(gate + (e * F + f0) * rbg, 16 * rbg, up + (e * F + f0) * rbg, 16 * rbg, NULL, 0);
                pfq_run(&q, pfq_left(&q));
            }
            for (; u < NU; u = un, un = claim(&ctr1)) {
                const int a = (int)(u / fgn), an = un < NU ? (int)(un / fgn) : -1;
                const int64_t e = act[a], nb = boff[a + 1] - boff[a], cn = off[a + 1] - off[a];
                const int64_t fb0 = (u % fgn) * TILE_S1_STEPS;
                const int64_t fb1 = fb0 + TILE_S1_STEPS < fu ? fb0 + TILE_S1_STEPS : fu;
                const uint8_t *bn = an >= 0 && an != a ? xb + boff[an] * tbx : NULL;
                const int64_t bbytes = bn ? (boff[an + 1] - boff[an]) * tbx : 0, bslice = bbytes / (fb1 - fb0) + 64;
                for (int64_t fb = fb0; fb < fb1; fb++) {
                    const int64_t f0 = fb * 16;
                    const int64_t ne = fb + 1 < fb1 ? e : an >= 0 ? act[an] : -1;
                    const int64_t nf = fb + 1 < fb1 ? f0 + 16 : (un % fgn) * 16 * TILE_S1_STEPS;
                    const int64_t bo = (fb - fb0) * bslice < bbytes ? (fb - fb0) * bslice : bbytes;
                    pfq q = ne < 0 ? pfq_of(NULL, 0, NULL, 0, NULL, 0) :
                            pfq_of(gate + (ne * F + nf) * rbg, 16 * rbg, up + (ne * F + nf) * rbg, 16 * rbg,
                                   bn ? bn + bo : NULL, bbytes - bo < bslice ? bbytes - bo : bslice);
                    tile_step_q8(gi, gate + (e * F + f0) * rbg, up + (e * F + f0) * rbg, rbg, H, xb + boff[a] * tbx,
                                 tbx, (int)nb, bf.A, bf.ws, bf.wm, bf.C, &q);
                    for (int64_t j = 0; j < nb; j++) {
                        const float *cg = bf.C + j * 512, *cu = cg + 256;
                        const int nn = cn - j * 16 < 16 ? (int)(cn - j * 16) : 16;
                        float *h0 = h + (off[a] + j * 16) * F + f0;
                        if (!A->kind) {                 /* silu(g) u for 16 tokens a row, as silu() lane by lane */
                            for (int m = 0; m < 16; m++) {
                                const __m512 g = _mm512_loadu_ps(cg + m * 16), u = _mm512_loadu_ps(cu + m * 16);
                                const __m512 sg = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                                 exp_vec16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                                float hv[16] __attribute__((aligned(64)));
                                _mm512_store_ps(hv, _mm512_mul_ps(sg, u));
                                for (int n = 0; n < nn; n++) h0[n * F + m] = hv[n];
                            }
                        } else {
                            for (int n = 0; n < nn; n++)
                                for (int m = 0; m < 16; m++)
                                    h0[n * F + m] = act_h(A, cg[m * 16 + n], cu[m * 16 + n], e, F, f0 + m);
                        }
                    }
                }
            }
        }
#pragma omp barrier
        /* ---- stage 1b: each pair's h quantized (as the streaming kernel quantizes it), the h blocks packed */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < off[na]; p++) qrows_quant(&hr, p, h + p * F, bf.xq);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < NB; b++) {
            int a = 0;
            while (boff[a + 1] <= b) a++;
            const int64_t i0 = off[a] + (b - boff[a]) * 16, cn = off[a + 1] - i0;
            pack_tb(hb + b * tbh, &hr, pidx + i0, cn < 16 ? (int)cn : 16);
        }
        /* ---- stage 2: units of TILE_S2_ROWS rows of H, every active expert in ascending order */
        amx8_config(SB16(di));
        {
            int64_t v = claim(&ctr2), vn = claim(&ctr2);
            if (v < NV && na > 0) {
                pfq q = pfq_of(down + ((int64_t)act[0] * H + v * TILE_S2_ROWS) * rbd, 32 * rbd, NULL, 0, NULL, 0);
                pfq_run(&q, pfq_left(&q));
            }
            for (; v < NV; v = vn, vn = claim(&ctr2)) {
                const int64_t h0 = v * TILE_S2_ROWS, hn = H - h0 < TILE_S2_ROWS ? H - h0 : TILE_S2_ROWS;
                for (int64_t t = 0; t < T; t++) memset(out + t * H + h0, 0, (size_t)hn * 4);
                for (int a = 0; a < na; a++) {
                    const int64_t e = act[a], nb = boff[a + 1] - boff[a], cn = off[a + 1] - off[a];
                    for (int64_t r0 = h0; r0 < h0 + hn; r0 += 32) {
                        const int an = r0 + 32 < h0 + hn ? -1 : a + 1 < na ? a + 1 : vn < NV ? 0 : -1;
                        const uint8_t *nx = r0 + 32 < h0 + hn ? down + (e * H + r0 + 32) * rbd :
                                            an < 0 ? NULL :
                                            down + ((int64_t)act[an] * H + (an ? h0 : vn * TILE_S2_ROWS)) * rbd;
                        pfq q = pfq_of(nx, 32 * rbd, an < 0 ? NULL : hb + boff[an] * tbh,
                                       an < 0 ? 0 : (boff[an + 1] - boff[an]) * tbh, NULL, 0);
                        tile_step_q8(di, down + (e * H + r0) * rbd, down + (e * H + r0 + 16) * rbd, rbd, F,
                                     hb + boff[a] * tbh, tbh, (int)nb, bf.A, bf.ws, bf.wm, bf.C, &q);
                        for (int64_t j = 0; j < nb; j++) {
                            const int64_t p0 = off[a] + j * 16;
                            add_block_rows(out, H, r0, bf.C + j * 512, ptok + p0, pw + p0,
                                           cn - j * 16 < 16 ? (int)(cn - j * 16) : 16, A->bd ? A->bd + e * H + r0 : NULL);
                        }
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}
#endif

static int moe_tile_act(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *wts,
                        int64_t k, const uint8_t *gate, const uint8_t *up, int gtype, int64_t F, int64_t E,
                        const uint8_t *down, int dtype, float *out, int nthreads, const moe_act *A) {
    const int gi = type_index(gtype), di = type_index(dtype);
    if (!moe_args_ok(gi, di, T, H, F, k, ids, E)) return -1;
    if (g_tile < 0) g_tile = tile_best();
    const int mode = g_tile;
    const int64_t P = T * k, rbg = row_bytes(gi, H), rbd = row_bytes(di, F);
    const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
    if (T == 0) return 0;
#if HM_AMX8
    if (tile_q8(mode, gi, H) && tile_q8(mode, di, F))
        return moe_tile_q8(x, T, H, ids, wts, k, gate, up, gi, F, E, down, di, out, nth, A);
#endif
    if (canon_type(gi, H) || canon_type(di, F))  /* the canonical products: the streaming kernel's */
        return moe_ffn_act(x, T, H, ids, wts, k, gate, up, gtype, F, E, down, dtype, out, nthreads, A);
    /* token blocks: at most P / 16 + one partial block per active expert; an expert has at most P pairs */
    const int64_t nb_cap = P / 16 + (E < P ? E : P), nbmax_cap = (P + 15) / 16;
    const size_t scratch = ((size_t)32 * TILE_LDA * 2 + (size_t)nbmax_cap * 2048 + 63) & ~(size_t)63;
    const size_t need = 64 * 4 + (size_t)E * 4 * 2 + (size_t)(E + 1) * 8 * 3 + (size_t)P * 8 +
                        (size_t)nb_cap * 16 * (H + F) * 2 + (size_t)T * H * 2 + 64 + (size_t)nth * scratch;
    char *ws = workspace(need);
    if (!ws) return -2;
    int32_t *slot = (int32_t *)ws;                                  /* [E] expert -> active index */
    int32_t *act = slot + E;                                        /* [E] active experts, ascending */
    int64_t *off = (int64_t *)(((uintptr_t)(act + E) + 63) & ~(uintptr_t)63);  /* [E+1] pair offsets */
    int64_t *boff = off + E + 1;                                    /* [E+1] token-block offsets */
    int64_t *pos = boff + E + 1;                                    /* [E+1] scratch */
    int32_t *ptok = (int32_t *)(pos + E + 1);                       /* [P] token of sorted pair */
    float *pw = (float *)(ptok + P);                                /* [P] its router weight */
    uint32_t *xb = (uint32_t *)(((uintptr_t)(pw + P) + 63) & ~(uintptr_t)63);   /* [NB][H/2][16] */
    uint32_t *hb = xb + nb_cap * 16 * (H / 2);                      /* [NB][F/2][16] */
    uint32_t *xp = hb + nb_cap * 16 * (F / 2);                      /* [T][H/2]: x as bf16 pairs */
    char *scr = (char *)(((uintptr_t)(xp + T * (H / 2)) + 63) & ~(uintptr_t)63);   /* [nth][scratch] */
    const int na = route_pairs(ids, wts, P, k, E, slot, act, off, pos, ptok, pw);
    int64_t NB = 0;
    boff[0] = 0;
    for (int a = 0; a < na; a++) boff[a + 1] = NB += (off[a + 1] - off[a] + 15) / 16;
    const int64_t fu = F / 16, fgn = (fu + TILE_S1_STEPS - 1) / TILE_S1_STEPS, xs = 16 * (H / 2), hs = 16 * (F / 2);
    const int64_t NU = (int64_t)na * fgn, NV = (H + TILE_S2_ROWS - 1) / TILE_S2_ROWS;
    int64_t ctr1 = 0, ctr2 = 0;   /* units claimed so far, stage 1 and stage 2 */

#pragma omp parallel num_threads(nth)
    {
        const int tid = omp_get_thread_num();
        uint16_t *Aw = (uint16_t *)(scr + (size_t)tid * scratch);   /* 32 bf16 rows of a pass */
        float *C = (float *)(Aw + 32 * TILE_LDA);                   /* [nbmax][2][16][16] */
#if HM_AMX
        if (mode == TILE_AMX) amx_config();
#endif
        /* ---- stage 0: x to bf16 pairs once, then the token blocks (each token is in k of them) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) bf16_pairs(xp + t * (H / 2), x + t * H, H);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < NB; b++) {
            int a = 0;
            while (boff[a + 1] <= b) a++;
            const int64_t i0 = off[a] + (b - boff[a]) * 16, cn = off[a + 1] - i0;
            pack_tokens(xb + b * xs, xp, ptok + i0, cn < 16 ? (int)cn : 16, H / 2);
        }
        /* ---- stage 1: units (expert, 16 TILE_S1_STEPS rows of F), 16 rows a step: the expert's token
         * blocks stay in this core's cache across the unit. Units are claimed one ahead, so each step
         * prefetches the next one's rows, into the next unit too, and a slice of the next unit's blocks. */
        {
            int64_t u = claim(&ctr1), un = claim(&ctr1);
            if (u < NU) {
                const int64_t e = act[u / fgn], f0 = (u % fgn) * 16 * TILE_S1_STEPS;
                pfq q = pfq_of(gate + (e * F + f0) * rbg, 16 * rbg, up + (e * F + f0) * rbg, 16 * rbg, NULL, 0);
                pfq_run(&q, pfq_left(&q));                               /* the thread's first step */
            }
            for (; u < NU; u = un, un = claim(&ctr1)) {
                const int a = (int)(u / fgn), an = un < NU ? (int)(un / fgn) : -1;
                const int64_t e = act[a], nb = boff[a + 1] - boff[a], cn = off[a + 1] - off[a];
                const int64_t fb0 = (u % fgn) * TILE_S1_STEPS;
                const int64_t fb1 = fb0 + TILE_S1_STEPS < fu ? fb0 + TILE_S1_STEPS : fu;
                /* the next unit's token blocks, if another expert's: a slice per step */
                const uint8_t *bn = an >= 0 && an != a ? (const uint8_t *)(xb + boff[an] * xs) : NULL;
                const int64_t bbytes = bn ? (boff[an + 1] - boff[an]) * xs * 4 : 0, bslice = bbytes / (fb1 - fb0) + 64;
                for (int64_t fb = fb0; fb < fb1; fb++) {
                    const int64_t f0 = fb * 16;
                    const int64_t ne = fb + 1 < fb1 ? e : an >= 0 ? act[an] : -1;
                    const int64_t nf = fb + 1 < fb1 ? f0 + 16 : (un % fgn) * 16 * TILE_S1_STEPS;
                    const int64_t bo = (fb - fb0) * bslice < bbytes ? (fb - fb0) * bslice : bbytes;
                    pfq q = ne < 0 ? pfq_of(NULL, 0, NULL, 0, NULL, 0) :
                            pfq_of(gate + (ne * F + nf) * rbg, 16 * rbg, up + (ne * F + nf) * rbg, 16 * rbg,
                                   bn ? bn + bo : NULL, bbytes - bo < bslice ? bbytes - bo : bslice);
                    tile_step(mode, gi, gate + (e * F + f0) * rbg, up + (e * F + f0) * rbg, rbg, H,
                              xb + boff[a] * xs, xs, (int)nb, Aw, C, &q);
                    for (int64_t j = 0; j < nb; j++) {
                        uint16_t *hd = (uint16_t *)(hb + (boff[a] + j) * hs);
                        const float *cg = C + j * 512, *cu = cg + 256;
                        for (int m = 0; m < 16; m++) {
                            const int64_t f = f0 + m;
                            uint16_t *hrow = hd + (f / 2) * 32 + (f & 1);
                            float hv[16];
                            if (!A->kind) {
                                for (int n = 0; n < 16; n++) {        /* branch-free: vectorizes */
                                    const float g = cg[m * 16 + n];
                                    hv[n] = g / (1.0f + exp_vec(-g)) * cu[m * 16 + n];
                                }
                            } else {
                                for (int n = 0; n < 16; n++) hv[n] = act_h(A, cg[m * 16 + n], cu[m * 16 + n], e, F, f);
                            }
                            for (int n = 0; n < 16; n++) hrow[2 * n] = j * 16 + n < cn ? bf16_rne(hv[n]) : 0;
                        }
                    }
                }
            }
        }
#pragma omp barrier
        /* ---- stage 2: units of 64 rows of H, 32 a step, all experts (an expert's h blocks serve both
         * halves); claimed one ahead like stage 1 */
        {
            int64_t v = claim(&ctr2), vn = claim(&ctr2);
            if (v < NV && na > 0) {
                pfq q = pfq_of(down + ((int64_t)act[0] * H + v * TILE_S2_ROWS) * rbd, 32 * rbd, NULL, 0, NULL, 0);
                pfq_run(&q, pfq_left(&q));
            }
            for (; v < NV; v = vn, vn = claim(&ctr2)) {
                const int64_t h0 = v * TILE_S2_ROWS, hn = H - h0 < TILE_S2_ROWS ? H - h0 : TILE_S2_ROWS;
                for (int64_t t = 0; t < T; t++) memset(out + t * H + h0, 0, (size_t)hn * 4);
                for (int a = 0; a < na; a++) {
                    const int64_t e = act[a], nb = boff[a + 1] - boff[a], cn = off[a + 1] - off[a];
                    for (int64_t r0 = h0; r0 < h0 + hn; r0 += 32) {
                        /* the next step: these rows' next 32, else the next expert's (its h blocks too) */
                        const int an = r0 + 32 < h0 + hn ? -1 : a + 1 < na ? a + 1 : vn < NV ? 0 : -1;
                        const uint8_t *nx = r0 + 32 < h0 + hn ? down + (e * H + r0 + 32) * rbd :
                                            an < 0 ? NULL :
                                            down + ((int64_t)act[an] * H + (an ? h0 : vn * TILE_S2_ROWS)) * rbd;
                        pfq q = pfq_of(nx, 32 * rbd, an < 0 ? NULL : (const uint8_t *)(hb + boff[an] * hs),
                                       an < 0 ? 0 : (boff[an + 1] - boff[an]) * hs * 4, NULL, 0);
                        tile_step(mode, di, down + (e * H + r0) * rbd, down + (e * H + r0 + 16) * rbd, rbd, F,
                                  hb + boff[a] * hs, hs, (int)nb, Aw, C, &q);
                        for (int64_t j = 0; j < nb; j++) {
                            const int64_t p0 = off[a] + j * 16;
                            add_block_rows(out, H, r0, C + j * 512, ptok + p0, pw + p0,
                                           cn - j * 16 < 16 ? (int)(cn - j * 16) : 16, A->bd ? A->bd + e * H + r0 : NULL);
                        }
                    }
                }
            }
        }
#if HM_AMX
        if (mode == TILE_AMX) _tile_release();
#endif
    }
    return 0;
}

/* out[T, N] = x[T, K] @ W[N, K]^T, W as GGUF rows, for many tokens with the grouped tile products (AMX or
 * AVX512-BF16): 32 rows of W at a time are dequantized into cache and multiplied with every 16-token block,
 * so the bf16 weights never go through memory (dequantize + torch.mm writes them out and reads them back).
 * Threads claim 32-row units one ahead, prefetching the next. N % 32 == 0. */
int hm_tile_mm(const float *x, int64_t T, int64_t K, const uint8_t *w, int wtype, int64_t N, float *out,
               int nthreads) {
    const int wi = type_index(wtype);
    if (wi < 0 || K % 32 || K % TINFO[wi].qk || N % 32 || T < 1) return -1;
    if (g_tile < 0) g_tile = tile_best();
    const int mode = g_tile;
#if HM_AMX8
    if (tile_q8(mode, wi, K)) return tile_mm_q8(x, T, K, w, wi, N, out, nthreads > 0 ? nthreads : omp_get_max_threads());
#endif
    if (canon_type(wi, K)) return hm_qmatmul(x, T, K, w, wtype, N, out, nthreads);   /* the canonical products */
    const int64_t rb = row_bytes(wi, K), NB = (T + 15) / 16, xs = 16 * (K / 2), NU = N / 32;
    const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
    const size_t scratch = ((size_t)32 * TILE_LDA * 2 + (size_t)NB * 2048 + 63) & ~(size_t)63;
    char *ws = workspace((size_t)NB * xs * 4 + (size_t)T * (K / 2) * 4 + (size_t)T * 8 + 64 * 3 +
                         (size_t)nth * scratch);
    if (!ws) return -2;
    uint32_t *xb = (uint32_t *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);      /* [NB][K/2][16] token blocks */
    uint32_t *xp = xb + NB * xs;                                               /* [T][K/2] x as bf16 pairs */
    int32_t *tok = (int32_t *)(xp + T * (K / 2));                              /* [T] 0.. */
    float *one = (float *)(tok + T);                                           /* [T] 1.0 */
    char *scr = (char *)(((uintptr_t)(one + T) + 63) & ~(uintptr_t)63);        /* [nth][scratch] */
    int64_t ctr = 0;
#pragma omp parallel num_threads(nth)
    {
        const int tid = omp_get_thread_num();
        uint16_t *Aw = (uint16_t *)(scr + (size_t)tid * scratch);
        float *C = (float *)(Aw + 32 * TILE_LDA);
#if HM_AMX
        if (mode == TILE_AMX) amx_config();
#endif
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            bf16_pairs(xp + t * (K / 2), x + t * K, K);
            tok[t] = (int32_t)t;
            one[t] = 1.0f;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < NB; b++)
            pack_tokens(xb + b * xs, xp, tok + b * 16, T - b * 16 < 16 ? (int)(T - b * 16) : 16, K / 2);
        int64_t u = claim(&ctr), un = claim(&ctr);
        if (u < NU) {
            pfq q = pfq_of(w + u * 32 * rb, 32 * rb, NULL, 0, NULL, 0);
            pfq_run(&q, pfq_left(&q));
        }
        for (; u < NU; u = un, un = claim(&ctr)) {
            const int64_t r0 = u * 32;
            pfq q = pfq_of(un < NU ? w + un * 32 * rb : NULL, un < NU ? 32 * rb : 0, NULL, 0, NULL, 0);
            tile_step(mode, wi, w + r0 * rb, w + (r0 + 16) * rb, rb, K, xb, xs, (int)NB, Aw, C, &q);
            for (int64_t t = 0; t < T; t++) memset(out + t * N + r0, 0, 32 * sizeof(float));
            for (int64_t j = 0; j < NB; j++)
                add_block_rows(out, N, r0, C + j * 512, tok + j * 16, one + j * 16,
                               T - j * 16 < 16 ? (int)(T - j * 16) : 16, NULL);
        }
#if HM_AMX
        if (mode == TILE_AMX) _tile_release();
#endif
    }
    return 0;
}

int hm_moe_ffn(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *wts,
               int64_t k, const uint8_t *gate, const uint8_t *up, int gtype, int64_t F, int64_t E,
               const uint8_t *down, int dtype, float *out, int nthreads) {
    return moe_ffn_act(x, T, H, ids, wts, k, gate, up, gtype, F, E, down, dtype, out, nthreads, &ACT_SILU);
}

/* Decode hand-off with a GPU through pinned host memory, no CUDA call on either side: wait until the GPU
 * has written one token's [x (H) | router weights (k) | expert ids as floats (k)] to `packed` and then
 * `step` to *ready (graphs.py: gpu_decode.router_topk(publish=)), run the experts of its first kc slots
 * into out (the GPU runs the other k - kc itself: graphs.py's decode share), then set *done = step (the
 * GPU's next segment waits for that: gpu_decode.add_rms_norm(wait=)). Returns 0; -1 for an id that is not
 * an expert or bad arguments; -3 when *ready did not reach step within timeout_s. *done is set in every
 * case, so a GPU waiting on it never hangs (the caller raises on an error). */
#ifndef HM_SPIN_S
#define HM_SPIN_S 200e-6   /* hm_moe_handoff spins this long (a GPU segment is ~60 us), then yields the core */
#endif
int hm_moe_handoff(const int32_t *ready, int32_t *done, double timeout_s, const float *packed, int64_t H,
                   int64_t k, int64_t kc, const uint8_t *gate, const uint8_t *up, int gtype, int64_t F, int64_t E,
                   const uint8_t *down, int dtype, float *out, int nthreads, int32_t step) {
    int rc = 0, yield = 0;
    double start = 0;
    for (uint64_t spin = 0; __atomic_load_n(ready, __ATOMIC_ACQUIRE) != step; spin++) {
        if (yield) sched_yield();       /* a long wait: a thread that wants this core (a busy machine) runs */
#if defined(__x86_64__) || defined(__i386__)
        else __builtin_ia32_pause();
#endif
        if ((spin & 255) == 0) {
            const double t = hm_now();
            if (start == 0) start = t;
            else if (t - start > timeout_s) { rc = -3; break; }
            else if (t - start > HM_SPIN_S) yield = 1;
        }
    }
    int32_t ids[64];
    float wts[64];
    if (!rc && (k < 1 || k > 64 || kc < 1 || kc > k)) rc = -1;
    for (int64_t j = 0; !rc && j < k; j++) {
        const float f = packed[H + k + j];
        if (!(f >= 0.0f && f < (float)E)) rc = -1;   /* NaN too */
        ids[j] = rc ? 0 : (int32_t)f;
        wts[j] = packed[H + j];
    }
    if (!rc) rc = moe_ffn_act(packed, 1, H, ids, wts, kc, gate, up, gtype, F, E, down, dtype, out, nthreads, &ACT_SILU);
    __atomic_store_n(done, step, __ATOMIC_RELEASE);
    return rc;
}

int hm_moe_tile(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *wts,
                int64_t k, const uint8_t *gate, const uint8_t *up, int gtype, int64_t F, int64_t E,
                const uint8_t *down, int dtype, float *out, int nthreads) {
    return moe_tile_act(x, T, H, ids, wts, k, gate, up, gtype, F, E, down, dtype, out, nthreads, &ACT_SILU);
}

/* gpt-oss's experts: biases bg, bu [E, F] and bd [E, H] (float32) and the clamped SwiGLU; tile = 1 runs
 * the grouped tile kernel, else the streaming one */
int hm_moe_oai(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *wts,
               int64_t k, const uint8_t *gate, const uint8_t *up, int gtype, int64_t F, int64_t E,
               const uint8_t *down, int dtype, float *out, int nthreads,
               const float *bg, const float *bu, const float *bd, float alpha, float limit, int tile) {
    if (!bg || !bu || !bd) return -1;
    const moe_act A = {1, alpha, limit, bg, bu, bd};
    return (tile ? moe_tile_act : moe_ffn_act)(x, T, H, ids, wts, k, gate, up, gtype, F, E, down, dtype, out,
                                               nthreads, &A);
}

/* the tile-product implementation: 1 = portable C, 2 = AVX512-BF16, 3 = AMX;
 * set: -1 = query, else force (an unavailable mode is refused: returns the current one) */
int hm_tile_mode(int set) {
    if (g_tile < 0) g_tile = tile_best();
    if (set >= TILE_C && set <= tile_best() && (set != TILE_BF16 || HM_DPBF16)) g_tile = set;
    return g_tile;
}

/* ------------------------------------------------------------------ decode step on the CPU
 *
 * hm_decode_step: one token through a whole llama-style decoder (llama, qwen3, qwen3moe: RMSNorm, RoPE,
 * GQA attention over a f32/f16/bf16 KV cache, softmax-routed experts and/or a SwiGLU FFN), every weight in
 * host RAM, in one call from Python (runtime/steps/cpu_decode.py). The eager path spent ~18 ms a token of
 * Qwen3-30B-A3B in Python and small torch ops; here a layer with routed experts is one parallel region
 * (layer_block: q/k/v, attention, output projection, router and experts, one thread doing the norms, RoPE,
 * cache write and routing between barriers) and a few loops over H on the calling thread.
 * Matrix-vector products: threads claim chunks of GV_CHUNK rows (of q, k and v together), each row by the
 * kernels hm_qmatmul uses (the integer path for the types hm_set_int8 names), prefetching ahead into the
 * next chunk as the MoE kernel does. Attention: flash-decoding, (KV head, run of positions) tasks with an
 * online softmax over the query heads of the group, merged per head. */
typedef struct { const uint8_t *w; int64_t rows; int32_t type, pad; } hm_mat;

typedef struct {
    const float *attn_norm, *q_norm, *k_norm, *ffn_norm;   /* q_norm / k_norm NULL: none */
    hm_mat q, k, v, o;
    void *kc, *vc;                                         /* [nkv, slots, D] of kv_type */
    hm_mat router, gate_exps, up_exps, down_exps;          /* router.rows == 0: no routed experts */
    hm_mat gate, up, down;                                 /* SwiGLU FFN (dense or shared expert); gate.rows == 0: none */
} hm_dlayer;

typedef struct {
    int64_t n_layer, H, nh, nkv, D, slots, E, k, n_ff_exp, n_ff;
    int32_t kv_type, neox, norm_topk, nthreads;
    float eps, scale, wscale, pad;
    const float *out_norm;
    hm_mat embd, head;
    const hm_dlayer *layers;
    uint8_t *scratch;                                      /* hm_decode_scratch(m) bytes, 64-aligned */
    int32_t moe_tile_t, mm_tile_t;                         /* prompts: tokens from which the experts and the
                                                            * dense products take the tile kernels (0: never) */
} hm_dmodel;

#ifndef GV_CHUNK
#define GV_CHUNK 32      /* rows a thread claims at a time (a multiple of 4) */
#endif
#define ATT_MAXCH 64     /* position runs per KV head at most */
#define DEC_MAXD 256     /* head size bound (thread-local rows) */

typedef struct { const uint8_t *w; int64_t n, rb; float *out; int ti, q8; } gv_part;

static gv_part gv_mk(const hm_mat *m, int64_t K, float *out) {
    const int ti = type_index(m->type);
    const gv_part p = {m->w, m->rows, row_bytes(ti, K), out, ti, (INT8_MASK >> ti & 1) && q8_type(ti, K)};
    return p;
}

static inline const uint8_t *gv_row(const gv_part *p, const int64_t *start, int np, int64_t g) {
    int i = 0;
    while (i + 1 < np && g >= start[i + 1]) i++;
    return p[i].w + (g - start[i]) * p[i].rb;
}

/* rows [g0, g1) of the parts laid end to end, prefetching lead rows ahead, on into [n0, n1) */
static void gv_range(const gv_part *p, const int64_t *start, int np, int64_t K, const float *x, const xq8 *xq,
                     int64_t g0, int64_t g1, int64_t n0, int64_t n1, int cold) {
    int i = 0;
    for (int64_t g = g0; g < g1;) {
        while (g >= start[i + 1]) i++;
        const gv_part *P = p + i;
        const int64_t r = g - start[i], lead = (HM_PF_DIST + P->rb - 1) / P->rb;
        const int R = g + 4 <= g1 && g + 4 <= start[i + 1] ? 4 : 1;
        if (cold && g == g0) {
            int64_t n = g1 - g0 < lead ? g1 - g0 : lead;
            n = n < start[i + 1] - g ? n : start[i + 1] - g;
            prefetch_range(P->w + r * P->rb, n * P->rb);
        }
        int64_t gl = g + lead;
        const uint8_t *pf[2] = {NULL, NULL};
        if (gl < g1 || (gl = n0 + (gl - g1)) < n1) {   /* prefetches never fault: no bound for row gl + 2 */
            pf[0] = gv_row(p, start, np, gl);
            pf[1] = R == 4 ? gv_row(p, start, np, gl + 2) : NULL;
        }
        const uint8_t *rows[4] = {P->w + r * P->rb, NULL, NULL, NULL};
        for (int c = 1; c < R; c++) rows[c] = rows[0] + c * P->rb;
        float res[16];
        dot_rows1(P->ti, R, rows, pf, K, x, P->q8 ? xq : NULL, res);
        for (int c = 0; c < R; c++) P->out[r + c] = res[c];
        g += R;
    }
}

/* the parts laid end to end: start [np + 1] (part i's rows from start[i]); returns whether any part takes x
 * quantized (the integer path) */
static int gv_starts(const gv_part *p, int np, int64_t *start) {
    int q8 = 0;
    start[0] = 0;
    for (int i = 0; i < np; i++) { start[i + 1] = start[i] + p[i].n; q8 |= p[i].q8; }
    return q8;
}

/* one thread's share of a product inside a parallel region: chunks of GV_CHUNK rows claimed from *ctr (0 at
 * the start of the product, shared by the team) until none are left */
static void gemv_team(const gv_part *p, const int64_t *start, int np, int64_t K, const float *x, const xq8 *xq,
                      int64_t *ctr) {
    const int64_t N = start[np], nc = (N + GV_CHUNK - 1) / GV_CHUNK;
    int64_t cur = claim(ctr), nxt = claim(ctr);
    for (int cold = 1; cur < nc; cold = 0, cur = nxt, nxt = claim(ctr)) {
        int64_t g0, g1, n0, n1;
        chunk_range(cur, GV_CHUNK, N, &g0, &g1);
        chunk_range(nxt, GV_CHUNK, N, &n0, &n1);
        gv_range(p, start, np, K, x, xq, g0, g1, n0, n1, cold);
    }
}

/* out of each part = its rows . x (K columns); xq: room for x quantized (integer-path parts) */
static void gemv_run(const gv_part *p, int np, int64_t K, const float *x, const xq8 *xq, int nth) {
    int64_t start[5];
    if (gv_starts(p, np, start)) quant_x8(x, 0, K / 32, xq);
    int64_t ctr = 0;
#pragma omp parallel num_threads(nth)
    gemv_team(p, start, np, K, x, xq, &ctr);
}

static inline float dotf(const float *a, const float *b, int64_t n) {
#if HM_AVX512
    if (n % 16 == 0) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s);
        return _mm512_reduce_add_ps(s);
    }
#endif
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y = x * w / rms(x) (in place allowed) */
static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *y) {
    const float r = 1.0f / sqrtf(dotf(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* RoPE on nheads rows of D with this position's cos/sin [D], laid out as ops.rope_tables: NeoX rotates the
 * two halves, GGUF llama adjacent pairs */
static void rope_heads(float *x, int64_t nheads, int64_t D, const float *cs, const float *sn, int neox) {
    for (int64_t h = 0; h < nheads; h++) {
        float *v = x + h * D;
        if (neox) {
            for (int64_t i = 0; i < D / 2; i++) {
                const float a = v[i], b = v[i + D / 2];
                v[i] = a * cs[i] - b * sn[i];
                v[i + D / 2] = b * cs[i + D / 2] + a * sn[i + D / 2];
            }
        } else {
            for (int64_t i = 0; i < D; i += 2) {
                const float a = v[i], b = v[i + 1];
                v[i] = a * cs[i] - b * sn[i];
                v[i + 1] = b * cs[i + 1] + a * sn[i + 1];
            }
        }
    }
}

/* float -> IEEE half, round to nearest even (as torch's .to(float16)) */
static inline uint16_t f32_to_fp16(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    const uint16_t sign = (uint16_t)((b >> 16) & 0x8000);
    const uint32_t a = b & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00;                       /* nan */
    if (a >= 0x477FF000u) return sign | 0x7C00;                      /* rounds to inf */
    if (a < 0x38800000u) return sign | (uint16_t)rintf(f32_bits(a) * 16777216.0f);   /* subnormal: x 2^24 */
    return sign | (uint16_t)((a + 0xFFFu + ((a >> 13) & 1) - 0x38000000u) >> 13);
}

static inline void kv_load(int kvt, const void *base, int64_t off, int64_t D, float *dst) {
    if (kvt == T_F32) { memcpy(dst, (const float *)base + off, (size_t)D * 4); return; }
    const uint16_t *s = (const uint16_t *)base + off;
    if (kvt == T_BF16) { for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(s[d]); return; }
#if HM_AVX512
    if (D % 16 == 0) {
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + d))));
        return;
    }
#endif
    for (int64_t d = 0; d < D; d++) dst[d] = fp16_to_f32(s[d]);
}

static inline void kv_store(int kvt, void *base, int64_t off, int64_t D, const float *src) {
    if (kvt == T_F32) { memcpy((float *)base + off, src, (size_t)D * 4); return; }
    uint16_t *s = (uint16_t *)base + off;
    for (int64_t d = 0; d < D; d++) s[d] = kvt == T_BF16 ? f32_to_bf16(src[d]) : f32_to_fp16(src[d]);
}

#define ATT_SB 32        /* positions converted to float32 and scored together */

/* acc[0..D) += sum_i e[i] * v[i * D ..] (one accumulator register per 16 lanes, over the n rows) */
static inline void axpy_rows(float *acc, const float *e, const float *v, int64_t n, int64_t D) {
#if HM_AVX512
    if (D % 16 == 0) {
        for (int64_t d = 0; d < D; d += 16) {
            __m512 a = _mm512_loadu_ps(acc + d);
            for (int64_t i = 0; i < n; i++) a = _mm512_fmadd_ps(_mm512_set1_ps(e[i]), _mm512_loadu_ps(v + i * D + d), a);
            _mm512_storeu_ps(acc + d, a);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < D; d++) acc[d] += e[i] * v[i * D + d];
}

/* Attention of one query token (q [nh, D], roped) against positions [0, P) of layer L's cache: tasks (KV
 * head g, run c of CH positions; att_runs) keep per query head of the group [max, sum, acc[D]] (att_task);
 * each block of ATT_SB positions is converted to float32 once for the group, scored for one head at a time,
 * and added in with one rescale per block (an online softmax by blocks); att_merge combines the runs per
 * head. The runs depend only on P, so a query's result is the same in a decode step (attn_block) and in a
 * prompt or a batch (attend_batch): both run these two functions. */
static void att_runs(int64_t P, int64_t *nch, int64_t *CH) {
    int64_t ch = ATT_SB;                          /* runs of ATT_SB 2^s positions, aligned: blocks never straddle */
    while ((P + ch - 1) / ch > ATT_MAXCH) ch *= 2;
    *CH = ch;
    *nch = (P + ch - 1) / ch;
}


/* One query's state pt [G][max, sum, acc[D]] (its KV head's query heads; qg the group's rows) updated by n <=
 * ATT_SB positions: keys kt transposed ([D][ATT_SB], lanes n.. zero), values vf [n][D]. The scores of the
 * positions are lanes: s_i = ((p0 + p1) + (p2 + p3)) scale, p_c the fma chain over d = c mod 4 ascending; the
 * block's max, then exp_vec(s_i - max) and their sum as a tree over the lanes; acc += e_i v_i, i ascending.
 * The decode step and prompts both run this (the canonical attention). */
static inline void att_block(const hm_dmodel *m, const float *qg, int64_t n, const float *kt, const float *vf,
                             float *pt) {
    const int64_t D = m->D, G = m->nh / m->nkv, W = D + 2;
    const float scale = m->scale;
    float sc[ATT_SB] __attribute__((aligned(64)));
    for (int64_t j = 0; j < G; j++) {
        float *a = pt + j * W;
        const float *qj = qg + j * D;
        float mb = -INFINITY, sum = 0.0f;
#if HM_AVX512
        if (D % 4 == 0) {
            __m512 p[2][4];
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 4; c++) p[h][c] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 4)
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const __m512 qd = _mm512_set1_ps(qj[d + c]);
                    p[0][c] = _mm512_fmadd_ps(qd, _mm512_load_ps(kt + (d + c) * ATT_SB), p[0][c]);
                    p[1][c] = _mm512_fmadd_ps(qd, _mm512_load_ps(kt + (d + c) * ATT_SB + 16), p[1][c]);
                }
            const __mmask16 k0 = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
            const __mmask16 k1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            __m512 s0 = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(p[0][0], p[0][1]), _mm512_add_ps(p[0][2], p[0][3])),
                                      _mm512_set1_ps(scale));
            __m512 s1 = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(p[1][0], p[1][1]), _mm512_add_ps(p[1][2], p[1][3])),
                                      _mm512_set1_ps(scale));
            s0 = _mm512_mask_blend_ps(k0, ninf, s0);
            s1 = _mm512_mask_blend_ps(k1, ninf, s1);
            mb = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
            if (mb > a[0]) {                    /* a new max: rescale what was summed */
                const float f = expf(a[0] - mb);
                a[1] *= f;
                for (int64_t d = 0; d < D; d++) a[2 + d] *= f;
                a[0] = mb;
            }
            const __m512 mx = _mm512_set1_ps(a[0]);
            const __m512 e0 = _mm512_maskz_mov_ps(k0, exp_vec16(_mm512_sub_ps(s0, mx)));
            const __m512 e1 = _mm512_maskz_mov_ps(k1, exp_vec16(_mm512_sub_ps(s1, mx)));
            _mm512_store_ps(sc, e0);
            _mm512_store_ps(sc + 16, e1);
            sum = _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        } else
#endif
        {
            for (int64_t i = 0; i < n; i++) {
                float pc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int64_t d = 0; d < D; d++) pc[d & 3] = fmaf(qj[d], kt[d * ATT_SB + i], pc[d & 3]);
                sc[i] = ((pc[0] + pc[1]) + (pc[2] + pc[3])) * scale;
                mb = sc[i] > mb ? sc[i] : mb;
            }
            if (mb > a[0]) {
                const float f = expf(a[0] - mb);
                a[1] *= f;
                for (int64_t d = 0; d < D; d++) a[2 + d] *= f;
                a[0] = mb;
            }
            for (int64_t i = 0; i < n; i++) {
                sc[i] = exp_vec(sc[i] - a[0]);
                sum += sc[i];
            }
        }
        a[1] += sum;
        axpy_rows(a + 2, sc, vf, n, D);
    }
}

static inline void att_init(const hm_dmodel *m, float *pt) {
    const int64_t D = m->D, G = m->nh / m->nkv, W = D + 2;
    for (int64_t j = 0; j < G; j++) {
        pt[j * W] = -INFINITY;
        memset(pt + j * W + 1, 0, (size_t)(D + 1) * 4);
    }
}

/* positions [b, b + n) of KV head g of layer L's cache as float32 */
/* positions [b, b + n) of KV head g of layer L's cache as float32: keys transposed into kt [D][ATT_SB] (lanes
 * n.. zero), values vf [n][D] */
static inline void att_load(const hm_dmodel *m, const hm_dlayer *L, int64_t g, int64_t b, int64_t n, float *kt,
                            float *vf) {
    const int64_t D = m->D, S = m->slots;
    float row[DEC_MAXD];
    if (n < ATT_SB)
        for (int64_t d = 0; d < D; d++) memset(kt + d * ATT_SB + n, 0, (size_t)(ATT_SB - n) * 4);
    for (int64_t i = 0; i < n; i++) {
        kv_load(m->kv_type, L->kc, (g * S + b + i) * D, D, row);
        for (int64_t d = 0; d < D; d++) kt[d * ATT_SB + i] = row[d];
        kv_load(m->kv_type, L->vc, (g * S + b + i) * D, D, vf + i * D);
    }
}

/* run c (CH positions from c CH, up to P) of KV head g for one query (q [nh, D]) -> pt */
__attribute__((noinline)) static void att_task(const hm_dmodel *m, const hm_dlayer *L, const float *q, int64_t P,
                                               int64_t g, int64_t c, int64_t CH, float *pt, float *kf, float *vf) {
    const int64_t D = m->D, G = m->nh / m->nkv;
    const int64_t p0 = c * CH, p1 = p0 + CH < P ? p0 + CH : P;
    att_init(m, pt);
    for (int64_t b = p0; b < p1; b += ATT_SB) {
        const int64_t n = p1 - b < ATT_SB ? p1 - b : ATT_SB;
        att_load(m, L, g, b, n, kf, vf);
        att_block(m, q + g * G * D, n, kf, vf, pt);
    }
}

/* head h's output o [D] from the nch runs of its KV head (part: [nkv][nch][G][D + 2] of one query) */
__attribute__((noinline)) static void att_merge(const hm_dmodel *m, const float *part, int64_t nch, int64_t h, float *oh) {
    const int64_t D = m->D, G = m->nh / m->nkv, W = D + 2, g = h / G, j = h % G;
    float mx = -INFINITY, l = 0;
    for (int64_t c = 0; c < nch; c++) {
        const float mc = part[((g * nch + c) * G + j) * W];
        mx = mc > mx ? mc : mx;
    }
    memset(oh, 0, (size_t)D * 4);
    for (int64_t c = 0; c < nch; c++) {
        const float *a = part + ((g * nch + c) * G + j) * W;
        const float f = expf(a[0] - mx);
        l += f * a[1];
        for (int64_t d = 0; d < D; d++) oh[d] += f * a[2 + d];
    }
    const float il = l > 0 ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < D; d++) oh[d] *= il;
}

/* softmax over the router's E logits, the top k (ties: lower id), renormalized if asked, times scale */
static void route_softmax(const float *l, int64_t E, int64_t k, int norm, float scale, int32_t *ids, float *w) {
    float mx = -INFINITY, sum = 0, sel = 0;
    for (int64_t e = 0; e < E; e++) mx = l[e] > mx ? l[e] : mx;
    for (int64_t e = 0; e < E; e++) sum += expf(l[e] - mx);
    int64_t prev = -1;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if ((prev < 0 || l[e] < l[prev] || (l[e] == l[prev] && e > prev)) && (best < 0 || l[e] > l[best]))
                best = e;
        ids[j] = (int32_t)best;                         /* -1 (NaN logits): the expert kernel skips it */
        w[j] = best < 0 ? 0.0f : expf(l[best] - mx) / sum;
        sel += w[j];
        if (best >= 0) prev = best;
    }
    for (int64_t j = 0; j < k; j++) w[j] = (norm && sel > 0 ? w[j] / sel : w[j]) * scale;
}

/* the scratch layout: float buffers of the step, then x quantized; base NULL: only the size */
typedef struct { float *x, *h, *y, *y2, *qkv, *att, *rl, *ff, *part; xq8 xq; } dec_bufs;

static int64_t dec_layout(const hm_dmodel *m, uint8_t *base, dec_bufs *b) {
    const int64_t H = m->H, nq = m->nh * m->D, kmax = H > nq ? (H > m->n_ff ? H : m->n_ff) : (nq > m->n_ff ? nq : m->n_ff);
    const int64_t n[9] = {H, H, H, H, nq + 2 * m->nkv * m->D, nq, m->E > 0 ? m->E : 1, 2 * m->n_ff + 1,
                          m->nh * ATT_MAXCH * (m->D + 2)};
    float **dst[9] = {&b->x, &b->h, &b->y, &b->y2, &b->qkv, &b->att, &b->rl, &b->ff, &b->part};
    int64_t off = 0;
    for (int i = 0; i < 9; i++) {
        if (base) *dst[i] = (float *)(base + off);
        off += (n[i] * 4 + 63) & ~(int64_t)63;
    }
    if (base) xq8_init(&b->xq, base + off, kmax);
    return off + (int64_t)xq8_bytes(kmax) + 64;
}

int64_t hm_decode_scratch(const hm_dmodel *m) {
    dec_bufs b;
    return dec_layout(m, NULL, &b);
}

/* A decode layer in one parallel region: q/k/v = h W (h: x normed), their norms, RoPE and the cache write at
 * pos (one thread), attention over positions [0, pos], y = att W_o; with routed experts also x += y,
 * h = ffn_norm(x), the router's logits rl = h W_r, the routing (one thread) and y = the routed experts of h.
 * Each step, and every value, is the one the separate calls (gemv_run, the attention's att_task / att_merge,
 * moe_ffn_act) compute; the team only meets at barriers between them instead of entering a region for each
 * (entering one wakes the workers; on a machine whose cores other programs keep busy that cost up to ~0.3 ms
 * a region with 2 threads, a barrier between phases less). times (NULL: none): [0] += products,
 * [1] += attention, [2] += routed experts, from the stamps of the threads at the barriers. Returns 0, or
 * the expert kernel's error. */
static int layer_block(const hm_dmodel *m, const hm_dlayer *L, const dec_bufs *b, int64_t pos, const float *cs,
                       const float *sn, int nth, double *times) {
    const int64_t H = m->H, D = m->D, nh = m->nh, nkv = m->nkv, nq = nh * D, nk = nkv * D, S = m->slots;
    const int64_t G = nh / nkv, W = D + 2, P = pos + 1;
    float *q = b->qkv, *k = b->qkv + nq, *v = b->qkv + nq + nk;
    const gv_part pqkv[3] = {gv_mk(&L->q, H, q), gv_mk(&L->k, H, k), gv_mk(&L->v, H, v)};
    const gv_part po = gv_mk(&L->o, nq, b->y), pr = gv_mk(&L->router, H, b->rl);
    int64_t s_qkv[4], s_o[2], s_r[2], ctr[3] = {0, 0, 0};
    const int q8_qkv = gv_starts(pqkv, 3, s_qkv), q8_o = gv_starts(&po, 1, s_o);
    const int router = L->router.rows > 0, q8_r = router && gv_starts(&pr, 1, s_r);
    int64_t nch, CH, mctr[2] = {0, 0};
    att_runs(P, &nch, &CH);
    int32_t ids[64];
    float wts[64];
    moe_ctx mc;
    int rc = 0;
    double t0 = times ? hm_now() : 0, t1 = t0, t2 = t0, t3 = t0, t4 = t0;
    if (q8_qkv) quant_x8(b->h, 0, H / 32, &b->xq);
#pragma omp parallel num_threads(nth)
    {
        gemv_team(pqkv, s_qkv, 3, H, b->h, &b->xq, &ctr[0]);
#pragma omp barrier
        if (times && omp_get_thread_num() == 0) t1 = hm_now();
#pragma omp single
        {
            for (int64_t i = 0; L->q_norm && i < nh; i++) rmsnorm(q + i * D, L->q_norm, D, m->eps, q + i * D);
            for (int64_t i = 0; L->k_norm && i < nkv; i++) rmsnorm(k + i * D, L->k_norm, D, m->eps, k + i * D);
            rope_heads(q, nh, D, cs, sn, m->neox);
            rope_heads(k, nkv, D, cs, sn, m->neox);
            for (int64_t g = 0; g < nkv; g++) {
                kv_store(m->kv_type, L->kc, (g * S + pos) * D, D, k + g * D);
                kv_store(m->kv_type, L->vc, (g * S + pos) * D, D, v + g * D);
            }
        }
        float kf[ATT_SB * DEC_MAXD] __attribute__((aligned(64))), vf[ATT_SB * DEC_MAXD];
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < nkv * nch; t++)
            att_task(m, L, q, P, t / nch, t % nch, CH, b->part + t * G * W, kf, vf);
#pragma omp for schedule(static)
        for (int64_t h = 0; h < nh; h++) att_merge(m, b->part, nch, h, b->att + h * D);
#pragma omp single
        {
            if (times) t2 = hm_now();
            if (q8_o) quant_x8(b->att, 0, nq / 32, &b->xq);
        }
        gemv_team(&po, s_o, 1, nq, b->att, &b->xq, &ctr[1]);
        if (router) {
#pragma omp barrier
#pragma omp single
            {
                for (int64_t i = 0; i < H; i++) b->x[i] += b->y[i];
                rmsnorm(b->x, L->ffn_norm, H, m->eps, b->h);
                if (q8_r) quant_x8(b->h, 0, H / 32, &b->xq);
            }
            gemv_team(&pr, s_r, 1, H, b->h, &b->xq, &ctr[2]);
#pragma omp barrier
#pragma omp single
            {
                if (times) t3 = hm_now();
                route_softmax(b->rl, L->router.rows, m->k, m->norm_topk, m->wscale, ids, wts);
                if (times) t4 = hm_now();
                rc = moe_prep(b->h, 1, H, ids, wts, m->k, L->gate_exps.w, L->up_exps.w, L->gate_exps.type,
                              m->n_ff_exp, L->router.rows, L->down_exps.w, L->down_exps.type, b->y, &ACT_SILU, &mc);
            }
            if (rc == 0) moe_team(&mc, mctr);
        }
    }
    if (times) {
        const double t5 = hm_now();
        times[0] += (t1 - t0) + (router ? t3 - t2 : t5 - t2);
        times[1] += t2 - t1;
        if (router) times[2] += t5 - t4;
    }
    return rc < 0 ? rc : 0;
}

/* Decode one token at position pos: logits [n_vocab] = the model on token, its keys and values written to
 * the cache at pos. cs / sn: RoPE cos and sin [D] of pos. times (NULL: none) += seconds in matrix-vector
 * products [0], attention [1], routed experts [2]. Returns 0; -1 for a token or position out of range;
 * the expert kernel's error otherwise. Shapes and types are checked by the caller (cpu_decode.py). */
int hm_decode_step(const hm_dmodel *m, int64_t token, int64_t pos, const float *cs, const float *sn,
                   float *logits, double *times) {
    const int64_t H = m->H, D = m->D, S = m->slots;
    const int nth = m->nthreads > 0 ? m->nthreads : omp_get_max_threads();
    if (token < 0 || token >= m->embd.rows || pos < 0 || pos >= S || D > DEC_MAXD) return -1;
    dec_bufs b;
    dec_layout(m, m->scratch, &b);
    double t = times ? hm_now() : 0;
#define LAP(i) do { if (times) { const double t1 = hm_now(); times[i] += t1 - t; t = t1; } } while (0)
#define UNTIMED() do { if (times) t = hm_now(); } while (0)
    const int ei = type_index(m->embd.type);
    deq_scalar(ei, m->embd.w + token * row_bytes(ei, H), 0, (int)H, b.x);
    for (int64_t l = 0; l < m->n_layer; l++) {
        const hm_dlayer *L = m->layers + l;
        rmsnorm(b.x, L->attn_norm, H, m->eps, b.h);
        const int rc = layer_block(m, L, &b, pos, cs, sn, nth, times);   /* with routed experts: y = theirs */
        if (rc) return rc;
        float *ffo = b.y;
        if (L->router.rows) {
            ffo = b.y2;
        } else {
            for (int64_t i = 0; i < H; i++) b.x[i] += b.y[i];
            rmsnorm(b.x, L->ffn_norm, H, m->eps, b.h);
        }
        if (L->gate.rows) {
            const int64_t F = L->gate.rows;
            const gv_part pgu[2] = {gv_mk(&L->gate, H, b.ff), gv_mk(&L->up, H, b.ff + F)};
            UNTIMED();
            gemv_run(pgu, 2, H, b.h, &b.xq, nth);
            for (int64_t i = 0; i < F; i++) b.ff[i] = silu(b.ff[i]) * b.ff[F + i];
            const gv_part pd = gv_mk(&L->down, F, ffo);
            gemv_run(&pd, 1, F, b.ff, &b.xq, nth);
            LAP(0);
            if (L->router.rows)
                for (int64_t i = 0; i < H; i++) b.y[i] += b.y2[i];
        }
        for (int64_t i = 0; i < H; i++) b.x[i] += b.y[i];
    }
    rmsnorm(b.x, m->out_norm, H, m->eps, b.h);
    const gv_part ph = gv_mk(&m->head, H, logits);
    UNTIMED();
    gemv_run(&ph, 1, H, b.h, &b.xq, nth);
    LAP(0);
#undef LAP
#undef UNTIMED
    return 0;
}

/* ------------------------------------------------------------------ prompt and batch steps on the CPU
 *
 * hm_batch_step: the tokens of several sequences (each a prompt chunk or a decode token, each with its own
 * cache and positions) through the model hm_decode_step runs; hm_prompt_step is its one-sequence case.
 * Every token's values are computed by the same arithmetic as hm_decode_step computes them for that token
 * alone: the same norms, RoPE, cache writes and attention per token (att_task / att_merge, whose runs depend on the position only),
 * the same routing, and products that are canonical per (row, token) (the integer path's cdot_ref, or the
 * fp32 kernels for float types), whichever kernel runs them (the streaming kernels, or the int8 AMX tiles for
 * many tokens). So a prompt split anywhere, decoded token by token, or batched with other sequences gives the
 * same logits, bit for bit. The work is batched: one call per matrix for all tokens (every weight byte read once
 * a call), the experts once per layer, attention over all (query, KV head, run) tasks of groups of queries. */
#ifndef PQ_BYTES
#define PQ_BYTES (2 << 20)    /* the partials of a group of queries sharing each converted key/value block */
#endif

typedef struct { float *x, *h, *y, *y2, *q, *k, *v, *att, *rl, *g, *u, *wts, *part; int32_t *ids; } pr_bufs;

/* One sequence of a batch: T tokens at positions pos0.. of its own cache, kc[l] / vc[l] layer l's [nkv, slots, D]
 * (NULL: the caches the model's layers name, m->slots of them) */
typedef struct { int64_t T, pos0, slots; void *const *kc, *const *vc; } hm_seq;

/* A group of queries of one sequence that attend together (attend_batch): nt queries from token tq (position
 * pos), runs of CH positions, nrun runs for the last; their partials at part + off, QS floats a query */
typedef struct { int64_t s, tq, pos, nt, CH, nrun, QS, off, task0; } att_group;

/* partials' floats: one query's at most, PQ_BYTES' worth, or for batches of several sequences up to 16 queries
 * at most runs (so a decode step of many sequences attends in few parallel regions) */
static int64_t part_floats(const hm_dmodel *m, int64_t nseq) {
    const int64_t QS1 = m->nh * ATT_MAXCH * (m->D + 2), many = (nseq < 16 ? nseq : 16) * QS1;
    return many > PQ_BYTES / 4 ? many : PQ_BYTES / 4;
}

static int64_t pr_layout(const hm_dmodel *m, int64_t T, int64_t nseq, uint8_t *base, pr_bufs *b, att_group **gr) {
    const int64_t H = m->H, nq = m->nh * m->D, nk = m->nkv * m->D, F = m->n_ff > 0 ? m->n_ff : 1;
    const int64_t n[15] = {T * H, T * H, T * H, T * H, T * nq, T * nk, T * nk, T * nq, T * (m->E > 0 ? m->E : 1),
                           T * F, T * F, T * (m->k > 0 ? m->k : 1), part_floats(m, nseq),
                           T * (m->k > 0 ? m->k : 1), T * (int64_t)sizeof(att_group) / 4 + 1};
    float **dst[13] = {&b->x, &b->h, &b->y, &b->y2, &b->q, &b->k, &b->v, &b->att, &b->rl, &b->g, &b->u, &b->wts,
                       &b->part};
    int64_t off = 0;
    for (int i = 0; i < 15; i++) {
        if (base) {
            if (i < 13) *dst[i] = (float *)(base + off);
            else if (i == 13) b->ids = (int32_t *)(base + off);
            else *gr = (att_group *)(base + off);
        }
        off += (n[i] * 4 + 63) & ~(int64_t)63;
    }
    return off + 64;
}

/* scratch bytes of hm_batch_step for T tokens of nseq sequences in all */
int64_t hm_batch_scratch(const hm_dmodel *m, int64_t T, int64_t nseq) {
    pr_bufs b;
    return pr_layout(m, T, nseq, NULL, &b, NULL);
}

int64_t hm_prompt_scratch(const hm_dmodel *m, int64_t T) { return hm_batch_scratch(m, T, 1); }

/* out [T][N] = x [T][K] . the rows of W: hm_tile_mm from mm_tile_t tokens (the int8 tiles for a type they take,
 * the streaming kernels' values for the other canonical types, the bf16 tiles only with hm_set_exact(0)), else
 * the streaming kernels */
static int pr_mm(const hm_dmodel *m, const float *x, int64_t T, int64_t K, const hm_mat *W, float *out, int nth) {
    if (type_index(W->type) < 0) return -1;
    if (m->mm_tile_t > 0 && T >= m->mm_tile_t && W->rows % 32 == 0)
        return hm_tile_mm(x, T, K, W->w, W->type, W->rows, out, nth);
    return hm_qmatmul(x, T, K, W->w, W->type, W->rows, out, nth);
}

/* The attention groups of a batch: per sequence, its queries in order, a group while they share a run length
 * and their partials stay within PQ_BYTES (one query alone may take more). Returns how many. */
static int64_t att_groups(const hm_dmodel *m, const hm_seq *seqs, int64_t nseq, att_group *gr) {
    const int64_t W = m->D + 2;
    int64_t ng = 0, tq = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t pos0 = seqs[s].pos0, T = seqs[s].T;
        for (int64_t t0 = 0; t0 < T;) {
            int64_t nch0, CH;
            att_runs(pos0 + t0 + 1, &nch0, &CH);
            int64_t nt = 1;
            while (t0 + nt < T) {
                int64_t n2, c2;
                att_runs(pos0 + t0 + nt + 1, &n2, &c2);
                if (c2 != CH || (nt + 1) * m->nh * n2 * W * 4 > PQ_BYTES) break;
                nt++;
            }
            const int64_t nrun = (pos0 + t0 + nt + CH - 1) / CH;
            const att_group g = {s, tq + t0, pos0 + t0, nt, CH, nrun, m->nh * nrun * W, 0, 0};
            gr[ng++] = g;
            t0 += nt;
        }
        tq += T;
    }
    return ng;
}

/* Attention of every query of a batch (q rows nq apart; sequence s's queries at positions pos0_s + t against its
 * own cache) -> o rows. Each query's runs and blocks are att_task's (the same updates in the same order: its
 * result depends on its position alone), but a group of queries with the same run length shares each block of
 * converted keys and values: tasks (group, KV head, run), each run's blocks in order, every query of the group
 * that reaches a block updated by it. Groups run in waves whose partials fit the buffer (npart floats). */
static void attend_batch(const hm_dmodel *m, const hm_dlayer *L, int64_t l, const hm_seq *seqs, att_group *gr,
                         int64_t ng, const float *q, float *part, int64_t npart, float *o, int nth) {
    const int64_t nq = m->nh * m->D, nkv = m->nkv, G = m->nh / m->nkv, D = m->D, W = D + 2;
    for (int64_t j0 = 0; j0 < ng;) {
        int64_t j1 = j0, used = 0, ntask = 0, nmerge = 0;
        while (j1 < ng && (j1 == j0 || used + gr[j1].nt * gr[j1].QS <= npart)) {
            gr[j1].off = used;
            gr[j1].task0 = ntask;
            used += gr[j1].nt * gr[j1].QS;
            ntask += nkv * gr[j1].nrun;
            nmerge += gr[j1].nt * m->nh;
            j1++;
        }
#pragma omp parallel num_threads(nth)
        {
            float kf[ATT_SB * DEC_MAXD] __attribute__((aligned(64))), vf[ATT_SB * DEC_MAXD];
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < ntask; u++) {
                int64_t j = j0;
                while (j + 1 < j1 && gr[j + 1].task0 <= u) j++;
                const att_group *a = gr + j;
                const hm_seq *sq = seqs + a->s;
                hm_dlayer Ls = *L;
                hm_dmodel ms = *m;
                if (sq->kc) { Ls.kc = sq->kc[l]; Ls.vc = sq->vc[l]; ms.slots = sq->slots; }
                const int64_t v = u - a->task0, g = v / a->nrun, c = v % a->nrun, p0 = c * a->CH;
                const int64_t Pmax = a->pos + a->nt;
                float *pg = part + a->off;
                int64_t i0 = p0 - a->pos;                      /* the first query that reaches this run: P > p0 */
                i0 = i0 < 0 ? 0 : i0;
                for (int64_t i = i0; i < a->nt; i++) {
                    const int64_t P = a->pos + i + 1, nch = (P + a->CH - 1) / a->CH;
                    att_init(&ms, pg + i * a->QS + (g * nch + c) * G * W);
                }
                const int64_t p1 = p0 + a->CH < Pmax ? p0 + a->CH : Pmax;
                for (int64_t b = p0; b < p1; b += ATT_SB) {
                    const int64_t n = p1 - b < ATT_SB ? p1 - b : ATT_SB;
                    att_load(&ms, &Ls, g, b, n, kf, vf);
                    const int64_t i1 = b - a->pos;
                    for (int64_t i = i1 < i0 ? i0 : i1; i < a->nt; i++) {
                        const int64_t P = a->pos + i + 1, nch = (P + a->CH - 1) / a->CH;
                        const int64_t e = P < b + n ? P - b : n;   /* the query sees positions < P */
                        att_block(&ms, q + (a->tq + i) * nq + g * G * D, e, kf, vf,
                                  pg + i * a->QS + (g * nch + c) * G * W);
                    }
                }
            }
#pragma omp for schedule(static)
            for (int64_t u = 0; u < nmerge; u++) {
                int64_t j = j0, r = u;
                while (r >= gr[j].nt * m->nh) { r -= gr[j].nt * m->nh; j++; }
                const att_group *a = gr + j;
                const int64_t i = r / m->nh, hh = r % m->nh, P = a->pos + i + 1;
                att_merge(m, part + a->off + i * a->QS, (P + a->CH - 1) / a->CH, hh, o + (a->tq + i) * nq + hh * D);
            }
        }
        j0 = j1;
    }
}

/* A batch of sequences, each with its own cache and positions: tokens [sum T] (sequence after sequence), keys
 * and values written to each sequence's cache, logits of every token (all = 1: [sum T][n_vocab]) or of each
 * sequence's last ([nseq][n_vocab]). Every token's values are those hm_decode_step computes for it alone (the
 * same norms, RoPE, cache writes and attention per token; products canonical per (row, token) whichever kernel
 * runs them), so a sequence gets the same logits, bit for bit, alone or batched, in a prompt split anywhere or
 * decoded token by token. The work is batched: one call per matrix for all tokens (every weight byte read once a
 * call), the experts once per layer over every token's choice, attention as (group, KV head, run) tasks.
 * cs / sn: RoPE cos and sin [sum T][D] of each token's position. scratch: hm_batch_scratch(m, sum T, nseq)
 * bytes. times as hm_decode_step's. distinct (NULL: not wanted): per layer, how many different experts the batch
 * routed to (0 for a layer without routed experts). Returns 0; -1 for a token, position or sequence out of
 * range; a kernel's error otherwise. */
int hm_batch_step(const hm_dmodel *m, const int64_t *tokens, const hm_seq *seqs, int64_t nseq, const float *cs,
                  const float *sn, float *logits, int all, uint8_t *scratch, double *times, int32_t *distinct) {
    const int64_t H = m->H, D = m->D, nh = m->nh, nkv = m->nkv, nq = nh * D, nk = nkv * D;
    const int nth = m->nthreads > 0 ? m->nthreads : omp_get_max_threads();
    if (nseq < 1 || D > DEC_MAXD) return -1;
    int64_t T = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const hm_seq *sq = seqs + s;
        const int64_t S = sq->kc ? sq->slots : m->slots;
        if (sq->T < 1 || sq->pos0 < 0 || sq->pos0 + sq->T > S || (sq->kc && !sq->vc)) return -1;
        T += sq->T;
    }
    for (int64_t t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= m->embd.rows) return -1;
    pr_bufs b;
    att_group *gr = NULL;
    pr_layout(m, T, nseq, scratch, &b, &gr);
    const int64_t npart = part_floats(m, nseq), ng = att_groups(m, seqs, nseq, gr);
    double tm = times ? hm_now() : 0;
#define LAP(i) do { if (times) { const double t1 = hm_now(); times[i] += t1 - tm; tm = t1; } } while (0)
#define UNTIMED() do { if (times) tm = hm_now(); } while (0)
    const int ei = type_index(m->embd.type);
    int rc = 0;
    for (int64_t t = 0; t < T; t++) deq_scalar(ei, m->embd.w + tokens[t] * row_bytes(ei, H), 0, (int)H, b.x + t * H);
    for (int64_t l = 0; l < m->n_layer && !rc; l++) {
        const hm_dlayer *L = m->layers + l;
        for (int64_t t = 0; t < T; t++) rmsnorm(b.x + t * H, L->attn_norm, H, m->eps, b.h + t * H);
        UNTIMED();
        rc = pr_mm(m, b.h, T, H, &L->q, b.q, nth);
        if (!rc) rc = pr_mm(m, b.h, T, H, &L->k, b.k, nth);
        if (!rc) rc = pr_mm(m, b.h, T, H, &L->v, b.v, nth);
        LAP(0);
        if (rc) break;
        for (int64_t s = 0, t = 0; s < nseq; s++) {
            const hm_seq *sq = seqs + s;
            void *kc = sq->kc ? sq->kc[l] : L->kc, *vc = sq->kc ? sq->vc[l] : L->vc;
            const int64_t S = sq->kc ? sq->slots : m->slots;
            for (int64_t i = 0; i < sq->T; i++, t++) {
                float *q = b.q + t * nq, *k = b.k + t * nk, *v = b.v + t * nk;
                const int64_t pos = sq->pos0 + i;
                for (int64_t j = 0; L->q_norm && j < nh; j++) rmsnorm(q + j * D, L->q_norm, D, m->eps, q + j * D);
                for (int64_t j = 0; L->k_norm && j < nkv; j++) rmsnorm(k + j * D, L->k_norm, D, m->eps, k + j * D);
                rope_heads(q, nh, D, cs + t * D, sn + t * D, m->neox);
                rope_heads(k, nkv, D, cs + t * D, sn + t * D, m->neox);
                for (int64_t g = 0; g < nkv; g++) {
                    kv_store(m->kv_type, kc, (g * S + pos) * D, D, k + g * D);
                    kv_store(m->kv_type, vc, (g * S + pos) * D, D, v + g * D);
                }
            }
        }
        UNTIMED();
        attend_batch(m, L, l, seqs, gr, ng, b.q, b.part, npart, b.att, nth);
        LAP(1);
        rc = pr_mm(m, b.att, T, nq, &L->o, b.y, nth);
        LAP(0);
        if (rc) break;
        for (int64_t i = 0; i < T * H; i++) b.x[i] += b.y[i];
        for (int64_t t = 0; t < T; t++) rmsnorm(b.x + t * H, L->ffn_norm, H, m->eps, b.h + t * H);
        float *ffo = b.y;
        if (distinct) distinct[l] = 0;
        if (L->router.rows) {
            const int64_t E = L->router.rows, k = m->k;
            UNTIMED();
            rc = pr_mm(m, b.h, T, H, &L->router, b.rl, nth);
            LAP(0);
            if (rc) break;
            for (int64_t t = 0; t < T; t++)
                route_softmax(b.rl + t * E, E, k, m->norm_topk, m->wscale, b.ids + t * k, b.wts + t * k);
            if (distinct) {
                uint64_t seen[64] = {0};                   /* E <= 4096: the experts counted once each */
                int32_t n = 0;
                for (int64_t i = 0; i < T * k; i++) {
                    const int32_t e = b.ids[i];
                    if (e < 0 || e >= 4096 || (seen[e >> 6] >> (e & 63) & 1)) continue;
                    seen[e >> 6] |= 1ull << (e & 63);
                    n++;
                }
                distinct[l] = n;
            }
            UNTIMED();
            rc = (m->moe_tile_t > 0 && T >= m->moe_tile_t ? moe_tile_act : moe_ffn_act)(
                b.h, T, H, b.ids, b.wts, k, L->gate_exps.w, L->up_exps.w, L->gate_exps.type, m->n_ff_exp, E,
                L->down_exps.w, L->down_exps.type, b.y, nth, &ACT_SILU);
            LAP(2);
            if (rc) break;
            ffo = b.y2;
        }
        if (L->gate.rows) {
            const int64_t F = L->gate.rows;
            UNTIMED();
            rc = pr_mm(m, b.h, T, H, &L->gate, b.g, nth);
            if (!rc) rc = pr_mm(m, b.h, T, H, &L->up, b.u, nth);
            if (rc) break;
            for (int64_t i = 0; i < T * F; i++) b.g[i] = silu(b.g[i]) * b.u[i];
            rc = pr_mm(m, b.g, T, F, &L->down, ffo, nth);
            LAP(0);
            if (rc) break;
            if (L->router.rows)
                for (int64_t i = 0; i < T * H; i++) b.y[i] += b.y2[i];
        }
        for (int64_t i = 0; i < T * H; i++) b.x[i] += b.y[i];
    }
    if (rc) return rc;
    int64_t nt = 0;                                        /* the rows wanted, normed into b.h in order */
    for (int64_t s = 0, t = 0; s < nseq; t += seqs[s].T, s++)
        for (int64_t i = all ? 0 : seqs[s].T - 1; i < seqs[s].T; i++, nt++)
            rmsnorm(b.x + (t + i) * H, m->out_norm, H, m->eps, b.h + nt * H);
    UNTIMED();
    rc = pr_mm(m, b.h, nt, H, &m->head, logits, nth);
    LAP(0);
#undef LAP
#undef UNTIMED
    return rc;
}

/* A prompt chunk of one sequence in the model's own cache: hm_batch_step with one sequence. tokens [T] at
 * positions pos0..; logits of every token (all = 1: [T][n_vocab]) or of the last ([n_vocab]). scratch:
 * hm_prompt_scratch(m, T) bytes. */
int hm_prompt_step(const hm_dmodel *m, const int64_t *tokens, int64_t T, int64_t pos0, const float *cs,
                   const float *sn, float *logits, int all, uint8_t *scratch, double *times) {
    const hm_seq one = {T, pos0, m->slots, NULL, NULL};
    return hm_batch_step(m, tokens, &one, 1, cs, sn, logits, all, scratch, times, NULL);
}

/* ------------------------------------------------------------------ info */

int hm_type_supported(int id) { return type_index(id) >= 0; }

/* An _R4 / _R8 tensor's rows back to its base type's rows (the inverse of ik_llama.cpp's repacking, -rtr), so
 * they take the base type's kernels. src: ngroups groups of R interleaved rows (R hdr-byte row headers, then nb
 * chunks of R bb-byte blocks); each chunk is a fixed bit permutation of the R base blocks, given as gather
 * tables (quant/ref_interleaved.py derives them from the packing code): whole bytes out[cj] = in[cs], and runs
 * of bits seg[i] = {dst byte, src byte, right shift, mask, left shift}: out[d] |= ((in[s] >> r) & m) << l.
 * dst: the rows in order, hdr + nb * bb bytes each. */
int hm_deinterleave(const uint8_t *src, uint8_t *dst, int64_t ngroups, int R, int64_t nb, int bb, int hdr,
                    const int64_t *cj, const int64_t *cs, int64_t ncj, const int64_t *seg, int64_t nseg,
                    int nthreads) {
    if (ngroups < 0 || R < 1 || nb < 1 || bb < 1 || hdr < 0) return -1;
    const int64_t rb = hdr + nb * bb, gb = (int64_t)R * rb;
    const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
    int bad = 0;
#pragma omp parallel num_threads(nth)
    {
        uint8_t *out = malloc((size_t)R * bb);
        if (!out) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < ngroups; g++) {
            if (!out) continue;
            const uint8_t *in = src + g * gb;
            uint8_t *rows = dst + g * gb;
            for (int r = 0; r < R; r++) memcpy(rows + r * rb, in + r * hdr, (size_t)hdr);
            for (int64_t k = 0; k < nb; k++) {
                const uint8_t *x = in + (int64_t)R * hdr + k * R * bb;
                memset(out, 0, (size_t)R * bb);
                for (int64_t i = 0; i < ncj; i++) out[cj[i]] = x[cs[i]];
                for (int64_t i = 0; i < nseg; i++) {
                    const int64_t *sg = seg + 5 * i;
                    out[sg[0]] |= (uint8_t)(((x[sg[1]] >> sg[2]) & sg[3]) << sg[4]);
                }
                for (int r = 0; r < R; r++) memcpy(rows + r * rb + hdr + k * bb, out + r * bb, (size_t)bb);
            }
        }
        free(out);
    }
    return bad ? -2 : 0;
}

/* whether single-token rows of this ggml type take the integer path now (this CPU, path and setting) */
int hm_int8_type(int id) {
    const int ti = type_index(id);
    return ti >= 0 && (INT8_MASK >> ti & 1) && q8_type(ti, 64);
}

/* ggml type ids whose single-token rows use the integer path: ids[0..n) (n = 0: fp32
 * activations everywhere; n < 0: the default set). Returns how many types were accepted. */
int hm_set_int8(const int *ids, int n) {
    if (n < 0) { g_int8_default = 1; return __builtin_popcount(INT8_MASK); }
    unsigned m = 0;
    int ok = 0;
    for (int i = 0; i < n; i++) {
        const int ti = type_index(ids[i]);
        if (ti >= 0 && q8_type(ti, 64)) { m |= 1u << ti; ok++; }
    }
    g_int8 = m;
    g_int8_default = 0;
    return ok;
}

/* 1 (the default): large batches compute every (row, token) as single tokens do (canonical_type); 0: the earlier
 * large-batch paths (bf16 tiles), faster on AMX but batch-dependent. Another value: query. Returns the previous. */
int hm_set_exact(int on) {
    const int prev = g_exact;
    if (on == 0 || on == 1) g_exact = on;
    return prev;
}

/* activation terms of the integer path: 1 (int8, as ggml's q8_0) or 2 (two int8 terms, ~15 bits; the default);
 * another value: query. Returns the previous (or current) count. */
int hm_set_act_terms(int n) {
    const int prev = g_xterms;
    if (n == 1 || n == 2) g_xterms = n;
    return prev;
}

/* the vector kernels to use: 2 AVX-512, 1 AVX2, 0 portable C; -1 (or more than this CPU has): the best
 * this build has. Tests lower it to check the AVX2 and portable paths on an AVX-512 machine. Returns the
 * previous level. */
int hm_set_simd(int level) {
    const int prev = g_simd;
    g_simd = level < 0 || level > SIMD_BEST ? SIMD_BEST : level;
    return prev;
}

const char *hm_simd(void) {
    return g_simd == 2 ? (HM_VNNI ? "avx512-vnni" : "avx512") : g_simd == 1 ? (HM_AVXVNNI ? "avx2-vnni" : "avx2")
                                                                          : "generic";
}
