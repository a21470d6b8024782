// mlagen/mla_verify_partial_store.cuh — the element type of the workspace's o_part partials: its loads (the combine)
// and stores (the dimsplit_t output warps' epilogue).
//
// o_part holds each split's normalized output rows [bs, num_splits, rows_max, kv_lora_rank]; lse_part stays fp32.
// With bf16 partials the rows are rounded once more before the combine: each o_s is a convex combination of V rows,
// so it is finite wherever V is and its rounding error is at most 2^-8 of P_s |V| (8 significant bits); the
// combine's weighted sum of those errors is at most 2^-8 of P |V|, a third rounding beside P's and the output's
// (verify.py's out_rtol_mag, 3 x 2^-8 of P |V|, is the worst case of the three). FlashInfer's MLA kernel
// (include/flashinfer/attention/mla.cuh, 0.7.4) also keeps its split partials in the output dtype beside fp32 LSEs.
//
// The buffer keeps its fp32 size either way (ops.py lays out the workspace without knowing the element type): bf16
// partials fill the first half of the o_part region, and lse_part stays where it was.
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>

#include "mlagen/ptx.cuh"

// MLAGEN_DST_PARTIAL_BF16 2 (every shipped build): dimsplit_t writes bf16 partials in the paired layout below, two
// values per 4-byte store (measured 0.972-0.999x the time of dim order with bit-identical outputs, docs/perf-notes.md
// v29); 1: bf16 in dim order, each output-warp lane storing its fragments' values as 2-byte scalars from registers
// (v22-v29's shipped layout); 0: fp32 (v21; the fused merge's builds, which read fp32). Other schedules write fp32.
// On an H200 bf16 in dim order measured 0.966-1.000x of fp32 (v22); staging the rows through the idle ring for
// 16-byte stores (fp32 or bf16) and pairing adjacent dims by a shuffle for 4-byte stores measured slower than either
// (code at commit 8c5a9db).
#ifndef MLAGEN_DST_PARTIAL_BF16
#define MLAGEN_DST_PARTIAL_BF16 2
#endif
static_assert(MLAGEN_DST_PARTIAL_BF16 >= 0 && MLAGEN_DST_PARTIAL_BF16 <= 2, "MLAGEN_DST_PARTIAL_BF16 must be 0, 1 or 2");

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

// One partial value (round to nearest even for bf16).
__device__ __forceinline__ void store_partial1(float* dst, float v) { *dst = v; }
__device__ __forceinline__ void store_partial1(__nv_bfloat16* dst, float v) { *dst = __float2bfloat16_rn(v); }

// The paired layout of bf16 partials (MLAGEN_DST_PARTIAL_BF16 2): in every 16-dim group of a partial row, dims i and
// i + 8 (i < 8) sit side by side at positions 2 i and 2 i + 1. Those are the two values one lane holds of an
// mma.sync m16n8 accumulator column (rows g and g + 8 of the m16 tile: PTX ISA, "Matrix Fragments for mma.m16n8k16",
// C / D layout), i.e. of the dimsplit_t output warps' O^T tile (m16 = 16 output dims), so a lane stores both with one
// 4-byte store and a warp's store covers whole 32-byte sectors (8 lanes x 4 bytes per row). Only the combine reads
// o_part; it undoes the permutation (paired_partial_dim_lo).
template <class PartialT>
inline constexpr bool kPartialPaired = std::is_same_v<PartialT, __nv_bfloat16> && MLAGEN_DST_PARTIAL_BF16 == 2;

// Dims i and i + 8 of the 16-dim group at group_row (a partial row + 16 m), i = g, rounded to bf16 (nearest even),
// with one 4-byte store at positions 2 g, 2 g + 1.
__device__ __forceinline__ void store_partial_pair(__nv_bfloat16* group_row, int g, float v_lo, float v_hi) {
  *reinterpret_cast<uint32_t*>(group_row + 2 * g) = ptx::pack_bf16x2(v_lo, v_hi);
}

// The output dims of the four partial values at positions pos .. pos + 3 of a row (pos a multiple of 4) in the paired
// layout, as two pairs of consecutive dims: positions (pos, pos + 2) hold dims d_lo, d_lo + 1 and (pos + 1, pos + 3)
// dims d_lo + 8, d_lo + 9.
__device__ __forceinline__ int paired_partial_dim_lo(int pos) { return (pos & ~15) + (pos & 15) / 2; }

}  // namespace mlagen
