/* Native CPU kernels for the routed and shared experts: products straight from packed FP4 (E2M1,
 * two codes per byte, element 2i in the low nibble) and FP8 (E4M3) weight rows.
 *
 * Built by dsv41/kernels/native.py with the machine's C compiler on first use and called through
 * ctypes. Scales are read as stored, E8M0 bytes, one per 32 values along K: for the weights one
 * scale row per `rows_per_scale` weight rows (1 for FP4 experts, 32 for FP8 blocks), for the
 * activations one per `act_block` values. Every scale row is split into its largest byte `top`
 * and relative scales 2**(byte - top), so each product below is an exact float32 and only the
 * order of additions differs from the reference; the powers of two 2**top are applied to the
 * result, the token's first, then the row's (see experts.py for the span that keeps the split
 * exact; rows or tokens outside it are flagged and recomputed by the caller).
 *
 * - dsv41_small_gemm: the whole product for up to GEMV_MAX_TOKENS tokens; each 32-value block
 *   of a weight row is decoded once into registers and multiplied into every token.
 * - dsv41_activation, dsv41_scale_range, dsv41_decode: the pieces for more tokens, where the
 *   caller decodes weight rows into a float32 buffer for a BLAS GEMM.
 *
 * FP4 codes go through a 16-entry table of 2 * value (small integers, exact in int8); the factor
 * 0.5 is folded into the block scale. E4M3 bytes are moved into the bit positions of an IEEE
 * half (value * 2**-8, subnormals included) and widened by the F16C conversion, which reads half
 * subnormals as themselves whatever the thread's denormal flags say; 2**8 is folded into the
 * block scale. Without AVX2/FMA/F16C the same arithmetic runs as plain C.
 *
 * Work is split by weight rows over `threads` POSIX threads (the caller's thread takes one part).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DSV41_SIMD 1
#else
#define DSV41_SIMD 0
#endif

#define BLOCK 32
#define GEMV_MAX_TOKENS 8
#define MAX_THREADS 64
#define ABI_VERSION 5

int dsv41_abi_version(void) { return ABI_VERSION; }
int dsv41_simd(void) { return DSV41_SIMD; }
int dsv41_gemv_max_tokens(void) { return GEMV_MAX_TOKENS; }

/* 2 * value of each E2M1 code; code 8 is -0, read as 0. */
static const int8_t FP4_TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static float e4m3_value(uint8_t b) {
    int e = (b >> 3) & 0xF, m = b & 0x7;
    float mag = e ? (float)(8 + m) * (float)(1 << e) / 1024.0f /* (1 + m/8) * 2**(e-7) */
                  : (float)m / 512.0f;                          /* m/8 * 2**-6 */
    return (b & 0x80) ? -mag : mag;
}

static inline float float_of_bits(uint32_t u) {
    union { uint32_t u; float f; } bits;
    bits.u = u;
    return bits.f;
}

/* An E8M0 byte as the float32 it stands for: 2**(byte - 127), 2**-127 as a subnormal, 255 NaN. */
static inline float e8m0_value(uint8_t byte) {
    return float_of_bits(byte == 0 ? 0x00400000u : byte == 255 ? 0x7FC00000u : (uint32_t)byte << 23);
}

/* 2**(exponent - 127) for a biased exponent in the normal range, else 0. */
static inline float pow2_biased(int32_t exponent) {
    return float_of_bits(exponent > 0 && exponent < 255 ? (uint32_t)exponent << 23 : 0);
}

/* Where element i of a row sits once arranged for the FP4 GEMV: per 32-value block, the 16 even
 * elements, then the 16 odd ones (the order the packed nibbles decode in). */
static inline int64_t arranged_index(int64_t i) {
    int64_t e = i % BLOCK;
    return i - e + (e & 1) * (BLOCK / 2) + e / 2;
}

typedef struct {
    const uint8_t *w;      /* [n, row_bytes] */
    const uint8_t *scale;  /* E8M0 [ceil(n / rows_per_scale), nb] */
    const int32_t *top;    /* [ceil(n / rows_per_scale)]: each scale row's largest byte */
    const float *a;        /* gemv: [m, k], FP4 arranged per block; decode: unused */
    const float *a_pow;    /* gemv: [m] each token's power of two */
    float *out;            /* gemv: [m, n]; decode: [last - first, k] */
    int64_t m, n, k, rows_per_scale, first;
    int fp4;
} job_t;

/* rel[b] = 2**(byte - top) times the decode's factor (0.5 for the FP4 table's 2 * value, 2**8
 * for E4M3 read as halves) for each block b of weight row `row`; 0 where that leaves the normal
 * range (rows outside the span, recomputed by the caller). */
static void row_scales(const job_t *j, int64_t row, float *rel) {
    int64_t srow = row / j->rows_per_scale, nb = j->k / BLOCK;
    const uint8_t *bytes = j->scale + srow * nb;
    int32_t bias = (j->fp4 ? 126 : 135) - j->top[srow];
    for (int64_t b = 0; b < nb; b++) rel[b] = pow2_biased(bias + (int32_t)bytes[b]);
}

/* The token's power of two first, then the row's: the order the reference applies its scales. */
static inline float finish(const job_t *j, int64_t t, int64_t r, float sum) {
    return sum * j->a_pow[t] * e8m0_value((uint8_t)j->top[r / j->rows_per_scale]);
}

typedef void (*body_fn)(const job_t *, int64_t, int64_t, float *);

typedef struct {
    const job_t *job;
    body_fn body;
    int64_t r0, r1;
    float *rel;  /* this part's scratch for one row's block scales */
} part_t;

static void *run_part(void *arg) {
    part_t *p = (part_t *)arg;
    p->body(p->job, p->r0, p->r1, p->rel);
    return NULL;
}

/* Rows [first, last) in `threads` contiguous parts; a part whose thread cannot start runs here.
 * Returns 0, or -2 when the scratch cannot be allocated. */
static int parallel_rows(const job_t *job, int64_t first, int64_t last, int threads, body_fn body) {
    int64_t n = last - first, nb = job->k / BLOCK;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = (int)(n > 0 ? n : 1);
    float *scratch = malloc(sizeof(float) * (size_t)(threads * (nb > 0 ? nb : 1)));
    if (!scratch) return -2;
    part_t parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        parts[t] = (part_t){job, body, first + n * t / threads, first + n * (t + 1) / threads, scratch + t * nb};
        started[t] = t > 0 && pthread_create(&ids[t], NULL, run_part, &parts[t]) == 0;
    }
    for (int t = 0; t < threads; t++)
        if (!started[t]) run_part(&parts[t]);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
    free(scratch);
    return 0;
}

#if DSV41_SIMD
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 i8_to_ps(__m128i x) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)); }

/* One 32-value block of a weight row -> 4 x 8 floats (times the factor row_scales folds out):
 * FP4 in the arranged order (even elements, then odd), E4M3 in natural order. */
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

/* M tokens at a time, FP4 or not: compile-time constants, so the accumulators stay in registers
 * and the format's branch leaves the loop. */
#define GEMV_BODY(M, FP4, NAME)                                                                   \
    static void NAME(const job_t *j, int64_t r0, int64_t r1, float *rel) {                        \
        const int64_t nb = j->k / BLOCK, row_bytes = FP4 ? j->k / 2 : j->k;                      \
        const int64_t block_bytes = FP4 ? BLOCK / 2 : BLOCK;                                      \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            const uint8_t *w = j->w + r * row_bytes;                                              \
            row_scales(j, r, rel);                                                                \
            __m256 acc[M];                                                                        \
            for (int t = 0; t < M; t++) acc[t] = _mm256_setzero_ps();                             \
            for (int64_t b = 0; b < nb; b++) {                                                    \
                __m256 v[4];                                                                      \
                decode_block(FP4, w + b * block_bytes, v);                                        \
                __m256 scale = _mm256_broadcast_ss(rel + b);                                      \
                for (int t = 0; t < M; t++) {                                                     \
                    const float *a = j->a + t * j->k + b * BLOCK;                                 \
                    __m256 p01 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(a + 8),                    \
                                                 _mm256_mul_ps(v[0], _mm256_loadu_ps(a)));        \
                    __m256 p23 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(a + 24),                   \
                                                 _mm256_mul_ps(v[2], _mm256_loadu_ps(a + 16)));   \
                    acc[t] = _mm256_fmadd_ps(_mm256_add_ps(p01, p23), scale, acc[t]);             \
                }                                                                                 \
            }                                                                                     \
            for (int t = 0; t < M; t++) j->out[t * j->n + r] = finish(j, t, r, hsum(acc[t]));     \
        }                                                                                         \
    }

#define GEMV_BOTH(M) GEMV_BODY(M, 1, gemv_fp4_##M) GEMV_BODY(M, 0, gemv_fp8_##M)
GEMV_BOTH(1)
GEMV_BOTH(2)
GEMV_BOTH(3)
GEMV_BOTH(4)
GEMV_BOTH(5)
GEMV_BOTH(6)
GEMV_BOTH(7)
GEMV_BOTH(8)

static const body_fn GEMV_FP4[GEMV_MAX_TOKENS + 1] = {
    0, gemv_fp4_1, gemv_fp4_2, gemv_fp4_3, gemv_fp4_4, gemv_fp4_5, gemv_fp4_6, gemv_fp4_7, gemv_fp4_8};
static const body_fn GEMV_FP8[GEMV_MAX_TOKENS + 1] = {
    0, gemv_fp8_1, gemv_fp8_2, gemv_fp8_3, gemv_fp8_4, gemv_fp8_5, gemv_fp8_6, gemv_fp8_7, gemv_fp8_8};

static void gemv_rows(const job_t *j, int64_t r0, int64_t r1, float *rel) {
    (j->fp4 ? GEMV_FP4 : GEMV_FP8)[j->m](j, r0, r1, rel);
}

static void decode_rows(const job_t *j, int64_t r0, int64_t r1, float *rel) {
    const int64_t nb = j->k / BLOCK, row_bytes = j->fp4 ? j->k / 2 : j->k;
    const int64_t block_bytes = j->fp4 ? BLOCK / 2 : BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        row_scales(j, r, rel);
        float *dst = j->out + (r - j->first) * j->k;
        for (int64_t b = 0; b < nb; b++, dst += BLOCK) {
            __m256 v[4];
            decode_block(j->fp4, j->w + r * row_bytes + b * block_bytes, v);
            __m256 scale = _mm256_broadcast_ss(rel + b);
            if (j->fp4) {  /* back from (even, odd) to natural order */
                __m256 lo01 = _mm256_unpacklo_ps(v[0], v[2]), hi01 = _mm256_unpackhi_ps(v[0], v[2]);
                __m256 lo23 = _mm256_unpacklo_ps(v[1], v[3]), hi23 = _mm256_unpackhi_ps(v[1], v[3]);
                v[0] = _mm256_permute2f128_ps(lo01, hi01, 0x20), v[1] = _mm256_permute2f128_ps(lo01, hi01, 0x31);
                v[2] = _mm256_permute2f128_ps(lo23, hi23, 0x20), v[3] = _mm256_permute2f128_ps(lo23, hi23, 0x31);
            }
            for (int q = 0; q < 4; q++) _mm256_storeu_ps(dst + 8 * q, _mm256_mul_ps(v[q], scale));
        }
    }
}
#else
/* Element i of weight row r times the factor row_scales folds out (2 for FP4, 2**-8 for E4M3). */
static inline float weight_value(const job_t *j, int64_t r, int64_t i) {
    if (j->fp4) {
        uint8_t byte = j->w[r * (j->k / 2) + i / 2];
        return (float)FP4_TWICE[(i & 1) ? byte >> 4 : byte & 0x0F];
    }
    return e4m3_value(j->w[r * j->k + i]) / 256.0f;
}

static void gemv_rows(const job_t *j, int64_t r0, int64_t r1, float *rel) {
    const int64_t nb = j->k / BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        row_scales(j, r, rel);
        for (int64_t t = 0; t < j->m; t++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float p = 0.0f;
                for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; i++)
                    p += weight_value(j, r, i) * j->a[t * j->k + (j->fp4 ? arranged_index(i) : i)];
                acc += p * rel[b];
            }
            j->out[t * j->n + r] = finish(j, t, r, acc);
        }
    }
}

static void decode_rows(const job_t *j, int64_t r0, int64_t r1, float *rel) {
    for (int64_t r = r0; r < r1; r++) {
        row_scales(j, r, rel);
        for (int64_t i = 0; i < j->k; i++)
            j->out[(r - j->first) * j->k + i] = weight_value(j, r, i) * rel[i / BLOCK];
    }
}
#endif

/* FP8 activation bytes [m, k] with E8M0 scales [m, k / act_block] -> float32
 * value * 2**(scale - top) per token, arranged for the FP4 GEMV when asked, with each token's
 * largest and smallest scale byte. */
int dsv41_activation(const uint8_t *a, const uint8_t *scale, int64_t m, int64_t k, int64_t act_block,
                     int arrange, float *out, int32_t *top, int32_t *low) {
    if (m < 0 || act_block < 1 || k % act_block || (arrange && k % BLOCK)) return -1;
    int64_t nb = k / act_block;
    for (int64_t t = 0; t < m; t++) {
        const uint8_t *srow = scale + t * nb;
        uint8_t hi = srow[0], lo = srow[0];
        for (int64_t b = 1; b < nb; b++) {
            hi = srow[b] > hi ? srow[b] : hi;
            lo = srow[b] < lo ? srow[b] : lo;
        }
        top[t] = hi, low[t] = lo;
        for (int64_t i = 0; i < k; i++)
            out[t * k + (arrange ? arranged_index(i) : i)] =
                e4m3_value(a[t * k + i]) * pow2_biased(127 + (int32_t)srow[i / act_block] - hi);
    }
    return 0;
}

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

/* out[r - first, :] = value(w[r, :]) * 2**(scale - top) for first <= r < last, natural order. */
int dsv41_decode(int fp4, const uint8_t *w, const uint8_t *scale, const int32_t *top, int64_t rows_per_scale,
                 float *out, int64_t first, int64_t last, int64_t k, int threads) {
    if (first < 0 || last < first || k % BLOCK || rows_per_scale < 1) return -1;
    job_t job = {w, scale, top, NULL, NULL, out, 0, last, k, rows_per_scale, first, fp4};
    return parallel_rows(&job, first, last, threads, decode_rows);
}

/* The whole fused GEMM for 1 <= m <= GEMV_MAX_TOKENS: FP8 activation bytes [m, k] with E8M0
 * scales [m, k / act_block] times weights [n, row_bytes] with E8M0 scales -> out [m, n].
 * row_ok[n] and token_ok[m] say whether a row's or token's scales span at most `span` octaves
 * and are not NaN; returns how many rows and tokens are not (their outputs are meaningless and
 * the caller recomputes them), -1 for bad shapes, -2 when memory runs out. */
int dsv41_small_gemm(int fp4, const uint8_t *w, const uint8_t *w_scale, int64_t rows_per_scale,
                     const uint8_t *a, const uint8_t *a_scale, int64_t act_block, float *out,
                     uint8_t *row_ok, uint8_t *token_ok, int64_t m, int64_t n, int64_t k, int32_t span,
                     int threads) {
    if (m < 1 || m > GEMV_MAX_TOKENS || n < 0 || k % BLOCK || rows_per_scale < 1 || act_block < 1 ||
        k % act_block)
        return -1;
    int64_t scale_rows = (n + rows_per_scale - 1) / rows_per_scale;
    float *values = malloc(sizeof(float) * (size_t)(m * k + m));
    int32_t *ranges = malloc(sizeof(int32_t) * (size_t)(2 * (m + scale_rows)));
    if (!values || !ranges) {
        free(values), free(ranges);
        return -2;
    }
    float *a_pow = values + m * k;
    int32_t *a_top = ranges, *a_low = ranges + m, *w_top = ranges + 2 * m, *w_low = w_top + scale_rows;
    dsv41_activation(a, a_scale, m, k, act_block, fp4, values, a_top, a_low);
    dsv41_scale_range(w_scale, scale_rows, k / BLOCK, w_top, w_low);
    int bad = 0;
    for (int64_t t = 0; t < m; t++) {
        a_pow[t] = e8m0_value((uint8_t)a_top[t]);
        token_ok[t] = a_top[t] - a_low[t] <= span && a_top[t] < 255;
        bad += !token_ok[t];
    }
    for (int64_t r = 0; r < n; r++) {
        int64_t s = r / rows_per_scale;
        row_ok[r] = w_top[s] - w_low[s] <= span && w_top[s] < 255;
        bad += !row_ok[r];
    }
    job_t job = {w, w_scale, w_top, values, a_pow, out, m, n, k, rows_per_scale, 0, fp4};
    int status = parallel_rows(&job, 0, n, threads, gemv_rows);
    free(values), free(ranges);
    return status < 0 ? status : bad;
}
