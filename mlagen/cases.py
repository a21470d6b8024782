"""Input generation for verify, tests and bench: fresh random problems plus the edge cases of
issue #2 (empty splits, ragged last pages with NaN stale slots, mixed lengths, padded rows,
pools over 4 GiB, runtime q_len below the variant's maximum, remapped req_pool_indices).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mlagen.spec import Variant


@dataclasses.dataclass
class Problem:
    """One verify batch. Shapes: q [bs*q_len, H, D] bf16; kv_cache [num_slots, D] bf16;
    block_table int32 [rows, max_pages]; kv_lens int32 [bs]; tree_mask int64 [bs, q_len] or None."""

    name: str
    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    kv_lens: torch.Tensor
    q_len: int
    page_size: int
    softmax_scale: float
    mask: str
    tree_mask: torch.Tensor | None
    req_pool_indices: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.shape[0])

    def kernel_args(self) -> dict:
        return dict(q_len=self.q_len, softmax_scale=self.softmax_scale, tree_mask=self.tree_mask,
                    req_pool_indices=self.req_pool_indices)

    def reference_args(self) -> dict:
        return dict(q_len=self.q_len, page_size=self.page_size, softmax_scale=self.softmax_scale, mask=self.mask,
                    tree_mask=self.tree_mask, req_pool_indices=self.req_pool_indices)


def random_tree(q_len: int, gen: torch.Generator) -> list[int]:
    """Bitmask rows of a random draft tree: node i's parent is a random earlier node; each row
    holds the node's ancestors and itself (SGLang/EAGLE tree verification)."""
    rows = []
    for i in range(q_len):
        if i == 0:
            rows.append(1)
        else:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            rows.append(rows[parent] | (1 << i))
    return rows


def _to_i64(bits: int) -> int:
    return bits - (1 << 64) if bits >= (1 << 63) else bits


def make_problem(v: Variant, kv_lens: list[int], *, q_len: int | None = None, device="cuda", seed: int | None = None,
                 name: str = "random", pool_slots: int | None = None, min_slot: int = 0, poison_pool: bool = True,
                 kv3d: bool = False, remap_rows: bool = False) -> Problem:
    """A random problem for variant ``v``.

    Every pool row that no request references, and every stale slot of a ragged last page, is
    NaN when ``poison_pool`` (they must never leak into the output). Pages are a random
    permutation of the pool's pages at or above ``min_slot`` (used to place data past 4 GiB).
    """
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, (1,))))
    q_len = q_len or v.q_len
    bs, P, D = len(kv_lens), v.page_size, v.dim_qk
    pages_per_req = [max(1, math.ceil(L / P)) for L in kv_lens]
    total_pages = sum(pages_per_req)
    first_page = math.ceil(min_slot / P)
    n_pages = max(first_page + total_pages + 3, math.ceil((pool_slots or 0) / P))
    perm = torch.randperm(n_pages - first_page, generator=gen)[:total_pages] + first_page
    max_pages = max(pages_per_req)
    rows = bs + 2 if remap_rows else bs
    table = torch.full((rows, max_pages + 1), -1, dtype=torch.int32)  # -1: an id that must never be read
    row_of = list(range(bs))
    if remap_rows:
        row_of = torch.randperm(rows, generator=gen)[:bs].tolist()
    off = 0
    for b, n in enumerate(pages_per_req):
        table[row_of[b], :n] = perm[off:off + n].to(torch.int32)
        off += n
    num_slots = n_pages * P
    fill = float("nan") if poison_pool else 0.0
    dgen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    kv = torch.full((num_slots, D), fill, dtype=torch.bfloat16, device=device)
    for b, L in enumerate(kv_lens):
        if L <= 0:
            continue
        pos = torch.arange(L)
        slots = table[row_of[b], pos // P].long() * P + pos % P
        kv[slots.to(device)] = torch.randn(L, D, generator=dgen, device=device).to(torch.bfloat16)
    q = torch.randn(bs * q_len, v.heads, D, generator=dgen, device=device).to(torch.bfloat16)
    tree = None
    if v.mask == "tree":
        tree = torch.tensor([[_to_i64(r) for r in random_tree(q_len, gen)] for _ in range(bs)], dtype=torch.int64,
                            device=device)
    kv_cache = kv.view(num_slots, 1, D) if kv3d else kv
    req = torch.tensor(row_of, dtype=torch.int64, device=device) if remap_rows else None
    return Problem(name=name, q=q, kv_cache=kv_cache, block_table=table.to(device),
                   kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device), q_len=q_len, page_size=P,
                   softmax_scale=1.0 / math.sqrt(192) * (1.0 + 0.1 * float(torch.rand(1, generator=gen))),
                   mask=v.mask, tree_mask=tree, req_pool_indices=req)


def verify_cases(v: Variant, device="cuda", *, quick: bool = False, big_pool: bool = True):
    """Yield the verify case set for ``v`` (fresh random data each call).

    quick: skip the 128k-token and >4 GiB cases (unit tests); big_pool: include the >4 GiB pool.
    """
    Q, P, bn = v.q_len, v.page_size, v.block_n
    ns = 64 if v.nsplit == "auto" else int(v.nsplit)
    yield make_problem(v, [Q + 1000, Q + 37, Q + 4096 + 5], device=device, name="random mixed lengths")
    yield make_problem(v, [Q + 3], device=device, name="short: most splits empty")
    yield make_problem(v, [max(1, Q)], device=device, name="kv_len == q_len (no prefix)")
    yield make_problem(v, [1], q_len=1, device=device, name="kv_len 1, q_len 1")
    yield make_problem(v, [ns * bn - 3 + Q], device=device, name="kv_len just under nsplit x tile")
    yield make_problem(v, [P * 7 + (P // 2 or 1) + Q, P * 3 + 1 + Q], device=device,
                       name="ragged last page, NaN stale slots")
    yield make_problem(v, [0, Q + 500, 0], device=device, name="padded rows kv_len 0")
    yield make_problem(v, [Q + 300, Q + 20], device=device, remap_rows=True, kv3d=True,
                       name="req_pool_indices remap, [slots,1,576] cache")
    for ql in sorted({1, max(1, Q // 2), Q}):
        if ql < Q:
            yield make_problem(v, [ql + 700, ql + 9], q_len=ql, device=device, name=f"runtime q_len {ql} < {Q}")
    if not quick:
        yield make_problem(v, [Q + 131072 + 77, Q + 5, Q + 2000], device=device,
                           name="mixed 128k / tiny / 2k")
        if big_pool:
            min_slot = (4 << 30) // (v.dim_qk * 2) + 1024  # first referenced row past 4 GiB
            yield make_problem(v, [Q + 3000, Q + 100], device=device, min_slot=min_slot,
                               name="pool > 4 GiB (rows past 4 GiB)")
