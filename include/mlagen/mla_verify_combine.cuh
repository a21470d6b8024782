// mlagen/mla_verify_combine.cuh — merge the split-KV partials of mla_verify_partial.cuh.
//   lse   = log(sum_s exp(lse_s))                (log-sum-exp over non-empty splits)
//   out   = sum_s exp(lse_s - lse) * o_s         (o_s normalized per split)
// Splits with lse_s = -inf are skipped, so their (unwritten) o_s is never read.
// A row with no visible key (kv_len 0, padded batch row) gets out = 0 and lse = -inf.
#pragma once
#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>

#include "mlagen/mla_verify_params.cuh"

namespace mlagen {

// One CTA per (row, request); 128 threads x 4 dims = 512 output dims.
template <int kHeads, int kRowsMax, int kDimV>
__global__ void __launch_bounds__(kDimV / 4) mla_verify_combine_kernel(const MlaVerifyParams p) {
  static_assert(kDimV % 4 == 0, "dims must divide by 4");
  const int row = blockIdx.x;  // (query i, head h) = (row / H, row % H)
  const int b = blockIdx.y;
  const int rows = p.q_len * kHeads;
  if (row >= rows) return;
  const int64_t base = static_cast<int64_t>(b) * p.num_splits * kRowsMax + row;
  const float* lse_part = p.lse_part + base;

  float lse_max = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) lse_max = fmaxf(lse_max, lse_part[static_cast<int64_t>(s) * kRowsMax]);

  const int d = threadIdx.x * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  if (lse_max != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float lse_s = lse_part[static_cast<int64_t>(s) * kRowsMax];
      if (lse_s == -INFINITY) continue;
      const float w = __expf(lse_s - lse_max);
      const float4 o = *reinterpret_cast<const float4*>(p.o_part + (base + static_cast<int64_t>(s) * kRowsMax) * kDimV + d);
      acc.x += w * o.x;
      acc.y += w * o.y;
      acc.z += w * o.z;
      acc.w += w * o.w;
      wsum += w;
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  const int qi = row / kHeads, h = row % kHeads;
  const int64_t tok = static_cast<int64_t>(b) * p.q_len + qi;
  __nv_bfloat16* out_row = p.out + tok * p.out_stride_tok + static_cast<int64_t>(h) * p.out_stride_head + d;
  __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  *reinterpret_cast<__nv_bfloat162*>(out_row) = lo;
  *reinterpret_cast<__nv_bfloat162*>(out_row + 2) = hi;
  if (p.lse != nullptr && threadIdx.x == 0) {
    p.lse[tok * p.lse_stride_tok + h] = wsum > 0.f ? lse_max + logf(wsum) : -INFINITY;
  }
}

}  // namespace mlagen
