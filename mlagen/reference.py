"""The one torch reference of MLA verify attention (serves verify, tests and bench).

Semantics (issue #2): request b has ``kv_len[b]`` cached tokens, the last ``q_len`` of which are
the draft tokens being verified (their KV is already in the cache). Query i of request b is at
position ``kv_len - q_len + i``; it sees every prefix position ``< kv_len - q_len`` and draft
position j when the mask allows it (tree: bit j of ``tree_mask[b, i]``; causal: j <= i; none:
always). Keys are all ``kv_lora_rank + qk_rope_head_dim`` dims of a cache row, values its first
``kv_lora_rank`` dims (absorbed MLA, DeepSeek-V3 paper §2.1 / FlashMLA's layout). A row with no
visible key gets out = 0 and lse = -inf.
"""

from __future__ import annotations

import torch


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
                         req_pool_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference on the bf16 inputs.

    Args:
        q: bf16 [bs*q_len, H, D] with D = kv_lora_rank + qk_rope_head_dim (576).
        kv_cache: bf16 [num_slots, D] or [num_slots, 1, D].
        block_table: int32 [rows, max_pages] page ids (page_size 1: slot ids, SGLang's req_to_token).
        kv_lens: int [bs] cached tokens per request including the q_len draft tokens.
        tree_mask: int64 [bs, q_len] bitmasks (mask 'tree').
        req_pool_indices: optional int [bs]: request b uses block_table row req_pool_indices[b].
    Returns:
        out fp32 [bs*q_len, H, kv_lora_rank], lse fp32 [bs*q_len, H] (natural log; -inf when no key is visible).
    """
    kv = kv_cache.reshape(kv_cache.shape[0], kv_cache.shape[-1])
    bs = kv_lens.shape[0]
    H = q.shape[1]
    out = torch.zeros(bs * q_len, H, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((bs * q_len, H), float("-inf"), dtype=torch.float32, device=q.device)
    lens = kv_lens.tolist()
    rows = req_pool_indices.tolist() if req_pool_indices is not None else list(range(bs))
    for b in range(bs):
        L = int(lens[b])
        if L <= 0:
            continue
        slots = gather_slots(block_table, int(rows[b]), L, page_size)
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
    return out, lse


def mla_verify_naive(q, kv_cache, block_table, kv_lens, *, q_len, page_size, softmax_scale, kv_lora_rank=512,
                     mask="tree", tree_mask=None):
    """Per-token, per-head, per-key loop in float64 (CPU, tiny shapes): the check on the reference."""
    import math

    kv = kv_cache.reshape(kv_cache.shape[0], kv_cache.shape[-1]).double().cpu()
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
                    vals.append(kv[slot, :kv_lora_rank])
                if not scores:
                    continue
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                z = sum(w)
                out[b * q_len + i, h] = sum(wi * vi for wi, vi in zip(w, vals)) / z
                lse[b * q_len + i, h] = m + math.log(z)
    return out, lse
