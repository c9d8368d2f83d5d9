/* The grouped tile MoE FFN and hm_tile_mm; the MoE entry points (hm_moe_ffn, hm_moe_handoff,
 * hm_moe_handoff_oai, hm_moe_handoff_rows_oai, hm_moe_tile, hm_moe_oai, hm_tile_mode).
 * Part of cpu_moe.c (its main unit): included there, in order, never compiled alone. */

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
/* spins until *ready == step (HM_SPIN_S, then yields the core between polls); 0, or -3 after timeout_s */
static int handoff_wait(const int32_t *ready, int32_t step, double timeout_s) {
    int yield = 0;
    double start = 0;
    for (uint64_t spin = 0; __atomic_load_n(ready, __ATOMIC_ACQUIRE) != step; spin++) {
        if (yield) sched_yield();       /* a long wait: a thread that wants this core (a busy machine) runs */
#if defined(__x86_64__) || defined(__i386__)
        else __builtin_ia32_pause();
#endif
        if ((spin & 255) == 0) {
            const double t = hm_now();
            if (start == 0) start = t;
            else if (t - start > timeout_s) return -3;
            else if (t - start > HM_SPIN_S) yield = 1;
        }
    }
    return 0;
}

/* The CPU side of a decode hand-off with a GPU: waits until *ready == step, then runs the experts of the first kc
 * of the k slots of the first T of the Tp rows of packed [Tp][H + 2k] (row: x | router weights | expert ids as
 * floats; every slot's id is checked; -1: a pair the GPU runs, skipped) into out [Tp][H], zeros in the rows after T
 * (padding), and sets *done =
 * step, also after an error, so that the GPU never waits forever. 0, -1 (an id that is not an expert, or bad
 * sizes), -2 (no memory), -3 (the GPU did not come within timeout_s). */
static int handoff_rows(const int32_t *ready, int32_t *done, double timeout_s, const float *packed, int64_t T,
                        int64_t Tp, int64_t H, int64_t k, int64_t kc, const uint8_t *gate, const uint8_t *up,
                        int gtype, int64_t F, int64_t E, const uint8_t *down, int dtype, float *out, int nthreads,
                        int32_t step, const moe_act *A) {
    static __thread float *xs;                    /* several rows' x, contiguous: kept from call to call */
    static __thread size_t xs_n;
    int32_t ids[64 * 64];
    float wts[64 * 64];
    int rc = handoff_wait(ready, step, timeout_s);
    if (!rc && (k < 1 || k > 64 || kc < 1 || kc > k || T < 1 || T > Tp || Tp > 64)) rc = -1;
    const float *x = packed;                      /* one row: its x is contiguous already */
    if (!rc && T > 1) {
        if (xs_n < (size_t)T * H) {
            float *p = (float *)realloc(xs, (size_t)Tp * H * sizeof(float));
            if (p) xs = p, xs_n = (size_t)Tp * H;
            else rc = -2;
        }
        for (int64_t t = 0; !rc && t < T; t++) memcpy(xs + t * H, packed + t * (H + 2 * k), (size_t)H * sizeof(float));
        x = xs;
    }
    for (int64_t t = 0; !rc && t < T; t++) {
        const float *row = packed + t * (H + 2 * k);
        for (int64_t j = 0; !rc && j < k; j++) {
            const float f = row[H + k + j];
            if (!(f >= 0.0f && f < (float)E) && f != -1.0f) rc = -1;   /* NaN too; -1: a pair the GPU runs */
            if (j < kc) {
                ids[t * kc + j] = rc ? 0 : (int32_t)f;
                wts[t * kc + j] = row[H + j];
            }
        }
    }
    if (!rc) rc = moe_ffn_act(x, T, H, ids, wts, kc, gate, up, gtype, F, E, down, dtype, out, nthreads, A);
    if (Tp > T && Tp <= 64) memset(out + T * H, 0, (size_t)(Tp - T) * H * sizeof(float));
    __atomic_store_n(done, step, __ATOMIC_RELEASE);
    return rc;
}

/* one token (the single-sequence decode step): its first kc slots on the CPU, the GPU runs the others */
int hm_moe_handoff(const int32_t *ready, int32_t *done, double timeout_s, const float *packed, int64_t H,
                   int64_t k, int64_t kc, const uint8_t *gate, const uint8_t *up, int gtype, int64_t F, int64_t E,
                   const uint8_t *down, int dtype, float *out, int nthreads, int32_t step) {
    return handoff_rows(ready, done, timeout_s, packed, 1, 1, H, k, kc, gate, up, gtype, F, E, down, dtype, out,
                        nthreads, step, &ACT_SILU);
}

/* hm_moe_handoff for gpt-oss's experts: biases bg, bu [E, F] and bd [E, H] (float32), the clamped SwiGLU */
int hm_moe_handoff_oai(const int32_t *ready, int32_t *done, double timeout_s, const float *packed, int64_t H,
                       int64_t k, int64_t kc, const uint8_t *gate, const uint8_t *up, int gtype, int64_t F, int64_t E,
                       const uint8_t *down, int dtype, float *out, int nthreads, const float *bg, const float *bu,
                       const float *bd, float alpha, float limit, int32_t step) {
    const moe_act A = {1, alpha, limit, bg, bu, bd};
    if (!bg || !bu || !bd) {                       /* still hand the step back: the GPU waits for it */
        __atomic_store_n(done, step, __ATOMIC_RELEASE);
        return -1;
    }
    return handoff_rows(ready, done, timeout_s, packed, 1, 1, H, k, kc, gate, up, gtype, F, E, down, dtype, out,
                        nthreads, step, &A);
}

/* the batched decode step (runtime/steps/gpu_batch.py): the first T of Tp rows, every slot */
int hm_moe_handoff_rows(const int32_t *ready, int32_t *done, double timeout_s, const float *packed, int64_t T,
                        int64_t Tp, int64_t H, int64_t k, const uint8_t *gate, const uint8_t *up, int gtype,
                        int64_t F, int64_t E, const uint8_t *down, int dtype, float *out, int nthreads,
                        int32_t step) {
    return handoff_rows(ready, done, timeout_s, packed, T, Tp, H, k, k, gate, up, gtype, F, E, down, dtype, out,
                        nthreads, step, &ACT_SILU);
}

/* hm_moe_handoff_rows for gpt-oss's experts: biases bg, bu [E, F] and bd [E, H] (float32), the clamped SwiGLU */
int hm_moe_handoff_rows_oai(const int32_t *ready, int32_t *done, double timeout_s, const float *packed, int64_t T,
                            int64_t Tp, int64_t H, int64_t k, const uint8_t *gate, const uint8_t *up, int gtype,
                            int64_t F, int64_t E, const uint8_t *down, int dtype, float *out, int nthreads,
                            const float *bg, const float *bu, const float *bd, float alpha, float limit,
                            int32_t step) {
    const moe_act A = {1, alpha, limit, bg, bu, bd};
    if (!bg || !bu || !bd) {                       /* still hand the step back: the GPU waits for it */
        __atomic_store_n(done, step, __ATOMIC_RELEASE);
        return -1;
    }
    return handoff_rows(ready, done, timeout_s, packed, T, Tp, H, k, k, gate, up, gtype, F, E, down, dtype, out,
                        nthreads, step, &A);
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
