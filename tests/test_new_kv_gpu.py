"""GPU tests (pytest -m gpu): the step's draft rows passed to the launch (k_new, kv_write_loc).

The draft tokens' cache rows are NaN before the launch, so a kernel that read them from the cache
instead of k_new would fail the comparison; after it, those rows must hold k_new bit for bit and
every other row must be unchanged (bitwise, NaN rows included).
"""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

SPECS = [
    # dimsplit (cluster of two CTAs, each stores its half of the dims), both loaders
    dict(name="gpu_newkv_ds", heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", mask="tree", schedule="dimsplit",
         row_tiles=5, block_n=32, stages=3, load_width=["bulk", 128]),
    # dimsplit with two producer warps (num_warps = row_tiles + 2)
    dict(name="gpu_newkv_ds2p", heads_per_rank=8, q_len=9, page_size=16, nsplit="auto", mask="tree",
         schedule="dimsplit", row_tiles=5, block_n=32, stages=3, num_warps=7, load_width=128),
    # dimsplit_t (score and output warps; each CTA of the first cluster stores its half of the dims)
    dict(name="gpu_newkv_dst", heads_per_rank=8, q_len=9, page_size=16, nsplit="auto", mask="tree",
         schedule="dimsplit_t", row_tiles=3, block_n=32, stages=[3, 4], num_warps=8, load_width=128),
    # rowblock, both loaders, paged
    dict(name="gpu_newkv_rb", heads_per_rank=8, q_len=9, page_size=64, nsplit="auto", mask="tree", row_tiles=1,
         block_n=32, stages=2, load_width=["bulk", 128]),
    # q_len 1 (SGLang decode: the new token is the draft row)
    dict(name="gpu_newkv_q1", heads_per_rank=8, q_len=1, page_size=1, nsplit="auto", mask="causal", row_tiles=1,
         block_n=32, stages=2, load_width="bulk"),
]


@pytest.fixture(scope="module")
def kernels(build_native):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mlagen.ops import VerifyKernel

    ks = [VerifyKernel(b.variant, b.so_path) for spec in SPECS for b in build_native(spec)]
    assert len(ks) == 8 and all(k.has_new_kv for k in ks)
    return ks


def _bits(t):
    return t.contiguous().view(torch.int16)


def _draft_slots(p, v):
    """int64 [bs * q_len] cache slots of each request's draft positions (-1 for kv_len 0 rows)."""
    from mlagen.reference import gather_slots

    rows = p.req_pool_indices.tolist() if p.req_pool_indices is not None else list(range(p.kv_lens.shape[0]))
    locs = []
    for b, L in enumerate(p.kv_lens.tolist()):
        if L <= 0:
            locs += [-1] * p.q_len
            continue
        slots = gather_slots(p.block_table, int(rows[b]), L, v.page_size)
        locs += slots[L - p.q_len:].tolist()
    return torch.tensor(locs, dtype=torch.int64, device="cuda")


def _problem(k, lens, q_len=None):
    from mlagen.cases import make_problem

    v = k.variant
    p = make_problem(v, lens, q_len=q_len, device="cuda")
    loc = _draft_slots(p, v)
    T = p.q.shape[0]
    k_new = torch.randn(T, 1, v.dim_qk, device="cuda").to(torch.bfloat16)
    real = loc >= 0
    ref_pool = p.kv_cache.clone()
    ref_pool[loc[real]] = k_new[real].reshape(-1, v.dim_qk)  # the cache as SGLang's write leaves it
    test_pool = p.kv_cache.clone()
    test_pool[loc[real]] = float("nan")  # must never be read
    return p, loc, k_new, ref_pool, test_pool


@pytest.mark.parametrize("write", [True, False], ids=["store", "read-only"])
def test_new_kv_rows_read_from_k_and_stored(kernels, write):
    from mlagen.verify import compare

    for k in kernels:
        v = k.variant
        q = v.q_len
        cases = [[q + 1000, q + 37, 0, q, q + 4096 + 5], [q + 40_000]]
        if q > 1:
            cases.append(([3 + 700, 3 + 9], 3))  # runtime q_len 3 < the variant's
        for case in cases:
            lens, ql = (case, None) if isinstance(case[0], int) else case
            p, loc, k_new, ref_pool, test_pool = _problem(k, lens, ql)
            before = test_pool.clone()
            out = torch.full((p.q.shape[0], v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((p.q.shape[0], v.heads), float("nan"), device="cuda")
            k(p.q, test_pool, p.block_table, p.kv_lens, out=out, lse=lse, k_new=k_new,
              kv_write_loc=loc if write else None, **p.kernel_args())
            torch.cuda.synchronize()
            r = compare(dataclasses.replace(p, kv_cache=ref_pool), out, lse)
            assert r.passed, f"{v.uri} lens {lens}: {r.detail}"
            real = loc >= 0
            if write:
                assert torch.equal(_bits(test_pool[loc[real]]), _bits(k_new[real].reshape(-1, v.dim_qk))), v.uri
                others = torch.ones(test_pool.shape[0], dtype=torch.bool, device="cuda")
                others[loc[real]] = False
                assert torch.equal(_bits(test_pool[others]), _bits(before[others])), f"{v.uri}: other rows changed"
            else:
                assert torch.equal(_bits(test_pool), _bits(before)), f"{v.uri}: the cache changed without kv_write_loc"


def test_new_kv_out_of_range_slots_skipped(kernels):
    """Slots outside [0, num_slots) are not written (and nothing faults); the others are."""
    k = kernels[0]
    v = k.variant
    p, loc, k_new, ref_pool, test_pool = _problem(k, [v.q_len + 300, v.q_len + 50])
    n = test_pool.shape[0]
    bad = loc.clone()
    bad[0], bad[1] = -5, n  # two rows of request 0 point outside the cache
    before = test_pool.clone()
    k(p.q, test_pool, p.block_table, p.kv_lens, k_new=k_new, kv_write_loc=bad, **p.kernel_args())
    torch.cuda.synchronize()
    assert torch.equal(_bits(test_pool[loc[2:]]), _bits(k_new[2:].reshape(-1, v.dim_qk)))
    assert torch.isnan(test_pool[loc[:2]].float()).all(), "rows whose slot was out of range must stay as they were"
    untouched = torch.ones(n, dtype=torch.bool, device="cuda")
    untouched[loc] = False
    assert torch.equal(_bits(test_pool[untouched]), _bits(before[untouched]))


def test_new_kv_graph_replay(kernels):
    """Captured once, replayed with new k_new contents and new slots: the graph reads and stores each step's rows."""
    from mlagen.verify import compare

    k = kernels[0]
    v = k.variant
    lens = [v.q_len + 2000, v.q_len + 130, v.q_len + 9000]
    p, loc, k_new, ref_pool, test_pool = _problem(k, lens)
    ws = k.alloc_workspace(len(lens), "cuda")
    out = torch.empty(p.q.shape[0], v.heads, v.dim_v, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(p.q.shape[0], v.heads, device="cuda")
    k_buf, loc_buf = k_new.clone(), loc.clone()

    def run():
        k(p.q, test_pool, p.block_table, p.kv_lens, out=out, lse=lse, workspace=ws, k_new=k_buf, kv_write_loc=loc_buf,
          **p.kernel_args())

    from mlagen.bench import capture_graph

    g = capture_graph(run)
    for _ in range(5):
        k_buf.copy_(torch.randn_like(k_buf, dtype=torch.float32).to(torch.bfloat16))
        test_pool[loc] = float("nan")
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = p.kv_cache.clone()
        ref[loc] = k_buf.reshape(-1, v.dim_qk)
        r = compare(dataclasses.replace(p, kv_cache=ref), out, lse)
        assert r.passed, r.detail
        assert torch.equal(_bits(test_pool[loc]), _bits(k_buf.reshape(-1, v.dim_qk)))


def test_new_kv_bad_input_raises_before_launch(kernels):
    k = kernels[0]
    v = k.variant
    p, loc, k_new, ref_pool, test_pool = _problem(k, [v.q_len + 100, v.q_len + 10])
    out = torch.full((p.q.shape[0], v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
    before = test_pool.clone()
    T, D = p.q.shape[0], v.dim_qk
    with pytest.raises(ValueError, match="kv_write_loc needs k_new"):
        k(p.q, test_pool, p.block_table, p.kv_lens, out=out, kv_write_loc=loc, **p.kernel_args())
    with pytest.raises(ValueError, match="k_new must have shape"):
        k(p.q, test_pool, p.block_table, p.kv_lens, out=out, k_new=k_new[:-1], kv_write_loc=loc[:-1], **p.kernel_args())
    misaligned = torch.empty(T * D + 4, dtype=torch.bfloat16, device="cuda")[4:].view(T, D)
    with pytest.raises(ValueError, match="16-byte aligned"):
        k(p.q, test_pool, p.block_table, p.kv_lens, out=out, k_new=misaligned, kv_write_loc=loc, **p.kernel_args())
    with pytest.raises(ValueError, match="kv_write_loc must be torch.int64"):
        k(p.q, test_pool, p.block_table, p.kv_lens, out=out, k_new=k_new, kv_write_loc=loc.int(), **p.kernel_args())
    with pytest.raises(ValueError, match="overlaps kv_cache"):
        k(p.q, test_pool, p.block_table, p.kv_lens, out=out, k_new=test_pool[:T], kv_write_loc=loc, **p.kernel_args())
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all(), "a rejected call must not write the output"
    assert torch.equal(_bits(test_pool), _bits(before)), "a rejected call must not write the cache"


_FP8_NEW_KV_TILES = {  # the e4m3 schedules: dimsplit (converter warps), dimsplit_t (the output warps convert)
    "dimsplit": dict(row_tiles=5, stages=3, num_warps=8),
    "dimsplit_t": dict(row_tiles=3, stages=2, num_warps=8),
}


@pytest.mark.parametrize("schedule", sorted(_FP8_NEW_KV_TILES))
def test_new_kv_fp8_cache_reads_bf16_drafts_and_stores_e4m3(schedule, build_native):
    """On an e4m3 cache (dtype fp8_e4m3) the draft tokens come from k_new in bf16 (not rounded to e4m3:
    SGLang's Triton verify reads them from k the same way) and are stored quantized as SGLang's write
    casts them (torch float8_e4m3fn: round to nearest even); the prefix is the cache's e4m3 values."""
    from mlagen.cases import make_fp8_problem
    from mlagen.ops import VerifyKernel
    from mlagen.reference import dequantize_e4m3, mla_verify_reference

    spec = dict(name=f"gpu_newkv_fp8_{schedule}", heads_per_rank=8, q_len=9, page_size=16, nsplit="auto", mask="tree",
                schedule=schedule, block_n=32, load_width=128, dtype="fp8_e4m3", **_FP8_NEW_KV_TILES[schedule])
    (k,) = [VerifyKernel(b.variant, b.so_path) for b in build_native(spec)]
    v = k.variant
    for lens in ([v.q_len + 1000, v.q_len + 37, 0, v.q_len], [v.q_len + 20_000]):
        p = make_fp8_problem(v, lens, as_bytes=True, device="cuda")
        loc = _draft_slots(p, v)
        real = loc >= 0
        T = p.q.shape[0]
        k_new = torch.randn(T, 1, v.dim_qk, device="cuda").to(torch.bfloat16)
        cache = p.kv_cache.clone()
        cache[loc[real]] = 0x7F  # NaN bytes: must never be read
        before = cache.clone()
        out = torch.full((T, v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((T, v.heads), float("nan"), device="cuda")
        k(p.q, cache, p.block_table, p.kv_lens, out=out, lse=lse, k_new=k_new, kv_write_loc=loc, **p.kernel_args())
        torch.cuda.synchronize()
        want_bytes = k_new[real].reshape(-1, v.dim_qk).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(cache[loc[real]], want_bytes), "draft rows not stored as torch's e4m3 cast"
        others = torch.ones(cache.shape[0], dtype=torch.bool, device="cuda")
        others[loc[real]] = False
        assert torch.equal(cache[others], before[others])
        ref_cache = dequantize_e4m3(p.kv_cache).to(torch.bfloat16)  # the prefix's e4m3 values
        ref_cache[loc[real]] = k_new[real].reshape(-1, v.dim_qk)  # drafts in bf16
        ref_out, ref_lse = mla_verify_reference(p.q, ref_cache, p.block_table, p.kv_lens, q_len=p.q_len,
                                                page_size=v.page_size, softmax_scale=p.softmax_scale, mask=v.mask,
                                                tree_mask=p.tree_mask)
        assert torch.isfinite(out.float()).all()
        assert (out.float() - ref_out).abs().max().item() < 2e-2, lens
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin) and (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-2
