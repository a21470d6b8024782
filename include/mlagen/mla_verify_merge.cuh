// mlagen/mla_verify_merge.cuh — the combine folded into the partial kernel ("merge"), for a grid whose CTAs are all
// resident at once (the launch checks it: mla_verify_launch.cuh). After writing its partial (o_part, lse_part), every
// CTA of the grid arrives on a global counter, waits until all have arrived, then merges its share of the outputs:
//   lse = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - lse) * o_s   (as mla_verify_combine.cuh, same live splits)
// It removes the combine's launch; on an H200 it measured 1.1-11 % slower than the combine kernel (docs/perf-notes.md
// v21: after the grid-wide wait the merge reads the 6-9 MB of partials at about half the combine kernel's rate), so
// only diagnostic builds (MLAGEN_DST_MERGE 1) contain it. It reads fp32 partials: such builds set
// MLAGEN_DST_PARTIAL_BF16 0 (mla_verify_partial_store.cuh; the dimsplit_t config asserts it).
//
//   item    128 output dims (32 lanes x float4) of one (request, row): items = bs x q_len*H x kDimV / 128.
//   share   CTA c of the grid's n takes items c, c + n, c + 2n, ... (a round-robin over the linear block index);
//           its warps split an item's splits into `groups` (kWarps / items of the CTA, at least 1), each warp summing
//           its splits in a fixed order, then the item's first warp adds the groups in order: outputs are
//           deterministic (they differ from the combine kernel's only by the order of the fp32 sums).
//   counters p.merge_counters[0] arrivals, [1] departures, both 0 before the launch; the last CTA to leave sets
//           both back to 0, so a workspace stays valid for the next launch (and CUDA-graph replays).
// The wait is bounded: a grid that was not co-resident (the launch's occupancy check assumes an otherwise idle GPU;
// kernels of other streams or processes can still hold SMs) or counters that were not 0 end in a trap after 4 s, which
// kills the CUDA context, instead of a hang.
#pragma once
// MLAGEN_MERGE_DIAG (diagnostic timing only; outputs are then wrong): 0 the merge as described; 1 the arrival wait and
// the counters only, no merge work (out / lse not written); 2 the merge work without waiting for the other CTAs.
#ifndef MLAGEN_MERGE_DIAG
#define MLAGEN_MERGE_DIAG 0
#endif
#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>

#include "mlagen/mla_verify_batch.cuh"
#include "mlagen/mla_verify_combine.cuh"  // split_weights_in_place, store_merged_row, add_float4
#include "mlagen/mla_verify_params.cuh"
#include "mlagen/mla_verify_split.cuh"
#include "mlagen/ptx.cuh"

namespace mlagen {

inline constexpr int kMergeMaxSplits = kMaxSplits;  // splits per launch (mla_verify_combine.cuh)
inline constexpr uint64_t kMergeSpinLimitNs = 4000000000ull;  // 4 s: only a non-resident grid waits this long

template <int kThreads>
struct MergeShape {
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kUnroll = 16;  // independent 16-byte partial loads in flight per lane
  // shared memory: per warp the weights of up to kMergeMaxSplits splits, then per warp its 32 float4 sums
  static constexpr int kSmemBytes = kWarps * kMergeMaxSplits * 4 + kWarps * 32 * 16;
  static_assert(kThreads % 32 == 0 && kWarps >= 1, "whole warps");
};

// Every thread of the CTA calls this after the CTA's partial is written (no thread may still write o_part /
// lse_part). smem: MergeShape<kThreads>::kSmemBytes of this CTA's shared memory that nothing else uses any more.
template <int kHeads, int kRowsMax, int kDimV, int kBlockN, int kThreads>
__device__ __forceinline__ void merge_partials(const MlaVerifyParams& p, unsigned char* smem) {
  using Shape = MergeShape<kThreads>;
  constexpr int kWarps = Shape::kWarps, kUnroll = Shape::kUnroll;
  constexpr int kColBlocks = kDimV / 128;
  static_assert(kDimV % 128 == 0, "an item is 128 output dims");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const unsigned n_cta = gridDim.x * gridDim.y * gridDim.z;
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  unsigned int* arrived = p.merge_counters;
  unsigned int* departed = p.merge_counters + 1;

  __syncthreads();  // the CTA's partial stores come before thread 0's release
  if (tid == 0 && MLAGEN_MERGE_DIAG != 2) {
    __threadfence();
    ptx::red_release_gpu_add(arrived, 1u);
    const uint64_t t0 = ptx::globaltimer_ns();
    for (;;) {
      const unsigned int v = ptx::ld_acquire_gpu(arrived);
      if (v == n_cta) break;
      if (v > n_cta || ptx::globaltimer_ns() - t0 > kMergeSpinLimitNs) __trap();  // counters not 0, or not resident
      __nanosleep(64);
    }
    __threadfence();
  }
  __syncthreads();  // every partial of the grid is visible from here on

  float* w_all = reinterpret_cast<float*>(smem);                          // [kWarps][kMergeMaxSplits]
  float4* acc_all = reinterpret_cast<float4*>(smem + kWarps * kMergeMaxSplits * 4);  // [kWarps][32]
  float* w_smem = w_all + warp * kMergeMaxSplits;
  const int rows = p.q_len * kHeads;
  const int items = p.batch_size * rows * kColBlocks;
  const int first = static_cast<int>(cta), stride = static_cast<int>(n_cta);
  const int my_items = MLAGEN_MERGE_DIAG == 1 ? 0 : first < items ? (items - 1 - first) / stride + 1 : 0;
  const int groups = my_items >= kWarps ? 1 : kWarps / (my_items > 0 ? my_items : 1);
  const int per_pass = kWarps / groups;
  for (int pass0 = 0; pass0 < my_items; pass0 += per_pass) {  // the same trip count in every warp of the CTA
    const int k = pass0 + warp / groups, sg = warp % groups;
    const bool active = warp < per_pass * groups && k < my_items;
    int b = 0, r = 0, cb = 0;
    float lse_max = -INFINITY, wsum = 0.f;
    if (active) {
      const int it = first + k * stride;
      b = it / (rows * kColBlocks);
      r = (it / kColBlocks) % rows;
      cb = it % kColBlocks;
      const int ns = live_splits(request_kv_len(p, b), kBlockN, p.num_splits, p.min_tiles_per_split);
      const int64_t base = static_cast<int64_t>(b) * p.num_splits * kRowsMax + r;
      const float* o_col = p.o_part + base * kDimV + cb * 128 + lane * 4;
      // The first kUnroll partials of this warp's splits are requested before the weights are known (one round
      // trip instead of two); a split whose weight is 0 (lse -inf: no visible key, o_s possibly never written)
      // contributes nothing, whatever its o_s holds.
      float4 o[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int s = sg + u * groups;
        o[u] = s < ns ? __ldcg(reinterpret_cast<const float4*>(o_col + static_cast<int64_t>(s) * kRowsMax * kDimV))
                      : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float m = -INFINITY;
      for (int s = lane; s < ns; s += 32) {
        const float l = __ldcg(p.lse_part + base + static_cast<int64_t>(s) * kRowsMax);
        w_smem[s] = l;
        m = fmaxf(m, l);
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      float ws = split_weights_in_place(w_smem, lane, 32, ns, m);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) ws += __shfl_xor_sync(0xffffffffu, ws, off);
      __syncwarp();  // every lane's weights are in w_smem
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int s0 = sg;; s0 += kUnroll * groups) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int s = s0 + u * groups;
          const float w = s < ns ? w_smem[s] : 0.f;
          if (w != 0.f) {
            acc.x += w * o[u].x;
            acc.y += w * o[u].y;
            acc.z += w * o[u].z;
            acc.w += w * o[u].w;
          }
        }
        if (s0 + kUnroll * groups >= ns) break;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {  // the next kUnroll splits of this warp (more than kUnroll x groups live)
          const int s = s0 + (kUnroll + u) * groups;
          o[u] = s < ns ? __ldcg(reinterpret_cast<const float4*>(o_col + static_cast<int64_t>(s) * kRowsMax * kDimV))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
      acc_all[warp * 32 + lane] = acc;
      lse_max = m;
      wsum = ws;
    }
    __syncthreads();  // the item's group sums are in acc_all
    if (active && sg == 0) {
      float4 acc = acc_all[warp * 32 + lane];
      for (int gi = 1; gi < groups; ++gi) add_float4(acc, acc_all[(warp + gi) * 32 + lane]);
      store_merged_row<kHeads>(p, b, r, cb * 128 + lane * 4, cb * 128 + lane * 4 + 2, acc, wsum, lse_max,
                               cb == 0 && lane == 0);
    }
    __syncthreads();  // acc_all and the weights are reused by the next pass
  }
  // Every CTA that departs has finished its wait: the last one resets the counters for the next launch.
  if (tid == 0 && MLAGEN_MERGE_DIAG != 2) {
    if (atomicAdd(departed, 1u) == n_cta - 1) {
      atomicExch(arrived, 0u);
      atomicExch(departed, 0u);
    }
  }
}

}  // namespace mlagen
