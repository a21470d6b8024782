"""The one torch reference of MLA verify attention (serves verify, tests and bench).

Semantics (issue #2): request b has ``kv_len[b]`` cached tokens, the last ``q_len`` of which are
the draft tokens being verified (their KV is already in the cache). Query i of request b is at
position ``kv_len - q_len + i``; it sees every prefix position ``< kv_len - q_len`` and draft
position j when the mask allows it (tree: bit j of ``tree_mask[b, i]``; causal: j <= i; none:
always). Keys are all ``kv_lora_rank + qk_rope_head_dim`` dims of a cache row, values its first
``kv_lora_rank`` dims (absorbed MLA, DeepSeek-V3 paper §2.1 / FlashMLA's layout). A row with no
visible key gets out = 0 and lse = -inf.

fp8 KV cache (issue #12; spec ``dtype: fp8_e4m3``, served by the SGLang backend for --kv-cache-dtype fp8_e4m3):
a cache of float8_e4m3fn values (or their uint8 bytes, SGLang's storage dtype) with per-tensor descales
k_scale / v_scale.
The bytes are the truth: key = e4m3(byte) x k_scale, value = e4m3(byte)[:kv_lora_rank] x v_scale,
each one fp32 rounding of the decoded byte times fp32(scale); q, out and lse are as for bf16.
That is SGLang 0.5.23's Triton backend: scores = (q . k_fp8) x sm_scale x k_scale
(kernels/ops/attention/extend_attention.py:646, decode_attention.py:1305), out = (P V_fp8) x v_scale
(extend_attention.py:713, decode_attention.py:1016); see docs/fp8-kv-cache.md.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value (bytes 0x7e / 0xfe)
E4M3_NAN_BYTES = (0x7F, 0xFF)  # the only NaN encodings; e4m3fn has no infinities


def _e4m3_value(byte: int) -> float:
    """The value of one float8_e4m3fn byte, decoded from its fields: sign (bit 7), exponent (bits 6-3,
    bias 7), mantissa (bits 2-0). Exponent 0 is subnormal (m x 2^-9); exponent 15 with mantissa 7 is
    NaN; every other pattern is finite, up to 1.75 x 2^8 = 448."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    if e == 0:
        return sign * math.ldexp(m, -9)
    return sign * math.ldexp(8 + m, e - 10)  # (1 + m / 8) x 2^(e - 7)


_E4M3_TABLE = torch.tensor([_e4m3_value(b) for b in range(256)], dtype=torch.float32)  # exact in fp32


def is_fp8_kv(kv_cache: torch.Tensor) -> bool:
    """True for an fp8 (e4m3) KV cache: dtype float8_e4m3fn, or uint8 holding its bytes."""
    return kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn)


def e4m3_bytes(kv: torch.Tensor) -> torch.Tensor:
    """uint8 view of an fp8 KV tensor (float8_e4m3fn or uint8; no copy).

    Raises:
        TypeError: any other dtype.
    """
    if kv.dtype == torch.uint8:
        return kv
    if kv.dtype == torch.float8_e4m3fn:
        return kv.view(torch.uint8)
    raise TypeError(f"expected an fp8 e4m3 KV tensor (float8_e4m3fn or uint8 bytes), got {kv.dtype}")


def dequantize_e4m3(kv: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fp32 values of e4m3 KV entries times a per-tensor scale.

    Args:
        kv: float8_e4m3fn, or uint8 bytes of them (SGLang's MLA pool stores uint8 [slots, 1, 576] and
            views it as float8_e4m3fn), any shape.
        scale: the descale (SGLang ``layer.k_scale_float`` / ``v_scale_float``; 1.0 without scales),
            rounded to fp32 as a kernel receives it.
    Returns:
        fp32, the shape of ``kv``: the decoded byte (exact in fp32) times fp32(scale), one rounding.
        NaN bytes (0x7f, 0xff) give NaN; 0x80 gives -0.0.
    Raises:
        TypeError: ``kv`` is neither float8_e4m3fn nor uint8.
    """
    b = e4m3_bytes(kv)
    out = _E4M3_TABLE.to(b.device)[b.long()]
    s = float(torch.tensor(float(scale), dtype=torch.float32))
    return out if s == 1.0 else out * s


def split_kv_scale(kv_scale) -> tuple[float, float]:
    """(k_scale, v_scale) of a ``kv_scale`` argument: None -> (1.0, 1.0), a number -> (s, s), a pair as is.

    Raises:
        ValueError: a scale that is not finite and positive, or a sequence that is not a pair.
    """
    if kv_scale is None:
        return 1.0, 1.0
    if isinstance(kv_scale, (int, float)):
        ks = vs = float(kv_scale)
    else:
        pair = tuple(kv_scale)
        if len(pair) != 2:
            raise ValueError(f"kv_scale must be a number or a (k_scale, v_scale) pair, got {kv_scale!r}")
        ks, vs = float(pair[0]), float(pair[1])
    for name, x in (("k_scale", ks), ("v_scale", vs)):
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{name} must be finite and > 0, got {x}")
    return ks, vs


def visible_mask(kv_len: int, q_len: int, mask: str, tree_rows: torch.Tensor | None) -> torch.Tensor:
    """Bool [q_len, kv_len]: which key positions each query row of one request sees.

    Args:
        tree_rows: int64 [q_len] bitmasks (tree mask only); bit j = query sees draft token j.
    Raises:
        ValueError: unknown mask kind, or a tree mask without ``tree_rows``.
    """
    prefix = kv_len - q_len
    pos = torch.arange(kv_len)
    d = pos - prefix  # draft index of each key, < 0 for the prefix
    qi = torch.arange(q_len)[:, None]
    is_prefix = (d < 0)[None, :].expand(q_len, kv_len)
    dd = d.clamp(min=0)[None, :].expand(q_len, kv_len)
    if mask == "none":
        draft_ok = torch.ones(q_len, kv_len, dtype=torch.bool)
    elif mask == "causal":
        draft_ok = dd <= qi
    elif mask == "tree":
        if tree_rows is None:
            raise ValueError("mask 'tree' needs tree_mask rows")
        rows = tree_rows.to("cpu", torch.int64)[:, None]
        draft_ok = ((rows >> dd.clamp(max=63)) & 1).bool() & (dd < 64)
    else:
        raise ValueError(f"unknown mask {mask!r}; allowed: none, causal, tree")
    return is_prefix | draft_ok


def gather_slots(block_table: torch.Tensor, row: int, kv_len: int, page_size: int) -> torch.Tensor:
    """int64 [kv_len] cache slots of a request: page_id * page_size + pos % page_size."""
    pos = torch.arange(kv_len, device=block_table.device)
    pages = block_table[row, pos // page_size].to(torch.int64)
    return pages * page_size + pos % page_size


def mla_verify_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, kv_lens: torch.Tensor,
                         *, q_len: int, page_size: int, softmax_scale: float, kv_lora_rank: int = 512,
                         mask: str = "tree", tree_mask: torch.Tensor | None = None,
                         req_pool_indices: torch.Tensor | None = None,
                         kv_scale: float | tuple[float, float] | None = None,
                         with_magnitude: bool = False):
    """fp32 reference on the bf16 (or fp8 KV) inputs.

    Args:
        q: bf16 [bs*q_len, H, D] with D = kv_lora_rank + qk_rope_head_dim (576).
        kv_cache: bf16 [num_slots, D] or [num_slots, 1, D]; or an fp8 e4m3 cache of the same shape,
            dtype float8_e4m3fn or uint8 (its bytes).
        block_table: int32 [rows, max_pages] page ids (page_size 1: slot ids, SGLang's req_to_token).
        kv_lens: int [bs] cached tokens per request including the q_len draft tokens; <= 0: a padded row
            (out 0, lse -inf).
        q_len: draft tokens per request (query i of request b is row b*q_len + i of q).
        page_size: tokens per page of block_table.
        softmax_scale: multiplies q . k (before k_scale).
        kv_lora_rank: dims of V (the first dims of a cache row); 512 for DeepSeek-V3.
        mask: "tree", "causal" or "none" (see the module docstring).
        tree_mask: int64 [bs, q_len] bitmasks (mask 'tree').
        req_pool_indices: optional int [bs]: request b uses block_table row req_pool_indices[b].
        kv_scale: per-tensor descales, a number (k_scale = v_scale) or a (k_scale, v_scale) pair; None
            is (1.0, 1.0). Keys are the stored rows x k_scale, values their first kv_lora_rank dims x
            v_scale (:func:`dequantize_e4m3` for fp8), so scores = q . k_stored x softmax_scale x k_scale
            and out = softmax(scores) V_stored x v_scale: SGLang 0.5.23's Triton backend
            (extend_attention.py:646 / :713, decode_attention.py:1305 / :1016; docs/fp8-kv-cache.md).
            Only rows of positions < kv_len are read: NaN bytes elsewhere never matter. A NaN in a draft row
            (a position in [kv_len - q_len, kv_len)) reaches every query row of its request, also those the mask
            hides it from (their weight 0 times NaN in P V), as in the kernels' P V MMAs; :func:`mla_verify_naive`
            skips hidden keys instead, so the two agree wherever the draft rows are finite.
        with_magnitude: also return P |V| (fp32, out's shape): the scale of each output element's rounding
            error (bf16 P and bf16 out each round by at most 2^-8 of it), which the tolerance of
            :func:`mlagen.verify.compare` grows with (fp8 rows at +-448 give outputs in the hundreds).
    Returns:
        out fp32 [bs*q_len, H, kv_lora_rank], lse fp32 [bs*q_len, H] (natural log of the scaled scores;
        -inf when no key is visible), on q's device; with ``with_magnitude`` a third tensor, P |V|.
    Raises:
        ValueError: a kv_scale that is not finite and positive, or a sequence that is not a pair
            (:func:`split_kv_scale`); an unknown mask, or mask "tree" without tree_mask (:func:`visible_mask`:
            raised at the first request with kv_len > 0).
    """
    kv = kv_cache.reshape(kv_cache.shape[0], kv_cache.shape[-1])
    fp8 = is_fp8_kv(kv)
    if fp8:
        kv = e4m3_bytes(kv)
    k_scale, v_scale = split_kv_scale(kv_scale)
    scaled = fp8 or kv_scale is not None
    bs = kv_lens.shape[0]
    H = q.shape[1]
    out = torch.zeros(bs * q_len, H, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((bs * q_len, H), float("-inf"), dtype=torch.float32, device=q.device)
    mag = torch.zeros_like(out) if with_magnitude else None
    lens = kv_lens.tolist()
    rows = req_pool_indices.tolist() if req_pool_indices is not None else list(range(bs))
    for b in range(bs):
        L = int(lens[b])
        if L <= 0:
            continue
        slots = gather_slots(block_table, int(rows[b]), L, page_size)
        if scaled:
            stored = kv[slots.to(kv.device)]
            if fp8:
                k = dequantize_e4m3(stored, k_scale).to(q.device)  # [L, D]
                v = dequantize_e4m3(stored[:, :kv_lora_rank], v_scale).to(q.device)
            else:
                k = stored.float() * k_scale
                v = stored[:, :kv_lora_rank].float() * v_scale
        else:
            k = kv[slots].float()  # [L, D]
            v = k[:, :kv_lora_rank]
        qb = q[b * q_len:(b + 1) * q_len].float()  # [q_len, H, D]
        s = torch.einsum("ihd,ld->ihl", qb, k) * softmax_scale
        vis = visible_mask(L, q_len, mask, tree_mask[b] if tree_mask is not None else None).to(q.device)
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        lse_b = torch.logsumexp(s, dim=-1)  # [q_len, H]
        p = torch.exp(s - lse_b[..., None]).nan_to_num(0.0)  # rows with no visible key -> 0
        out[b * q_len:(b + 1) * q_len] = torch.einsum("ihl,ld->ihd", p, v)
        lse[b * q_len:(b + 1) * q_len] = lse_b
        if with_magnitude:
            mag[b * q_len:(b + 1) * q_len] = torch.einsum("ihl,ld->ihd", p, v.abs())
    return (out, lse, mag) if with_magnitude else (out, lse)


def mla_verify_naive(q, kv_cache, block_table, kv_lens, *, q_len, page_size, softmax_scale, kv_lora_rank=512,
                     mask="tree", tree_mask=None, kv_scale=None):
    """Per-token, per-head, per-key loop in float64 (CPU, tiny shapes): the check on the reference.

    Arguments as in :func:`mla_verify_reference`, with no req_pool_indices: request b reads block_table row b.
    An fp8 cache is decoded from its bytes field by field (float64, scale rounded to fp32: the products are
    exact).

    Returns:
        out float64 [bs*q_len, H, kv_lora_rank] and lse float64 [bs*q_len, H] (natural log; -inf and out 0 for a
        row with no visible key), on the CPU.
    Raises:
        ValueError: a mask other than "tree", "causal" or "none"; mask "tree" with tree_mask None; a bad kv_scale
            (:func:`split_kv_scale`; checked only with a kv_scale or an fp8 cache).
    """
    if mask not in ("tree", "causal", "none"):
        raise ValueError(f"unknown mask {mask!r}; allowed: none, causal, tree")
    if mask == "tree" and tree_mask is None:
        raise ValueError("mask 'tree' needs tree_mask (int64 [bs, q_len] bitmasks)")
    kv2 = kv_cache.reshape(kv_cache.shape[0], kv_cache.shape[-1]).cpu()
    if kv_scale is None and not is_fp8_kv(kv2):
        kv = kv2.double()
        kvv = kv
    else:
        ks, vs = (float(torch.tensor(s, dtype=torch.float32)) for s in split_kv_scale(kv_scale))
        if is_fp8_kv(kv2):
            table = torch.tensor([_e4m3_value(b) for b in range(256)], dtype=torch.float64)
            base = table[e4m3_bytes(kv2).long()]
        else:
            base = kv2.double()
        kv, kvv = base * ks, base * vs
    qd = q.double().cpu()
    bs, H = kv_lens.shape[0], q.shape[1]
    out = torch.zeros(bs * q_len, H, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((bs * q_len, H), float("-inf"), dtype=torch.float64)
    for b in range(bs):
        L = int(kv_lens[b])
        prefix = L - q_len
        for i in range(q_len):
            for h in range(H):
                scores, vals = [], []
                for j in range(L):
                    d = j - prefix
                    if d >= 0:
                        if mask == "causal" and d > i:
                            continue
                        if mask == "tree" and not (int(tree_mask[b, i]) >> d) & 1:
                            continue
                    slot = int(block_table[b, j // page_size]) * page_size + j % page_size
                    scores.append(float(qd[b * q_len + i, h] @ kv[slot]) * softmax_scale)
                    vals.append(kvv[slot, :kv_lora_rank])
                if not scores:
                    continue
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                z = sum(w)
                out[b * q_len + i, h] = sum(wi * vi for wi, vi in zip(w, vals)) / z
                lse[b * q_len + i, h] = m + math.log(z)
    return out, lse
