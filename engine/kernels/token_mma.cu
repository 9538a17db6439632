// One token's linear layer with e4m3 weights (a float32 scale per output channel, an optional bias; or SwiGLU of a
// fused gate/up weight) on the tensor cores: y = x W^T, where token_gemv.cu does the same on the CUDA cores.
//
// Why: an e4m3 byte there costs about four instructions (its widening to f16, that to float32, the product, x's
// unpacking), twice a 16-bit weight's per byte, and its launches stream the weight well below the rate 16-bit ones
// reach. Here a lane widens its weight bytes to f16 pairs (one instruction a pair), which go as they are into an MMA's
// A fragment; x is the B fragment; the MMA does the products and the sums. A lane's bytes are consecutive in the row,
// where the MMA's layout wants every lane's A values at fixed k slots, but a dot product does not care in which order
// it meets its k: each lane takes B's values at the same positions of x as its A values, so every slot pairs a weight
// with its own x.
//
// mma.m16n8k16 (f16 in, float32 sums): lane t is in group g = t / 4 with q = t % 4; it holds A rows g and g + 8 at k
// slots 2q, 2q + 1, 2q + 8, 2q + 9, B column g at the same slots, and the sums of rows g and g + 8 in columns 2q,
// 2q + 1. A warp's step takes 16 bytes a lane of two A rows: 4 MMAs, the lane's four 32-bit words in turn (bytes 4i,
// 4i + 1 at slots 2q, 2q + 1; 4i + 2, 4i + 3 at 2q + 8, 2q + 9).
// - A linear layer: a block owns 8 output rows, A row g + 8 is row g's next 64 bytes, and B column 1 holds the x of
//   those (column 0, of A row g's): row g's sum is column 0 of row g plus column 1 of row g + 8 (lane 4g's first and
//   last sum). A step covers 128 bytes of 8 rows.
// - SwiGLU: A row g is gate row g, row g + 8 its up row, both against column 0's x: 64 bytes of 8 gate/up pairs.
// The columns past the first one or two are never read; their lanes load some x all the same (no branch).
// A block's WARPS warps take a row's steps in turn (warp w steps w, w + WARPS, ...: the block reads 1 KB of a row at
// a time); each keeps UNROLL steps in flight (a step's slot asks for the step UNROLL further once its MMAs have
// taken it), the first UNROLL asked for before the PDL wait (no kernel writes a
// weight; plain loads, which the fence holds the wait behind: token_gemv.cu's PIN), then the warps' sums meet in
// shared memory and lanes 0-7 of warp 0 finish the rows with token_gemv.cu's roundings.
//
// x is staged in shared memory as f16, which e4m3 widens to exactly. With BF16 (x bfloat16) each value is scaled by
// 2^-8 first and the sums by 2^8 after: f16 then holds every bfloat16 of magnitude 2^-9 to 1.6e7 exactly (bfloat16
// has 8 significant bits, f16 11), where unscaled it would overflow past 65,504; smaller ones are rounded to a
// multiple of 2^-16. fp16 x is taken as it is.
//
// Compile-time: K, BF16, WARPS, UNROLL, SWIGLU, HAS_SCALE, HAS_BIAS, PDL; with PDL, EARLY (the next kernel let in
// first thing, else once the block has left its loop). tests/engine/test_token_mma_sass.py checks the order around
// the wait in the SASS.
#ifndef EARLY
#define EARLY 1
#endif

#include "token_common.cuh"

#define STEP (SWIGLU ? 64 : 128)  // a row's bytes that a warp's step covers
#define STEPS_PER_WARP (K / STEP / WARPS)
#define X_SCALE (BF16 ? 256.f : 1.f)  // what the sums are multiplied by (x was staged times 1 / X_SCALE)

static_assert(K % (STEP * WARPS) == 0, "whole steps for every warp");
static_assert(STEPS_PER_WARP % UNROLL == 0, "whole runs of UNROLL steps");

__device__ __forceinline__ u32 widen_lo(u32 v) {  // the low two e4m3 bytes of v as an f16 pair
  u32 r;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ u32 widen_hi(u32 v) {
  u32 r;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ uint4 ld_first(const unsigned char* p) {  // read once; a plain load, which a fence orders
  uint4 r;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ uint4 ld_stream(const unsigned char* p) {  // read once: do not keep in L1
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One step: the lane's 16 bytes of A rows g (lo) and g + 8 (hi) against its 16 x values (two 16-byte halves).
__device__ __forceinline__ void step(float (&c)[4], const uint4& lo, const uint4& hi, const uint4& x0,
                                     const uint4& x1) {
  const u32 a[4] = {lo.x, lo.y, lo.z, lo.w}, b[4] = {hi.x, hi.y, hi.z, hi.w};
  const u32 xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    mma(c, widen_lo(a[i]), widen_lo(b[i]), widen_hi(a[i]), widen_hi(b[i]), xv[2 * i], xv[2 * i + 1]);
}

__device__ __forceinline__ u32 to_f16x2(float a, float b) {  // two floats as an f16 pair, round to nearest even
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(a), "f"(b));
  return r;
}

// x [K] 16-bit; w [N_total, K] e4m3, rows stride_w bytes apart; scale [N_total] float32; bias [N] 16-bit; out [N].
extern "C" __global__ void __launch_bounds__(32 * WARPS)
    token_mma(const u16* __restrict__ x, const unsigned char* __restrict__ w, const float* __restrict__ scale,
              const u16* __restrict__ bias, u16* __restrict__ out, int n, long long stride_w) {
  __shared__ __align__(16) u16 xs[K];
  __shared__ float sums[WARPS][2][8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#if PDL && EARLY
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  const int row = min(blockIdx.x * 8 + g, n - 1);  // a last block's rows past n read row n - 1 and store nothing
  const unsigned char* lo = w + row * stride_w + q * 16 + warp * STEP;
  const unsigned char* hi = SWIGLU ? lo + (long long)n * stride_w : lo + 64;
  // The lane's x: 16 values at the same positions of a step as its A bytes (column g: g odd, row g + 8's half).
  const int xoff = (SWIGLU ? 0 : (g & 1) * 64) + q * 16 + warp * STEP;
  uint4 buf[UNROLL][2];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    buf[u][0] = ld_first(lo + u * WARPS * STEP);
    buf[u][1] = ld_first(hi + u * WARPS * STEP);
  }
#if PDL
  asm volatile("membar.cta;" ::: "memory");  // keeps the wait behind the first steps (token_gemv.cu's PIN)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#pragma unroll
  for (int j = 0; j < (K / 8 + 32 * WARPS - 1) / (32 * WARPS); ++j) {  // 8 values a thread at a time
    const int i = j * 32 * WARPS + threadIdx.x;
    if (K / 8 % (32 * WARPS) != 0 && i >= K / 8) break;
    const uint4 v = ld_after_wait(reinterpret_cast<const uint4*>(x) + i);
#if BF16
    const u32 u[4] = {v.x, v.y, v.z, v.w};
    u32 h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = to_f16x2(lo16(u[j]) * (1.f / X_SCALE), hi16(u[j]) * (1.f / X_SCALE));
    reinterpret_cast<uint4*>(xs)[i] = make_uint4(h[0], h[1], h[2], h[3]);
#else
    reinterpret_cast<uint4*>(xs)[i] = v;
#endif
  }
  __syncthreads();
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s = 0; s < STEPS_PER_WARP; ++s) {  // step s from slot s % UNROLL, which then asks for step s + UNROLL
    const int u = s % UNROLL;
    const uint4* xv = reinterpret_cast<const uint4*>(xs + xoff + s * WARPS * STEP);
    step(c, buf[u][0], buf[u][1], xv[0], xv[1]);
    if (s + UNROLL < STEPS_PER_WARP) {
      buf[u][0] = ld_stream(lo + (s + UNROLL) * WARPS * STEP);
      buf[u][1] = ld_stream(hi + (s + UNROLL) * WARPS * STEP);
    }
  }
#if PDL && !EARLY
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  if (q == 0) {  // lane 4g: row g's column 0 (c[0]) and row g + 8's column 1 (c[3]), or with SwiGLU column 0 (c[2])
    sums[warp][0][g] = c[0];
    sums[warp][1][g] = SWIGLU ? c[2] : c[3];
  }
  __syncthreads();
  if (threadIdx.x < 8) {
    const int r = blockIdx.x * 8 + threadIdx.x;
    float y = 0.f, up = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) {
      if (SWIGLU) {
        y += sums[v][0][threadIdx.x];
        up += sums[v][1][threadIdx.x];
      } else {
        y += sums[v][0][threadIdx.x] + sums[v][1][threadIdx.x];
      }
    }
    if (r < n) {
      y *= X_SCALE;
      up *= X_SCALE;
      if (HAS_SCALE) {
        y *= __ldg(scale + r);
        if (SWIGLU) up *= __ldg(scale + n + r);
      }
      if (HAS_BIAS) y += lo16(__ldg(bias + r));
      if (SWIGLU) {
        // The unfused ops' roundings: each matmul's output, then the activation, in the activations' dtype.
        const float gate = rounded(y);
        y = rounded(gate / (1.f + expf(-gate))) * rounded(up);
      }
      out[r] = round16(y);
    }
  }
}
