// mlagen/mla_verify_partial.cuh — split-KV partial kernel of MLA verify attention.
//
// CTA (row block rb, split s, request b) computes, for rows r = (query i, head h) in its block,
// over the KV tiles of split s:
//   scores  S = (Q K^T) * softmax_scale          Q: [rows, 576], K: [tokens, 576]
//   masked  S = -inf where the key is past kv_len or hidden by the draft mask
//   softmax online over tiles: running row max m, row sum l, rescale alpha = 2^(m_old - m_new)
//   output  O = P V / l                           V = K[:, :512]
// and writes O (fp32) and LSE = ln(sum exp S) to the workspace; mla_verify_combine.cuh merges splits.
// Work split inside a CTA: warp (token group, k group) computes partial scores of all rows over
// its slice of the 576 dims (its Q slice lives in registers), partials are summed in shared memory, and for
// P V every warp owns 512 / kWarps output dims of all rows. KV tiles stream through a
// kStages-deep ring, filled either by every thread's cp.async chunks (load_width 32/64/128) or by
// one cp.async.bulk per token row, spread over the warps, and an mbarrier per stage (load_width bulk).
// Token positions past kv_len are zero-filled, never read.
#pragma once
#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>

#include "mlagen/mla_verify_batch.cuh"
#include "mlagen/mla_verify_config.cuh"
#include "mlagen/mla_verify_params.cuh"
#include "mlagen/mla_verify_new_kv.cuh"
#include "mlagen/mla_verify_split.cuh"
#include "mlagen/ptx.cuh"

// Diagnostic builds only (tools/device_ablate.py): MLAGEN_ABLATE drops phases of the main loop so
// that timing differences show what each costs. The output is then wrong. Bits: 1 KV loads (and
// their waits), 2 Q K^T MMAs, 4 softmax pass, 8 P V MMAs, 16 the two barriers inside a tile, 32 the dimsplit_t
// score exchange between the cluster's CTAs (st.async and its waits), 256 the bf16 cluster producer's page-table loads
// (dimsplit_produce_bf16 takes the position as the cache slot).
// 0 (the default, every shipped build) compiles to the full kernel.
#ifndef MLAGEN_ABLATE
#define MLAGEN_ABLATE 0
#endif

namespace mlagen {

inline constexpr int kAblate = MLAGEN_ABLATE;
inline constexpr int kAblateLoads = 1, kAblateScores = 2, kAblateSoftmax = 4, kAblatePV = 8, kAblateBarriers = 16,
                     kAblateExchange = 32,
                     // e4m3 dimsplit_t: no e4m3 -> bf16 conversion (the output warps still pass its barriers); no wait
                     // for the bf16 stage's release before converting (races: a timing diagnostic only)
                     kAblateConvert = 64, kAblateConvertWait = 128,
                     // the bf16 cluster producer reads no page table: position pos is its slot (wrong rows; with
                     // kAblateLoads only the L2 prefetch addresses them)
                     kAblateTable = 256;

// Zeroes an array of mma accumulator fragments, [tiles][n tiles][4] fp32.
template <int kA, int kB>
__device__ __forceinline__ void zero_fragments(float (&f)[kA][kB][4]) {
#pragma unroll
  for (int a = 0; a < kA; ++a)
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) f[a][b][e] = 0.f;
}

// A row's log-sum-exp (natural log) from its running max in log2 units and its sum of exp2(s - max); -inf for a
// row with nothing visible (l = 0): the dimsplit-family kernels' lse_part, read by the combine.
__device__ __forceinline__ float row_lse(float m_log2, float l) {
  return l > 0.f ? (m_log2 + log2f(l)) * 0.6931471805599453f : -INFINITY;
}

template <class Cfg>
__device__ __forceinline__ bool key_visible(int key_pos, int kv_len, int prefix_len, int query_idx,
                                            int64_t mask_row) {
  if (key_pos >= kv_len) return false;
  const int d = key_pos - prefix_len;  // draft index of the key, < 0 for the prefix
  if (d < 0) return true;
  if constexpr (Cfg::kMask == MaskKind::kCausal) {
    return d <= query_idx;
  } else if constexpr (Cfg::kMask == MaskKind::kTree) {
    return (mask_row >> d) & 1;
  } else {
    return true;
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) mla_verify_partial_kernel(const MlaVerifyParams p) {
  ptx::griddep_launch_dependents();  // the combine's CTAs may be scheduled now; they wait for this grid's end
  if constexpr (Cfg::kPdl == 1) ptx::griddep_wait();  // (MLAGEN_ROWBLOCK_PDL 1: before any global access)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* kv_smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kStages][kBlockN][kKvRowElems]
  float* s_part_smem = reinterpret_cast<float*>(smem_raw + Cfg::kSmemKv);  // [kWarps][kRowsPerCta][kBlockN]
  __nv_bfloat16* p_smem =
      reinterpret_cast<__nv_bfloat16*>(smem_raw + Cfg::kSmemKv + Cfg::kSmemS);  // [kRowsPerCta][kPRowElems]
  float* m_smem = reinterpret_cast<float*>(smem_raw + Cfg::kSmemKv + Cfg::kSmemS + Cfg::kSmemP);
  float* l_smem = m_smem + Cfg::kRowsPerCta;
  float* alpha_smem = l_smem + Cfg::kRowsPerCta;
  // cp.async path: cache slot of each token of the tiles in flight, slot_smem[(tile - tile_begin) % kStages][n],
  // -1 past kv_len. Bulk path: full_bar[stage] completes when the stage's rows have landed.
  int64_t* slot_smem = reinterpret_cast<int64_t*>(alpha_smem + Cfg::kRowsPerCta);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem_raw + Cfg::kSmemKv + Cfg::kSmemS + Cfg::kSmemP +
                                                   Cfg::kSmemStats + Cfg::kSmemSlots);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // mma fragment row group
  const int t4 = lane % 4;

  const int row_block = blockIdx.x;
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int q_len = p.q_len;
  const int rows = q_len * Cfg::kHeads;
  const int row0 = row_block * Cfg::kRowsPerCta;
  if (row0 >= rows) return;
  const int live_rows = rows - row0 < Cfg::kRowsPerCta ? rows - row0 : Cfg::kRowsPerCta;

  const int kv_len = request_kv_len(p, b);
  const int prefix_len = kv_len - q_len;
  int tile_begin, tile_end;
  split_tile_range(kv_len, Cfg::kBlockN, p.num_splits, p.min_tiles_per_split, split, tile_begin, tile_end);

  if (row_block == 0 && split == 0) store_new_kv_rows(p, b, 0, Cfg::kDimQK, tid, Cfg::kThreads);

  const int64_t ws_row_base = (static_cast<int64_t>(b) * p.num_splits + split) * Cfg::kRowsMax + row0;
  float* lse_part = p.lse_part + ws_row_base;
  if (tile_begin >= tile_end) {  // empty split: contributes nothing
    for (int r = tid; r < live_rows; r += Cfg::kThreads) lse_part[r] = -INFINITY;
    return;
  }

  const int32_t* page_row = request_page_row(p, b);

  // ---- page-table gather: thread n < kBlockN owns token n of a tile. Its global load is issued
  // one iteration before the slot is needed, so the dependent load stays off the critical path.
  // "slot" below: the global address of a token's row (token_row_addr), kNoSlot past kv_len.
  auto slot_at = [&](int pos) -> int64_t {  // row address of token position pos < kv_len (mla_verify_new_kv.cuh)
    return token_row_addr<Cfg::kPageSize>(p, page_row, b, pos, prefix_len);
  };
  auto slot_of = [&](int tile) -> int64_t {
    const int pos = tile * Cfg::kBlockN + tid;
    return tid < Cfg::kBlockN && pos < kv_len ? slot_at(pos) : kNoSlot;
  };
  auto ring = [&](int tile) { return slot_smem + ((tile - tile_begin) % Cfg::kStages) * Cfg::kBlockN; };

  // ---- KV tile loader: kBlockN tokens x 576 dims, one cp.async of kLoadBytes per chunk;
  // tokens past kv_len are zero-filled without a read.
  auto load_kv_tile = [&](int tile) {
    __nv_bfloat16* dst_stage = kv_smem + ((tile - tile_begin) % Cfg::kStages) * (Cfg::kBlockN * Cfg::kKvRowElems);
    const int64_t* slots = ring(tile);
#pragma unroll 4
    for (int c = tid; c < Cfg::kBlockN * Cfg::kChunksPerRow; c += Cfg::kThreads) {
      const int n = c / Cfg::kChunksPerRow;
      const int chunk = c % Cfg::kChunksPerRow;
      const int64_t slot = slots[n];
      const bool valid = slot != kNoSlot;
      const __nv_bfloat16* src = valid ? row_at(slot, chunk * Cfg::kLoadElems) : p.kv;
      ptx::cp_async_zfill<Cfg::kLoadBytes>(dst_stage + n * Cfg::kKvRowElems + chunk * Cfg::kLoadElems, src, valid);
    }
  };

  // ---- bulk loader: token n of a tile belongs to lane n % kBulkTokensPerWarp of warp n / kBulkTokensPerWarp,
  // which copies its 576-dim row with one cp.async.bulk (the copy engine serializes a warp's bulk
  // copies, so the tile is spread over all warps). Thread 0 posts the tile's byte count on the
  // stage's mbarrier. Rows past kv_len (last tile of a request) are zeroed with plain stores; the
  // __syncthreads of a later iteration makes them visible before the tile is consumed.
  const int bulk_n = warp * Cfg::kBulkTokensPerWarp + lane;
  const bool bulk_lane = lane < Cfg::kBulkTokensPerWarp && bulk_n < Cfg::kBlockN;
  auto bulk_slot = [&](int tile) -> int64_t {
    const int pos = tile * Cfg::kBlockN + bulk_n;
    return bulk_lane && pos < kv_len ? slot_at(pos) : kNoSlot;
  };
  auto bulk_load_tile = [&](int tile, int64_t slot) {
    const int stage = (tile - tile_begin) % Cfg::kStages;
    __nv_bfloat16* dst_stage = kv_smem + stage * (Cfg::kBlockN * Cfg::kKvRowElems);
    const int left = kv_len - tile * Cfg::kBlockN;
    const int valid = left < Cfg::kBlockN ? left : Cfg::kBlockN;
    if (tid == 0) ptx::mbarrier_arrive_expect_tx(full_bar + stage, static_cast<uint32_t>(valid) * Cfg::kRowBytes);
    if (!bulk_lane) return;
    if (bulk_n < valid) {
      ptx::bulk_copy_g2s(dst_stage + bulk_n * Cfg::kKvRowElems, row_at(slot), Cfg::kRowBytes,
                         full_bar + stage);
    } else {
      uint4* row = reinterpret_cast<uint4*>(dst_stage + bulk_n * Cfg::kKvRowElems);
      for (int c = 0; c < Cfg::kKvRowElems * 2 / 16; ++c) row[c] = make_uint4(0u, 0u, 0u, 0u);
      ptx::fence_proxy_async_smem();  // the row may be bulk-written again later
    }
  };
  int64_t slot_next = -1;  // bulk: this lane's slot in the next tile to issue

  // Prologue: slots of the first kStages tiles, then the first kStages - 1 tiles in flight.
  if constexpr (Cfg::kBulkLoad) {
    if (tid == 0) {
      for (int st = 0; st < Cfg::kStages; ++st) ptx::mbarrier_init(full_bar + st, 1);
      ptx::fence_barrier_init();
    }
    __syncthreads();
    for (int st = 0; st < Cfg::kStages - 1; ++st) {
      if (!(kAblate & kAblateLoads) && tile_begin + st < tile_end) bulk_load_tile(tile_begin + st, bulk_slot(tile_begin + st));
    }
    const int first_ahead = tile_begin + Cfg::kStages - 1;
    slot_next = first_ahead < tile_end ? bulk_slot(first_ahead) : -1;
  } else {
    for (int st = 0; st < Cfg::kStages; ++st) {
      if (tid < Cfg::kBlockN) ring(tile_begin + st)[tid] = tile_begin + st < tile_end ? slot_of(tile_begin + st) : -1;
    }
    __syncthreads();
#pragma unroll
    for (int st = 0; st < Cfg::kStages - 1; ++st) {
      if (!(kAblate & kAblateLoads) && tile_begin + st < tile_end) load_kv_tile(tile_begin + st);
      ptx::cp_async_commit();
    }
  }

  // ---- Q slice of this warp in registers, as mma A fragments: q_frag[row tile][k step][4].
  const int k_group = warp % Cfg::kKGroups;
  const int n_group = warp / Cfg::kKGroups;
  const int ks_begin = k_group * Cfg::kKSteps / Cfg::kKGroups;
  const int ks_end = (k_group + 1) * Cfg::kKSteps / Cfg::kKGroups;
  uint32_t q_frag[Cfg::kRowTiles][Cfg::kKStepsPerWarp][4];
#pragma unroll
  for (int mt = 0; mt < Cfg::kRowTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 16 + g + half * 8;
      const bool row_ok = r < live_rows;
      const int row = row0 + r;
      const int qi = row / Cfg::kHeads, h = row % Cfg::kHeads;
      const __nv_bfloat16* q_row =
          p.q + (static_cast<int64_t>(b) * q_len + qi) * p.q_stride_tok + static_cast<int64_t>(h) * p.q_stride_head;
#pragma unroll
      for (int kk = 0; kk < Cfg::kKStepsPerWarp; ++kk) {
        const int k0 = (ks_begin + kk) * 16 + 2 * t4;
        const bool ok = row_ok && (ks_begin + kk < ks_end);
        q_frag[mt][kk][half] = ok ? *reinterpret_cast<const uint32_t*>(q_row + k0) : 0u;
        q_frag[mt][kk][half + 2] = ok ? *reinterpret_cast<const uint32_t*>(q_row + k0 + 8) : 0u;
      }
    }
  }

  for (int r = tid; r < Cfg::kRowsPerCta; r += Cfg::kThreads) {
    m_smem[r] = -INFINITY;
    l_smem[r] = 0.f;
  }

  float o_acc[Cfg::kRowTiles][Cfg::kNTilesO][4];
  zero_fragments(o_acc);

  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;  // exp(x) = 2^(x log2 e)
  // Tree-mask row of each softmax row this thread owns (fixed across tiles), loaded once.
  constexpr int kSoftmaxPasses = (Cfg::kRowsPerCta + Cfg::kRowsPerPass - 1) / Cfg::kRowsPerPass;
  int64_t mask_rows[kSoftmaxPasses];
#pragma unroll
  for (int ps = 0; ps < kSoftmaxPasses; ++ps) {
    const int r = ps * Cfg::kRowsPerPass + tid / Cfg::kSoftmaxLanes;
    mask_rows[ps] = 0;
    if constexpr (Cfg::kMask == MaskKind::kTree) {
      if (r < live_rows) mask_rows[ps] = request_tree_row(p, b, (row0 + r) / Cfg::kHeads);
    }
  }
  const int dim_v0 = warp * Cfg::kDimVPerWarp;

  // ---- the three phases of a tile, shared by both loop schedules below.
  // Q K^T partial scores of the K tile in stage `stage`, stored to the partial-score buffer s_buf.
  auto compute_scores = [&](int stage, float* s_buf) {
    const __nv_bfloat16* k_smem = kv_smem + stage * (Cfg::kBlockN * Cfg::kKvRowElems);
    // ---- partial scores over this warp's k slice: s_frag[row tile][n8 tile][4]
    float s_frag[Cfg::kRowTiles][Cfg::kNTilesS][4];
    zero_fragments(s_frag);
#pragma unroll
    for (int kk = 0; kk < Cfg::kKStepsPerWarp; ++kk) {
      if (!(kAblate & kAblateScores) && ks_begin + kk < ks_end) {
        const int k0 = (ks_begin + kk) * 16;
        // matrices: (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi) of this warp's 16 tokens
        const int m = lane / 8;
        const int n = n_group * 16 + (m / 2) * 8 + lane % 8;
        uint32_t kb[4];
        ptx::ldmatrix_x4(kb, k_smem + n * Cfg::kKvRowElems + k0 + (m % 2) * 8);
#pragma unroll
        for (int mt = 0; mt < Cfg::kRowTiles; ++mt) {
          ptx::mma_bf16_16816(s_frag[mt][0], q_frag[mt][kk], kb[0], kb[1]);
          ptx::mma_bf16_16816(s_frag[mt][1], q_frag[mt][kk], kb[2], kb[3]);
        }
      }
    }
    float* s_mine = s_buf + k_group * (Cfg::kRowsPerCta * Cfg::kSRowFloats);
#pragma unroll
    for (int mt = 0; mt < Cfg::kRowTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
        const int c = n_group * 16 + nt * 8 + 2 * t4;
        *reinterpret_cast<float2*>(s_mine + (mt * 16 + g) * Cfg::kSRowFloats + c) =
            make_float2(s_frag[mt][nt][0], s_frag[mt][nt][1]);
        *reinterpret_cast<float2*>(s_mine + (mt * 16 + g + 8) * Cfg::kSRowFloats + c) =
            make_float2(s_frag[mt][nt][2], s_frag[mt][nt][3]);
      }
  };
  // Online softmax of tile `tile` from s_buf: P (bf16) to p_smem, running max / sum, alpha.
  auto softmax_pass = [&](int tile, const float* s_buf) {
    // ---- online softmax: 8 lanes per row, kColsPerLane columns each. A tile wholly inside the
    // prefix (every tile but the last one or two of a request) needs no per-key mask test.
    const bool tile_in_prefix = (tile + 1) * Cfg::kBlockN <= prefix_len;
#pragma unroll
    for (int r0 = 0; r0 < ((kAblate & kAblateSoftmax) ? 0 : Cfg::kRowsPerCta); r0 += Cfg::kRowsPerPass) {
      const int r = r0 + tid / Cfg::kSoftmaxLanes;
      const int c0 = (tid % Cfg::kSoftmaxLanes) * Cfg::kColsPerLane;
      const bool row_in_cta = r < Cfg::kRowsPerCta;  // warp-uniform groups of 8 lanes
      const bool row_live = r < live_rows;
      const int qi = (row0 + r) / Cfg::kHeads;
      const int64_t mask_row = mask_rows[r0 / Cfg::kRowsPerPass];
      float s[Cfg::kColsPerLane];
#pragma unroll
      for (int j = 0; j < Cfg::kColsPerLane; ++j) s[j] = 0.f;
      if (row_live) {  // sum the k-group partial scores, vector loads along the row
#pragma unroll
        for (int kg = 0; kg < Cfg::kKGroups; ++kg) {
          const float* src = s_buf + (kg * Cfg::kRowsPerCta + r) * Cfg::kSRowFloats + c0;
          if constexpr (Cfg::kColsPerLane % 4 == 0) {
#pragma unroll
            for (int j = 0; j < Cfg::kColsPerLane; j += 4) {
              const float4 v = *reinterpret_cast<const float4*>(src + j);
              s[j] += v.x; s[j + 1] += v.y; s[j + 2] += v.z; s[j + 3] += v.w;
            }
          } else if constexpr (Cfg::kColsPerLane % 2 == 0) {
#pragma unroll
            for (int j = 0; j < Cfg::kColsPerLane; j += 2) {
              const float2 v = *reinterpret_cast<const float2*>(src + j);
              s[j] += v.x; s[j + 1] += v.y;
            }
          } else {
#pragma unroll
            for (int j = 0; j < Cfg::kColsPerLane; ++j) s[j] += src[j];
          }
        }
      }
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < Cfg::kColsPerLane; ++j) {
        const bool vis =
            row_live && (tile_in_prefix || key_visible<Cfg>(tile * Cfg::kBlockN + c0 + j, kv_len, prefix_len, qi, mask_row));
        s[j] = vis ? s[j] * scale_log2 : -INFINITY;
        tile_max = fmaxf(tile_max, s[j]);
      }
#pragma unroll
      for (int off = 1; off < Cfg::kSoftmaxLanes; off *= 2)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
      const float m_old = row_in_cta ? m_smem[r] : -INFINITY;
      const float m_new = fmaxf(m_old, tile_max);
      const bool any = m_new != -INFINITY;
      const float alpha = any ? exp2f(m_old - m_new) : 1.f;
      float row_sum = 0.f;
#pragma unroll
      for (int j = 0; j < Cfg::kColsPerLane; ++j) {
        const float pj = any ? exp2f(s[j] - m_new) : 0.f;
        s[j] = pj;
        row_sum += pj;
      }
#pragma unroll
      for (int off = 1; off < Cfg::kSoftmaxLanes; off *= 2) row_sum += __shfl_xor_sync(0xffffffffu, row_sum, off);
      __syncwarp();  // every lane has read m_smem[r] before lane 0 of the row group rewrites it
      if (row_in_cta) {
#pragma unroll
        for (int j = 0; j < Cfg::kColsPerLane; j += 2) {
          const float hi = j + 1 < Cfg::kColsPerLane ? s[j + 1] : 0.f;
          *reinterpret_cast<uint32_t*>(p_smem + r * Cfg::kPRowElems + c0 + j) = ptx::pack_bf16x2(s[j], hi);
        }
        if (tid % Cfg::kSoftmaxLanes == 0) {
          m_smem[r] = m_new;
          l_smem[r] = l_smem[r] * alpha + row_sum;
          alpha_smem[r] = alpha;
        }
      }
    }
  };
  // O = alpha * O + P V with the V rows of stage `stage`.
  auto pv_pass = [&](int stage) {
    const __nv_bfloat16* k_smem = kv_smem + stage * (Cfg::kBlockN * Cfg::kKvRowElems);
    // ---- rescale O, then O += P V over this warp's output dims.
#pragma unroll
    for (int mt = 0; mt < Cfg::kRowTiles; ++mt) {
      const float a_lo = alpha_smem[mt * 16 + g];
      const float a_hi = alpha_smem[mt * 16 + g + 8];
      if (__all_sync(0xffffffffu, a_lo == 1.f && a_hi == 1.f)) continue;  // no row max of this tile moved
#pragma unroll
      for (int nt = 0; nt < Cfg::kNTilesO; ++nt) {
        o_acc[mt][nt][0] *= a_lo;
        o_acc[mt][nt][1] *= a_lo;
        o_acc[mt][nt][2] *= a_hi;
        o_acc[mt][nt][3] *= a_hi;
      }
    }
#pragma unroll
    for (int ks = 0; ks < ((kAblate & kAblatePV) ? 0 : Cfg::kBlockN / 16); ++ks) {
      uint32_t p_frag[Cfg::kRowTiles][4];
      {
        const int m = lane / 8;
        const int r = (m % 2) * 8 + lane % 8;
        const int c = ks * 16 + (m / 2) * 8;
#pragma unroll
        for (int mt = 0; mt < Cfg::kRowTiles; ++mt)
          ptx::ldmatrix_x4(p_frag[mt], p_smem + (mt * 16 + r) * Cfg::kPRowElems + c);
      }
#pragma unroll
      for (int nb = 0; nb < Cfg::kNTilesO / 2; ++nb) {
        // matrices: (tokens lo, dims 0-7), (tokens hi, dims 0-7), (tokens lo, dims 8-15), (tokens hi, dims 8-15)
        const int m = lane / 8;
        const int token = ks * 16 + (m % 2) * 8 + lane % 8;
        const int dim = dim_v0 + nb * 16 + (m / 2) * 8;
        uint32_t vb[4];
        ptx::ldmatrix_x4_trans(vb, k_smem + token * Cfg::kKvRowElems + dim);
#pragma unroll
        for (int mt = 0; mt < Cfg::kRowTiles; ++mt) {
          ptx::mma_bf16_16816(o_acc[mt][2 * nb], p_frag[mt], vb[0], vb[1]);
          ptx::mma_bf16_16816(o_acc[mt][2 * nb + 1], p_frag[mt], vb[2], vb[3]);
        }
      }
    }
  };

  if constexpr (!Cfg::kOverlap) {
    // Serial schedule: per tile, scores -> barrier -> softmax -> barrier -> P V (3 barriers).
    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int stage = (tile - tile_begin) % Cfg::kStages;
      const int ahead = tile + Cfg::kStages;
      int64_t ahead_slot = -1;
      if constexpr (Cfg::kBulkLoad) {
        if constexpr (!(kAblate & kAblateLoads)) {
          ptx::mbarrier_wait_parity(full_bar + stage, static_cast<uint32_t>((tile - tile_begin) / Cfg::kStages) & 1u);
        }
        __syncthreads();  // every warp is done with the stage refilled below
        const int next = tile + Cfg::kStages - 1;
        if (!(kAblate & kAblateLoads) && next < tile_end) {
          bulk_load_tile(next, slot_next);
          slot_next = ahead < tile_end ? bulk_slot(ahead) : -1;
        }
      } else {
        ptx::cp_async_wait<Cfg::kStages - 2>();
        __syncthreads();
        {  // refill the stage consumed in the previous iteration
          const int next = tile + Cfg::kStages - 1;
          if (!(kAblate & kAblateLoads) && next < tile_end) load_kv_tile(next);
          ptx::cp_async_commit();
        }
        // slots of tile + kStages: loaded now, stored after this tile's math (ring entry is free by then)
        ahead_slot = ahead < tile_end ? slot_of(ahead) : -1;
      }
      compute_scores(stage, s_part_smem);
      if constexpr (!(kAblate & kAblateBarriers)) __syncthreads();
      softmax_pass(tile, s_part_smem);
      if constexpr (!(kAblate & kAblateBarriers)) __syncthreads();
      pv_pass(stage);
      if constexpr (!Cfg::kBulkLoad) {
        if (tid < Cfg::kBlockN) ring(ahead)[tid] = ahead_slot;
      }
    }
  } else {
    // Overlapped schedule (bulk loads): the scores of tile t+1 are computed in the same phase as
    // P V of tile t, from a second partial-score buffer, so two independent MMA streams interleave
    // and a tile costs 2 barriers. Iteration t: issue tile t+S-1 into the stage tile t-1 freed;
    // softmax(t); wait for tile t+1; barrier; P V(t) + scores(t+1); barrier.
    static_assert(Cfg::kBulkLoad, "overlap needs the bulk loader");
    auto wait_tile = [&](int tile) {
      if constexpr (!(kAblate & kAblateLoads)) {
        const int i = tile - tile_begin;
        ptx::mbarrier_wait_parity(full_bar + i % Cfg::kStages, static_cast<uint32_t>(i / Cfg::kStages) & 1u);
      }
    };
    auto s_buf_of = [&](int tile) { return s_part_smem + ((tile - tile_begin) & 1) * Cfg::kSBufFloats; };
    wait_tile(tile_begin);
    __syncthreads();
    compute_scores(0, s_buf_of(tile_begin));
    __syncthreads();
    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int stage = (tile - tile_begin) % Cfg::kStages;
      const int next = tile + Cfg::kStages - 1;  // its stage held tile - 1, free since the last barrier
      if (!(kAblate & kAblateLoads) && next < tile_end) {
        bulk_load_tile(next, slot_next);
        const int ahead = next + 1;
        slot_next = ahead < tile_end ? bulk_slot(ahead) : -1;
      }
      softmax_pass(tile, s_buf_of(tile));
      if (tile + 1 < tile_end) wait_tile(tile + 1);
      __syncthreads();  // P, alpha visible; tile + 1 landed
      pv_pass(stage);
      if (tile + 1 < tile_end) compute_scores((tile + 1 - tile_begin) % Cfg::kStages, s_buf_of(tile + 1));
      __syncthreads();  // scores of tile + 1 visible; P and stage `stage` free
    }
  }
  if constexpr (!Cfg::kBulkLoad) ptx::cp_async_wait<0>();
  __syncthreads();

  // ---- epilogue: normalized partial O and its LSE (natural log) for the combine step.
  float* o_part = p.o_part + ws_row_base * Cfg::kDimV;
#pragma unroll
  for (int mt = 0; mt < Cfg::kRowTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 16 + g + half * 8;
      if (r < live_rows) {
        const float l = l_smem[r];
        const float inv_l = l > 0.f ? 1.f / l : 0.f;
        float* o_row = o_part + static_cast<int64_t>(r) * Cfg::kDimV + dim_v0;
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesO; ++nt) {
          *reinterpret_cast<float2*>(o_row + nt * 8 + 2 * t4) =
              make_float2(o_acc[mt][nt][2 * half] * inv_l, o_acc[mt][nt][2 * half + 1] * inv_l);
        }
      }
    }
  }
  for (int r = tid; r < live_rows; r += Cfg::kThreads) {
    const float l = l_smem[r];
    lse_part[r] = l > 0.f ? (m_smem[r] + log2f(l)) * 0.6931471805599453f : -INFINITY;
  }
}

}  // namespace mlagen
