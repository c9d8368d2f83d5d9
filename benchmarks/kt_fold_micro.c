/* IQ2_KT's T=1 dot product, two ways, one thread (issue 24; docs/cpu-kernels.md, "The trellis types"):
 *   table: 64 values of 8 u16 indices by one vpgatherqq from the 512 KiB table of 128 + v, one vpdpbusd;
 *   fold:  each weight's generator state masked to four 6-bit bytes, its activation spread to its lane's four
 *          bytes, one vpdpbusd giving a * (v + 126): four vpmulld, vpand and vpdpbusd per 64 weights, no gather;
 *   mixed: even 64-weight chunks by the table, odd ones folded (the gather's loads beside the multiplies).
 * Both sums are checked against each other (table - fold = 2 * sum(a)). Index bytes stream from a buffer far
 * larger than L2 (the weights' 2 bytes per 8 weights; scales left out), activations stay in L1.
 *   gcc -O3 -march=native -o /tmp/kt_fold benchmarks/kt_fold_micro.c && /tmp/kt_fold [MiB of indices] [passes] */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define KA 0xCBAC1FEDu
static uint64_t tab[65536];

static int kt_value(uint32_t x, int n) {
    for (int i = 0; i < n; i++) x *= KA;
    x &= 0x3F3F3F3Fu;
    return (int)((x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)) - 126;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define K 2048   /* weights a row: 256 u16 indices, 2048 activations */

static int64_t row_table(const uint16_t *ix, const int8_t *a) {
    __m512i acc = _mm512_setzero_si512();
    for (int c = 0; c < K / 64; c++) {
        const __m512i u = _mm512_i32gather_epi64(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(ix + 8 * c))),
                                                 (const void *)tab, 8);
        acc = _mm512_dpbusd_epi32(acc, u, _mm512_loadu_si512((const void *)(a + 64 * c)));
    }
    return _mm512_reduce_add_epi32(acc);
}

static int64_t row_fold(const uint16_t *ix, const int8_t *a4, const int8_t *a, int mixed, int64_t corr) {
    const __m512i ka = _mm512_setr_epi32((int)KA, (int)(KA * KA), (int)(KA * KA * KA), (int)(KA * KA * KA * KA),
        (int)(KA * KA * KA * KA * KA), (int)(KA * KA * KA * KA * KA * KA), (int)(KA * KA * KA * KA * KA * KA * KA),
        (int)(KA * KA * KA * KA * KA * KA * KA * KA), (int)KA, (int)(KA * KA), (int)(KA * KA * KA),
        (int)(KA * KA * KA * KA), (int)(KA * KA * KA * KA * KA), (int)(KA * KA * KA * KA * KA * KA),
        (int)(KA * KA * KA * KA * KA * KA * KA), (int)(KA * KA * KA * KA * KA * KA * KA * KA));
    const __m512i m6 = _mm512_set1_epi32(0x3F3F3F3F), off = _mm512_set1_epi32(4096);
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512(), acc2 = _mm512_setzero_si512();
    for (int c = 0; c < K / 64; c++) {
        if (mixed && !(c & 1)) {
            const __m512i u = _mm512_i32gather_epi64(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                (const __m128i *)(ix + 8 * c))), (const void *)tab, 8);
            acc2 = _mm512_dpbusd_epi32(acc2, u, _mm512_loadu_si512((const void *)(a + 64 * c)));
            continue;
        }
        const __m512i s = _mm512_add_epi32(_mm512_cvtepu16_epi32(_mm256_castsi128_si256(
            _mm_loadu_si128((const __m128i *)(ix + 8 * c)))), off);        /* lanes 0-7: the chunk's 8 seeds */
        for (int p = 0; p < 4; p++) {                                     /* seeds 2p, 2p + 1: 16 weights */
            const __m512i sel = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
            const __m512i x = _mm512_and_si512(_mm512_mullo_epi32(_mm512_permutexvar_epi32(sel, s), ka), m6);
            const __m512i av = _mm512_loadu_si512((const void *)(a4 + 4 * (64 * c + 16 * p)));
            if (p & 1) acc1 = _mm512_dpbusd_epi32(acc1, x, av);
            else acc0 = _mm512_dpbusd_epi32(acc0, x, av);
        }
    }
    /* table chunks count 128 + v, folded ones v + 126: corr = 2 a over the table's chunks (made once) */
    return _mm512_reduce_add_epi32(_mm512_add_epi32(acc0, acc1)) + _mm512_reduce_add_epi32(acc2) - corr;
}

int main(int argc, char **argv) {
    const size_t mib = argc > 1 ? (size_t)atoi(argv[1]) : 256;
    const int passes = argc > 2 ? atoi(argv[2]) : 4;
    for (uint32_t i = 0; i < 65536; i++) {
        uint64_t u = 0;
        for (int n = 0; n < 8; n++) u |= (uint64_t)(128 + kt_value(4096 + i, n + 1)) << 8 * n;
        tab[i] = u;
    }
    const size_t rows = (mib << 20) / (K / 4);
    uint16_t *ix = aligned_alloc(64, rows * (K / 4));
    int8_t a[K], a4[4 * K] __attribute__((aligned(64)));
    srand(7);
    for (size_t i = 0; i < rows * (K / 8); i++) ix[i] = (uint16_t)rand();
    int64_t suma = 0;
    for (int i = 0; i < K; i++) {
        a[i] = (int8_t)(rand() % 255 - 127);
        suma += a[i];
        for (int b = 0; b < 4; b++) a4[4 * i + b] = a[i];
    }
    int64_t corr = 0;                             /* 2 a over the even chunks: the mixed rows' offset */
    for (int c = 0; c < K / 64; c += 2)
        for (int i = 0; i < 64; i++) corr += 2 * a[64 * c + i];
    for (int r = 0; r < 3; r++) {
        for (int way = 0; way < 3; way++) {
            int64_t tot = 0;
            const double t0 = now();
            for (int p = 0; p < passes; p++)
                for (size_t j = 0; j < rows; j++)
                    tot += way ? row_fold(ix + j * (K / 8), a4, a, way == 2, way == 2 ? corr : 0) - 126 * suma
                               : row_table(ix + j * (K / 8), a) - 128 * suma;
            const double s = now() - t0;
            const double w = (double)rows * K * passes;
            printf("round %d %-5s: %.2f G weights/s, %.2f GB/s of IQ2_KT bytes (68 per 256), sum %lld\n", r + 1,
                   way == 2 ? "mixed" : way ? "fold" : "table", w / s / 1e9, w * 68 / 256 / s / 1e9, (long long)tot);
        }
    }
    return 0;
}
