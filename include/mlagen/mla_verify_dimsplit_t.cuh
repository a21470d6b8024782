// mlagen/mla_verify_dimsplit_t.cuh — split-KV partial kernel of MLA verify attention, schedule "dimsplit_t":
// the dimsplit cluster (two CTAs on two SMs each own half of the 576 dims, so every KV row of a split crosses
// L2 -> shared memory once) with the MMAs transposed and the consumer work split between two kinds of warp.
//
//   S^T = K Q^T    m16 = 16 tokens (a sub-tile is a whole stage: one or two m16 tiles), n8 = 8 (token, head)
//                  rows, k16 = 16 of the CTA's 288 dims. Score warp s holds Q of rows [24s, 24s + 24) as B
//                  fragments in registers (3 n8 tiles x 18 k-steps) and streams K from the stage as A
//                  fragments (ldmatrix): one K fragment feeds 3 MMAs.
//   exchange       the score fragments go to the peer CTA by st.async (bytes complete the peer's exchange
//                  mbarrier), two buffers deep, or one (4 stages at block_n 32) whose reads the peer's warp
//                  signals on the sender's xempty mbarrier; S = S_0 + S_1 is the same sum in both CTAs (fp32;
//                  fp16 pairs in MLAGEN_DST_XCHG_F16 diagnostic builds).
//   softmax        in the score warps' registers: a row is an n index, so its max over the step's tokens is
//                  a register max over the m16 tiles plus a 3-shuffle reduction over the 8 lanes of one t4;
//                  P^T (bf16, [tokens][rows]) and each
//                  row's rescale factor go to a shared buffer (kPBufs deep; pfull / pempty mbarriers). The
//                  softmax of step j runs inside the last K steps of step j + 1 (one basic block; kHalfK).
//                  A row's running max moves only past a slack of 8 (log2; kRescaleSlack), and each score
//                  warp flags the steps where one of its rows' factors is not 1 (kRescaleFlag), so the output
//                  warps seldom rescale O^T.
//   O^T = V^T P^T  m16 = 16 output dims, n8 = rows, k16 = tokens. Output warp o owns 64 of the CTA's 256
//                  output dims for every row (O^T accumulators, 4 x 9 fragments at 72 rows): A = V^T from the
//                  stage (ldmatrix.trans), B = P^T from the buffer (ldmatrix.trans); one V fragment feeds 9
//                  MMAs and one P fragment 4.
//   producer       the dimsplit producer (dimsplit_produce_bf16): 16-byte cp.async into a kStages ring,
//                  full / empty mbarriers, and an L2 prefetch of the tile kStages ahead.
//   fp8 (e4m3)     the producer copies e4m3 rows into a kStages ring (dimsplit_produce_fp8); the output warps
//                  convert tile j + 3 into the bf16 stage tile j just left, after their P V step of j (3 bf16 stages).
//   epilogue       the score warps write each row's 1 / l (and, rank 0, its LSE to lse_part); the output warps
//                  load every row's factor, then store the normalized O^T from registers to o_part, in bf16, a
//                  fragment's dims g and g + 8 side by side, one 4-byte store per pair (mla_verify_partial_store.cuh;
//                  MLAGEN_DST_PARTIAL_BF16 1: dim order, 0: fp32).
// Why (docs/perf-notes.md, dimsplit_t): mma.sync takes both operands from registers, so a warp re-reads from
// shared memory every operand it does not hold. In dimsplit each of 5 m16 warps reads all of K and V
// (~106 KB of ldmatrix per 16 tokens per CTA with its Q steps), against ~45 KB here (3 score warps read K,
// each output warp only its 64 dims of V, plus P); 72 rows are 9 n8 tiles (no padding to 80); and the score
// and output work run in different warps, so one's latency hides behind the other's MMAs.
// Only mma.sync, ldmatrix, cp.async, mbarrier and cluster shared memory (st.async): the same code runs on
// sm_90 and sm_120. Fragment layouts: PTX ISA "Matrix Fragments for mma.m16n8k16" and "ldmatrix".
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>

#include "mlagen/mla_verify_config.cuh"
#include "mlagen/mla_verify_dimsplit.cuh"  // dimsplit_produce_bf16
#include "mlagen/mla_verify_merge.cuh"
#include "mlagen/mla_verify_new_kv.cuh"
#include "mlagen/mla_verify_params.cuh"
#include "mlagen/mla_verify_partial.cuh"  // key_visible
#include "mlagen/mla_verify_partial_store.cuh"
#include "mlagen/mla_verify_split.cuh"
#include "mlagen/ptx.cuh"

// Diagnostic builds only (tools/device_ab_define.py), for A/B timing of the prologue: MLAGEN_DST_PROLOGUE 0 (every
// shipped build): the producer zero-fills the rows past kv_len of the last tile; 1: v14's, the whole ring zeroed
// before the first copy (perf-notes v15).
#ifndef MLAGEN_DST_PROLOGUE
#define MLAGEN_DST_PROLOGUE 0
#endif
// MLAGEN_DST_PRODUCER 0 (every shipped build): the v16 producer (a whole tile's copies unrolled, the L2 prefetch's
// page entries two tiles ahead); 1: v15's producer, for A/B timing (perf-notes v16).
#ifndef MLAGEN_DST_PRODUCER
#define MLAGEN_DST_PRODUCER 0
#endif
// MLAGEN_DST_TREE_ROWS 0 (every shipped build): a request's tree rows are read once into shared memory (by an output
// warp, in the CTAs whose split holds draft keys) and the masked steps read them there; 1: v15's, each masked
// step reads them from global memory itself (perf-notes v16).
#ifndef MLAGEN_DST_TREE_ROWS
#define MLAGEN_DST_TREE_ROWS 0
#endif

// MLAGEN_DST_MASK_PEEL 1 (every shipped build): a bf16 build's score loop runs the split's steps that hold only prefix
// keys in a loop of their own, whose body has no masking code, and the steps after them (draft keys or keys past
// kv_len: the last few of a request's last split) in a second loop; 0: v19's single loop with the masking code
// between the two halves of every step, for A/B timing (perf-notes v20). e4m3 builds keep the single loop either way.
#ifndef MLAGEN_DST_MASK_PEEL
#define MLAGEN_DST_MASK_PEEL 1
#endif

// MLAGEN_DST_MERGE 0 (every shipped build): no merge code in the kernel, every launch runs the combine kernel; 1: the
// kernel can fold the combine in (mla_verify_merge.cuh; the launch decides per grid), a diagnostic build: on an H200
// it measured 1.1-11 % slower than the combine kernel (perf-notes v21).
#ifndef MLAGEN_DST_MERGE
#define MLAGEN_DST_MERGE 0
#endif

// MLAGEN_DST_FP8_CONVERT 0 (every shipped build): the output warps' e4m3 -> bf16 conversion of a tile issues all of a
// thread's shared-memory loads first, then converts and stores (dimsplit_t_convert_fp8_tile); 1: one chunk at a time
// (dimsplit's converter loop, dimsplit_convert_fp8_tile), for A/B timing (perf-notes v18).
#ifndef MLAGEN_DST_FP8_CONVERT
#define MLAGEN_DST_FP8_CONVERT 0
#endif

// MLAGEN_DST_L2_PREFETCH 2 (every shipped build): the producer prefetches into L2 the tile kStages ahead (perf-notes
// v12b) except in bf16 builds of 3 score warps and at least 4 stages: there the builds without it took 0.944-1.004x
// the time on an H200 (perf-notes v25); 1: in every build (v12b-v24); 0: in none. For A/B timing
// (tools/device_ab_define.py) and traffic (tools/l2_bytes.py --define).
#ifndef MLAGEN_DST_L2_PREFETCH
#define MLAGEN_DST_L2_PREFETCH 2
#endif

// MLAGEN_DST_HALF_K 0 (every shipped build): a score step runs this many of its 18 K steps before it receives the peer's
// half of the previous step's scores; the rest carry that step's softmax, its pieces spread evenly over them. 0: 4 in
// bf16 builds of 3 score warps (perf-notes v26: 0.937-1.003x the time of 9 on an H200, outputs bit-identical) or of
// one (the q_len 1 tile, v27: 0.976-1.002x) with at least 4 stages, 9 (v12-v25: one piece per K step) in the others
// (e4m3: level, v27); 1-17 force it, for A/B timing.
#ifndef MLAGEN_DST_HALF_K
#define MLAGEN_DST_HALF_K 0
#endif

// MLAGEN_DST_TRACE 0 (every shipped build): 1: a diagnostic build that times each consumer warp's waits with %clock64
// (and, in bf16 builds, the producer warp's waits for a stage to empty: perf-notes v38)
// and prints, for every cluster of row block 0 (blockIdx.x < 2: every split and request) of every launch, one line per warp (tools/dst_trace.py reads them): its sub-tiles,
// the cycles and the %globaltimer ns from the cluster barrier to the end of its role (cycles / ns: the SM clock), the
// cycles before its first sub-tile (score warps: the Q loads) and after its last (the row sums / the epilogue), the
// cycles inside each of its waits (perf-notes v28), and the absolute %globaltimer ns of its CTA's start (with
// MLAGEN_DST_PDL 1: once its wait for the kernel before has returned), of the cluster
// barrier and of its role's end (the launch's timeline), and for the score warps the cycles from the cluster barrier
// until every Q fragment has landed and until the first stage has (perf-notes v35).
#ifndef MLAGEN_DST_TRACE
#define MLAGEN_DST_TRACE 0
#endif
#if MLAGEN_DST_TRACE
#include <cstdio>  // device printf
#endif

// MLAGEN_DST_PBUFS 2 (every shipped build): P^T buffers; MLAGEN_DST_XBUFS 0 (every shipped build): score exchange buffers
// chosen by what fits in sm_120's 99 KB (two, else one), 1 or 2 forces the count (a build whose shared memory exceeds its
// archs' limit fails to compile). For A/B timing of the exchange's handshake and the P^T buffers (perf-notes v26).
#ifndef MLAGEN_DST_PBUFS
#define MLAGEN_DST_PBUFS 2
#endif
#ifndef MLAGEN_DST_XBUFS
#define MLAGEN_DST_XBUFS 0
#endif

// MLAGEN_DST_BULK 0 (every shipped build): the producer's lanes copy a token's halves with 16-byte cp.async; 1: with
// two cp.async.bulk per token (dimsplit's bulk producer: one expect_tx arrival per stage, the ring zeroed up front),
// bf16 only, for measuring the L2 -> SM bytes and time of each copy form (perf-notes v25).
#ifndef MLAGEN_DST_BULK
#define MLAGEN_DST_BULK 0
#endif

// MLAGEN_DST_EPILOGUE 1 (every shipped build): the score warps turn each row sum into its reciprocal (rcp.approx) and
// the LSE (lg2.approx) and hand the reciprocals over in pairs; the output warps load all their rows' factors first,
// then store. 0: v30's, the output warps divide per row (IEEE division, a slow-path call) between the stores of
// consecutive rows, and the LSE uses log2f, for A/B timing (perf-notes v31: the code runs once per call, cold, and
// each row's branches kept the rows' latency chains apart).
#ifndef MLAGEN_DST_EPILOGUE
#define MLAGEN_DST_EPILOGUE 1
#endif

// MLAGEN_DST_RESCALE_SLACK -1 (every shipped build): the rescale slack N of MlaDimSplitTConfig::kRescaleSlack, 8 in
// builds of 1 or 3 score warps and 0 in builds of 2 (there the slack's registers cost 4 B of spills on sm_90 at H1 q40).
// With N = 0 a row's running max follows every new maximum, so the output warps rescale O^T (144 FMULs per thread) in
// every step where some row's max grew: with i.i.d. scores that is most steps of a split (a row sets a new record in
// tile t with probability ~1/t; 72 rows). N > 0: the running max moves only when the step's max exceeds it by more than
// N (log2 units), as FlashAttention-4 does (Modal, "We reverse-engineered Flash Attention 4", 2025): P = 2^(s
// scale_log2 - m) is then up to 2^N, l and O^T share that reference, so the result is the same softmax up to bf16
// rounding of P, and the output warps skip the rescale in the other steps (perf-notes v33b, v34: with the flags below,
// 0.953-0.990x the time of N = 0 on an H200). 0-16 force N, for A/B timing.
#ifndef MLAGEN_DST_RESCALE_SLACK
#define MLAGEN_DST_RESCALE_SLACK -1
#endif

// MLAGEN_DST_RESCALE_FLAG -1 (every shipped build): MlaDimSplitTConfig::kRescaleFlag is on where the slack is. 0: the
// output warps load every row's rescale factor of a step (9 LDS.64 at 72 rows) and test each against 1 (~45 SASS
// instructions per step) to decide whether to rescale O^T; 1: each score warp also publishes one flag per P^T buffer
// (some factor of its rows differs from 1, a warp vote), the output warps read the flags and load the factors only when
// one is set (perf-notes v33c). Bit-identical outputs either way; 0 / 1 force it, for A/B timing.
#ifndef MLAGEN_DST_RESCALE_FLAG
#define MLAGEN_DST_RESCALE_FLAG -1
#endif

// MLAGEN_DST_PDL 1 (every shipped build): the partial kernel is launched as a programmatic dependent of the kernel
// before it in the stream (cudaLaunchAttributeProgrammaticStreamSerialization), and the combine lets the next kernel
// launch from its start, so a call's CTAs may be scheduled while the kernel before it (e.g. the previous call's
// combine) still runs; they wait (griddepcontrol.wait) at their first instruction, before any global access, so the
// order of every read and write is the stream's. On an H100 it took 0.943x the time at 4k bs 1 and 0.969x at bs 4,
// 0.98-1.00x from 16k up (perf-notes v39). 0: launched in stream order (v38). 2 (diagnostic): the wait comes after
// reading the request's kv_len and page-table row index, correct only when the kernel just before wrote neither;
// 0.917x at 4k bs 1 (a wait after the cluster's barrier set-up as well gained nothing more and was removed). For A/B
// timing.
#ifndef MLAGEN_DST_PDL
#define MLAGEN_DST_PDL 1
#endif

// MLAGEN_DST_XCHG_F16 0 (every shipped build): the score exchange carries fp32 scores. 2 (diagnostic, perf-notes v40):
// it carries each CTA's half of S^T as fp16 pairs
// (cvt.rn.satfinite.f16x2.f32: round to nearest, |S_c| past 65504 clamped), and each CTA adds the peer's rounded half
// to its own fp32 half. A warp's send of a 32-token step is then 1.5 KB in 3 st.async of 16 B per lane (fp32: 3 KB in
// 6), and two exchange buffers fit in sm_120's 99 KB beside 4 stages (no xempty handshake). The two CTAs' S then differ
// by the rounding of one half (|error| <= 2^-11 |S_c| for |S_c| in fp16's normal range, before the softmax scale):
// each CTA's P, row sums and O^T half
// are one consistent softmax of its own S, and the combine weighs both halves by rank 0's LSE. Measured on an H100
// (perf-notes v40): 0.989-1.007x the time of fp32, L2 -> SM 1.83 x KV instead of 2.08 at 64k bs 1, outputs within
// 0.0039 of the fp32 exchange's. 1 (diagnostic): each CTA rounds its own half too, so S = S_0 + S_1 is the same sum in
// both (24 more conversions per lane and step: 1.006-1.023x, slower). Not shipped: the rounding is relative to the
// partial score itself, not to its distance from the row max, so at Kimi-K2's logits (QK-clip caps them near 100) a
// CPU emulation of form 2 gives output errors up to 1.8e-2 (half the verify bound, several bf16 steps) for a 1-2 %
// gain; at N(0, 1) test inputs it is within 0.0039 of fp32. For A/B timing and accuracy studies.
#ifndef MLAGEN_DST_XCHG_F16
#define MLAGEN_DST_XCHG_F16 0
#endif

// MLAGEN_DST_COPY_L1 0 (every shipped build): the bf16 producer's 16-byte copies are cp.async.cg. 1: .ca (through L1)
// in every bf16 build; -1: .ca only in builds of 3 score warps whose rows are one row block (H8 q9: 72 rows). .ca
// copies cross L2 -> SM as 1.07x the KV bytes against .cg's 1.56x (perf-notes v25, v40; why .cg moves more is not
// known), but on an H100 with the fp32 exchange they took 0.985-1.014x the time of .cg at H8 (above 1 from 64k up)
// and 1.060-1.100x at H16 (2 row blocks) and H64 (8 row blocks, each cluster of a split reading the same KV rows).
// For A/B timing and L2 -> SM measurements.
#ifndef MLAGEN_DST_COPY_L1
#define MLAGEN_DST_COPY_L1 0
#endif

namespace mlagen {

// e4m3 KV cache: thread ct's share (of kNThreads) of converting one e4m3 stage (positions [pos0, pos0 + kBlockN))
// into a bf16 stage, as dimsplit_convert_fp8_tile does (fp8_chunk_to_stage: draft rows from k_new in bf16, rows past
// kv_len 0, the rest dequantized exactly), with every shared-memory load of the thread issued before the first
// conversion, so the loads' latency is paid once per tile instead of once per chunk.
template <class Cfg, int kNThreads>
__device__ __forceinline__ void dimsplit_t_convert_fp8_tile(const MlaVerifyParams& p, int b, int q_len, int pos0,
                                                            int kv_len, int prefix_len, uint32_t rank,
                                                            const uint8_t* src_stage, __nv_bfloat16* dst_stage, int ct) {
  constexpr int kChunksPerRow = Cfg::kDimCta / 16;  // 16 latent + 2 rope chunks of 16 values
  constexpr int kChunks = Cfg::kBlockN * kChunksPerRow;
  constexpr int kPerThread = (kChunks + kNThreads - 1) / kNThreads;
  uint4 raw[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int c = ct + k * kNThreads;
    if (c < kChunks) {
      raw[k] = *reinterpret_cast<const uint4*>(src_stage + (c / kChunksPerRow) * Cfg::kFp8RowBytes +
                                               (c % kChunksPerRow) * 16);
    }
  }
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int c = ct + k * kNThreads;
    if (c < kChunks) {
      const int n = c / kChunksPerRow;
      fp8_chunk_to_stage<Cfg>(p, b, q_len, pos0 + n, n, c % kChunksPerRow, kv_len, prefix_len, rank, raw[k], dst_stage);
    }
  }
}

// mbarriers of a dimsplit_t CTA with x_bufs score exchange buffers: full, empty [cons_stages]; exchange
// [x_bufs][score_warps]; pfull, pempty [p_bufs]; with one exchange buffer, xempty [score_warps] (the peer's warp has
// read this warp's last send); tree (the request's tree rows are in shared memory); fp8: full8, empty8 [fp8_bars / 2]
// (the e4m3 ring). One count for the exchange-buffer choice and the layout (feasibility.py mirrors it).
constexpr int dimsplit_t_num_bars(int x_bufs, int cons_stages, int score_warps, int p_bufs, bool tree_bar, int fp8_bars) {
  return 2 * cons_stages + x_bufs * score_warps + 2 * p_bufs + (x_bufs == 1 ? score_warps : 0) + (tree_bar ? 1 : 0) +
         fp8_bars;
}

template <int kHeads_, int kQLenMax_, int kKvLoraRank_, int kRopeDim_, int kPageSize_, int kLoadBits_, int kBlockN_,
          int kWarps_, int kRowTiles_, int kStages_, MaskKind kMask_, int kSmemLimit_ = kSmemLimitSm120,
          bool kKvFp8_ = false>
struct MlaDimSplitTConfig {
  static constexpr bool kDimSplit = true;    // a two-CTA cluster per (row block, split, request)
  static constexpr bool kTransposed = true;  // S^T = K Q^T, O^T = V^T P^T (this header)
  // e4m3 KV cache: the producer fills an e4m3 ring of kStages stages; the output warps dequantize each tile into
  // the bf16 ring of kConvStages stages that the score and output warps read, right after their P V step
  // (dimsplit_t_convert_fp8_tile; docs/perf-notes.md v18).
  static constexpr bool kKvFp8 = kKvFp8_;
  static constexpr int kClusterCtas = 2;
  // Programmatic dependent launch of the partial kernel and where it waits (MLAGEN_DST_PDL).
  static constexpr int kPdl = MLAGEN_DST_PDL;
  static_assert(kPdl >= 0 && kPdl <= 2, "MLAGEN_DST_PDL is 0-2");
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
  static constexpr int kStages = kStages_;
  // fp8: bf16 stages the output warps fill. A tile is read by the score warps (K of step j) and then by the output
  // warps (V, during the score warps' step j + 2), so three tiles are live at once: tile j + 3 is converted into
  // tile j's stage right after the output warps' step j, one score step before it is needed.
  static constexpr int kConvStages = 3;
  static constexpr int kConsStages = kKvFp8 ? kConvStages : kStages;  // stages of the ring the consumers read
  // The producer prefetches into L2 the tile kStages ahead of the one it copies: a stage is held by the score
  // warps (K) and then the output warps (V) for about two steps, so with 3 stages a copy is issued only about
  // one step before the score warps need it, less than the DRAM latency (perf-notes v12b). fp8: the tile
  // kStages + 2 ahead (the e4m3 ring is copied about kConvStages - 1 steps before the score warps need a tile).
  // Not in bf16 builds of 3 score warps with 4 or more stages (MLAGEN_DST_L2_PREFETCH 2): with the 4th stage (v13) and
  // the page entries two tiles ahead (v16) the copies start early enough, and the prefetch measured slower (v25).
  static constexpr bool kL2Prefetch =
      MLAGEN_DST_L2_PREFETCH == 1 || (MLAGEN_DST_L2_PREFETCH == 2 && (kKvFp8 || kStages < 4 || kRowTiles_ != 3));
  static constexpr int kL2PrefetchTiles = !kL2Prefetch ? 0 : kKvFp8 ? kStages + 2 : kStages;
  // The producer zero-fills the rows past kv_len of a request's last tile (src-size 0 copies) instead of the
  // prologue zeroing the whole ring (75 KB at 4 stages) before the first copy.
  static constexpr bool kZeroFillTail = MLAGEN_DST_PROLOGUE == 0 && MLAGEN_DST_BULK == 0;
  // The producer's v16 form (dimsplit_produce_bf16): a whole tile's copies in one unrolled block and the L2
  // prefetch's page entries requested two tiles ahead.
  static constexpr bool kProducerV16 = MLAGEN_DST_PRODUCER == 0;
  // The bf16 producer's 16-byte copies through L1 (.ca; MLAGEN_DST_COPY_L1; -1: where the rows are one row block of 3
  // score warps, kRowTiles_ being the score warp count). The e4m3 producer does not use it.
  static constexpr bool kCopyL1 =
      !kKvFp8_ &&
      (MLAGEN_DST_COPY_L1 >= 0 ? MLAGEN_DST_COPY_L1 != 0 : kRowTiles_ == 3 && kHeads_ * kQLenMax_ <= 3 * 24);
  static_assert(MLAGEN_DST_COPY_L1 >= -1 && MLAGEN_DST_COPY_L1 <= 1, "MLAGEN_DST_COPY_L1 is -1, 0 or 1");
  // The score warps' unmasked steps in a loop without masking code (perf-notes v20: in v19's single loop the ~450
  // SASS instructions of the mask sat between the two halves of every step, and the jump over them missed the
  // instruction cache; bf16 1.1-3.4 % faster). Not for e4m3 pools: there it measured 0.996-1.009x.
  static constexpr bool kMaskPeel = MLAGEN_DST_MASK_PEEL != 0 && !kKvFp8;
  // The combine folded into this kernel when the launch's grid is co-resident (mla_verify_merge.cuh, perf-notes v21;
  // diagnostic builds only: slower than the combine kernel so far).
  static constexpr bool kFusedMerge = MLAGEN_DST_MERGE != 0;

  // Warp roles: score warps [0, kScoreWarps), output warps [kScoreWarps, kScoreWarps + kOutWarps), a producer.
  static constexpr int kRowTiles = kRowTiles_;  // score warps, 24 rows (3 n8 tiles) each
  static constexpr int kScoreWarps = kRowTiles;
  static constexpr int kRowsPerScoreWarp = 24;
  static constexpr int kNTilesS = kRowsPerScoreWarp / 8;
  static constexpr int kRowsPerCta = kRowTiles * kRowsPerScoreWarp;  // rows of the cluster (both CTAs: all)
  static constexpr int kRowNTiles = kRowsPerCta / 8;
  // The rescale slack (log2 units) and the score warps' rescale flags (MLAGEN_DST_RESCALE_SLACK / _FLAG above).
  static constexpr int kRescaleSlack =
      MLAGEN_DST_RESCALE_SLACK >= 0 ? MLAGEN_DST_RESCALE_SLACK : (kScoreWarps == 2 ? 0 : 8);
  static_assert(kRescaleSlack <= 16, "MLAGEN_DST_RESCALE_SLACK: P up to 2^N in bf16 and fp32 sums");
  static constexpr bool kRescaleFlag =
      MLAGEN_DST_RESCALE_FLAG >= 0 ? MLAGEN_DST_RESCALE_FLAG != 0 : kRescaleSlack > 0;
  static constexpr int kOutWarps = 4;
  static constexpr int kFirstOutWarp = kScoreWarps;
  static constexpr int kConsumerWarps = kScoreWarps + kOutWarps;  // arrivals on empty[stage]
  static constexpr int kProducerWarp = kConsumerWarps;
  static constexpr int kProducerWarps = 1;
  static constexpr int kTokensPerProducer = kBlockN;
  static constexpr int kRowsMax = kHeads * kQLenMax;
  static constexpr int kRowBlocks = (kRowsMax + kRowsPerCta - 1) / kRowsPerCta;

  // This CTA's half of a KV row (as in MlaDimSplitConfig).
  static constexpr int kLatentHalf = kKvLoraRank / 2;
  static constexpr int kRopeHalf = kRopeDim / 2;
  static constexpr int kDimCta = kLatentHalf + kRopeHalf;  // 288
  static constexpr int kKSteps = kDimCta / 16;              // 18
  static constexpr int kLatentSteps = kLatentHalf / 16;
  static constexpr int kDimVCta = kLatentHalf;              // 256 output dims per CTA
  static constexpr int kDimVWarp = kDimVCta / kOutWarps;    // 64 per output warp
  static constexpr int kMTilesO = kDimVWarp / 16;           // m16 dim tiles per output warp
  // A score / output step is a whole stage: block_n 32 gives each score warp two m16 token tiles per step
  // (6 independent accumulators per K step, one softmax pass per 32 tokens), block_n 16 one (two
  // accumulator chains over the even / odd K steps instead).
  static constexpr int kSubTile = kBlockN;
  static constexpr int kSubTiles = 1;
  static constexpr int kMTilesS = kSubTile / 16;

  // Shared memory: the KV ring (rows padded by 16 B: 592 B = 37 x 16 B, so the 8 rows of an ldmatrix fall in
  // distinct bank groups), fp8: the e4m3 ring, the exchange buffers [kXBufs][kScoreWarps][kMTilesS x 3 tiles][32 lanes][4 floats]
  // (fp16: [3 tiles][32 lanes][kMTilesS x 2 words]),
  // the P^T buffers [kPBufs][kSubTile tokens][kPRowElems] bf16 (row stride an odd count of 16-B units, same reason), the
  // rescale factors [kPBufs][kRowsPerCta], the final row sums [kRowsPerCta], then the mbarriers.
  static constexpr int kKvRowElems = kDimCta + 8;
  static constexpr int kStageElems = kBlockN * kKvRowElems;
  static constexpr int kSmemKv = kConsStages * kStageElems * 2;  // the bf16 ring the score and output warps read
  // fp8: e4m3 stages of kBlockN rows of this CTA's 288 bytes, padded by 16 B (304 = 19 x 16 B), after the bf16 ring
  static constexpr int kFp8RowBytes = kDimCta + 16;
  static constexpr int kFp8StageBytes = kBlockN * kFp8RowBytes;
  static constexpr int kSmemFp8 = kKvFp8 ? kStages * kFp8StageBytes : 0;
  static constexpr int kFp8Bars = kKvFp8 ? 2 * kStages : 0;  // full8, empty8 [kStages]
  // A score warp's exchange fragment in 32-bit words per lane and step: fp32 scores (4 per m16 x n8 tile) or fp16
  // pairs (2 per tile; MLAGEN_DST_XCHG_F16).
  // (bf16 KV only: e4m3 builds always exchange fp32)
  static constexpr bool kXchgF16 = MLAGEN_DST_XCHG_F16 != 0 && !kKvFp8;
  static constexpr bool kXchgRoundOwn = kXchgF16 && MLAGEN_DST_XCHG_F16 == 1;  // each CTA adds its own half as sent
  static_assert(MLAGEN_DST_XCHG_F16 >= 0 && MLAGEN_DST_XCHG_F16 <= 2, "MLAGEN_DST_XCHG_F16 is 0-2");
  static constexpr int kXchgWordsPerTile = kXchgF16 ? 2 : 4;
  static constexpr int kXchgWordsPerWarp = kMTilesS * kNTilesS * 32 * kXchgWordsPerTile;
  // Two P^T buffers: a score warp writes P^T of sub-tile j once the output warps are done with j - 2, so while
  // it computes j + 1 the output warps may still hold j - 2 .. j (perf-notes v11: three buffers measured the
  // same).
  static constexpr int kPBufs = MLAGEN_DST_PBUFS;
  static_assert(kPBufs == 1 || kPBufs == 2, "MLAGEN_DST_PBUFS must be 1 or 2");
  static constexpr int kPRowElems = (kRowsPerCta * 2 / 16) % 2 == 1 ? kRowsPerCta : kRowsPerCta + 8;
  static constexpr int kPBufElems = kSubTile * kPRowElems;
  static constexpr int kSmemP = kPBufs * kPBufElems * 2;
  static constexpr int kSmemAlpha = kPBufs * kRowsPerCta * 4;
  static constexpr int kSmemStats = kRowsPerCta * 4;
  // The request's tree rows (int64 per draft query), read once per CTA instead of in every masked step: keeps the
  // masked steps' code short (it sits inside the score loop's hot block; perf-notes v16).
  static constexpr bool kTreeRowsSmem = kMask == MaskKind::kTree && MLAGEN_DST_TREE_ROWS == 0;
  static constexpr int kSmemTree = kTreeRowsSmem ? kQLenMax * 8 : 0;
  // Score exchange buffers: two when they fit beside the ring in sm_120's 99 KB (a warp's send of sub-tile
  // j + 2 then follows its peer's read of j with no further signal), else one, and the peer's read of j is
  // signalled by an arrival on this warp's xempty barrier before the send of j + 1 (the exchange costs one
  // buffer of fp32 scores, 9 KB at 72 rows x 32 tokens, so a 4th 32-token stage fits: perf-notes v13).
  static constexpr int kXchgBufBytes = kScoreWarps * kXchgWordsPerWarp * 4;
  static constexpr int kSmemWithTwoXBufsNoFlags =
      kSmemKv + kSmemFp8 + 2 * kXchgBufBytes + kSmemP + kSmemAlpha + kSmemStats + kSmemTree +
      dimsplit_t_num_bars(2, kConsStages, kScoreWarps, kPBufs, kTreeRowsSmem, kFp8Bars) * 8;
  // (with the rescale flags after everything else, 16-byte aligned, as kSmemBytes below counts them)
  static constexpr int kSmemWithTwoXBufs =
      kRescaleFlag ? (kSmemWithTwoXBufsNoFlags + 15) / 16 * 16 + kPBufs * 16 : kSmemWithTwoXBufsNoFlags;
  static constexpr int kXBufs = MLAGEN_DST_XBUFS != 0 ? MLAGEN_DST_XBUFS : kSmemWithTwoXBufs <= kSmemLimitSm120 ? 2 : 1;
  static_assert(kXBufs == 1 || kXBufs == 2, "MLAGEN_DST_XBUFS must be 0, 1 or 2");
  static constexpr int kSmemXchg = kXBufs * kXchgBufBytes;
  static constexpr int kXEmptyBars = kXBufs == 1 ? kScoreWarps : 0;
  static constexpr int kNumBars = dimsplit_t_num_bars(kXBufs, kConsStages, kScoreWarps, kPBufs, kTreeRowsSmem, kFp8Bars);
  static constexpr int kSmemBars = kNumBars * 8;
  // kRescaleFlag: [kPBufs][4] int flags (one per score warp) after everything else, 16-byte aligned
  static constexpr int kSmemBeforeFlags =
      kSmemKv + kSmemXchg + kSmemP + kSmemAlpha + kSmemStats + kSmemTree + kSmemBars + kSmemFp8;
  static constexpr int kFlagOffset = (kSmemBeforeFlags + 15) / 16 * 16;
  static constexpr int kSmemBytes = kRescaleFlag ? kFlagOffset + kPBufs * 16 : kSmemBeforeFlags;

  // The partials' element type (mla_verify_partial_store.cuh, perf-notes v22): bf16 in shipped builds.
  static constexpr bool kPartialBf16 = MLAGEN_DST_PARTIAL_BF16 != 0;
  using PartialT = typename PartialElem<kPartialBf16>::type;

  // The producer (dimsplit_produce_bf16): 16-byte cp.async, one warp instruction per token's latent half.
  static constexpr bool kBulkLoad = MLAGEN_DST_BULK != 0;
  static constexpr int kLoadBytes = 16;
  static constexpr int kLatentBytes = kLatentHalf * 2;
  static constexpr int kRopeBytes = kRopeHalf * 2;
  static constexpr int kTokenBytes = kDimCta * 2;
  static constexpr int kLatentChunks = kLatentHalf * 2 / 16;
  static constexpr int kRopeChunks = kRopeHalf * 2 / 16;

  // Registers held per thread across the main loop: score warps Q (B fragments) + two accumulator chains +
  // the previous sub-tile's scores; output warps the O^T accumulators.
  static constexpr int kRegsScore = kKSteps * kNTilesS * 2 + 3 * kMTilesS * kNTilesS * 4;
  static constexpr int kRegsOut = kMTilesO * kRowNTiles * 4;

  static_assert(kHeads >= 1 && kHeads <= 128, "heads_per_rank must be in [1, 128]");
  static_assert(kQLenMax >= 1 && kQLenMax <= 64, "q_len must be in [1, 64] (tree mask is a 64-bit row)");
  static_assert(kPageSize >= 1 && (kPageSize & (kPageSize - 1)) == 0, "page_size must be a power of two");
  static_assert(kLoadBits_ == 128, "dimsplit_t: load_width must be 128 (16-byte cp.async producer)");
  static_assert(kKvLoraRank == 512 && kRopeDim == 64,
                "dimsplit_t: kv_lora_rank 512 and qk_rope_head_dim 64 (a 512-byte latent half per producer "
                "instruction, 64 output dims per output warp)");
  static_assert(kBlockN == 16 || kBlockN == 32, "dimsplit_t: block_n must be 16 or 32 (one token per producer lane)");
  static_assert(kRowTiles >= 1 && kRowTiles <= 3, "dimsplit_t: row_tiles (score warps of 24 rows) must be 1..3");
  static_assert(kWarps == kRowTiles + kOutWarps + 1, "dimsplit_t: num_warps must be row_tiles + 5");
  static_assert(kStages >= 2, "need at least two pipeline stages");
  static_assert(!kKvFp8 || kBlockN == 32, "dimsplit_t fp8: block_n 32 (the e4m3 producer copies two tokens' latent "
                                          "halves per instruction, 16 tokens' rope halves)");
  static_assert(kDimV == 128 || kDimV == 256 || kDimV == 512, "the combine handles kv_lora_rank 128, 256 or 512");
  static_assert(!kBulkLoad || !kKvFp8, "dimsplit_t: the bulk producer (MLAGEN_DST_BULK) is bf16 only");
  static_assert(kSmemBytes <= kSmemLimit_, "shared memory exceeds the per-block limit of the target archs");
  static_assert(kRegsScore <= 184 && kRegsOut <= 184, "register tiles would spill");
  static_assert(MergeShape<kThreads>::kSmemBytes <= kSmemKv, "the fused merge's scratch must fit in the KV ring");
  static_assert(!(kFusedMerge && kPartialBf16), "the fused merge reads fp32 partials (MLAGEN_DST_PARTIAL_BF16 0)");
};

// O^T *= alpha per row (n index): the output warps' rescale when some row max moved.
template <int kMTiles, int kN>
__device__ __forceinline__ void dimsplit_t_rescale_o(float (&o)[kMTiles][kN][4], const float2 (&alpha)[kN]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
      o[mt][nt][0] *= alpha[nt].x;
      o[mt][nt][1] *= alpha[nt].y;
      o[mt][nt][2] *= alpha[nt].x;
      o[mt][nt][3] *= alpha[nt].y;
    }
}

// One CTA's partial: o_part / lse_part of its (row block, split, request), in smem_raw (Cfg::kSmemBytes).
// Online softmax of one row of a sub-tile's score fragments S^T (n8 tile nt, column parity e: row 2 t4 + e, whose
// tokens 16 mt + g, + 8 are the 8 lanes of one t4): the max over the step's tokens (registers, then 3 shuffles over
// those lanes), P = 2^(S scale_log2 - m) in place by one FFMA and one ex2.approx.ftz each (m_run: scaled, log2 units),
// the row's rescale factor alpha = 2^(m_old - m_new), and this thread's share of the running sum l_run.
template <int kSlack, int kM, int kN>
__device__ __forceinline__ void dimsplit_t_softmax_row(float (&s)[kM][kN][4], int nt, int e, float scale_log2,
                                                       float& m_run, float& l_run, float& alpha) {
  float mx = -INFINITY;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) mx = fmaxf(mx, fmaxf(s[mt][nt][e], s[mt][nt][2 + e]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
  float m_new;
  if constexpr (kSlack > 0) {
    const float mx_s = mx * scale_log2;  // (m_run -inf: any finite max is taken; a NaN never is)
    m_new = mx_s > m_run + static_cast<float>(kSlack) ? mx_s : m_run;
  } else {
    m_new = fmaxf(m_run, mx * scale_log2);
  }
  const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet stays at 0
  alpha = ptx::ex2_approx_ftz(m_run - m_use);
  m_run = m_new;
  float sum = 0.f;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
    s[mt][nt][e] = ptx::ex2_approx_ftz(fmaf(s[mt][nt][e], scale_log2, -m_use));
    s[mt][nt][2 + e] = ptx::ex2_approx_ftz(fmaf(s[mt][nt][2 + e], scale_log2, -m_use));
    sum += s[mt][nt][e] + s[mt][nt][2 + e];
  }
  l_run = l_run * alpha + sum;
}

// P^T (bf16, [tokens][kPRowElems]) of n8 tile nt of the fragments s into P buffer buf, rows rl, rl + 1 (rl = the
// tile's first row + 2 t4), and those rows' rescale factors into the buffer's factors (lanes with g == 0).
template <class Cfg, int kN>
__device__ __forceinline__ void dimsplit_t_store_pt(__nv_bfloat16* pt_smem, float* alpha_smem, int buf, int rl, int g,
                                                    const float (&s)[Cfg::kMTilesS][kN][4], int nt,
                                                    const float (&alpha)[2]) {
  __nv_bfloat16* pt = pt_smem + buf * Cfg::kPBufElems;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTilesS; ++mt) {
    __nv_bfloat16* pt_tok = pt + (mt * 16 + g) * Cfg::kPRowElems + rl;
    *reinterpret_cast<uint32_t*>(pt_tok) = ptx::pack_bf16x2(s[mt][nt][0], s[mt][nt][1]);
    *reinterpret_cast<uint32_t*>(pt_tok + 8 * Cfg::kPRowElems) = ptx::pack_bf16x2(s[mt][nt][2], s[mt][nt][3]);
  }
  if (g == 0) *reinterpret_cast<float2*>(alpha_smem + buf * Cfg::kRowsPerCta + rl) = make_float2(alpha[0], alpha[1]);
}

template <class Cfg>
__device__ __forceinline__ void dimsplit_t_partial(const MlaVerifyParams& p, unsigned char* smem_raw) {
#if MLAGEN_DST_TRACE
  const uint64_t trace_entry_ns = ptx::globaltimer_ns();  // this CTA's start (the launch's timeline, dst_trace.py)
#endif
  __nv_bfloat16* kv_smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kConsStages][kBlockN][kKvRowElems]
  uint8_t* fp8_smem = smem_raw + Cfg::kSmemKv;  // fp8: [kStages][kBlockN][kFp8RowBytes] (16-byte aligned rows)
  unsigned char* smem_rest = smem_raw + Cfg::kSmemKv + Cfg::kSmemFp8;
  float* xchg_smem = reinterpret_cast<float*>(smem_rest);  // 32-bit words: fp32 scores or fp16 pairs
  __nv_bfloat16* pt_smem = reinterpret_cast<__nv_bfloat16*>(smem_rest + Cfg::kSmemXchg);
  float* alpha_smem = reinterpret_cast<float*>(smem_rest + Cfg::kSmemXchg + Cfg::kSmemP);
  float* lsum_smem = alpha_smem + Cfg::kPBufs * Cfg::kRowsPerCta;  // [kRowsPerCta]: the final row sums
  int64_t* tree_smem = reinterpret_cast<int64_t*>(lsum_smem + Cfg::kRowsPerCta);  // [kQLenMax] with kTreeRowsSmem
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(tree_smem) + Cfg::kSmemTree);
  uint64_t* empty_bar = full_bar + Cfg::kConsStages;                                    // [kConsStages]
  uint64_t* xfull_bar = empty_bar + Cfg::kConsStages;       // [kXBufs][kScoreWarps]: the peer's scores landed
  uint64_t* pfull_bar = xfull_bar + Cfg::kXBufs * Cfg::kScoreWarps;  // [kPBufs]: P^T and factors written
  uint64_t* pempty_bar = pfull_bar + Cfg::kPBufs;                    // [kPBufs]: the output warps are done
  uint64_t* xempty_bar = pempty_bar + Cfg::kPBufs;  // [kXEmptyBars]: the peer read this warp's last scores
  uint64_t* tree_bar = xempty_bar + Cfg::kXEmptyBars;  // kTreeRowsSmem: tree_smem holds the request's rows
  uint64_t* full8_bar = tree_bar + (Cfg::kTreeRowsSmem ? 1 : 0);  // fp8 [kStages]: the producer's copies landed
  uint64_t* empty8_bar = full8_bar + (Cfg::kKvFp8 ? Cfg::kStages : 0);  // fp8 [kStages]: the output warps read it
  int* flag_smem = reinterpret_cast<int*>(smem_raw + Cfg::kFlagOffset);  // kRescaleFlag, [kPBufs][4]: factors moved

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
  const int32_t* page_row = request_page_row(p, b);  // its index load ahead of kv_len's (no dependence)
  ClusterSplit w;
  // MLAGEN_DST_PDL 2: the split's stores wait for the kernel before
  const bool live = cluster_split_begin<Cfg, Cfg::kPdl != 2>(p, b, row_block, split, rank, tid, w);
  if constexpr (Cfg::kPdl == 2) {
    if (w.row0 < w.rows) {
      ptx::griddep_wait();
      cluster_split_stores<Cfg>(p, b, row_block, split, rank, tid, w);
    }
  }
  if (!live) return;  // the same for both CTAs
  const int rows = w.rows, row0 = w.row0, live_rows = w.live_rows, kv_len = w.kv_len, prefix_len = w.prefix_len;
  const int tile_begin = w.tile_begin;
  const int64_t ws_row_base = w.ws_row_base;
  float* lse_part = p.lse_part + ws_row_base;
  const int num_tiles = w.tile_end - w.tile_begin;
  const int num_sub = num_tiles * Cfg::kSubTiles;
  // Whether some step of this split holds draft keys or keys past kv_len (then masked, and its CTA reads the tree rows).
  const bool masked_split = w.tile_end * Cfg::kBlockN > prefix_len;

  if (tid == 0) {
    for (int st = 0; st < Cfg::kConsStages; ++st) {
      // the producer's lanes (cp.async.mbarrier.arrive.noinc); fp8: the output warps' lane 0 (their conversion)
      ptx::mbarrier_init(full_bar + st, Cfg::kKvFp8 ? Cfg::kOutWarps : Cfg::kBulkLoad ? 1 : 32);
      ptx::mbarrier_init(empty_bar + st, Cfg::kConsumerWarps);
    }
    if constexpr (Cfg::kKvFp8) {
      for (int st = 0; st < Cfg::kStages; ++st) {
        ptx::mbarrier_init(full8_bar + st, 32);               // the producer's lanes (cp.async)
        ptx::mbarrier_init(empty8_bar + st, Cfg::kOutWarps);  // the output warps' lane 0
      }
    }
    // exchange: one arrival (the receiving warp's lane 0, with expect_tx) + the peer's st.async bytes
    for (int i = 0; i < Cfg::kXBufs * Cfg::kScoreWarps; ++i) ptx::mbarrier_init(xfull_bar + i, 1);
    for (int i = 0; i < Cfg::kXEmptyBars; ++i) ptx::mbarrier_init(xempty_bar + i, 1);  // the peer warp's lane 0
    if constexpr (Cfg::kTreeRowsSmem) ptx::mbarrier_init(tree_bar, 1);  // the first output warp's lane 0
    for (int i = 0; i < Cfg::kPBufs; ++i) {
      ptx::mbarrier_init(pfull_bar + i, Cfg::kScoreWarps);
      ptx::mbarrier_init(pempty_bar + i, Cfg::kOutWarps);
    }
    ptx::fence_barrier_init();
  }
  // (ablation builds without KV loads read the ring as it is: zero it for them too)
  if constexpr (!Cfg::kZeroFillTail || (kAblate & (kAblateLoads | kAblateConvert))) zero_kv_ring<Cfg>(kv_smem, tid);
  if constexpr (Cfg::kKvFp8 && (kAblate & kAblateLoads)) {  // (the conversion then reads zeros, not stale bytes)
    for (int i = tid; i < Cfg::kSmemFp8 / 16; i += Cfg::kThreads)
      reinterpret_cast<uint4*>(fp8_smem)[i] = make_uint4(0u, 0u, 0u, 0u);
  }
  ptx::cluster_sync();  // both CTAs' barriers initialized before any remote arrival

  // MLAGEN_DST_TRACE: per warp, cycles inside each wait kind (slots kTrace*), summed by lane 0 in shared memory
  constexpr int kTraceStage = 0, kTracePeer = 1, kTraceP = 2, kTraceXEmpty = 3;
#if MLAGEN_DST_TRACE
  constexpr int kTraceSlots = 6;  // the 4 wait kinds; score warps: cycles until Q (4) / the first stage (5) landed
  __shared__ unsigned long long trace_wait_smem[Cfg::kThreads / 32][kTraceSlots];
  if (lane < kTraceSlots) trace_wait_smem[warp][lane] = 0ull;
  __syncwarp();
  const uint64_t trace_t0 = ptx::clock64_cycles(), trace_ns0 = ptx::globaltimer_ns();
  uint64_t trace_first = 0, trace_last = 0;  // cycles at the first sub-tile's start and after the last one
#endif
  auto traced = [&](int slot, auto&& wait) {  // wait(); timed in MLAGEN_DST_TRACE builds
#if MLAGEN_DST_TRACE
    const uint64_t t = ptx::clock64_cycles();
    wait();
    if (lane == 0) trace_wait_smem[warp][slot] += ptx::clock64_cycles() - t;
#else
    (void)slot;
    wait();
#endif
  };
  auto trace_mark = [&](bool last) {  // MLAGEN_DST_TRACE: the first sub-tile starts / the last one is done
#if MLAGEN_DST_TRACE
    (last ? trace_last : trace_first) = ptx::clock64_cycles();
#else
    (void)last;
#endif
  };

  auto sub_kv = [&](int j) { return ring_sub_tile<Cfg>(kv_smem, j); };
  auto wait_full = [&](int j) { traced(kTraceStage, [&] { wait_sub_tile_full<Cfg>(full_bar, j); }); };
  auto release_stage = [&](int j) {  // this warp is done reading the stage of sub-tile j (after its last one)
    if (j % Cfg::kSubTiles == Cfg::kSubTiles - 1) {
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(empty_bar + (j / Cfg::kSubTiles) % Cfg::kConsStages);
    }
  };
  constexpr uint32_t kStatBar = 1;  // named barrier: the score warps' final row sums -> the output warps
  constexpr uint32_t kStatThreads = Cfg::kConsumerWarps * 32;


  if (warp == Cfg::kProducerWarp) {
    if constexpr (Cfg::kKvFp8) {
      dimsplit_produce_fp8<Cfg>(p, page_row, kv_len, prefix_len, tile_begin, num_tiles, rank, lane, fp8_smem,
                                full8_bar, empty8_bar);
    } else {
      // (MLAGEN_DST_TRACE: its waits for a stage to empty timed in the stage slot)
      auto wait_stage = [&](uint64_t* bar, uint32_t parity) {
        traced(kTraceStage, [&] { ptx::mbarrier_wait_parity(bar, parity); });
      };
      trace_mark(false);
      dimsplit_produce_bf16<Cfg>(p, page_row, b, kv_len, prefix_len, tile_begin, num_tiles, rank, warp, lane, kv_smem,
                                 full_bar, empty_bar, wait_stage);
      trace_mark(true);
    }
  } else if (warp < Cfg::kScoreWarps) {
    // ---- score warp sw: rows [24 sw, 24 sw + 24) of the cluster's block, n8 tile nt = rows 24 sw + 8 nt + (0..7)
    const int sw = warp;
    const int rloc0 = sw * Cfg::kRowsPerScoreWarp;
    // Q as B fragments (k16 x n8, "col"): b0 = Q[row g][dims 2 t4, +1], b1 = Q[row g][dims 2 t4 + 8, +9]. (Loaded
    // before the barrier setup instead, they measured 1-7 % slower at 4k-16k: perf-notes v15.)
    uint32_t q_frag[Cfg::kKSteps][Cfg::kNTilesS][2];
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
      const int r = row0 + rloc0 + nt * 8 + g;
      const bool row_ok = r < rows;
      const __nv_bfloat16* q_row = q_row_of<Cfg>(p, b, q_len, r);
#pragma unroll
      for (int ks = 0; ks < Cfg::kKSteps; ++ks) {
        const int dim = cta_dim_of_kstep<Cfg>(rank, ks);
        q_frag[ks][nt][0] = row_ok ? *reinterpret_cast<const uint32_t*>(q_row + dim + 2 * t4) : 0u;
        q_frag[ks][nt][1] = row_ok ? *reinterpret_cast<const uint32_t*>(q_row + dim + 8 + 2 * t4) : 0u;
      }
    }
#if MLAGEN_DST_TRACE
    {  // the trace's Q stamp: a shared store of a value that depends on every fragment issues only once all of the
       // loads have landed, and the clock read issues after it (in order)
      __shared__ uint32_t trace_q_sink[Cfg::kThreads / 32];
      uint32_t q_all = 0u;
#pragma unroll
      for (int ks = 0; ks < Cfg::kKSteps; ++ks)
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesS; ++nt) q_all ^= q_frag[ks][nt][0] ^ q_frag[ks][nt][1];
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(ptx::smem_u32(trace_q_sink + warp)), "r"(q_all) : "memory");
      if (lane == 0) trace_wait_smem[warp][4] = ptx::clock64_cycles() - trace_t0;
    }
#endif
    // Per row (n8 tile nt, column parity e = row 2 t4 + e): running max (log2 units), this thread's share of
    // the running sum (its tokens g and g + 8 of every sub-tile).
    float m_run[Cfg::kNTilesS][2], l_run[Cfg::kNTilesS][2];
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
      m_run[nt][0] = m_run[nt][1] = -INFINITY;
      l_run[nt][0] = l_run[nt][1] = 0.f;
    }
    const float scale_log2 = p.softmax_scale * 1.4426950408889634f;  // > 0 (checked on the host)
    const uint32_t xchg_remote = ptx::map_to_cta(ptx::smem_u32(xchg_smem), peer);
    const uint32_t xbar_remote = ptx::map_to_cta(ptx::smem_u32(xfull_bar), peer);
    auto xslot = [&](int j) { return (j % Cfg::kXBufs) * Cfg::kScoreWarps + sw; };

    // One k step ks of S^T_c (sub-tile j over this CTA's 288 dims); A = K of m16 token tile mt (ldmatrix:
    // matrices (tokens 0-7, k lo), (tokens 8-15, k lo), (tokens 0-7, k hi), (tokens 8-15, k hi)). With one
    // token tile, two accumulator chains (s: even k steps, s2: odd) keep consecutive MMAs independent; the
    // caller adds s2 into s after the last k step.
    using Acc = float[Cfg::kMTilesS][Cfg::kNTilesS][4];
    constexpr int kChains = Cfg::kMTilesS == 1 ? 2 : 1;
    auto zero_acc = [&](Acc& s, Acc& s2) {
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTilesS; ++mt)
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = s2[mt][nt][e] = 0.f;
    };
    auto mma_kstep = [&](int j, int ks, Acc& s, Acc& s2) {  // ks: a compile-time constant after unrolling
      if constexpr (kAblate & kAblateScores) return;  // diagnostic: no K loads from the stage, no Q K^T MMAs
      const __nv_bfloat16* a_src = sub_kv(j) + (lane % 16) * Cfg::kKvRowElems + (lane / 16) * 8;
      uint32_t a[Cfg::kMTilesS][4];
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTilesS; ++mt) ptx::ldmatrix_x4(a[mt], a_src + mt * 16 * Cfg::kKvRowElems + ks * 16);
      Acc& acc = (kChains == 2 && ks % 2) ? s2 : s;
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTilesS; ++mt)
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
          ptx::mma_bf16_16816(acc[mt][nt], a[mt], q_frag[ks][nt][0], q_frag[ks][nt][1]);
    };
    auto join_chains = [&](Acc& s, const Acc& s2) {
      if constexpr (kChains == 2) {
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTilesS; ++mt)
#pragma unroll
          for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] += s2[mt][nt][e];
      }
    };
    const uint32_t xempty_remote = ptx::map_to_cta(ptx::smem_u32(xempty_bar + sw), peer);
    // fp16 (kXchgF16); with kXchgRoundOwn the sender also rounds its own half in place to the values it sends.
    auto send_scores = [&](int j, Acc& s) {
      if constexpr (kAblate & kAblateExchange) return;  // diagnostic: each CTA keeps its half of the scores
      if constexpr (Cfg::kXBufs == 1) {  // the peer has read sub-tile j - 1 from its (only) buffer
        if (j > 0) {
          traced(kTraceXEmpty,
                 [&] { ptx::mbarrier_wait_parity(xempty_bar + sw, static_cast<uint32_t>(j - 1) & 1u); });
        }
      }
      const int xoff = xslot(j) * Cfg::kXchgWordsPerWarp;
      const uint32_t bar = xbar_remote + static_cast<uint32_t>(xslot(j) * 8);
      if constexpr (Cfg::kXchgF16) {
        // word 2 mt + h of lane `lane` of n8 tile nt: the fp16 pair (s[mt][nt][2 h], s[mt][nt][2 h + 1])
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
          uint32_t w[Cfg::kMTilesS * 2];
#pragma unroll
          for (int mt = 0; mt < Cfg::kMTilesS; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              w[2 * mt + h] = ptx::pack_f16x2_satfinite(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
              if constexpr (Cfg::kXchgRoundOwn) {
                ptx::unpack_f16x2(w[2 * mt + h], s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
              }
            }
          const uint32_t dst =
              xchg_remote + static_cast<uint32_t>((xoff + (nt * 32 + lane) * Cfg::kMTilesS * 2) * 4);
          if constexpr (Cfg::kMTilesS == 2) {
            ptx::st_async_cluster_v4_b32(dst, w[0], w[1], w[2], w[3], bar);
          } else {
            ptx::st_async_cluster_v2_b32(dst, w[0], w[1], bar);
          }
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTilesS; ++mt)
#pragma unroll
          for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
            const int f = (mt * Cfg::kNTilesS + nt) * 32 + lane;
            const uint32_t dst = xchg_remote + static_cast<uint32_t>((xoff + f * 4) * 4);
            ptx::st_async_cluster_v4(dst, s[mt][nt][0], s[mt][nt][1], s[mt][nt][2], s[mt][nt][3], bar);
          }
      }
    };
    // S = S_c + S_{1-c} (unscaled) of sub-tile j once the peer's half landed; keys the mask hides -> -inf.
    // Fragment (m16 tokens x n8 rows) of token tile mt: s[mt][nt][0] = (token 16 mt + g, row 2 t4), [1] = (g,
    // 2 t4 + 1), [2] = (g + 8, 2 t4), [3] = (g + 8, 2 t4 + 1); a row's tokens are the 8 lanes of one t4.
    // kMaskMode (a std::integral_constant): 0 the step holds only prefix keys below kv_len (the caller knows), so no
    // masking code is emitted; 1 the step's keys are tested at run time.
    auto receive_and_mask = [&](int j, Acc& s, auto kMaskMode) {
      if constexpr (!(kAblate & kAblateExchange)) {
        uint64_t* xbar = xfull_bar + xslot(j);
        if (lane == 0) ptx::mbarrier_arrive_expect_tx(xbar, Cfg::kXchgWordsPerWarp * 4);
        traced(kTracePeer, [&] { ptx::mbarrier_wait_parity(xbar, static_cast<uint32_t>(j / Cfg::kXBufs) & 1u); });
        const float* xin = xchg_smem + xslot(j) * Cfg::kXchgWordsPerWarp;
        if constexpr (Cfg::kXchgF16) {
#pragma unroll
          for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
            uint32_t w[Cfg::kMTilesS * 2];
            const float* src = xin + (nt * 32 + lane) * Cfg::kMTilesS * 2;
            if constexpr (Cfg::kMTilesS == 2) {
              const uint4 v = *reinterpret_cast<const uint4*>(src);
              w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
            } else {
              const uint2 v = *reinterpret_cast<const uint2*>(src);
              w[0] = v.x, w[1] = v.y;
            }
#pragma unroll
            for (int mt = 0; mt < Cfg::kMTilesS; ++mt)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                float lo, hi;
                ptx::unpack_f16x2(w[2 * mt + h], lo, hi);
                s[mt][nt][2 * h] += lo;
                s[mt][nt][2 * h + 1] += hi;
              }
          }
        } else {
#pragma unroll
          for (int mt = 0; mt < Cfg::kMTilesS; ++mt)
#pragma unroll
            for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
              const float4 v = *reinterpret_cast<const float4*>(xin + ((mt * Cfg::kNTilesS + nt) * 32 + lane) * 4);
              s[mt][nt][0] += v.x;
              s[mt][nt][1] += v.y;
              s[mt][nt][2] += v.z;
              s[mt][nt][3] += v.w;
            }
        }
      }
      if constexpr (Cfg::kXBufs == 1 && !(kAblate & kAblateExchange)) {
        // The buffer is free for the peer's next send (its reads are done: release at CTA scope, no fence; a
        // release.cluster arrival would add a GPU-scope fence per step).
        __syncwarp();
        if (lane == 0) ptx::mbarrier_arrive_cluster_cta(xempty_remote);
      }
      const int key0 = (tile_begin * Cfg::kSubTiles + j) * Cfg::kSubTile;  // the sub-tile's first token
      // draft keys or keys past kv_len in this sub-tile
      if (decltype(kMaskMode)::value != 0 && key0 + Cfg::kSubTile > prefix_len) {
        if constexpr (Cfg::kTreeRowsSmem) ptx::mbarrier_wait_parity(tree_bar, 0u);  // (phase 0: done at most once)
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int r = row0 + rloc0 + nt * 8 + 2 * t4 + e;
            const int qi = r / Cfg::kHeads;
            int64_t mask_row = 0;
            if constexpr (Cfg::kTreeRowsSmem) {
              if (r < rows) mask_row = tree_smem[qi];
            } else if constexpr (Cfg::kMask == MaskKind::kTree) {
              if (r < rows) mask_row = request_tree_row(p, b, qi);
            }
#pragma unroll
            for (int mt = 0; mt < Cfg::kMTilesS; ++mt) {
              if (!key_visible<Cfg>(key0 + mt * 16 + g, kv_len, prefix_len, qi, mask_row)) s[mt][nt][e] = -INFINITY;
              if (!key_visible<Cfg>(key0 + mt * 16 + g + 8, kv_len, prefix_len, qi, mask_row)) s[mt][nt][2 + e] = -INFINITY;
            }
          }
      }
      if (j >= Cfg::kPBufs) {  // the output warps are done with sub-tile j - kPBufs in P buffer j % kPBufs
        traced(kTraceP, [&] {
          ptx::mbarrier_wait_parity(pempty_bar + j % Cfg::kPBufs, static_cast<uint32_t>(j / Cfg::kPBufs - 1) & 1u);
        });
      }
    };
    // Online softmax of one row (n8 tile nt, column parity e) of sub-tile j: the max over the step's tokens
    // (registers, then 3 shuffles over the 8 lanes of a t4), P = 2^(S scale_log2 - m) by one FFMA and one
    // ex2.approx.ftz each (m, m_run: scaled, log2 units), the row's rescale factor and running sum.
    auto softmax_row = [&](Acc& s, int nt, int e, float& alpha) {
      if constexpr (kAblate & kAblateSoftmax) {  // diagnostic: the scores themselves as P, no max / exp / sum
        alpha = 1.f;
        return;
      }
      dimsplit_t_softmax_row<Cfg::kRescaleSlack>(s, nt, e, scale_log2, m_run[nt][e], l_run[nt][e], alpha);
    };
    // P^T (bf16, [tokens][rows]) of n8 tile nt and its rows' rescale factors into P buffer j % kPBufs.
    auto write_p = [&](int j, const Acc& s, int nt, const float (&alpha)[2]) {
      const int buf = j % Cfg::kPBufs;
      dimsplit_t_store_pt<Cfg>(pt_smem, alpha_smem, buf, rloc0 + nt * 8 + 2 * t4, g, s, nt, alpha);
    };
    // Release P buffer j % kPBufs to the output warps: P^T and the factors of step j, and with kRescaleFlag this
    // warp's flag of that buffer (whether some factor of its rows differs from 1: a warp vote, lane 0's store,
    // ordered before its pfull arrival).
    auto publish_p = [&](int j, const float (&alpha)[Cfg::kNTilesS][2]) {
      if constexpr (Cfg::kRescaleFlag) {
        bool moved = false;
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesS; ++nt) moved = moved || alpha[nt][0] != 1.f || alpha[nt][1] != 1.f;
        moved = __any_sync(0xffffffffu, moved);
        if (lane == 0) flag_smem[(j % Cfg::kPBufs) * 4 + sw] = moved ? 1 : 0;
      }
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(pfull_bar + j % Cfg::kPBufs);
    };

    // Software pipeline, per sub-tile j: the first kHalfK of the next sub-tile's K steps (j + 1), then S of j
    // (the peer's half, sent one step earlier, has crossed the cluster meanwhile), then the rest of
    // j + 1's K steps with the softmax of j interleaved in one basic block (the MMAs of j + 1 do not depend
    // on the softmax of j, so the scheduler fills the tensor pipe's gaps with the softmax's shuffles, ex2 and
    // stores), then j + 1 goes to the peer. Exchange buffer reuse: with two buffers, this warp sends j + 1 into
    // the peer's buffer (j + 1) % 2 after receiving the peer's j, which the peer sent after its softmax of
    // j - 1 had read that buffer; with one, send_scores(j + 1) waits on xempty for the peer's read of j.
    // With kMaskPeel the steps whose keys are all prefix keys run in a loop of their own, compiled without the
    // masking code, so the two halves of its body are contiguous in the instruction stream.
    constexpr int kHalfK =
        MLAGEN_DST_HALF_K == 0
            ? (!Cfg::kKvFp8 && (Cfg::kRowTiles == 3 || Cfg::kRowTiles == 1) && Cfg::kStages >= 4 ? 4 : 9)
            : MLAGEN_DST_HALF_K;
    static_assert(Cfg::kKSteps == 18, "dimsplit_t: 18 K steps per CTA (kv_lora_rank 512, qk_rope_head_dim 64)");
    constexpr int kSecondK = Cfg::kKSteps - kHalfK;  // K steps that carry the softmax's 3 kNTilesS pieces
    constexpr int kPieces = 3 * Cfg::kNTilesS;       // per n8 tile: the two rows' softmax, then its P^T and factors
    static_assert(kHalfK >= 1 && kSecondK >= 1, "MLAGEN_DST_HALF_K: 1..17 (both parts of a score step need a K step)");
    Acc s_cur, s_next, s_odd;
    trace_mark(false);
    wait_full(0);
#if MLAGEN_DST_TRACE
    if (lane == 0) trace_wait_smem[warp][5] = ptx::clock64_cycles() - trace_t0;  // the first stage (and Q) landed
#endif
    zero_acc(s_cur, s_odd);
#pragma unroll
    for (int ks = 0; ks < Cfg::kKSteps; ++ks) mma_kstep(0, ks, s_cur, s_odd);
    join_chains(s_cur, s_odd);
    send_scores(0, s_cur);
    using Unmasked = std::integral_constant<int, 0>;  // receive_and_mask's kMaskMode: no masking code
    using Tested = std::integral_constant<int, 1>;    // the step's keys tested at run time
    // The softmax of step j (every row of this warp, in order) and its P^T, published; then the next step's scores
    // become the current ones.
    auto softmax_publish = [&](int j) {
      float alpha[Cfg::kNTilesS][2];
#pragma unroll
      for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
        softmax_row(s_cur, nt, 0, alpha[nt][0]);
        softmax_row(s_cur, nt, 1, alpha[nt][1]);
        write_p(j, s_cur, nt, alpha[nt]);
      }
      publish_p(j, alpha);
    };
    auto advance_scores = [&]() {
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTilesS; ++mt)
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s_cur[mt][nt][e] = s_next[mt][nt][e];
    };
    // Step j < num_sub - 1 (after release_stage(j)): the first kHalfK of j + 1's K steps, S of j, then the rest
    // with the softmax of j.
    auto score_step = [&](int j, auto kMaskMode) {
      float alpha[Cfg::kNTilesS][2];
      wait_full(j + 1);
      zero_acc(s_next, s_odd);
#pragma unroll
      for (int ks = 0; ks < kHalfK; ++ks) mma_kstep(j + 1, ks, s_next, s_odd);
      receive_and_mask(j, s_cur, kMaskMode);
#pragma unroll
      for (int i = 0; i < kSecondK; ++i) {  // one basic block: MMAs of j + 1, softmax of j
        mma_kstep(j + 1, kHalfK + i, s_next, s_odd);
        if constexpr (kSecondK == kPieces) {  // (9 + 9: piece i after K step i)
          if (i < 2 * Cfg::kNTilesS) softmax_row(s_cur, i / 2, i % 2, alpha[i / 2][i % 2]);
          if (i >= 2 * Cfg::kNTilesS && i < 3 * Cfg::kNTilesS) {
            const int nt = i - 2 * Cfg::kNTilesS;
            write_p(j, s_cur, nt, alpha[nt]);
          }
        } else {  // piece pc after K step pc * kSecondK / kPieces
#pragma unroll
          for (int pc = 0; pc < kPieces; ++pc) {
            if (pc * kSecondK / kPieces != i) continue;
            if (pc < 2 * Cfg::kNTilesS) softmax_row(s_cur, pc / 2, pc % 2, alpha[pc / 2][pc % 2]);
            if (pc >= 2 * Cfg::kNTilesS) write_p(j, s_cur, pc - 2 * Cfg::kNTilesS, alpha[pc - 2 * Cfg::kNTilesS]);
          }
        }
      }
      join_chains(s_next, s_odd);
      publish_p(j, alpha);
      send_scores(j + 1, s_next);
      advance_scores();
    };
    auto last_step = [&](int j) {  // the split's last sub-tile (after release_stage(j))
      receive_and_mask(j, s_cur, Tested{});
      softmax_publish(j);
    };
    if constexpr (Cfg::kMaskPeel) {
      // Steps [0, j_prefix) hold only prefix keys (all below kv_len): key0 + kSubTile <= prefix_len.
      const int j_prefix = prefix_len / Cfg::kSubTile - tile_begin * Cfg::kSubTiles;
      const int j_hot_end = j_prefix < num_sub - 1 ? j_prefix : num_sub - 1;
      int j = 0;
#pragma unroll 1
      for (; j < j_hot_end; ++j) {
        release_stage(j);  // the K steps of j have read its K
        score_step(j, Unmasked{});
      }
#pragma unroll 1
      for (; j < num_sub - 1; ++j) {
        release_stage(j);
        score_step(j, Tested{});
      }
      release_stage(j);
      last_step(j);
    } else {  // v19's single loop
#pragma unroll 1
      for (int j = 0; j < num_sub; ++j) {
        release_stage(j);  // the K steps of j have read its K
        if (j + 1 < num_sub) {
          score_step(j, Tested{});
        } else {
          last_step(j);
        }
      }
    }
    trace_mark(true);
    // ---- row statistics for the output warps (row sums over the 8 lanes of a t4) and, from rank 0, the LSE
#if MLAGEN_DST_EPILOGUE == 1
    // lsum_smem gets 1 / l (0 for a row without a visible key), a float2 per n8 tile (rows 2 t4, 2 t4 + 1)
    static_assert((Cfg::kSmemKv + Cfg::kSmemFp8 + Cfg::kSmemXchg + Cfg::kSmemP + Cfg::kSmemAlpha) % 8 == 0,
                  "lsum_smem's float2 pairs need an 8-byte aligned offset");
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTilesS; ++nt) {
      float l[2], inv_l[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        l[e] = l_run[nt][e];
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 4);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 8);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 16);
        inv_l[e] = l[e] > 0.f ? ptx::rcp_approx_ftz(l[e]) : 0.f;
      }
      const int rl0 = rloc0 + nt * 8 + 2 * t4;
      if (g == 0) {
        *reinterpret_cast<float2*>(lsum_smem + rl0) = make_float2(inv_l[0], inv_l[1]);
        if (rank == 0) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {  // natural-log LSE of the row (row_lse's formula)
            if (rl0 + e < live_rows) {
              lse_part[rl0 + e] =
                  l[e] > 0.f ? (m_run[nt][e] + ptx::lg2_approx_ftz(l[e])) * 0.6931471805599453f : -INFINITY;
            }
          }
        }
      }
    }
#else
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float l = l_run[nt][e];
        l += __shfl_xor_sync(0xffffffffu, l, 4);
        l += __shfl_xor_sync(0xffffffffu, l, 8);
        l += __shfl_xor_sync(0xffffffffu, l, 16);
        const int rl = rloc0 + nt * 8 + 2 * t4 + e;
        if (g == 0) {
          lsum_smem[rl] = l;
          if (rank == 0 && rl < live_rows) {
            lse_part[rl] = row_lse(m_run[nt][e], l);
          }
        }
      }
#endif
    ptx::named_barrier_arrive(kStatBar, kStatThreads);
  } else {
    // ---- output warp ow: dims [64 ow, 64 ow + 64) of this CTA's 256 latent dims, every row of the block.
    const int ow = warp - Cfg::kFirstOutWarp;
    const int dim0 = ow * Cfg::kDimVWarp;
    // O^T fragments (m16 dims x n8 rows): o[mt][nt][0] = (dim 16 mt + g, row 8 nt + 2 t4), [1] = (.., row + 1),
    // [2] = (dim + 8, row 8 nt + 2 t4), [3] = (dim + 8, row + 1).
    float o[Cfg::kMTilesO][Cfg::kRowNTiles][4];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTilesO; ++mt)
#pragma unroll
      for (int nt = 0; nt < Cfg::kRowNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.f;
    // ldmatrix.trans row addresses: V^T A fragments, matrices (tokens 0-7, dims 0-7), (tokens 0-7, dims 8-15),
    // (tokens 8-15, dims 0-7), (tokens 8-15, dims 8-15); P^T B fragments, matrices (tokens 0-7, rows n0),
    // (tokens 8-15, rows n0), (tokens 0-7, rows n0 + 8), (tokens 8-15, rows n0 + 8).
    const int v_tok = lane % 8 + 8 * (lane / 16), v_dim = 8 * ((lane / 8) % 2);
    const int p_tok = lane % 8 + 8 * ((lane / 8) % 2), p_row = 8 * (lane / 16);
    // fp8: tile i from the e4m3 ring into bf16 stage i % kConvStages, shared by the 4 output warps; the stage's
    // previous tile (i - kConvStages) must be released by every consumer warp first.
    auto convert_tile = [&](int i) {
      if constexpr (Cfg::kKvFp8) {
        const int st8 = i % Cfg::kStages;
        const int cs = i % Cfg::kConsStages;
        ptx::mbarrier_wait_parity(full8_bar + st8, static_cast<uint32_t>(i / Cfg::kStages) & 1u);
        if (i >= Cfg::kConsStages && !(kAblate & kAblateConvertWait)) {
          ptx::mbarrier_wait_parity(empty_bar + cs, static_cast<uint32_t>(i / Cfg::kConsStages - 1) & 1u);
        }
        if constexpr (kAblate & kAblateConvert) {
          // diagnostic: the stage keeps its zeros (zero_kv_ring), only the barriers below run
        } else if constexpr (MLAGEN_DST_FP8_CONVERT == 1) {
          dimsplit_convert_fp8_tile<Cfg>(p, b, q_len, (tile_begin + i) * Cfg::kBlockN, kv_len, prefix_len, rank,
                                         fp8_smem + st8 * Cfg::kFp8StageBytes, kv_smem + cs * Cfg::kStageElems,
                                         ow * 32 + lane, Cfg::kOutWarps * 32);
        } else {
          dimsplit_t_convert_fp8_tile<Cfg, Cfg::kOutWarps * 32>(p, b, q_len, (tile_begin + i) * Cfg::kBlockN, kv_len,
                                                                 prefix_len, rank, fp8_smem + st8 * Cfg::kFp8StageBytes,
                                                                 kv_smem + cs * Cfg::kStageElems, ow * 32 + lane);
        }
        __syncwarp();
        if (lane == 0) {
          ptx::mbarrier_arrive(empty8_bar + st8);  // release: this warp's reads of the e4m3 stage are done
          ptx::mbarrier_arrive(full_bar + cs);     // release: its part of the bf16 stage is written
        }
      }
    };
    if constexpr (Cfg::kKvFp8) {
      for (int i = 0; i < (num_sub < Cfg::kConsStages ? num_sub : Cfg::kConsStages); ++i) convert_tile(i);
    }
    if constexpr (Cfg::kTreeRowsSmem) {  // the request's tree rows for the score warps' masked steps (idle until P)
      if (ow == 0 && masked_split) {
        for (int qi = lane; qi < q_len; qi += 32) tree_smem[qi] = request_tree_row(p, b, qi);
        __syncwarp();
        if (lane == 0) ptx::mbarrier_arrive(tree_bar);  // release: the rows
      }
    }
    trace_mark(false);
    // One P V step per sub-tile j, inline in the loop (as a lambda, even one called only there, it reorders ptxas's
    // schedule of the score warps' loop: perf-notes v33).
#pragma unroll 1
    for (int j = 0; j < num_sub; ++j) {
      wait_full(j);  // (already implied by pfull through the score warps; keeps the stage's visibility local)
      const int buf = j % Cfg::kPBufs;
      traced(kTraceP, [&] { ptx::mbarrier_wait_parity(pfull_bar + buf, static_cast<uint32_t>(j / Cfg::kPBufs) & 1u); });
      const float* alpha_in = alpha_smem + buf * Cfg::kRowsPerCta;
      float2 alpha[Cfg::kRowNTiles];
      if constexpr (Cfg::kRescaleFlag) {
        const int4 moved = *reinterpret_cast<const int4*>(flag_smem + buf * 4);  // the score warps' flags of step j
        if ((moved.x | (Cfg::kScoreWarps > 1 ? moved.y : 0) | (Cfg::kScoreWarps > 2 ? moved.z : 0)) != 0) {
#pragma unroll
          for (int nt = 0; nt < Cfg::kRowNTiles; ++nt) {
            alpha[nt] = *reinterpret_cast<const float2*>(alpha_in + nt * 8 + 2 * t4);
          }
          dimsplit_t_rescale_o(o, alpha);
        }
      } else {
        bool unit = true;
#pragma unroll
        for (int nt = 0; nt < Cfg::kRowNTiles; ++nt) {
          alpha[nt] = *reinterpret_cast<const float2*>(alpha_in + nt * 8 + 2 * t4);
          unit = unit && alpha[nt].x == 1.f && alpha[nt].y == 1.f;
        }
        if (!__all_sync(0xffffffffu, unit)) dimsplit_t_rescale_o(o, alpha);  // some row max moved
      }
#pragma unroll
      for (int kt = 0; kt < ((kAblate & kAblatePV) ? 0 : Cfg::kMTilesS); ++kt) {  // k16 steps over the tokens
        const __nv_bfloat16* pt =
            pt_smem + buf * Cfg::kPBufElems + (kt * 16 + p_tok) * Cfg::kPRowElems + p_row;
        uint32_t pb[Cfg::kRowNTiles][2];
#pragma unroll
        for (int np = 0; np < Cfg::kRowNTiles / 2; ++np) {
          uint32_t r[4];
          ptx::ldmatrix_x4_trans(r, pt + np * 16);
          pb[2 * np][0] = r[0];
          pb[2 * np][1] = r[1];
          pb[2 * np + 1][0] = r[2];
          pb[2 * np + 1][1] = r[3];
        }
        if constexpr (Cfg::kRowNTiles % 2 == 1) {  // the last n8 tile alone: lanes 0-15 give its two matrices
          uint32_t r[2];
          ptx::ldmatrix_x2_trans(r, pt - p_row + (Cfg::kRowNTiles - 1) * 8);
          pb[Cfg::kRowNTiles - 1][0] = r[0];
          pb[Cfg::kRowNTiles - 1][1] = r[1];
        }
        const __nv_bfloat16* v_src = sub_kv(j) + (kt * 16 + v_tok) * Cfg::kKvRowElems + dim0 + v_dim;
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTilesO; ++mt) {
          uint32_t va[4];
          ptx::ldmatrix_x4_trans(va, v_src + mt * 16);
#pragma unroll
          for (int nt = 0; nt < Cfg::kRowNTiles; ++nt) ptx::mma_bf16_16816(o[mt][nt], va, pb[nt][0], pb[nt][1]);
        }
      }
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(pempty_bar + buf);  // P buffer free for sub-tile j + kPBufs
      release_stage(j);
      if constexpr (Cfg::kKvFp8) {
        if (j + Cfg::kConsStages < num_sub) convert_tile(j + Cfg::kConsStages);  // into the stage j just left
      }
    }
    trace_mark(true);
    // ---- epilogue: normalized partial O^T of this warp's dims (scores warps' row sums), rows < live_rows
    ptx::named_barrier_sync(kStatBar, kStatThreads);
    using PartialT = typename Cfg::PartialT;
    PartialT* o_base =
        reinterpret_cast<PartialT*>(p.o_part) + ws_row_base * Cfg::kDimV + rank * Cfg::kDimVCta + dim0;
#if MLAGEN_DST_EPILOGUE == 1
    float2 inv_l2[Cfg::kRowNTiles];  // every row's 1 / l (the score warps'), loaded before the first store
#pragma unroll
    for (int nt = 0; nt < Cfg::kRowNTiles; ++nt) {
      inv_l2[nt] = *reinterpret_cast<const float2*>(lsum_smem + nt * 8 + 2 * t4);
    }
#endif
#pragma unroll
    for (int nt = 0; nt < Cfg::kRowNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int rl = nt * 8 + 2 * t4 + e;
        if (rl < live_rows) {
#if MLAGEN_DST_EPILOGUE == 1
          const float inv_l = e == 0 ? inv_l2[nt].x : inv_l2[nt].y;
#else
          const float l = lsum_smem[rl];
          const float inv_l = l > 0.f ? 1.f / l : 0.f;
#endif
          PartialT* o_row = o_base + static_cast<int64_t>(rl) * Cfg::kDimV;
#pragma unroll
          for (int mt = 0; mt < Cfg::kMTilesO; ++mt) {
            if constexpr (kPartialPaired<PartialT>) {  // dims 16 mt + g, + 8: one 4-byte store
              store_partial_pair(o_row + mt * 16, g, o[mt][nt][e] * inv_l, o[mt][nt][2 + e] * inv_l);
            } else {
              store_partial1(o_row + mt * 16 + g, o[mt][nt][e] * inv_l);
              store_partial1(o_row + mt * 16 + g + 8, o[mt][nt][2 + e] * inv_l);
            }
          }
        }
      }
  }
  __syncwarp();
#if MLAGEN_DST_TRACE
  if (lane == 0 && blockIdx.x < 2 && (warp != Cfg::kProducerWarp || !Cfg::kKvFp8)) {
    const uint64_t t1 = ptx::clock64_cycles(), ns1 = ptx::globaltimer_ns();
    const unsigned long long* w = trace_wait_smem[warp];
    printf("dst_trace cta %d warp %d role %s sub %d cycles %llu ns %llu before %llu after %llu wait %llu %llu %llu %llu"
           " split %d entry %llu t0 %llu end %llu q %llu s0 %llu\n",
           static_cast<int>(blockIdx.x), warp,
           warp < Cfg::kScoreWarps ? "score" : warp == Cfg::kProducerWarp ? "producer" : "output", num_sub,
           static_cast<unsigned long long>(t1 - trace_t0), static_cast<unsigned long long>(ns1 - trace_ns0),
           static_cast<unsigned long long>(trace_first - trace_t0), static_cast<unsigned long long>(t1 - trace_last),
           w[0], w[1], w[2], w[3], split + b * static_cast<int>(gridDim.y),
           static_cast<unsigned long long>(trace_entry_ns), static_cast<unsigned long long>(trace_ns0),
           static_cast<unsigned long long>(ns1),
           w[4], w[5]);
  }
#endif
  ptx::cluster_sync();  // no CTA leaves while its peer may still address its shared memory
}

// With p.merge_counters set (a co-resident grid: mla_verify_launch.cuh) the CTAs then merge the partials into out /
// lse themselves (mla_verify_merge.cuh) and no combine kernel runs; the ring is free by then and holds the merge's
// scratch.
template <class Cfg>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(Cfg::kThreads, 1)
    mla_verify_dimsplit_t_kernel(const MlaVerifyParams p) {
  ptx::griddep_launch_dependents();  // the combine's CTAs may be scheduled now; they wait for this grid's end
  if constexpr (Cfg::kPdl == 1) ptx::griddep_wait();  // (MLAGEN_DST_PDL 1: before any global access)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  dimsplit_t_partial<Cfg>(p, smem_raw);
  if constexpr (Cfg::kFusedMerge) {
    if (p.merge_counters != nullptr) {
      // (MLAGEN_DST_PDL 2: a CTA whose block starts past the request's rows returned without waiting; the merge's
      // counters are the kernel before's too)
      if constexpr (Cfg::kPdl == 2) ptx::griddep_wait();
      merge_partials<Cfg::kHeads, Cfg::kRowsMax, Cfg::kDimV, Cfg::kBlockN, Cfg::kThreads>(p, smem_raw);
    }
  }
}

}  // namespace mlagen
