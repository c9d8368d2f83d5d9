/* The integer-path kernels (AVX-512 VNNI: kern_q8, kern_qc; AVX-VNNI), the types each path takes,
 * dot_rows1 and dot_rows_q.
 * Part of cpu_moe.c (every unit): included there, in order, never compiled alone. */

/* gf2p8affineqb matrices (one per qword): byte 7-i of a qword selects the input bits that
 * form output bit i. LO keeps bits 0-3, HI moves bits 4-7 down, BIT(k) moves bit k to bit 4. */
#define GF_LO 0x0102040800000000ull
#define GF_HI 0x1020408000000000ull
#define GF_BIT(k) ((uint64_t)(1u << (k)) << 24)
#define GF_2BITS(k) (GF_BIT(k) | (uint64_t)(1u << ((k) + 1)) << 16)   /* bits k, k+1 -> bits 4, 5 */
#define GF_2LOW(k) ((uint64_t)(1u << (k)) << 56 | (uint64_t)(1u << ((k) + 1)) << 48)   /* bits k, k+1 -> 0, 1 */
#define GF_TO2(k) ((uint64_t)(1u << (k)) << 40)                                       /* bit k -> bit 2 */

typedef void (*kq_fn)(const uint8_t *const *w, const uint8_t *const *pf, int64_t K, const xq8 *xq, float *res);
/* an integer-path kernel FN(ti, R, ...) for R of 1, 2, 4 rows (prefix P; KDEF / KDECL as KSHAPES), and a type's row
 * of the table [type][R] */
#define KQFN(P, TI, R) HM_HIDDEN void P##_##TI##_##R(const uint8_t *const *w, const uint8_t *const *pf, int64_t K, \
                                                  const xq8 *xq, float *res)
#define KQDECL(P, FN, TI, R) KQFN(P, TI, R);
#define KQDEF(P, FN, TI, R) KQFN(P, TI, R) { FN(TI, R, w, pf, K, xq, res); }
#define KQSHAPES(E, P, FN, TI) E(P, FN, TI, 1) E(P, FN, TI, 2) E(P, FN, TI, 4)
#define KQROW(P, TI) {0, P##_##TI##_1, P##_##TI##_2, 0, P##_##TI##_4}

/* the x types with a 256-bit integer kernel (the generic unit: x_u32, scales per 16) */
#define X256(ti) ((ti) == I_Q2_K || (ti) == I_Q3_K || (ti) == I_IQ4_XS || X_GRID(ti))

/* The 32-weight block types on the integer path: 16 bytes of nibbles after a scale, each nibble an entry of a
 * table of small integers (Q4_0: q - 8). vpdpbusd wants the weights unsigned, so the tables are offset by
 * 8 << B32_SHIFT and the offset is taken off with the blocks' -8 sum(q) << B32_SHIFT (c1, c2). */
#define IS_B32(ti) ((ti) == I_Q4_0 || (ti) == I_IQ4_NL || (ti) == I_MXFP4)
#define B32_SHIFT(ti) ((ti) == I_IQ4_NL ? 4 : (ti) == I_MXFP4 ? 1 : 0)          /* offsets 128, 16, 8 */
#define B32_QS(ti) ((ti) == I_MXFP4 ? 1 : 2)                                   /* where the nibbles start */
static const uint8_t KU8_MXFP4[16] = {16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4};
#if HM_AVX2
HM_STATE(float g_e8m0[256], {0});        /* MXFP4's block scales */
#if HM_MAIN
__attribute__((constructor)) static void init_e8m0_table(void) {
    for (int i = 0; i < 256; i++) g_e8m0[i] = e8m0_half((uint8_t)i);
}
#endif
/* a block's scale, as a float in memory (broadcast loads) */
#define B32_D(ti, b) ((ti) == I_MXFP4 ? &g_e8m0[(b)[0]] : &F16(b))
#endif

#if HM_AVX2
/* the 32 nibbles of 16 bytes: low nibbles (weights 0-15) in the low lane, high nibbles (16-31) in the high one */
HM_INLINE __m256i nib32(const uint8_t *p) {
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
#if defined(__GFNI__)
    return _mm256_gf2p8affine_epi64_epi8(q, _mm256_set_epi64x((long long)GF_HI, (long long)GF_HI, (long long)GF_LO,
                                                              (long long)GF_LO), 0);
#else
    return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
#endif
}
#endif

static int q8_type(int ti, int64_t K) {
    return K % 64 == 0 && (INT8_512 || INT8_256) &&
           (IS_B32(ti) || ti == I_Q4_K || ti == I_Q5_K || ti == I_Q6_K || ((ti == I_Q8_0 || IS_X(ti)) && INT8_512) ||
            (HM_AVXVNNI && X256(ti)));
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

/* sum over 4 weights of u (256 q1 + q2) per lane, exact */
HM_INLINE __m512i qc_dot(__m512i u, __m512i x1, __m512i x2) {
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x1), 8), u, x2);
}

/* rows4_lanes of the R rows' (1-4) products u[r] . (256 q1 + q2) with the activations at q1, q2 (64 bytes each).
 * One term (two = 0: q2 = 0): the q1 products only, and the shift by 8 once after the lanes are summed
 * (exact integers: the same sums). */
HM_INLINE __m512i qc_rows4(const __m512i *qv, const int R, const int8_t *q1, const int8_t *q2, const int two) {
    const __m512i z = _mm512_setzero_si512(), x1 = _mm512_load_si512(q1);
    if (!two)
        return _mm512_slli_epi32(rows4_lanes(_mm512_dpbusd_epi32(z, qv[0], x1),
                                             R > 1 ? _mm512_dpbusd_epi32(z, qv[1], x1) : z,
                                             R > 2 ? _mm512_dpbusd_epi32(z, qv[2], x1) : z,
                                             R > 3 ? _mm512_dpbusd_epi32(z, qv[3], x1) : z), 8);
    const __m512i x2 = _mm512_load_si512(q2);
    return rows4_lanes(qc_dot(qv[0], x1, x2), R > 1 ? qc_dot(qv[1], x1, x2) : z, R > 2 ? qc_dot(qv[2], x1, x2) : z,
                       R > 3 ? qc_dot(qv[3], x1, x2) : z);
}

#include "cpu_vnni_x.h"   /* x_u64, x_scales16, rows4_T, x_scales4 */

/* cdot_ref's four chains of a per-16 type in one vector (lane 4L + r: row r's chain L) -> per row r (lane r):
 * (chain 0 + chain 1) + (chain 2 + chain 3) */
HM_INLINE __m128 chains4(const __m512 a) {
    const __m512 s = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0xB1));   /* lanes 0: L0 + L1, 2: L2 + L3 */
    return _mm_add_ps(_mm512_castps512_ps128(s), _mm512_extractf32x4_ps(s, 2));
}

/* res[r * NT + t] = cdot_ref(row w[r], token xq[t]) for R rows (1, 2 or 4) and NT tokens (1-4), bit for bit:
 * the weights of a step are unpacked once for all NT tokens; per token the rows' lane sums are reduced to
 * block sums (rows4_lanes) and the float chains run over the rows: the per-32 types' in an xmm (one lane a
 * row), the per-16 types' four chains in a zmm (lane 4L + r: row r's sub-blocks i = L mod 4). */
HM_INLINE void kern_qc(const int ti, const int R, const int NT, const uint8_t *const *w, const uint8_t *const *pf,
                       int64_t K, const xq8 *const *xq, float *res) {
    __m128 acc[4], accm[4];                              /* accm: the K-quants' mins */
    __m512 a16[4], m16[4];                               /* the per-16 types' chains and Q2_K's mins */
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        acc[t] = accm[t] = _mm_setzero_ps();
        a16[t] = m16[t] = _mm512_setzero_ps();
    }
    const int two = act_terms(ti) > 1;                  /* the activations' terms (the weight type's count) */
    const int ts = TINFO[ti].ts;
    const int step = IS_K(ti) ? ts : 2 * ts;            /* bytes per iteration: 64 or 256 weights */
    const pfreg pr = pf_regions(R, w, pf);
    const int64_t rb = IS_K(ti) ? K / 256 * ts : K / 32 * ts;
    /* the rows' x_rowscale, row r's in lanes 4L + r (x_scales4) */
    const __m512 rd4 = XS4(ti) && R == 4 && X_HDR(ti) ?
        _mm512_broadcast_f32x4(_mm_setr_ps(x_rowscale(ti, w[0]), x_rowscale(ti, w[1]), x_rowscale(ti, w[2]),
                                           x_rowscale(ti, w[3]))) : _mm512_setzero_ps();
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
                __m512i l4 = qc_rows4(qv, R, q->q1 + e, q->q2 + e, two);
                l4 = _mm512_add_epi32(l4, _mm512_shuffle_i32x4(l4, l4, 0xB1));     /* lanes 0: block b, 2: b + 1 */
                const __m128i i0 = _mm_sub_epi32(_mm512_castsi512_si128(l4), _mm_set1_epi32(QC_OFF(ti) * q->sxi[b]));
                const __m128i i1 = _mm_sub_epi32(_mm512_extracti32x4_epi32(l4, 2),
                                                 _mm_set1_epi32(QC_OFF(ti) * q->sxi[b + 1]));
                acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(i0), _mm_mul_ps(dw0, _mm_set1_ps(q->xsb[b])), acc[t]);
                acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(i1), _mm_mul_ps(dw1, _mm_set1_ps(q->xsb[b + 1])), acc[t]);
            }
        } else if (IS_X(ti)) {
            /* scales (and Q2_K's mins) as [sub-block i][row] */
            __m512 Sc[4], Mc[4];
            int ex[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) ex[r] = x_extra16v(ti, w[r] + TINFO[ti].hdr + o);
            x_scales_rows(ti, R, w, o, rd4, Sc, Mc);
            if (X_MIN(ti)) {
                const __m512i i4 = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                       14, 15), 2);
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const __m512 sx = _mm512_loadu_ps(xq[t]->sx16 + e / 16);
#pragma GCC unroll 4
                    for (int c = 0; c < 4; c++)   /* lane 4L + r: sx16 of sub-block 4c + L */
                        m16[t] = _mm512_fmadd_ps(Mc[c], _mm512_permutexvar_ps(_mm512_add_epi32(i4,
                                                     _mm512_set1_epi32(4 * c)), sx), m16[t]);
                }
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
                    __m512i l4 = qc_rows4(qv, R, q->q1 + j, q->q2 + j, two);
                    if (X_OFF(ti))
                        l4 = _mm512_sub_epi32(l4, _mm512_slli_epi32(_mm512_load_si512(q->sxi4 + j / 4), X_OFF_SH(ti)));
                    const __m512 sc = _mm512_mul_ps(sv, _mm512_load_ps(q->xs + 16 * (j / 64)));
                    a16[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l4), sc, a16[t]);
                }
            }
        } else if (ti == I_Q6_K) {
            float Sm[16][4] __attribute__((aligned(64)));   /* [sub-block i][row] */
            q6_scales(R, w, o, Sm);
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
                        __m512i l4 = qc_rows4(qv, R, q->q1 + j, q->q2 + j, two);
                        l4 = _mm512_sub_epi32(l4, _mm512_slli_epi32(_mm512_load_si512(q->sxi4 + j / 4), 5));
                        const __m512 sc = _mm512_mul_ps(sv, _mm512_load_ps(q->xs + 16 * (j / 64)));
                        a16[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l4), sc, a16[t]);
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
                    __m512i l4 = qc_rows4(qv, R, q->q1 + jj, q->q2 + jj, two);
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
        _mm_storeu_ps(v, SB16(ti) ? chains4(a16[t]) : X_MIN(ti) ? _mm_sub_ps(chains4(a16[t]), chains4(m16[t])) :
                         IS_K(ti) ? _mm_sub_ps(acc[t], accm[t]) : acc[t]);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) res[r * NT + t] = v[r];
    }
}

typedef void (*kqc_fn)(const uint8_t *const *w, const uint8_t *const *pf, int64_t K, const xq8 *const *xq, float *res);
/* kern_qc's instances (KDEF / KDECL as KSHAPES) and the table KQC[type][R][NT] of them */
#define KQCFN(TI, R, NT) HM_HIDDEN void kqc_##TI##_##R##_##NT(const uint8_t *const *w, const uint8_t *const *pf, \
                                                             int64_t K, const xq8 *const *xq, float *res)
#define KQCDECL(TI, R, NT) KQCFN(TI, R, NT);
#define KQCDEF(TI, R, NT) KQCFN(TI, R, NT) { kern_qc(TI, R, NT, w, pf, K, xq, res); }
#define KQCSHAPES(E, TI) E(TI, 1, 1) E(TI, 1, 2) E(TI, 1, 3) E(TI, 1, 4) E(TI, 2, 1) E(TI, 2, 2) E(TI, 2, 3) \
    E(TI, 2, 4) E(TI, 4, 1) E(TI, 4, 2) E(TI, 4, 3) E(TI, 4, 4)
#define KQCROW(TI) { {0}, {0, kqc_##TI##_1_1, kqc_##TI##_1_2, kqc_##TI##_1_3, kqc_##TI##_1_4}, \
    {0, kqc_##TI##_2_1, kqc_##TI##_2_2, kqc_##TI##_2_3, kqc_##TI##_2_4}, {0}, \
    {0, kqc_##TI##_4_1, kqc_##TI##_4_2, kqc_##TI##_4_3, kqc_##TI##_4_4} }
#define KQCDECLS(TI) KQCSHAPES(KQCDECL, TI)
KQCDECLS(I_Q4_0) KQCDECLS(I_Q8_0) KQCDECLS(I_Q4_K) KQCDECLS(I_Q5_K) KQCDECLS(I_Q6_K) KQCDECLS(I_IQ4_NL)
KQCDECLS(I_MXFP4) KQCDECLS(I_IQ4_XS) KQCDECLS(I_Q3_K) KQCDECLS(I_Q2_K) KQCDECLS(I_IQ4_KS) KQCDECLS(I_IQ4_K)
KQCDECLS(I_IQ3_K) KQCDECLS(I_IQ2_K) KQCDECLS(I_IQ5_K) KQCDECLS(I_IQ2_KS) KQCDECLS(I_IQ2_KL) KQCDECLS(I_IQ3_XXS)
KQCDECLS(I_IQ3_S) KQCDECLS(I_IQ2_XXS) KQCDECLS(I_IQ2_XS) KQCDECLS(I_IQ1_S) KQCDECLS(I_IQ1_M)
KQCDECLS(I_IQ2_KT) KQCDECLS(I_IQ3_KT) KQCDECLS(I_IQ4_KT)
static const kqc_fn KQC[N_TYPES][5][5] = {
    [I_Q4_0] = KQCROW(I_Q4_0), [I_Q8_0] = KQCROW(I_Q8_0), [I_Q4_K] = KQCROW(I_Q4_K), [I_Q5_K] = KQCROW(I_Q5_K),
    [I_Q6_K] = KQCROW(I_Q6_K), [I_IQ4_NL] = KQCROW(I_IQ4_NL), [I_MXFP4] = KQCROW(I_MXFP4),
    [I_IQ4_XS] = KQCROW(I_IQ4_XS), [I_Q3_K] = KQCROW(I_Q3_K), [I_Q2_K] = KQCROW(I_Q2_K),
    [I_IQ4_KS] = KQCROW(I_IQ4_KS), [I_IQ4_K] = KQCROW(I_IQ4_K), [I_IQ3_K] = KQCROW(I_IQ3_K),
    [I_IQ2_K] = KQCROW(I_IQ2_K), [I_IQ5_K] = KQCROW(I_IQ5_K), [I_IQ2_KS] = KQCROW(I_IQ2_KS),
    [I_IQ2_KL] = KQCROW(I_IQ2_KL), [I_IQ3_XXS] = KQCROW(I_IQ3_XXS), [I_IQ3_S] = KQCROW(I_IQ3_S),
    [I_IQ2_XXS] = KQCROW(I_IQ2_XXS), [I_IQ2_XS] = KQCROW(I_IQ2_XS), [I_IQ1_S] = KQCROW(I_IQ1_S),
    [I_IQ1_M] = KQCROW(I_IQ1_M), [I_IQ2_KT] = KQCROW(I_IQ2_KT), [I_IQ3_KT] = KQCROW(I_IQ3_KT),
    [I_IQ4_KT] = KQCROW(I_IQ4_KT), };
#endif /* HM_VNNI */

#if HM_AVXVNNI
/* a + the sums of 4 products u.s of each 32-bit lane (u unsigned, s signed bytes) by vpmaddubsw + vpmaddwd, the
 * same int32 sums as vpdpbusd while no pair's sum leaves int16: the activations lie in [-127, 127], so u <= 128
 * is safe (2 * 128 * 127 < 2^15); BIG types (u up to 255) split u into u & 127 and u & 128. */
HM_INLINE __m256i dp256_mad(const __m256i a, const __m256i u, const __m256i s, const int big) {
    const __m256i one = _mm256_set1_epi16(1);
    if (!big) return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), one));
    const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(u, _mm256_set1_epi8(0x7F)), s);
    const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(u, _mm256_set1_epi8((char)0x80)), s);
    return _mm256_add_epi32(a, _mm256_add_epi32(_mm256_madd_epi16(lo, one), _mm256_madd_epi16(hi, one)));
}

/* the same: vpdpbusd where the CPU has AVX-VNNI */
HM_INLINE __m256i dp256(const __m256i a, const __m256i u, const __m256i s, const int big) {
#if HM_DPBUSD256
    (void)big;
    return _mm256_dpbusd_avx_epi32(a, u, s);
#else
    return dp256_mad(a, u, s, big);
#endif
}

#if HM_MAIN
/* Tests: out[n / 4] = sum of u[i] s[i] over each 4 bytes, by dp256_mad (n a multiple of 32); -1 without AVX2 */
int hm_dp256_test(const uint8_t *u, const int8_t *s, int64_t n, int big, int32_t *out) {
    for (int64_t i = 0; i < n; i += 32) {
        const __m256i uv = _mm256_loadu_si256((const __m256i *)(u + i));
        const __m256i sv = _mm256_loadu_si256((const __m256i *)(s + i));
        _mm256_storeu_si256((__m256i *)(out + i / 4), dp256_mad(_mm256_setzero_si256(), uv, sv, big));
    }
    return 0;
}
#endif

/* bits k, k+1 of each byte of v -> bits 4, 5 (mask 0x30) or bit k -> bit 4 (0x10), as GF_2BITS / GF_BIT: one
 * gf2p8affineqb with GFNI, else a 16-bit shift and a mask (the mask drops what crosses bytes) */
HM_INLINE __m256i bits_to4(const __m256i v, const int k, const int two) {
#if defined(__GFNI__)
    return _mm256_gf2p8affine_epi64_epi8(v, _mm256_set1_epi64x((long long)(two ? GF_2BITS(k) : GF_BIT(k))), 0);
#else
    const __m256i t = k < 4 ? _mm256_slli_epi16(v, 4 - k) : _mm256_srli_epi16(v, k - 4);
    return _mm256_and_si256(t, _mm256_set1_epi8(two ? 0x30 : 0x10));
#endif
}

/* prep_k for the 256-bit x kernels: Q2_K's, Q3_K's and the grid types' 16 scales (and Q2_K's mins) by vector ops:
 * the same values, without 16 passes of the scalar x_scales */
HM_INLINE void prep_x256(const int ti, const uint8_t *b, float rd, kscale *ks) {
    const __m128i m0f = _mm_set1_epi8(0x0F);
    if (ti == I_Q2_K) {               /* bytes 0-15: scale in the low nibble, min in the high one */
        const __m128i sc = _mm_loadu_si128((const __m128i *)b);
        const __m128i l = _mm_and_si128(sc, m0f), h = _mm_and_si128(_mm_srli_epi16(sc, 4), m0f);
        const __m256 d = _mm256_set1_ps(F16(b + 80)), dm = _mm256_set1_ps(F16(b + 82));
        for (int k = 0; k < 2; k++) {
            const __m128i lk = k ? _mm_srli_si128(l, 8) : l, hk = k ? _mm_srli_si128(h, 8) : h;
            _mm256_storeu_ps(ks->s + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lk))));
            _mm256_storeu_ps(ks->m + 8 * k, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hk))));
        }
    } else if (ti == I_Q3_K) {        /* 6-bit scales: low 4 bits in bytes 96-103, high 2 in the u32 at 104 */
        uint32_t h;
        memcpy(&h, b + 104, 4);
        const __m128i s8 = _mm_loadl_epi64((const __m128i *)(b + 96));
        const __m256i hv = _mm256_set1_epi32((int)h), m3 = _mm256_set1_epi32(3);
        const __m256 d = _mm256_set1_ps(F16(b + 108));
        for (int k = 0; k < 2; k++) {     /* sub-blocks 8k..8k+7: nibble k of bytes 0-7; bits 8 (i % 4) + 2 (i / 4) */
            const __m256i l = _mm256_cvtepu8_epi32(_mm_and_si128(k ? _mm_srli_epi16(s8, 4) : s8, m0f));
            const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(hv, k ? _mm256_setr_epi32(4, 12, 20, 28, 6, 14, 22, 30)
                                                                         : _mm256_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26)), m3);
            const __m256i q = _mm256_sub_epi32(_mm256_or_si256(l, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
            const __m256 sv = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
            _mm256_storeu_ps(ks->s + 8 * k, sv);
            _mm256_storeu_ps(ks->m + 8 * k, _mm256_mul_ps(_mm256_set1_ps((float)X_OFF(I_Q3_K)), sv));
        }
    } else if (X_GRID(ti)) {
        const __m256 off = _mm256_set1_ps((float)X_OFF(ti));
        __m256 s0, s1;
        if (ti == I_IQ2_XS || ti == I_IQ1_M) {   /* a scale per 16 */
            __m256i f0, f1;
            if (ti == I_IQ2_XS) {                 /* d (s + 0.5) 0.25, s the nibbles at b + 66, low ones first */
                const __m128i x = _mm_loadl_epi64((const __m128i *)(b + 66));
                const __m128i n = _mm_unpacklo_epi8(_mm_and_si128(x, m0f), _mm_and_si128(_mm_srli_epi16(x, 4), m0f));
                f0 = _mm256_cvtepu8_epi32(n);
                f1 = _mm256_cvtepu8_epi32(_mm_srli_si128(n, 8));
            } else {                              /* d (2 f + 1) / 8, f bits 3 (i % 4) of the u16 i / 4 at b + 48 */
                const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9), m7 = _mm256_set1_epi32(7);
                f0 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_setr_epi32(rd16(b + 48), rd16(b + 48), rd16(b + 48),
                    rd16(b + 48), rd16(b + 50), rd16(b + 50), rd16(b + 50), rd16(b + 50)), sh), m7);
                f1 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_setr_epi32(rd16(b + 52), rd16(b + 52), rd16(b + 52),
                    rd16(b + 52), rd16(b + 54), rd16(b + 54), rd16(b + 54), rd16(b + 54)), sh), m7);
            }
            if (ti == I_IQ2_XS) {
                const __m256 d = _mm256_set1_ps(F16(b)), h = _mm256_set1_ps(0.5f), q = _mm256_set1_ps(0.25f);
                s0 = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_add_ps(_mm256_cvtepi32_ps(f0), h)), q);
                s1 = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_add_ps(_mm256_cvtepi32_ps(f1), h)), q);
            } else {
                const __m256 d = _mm256_set1_ps(g_f16[iq1m_d(b)]), e = _mm256_set1_ps(0.125f);
                const __m256i one = _mm256_set1_epi32(1);
                s0 = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(f0, 1), one))), e);
                s1 = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(f1, 1), one))), e);
            }
        } else {                                  /* a scale per 32, each stored twice */
            __m256 sv;
            if (ti == I_IQ3_XXS || ti == I_IQ2_XXS) {   /* d (v + 1/2) / 2 (/ 4), v the top 4 bits of a u32 per 32 */
                __m256i u;
                if (ti == I_IQ3_XXS) {
                    u = _mm256_loadu_si256((const __m256i *)(b + 66));          /* bytes 66-97 */
                } else {                          /* the second u32 of each 8 bytes from b + 2 */
                    const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
                    u = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(b + 2)), odd),
                                           _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(b + 34)), odd),
                                           0xF0);
                }
                const __m256 v = _mm256_cvtepi32_ps(_mm256_srli_epi32(u, 28));
                sv = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(F16(b)), _mm256_add_ps(v, _mm256_set1_ps(0.5f))),
                                   _mm256_set1_ps(ti == I_IQ3_XXS ? 0.5f : 0.25f));
            } else if (ti == I_IQ3_S) {           /* d (1 + 2 s), s the nibbles at b + 106 */
                uint32_t lw;
                memcpy(&lw, b + 106, 4);
                const __m128i x = _mm_cvtsi32_si128((int)lw);
                const __m256i s = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(x, m0f),
                                                                         _mm_and_si128(_mm_srli_epi16(x, 4), m0f)));
                sv = _mm256_mul_ps(_mm256_set1_ps(F16(b)), _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(s, 1),
                                                                                               _mm256_set1_epi32(1))));
            } else {                              /* IQ1_S: d (2 f + 1) / 8, f bits 12-14 of a u16 per 32 at b + 34 */
                const __m256i f = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128((const __m128i *)(b + 34))), 12), _mm256_set1_epi32(7));
                sv = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(F16(b)), _mm256_cvtepi32_ps(_mm256_add_epi32(
                    _mm256_slli_epi32(f, 1), _mm256_set1_epi32(1)))), _mm256_set1_ps(0.125f));
            }
            const __m256 lo = _mm256_unpacklo_ps(sv, sv), hi = _mm256_unpackhi_ps(sv, sv);   /* each twice */
            s0 = _mm256_permute2f128_ps(lo, hi, 0x20);
            s1 = _mm256_permute2f128_ps(lo, hi, 0x31);
        }
        _mm256_storeu_ps(ks->s, s0);
        _mm256_storeu_ps(ks->s + 8, s1);
        _mm256_storeu_ps(ks->m, _mm256_mul_ps(off, s0));
        _mm256_storeu_ps(ks->m + 8, _mm256_mul_ps(off, s1));
    } else {
        prep_k(ti, b, rd, ks);
    }
}

/* kern_q8 on 256 bits (AVX-VNNI or AVX2): one 32-weight block (Q4_0) or 32 weights of a K or x super-block per
 * vector */
HM_INLINE void kern_q8_256(const int ti, const int R, const uint8_t *const *w, const uint8_t *const *pf,
                           int64_t K, const xq8 *xq, float *res) {
    __m256 acc[4], accm[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    const int ts = TINFO[ti].ts;
    const int two = act_terms(ti) > 1;                   /* one term: q2 = 0, its products skipped */
    const int step = IS_B32(ti) ? 2 * ts : ts;           /* bytes per iteration: 64 or 256 weights */
    const pfreg pr = pf_regions(R, w, pf);
    const int64_t rb = IS_B32(ti) ? K / 32 * ts : K / 256 * ts;
    float rd[4];                                         /* x types' row scales */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) rd[r] = IS_X(ti) ? x_rowscale(ti, w[r]) : 1.0f;
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
                    __m256i q = nib32(bl + B32_QS(ti));
                    if (ti != I_Q4_0) q = _mm256_shuffle_epi8(tab, q);  /* nibble -> table value + offset */
                    __m256i a = _mm256_slli_epi32(dp256(c1, q, x1, ti == I_IQ4_NL), 8);   /* c1, c2: the offset */
                    if (two) a = _mm256_add_epi32(dp256(a, q, x2, ti == I_IQ4_NL), c2);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(_mm256_broadcast_ss(B32_D(ti, bl)), xs),
                                             acc[r]);
                }
            }
        } else if (IS_X(ti)) {                            /* x types: 8 units of 32 (x_u32), scales per 16 */
            kscale ks[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                prep_x256(ti, w[r] + TINFO[ti].hdr + o, rd[r], &ks[r]);
                accm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(ks[r].m), _mm256_loadu_ps(xq->sx16 + e / 16), accm[r]);
                accm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(ks[r].m + 8), _mm256_loadu_ps(xq->sx16 + e / 16 + 8),
                                          accm[r]);
            }
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) {
                const int64_t j = e + 32 * u;
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq->q1 + j));
                const __m256i x2 = _mm256_loadu_si256((const __m256i *)(xq->q2 + j));
                const __m256 xs = _mm256_loadu_ps(xq->xs + 16 * (j / 64) + 8 * ((j / 32) & 1));
                const int v = 2 * (u & 3);                /* sub-blocks 2u, 2u + 1 in ks.s[8 (u / 4) ..] */
                const __m256i si = _mm256_setr_epi32(v, v, v, v, v + 1, v + 1, v + 1, v + 1);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m256i q = x_u32(ti, w[r] + TINFO[ti].hdr + o, u);
                    __m256i a = _mm256_slli_epi32(dp256(_mm256_setzero_si256(), q, x1, X_OFF(ti) > 64), 8);
                    if (two) a = dp256(a, q, x2, X_OFF(ti) > 64);
                    const __m256 ws = _mm256_permutevar8x32_ps(_mm256_loadu_ps(ks[r].s + 8 * (u >> 2)), si);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(ws, xs), acc[r]);
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
                    const __m256i si = _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                                         2 * g + 1);
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++) {
                        const uint8_t *b = w[r] + o;
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32 * (g & 1)));
                        const __m256i nib = _mm256_and_si256(g < 2 ? raw : _mm256_srli_epi16(raw, 4), m4);
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
                        const __m256i q = _mm256_or_si256(nib, bits_to4(qh, 2 * g, 1));
                        __m256i a = _mm256_slli_epi32(dp256(_mm256_setzero_si256(), q, x1, 0), 8);
                        if (two) a = dp256(a, q, x2, 0);
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
                            q = _mm256_or_si256(q, bits_to4(_mm256_loadu_si256((const __m256i *)(b + 16)), 2 * c + h, 0));
                        __m256i a = _mm256_slli_epi32(dp256(_mm256_setzero_si256(), q, x1, 0), 8);
                        if (two) a = dp256(a, q, x2, 0);
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

#define KQ2DECLS(TI) KQSHAPES(KQDECL, kq2, , TI)
KQ2DECLS(I_Q4_0) KQ2DECLS(I_Q4_K) KQ2DECLS(I_Q5_K) KQ2DECLS(I_Q6_K) KQ2DECLS(I_IQ4_NL) KQ2DECLS(I_MXFP4)
KQ2DECLS(I_Q2_K) KQ2DECLS(I_Q3_K) KQ2DECLS(I_IQ4_XS) KQ2DECLS(I_IQ3_XXS) KQ2DECLS(I_IQ3_S) KQ2DECLS(I_IQ2_XXS)
KQ2DECLS(I_IQ2_XS) KQ2DECLS(I_IQ1_S) KQ2DECLS(I_IQ1_M)
static const kq_fn KQTAB2[N_TYPES][5] = {
    [I_Q4_0] = KQROW(kq2, I_Q4_0), [I_Q4_K] = KQROW(kq2, I_Q4_K), [I_Q5_K] = KQROW(kq2, I_Q5_K),
    [I_Q6_K] = KQROW(kq2, I_Q6_K), [I_IQ4_NL] = KQROW(kq2, I_IQ4_NL), [I_MXFP4] = KQROW(kq2, I_MXFP4),
    [I_Q2_K] = KQROW(kq2, I_Q2_K), [I_Q3_K] = KQROW(kq2, I_Q3_K), [I_IQ4_XS] = KQROW(kq2, I_IQ4_XS),
    [I_IQ3_XXS] = KQROW(kq2, I_IQ3_XXS), [I_IQ3_S] = KQROW(kq2, I_IQ3_S), [I_IQ2_XXS] = KQROW(kq2, I_IQ2_XXS),
    [I_IQ2_XS] = KQROW(kq2, I_IQ2_XS), [I_IQ1_S] = KQROW(kq2, I_IQ1_S), [I_IQ1_M] = KQROW(kq2, I_IQ1_M), };
#endif /* HM_AVXVNNI */
#if !HM_AVXVNNI && HM_MAIN
int hm_dp256_test(const uint8_t *u, const int8_t *s, int64_t n, int big, int32_t *out) {
    (void)u, (void)s, (void)n, (void)big, (void)out;
    return -1;
}
#endif

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
                          (1u << I_IQ3_XXS) | (1u << I_IQ3_S) | (1u << I_IQ2_XXS) | (1u << I_IQ2_XS) | \
                          (1u << I_IQ1_S) | (1u << I_IQ1_M) | (1u << I_IQ2_KT) | (1u << I_IQ3_KT) | (1u << I_IQ4_KT))
/* AVX-VNNI (dev VM, 1 thread, T=1, GB/s fp32 -> integer): Q4_0 7.2 -> 12.4, Q4_K 7.3 -> 11.2, Q5_K 8.4 -> 11.6,
 * Q6_K 7.4 -> 12.1, MXFP4 6.3 -> 11.3, IQ4_NL 6.8 -> 11.3. On AVX-512 (the same VM; MXFP4 not yet on SPR)
 * IQ4_NL's fp32 path is as fast (11.4 vs 11.6) and stays; MXFP4 9.7 -> 11.9 (2 threads: 17.2 -> 21.5). */
#define INT8_DEFAULT_256 (INT8_DEFAULT_256_ | (1u << I_IQ4_NL) | (1u << I_Q2_K) | (1u << I_Q3_K) | (1u << I_IQ4_XS) | \
                          (1u << I_IQ3_XXS) | (1u << I_IQ3_S) | (1u << I_IQ2_XXS) | (1u << I_IQ2_XS) | (1u << I_IQ1_S) | \
                          (1u << I_IQ1_M))
HM_STATE(unsigned g_int8, 0);             /* the types set_int8 chose, unless g_int8_default */
HM_STATE(int g_int8_default, 1);          /* the measured defaults of the path in use */
#define INT8_MASK (g_int8_default ? (g_simd == 2 ? INT8_DEFAULT_512 : INT8_DEFAULT_256) : g_int8)
/* rows shared by several tokens take the integer path too (the canonical products, any batch size): where the
 * AVX-512 VNNI kernels run (the AVX-VNNI path keeps fp32 for those, and its own order for single tokens), unless
 * hm_set_exact(0) asked for the earlier large-batch paths (bf16 tiles; results then depend on the batch) */
HM_STATE(int g_exact, 1);
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
