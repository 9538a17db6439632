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

__device__ __forceinline__ u32 pack(float a, float b) { return (u32)round16(a) | ((u32)round16(b) << 16); }

__device__ __forceinline__ uint4 ld16(const void* p) {  // 16 bytes the kernel before wrote
  return ld_after_wait(static_cast<const uint4*>(p));
}

__device__ __forceinline__ void unpack(const uint4& v, float* f) {  // 8 16-bit values
  const u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = lo16(u[i]);
    f[2 * i + 1] = hi16(u[i]);
  }
}

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
#if PARTS == 1
    unpack(ld16(static_cast<const u16*>(x) + row * N + c), xf[v]);
#else
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < PARTS; ++j) {
#if X_F32
      const float* p = static_cast<const float*>(x) + (row * PARTS + j) * N + c;
      const uint4 a = ld16(p), b = ld16(p + 4);
      const u32 u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += __uint_as_float(u[i]);
#else
      float f[8];
      unpack(ld16(static_cast<const u16*>(x) + (row * PARTS + j) * N + c), f);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += f[i];
#endif
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) xf[v][i] = lo16(round16(s[i]));  // rounded once to the residual's dtype
#endif
#if HAS_RES
    float r[8];
    unpack(ld16(res + row * N + c), r);
#pragma unroll
    for (int i = 0; i < 8; ++i) xf[v][i] = lo16(round16(r[i] + xf[v][i]));
    *reinterpret_cast<uint4*>(res_out + row * N + c) =
        make_uint4(pack(xf[v][0], xf[v][1]), pack(xf[v][2], xf[v][3]), pack(xf[v][4], xf[v][5]),
                   pack(xf[v][6], xf[v][7]));
#endif
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(xf[v][i], xf[v][i], ss);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL, ss, o);
  if ((t & 31) == 0) partial[t >> 5] = ss;
  __syncthreads();
  float total = 0.f;  // every thread adds the warps' sums in the same order
#pragma unroll
  for (int i = 0; i < WARPS; ++i) total += partial[i];
  const float inv = rsqrtf(total * (1.f / N) + eps);
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    float wf[8], y[8];
    unpack(wv[v], wf);
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = wf[i] * lo16(round16(xf[v][i] * inv));
    const long long c = (long long)(v * THREADS + t) * 8;
    *reinterpret_cast<uint4*>(out + row * N + c) =
        make_uint4(pack(y[0], y[1]), pack(y[2], y[3]), pack(y[4], y[5]), pack(y[6], y[7]));
  }
}
