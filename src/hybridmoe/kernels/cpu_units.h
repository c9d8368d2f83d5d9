/* The kernel units: which row x token kernel instances each compiles (cpu_moe.c). The main unit's tables (KTAB2,
 * KTAB in cpu_fp32.h; KQC, KQTAB2 in cpu_vnni.h) point to these instances; each instance is defined in exactly one
 * unit (one missing, or defined twice, fails the link, naming it). The shares are balanced by compile time
 * (docs/cpu-kernels.md has the per-unit times): the build takes about as long as its slowest unit once there are
 * as many cores as units. A new type goes into one unit of each table that has it; a new unit is a new block
 * below and HM_UNITS + 1 (cpu_build.py compiles units 0 .. HM_UNITS - 1).
 * Part of cpu_moe.c: included there by the kernel units only, never compiled alone. */
#define HM_UNITS 12

#if HM_AVX2                 /* AVX2 fp32 kernels (kern_avx2), units 1-5 */
#define K256(TI) KSHAPES(KDEF, k2, kern_avx2, TI)
#if HM_UNIT == 1
K256(I_F32) K256(I_F16) K256(I_BF16) K256(I_Q4_0) K256(I_Q8_0) K256(I_IQ4_NL) K256(I_MXFP4) K256(I_Q4_K)
K256(I_IQ2_KL)
#elif HM_UNIT == 2
K256(I_Q5_K) K256(I_Q6_K) K256(I_Q3_K) K256(I_Q2_K) K256(I_IQ4_XS) K256(I_IQ4_KS)
#elif HM_UNIT == 3
K256(I_IQ4_K) K256(I_IQ3_K) K256(I_IQ2_K) K256(I_IQ5_K) K256(I_IQ2_KS)
#elif HM_UNIT == 4
K256(I_IQ3_XXS) K256(I_IQ3_S) K256(I_IQ2_XXS) K256(I_IQ2_XS) K256(I_IQ1_S)
#elif HM_UNIT == 5
K256(I_IQ1_M) K256(I_IQ2_KT) K256(I_IQ3_KT) K256(I_IQ4_KT)
#endif
#endif

#if HM_AVXVNNI              /* AVX-VNNI / AVX2 integer-path kernels (kern_q8_256), with unit 9 */
#define KQ256(TI) KQSHAPES(KQDEF, kq2, kern_q8_256, TI)
#if HM_UNIT == 9
KQ256(I_Q4_0) KQ256(I_Q4_K) KQ256(I_Q5_K) KQ256(I_Q6_K) KQ256(I_IQ4_NL) KQ256(I_MXFP4) KQ256(I_Q2_K) KQ256(I_Q3_K)
KQ256(I_IQ4_XS) KQ256(I_IQ3_XXS) KQ256(I_IQ3_S) KQ256(I_IQ2_XXS) KQ256(I_IQ2_XS) KQ256(I_IQ1_S) KQ256(I_IQ1_M)
#endif
#endif

#if HM_AVX512               /* AVX-512 fp32 kernels (kern_avx), units 6-9 (9 also has the kq2 ones, above) */
#define K512(TI) KSHAPES(KDEF, k, kern_avx, TI)
#if HM_UNIT == 6
K512(I_F32) K512(I_F16) K512(I_BF16) K512(I_Q4_0) K512(I_Q8_0) K512(I_IQ4_NL) K512(I_MXFP4) K512(I_Q4_K)
K512(I_Q5_K) K512(I_Q6_K) K512(I_IQ2_KL)
#elif HM_UNIT == 7
K512(I_Q3_K) K512(I_Q2_K) K512(I_IQ4_XS) K512(I_IQ4_KS) K512(I_IQ4_K) K512(I_IQ3_K) K512(I_IQ2_K)
#elif HM_UNIT == 8
K512(I_IQ5_K) K512(I_IQ2_KS) K512(I_IQ2_KT) K512(I_IQ3_KT) K512(I_IQ4_KT)
#elif HM_UNIT == 9
K512(I_IQ3_XXS) K512(I_IQ3_S) K512(I_IQ2_XXS) K512(I_IQ2_XS) K512(I_IQ1_S) K512(I_IQ1_M)
#endif
#endif

#if HM_VNNI                 /* AVX-512 VNNI canonical integer products (kern_qc), units 10-11 */
#define KQ512(TI) KQCSHAPES(KQCDEF, TI)
#if HM_UNIT == 10
KQ512(I_Q4_0) KQ512(I_Q8_0) KQ512(I_IQ4_NL) KQ512(I_MXFP4) KQ512(I_Q4_K) KQ512(I_Q5_K) KQ512(I_Q6_K) KQ512(I_Q3_K)
KQ512(I_Q2_K) KQ512(I_IQ4_XS) KQ512(I_IQ4_KS) KQ512(I_IQ4_K) KQ512(I_IQ3_K) KQ512(I_IQ2_K)
#elif HM_UNIT == 11
KQ512(I_IQ5_K) KQ512(I_IQ2_KS) KQ512(I_IQ2_KL) KQ512(I_IQ3_XXS) KQ512(I_IQ3_S) KQ512(I_IQ2_XXS) KQ512(I_IQ2_XS) KQ512(I_IQ1_S)
KQ512(I_IQ1_M) KQ512(I_IQ2_KT) KQ512(I_IQ3_KT) KQ512(I_IQ4_KT)
#endif
#endif
