// mlagen/mla_verify_batch.cuh — a request's KV length, block-table row, cache slots and tree-mask rows, read
// from the launch's batch inputs in one of two forms (MlaVerifyParams):
//   * metadata buffers (CUDA-graph steps): kv_lens int32 [bs], a page table (page ids, page_size kPageSize)
//     and tree bitmask rows int64 [bs, q_len], filled per step by include/mlagen/mla_verify_metadata.cuh or
//     by the caller;
//   * SGLang's batch state itself (eager steps, "direct": no metadata launch before the kernel), set by
//     seq_lens != null: kv_len = seq_lens[b] + kv_len_extra for b < num_real and 0 for the DP-padded rows
//     after them; block_table is SGLang's req_to_token (one cache slot per token at any page size:
//     slot of position pos = row[pos]); tree rows from tree_qlen_mask, SGLang's TreeMaskMode.QLEN_ONLY
//     custom mask (one byte per cell, request b's [q_len, q_len] block at b * q_len * q_len; cell [i, j]
//     != 0: draft i sees draft j, the same bits the metadata launch packs), or tree_mask with stride 0
//     (one row set shared by every request: the causal placeholder).
// Both forms give the kernels the same values for SGLang's valid batches; the direct form keeps every read
// inside its tensors for invalid ones too (kv_len clamped to [0, block_table_cols], a req_to_token row index
// outside [0, block_table_rows) read as row 0).
#pragma once
#include <cstdint>

#include "mlagen/mla_verify_params.cuh"

// Diagnostic builds only (tools/device_ab_define.py): MLAGEN_BATCH_DIRECT 1 (every shipped build) reads either form;
// 0 compiles the metadata-buffer form alone (run_direct is then wrong: never install such a build), to time what the
// direct form's run-time choices cost the kernels on metadata buffers (docs/perf-notes.md v17, the q_len 1 tile).
#ifndef MLAGEN_BATCH_DIRECT
#define MLAGEN_BATCH_DIRECT 1
#endif

namespace mlagen {

// Element i of an int32 or int64 index tensor (seq_lens, req_pool_indices) as int64; also the metadata kernel's
// (which indexes with int, the kernels here with int64).
template <class Index>
__device__ __forceinline__ int64_t batch_load_index(const void* ptr, int is_int64, Index i) {
  return is_int64 ? static_cast<const int64_t*>(ptr)[i] : static_cast<int64_t>(static_cast<const int32_t*>(ptr)[i]);
}

// Whether the launch passes SGLang's batch state itself (the direct form) rather than metadata buffers.
__device__ __forceinline__ bool batch_is_direct(const MlaVerifyParams& p) {
  return MLAGEN_BATCH_DIRECT && p.seq_lens != nullptr;
}

// Request b's KV length, its draft tokens included.
__device__ __forceinline__ int request_kv_len(const MlaVerifyParams& p, int b) {
  if (!batch_is_direct(p)) return p.kv_lens[b];
  if (b >= p.num_real) return 0;
  const int64_t n = batch_load_index(p.seq_lens, p.seq_lens_is_int64, static_cast<int64_t>(b)) + p.kv_len_extra;
  return n <= 0 ? 0 : static_cast<int>(n < p.block_table_cols ? n : p.block_table_cols);
}

// Request b's row of the block table (row req_idx[b] when SGLang's req_pool_indices are passed, else b).
__device__ __forceinline__ const int32_t* request_page_row(const MlaVerifyParams& p, int b) {
  int64_t table_row = b;
  if (p.req_idx != nullptr) {
    table_row = batch_load_index(p.req_idx, p.req_idx_is_int64, static_cast<int64_t>(b));
    if (batch_is_direct(p) && (table_row < 0 || table_row >= p.block_table_rows)) table_row = 0;
  }
  return p.block_table + table_row * p.block_table_stride;
}

// The table entry a loader fetches for position pos: a page id, or (direct) the token's slot.
template <int kPageSize>
__device__ __forceinline__ int32_t table_entry(const MlaVerifyParams& p, const int32_t* page_row, int pos) {
  return batch_is_direct(p) ? page_row[pos] : page_row[pos / kPageSize];
}

// The cache slot of position pos from its table entry (table_entry).
template <int kPageSize>
__device__ __forceinline__ int64_t entry_slot(const MlaVerifyParams& p, int32_t entry, int pos) {
  return batch_is_direct(p) ? static_cast<int64_t>(entry) : static_cast<int64_t>(entry) * kPageSize + pos % kPageSize;
}

// Tree bitmask of draft query qi of request b (bit j: qi sees draft token j).
__device__ __forceinline__ int64_t request_tree_row(const MlaVerifyParams& p, int b, int qi) {
  if (!MLAGEN_BATCH_DIRECT || p.tree_qlen_mask == nullptr) {
    return p.tree_mask[static_cast<int64_t>(b) * p.tree_mask_stride + qi];
  }
  const uint8_t* cells = p.tree_qlen_mask + (static_cast<int64_t>(b) * p.q_len + qi) * p.q_len;
  uint64_t bits = 0;
#pragma unroll 4
  for (int j = 0; j < p.q_len; ++j) bits |= static_cast<uint64_t>(cells[j] != 0) << j;
  return static_cast<int64_t>(bits);
}

}  // namespace mlagen
