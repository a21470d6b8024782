"""Reject infeasible variants before rendering (mirrors the static_asserts of
include/mlagen/mla_verify_config.cuh; CUTLASS's generator drops tiles over the arch's shared memory
the same way).
"""

from __future__ import annotations

import dataclasses

from mlagen.spec import Variant
from mlagen.tables import DIMSPLIT_T_ROWS_PER_SCORE_WARP, SMEM_LIMIT

SOFTMAX_LANES = 8
REG_TILE_LIMIT = 200  # registers per thread held in Q / S / O fragments (same bound as the C++ config)
DIMSPLIT_REG_TILE_LIMIT = 184  # dimsplit: one warp per CTA holds 16 rows' Q half, S and O half (MlaDimSplitConfig)
ROWBLOCK_WARPS = (4, 8, 16)
DIMSPLIT_PAIR_MAX_ROW_TILES = 5  # two warps per row tile: 2 x 5 + 1 = 11 warps leave 168 registers per thread
DIMSPLIT_MAX_ROW_TILES = 7  # consumer warps per CTA (plus the producer warp): 8 warps x 255 registers fill an SM


def dimsplit_row_tiles(rows_max: int) -> int:
    """Row tiles per cluster for the dimsplit schedule: the fewest clusters (each reads the KV once)
    that cover ``rows_max`` = H x q_len rows with at most DIMSPLIT_MAX_ROW_TILES m16 tiles each,
    balanced (H=8 q9: 72 rows -> 1 cluster of 5; H=16 q9: 144 -> 2 of 5; H=64 q9: 576 -> 6 of 6)."""
    m_tiles = -(-rows_max // 16)
    clusters = -(-m_tiles // DIMSPLIT_MAX_ROW_TILES)
    return -(-m_tiles // clusters)


DIMSPLIT_T_MAX_SCORE_WARPS = 3  # 72 rows: the output warps' O^T (64 dims x 72 rows) is 144 registers
DIMSPLIT_T_OUT_WARPS = 4
# 32-bit words per lane and m16 x n8 score tile in dimsplit_t's score exchange: fp32 scores (MlaDimSplitTConfig's
# kXchgWordsPerTile with MLAGEN_DST_XCHG_F16 0, every shipped build; its fp16 diagnostic builds use 2)
DIMSPLIT_T_XCHG_WORDS = 4
DIMSPLIT_T_FP8_BF16_STAGES = 3  # fp8: bf16 stages the output warps dequantize into (MlaDimSplitTConfig::kConvStages)


def dimsplit_t_row_tiles(rows_max: int) -> int:
    """Score warps (24 rows each) per cluster for the dimsplit_t schedule: the fewest clusters of at most
    72 rows that cover ``rows_max`` = H x q_len, balanced (H=8 q9: 72 rows -> 1 cluster of 3; H=8 q1: 8 ->
    1 of 1; H=16 q9: 144 -> 2 of 3)."""
    warps = -(-rows_max // DIMSPLIT_T_ROWS_PER_SCORE_WARP)
    clusters = -(-warps // DIMSPLIT_T_MAX_SCORE_WARPS)
    return -(-warps // clusters)


def dimsplit_t_num_warps(row_tiles: int) -> int:
    """Warps of a dimsplit_t CTA: ``row_tiles`` score warps, DIMSPLIT_T_OUT_WARPS output warps and a producer
    (MlaDimSplitTConfig's warp roles)."""
    return row_tiles + DIMSPLIT_T_OUT_WARPS + 1


def dimsplit_pairs(v: Variant) -> bool:
    """Whether a dimsplit variant runs two consumer warps per row tile (num_warps = 2 x row_tiles + 1;
    MlaDimSplitConfig::kPairs): each scores 8 of a sub-tile's 16 tokens and owns 128 of the CTA's 256
    output dims."""
    return v.schedule == "dimsplit" and v.dtype != "fp8_e4m3" and v.num_warps == 2 * v.row_tiles + 1


@dataclasses.dataclass(frozen=True)
class Resources:
    """Static resource model of one variant: shared memory (bytes) and register tiles (words/thread)."""

    smem_bytes: int
    regs_q: int
    regs_s: int
    regs_o: int

    @property
    def regs_tiles(self) -> int:
        return self.regs_q + self.regs_s + self.regs_o


def resources(v: Variant) -> Resources:
    """Shared memory and register-tile sizes of ``v``, computed as the C++ MlaVerifyConfig (rowblock),
    MlaDimSplitConfig (dimsplit) or MlaDimSplitTConfig (dimsplit_t; regs_q / regs_s: a score warp's Q and
    scores, regs_o: an output warp's O^T) does."""
    dim_qk, dim_v = v.dim_qk, v.dim_v
    if v.schedule == "dimsplit_t":
        dim_cta = v.kv_lora_rank // 2 + v.qk_rope_head_dim // 2
        rows = DIMSPLIT_T_ROWS_PER_SCORE_WARP * v.row_tiles
        fp8 = v.dtype == "fp8_e4m3"
        cons_stages = DIMSPLIT_T_FP8_BF16_STAGES if fp8 else v.stages  # fp8: the bf16 ring the output warps fill
        smem_kv = cons_stages * v.block_n * (dim_cta + 8) * 2
        smem_kv += v.stages * v.block_n * (dim_cta + 16) if fp8 else 0  # the e4m3 ring, rows padded by 16 B
        fp8_bars = 2 * v.stages if fp8 else 0
        m_tiles = v.block_n // 16  # m16 token tiles of a score step (a whole stage)
        # [score warps][m x 3 tiles][32 lanes][4 words]: fp32 scores (e4m3 builds always)
        xchg_words = 4 if fp8 else DIMSPLIT_T_XCHG_WORDS
        xchg_buf = v.row_tiles * m_tiles * 3 * 32 * xchg_words * 4
        p_row = rows if (rows * 2 // 16) % 2 else rows + 8
        smem_p = 2 * v.block_n * p_row * 2 + 2 * rows * 4 + rows * 4  # 2 P^T buffers, their rescale factors, row sums
        tree = v.mask == "tree"  # the request's tree rows (int64 per draft query) and their mbarrier
        smem_p += v.q_len * 8 if tree else 0
        def bars(x_bufs: int) -> int:  # MlaDimSplitTConfig's dimsplit_t_num_bars (2 P^T buffers)
            return (2 * cons_stages + x_bufs * v.row_tiles + 2 * 2 + (v.row_tiles if x_bufs == 1 else 0) + tree
                    + fp8_bars)

        # kRescaleFlag (on with the default rescale slack): [2 P^T buffers][4] ints, 16-B aligned
        flags = v.row_tiles != 2

        def total(x_bufs: int) -> int:
            smem = smem_kv + x_bufs * xchg_buf + smem_p + bars(x_bufs) * 8
            return -(-smem // 16) * 16 + 2 * 16 if flags else smem

        # two exchange buffers when they fit in sm_120's limit, else one and an xempty barrier per score warp
        smem = total(2) if total(2) <= SMEM_LIMIT["sm_120"] else total(1)
        return Resources(smem, dim_cta // 16 * 3 * 2, 3 * m_tiles * 3 * 4,
                         v.kv_lora_rank // 2 // DIMSPLIT_T_OUT_WARPS // 16 * (rows // 8) * 4)
    if v.schedule == "dimsplit":
        dim_cta = v.kv_lora_rank // 2 + v.qk_rope_head_dim // 2
        pairs = dimsplit_pairs(v)
        wpt = 2 if pairs else 1  # consumer warps per row tile
        consumers = v.row_tiles * wpt
        fp8 = v.dtype == "fp8_e4m3"
        cons_stages = 2 if fp8 else v.stages  # fp8: the bf16 ring the converter warps fill (kConvStages)
        smem_kv = cons_stages * v.block_n * (dim_cta + 8) * 2
        smem_kv += v.stages * v.block_n * (dim_cta + 16) if fp8 else 0  # the e4m3 ring, rows padded by 16 B
        smem_xchg = 2 * consumers * (2 // wpt * 32 * 4) * 4  # 16-token score fragments, double buffered
        smem_bars = (2 * cons_stages + 2 * consumers + (2 * v.stages if fp8 else 0)) * 8
        smem_pair = 2 * consumers * 32 * 16 if pairs else 0  # P and row maxima between the warps of a pair
        rope_steps = v.qk_rope_head_dim // 2 // 16
        q_smem_steps = min(dim_cta // 16, rope_steps + (2 if pairs else 6))  # Q k-steps read from shared memory
        smem_q = v.row_tiles * 16 * (q_smem_steps * 16 + 8) * 2
        return Resources(smem_kv + smem_xchg + smem_bars + smem_q + smem_pair, (dim_cta // 16 - q_smem_steps) * 4,
                         2 * (2 // wpt) * 4, v.kv_lora_rank // 2 // wpt // 8 * 4)
    kv_row = dim_qk + 8
    smem_kv = v.stages * v.block_n * kv_row * 2
    n_groups = v.block_n // 16
    k_groups = max(1, v.num_warps // max(1, n_groups))
    smem_s = k_groups * v.rows_per_cta * (v.block_n + 8) * 4  # rows padded by 8 floats (bank spread)
    smem_s *= 2 if v.overlap else 1  # overlap: a second partial-score buffer
    smem_p = v.rows_per_cta * (v.block_n + 8) * 2
    smem_stats = 3 * v.rows_per_cta * 4
    bulk = v.load_width == "bulk"
    smem_slots = 0 if bulk else v.stages * v.block_n * 8  # cp.async: slot ring; bulk: one mbarrier per stage
    smem_slots += v.stages * 8 if bulk else 0
    k_steps = dim_qk // 16
    ks_per_warp = -(-k_steps // k_groups)
    regs_q = v.row_tiles * ks_per_warp * 4
    regs_s = v.row_tiles * 2 * 4
    regs_o = v.row_tiles * (dim_v // v.num_warps // 8) * 4
    return Resources(smem_kv + smem_s + smem_p + smem_stats + smem_slots, regs_q, regs_s, regs_o)


def infeasible_reason(v: Variant) -> str | None:
    """Why ``v`` cannot be built for all of its archs, or None when it can."""
    if v.schedule == "dimsplit":
        return _dimsplit_reason(v)
    if v.schedule == "dimsplit_t":
        return _dimsplit_t_reason(v)
    if v.dtype != "bf16":
        return f"dtype {v.dtype} (KV cache) needs schedule dimsplit or dimsplit_t (their warps dequantize the stages)"
    if v.num_warps not in ROWBLOCK_WARPS:
        return f"schedule rowblock needs num_warps 4, 8 or 16, got {v.num_warps}"
    if v.overlap and v.load_width != "bulk":
        return f"overlap needs load_width bulk, got {v.load_width}"
    r = resources(v)
    if (why := _smem_reason(v, r)) is not None:
        return why
    if (v.dim_v // v.num_warps) % 16:
        return f"kv_lora_rank / num_warps = {v.dim_v / v.num_warps:g} dims is not a multiple of 16"
    if v.block_n % SOFTMAX_LANES:
        return f"block_n {v.block_n} does not divide by {SOFTMAX_LANES} softmax lanes"
    if v.num_warps % (v.block_n // 16):
        return f"num_warps {v.num_warps} is not a multiple of block_n / 16 = {v.block_n // 16} token groups"
    if v.dim_qk // 16 < v.num_warps // (v.block_n // 16):
        return f"{v.dim_qk // 16} k-steps cannot be shared by {v.num_warps // (v.block_n // 16)} k-groups"
    if r.regs_tiles > REG_TILE_LIMIT:
        return f"register tiles {r.regs_tiles} words/thread > {REG_TILE_LIMIT} (Q {r.regs_q}, S {r.regs_s}, O {r.regs_o}): would spill"
    if v.rows_per_cta > 2 * v.rows_max and v.row_tiles > 1:
        return f"row_tiles {v.row_tiles} ({v.rows_per_cta} rows) is more than twice the {v.rows_max} rows of H x q_len"
    return None


def _dimsplit_reason(v: Variant) -> str | None:
    """Why a dimsplit variant cannot be built (the rules of MlaDimSplitConfig's static_asserts)."""
    if v.load_width not in ("bulk", 128):
        return f"schedule dimsplit loads with cp.async.bulk or 16-byte cp.async: load_width must be bulk or 128, got {v.load_width}"
    if v.load_width == 128 and v.kv_lora_rank != 512:
        return "schedule dimsplit with load_width 128 moves a 512-byte latent half per warp instruction: kv_lora_rank must be 512"
    if v.overlap:
        return "schedule dimsplit overlaps loads and math by itself: overlap must be 0"
    if v.block_n != 32:
        # block_n 16 compiles, but spills at 255 registers with some nvcc 13.x builds for sm_120 and
        # ran slower on the H200 (139.5 vs 128.6 µs at H8 q9 bs1 64k, bulk loader)
        return f"schedule dimsplit: block_n must be 32 (stages of 32 tokens, consumed 16 at a time), got {v.block_n}"
    if (v.kv_lora_rank // 2) % 16 or (v.qk_rope_head_dim // 2) % 16 or v.qk_rope_head_dim % 2:
        return (f"schedule dimsplit splits kv_lora_rank {v.kv_lora_rank} and qk_rope_head_dim {v.qk_rope_head_dim} "
                "in halves that must be multiples of 16")
    rope_chunks = v.qk_rope_head_dim // 2 * 2 // 16  # 16-byte chunks of a rope half (MlaDimSplitConfig::kRopeChunks)
    if v.load_width == 128 and (rope_chunks == 0 or 32 % rope_chunks):
        # the cp.async loader copies whole tokens' rope halves per warp instruction (32 % kRopeChunks == 0,
        # a static_assert that does not compile for kRopeChunks 0)
        return (f"schedule dimsplit with load_width 128 copies the rope halves of 32 / (qk_rope_head_dim / 16) tokens "
                f"per warp instruction: qk_rope_head_dim must be 32, 64 or 128, got {v.qk_rope_head_dim} (use load_width bulk)")
    if v.dtype == "fp8_e4m3":
        if v.load_width != 128:
            return f"dtype fp8_e4m3 loads with 16-byte cp.async: load_width must be 128, got {v.load_width}"
        if v.kv_lora_rank != 512 or v.qk_rope_head_dim != 64:
            return "dtype fp8_e4m3 copies 256 + 32 bytes of each row per CTA: kv_lora_rank 512, qk_rope_head_dim 64"
        if v.row_tiles + 3 > 8:
            return (f"dtype fp8_e4m3 runs row_tiles + 3 warps (a producer and two converter warps) of at most 8: "
                    f"at most 5 row tiles, got {v.row_tiles} ({v.rows_max} rows)")
    want = dimsplit_row_tiles(v.rows_max)
    if v.row_tiles != want:
        return (f"schedule dimsplit covers {v.rows_max} rows with clusters of {want} row tiles "
                f"(fewest KV reads, at most {DIMSPLIT_MAX_ROW_TILES}): row_tiles must be {want}, got {v.row_tiles}")
    if v.dtype == "fp8_e4m3" and v.num_warps != v.row_tiles + 3:
        return (f"dtype fp8_e4m3 runs one warp per row tile, a producer and two converter warps: num_warps must be "
                f"row_tiles + 3 = {v.row_tiles + 3}, got {v.num_warps}")
    pair_warps = 2 * v.row_tiles + 1
    if not (v.row_tiles + 1 <= v.num_warps <= 8 or v.num_warps == pair_warps):
        return (f"schedule dimsplit needs num_warps 2 x row_tiles + 1 = {pair_warps} (two warps per row tile) or in "
                f"[row_tiles + 1, 8] = [{v.row_tiles + 1}, 8] (one), got {v.num_warps}")
    if dimsplit_pairs(v) and v.row_tiles == 4:
        # 9 warps leave 168 registers per thread; nvcc 13.0 spills 8 B on sm_90 there (tree mask, cp.async loader)
        return ("schedule dimsplit with two warps per row tile spills at row_tiles 4 (9 warps, 168 registers on "
                "sm_90): use num_warps 5 (one warp per row tile)")
    if dimsplit_pairs(v) and v.load_width == "bulk" and v.row_tiles >= 4:
        # the bulk producer's extra registers spill at 168 per thread (sm_90, nvcc 13.0: 4 B with 11 warps)
        return ("schedule dimsplit with two warps per row tile loads with 16-byte cp.async at this size: "
                f"load_width must be 128 for row_tiles {v.row_tiles} (the bulk loader spills at 168 registers)")
    if dimsplit_pairs(v) and v.row_tiles > DIMSPLIT_PAIR_MAX_ROW_TILES:
        return (f"schedule dimsplit with two warps per row tile fits at most {DIMSPLIT_PAIR_MAX_ROW_TILES} row tiles "
                f"({2 * DIMSPLIT_PAIR_MAX_ROW_TILES + 1} warps, 168 registers each), got row_tiles {v.row_tiles}")
    r = resources(v)
    if (why := _smem_reason(v, r)) is not None:
        return why
    if r.regs_tiles > DIMSPLIT_REG_TILE_LIMIT:
        return (f"register tiles {r.regs_tiles} words/thread > {DIMSPLIT_REG_TILE_LIMIT} "
                f"(Q {r.regs_q}, S {r.regs_s}, O {r.regs_o}): would spill")
    return None


def _dimsplit_t_reason(v: Variant) -> str | None:
    """Why a dimsplit_t variant cannot be built (the rules of MlaDimSplitTConfig's static_asserts)."""
    if v.dtype == "fp8_e4m3" and v.block_n != 32:
        return (f"schedule dimsplit_t with dtype fp8_e4m3 copies the e4m3 rows in 32-token stages: block_n must be 32, "
                f"got {v.block_n}")
    if v.load_width != 128:
        return f"schedule dimsplit_t loads with 16-byte cp.async: load_width must be 128, got {v.load_width}"
    if v.kv_lora_rank != 512 or v.qk_rope_head_dim != 64:
        return ("schedule dimsplit_t needs kv_lora_rank 512 and qk_rope_head_dim 64 (a 512-byte latent half per "
                "producer instruction, 64 output dims per output warp)")
    if v.overlap:
        return "schedule dimsplit_t overlaps loads and math by itself: overlap must be 0"
    if v.block_n not in (16, 32):
        return f"schedule dimsplit_t: block_n must be 16 or 32 (stages of 16 or 32 tokens), got {v.block_n}"
    want = dimsplit_t_row_tiles(v.rows_max)
    if v.row_tiles != want:
        return (f"schedule dimsplit_t covers {v.rows_max} rows with score warps of {DIMSPLIT_T_ROWS_PER_SCORE_WARP} "
                f"rows, at most {DIMSPLIT_T_MAX_SCORE_WARPS} per cluster: row_tiles must be {want} and num_warps "
                f"{dimsplit_t_num_warps(want)}, got row_tiles {v.row_tiles}")
    warps = dimsplit_t_num_warps(v.row_tiles)
    if v.num_warps != warps:
        return (f"schedule dimsplit_t runs row_tiles score warps, {DIMSPLIT_T_OUT_WARPS} output warps and a producer: "
                f"num_warps must be {warps}, got {v.num_warps}")
    why = _smem_reason(v, resources(v))
    if why is not None and v.dtype == "fp8_e4m3" and v.stages > 2:
        why += f" (dtype fp8_e4m3 on dimsplit_t: an e4m3 ring of stages 2 fits beside its 3 bf16 stages, got {v.stages})"
    return why


def _smem_reason(v: Variant, r: Resources) -> str | None:
    """The shared-memory limit of the first of ``v``'s archs that ``r`` exceeds, as a reason, or None."""
    for arch in v.archs:
        if r.smem_bytes > SMEM_LIMIT[arch]:
            return f"shared memory {r.smem_bytes} B > {SMEM_LIMIT[arch]} B per block on {arch}"
    return None


def split_feasible(variants: list[Variant]) -> tuple[list[Variant], list[tuple[Variant, str]]]:
    """Partition into (feasible, [(infeasible, reason)])."""
    ok, bad = [], []
    for v in variants:
        reason = infeasible_reason(v)
        if reason is None:
            ok.append(v)
        else:
            bad.append((v, reason))
    return ok, bad
