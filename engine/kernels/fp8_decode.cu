// Decode attention over an FP8 (e4m3) paged KV cache with the tensor cores' own fragments, outside Triton.
//
// One warp per (split, sequence, KV head), one query token per sequence, head size 128, up to 8 query heads per KV
// head. Scores are computed transposed, S^T = K Q^T, so that keys fill the MMA's 16 rows and the GQA group its 8
// columns (Triton's dot wants 16 query rows, of which a group of 4 fills 4), and the output transposed,
// O^T = V^T P^T. Dimensions are permuted inside each dot so that every thread's fragment of a key's row is one
// contiguous run of bytes: the K fragment is widened by cvt.rn.f16x2.e4m3x2 straight into MMA registers, the V
// fragment after a byte permute pairs two keys' bytes, and P^T reaches the second MMA by one movmatrix transpose per
// 8x8 block. Nothing goes through shared memory. Launched plainly (outside programmatic dependent launch).
//
// Lane (g = lane / 4, c = lane % 4) of the warp:
//   QK, m16n8k16: A = K rows (keys 16t + g, 16t + g + 8), k slot (16ks + 2c + {0,1}, +8) <-> dim 32c + 4ks + {0..3},
//                 B = Q^T (query head g, same dims), C = S^T (keys as A's rows, heads 2c, 2c + 1);
//   PV, m16n8k16: A = V^T, row (mt, g) <-> dim 16g + 2mt, row (mt, g + 8) <-> dim 16g + 2mt + 1, k = keys
//                 16t + 2c + {0, 1, 8, 9}; B = P^T; C = O^T: dims 16g..16g + 15 of heads 2c, 2c + 1.
// The softmax runs in base 2 with a lazy rescale (the running maxima move only when one grows by more than 2^8),
// as the Triton kernel's decode tiles do; a split writes the same partials (sum and maximum in log2 units) that
// engine.kernels.triton_ops merges.

typedef unsigned int u32;
typedef unsigned short u16;

#define FULL 0xffffffffu

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 v) {  // the low two bytes of v, low byte to the low half
  u32 r;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ u32 e4m3x2_hi_to_f16x2(u32 v) {  // the high two bytes of v
  u32 r;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u32 transpose8x8(u32 v) {
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float to_f32(u16 x, bool bf16) {  // a 16-bit query element
  if (bf16) return __int_as_float(((u32)x) << 16);
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
  return r;
}

__device__ __forceinline__ u16 from_f32(float x, bool bf16) {
  u16 r;
  if (bf16)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ uint4 ld16(const unsigned char* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// One tile of 32 keys from n0: K and V fragments of this lane. FULL_TILE: all 32 keys are below hi.
template <bool FULL_TILE>
__device__ __forceinline__ void load_tile(const int* __restrict__ table, int n0,
                                          int hi, const unsigned char* head, int g, int c, uint4 (&kf)[2][2][2],
                                          uint4 (&vf)[2][4]) {
  // Block size BS, strides SB (block) and SS (slot) in bytes, V at V_OFFSET: compile-time constants.
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const unsigned char* base = head;
    if (FULL_TILE) {  // 16 keys from a multiple of 16: one block
      const int k0 = n0 + 16 * t;
      base += (long long)__ldg(table + k0 / BS) * SB + (k0 % BS) * SS;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const unsigned char* row = base + (g + 8 * r) * SS;
      if (!FULL_TILE) {
        const int key = min(n0 + 16 * t + g + 8 * r, hi - 1);
        row = head + (long long)__ldg(table + key / BS) * SB + (key % BS) * SS;
      }
      kf[t][r][0] = ld16(row + 32 * c);
      kf[t][r][1] = ld16(row + 32 * c + 16);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 2 * c + (i & 1) + 8 * (i >> 1);
      const unsigned char* row = base + j * SS;
      if (!FULL_TILE) {
        const int key = min(n0 + 16 * t + j, hi - 1);
        row = head + (long long)__ldg(table + key / BS) * SB + (key % BS) * SS;
      }
      vf[t][i] = ld16(row + V_OFFSET + 16 * g);
    }
  }
}

__device__ __forceinline__ u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

template <bool FULL_TILE>
__device__ __forceinline__ void attend(const uint4 (&kf)[2][2][2], const uint4 (&vf)[2][4], const u32 (&qf)[8][2],
                                       int n0, int hi, int g, float qk_scale, float (&m)[2], float (&l)[2],
                                       float (&acc)[8][4]) {
  // S^T: two 16-key tiles, each over eight k-steps in two chains (even and odd steps).
  float s[2][4];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    float e[4] = {0.f, 0.f, 0.f, 0.f}, o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      u32 w0 = word(kf[t][0][ks >> 2], ks & 3), w1 = word(kf[t][1][ks >> 2], ks & 3);
      mma16816((ks & 1) ? o : e, e4m3x2_to_f16x2(w0), e4m3x2_to_f16x2(w1), e4m3x2_hi_to_f16x2(w0),
               e4m3x2_hi_to_f16x2(w1), qf[ks][0], qf[ks][1]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s[t][j] = (e[j] + o[j]) * qk_scale;
      if (!FULL_TILE && n0 + 16 * t + g + 8 * (j >> 1) >= hi) s[t][j] = __int_as_float(0xff800000u);
    }
  }
  // The tile's maximum of each of this lane's two heads, over the warp's keys.
  float tm[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float x = fmaxf(fmaxf(s[0][h], s[0][h + 2]), fmaxf(s[1][h], s[1][h + 2]));
    x = fmaxf(x, __shfl_xor_sync(FULL, x, 4));
    x = fmaxf(x, __shfl_xor_sync(FULL, x, 8));
    x = fmaxf(x, __shfl_xor_sync(FULL, x, 16));
    tm[h] = fmaxf(m[h], x);
  }
  if (__any_sync(FULL, tm[0] - m[0] > 8.f || tm[1] - m[1] > 8.f)) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float alpha = exp2_approx(m[h] - tm[h]);
      l[h] *= alpha;
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        acc[mt][h] *= alpha;
        acc[mt][h + 2] *= alpha;
      }
      m[h] = tm[h];
    }
  }
  // P^T, each 8x8 block transposed from S^T's layout to the second MMA's B fragment.
  u32 pb[2][2];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    float p0 = exp2_approx(s[t][0] - m[0]), p1 = exp2_approx(s[t][1] - m[1]);
    float p2 = exp2_approx(s[t][2] - m[0]), p3 = exp2_approx(s[t][3] - m[1]);
    l[0] += p0 + p2;
    l[1] += p1 + p3;
    pb[t][0] = transpose8x8(pack_f16x2(p0, p1));
    pb[t][1] = transpose8x8(pack_f16x2(p2, p3));
  }
  // O^T += V^T P^T: V's bytes of keys (2c, 2c + 1) and (2c + 8, 2c + 9) interleaved, then widened.
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u32 k0 = word(vf[t][0], j), k1 = word(vf[t][1], j), k8 = word(vf[t][2], j), k9 = word(vf[t][3], j);
      u32 lo01 = prmt(k0, k1, 0x5140), hi01 = prmt(k0, k1, 0x7362);
      u32 lo89 = prmt(k8, k9, 0x5140), hi89 = prmt(k8, k9, 0x7362);
      mma16816(acc[2 * j], e4m3x2_to_f16x2(lo01), e4m3x2_hi_to_f16x2(lo01), e4m3x2_to_f16x2(lo89),
               e4m3x2_hi_to_f16x2(lo89), pb[t][0], pb[t][1]);
      mma16816(acc[2 * j + 1], e4m3x2_to_f16x2(hi01), e4m3x2_hi_to_f16x2(hi01), e4m3x2_to_f16x2(hi89),
               e4m3x2_hi_to_f16x2(hi89), pb[t][0], pb[t][1]);
    }
  }
}

// q [tokens, H, 128] 16-bit (BF16: bfloat16, else float16); kv: the cache's bytes, K at 0 and V at v_offset; block
// (b, kv head h, slot j) of either at b * sb + h * sh + j * sss bytes. Splits > 1: partials to part_acc
// [seqs, H, splits, 128] and part_ml [seqs, H, splits, 2] (f32); else the output to out [tokens, H, 128].
// The launch bound (4 programs an SM at least) leaves ptxas at 152 registers, the build measured on the H200.
extern "C" __global__ void __launch_bounds__(32, 4) fp8_decode_attention(
    const u16* __restrict__ q, const unsigned char* __restrict__ kv, u16* __restrict__ out,
    const int* __restrict__ tables, const int* __restrict__ qstart, const int* __restrict__ ctx_lens,
    float* __restrict__ part_acc, float* __restrict__ part_ml, float qk_scale, long long table_stride, int splits,
    int heads, int group) {
  const int sp = blockIdx.x, s = blockIdx.y, kvh = blockIdx.z;
  const int lane = threadIdx.x, g = lane >> 2, c = lane & 3;
  const int q0 = __ldg(qstart + s);
  const int ctx = __ldg(ctx_lens + s);
  const int split_size = ((ctx + splits - 1) / splits + 31) / 32 * 32;
  const int lo = sp * split_size;
  const int hi = min(ctx, lo + split_size);
  // Q^T fragments: query head g of the group (zeros past it), dims 32c..32c + 31 as fp16 pairs.
  u32 qf[8][2];
  {
    const bool live = g < group;
    const u16* qrow = q + ((long long)q0 * heads + kvh * group + (live ? g : 0)) * 128 + 32 * c;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint4 w = live ? __ldg(reinterpret_cast<const uint4*>(qrow) + i) : make_uint4(0, 0, 0, 0);
      u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float a = to_f32((u16)(ws[k] & 0xffff), BF16), b = to_f32((u16)(ws[k] >> 16), BF16);
        qf[2 * i + (k >> 1)][k & 1] = pack_f16x2(a, b);
      }
    }
  }
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
  float acc[8][4];
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  const int* table = tables + (long long)s * table_stride;
  const unsigned char* head = kv + (long long)kvh * SH;
  uint4 kf[2][2][2], vf[2][4];
  int n0 = lo;
  for (; n0 + 32 <= hi; n0 += 32) {
    load_tile<true>(table, n0, hi, head, g, c, kf, vf);
    attend<true>(kf, vf, qf, n0, hi, g, qk_scale, m, l, acc);
  }
  if (n0 < hi) {
    load_tile<false>(table, n0, hi, head, g, c, kf, vf);
    attend<false>(kf, vf, qf, n0, hi, g, qk_scale, m, l, acc);
  }
  // The sums over the warp's keys.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(FULL, l[h], 4);
    l[h] += __shfl_xor_sync(FULL, l[h], 8);
    l[h] += __shfl_xor_sync(FULL, l[h], 16);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int local = 2 * c + h;
    if (local >= group) continue;
    const int head = kvh * group + local;
    if (splits > 1) {
      const long long part = ((long long)s * heads + head) * splits + sp;
      float4* dst = reinterpret_cast<float4*>(part_acc + part * 128 + 16 * g);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        dst[i] = make_float4(acc[2 * i][h], acc[2 * i][h + 2], acc[2 * i + 1][h], acc[2 * i + 1][h + 2]);
      if (g == 0) {
        part_ml[part * 2] = m[h];
        part_ml[part * 2 + 1] = l[h];
      }
    } else {
      const float inv = 1.f / l[h];
      u32 w[8];
#pragma unroll
      for (int mt = 0; mt < 8; ++mt)
        w[mt] = (u32)from_f32(acc[mt][h] * inv, BF16) | ((u32)from_f32(acc[mt][h + 2] * inv, BF16) << 16);
      uint4* dst = reinterpret_cast<uint4*>(out + ((long long)q0 * heads + head) * 128 + 16 * g);
      dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
      dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
  }
}
