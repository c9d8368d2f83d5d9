/* Hm_decode_step: one token through a whole model on the CPU.
 * Part of cpu_moe.c (its main unit): included there, in order, never compiled alone. */

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
    /* gpt-oss's block (NULL / 0: none): q|k|v and output biases, the router's bias, a sink logit per head, the
     * experts' biases ([E, F], [E, F], [E, H]: the clamped SwiGLU, m->alpha / m->limit); a cache of `slots`
     * slots (0: m->slots) holding position p in slot p % slots, attended over its last `window` positions
     * (1 <= window <= slots where slots is set: the caller's check, cpu_decode.py) */
    const float *qkv_b, *o_b, *router_b, *sinks, *bg, *bu, *bd;
    int64_t slots, window;
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
    float alpha, limit;                                    /* gpt-oss's clamped SwiGLU (layers with bg) */
} hm_dmodel;

#ifndef GV_CHUNK
#define GV_CHUNK 32      /* rows a thread claims at a time (a multiple of 4) */
#endif
#define ATT_MAXCH 64     /* position runs per KV head at most */
#define DEC_MAXD 256     /* head size bound (thread-local rows) */

/* q8: the activation terms of an integer-path part (act_terms of its type), 0 for the fp32 path */
typedef struct { const uint8_t *w; int64_t n, rb; float *out; int ti, q8; } gv_part;

static gv_part gv_mk(const hm_mat *m, int64_t K, float *out) {
    const int ti = type_index(m->type);
    const gv_part p = {m->w, m->rows, row_bytes(ti, K), out, ti,
                       (INT8_MASK >> ti & 1) && q8_type(ti, K) ? act_terms(ti) : 0};
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
        dot_rows1(P->ti, R, rows, pf, K, x, P->q8 ? &xq[P->q8 - 1] : NULL, res);
        for (int c = 0; c < R; c++) P->out[r + c] = res[c];
        g += R;
    }
}

/* the parts laid end to end: start [np + 1] (part i's rows from start[i]); returns which quantized forms of x
 * the parts take (the integer path): bit 0 one activation term, bit 1 two */
static int gv_starts(const gv_part *p, int np, int64_t *start) {
    int q8 = 0;
    start[0] = 0;
    for (int i = 0; i < np; i++) { start[i + 1] = start[i] + p[i].n; q8 |= p[i].q8 ? 1 << (p[i].q8 - 1) : 0; }
    return q8;
}

/* x (K) quantized into xq[0] (one term) and / or xq[1] (two), as gv_starts' mask asks */
static void gv_quant(int need, const float *x, int64_t K, const xq8 *xq) {
    for (int n = 1; n <= 2; n++)
        if (need >> (n - 1) & 1) quant_x8(x, 0, K / 32, &xq[n - 1], n);
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

/* out of each part = its rows . x (K columns); xq[2]: room for x quantized (integer-path parts: one term, two) */
static void gemv_run(const gv_part *p, int np, int64_t K, const float *x, const xq8 *xq, int nth) {
    int64_t start[5];
    gv_quant(gv_starts(p, np, start), x, K, xq);
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
    const int64_t D = m->D, S = L->slots ? L->slots : m->slots;   /* position p in slot p % S */
    float row[DEC_MAXD];
    if (n < ATT_SB)
        for (int64_t d = 0; d < D; d++) memset(kt + d * ATT_SB + n, 0, (size_t)(ATT_SB - n) * 4);
    for (int64_t i = 0; i < n; i++) {
        const int64_t sl = (b + i) % S;
        kv_load(m->kv_type, L->kc, (g * S + sl) * D, D, row);
        for (int64_t d = 0; d < D; d++) kt[d * ATT_SB + i] = row[d];
        kv_load(m->kv_type, L->vc, (g * S + sl) * D, D, vf + i * D);
    }
}

/* run c (CH positions from lo + c CH, up to P) of KV head g for one query (q [nh, D]) -> pt */
__attribute__((noinline)) static void att_task(const hm_dmodel *m, const hm_dlayer *L, const float *q, int64_t lo,
                                               int64_t P, int64_t g, int64_t c, int64_t CH, float *pt, float *kf,
                                               float *vf) {
    const int64_t D = m->D, G = m->nh / m->nkv;
    const int64_t p0 = lo + c * CH, p1 = p0 + CH < P ? p0 + CH : P;
    att_init(m, pt);
    for (int64_t b = p0; b < p1; b += ATT_SB) {
        const int64_t n = p1 - b < ATT_SB ? p1 - b : ATT_SB;
        att_load(m, L, g, b, n, kf, vf);
        att_block(m, q + g * G * D, n, kf, vf, pt);
    }
}

/* head h's output o [D] from the nch runs of its KV head (part: [nkv][nch][G][D + 2] of one query); sinks (NULL:
 * none): one more logit per head in the softmax's denominator (gpt-oss) */
__attribute__((noinline)) static void att_merge(const hm_dmodel *m, const float *part, int64_t nch, int64_t h, float *oh,
                                                const float *sinks) {
    const int64_t D = m->D, G = m->nh / m->nkv, W = D + 2, g = h / G, j = h % G;
    float mx = sinks ? sinks[h] : -INFINITY, l = 0;
    for (int64_t c = 0; c < nch; c++) {
        const float mc = part[((g * nch + c) * G + j) * W];
        mx = mc > mx ? mc : mx;
    }
    if (sinks) l = expf(sinks[h] - mx);
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
typedef struct { float *x, *h, *y, *y2, *qkv, *att, *rl, *ff, *part; xq8 xq[2]; } dec_bufs;   /* xq: gv_quant's */

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
    const int64_t xqb = ((int64_t)xq8_bytes(kmax) + 127) & ~(int64_t)63;
    for (int i = 0; base && i < 2; i++) xq8_init(&b->xq[i], base + off + i * xqb, kmax);
    return off + 2 * xqb;
}

int64_t hm_decode_scratch(const hm_dmodel *m) {
    dec_bufs b;
    return dec_layout(m, NULL, &b);
}

/* A decode layer in one parallel region: q/k/v = h W (h: x normed), their norms, RoPE and the cache write at
 * pos (one thread), attention over positions [0, pos] (gpt-oss: a window's last positions, from its ring's
 * slots; the biases, the sinks), y = att W_o; with routed experts also x += y,
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
    const int64_t G = nh / nkv, W = D + 2, P = pos + 1, LS = L->slots ? L->slots : S, sp = pos % LS;
    const int64_t lo = L->window > 0 && P > L->window ? P - L->window : 0;    /* the window's first position */
    float *q = b->qkv, *k = b->qkv + nq, *v = b->qkv + nq + nk;
    const gv_part pqkv[3] = {gv_mk(&L->q, H, q), gv_mk(&L->k, H, k), gv_mk(&L->v, H, v)};
    const gv_part po = gv_mk(&L->o, nq, b->y), pr = gv_mk(&L->router, H, b->rl);
    int64_t s_qkv[4], s_o[2], s_r[2], ctr[3] = {0, 0, 0};
    const int q8_qkv = gv_starts(pqkv, 3, s_qkv), q8_o = gv_starts(&po, 1, s_o);
    const int router = L->router.rows > 0, q8_r = router && gv_starts(&pr, 1, s_r);
    int64_t nch, CH, mctr[2] = {0, 0};
    att_runs(P - lo, &nch, &CH);
    int32_t ids[64];
    float wts[64];
    const moe_act oai = {1, m->alpha, m->limit, L->bg, L->bu, L->bd};   /* read by moe_team after the single */
    moe_ctx mc;
    int rc = 0;
    double t0 = times ? hm_now() : 0, t1 = t0, t2 = t0, t3 = t0, t4 = t0;
    gv_quant(q8_qkv, b->h, H, b->xq);
#pragma omp parallel num_threads(nth)
    {
        gemv_team(pqkv, s_qkv, 3, H, b->h, b->xq, &ctr[0]);
#pragma omp barrier
        if (times && omp_get_thread_num() == 0) t1 = hm_now();
#pragma omp single
        {
            for (int64_t i = 0; L->qkv_b && i < nq + 2 * nk; i++) b->qkv[i] += L->qkv_b[i];
            for (int64_t i = 0; L->q_norm && i < nh; i++) rmsnorm(q + i * D, L->q_norm, D, m->eps, q + i * D);
            for (int64_t i = 0; L->k_norm && i < nkv; i++) rmsnorm(k + i * D, L->k_norm, D, m->eps, k + i * D);
            rope_heads(q, nh, D, cs, sn, m->neox);
            rope_heads(k, nkv, D, cs, sn, m->neox);
            for (int64_t g = 0; g < nkv; g++) {
                kv_store(m->kv_type, L->kc, (g * LS + sp) * D, D, k + g * D);
                kv_store(m->kv_type, L->vc, (g * LS + sp) * D, D, v + g * D);
            }
        }
        float kf[ATT_SB * DEC_MAXD] __attribute__((aligned(64))), vf[ATT_SB * DEC_MAXD];
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < nkv * nch; t++)
            att_task(m, L, q, lo, P, t / nch, t % nch, CH, b->part + t * G * W, kf, vf);
#pragma omp for schedule(static)
        for (int64_t h = 0; h < nh; h++) att_merge(m, b->part, nch, h, b->att + h * D, L->sinks);
#pragma omp single
        {
            if (times) t2 = hm_now();
            gv_quant(q8_o, b->att, nq, b->xq);
        }
        gemv_team(&po, s_o, 1, nq, b->att, b->xq, &ctr[1]);
        if (router) {
#pragma omp barrier
#pragma omp single
            {
                for (int64_t i = 0; L->o_b && i < H; i++) b->y[i] += L->o_b[i];
                for (int64_t i = 0; i < H; i++) b->x[i] += b->y[i];
                rmsnorm(b->x, L->ffn_norm, H, m->eps, b->h);
                gv_quant(q8_r, b->h, H, b->xq);
            }
            gemv_team(&pr, s_r, 1, H, b->h, b->xq, &ctr[2]);
#pragma omp barrier
#pragma omp single
            {
                if (times) t3 = hm_now();
                for (int64_t e = 0; L->router_b && e < L->router.rows; e++) b->rl[e] += L->router_b[e];
                route_softmax(b->rl, L->router.rows, m->k, m->norm_topk, m->wscale, ids, wts);
                if (times) t4 = hm_now();
                rc = moe_prep(b->h, 1, H, ids, wts, m->k, L->gate_exps.w, L->up_exps.w, L->gate_exps.type,
                              m->n_ff_exp, L->router.rows, L->down_exps.w, L->down_exps.type, b->y,
                              L->bg ? &oai : &ACT_SILU, &mc);
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
            gemv_run(pgu, 2, H, b.h, b.xq, nth);
            for (int64_t i = 0; i < F; i++) b.ff[i] = silu(b.ff[i]) * b.ff[F + i];
            const gv_part pd = gv_mk(&L->down, F, ffo);
            gemv_run(&pd, 1, F, b.ff, b.xq, nth);
            LAP(0);
            if (L->router.rows)
                for (int64_t i = 0; i < H; i++) b.y[i] += b.y2[i];
        }
        for (int64_t i = 0; i < H; i++) b.x[i] += b.y[i];
    }
    rmsnorm(b.x, m->out_norm, H, m->eps, b.h);
    const gv_part ph = gv_mk(&m->head, H, logits);
    UNTIMED();
    gemv_run(&ph, 1, H, b.h, b.xq, nth);
    LAP(0);
#undef LAP
#undef UNTIMED
    return 0;
}
