// mlagen/mla_verify_combine.cuh — merge the split-KV partials of mla_verify_partial.cuh.
//   lse   = log(sum_s exp(lse_s))                (log-sum-exp over non-empty splits)
//   out   = sum_s exp(lse_s - lse) * o_s         (o_s normalized per split)
// Only the live splits of a request (mla_verify_split.cuh, from kv_len) are read, and among them
// splits with lse_s = -inf (no visible key) are skipped, so an unwritten o_s is never read.
// A row with no visible key (kv_len 0, padded batch row) gets out = 0 and lse = -inf.
#pragma once
#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>

#include "mlagen/mla_verify_params.cuh"
#include "mlagen/mla_verify_split.cuh"

namespace mlagen {

inline constexpr int kMaxSplits = 256;

// One CTA per (row, request); kDimV / 4 threads x 4 dims. The split LSEs are read once into shared
// memory (in parallel), then the weighted partial rows are read with kUnroll independent loads in
// flight per thread; splits with zero weight (empty) are never read.
template <int kHeads, int kRowsMax, int kDimV, int kBlockN>
__global__ void __launch_bounds__(kDimV / 4) mla_verify_combine_kernel(const MlaVerifyParams p) {
  static_assert(kDimV % 4 == 0 && kDimV / 4 >= 32, "dims must divide by 4, at least one warp");
  constexpr int kThreads = kDimV / 4;
  constexpr int kWarpsC = kThreads / 32;
  constexpr int kUnroll = 8;
  __shared__ float w_smem[kMaxSplits];
  __shared__ float red_smem[kWarpsC];
  const int row = blockIdx.x;  // (query i, head h) = (row / H, row % H)
  const int b = blockIdx.y;
  const int rows = p.q_len * kHeads;
  if (row >= rows) return;
  const int64_t base = static_cast<int64_t>(b) * p.num_splits * kRowsMax + row;
  const int ns = live_splits(p.kv_lens[b], kBlockN, p.num_splits, p.min_tiles_per_split);
  const int tid = threadIdx.x;

  // lse_max over splits (block reduction)
  float m = -INFINITY;
  for (int s = tid; s < ns; s += kThreads) {
    const float l = p.lse_part[base + static_cast<int64_t>(s) * kRowsMax];
    w_smem[s] = l;
    m = fmaxf(m, l);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (tid % 32 == 0) red_smem[tid / 32] = m;
  __syncthreads();
  float lse_max = red_smem[0];
#pragma unroll
  for (int w = 1; w < kWarpsC; ++w) lse_max = fmaxf(lse_max, red_smem[w]);
  for (int s = tid; s < ns; s += kThreads) {
    const float l = w_smem[s];
    w_smem[s] = (lse_max == -INFINITY || l == -INFINITY) ? 0.f : __expf(l - lse_max);
  }
  __syncthreads();

  const int d = tid * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  const float* o_base = p.o_part + base * kDimV + d;
  for (int s0 = 0; s0 < ns; s0 += kUnroll) {
    float4 o[kUnroll];
    float w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = s0 + u;
      w[u] = s < ns ? w_smem[s] : 0.f;
      o[u] = w[u] != 0.f ? *reinterpret_cast<const float4*>(o_base + static_cast<int64_t>(s) * kRowsMax * kDimV)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      acc.x += w[u] * o[u].x;
      acc.y += w[u] * o[u].y;
      acc.z += w[u] * o[u].z;
      acc.w += w[u] * o[u].w;
      wsum += w[u];
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  const int qi = row / kHeads, h = row % kHeads;
  const int64_t tok = static_cast<int64_t>(b) * p.q_len + qi;
  __nv_bfloat16* out_row = p.out + tok * p.out_stride_tok + static_cast<int64_t>(h) * p.out_stride_head + d;
  *reinterpret_cast<__nv_bfloat162*>(out_row) = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  *reinterpret_cast<__nv_bfloat162*>(out_row + 2) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  if (p.lse != nullptr && tid == 0) {
    p.lse[tok * p.lse_stride_tok + h] = wsum > 0.f ? lse_max + logf(wsum) : -INFINITY;
  }
}

}  // namespace mlagen
