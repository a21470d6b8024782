// mlagen/mla_verify_new_kv.cuh — this step's draft KV rows inside the verify launch.
// With MlaVerifyParams::k_new set, the loaders take draft token i of request b from k_new row
// (b * q_len + i) instead of the cache (a "new-row slot", encoded as a negative slot <= -2), so the
// launch does not depend on a separate KV write; one CTA per request stores the rows to the cache at
// kv_write_loc (SGLang's out_cache_loc) for later steps. No CTA of the launch reads those slots (their
// tokens come from k_new), so the store needs no ordering against the loads.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>

#include "mlagen/mla_verify_batch.cuh"
#include "mlagen/mla_verify_fp8.cuh"
#include "mlagen/mla_verify_params.cuh"

namespace mlagen {

inline constexpr int64_t kNoSlot = -1;  // a token past kv_len: nothing to load

// Slot of draft row `row` (b * q_len + i) of k_new: -2 - row (never -1, never a cache slot).
__device__ __forceinline__ int64_t new_row_slot(int64_t row) { return -2 - row; }

// Global address of a token's row (a cache slot >= 0 or a new-row slot <= -2); `dim` elements in.
__device__ __forceinline__ const __nv_bfloat16* kv_row_src(const MlaVerifyParams& p, int64_t slot, int dim = 0) {
  return slot >= 0 ? p.kv + slot * p.kv_stride_slot + dim : p.k_new + (-2 - slot) * p.k_new_stride_tok + dim;
}

// Slot of position `pos` of request b: from k_new for the draft positions when k_new is set, else from
// the block table (mla_verify_batch.cuh).
template <int kPageSize>
__device__ __forceinline__ int64_t token_slot(const MlaVerifyParams& p, const int32_t* page_row, int b, int pos,
                                              int prefix_len) {
  if (p.k_new != nullptr && pos >= prefix_len) return new_row_slot(static_cast<int64_t>(b) * p.q_len + (pos - prefix_len));
  return entry_slot<kPageSize>(p, table_entry<kPageSize>(p, page_row, pos), pos);
}

// Global address of position `pos`'s row as an int64 (never kNoSlot): what the loaders keep per token, so
// the per-copy address is one add (no page-table or k_new arithmetic in the copy loops).
template <int kPageSize>
__device__ __forceinline__ int64_t token_row_addr(const MlaVerifyParams& p, const int32_t* page_row, int b, int pos,
                                                  int prefix_len) {
  return reinterpret_cast<int64_t>(kv_row_src(p, token_slot<kPageSize>(p, page_row, b, pos, prefix_len)));
}

// The row address kept by a loader, `dim` elements in.
__device__ __forceinline__ const __nv_bfloat16* row_at(int64_t addr, int dim = 0) {
  return reinterpret_cast<const __nv_bfloat16*>(addr) + dim;
}

// Store request b's q_len rows of k_new (dims [dim0, dim0 + dims), a multiple of 8) to the cache at
// kv_write_loc, 8 values per thread-step; called by every thread of the one CTA that writes request b.
// kE4m3: the cache holds e4m3 bytes (kv_stride_slot in bytes) and each bf16 value is quantized as
// SGLang's KV write casts it (bf16x8_to_e4m3x8: round to nearest even, saturating).
template <bool kE4m3 = false>
__device__ __forceinline__ void store_new_kv_rows(const MlaVerifyParams& p, int b, int dim0, int dims, int tid,
                                                  int nthreads) {
  if (p.k_new == nullptr || p.kv_write_loc == nullptr) return;
  const int chunks = dims / 8;
  const int total = p.q_len * chunks;
  for (int c = tid; c < total; c += nthreads) {
    const int i = c / chunks;
    const int dim = dim0 + (c % chunks) * 8;
    const int64_t row = static_cast<int64_t>(b) * p.q_len + i;
    const int64_t loc = p.kv_write_loc[row];
    if (loc < 0 || loc >= p.kv_num_slots) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(p.k_new + row * p.k_new_stride_tok + dim);
    if constexpr (kE4m3) {
      uint8_t* kv = reinterpret_cast<uint8_t*>(const_cast<__nv_bfloat16*>(p.kv));
      *reinterpret_cast<uint2*>(kv + loc * p.kv_stride_slot + dim) = bf16x8_to_e4m3x8(v);
    } else {
      *reinterpret_cast<uint4*>(const_cast<__nv_bfloat16*>(p.kv) + loc * p.kv_stride_slot + dim) = v;
    }
  }
}

}  // namespace mlagen
