/* The few ggml symbols ik_llama.cpp's quantizers (iqk_quantize.cpp, ggml-quants.c) reach, for quantizing only
 * (benchmarks/act_error.py --ik): type sizes from a table the caller fills (ikq_set_type), the fp16 table, aborts
 * for the rest. Built with ik_llama.cpp's ggml/ tree (git archive of its ggml folder):
 *   g++ -O2 -march=native -fPIC -std=c++17 -DGGML_USE_IQK_MULMAT -Iggml/include -Iggml/src -Iggml/src/iqk \
 *       -c ggml/src/iqk/iqk_quantize.cpp
 *   gcc -O2 -march=native -fPIC -DGGML_USE_IQK_MULMAT -Iggml/include -Iggml/src -c ggml/src/ggml-quants.c
 *   gcc -O2 -march=native -fPIC -c ik_quant_shim.c
 *   g++ -shared -Wl,--no-undefined -o libikq.so iqk_quantize.o ggml-quants.o ik_quant_shim.o */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdbool.h>
#include <immintrin.h>
float ggml_table_f32_f16[1 << 16];
__attribute__((constructor)) static void init_tab(void) {
    for (int i = 0; i < (1 << 16); i++) ggml_table_f32_f16[i] = _cvtsh_ss((unsigned short)i);
}
static int64_t g_blck[512], g_ts[512], g_hdr[512];
void ikq_set_type(int t, int64_t blck, int64_t ts, int64_t hdr) { g_blck[t] = blck; g_ts[t] = ts; g_hdr[t] = hdr; }
static void need(int t) { if (!g_blck[t]) { fprintf(stderr, "ikq: type %d has no size\n", t); abort(); } }
size_t ggml_type_size(int t) { need(t); return (size_t)g_ts[t]; }
size_t ggml_row_size(int t, int64_t ne) { need(t); return (size_t)(g_hdr[t] + ne / g_blck[t] * g_ts[t]); }
void ggml_abort(const char *file, int line, const char *fmt, ...) { fprintf(stderr, "ggml_abort %s:%d %s\n", file, line, fmt); abort(); }
float ggml_bf16_to_fp32(uint16_t v) { union { uint32_t u; float f; } x = { (uint32_t)v << 16 }; return x.f; }
bool ggml_is_contiguous(const void *t) { (void)t; fprintf(stderr, "ikq: ggml_is_contiguous\n"); abort(); }
int64_t ggml_nrows(const void *t) { (void)t; fprintf(stderr, "ikq: ggml_nrows\n"); abort(); }
bool iqk_mul_mat(long a, long b, long c, int d, const void *e, long f, int g, const void *h, long i, float *j, long k,
                 int l, int m) {
    (void)a, (void)b, (void)c, (void)d, (void)e, (void)f, (void)g, (void)h, (void)i, (void)j, (void)k, (void)l, (void)m;
    fprintf(stderr, "ikq: iqk_mul_mat\n");
    abort();
}
