/* Native CPU kernels for the experts and the dense quantized linears: products straight from
 * packed FP4 (E2M1, two codes per byte, element 2i in the low nibble) or FP8 (E4M3) weight rows.
 *
 * Built by dsv41/kernels/native.py with the machine's C compiler on first use and called through
 * ctypes. Two kinds of product:
 * - dsv41_gemm_many, for the few tokens a weight sees while decoding (the caller uses it up to
 *   8), several products per call: what the op layer's fp4_gemm / fp8_gemm compute, in their
 *   order, below;
 * - dsv41_decode (with dsv41_activation, dsv41_scale_range and dsv41_apply_powers), for many
 *   tokens: rows decoded into a float32 (or, exactly, BF16) buffer for the caller's GEMM, scales
 *   split as experts.py explains.
 * dsv41_act_quant is quant.py's act_quant (E8M0 scales) byte for byte, for every CPU caller.
 *
 * dsv41_gemm_many computes, for each output (token t, row r), one float32 partial product per
 * 32-value K block, scaled by the block's activation and weight scales as the reference scales it (FP4: times the activation scale, then
 * the weight scale; FP8: times their product), and added into a float32 accumulator in K order.
 * Only the order of the 32 additions inside a block is this kernel's own (eight lanes of four
 * products each, then the lanes pairwise), and it is the same for every token count, so a token's
 * result does not depend on how many tokens share the call.
 *
 * Scales are read as stored, E8M0 bytes, one per 32 values along K: for the weights one scale row
 * per `rows_per_scale` weight rows (1 for FP4 experts, 32 for FP8 blocks), for the activations
 * one per `act_block` values.
 *
 * FP4 codes go through a 16-entry table of 2 * value (small integers, exact in int8); E4M3 bytes
 * are moved into the bit positions of an IEEE half (value * 2**-8, subnormals included) and
 * widened by the F16C conversion, which reads half subnormals as themselves whatever the thread's
 * denormal flags say. Both factors (1/2, 2**8) are powers of two folded into the activations, so
 * every product is the reference's product. Without AVX2/FMA/F16C the same arithmetic runs as
 * plain C, in the same order; with AVX-512 one token's products take two blocks per 512-bit
 * vector, reduced per 256-bit half, so they too are the same sums in the same order. With
 * AVX-512 BF16 (and VBMI, for FP8) the products of up to 8 tokens are taken two at a time by the
 * BF16 dot-product instruction instead (see dot_rows, dot_group): the same sums in fewer
 * instructions.
 *
 * Tokens go in groups of eight (one vector lane each for the block sums); work is split by weight
 * rows over `threads` threads (see parallel_rows), in tiles of rows that stay in cache while
 * every token group passes over them.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DSV41_SIMD 1
#else
#define DSV41_SIMD 0
#endif

#define BLOCK 32
#define GROUP 8      /* tokens per pass over a weight row */
#define ROW_TILE 64  /* weight rows kept in cache while all token groups pass */
/* A row tile's weight scales as floats, four rows side by side per block: [rows / 4, nb, 4]. */
#define SW_INDEX(row, b, nb) ((((row) / 4) * (nb) + (b)) * 4 + (row) % 4)
#define MAX_THREADS 64
#define ABI_VERSION 13

int dsv41_abi_version(void) { return ABI_VERSION; }
int dsv41_simd(void) { return DSV41_SIMD; }
int dsv41_avx512(void);
#ifdef _OPENMP
int dsv41_openmp(void) { return 1; }
#else
int dsv41_openmp(void) { return 0; }
#endif

/* 2 * value of each E2M1 code; code 8 is -0, read as 0. */
static const int8_t FP4_TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static float e4m3_value(uint8_t b) {
    int e = (b >> 3) & 0xF, m = b & 0x7;
    float mag = e ? (float)(8 + m) * (float)(1 << e) / 1024.0f /* (1 + m/8) * 2**(e-7) */
                  : (float)m / 512.0f;                          /* m/8 * 2**-6 */
    return (b & 0x80) ? -mag : mag;
}

/* An activation's E4M3 byte: its value, NaN for the NaN code (S.1111.111, what act_quant makes of
 * a NaN or Inf), so the token's every product is NaN, as in the reference's GEMM. Weight bytes go
 * through e4m3_value, which reads that code as 480 (dsv41 audit --values reports such weights). */
static float e4m3_activation(uint8_t b) {
    union { uint32_t u; float f; } nan = {0x7FC00000u};
    return (b & 0x7F) == 0x7F ? nan.f : e4m3_value(b);
}

/* An E8M0 byte as the float32 it stands for: 2**(byte - 127), 2**-127 as a subnormal, 255 NaN. */
static inline float e8m0_value(uint8_t byte) {
    union { uint32_t u; float f; } bits;
    bits.u = byte == 0 ? 0x00400000u : byte == 255 ? 0x7FC00000u : (uint32_t)byte << 23;
    return bits.f;
}

/* Where element i of a row sits once arranged for FP4 weights: per 32-value block, the 16 even
 * elements, then the 16 odd ones (the order the packed nibbles decode in). */
static inline int64_t arranged_index(int64_t i) {
    int64_t e = i % BLOCK;
    return i - e + (e & 1) * (BLOCK / 2) + e / 2;
}

typedef struct {
    const uint8_t *w;        /* [n, row_bytes] */
    const uint8_t *w_scale;  /* E8M0 [ceil(n / rows_per_scale), k / 32] */
    const float *a;          /* [m, k] activation values times the decode's factor, FP4 arranged */
    const float *a_scale;    /* [groups, k / 32, GROUP] activation scales, 0 past the last token */
    const uint16_t *a_pairs; /* with FP4_DOT / FP8_DOT: [m, k] activations as BF16 in (fp8_)pair_index order */
    float *out;              /* [n, m] */
    int64_t m, n, k, rows_per_scale;
    int fp4;
    int *failed;             /* set when a thread cannot allocate its scratch */
} job_t;

/* Rows of a weight decoded into float32 times their relative block scales 2**(byte - top), for
 * the caller's BLAS GEMM when many tokens share the weight (see dsv41_decode). */
typedef struct {
    const uint8_t *w;      /* [n, row_bytes] */
    const uint8_t *scale;  /* E8M0 [ceil(n / rows_per_scale), k / 32] */
    const int32_t *top;    /* [ceil(n / rows_per_scale)]: each scale row's largest byte */
    void *out;             /* [last - first, k] float32, or BF16 with `bf16` */
    int64_t k, rows_per_scale, first;
    int fp4;
    int bf16;              /* store the top half of each float32: exact, see dsv41_decode */
} decode_t;

/* 2**(exponent - 127) for a biased exponent in the normal range, else 0. */
static inline float pow2_biased(int32_t exponent) {
    union { uint32_t u; float f; } bits;
    bits.u = exponent > 0 && exponent < 255 ? (uint32_t)exponent << 23 : 0;
    return bits.f;
}

typedef void (*rows_fn)(const void *, int64_t, int64_t);

#ifndef _OPENMP
typedef struct {
    const void *job;
    rows_fn body;
    int64_t r0, r1;
} part_t;

static void *run_part(void *arg) {
    part_t *p = (part_t *)arg;
    p->body(p->job, p->r0, p->r1);
    return NULL;
}
#endif

/* Rows [first, last) in `threads` contiguous parts. Built with OpenMP, the parts run on the
 * process's OpenMP pool (torch's own, already loaded, whose idle workers spin-wait for work and
 * would otherwise hold the cores that fresh threads need); without it, on POSIX threads, a part
 * whose thread cannot start running here. `job` is handed to `body` as it is. */
static void parallel_rows(const void *job, int64_t first, int64_t last, int threads, rows_fn body) {
    int64_t n = last - first;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = (int)(n > 0 ? n : 1);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) body(job, first + n * t / threads, first + n * (t + 1) / threads);
#else
    part_t parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        parts[t] = (part_t){job, body, first + n * t / threads, first + n * (t + 1) / threads};
        started[t] = t > 0 && pthread_create(&ids[t], NULL, run_part, &parts[t]) == 0;
    }
    for (int t = 0; t < threads; t++)
        if (!started[t]) run_part(&parts[t]);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
#endif
}

#if DSV41_SIMD
static inline __m256 i8_to_ps(__m128i x) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)); }

/* One 32-value block of a weight row -> 4 x 8 floats (FP4: 2 * value in the arranged order, even
 * elements then odd; E4M3: value * 2**-8 in natural order). */
static inline __attribute__((always_inline)) void decode_block(int fp4, const uint8_t *src, __m256 v[4]) {
    if (fp4) {
        const __m128i nibble = _mm_set1_epi8(0x0F);
        const __m128i table = _mm_loadu_si128((const __m128i *)FP4_TWICE);
        __m128i bytes = _mm_loadu_si128((const __m128i *)src);
        __m128i even = _mm_shuffle_epi8(table, _mm_and_si128(bytes, nibble));
        __m128i odd = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
        v[0] = i8_to_ps(even), v[1] = i8_to_ps(_mm_srli_si128(even, 8));
        v[2] = i8_to_ps(odd), v[3] = i8_to_ps(_mm_srli_si128(odd, 8));
    } else {
        for (int h = 0; h < 2; h++) {
            /* 16 E4M3 bytes -> half bit patterns s|0eeee|mmm0000000 = value * 2**-8 */
            __m256i u16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + 16 * h)));
            __m256i sign = _mm256_slli_epi16(_mm256_and_si256(u16, _mm256_set1_epi16(0x80)), 8);
            __m256i body = _mm256_slli_epi16(_mm256_and_si256(u16, _mm256_set1_epi16(0x7F)), 7);
            __m256i halves = _mm256_or_si256(sign, body);
            v[2 * h] = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
            v[2 * h + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
        }
    }
}

/* Lane sums of one token's four products: (v0 a0 + v1 a1) + (v2 a2 + v3 a3), lane by lane. */
static inline __m256 lane_sums(const __m256 v[4], const float *a) {
    __m256 p01 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(a + 8), _mm256_mul_ps(v[0], _mm256_loadu_ps(a)));
    __m256 p23 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(a + 24), _mm256_mul_ps(v[2], _mm256_loadu_ps(a + 16)));
    return _mm256_add_ps(p01, p23);
}

/* T tokens' lane sums (T <= 8, the rest zero) -> one vector of their block sums, token t in lane
 * t, each summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) whatever T is. */
static inline __attribute__((always_inline)) __m256 block_sums(int T, const __m256 s[GROUP]) {
    if (T == 1) {
        __m256 h = _mm256_hadd_ps(s[0], s[0]);
        h = _mm256_hadd_ps(h, h);  /* lane 0: l0+l1 + l2+l3, lane 4: l4+l5 + l6+l7 */
        return _mm256_zextps128_ps256(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
    __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    if (T <= 4)  /* lanes 0-3 hold each token's first four lanes summed, 4-7 its last four */
        return _mm256_zextps128_ps256(_mm_add_ps(_mm256_castps256_ps128(h0123), _mm256_extractf128_ps(h0123, 1)));
    __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

/* The token group starting at g0 (T tokens, a compile-time count) against rows [r0, r1):
 * acc[r - r0] gets each row's sums for the group's tokens, added block by block in K order; sw
 * holds the rows' weight scales as floats (SW_INDEX). */
#define GROUP_BODY(T, FP4, NAME)                                                                  \
    static void NAME(const job_t *j, int64_t r0, int64_t r1, int64_t g0, const float *sw, float *acc) { \
        const int64_t nb = j->k / BLOCK, row_bytes = FP4 ? j->k / 2 : j->k;                      \
        const int64_t block_bytes = FP4 ? BLOCK / 2 : BLOCK;                                      \
        const float *a = j->a + g0 * j->k;                                                        \
        const float *a_scale = j->a_scale + (g0 / GROUP) * nb * GROUP;                            \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            const uint8_t *w = j->w + r * row_bytes;                                              \
            __m256 sum = _mm256_setzero_ps();                                                     \
            for (int64_t b = 0; b < nb; b++) {                                                    \
                __m256 v[4], s[GROUP];                                                            \
                decode_block(FP4, w + b * block_bytes, v);                                        \
                for (int t = 0; t < GROUP; t++)                                                   \
                    s[t] = t < T ? lane_sums(v, a + t * j->k + b * BLOCK) : _mm256_setzero_ps();  \
                __m256 partial = block_sums(T, s);                                                \
                __m256 sa = _mm256_loadu_ps(a_scale + b * GROUP);                                 \
                __m256 sb = _mm256_broadcast_ss(sw + SW_INDEX(r - r0, b, nb));                    \
                if (FP4) /* the reference's fp4_gemm: activation scale, then weight scale */      \
                    partial = _mm256_mul_ps(_mm256_mul_ps(partial, sa), sb);                      \
                else /* its fp8_gemm: the two scales combined first */                            \
                    partial = _mm256_mul_ps(partial, _mm256_mul_ps(sa, sb));                      \
                sum = _mm256_add_ps(sum, partial);                                                \
            }                                                                                     \
            _mm256_storeu_ps(acc + (r - r0) * GROUP, sum);                                        \
        }                                                                                         \
    }

#define GROUP_BOTH(T) GROUP_BODY(T, 1, fp4_group_##T) GROUP_BODY(T, 0, fp8_group_##T)
GROUP_BOTH(1)
GROUP_BOTH(2)
GROUP_BOTH(3)
GROUP_BOTH(4)
GROUP_BOTH(5)
GROUP_BOTH(6)
GROUP_BOTH(7)
GROUP_BOTH(8)

/* GROUP_BODY's steps for block b of row w against the group's T tokens: the block's partials,
 * scaled (row_in_tile: the row's place in sw). */
static inline __attribute__((unused)) __m256 group_block(int fp4, int T, const job_t *j, const uint8_t *w, int64_t b,
                                                         int64_t g0, const float *a_scale, const float *sw,
                                                         int64_t row_in_tile) {
    const int64_t nb = j->k / BLOCK, block_bytes = fp4 ? BLOCK / 2 : BLOCK;
    const float *a = j->a + g0 * j->k;
    __m256 v[4], s[GROUP];
    decode_block(fp4, w + b * block_bytes, v);
    for (int t = 0; t < GROUP; t++) s[t] = t < T ? lane_sums(v, a + t * j->k + b * BLOCK) : _mm256_setzero_ps();
    __m256 partial = T > 4 ? block_sums(8, s) : T > 1 ? block_sums(4, s) : block_sums(1, s);
    __m256 sa = _mm256_loadu_ps(a_scale + b * GROUP), sb = _mm256_broadcast_ss(sw + SW_INDEX(row_in_tile, b, nb));
    return fp4 ? _mm256_mul_ps(_mm256_mul_ps(partial, sa), sb) : _mm256_mul_ps(partial, _mm256_mul_ps(sa, sb));
}

typedef void (*group_fn)(const job_t *, int64_t, int64_t, int64_t, const float *, float *);
static const group_fn FP4_GROUP[GROUP + 1] = {
    0, fp4_group_1, fp4_group_2, fp4_group_3, fp4_group_4, fp4_group_5, fp4_group_6, fp4_group_7, fp4_group_8};
static const group_fn FP8_GROUP[GROUP + 1] = {
    0, fp8_group_1, fp8_group_2, fp8_group_3, fp8_group_4, fp8_group_5, fp8_group_6, fp8_group_7, fp8_group_8};

/* One block's sums of four rows scaled as the reference scales them (FP4: by the activation
 * scale, then the weight scale; FP8: by their product), added to the rows' running sums. */
static inline __attribute__((always_inline)) __m128 add_scaled_block(int fp4, __m128 sum, __m128 partial,
                                                                      float a_scale, const float *w_scales) {
    const __m128 sa = _mm_set1_ps(a_scale), sb = _mm_loadu_ps(w_scales);
    partial = fp4 ? _mm_mul_ps(_mm_mul_ps(partial, sa), sb) : _mm_mul_ps(partial, _mm_mul_ps(sa, sb));
    return _mm_add_ps(sum, partial);
}

/* Block b of four weight rows (from w, row_bytes apart) against one token: each row's lane sums
 * reduced together, row q in lane q (its first four lanes summed, then its last four, then both),
 * then scaled and added in K order. */
static inline __attribute__((always_inline)) __m128 four_rows_block(int fp4, const uint8_t *w, int64_t row_bytes,
                                                                     int64_t b, const float *a, const float *a_scale,
                                                                     const float *sw, int64_t nb, __m128 sum) {
    const int64_t block_bytes = fp4 ? BLOCK / 2 : BLOCK;
    __m256 s[4];
    for (int q = 0; q < 4; q++) {
        __m256 v[4];
        decode_block(fp4, w + q * row_bytes + b * block_bytes, v);
        s[q] = lane_sums(v, a + b * BLOCK);
    }
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    __m128 partial = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    return add_scaled_block(fp4, sum, partial, a_scale[b * GROUP], sw + SW_INDEX(0, b, nb));
}

static inline void store_four_rows(__m128 sum, float *acc) {
    float lanes[4];
    _mm_storeu_ps(lanes, sum);
    for (int q = 0; q < 4; q++) acc[q * GROUP] = lanes[q];
}

/* One token (the group at g0 holds just one: every expert while decoding) against four rows at a
 * time, the rows' lane sums reduced together: each row's block sum in exactly the order
 * block_sums gives one token, and the scaling and K-order addition lane by lane as in GROUP_BODY. */
#define FOUR_ROWS_BODY(FP4, NAME)                                                                 \
    static __attribute__((unused)) void NAME(const job_t *j, int64_t r0, int64_t g0, const float *sw, float *acc) {       \
        const int64_t nb = j->k / BLOCK, row_bytes = FP4 ? j->k / 2 : j->k;                      \
        const float *a = j->a + g0 * j->k, *a_scale = j->a_scale + (g0 / GROUP) * nb * GROUP;      \
        __m128 sum = _mm_setzero_ps();                                                            \
        for (int64_t b = 0; b < nb; b++)                                                          \
            sum = four_rows_block(FP4, j->w + r0 * row_bytes, row_bytes, b, a, a_scale, sw, nb, sum); \
        store_four_rows(sum, acc);                                                                \
    }
FOUR_ROWS_BODY(1, fp4_four_rows)
FOUR_ROWS_BODY(0, fp8_four_rows)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define DSV41_AVX512 1
/* hadd_ps on each 128-bit lane of a zmm: [a0+a1, a2+a3, b0+b1, b2+b3], the same sums as AVX2's. */
static inline __m512 hadd512(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* Two adjacent 32-value blocks of a weight row -> 4 zmm: v[j] holds decode_block's v[j] of the
 * first block in its low half and of the second in its high half. */
static inline __attribute__((always_inline)) void decode_two_blocks(int fp4, const uint8_t *src, __m512 v[4]) {
    if (fp4) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_TWICE));
        __m256i bytes = _mm256_loadu_si256((const __m256i *)src);  /* one block per 128-bit lane */
        __m256i even = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, nibble));
        __m256i odd = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble));
        /* qwords [first 0-7, second 0-7, first 8-15, second 8-15] */
        even = _mm256_permute4x64_epi64(even, _MM_SHUFFLE(3, 1, 2, 0));
        odd = _mm256_permute4x64_epi64(odd, _MM_SHUFFLE(3, 1, 2, 0));
        v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(even)));
        v[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(even, 1)));
        v[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(odd)));
        v[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(odd, 1)));
    } else {
        __m512i h[2];
        for (int half = 0; half < 2; half++) {  /* 32 E4M3 bytes -> 32 half bit patterns */
            __m512i u16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + 32 * half)));
            __m512i sign = _mm512_slli_epi16(_mm512_and_si512(u16, _mm512_set1_epi16(0x80)), 8);
            __m512i body = _mm512_slli_epi16(_mm512_and_si512(u16, _mm512_set1_epi16(0x7F)), 7);
            h[half] = _mm512_or_si512(sign, body);  /* 128-bit lane j: elements 8j..8j+7 */
        }
        const __m512i lanes01 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
        const __m512i lanes23 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
        __m512i p01 = _mm512_permutex2var_epi64(h[0], lanes01, h[1]);  /* [f0, s0, f1, s1] */
        __m512i p23 = _mm512_permutex2var_epi64(h[0], lanes23, h[1]);
        v[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(p01)), v[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(p01, 1));
        v[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(p23)), v[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(p23, 1));
    }
}

/* FOUR_ROWS_BODY two blocks at a time: each 512-bit vector holds a block pair's lanes, reduced
 * as hadd per 256-bit half, so every row's block sums, scalings and K-order additions are the
 * AVX2 body's; an odd last block takes that body's steps as they are. */
#define FOUR_ROWS_512(FP4, NAME)                                                                  \
    static __attribute__((unused)) void NAME(const job_t *j, int64_t r0, int64_t g0, const float *sw, float *acc) {       \
        const int64_t nb = j->k / BLOCK, row_bytes = FP4 ? j->k / 2 : j->k;                      \
        const int64_t block_bytes = FP4 ? BLOCK / 2 : BLOCK;                                      \
        const uint8_t *w = j->w + r0 * row_bytes;                                                 \
        const float *a = j->a + g0 * j->k, *a_scale = j->a_scale + (g0 / GROUP) * nb * GROUP;      \
        __m128 sum = _mm_setzero_ps();                                                            \
        int64_t b = 0;                                                                            \
        for (; b + 2 <= nb; b += 2) {                                                             \
            __m512 az[4], s[4];                                                                   \
            for (int q = 0; q < 4; q++)                                                           \
                az[q] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a + b * BLOCK + 8 * q)), \
                                           _mm256_loadu_ps(a + (b + 1) * BLOCK + 8 * q), 1);       \
            for (int q = 0; q < 4; q++) {                                                         \
                __m512 v[4];                                                                      \
                decode_two_blocks(FP4, w + q * row_bytes + b * block_bytes, v);                   \
                __m512 p01 = _mm512_fmadd_ps(v[1], az[1], _mm512_mul_ps(v[0], az[0]));            \
                __m512 p23 = _mm512_fmadd_ps(v[3], az[3], _mm512_mul_ps(v[2], az[2]));            \
                s[q] = _mm512_add_ps(p01, p23);                                                   \
            }                                                                                     \
            __m512 h = hadd512(hadd512(s[0], s[1]), hadd512(s[2], s[3]));                         \
            __m128 part[2] = {_mm_add_ps(_mm512_castps512_ps128(h), _mm512_extractf32x4_ps(h, 1)),  \
                              _mm_add_ps(_mm512_extractf32x4_ps(h, 2), _mm512_extractf32x4_ps(h, 3))}; \
            for (int half = 0; half < 2; half++)                                                  \
                sum = add_scaled_block(FP4, sum, part[half], a_scale[(b + half) * GROUP],         \
                                       sw + SW_INDEX(0, b + half, nb));                           \
        }                                                                                         \
        for (; b < nb; b++) sum = four_rows_block(FP4, w, row_bytes, b, a, a_scale, sw, nb, sum);  \
        store_four_rows(sum, acc);                                                                \
    }
FOUR_ROWS_512(1, fp4_four_rows_512)
FOUR_ROWS_512(0, fp8_four_rows_512)

#if defined(__AVX512BF16__)
#define FP4_DOT 1
/* Byte order within a block's 16 bytes that puts byte m beside byte m + 8. */
static const int8_t PAIR_BYTES[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};
/* BF16 bits of each E2M1 code's value (code 8, -0, read as 0, as FP4_TWICE reads it), given
 * twice: the word permute reads five index bits, so a byte's high nibble may stay in the index.
 * Filled from FP4_TWICE when the library loads (dot_tables). */
static uint16_t FP4_BF16[32];

/* Where activation element i of a row goes in a_pairs: per pair of blocks, 32 values for the low
 * nibbles (block by block, bytes in PAIR_BYTES order), then 32 for the high nibbles. A last odd
 * block keeps its natural order; dot_rows reads it from the float activations instead. */
static inline int64_t pair_index(int64_t i, int64_t k) {
    int64_t block = i / BLOCK, e = i % BLOCK;
    if ((block | 1) * BLOCK >= k) return i;
    int64_t u = (e / 2) % 8 * 2 + (e / 2) / 8;  /* PAIR_BYTES position of byte e / 2 */
    return (block & ~(int64_t)1) * BLOCK + (e & 1) * 32 + (block & 1) * 16 + u;
}

#if defined(__AVX512VBMI__)
#define FP8_DOT 1
/* The BF16 bits of each E4M3 magnitude code 0-127 (0x7F read as 480, as e4m3_value reads it):
 * low bytes, then high bytes; the sign bit is the code's own, moved to the high byte's top.
 * Filled from e4m3_value when the library loads (dot_tables). */
static uint8_t E4M3_BF16_LOW[128], E4M3_BF16_HIGH[128];

/* The order two E4M3 blocks' 64 bytes are looked up in: 128-bit lane 2 * block + half holds, for
 * l = 4 * half + 0..3, the bytes l and l + 8 side by side, then l + 16 and l + 24, so that the low
 * and high halves of each lane, looked up and unpacked into BF16 words, pair a block's elements
 * as the float body's lanes do. */
static const uint8_t FP8_PAIR_BYTES[64] = {
    0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27,
    4, 12, 5, 13, 6, 14, 7, 15, 20, 28, 21, 29, 22, 30, 23, 31,
    32, 40, 33, 41, 34, 42, 35, 43, 48, 56, 49, 57, 50, 58, 51, 59,
    36, 44, 37, 45, 38, 46, 39, 47, 52, 60, 53, 61, 54, 62, 55, 63};

/* Where activation element i of a row goes in a_pairs for FP8 weights: the FP8_PAIR_BYTES order
 * per pair of blocks, the low half of every lane's words (32 values), then the high half. A last
 * odd block keeps its natural order; dot_rows reads it from the float activations instead. */
static inline int64_t fp8_pair_index(int64_t i, int64_t k) {
    int64_t block = i / BLOCK, e = i % BLOCK;
    if ((block | 1) * BLOCK >= k) return i;
    int64_t part = e / 16, l = e % 8, second = (e % 16) / 8;  /* element l (+ 8) of its 16-byte part */
    int64_t lane = (block & 1) * 2 + l / 4, word = (l % 4) * 2 + second;
    return (block & ~(int64_t)1) * BLOCK + part * 32 + lane * 8 + word;
}

#endif

/* The dot-product bodies' lookup tables, from the one definition of each value (FP4_TWICE,
 * e4m3_value): every value there is exact in BF16, the top half of its float32. Run once when the
 * library is loaded, before any thread can use them. */
static uint16_t bf16_top(float value) {
    union { float f; uint32_t u; } bits = {value};
    return (uint16_t)(bits.u >> 16);
}
__attribute__((constructor)) static void dot_tables(void) {
    for (int code = 0; code < 32; code++) FP4_BF16[code] = bf16_top(0.5f * (float)FP4_TWICE[code % 16]);
#if FP8_DOT
    for (int code = 0; code < 128; code++) {
        uint16_t bits = bf16_top(e4m3_value((uint8_t)code));
        E4M3_BF16_LOW[code] = (uint8_t)(bits & 0xFF), E4M3_BF16_HIGH[code] = (uint8_t)(bits >> 8);
    }
#endif
}

/* The bodies below take one token's products (or a group's) on the BF16 dot-product instruction.
 * Every FP4 code and E4M3 weight byte is looked up as the BF16 of its value and the activations
 * are held as BF16 (all exact: at most four significant bits). Each 32-bit lane of a dot product,
 * started from -0, takes two of a block's products: for FP4 elements 2m and 2m + 16 (low nibbles)
 * or 2m + 1 and 2m + 17 (high nibbles), whose sum is exact in float32 (E2M1 times E4M3 values are
 * multiples of 2**-10 below 2**12); for FP8 elements l and l + 8 (or l + 16 and l + 24), their
 * sum rounded once, as the float bodies' multiply and fused multiply-add round it. Two such lanes
 * added give one lane of the float bodies' sums, bit for bit, zero signs included; from there
 * the reductions, scalings and K-order additions are theirs. */

/* Two blocks of a weight row (FP4 16 bytes each, E4M3 32) -> two vectors of BF16 values laid out
 * as the activations' pair_index (FP4) or fp8_pair_index (FP8) order, so that the two dot
 * products of dot_lanes added are the float bodies' lanes. */
static inline __attribute__((always_inline)) void dot_decode(int fp4, const uint8_t *src, __m512bh w[2]) {
    if (fp4) {
        const __m128i pair_bytes = _mm_loadu_si128((const __m128i *)PAIR_BYTES);
        const __m512i table = _mm512_loadu_si512(FP4_BF16);
        __m256i bytes = _mm256_loadu_si256((const __m256i *)src);
        /* one word per byte, bytes m and m + 8 of each block side by side */
        __m512i words = _mm512_cvtepu8_epi16(_mm256_shuffle_epi8(bytes, _mm256_broadcastsi128_si256(pair_bytes)));
        w[0] = (__m512bh)_mm512_permutexvar_epi16(words, table);
        w[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
    } else {
#if FP8_DOT
        const __m512i low0 = _mm512_loadu_si512(E4M3_BF16_LOW), low1 = _mm512_loadu_si512(E4M3_BF16_LOW + 64);
        const __m512i high0 = _mm512_loadu_si512(E4M3_BF16_HIGH), high1 = _mm512_loadu_si512(E4M3_BF16_HIGH + 64);
        __m512i bytes = _mm512_permutexvar_epi8(_mm512_loadu_si512(FP8_PAIR_BYTES), _mm512_loadu_si512(src));
        __m512i low = _mm512_permutex2var_epi8(low0, bytes, low1); /* the index's top bit: ignored */
        __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high0, bytes, high1), bytes,
                                                 _mm512_set1_epi8((char)0x80), 0xF8); /* | the sign */
        w[0] = (__m512bh)_mm512_unpacklo_epi8(low, high), w[1] = (__m512bh)_mm512_unpackhi_epi8(low, high);
#endif
    }
}

/* One token's lane sums of the two blocks dot_decode gave, laid out as the float bodies' are:
 * lanes 0-7 block A's, 8-15 block B's. `pairs`: the token's BF16 activations of the two blocks. */
static inline __attribute__((always_inline)) __m512 dot_lanes(const __m512bh w[2], const uint16_t *pairs) {
    const __m512 minus_zero = _mm512_set1_ps(-0.0f);
    __m512 d0 = _mm512_dpbf16_ps(minus_zero, w[0], (__m512bh)_mm512_loadu_si512(pairs));
    __m512 d1 = _mm512_dpbf16_ps(minus_zero, w[1], (__m512bh)_mm512_loadu_si512(pairs + 32));
    return _mm512_add_ps(d0, d1);
}

/* FOUR_ROWS_512 on the dot product: four rows against one token. */
static inline __attribute__((always_inline)) void dot_rows(int fp4, const job_t *j, int64_t r0, int64_t g0,
                                                           const float *sw, float *acc) {
    const int64_t nb = j->k / BLOCK, row_bytes = fp4 ? j->k / 2 : j->k, block_bytes = fp4 ? BLOCK / 2 : BLOCK;
    const uint8_t *w = j->w + r0 * row_bytes;
    const float *a = j->a + g0 * j->k, *a_scale = j->a_scale + (g0 / GROUP) * nb * GROUP;
    const uint16_t *pairs = j->a_pairs + g0 * j->k;
    __m128 sum = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512 s[4];
        for (int q = 0; q < 4; q++) {
            __m512bh v[2];
            dot_decode(fp4, w + q * row_bytes + b * block_bytes, v);
            s[q] = dot_lanes(v, pairs + b * BLOCK);
        }
        __m512 h = hadd512(hadd512(s[0], s[1]), hadd512(s[2], s[3]));
        __m128 part[2] = {_mm_add_ps(_mm512_castps512_ps128(h), _mm512_extractf32x4_ps(h, 1)),
                          _mm_add_ps(_mm512_extractf32x4_ps(h, 2), _mm512_extractf32x4_ps(h, 3))};
        for (int half = 0; half < 2; half++)
            sum = add_scaled_block(fp4, sum, part[half], a_scale[(b + half) * GROUP], sw + SW_INDEX(0, b + half, nb));
    }
    for (; b < nb; b++) sum = four_rows_block(fp4, w, row_bytes, b, a, a_scale, sw, nb, sum);
    store_four_rows(sum, acc);
}

/* GROUP_BODY on the dot product: rows [r0, r1) against the group's T tokens (2 to 8), each row's
 * two blocks decoded once for all of them; the group's block sums reduced as block_sums reduces
 * them (tokens 0-3, then 4-7, each first half of a block's lanes plus its second). An odd last
 * block takes GROUP_BODY's steps (group_block). */
static inline __attribute__((always_inline)) void dot_group(int fp4, const job_t *j, int64_t r0, int64_t r1,
                                                            int64_t g0, int T, const float *sw, float *acc) {
    const int64_t nb = j->k / BLOCK, row_bytes = fp4 ? j->k / 2 : j->k, block_bytes = fp4 ? BLOCK / 2 : BLOCK;
    const float *a_scale = j->a_scale + (g0 / GROUP) * nb * GROUP;
    const uint16_t *pairs = j->a_pairs + g0 * j->k;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = j->w + r * row_bytes;
        __m256 sum = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            __m512bh v[2];
            __m512 s[GROUP];
            dot_decode(fp4, w + b * block_bytes, v);
            for (int t = 0; t < GROUP; t++)
                s[t] = t < T ? dot_lanes(v, pairs + t * j->k + b * BLOCK) : _mm512_setzero_ps();
            /* per 128-bit lane: tokens 0-3 (h0) and 4-7 (h1), each the lane's four values summed */
            __m512 h0 = hadd512(hadd512(s[0], s[1]), hadd512(s[2], s[3]));
            __m512 h1 = T > 4 ? hadd512(hadd512(s[4], s[5]), hadd512(s[6], s[7])) : _mm512_setzero_ps();
            for (int half = 0; half < 2; half++) {  /* block A's lanes 0-1, block B's 2-3 */
                __m128 t0 = _mm_add_ps(_mm512_extractf32x4_ps(h0, 0), _mm512_extractf32x4_ps(h0, 1));
                __m128 t4 = _mm_add_ps(_mm512_extractf32x4_ps(h1, 0), _mm512_extractf32x4_ps(h1, 1));
                if (half) {
                    t0 = _mm_add_ps(_mm512_extractf32x4_ps(h0, 2), _mm512_extractf32x4_ps(h0, 3));
                    t4 = _mm_add_ps(_mm512_extractf32x4_ps(h1, 2), _mm512_extractf32x4_ps(h1, 3));
                }
                __m256 partial = _mm256_set_m128(t4, t0);
                __m256 sa = _mm256_loadu_ps(a_scale + (b + half) * GROUP);
                __m256 sb = _mm256_broadcast_ss(sw + SW_INDEX(r - r0, b + half, nb));
                partial = fp4 ? _mm256_mul_ps(_mm256_mul_ps(partial, sa), sb) : _mm256_mul_ps(partial, _mm256_mul_ps(sa, sb));
                sum = _mm256_add_ps(sum, partial);
            }
        }
        if (b < nb) sum = _mm256_add_ps(sum, group_block(fp4, T, j, w, b, g0, a_scale, sw, r - r0));
        _mm256_storeu_ps(acc + (r - r0) * GROUP, sum);
    }
}

static void fp4_dot_rows(const job_t *j, int64_t r0, int64_t g0, const float *sw, float *acc) {
    dot_rows(1, j, r0, g0, sw, acc);
}
static void fp4_dot_group(const job_t *j, int64_t r0, int64_t r1, int64_t g0, int T, const float *sw, float *acc) {
    dot_group(1, j, r0, r1, g0, T, sw, acc);
}
#define FP4_ONE_TOKEN fp4_dot_rows
#if FP8_DOT
static void fp8_dot_rows(const job_t *j, int64_t r0, int64_t g0, const float *sw, float *acc) {
    dot_rows(0, j, r0, g0, sw, acc);
}
static void fp8_dot_group(const job_t *j, int64_t r0, int64_t r1, int64_t g0, int T, const float *sw, float *acc) {
    dot_group(0, j, r0, r1, g0, T, sw, acc);
}
#define FP8_ONE_TOKEN fp8_dot_rows
#endif
#else
#define FP4_DOT 0
#define FP4_ONE_TOKEN fp4_four_rows_512
#endif
#ifndef FP8_DOT  /* no BF16 dot product, or no VBMI byte permutes for the E4M3 lookup */
#define FP8_DOT 0
#define FP8_ONE_TOKEN fp8_four_rows_512
#endif

/* One FP4 row -> BF16 values * 2**(byte - top) straight from the codes (decode_rows' BF16 result,
 * bit for bit): each code looks up its E2M1 value's BF16 bits, and the block's relative power of
 * two is added to the exponent field of every nonzero one, exact while the result stays a normal
 * number; a block whose power leaves that range is (signed) 0, as decode_rows writes it. */
static void fp4_row_bf16(const uint8_t *src, const uint8_t *bytes, int32_t top, int64_t nb, uint16_t *dst) {
    /* BF16 of 0, 0.5, 1, 1.5, 2, 3, 4, 6, then -0 (read as 0) and the negatives */
    const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                           (short)0xC0C0, (short)0xC080, (short)0xC040, (short)0xC000,
                                           (short)0xBFC0, (short)0xBF80, (short)0xBF00, 0,
                                           0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m512i magnitude_bits = _mm512_set1_epi16(7);
    for (int64_t b = 0; b < nb; b++, src += BLOCK / 2, dst += BLOCK) {
        int32_t shift = (int32_t)bytes[b] - top;
        __m128i raw = _mm_loadu_si128((const __m128i *)src);
        __m128i low = _mm_and_si128(raw, nibble), high = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
        /* element 2i is byte i's low nibble: interleaved, the block's 32 codes in natural order */
        __m256i codes8 = _mm256_set_m128i(_mm_unpackhi_epi8(low, high), _mm_unpacklo_epi8(low, high));
        __m512i codes = _mm512_cvtepu8_epi16(codes8);
        __m512i values = _mm512_permutexvar_epi16(codes, table);
        if (126 + shift > 0) {
            __mmask32 nonzero = _mm512_test_epi16_mask(codes, magnitude_bits);
            values = _mm512_mask_add_epi16(values, nonzero, values, _mm512_set1_epi16((short)(shift * 128)));
        } else {  /* below the normal range: decode_rows' pow2_biased gives 0, signed as the value */
            values = _mm512_and_si512(values, _mm512_set1_epi16((short)0x8000));
        }
        _mm512_storeu_si512(dst, values);
    }
}
#else
#define DSV41_AVX512 0
#endif

/* Rows [r0, r1) of a tile against the token group at g0: acc[r - r0] gets each row's outputs for
 * the group's tokens; sw holds the tile's weight scales (SW_INDEX). */
static void group_rows(const job_t *j, int64_t r0, int64_t r1, int64_t g0, const float *sw, float *acc) {
    const int64_t nb = j->k / BLOCK;
    int64_t tokens = j->m - g0 < GROUP ? j->m - g0 : GROUP;
    if (tokens == 1)
        for (; r0 + 4 <= r1; r0 += 4, sw += 4 * nb, acc += 4 * GROUP)
#if DSV41_AVX512
            (j->fp4 ? FP4_ONE_TOKEN : FP8_ONE_TOKEN)(j, r0, g0, sw, acc);
#else
            (j->fp4 ? fp4_four_rows : fp8_four_rows)(j, r0, g0, sw, acc);
#endif
#if FP4_DOT
    if (tokens > 1 && j->fp4) return fp4_dot_group(j, r0, r1, g0, (int)tokens, sw, acc);
#endif
#if FP8_DOT
    if (tokens > 1 && !j->fp4) return fp8_dot_group(j, r0, r1, g0, (int)tokens, sw, acc);
#endif
    (j->fp4 ? FP4_GROUP : FP8_GROUP)[tokens](j, r0, r1, g0, sw, acc);
}

static void decode_rows(const void *job, int64_t r0, int64_t r1) {
    const decode_t *d = job;
    const int64_t nb = d->k / BLOCK, row_bytes = d->fp4 ? d->k / 2 : d->k;
    const int64_t block_bytes = d->fp4 ? BLOCK / 2 : BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *bytes = d->scale + (r / d->rows_per_scale) * nb;
#if DSV41_AVX512
        if (d->fp4 && d->bf16) {
            fp4_row_bf16(d->w + r * row_bytes, bytes, d->top[r / d->rows_per_scale], nb,
                         (uint16_t *)d->out + (r - d->first) * d->k);
            continue;
        }
#endif
        /* 2 * value (FP4) or value * 2**-8 (E4M3) times 2**(byte - top): the factor folds in */
        int32_t bias = (d->fp4 ? 126 : 135) - d->top[r / d->rows_per_scale];
        float row[BLOCK], *dst = d->bf16 ? row : (float *)d->out + (r - d->first) * d->k;
        uint16_t *half = (uint16_t *)d->out + (r - d->first) * d->k;
        for (int64_t b = 0; b < nb; b++, dst += d->bf16 ? 0 : BLOCK, half += BLOCK) {
            __m256 v[4];
            decode_block(d->fp4, d->w + r * row_bytes + b * block_bytes, v);
            __m256 scale = _mm256_set1_ps(pow2_biased(bias + (int32_t)bytes[b]));
            if (d->fp4) {  /* back from (even, odd) to natural order */
                __m256 lo01 = _mm256_unpacklo_ps(v[0], v[2]), hi01 = _mm256_unpackhi_ps(v[0], v[2]);
                __m256 lo23 = _mm256_unpacklo_ps(v[1], v[3]), hi23 = _mm256_unpackhi_ps(v[1], v[3]);
                v[0] = _mm256_permute2f128_ps(lo01, hi01, 0x20), v[1] = _mm256_permute2f128_ps(lo01, hi01, 0x31);
                v[2] = _mm256_permute2f128_ps(lo23, hi23, 0x20), v[3] = _mm256_permute2f128_ps(lo23, hi23, 0x31);
            }
            if (d->bf16) {  /* the high 16 bits of each float32: its BF16, the low ones are zero */
                for (int q = 0; q < 4; q++) {
                    __m256 x = _mm256_mul_ps(v[q], scale);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
                    /* the conversion rounds, but these values are exact in BF16: the same bits */
                    _mm_storeu_si128((__m128i *)(half + 8 * q), (__m128i)_mm256_cvtneps_pbh(x));
#else
                    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
                    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
                    _mm_storeu_si128((__m128i *)(half + 8 * q), packed);
#endif
                }
                continue;
            }
            for (int q = 0; q < 4; q++) _mm256_storeu_ps(dst + 8 * q, _mm256_mul_ps(v[q], scale));
        }
    }
}
#else
/* The same sums in plain C: lane l of a block holds arranged elements l, l+8, l+16, l+24. */
static float weight_value(const job_t *j, int64_t r, int64_t i) {
    if (j->fp4) {  /* i in arranged order: even elements of the block, then odd */
        int64_t e = i % BLOCK, natural = i - e + (e < BLOCK / 2 ? 2 * e : 2 * (e - BLOCK / 2) + 1);
        uint8_t byte = j->w[r * (j->k / 2) + natural / 2];
        return (float)FP4_TWICE[(natural & 1) ? byte >> 4 : byte & 0x0F];
    }
    return e4m3_value(j->w[r * j->k + i]) / 256.0f;
}

static void group_rows(const job_t *j, int64_t r0, int64_t r1, int64_t g0, const float *sw, float *acc) {
    const int64_t nb = j->k / BLOCK;
    int64_t tokens = j->m - g0 < GROUP ? j->m - g0 : GROUP;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t t = 0; t < tokens; t++) {
            const float *a = j->a + (g0 + t) * j->k;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float lane[8];
                for (int l = 0; l < 8; l++) {
                    int64_t i = b * BLOCK + l;
                    float p01 = weight_value(j, r, i) * a[i] + weight_value(j, r, i + 8) * a[i + 8];
                    float p23 = weight_value(j, r, i + 16) * a[i + 16] + weight_value(j, r, i + 24) * a[i + 24];
                    lane[l] = p01 + p23;
                }
                float partial = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
                float sa = j->a_scale[((g0 / GROUP) * nb + b) * GROUP + t], sb = sw[SW_INDEX(r - r0, b, nb)];
                partial = j->fp4 ? (partial * sa) * sb : partial * (sa * sb);
                sum = sum + partial;
            }
            acc[(r - r0) * GROUP + t] = sum;
        }
}

static void decode_rows(const void *job, int64_t r0, int64_t r1) {
    const decode_t *d = job;
    const int64_t nb = d->k / BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *bytes = d->scale + (r / d->rows_per_scale) * nb;
        int32_t top = d->top[r / d->rows_per_scale];
        for (int64_t i = 0; i < d->k; i++) {
            float value;
            if (d->fp4) {
                uint8_t byte = d->w[r * (d->k / 2) + i / 2];
                value = 0.5f * (float)FP4_TWICE[(i & 1) ? byte >> 4 : byte & 0x0F];
            } else {
                value = e4m3_value(d->w[r * d->k + i]);
            }
            float scaled = value * pow2_biased(127 + (int32_t)bytes[i / BLOCK] - top);
            if (d->bf16) {
                union { float f; uint32_t u; } bits = {scaled};
                ((uint16_t *)d->out)[(r - d->first) * d->k + i] = (uint16_t)(bits.u >> 16);
            } else {
                ((float *)d->out)[(r - d->first) * d->k + i] = scaled;
            }
        }
    }
}
#endif

#ifndef FP4_DOT
#define FP4_DOT 0
#endif
#ifndef FP8_DOT
#define FP8_DOT 0
#endif

#if DSV41_SIMD
/* Eight E8M0 bytes -> the float32 bit patterns e8m0_value gives them. */
static inline __m256i e8m0_bits8(const uint8_t *bytes) {
    __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    __m256i bits = _mm256_slli_epi32(x, 23);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(x, _mm256_setzero_si256()));
    return _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(x, _mm256_set1_epi32(255)));
}
#endif

/* Rows [t0, t1)'s weight scales as floats in SW_INDEX order: with SIMD, four rows' eight blocks at
 * a time (a 4 x 8 transpose), the rest one by one. A tile's worth per row, so it matters: done
 * one value at a time it took about a third of one token's FP4 products. */
static void tile_scales(const job_t *j, int64_t t0, int64_t t1, float *sw) {
    const int64_t nb = j->k / BLOCK;
    int64_t r = t0;
#if DSV41_SIMD
    for (; r + 4 <= t1; r += 4) {
        const uint8_t *row[4];
        for (int q = 0; q < 4; q++) row[q] = j->w_scale + ((r + q) / j->rows_per_scale) * nb;
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8) {
            __m256i x0 = e8m0_bits8(row[0] + b), x1 = e8m0_bits8(row[1] + b);
            __m256i x2 = e8m0_bits8(row[2] + b), x3 = e8m0_bits8(row[3] + b);
            __m256i u0 = _mm256_unpacklo_epi32(x0, x1), u1 = _mm256_unpackhi_epi32(x0, x1);
            __m256i u2 = _mm256_unpacklo_epi32(x2, x3), u3 = _mm256_unpackhi_epi32(x2, x3);
            /* block b + i (b + 4 + i in the upper half): the four rows' scales */
            __m256i t0_ = _mm256_unpacklo_epi64(u0, u2), t1_ = _mm256_unpackhi_epi64(u0, u2);
            __m256i t2_ = _mm256_unpacklo_epi64(u1, u3), t3_ = _mm256_unpackhi_epi64(u1, u3);
            __m256i *dst = (__m256i *)(sw + SW_INDEX(r - t0, b, nb));
            _mm256_storeu_si256(dst, _mm256_permute2x128_si256(t0_, t1_, 0x20));
            _mm256_storeu_si256(dst + 1, _mm256_permute2x128_si256(t2_, t3_, 0x20));
            _mm256_storeu_si256(dst + 2, _mm256_permute2x128_si256(t0_, t1_, 0x31));
            _mm256_storeu_si256(dst + 3, _mm256_permute2x128_si256(t2_, t3_, 0x31));
        }
        for (; b < nb; b++)
            for (int q = 0; q < 4; q++) sw[SW_INDEX(r + q - t0, b, nb)] = e8m0_value(row[q][b]);
    }
#endif
    for (; r < t1; r++)
        for (int64_t b = 0; b < nb; b++)
            sw[SW_INDEX(r - t0, b, nb)] = e8m0_value(j->w_scale[(r / j->rows_per_scale) * nb + b]);
}

/* A thread's rows, a tile at a time: the tile's weight scales as floats once, then every token
 * group over the tile. */
static void gemm_rows(const void *job, int64_t r0, int64_t r1) {
    const job_t *j = job;
    const int64_t nb = j->k / BLOCK;
    float *sw = malloc(sizeof(float) * (size_t)(ROW_TILE * nb));
    float *acc = malloc(sizeof(float) * ROW_TILE * GROUP);
    if (!sw || !acc) {  /* reported through the flag the caller checks */
        free(sw), free(acc);
        __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t t0 = r0; t0 < r1; t0 += ROW_TILE) {
        int64_t t1 = t0 + ROW_TILE < r1 ? t0 + ROW_TILE : r1;
        tile_scales(j, t0, t1, sw);
        for (int64_t g0 = 0; g0 < j->m; g0 += GROUP) {
            group_rows(j, t0, t1, g0, sw, acc);
            int64_t tokens = j->m - g0 < GROUP ? j->m - g0 : GROUP;
            for (int64_t r = t0; r < t1; r++)
                memcpy(j->out + r * j->m + g0, acc + (r - t0) * GROUP, sizeof(float) * (size_t)tokens);
        }
    }
    free(sw), free(acc);
}

/* One product for dsv41_gemm_many: out[r, t] = the block-scaled product of FP8 activation row t
 * (bytes [m, k], E8M0 scales [m, k / act_block]) and weight row r (FP4 packed [n, k / 2] or
 * E4M3 [n, k], E8M0 scales [ceil(n / rows_per_scale), k / 32]), as float32 [n, m]. */
typedef struct {
    const uint8_t *w, *w_scale, *a, *a_scale;
    float *out;
    int64_t rows_per_scale, act_block, m, n, k;
    int64_t fp4;
} dsv41_gemm_desc;

typedef struct {
    const job_t *jobs;
    int64_t count;
} many_t;

/* Rows of the products laid end to end: each part takes its share of every product it spans. */
static void many_rows(const void *arg, int64_t r0, int64_t r1) {
    const many_t *many = arg;
    for (int64_t i = 0, first = 0; i < many->count && first < r1; first += many->jobs[i].n, i++) {
        int64_t lo = r0 > first ? r0 - first : 0, hi = r1 - first < many->jobs[i].n ? r1 - first : many->jobs[i].n;
        if (lo < hi) gemm_rows(&many->jobs[i], lo, hi);
    }
}

/* The decode's factor (FP4 values come as 2 * value, E4M3 as value * 2**-8) moves onto the
 * activation: a power of two, so every product stays the reference's product. values [m, k]
 * (FP4 arranged), scales [groups, k / 32, GROUP] (0 past the last token), pairs (FP4 with
 * FP4_DOT, else NULL) [m, k] the values themselves as BF16 in pair_index order. */
static void prepare_activation(const dsv41_gemm_desc *d, float *values, float *scales, uint16_t *pairs) {
    const int64_t k = d->k, nb = k / BLOCK;
    const float factor = d->fp4 ? 0.5f : 256.0f;
    for (int64_t t = 0; t < d->m; t++) {
        for (int64_t i = 0; i < k; i++) {
            float value = e4m3_activation(d->a[t * k + i]);
            values[t * k + (d->fp4 ? arranged_index(i) : i)] = value * factor;
#if FP4_DOT
            if (pairs && d->fp4) pairs[t * k + pair_index(i, k)] = bf16_top(value);  /* exact in BF16 */
#endif
#if FP8_DOT
            if (pairs && !d->fp4) pairs[t * k + fp8_pair_index(i, k)] = bf16_top(value);
#endif
        }
        for (int64_t b = 0; b < nb; b++)
            scales[((t / GROUP) * nb + b) * GROUP + t % GROUP] =
                e8m0_value(d->a_scale[t * (k / d->act_block) + b * BLOCK / d->act_block]);
    }
}

/* Several independent products in one parallel pass over all their weight rows (a decode
 * step's gate and up projections of every selected expert, say), so the threads start once.
 * Returns 0; -1 for a shape it does not take (nothing computed); -2 when memory runs out. */
int dsv41_gemm_many(const dsv41_gemm_desc *descs, int64_t count, int threads) {
    int64_t total = 0;
    for (int64_t i = 0; i < count; i++) {
        const dsv41_gemm_desc *d = &descs[i];
        if (d->m < 0 || d->n < 0 || d->k < BLOCK || d->k % BLOCK || d->rows_per_scale < 1 ||
            d->act_block < BLOCK || d->act_block % BLOCK || d->k % d->act_block)
            return -1;
        total += d->m > 0 ? d->n : 0;
    }
    job_t *jobs = calloc((size_t)(count > 0 ? count : 1), sizeof(job_t));
    int failed = jobs == NULL;
    for (int64_t i = 0; i < count && !failed; i++) {
        const dsv41_gemm_desc *d = &descs[i];
        int64_t groups = (d->m + GROUP - 1) / GROUP, nb = d->k / BLOCK;
        float *values = malloc(sizeof(float) * (size_t)(d->m * d->k + 1));
        float *scales = calloc((size_t)(groups * nb * GROUP + 1), sizeof(float));
        int dot = d->fp4 ? FP4_DOT : FP8_DOT;  /* one token's products on the BF16 dot product */
        uint16_t *pairs = dot ? malloc(sizeof(uint16_t) * (size_t)(d->m * d->k + 1)) : NULL;
        /* a product with no tokens keeps n = 0: it has no rows to hand out */
        jobs[i] = (job_t){d->w, d->w_scale, values, scales, pairs, d->out, d->m, d->m > 0 ? d->n : 0, d->k,
                          d->rows_per_scale, (int)d->fp4, &failed};
        if (!values || !scales || (dot && !pairs)) failed = 1;
        else prepare_activation(d, values, scales, pairs);
    }
    if (!failed && total > 0) {
        many_t many = {jobs, count};
        parallel_rows(&many, 0, total, threads, many_rows);
    }
    for (int64_t i = 0; jobs && i < count; i++)
        free((void *)jobs[i].a), free((void *)jobs[i].a_scale), free((void *)jobs[i].a_pairs);
    free(jobs);
    return failed ? -2 : 0;
}

/* For many tokens the caller runs a BLAS GEMM on decoded rows instead, with the scales split as
 * in experts.py: each token's or weight row's largest scale byte `top`, relative scales
 * 2**(byte - top) applied before the product, 2**top after. */

/* Each scale row's largest and smallest byte: top[s], low[s] for s < scale_rows. */
int dsv41_scale_range(const uint8_t *scale, int64_t scale_rows, int64_t nb, int32_t *top, int32_t *low) {
    if (scale_rows < 0 || nb < 1) return -1;
    for (int64_t s = 0; s < scale_rows; s++) {
        const uint8_t *row = scale + s * nb;
        uint8_t hi = row[0], lo = row[0];
        for (int64_t b = 1; b < nb; b++) {
            hi = row[b] > hi ? row[b] : hi;
            lo = row[b] < lo ? row[b] : lo;
        }
        top[s] = hi, low[s] = lo;
    }
    return 0;
}

/* FP8 activation bytes [m, k] with E8M0 scales [m, k / act_block] -> value * 2**(scale - top),
 * natural order, NaN for the NaN code, with each token's largest and smallest scale byte; float32,
 * or with `bf16` its top half, the same number: an E4M3 value times a power of two has at most 4
 * significant bits (and a NaN stays NaN there). */
int dsv41_activation(const uint8_t *a, const uint8_t *scale, int64_t m, int64_t k, int64_t act_block, void *out,
                     int32_t *top, int32_t *low, int bf16) {
    if (m < 0 || act_block < BLOCK || act_block % BLOCK || k % act_block) return -1;
    int64_t nb = k / act_block;
    dsv41_scale_range(scale, m, nb, top, low);
    float row[BLOCK];
    for (int64_t t = 0; t < m; t++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *src = a + t * k + b * act_block;
            float factor = pow2_biased(127 + (int32_t)scale[t * nb + b] - top[t]);
            for (int64_t i0 = 0; i0 < act_block; i0 += BLOCK) {
                float *dst = bf16 ? row : (float *)out + t * k + b * act_block + i0;
                int64_t i = 0;
#if DSV41_SIMD
                /* E4M3 bytes as IEEE halves (value * 2**-8, as decode_block reads weights; the NaN
                 * code as a half NaN), times the factor and 2**8: one multiply by a power of two,
                 * so the same value as e4m3_activation's */
                const __m256 scaled = _mm256_set1_ps(factor * 256.0f);
                for (; i + 16 <= BLOCK; i += 16) {
                    __m256i u16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i0 + i)));
                    __m256i magnitude = _mm256_and_si256(u16, _mm256_set1_epi16(0x7F));
                    __m256i sign = _mm256_slli_epi16(_mm256_and_si256(u16, _mm256_set1_epi16(0x80)), 8);
                    __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7F)),
                                                   _mm256_set1_epi16(0x7E00));
                    __m256i halves = _mm256_or_si256(_mm256_or_si256(sign, _mm256_slli_epi16(magnitude, 7)), nan);
                    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), scaled));
                    _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)), scaled));
                }
#endif
                for (; i < BLOCK; i++) dst[i] = e4m3_activation(src[i0 + i]) * factor;
                if (bf16) {
                    uint16_t *half = (uint16_t *)out + t * k + b * act_block + i0;
                    for (int q = 0; q < BLOCK; q++) {
                        union { float f; uint32_t u; } bits = {row[q]};
                        half[q] = (uint16_t)(bits.u >> 16);
                    }
                }
            }
        }
    return 0;
}

/* out[r - first, :] = value(w[r, :]) * 2**(scale - top) for first <= r < last, natural order;
 * 0 where that leaves the normal range (rows the caller recomputes). With `bf16` the values are
 * written as BF16: an E2M1 or E4M3 value times a power of two has at most 4 significant bits, so
 * its float32 bits end in 16 zeros and the top half is the same number, exactly. */
int dsv41_decode(int fp4, const uint8_t *w, const uint8_t *scale, const int32_t *top, int64_t rows_per_scale,
                 void *out, int64_t first, int64_t last, int64_t k, int threads, int bf16) {
    if (first < 0 || last < first || k % BLOCK || rows_per_scale < 1) return -1;
    decode_t d = {w, scale, top, out, k, rows_per_scale, first, fp4, bf16 != 0};
    parallel_rows(&d, first, last, threads, decode_rows);
    return 0;
}

/* float32 -> BF16, rounded to nearest even as torch rounds it (a NaN becomes the quiet NaN). */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A float32 value, already divided by its block's scale, -> its E4M3 byte as quant.py's to_e4m3
 * makes it: NaN -> the NaN code, magnitudes clamped to 448, then rounded to nearest even (the
 * subnormal range by adding 2**14, whose ulp is E4M3's 2**-9, as torch's conversion does).
 * Branch-free, so the compiler vectorizes the loops that call it. */
static inline uint8_t e4m3_code(float v) {
    uint32_t u, sub_bits;
    memcpy(&u, &v, sizeof u);
    const uint32_t sign = (u >> 24) & 0x80u, denorm_bits = 141u << 23; /* 2**14 */
    uint32_t mag = u & 0x7FFFFFFFu;
    const uint32_t nan = mag > 0x7F800000u;
    mag = mag > 0x43E00000u ? 0x43E00000u : mag; /* 448 */
    float shifted;
    memcpy(&shifted, &mag, sizeof shifted);
    shifted = shifted + 16384.0f;
    memcpy(&sub_bits, &shifted, sizeof sub_bits);
    const uint32_t subnormal = sub_bits - denorm_bits;
    const uint32_t normal = (mag + (uint32_t)((7 - 127) * (1 << 23)) + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;
    const uint32_t code = nan ? 0x7Fu : mag < (121u << 23) ? subnormal : normal; /* 2**-6: the smallest normal */
    return (uint8_t)(code | sign);
}

typedef struct {
    const void *x;   /* float32 or BF16 [m, k] */
    uint8_t *codes;  /* E4M3 [m, k] */
    uint8_t *scales; /* E8M0 [m, k / block] */
    int64_t k, block;
    int bf16;
} quant_t;

/* 32 inputs from x[at...] as float32. */
static inline void quant_load(const quant_t *q, int64_t at, float v[BLOCK]) {
    if (q->bf16) {
        const uint16_t *h = (const uint16_t *)q->x + at;
#if DSV41_SIMD
        for (int i = 0; i < BLOCK; i += 8)
            _mm256_storeu_ps(v + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i))), 16)));
#else
        for (int i = 0; i < BLOCK; i++) v[i] = bf16_value(h[i]);
#endif
    } else {
        memcpy(v, (const float *)q->x + at, sizeof(float) * BLOCK);
    }
}

#if DSV41_SIMD
/* e4m3_code on eight lanes -> their bytes in the low 64 bits. */
static inline __m128i e4m3_codes8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000));
    mag = _mm256_min_epu32(mag, _mm256_set1_epi32(0x43E00000));
    const __m256i subnormal = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(16384.0f))),
        _mm256_set1_epi32(141 << 23));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32((int)0xC407FFFFu)), odd), 20);
    __m256i code = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), mag));
    code = _mm256_or_si256(_mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan), sign);
    /* byte 0 of each 32-bit lane, four per 128-bit half, then the halves side by side */
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i bytes = _mm256_shuffle_epi8(code, pick);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
}
#endif

static void quant_rows(const void *job, int64_t r0, int64_t r1) {
    const quant_t *q = job;
    const float inv_max = (float)(1.0 / 448.0), floor_amax = 1e-4f;
    float v[BLOCK];
    for (int64_t b0 = r0 * q->k; b0 < r1 * q->k; b0 += q->block) {
        float amax = 0.0f;
        int nan = 0;
        for (int64_t i0 = b0; i0 < b0 + q->block; i0 += BLOCK) {
            quant_load(q, i0, v);
#if DSV41_SIMD
            const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
            __m256 top = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
            for (int i = 0; i < BLOCK; i += 8) {
                __m256 a = _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude);
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
                top = _mm256_max_ps(top, a);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, top);
            nan |= _mm256_movemask_ps(unordered) != 0;
            for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
#else
            for (int i = 0; i < BLOCK; i++) {
                float a = fabsf(v[i]);
                nan |= a != a;
                amax = a > amax ? a : amax;
            }
#endif
        }
        /* quant.py: amax (NaN if any is) floored, times float32(1/448), rounded up to a power of two */
        float scale = nan ? NAN : (amax < floor_amax ? floor_amax : amax) * inv_max;
        uint32_t bits;
        memcpy(&bits, &scale, sizeof bits);
        bits = (((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0)) << 23; /* a NaN's 256 makes -0, as in pow2_ceil */
        memcpy(&scale, &bits, sizeof scale);
        q->scales[b0 / q->block] = (uint8_t)((bits >> 23) & 0xFFu);
        for (int64_t i0 = b0; i0 < b0 + q->block; i0 += BLOCK) {
            quant_load(q, i0, v);
#if DSV41_SIMD
            const __m256 divisor = _mm256_set1_ps(scale);
            for (int i = 0; i < BLOCK; i += 8)
                _mm_storel_epi64((__m128i *)(q->codes + i0 + i), e4m3_codes8(_mm256_div_ps(_mm256_loadu_ps(v + i), divisor)));
#else
            for (int i = 0; i < BLOCK; i++) q->codes[i0 + i] = e4m3_code(v[i] / scale);
#endif
        }
    }
}

/* quant.py's act_quant with E8M0 scales, byte for byte: x [m, k] (float32, or BF16 with `bf16`)
 * -> E4M3 codes [m, k] and E8M0 scale bytes [m, k / block]. Returns 0, -1 for a shape it does
 * not take. */
int dsv41_act_quant(const void *x, int bf16, int64_t m, int64_t k, int64_t block, uint8_t *codes, uint8_t *scales,
                    int threads) {
    if (m < 0 || block < BLOCK || block % BLOCK || k % block) return -1;
    quant_t q = {x, codes, scales, k, block, bf16 != 0};
    if (m > 0) parallel_rows(&q, 0, m, threads, quant_rows);
    return 0;
}

typedef struct {
    uint16_t *out;       /* BF16, token t's row at out + t * ld */
    const float *w_pow;  /* [n] */
    const int32_t *a_top;
    int64_t n, ld;
} powers_t;

static void power_rows(const void *job, int64_t t0, int64_t t1) {
    const powers_t *p = job;
    for (int64_t t = t0; t < t1; t++) {
        const float a_pow = e8m0_value((uint8_t)p->a_top[t]);
        uint16_t *row = p->out + t * p->ld;
        for (int64_t r = 0; r < p->n; r++) row[r] = bf16_round(bf16_value(row[r]) * a_pow * p->w_pow[r]);
    }
}

/* The powers of two that dsv41_activation and dsv41_scale_range split off, applied to a BF16
 * product [m, n] in place (token t's outputs at out + t * ld): out[t, r] = BF16(out[t, r] *
 * 2**(a_top[t] - 127) * 2**(w_top[r / rows_per_scale] - 127)), the token's power first as the
 * reference applies its scales, one rounding. Returns 0, -1 for a shape it does not take, -2 when
 * memory runs out. */
int dsv41_apply_powers(uint16_t *out, int64_t m, int64_t n, int64_t ld, const int32_t *a_top, const int32_t *w_top,
                       int64_t rows_per_scale, int threads) {
    if (m < 0 || n < 0 || ld < n || rows_per_scale < 1) return -1;
    float *w_pow = malloc(sizeof(float) * (size_t)(n + 1));
    if (!w_pow) return -2;
    for (int64_t r = 0; r < n; r++) w_pow[r] = e8m0_value((uint8_t)w_top[r / rows_per_scale]);
    powers_t p = {out, w_pow, a_top, n, ld};
    if (m > 0) parallel_rows(&p, 0, m, threads, power_rows);
    free(w_pow);
    return 0;
}

/* 1 where one token's four-row products take the AVX-512 body (same sums as the AVX2 one). */
#ifndef DSV41_AVX512
#define DSV41_AVX512 0
#endif
int dsv41_avx512(void) { return DSV41_AVX512; }
int dsv41_fp4_dot(void) { return FP4_DOT; }
int dsv41_fp8_dot(void) { return FP8_DOT; }
