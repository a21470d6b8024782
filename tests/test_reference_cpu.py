"""The torch reference against a naive float64 per-token loop (CPU), on fresh random inputs."""

import math

import pytest
import torch

from mlagen.cases import random_tree
from mlagen.reference import mla_verify_naive, mla_verify_reference, visible_mask


def _problem(kv_lens, q_len, H, P, D=40, rank=32, mask="tree", seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, (1,))))
    pages = [max(1, math.ceil(L / P)) for L in kv_lens]
    n_pages = sum(pages) + 2
    perm = torch.randperm(n_pages, generator=g)
    table = torch.full((len(kv_lens), max(pages)), -1, dtype=torch.int32)
    off = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[off:off + n].to(torch.int32)
        off += n
    kv = torch.randn(n_pages * P, D, generator=g).to(torch.bfloat16)
    q = torch.randn(len(kv_lens) * q_len, H, D, generator=g).to(torch.bfloat16)
    tree = torch.tensor([random_tree(q_len, g) for _ in kv_lens], dtype=torch.int64) if mask == "tree" else None
    return q, kv, table, torch.tensor(kv_lens, dtype=torch.int32), tree


@pytest.mark.parametrize("mask", ["tree", "causal", "none"])
@pytest.mark.parametrize("P", [1, 4])
def test_reference_matches_naive_loop(mask, P):
    q_len, H = 5, 3
    q, kv, table, lens, tree = _problem([13, 5, 0, 22], q_len, H, P, mask=mask)
    args = dict(q_len=q_len, page_size=P, softmax_scale=0.37, kv_lora_rank=32, mask=mask, tree_mask=tree)
    out, lse = mla_verify_reference(q, kv, table, lens, **args)
    n_out, n_lse = mla_verify_naive(q, kv, table, lens, **args)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), n_out, atol=1e-5, rtol=1e-5)
    fin = torch.isfinite(n_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse.double()[fin], n_lse[fin], atol=1e-5, rtol=1e-5)
    # padded request (kv_len 0): out 0, lse -inf
    assert (out[2 * q_len:3 * q_len] == 0).all() and torch.isinf(lse[2 * q_len:3 * q_len]).all()


def test_masks_differ_and_tree_is_ancestor_closed():
    g = torch.Generator().manual_seed(0)
    rows = random_tree(9, g)
    for i, r in enumerate(rows):
        assert (r >> i) & 1 and r & 1  # self and root
    t = visible_mask(12, 9, "tree", torch.tensor(rows))
    c = visible_mask(12, 9, "causal", None)
    assert t[:, :3].all() and c[:, :3].all()  # prefix always visible
    assert (t <= c).all()  # a tree row sees a subset of the causal row
    with pytest.raises(ValueError, match="unknown mask"):
        visible_mask(3, 1, "sliding", None)


def test_reference_ignores_nan_in_unreferenced_rows():
    q, kv, table, lens, tree = _problem([9, 17], 3, 2, 4)
    used = set()
    for b, L in enumerate(lens.tolist()):
        for j in range(L):
            used.add(int(table[b, j // 4]) * 4 + j % 4)
    for s in range(kv.shape[0]):
        if s not in used:
            kv[s] = float("nan")
    out, lse = mla_verify_reference(q, kv, table, lens, q_len=3, page_size=4, softmax_scale=0.2, kv_lora_rank=32,
                                    tree_mask=tree)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()


def test_naive_loop_refuses_an_unknown_mask_or_a_tree_without_rows():
    """The float64 check refuses what the reference refuses: a misspelt mask is an error, not a silent "none"."""
    q = torch.randn(2, 1, 576, dtype=torch.bfloat16)
    kv = torch.randn(8, 576, dtype=torch.bfloat16)
    table = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    lens = torch.tensor([5], dtype=torch.int32)
    args = dict(q_len=2, page_size=1, softmax_scale=0.1)
    with pytest.raises(ValueError, match="unknown mask"):
        mla_verify_naive(q, kv, table, lens, mask="casual", **args)
    with pytest.raises(ValueError, match="tree_mask"):
        mla_verify_naive(q, kv, table, lens, mask="tree", **args)
    out, lse = mla_verify_naive(q, kv, table, lens, mask="causal", **args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
