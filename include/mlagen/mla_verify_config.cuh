// mlagen/mla_verify_config.cuh — compile-time configuration of one MLA verify-attention variant.
// Every constant a kernel uses is derived here; static_asserts reject infeasible variants
// (mlagen/feasibility.py applies the same rules in Python before rendering).
#pragma once
#include <cstdint>

// MLAGEN_ROWBLOCK_PDL 0 (every shipped build): the rowblock partial kernel is launched in stream order. 1: as a
// programmatic dependent of the kernel before it, waiting (griddepcontrol.wait) at its first instruction, with the
// combine letting the next kernel launch from its start: MLAGEN_DST_PDL 1's form (mla_verify_dimsplit_t.cuh), which
// took 0.94-0.97x the time of dimsplit_t's calls at 4k (perf-notes v39). Built for an A/B of the rowblock tiles (the
// q_len 1 winners), not yet timed.
#ifndef MLAGEN_ROWBLOCK_PDL
#define MLAGEN_ROWBLOCK_PDL 0
#endif

namespace mlagen {

enum class MaskKind : int { kNone = 0, kCausal = 1, kTree = 2 };

// Opt-in maximum dynamic shared memory per block: sm_120 (RTX PRO 6000 Blackwell) and sm_90 (H100/H200).
inline constexpr int kSmemLimitSm120 = 101376;
inline constexpr int kSmemLimitSm90 = 232448;

template <int kHeads_, int kQLenMax_, int kKvLoraRank_, int kRopeDim_, int kPageSize_, int kLoadBits_, int kBlockN_, int kWarps_,
          int kRowTiles_, int kStages_, MaskKind kMask_, int kSmemLimit_ = kSmemLimitSm120, int kOverlap_ = 0>
struct MlaVerifyConfig {
  static constexpr bool kDimSplit = false;  // schedule rowblock (mla_verify_partial.cuh)
  static constexpr bool kTransposed = false;  // S^T / O^T MMAs: dimsplit_t only (mla_verify_launch.cuh)
  using PartialT = float;                     // o_part's element type (dimsplit_t: mla_verify_partial_store.cuh)
  static constexpr bool kFusedMerge = false;  // the combine folded in: dimsplit_t diagnostic builds only
  static constexpr int kClusterCtas = 1;
  // Programmatic dependent launch of the partial kernel, waiting at its first instruction (MLAGEN_ROWBLOCK_PDL).
  static constexpr int kPdl = MLAGEN_ROWBLOCK_PDL;
  static_assert(kPdl == 0 || kPdl == 1, "MLAGEN_ROWBLOCK_PDL is 0 or 1");
  // Problem shape (DeepSeek-V3 / Kimi-K2 absorbed MLA).
  static constexpr int kHeads = kHeads_;          // H: query heads per rank
  static constexpr int kQLenMax = kQLenMax_;      // max draft tokens per request
  static constexpr int kKvLoraRank = kKvLoraRank_; // latent dims (512): K and V share them
  static constexpr int kRopeDim = kRopeDim_;       // qk_rope_head_dim (64)
  static constexpr int kDimQK = kKvLoraRank + kRopeDim;  // 576 for DeepSeek-V3 / Kimi-K2
  static constexpr int kDimV = kKvLoraRank;              // 512
  static constexpr int kPageSize = kPageSize_;
  static constexpr MaskKind kMask = kMask_;

  // Tiling. Rows = (query token, head) pairs folded into the MMA M dimension.
  static constexpr int kBlockN = kBlockN_;        // KV tokens per pipeline stage
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowTiles = kRowTiles_;    // m16 row tiles per CTA
  static constexpr int kRowsPerCta = kRowTiles * 16;
  static constexpr int kRowsMax = kHeads * kQLenMax;
  static constexpr int kRowBlocks = (kRowsMax + kRowsPerCta - 1) / kRowsPerCta;
  static constexpr int kStages = kStages_;

  // S = Q K^T: warps form kNGroups x kKGroups; warp (ng, kg) computes partial scores of all rows
  // for tokens [16 ng, 16 ng + 16) over k-step slice kg of the kDimQK / 16 k-steps (its Q slice
  // lives in registers). The kKGroups partials are summed in shared memory.
  static constexpr int kKSteps = kDimQK / 16;
  static constexpr int kNGroups = kBlockN / 16;
  static constexpr int kKGroups = kWarps / (kNGroups > 0 ? kNGroups : 1);
  static constexpr int kKStepsPerWarp = (kKSteps + kKGroups - 1) / (kKGroups > 0 ? kKGroups : 1);
  static constexpr int kNTilesS = 2;  // n8 tiles per warp: 16 tokens
  // O = P V: each warp owns kDimVPerWarp output dims for all rows.
  static constexpr int kDimVPerWarp = kDimV / kWarps;
  static constexpr int kNTilesO = kDimVPerWarp / 8;

  // Global loads. kLoadBits_ = 32/64/128: every thread issues cp.async of kLoadBytes per chunk.
  // kLoadBits_ = 0 ("bulk"): each token's whole 576-dim row moves with one cp.async.bulk (TMA
  // engine, no tensor map), kBulkTokensPerWarp tokens per warp, completion counted on a per-stage mbarrier.
  static constexpr bool kBulkLoad = kLoadBits_ == 0;
  static constexpr int kLoadBytes = kBulkLoad ? 16 : kLoadBits_ / 8;
  static constexpr int kLoadElems = kLoadBytes / 2;
  static constexpr int kChunksPerRow = kDimQK / kLoadElems;
  static constexpr int kRowBytes = kDimQK * 2;                 // one token's K row in global memory
  static constexpr int kBulkTokensPerWarp = (kBlockN + kWarps - 1) / kWarps;

  // Softmax: 8 threads per row.
  static constexpr int kSoftmaxLanes = 8;
  static constexpr int kColsPerLane = kBlockN / kSoftmaxLanes;
  static constexpr int kRowsPerPass = kThreads / kSoftmaxLanes;

  // Shared memory (bytes). Rows padded by 16 B (576 dims: 1168 B = 73 x 16 B); an odd number of
  // 16 B units per row makes the 8 row addresses of an ldmatrix hit distinct bank groups.
  static constexpr int kKvRowElems = kDimQK + 8;
  static constexpr int kPRowElems = kBlockN + 8;
  // Partial-score rows padded by 8 floats: the 8 fragment rows g of a float2 store land on
  // distinct banks (row stride = 8 mod 32 banks), and a softmax lane group reads one row.
  static constexpr int kSRowFloats = kBlockN + 8;
  static constexpr int kSmemKv = kStages * kBlockN * kKvRowElems * 2;
  // overlap: scores of tile t+1 are computed while P V of tile t runs, so two partial-score buffers.
  static constexpr bool kOverlap = kOverlap_ != 0;
  static constexpr int kSBufFloats = kKGroups * kRowsPerCta * kSRowFloats;
  static constexpr int kSmemS = (kOverlap ? 2 : 1) * kSBufFloats * 4;
  static constexpr int kSmemP = kRowsPerCta * kPRowElems * 2;
  static constexpr int kSmemStats = 3 * kRowsPerCta * 4;
  // cp.async path: int64 cache-slot ring, one row per stage. Bulk path: one mbarrier per stage.
  static constexpr int kSmemSlots = kBulkLoad ? 0 : kStages * kBlockN * 8;
  static constexpr int kSmemBars = kBulkLoad ? kStages * 8 : 0;
  static constexpr int kSmemBytes = kSmemKv + kSmemS + kSmemP + kSmemStats + kSmemSlots + kSmemBars;

  // Registers held per thread across the main loop (estimate, fp32/bf16x2 words).
  static constexpr int kRegsQ = kRowTiles * kKStepsPerWarp * 4;
  static constexpr int kRegsS = kRowTiles * kNTilesS * 4;
  static constexpr int kRegsO = kRowTiles * kNTilesO * 4;

  static_assert(kHeads >= 1 && kHeads <= 128, "heads_per_rank must be in [1, 128]");
  static_assert(kQLenMax >= 1 && kQLenMax <= 64, "q_len must be in [1, 64] (tree mask is a 64-bit row)");
  static_assert(kPageSize >= 1 && (kPageSize & (kPageSize - 1)) == 0, "page_size must be a power of two");
  static_assert(kBulkLoad || kLoadBits_ == 32 || kLoadBits_ == 64 || kLoadBits_ == 128,
                "load_width must be 32, 64 or 128 bits, or 0 for bulk copies");
  static_assert(!kBulkLoad || (kRowBytes % 16 == 0 && (kKvRowElems * 2) % 16 == 0),
                "bulk copies move 16-byte multiples between 16-byte aligned rows");
  static_assert(!kBulkLoad || kBulkTokensPerWarp <= 32, "bulk loader: one token per lane");
  static_assert(!kOverlap || kBulkLoad, "overlap needs load_width bulk");
  static_assert(kDimQK % 16 == 0, "kv_lora_rank + qk_rope_head_dim must be a multiple of 16");
  static_assert(kDimQK % kLoadElems == 0, "kv_lora_rank + qk_rope_head_dim must divide by the load width");
  static_assert(kDimV == 128 || kDimV == 256 || kDimV == 512, "the combine handles kv_lora_rank 128, 256 or 512");
  static_assert(kBlockN % 16 == 0 && kBlockN >= 16, "block_n must be a multiple of 16");
  static_assert(kWarps % kNGroups == 0 && kKGroups >= 1, "num_warps must be a multiple of block_n / 16");
  static_assert(kWarps == 4 || kWarps == 8 || kWarps == 16, "num_warps must be 4, 8 or 16");
  static_assert(kDimVPerWarp % 16 == 0, "kv_lora_rank / num_warps must be a multiple of 16");
  static_assert(kColsPerLane >= 1 && kBlockN % kSoftmaxLanes == 0, "block_n must divide by 8");
  static_assert(kStages >= 2, "need at least two pipeline stages");
  static_assert(kBlockN <= kThreads, "one thread per token gathers the page table");
  static_assert(kRowTiles >= 1 && kRowTiles <= 8, "row_tiles must be in [1, 8]");
  static_assert(kSmemBytes <= kSmemLimit_, "shared memory exceeds the per-block limit of the target archs");
  static_assert(kRegsQ + kRegsS + kRegsO <= 200, "register tiles would spill");
};

}  // namespace mlagen
