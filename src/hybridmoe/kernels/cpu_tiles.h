/* Hm_dequant, the large-batch helpers and the bf16 tile products (AMX, AVX512-BF16, C).
 * Part of cpu_moe.c (its main unit): included there, in order, never compiled alone. */

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
