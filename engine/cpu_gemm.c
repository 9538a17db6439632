/* A few rows times a float32 weight on one CPU core with AVX-512, reading the weight once (engine/cpu_packed.py).
 *
 * A speculative verify row is 2 .. ~17 rows of activations. Torch's GEMM paths (MKL, oneDNN) stream the weight
 * at 60-70% of what one core's GEMV reaches for such row counts; this kernel keeps every row's accumulators in
 * registers while the weight streams past once, so up to ~10 rows cost about what one row does.
 *
 * Layout: the weight [N, K] is packed once into panels of PANEL outputs, panel p holding [K][PANEL] (the PANEL
 * weights of input k side by side), so a panel is one contiguous stream; the last panel is padded with zeros.
 * Each float of the output is a sum over k in order, one FMA per term. */
#include <immintrin.h>

#define PANEL 32
#define MAX_GROUP 10 /* rows per pass over a panel: 2 accumulators a row + 2 weights + 1 broadcast <= 32 */

#define PANEL_KERNEL(MR)                                                                                     \
    static void panel_##MR(const float *restrict w, const float *restrict x, float *restrict out, long k_len, \
                           long ldo, long valid) {                                                          \
        __m512 lo[MR], hi[MR];                                                                               \
        _Pragma("GCC unroll 16") for (int m = 0; m < MR; m++) {                                              \
            lo[m] = _mm512_setzero_ps();                                                                     \
            hi[m] = _mm512_setzero_ps();                                                                     \
        }                                                                                                    \
        for (long k = 0; k < k_len; k++) {                                                                   \
            _mm_prefetch((const char *)(w + (k + 32) * PANEL), _MM_HINT_T0);                                 \
            _mm_prefetch((const char *)(w + (k + 32) * PANEL + 16), _MM_HINT_T0);                            \
            __m512 w_lo = _mm512_loadu_ps(w + k * PANEL);                                                    \
            __m512 w_hi = _mm512_loadu_ps(w + k * PANEL + 16);                                               \
            _Pragma("GCC unroll 16") for (int m = 0; m < MR; m++) {                                          \
                __m512 xv = _mm512_set1_ps(x[m * k_len + k]);                                                \
                lo[m] = _mm512_fmadd_ps(xv, w_lo, lo[m]);                                                    \
                hi[m] = _mm512_fmadd_ps(xv, w_hi, hi[m]);                                                    \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 16") for (int m = 0; m < MR; m++) {                                              \
            float *o = out + m * ldo;                                                                        \
            if (valid == PANEL) {                                                                            \
                _mm512_storeu_ps(o, lo[m]);                                                                  \
                _mm512_storeu_ps(o + 16, hi[m]);                                                             \
            } else {                                                                                         \
                float t[PANEL];                                                                              \
                _mm512_storeu_ps(t, lo[m]);                                                                  \
                _mm512_storeu_ps(t + 16, hi[m]);                                                             \
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
PANEL_KERNEL(7)
PANEL_KERNEL(8)
PANEL_KERNEL(9)
PANEL_KERNEL(10)

typedef void (*panel_fn)(const float *, const float *, float *, long, long, long);
static const panel_fn PANELS[MAX_GROUP + 1] = {0,       panel_1, panel_2, panel_3, panel_4, panel_5,
                                               panel_6, panel_7, panel_8, panel_9, panel_10};

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
