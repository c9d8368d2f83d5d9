/* The integer path's quantized activations (quant_x8) and its canonical products (cdot_ref).
 * Part of cpu_moe.c (every unit): included there, in order, never compiled alone. */

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
/* the same on 256 bits, for every AVX2 CPU without AVX-512: with AVX-VNNI (Intel client cores since Alder Lake)
 * vpdpbusd, without it (Haswell, Zen 2/3) vpmaddubsw + vpmaddwd (dp256: exact, the same int32 sums); GFNI's
 * nibble unpack becomes shifts and masks where the CPU lacks it */
#define HM_AVXVNNI HM_AVX2
#if HM_AVX2 && defined(__AVXVNNI__)
#define HM_DPBUSD256 1
#else
#define HM_DPBUSD256 0
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

/* the canonical record of block b: d/256, the exact block sum of X, the per-16 sums exact and as floats (all paths) */
static inline void xq8_sums(const xq8 *q, int64_t b, float xs, int t1, int t2, const int g1[2], const int g2[2]) {
    q->xsb[b] = xs;
    q->sxi[b] = 256 * t1 + t2;
    for (int h = 0; h < 2; h++) {
        q->sx16[2 * b + h] = xs * (float)(256 * g1[h] + g2[h]);
        for (int i = 0; i < 4; i++) q->sxi4[(2 * b + h) * 4 + i] = 256 * g1[h] + g2[h];
    }
}

/* Activation terms of the integer path, per weight type (docs/cpu-kernels.md, "Activation terms per weight type").
 * 2: x ~ d/256 (256 q1 + q2), about 15 bits; 1: q2 = 0, plain int8 as ggml's q8_0 (the same formulas with q2 = 0,
 * so every kernel stays canonical; the kernels skip the second term's products). A matrix takes one term where
 * its weight type's own quantization error on a layer's output is >= ~20x the one-term activation error
 * (benchmarks/act_error.py: errors add in quadrature, so the result's error grows by ~0.1%; the 1-3.5-bit types),
 * two elsewhere: the 4-4.5-bit types sit at 11-16x (9-12x with outlier channels), where one term bought 2-6% of a
 * core and cost their logits llama.cpp's distance from the dequantized weights (docs/cpu-kernels.md). The count
 * is the weight type's, the same for every number of tokens, and the activations a matrix reads are quantized
 * with its type's count. MXFP4 keeps two: it is gpt-oss's own trained format, its weights are the model's, with
 * no quantization error of their own to hide a one-term error in. g_xterms: 0 the rule; 1 or 2 for every type
 * (hm_set_act_terms). */
HM_STATE(int g_xterms, 0);
#define ONE_TERM_TYPES ((1u << I_Q3_K) | (1u << I_Q2_K) | (1u << I_IQ3_K) | (1u << I_IQ2_K) | (1u << I_IQ2_KS) | \
                        (1u << I_IQ2_KL) | (1u << I_IQ3_XXS) | (1u << I_IQ3_S) | (1u << I_IQ2_XXS) | \
                        (1u << I_IQ2_XS) | (1u << I_IQ1_S) | (1u << I_IQ1_M) | (1u << I_IQ2_KT) | (1u << I_IQ3_KT))
static inline int act_terms(int ti) {
    return g_xterms ? g_xterms : (ONE_TERM_TYPES >> ti & 1) ? 1 : 2;
}

/* quantize blocks [b0, b1) of 32 elements of x (b0, b1 even) in `terms` int8 terms (act_terms of the weight
 * type that reads them) */
static void quant_x8(const float *x, int64_t b0, int64_t b1, const xq8 *q, int terms) {
    const float t2 = terms > 1 ? 1.0f : 0.0f;            /* the second term, or none */
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
 * With X = 256 q1 + q2 the quantized activations (quant_x8: xs_b = d/256 per 32-block b; q2 = 0 for the weight
 * types that take one term, act_terms):
 * - 32-weight block types (Q4_0: v = q - 8; Q8_0: v = q; IQ4_NL, MXFP4: v = the table's integer; scale dw):
 *     I_b = sum v X over the block (exact int32), acc = fma((float)I_b, dw_b * xs_b, acc), b ascending.
 * - Q4_K, Q5_K (sub-block j of 32 in a super-block; S_j = d sc_j, M_j = dmin m_j, v = q unsigned):
 *     acc = fma((float)I_b, S_j * xs_b, acc), accm = fma(M_j, sx_b, accm) (sx_b = xs_b sum X, quant_x8's sxf),
 *     two chains, b ascending; the result is acc - accm.
 * - Q6_K and the x types (every type whose scales are per 16: IQ4_XS, Q3_K, Q2_K, the K/KS/KL, grid and trellis
 *   types; sub-block i of 16 along the row, S_i, M_i as x_scales or prep_k, v = u - X_OFF, Q6_K: q - 32):
 *     I_i = sum v X over the 16, four chains by i mod 4: acc_(i%4) = fma((float)I_i, S_i * xs_(i/2), acc_(i%4)),
 *     Q2_K: accm_(i%4) = fma(M_i, sx16_i, accm_(i%4)) (sx16_i = xs sum X over the 16, quant_x8's sx16); the
 *     result is ((acc_0 + acc_1) + (acc_2 + acc_3)) - ((accm_0 + accm_1) + (accm_2 + accm_3)). Four chains, so
 *     that a kernel holding 4 sub-blocks of 4 rows in one vector takes them with one FMA (kern_qc).
 * Chains per (row, token) over the blocks in order: the integers are exact however a kernel sums them
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
    float accm = 0.0f, a4[4] = {0.0f, 0.0f, 0.0f, 0.0f}, m4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
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
                a4[i % 4] = fmaf((float)I, S[i] * q->xsb[e0 / 32], a4[i % 4]);
                if (X_MIN(ti)) m4[i % 4] = fmaf(M[i], q->sx16[e0 / 16], m4[i % 4]);
            }
        }
        return ((a4[0] + a4[1]) + (a4[2] + a4[3])) - ((m4[0] + m4[1]) + (m4[2] + m4[3]));
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
            if (ti == I_Q6_K) {
                a4[i % 4] = fmaf((float)I, S[i] * q->xsb[blk], a4[i % 4]);
                continue;
            }
            acc = fmaf((float)I, S[i] * q->xsb[blk], acc);
            accm = fmaf(M[i], q->sxf[blk], accm);
        }
    }
    return ti == I_Q6_K ? (a4[0] + a4[1]) + (a4[2] + a4[3]) : acc - accm;
}
