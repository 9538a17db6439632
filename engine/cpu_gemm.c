/* A few rows times a float32 weight on one CPU core with AVX-512 or AVX2, reading the weight once
 * (engine/cpu_packed.py builds it with the flags of the CPU it runs on).
 *
 * A speculative verify row is 2 .. ~17 rows of activations. Torch's GEMM paths (MKL, oneDNN) stream the weight
 * at 60-70% of what one core's GEMV reaches for such row counts; this kernel keeps every row's accumulators in
 * registers while the weight streams past once, so up to MAX_GROUP rows cost about what one row does.
 *
 * Layout: the weight [N, K] is packed once into panels of PANEL outputs, panel p holding [K][PANEL] (the PANEL
 * weights of input k side by side), so a panel is one contiguous stream; the last panel is padded with zeros.
 * Each float of the output is a sum over k in order, one FMA per term. A panel is two vectors wide: 32 floats with
 * AVX-512 (32 registers), 16 with AVX2 (16 registers). */
#include <immintrin.h>

#if defined(__AVX512F__)
#define VEC __m512
#define VW 16
#define VZERO _mm512_setzero_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define MAX_GROUP 10 /* rows per pass over a panel: 2 accumulators a row + 2 weights + 1 broadcast <= 32 */
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC __m256
#define VW 8
#define VZERO _mm256_setzero_ps
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define MAX_GROUP 6 /* 2 accumulators a row + 2 weights + 1 broadcast <= 16 */
#else
#error "cpu_gemm.c needs AVX-512 (-mavx512f) or AVX2 with FMA (-mavx2 -mfma)"
#endif
#define PANEL (2 * VW)

#define PANEL_KERNEL(MR)                                                                                     \
    static void panel_##MR(const float *restrict w, const float *restrict x, float *restrict out, long k_len, \
                           long ldo, long valid) {                                                          \
        VEC lo[MR], hi[MR];                                                                                  \
        _Pragma("GCC unroll 16") for (int m = 0; m < MR; m++) {                                              \
            lo[m] = VZERO();                                                                                 \
            hi[m] = VZERO();                                                                                 \
        }                                                                                                    \
        for (long k = 0; k < k_len; k++) {                                                                   \
            _mm_prefetch((const char *)(w + (k + 32) * PANEL), _MM_HINT_T0);                                 \
            _mm_prefetch((const char *)(w + (k + 32) * PANEL + VW), _MM_HINT_T0);                            \
            VEC w_lo = VLOAD(w + k * PANEL);                                                                 \
            VEC w_hi = VLOAD(w + k * PANEL + VW);                                                            \
            _Pragma("GCC unroll 16") for (int m = 0; m < MR; m++) {                                          \
                VEC xv = VSET1(x[m * k_len + k]);                                                            \
                lo[m] = VFMA(xv, w_lo, lo[m]);                                                               \
                hi[m] = VFMA(xv, w_hi, hi[m]);                                                               \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 16") for (int m = 0; m < MR; m++) {                                              \
            float *o = out + m * ldo;                                                                        \
            if (valid == PANEL) {                                                                            \
                VSTORE(o, lo[m]);                                                                            \
                VSTORE(o + VW, hi[m]);                                                                       \
            } else {                                                                                         \
                float t[PANEL];                                                                              \
                VSTORE(t, lo[m]);                                                                            \
                VSTORE(t + VW, hi[m]);                                                                       \
                for (long j = 0; j < valid; j++) o[j] = t[j];                                                \
            }                                                                                                \
        }                                                                                                    \
    }

PANEL_KERNEL(1)
PANEL_KERNEL(2)
PANEL_KERNEL(3)
PANEL_KERNEL(4)
PANEL_KERNEL(5)
PANEL_KERNEL(6)
#if MAX_GROUP >= 10
PANEL_KERNEL(7)
PANEL_KERNEL(8)
PANEL_KERNEL(9)
PANEL_KERNEL(10)
#endif

typedef void (*panel_fn)(const float *, const float *, float *, long, long, long);
static const panel_fn PANELS[MAX_GROUP + 1] = {0, panel_1, panel_2, panel_3, panel_4, panel_5, panel_6,
#if MAX_GROUP >= 10
                                               panel_7, panel_8, panel_9, panel_10
#endif
};

long atomesh_panel_width(void) { return PANEL; }

/* w [n, k] row-major -> packed [ceil(n / PANEL)][k][PANEL]. */
void atomesh_pack(const float *w, float *packed, long n, long k) {
    long panels = (n + PANEL - 1) / PANEL;
    for (long p = 0; p < panels; p++)
        for (long i = 0; i < k; i++)
            for (long j = 0; j < PANEL; j++) {
                long row = p * PANEL + j;
                packed[(p * k + i) * PANEL + j] = row < n ? w[row * k + i] : 0.0f;
            }
}

/* out [m, n] = x [m, k] @ w.T (+ bias [n] when not null), w packed by atomesh_pack. The rows go over each panel
 * in groups of at most MAX_GROUP, as even as can be (a panel re-read by a second group comes from the cache). */
void atomesh_gemm(const float *packed, const float *x, const float *bias, float *out, long m, long n, long k) {
    long panels = (n + PANEL - 1) / PANEL;
    long groups = (m + MAX_GROUP - 1) / MAX_GROUP;
    for (long p = 0; p < panels; p++) {
        long valid = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        long row = 0;
        for (long g = 0; g < groups; g++) {
            long rows = (m - row + (groups - g) - 1) / (groups - g);
            PANELS[rows](packed + p * k * PANEL, x + row * k, out + row * n + p * PANEL, k, n, valid);
            row += rows;
        }
    }
    if (bias)
        for (long r = 0; r < m; r++)
            for (long j = 0; j < n; j++) out[r * n + j] += bias[j];
}
