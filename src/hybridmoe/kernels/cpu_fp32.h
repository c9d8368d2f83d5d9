/* The fp32 row x token kernels (portable C, AVX2, AVX-512) and dot_rows, which picks the path in use.
 * Part of cpu_moe.c (every unit): included there, in order, never compiled alone. */

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

/* A kernel FN(ti, R, NT, ...) instantiated for every type and (R rows, NT tokens) shape dot_rows asks for (prefix
 * P): KSHAPES(KDEF, P, FN, TI) defines a type's instances (in a kernel unit: cpu_units.h), KSHAPES(KDECL, ...)
 * declares them; KTABLE(NAME, P) declares every type's and makes the table NAME[type][R][NT] of them. */
#define KFN(P, TI, R, NT) HM_HIDDEN void P##_##TI##_##R##_##NT(const uint8_t *const *w, const uint8_t *const *pf, \
                                                          int64_t K, const float *const *x, float *res)
#define KDECL(P, FN, TI, R, NT) KFN(P, TI, R, NT);
#define KDEF(P, FN, TI, R, NT) KFN(P, TI, R, NT) { FN(TI, R, NT, w, pf, K, x, res); }
#define KSHAPES(E, P, FN, TI) \
    E(P, FN, TI, 4, 1) E(P, FN, TI, 4, 2) E(P, FN, TI, 2, 1) E(P, FN, TI, 2, 2) E(P, FN, TI, 2, 3) \
    E(P, FN, TI, 2, 4) E(P, FN, TI, 1, 1) E(P, FN, TI, 1, 2) E(P, FN, TI, 1, 3) E(P, FN, TI, 1, 4)
#define KTROW(P, TI) { {0}, \
    {0, P##_##TI##_1_1, P##_##TI##_1_2, P##_##TI##_1_3, P##_##TI##_1_4}, \
    {0, P##_##TI##_2_1, P##_##TI##_2_2, P##_##TI##_2_3, P##_##TI##_2_4}, {0}, \
    {0, P##_##TI##_4_1, P##_##TI##_4_2, 0, 0} }
#define KDECLS(P, TI) KSHAPES(KDECL, P, , TI)
#define KTABLE(NAME, P) \
    KDECLS(P, I_F32) KDECLS(P, I_F16) KDECLS(P, I_BF16) KDECLS(P, I_Q4_0) KDECLS(P, I_Q8_0) KDECLS(P, I_Q4_K) \
    KDECLS(P, I_Q5_K) KDECLS(P, I_Q6_K) KDECLS(P, I_IQ4_NL) KDECLS(P, I_MXFP4) KDECLS(P, I_IQ4_XS) KDECLS(P, I_Q3_K) \
    KDECLS(P, I_Q2_K) KDECLS(P, I_IQ4_KS) KDECLS(P, I_IQ4_K) KDECLS(P, I_IQ3_K) KDECLS(P, I_IQ2_K) KDECLS(P, I_IQ5_K) \
    KDECLS(P, I_IQ2_KS) KDECLS(P, I_IQ2_KL) KDECLS(P, I_IQ3_XXS) KDECLS(P, I_IQ3_S) KDECLS(P, I_IQ2_XXS) \
    KDECLS(P, I_IQ2_XS) KDECLS(P, I_IQ1_S) KDECLS(P, I_IQ1_M) KDECLS(P, I_IQ2_KT) KDECLS(P, I_IQ3_KT) \
    KDECLS(P, I_IQ4_KT) \
    static const kern_fn NAME[N_TYPES][5][5] = { \
        [I_F32] = KTROW(P, I_F32), [I_F16] = KTROW(P, I_F16), [I_BF16] = KTROW(P, I_BF16), \
        [I_Q4_0] = KTROW(P, I_Q4_0), [I_Q8_0] = KTROW(P, I_Q8_0), [I_Q4_K] = KTROW(P, I_Q4_K), \
        [I_Q5_K] = KTROW(P, I_Q5_K), [I_Q6_K] = KTROW(P, I_Q6_K), [I_IQ4_NL] = KTROW(P, I_IQ4_NL), \
        [I_MXFP4] = KTROW(P, I_MXFP4), [I_IQ4_XS] = KTROW(P, I_IQ4_XS), [I_Q3_K] = KTROW(P, I_Q3_K), \
        [I_Q2_K] = KTROW(P, I_Q2_K), [I_IQ4_KS] = KTROW(P, I_IQ4_KS), [I_IQ4_K] = KTROW(P, I_IQ4_K), \
        [I_IQ3_K] = KTROW(P, I_IQ3_K), [I_IQ2_K] = KTROW(P, I_IQ2_K), [I_IQ5_K] = KTROW(P, I_IQ5_K), \
        [I_IQ2_KS] = KTROW(P, I_IQ2_KS), [I_IQ2_KL] = KTROW(P, I_IQ2_KL), [I_IQ3_XXS] = KTROW(P, I_IQ3_XXS), \
        [I_IQ3_S] = KTROW(P, I_IQ3_S), [I_IQ2_XXS] = KTROW(P, I_IQ2_XXS), [I_IQ2_XS] = KTROW(P, I_IQ2_XS), \
        [I_IQ1_S] = KTROW(P, I_IQ1_S), [I_IQ1_M] = KTROW(P, I_IQ1_M), [I_IQ2_KT] = KTROW(P, I_IQ2_KT), \
        [I_IQ3_KT] = KTROW(P, I_IQ3_KT), [I_IQ4_KT] = KTROW(P, I_IQ4_KT), };

#if HM_AVX2

/* fp16 -> fp32 lookup (256 KiB): a block scale becomes one scalar load that the multiply
 * broadcasts from memory, instead of insert + convert + broadcast shuffles per block */
HM_STATE(float g_f16[65536], {0});
#if HM_MAIN
__attribute__((constructor)) static void init_f16_table(void) {
    for (uint32_t i = 0; i < 65536; i++) g_f16[i] = fp16_to_f32((uint16_t)i);
}
#endif

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

/* 8 lanes of trellis seeds -> the generator's 4-byte sums after steps p[lane] (0..252; v = sum - 126) */
HM_INLINE __m256i kt_sums8(__m256i x, __m256i p) {
    const __m256i s = _mm256_and_si256(_mm256_mullo_epi32(x, p), _mm256_set1_epi32(0x3F3F3F3F));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(s, _mm256_set1_epi8(1)), _mm256_set1_epi16(1));
}

/* unit u (elements 32u..32u+31) of trellis-type super-block b as u (x_value), in element order */
HM_INLINE __m256i kt_u32(const int ti, const uint8_t *b, const int u) {
    const uint32_t k1 = KT_KA, k2 = k1 * KT_KA, k3 = k2 * KT_KA, k4 = k3 * KT_KA;
    __m256i s[4];
    if (ti == I_IQ4_KT) {   /* block u: 8 groups of 4 */
        uint32_t shb;
        memcpy(&shb, b + 4 * u, 4);
        const __m256i top = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)shb),
                                                               _mm256_setr_epi32(8, 11, 14, 17, 20, 23, 26, 29)),
                                             _mm256_set1_epi32(7));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
            (const __m128i *)(b + 96 + 8 * (u & 3)))), 4 * (u >> 2)), _mm256_set1_epi32(0xF));
        __m256i x = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 32 + 8 * u))),
                                    _mm256_or_si256(_mm256_slli_epi32(hi, 8), _mm256_slli_epi32(top, 12)));
        x = _mm256_add_epi32(x, _mm256_set1_epi32((int)(4096 + 32768 * (shb & 1))));
        const __m256i p = _mm256_setr_epi32(k1, k2, k3, k4, k1, k2, k3, k4);
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++)
            s[q] = kt_sums8(_mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1,
                                                                             2 * q + 1, 2 * q + 1, 2 * q + 1)), p);
    } else {                /* 4 groups of 8: a u16 index each */
        const uint32_t k5 = k4 * KT_KA, k6 = k5 * KT_KA, k7 = k6 * KT_KA, k8 = k7 * KT_KA;
        const __m256i p = _mm256_setr_epi32(k1, k2, k3, k4, k5, k6, k7, k8);
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) s[q] = kt_sums8(_mm256_set1_epi32(4096 + rd16(b + 4 + 8 * u + 2 * q)), p);
    }
    const __m256i v = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(_mm256_packus_epi32(s[0], s[1]),
                                                                      _mm256_packus_epi32(s[2], s[3])),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (ti != I_IQ3_KT) return _mm256_add_epi8(v, _mm256_set1_epi8(2));      /* 128 + v = sum + 2 */
    /* IQ3_KT: 128 +- |v|; the sign of element l of 32-block u is bit u of qh[l] */
    const __m256i m = _mm256_cmpgt_epi8(_mm256_setzero_si256(),
                                        _mm256_slli_epi16(_mm256_loadu_si256((const __m256i *)(b + 68)), 7 - u));
    const __m256i a = _mm256_abs_epi8(_mm256_sub_epi8(v, _mm256_set1_epi8(126)));
    return _mm256_add_epi8(_mm256_set1_epi8((char)128), _mm256_sub_epi8(_mm256_xor_si256(a, m), m));
}

/* the 32 sign bits of sub-block u of an XXS type: its four 7-bit codes spread to bytes, their parities on top */
HM_INLINE uint32_t xxs_neg32(const int ti, const uint8_t *b, const int u) {
    uint32_t aux;
    memcpy(&aux, b + (ti == I_IQ3_XXS ? 66 + 4 * u : 6 + 8 * u), 4);
    return (uint32_t)codes_neg((aux & 0x7Fu) | (aux << 1 & 0x7F00u) | (aux << 2 & 0x7F0000u) | (aux << 3 & 0x7F000000u));
}

/* unit u (elements 32u..32u+31) of grid-type super-block b as u (x_value), in element order */
HM_INLINE __m256i grid_u32(const int ti, const uint8_t *b, const int u) {
    __m256i g;
    uint32_t neg;
    if (ti == I_IQ3_XXS || ti == I_IQ3_S) {   /* 8 indices of 4 magnitudes */
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * u)));
        if (ti == I_IQ3_S) {   /* 9th index bits: byte 66 + u; plain sign bytes */
            idx = _mm256_or_si256(idx, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(
                _mm256_set1_epi32(b[66 + u]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), _mm256_set1_epi32(1)), 8));
            memcpy(&neg, b + 74 + 4 * u, 4);
            g = _mm256_i32gather_epi32((const int *)IQ3S_GRID, idx, 4);
        } else {
            neg = xxs_neg32(ti, b, u);
            g = _mm256_i32gather_epi32((const int *)IQ3XXS_GRID, idx, 4);
        }
    } else {                                  /* 4 indices of 8 values */
        __m128i idx;
        const long long *grid = (const long long *)(ti == I_IQ2_XXS ? IQ2XXS_GRID : ti == I_IQ2_XS ? IQ2XS_GRID : IQ1S_GRID);
        switch (ti) {
        case I_IQ2_XXS: {   /* sub-block u: 4 index bytes, then its u32 of codes and scale */
            uint32_t iw;
            memcpy(&iw, b + 2 + 8 * u, 4);
            idx = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)iw));
            neg = xxs_neg32(ti, b, u);
            break;
        }
        case I_IQ2_XS: {    /* a u16 per 8: 9-bit index, 7-bit code */
            const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * u));
            idx = _mm_and_si128(_mm_cvtepu16_epi32(q), _mm_set1_epi32(511));
            neg = (uint32_t)codes_neg((uint32_t)_mm_cvtsi128_si32(_mm_packus_epi16(_mm_srli_epi16(q, 9), _mm_setzero_si128())));
            break;
        }
        case I_IQ1_S: {     /* 4 index bytes; 3 index bits each, the scale and the delta's sign in qh[u] */
            const int qh = rd16(b + 34 + 2 * u);
            uint32_t iw;
            memcpy(&iw, b + 2 + 4 * u, 4);
            idx = _mm_or_si128(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)iw)), _mm_slli_epi32(_mm_and_si128(
                _mm_srlv_epi32(_mm_set1_epi32(qh), _mm_setr_epi32(0, 3, 6, 9)), _mm_set1_epi32(7)), 8));
            neg = qh & 0x8000 ? 0xFFFFFFFFu : 0;
            break;
        }
        default: {          /* IQ1_M: group k: an index byte, a nibble of 3 index bits and the delta's sign */
            const int nb = rd16(b + 32 + 2 * u);
            uint32_t iw;
            memcpy(&iw, b + 4 * u, 4);
            idx = _mm_or_si128(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)iw)), _mm_slli_epi32(_mm_and_si128(
                _mm_srlv_epi32(_mm_set1_epi32(nb), _mm_setr_epi32(0, 4, 8, 12)), _mm_set1_epi32(7)), 8));
            neg = 0;
            for (int k = 0; k < 4; k++) neg |= (uint32_t)((nb >> (4 * k + 3)) & 1) * 0xFFu << 8 * k;
            break;
        }
        }
        g = _mm256_i32gather_epi64(grid, idx, 8);
    }
    /* the 32 sign bits -> a byte mask m (0 or -1 a byte) */
    const __m256i bits = _mm256_set1_epi64x(0x8040201008040201ll);
    const __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)neg), _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)), bits), bits);
    if (ti == I_IQ1_S || ti == I_IQ1_M)       /* 64 + 8 v, then + 1 or - 1 */
        return _mm256_add_epi8(g, _mm256_add_epi8(_mm256_set1_epi8(1), _mm256_add_epi8(m, m)));
    return _mm256_add_epi8(_mm256_set1_epi8(64), _mm256_sub_epi8(_mm256_xor_si256(g, m), m));   /* 64 +- g */
}

/* unit u (32 elements) of x-type super-block b as unsigned bytes (16-bit shifts: the masks drop what crosses
 * bytes) */
HM_INLINE __m256i x_u32(const int ti, const uint8_t *b, const int u) {
    __m256i q;
    if (X_GRID(ti)) return grid_u32(ti, b, u);
    if (X_KT(ti)) return kt_u32(ti, b, u);
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
    case I_IQ5_K: case I_IQ2_KS: case I_IQ2_KL: case I_IQ3_XXS: case I_IQ3_S: case I_IQ2_XXS:
    case I_IQ2_XS: case I_IQ1_S: case I_IQ1_M: case I_IQ2_KT: case I_IQ3_KT: case I_IQ4_KT:
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

KTABLE(KTAB2, k2)

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
    case I_IQ5_K: case I_IQ2_KS: case I_IQ2_KL: case I_IQ3_XXS: case I_IQ3_S: case I_IQ2_XXS:
    case I_IQ2_XS: case I_IQ1_S: case I_IQ1_M: case I_IQ2_KT: case I_IQ3_KT: case I_IQ4_KT: {
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

KTABLE(KTAB, k)
#endif /* HM_AVX512 */

/* the vector kernels in use: 2 AVX-512, 1 AVX2, 0 portable C (hm_set_simd lowers it for tests) */
#define SIMD_BEST (HM_AVX512 ? 2 : HM_AVX2 ? 1 : 0)
HM_STATE(int g_simd, SIMD_BEST);

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
