// mlagen/mla_verify_metadata.cuh — one launch that turns SGLang's batch state into the verify
// kernel's per-batch inputs (kv_lens, block table, tree bitmasks): the fused form of the torch
// helpers in mlagen/sglang_plugin/metadata.py (fill_kv_lens, fill_block_table, causal_bits,
// pack_qlen_mask, pack_full_mask), which stay the CPU path and this kernel's test reference.
//
// Graph safe: no allocation, no host sync; every length is read on the device. Sizes and strides
// are in elements. Layouts of SGLang 0.5.23:
//   * seq_lens [bs] int32/int64: the verify batch's prefix lengths, draft tokens excluded (their
//     slots sit at req_to_token columns seq_len .. seq_len + q_len - 1,
//     EagleVerifyInput.generate_attn_arg_prefill), so kv_len = seq_len + q_len ("extra").
//   * req_to_token [pool_rows, width] int32 slot ids (ReqToTokenPool); a page's slots are
//     contiguous and page-aligned, so page id = slot of the page's first token / page_size.
//   * custom mask (bool/uint8, 1-D, one byte per cell), per TreeMaskMode
//     (sglang/kernels/ops/speculative/spec_tree.py, re-exported by srt/speculative/eagle_utils;
//     sizes in srt/layers/attention/verify_mask.py tree_mask_numel):
//       QLEN_ONLY: request b's block is row-major [q_len, q_len] at b * q_len * q_len;
//       FULL_MASK: request b's block is row-major [q_len, seq_len[b] + q_len] at
//                  sum_{r<b} (seq_len[r] + q_len) * q_len (sgl_build_tree_kernel_efficient's
//                  q*q*b + prefix_sum(seq_len)*q); cell [i, seq_len[b] + j] = draft i sees draft j.
//   * tree mask out [bs, q_len] int64: bit j of row i = draft query i sees draft token j.
//
// Grid (bs, page chunks), kMetaThreads threads: block (b, c) gathers pages
// [c * kMetaPagesPerBlock, (c + 1) * kMetaPagesPerBlock) of request b's block-table row (a long
// context is many pages: one CTA per request would gather them serially on one SM); the c == 0
// block also writes kv_lens[b] and tree row b (one warp per draft row, 64 mask cells read as two
// coalesced 32-lane ballots). FULL_MASK's start offset is an in-block reduction over r < b.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "mlagen/mla_verify_batch.cuh"  // batch_load_index

namespace mlagen {

// How the tree-mask output is filled (an int from Python; values are part of the module ABI).
enum MetaTreeMode : int {
  kMetaTreeNone = 0,      // no tree output (tree_mask may be null)
  kMetaTreeCausal = 1,    // every row b < bs: row i has bits 0..i (chain drafts; capture placeholder)
  kMetaTreeQLenOnly = 2,  // SGLang TreeMaskMode.QLEN_ONLY custom mask
  kMetaTreeFullMask = 3,  // SGLang TreeMaskMode.FULL_MASK custom mask
};

constexpr int kMetaThreads = 128;
constexpr int kMetaPagesPerThread = 8;
constexpr int kMetaPagesPerBlock = kMetaThreads * kMetaPagesPerThread;
constexpr int kMetaMaxQLen = 64;  // bits of an int64 row

struct MlaMetadataParams {
  // ---- inputs
  const void* seq_lens;  // [>= bs] int32 or int64
  int seq_lens_is_int64;
  const void* req_pool_indices;  // [>= bs] int32 or int64: rows of req_to_token
  int rpi_is_int64;
  const int32_t* req_to_token;  // [pool_rows, width] slot ids
  int64_t req_to_token_stride;  // row stride
  int64_t pool_rows;  // a row index outside [0, pool_rows) gets page 0 everywhere (never read out of bounds)
  const uint8_t* custom_mask;  // 1-D, one byte per cell (bool / uint8); QLEN_ONLY / FULL_MASK only
  int64_t custom_mask_numel;  // cells past it read as 0 (never read out of bounds)
  // ---- outputs
  int32_t* kv_lens;  // [bs]: seq_lens[b] + extra, 0 for the last num_padding rows
  int32_t* block_table;  // [bs, >= npages]: columns >= npages untouched
  int64_t block_table_stride;
  int64_t* tree_mask;  // [bs, >= q_len] or null (tree_mode none); columns >= q_len untouched
  int64_t tree_mask_stride;
  // ---- sizes
  int batch_size;  // bs, padded rows included
  int num_padding;  // the last num_padding rows are padding (kv_len 0, zero tree rows, mask never read)
  int extra;  // added to seq_lens (q_len for verify, 0 for decode)
  int npages;  // block-table columns to write: page p reads req_to_token[row, p * page_size]
  int page_size;
  int q_len;  // draft tokens per request (tree rows / bits), 1..64 when tree_mode != none
  int tree_mode;  // MetaTreeMode
};

// torch.div(x, d, rounding_mode="floor") for int32 (C++ '/' truncates toward zero).
__device__ __forceinline__ int32_t meta_floor_div(int32_t x, int32_t d) {
  const int32_t q = x / d;
  return (x % d != 0 && ((x < 0) != (d < 0))) ? q - 1 : q;
}

__device__ __forceinline__ bool meta_cell(const MlaMetadataParams& p, int64_t idx) {
  return idx >= 0 && idx < p.custom_mask_numel && p.custom_mask[idx] != 0;
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads) mla_verify_metadata_kernel(const MlaMetadataParams p) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  constexpr int kWarps = kThreads / 32;
  const int b = blockIdx.x;
  const int tid = threadIdx.x;

  // ---- block table: pages [chunk0, chunk0 + kMetaPagesPerBlock) of row b (all loads, then all stores)
  {
    int64_t row = batch_load_index(p.req_pool_indices, p.rpi_is_int64, b);
    const bool row_ok = row >= 0 && row < p.pool_rows;
    const int32_t* src = p.req_to_token + (row_ok ? row : 0) * p.req_to_token_stride;
    int32_t* dst = p.block_table + static_cast<int64_t>(b) * p.block_table_stride;
    const int64_t chunk0 = static_cast<int64_t>(blockIdx.y) * kMetaPagesPerBlock;
    int32_t v[kMetaPagesPerThread];
#pragma unroll
    for (int k = 0; k < kMetaPagesPerThread; ++k) {
      const int64_t pg = chunk0 + k * kThreads + tid;
      v[k] = (row_ok && pg < p.npages) ? src[pg * p.page_size] : 0;
    }
#pragma unroll
    for (int k = 0; k < kMetaPagesPerThread; ++k) {
      const int64_t pg = chunk0 + k * kThreads + tid;
      if (pg < p.npages) dst[pg] = p.page_size > 1 ? meta_floor_div(v[k], p.page_size) : v[k];
    }
  }
  if (blockIdx.y != 0) return;

  // ---- kv_lens (torch: seq_lens + extra, copied into int32: the low 32 bits)
  const int real = p.batch_size - p.num_padding;
  const bool padded = b >= real;
  const int64_t len = batch_load_index(p.seq_lens, p.seq_lens_is_int64, b);
  if (tid == 0) p.kv_lens[b] = padded ? 0 : static_cast<int32_t>(len + p.extra);

  if (p.tree_mode == kMetaTreeNone || p.tree_mask == nullptr) return;
  const int q = p.q_len;
  int64_t* tree = p.tree_mask + static_cast<int64_t>(b) * p.tree_mask_stride;
  if (p.tree_mode == kMetaTreeCausal) {  // bits 0..i; i = 63: all 64 bits
    for (int i = tid; i < q; i += kThreads) {
      tree[i] = static_cast<int64_t>(i >= 63 ? ~0ull : (1ull << (i + 1)) - 1ull);
    }
    return;
  }
  if (padded) {  // padded rows never index the mask (it covers the real rows only)
    for (int i = tid; i < q; i += kThreads) tree[i] = 0;
    return;
  }
  // Block of request b: cell [i, j] at base + i * row_width + col0 + j.
  int64_t base, row_width, col0;
  if (p.tree_mode == kMetaTreeQLenOnly) {
    base = static_cast<int64_t>(b) * q * q;
    row_width = q;
    col0 = 0;
  } else {  // FULL_MASK: start = sum_{r<b} (seq_lens[r] + q) * q over real rows (b < real here)
    __shared__ int64_t warp_sums[kWarps];
    int64_t s = 0;
    for (int r = tid; r < b; r += kThreads) s += (batch_load_index(p.seq_lens, p.seq_lens_is_int64, r) + q) * q;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if ((tid & 31) == 0) warp_sums[tid >> 5] = s;
    __syncthreads();
    base = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) base += warp_sums[w];
    row_width = len + q;
    col0 = len;
  }
  const int lane = tid & 31;
  for (int i = tid >> 5; i < q; i += kWarps) {
    const int64_t r0 = base + static_cast<int64_t>(i) * row_width + col0;
    const unsigned lo = __ballot_sync(0xffffffffu, lane < q && meta_cell(p, r0 + lane));
    const unsigned hi = __ballot_sync(0xffffffffu, lane + 32 < q && meta_cell(p, r0 + lane + 32));
    if (lane == 0) tree[i] = static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo);
  }
}

// Fill kv_lens / block table / tree mask of a batch in one launch on ``stream``.
// Returns cudaErrorInvalidValue (nothing launched) for sizes out of range: batch_size < 0,
// num_padding outside [0, batch_size], npages < 0, page_size < 1, an unknown tree_mode, q_len
// outside [1, 64] or a null tree_mask with a tree mode, a null custom_mask (with real rows) for
// QLEN_ONLY / FULL_MASK, or more than 65,535 page chunks; else the launch's error.
inline cudaError_t mla_verify_metadata_launch(const MlaMetadataParams& p, cudaStream_t stream) {
  if (p.batch_size < 0 || p.num_padding < 0 || p.num_padding > p.batch_size || p.npages < 0 || p.page_size < 1)
    return cudaErrorInvalidValue;
  if (p.tree_mode < kMetaTreeNone || p.tree_mode > kMetaTreeFullMask) return cudaErrorInvalidValue;
  if (p.tree_mode != kMetaTreeNone && (p.q_len < 1 || p.q_len > kMetaMaxQLen || p.tree_mask == nullptr))
    return cudaErrorInvalidValue;
  const bool reads_mask = p.tree_mode == kMetaTreeQLenOnly || p.tree_mode == kMetaTreeFullMask;
  if (reads_mask && p.custom_mask == nullptr && p.batch_size > p.num_padding) return cudaErrorInvalidValue;
  if (p.seq_lens == nullptr || p.req_pool_indices == nullptr || p.req_to_token == nullptr || p.kv_lens == nullptr ||
      p.block_table == nullptr)
    return p.batch_size == 0 ? cudaSuccess : cudaErrorInvalidValue;
  if (p.batch_size == 0) return cudaSuccess;
  const int64_t chunks = p.npages > 0 ? (static_cast<int64_t>(p.npages) + kMetaPagesPerBlock - 1) / kMetaPagesPerBlock : 1;
  if (chunks > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.batch_size), static_cast<unsigned>(chunks));
  mla_verify_metadata_kernel<kMetaThreads><<<grid, kMetaThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlagen
