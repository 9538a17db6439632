// RMS norm of a decode step's rows, with the residual add before it: out = w * rmsnorm(res + x), res_out = res + x,
// each rounded to the activations' dtype as the unfused ops round (triton_ops._rms_norm_kernel's numerics).
//
// A block a row, THREADS threads, VEC 16-byte chunks (8 values) of the row a thread. Under PDL the kernel's blocks
// are placed while the kernel before still runs: the norm's weight (no kernel writes it) is asked for before the
// wait, and a CTA-scope fence keeps the wait behind those loads in the compiled code (ptxas otherwise schedules a
// bare griddepcontrol.wait first; token_gemv.cu's header). What the kernel before wrote (x, the residual) is read
// after the wait with plain ld.global, never through the read-only path, which ptxas may move above it.
// tests/engine/test_token_gemv_sass.py checks both in the SASS.
//
// Compile-time: N (columns), VEC, THREADS (N / (8 * VEC)), BF16 (bfloat16, else float16), HAS_RES, PARTS (x is
// [rows, PARTS, N], summed in float32 and rounded once to the residual's dtype before the add), X_F32 (those parts
// float32, else the activations' dtype), PDL, PIN, EARLY (let the next kernel launch first thing).
#ifndef PIN
#define PIN 0
#endif
#ifndef EARLY
#define EARLY 0
#endif

#include "token_common.cuh"

#define WARPS (THREADS / 32)

static_assert(N == 8 * VEC * THREADS, "whole 16-byte chunks for every thread");
static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
static_assert(PARTS == 1 || HAS_RES, "parts are summed only before a residual add");
static_assert(!X_F32 || PARTS > 1, "float32 x only as parts");

// x [rows, PARTS, N] (16-bit or float32 parts); res, out, res_out [rows, N] 16-bit; w [N] 16-bit.
extern "C" __global__ void __launch_bounds__(THREADS) token_norm(const void* __restrict__ x,
                                                                const u16* __restrict__ res,
                                                                const u16* __restrict__ w, u16* __restrict__ out,
                                                                u16* __restrict__ res_out, float eps) {
  __shared__ float partial[WARPS];
  const long long row = blockIdx.x;
  const int t = threadIdx.x;
#if PDL && EARLY
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  uint4 wv[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) wv[v] = __ldg(reinterpret_cast<const uint4*>(w) + v * THREADS + t);
#if PDL
#if PIN
  asm volatile("membar.cta;" ::: "memory");  // keeps the wait behind the weight's loads (the header)
#endif
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  float xf[VEC][8];
  float ss = 0.f;
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const long long c = (long long)(v * THREADS + t) * 8;  // this chunk's first column
    stream_chunk<N, PARTS, (bool)X_F32, (bool)HAS_RES>(x, res, row, c, xf[v]);
#if HAS_RES
    *reinterpret_cast<uint4*>(res_out + row * N + c) = pack8(xf[v]);
#endif
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(xf[v][i], xf[v][i], ss);
  }
  const float inv = rsqrtf(block_sum<WARPS>(ss, partial) * (1.f / N) + eps);
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const long long c = (long long)(v * THREADS + t) * 8;
    *reinterpret_cast<uint4*>(out + row * N + c) = normed_chunk(wv[v], xf[v], inv);
  }
}
