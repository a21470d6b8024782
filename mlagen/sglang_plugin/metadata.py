"""Torch helpers that turn SGLang batch state into the mlagen kernel's inputs.

All functions write into caller-provided tensors where a CUDA-graph buffer is involved; none
calls ``.item()`` or synchronizes. Shapes use ``bs`` = requests in the (possibly padded) batch and
``q`` = draft tokens per request.
"""

from __future__ import annotations

import torch


def causal_bits(q_len: int, device=None) -> torch.Tensor:
    """int64 [q_len]: row i has bits 0..i set (a chain draft: query i sees drafts j <= i)."""
    i = torch.arange(q_len, dtype=torch.int64, device=device)
    # (1 << (i + 1)) - 1 without overflowing at i = 63: sum of bits 0..i.
    j = torch.arange(q_len, dtype=torch.int64, device=device)
    return torch.where(j[None, :] <= i[:, None], torch.ones((), dtype=torch.int64, device=device) << j[None, :],
                       torch.zeros((), dtype=torch.int64, device=device)).sum(-1)


def pack_full_mask(custom_mask: torch.Tensor, seq_lens: torch.Tensor, q_len: int) -> torch.Tensor:
    """Pack SGLang's FULL_MASK verify mask into per-row draft bitmasks.

    Args:
        custom_mask: bool/uint8 1-D, per request b (in order) a row-major [q_len, seq_lens[b] + q_len]
            block: row i = draft query i, column c = key position c (prefix then drafts); it must hold
            sum_b (seq_lens[b] + q_len) * q_len cells (SGLang's FULL_MASK size).
        seq_lens: int [n] prefix lengths (excluding the draft tokens), the layout's seq lens.
        q_len: draft tokens per request (<= 64).
    Returns:
        int64 [n, q_len]: bit j of [b, i] = query i of request b sees draft token j.
    Raises:
        IndexError: a mask shorter than that, on the CPU (on a CUDA device the out-of-range read is a
            device-side assert, reported as a RuntimeError).
    """
    n = seq_lens.shape[0]
    dev = custom_mask.device
    L = seq_lens.to(device=dev, dtype=torch.int64)
    width = L + q_len
    block = width * q_len
    start = torch.cumsum(block, 0) - block  # exclusive prefix sum
    i = torch.arange(q_len, dtype=torch.int64, device=dev)
    idx = (start[:, None, None] + i[None, :, None] * width[:, None, None] + L[:, None, None]
           + i[None, None, :])  # [n, q(i), q(j)]
    bits = custom_mask[idx.reshape(-1)].reshape(n, q_len, q_len) != 0
    weights = torch.ones((), dtype=torch.int64, device=dev) << i  # bit 63 wraps to INT64_MIN: fine
    return (bits.to(torch.int64) * weights[None, None, :]).sum(-1)


def pack_qlen_mask(custom_mask: torch.Tensor, n: int, q_len: int) -> torch.Tensor:
    """Pack SGLang's QLEN_ONLY verify mask (TreeMaskMode.QLEN_ONLY) into per-row draft bitmasks.

    Args:
        custom_mask: bool/uint8 1-D with >= n * q_len * q_len elements: per request b a row-major
            [q_len, q_len] block at b * q_len * q_len, [i, j] = draft query i sees draft token j.
        n: requests to pack (the first n blocks).
        q_len: draft tokens per request (<= 64).
    Returns:
        int64 [n, q_len]: bit j of [b, i] = query i of request b sees draft token j.
    Raises:
        ValueError: the mask holds fewer than n * q_len * q_len elements.
    """
    need = n * q_len * q_len
    if custom_mask.numel() < need:
        raise ValueError(f"QLEN_ONLY verify mask has {custom_mask.numel()} elements, {need} needed "
                         f"for {n} requests of {q_len} draft tokens")
    bits = custom_mask.reshape(-1)[:need].reshape(n, q_len, q_len) != 0
    weights = torch.ones((), dtype=torch.int64, device=custom_mask.device) << torch.arange(
        q_len, dtype=torch.int64, device=custom_mask.device)
    return (bits.to(torch.int64) * weights).sum(-1)


def page_columns(table_width: int, page_size: int, device=None) -> torch.Tensor:
    """int64 [ceil(table_width / page_size)]: the req_to_token column of each page's first token (0, page_size,
    ...), for a req_to_token of ``table_width`` columns."""
    return torch.arange(0, table_width, page_size, dtype=torch.int64, device=device)


def fill_block_table(out: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     cols: torch.Tensor, page_size: int) -> None:
    """Write page ids into ``out[:bs, :ncols]`` (int32) from SGLang's req_to_token.

    Args:
        out: int32 [>= bs, >= ncols]; columns past ncols keep stale values (never read: the kernel
            reads only ceil(kv_len / page_size) pages).
        req_to_token: int32 [pool_rows, width] slot ids; a page's slots are contiguous and
            page-aligned, so page id = slot of its first token // page_size.
        req_pool_indices: int [bs] rows of req_to_token.
        cols: int64 [ncols] from :func:`page_columns` (possibly a prefix of it).
    """
    bs, ncols = req_pool_indices.shape[0], cols.shape[0]
    rows = req_to_token[req_pool_indices.to(torch.int64)[:, None], cols[None, :]]
    if page_size > 1:
        rows = torch.div(rows, page_size, rounding_mode="floor")
    out[:bs, :ncols].copy_(rows)


def fill_kv_lens(out: torch.Tensor, seq_lens: torch.Tensor, extra: int, num_padding: int) -> None:
    """out[:bs] = seq_lens + extra (int32); the last ``num_padding`` rows get 0 (padded rows).

    Args:
        out: int32 [>= bs] (kv_lens buffer); rows past bs are untouched.
        seq_lens: int [bs] (int32 / int64; copied into out's int32), bs = its length.
        extra: added to every row (q_len for target verify, 0 for decode).
        num_padding: padded rows at the end of the batch, 0 <= num_padding <= bs.
    """
    bs = seq_lens.shape[0]
    out[:bs].copy_(seq_lens + extra if extra else seq_lens)
    if num_padding > 0:
        out[bs - num_padding:bs].zero_()
