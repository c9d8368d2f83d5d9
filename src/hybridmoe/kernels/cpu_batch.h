/* Hm_batch_step / hm_prompt_step, and the info, repacking and settings entry points.
 * Part of cpu_moe.c (its main unit): included there, in order, never compiled alone. */

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
                att_merge(m, part + a->off + i * a->QS, (P + a->CH - 1) / a->CH, hh, o + (a->tq + i) * nq + hh * D,
                          L->sinks);
            }
        }
        j0 = j1;
    }
}

/* attend_batch for a window layer (L->window > 0, its caches rings of L->slots): each query as hm_decode_step's
 * layer_block attends it (att_task over the runs of its window from lo = P - window, att_merge with the sinks),
 * so a token's values are the same batched or alone; (query, KV head, run) tasks in waves that fit npart. */
static void attend_window(const hm_dmodel *m, const hm_dlayer *L, int64_t l, const hm_seq *seqs, int64_t nseq,
                          const float *q, float *part, int64_t npart, float *o, int nth) {
    const int64_t nq = m->nh * m->D, nkv = m->nkv, G = m->nh / m->nkv, D = m->D, W = D + 2;
    int64_t T = 0;
    for (int64_t s = 0; s < nseq; s++) T += seqs[s].T;
    for (int64_t t0 = 0; t0 < T;) {
        int64_t t1 = t0, used = 0;
        while (t1 < T && (t1 == t0 || used + m->nh * ATT_MAXCH * W <= npart)) {
            used += m->nh * ATT_MAXCH * W;
            t1++;
        }
#pragma omp parallel num_threads(nth)
        {
            float kf[ATT_SB * DEC_MAXD] __attribute__((aligned(64))), vf[ATT_SB * DEC_MAXD];
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < (t1 - t0) * nkv * ATT_MAXCH; u++) {
                const int64_t t = t0 + u / (nkv * ATT_MAXCH), g = u / ATT_MAXCH % nkv, c = u % ATT_MAXCH;
                int64_t s = 0, r = t;
                while (r >= seqs[s].T) r -= seqs[s].T, s++;
                const int64_t P = seqs[s].pos0 + r + 1, lo = P > L->window ? P - L->window : 0;
                int64_t nch, CH;
                att_runs(P - lo, &nch, &CH);
                if (c >= nch) continue;
                hm_dlayer Ls = *L;
                if (seqs[s].kc) { Ls.kc = seqs[s].kc[l]; Ls.vc = seqs[s].vc[l]; }
                att_task(m, &Ls, q + t * nq, lo, P, g, c, CH, part + ((t - t0) * nkv * ATT_MAXCH + g * nch + c) * G * W,
                         kf, vf);
            }
#pragma omp for schedule(static)
            for (int64_t u = 0; u < (t1 - t0) * m->nh; u++) {
                const int64_t t = t0 + u / m->nh, hh = u % m->nh;
                int64_t s = 0, r = t;
                while (r >= seqs[s].T) r -= seqs[s].T, s++;
                const int64_t P = seqs[s].pos0 + r + 1, lo = P > L->window ? P - L->window : 0;
                int64_t nch, CH;
                att_runs(P - lo, &nch, &CH);
                att_merge(m, part + (t - t0) * nkv * ATT_MAXCH * G * W, nch, hh, o + t * nq + hh * D, L->sinks);
            }
        }
        t0 = t1;
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
        for (int64_t t = 0; L->qkv_b && t < T; t++) {        /* gpt-oss: q | k | v biases */
            for (int64_t i = 0; i < nq; i++) b.q[t * nq + i] += L->qkv_b[i];
            for (int64_t i = 0; i < nk; i++) b.k[t * nk + i] += L->qkv_b[nq + i];
            for (int64_t i = 0; i < nk; i++) b.v[t * nk + i] += L->qkv_b[nq + nk + i];
        }
        for (int64_t s = 0, t = 0; s < nseq; s++) {
            const hm_seq *sq = seqs + s;
            void *kc = sq->kc ? sq->kc[l] : L->kc, *vc = sq->kc ? sq->vc[l] : L->vc;
            const int64_t S = L->slots ? L->slots : sq->kc ? sq->slots : m->slots;   /* position p in slot p % S */
            for (int64_t i = 0; i < sq->T; i++, t++) {
                float *q = b.q + t * nq, *k = b.k + t * nk, *v = b.v + t * nk;
                const int64_t pos = sq->pos0 + i;
                for (int64_t j = 0; L->q_norm && j < nh; j++) rmsnorm(q + j * D, L->q_norm, D, m->eps, q + j * D);
                for (int64_t j = 0; L->k_norm && j < nkv; j++) rmsnorm(k + j * D, L->k_norm, D, m->eps, k + j * D);
                rope_heads(q, nh, D, cs + t * D, sn + t * D, m->neox);
                rope_heads(k, nkv, D, cs + t * D, sn + t * D, m->neox);
                for (int64_t g = 0; g < nkv; g++) {
                    kv_store(m->kv_type, kc, (g * S + pos % S) * D, D, k + g * D);
                    kv_store(m->kv_type, vc, (g * S + pos % S) * D, D, v + g * D);
                }
            }
        }
        UNTIMED();
        if (L->window > 0) attend_window(m, L, l, seqs, nseq, b.q, b.part, npart, b.att, nth);
        else attend_batch(m, L, l, seqs, gr, ng, b.q, b.part, npart, b.att, nth);
        LAP(1);
        rc = pr_mm(m, b.att, T, nq, &L->o, b.y, nth);
        LAP(0);
        if (rc) break;
        for (int64_t t = 0; L->o_b && t < T; t++)
            for (int64_t i = 0; i < H; i++) b.y[t * H + i] += L->o_b[i];
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
            for (int64_t t = 0; t < T; t++) {
                for (int64_t e = 0; L->router_b && e < E; e++) b.rl[t * E + e] += L->router_b[e];
                route_softmax(b.rl + t * E, E, k, m->norm_topk, m->wscale, b.ids + t * k, b.wts + t * k);
            }
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
            const moe_act oai = {1, m->alpha, m->limit, L->bg, L->bu, L->bd};
            rc = (m->moe_tile_t > 0 && T >= m->moe_tile_t ? moe_tile_act : moe_ffn_act)(
                b.h, T, H, b.ids, b.wts, k, L->gate_exps.w, L->up_exps.w, L->gate_exps.type, m->n_ff_exp, E,
                L->down_exps.w, L->down_exps.type, b.y, nth, L->bg ? &oai : &ACT_SILU);
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

/* scratch bytes of hm_decode_batch for nseq sequences: hm_batch_step's, then their RoPE rows */
int64_t hm_decode_batch_scratch(const hm_dmodel *m, int64_t nseq) {
    return hm_batch_scratch(m, nseq, nseq) + ((2 * nseq * m->D * 4 + 63) & ~(int64_t)63);
}

/* A server's decode step: one token of each of nseq sequences, hm_batch_step's work with the per-step setup done
 * here. pos [nseq]: each token's position (written into seqs' pos0, T set to 1: the caller keeps one seqs array
 * while the batch's caches stay the same). cs_tab / sn_tab: RoPE cos and sin [npos][D] of positions 0..npos-1,
 * this step's rows gathered from them. logits [nseq][n_vocab]. scratch: hm_decode_batch_scratch(m, nseq) bytes.
 * top (NULL: not wanted): each row's argmax, the first of equal maxima (torch.argmax's), for the greedy samplers.
 * Returns hm_batch_step's code (0; -1 for a token, position or sequence out of range, nothing written; a kernel's
 * error), -3 when a position is past the tables (nothing written: extend them and call again), or 1 when every
 * step ran but some logits are not finite (top is then not set). */
int hm_decode_batch(const hm_dmodel *m, const int64_t *tokens, const int64_t *pos, hm_seq *seqs, int64_t nseq,
                    const float *cs_tab, const float *sn_tab, int64_t npos, float *logits, uint8_t *scratch,
                    double *times, int32_t *distinct, int64_t *top) {
    const int64_t D = m->D;
    if (nseq < 1 || D > DEC_MAXD) return -1;
    for (int64_t s = 0; s < nseq; s++)
        if (pos[s] < 0 || pos[s] >= (seqs[s].kc ? seqs[s].slots : m->slots)) return -1;
    for (int64_t s = 0; s < nseq; s++)
        if (pos[s] >= npos) return -3;
    float *cs = (float *)(scratch + hm_batch_scratch(m, nseq, nseq)), *sn = cs + nseq * D;
    for (int64_t s = 0; s < nseq; s++) {
        seqs[s].T = 1;
        seqs[s].pos0 = pos[s];
        memcpy(cs + s * D, cs_tab + pos[s] * D, (size_t)D * 4);
        memcpy(sn + s * D, sn_tab + pos[s] * D, (size_t)D * 4);
    }
    const int rc = hm_batch_step(m, tokens, seqs, nseq, cs, sn, logits, 0, scratch, times, distinct);
    if (rc) return rc;
    const int64_t V = m->head.rows;
    uint32_t bad = 0;                                      /* exponent all ones: inf or NaN (-ffast-math-proof) */
    for (int64_t i = 0; i < nseq * V; i++) {
        uint32_t u;
        memcpy(&u, logits + i, 4);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    if (bad) return 1;
    for (int64_t s = 0; top && s < nseq; s++) {
        const float *r = logits + s * V;
        int64_t best = 0;
        for (int64_t i = 1; i < V; i++)
            if (r[i] > r[best]) best = i;
        top[s] = best;
    }
    return 0;
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

/* activation terms of the integer path: 0 the per-type rule (act_terms; the default), 1 (int8, as ggml's q8_0) or
 * 2 (two int8 terms, ~15 bits) for every type; another value: query. Returns the previous (or current) setting. */
int hm_set_act_terms(int n) {
    const int prev = g_xterms;
    if (n >= 0 && n <= 2) g_xterms = n;
    return prev;
}

/* the activation terms rows of GGML type wtype take on the integer path now (1 or 2); -1 for an unknown type */
int hm_act_terms(int wtype) {
    const int ti = type_index(wtype);
    return ti < 0 ? -1 : act_terms(ti);
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
    return g_simd == 2 ? (HM_VNNI ? "avx512-vnni" : "avx512") : g_simd == 1 ? (HM_DPBUSD256 ? "avx2-vnni" : "avx2-int8")
                                                                          : "generic";
}
