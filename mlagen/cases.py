"""Input generation for verify, tests and bench: fresh random problems plus the edge cases of
issue #2 (empty splits, ragged last pages with NaN stale slots, mixed lengths, padded rows,
pools over 4 GiB, runtime q_len below the variant's maximum, remapped req_pool_indices).

fp8 (e4m3) KV problems (issue #12) come from :func:`make_fp8_problem` / :func:`fp8_cases`;
:func:`verify_cases` yields :func:`fp8_cases` for dtype fp8_e4m3 variants.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mlagen.reference import E4M3_NAN_BYTES, split_kv_scale
from mlagen.spec import Variant


@dataclasses.dataclass
class Problem:
    """One verify batch. Shapes: q [bs*q_len, H, D] bf16; kv_cache [num_slots, D] or [num_slots, 1, D]
    (SGLang's MLA pool shape), bf16, or for fp8 problems float8_e4m3fn / uint8 (its bytes); block_table int32
    [rows, max_pages]; kv_lens int32 [bs]; tree_mask int64 [bs, q_len] or None.

    ``req_pool_indices``: None (request b reads block_table row b) or int64 [bs], the row of each request.
    ``kv_scale``: None (bf16), or the fp8 descales, a number (k_scale = v_scale) or a (k_scale, v_scale) pair as
    :func:`mlagen.reference.split_kv_scale` reads them.
    """

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
    kv_scale: float | tuple[float, float] | None = None  # fp8 problems: descales (k_scale, v_scale)

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.shape[0])

    def kernel_args(self) -> dict:
        return dict(q_len=self.q_len, softmax_scale=self.softmax_scale, tree_mask=self.tree_mask,
                    req_pool_indices=self.req_pool_indices)

    def reference_args(self) -> dict:
        args = dict(q_len=self.q_len, page_size=self.page_size, softmax_scale=self.softmax_scale, mask=self.mask,
                    tree_mask=self.tree_mask, req_pool_indices=self.req_pool_indices)
        if self.kv_scale is not None:
            args["kv_scale"] = self.kv_scale
        return args


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


def ramp_factors(length: int, kv_ramp: float) -> torch.Tensor:
    """fp32 [length]: the scale 1 + kv_ramp * pos / length of a request's KV row at each position pos (kv_ramp of
    :func:`make_problem` and :func:`make_fp8_problem`)."""
    return 1.0 + kv_ramp * torch.arange(length, dtype=torch.float32) / length


def make_problem(v: Variant, kv_lens: list[int], *, q_len: int | None = None, device="cuda", seed: int | None = None,
                 name: str = "random", pool_slots: int | None = None, min_slot: int = 0, poison_pool: bool = True,
                 kv3d: bool = False, remap_rows: bool = False, kv_ramp: float = 0.0) -> Problem:
    """A random problem for variant ``v``: bf16 q and KV rows N(0, 1), one request per entry of ``kv_lens``
    (draft tokens included; 0 = a padded row, which still gets a page), a random tree for tree variants.

    Every pool row that no request references, and every stale slot of a ragged last page, is
    NaN when ``poison_pool`` (they must never leak into the output). Pages are a random
    permutation of the pool's pages at or above ``min_slot`` (used to place data past 4 GiB).
    softmax_scale is 1/sqrt(192) (DeepSeek-V3's query-key head dim before absorption: qk_nope_head_dim 128 +
    qk_rope_head_dim 64) times a random factor in [1, 1.1), like a yarn mscale.

    Args:
        q_len: draft tokens per request; 0 or None = ``v.q_len``.
        device: where the tensors go.
        seed: seeds the layout (pages, rows, tree) and, through it, the data; None = a random seed.
        name: the problem's name.
        pool_slots: the pool holds at least this many slots (rounded up to whole pages); default: the pages
            the requests use + 3 (+ those below ``min_slot``).
        min_slot: first cache row (slot) that a page may start at; the pool grows to hold the pages above it.
        poison_pool: NaN (else 0) in the rows no request reads.
        kv3d: kv_cache as a [num_slots, 1, D] view (SGLang's MLA pool shape) instead of [num_slots, D].
        remap_rows: block_table gets bs + 2 rows, each request a random one of them, and ``req_pool_indices``
            (int64 [bs]) says which.
        kv_ramp: the KV row at position pos of a request of L tokens is scaled by 1 + kv_ramp * pos / L, so the
            scores, and each row's running max, grow along the context (0: i.i.d. rows).
    Returns:
        A :class:`Problem`; block_table int32 [rows, max pages + 1], entries no request uses -1.
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
        rows = torch.randn(L, D, generator=dgen, device=device)
        if kv_ramp:
            rows *= ramp_factors(L, kv_ramp).to(device).unsqueeze(1)
        kv[slots.to(device)] = rows.to(torch.bfloat16)
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
    if v.dtype == "fp8_e4m3":  # an e4m3 cache: its own case set (descales, e4m3 extremes, NaN-byte slots)
        yield from fp8_cases(v, device, quick=quick, big_pool=big_pool)
        return
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
    # scores up to 5x larger at the end of the context: the running max keeps growing, by more than any rescale slack
    yield make_problem(v, [Q + 6000, Q + 700], device=device, kv_ramp=4.0, name="rising scores along the context")
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


# ------------------------------------------------------------------ fp8 (e4m3) KV cache, issue #12
E4M3_MAX_BYTES = (0x7E, 0xFE)  # +448, -448


def quantize_e4m3(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """uint8 e4m3 bytes of ``x / scale`` the way SGLang 0.5.23 fills an fp8 MLA pool: k (bf16) divided
    by ``layer.k_scale`` in bf16 (triton_backend.py:1727, :2329), then ``.to(torch.float8_e4m3fn)``
    (memory_pool.py:4971): round to nearest even. Finite values are clamped to +-448 first, so the
    bytes do not depend on whether the installed torch saturates or returns NaN on overflow; NaN stays NaN.
    """
    q = x.to(torch.bfloat16)
    if float(scale) != 1.0:
        q = q / torch.tensor(float(scale), dtype=torch.float32, device=q.device)
    q = q.float().clamp(-448.0, 448.0)
    return q.to(torch.float8_e4m3fn).view(torch.uint8)


def referenced_slots(block_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int,
                     req_pool_indices: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [n] sorted cache slots of every visible position (pos < kv_len) of every request."""
    table = block_table.to("cpu", torch.int64)
    rows = req_pool_indices.tolist() if req_pool_indices is not None else list(range(int(kv_lens.shape[0])))
    out = []
    for b, L in enumerate(kv_lens.tolist()):
        if L > 0:
            pos = torch.arange(int(L))
            out.append(table[int(rows[b]), pos // page_size] * page_size + pos % page_size)
    return torch.cat(out).unique() if out else torch.zeros(0, dtype=torch.int64)


def make_fp8_problem(v: Variant, kv_lens: list[int], *, kv_scale: float | tuple[float, float] = 1.0,
                     special: bool = False, q_len: int | None = None, device="cuda", seed: int | None = None,
                     name: str = "fp8 random", remap_rows: bool = False, kv3d: bool = False, as_bytes: bool = False,
                     pool_slots: int | None = None, min_slot: int = 0, kv_ramp: float = 0.0) -> Problem:
    """A random problem for ``v``'s shape with an fp8 e4m3 KV cache (:func:`fp8_cases`, so :func:`verify_cases` of
    dtype fp8_e4m3 variants).

    The layout (pages, block table, q, tree) is :func:`make_problem`'s. Visible KV rows are fresh
    N(0, 1) values quantized by :func:`quantize_e4m3` with k_scale (SGLang stores k / k_scale), so
    they dequantize to about the bf16 magnitudes; ``kv_scale`` is a number (k = v scale) or a
    (k_scale, v_scale) pair and is carried in ``Problem.kv_scale``. Every slot no request reads
    (unreferenced pool rows, stale slots of ragged last pages) holds NaN bytes, 0x7f or 0xff at
    random: a kernel that reads past kv_len or an unused page slot poisons its output.

    special: also write, into visible rows of every non-empty request, e4m3's extremes: one row with
    +-448 (bytes 0x7e / 0xfe) in 8 random dims, one row with 64 random dims subnormal (bytes 0x01-0x07
    with random sign, 2^-9 .. 7 x 2^-9), and 16 dims of one row +-0 (0x00 / 0x80).
    kv_ramp: as :func:`make_problem`'s (each visible row scaled by 1 + kv_ramp * pos / L before quantizing).
    Other arguments as :func:`make_problem`.
    Returns:
        Problem whose kv_cache is float8_e4m3fn (uint8 with ``as_bytes``) [num_slots, 576], or
        [num_slots, 1, 576] with ``kv3d`` (SGLang's MLA pool shape).
    Raises:
        ValueError: a kv_scale that is not finite and positive, or a sequence that is not a pair
            (:func:`mlagen.reference.split_kv_scale`).
    """
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, (1,))))
    layout_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    base = make_problem(v, kv_lens, q_len=q_len, device="cpu", seed=layout_seed, name=name, pool_slots=pool_slots,
                        min_slot=min_slot, poison_pool=False, remap_rows=remap_rows)
    k_scale, _ = split_kv_scale(kv_scale)
    num_slots, D = base.kv_cache.shape
    used = referenced_slots(base.block_table, base.kv_lens, base.page_size, base.req_pool_indices)
    kv = torch.tensor(E4M3_NAN_BYTES, dtype=torch.uint8)[torch.randint(0, 2, (num_slots, D), generator=gen)]
    rows_of = base.req_pool_indices.tolist() if base.req_pool_indices is not None else list(range(len(kv_lens)))
    table, P = base.block_table.to(torch.int64), base.page_size

    def slot(b, pos):  # pool slot(s) of request b's position(s) pos (an int or an int64 tensor)
        return table[rows_of[b], pos // P] * P + pos % P

    vals = torch.randn(int(used.numel()), D, generator=gen)
    if kv_ramp:
        factor = torch.ones(num_slots)
        for b, L in enumerate(kv_lens):
            if L > 0:
                factor[slot(b, torch.arange(L))] = ramp_factors(L, kv_ramp)
        vals *= factor[used].unsqueeze(1)
    kv[used] = quantize_e4m3(vals, k_scale)
    if special:

        for b, L in enumerate(kv_lens):
            if L <= 0:
                continue
            r_max, r_sub, r_zero = (int(slot(b, int(torch.randint(0, L, (1,), generator=gen)))) for _ in range(3))
            dims = torch.randperm(D, generator=gen)
            extremes = torch.tensor(E4M3_MAX_BYTES, dtype=torch.uint8)
            kv[r_max, dims[:8]] = extremes[torch.randint(0, 2, (8,), generator=gen)]
            sub = torch.randint(1, 8, (64,), generator=gen) | (torch.randint(0, 2, (64,), generator=gen) << 7)
            kv[r_sub, dims[8:72]] = sub.to(torch.uint8)
            kv[r_zero, dims[72:88]] = (torch.randint(0, 2, (16,), generator=gen) << 7).to(torch.uint8)
    cache = kv if as_bytes else kv.view(torch.float8_e4m3fn)
    if kv3d:
        cache = cache.view(num_slots, 1, D)

    def dev(t):
        return t.to(device) if t is not None else None

    return dataclasses.replace(base, q=dev(base.q), kv_cache=cache.to(device), block_table=dev(base.block_table),
                               kv_lens=dev(base.kv_lens), tree_mask=dev(base.tree_mask),
                               req_pool_indices=dev(base.req_pool_indices), kv_scale=kv_scale)


def fp8_cases(v: Variant, device="cuda", *, quick: bool = False, big_pool: bool = True):
    """Yield the fp8 KV case set for ``v``'s shape (fresh random data each call; :func:`verify_cases` of
    dtype fp8_e4m3 variants): descales 1, 0.37, 3.1 and a (0.37, 3.1) pair, e4m3's extremes (+-448,
    subnormals, +-0), NaN-byte stale slots of ragged pages, padded rows, remapped rows in a
    [slots, 1, 576] uint8 pool, runtime q_len below the maximum, kv_len == q_len, scores rising along the context
    (the running max keeps growing); ``quick`` skips the
    128k case and the pool past 4 GiB (``big_pool`` False skips only the latter)."""
    Q, P = v.q_len, v.page_size
    yield make_fp8_problem(v, [Q + 1000, Q + 37, Q + 4096 + 5], device=device, name="fp8 random mixed lengths, scale 1")
    yield make_fp8_problem(v, [Q + 700, Q + 9], kv_scale=0.37, device=device, name="fp8 k_scale = v_scale = 0.37")
    yield make_fp8_problem(v, [Q + 700, Q + 9], kv_scale=3.1, device=device, name="fp8 k_scale = v_scale = 3.1")
    yield make_fp8_problem(v, [Q + 300, Q + 20], kv_scale=(0.37, 3.1), device=device,
                           name="fp8 k_scale 0.37, v_scale 3.1 (applied to scores / output)")
    yield make_fp8_problem(v, [Q + 500, Q + 3, max(1, Q)], kv_scale=0.37, special=True, device=device,
                           name="fp8 +-448, subnormals, +-0")
    yield make_fp8_problem(v, [P * 7 + (P // 2 or 1) + Q, P * 3 + 1 + Q], special=True, device=device,
                           name="fp8 ragged last page, NaN-byte stale slots")
    yield make_fp8_problem(v, [0, Q + 500, 0], device=device, name="fp8 padded rows kv_len 0")
    yield make_fp8_problem(v, [Q + 300, Q + 20], kv_scale=3.1, remap_rows=True, kv3d=True, as_bytes=True, device=device,
                           name="fp8 req_pool_indices remap, uint8 [slots,1,576] pool")
    if Q > 1:
        ql = max(1, Q // 2)
        yield make_fp8_problem(v, [ql + 700, ql + 9], q_len=ql, device=device, name=f"fp8 runtime q_len {ql} < {Q}")
    yield make_fp8_problem(v, [max(1, Q)], device=device, name="fp8 kv_len == q_len (no prefix)")
    yield make_fp8_problem(v, [Q + 6000, Q + 700], device=device, kv_ramp=4.0, name="fp8 rising scores along the context")
    if not quick:
        yield make_fp8_problem(v, [Q + 131072 + 77, Q + 5, Q + 2000], kv_scale=0.37, device=device,
                               name="fp8 mixed 128k / tiny / 2k")
        if big_pool:
            min_slot = (4 << 30) // v.dim_qk + 1024  # first referenced row past 4 GiB of e4m3 rows
            yield make_fp8_problem(v, [Q + 3000, Q + 100], device=device, min_slot=min_slot,
                                   name="fp8 pool > 4 GiB (rows past 4 GiB)")
