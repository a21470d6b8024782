// mlagen/mla_verify_combine.cuh — merge the split-KV partials of the partial kernels.
//   lse   = log(sum_s exp(lse_s))                (log-sum-exp over non-empty splits)
//   out   = sum_s exp(lse_s - lse) * o_s         (o_s normalized per split)
// Only the live splits of a request (mla_verify_split.cuh, from kv_len) are read, and among them
// splits with lse_s = -inf (no visible key) are skipped, so an unwritten o_s is never read.
// A row with no visible key (kv_len 0, padded batch row) gets out = 0 and lse = -inf.
//
// It may be launched as a programmatic dependent of the partial kernel (mla_verify_launch.cuh, MLAGEN_PDL=1): its
// CTAs can then be resident before the partial kernel ends, so nothing the partial kernel writes (o_part,
// lse_part) is read before ptx::griddep_wait().
#pragma once
#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>

#include "mlagen/mla_verify_batch.cuh"
#include "mlagen/mla_verify_params.cuh"
#include "mlagen/mla_verify_partial_store.cuh"
#include "mlagen/mla_verify_split.cuh"
#include "mlagen/ptx.cuh"

// MLAGEN_COMBINE_UNROLL 8 (every shipped build): partial loads in flight per thread in one pass of the split loop, so a
// pass reads 8 x kGroups splits (64 with 8 dim chunks per row); 16: 128, for A/B timing where nsplit auto takes more
// than 64 splits (66 at bs 1 on an H200: two dependent passes at 8). The sums run in the same order either way.
#ifndef MLAGEN_COMBINE_UNROLL
#define MLAGEN_COMBINE_UNROLL 8
#endif

namespace mlagen {

inline constexpr int kMaxSplits = 256;
inline constexpr int kCombineThreads = 128;

__device__ __forceinline__ void add_float4(float4& acc, const float4& a) {
  acc.x += a.x;
  acc.y += a.y;
  acc.z += a.z;
  acc.w += a.w;
}

// Split weights exp(lse_s - lse_max) in place of the lse values w[s], s = first, first + step, ... < ns (0 for a split
// with no visible key, or when no split has one); returns this thread's sum of them.
__device__ __forceinline__ float split_weights_in_place(float* w, int first, int step, int ns, float lse_max) {
  float sum = 0.f;
  for (int s = first; s < ns; s += step) {
    const float l = w[s];
    const float wt = (lse_max == -INFINITY || l == -INFINITY) ? 0.f : __expf(l - lse_max);
    w[s] = wt;
    sum += wt;
  }
  return sum;
}

// The last step of merging one output row's split partials (the combine, or the merge in mla_verify_merge.cuh):
// out[token of row, head of row, dims d0, d0 + 1] = (acc.x, acc.y) / wsum and [dims d1, d1 + 1] = (acc.z, acc.w) /
// wsum in bf16 (0 when no split had a visible key), and with lse_lane (and an lse output) the row's
// lse = lse_max + log(wsum) (-inf when none had).
template <int kHeads>
__device__ __forceinline__ void store_merged_row(const MlaVerifyParams& p, int b, int row, int d0, int d1,
                                                 const float4& acc, float wsum, float lse_max, bool lse_lane) {
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  const int qi = row / kHeads, h = row % kHeads;
  const int64_t tok = static_cast<int64_t>(b) * p.q_len + qi;
  __nv_bfloat16* out_d0 = p.out + tok * p.out_stride_tok + static_cast<int64_t>(h) * p.out_stride_head + d0;
  *reinterpret_cast<__nv_bfloat162*>(out_d0) = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  *reinterpret_cast<__nv_bfloat162*>(out_d0 + (d1 - d0)) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  if (p.lse != nullptr && lse_lane) p.lse[tok * p.lse_stride_tok + h] = wsum > 0.f ? lse_max + logf(wsum) : -INFINITY;
}

// Compile-time shape of the combine. A row's kDimV / 4 float4 columns are cut into kChunks chunks, one CTA per
// (row, chunk, request). In a CTA, kLanes = kDimV / 4 / kChunks threads cover the chunk (4 dims each) and
// kGroups = kCombineThreads / kLanes such groups read disjoint splits (s = g, g + kGroups, ...); group 0 sums them
// through shared memory. kChunks 1: one CTA per row reads every split. kChunks 4 / 8: a row is spread over 4 / 8
// CTAs with 4 / 8 times the loads in flight (few rows, many splits: at batch 1 and long context, one CTA per row
// left 60 of 132 SMs idle, each CTA reading 63 partials). The launch picks kChunks from NSPLIT alone
// (combine_chunks): with nsplit auto a large batch gets few splits and so one CTA per row; a fixed NSPLIT >= 8
// spreads rows at every batch size (untimed at large batches).
template <int kDimV, int kChunks>
struct CombineShape {
  static constexpr int kLanes = kDimV / 4 / kChunks;
  static constexpr int kGroups = kCombineThreads / kLanes;
  // independent loads in flight per thread (16 bytes of fp32 partials, 8 of bf16)
  static constexpr int kUnroll = MLAGEN_COMBINE_UNROLL;
  static_assert(kDimV % (4 * kChunks) == 0, "the dim chunks must cover kv_lora_rank in float4 columns");
  static_assert(kLanes >= 1 && kCombineThreads % kLanes == 0, "a chunk's columns must divide the CTA's threads");
  static_assert(kGroups * kUnroll <= kMaxSplits, "one pass of the split loop reads at most kMaxSplits partials");
};

// Grid (kRowsMax * kChunks, bs), kCombineThreads threads. Block x = row * kChunks + chunk, so the CTAs of one
// row read adjacent columns of the same partial rows. PartialT: the element type of o_part (float, or
// __nv_bfloat16 for shipped dimsplit_t builds: MLAGEN_DST_PARTIAL_BF16, mla_verify_partial_store.cuh); bf16 partials
// in the paired layout (kPartialPaired) go to their dims in the final store.
// kLaunchNext: the next kernel in the stream (the next call's partial kernel, launched as a programmatic dependent:
// MLAGEN_DST_PDL, MLAGEN_ROWBLOCK_PDL) may be scheduled from this kernel's start; it waits for this grid's end before
// touching o_part.
template <int kHeads, int kRowsMax, int kDimV, int kBlockN, int kChunks, typename PartialT = float,
          bool kLaunchNext = false>
__global__ void __launch_bounds__(kCombineThreads) mla_verify_combine_kernel(const MlaVerifyParams p) {
  if constexpr (kLaunchNext) ptx::griddep_launch_dependents();
  using Shape = CombineShape<kDimV, kChunks>;
  constexpr int kLanes = Shape::kLanes, kGroups = Shape::kGroups, kUnroll = Shape::kUnroll;
  constexpr int kWarpsC = kCombineThreads / 32;
  __shared__ float w_smem[kMaxSplits];  // exp(lse_s - lse_max) per split
  __shared__ float red_smem[kWarpsC];
  __shared__ float4 acc_smem[kGroups > 1 ? kGroups - 1 : 1][kLanes];  // groups 1.. hand their sums to group 0
  const int row = blockIdx.x / kChunks;  // (query i, head h) = (row / H, row % H)
  const int chunk = blockIdx.x % kChunks;
  const int b = blockIdx.y;
  const int rows = p.q_len * kHeads;
  if (row >= rows) return;
  const int tid = threadIdx.x;
  const int lane = tid % kLanes, group = tid / kLanes;
  ptx::griddep_wait();  // the partial kernel's o_part / lse_part are complete and visible from here on
  const int64_t base = static_cast<int64_t>(b) * p.num_splits * kRowsMax + row;
  const int ns = live_splits(request_kv_len(p, b), kBlockN, p.num_splits, p.min_tiles_per_split);

  // lse_max over splits (block reduction)
  float m = -INFINITY;
  for (int s = tid; s < ns; s += kCombineThreads) {
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
  float wpart = split_weights_in_place(w_smem, tid, kCombineThreads, ns, lse_max);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) wpart += __shfl_xor_sync(0xffffffffu, wpart, off);
  __syncthreads();  // every thread has read red_smem's maxima: it is reused for the weight sums
  if (tid % 32 == 0) red_smem[tid / 32] = wpart;
  __syncthreads();  // w_smem and the weight sums are complete
  float wsum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarpsC; ++w) wsum += red_smem[w];

  const int d = chunk * (kDimV / kChunks) + lane * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const PartialT* o_base = reinterpret_cast<const PartialT*>(p.o_part) + base * kDimV + d;
  for (int s0 = group; s0 < ns; s0 += kUnroll * kGroups) {
    float4 o[kUnroll];
    float w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = s0 + u * kGroups;
      w[u] = s < ns ? w_smem[s] : 0.f;
      o[u] = w[u] != 0.f ? load_partial4(o_base + static_cast<int64_t>(s) * kRowsMax * kDimV)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      acc.x += w[u] * o[u].x;
      acc.y += w[u] * o[u].y;
      acc.z += w[u] * o[u].z;
      acc.w += w[u] * o[u].w;
    }
  }
  if constexpr (kGroups > 1) {
    if (group > 0) acc_smem[group - 1][lane] = acc;
    __syncthreads();
    if (group > 0) return;
#pragma unroll
    for (int g = 0; g < kGroups - 1; ++g) add_float4(acc, acc_smem[g][lane]);
  }
  if constexpr (kPartialPaired<PartialT>) {  // positions d .. d + 3 hold dims lo, lo + 8, lo + 1, lo + 9
    const int lo = paired_partial_dim_lo(d);
    store_merged_row<kHeads>(p, b, row, lo, lo + 8, make_float4(acc.x, acc.z, acc.y, acc.w), wsum, lse_max,
                             chunk == 0 && tid == 0);
  } else {
    store_merged_row<kHeads>(p, b, row, d, d + 2, acc, wsum, lse_max, chunk == 0 && tid == 0);
  }
}

// Dim chunks per row for a launch of num_splits splits: more CTAs per row when each row has many partials.
__host__ __forceinline__ int combine_chunks(int num_splits) { return num_splits >= 32 ? 8 : num_splits >= 8 ? 4 : 1; }

}  // namespace mlagen
