/* The exact int8 tiles (AMX-INT8) of prompts.
 * Part of cpu_moe.c (its main unit): included there, in order, never compiled alone. */

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

/* row t of r = x (K floats) quantized by quant_x8, the function every path quantizes with, for rows of type ti;
 * tmp: xq8_bytes(K) */
static void qrows_quant(const qrows *r, int64_t t, const float *x, void *tmp, int ti) {
    const int64_t K = r->K;
    xq8 q;
    xq8_init(&q, tmp, K);
    q.q1 = r->q1 + t * K;
    q.q2 = r->q2 + t * K;
    quant_x8(x, 0, K / 32, &q, act_terms(ti));
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
        kscale ks;
        prep_k(ti, b, 1.0f, &ks);
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

/* c[16 rows][16 tokens] (+)= the canonical chains of 16 unpacked weight rows (A, A8_LDA apart; scales ws, 32
 * apart per block) and token block tb over the pass's blocks: elements [k0, k0 + kc) of K. The per-16 types'
 * four chains (cdot_ref: sub-blocks i = L mod 4) one after the other, chain L at c + L * cst; the others' one.
 * Software-pipelined: a block's products run (tiles 0, 1 or 5, 6 in turn) while the previous block's sums are
 * stored and go into the float chain; a block's loads, products and store otherwise wait on each other in turn.
 * (Double-buffering the operand tiles instead, the sums single: 10% slower in the model, 2026-11-25.) */
static void a8_chain(int ti, const int8_t *A, const float *ws, const uint8_t *tb, int64_t K, int64_t k0, int64_t kc,
                     float *c, int64_t cst, int acc_in, pfq *pq, int64_t per) {
    const int q6 = SB16(ti), us = ti == I_Q4_K || ti == I_Q5_K, nch = q6 ? 4 : 1;
    const int two = act_terms(ti) > 1;                     /* one term: q2 = 0, its tiles skipped */
    const int8_t *B1 = (const int8_t *)tb, *B2 = B1 + 16 * K;
    const float *xs = (const float *)(tb + 32 * K);
    int32_t cb[2][16][16] __attribute__((aligned(64)));
    const int64_t len = q6 ? 16 : 32, nbk = kc / len;
    for (int L = 0; L < nch; L++) {
        float *cl = c + L * cst;
        __m512 acc[16];
#pragma GCC unroll 16
        for (int m = 0; m < 16; m++) acc[m] = acc_in ? _mm512_loadu_ps(cl + 16 * m) : _mm512_setzero_ps();
        const int64_t nn = (nbk - L + nch - 1) / nch;      /* the chain's blocks L, L + nch, ... */
        for (int64_t n = 0; n <= nn; n++) {
            if (n < nn) {
                const int64_t b = L + n * nch, ba = k0 / len + b;   /* block (sub-block) index within K */
                if (n & 1) A8_PRODUCTS(5, 6);
                else A8_PRODUCTS(0, 1);
            }
            if (n == 0) continue;
            const int64_t bp = L + (n - 1) * nch, bpa = k0 / len + bp;   /* the previous block: store, chain */
            if ((n - 1) & 1) { _tile_stored(5, cb[0], 64); if (two) _tile_stored(6, cb[1], 64); }
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
        for (int m = 0; m < 16; m++) _mm512_storeu_ps(cl + 16 * m, acc[m]);
    }
}
#undef A8_PRODUCTS
#endif

/* One int8 tile step: C[j][g] ([16 rows][16 tokens] floats, g = 0: the 16 rows at w0, 1: at w1) = the
 * canonical products of those rows (rb bytes each, K long) with token blocks j < nb (tbs bytes apart).
 * Passes of TILE_KC (scratch A: 32 x A8_LDA bytes, ws: 32 x TILE_KC/16 floats, wm: 32 x K/32 floats; C: the
 * per-16 types' four chains, nb x 512 floats apart, summed into the first after the last pass). */
static void tile_step_q8(int ti, const uint8_t *w0, const uint8_t *w1, int64_t rb, int64_t K, const uint8_t *tb,
                         int64_t tbs, int nb, int8_t *A, float *ws, float *wm, float *C, pfq *pq) {
#if HM_AMX8
    /* the next step's lines are prefetched while the tiles run, none while this step's rows are unpacked (its
     * own loads from memory then): spread evenly over the chains' blocks (bursts every 8 blocks slowed them) */
    const int64_t calls = (int64_t)nb * 2 * (K / 16) + 1;
    const int64_t per = (pfq_left(pq) + calls - 1) / calls;
    const int64_t cs = (int64_t)nb * 512;                 /* the per-16 types' chain L at C + L cs */
    for (int64_t k0 = 0; k0 < K; k0 += TILE_KC) {
        const int64_t kc = K - k0 < TILE_KC ? K - k0 : TILE_KC;
        for (int m = 0; m < 32; m++)
            a8_unpack_row(ti, m < 16 ? w0 + m * rb : w1 + (m - 16) * rb, k0, kc, A + m * A8_LDA, ws + m, wm + m);
        for (int j = 0; j < nb; j++)
            for (int g = 0; g < 2; g++)
                a8_chain(ti, A + g * 16 * A8_LDA, ws + 16 * g, tb + j * tbs, K, k0, kc, C + (j * 2 + g) * 256,
                         cs, k0 > 0, pq, per);
    }
    if (SB16(ti))                                         /* the four chains: (0 + 1) + (2 + 3), into chain 0 */
        for (int64_t i = 0; i < cs; i += 16) {
            const __m512 s01 = _mm512_add_ps(_mm512_loadu_ps(C + i), _mm512_loadu_ps(C + cs + i));
            const __m512 s23 = _mm512_add_ps(_mm512_loadu_ps(C + 2 * cs + i), _mm512_loadu_ps(C + 3 * cs + i));
            _mm512_storeu_ps(C + i, _mm512_add_ps(s01, s23));
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

/* per-thread scratch of tile_step_q8 for rows of K: A, ws, wm, C for nbmax token blocks (four chains each: the
 * per-16 types'), and quant_x8's */
static size_t a8_scratch(int64_t K, int64_t nbmax) {
    return ((size_t)32 * A8_LDA + (size_t)32 * (TILE_KC / 16) * 4 + (size_t)32 * (K / 32) * 4 +
            (size_t)nbmax * 2048 * 4 + xq8_bytes(K) + 5 * 64 + 63) & ~(size_t)63;
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
    b.C = (float *)q; q += (size_t)nbmax * 2048 * 4;
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
            qrows_quant(&xr, t, x + t * K, bf.xq, wi);
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
        for (int64_t t = 0; t < T; t++) qrows_quant(&xr, t, x + t * H, bf.xq, gi);
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
        for (int64_t p = 0; p < off[na]; p++) qrows_quant(&hr, p, h + p * F, bf.xq, di);
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
