// One token's linear layer, y = x W^T (times a per-channel scale, plus a bias; or SwiGLU of a fused gate/up weight),
// on the CUDA cores: a decode step at batch 1 reads each weight once, so its speed is the weight's stream from HBM.
//
// A block of WARPS warps owns ROWS_PER_WARP * WARPS output channels, each warp ROWS_PER_WARP of them (with SWIGLU,
// those gate rows and the matching up rows N' further). Lane l reads 16-byte chunks l, l + 32, ... of each of its
// rows, UNROLL chunks a row at a time in flight. The first chunks are requested before the wait for the kernel
// before (programmatic dependent launch: no kernel writes a weight), then x, which that kernel wrote, is staged in
// shared memory. Products and sums are float32; each row's sum is reduced across the warp once.
//
// The order around the wait is ptxas's to keep, and it keeps only part of it. A bare griddepcontrol.wait has no
// inputs, and ptxas schedules it first, above the weight loads; with PIN a CTA-scope fence after those loads holds it
// behind them. Loads through the read-only path (ld.global.nc, __ldg) may be moved above the wait, so what the kernel
// before wrote (x, the routing's ids and weights) is read with plain ld.global, which stays after it. Read-only loads
// may also be moved below the fence and the wait: with NORM, whose code after the wait is long, ptxas sank every one
// of them there, so NORM launches ask for their first chunks and the norm's weight with plain loads, which the fence
// keeps in front of it. So do STAGE launches (ptxas sank their first chunks when x's staging was unrolled).
// tests/engine/test_token_gemv_sass.py checks all of it in the SASS of every variant.
//
// Compile-time: K (columns), WBYTES (1: e4m3, 2: 16-bit of the activations' kind), BF16 (activations and output
// bfloat16, else float16), WARPS, ROWS_PER_WARP, UNROLL, SWIGLU, HAS_SCALE, HAS_BIAS, PDL; with PDL, PIN (above) and
// EARLY, which lets the next kernel launch first thing, else once this block has left its loop.
//
// STAGE: the next STAGE runs of every row (after the first, which goes to registers) are asked for before the wait as
// well, into shared memory (cp.async, 16 bytes a copy, one slot a thread, no registers held), and read from there in
// the loop: under PDL a block placed while the kernel before still runs (an attention that lets the next kernels in
// first thing) then streams more of its weight in that time. Linear layers only (not experts: their weight is known
// after the wait; not a router), without SwiGLU (its two rows' first runs already take the registers of a thread).
//
// XF32 (e4m3 weights; an A/B knob, token_gemv.X_F32): x staged as float32, so the loop does not widen x's 16-bit
// values for every row, 16 fewer instructions a chunk of 16 weights. A lane's chunk of 16 values is read as four
// float4s, and x is laid out so that each of those is one 512-byte row across the warp (value k at float4
// ((k / 512 * 4 + k % 16 / 4) * 32 + k / 16 % 32), lane k / 16 % 32's): no bank conflict. The twentieth round staged
// float32 x in order, a 16-way conflict, and lost a third. The products and their order are the same as with 16-bit x.
//
// NORM (with ROUTER only): x is not the router's input but what a residual add and RMS norm take (token_norm.cu's op,
// folded in: one launch fewer). x may be NORM_PARTS parts [NORM_PARTS, K] (float32 with NORM_F32), summed and rounded
// once before the add. Every block computes the norm itself (x and the residual are 2 x K x 2 bytes, from L2) and
// stages it in x's place; the norm's weight is asked for before the wait. Block 0 stores the residual stream
// (res_out) and the norm (normed), which the MoE layer's experts read. The same fold into a linear layer's launch
// measured slower and was taken out (docs/engine.md, twenty-first round).
//
// EXPERTS: one token's routed experts of a MoE layer, blockIdx.y the (token, expert) pair: its weight is expert
// ids[pair] of a stack (expert_stride bytes apart), its x row pair * x_stride, its output row pair. The expert is
// only known after the wait (the routing kernel wrote it), so nothing is requested before it. ROUTED: the output,
// rounded to the activations' dtype, times the pair's routing weight (float32 with ROUTE_F32, else 16-bit), rounded
// once more, as the torch reference does.
//
// ROUTER (the number of experts a token takes, top_k): a MoE layer's router and its routing in one launch. The
// n = E logits, each rounded to the activations' dtype as the router's own output would be, go to float32 scratch;
// the last block to finish (a counter it resets for the next launch) takes the softmax over the E experts in
// float32, the top_k largest (ties to the lower id), divided by their sum (added in selection order) with RENORM,
// and stores them (float32 with ROUTE_F32, else the activations' dtype) and their ids (int64).
#ifndef EXPERTS
#define EXPERTS 0
#endif
#ifndef ROUTER
#define ROUTER 0
#endif
#ifndef RENORM
#define RENORM 1
#endif
#ifndef ROUTED
#define ROUTED 0
#endif
#ifndef ROUTE_F32
#define ROUTE_F32 1
#endif
#ifndef EARLY
#define EARLY 0
#endif
#ifndef PIN
#define PIN 0
#endif
#ifndef STAGE
#define STAGE 0
#endif
#ifndef NORM
#define NORM 0
#endif
#ifndef NORM_PARTS
#define NORM_PARTS 1
#endif
#ifndef NORM_F32
#define NORM_F32 0
#endif
#ifndef XF32
#define XF32 0
#endif

#include "token_common.cuh"

#define CHUNK_VALUES (16 / WBYTES)
#define CHUNKS_PER_ROW (K / CHUNK_VALUES)
#define CHUNKS_PER_LANE (CHUNKS_PER_ROW / 32)
#define ROWS (SWIGLU ? 2 * ROWS_PER_WARP : ROWS_PER_WARP)

static_assert(K % (32 * CHUNK_VALUES) == 0, "whole 16-byte chunks for every lane");
static_assert(CHUNKS_PER_LANE % UNROLL == 0, "whole runs of UNROLL chunks");
static_assert(!NORM || (K / 8) % (32 * WARPS) == 0, "the norm: whole 16-byte chunks for every thread");
static_assert(!NORM || ROUTER, "the norm before a router only");
static_assert((NORM_PARTS == 1 && !NORM_F32) || NORM, "parts only before the norm");
static_assert(!NORM_F32 || NORM_PARTS > 1, "float32 x only as parts");
static_assert(!STAGE || (!EXPERTS && !ROUTER && !SWIGLU), "runs staged before the wait: a linear layer's weight");
static_assert((STAGE + 1) * UNROLL <= CHUNKS_PER_LANE, "staged runs within the row");
static_assert(!XF32 || (WBYTES == 1 && !NORM && !STAGE && K * 4 <= 32768), "float32 x: e4m3 rows, in 32 KB");
#define XS_WORDS (XF32 ? K : K / 2)  // x in shared memory, 32-bit words

__device__ __forceinline__ u32 e4m3x2_lo(u32 v) {  // the low two e4m3 bytes of v as f16x2
  u32 r;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ u32 e4m3x2_hi(u32 v) {
  u32 r;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ void f16x2_to_f32(u32 h, float& a, float& b) {
  asm("{ .reg .b16 x, y; mov.b32 {x, y}, %2; cvt.f32.f16 %0, x; cvt.f32.f16 %1, y; }" : "=f"(a), "=f"(b) : "r"(h));
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

__device__ __forceinline__ void stage16(unsigned dst, const unsigned char* p) {  // 16 bytes to shared memory, async
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(p) : "memory");
}

// x's 16 bytes at chunk i (8 values, 8i ..), as the kernel before wrote them, to shared memory: as they are, or (XF32)
// widened to float32 at their two float4 slots.
__device__ __forceinline__ void stage_x(u32* __restrict__ xs, int i, const uint4& v) {
#if XF32
  float4* const xf = reinterpret_cast<float4*>(xs);
  const int at = ((i >> 6) * 4 + (i & 1) * 2) * 32 + ((i >> 1) & 31);  // values 8i .. 8i + 3; 8i + 4 .. one row on
  xf[at] = make_float4(lo16(v.x), hi16(v.x), lo16(v.y), hi16(v.y));
  xf[at + 32] = make_float4(lo16(v.z), hi16(v.z), lo16(v.w), hi16(v.w));
#else
  reinterpret_cast<uint4*>(xs)[i] = v;
#endif
}

// acc += the chunk's 16 / WBYTES weights times x's values: the lane's chunk c of its row, values (32c + lane) * 16 /
// WBYTES on.
__device__ __forceinline__ float dot_chunk(const uint4& w, const u32* __restrict__ xs, int c, int lane) {
  float acc = 0.f;
#if WBYTES == 1
  const u32 ws[4] = {w.x, w.y, w.z, w.w};
#if XF32
  const float4* xf = reinterpret_cast<const float4*>(xs) + c * 128 + lane;  // 4 float4s, 32 apart
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 x = xf[32 * i];  // values 4i .. 4i + 3 of the chunk
    float a, b, cc, d;
    f16x2_to_f32(e4m3x2_lo(ws[i]), a, b);
    f16x2_to_f32(e4m3x2_hi(ws[i]), cc, d);
    acc = fmaf(a, x.x, acc);
    acc = fmaf(b, x.y, acc);
    acc = fmaf(cc, x.z, acc);
    acc = fmaf(d, x.w, acc);
  }
#else
  const uint4* xv = reinterpret_cast<const uint4*>(xs) + (c * 32 + lane) * 2;  // x in shared memory, 16-bit pairs
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 x = xv[i];  // 8 values (lanes 32 bytes apart: lanes l and l + 4 of a quarter warp share banks)
    const u32 xw[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float a, b, cc, d;
      f16x2_to_f32(e4m3x2_lo(ws[2 * i + j]), a, b);
      f16x2_to_f32(e4m3x2_hi(ws[2 * i + j]), cc, d);
      acc = fmaf(a, lo16(xw[2 * j]), acc);
      acc = fmaf(b, hi16(xw[2 * j]), acc);
      acc = fmaf(cc, lo16(xw[2 * j + 1]), acc);
      acc = fmaf(d, hi16(xw[2 * j + 1]), acc);
    }
  }
#endif
#else
  const uint4 x = reinterpret_cast<const uint4*>(xs)[c * 32 + lane];
  acc = fmaf(lo16(w.x), lo16(x.x), acc);
  acc = fmaf(hi16(w.x), hi16(x.x), acc);
  acc = fmaf(lo16(w.y), lo16(x.y), acc);
  acc = fmaf(hi16(w.y), hi16(x.y), acc);
  acc = fmaf(lo16(w.z), lo16(x.z), acc);
  acc = fmaf(hi16(w.z), hi16(x.z), acc);
  acc = fmaf(lo16(w.w), lo16(x.w), acc);
  acc = fmaf(hi16(w.w), hi16(x.w), acc);
#endif
  return acc;
}

#if ROUTER
static_assert(ROUTER <= 32 && ROUTER <= ROUTER_E, "a lane a pick");
// The count before an atomic add of one at p, ordered after what this thread (and, after a barrier, its block)
// stored and before what it loads next (release and acquire at the GPU's scope): no fence in every thread.
__device__ __forceinline__ unsigned count_in(unsigned* p) {
  unsigned old;
  asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  return old;
}

// The routing of ROUTER's header, by warp 0 of the grid's last block once every block's logits are stored: once a
// block's stores are done (a barrier), its thread 0 counts it; the last count also orders the other blocks' logits
// before this block's loads (after a second barrier, past L1), and that block resets the counter for the next launch.
__device__ __forceinline__ void route_last_block(const float* logits, unsigned int* counter, int n, void* weights_out,
                                                 long long* ids_out) {
  __shared__ bool last;
  __syncthreads();  // this block's logits, before its count
  if (threadIdx.x == 0) {
    last = count_in(counter) == gridDim.x - 1;
    if (last) *counter = 0u;  // every block has counted: ready for the next launch
  }
  __syncthreads();  // the other blocks' logits (thread 0 acquired them), before this block's loads
  if (!last || threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  constexpr int PER_LANE = (ROUTER_E + 31) / 32;
  float p[PER_LANE];
  float top = __int_as_float(0xff800000);
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = i * 32 + lane;
    p[i] = e < n ? __ldcg(logits + e) : __int_as_float(0xff800000);
    top = fmaxf(top, p[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(FULL, top, o));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    p[i] = i * 32 + lane < n ? expf(p[i] - top) : 0.f;
    sum += p[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL, sum, o);
  // A key a pick: a probability (>= 0, so its bits order as it does) above the complement of its id, so the largest
  // key is the largest probability, ties to the lower id; taken experts and lanes past n hold 0 (below every key).
  unsigned long long key[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = i * 32 + lane;
    const unsigned long long bits = __float_as_uint(__fdiv_rn(p[i], sum));
    key[i] = e < n ? (bits << 32) | (0xffffffffu - (unsigned)e) : 0ull;
  }
  float picked = 0.f, total = 0.f;  // lane k keeps pick k
  int picked_id = 0;
  for (int k = 0; k < ROUTER; ++k) {
    unsigned long long best = 0ull;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) best = key[i] > best ? key[i] : best;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long other = __shfl_xor_sync(FULL, best, o);
      best = other > best ? other : best;
    }
    const int id = (int)(0xffffffffu - (unsigned)(best & 0xffffffffull));
    const float w = __uint_as_float((unsigned)(best >> 32));
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (i * 32 + lane == id) key[i] = 0ull;
    total += w;
    if (lane == k) {
      picked = w;
      picked_id = id;
    }
  }
  if (lane < ROUTER) {
    const float w = RENORM ? __fdiv_rn(picked, total) : picked;
#if ROUTE_F32
    static_cast<float*>(weights_out)[lane] = w;
#else
    static_cast<u16*>(weights_out)[lane] = round16(w);
#endif
    ids_out[lane] = picked_id;
  }
}
#endif

// x [K] 16-bit (with NORM: [NORM_PARTS, K], float32 parts with NORM_F32); w [N_total, K] row stride stride_w bytes;
// out [N]; scale/bias [N_total] (scale float32); with NORM, the residual res [K], the norm's weight nw [K], res_out [K]
// (res + x), eps and normed [K].
// MIN_BLOCKS (STAGE launches the host bounds, else 0: none): blocks an SM must hold at once, which bounds the
// registers a thread. ptxas gave the staged o projection of qwen3-8b 70 registers where the unstaged one has 64, so
// that 7 of its 1,024 blocks would fit an SM, not 8 (token_gemv.stage_bounds).
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0
#endif
static_assert(!MIN_BLOCKS || STAGE || XF32, "a bound on the registers: staged launches, float32 x");
#if MIN_BLOCKS
#define BOUNDS __launch_bounds__(32 * WARPS, MIN_BLOCKS)
#else
#define BOUNDS __launch_bounds__(32 * WARPS)
#endif

extern "C" __global__ void BOUNDS token_gemv(const u16* __restrict__ x, const unsigned char* __restrict__ w,
                                             const float* __restrict__ scale, const u16* __restrict__ bias,
                                             u16* __restrict__ out, int n, long long stride_w,
                                             const long long* __restrict__ ids, const void* __restrict__ route_w,
                                             long long expert_stride, int x_stride, float* __restrict__ logits,
                                             unsigned int* __restrict__ counter, void* __restrict__ weights_out,
                                             long long* __restrict__ ids_out, const u16* __restrict__ res,
                                             const u16* __restrict__ nw, u16* __restrict__ res_out, float eps,
                                             u16* __restrict__ normed) {
  __shared__ __align__(16) u32 xs[XS_WORDS];
#if STAGE  // run s + 1's chunk u of row r, thread t: [s][r][u][t] (a warp's 16-byte slots in a row: no bank conflict)
  __shared__ __align__(16) uint4 ahead[STAGE * ROWS * UNROLL * 32 * WARPS];
#endif
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#if PDL && EARLY
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
#if EXPERTS
#if PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int pair = blockIdx.y;
  w += ld_after_wait(ids + pair) * expert_stride;
  x += (long long)pair * x_stride;
  out += (long long)pair * n;
#if ROUTED  // asked for now: its round trip overlaps the weight's stream, not the stores after it
#if ROUTE_F32
  const float rw = ld_after_wait(static_cast<const float*>(route_w) + pair);
#else
  const float rw = lo16(ld_after_wait(static_cast<const u16*>(route_w) + pair));
#endif
#endif
#endif
  const int row0 = (blockIdx.x * WARPS + warp) * ROWS_PER_WARP;
  const unsigned char* rows[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    int row = row0 + (r % ROWS_PER_WARP);
    row = min(row, n - 1);  // a last warp's rows past n read row n - 1 and store nothing
    if (SWIGLU && r >= ROWS_PER_WARP) row += n;
    rows[r] = w + row * stride_w + lane * 16;
  }
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#if STAGE
  {  // first, while few registers are live: this thread's first slot's shared-memory address, the others at offsets
    const unsigned slot0 = static_cast<unsigned>(__cvta_generic_to_shared(&ahead[threadIdx.x]));
#pragma unroll
    for (int s = 0; s < STAGE; ++s)
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
          stage16(slot0 + ((s * ROWS + r) * UNROLL + u) * 32 * WARPS * 16, rows[r] + ((s + 1) * UNROLL + u) * 512);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
#endif
  uint4 buf[ROWS][UNROLL];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)  // with NORM or STAGE plain loads (the header)
      buf[r][u] = NORM || STAGE ? ld_first(rows[r] + u * 512) : ld_stream(rows[r] + u * 512);
#if NORM
  constexpr int NORM_CHUNKS = K / 8 / (32 * WARPS);  // a thread's 16-byte chunks of the norm
  uint4 wn[NORM_CHUNKS];
#pragma unroll
  for (int j = 0; j < NORM_CHUNKS; ++j)
    wn[j] = ld_first(reinterpret_cast<const unsigned char*>(nw) + (j * 32 * WARPS + threadIdx.x) * 16);
#endif
#if PDL && !EXPERTS
#if PIN
  asm volatile("membar.cta;" ::: "memory");  // keeps the wait behind the first chunks (the header)
#endif
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if NORM
  {  // the stream's values staged (exact: they are 16-bit), then normalised in place, each thread its own chunks
    __shared__ float partial[WARPS];
    uint4* const staged = reinterpret_cast<uint4*>(xs);
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_CHUNKS; ++j) {
      const int i = j * 32 * WARPS + threadIdx.x;
      float xf[8];
      stream_chunk<K, NORM_PARTS, (bool)NORM_F32, true>(x, res, 0, i * 8, xf);
      const uint4 packed = pack8(xf);
      if (blockIdx.x == 0) reinterpret_cast<uint4*>(res_out)[i] = packed;
      staged[i] = packed;
#pragma unroll
      for (int v = 0; v < 8; ++v) ss = fmaf(xf[v], xf[v], ss);
    }
    const float inv = rsqrtf(block_sum<WARPS>(ss, partial) * (1.f / K) + eps);
#pragma unroll
    for (int j = 0; j < NORM_CHUNKS; ++j) {
      const int i = j * 32 * WARPS + threadIdx.x;
      float xf[8];
      unpack(staged[i], xf);
      const uint4 y = normed_chunk(wn[j], xf, inv);
      staged[i] = y;
      if (blockIdx.x == 0) reinterpret_cast<uint4*>(normed)[i] = y;
    }
  }
#elif STAGE && (K / 8) % (32 * WARPS) == 0  // whole chunks a thread: unrolled, in the registers the stage leaves
#pragma unroll
  for (int j = 0; j < K / 8 / (32 * WARPS); ++j) {
    const int i = j * 32 * WARPS + threadIdx.x;
    stage_x(xs, i, ld_after_wait(reinterpret_cast<const uint4*>(x) + i));
  }
#else
  for (int i = threadIdx.x; i < K / 8; i += 32 * WARPS)
    stage_x(xs, i, ld_after_wait(reinterpret_cast<const uint4*>(x) + i));
#endif
  __syncthreads();
#pragma unroll
  for (int c0 = 0; c0 < CHUNKS_PER_LANE; c0 += UNROLL) {
    const int run = c0 / UNROLL;
#if STAGE
    if (run > 0 && run <= STAGE) {  // staged before the wait: this thread's own slots, once its copies have landed
      if (run == 1) asm volatile("cp.async.wait_all;" ::: "memory");
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
          buf[r][u] = ahead[(((run - 1) * ROWS + r) * UNROLL + u) * 32 * WARPS + threadIdx.x];
    } else
#endif
    if (run > 0) {  // the rest (the first run was asked for before the wait)
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) buf[r][u] = ld_stream(rows[r] + (c0 + u) * 512);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) acc[r] += dot_chunk(buf[r][u], xs, c0 + u, lane);
  }
#if PDL && !EARLY
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(FULL, acc[r], o);
  }
  if (lane < ROWS_PER_WARP) {
    // Lane r stores row r (the sums are in every lane; a constant index keeps them in registers).
    float y = acc[0], up = SWIGLU ? acc[ROWS_PER_WARP] : 0.f;
#pragma unroll
    for (int r = 1; r < ROWS_PER_WARP; ++r)
      if (lane == r) {
        y = acc[r];
        if (SWIGLU) up = acc[ROWS_PER_WARP + r];
      }
    const int row = row0 + lane;
    if (row < n) {
      if (HAS_SCALE) {
        y *= __ldg(scale + row);
        if (SWIGLU) up *= __ldg(scale + n + row);
      }
      if (HAS_BIAS) y += lo16(__ldg(bias + row));
      if (SWIGLU) {
        // The unfused ops' roundings: each matmul's output, then the activation, in the activations' dtype.
        const float g = rounded(y);
        y = rounded(g / (1.f + expf(-g))) * rounded(up);
      }
#if ROUTED
      y = rounded(y) * rw;
#endif
#if ROUTER
      logits[row] = rounded(y);
#else
      out[row] = round16(y);
#endif
    }
  }
#if ROUTER
  route_last_block(logits, counter, n, weights_out, ids_out);
#endif
}
