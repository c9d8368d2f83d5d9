/* The x types on AVX-512: x_u64 (64 weights of a super-block as u: nibbles, crumbs, bit planes, tables, grids,
 * trellis values) and x_scales16 (its 16 scales in vectors), for the integer path and the int8 tiles; rows4_T and
 * x_scales4 (4 rows' scales in the integer path's layout).
 * Part of cpu_moe.c: included by cpu_vnni.h (inside its HM_VNNI block), never compiled alone. */

/* x_extra16 in a few vector ops */
HM_INLINE int x_extra16v(const int ti, const uint8_t *b) {
    if (ti != I_IQ4_KS && ti != I_IQ2_KS) return X_EXTRA(ti) ? rd16(b + 2) : 0;
    /* per 32 (IQ4_KS: bit 0 of the 8 scale bytes; IQ2_KS: the low byte at b), each twice for the sub-blocks of 16 */
    const unsigned m = ti == I_IQ2_KS ? b[0] :
        (unsigned)_mm_movemask_epi8(_mm_slli_epi16(_mm_loadl_epi64((const __m128i *)b), 7)) & 0xFF;
#if defined(__BMI2__)
    return (int)(_pdep_u32(m, 0x5555u) * 3);
#else
    int r = 0;
    for (int k = 0; k < 8; k++) r |= (int)((m >> k) & 1) * 3 << 2 * k;
    return r;
#endif
}

/* 4 bits -> a byte mask of the 128-bit lanes they stand for */
HM_INLINE __mmask64 lanes_mask(unsigned b4) {
    return (((uint64_t)(b4 & 1) | (uint64_t)(b4 & 2) << 15 | (uint64_t)(b4 & 4) << 30 | (uint64_t)(b4 & 8) << 45) *
            0xFFFFu);
}

/* IQ3_XXS's / IQ2_XXS's 8 sign codes of sub-blocks 2c, 2c + 1 (four 7-bit codes in the low 28 bits of each
 * sub-block's u32 at a0, a1) -> the 64 sign bits */
HM_INLINE uint64_t xxs_neg(const int ti, const uint8_t *b, const int c, const uint8_t *a0, const uint8_t *a1) {
#if defined(__BMI2__)
    uint32_t w0, w1;
    memcpy(&w0, a0, 4);
    memcpy(&w1, a1, 4);
    (void)ti; (void)b; (void)c;
    return codes_neg(_pdep_u64(w0, 0x7F7F7F7Full) | _pdep_u64(w1, 0x7F7F7F7Full) << 32);
#else
    uint64_t neg = 0;
    (void)a0; (void)a1;
    for (int k = 0; k < 8; k++) neg |= (uint64_t)xxs_signs(ti, b, 2 * c + k / 4, k % 4) << 8 * k;
    return neg;
#endif
}

/* one bit per 8 bytes (bit k: bytes 8k..8k+7) -> a byte mask */
HM_INLINE uint64_t groups_mask(unsigned bits8) {
#if defined(__BMI2__)
    return _pdep_u64(bits8, 0x0101010101010101ull) * 0xFF;
#else
    uint64_t m = 0;
    for (int k = 0; k < 8; k++) m |= (uint64_t)((bits8 >> k) & 1) * 0xFF << 8 * k;
    return m;
#endif
}

/* IQ1_S / IQ1_M: IQ1S_GRID's entries with the delta folded in, [index | delta sign << 11] = 64 + 8 v + 1 per byte
 * (sign clear) or 64 + 8 v - 1 (set): one gather gives u (32 KiB, built at load) */
HM_STATE(uint64_t g_iq1u[4096] __attribute__((aligned(64))), {0});
#if HM_MAIN
__attribute__((constructor)) static void init_iq1u(void) {
    for (int j = 0; j < 4096; j++)   /* bytes are 56, 64 or 72: no carry crosses a byte */
        g_iq1u[j] = IQ1S_GRID[j & 2047] + (j & 2048 ? (uint64_t)0 - 0x0101010101010101ull : 0x0101010101010101ull);
}
#endif

/* iq1_u64 wants VBMI (vpmultishiftqb: Ice Lake, Sapphire Rapids, Zen 4 on); elsewhere the scalar index code below */
#if defined(__AVX512VBMI__)
#define GRID_VEC 1
#else
#define GRID_VEC 0
#endif

#if GRID_VEC
/* chunk c of IQ1_S / IQ1_M super-block b as u: the 16 grid indices of chunks 2h, 2h + 1 (h = c / 2) are built in one
 * vector (the compiler shares it between the two chunks): index bytes zero-extended, or'd with the 3 high bits and
 * the delta's sign that vpmultishiftqb picks out of qh (8 bytes, broadcast) into bits 8-11 */
HM_INLINE __m512i iq1_u64(const int ti, const uint8_t *b, const int c) {
    const int h = c >> 1;
    uint64_t qh;
    __m512i idx;
    if (ti == I_IQ1_M) {   /* lane m: nibble m of qh (bits 0-2: index bits 8-10, bit 3: the sign) */
        memcpy(&qh, b + 32 + 8 * h, 8);
        const __m512i ms = _mm512_multishift_epi64_epi8(_mm512_setr_epi32(0 << 10, 1 << 10, 2 << 10, 3 << 10, 4 << 10,
            5 << 10, 6 << 10, 7 << 10, 8 << 10, 9 << 10, 10 << 10, 11 << 10, 12 << 10, 13 << 10, 14 << 10, 15 << 10),
                                                        _mm512_set1_epi64((long long)qh));
        idx = _mm512_ternarylogic_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * h))), ms,
                                        _mm512_set1_epi32(0xF00), 0xF8);   /* a | (b & c) */
    } else {               /* lane m: u16 m/4 of qh, bits 3(m%4)..+2 -> 8-10 and its bit 15 (the sign) -> bit 31 */
#define IQ1S_MS(m) (int)((16u * ((m) / 4) + 3u * ((m) % 4)) << 8 | (16u * ((m) / 4) + 8u) << 24)
        memcpy(&qh, b + 34 + 8 * h, 8);
        const __m512i ms = _mm512_multishift_epi64_epi8(_mm512_setr_epi32(IQ1S_MS(0), IQ1S_MS(1), IQ1S_MS(2),
            IQ1S_MS(3), IQ1S_MS(4), IQ1S_MS(5), IQ1S_MS(6), IQ1S_MS(7), IQ1S_MS(8), IQ1S_MS(9), IQ1S_MS(10),
            IQ1S_MS(11), IQ1S_MS(12), IQ1S_MS(13), IQ1S_MS(14), IQ1S_MS(15)), _mm512_set1_epi64((long long)qh));
#undef IQ1S_MS
        idx = _mm512_ternarylogic_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * h))), ms,
                                        _mm512_set1_epi32(0x700), 0xF8);
        idx = _mm512_mask_or_epi32(idx, _mm512_movepi32_mask(ms), idx, _mm512_set1_epi32(0x800));
    }
    return _mm512_i32gather_epi64(c & 1 ? _mm512_extracti64x4_epi64(idx, 1) : _mm512_castsi512_si256(idx),
                                  (const void *)g_iq1u, 8);
}
#endif

#if GRID_VEC && defined(__AVX512BITALG__)
#define GRID_VSIGNS 1
/* the 32 sign bytes of IQ3_XXS / IQ2_XXS / IQ2_XS super-block b, byte k the signs of group k of 8 (bit l: element l):
 * the 7-bit codes picked into bytes (vpmultishiftqb, IQ2_XS a shift and a narrowing), their parity on top (vpopcntb).
 * The compiler shares it between the super-block's four chunks. */
HM_INLINE __m256i grid_signs32(const int ti, const uint8_t *b) {
    __m256i codes;
    if (ti == I_IQ3_XXS)          /* u32 s at 66 + 4s: codes at bits 0, 7, 14, 21; a qword holds two sub-blocks */
        codes = _mm256_multishift_epi64_epi8(_mm256_set1_epi64x(0x352E2720150E0700ll),
                                             _mm256_loadu_si256((const __m256i *)(b + 66)));
    else if (ti == I_IQ2_XXS)     /* qword s at 2 + 8s: 4 index bytes, then the u32 of codes */
        codes = _mm512_cvtepi64_epi32(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352E2720ll),
                                                                   _mm512_loadu_si512((const void *)(b + 2))));
    else                          /* IQ2_XS: u16 k at 2 + 2k, its code in bits 9-15 */
        codes = _mm512_cvtepi16_epi8(_mm512_srli_epi16(_mm512_loadu_si512((const void *)(b + 2)), 9));
    const __m256i m = _mm256_and_si256(codes, _mm256_set1_epi8(0x7F));
    /* m | parity << 7: bit 0 of each byte's popcount to its bit 7 (what the word shift spills is masked off) */
    return _mm256_ternarylogic_epi32(m, _mm256_slli_epi16(_mm256_popcnt_epi8(m), 7), _mm256_set1_epi8((char)0x80), 0xF8);
}

/* chunk c's sign mask from grid_signs32: bit 8k + l = bit l of sign byte 8c + k (vpermb spreads, vptestmb tests) */
HM_INLINE __mmask64 grid_neg(const __m256i s, const int c) {
    const long long k = 0x0101010101010101ll;
    const __m512i spread = _mm512_permutexvar_epi8(_mm512_set_epi64((8 * c + 7) * k, (8 * c + 6) * k, (8 * c + 5) * k,
        (8 * c + 4) * k, (8 * c + 3) * k, (8 * c + 2) * k, (8 * c + 1) * k, 8 * c * k), _mm512_castsi256_si512(s));
    return _mm512_test_epi8_mask(spread, _mm512_set1_epi64(0x8040201008040201ll));
}
#else
#define GRID_VSIGNS 0
#endif

/* chunk c (elements 64c..64c+63) of grid-type super-block b as u (x_value), in element order */
HM_INLINE __m512i grid_u64(const int ti, const uint8_t *b, const int c) {
#if GRID_VEC
    if (ti == I_IQ1_S || ti == I_IQ1_M) return iq1_u64(ti, b, c);
#endif
    const __m512i o = _mm512_set1_epi8(64);
    if (ti == I_IQ3_XXS || ti == I_IQ3_S) {   /* 16 indices of 4 magnitudes: vpgatherdd */
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * c)));
        uint64_t neg;
        if (ti == I_IQ3_S) {   /* the 9th index bits: bit k of the u16 at 66 + 2c; plain sign bytes */
            idx = _mm512_mask_or_epi32(idx, (__mmask16)rd16(b + 66 + 2 * c), idx, _mm512_set1_epi32(256));
            memcpy(&neg, b + 74 + 8 * c, 8);
        } else {
#if GRID_VSIGNS
            neg = grid_neg(grid_signs32(ti, b), c);
#else
            neg = xxs_neg(ti, b, c, b + 66 + 8 * c, b + 70 + 8 * c);
#endif
        }
        const __m512i g = _mm512_i32gather_epi32(idx, (const void *)(ti == I_IQ3_S ? IQ3S_GRID : IQ3XXS_GRID), 4);
        return _mm512_mask_sub_epi8(_mm512_add_epi8(o, g), (__mmask64)neg, o, g);
    }
    /* 8 indices of 8 values: vpgatherqq */
    __m256i idx;
    uint64_t neg;
    switch (ti) {
    case I_IQ2_XXS: {   /* sub-block s: 4 index bytes, then its u32 of codes and scale */
#if GRID_VEC            /* the 16 indices of chunks 2h, 2h + 1 by one vpermb (shared by the two chunks) */
        const __m512i i16 = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10,
            11, 16, 17, 18, 19, 24, 25, 26, 27), _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2 + 32 * (c >> 1)))));
        idx = c & 1 ? _mm512_extracti64x4_epi64(i16, 1) : _mm512_castsi512_si256(i16);
#else
        uint32_t i0, i1;
        memcpy(&i0, b + 2 + 16 * c, 4);
        memcpy(&i1, b + 10 + 16 * c, 4);
        idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)((uint64_t)i1 << 32 | i0)));
#endif
#if GRID_VSIGNS
        neg = grid_neg(grid_signs32(ti, b), c);
#else
        neg = xxs_neg(ti, b, c, b + 6 + 16 * c, b + 14 + 16 * c);
#endif
        break;
    }
    case I_IQ2_XS: {    /* a u16 per 8: 9-bit index, 7-bit code */
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * c));
        idx = _mm256_and_si256(_mm256_cvtepu16_epi32(q), _mm256_set1_epi32(511));
#if GRID_VSIGNS
        neg = grid_neg(grid_signs32(ti, b), c);
#else
        neg = codes_neg((uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(_mm_srli_epi16(q, 9), _mm_setzero_si128())));
#endif
        break;
    }
    case I_IQ1_S: {     /* sub-block s: 4 index bytes; 3 index bits each, the scale and the delta's sign in qh[s] */
        uint32_t h;                                   /* qh[2c] | qh[2c + 1] << 16 */
        memcpy(&h, b + 34 + 4 * c, 4);
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)h),
                                                              _mm256_setr_epi32(0, 3, 6, 9, 16, 19, 22, 25)),
                                            _mm256_set1_epi32(7));
        idx = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * c))),
                              _mm256_slli_epi32(hi, 8));
        neg = (uint64_t)(0u - ((h >> 15) & 1)) | (uint64_t)(0u - (h >> 31)) << 32;
        break;
    }
    default: {          /* IQ1_M: group k: an index byte, a nibble of 3 index bits and the delta's sign */
        uint32_t nb;
        memcpy(&nb, b + 32 + 4 * c, 4);
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)nb),
                                                              _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                            _mm256_set1_epi32(7));
        idx = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * c))),
                              _mm256_slli_epi32(hi, 8));
#if defined(__BMI2__)
        neg = groups_mask(_pext_u32(nb, 0x88888888u));
#else
        unsigned s8 = 0;
        for (int k = 0; k < 8; k++) s8 |= ((nb >> (4 * k + 3)) & 1) << k;
        neg = groups_mask(s8);
#endif
        break;
    }
    }
    if (ti == I_IQ1_S || ti == I_IQ1_M) {   /* 64 + 8 v, then + 1 or - 1 */
        const __m512i g = _mm512_i32gather_epi64(idx, (const void *)IQ1S_GRID, 8), one = _mm512_set1_epi8(1);
        return _mm512_mask_sub_epi8(_mm512_add_epi8(g, one), (__mmask64)neg, g, one);
    }
    const __m512i g = _mm512_i32gather_epi64(idx, (const void *)(ti == I_IQ2_XS ? IQ2XS_GRID : IQ2XXS_GRID), 8);
    return _mm512_mask_sub_epi8(_mm512_add_epi8(o, g), (__mmask64)neg, o, g);
}

/* IQ2_KT's and IQ3_KT's 8 values (steps 1..8) of every u16 index as u = 128 + v, from kt_value: 512 KiB that
 * stay in L2 while the weights stream past. One vpgatherqq gives 64 values; computing them takes four vpmulld
 * (two uops each on the port vpdpbusd needs) and a dozen more vector ops (T=1: 1.4x with the table). */
HM_STATE(uint64_t g_kt8[65536], {0});
#if HM_MAIN
__attribute__((constructor)) static void init_kt8_table(void) {
    for (uint32_t i = 0; i < 65536; i++) {
        uint64_t u = 0;
        for (int n = 0; n < 8; n++) u |= (uint64_t)(128 + kt_value(4096 + i, n + 1)) << 8 * n;
        g_kt8[i] = u;
    }
}
#endif

/* IQ4_KT's values are computed (its table would be 16 lookups per 64 values: slower). Vector k (0..3) holds
 * weight 4L + k of the chunk in lane L as the generator's state (seed L times KA^(k+1), one vpmulld per 16
 * weights) masked to four 6-bit bytes; the value is their sum minus 126. Two rounds of byte shuffles and adds
 * (port 5 and any vector port, not vpdpbusd's) leave lane L = the four sums of weights 4L..4L+3. */
HM_INLINE __m512i kt_state(__m512i x, uint32_t p) {
    return _mm512_and_si512(_mm512_mullo_epi32(x, _mm512_set1_epi32((int)p)), _mm512_set1_epi32(0x3F3F3F3F));
}

/* [a, b] -> per 16-bit word [a's byte pair sum, b's byte pair sum] (each <= 126) */
HM_INLINE __m512i kt_pair_sums(__m512i a, __m512i b) {
    const __m512i sw = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    const __m512i lo = _mm512_mask_shuffle_epi8(a, 0xAAAAAAAAAAAAAAAAull, b, sw);   /* [a.0, b.0] */
    const __m512i hi = _mm512_mask_shuffle_epi8(b, 0x5555555555555555ull, a, sw);   /* [a.1, b.1] */
    return _mm512_add_epi8(lo, hi);
}

/* s[0..3] (states as above) -> lane L byte k = the byte sum of s[k]'s lane L (0..252) */
HM_INLINE __m512i kt_sums64(const __m512i *s) {
    const __m512i r01 = kt_pair_sums(s[0], s[1]), r23 = kt_pair_sums(s[2], s[3]);   /* [a0 b0 a1 b1] per lane */
    const __m512i sw = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    const __m512i lo = _mm512_mask_shuffle_epi8(r01, 0xCCCCCCCCCCCCCCCCull, r23, sw);
    const __m512i hi = _mm512_mask_shuffle_epi8(r23, 0x3333333333333333ull, r01, sw);
    return _mm512_add_epi8(lo, hi);
}

/* chunk c (elements 64c..64c+63) of trellis-type super-block b as u (x_value), in element order */
HM_INLINE __m512i kt_u64(const int ti, const uint8_t *b, const int c) {
    if (ti != I_IQ4_KT) {   /* 8 groups of 8, a u16 index each */
        const __m512i u = _mm512_i32gather_epi64(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 4 + 16 * c))),
                                                 (const void *)g_kt8, 8);
        if (ti == I_IQ2_KT) return u;
        /* IQ3_KT: 128 +- |v|; the sign of element l of 32-block j is bit j of qh[l] (one vptestmb for both blocks) */
        const __mmask64 neg = _mm512_test_epi8_mask(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 68))),
                                                    _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << 2 * c)),
                                                                       _mm256_set1_epi8((char)(2 << 2 * c)), 1));
        const __m512i o = _mm512_set1_epi8((char)128), a = _mm512_abs_epi8(_mm512_xor_si512(u, o));
        return _mm512_mask_sub_epi8(_mm512_add_epi8(o, a), neg, o, a);
    }
    /* IQ4_KT: 16 groups of 4 (blocks 2c, 2c + 1), lane L the seed of group L */
    uint32_t h0, h1;
    memcpy(&h0, b + 8 * c, 4);
    memcpy(&h1, b + 8 * c + 4, 4);
    /* seed = 4096 + qs byte | qh nibble << 8 | 3 bits of the block's u32 << 12 | its bit 0 << 15 */
    const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi32((int)h0), _mm256_set1_epi32((int)h1), 1);
    const __m512i top = _mm512_and_si512(_mm512_rorv_epi32(sh, _mm512_setr_epi32(28, 31, 2, 5, 8, 11, 14, 17, 28, 31,
                                                                                 2, 5, 8, 11, 14, 17)),
                                         _mm512_set1_epi32(0x7000));     /* bits 8 + 3k.. -> 12..14 */
    const __m512i nib = _mm512_and_si512(_mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(
        (const __m128i *)(b + 96 + 16 * (c & 1)))), 8 - 4 * (c >> 1)), _mm512_set1_epi32(0xF00));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32 + 16 * c)));
    const __m512i hb = _mm512_ternarylogic_epi32(_mm512_ror_epi32(sh, 17), _mm512_set1_epi32(0x8000),
                                                 _mm512_set1_epi32(4096), 0xEA);   /* (a & b) | c */
    const __m512i x = _mm512_add_epi32(_mm512_ternarylogic_epi32(q, nib, top, 0xFE), hb);   /* a | b | c */
    const __m512i s[4] = {kt_state(x, KT_KA), kt_state(x, KT_KA * KT_KA), kt_state(x, KT_KA * KT_KA * KT_KA),
                          kt_state(x, KT_KA * KT_KA * KT_KA * KT_KA)};
    return _mm512_add_epi8(kt_sums64(s), _mm512_set1_epi8(2));      /* 128 + v = sum + 2 */
}

#if GRID_VEC
/* the table values of indices q (< 32) of chunk c, lane L taking table (bit 4c + L of ex) of XTAB[ti]: that bit is
 * put at bit 5 of each byte (vpmultishiftqb rotates it out of the broadcast ex), so one vpermb over both tables'
 * 64 bytes looks them up */
HM_INLINE __m512i x_tab2(const int ti, const __m512i q, const int c, const int ex) {
#define XT_O(L) (long long)(0x0101010101010101ull * (uint64_t)((4 * c + (L) + 59) & 63))
    const __m512i sel = _mm512_multishift_epi64_epi8(_mm512_set_epi64(XT_O(3), XT_O(3), XT_O(2), XT_O(2), XT_O(1),
                                                                       XT_O(1), XT_O(0), XT_O(0)),
                                                     _mm512_set1_epi64((long long)(unsigned)ex));
#undef XT_O
    return _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(q, sel, _mm512_set1_epi8(0x20), 0xF8),   /* a | (b & c) */
                                   _mm512_loadu_si512((const void *)XTAB[ti]));
}
#endif

/* chunk c (elements 64c..64c+63) of x-type super-block b as unsigned bytes, in element order (ex: x_extra16) */
HM_INLINE __m512i x_u64(const int ti, const uint8_t *b, const int c, const int ex) {
    __m512i q;
    if (X_GRID(ti)) return grid_u64(ti, b, c);
    if (X_KT(ti)) return kt_u64(ti, b, c);
    if (X_PAIRS(ti)) {   /* sub-blocks 2c, 2c + 1: 32 pair indices -> 32 u16 of two u each (vpermw) */
        /* the nibbles of qs (low ones, then high); bit 2c (2c + 1) of qh -> bit 4 of the low (high) half */
        const __m256i nib = nib32(b + 6 + 16 * c);
        const __m256i hb = _mm256_gf2p8affine_epi64_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(
            (const __m128i *)(b + 70))), _mm256_set_epi64x((long long)GF_BIT(2 * c + 1), (long long)GF_BIT(2 * c + 1),
                                                           (long long)GF_BIT(2 * c), (long long)GF_BIT(2 * c)), 0);
        const __m512i idx = _mm512_cvtepu8_epi16(_mm256_or_si256(nib, hb));
        return _mm512_permutexvar_epi16(idx, _mm512_load_si512((const void *)KL_PAIRS));
    }
    if (X_NIB64(ti)) {   /* [qs, qs] -> [low nibbles, high nibbles], bits 2c, 2c + 1 of qh -> bit 4 */
        const __m512i mqk = _mm512_set_epi64(GF_HI, GF_HI, GF_HI, GF_HI, GF_LO, GF_LO, GF_LO, GF_LO);
        const __m512i mh = _mm512_set_epi64(GF_BIT(2 * c + 1), GF_BIT(2 * c + 1), GF_BIT(2 * c + 1), GF_BIT(2 * c + 1),
                                            GF_BIT(2 * c), GF_BIT(2 * c), GF_BIT(2 * c), GF_BIT(2 * c));
        q = _mm512_gf2p8affine_epi64_epi8(_mm512_broadcast_i64x4(_mm256_loadu_si256(
            (const __m256i *)(b + X_QS(ti) + 32 * c))), mqk, 0);
        q = _mm512_or_si512(q, _mm512_gf2p8affine_epi64_epi8(_mm512_broadcast_i64x4(_mm256_loadu_si256(
            (const __m256i *)(b + X_QH(ti)))), mh, 0));
#if GRID_VEC
        return x_tab2(ti, q, c, ex);
#else
        /* 32-entry tables, two per extra bit: four vpshufb, merged by bit 4 and the lanes' extra bits */
        const __mmask64 h = _mm512_test_epi8_mask(q, _mm512_set1_epi8(0x10)), e = lanes_mask((unsigned)(ex >> 4 * c) & 0xF);
#define XT(k, o) _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)(XTAB[ti][k] + (o))))
        __m512i u = _mm512_shuffle_epi8(XT(0, 0), q);
        u = _mm512_mask_shuffle_epi8(u, h & ~e, XT(0, 16), q);
        u = _mm512_mask_shuffle_epi8(u, ~h & e, XT(1, 0), q);
        return _mm512_mask_shuffle_epi8(u, h & e, XT(1, 16), q);
#undef XT
#endif
    }
    if (X_NIB(ti)) {   /* 32-blocks 2c, 2c + 1: [qs0, qs0, qs1, qs1] -> nibbles [lo0, hi0, lo1, hi1] */
        const __m512i mq40 = _mm512_set_epi64(GF_HI, GF_HI, GF_LO, GF_LO, GF_HI, GF_HI, GF_LO, GF_LO);
        q = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b + X_QS(ti) + 32 * c)));
        q = _mm512_mask_broadcast_i32x4(q, 0xFF00, _mm_loadu_si128((const __m128i *)(b + X_QS(ti) + 16 + 32 * c)));
        q = _mm512_gf2p8affine_epi64_epi8(q, mq40, 0);
    } else {
        /* units 2(c&1), 2(c&1) + 1 of half c/2: the same 32 bytes of 2-bit fields, bit pairs j0, j0 + 1 */
        const int n = c >> 1, j0 = 2 * (c & 1);
        const __m512i m2 = _mm512_set_epi64(GF_2LOW(2 * j0 + 2), GF_2LOW(2 * j0 + 2), GF_2LOW(2 * j0 + 2),
            GF_2LOW(2 * j0 + 2), GF_2LOW(2 * j0), GF_2LOW(2 * j0), GF_2LOW(2 * j0), GF_2LOW(2 * j0));
        q = _mm512_gf2p8affine_epi64_epi8(_mm512_broadcast_i64x4(_mm256_loadu_si256(
            (const __m256i *)(b + X_QS(ti) + 32 * n))), m2, 0);
        if (X_3BIT(ti)) {
            const int k = 4 * n + j0;   /* qh bits k, k + 1 -> bit 2 */
            const __m512i mh = _mm512_set_epi64(GF_TO2(k + 1), GF_TO2(k + 1), GF_TO2(k + 1), GF_TO2(k + 1),
                                                GF_TO2(k), GF_TO2(k), GF_TO2(k), GF_TO2(k));
            q = _mm512_or_si512(q, _mm512_gf2p8affine_epi64_epi8(
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + X_QH(ti)))), mh, 0));
        }
    }
    if (!X_TAB(ti)) return q;
#if GRID_VEC
    if (X_EXTRA(ti)) return x_tab2(ti, q, c, ex);
#endif
    const __m512i u = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)XTAB[ti][0])), q);
    if (!X_EXTRA(ti)) return u;
    return _mm512_mask_shuffle_epi8(u, lanes_mask((unsigned)(ex >> 4 * c) & 0xF),
                                    _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)XTAB[ti][1])), q);
}

/* 8 bytes of nibbles -> the 16 nibbles in order (low, high of byte 0, ...) as int32 */
HM_INLINE __m512i nibbles16(const uint8_t *p) {
    const __m128i x = _mm_loadl_epi64((const __m128i *)p), m4 = _mm_set1_epi8(0x0F);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
}

/* x_scales of super-block b in vectors: S (and M, Q2_K's mins) of the 16 sub-blocks, the same floats */
HM_INLINE void x_scales16(const int ti, const uint8_t *b, const float rd, __m512 *S, __m512 *M) {
    *M = _mm512_setzero_ps();
    switch (ti) {
    case I_Q2_K: {
        const __m128i v = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(0x0F);
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b + 80)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, m4))));
        *M = _mm512_mul_ps(_mm512_set1_ps(F16(b + 82)),
                           _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m4))));
        return;
    }
    case I_Q3_K: {
        /* low 4 bits: s[i] & 15 (i < 8), s[i - 8] >> 4; bits 4-5: bits 2(i/4) of s[8 + i%4] */
        const __m128i x = _mm_loadl_epi64((const __m128i *)(b + 96)), m4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4));
        uint32_t hw;
        memcpy(&hw, b + 104, 4);
        const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)hw), _mm_setr_epi32(0, 2, 4, 6)),
                                         _mm_set1_epi8(3));
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)));
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b + 108)), _mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32))));
        return;
    }
    case I_IQ4_K: case I_IQ5_K: {   /* bits 4-5: bits 2(i%4) of sh[i/4] */
        uint32_t hw;
        memcpy(&hw, b + 4, 4);
        const __m512i sh = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)hw),
                                                                 _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)));
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(sh, _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6,
                                                                                      0, 2, 4, 6)), _mm512_set1_epi32(3));
        const __m512i ls = _mm512_or_si512(nibbles16(b + 8), _mm512_slli_epi32(hi, 4));
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b)), _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
        return;
    }
    case I_IQ3_K: {   /* (2 ls + 1), negated where bit i of the u16 at b + 4 is set */
        const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(nibbles16(b + 6), 1), _mm512_set1_epi32(1));
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b)), _mm512_cvtepi32_ps(
            _mm512_mask_sub_epi32(v, (__mmask16)rd16(b + 4), _mm512_setzero_si512(), v)));
        return;
    }
    case I_IQ2_K:
        *S = _mm512_mul_ps(_mm512_set1_ps(F16(b)), _mm512_cvtepi32_ps(_mm512_sub_epi32(nibbles16(b + 4), _mm512_set1_epi32(8))));
        return;
    case I_IQ2_XS:   /* d (s + 0.5) 0.25, s the nibbles at b + 66 */
        *S = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(F16(b)), _mm512_add_ps(_mm512_cvtepi32_ps(nibbles16(b + 66)),
                                                                               _mm512_set1_ps(0.5f))),
                           _mm512_set1_ps(0.25f));
        return;
    case I_IQ1_M: {  /* d (2 f + 1) / 8, f bits 3(i%4) of the u16 i/4 at b + 48 */
        const __m512i sc = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
            _mm512_castsi128_si512(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(b + 48)))));
        const __m512i f = _mm512_and_si512(_mm512_srlv_epi32(sc, _mm512_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9,
                                                                                    0, 3, 6, 9)), _mm512_set1_epi32(7));
        const __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(f, 1), _mm512_set1_epi32(1)));
        *S = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(g_f16[iq1m_d(b)]), v), _mm512_set1_ps(0.125f));
        return;
    }
    }
    /* IQ4_XS, IQ4_KS, IQ2_KS, IQ2_KL, IQ3_XXS, IQ2_XXS, IQ3_S, IQ1_S, the KT types: 8 scales of 32, each twice */
    __m256 s8;
    if (ti == I_IQ2_KT || ti == I_IQ3_KT) {   /* the row scale times a code from a nibble: low ones first */
        uint32_t lw;
        memcpy(&lw, b, 4);
        const __m128i x = _mm_cvtsi32_si128((int)lw), m4 = _mm_set1_epi8(0x0F);
        const __m512i nib = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_unpacklo_epi32(_mm_and_si128(x, m4),
                                                                                          _mm_and_si128(_mm_srli_epi16(x, 4), m4))));
        const __m512 code = ti == I_IQ2_KT ? _mm512_permutexvar_ps(nib, _mm512_loadu_ps(KV_IQ4NL)) : _mm512_cvtepi32_ps(nib);
        s8 = _mm256_mul_ps(_mm256_set1_ps(rd), _mm512_castps512_ps256(code));
    } else if (ti == I_IQ4_KT) {   /* the row scale times (bits 1-7 of each 32-block's u32) - 64 */
        const __m256i sh = _mm256_loadu_si256((const __m256i *)b);
        s8 = _mm256_mul_ps(_mm256_set1_ps(rd), _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(
            _mm256_and_si256(sh, _mm256_set1_epi32(0xFF)), 1), _mm256_set1_epi32(64))));
    } else if (ti == I_IQ3_XXS || ti == I_IQ2_XXS) {   /* d (ls + 0.5) 0.5 (0.25), ls the top 4 bits of each sub-block's u32 */
        const __m256i ls = ti == I_IQ3_XXS ? _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(b + 66)), 28) :
            _mm512_castsi512_si256(_mm512_permutexvar_epi32(_mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11,
                                                                              13, 15),
                                                            _mm512_srli_epi32(_mm512_loadu_si512((const void *)(b + 2)), 28)));
        s8 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(F16(b)), _mm256_add_ps(_mm256_cvtepi32_ps(ls), _mm256_set1_ps(0.5f))),
                           _mm256_set1_ps(ti == I_IQ3_XXS ? 0.5f : 0.25f));
    } else if (ti == I_IQ3_S) {   /* d (1 + 2 s), s the nibbles at b + 106 */
        uint32_t lw;
        memcpy(&lw, b + 106, 4);
        const __m128i x = _mm_cvtsi32_si128((int)lw), m4 = _mm_set1_epi8(0x0F);
        const __m256i s = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
        s8 = _mm256_mul_ps(_mm256_set1_ps(F16(b)), _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(s, 1),
                                                                                       _mm256_set1_epi32(1))));
    } else if (ti == I_IQ1_S) {   /* d (2 f + 1) / 8, f bits 12-14 of each sub-block's u16 at b + 34 */
        const __m256i f = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 34))),
                                                             12), _mm256_set1_epi32(7));
        s8 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(F16(b)), _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(f, 1),
                                                                                                     _mm256_set1_epi32(1)))),
                           _mm256_set1_ps(0.125f));
    } else if (ti == I_IQ2_KL) {   /* nibble s/4 of byte 2 + s%4, bits 4-5 from bits 2s of the u16 at b */
        uint32_t lw;
        memcpy(&lw, b + 2, 4);
        const __m128i x = _mm_cvtsi32_si128((int)lw), m4 = _mm_set1_epi8(0x0F);
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_unpacklo_epi32(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(rd16(b)),
                                                              _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                            _mm256_set1_epi32(3));
        s8 = _mm256_mul_ps(_mm256_set1_ps(rd), _mm256_cvtepi32_ps(
            _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32))));
    } else if (ti == I_IQ2_KS) {   /* nibbles at b + 2, bit 4 from bits 8-15 of the u16 at b */
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(rd16(b)),
                                                              _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)),
                                            _mm256_set1_epi32(1));
        uint32_t lw;
        memcpy(&lw, b + 2, 4);
        const __m128i x = _mm_cvtsi32_si128((int)lw), m4 = _mm_set1_epi8(0x0F);
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(16));
        s8 = _mm256_mul_ps(_mm256_set1_ps(rd), _mm256_cvtepi32_ps(ls));
    } else if (ti == I_IQ4_KS) {
        const __m256i ls = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_loadl_epi64((const __m128i *)b),
                                                                               _mm_set1_epi8((char)254))),
                                            _mm256_set1_epi32(127));
        s8 = _mm256_mul_ps(_mm256_set1_ps(rd), _mm256_cvtepi32_ps(ls));
    } else {   /* IQ4_XS: low 4 bits from the nibbles at b + 4, bits 4-5 from the u16 at b + 2 */
        uint32_t lw;
        memcpy(&lw, b + 4, 4);
        const __m128i x = _mm_cvtsi32_si128((int)lw), m4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(x, m4), _mm_and_si128(_mm_srli_epi16(x, 4), m4)));
        const __m128i hi = _mm_and_si128(_mm_srlv_epi16(_mm_set1_epi16((short)rd16(b + 2)),
                                                        _mm_setr_epi16(0, 2, 4, 6, 8, 10, 12, 14)), _mm_set1_epi16(3));
        const __m256i ls = _mm256_sub_epi32(_mm256_cvtepu16_epi32(_mm_or_si128(lo, _mm_slli_epi16(hi, 4))),
                                            _mm256_set1_epi32(32));
        s8 = _mm256_mul_ps(_mm256_set1_ps(F16(b)), _mm256_cvtepi32_ps(ls));
    }
    *S = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castps256_ps512(s8));
}

/* 4 rows' 16 values v[r] -> o[c] = [values 4c..4c+3 of rows 0-3]: lane 4L + r holds v[r][4c + L] */
HM_INLINE void rows4_T(const __m512 *v, __m512 *o) {
    const __m512 t0 = _mm512_unpacklo_ps(v[0], v[1]), t1 = _mm512_unpackhi_ps(v[0], v[1]);
    const __m512 t2 = _mm512_unpacklo_ps(v[2], v[3]), t3 = _mm512_unpackhi_ps(v[2], v[3]);
    const __m512 u0 = _mm512_shuffle_ps(t0, t2, 0x44), u1 = _mm512_shuffle_ps(t0, t2, 0xEE);
    const __m512 u2 = _mm512_shuffle_ps(t1, t3, 0x44), u3 = _mm512_shuffle_ps(t1, t3, 0xEE);
    const __m512 v0 = _mm512_shuffle_f32x4(u0, u1, 0x44), v1 = _mm512_shuffle_f32x4(u2, u3, 0x44);
    const __m512 v2 = _mm512_shuffle_f32x4(u0, u1, 0xEE), v3 = _mm512_shuffle_f32x4(u2, u3, 0xEE);
    o[0] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    o[1] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
    o[2] = _mm512_shuffle_f32x4(v2, v3, 0x88);
    o[3] = _mm512_shuffle_f32x4(v2, v3, 0xDD);
}

/* x_scales16 of 4 rows at once, for the types whose scales are a per-row multiplier times small integer codes:
 * the 4 rows' scale bytes are unpacked side by side (a row's 16 bytes in each 128-bit lane: one vector op for all
 * four rows) and moved by one vpermb into rows4_T's layout, so the unpacking, the converts and the transpose are
 * paid once per 4 rows. The floats are x_scales16's: S = multiplier * (float)code, one rounding. */
#if defined(__AVX512VBMI__)
#define XS4_VEC 1
#define XS4(ti) ((ti) == I_IQ4_XS || (ti) == I_IQ4_KS || (ti) == I_Q3_K || (ti) == I_IQ4_K || (ti) == I_IQ5_K || \
                 (ti) == I_Q2_K || (ti) == I_IQ2_K || (ti) == I_IQ3_K || (ti) == I_IQ2_KS || (ti) == I_IQ2_KL)

/* the 16 bytes at p[r] + off as 128-bit lane r */
HM_INLINE __m512i rows4_x16(const uint8_t *const *p, const int64_t off) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[0] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[1] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[2] + off)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[3] + off)), 3);
}

/* the vpermb index taking code i of lane r to byte 16 (i / 4) + 4 (i % 4) + r (rows4_T's [sub-block 4c + L][row r]):
 * from byte k + i (XS4_BYTE), k + i / 2 (XS4_PER32: a code per 32 weights), or, from two sources (vpermt2b),
 * byte k + i of the first for i < n and byte i - n of the second after (XS4_SPLIT: nibbles that straddle an
 * unpack's halves) */
enum { XS4_BYTE, XS4_PER32, XS4_SPLIT };
HM_INLINE __m512i xs4_index(const int k, const int mode, const int n) {
    uint8_t ix[64] __attribute__((aligned(64)));
    for (int i = 0; i < 16; i++)
        for (int r = 0; r < 4; r++)
            ix[4 * i + r] = (uint8_t)(16 * r + (mode == XS4_BYTE ? k + i : mode == XS4_PER32 ? k + i / 2 :
                                                i < n ? k + i : 64 + i - n));
    return _mm512_load_si512(ix);
}

/* [c][L][r] int8 codes C times the rows' multipliers m (lanes 4L + r) -> Sc[c] as rows4_T gives them */
HM_INLINE void xs4_floats(const __m512i C, const __m512 m, __m512 *Sc) {
    Sc[0] = _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(C))));
    Sc[1] = _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(C, 1))));
    Sc[2] = _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(C, 2))));
    Sc[3] = _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(C, 3))));
}

/* the fp16 at byte k of each lane of s -> [the 4 lanes' values] in every 128-bit lane */
HM_INLINE __m512 xs4_f16(const __m512i s, const int k) {
    const __m512i ix = _mm512_castsi128_si512(_mm_setr_epi8((char)k, (char)(k + 1), (char)(16 + k), (char)(17 + k),
        (char)(32 + k), (char)(33 + k), (char)(48 + k), (char)(49 + k), 0, 0, 0, 0, 0, 0, 0, 0));
    return _mm512_broadcast_f32x4(_mm_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi8(ix, s))));
}

/* the fp16 at p[r] + off of rows 0-3 -> [the 4 values] in every 128-bit lane (row r's in lanes 4L + r) */
HM_INLINE __m512 rows4_f16(const uint8_t *const *p, const int64_t off) {
    const __m128i d = _mm_setr_epi16((short)rd16(p[0] + off), (short)rd16(p[1] + off), (short)rd16(p[2] + off),
                                     (short)rd16(p[3] + off), 0, 0, 0, 0);
    return _mm512_broadcast_f32x4(_mm_cvtph_ps(d));
}

/* (lo | (hi & hm)) - bias per byte: a code from its low nibble and its high bits already in place (hm: where) */
HM_INLINE __m512i xs4_code(const __m512i lo, const __m512i hi, const char hm, const char bias) {
    return _mm512_sub_epi8(_mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(hm), 0xF8), _mm512_set1_epi8(bias));
}

/* a vpmultishiftqb control: output byte i (0..15) of every lane takes the 8 bits from bit F(i) of its qword on */
#define XS4_MS(F) _mm512_broadcast_i32x4(_mm_setr_epi8(F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), F(9), \
                                                       F(10), F(11), F(12), F(13), F(14), F(15)))
/* IQ4_XS: bits 2j, 2j + 1 of the u16 at byte 2 (qword 0's bits 16 + 2j) -> bits 4-5 of byte 8 + j */
#define XS4_MS_IQ4XS(i) ((i) < 8 ? 0 : 12 + 2 * ((i) - 8))
/* Q3_K: bits 2(i/4), +1 of scale byte 8 + i%4 (qword 1's bits 8(i%4) on) -> bits 4-5 of byte i (the offsets rotate:
 * -4 is bit 60) */
#define XS4_MS_Q3K(i) ((8 * ((i) % 4) + 2 * ((i) / 4) + 60) % 64)
/* IQ4_K, IQ5_K: bits 2(i%4), +1 of byte 4 + i/4 (qword 0's bits 32 + 8(i/4) on) -> bits 4-5 of byte i */
#define XS4_MS_IQ4K(i) (28 + 8 * ((i) / 4) + 2 * ((i) % 4))
/* IQ2_KS: bit 8 + s of the u16 at byte 0 -> bit 4 of byte 4 + s (beside its nibble) */
#define XS4_MS_IQ2KS(i) ((i) >= 4 && (i) < 12 ? (i) : 0)
/* IQ2_KL: bits 2s, 2s + 1 of the u16 at byte 0 -> bits 4-5 of byte 2 + s (beside its nibble) */
#define XS4_MS_IQ2KL(i) ((i) >= 2 && (i) < 10 ? (2 * ((i) - 2) + 60) % 64 : 0)
/* IQ3_K: bit i of the u16 at byte 4 (its sign) -> bit 0 of byte i */
#define XS4_MS_IQ3K(i) (32 + (i))

/* the scales (and Q2_K's mins) of super-block o of rows w[0..3] (an XS4 type) as rows4_T gives them from x_scales16;
 * rd4: the rows' x_rowscale, row r's in lanes 4L + r */
HM_INLINE void x_scales4(const int ti, const uint8_t *const *w, const int64_t o, const __m512 rd4, __m512 *Sc,
                         __m512 *Mc) {
    const int64_t off = TINFO[ti].hdr + o;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (ti == I_IQ4_KS) {         /* lanes: 8 scale bytes; code (byte & 254) - 127 */
        const __m512i s = rows4_x16(w, off);
        const __m512i v = _mm512_sub_epi8(_mm512_and_si512(s, _mm512_set1_epi8((char)254)), _mm512_set1_epi8(127));
        xs4_floats(_mm512_permutexvar_epi8(xs4_index(0, XS4_PER32, 0), v), rd4, Sc);
        return;
    }
    if (ti == I_Q2_K) {           /* lanes: 16 bytes of scale | min << 4; d and dmin at bytes 80, 82 */
        const __m512i s = rows4_x16(w, off), ix = xs4_index(0, XS4_BYTE, 0);
        xs4_floats(_mm512_permutexvar_epi8(ix, _mm512_and_si512(s, m4)), rows4_f16(w, off + 80), Sc);
        xs4_floats(_mm512_permutexvar_epi8(ix, _mm512_and_si512(_mm512_srli_epi16(s, 4), m4)), rows4_f16(w, off + 82), Mc);
        return;
    }
    /* Q3_K's 16 bytes end with its super-block's: loaded 2 bytes early and shifted down (scales at 0-11, d at 12) */
    const __m512i s = ti == I_Q3_K ? _mm512_bsrli_epi128(rows4_x16(w, off + 94), 2) : rows4_x16(w, off);
    const __m512i a = _mm512_and_si512(s, m4), b = _mm512_and_si512(_mm512_srli_epi16(s, 4), m4);
    __m512i v;
    if (ti == I_IQ4_XS)           /* lanes: d, the u16 of high bits, 4 bytes of low nibbles (-> bytes 8-15) */
        v = _mm512_permutexvar_epi8(xs4_index(8, XS4_PER32, 0), xs4_code(_mm512_unpacklo_epi8(a, b),
            _mm512_multishift_epi64_epi8(XS4_MS(XS4_MS_IQ4XS), _mm512_unpacklo_epi64(s, s)), 0x30, 32));
    else if (ti == I_Q3_K)        /* low 4 bits: s[i] & 15 (i < 8), s[i - 8] >> 4; bits 4-5 from s[8 + i%4] */
        v = _mm512_permutexvar_epi8(xs4_index(0, XS4_BYTE, 0), xs4_code(_mm512_unpacklo_epi64(a, b),
            _mm512_multishift_epi64_epi8(XS4_MS(XS4_MS_Q3K), _mm512_unpackhi_epi64(s, s)), 0x30, 32));
    else if (ti == I_IQ2_K)       /* lanes: d, extra, 8 bytes of nibbles (low, high, ...); code - 8 */
        v = _mm512_sub_epi8(_mm512_permutex2var_epi8(_mm512_unpacklo_epi8(a, b), xs4_index(8, XS4_SPLIT, 8),
                                                     _mm512_unpackhi_epi8(a, b)), _mm512_set1_epi8(8));
    else if (ti == I_IQ2_KS)      /* lanes: the u16 of high bits (8-15), 4 bytes of low nibbles; code - 16 */
        v = _mm512_permutexvar_epi8(xs4_index(4, XS4_PER32, 0), xs4_code(_mm512_unpacklo_epi8(a, b),
            _mm512_multishift_epi64_epi8(XS4_MS(XS4_MS_IQ2KS), _mm512_unpacklo_epi64(s, s)), 0x10, 16));
    else if (ti == I_IQ2_KL)      /* lanes: the u16 of high bits, nibble s/4 of byte 2 + s%4: low ones, then high */
        v = _mm512_permutexvar_epi8(xs4_index(2, XS4_PER32, 0), xs4_code(
            _mm512_mask_blend_epi8(0x03C003C003C003C0ull, a, _mm512_bslli_epi128(b, 4)),
            _mm512_multishift_epi64_epi8(XS4_MS(XS4_MS_IQ2KL), _mm512_unpacklo_epi64(s, s)), 0x30, 32));
    else if (ti == I_IQ3_K) {     /* lanes: d, extra, the u16 of signs, 8 bytes of nibbles from byte 6: +-(2 lo + 1) */
        const __m512i lo = _mm512_permutex2var_epi8(_mm512_unpacklo_epi8(a, b), xs4_index(12, XS4_SPLIT, 4),
                                                    _mm512_unpackhi_epi8(a, b));
        const __m512i mag = _mm512_add_epi8(_mm512_add_epi8(lo, lo), _mm512_set1_epi8(1));
        const __m512i sg = _mm512_permutexvar_epi8(xs4_index(0, XS4_BYTE, 0), _mm512_multishift_epi64_epi8(
            XS4_MS(XS4_MS_IQ3K), _mm512_unpacklo_epi64(s, s)));
        v = _mm512_mask_sub_epi8(mag, _mm512_test_epi8_mask(sg, _mm512_set1_epi8(1)), _mm512_setzero_si512(), mag);
    } else                        /* IQ4_K, IQ5_K: d, extra, 4 bytes of high bits, 8 of low nibbles */
        v = _mm512_permutexvar_epi8(xs4_index(0, XS4_BYTE, 0), xs4_code(_mm512_unpackhi_epi8(a, b),
            _mm512_multishift_epi64_epi8(XS4_MS(XS4_MS_IQ4K), _mm512_unpacklo_epi64(s, s)), 0x30, 32));
    xs4_floats(v, ti == I_IQ2_KS || ti == I_IQ2_KL ? rd4 : xs4_f16(s, ti == I_Q3_K ? 12 : 0), Sc);
}

/* Q6_K's 16 int8 scales (byte 192) times d (byte 208) of rows w[0..3] in rows4_T's layout: prep_k's S, 4 rows at once */
HM_INLINE void q6_scales4(const uint8_t *const *w, const int64_t o, __m512 *Sc) {
    xs4_floats(_mm512_permutexvar_epi8(xs4_index(0, XS4_BYTE, 0), rows4_x16(w, o + 192)), rows4_f16(w, o + 208), Sc);
}
#else
#define XS4_VEC 0
#define XS4(ti) 0
#endif

/* the scales (and Q2_K's mins) of x-type super-block o of rows w[0..R) in rows4_T's layout (zero for rows past R):
 * x_scales4 where it applies (4 rows of an XS4 type; rd4 as it takes it), else x_scales16 a row */
HM_INLINE void x_scales_rows(const int ti, const int R, const uint8_t *const *w, const int64_t o, const __m512 rd4,
                             __m512 *Sc, __m512 *Mc) {
#if XS4_VEC
    if (XS4(ti) && R == 4) {
        x_scales4(ti, w, o, rd4, Sc, Mc);
        return;
    }
#endif
    (void)rd4;
    __m512 Sr[4], Mr[4];
    for (int r = 0; r < 4; r++) {
        if (r < R)
            x_scales16(ti, w[r] + TINFO[ti].hdr + o, X_HDR(ti) ? x_rowscale(ti, w[r]) : 1.0f, &Sr[r], &Mr[r]);
        else
            Sr[r] = Mr[r] = _mm512_setzero_ps();
    }
    rows4_T(Sr, Sc);
    if (X_MIN(ti)) rows4_T(Mr, Mc);
}
/* Q6_K's scales of super-block o of rows w[0..R) as Sm[sub-block i][row] (prep_k's S; 0 for rows past R) */
HM_INLINE void q6_scales(const int R, const uint8_t *const *w, const int64_t o, float Sm[16][4]) {
#if XS4_VEC
    if (R == 4) {
        __m512 Sq[4];
        q6_scales4(w, o, Sq);
        for (int c = 0; c < 4; c++) _mm512_store_ps(Sm[4 * c], Sq[c]);
        return;
    }
#endif
    kscale ks[4];
    for (int r = 0; r < R; r++) prep_k(I_Q6_K, w[r] + o, 1.0f, &ks[r]);
    for (int i = 0; i < 16; i++)
        for (int r = 0; r < 4; r++) Sm[i][r] = r < R ? ks[r].s[i] : 0.0f;
}
