/* hybridmoe CPU kernels: grouped quantized MoE FFN, quantized matmul, dequantize.
 *
 * Plain C11 + OpenMP, compiled at first use with -O3 -march=native (cpu_build.py) and called
 * through ctypes. Weights stay in their GGUF block layout and are read once per call.
 *
 * Math, fp32 path (all types): each 32-element unit of a weight row is decoded in registers
 * to fp32 (for the 4-bit types with a permute into a 16-entry table that already holds
 * scale * value) and multiplied with fp32 activations by FMA: exact up to fp32 rounding.
 * Integer path (Q4_0/Q4_K/Q5_K rows used by a single token, i.e. decode; hm_set_int8):
 * vpdpbusd on nibbles and two-term int8 activations (~15 bits), see "integer path" below.
 * Why these and not int16 / plain int8 activations: docs/cpu-kernels.md.
 *
 * Paths: AVX-512 (F/BW/VL; VNNI + GFNI for the integer path) intrinsics when the compiler
 * targets them; AVX2 (+ FMA, F16C) intrinsics for the streaming kernels and the dequantizer on
 * CPUs without AVX-512 (fp32 path only); otherwise a portable path (scalar dequantize of 256
 * elements into an L1 buffer, then dot loops the compiler vectorizes, e.g. for NEON).
 * hm_set_simd(level) selects a lower path at run time (tests use it).
 *
 * Threads: OpenMP, `num_threads(n)` per call (never omp_set_num_threads, which would change
 * torch's thread count: both share torch's libgomp when torch is loaded first).
 */

/* Several translation units from this one file, compiled in parallel and linked into one library
 * (cpu_build.py; -DHM_UNIT=n, n < HM_UNITS of cpu_units.h): the main unit (0, also when HM_UNIT is not defined)
 * compiles the entry points, the state they share and the kernel tables; each kernel unit (1 .. HM_UNITS - 1)
 * compiles a share of the row x token kernel instances those tables point to (cpu_units.h says which). Those
 * instances are most of the code (and of the compile time); they are reached only through the tables, so splitting
 * them off changes no code: each unit still sees every static helper it inlines. The pieces come in order, each
 * using what the ones before it define; cpu_build.py expands them in place (the build's cache key covers every
 * piece). A new piece with entry points goes with the main unit's (below the #else). */
#ifndef HM_UNIT
#define HM_UNIT 0
#endif
#define HM_MAIN (HM_UNIT == 0)
#include "cpu_types.h"        /* type table, x-type scheme, scalar helpers, scalar dequantizer (+ cpu_grids.h) */
#include "cpu_fp32.h"         /* fp32 row x token kernels: portable, AVX2, AVX-512 */
#include "cpu_act.h"          /* integer path: quantized activations, canonical products (reference) */
#include "cpu_vnni.h"         /* integer-path kernels: AVX-512 VNNI, AVX-VNNI (+ cpu_vnni_x.h) */
#if !HM_MAIN
#include "cpu_units.h"        /* the kernel units: which instances each compiles */
#else
#include "cpu_moe_stream.h"   /* streaming MoE FFN, qmatmul */
#include "cpu_tiles.h"        /* dequantize, bf16 tile products */
#include "cpu_tiles_int8.h"   /* exact int8 tiles (AMX-INT8) */
#include "cpu_tiles_moe.h"    /* grouped tile MoE FFN, tile matmul, MoE entry points */
#include "cpu_decode.h"       /* decode step */
#include "cpu_batch.h"        /* prompt and batch steps, info, repacking, settings */
#endif
