"""GPU test (pytest -m gpu): the verify kernel reading SGLang's batch state itself (``direct_plan`` /
``direct_batch`` -> module.run_direct, include/mlagen/mla_verify_batch.cuh) against the same kernel on the
metadata the fused fill writes (``fill_metadata`` -> module.run), bit for bit, on random batches:
page_size 1 (dimsplit_t) and 64 (rowblock), seq_lens / req_pool_indices int32 / int64, a QLEN_ONLY
custom mask or shared causal rows, q_len below the variant's maximum, DP-padded rows, this step's draft rows
from k_new. Outputs start as NaN; padded rows must come back 0, every other value finite and equal.

    python3 -m pytest -q -m gpu tests/test_direct_gpu.py
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

POOL_ROWS = 12
SPECS = {  # the tiles the SGLang backend serves with: dimsplit_t at page size 1, rowblock at 64
    "dimsplit_t_ps1": dict(heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", load_width=128, block_n=32,
                           num_warps=8, row_tiles=3, stages=4, schedule="dimsplit_t", mask="tree"),
    "rowblock_ps64": dict(heads_per_rank=8, q_len=9, page_size=64, nsplit="auto", load_width=128, block_n=16,
                          num_warps=8, row_tiles=2, stages=3, mask="tree"),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def kernel(request, gpu_arch):
    from mlagen.build import build_variants
    from mlagen.ops import load_so

    built = build_variants(dict(SPECS[request.param], kernel="mla_verify", name=f"direct-{request.param}",
                                arch=[gpu_arch]))
    k = load_so(built[0].uri, str(built[0].so_path))
    assert k.has_direct and k.has_fill_metadata, f"{built[0].uri} lacks run_direct / fill_metadata"
    return k


def _pool(gen, ps, width, slots_pages):
    """req_to_token [POOL_ROWS, width] int32 of token slots: each row a random sequence of whole pages."""
    pages_per_row = width // ps
    page_ids = torch.randint(0, slots_pages, (POOL_ROWS, pages_per_row), generator=gen)
    r2t = (page_ids[:, :, None] * ps + torch.arange(ps)[None, None, :]).reshape(POOL_ROWS, width)
    return r2t.to(torch.int32)


def _case(k, gen, *, q_len, bs, npad, idx_dtypes, mode, with_new_kv):
    v = k.variant
    ps, H = v.page_size, v.heads
    dev = "cuda"
    width = 64 * 40  # 2,560 token columns: up to 20 32-token tiles per split at bs 4 over ~60 splits
    slots_pages = 4 * width // ps
    r2t = _pool(gen, ps, width, slots_pages).to(dev)
    num_slots = slots_pages * ps
    kv = (torch.randn(num_slots, v.dim_qk, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    real = bs - npad
    lens = torch.randint(0, width - q_len + 1, (bs,), generator=gen)
    lens[0] = width - q_len  # one request at the table's full width
    lens[real:] = 1  # SGLang's padded rows
    rpi = torch.randperm(POOL_ROWS, generator=gen)[:bs]
    rpi[real:] = 0
    q = torch.randn(bs * q_len, H, v.dim_qk, generator=gen).to(torch.bfloat16).to(dev)
    custom = None
    if mode == "qlen_only":
        cells = torch.rand(real * q_len * q_len, generator=gen) < 0.5
        custom = cells.to(dev) if int(torch.randint(0, 2, (1,), generator=gen)) else cells.to(torch.uint8).to(dev)
    new_kv = {}
    if with_new_kv:
        k_new = torch.randn(bs * q_len, v.dim_qk, generator=gen).to(torch.bfloat16).to(dev)
        loc = torch.full((bs * q_len,), -1, dtype=torch.int64)  # -1: not stored (these slots are read elsewhere)
        new_kv = dict(k_new=k_new, kv_write_loc=loc.to(dev))
    return dict(r2t=r2t, kv=kv, seq_lens=lens.to(idx_dtypes[0]).to(dev), rpi=rpi.to(idx_dtypes[1]).to(dev), q=q,
                custom=custom, new_kv=new_kv, real=real)


def _filled(k, c, *, q_len, bs, npad, mode):
    """The fused fill's buffers for this batch (the CUDA-graph path's inputs)."""
    v = k.variant
    dev = "cuda"
    npages = -(-c["r2t"].shape[1] // v.page_size)
    kv_lens = torch.empty(bs, dtype=torch.int32, device=dev)
    table = torch.empty(bs, npages, dtype=torch.int32, device=dev)
    tree = torch.empty(bs, q_len, dtype=torch.int64, device=dev)
    k.fill_metadata(kv_lens, table, c["seq_lens"], c["rpi"], c["r2t"], extra=q_len, num_padding=npad, npages=npages,
                    page_size=v.page_size, q_len=q_len, tree_mask=tree, tree_mode=mode, custom_mask=c["custom"])
    return kv_lens, table, tree


@pytest.mark.parametrize("mode", ["qlen_only", "causal"])
def test_direct_matches_filled_metadata(kernel, mode):
    from mlagen.sglang_plugin import metadata as md

    k = kernel
    v = k.variant
    seed = 17 + v.page_size + (0 if mode == "causal" else 1000)
    n = 0
    for q_len in (v.q_len, 5):
        for bs, npad in ((1, 0), (4, 0), (5, 2)):
            for idx_dtypes in ((torch.int64, torch.int64), (torch.int32, torch.int32)):
                with_new_kv = n % 2 == 1
                gen = torch.Generator().manual_seed(seed)
                seed += 7919
                c = _case(k, gen, q_len=q_len, bs=bs, npad=npad, idx_dtypes=idx_dtypes, mode=mode,
                          with_new_kv=with_new_kv)
                scale = v.dim_qk ** -0.5
                kv_lens, table, tree = _filled(k, c, q_len=q_len, bs=bs, npad=npad, mode=mode)
                out_a = torch.full((bs * q_len, v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
                k(c["q"], c["kv"], table, kv_lens, q_len=q_len, softmax_scale=scale, tree_mask=tree, out=out_a,
                  **c["new_kv"])
                ws = k.alloc_workspace(bs, torch.device("cuda", torch.cuda.current_device()))
                plan = k.direct_plan(c["r2t"], q_len=q_len, batch_size=bs, workspace=ws)
                rows = md.causal_bits(q_len, "cuda") if mode == "causal" else None
                batch = k.direct_batch(plan, c["seq_lens"], c["rpi"], extra=q_len, num_padding=npad,
                                       qlen_mask=c["custom"], tree_rows=rows)
                out_b = torch.full_like(out_a, float("nan"))
                nk = ()
                if with_new_kv:
                    nk = k.new_kv_args(batch, c["new_kv"]["k_new"], c["new_kv"]["kv_write_loc"], c["kv"])
                k.launch(batch, c["q"], k.check_kv_cache(c["kv"]), out_b, scale, new_kv=nk)
                torch.cuda.synchronize()
                what = f"{v.uri} mode={mode} q_len={q_len} bs={bs} npad={npad} {idx_dtypes} k_new={with_new_kv}"
                real_rows = c["real"] * q_len
                assert torch.isfinite(out_a[:real_rows].float()).all(), what
                assert (out_a[real_rows:] == 0).all() and (out_b[real_rows:] == 0).all(), what
                assert torch.equal(out_a, out_b), (f"{what}: max |diff| "
                                                   f"{(out_a.float() - out_b.float()).abs().nan_to_num(99).max()}")
                n += 1
    assert n == 12


def test_direct_errors(kernel):
    """Bad direct arguments: a one-line ValueError, nothing launched."""
    k = kernel
    q_len = k.variant.q_len
    dev = "cuda"
    r2t = torch.zeros(3, 128, dtype=torch.int32, device=dev)
    plan = k.direct_plan(r2t, q_len=q_len, batch_size=3)
    lens = torch.full((3,), 5, dtype=torch.int64, device=dev)
    rpi = torch.zeros(3, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="QLEN_ONLY verify mask has 161 elements, 162 needed for 2 requests"):
        k.direct_batch(plan, lens, rpi, extra=q_len, num_padding=1,
                       qlen_mask=torch.ones(161, dtype=torch.bool, device=dev))
    with pytest.raises(ValueError, match="pass exactly one of qlen_mask / tree_rows"):
        k.direct_batch(plan, lens, rpi, extra=q_len)
    with pytest.raises(ValueError, match="seq_lens must be a 1-D int32 / int64 tensor"):
        k.direct_batch(plan, lens.float(), rpi, extra=q_len, tree_rows=torch.zeros(q_len, dtype=torch.int64,
                                                                                   device=dev))
    with pytest.raises(ValueError, match="req_pool_indices must be contiguous with >= 3 elements"):
        k.direct_batch(plan, lens, rpi[:2], extra=q_len, tree_rows=torch.zeros(q_len, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="num_padding must be an int in"):
        k.direct_batch(plan, lens, rpi, extra=q_len, num_padding=4,
                       tree_rows=torch.zeros(q_len, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="req_to_token must be torch.int32"):
        k.direct_plan(r2t.long(), q_len=q_len, batch_size=3)
    with pytest.raises(ValueError, match="batch_size must be an int in"):
        k.direct_plan(r2t, q_len=q_len, batch_size=70000)
