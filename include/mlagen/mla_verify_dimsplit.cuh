// mlagen/mla_verify_dimsplit.cuh — split-KV partial kernel of MLA verify attention, schedule "dimsplit":
// every KV row of a split crosses L2 -> shared memory once for all H x q_len rows of its request.
//
// One (row block, split, request) is a thread-block cluster of two CTAs on two SMs. CTA rank c owns
// half of the 576 dims of every KV row: latent dims [256c, 256c + 256) and rope dims
// [512 + 32c, 512 + 32c + 32) (288 dims, 576 bytes per token), so together they hold all rows' Q
// (bf16) and O (fp32), which one SM's registers and 99 KB of shared memory cannot (docs/perf-notes.md).
// Per KV tile of kBlockN tokens (consumed 16 tokens at a time):
//   producer warp   page-table gather, then 16-byte cp.async (or two cp.async.bulk per token) of the
//                   latent and rope halves into a kStages ring; full[stage] completes when they
//                   land, empty[stage] when every consumer warp is done with the stage.
//   consumer warp w m-tile w (16 rows): S_c = Q[:, dims_c] K[:, dims_c]^T in mma.sync fragments; the
//                   fragment goes to the peer CTA's shared memory by st.async, whose bytes complete
//                   the peer's exchange mbarrier; S = S_0 + S_1 (the same sum in both CTAs, so both run
//                   the same softmax); online softmax in the fragment registers (4-lane row reductions);
//                   O_c += P V[:, 256c : 256c + 256] with P taken straight from the score registers.
//                   With num_warps = 2 x row_tiles + 1 two warps share an m-tile: each scores 8 of the
//                   16 tokens and owns 128 of the 256 output dims (P and row maxima swapped in shared
//                   memory under one named barrier per sub-tile).
// No __syncthreads in the main loop: stages are handed over by mbarriers (full / empty), the score
// exchange by one mbarrier per (buffer, warp) in each CTA, double buffered. Both CTAs write their
// halves of o_part; rank 0 writes lse_part. The combine kernel (mla_verify_combine.cuh) is shared
// with the rowblock schedule. Only mma.sync, ldmatrix, cp.async / cp.async.bulk (no multicast), mbarrier and
// cluster shared memory: the same code runs on sm_90 and sm_120. Diagnostic builds honour MLAGEN_ABLATE
// (mla_verify_partial.cuh; here 16 drops the score exchange instead of the in-tile barriers).
// Fragment layouts: PTX ISA "Matrix Fragments for mma.m16n8k16"; P from the S accumulators as the
// A operand of the next MMA is the register reuse of FlashAttention-2 (Dao, 2023).
#pragma once
#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>

#include "mlagen/mla_verify_batch.cuh"
#include "mlagen/mla_verify_config.cuh"
#include "mlagen/mla_verify_params.cuh"
#include "mlagen/mla_verify_new_kv.cuh"
#include "mlagen/mla_verify_partial.cuh"  // key_visible
#include "mlagen/mla_verify_split.cuh"
#include "mlagen/ptx.cuh"

namespace mlagen {

// Compile-time configuration of a dimsplit variant; the fields the combine kernel, the launcher and
// the Python module read have the same names as in MlaVerifyConfig.
template <int kHeads_, int kQLenMax_, int kKvLoraRank_, int kRopeDim_, int kPageSize_, int kLoadBits_, int kBlockN_,
          int kWarps_, int kRowTiles_, int kStages_, MaskKind kMask_, int kSmemLimit_ = kSmemLimitSm120,
          bool kKvFp8_ = false>
struct MlaDimSplitConfig {
  static constexpr bool kDimSplit = true;
  static constexpr bool kTransposed = false;  // S^T / O^T MMAs: dimsplit_t only
  using PartialT = float;                     // o_part's element type (dimsplit_t: mla_verify_partial_store.cuh)
  static constexpr bool kFusedMerge = false;  // the combine folded in: dimsplit_t diagnostic builds only
  static constexpr int kPdl = 0;              // launched in stream order (dimsplit_t: MLAGEN_DST_PDL)
  static constexpr int kL2PrefetchTiles = 0;  // the producer's L2 prefetch distance (dimsplit_produce_bf16)
  static constexpr bool kZeroFillTail = false;  // the ring is zeroed up front (zero_kv_ring)
  static constexpr bool kProducerV16 = false;   // dimsplit_produce_bf16 as in v15 (dimsplit_t's v16 producer: off)
  static constexpr bool kCopyL1 = false;        // the producer's 16-byte copies: .cg (dimsplit_t: MLAGEN_DST_COPY_L1)
  // e4m3 KV cache: the producer fills an e4m3 ring of kStages stages, two converter warps dequantize each
  // stage into the bf16 ring of kConvStages stages that the consumers read (mla_verify_fp8.cuh).
  static constexpr bool kKvFp8 = kKvFp8_;
  static constexpr int kClusterCtas = 2;  // CTAs per (row block, split, request)
  static constexpr int kHeads = kHeads_;
  static constexpr int kQLenMax = kQLenMax_;
  static constexpr int kKvLoraRank = kKvLoraRank_;
  static constexpr int kRopeDim = kRopeDim_;
  static constexpr int kDimQK = kKvLoraRank + kRopeDim;
  static constexpr int kDimV = kKvLoraRank;
  static constexpr int kPageSize = kPageSize_;
  static constexpr MaskKind kMask = kMask_;

  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowTiles = kRowTiles_;  // m16 row tiles of the cluster's rows
  // Consumer warps per row tile: 2 when num_warps = 2 x row_tiles + 1 (a pair: warp h scores tokens
  // [8h, 8h + 8) of each sub-tile and owns output dims [128h, 128h + 128); P and the row maxima cross
  // between the two through shared memory, one named barrier per sub-tile), else 1 (a warp owns its
  // tile's scores of all 16 tokens of a sub-tile and all 256 output dims of the CTA; extra warps idle).
  // (fp8: always 1; its num_warps = row_tiles + 3 equals 2 x row_tiles + 1 at row_tiles 2.)
  static constexpr int kWarpsPerTile = (!kKvFp8_ && kWarps_ == 2 * kRowTiles_ + 1) ? 2 : 1;
  static constexpr bool kPairs = kWarpsPerTile == 2;
  static constexpr int kConsumerWarps = kRowTiles * kWarpsPerTile;
  static constexpr int kProducerWarp = kConsumerWarps;  // the first producer warp
  // Producer warps: two when num_warps = consumer warps + 2 with the cp.async loader (one warp per stage
  // half, on two schedulers: each issues half of a stage's copies; 2 x 32 lanes complete full[stage]),
  // else one (extra warps idle). The producer's instruction stream is on the critical path
  // (docs/perf-notes.md, v9).
  static constexpr int kProducerWarps =
      (!kKvFp8_ && kLoadBits_ != 0 && kWarpsPerTile == 1 && kWarps == kConsumerWarps + 2) ? 2 : 1;
  static constexpr int kConverterWarps = kKvFp8_ ? 2 : 0;
  static constexpr int kConverterWarp = kProducerWarp + kProducerWarps;  // the first converter warp
  static constexpr int kTokensPerProducer = kBlockN_ / kProducerWarps;
  static constexpr int kRowsPerCta = kRowTiles * 16;  // rows of the cluster (both CTAs hold all of them)
  static constexpr int kRowsMax = kHeads * kQLenMax;
  static constexpr int kRowBlocks = (kRowsMax + kRowsPerCta - 1) / kRowsPerCta;
  static constexpr int kStages = kStages_;
  static constexpr int kConvStages = 2;                                // fp8: bf16 stages the converters fill
  static constexpr int kConsStages = kKvFp8_ ? kConvStages : kStages_;  // stages of the ring the consumers read

  // This CTA's half of a KV row: latent [c * kLatentHalf, +kLatentHalf), rope [kKvLoraRank + c * kRopeHalf, +kRopeHalf).
  static constexpr int kLatentHalf = kKvLoraRank / 2;
  static constexpr int kRopeHalf = kRopeDim / 2;
  static constexpr int kDimCta = kLatentHalf + kRopeHalf;  // 288
  static constexpr int kKSteps = kDimCta / 16;              // 18 k16 steps of Q K^T per CTA
  static constexpr int kLatentSteps = kLatentHalf / 16;
  static constexpr int kDimVCta = kLatentHalf;              // 256 output dims per CTA
  static constexpr int kDimVWarp = kDimVCta / kWarpsPerTile;  // output dims per consumer warp
  // A stage of kBlockN tokens is consumed in sub-tiles of 16: scores of 16 tokens (2 n8 tiles) are
  // the most that fit beside Q (72) and O (128 words per thread) without spilling; a pair splits them.
  static constexpr int kSubTile = 16;
  static constexpr int kSubTiles = kBlockN / kSubTile;
  static constexpr int kNTilesS = kSubTile / 8 / kWarpsPerTile;  // n8 score tiles per warp
  static constexpr int kNTilesO = kDimVWarp / 8;                 // n8 output tiles per warp

  // Shared memory: KV ring (rows padded by 16 B: 592 B = 37 x 16 B, an odd count of 16-B units, so
  // the 8 row addresses of an ldmatrix fall in distinct bank groups), the score exchange buffers
  // [2][kRowTiles][kNTilesS][32 lanes][4 floats] (a warp's fragment, lane-contiguous per n8 tile:
  // conflict-free 16-B stores and loads), then the mbarriers.
  static constexpr int kKvRowElems = kDimCta + 8;
  static constexpr int kStageElems = kBlockN * kKvRowElems;
  static constexpr int kSmemKv = kConsStages * kStageElems * 2;  // the bf16 ring the consumers read
  // fp8: e4m3 stages of kBlockN rows of this CTA's 288 bytes, padded by 16 B (304 = 19 x 16 B)
  static constexpr int kFp8RowBytes = kDimCta + 16;
  static constexpr int kFp8StageBytes = kBlockN * kFp8RowBytes;
  static constexpr int kSmemFp8 = kKvFp8_ ? kStages * kFp8StageBytes : 0;
  static constexpr int kXchgFloatsPerWarp = kNTilesS * 32 * 4;
  static constexpr int kSmemXchg = 2 * kConsumerWarps * kXchgFloatsPerWarp * 4;
  // Pairs: [2][kConsumerWarps][32 lanes][4 words] (a warp's P of rows g, g + 8 as bf16x2 and its row
  // maxima), double buffered so one barrier per sub-tile suffices.
  static constexpr int kSmemPair = kPairs ? 2 * kConsumerWarps * 32 * 16 : 0;
  // full, empty (the consumers' ring), exchange, then for fp8 full8, empty8 (the e4m3 ring)
  static constexpr int kNumBars = 2 * kConsStages + 2 * kConsumerWarps + (kKvFp8_ ? 2 * kStages : 0);
  static constexpr int kSmemBars = kNumBars * 8;
  // The last kQSmemSteps k16 steps of each warp's Q (the rope dims and 6 latent steps) are read with
  // ldmatrix from shared memory instead of held in registers: the headroom that lets the scores of
  // sub-tile j + 1 live beside P(j) and O without spilling at 255 registers.
  // Pairs hold O of 128 dims (64 words): the rope steps and 2 latent steps come from shared memory
  // (0 spills at 168 registers on sm_90 and sm_120 with nvcc 13.0; the rope steps alone spill 20 B).
  static constexpr int kQSmemStepsWanted = kPairs ? kRopeHalf / 16 + 2 : kRopeHalf / 16 + 6;
  static constexpr int kQSmemSteps = kQSmemStepsWanted < kKSteps ? kQSmemStepsWanted : kKSteps;
  static constexpr int kQRegSteps = kKSteps - kQSmemSteps;
  static constexpr int kQSmemRowElems = kQSmemSteps * 16 + 8;  // +16 B: odd count of 16-B units per row
  static constexpr int kSmemQ = kRowTiles * 16 * kQSmemRowElems * 2;
  static constexpr int kSmemBytes = kSmemKv + kSmemXchg + kSmemBars + kSmemQ + kSmemPair + kSmemFp8;

  static constexpr int kLatentBytes = kLatentHalf * 2;
  static constexpr int kRopeBytes = kRopeHalf * 2;
  static constexpr int kTokenBytes = kDimCta * 2;  // bytes of one token row this CTA loads
  static constexpr int kLoadBytes = 16;            // 16-B cp.async chunks, or bulk copies of 16-B multiples
  // Loader: kLoadBits_ 0 ("bulk"): each producer lane issues two cp.async.bulk per token; the copy
  // engine serializes a warp's bulk copies (one per lane), so 64 per stage cost the producer warp
  // about 2 µs per 16 tokens on the H200. 128: the producer warp issues 16-byte cp.async, one warp
  // instruction per token's 512-byte latent half (lane = chunk) plus one per 8 tokens' rope halves,
  // and each lane's copies complete on full[stage] (cp.async.mbarrier.arrive.noinc).
  static constexpr bool kBulkLoad = kLoadBits_ == 0;
  static constexpr int kLatentChunks = kLatentHalf * 2 / 16;  // 32 lanes x 16 B = 512 B
  static constexpr int kRopeChunks = kRopeHalf * 2 / 16;      // 4 per token

  // Registers held per consumer thread across the main loop (fp32 / bf16x2 words).
  static constexpr int kRegsQ = kQRegSteps * 4;
  static constexpr int kRegsS = 2 * kNTilesS * 4;  // two accumulator chains
  static constexpr int kRegsO = kNTilesO * 4;

  static_assert(kHeads >= 1 && kHeads <= 128, "heads_per_rank must be in [1, 128]");
  static_assert(kQLenMax >= 1 && kQLenMax <= 64, "q_len must be in [1, 64] (tree mask is a 64-bit row)");
  static_assert(kPageSize >= 1 && (kPageSize & (kPageSize - 1)) == 0, "page_size must be a power of two");
  static_assert(kLatentHalf % 16 == 0 && kRopeHalf % 16 == 0, "each CTA's latent and rope halves must be k16 multiples");
  static_assert((kKvRowElems * 2) % 16 == 0 && kLatentBytes % 16 == 0 && kRopeBytes % 16 == 0,
                "bulk copies move 16-byte multiples between 16-byte aligned rows");
  static_assert(kBlockN == 16 || kBlockN == 32, "dimsplit: block_n must be 16 or 32 (one token per producer lane)");
  static_assert(kBulkLoad || kLoadBits_ == 128, "dimsplit: load_width must be bulk or 128");
  static_assert(kBulkLoad || (kLatentChunks == 32 && 32 % kRopeChunks == 0),
                "dimsplit cp.async loader: one warp instruction per 512-byte latent half (kv_lora_rank 512)");
  static_assert(kRowTiles >= 1 && kRowTiles + 1 <= kWarps, "dimsplit: num_warps must be at least row_tiles + 1");
  static_assert(kPairs || kWarps <= 8,
                "dimsplit: num_warps 2 x row_tiles + 1 (two warps per row tile) or in [row_tiles + 1, 8] (one warp "
                "per row tile, about 230 registers per thread)");
  static_assert(kPairs ? kWarps <= 15 : true, "dimsplit pairs: at most 7 row tiles (named barriers 1..7, 184 registers)");
  static_assert(kStages >= 2, "need at least two pipeline stages");
  static_assert(!kKvFp8_ || (!kBulkLoad && !kPairs && kWarps == kConsumerWarps + 3 && kLatentHalf == 256 &&
                             kRopeHalf == 32),
                "dimsplit fp8: load_width 128, one warp per row tile, num_warps = row_tiles + 3 (a producer and two "
                "converter warps), kv_lora_rank 512 and qk_rope_head_dim 64");
  static_assert(kBlockN_ % kProducerWarps == 0 && kTokensPerProducer <= 32, "a producer lane per token of its share");
  static_assert(kDimV == 128 || kDimV == 256 || kDimV == 512, "the combine handles kv_lora_rank 128, 256 or 512");
  static_assert(kSmemBytes <= kSmemLimit_, "shared memory exceeds the per-block limit of the target archs");
  static_assert(kRegsQ + kRegsS + kRegsO <= 184, "register tiles would spill");
  // Pairs: each of the SM's four schedulers has 16,384 registers for its ceil(warps / 4) warps (11 warps:
  // 168 per thread), of which about 40 go to addresses, loop state and the P / max exchange.
  static constexpr int kRegsPerThreadMax = 16384 / (((kWarps + 3) / 4) * 32) / 8 * 8;
  static_assert(!kPairs || kRegsPerThreadMax >= kRegsQ + kRegsS + kRegsO + 40,
                "dimsplit pairs: the register file cannot hold this many warps' tiles (row_tiles <= 5)");
};

// What one CTA of a dimsplit-family cluster (dimsplit, dimsplit_t) works on: its block of (token, head) rows,
// its request's lengths and its split's KV tiles.
struct ClusterSplit {
  int rows;        // H x q_len rows of the request
  int row0;        // first row of this cluster's block
  int live_rows;   // rows of the block below `rows`
  int kv_len;      // the request's KV length, draft tokens included
  int prefix_len;  // kv_len - q_len
  int tile_begin, tile_end;  // this split's tiles of kBlockN tokens
  int64_t ws_row_base;       // workspace row of (request, split, row0)
};

// This step's draft rows (k_new at kv_write_loc), stored by the request's first cluster, each CTA its half of the dims.
template <class Cfg>
__device__ __forceinline__ void store_split_draft_rows(const MlaVerifyParams& p, int b, int row_block, int split,
                                                       uint32_t rank, int tid) {
  if (row_block == 0 && split == 0) {
    store_new_kv_rows<Cfg::kKvFp8>(p, b, static_cast<int>(rank) * Cfg::kLatentHalf, Cfg::kLatentHalf, tid,
                                   Cfg::kThreads);
    store_new_kv_rows<Cfg::kKvFp8>(p, b, Cfg::kKvLoraRank + static_cast<int>(rank) * Cfg::kRopeHalf, Cfg::kRopeHalf,
                                   tid, Cfg::kThreads);
  }
}

// An empty split: rank 0 writes LSE -inf for the block's rows, so the combine skips it.
template <class Cfg>
__device__ __forceinline__ void store_empty_split_lse(const MlaVerifyParams& p, uint32_t rank, int tid,
                                                      const ClusterSplit& w) {
  if (rank == 0)
    for (int r = tid; r < w.live_rows; r += Cfg::kThreads) p.lse_part[w.ws_row_base + r] = -INFINITY;
}

// Fills `w` for the CTA of row block `row_block`, split `split`, request `b`. Returns false when the CTA has nothing
// to do: its block starts past the request's rows, or its split is empty. Both CTAs of a cluster return the same.
// Reads the request's kv_len. With kStores (the default) it also makes the split's global stores: the draft rows
// (store_split_draft_rows) and, for an empty split, its LSE (store_empty_split_lse); without, the caller makes them
// (cluster_split_stores), e.g. after waiting for the kernel before (MLAGEN_DST_PDL).
template <class Cfg, bool kStores = true>
__device__ __forceinline__ bool cluster_split_begin(const MlaVerifyParams& p, int b, int row_block, int split,
                                                    uint32_t rank, int tid, ClusterSplit& w) {
  w.rows = p.q_len * Cfg::kHeads;
  w.row0 = row_block * Cfg::kRowsPerCta;
  if (w.row0 >= w.rows) return false;
  w.live_rows = w.rows - w.row0 < Cfg::kRowsPerCta ? w.rows - w.row0 : Cfg::kRowsPerCta;
  w.kv_len = request_kv_len(p, b);
  w.prefix_len = w.kv_len - p.q_len;
  split_tile_range(w.kv_len, Cfg::kBlockN, p.num_splits, p.min_tiles_per_split, split, w.tile_begin, w.tile_end);
  if constexpr (kStores) store_split_draft_rows<Cfg>(p, b, row_block, split, rank, tid);
  w.ws_row_base = (static_cast<int64_t>(b) * p.num_splits + split) * Cfg::kRowsMax + w.row0;
  if (w.tile_begin >= w.tile_end) {
    if constexpr (kStores) store_empty_split_lse<Cfg>(p, rank, tid, w);
    return false;
  }
  return true;
}

// The stores cluster_split_begin<Cfg, false> left out, for a CTA whose block has rows (w.row0 < w.rows).
template <class Cfg>
__device__ __forceinline__ void cluster_split_stores(const MlaVerifyParams& p, int b, int row_block, int split,
                                                     uint32_t rank, int tid, const ClusterSplit& w) {
  store_split_draft_rows<Cfg>(p, b, row_block, split, rank, tid);
  if (w.tile_begin >= w.tile_end) store_empty_split_lse<Cfg>(p, rank, tid, w);
}

// Zero the KV ring once: columns past kv_len in a request's last tile are never loaded and then hold finite
// data (zeros or an earlier tile's rows), which P = 0 cancels exactly.
template <class Cfg>
__device__ __forceinline__ void zero_kv_ring(__nv_bfloat16* kv_smem, int tid) {
  for (int i = tid; i < Cfg::kSmemKv / 16; i += Cfg::kThreads)
    reinterpret_cast<uint4*>(kv_smem)[i] = make_uint4(0u, 0u, 0u, 0u);
}

// Sub-tile j (kSubTile tokens) of the consumers' ring: stage (j / kSubTiles) % kConsStages, row offset
// kSubTile (j % kSubTiles).
template <class Cfg>
__device__ __forceinline__ const __nv_bfloat16* ring_sub_tile(const __nv_bfloat16* kv_smem, int j) {
  return kv_smem + ((j / Cfg::kSubTiles) % Cfg::kConsStages) * Cfg::kStageElems +
         (j % Cfg::kSubTiles) * Cfg::kSubTile * Cfg::kKvRowElems;
}

// Wait until the stage of sub-tile j has landed (at the first sub-tile of a stage; later ones are there).
template <class Cfg>
__device__ __forceinline__ void wait_sub_tile_full(uint64_t* full_bar, int j) {
  if (j % Cfg::kSubTiles == 0) {
    const int i = j / Cfg::kSubTiles;
    ptx::mbarrier_wait_parity(full_bar + i % Cfg::kConsStages, static_cast<uint32_t>(i / Cfg::kConsStages) & 1u);
  }
}

// First dim of k16 step ks of CTA `rank`'s half of a KV row: its 256 latent dims, then its 32 rope dims.
template <class Cfg>
__device__ __forceinline__ int cta_dim_of_kstep(uint32_t rank, int ks) {
  return ks < Cfg::kLatentSteps ? static_cast<int>(rank) * Cfg::kLatentHalf + ks * 16
                                : Cfg::kKvLoraRank + static_cast<int>(rank) * Cfg::kRopeHalf + (ks - Cfg::kLatentSteps) * 16;
}

// q of (token, head) row r of request b (q_len tokens per request): query token r / H, head r % H.
template <class Cfg>
__device__ __forceinline__ const __nv_bfloat16* q_row_of(const MlaVerifyParams& p, int b, int q_len, int r) {
  const int qi = r / Cfg::kHeads, h = r % Cfg::kHeads;
  return p.q + (static_cast<int64_t>(b) * q_len + qi) * p.q_stride_tok + static_cast<int64_t>(h) * p.q_stride_head;
}

// The bf16 producer warp(s) of a dimsplit-family kernel (warps kProducerWarp .. + kProducerWarps): this CTA's
// half of every token row (latent [rank * kLatentHalf, +kLatentHalf), rope [kKvLoraRank + rank * kRopeHalf,
// +kRopeHalf)) into stage i % kStages of the ring, once empty[stage] says every consumer warp is done with the
// tile kStages before; full[stage] completes when the copies land. Each lane's page-table entry is requested
// two tiles ahead and turned into a row address only when its tile is issued. (nvcc turns the page_next2 ->
// page_next rotation into a register move that waits for the load one tile later, so the latency overlaps
// one tile's copies and empty[stage] wait: not a dependent stall right after the load, as before.) With
// Cfg::kL2PrefetchTiles > 0 (dimsplit_t) the lanes also prefetch into L2 the rows of the tile that far ahead.
// How the producer waits for a stage to empty: a blocking wait (dimsplit_t's MLAGEN_DST_TRACE builds pass one that is
// timed).
struct BlockingStageWait {
  __device__ __forceinline__ void operator()(uint64_t* bar, uint32_t parity) const {
    ptx::mbarrier_wait_parity(bar, parity);
  }
};
template <class Cfg, class StageWait = BlockingStageWait>
__device__ __forceinline__ void dimsplit_produce_bf16(const MlaVerifyParams& p, const int32_t* page_row, int b, int kv_len,
                                                      int prefix_len, int tile_begin, int num_tiles, uint32_t rank,
                                                      int warp, int lane, __nv_bfloat16* kv_smem, uint64_t* full_bar,
                                                      uint64_t* empty_bar, StageWait&& wait_stage = StageWait{}) {
  static_assert(!Cfg::kZeroFillTail || !Cfg::kBulkLoad, "the zero-filled tail is a cp.async-producer feature");
  // Producer warp pw: tokens [tok_p, tok_p + kTokensPerProducer) of each tile; lane n loads token tok_p + n.
  const int tok_p = (warp - Cfg::kProducerWarp) * Cfg::kTokensPerProducer;
  auto pos_of = [&](int tile) { return tile * Cfg::kBlockN + tok_p + lane; };
  auto from_table = [&](int pos) {  // this lane's token is a cache row found through the page table
    return lane < Cfg::kTokensPerProducer && pos < kv_len && !(p.k_new != nullptr && pos >= prefix_len);
  };
  auto page_of = [&](int tile) -> int32_t {  // the page-table entry (0 when the row does not come from the table)
    const int pos = pos_of(tile);
    if constexpr (kAblate & kAblateTable) {  // diagnostic: no table load, the entry that makes pos its own slot
      return from_table(pos) ? (batch_is_direct(p) ? pos : pos / Cfg::kPageSize) : 0;
    }
    return from_table(pos) ? table_entry<Cfg::kPageSize>(p, page_row, pos) : 0;
  };
  auto addr_of = [&](int tile, int32_t page) -> int64_t {  // row address (mla_verify_new_kv.cuh), kNoSlot past kv_len
    const int pos = pos_of(tile);
    if (lane >= Cfg::kTokensPerProducer || pos >= kv_len) return kNoSlot;
    const int64_t slot = from_table(pos) ? entry_slot<Cfg::kPageSize>(p, page, pos)
                                         : new_row_slot(static_cast<int64_t>(b) * p.q_len + (pos - prefix_len));
    return reinterpret_cast<int64_t>(kv_row_src(p, slot));
  };
  int32_t page_next = page_of(tile_begin);
  int32_t page_next2 = num_tiles > 1 ? page_of(tile_begin + 1) : 0;
  // L2 prefetch kPf tiles ahead (Cfg::kL2PrefetchTiles; 0: none): before the ring wait of tile i, each lane
  // asks L2 for the 128-byte lines of its token's two halves in tile i + kPf (4 latent lines + the rope line),
  // so the copies issued once a stage frees read L2 rather than DRAM. The page entry is requested a tile early.
  constexpr int kPf = Cfg::kL2PrefetchTiles;
  // The prefetch's page entries are requested two tiles before their prefetch (kPfAhead 2), so a tile's
  // iteration does not wait for a load issued one iteration earlier; 1: v15's (one tile earlier).
  constexpr bool kPfAhead2 = Cfg::kProducerV16;
  int32_t page_pf = kPf > 0 && num_tiles > kPf ? page_of(tile_begin + kPf) : 0;
  int32_t page_pf2 = kPfAhead2 && kPf > 0 && num_tiles > kPf + 1 ? page_of(tile_begin + kPf + 1) : 0;
  for (int i = 0; i < num_tiles; ++i) {
    const int tile = tile_begin + i;
    const int stage = i % Cfg::kStages;
    if constexpr (kPf > 0) {
      const int pos = pos_of(tile + kPf);
      if (i + kPf < num_tiles && from_table(pos)) {
        const __nv_bfloat16* row =
            row_at(reinterpret_cast<int64_t>(kv_row_src(p, entry_slot<Cfg::kPageSize>(p, page_pf, pos))));
#pragma unroll
        for (int c = 0; c < Cfg::kLatentBytes / 128; ++c) ptx::prefetch_l2(row + rank * Cfg::kLatentHalf + c * 64);
        if constexpr (Cfg::kRopeHalf > 0) ptx::prefetch_l2(row + Cfg::kKvLoraRank + rank * Cfg::kRopeHalf);
      }
      if constexpr (kPfAhead2) {
        page_pf = page_pf2;
        page_pf2 = i + kPf + 2 < num_tiles ? page_of(tile + kPf + 2) : 0;
      } else {
        page_pf = i + kPf + 1 < num_tiles ? page_of(tile + kPf + 1) : 0;
      }
    }
    if (i >= Cfg::kStages) wait_stage(empty_bar + stage, static_cast<uint32_t>(i / Cfg::kStages - 1) & 1u);
    const int64_t slot = addr_of(tile, page_next);
    page_next = page_next2;
    page_next2 = i + 2 < num_tiles ? page_of(tile + 2) : 0;
    const int left = kv_len - tile * Cfg::kBlockN;
    const int valid = left < Cfg::kBlockN ? left : Cfg::kBlockN;
    __nv_bfloat16* dst_stage = kv_smem + stage * Cfg::kStageElems;
    if constexpr (Cfg::kBulkLoad) {
      const bool copy = !(kAblate & kAblateLoads);
      if (lane == 0) ptx::mbarrier_arrive_expect_tx(full_bar + stage, copy ? static_cast<uint32_t>(valid) * Cfg::kTokenBytes : 0u);
      __syncwarp();
      if (copy && lane < valid) {
        __nv_bfloat16* dst = dst_stage + lane * Cfg::kKvRowElems;
        const __nv_bfloat16* src = row_at(slot);
        ptx::bulk_copy_g2s(dst, src + rank * Cfg::kLatentHalf, Cfg::kLatentBytes, full_bar + stage);
        if constexpr (Cfg::kRopeHalf > 0) {
          ptx::bulk_copy_g2s(dst + Cfg::kLatentHalf, src + Cfg::kKvLoraRank + rank * Cfg::kRopeHalf, Cfg::kRopeBytes,
                             full_bar + stage);
        }
      }
    } else {
      // This warp's tokens of the tile (all of them with one producer warp).
      const int mine = valid - tok_p < 0 ? 0 : (valid - tok_p < Cfg::kTokensPerProducer ? valid - tok_p
                                                                                        : Cfg::kTokensPerProducer);
      __nv_bfloat16* dst_mine = dst_stage + tok_p * Cfg::kKvRowElems;
      // Latent half of token n: lane = 16-byte chunk. Tokens past kv_len are not loaded (P = 0 there).
      auto copy_latent = [&](int n) {
        const int64_t sn = __shfl_sync(0xffffffffu, slot, n);
        ptx::cp_async_zfill<16, Cfg::kCopyL1>(dst_mine + n * Cfg::kKvRowElems + lane * 8,
                                row_at(sn, rank * Cfg::kLatentHalf + lane * 8), true);
      };
      // Rope halves: 32 / kRopeChunks tokens per instruction, from n0.
      constexpr int kTokPerInstr = Cfg::kRopeChunks > 0 ? 32 / Cfg::kRopeChunks : 32;
      auto copy_rope = [&](int n0) {
        const int n = n0 + lane / Cfg::kRopeChunks;
        const int c = lane % Cfg::kRopeChunks;
        const int64_t sn = __shfl_sync(0xffffffffu, slot, n < 32 ? n : 0);
        if (n < mine) {
          ptx::cp_async_zfill<16, Cfg::kCopyL1>(dst_mine + n * Cfg::kKvRowElems + Cfg::kLatentHalf + c * 8,
                                  row_at(sn, Cfg::kKvLoraRank + rank * Cfg::kRopeHalf + c * 8), true);
        }
      };
      if (Cfg::kProducerV16 && !(kAblate & kAblateLoads) && mine == Cfg::kTokensPerProducer) {
        // A whole tile (every tile of a split but its request's last): all of its copies in one unrolled block,
        // so the shuffle -> address -> copy chains of different tokens overlap (with a loop of runtime length
        // the compiler unrolled 4 tokens, and the producer warp waited on those chains: perf-notes v16).
#pragma unroll
        for (int n = 0; n < Cfg::kTokensPerProducer; ++n) copy_latent(n);
        if constexpr (Cfg::kRopeChunks > 0) {
#pragma unroll
          for (int n0 = 0; n0 < Cfg::kTokensPerProducer; n0 += kTokPerInstr) copy_rope(n0);
        }
      } else {
        for (int n = 0; n < ((kAblate & kAblateLoads) ? 0 : mine); ++n) copy_latent(n);
        if constexpr (Cfg::kRopeChunks > 0) {
          for (int n0 = 0; n0 < ((kAblate & kAblateLoads) ? 0 : mine); n0 += kTokPerInstr) copy_rope(n0);
        }
      }
      if constexpr (Cfg::kZeroFillTail) {
        // Rows past kv_len in the request's last tile: src-size 0 copies write zeros, which P = 0 cancels
        // (the ring is then never zeroed up front).
        for (int n = mine; n < Cfg::kTokensPerProducer; ++n) {
          __nv_bfloat16* dst = dst_mine + n * Cfg::kKvRowElems;
          if (lane < Cfg::kLatentChunks) ptx::cp_async_zfill<16, Cfg::kCopyL1>(dst + lane * 8, p.kv, false);
          if (lane < Cfg::kRopeChunks) {
            ptx::cp_async_zfill<16, Cfg::kCopyL1>(dst + Cfg::kLatentHalf + lane * 8, p.kv, false);
          }
        }
      }
      ptx::cp_async_mbarrier_arrive_noinc(full_bar + stage);  // this lane's copies complete on full[stage]
    }
  }
}

// e4m3 KV cache: the producer lane work of dimsplit / dimsplit_t (one warp). 16-byte cp.async of this CTA's 288
// e4m3 bytes of each token into the e4m3 ring [kStages][kBlockN][kFp8RowBytes] (lanes 0-15 / 16-31: the latent
// half of two tokens per instruction; then 16 tokens' rope halves); each lane's copies complete on full8[stage].
// Draft rows taken from k_new (bf16) and tokens past kv_len are not loaded: the converters fill them. With
// Cfg::kL2PrefetchTiles > 0, each lane first asks L2 for its token's lines of the tile that many ahead, as
// dimsplit_produce_bf16 does: two 128-byte lines from the start of its 256-byte latent half and the line of its rope
// half (a 576-byte row of an odd slot starts mid-line, so its latent half spans three lines; asking for the third
// too gained nothing: docs/perf-notes.md v19).
template <class Cfg>
__device__ __forceinline__ void dimsplit_produce_fp8(const MlaVerifyParams& p, const int32_t* page_row, int kv_len,
                                                     int prefix_len, int tile_begin, int num_tiles, uint32_t rank,
                                                     int lane, uint8_t* fp8_smem, uint64_t* full8_bar,
                                                     uint64_t* empty8_bar) {
  const uint8_t* kv_bytes = reinterpret_cast<const uint8_t*>(p.kv);
  auto slot_of = [&](int tile) -> int64_t {  // byte address of the cache row, kNoSlot when not loaded
    const int pos = tile * Cfg::kBlockN + lane;
    if (lane >= Cfg::kBlockN || pos >= kv_len || (p.k_new != nullptr && pos >= prefix_len)) return kNoSlot;
    const int64_t slot = entry_slot<Cfg::kPageSize>(p, table_entry<Cfg::kPageSize>(p, page_row, pos), pos);
    return reinterpret_cast<int64_t>(kv_bytes + slot * p.kv_stride_slot);
  };
  constexpr int kPf = Cfg::kL2PrefetchTiles;
  int64_t slot = slot_of(tile_begin);
  int64_t slot_pf = kPf > 0 && num_tiles > kPf ? slot_of(tile_begin + kPf) : kNoSlot;
  for (int i = 0; i < num_tiles; ++i) {
    const int tile = tile_begin + i;
    const int stage = i % Cfg::kStages;
    if constexpr (kPf > 0) {
      if (slot_pf != kNoSlot) {
        const uint8_t* row = reinterpret_cast<const uint8_t*>(slot_pf);
#pragma unroll
        for (int c = 0; c < Cfg::kLatentHalf / 128; ++c) ptx::prefetch_l2(row + rank * Cfg::kLatentHalf + c * 128);
        ptx::prefetch_l2(row + Cfg::kKvLoraRank + rank * Cfg::kRopeHalf);
      }
      slot_pf = i + kPf + 1 < num_tiles ? slot_of(tile + kPf + 1) : kNoSlot;
    }
    if (i >= Cfg::kStages) ptx::mbarrier_wait_parity(empty8_bar + stage, static_cast<uint32_t>(i / Cfg::kStages - 1) & 1u);
    const int left = kv_len - tile * Cfg::kBlockN;
    const int valid = left < Cfg::kBlockN ? left : Cfg::kBlockN;
    uint8_t* dst_stage = fp8_smem + stage * Cfg::kFp8StageBytes;
    for (int n0 = 0; n0 < ((kAblate & kAblateLoads) ? 0 : valid); n0 += 2) {  // latent: 16 chunks per token
      const int n = n0 + lane / 16;
      const int c = lane % 16;
      const int64_t sn = __shfl_sync(0xffffffffu, slot, n < 32 ? n : 0);
      if (n < valid && sn != kNoSlot) {
        ptx::cp_async_zfill<16>(dst_stage + n * Cfg::kFp8RowBytes + c * 16,
                                reinterpret_cast<const uint8_t*>(sn) + rank * Cfg::kLatentHalf + c * 16, true);
      }
    }
    for (int n0 = 0; n0 < ((kAblate & kAblateLoads) ? 0 : valid); n0 += 16) {  // rope: 2 chunks per token
      const int n = n0 + lane / 2;
      const int c = lane % 2;
      const int64_t sn = __shfl_sync(0xffffffffu, slot, n < 32 ? n : 0);
      if (n < valid && sn != kNoSlot) {
        ptx::cp_async_zfill<16>(dst_stage + n * Cfg::kFp8RowBytes + Cfg::kLatentHalf + c * 16,
                                reinterpret_cast<const uint8_t*>(sn) + Cfg::kKvLoraRank + rank * Cfg::kRopeHalf + c * 16,
                                true);
      }
    }
    ptx::cp_async_mbarrier_arrive_noinc(full8_bar + stage);  // this lane's copies complete on full8[stage]
    slot = i + 1 < num_tiles ? slot_of(tile + 1) : kNoSlot;
  }
}

// e4m3 KV cache: chunk ch (16 values: 16 latent chunks, then 2 rope chunks) of token row n of a bf16 stage (dst_stage)
// for position pos: a draft row (k_new, pos >= prefix_len) is copied from k_new's bf16, a row past kv_len is written as
// 0, any other row is `raw` (the chunk's 16 e4m3 bytes from the e4m3 stage) dequantized exactly (e4m3x16_to_bf16x16).
template <class Cfg>
__device__ __forceinline__ void fp8_chunk_to_stage(const MlaVerifyParams& p, int b, int q_len, int pos, int n, int ch,
                                                   int kv_len, int prefix_len, uint32_t rank, const uint4& raw,
                                                   __nv_bfloat16* dst_stage) {
  uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
  if (pos < kv_len) {
    if (p.k_new != nullptr && pos >= prefix_len) {
      const int gdim = ch < Cfg::kLatentSteps ? static_cast<int>(rank) * Cfg::kLatentHalf + ch * 16
                                              : Cfg::kKvLoraRank + static_cast<int>(rank) * Cfg::kRopeHalf +
                                                    (ch - Cfg::kLatentSteps) * 16;
      const __nv_bfloat16* g = p.k_new + (static_cast<int64_t>(b) * q_len + (pos - prefix_len)) * p.k_new_stride_tok + gdim;
      lo = *reinterpret_cast<const uint4*>(g);
      hi = *reinterpret_cast<const uint4*>(g + 8);
    } else {
      e4m3x16_to_bf16x16(raw, lo, hi);
    }
  }
  uint4* d = reinterpret_cast<uint4*>(dst_stage + n * Cfg::kKvRowElems + ch * 16);
  d[0] = lo;
  d[1] = hi;
}

// e4m3 KV cache: this thread's share (thread ct of nthreads) of converting one e4m3 stage (src, the tile of
// positions [pos0, pos0 + kBlockN)) into a bf16 stage of the consumers' ring (dst), one 16-value chunk at a time
// (fp8_chunk_to_stage). The caller orders the stage's reads (full8) and writes (empty of the bf16 stage).
template <class Cfg>
__device__ __forceinline__ void dimsplit_convert_fp8_tile(const MlaVerifyParams& p, int b, int q_len, int pos0,
                                                          int kv_len, int prefix_len, uint32_t rank,
                                                          const uint8_t* src_stage, __nv_bfloat16* dst_stage, int ct,
                                                          int nthreads) {
  constexpr int kChunksPerRow = Cfg::kDimCta / 16;  // 16 latent + 2 rope chunks of 16 values
  for (int c = ct; c < Cfg::kBlockN * kChunksPerRow; c += nthreads) {
    const int n = c / kChunksPerRow;
    const int ch = c % kChunksPerRow;
    const uint4 raw = *reinterpret_cast<const uint4*>(src_stage + n * Cfg::kFp8RowBytes + ch * 16);
    fp8_chunk_to_stage<Cfg>(p, b, q_len, pos0 + n, n, ch, kv_len, prefix_len, rank, raw, dst_stage);
  }
}

template <class Cfg>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(Cfg::kThreads, 1)
    mla_verify_dimsplit_kernel(const MlaVerifyParams p) {
  ptx::griddep_launch_dependents();  // the combine's CTAs may be scheduled now; they wait for this grid's end
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* kv_smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kStages][kBlockN][kKvRowElems]
  float* xchg_smem = reinterpret_cast<float*>(smem_raw + Cfg::kSmemKv);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem_raw + Cfg::kSmemKv + Cfg::kSmemXchg);  // [kConsStages]
  uint64_t* empty_bar = full_bar + Cfg::kConsStages;                                           // [kConsStages]
  uint64_t* xfull_bar = empty_bar + Cfg::kConsStages;  // [2][kConsumerWarps]: the peer's scores have landed
  __nv_bfloat16* q_smem = reinterpret_cast<__nv_bfloat16*>(smem_raw + Cfg::kSmemKv + Cfg::kSmemXchg + Cfg::kSmemBars);
  uint4* pair_smem = reinterpret_cast<uint4*>(smem_raw + Cfg::kSmemKv + Cfg::kSmemXchg + Cfg::kSmemBars + Cfg::kSmemQ);
  // fp8: the e4m3 ring [kStages][kBlockN][kFp8RowBytes] and its barriers (after the exchange barriers)
  uint8_t* fp8_smem = smem_raw + Cfg::kSmemKv + Cfg::kSmemXchg + Cfg::kSmemBars + Cfg::kSmemQ + Cfg::kSmemPair;
  uint64_t* full8_bar = xfull_bar + 2 * Cfg::kConsumerWarps;  // [kStages] (fp8 only)
  uint64_t* empty8_bar = full8_bar + Cfg::kStages;            // [kStages] (fp8 only)

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t4 = lane % 4;
  const uint32_t rank = ptx::cluster_cta_rank();
  const uint32_t peer = rank ^ 1u;

  const int row_block = blockIdx.x / Cfg::kClusterCtas;
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int q_len = p.q_len;
  ClusterSplit w;
  if (!cluster_split_begin<Cfg>(p, b, row_block, split, rank, tid, w)) return;  // the same for both CTAs
  const int rows = w.rows, row0 = w.row0, live_rows = w.live_rows, kv_len = w.kv_len, prefix_len = w.prefix_len;
  const int tile_begin = w.tile_begin;
  const int64_t ws_row_base = w.ws_row_base;
  float* lse_part = p.lse_part + ws_row_base;
  const int live_warps = (live_rows + 15) / 16 * Cfg::kWarpsPerTile;  // consumer warps with rows
  const int num_tiles = w.tile_end - w.tile_begin;

  if (tid == 0) {
    for (int st = 0; st < Cfg::kConsStages; ++st) {
      // bulk: 1 arrival + bytes; cp.async: every lane of every producer warp; fp8: every converter thread
      ptx::mbarrier_init(full_bar + st, Cfg::kKvFp8 ? 32 * Cfg::kConverterWarps
                                                    : (Cfg::kBulkLoad ? 1 : 32 * Cfg::kProducerWarps));
      ptx::mbarrier_init(empty_bar + st, static_cast<uint32_t>(live_warps));
    }
    if constexpr (Cfg::kKvFp8) {
      for (int st = 0; st < Cfg::kStages; ++st) {
        ptx::mbarrier_init(full8_bar + st, 32);                          // the producer's lanes (cp.async)
        ptx::mbarrier_init(empty8_bar + st, 32 * Cfg::kConverterWarps);  // every converter thread
      }
    }
    // exchange: one arrival (the receiving warp's lane 0, with expect_tx) + the peer's st.async bytes
    for (int i = 0; i < 2 * Cfg::kConsumerWarps; ++i) ptx::mbarrier_init(xfull_bar + i, 1);
    ptx::fence_barrier_init();
  }
  zero_kv_ring<Cfg>(kv_smem, tid);
  ptx::fence_proxy_async_smem();  // generic zero stores before the bulk copies' async writes
  ptx::cluster_sync();            // both CTAs' barriers initialized before any remote arrival
  const int32_t* page_row = request_page_row(p, b);

  if (Cfg::kKvFp8 && warp == Cfg::kProducerWarp) {
    if constexpr (Cfg::kKvFp8) {
      dimsplit_produce_fp8<Cfg>(p, page_row, kv_len, prefix_len, tile_begin, num_tiles, rank, lane, fp8_smem, full8_bar,
                                empty8_bar);
    }
  } else if (Cfg::kKvFp8 && warp >= Cfg::kConverterWarp && warp < Cfg::kConverterWarp + Cfg::kConverterWarps) {
    // ---- fp8 converters: e4m3 stage i -> bf16 stage i % kConsStages (dimsplit_convert_fp8_tile)
    if constexpr (Cfg::kKvFp8) {
      constexpr int kConvThreads = 32 * Cfg::kConverterWarps;
      const int ct = tid - Cfg::kConverterWarp * 32;
      for (int i = 0; i < num_tiles; ++i) {
        const int st8 = i % Cfg::kStages;
        const int cs = i % Cfg::kConsStages;
        ptx::mbarrier_wait_parity(full8_bar + st8, static_cast<uint32_t>(i / Cfg::kStages) & 1u);
        if (i >= Cfg::kConsStages) {
          ptx::mbarrier_wait_parity(empty_bar + cs, static_cast<uint32_t>(i / Cfg::kConsStages - 1) & 1u);
        }
        dimsplit_convert_fp8_tile<Cfg>(p, b, q_len, (tile_begin + i) * Cfg::kBlockN, kv_len, prefix_len, rank,
                                       fp8_smem + st8 * Cfg::kFp8StageBytes, kv_smem + cs * Cfg::kStageElems, ct,
                                       kConvThreads);
        ptx::mbarrier_arrive(empty8_bar + st8);  // this thread is done reading the e4m3 stage
        ptx::mbarrier_arrive(full_bar + cs);     // and has written its part of the bf16 stage
      }
    }
  } else if (!Cfg::kKvFp8 && warp >= Cfg::kProducerWarp && warp < Cfg::kProducerWarp + Cfg::kProducerWarps) {
    dimsplit_produce_bf16<Cfg>(p, page_row, b, kv_len, prefix_len, tile_begin, num_tiles, rank, warp, lane, kv_smem,
                               full_bar, empty_bar);
  } else if (warp < live_warps) {
    // ---- consumer warp: m-tile `tile` of the cluster's rows; with pairs, token / output-dim half `wh`.
    const int tile = warp / Cfg::kWarpsPerTile;
    const int wh = warp % Cfg::kWarpsPerTile;
    const uint32_t pair_bar = 1u + static_cast<uint32_t>(tile);  // named barrier of the pair (0 = __syncthreads)
    uint32_t q_frag[Cfg::kQRegSteps > 0 ? Cfg::kQRegSteps : 1][4];
    __nv_bfloat16* q_warp_smem = q_smem + tile * 16 * Cfg::kQSmemRowElems;  // [16 rows][kQSmemRowElems]
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + tile * 16 + g + half * 8;
      const bool row_ok = r < rows;
      const __nv_bfloat16* q_row = q_row_of<Cfg>(p, b, q_len, r);
#pragma unroll
      for (int ks = 0; ks < Cfg::kKSteps; ++ks) {
        const int k0 = cta_dim_of_kstep<Cfg>(rank, ks) + 2 * t4;
        if (ks < Cfg::kQRegSteps) {
          q_frag[ks][half] = row_ok ? *reinterpret_cast<const uint32_t*>(q_row + k0) : 0u;
          q_frag[ks][half + 2] = row_ok ? *reinterpret_cast<const uint32_t*>(q_row + k0 + 8) : 0u;
        } else if (wh == 0) {  // row g + 8 half of this lane's pairs, as an ldmatrix source (one copy per tile)
          __nv_bfloat16* dst = q_warp_smem + (g + half * 8) * Cfg::kQSmemRowElems + (ks - Cfg::kQRegSteps) * 16 + 2 * t4;
          *reinterpret_cast<uint32_t*>(dst) = row_ok ? *reinterpret_cast<const uint32_t*>(q_row + k0) : 0u;
          *reinterpret_cast<uint32_t*>(dst + 8) = row_ok ? *reinterpret_cast<const uint32_t*>(q_row + k0 + 8) : 0u;
        }
      }
    }
    if constexpr (Cfg::kPairs) {
      ptx::named_barrier_sync(pair_bar, 64);  // the tile's Q rows in shared memory, written by warp 0 of the pair
    } else {
      __syncwarp();  // the warp's Q rows in shared memory are read only by the warp itself
    }

    float o_acc[Cfg::kNTilesO][4];
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTilesO; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[nt][e] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};  // running row max (log2 units) of rows g, g + 8 (the same in a pair)
    float l_run[2] = {0.f, 0.f};              // this thread's share of the running row sums (its own tokens)

    const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
    const uint32_t xchg_local = ptx::smem_u32(xchg_smem);
    const uint32_t xchg_remote = ptx::map_to_cta(xchg_local, peer);
    const uint32_t xbar_remote = ptx::map_to_cta(ptx::smem_u32(xfull_bar), peer);
    const int m4 = lane / 8;  // ldmatrix matrix index of this lane's row address
    const int tok0 = wh * (Cfg::kSubTile / Cfg::kWarpsPerTile);  // this warp's first score token of a sub-tile

    auto sub_kv = [&](int j) { return ring_sub_tile<Cfg>(kv_smem, j); };
    auto wait_full = [&](int j) { wait_sub_tile_full<Cfg>(full_bar, j); };
    // S_c of this warp's tokens of sub-tile j over this CTA's 288 dims, in two independent accumulator
    // chains (even / odd k steps) so consecutive MMAs do not wait on each other.
    auto compute_scores = [&](int j, float (&s)[Cfg::kNTilesS][4]) {
      const __nv_bfloat16* kv_sub = sub_kv(j);
      float s2[Cfg::kNTilesS][4];
#pragma unroll
      for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = s2[nt][e] = 0.f;
      uint32_t kb8[4];  // pairs: B fragments of 8 tokens for k steps ks, ks + 1
#pragma unroll
      for (int ks = 0; ks < ((kAblate & kAblateScores) ? 0 : Cfg::kKSteps); ++ks) {
        uint32_t qa_smem[4];
        if (ks >= Cfg::kQRegSteps) {  // matrices: (rows 0-7, k lo), (rows 8-15, k lo), (rows 0-7, k hi), (rows 8-15, k hi)
          ptx::ldmatrix_x4(qa_smem, q_warp_smem + ((m4 % 2) * 8 + lane % 8) * Cfg::kQSmemRowElems +
                                        (ks - Cfg::kQRegSteps) * 16 + (m4 / 2) * 8);
        }
        const uint32_t(&qa)[4] = ks < Cfg::kQRegSteps ? q_frag[ks < Cfg::kQRegSteps ? ks : 0] : qa_smem;
        float(&acc)[Cfg::kNTilesS][4] = (ks % 2) ? s2 : s;
        if constexpr (Cfg::kNTilesS == 1) {
          // matrices: (tokens 0-7, k lo / hi of ks), (tokens 0-7, k lo / hi of ks + 1)
          if (ks % 2 == 0) ptx::ldmatrix_x4(kb8, kv_sub + (tok0 + lane % 8) * Cfg::kKvRowElems + ks * 16 + m4 * 8);
          ptx::mma_bf16_16816(acc[0], qa, kb8[(ks % 2) * 2], kb8[(ks % 2) * 2 + 1]);
        } else {
#pragma unroll
          for (int np = 0; np < Cfg::kNTilesS / 2; ++np) {
            // matrices: (tokens 0-7, k lo), (tokens 0-7, k hi), (tokens 8-15, k lo), (tokens 8-15, k hi)
            const int n = tok0 + np * 16 + (m4 / 2) * 8 + lane % 8;
            uint32_t kb[4];
            ptx::ldmatrix_x4(kb, kv_sub + n * Cfg::kKvRowElems + ks * 16 + (m4 % 2) * 8);
            ptx::mma_bf16_16816(acc[2 * np], qa, kb[0], kb[1]);
            ptx::mma_bf16_16816(acc[2 * np + 1], qa, kb[2], kb[3]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += s2[nt][e];
    };
    // Exchange buffer of sub-tile j in a CTA: [j & 1][consumer warp][n8 tile][lane][4].
    auto xoff_of = [&](int j) { return ((j & 1) * Cfg::kConsumerWarps + warp) * Cfg::kXchgFloatsPerWarp; };
    auto send_scores = [&](int j, const float (&s)[Cfg::kNTilesS][4]) {
      if constexpr (kAblate & kAblateBarriers) return;
      const int xoff = xoff_of(j);
      const uint32_t bar = xbar_remote + static_cast<uint32_t>(((j & 1) * Cfg::kConsumerWarps + warp) * 8);
#pragma unroll
      for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
        const uint32_t dst = xchg_remote + static_cast<uint32_t>((xoff + (nt * 32 + lane) * 4) * 4);
        ptx::st_async_cluster_v4(dst, s[nt][0], s[nt][1], s[nt][2], s[nt][3], bar);
      }
    };
    // S = S_c + S_{1-c} (the same sum in both CTAs), mask, online softmax in registers; leaves P as the
    // bf16 A operand of P V in pa and rescales O.
    auto softmax = [&](int j, float (&s)[Cfg::kNTilesS][4], uint32_t (&pa)[4]) {
      if constexpr (!(kAblate & kAblateBarriers)) {
        uint64_t* bar = xfull_bar + (j & 1) * Cfg::kConsumerWarps + warp;
        if (lane == 0) ptx::mbarrier_arrive_expect_tx(bar, Cfg::kXchgFloatsPerWarp * 4);
        ptx::mbarrier_wait_parity(bar, static_cast<uint32_t>(j >> 1) & 1u);
      }
      const int xoff = xoff_of(j);
#pragma unroll
      for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
        const float4 v = (kAblate & kAblateBarriers) ? make_float4(0.f, 0.f, 0.f, 0.f)
                                                     : *reinterpret_cast<const float4*>(xchg_smem + xoff + (nt * 32 + lane) * 4);
        s[nt][0] = (s[nt][0] + v.x) * scale_log2;
        s[nt][1] = (s[nt][1] + v.y) * scale_log2;
        s[nt][2] = (s[nt][2] + v.z) * scale_log2;
        s[nt][3] = (s[nt][3] + v.w) * scale_log2;
      }
      if constexpr (kAblate & kAblateSoftmax) {  // diagnostic: raw scores as P, no mask / max / exp / rescale
        pa[0] = ptx::pack_bf16x2(s[0][0], s[0][1]);
        pa[1] = ptx::pack_bf16x2(s[0][2], s[0][3]);
        pa[2] = Cfg::kPairs ? 0u : ptx::pack_bf16x2(s[Cfg::kNTilesS - 1][0], s[Cfg::kNTilesS - 1][1]);
        pa[3] = Cfg::kPairs ? 0u : ptx::pack_bf16x2(s[Cfg::kNTilesS - 1][2], s[Cfg::kNTilesS - 1][3]);
        return;
      }
      const int key0 = (tile_begin * Cfg::kSubTiles + j) * Cfg::kSubTile + tok0;  // this warp's first token
      // A sub-tile wholly inside the prefix (all but the last one or two of a request) needs no mask
      // test; the draft rows' mask bits are read (from L1) only for the others.
      if (key0 + Cfg::kNTilesS * 8 > prefix_len) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = row0 + tile * 16 + g + half * 8;
          const int qi = r / Cfg::kHeads;
          int64_t mask_row = 0;
          if constexpr (Cfg::kMask == MaskKind::kTree) {
            if (r < rows) mask_row = request_tree_row(p, b, qi);
          }
#pragma unroll
          for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int key = key0 + nt * 8 + 2 * t4 + e;
              if (!key_visible<Cfg>(key, kv_len, prefix_len, qi, mask_row)) s[nt][2 * half + e] = -INFINITY;
            }
        }
      }
      float alpha[2];
      if constexpr (!Cfg::kPairs) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float tile_max = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < Cfg::kNTilesS; ++nt) tile_max = fmaxf(tile_max, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
          const float m_new = fmaxf(m_run[half], tile_max);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet stays at 0
          alpha[half] = exp2f(m_run[half] - m_use);
          m_run[half] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
            s[nt][2 * half] = exp2f(s[nt][2 * half] - m_use);
            s[nt][2 * half + 1] = exp2f(s[nt][2 * half + 1] - m_use);
            sum += s[nt][2 * half] + s[nt][2 * half + 1];
          }
          l_run[half] = l_run[half] * alpha[half] + sum;
        }
        pa[0] = ptx::pack_bf16x2(s[0][0], s[0][1]);
        pa[1] = ptx::pack_bf16x2(s[0][2], s[0][3]);
        pa[2] = ptx::pack_bf16x2(s[1][0], s[1][1]);
        pa[3] = ptx::pack_bf16x2(s[1][2], s[1][3]);
      } else {
        // Each warp exponentiates its 8 tokens against its own new max, hands P (bf16) and that max to
        // its partner, and both rescale to the pair's max M (the same value in both warps): one barrier.
        float m_own[2], m_use_own[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float tile_max = fmaxf(s[0][2 * half], s[0][2 * half + 1]);
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
          m_own[half] = fmaxf(m_run[half], tile_max);
          m_use_own[half] = m_own[half] == -INFINITY ? 0.f : m_own[half];
          s[0][2 * half] = exp2f(s[0][2 * half] - m_use_own[half]);
          s[0][2 * half + 1] = exp2f(s[0][2 * half + 1] - m_use_own[half]);
        }
        const uint32_t p_lo = ptx::pack_bf16x2(s[0][0], s[0][1]);
        const uint32_t p_hi = ptx::pack_bf16x2(s[0][2], s[0][3]);
        uint4* slot = pair_smem + ((j & 1) * Cfg::kConsumerWarps + warp) * 32 + lane;
        *slot = make_uint4(p_lo, p_hi, __float_as_uint(m_own[0]), __float_as_uint(m_own[1]));
        ptx::named_barrier_sync(pair_bar, 64);
        const uint4 other = *(pair_smem + ((j & 1) * Cfg::kConsumerWarps + (warp ^ 1)) * 32 + lane);
        const float m_oth[2] = {__uint_as_float(other.z), __uint_as_float(other.w)};
        float f_own[2], f_oth[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float m_new = fmaxf(m_own[half], m_oth[half]);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          alpha[half] = exp2f(m_run[half] - m_use);
          m_run[half] = m_new;
          // A side with nothing visible has P = 0: factor 0 (never exp2 of a huge difference).
          f_own[half] = m_own[half] == -INFINITY ? 0.f : exp2f(m_use_own[half] - m_use);
          f_oth[half] = m_oth[half] == -INFINITY ? 0.f : exp2f(m_oth[half] - m_use);
        }
        uint32_t own_lo = p_lo, own_hi = p_hi, oth_lo = other.x, oth_hi = other.y;
        if (!__all_sync(0xffffffffu, f_own[0] == 1.f && f_own[1] == 1.f && f_oth[0] == 1.f && f_oth[1] == 1.f)) {
          s[0][0] *= f_own[0];
          s[0][1] *= f_own[0];
          s[0][2] *= f_own[1];
          s[0][3] *= f_own[1];
          own_lo = ptx::pack_bf16x2(s[0][0], s[0][1]);
          own_hi = ptx::pack_bf16x2(s[0][2], s[0][3]);
          const float2 a = ptx::unpack_bf16x2(oth_lo), c = ptx::unpack_bf16x2(oth_hi);
          oth_lo = ptx::pack_bf16x2(a.x * f_oth[0], a.y * f_oth[0]);
          oth_hi = ptx::pack_bf16x2(c.x * f_oth[1], c.y * f_oth[1]);
        }
        l_run[0] = l_run[0] * alpha[0] + s[0][0] + s[0][1];
        l_run[1] = l_run[1] * alpha[1] + s[0][2] + s[0][3];
        // A operand, k = the sub-tile's 16 tokens: a0 / a1 tokens 0-7 (warp 0 of the pair), a2 / a3 tokens 8-15.
        pa[0] = wh == 0 ? own_lo : oth_lo;
        pa[1] = wh == 0 ? own_hi : oth_hi;
        pa[2] = wh == 0 ? oth_lo : own_lo;
        pa[3] = wh == 0 ? oth_hi : own_hi;
      }
      if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {  // some row max moved
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesO; ++nt) {
          o_acc[nt][0] *= alpha[0];
          o_acc[nt][1] *= alpha[0];
          o_acc[nt][2] *= alpha[1];
          o_acc[nt][3] *= alpha[1];
        }
      }
    };
    // O_c += P V_c for sub-tile j (this warp's kDimVWarp dims): P (bf16) as the A operand.
    auto pv = [&](int j, const uint32_t (&pa)[4]) {
      const __nv_bfloat16* kv_sub = sub_kv(j) + wh * Cfg::kDimVWarp;
      const int token = (m4 % 2) * 8 + lane % 8;
#pragma unroll
      for (int nb = 0; nb < ((kAblate & kAblatePV) ? 0 : Cfg::kNTilesO / 2); ++nb) {
        // matrices: (tokens lo, dims 0-7), (tokens hi, dims 0-7), (tokens lo, dims 8-15), (tokens hi, dims 8-15)
        uint32_t vb[4];
        ptx::ldmatrix_x4_trans(vb, kv_sub + token * Cfg::kKvRowElems + nb * 16 + (m4 / 2) * 8);
        ptx::mma_bf16_16816(o_acc[2 * nb], pa, vb[0], vb[1]);
        ptx::mma_bf16_16816(o_acc[2 * nb + 1], pa, vb[2], vb[3]);
      }
    };

    // Software pipeline over sub-tiles: the scores of j + 1 are computed and sent before P V of j,
    // so the peer's half of them crosses the cluster while this warp runs P V(j).
    const int num_sub = num_tiles * Cfg::kSubTiles;
    float s[Cfg::kNTilesS][4];
    uint32_t pa[4];
    wait_full(0);
    compute_scores(0, s);
    send_scores(0, s);
    softmax(0, s, pa);
#pragma unroll 1
    for (int j = 0; j < num_sub; ++j) {
      const bool more = j + 1 < num_sub;
      if (more) {
        wait_full(j + 1);
        compute_scores(j + 1, s);
        send_scores(j + 1, s);
      }
      pv(j, pa);
      if (j % Cfg::kSubTiles == Cfg::kSubTiles - 1) {  // this warp is done with the stage of sub-tile j
        __syncwarp();
        if (lane == 0) ptx::mbarrier_arrive(empty_bar + (j / Cfg::kSubTiles) % Cfg::kConsStages);
      }
      if (more) softmax(j + 1, s, pa);
    }

    // ---- epilogue: normalized partial O (this warp's dims of the CTA's 256) and, from rank 0, the LSE
    float l_row[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = l_run[half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      l_row[half] = l;
    }
    if constexpr (Cfg::kPairs) {  // row sums of the partner's tokens (buffer of sub-tile num_sub: free, see softmax)
      uint4* slot = pair_smem + ((num_sub & 1) * Cfg::kConsumerWarps + warp) * 32 + lane;
      *slot = make_uint4(__float_as_uint(l_row[0]), __float_as_uint(l_row[1]), 0u, 0u);
      ptx::named_barrier_sync(pair_bar, 64);
      const uint4 other = *(pair_smem + ((num_sub & 1) * Cfg::kConsumerWarps + (warp ^ 1)) * 32 + lane);
      l_row[0] += __uint_as_float(other.x);
      l_row[1] += __uint_as_float(other.y);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float l = l_row[half];
      const int r = tile * 16 + g + half * 8;  // row within the block
      if (r < live_rows) {
        const float inv_l = l > 0.f ? 1.f / l : 0.f;
        float* o_row = p.o_part + (ws_row_base + r) * Cfg::kDimV + rank * Cfg::kDimVCta + wh * Cfg::kDimVWarp;
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesO; ++nt) {
          *reinterpret_cast<float2*>(o_row + nt * 8 + 2 * t4) =
              make_float2(o_acc[nt][2 * half] * inv_l, o_acc[nt][2 * half + 1] * inv_l);
        }
        if (rank == 0 && wh == 0 && t4 == 0) {
          lse_part[r] = row_lse(m_run[half], l);
        }
      }
    }
  }
  __syncwarp();
  ptx::cluster_sync();  // no CTA leaves while its peer may still address its shared memory
}

}  // namespace mlagen
