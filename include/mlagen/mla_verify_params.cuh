// mlagen/mla_verify_params.cuh — runtime arguments of the verify kernels (device pointers,
// sizes, strides in elements). Filled by the pybind11 module from Python ints; no torch types.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>

namespace mlagen {

struct MlaVerifyParams {
  // q: [bs * q_len, H, 576] bf16; row (b, i, h) at q + (b*q_len + i)*q_stride_tok + h*q_stride_head.
  const __nv_bfloat16* q;
  int64_t q_stride_tok, q_stride_head;
  // kv: [num_slots, 576] bf16 latent cache; V = first 512 dims of the same row.
  const __nv_bfloat16* kv;
  int64_t kv_stride_slot;
  // block_table: int32 page ids, request b reads row req_idx[b] (or b when req_idx is null);
  // slot of token t = block_table[row][t / page_size] * page_size + t % page_size
  // (page_size 1: SGLang's req_to_token).
  const int32_t* block_table;
  int64_t block_table_stride;
  const void* req_idx;  // int32 or int64 [bs], may be null
  int req_idx_is_int64;
  const int32_t* kv_lens;  // [bs], includes the q_len draft tokens (unused when seq_lens is set)
  const int64_t* tree_mask;  // [bs, q_len] bitmask rows (tree mask only); stride 0: one row set for all
  int64_t tree_mask_stride;
  // SGLang's batch state read directly (eager steps; mla_verify_batch.cuh), all null / 0 otherwise:
  // seq_lens int32 / int64 [>= bs] (kv_len = seq_lens[b] + kv_len_extra for b < num_real, 0 after), and
  // block_table is then req_to_token [block_table_rows, block_table_cols] of token slots; tree_qlen_mask
  // (bool / uint8, QLEN_ONLY layout) replaces tree_mask when set.
  const void* seq_lens;
  int seq_lens_is_int64;
  int kv_len_extra;
  int num_real;
  int64_t block_table_rows, block_table_cols;
  const uint8_t* tree_qlen_mask;
  // workspace: o_part [bs, num_splits, rows_max, 512] (fp32, or bf16 in the region's first half for dimsplit_t
  // builds with MLAGEN_DST_PARTIAL_BF16 1 or 2: mla_verify_partial_store.cuh), lse_part [bs, num_splits, rows_max] fp32
  float* o_part;
  float* lse_part;
  // out: [bs * q_len, H, 512] bf16; lse: [bs * q_len, H] fp32 (may be null)
  __nv_bfloat16* out;
  int64_t out_stride_tok, out_stride_head;
  float* lse;
  int64_t lse_stride_tok;
  // This step's draft rows (optional; k_new null: every token is read from kv):
  // k_new [bs * q_len, 576] bf16, row (b, i) at k_new + (b*q_len + i)*k_new_stride_tok, rows 16-byte aligned.
  // Draft token i of request b (position kv_len - q_len + i) is then read from k_new, never from kv, and
  // when kv_write_loc (int64 [bs * q_len], SGLang's out_cache_loc) is set, the rows are also stored to
  // kv[kv_write_loc[b*q_len + i]] (slots outside [0, kv_num_slots) are skipped) for later steps.
  // The store is not ordered against this launch's cache reads: a kv_write_loc slot must not be one that
  // any request reads at a prefix position (SGLang's out_cache_loc: fresh slots or its padding slot).
  const __nv_bfloat16* k_new;
  int64_t k_new_stride_tok;
  const int64_t* kv_write_loc;
  int64_t kv_num_slots;
  // The fused merge (dimsplit_t diagnostic builds only; mla_verify_merge.cuh): two unsigned ints, 0 before the launch, or
  // null for the separate combine kernel. The launch clears it when the grid would not fit on the device at once.
  unsigned int* merge_counters;
  int batch_size;
  int q_len;
  int num_splits;
  int min_tiles_per_split;
  float softmax_scale;
};

}  // namespace mlagen
