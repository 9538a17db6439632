// What the one-token kernels (token_gemv.cu, token_norm.cu) share: 16-bit values of the activations' dtype (BF16:
// bfloat16, else float16) as float and back, plain loads of what the kernel before wrote, and the pieces of an RMS norm
// (the residual stream's update, the block's sum, the output's roundings). NVRTC finds this file through the include
// path that engine.kernels.nvrtc.compile_cubin gives it.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;

#define FULL 0xffffffffu

__device__ __forceinline__ float lo16(u32 w) {  // the low 16-bit value of w (BF16 or fp16) as float
#if BF16
  return __int_as_float(w << 16);
#else
  float r;
  asm("{ .reg .b16 a, b; mov.b32 {a, b}, %1; cvt.f32.f16 %0, a; }" : "=f"(r) : "r"(w));
  return r;
#endif
}

__device__ __forceinline__ float hi16(u32 w) {
#if BF16
  return __int_as_float(w & 0xffff0000u);
#else
  float r;
  asm("{ .reg .b16 a, b; mov.b32 {a, b}, %1; cvt.f32.f16 %0, b; }" : "=f"(r) : "r"(w));
  return r;
#endif
}

__device__ __forceinline__ u16 round16(float x) {  // to the activations' dtype, round to nearest even
  u16 r;
#if BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
#endif
  return r;
}

__device__ __forceinline__ float rounded(float x) {  // x rounded to the activations' dtype, as float
  const u32 r = round16(x);
  return lo16(r);
}

// What the kernel before wrote, read after the wait with plain ld.global, never through the read-only path (ld.global.nc,
// whose loads ptxas may move above the wait); volatile, so that the compiler keeps them after the wait's asm too.
__device__ __forceinline__ long long ld_after_wait(const long long* p) {
  long long r;
  asm volatile("ld.global.s64 %0, [%1];" : "=l"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ float ld_after_wait(const float* p) {
  float r;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ u16 ld_after_wait(const u16* p) {
  u16 r;
  asm volatile("ld.global.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ uint4 ld_after_wait(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint4 ld16(const void* p) {  // 16 bytes the kernel before wrote
  return ld_after_wait(static_cast<const uint4*>(p));
}

__device__ __forceinline__ u32 pack(float a, float b) { return (u32)round16(a) | ((u32)round16(b) << 16); }

__device__ __forceinline__ uint4 pack8(const float* f) {  // 8 values, rounded to the activations' dtype
  return make_uint4(pack(f[0], f[1]), pack(f[2], f[3]), pack(f[4], f[5]), pack(f[6], f[7]));
}

__device__ __forceinline__ void unpack(const uint4& v, float* f) {  // 8 16-bit values
  const u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = lo16(u[i]);
    f[2 * i + 1] = hi16(u[i]);
  }
}

// The 8 values from column c of a row of Cols that an RMS norm normalises: x's (x [rows, Parts, Cols], the parts
// 16-bit or float32 with XFloat, summed in float32 and rounded once to the activations' dtype), plus the residual's
// with AddRes, rounded again: the unfused ops' roundings (triton_ops._rms_norm_kernel's). Read after the wait.
template <int Cols, int Parts, bool XFloat, bool AddRes>
__device__ __forceinline__ void stream_chunk(const void* x, const u16* res, long long row, long long c, float* xf) {
  if constexpr (Parts == 1) {
    unpack(ld16(static_cast<const u16*>(x) + row * Cols + c), xf);
  } else {
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < Parts; ++j) {
      if constexpr (XFloat) {
        const float* p = static_cast<const float*>(x) + (row * Parts + j) * Cols + c;
        const uint4 a = ld16(p), b = ld16(p + 4);
        const u32 u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] += __uint_as_float(u[i]);
      } else {
        float f[8];
        unpack(ld16(static_cast<const u16*>(x) + (row * Parts + j) * Cols + c), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] += f[i];
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) xf[i] = rounded(s[i]);  // rounded once to the residual's dtype
  }
  if constexpr (AddRes) {
    float r[8];
    unpack(ld16(res + row * Cols + c), r);
#pragma unroll
    for (int i = 0; i < 8; ++i) xf[i] = rounded(r[i] + xf[i]);
  }
}

// The sum of every thread's v over a block of Warps warps, the same in every thread (the warps' sums added in order);
// partial: Warps floats of shared memory.
template <int Warps>
__device__ __forceinline__ float block_sum(float v, float* partial) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < Warps; ++i) total += partial[i];
  return total;
}

// A chunk of the norm's output: weight w times the stream's values xf scaled by inv, each product's factor rounded
// first, as the unfused ops round.
__device__ __forceinline__ uint4 normed_chunk(const uint4& w, const float* xf, float inv) {
  float wf[8], y[8];
  unpack(w, wf);
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = wf[i] * rounded(xf[i] * inv);
  return pack8(y);
}
