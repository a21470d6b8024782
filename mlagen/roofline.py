"""The verify problem's byte and FLOP counts and its roofline floor (pure Python, no torch).

bytes = KV read once (bs * ctx * D_qk * 2, or * 1 for an fp8 e4m3 cache) + q (bs * q_len * H * D_qk * 2) + out (bs * q_len * H * D_v * 2)
FLOPs = 2 * rows * ctx * (D_qk + D_v), rows = bs * q_len * H (QK^T over 576 dims, PV over 512)
floor = max(bytes / copy bandwidth, FLOPs / mma.sync rate)   (issue #3)
ctx is the KV length including the q_len draft tokens; masked draft columns are counted (< q_len / ctx).
"""

from __future__ import annotations


def verify_bytes(heads: int, q_len: int, bs: int, ctx: int, dim_qk: int = 576, dim_v: int = 512,
                 kv_bytes: int = 2) -> int:
    """Minimum DRAM bytes of one verify call: KV once (``kv_bytes`` per element: 2 bf16, 1 fp8 e4m3) + q
    + out (bf16)."""
    return bs * ctx * dim_qk * kv_bytes + bs * q_len * heads * dim_qk * 2 + bs * q_len * heads * dim_v * 2


def verify_flops(heads: int, q_len: int, bs: int, ctx: int, dim_qk: int = 576, dim_v: int = 512) -> int:
    """FLOPs of one verify call: 2 * rows * ctx * (D_qk + D_v), rows = bs * q_len * heads."""
    return 2 * bs * q_len * heads * ctx * (dim_qk + dim_v)
