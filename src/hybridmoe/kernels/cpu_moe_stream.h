/* Workspace, silu, tracing, the streaming MoE FFN (moe_ffn_act), hm_qmatmul and hm_qdot_ref.
 * Part of cpu_moe.c (its main unit): included there, in order, never compiled alone. */

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
                quant_x8(c->h + (s0 + i) * F, b0, b0 + 2, &q, act_terms(c->di));
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
            quant_x8(c->x + t * c->H, 0, c->H / 32, &q, act_terms(c->gi));
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
                quant_x8(x + t * K, 0, K / 32, &q, act_terms(wi));
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
        quant_x8(x + t * K, 0, K / 32, &q, act_terms(wi));
        for (int64_t n = 0; n < N; n++) out[t * N + n] = cdot_ref(wi, w + n * rb, K, &q);
    }
    free(mem);
    return 0;
}
