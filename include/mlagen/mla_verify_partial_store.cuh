// mlagen/mla_verify_partial_store.cuh — the element type of the workspace's o_part partials, and the dimsplit_t
// output warps' store of their normalized O^T fragments into it.
//
// o_part holds each split's normalized output rows [bs, num_splits, rows_max, kv_lora_rank]; lse_part stays fp32.
// With bf16 partials the rows are rounded once more before the combine: each o_s is a convex combination of V rows,
// so it is finite wherever V is and its rounding error is at most 2^-9 of P_s |V|; the combine's weighted sum keeps
// that bound (verify.py's out_rtol_mag is 2^-7 of P |V|). FlashInfer's MLA kernel (include/flashinfer/attention/
// mla.cuh, 0.7.4) also keeps its split partials in the output dtype beside fp32 LSEs.
//
// The buffer keeps its fp32 size either way (ops.py lays out the workspace without knowing the element type): bf16
// partials fill the first half of the o_part region, and lse_part stays where it was.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>

#include "mlagen/ptx.cuh"

// MLAGEN_DST_PARTIAL selects the dimsplit_t partials (docs/perf-notes.md v22); other schedules keep fp32 partials.
//   0: fp32, each output-warp lane storing its fragments' values as 4-byte scalars (v21);
//   1: fp32, staged through the then idle KV ring and stored as 16-byte row segments;
//   2: bf16, staged the same way;
//   3: bf16, each lane storing 2-byte scalars from registers;
//   4: bf16 from registers, pairs of adjacent dims packed by one shuffle (store_partial_pairs): 4-byte stores.
// 2-4 halve the bytes the partial kernel writes and the combine reads. A build whose ring cannot hold the staged
// rows (block_n 16 with 2-3 stages) stores them from registers instead (1 -> 0, 2 -> 3).
#ifndef MLAGEN_DST_PARTIAL
#define MLAGEN_DST_PARTIAL 4
#endif

namespace mlagen {

template <bool kBf16>
struct PartialElem {
  using type = float;
};
template <>
struct PartialElem<true> {
  using type = __nv_bfloat16;
};

// Four consecutive partial values (16-byte aligned fp32, 8-byte aligned bf16) as a float4.
__device__ __forceinline__ float4 load_partial4(const float* src) { return *reinterpret_cast<const float4*>(src); }
__device__ __forceinline__ float4 load_partial4(const __nv_bfloat16* src) {
  const uint2 v = *reinterpret_cast<const uint2*>(src);
  const float2 lo = ptx::unpack_bf16x2(v.x), hi = ptx::unpack_bf16x2(v.y);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ void store_partial1(float* dst, float v) { *dst = v; }
__device__ __forceinline__ void store_partial1(__nv_bfloat16* dst, float v) { *dst = __float2bfloat16_rn(v); }

// Shared-memory elements one output warp stages: kRows rows of kDims partial values.
template <typename T, int kRows, int kDims>
inline constexpr int kPartialStageBytes = kRows * kDims * static_cast<int>(sizeof(T));

// One output warp's normalized O^T fragments into o_part rows, through shared memory.
//   o[mt][nt][e]: the fragments of dimsplit_t's output warp (m16 dims x n8 rows): [0] = (dim 16 mt + g, row
//     8 nt + 2 t4), [1] = (.., row + 1), [2] = (dim + 8, row 8 nt + 2 t4), [3] = (dim + 8, row + 1); g = lane / 4,
//     t4 = lane % 4. Row r is scaled by 1 / lsum[r] (0 when lsum[r] is 0: no visible key).
//   stage: this warp's kPartialStageBytes<T, 8 kRowNTiles, 16 kMTiles> of shared memory no other thread touches
//     meanwhile, 16-byte aligned. Rows are 16 kMTiles values with their 16-byte chunks XOR-swizzled by row % 8, so
//     the fragment writes (4 rows of 8 dims per instruction) and the row reads (8 lanes per row) hit distinct banks.
//   dst: row r of the warp's dims at dst + r * row_stride (elements, 16-byte aligned); rows >= live_rows untouched.
template <typename T, int kMTiles, int kRowNTiles>
__device__ __forceinline__ void store_partial_staged(const float (&o)[kMTiles][kRowNTiles][4], const float* lsum,
                                                     int live_rows, T* stage, T* dst, int64_t row_stride, int lane) {
  constexpr int kDims = kMTiles * 16;
  constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T));
  constexpr int kChunksPerRow = kDims / kChunkElems;
  static_assert(kDims % kChunkElems == 0, "a staged row is whole 16-byte chunks");
  const int g = lane / 4, t4 = lane % 4;
  auto slot = [](int r, int d) {  // element of (row r, dim d) in the swizzled stage
    const int chunk = (d / kChunkElems) ^ (r % 8);
    return r * kDims + chunk * kChunkElems + d % kChunkElems;
  };
#pragma unroll
  for (int nt = 0; nt < kRowNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = nt * 8 + 2 * t4 + e;
      if (r < live_rows) {
        const float l = lsum[r];
        const float inv_l = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          store_partial1(stage + slot(r, mt * 16 + g), o[mt][nt][e] * inv_l);
          store_partial1(stage + slot(r, mt * 16 + g + 8), o[mt][nt][2 + e] * inv_l);
        }
      }
    }
  __syncwarp();
  const int chunks = live_rows * kChunksPerRow;
#pragma unroll 4
  for (int i = lane; i < chunks; i += 32) {
    const int r = i / kChunksPerRow, c = i % kChunksPerRow;
    const uint4 v = *reinterpret_cast<const uint4*>(stage + slot(r, c * kChunkElems));
    *reinterpret_cast<uint4*>(dst + r * row_stride + c * kChunkElems) = v;
  }
}

// One output warp's normalized O^T fragments (as store_partial_staged) into bf16 o_part rows from registers: lanes g
// and g ^ 1 (lane ^ 4) swap one value each, so the even-g lane holds dims (d, d + 1) of its row 2 t4 and the odd-g
// lane dims (d - 1, d) of row 2 t4 + 1; each stores them as one bf16x2 (a warp instruction: 8 rows x 16 bytes).
// dst: row r of the warp's dims at dst + r * row_stride (elements, 4-byte aligned); rows >= live_rows untouched.
// Every lane of the warp must call it (the shuffles).
template <int kMTiles, int kRowNTiles>
__device__ __forceinline__ void store_partial_pairs(const float (&o)[kMTiles][kRowNTiles][4], const float* lsum,
                                                    int live_rows, __nv_bfloat16* dst, int64_t row_stride, int lane) {
  const int g = lane / 4, t4 = lane % 4;
  const bool odd = (g & 1) != 0;
#pragma unroll
  for (int nt = 0; nt < kRowNTiles; ++nt) {
    const int r0 = nt * 8 + 2 * t4;  // rows r0 (e 0) and r0 + 1 (e 1) of this lane's fragments
    const float l0 = lsum[r0], l1 = lsum[r0 + 1];  // lsum has 8 kRowNTiles rows
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    const int r = odd ? r0 + 1 : r0;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // dims 16 mt + g (h 0) and 16 mt + g + 8 (h 1)
        const float v0 = o[mt][nt][2 * h] * inv0, v1 = o[mt][nt][2 * h + 1] * inv1;
        const float other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
        const int d = mt * 16 + h * 8 + (g & ~1);
        if (r < live_rows) {
          *reinterpret_cast<uint32_t*>(dst + r * row_stride + d) = odd ? ptx::pack_bf16x2(other, v1)
                                                                       : ptx::pack_bf16x2(v0, other);
        }
      }
  }
}

}  // namespace mlagen
