// What the one-token kernels (token_gemv.cu, token_norm.cu) share: 16-bit values of the activations' dtype (BF16:
// bfloat16, else float16) as float and back, and plain loads of what the kernel before wrote. NVRTC finds this file
// through the include path that engine.kernels.nvrtc.compile_cubin gives it.
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
