"""GPU tests (pytest -m gpu): built variants against the reference, CUDA-graph replay, bad input."""

import pytest
import torch

pytestmark = pytest.mark.gpu

SPECS = {
    # the shipped K2 TP8 shape, both page sizes and load widths
    "k2": dict(name="gpu_k2", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit=["auto", 16],
               load_width=["bulk", 64, 128], mask="tree"),
    "k2_bn32": dict(name="gpu_k2_bn32", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit="auto", block_n=32,
                    stages=2, row_tiles=[1, 2], load_width=["bulk", 128], mask="tree"),
    # scores of tile t+1 overlapped with P V of tile t (second partial-score buffer)
    "k2_ov": dict(name="gpu_k2_ov", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit="auto", block_n=[16, 32],
                  stages=[2, 3], row_tiles=1, load_width="bulk", overlap=1, mask="tree"),
    # 4-warp CTAs (8 tokens per warp for the bulk loader at bn32) and a deep bulk ring
    "k2_w4": dict(name="gpu_k2_w4", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit="auto", block_n=[16, 32],
                  num_warps=4, stages=[2, 4], row_tiles=1, load_width="bulk", mask="tree"),
    # 16-warp CTAs (2 bulk rows per warp at bn32; 16 k-groups of partial scores at bn16)
    "k2_w16": dict(name="gpu_k2_w16", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit="auto", block_n=[16, 32],
                   num_warps=16, stages=2, row_tiles=[1, 2], load_width="bulk", mask="tree"),
    # dimsplit: a two-CTA cluster splits the 576 dims, KV read once per split (H8 q9: one cluster of 5 row
    # tiles; bulk and cp.async loaders; 2 and 4 stages; page sizes 1 / 64; fixed and auto NSPLIT)
    "k2_ds": dict(name="gpu_k2_ds", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit=["auto", 7],
                  schedule="dimsplit", block_n=32, stages=[2, 3], row_tiles=5, load_width=["bulk", 128], mask="tree"),
    # e4m3 KV cache (dtype fp8_e4m3): dimsplit with a producer and two converter warps (num_warps = row_tiles + 3)
    "k2_fp8": dict(name="gpu_k2_fp8", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit=["auto", 7],
                   schedule="dimsplit", block_n=32, stages=[2, 3], row_tiles=5, num_warps=8, load_width=128,
                   mask="tree", dtype="fp8_e4m3"),
    "fp8_rows": [dict(name="gpu_fp8_h16", heads_per_rank=16, q_len=9, page_size=16, nsplit="auto", mask="tree",
                      schedule="dimsplit", row_tiles=5, block_n=32, stages=3, num_warps=8, load_width=128,
                      dtype="fp8_e4m3"),
                 dict(name="gpu_fp8_q1", heads_per_rank=8, q_len=1, page_size=1, nsplit="auto", mask="causal",
                      schedule="dimsplit", row_tiles=1, block_n=32, stages=3, num_warps=4, load_width=128,
                      dtype="fp8_e4m3")],
    # e4m3 KV cache on dimsplit_t: the producer copies e4m3 rows into a 2-stage ring, the output warps dequantize
    # each tile into a 3-stage bf16 ring; page sizes 1 / 64, fixed and auto NSPLIT
    "k2_dst_fp8": dict(name="gpu_k2_dst_fp8", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit=["auto", 7],
                       schedule="dimsplit_t", block_n=32, stages=2, row_tiles=3, num_warps=8, load_width=128,
                       mask="tree", dtype="fp8_e4m3"),
    # dimsplit_t fp8 at other row counts: H16 (2 clusters), H1 q5 causal (one score warp), H64 q2 no mask, q_len 1
    "dst_fp8_rows": [dict(name="gpu_dst_fp8_h16", heads_per_rank=16, q_len=9, page_size=16, nsplit="auto", mask="tree",
                          schedule="dimsplit_t", row_tiles=3, num_warps=8, block_n=32, stages=2, load_width=128,
                          dtype="fp8_e4m3"),
                     dict(name="gpu_dst_fp8_h1", heads_per_rank=1, q_len=5, page_size=16, nsplit=8, mask="causal",
                          schedule="dimsplit_t", row_tiles=1, num_warps=6, block_n=32, stages=2, load_width=128,
                          dtype="fp8_e4m3"),
                     dict(name="gpu_dst_fp8_h64", heads_per_rank=64, q_len=2, page_size=1, nsplit="auto", mask="none",
                          schedule="dimsplit_t", row_tiles=3, num_warps=8, block_n=32, stages=2, load_width=128,
                          dtype="fp8_e4m3"),
                     dict(name="gpu_dst_fp8_q1", heads_per_rank=8, q_len=1, page_size=1, nsplit="auto", mask="causal",
                          schedule="dimsplit_t", row_tiles=1, num_warps=6, block_n=32, stages=2, load_width=128,
                          dtype="fp8_e4m3")],
    # dimsplit with two producer warps (num_warps = row_tiles + 2, cp.async loader): each loads half of a stage
    "k2_ds2p": [dict(name="gpu_k2_ds2p", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit=["auto", 7],
                     schedule="dimsplit", block_n=32, stages=[2, 3], row_tiles=5, num_warps=7, load_width=128,
                     mask="tree"),
                dict(name="gpu_ds2p_h16", heads_per_rank=16, q_len=9, page_size=16, nsplit="auto", mask="tree",
                     schedule="dimsplit", row_tiles=5, block_n=32, stages=3, num_warps=7, load_width=128)],
    # dimsplit at other row counts: H16 (2 clusters of 5 row tiles, the second with 4 live), H1 q5 causal
    # (one row tile, 5 of 16 rows live), H64 q2 no mask (8 row tiles -> 2 clusters of 4), q_len 1 decode
    "ds_rows": [dict(name="gpu_ds_h16", heads_per_rank=16, q_len=9, page_size=64, nsplit="auto", mask="tree",
                     schedule="dimsplit", row_tiles=5, block_n=32, stages=3, load_width="bulk"),
                dict(name="gpu_ds_h1", heads_per_rank=1, q_len=5, page_size=16, nsplit=8, mask="causal",
                     schedule="dimsplit", row_tiles=1, block_n=32, stages=2, load_width=128),
                dict(name="gpu_ds_h64", heads_per_rank=64, q_len=2, page_size=1, nsplit="auto", mask="none",
                     schedule="dimsplit", row_tiles=4, block_n=32, stages=2, load_width=128),
                dict(name="gpu_ds_q1", heads_per_rank=8, q_len=1, page_size=1, nsplit="auto", mask="causal",
                     schedule="dimsplit", row_tiles=1, block_n=32, stages=3, load_width="bulk")],
    # dimsplit with two consumer warps per row tile (num_warps = 2 x row_tiles + 1): each scores 8 of a
    # sub-tile's 16 tokens and owns 128 output dims; P and row maxima cross through shared memory
    "k2_dsp": dict(name="gpu_k2_dsp", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit=["auto", 7],
                   schedule="dimsplit", block_n=32, stages=[2, 3], row_tiles=5, num_warps=11, load_width=128,
                   mask="tree"),
    # pairs at other row counts: H16 (second cluster 4 live tiles), H1 q5 causal (1 tile, 5 rows), H16 q2
    # no mask (1 cluster of 2 tiles, 5 warps), q_len 1
    "dsp_rows": [dict(name="gpu_dsp_h16", heads_per_rank=16, q_len=9, page_size=64, nsplit="auto", mask="tree",
                      schedule="dimsplit", row_tiles=5, num_warps=11, block_n=32, stages=2, load_width=128),
                 dict(name="gpu_dsp_h1", heads_per_rank=1, q_len=5, page_size=16, nsplit=8, mask="causal",
                      schedule="dimsplit", row_tiles=1, num_warps=3, block_n=32, stages=2, load_width=128),
                 dict(name="gpu_dsp_h16q2", heads_per_rank=16, q_len=2, page_size=1, nsplit="auto", mask="none",
                      schedule="dimsplit", row_tiles=2, num_warps=5, block_n=32, stages=3, load_width=128),
                 dict(name="gpu_dsp_q1", heads_per_rank=8, q_len=1, page_size=1, nsplit="auto", mask="causal",
                      schedule="dimsplit", row_tiles=1, num_warps=3, block_n=32, stages=3, load_width="bulk")],
    # dimsplit_t: the dimsplit cluster with S^T = K Q^T and O^T = V^T P^T, 3 score warps of 24 rows, 4 output
    # warps of 64 dims and a producer (H8 q9: one cluster of 72 rows); 4 stages: one score exchange buffer
    "k2_dst": dict(name="gpu_k2_dst", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit=["auto", 7],
                   schedule="dimsplit_t", block_n=32, stages=[2, 3, 4], row_tiles=3, num_warps=8, load_width=128,
                   mask="tree"),
    # dimsplit_t at other row counts: H16 (2 clusters of 72 rows), H1 q5 causal (one score warp, 5 of 24 rows
    # live), H64 q2 no mask (128 rows: 2 clusters of 3 score warps, the second 56 rows live), q_len 1 decode
    # (3 and 4 stages: a score step receives after 9 or 4 K steps), H16 q3 (48 rows: two score warps, 6 n8
    # tiles) with 16-token steps in an 8-stage ring, and 16-token steps in a 2-stage ring at H8 q9
    "dst_rows": [dict(name="gpu_dst_h16", heads_per_rank=16, q_len=9, page_size=64, nsplit="auto", mask="tree",
                      schedule="dimsplit_t", row_tiles=3, num_warps=8, block_n=32, stages=[3, 4], load_width=128),
                 dict(name="gpu_dst_h1", heads_per_rank=1, q_len=5, page_size=16, nsplit=8, mask="causal",
                      schedule="dimsplit_t", row_tiles=1, num_warps=6, block_n=32, stages=2, load_width=128),
                 dict(name="gpu_dst_h64", heads_per_rank=64, q_len=2, page_size=1, nsplit="auto", mask="none",
                      schedule="dimsplit_t", row_tiles=3, num_warps=8, block_n=32, stages=2, load_width=128),
                 dict(name="gpu_dst_q1", heads_per_rank=8, q_len=1, page_size=1, nsplit="auto", mask="causal",
                      schedule="dimsplit_t", row_tiles=1, num_warps=6, block_n=32, stages=[3, 4], load_width=128),
                 dict(name="gpu_dst_h16q3", heads_per_rank=16, q_len=3, page_size=16, nsplit="auto", mask="tree",
                      schedule="dimsplit_t", row_tiles=2, num_warps=7, block_n=16, stages=8, load_width=128),
                 dict(name="gpu_dst_bn16", heads_per_rank=8, q_len=9, page_size=1, nsplit=7, mask="tree",
                      schedule="dimsplit_t", row_tiles=3, num_warps=8, block_n=16, stages=2, load_width=128),
                 # q_len 40 > 32: the tree rows' fill into shared memory takes a second pass of the warp's lanes
                 dict(name="gpu_dst_q40", heads_per_rank=1, q_len=40, page_size=16, nsplit=8, mask="tree",
                      schedule="dimsplit_t", row_tiles=2, num_warps=7, block_n=32, stages=3, load_width=128)],
    # extremes of H, other masks, odd q_len
    "h1": dict(name="gpu_h1", heads_per_rank=1, q_len=5, page_size=16, nsplit=8, mask="causal", row_tiles=1,
               load_width=["bulk", 128]),
    "h128": dict(name="gpu_h128", heads_per_rank=128, q_len=2, page_size=1, nsplit="auto", mask="none",
                 row_tiles=2, num_warps=8, stages=3, load_width=["bulk", 128]),
    "h16": dict(name="gpu_h16", heads_per_rank=16, q_len=9, page_size=64, nsplit="auto", mask="tree", row_tiles=3,
                load_width=["bulk", 128]),
}


@pytest.fixture(scope="module")
def kernels(build_native):
    return _LazyKernels(build_native)


class _LazyKernels(dict):
    """SPECS key -> built kernels (compiled for this GPU's arch: conftest.build_native), built on first use (so
    `-k k2_w4` builds only that spec)."""

    def __init__(self, build_native):
        super().__init__()
        self.build_native = build_native

    def __missing__(self, key):
        from mlagen.ops import VerifyKernel

        specs = SPECS[key] if isinstance(SPECS[key], list) else [SPECS[key]]
        self[key] = [VerifyKernel(b.variant, b.so_path) for spec in specs for b in self.build_native(spec)]
        assert self[key], f"spec {key} built no variant"
        return self[key]


def _check(kernel, quick):
    from mlagen.verify import verify_kernel

    results = verify_kernel(kernel, quick=quick)
    bad = [f"{r.name}: {r.detail}" for r in results if not r.passed]
    assert not bad, f"{kernel.variant.uri}: " + " | ".join(bad)
    assert len(results) >= (9 if kernel.variant.q_len > 1 else 8)  # q_len 1 has no shorter runtime q_len case


def test_k2_full_case_set(kernels):
    for i, k in enumerate(kernels["k2"]):
        _check(k, quick=i > 0)  # full set (128k, > 4 GiB pool) on the first, quick on the rest


def test_dimsplit_full_case_set(kernels):
    ks = kernels["k2_ds"]
    assert {k.variant.schedule for k in ks} == {"dimsplit"} and len(ks) == 16
    for i, k in enumerate(ks):
        _check(k, quick=i > 0)


def test_dimsplit_pairs_full_case_set(kernels):
    ks = kernels["k2_dsp"]
    assert {(k.variant.schedule, k.variant.num_warps) for k in ks} == {("dimsplit", 11)} and len(ks) == 8
    for i, k in enumerate(ks):
        _check(k, quick=i > 0)


def test_dimsplit_t_full_case_set(kernels):
    ks = kernels["k2_dst"]
    assert {(k.variant.schedule, k.variant.num_warps) for k in ks} == {("dimsplit_t", 8)} and len(ks) == 12
    for i, k in enumerate(ks):
        _check(k, quick=i > 0)


def test_fp8_full_case_set(kernels):
    ks = kernels["k2_fp8"]
    assert {(k.variant.schedule, k.variant.dtype) for k in ks} == {("dimsplit", "fp8_e4m3")} and len(ks) == 8
    for i, k in enumerate(ks):
        _check(k, quick=i > 0)


def test_dimsplit_t_fp8_full_case_set(kernels):
    ks = kernels["k2_dst_fp8"]
    assert {(k.variant.schedule, k.variant.dtype) for k in ks} == {("dimsplit_t", "fp8_e4m3")} and len(ks) == 4
    for i, k in enumerate(ks):
        _check(k, quick=i > 0)


@pytest.mark.parametrize("fp8_key, bf16_key, stages", [("k2_fp8", "k2_ds", 3), ("k2_dst_fp8", "k2_dst", None)])
def test_fp8_equals_bf16_on_the_dequantized_cache(kernels, fp8_key, bf16_key, stages):
    """The e4m3 kernel converts each stage exactly and then runs the bf16 kernel's math: on the same
    bytes, dequantized to bf16 for the bf16 build of the same tile, the outputs are bit-identical (dimsplit,
    and dimsplit_t against its bf16 build of any ring depth: the ring does not change the arithmetic)."""
    from mlagen.cases import make_fp8_problem
    from mlagen.reference import dequantize_e4m3

    f8 = next(k for k in kernels[fp8_key] if k.variant.nsplit == "auto" and k.variant.page_size == 1
              and (stages is None or k.variant.stages == stages))
    bf = next(k for k in kernels[bf16_key] if k.variant.nsplit == "auto" and k.variant.page_size == 1
              and k.variant.stages == (stages or 4) and k.variant.load_width == 128)
    p = make_fp8_problem(f8.variant, [9, 40, 4099, 65536], special=True, device="cuda")
    deq = dequantize_e4m3(p.kv_cache).to(torch.bfloat16)  # NaN bytes stay NaN (never visible)
    outs = []
    for k, cache in ((f8, p.kv_cache), (bf, deq)):
        out = torch.full((p.q.shape[0], 8, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((p.q.shape[0], 8), float("nan"), device="cuda")
        k(p.q, cache, p.block_table, p.kv_lens, out=out, lse=lse, **p.kernel_args())
        outs.append((out, lse))
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0][0].float()).all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("key", ["k2_ds", "k2_dsp", "k2_ds2p", "k2_dst"])
def test_dimsplit_equals_rowblock(kernels, key):
    """Same inputs, same outputs within bf16 rounding: the two schedules sum the same products in another order."""
    from mlagen.cases import make_problem

    ds = next(k for k in kernels[key] if k.variant.nsplit == "auto" and k.variant.page_size == 1)
    rb = next(k for k in kernels["k2"] if k.variant.nsplit == "auto" and k.variant.page_size == 1)
    p = make_problem(ds.variant, [9, 40, 4099, 65536], device="cuda")
    outs = []
    for k in (ds, rb):
        out = torch.full((p.q.shape[0], ds.variant.heads, ds.variant.dim_v), float("nan"), dtype=torch.bfloat16,
                         device="cuda")
        lse = torch.full((p.q.shape[0], ds.variant.heads), float("nan"), device="cuda")
        k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out, lse=lse, **p.kernel_args())
        outs.append((out.float(), lse))
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0][0]).all() and torch.isfinite(outs[0][1]).all()
    assert (outs[0][0] - outs[1][0]).abs().max().item() < 2e-2
    assert (outs[0][1] - outs[1][1]).abs().max().item() < 1e-3


@pytest.mark.parametrize("key", ["k2", "k2_dst"])
def test_head_major_out_equals_token_major(kernels, key):
    """out may be any layout whose rows do not overlap (ops._rows_overlap): written head-major ([H, T, 512]
    transposed), the kernel gives the same bits as into a contiguous out, and touches nothing between the rows."""
    from mlagen.cases import make_problem

    k = next(k for k in kernels[key] if k.variant.nsplit == "auto" and k.variant.page_size == 1)
    H, DV = k.variant.heads, k.variant.dim_v
    p = make_problem(k.variant, [9, 40, 4099], device="cuda")
    T = p.q.shape[0]
    plain = torch.full((T, H, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=plain, **p.kernel_args())
    backing = torch.full((H, T + 1, DV), float("nan"), dtype=torch.bfloat16, device="cuda")  # a spare row per head
    head_major = backing[:, :T].transpose(0, 1)
    k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=head_major, **p.kernel_args())
    torch.cuda.synchronize()
    assert torch.isfinite(plain.float()).all()
    assert torch.equal(head_major, plain)
    assert torch.isnan(backing[:, T].float()).all()  # the rows past the out view stay as they were


@pytest.mark.parametrize("key", ["h1", "h128", "h16", "k2_bn32", "k2_ov", "k2_w4", "k2_w16", "ds_rows", "dsp_rows",
                                 "k2_ds2p", "fp8_rows", "dst_rows", "dst_fp8_rows"])
def test_other_shapes(kernels, key):
    for k in kernels[key]:
        _check(k, quick=True)


def test_graph_replay_matches_eager(kernels):
    from mlagen.cases import make_problem

    k = kernels["k2"][0]
    v = k.variant
    bs = 6
    p = make_problem(v, [3000] * bs, device="cuda")
    ws = k.alloc_workspace(bs, "cuda")
    out = torch.empty(bs * v.q_len, v.heads, v.dim_v, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(bs * v.q_len, v.heads, dtype=torch.float32, device="cuda")
    lens = p.kv_lens

    def run():
        k(p.q, p.kv_cache, p.block_table, lens, out=out, lse=lse, workspace=ws, **p.kernel_args())

    from mlagen.bench import capture_graph

    g = capture_graph(run)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for it in range(50):
        new = torch.randint(0, 3001, (bs,), generator=gen)
        new[torch.rand(bs, generator=gen) < 0.2] = 0  # padded rows
        lens.copy_(new.to(torch.int32))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        got_out, got_lse = out.clone(), lse.clone()
        out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        assert torch.equal(got_out, out), f"replay {it} differs from eager for lengths {new.tolist()}"
        assert torch.equal(got_lse.nan_to_num(-1.0), lse.nan_to_num(-1.0))
        assert torch.isfinite(got_out).all()


def test_dimsplit_t_back_to_back_calls_share_a_workspace(kernels):
    """Shipped dimsplit_t builds launch the partial kernel as a programmatic dependent of the kernel before it, and
    the combine lets the next kernel launch from its start (MLAGEN_DST_PDL 1): a call's partial kernel may start
    while the previous call's combine still reads the workspace that both use. Calls alternating a long batch (its
    combine reads many splits) and a short one (its partial kernel reaches its stores soonest), captured in one CUDA
    graph and also launched eagerly back to back, must each give the output of the same call run alone."""
    from mlagen.bench import capture_graph
    from mlagen.cases import make_problem

    k = next(k for k in kernels["k2_dst"] if k.variant.nsplit == "auto" and k.variant.page_size == 1
             and k.variant.stages == 4)
    v = k.variant
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    probs = []
    for i in range(6):  # even: 4 requests of 3-5k tokens; odd: one request of at most 2 tiles
        lens = (torch.randint(3000, 5001, (4,), generator=gen) if i % 2 == 0
                else torch.randint(v.q_len, 2 * v.block_n + 1, (1,), generator=gen))
        probs.append(make_problem(v, lens.tolist(), device="cuda"))
    ws = k.alloc_workspace(4, "cuda")

    def out_lse(p):
        n = p.kv_lens.numel() * v.q_len
        return (torch.empty(n, v.heads, v.dim_v, dtype=torch.bfloat16, device="cuda"),
                torch.empty(n, v.heads, dtype=torch.float32, device="cuda"))

    alone = []
    for p in probs:  # each call alone (synchronized before the next)
        out, lse = out_lse(p)
        out.fill_(float("nan"))
        k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out, lse=lse, workspace=ws, **p.kernel_args())
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        alone.append((out, lse))
    outs = [out_lse(p) for p in probs]

    def run_all():
        for p, (out, lse) in zip(probs, outs):
            k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out, lse=lse, workspace=ws, **p.kernel_args())

    g = capture_graph(run_all)
    for how in ("graph", "eager"):
        for _ in range(20):
            for out, lse in outs:
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
            if how == "graph":
                g.replay()
            else:
                run_all()
            torch.cuda.synchronize()
            for i, ((out, lse), (ref_out, ref_lse)) in enumerate(zip(outs, alone)):
                assert torch.equal(out, ref_out), f"{how}: call {i} differs from the same call run alone"
                assert torch.equal(lse, ref_lse), f"{how}: call {i}'s LSE differs from the same call run alone"


# dimsplit_t builds with the combine folded in (MLAGEN_DST_MERGE 1, a diagnostic build; mla_verify_merge.cuh):
# H8 q9 tree 4 stages, H16 page size 64 (two row blocks), H1 q5 causal fixed NSPLIT, the e4m3 tile
MERGE_URIS = ["mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90",
              "mla_verify_h16_q9_kv512_rope64_ps64_nsauto_lw128_bn32_w8_rt3_st3_dimsplit_t_tree_bf16_sm120_sm90",
              "mla_verify_h1_q5_kv512_rope64_ps16_ns8_lw128_bn32_w6_rt1_st2_dimsplit_t_causal_bf16_sm120_sm90",
              "mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st2_dimsplit_t_tree_fp8e4m3_sm120_sm90"]


def _build_with_defines(jobs, out_dir):
    """Per (uri, defines) job, a VerifyKernel of the variant compiled for this GPU's arch with ``#define NAME VALUE``
    for each (NAME, VALUE) of defines ahead of the rendered source (outside the registry; the module name says the
    defines), compiled in parallel."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from mlagen.build import build_with_defines
    from mlagen.ops import VerifyKernel
    from mlagen.spec import Variant

    major, minor = torch.cuda.get_device_capability()

    def build(job):
        uri, defines = job
        v = dataclasses.replace(Variant.from_uri(uri), archs=(f"sm_{major}{minor}",))
        mod, so = build_with_defines(v, defines, out_dir)
        return VerifyKernel(v, so, mod)

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(build, jobs))


def _build_pairs(pairs, out_dir):
    """Per (uri, defines_a, defines_b) of ``pairs``, the two builds (a, b) of :func:`_build_with_defines`, all compiled
    in parallel."""
    built = _build_with_defines([(uri, d) for uri, a, b in pairs for d in (a, b)], out_dir)
    return [(built[2 * i], built[2 * i + 1]) for i in range(len(pairs))]


@pytest.fixture(scope="module")
def merge_kernels(tmp_path_factory):
    """The MERGE_URIS built with MLAGEN_DST_MERGE 1 for this GPU's arch (outside the registry), in parallel."""
    merge = (("MLAGEN_DST_MERGE", 1), ("MLAGEN_DST_PARTIAL_BF16", 0))  # the merge reads fp32 partials
    return _build_with_defines([(uri, merge) for uri in MERGE_URIS], tmp_path_factory.mktemp("merge"))


@pytest.mark.parametrize("i", range(len(MERGE_URIS)))
def test_dimsplit_t_fused_merge_equals_the_combine_kernel(merge_kernels, i):
    """A dimsplit_t build with MLAGEN_DST_MERGE 1 folds the combine into the partial kernel when its grid is
    co-resident (mla_verify_merge.cuh; else, as for H16 at 5 requests, it runs the combine kernel): on
    the same inputs the one-kernel launch and the partial + combine launch agree to fp32 summation order (out within
    one bf16 rounding step of each other, lse 1e-5), both finite and against the reference; a padded request
    (kv_len 0) is 0 with lse -inf in both; the workspace's merge counters are 0 again after each launch, eager and
    in 20 CUDA-graph replays with new lengths; and a workspace mlagen did not zero runs the combine kernel."""
    from mlagen.bench import capture_graph
    from mlagen.cases import make_fp8_problem, make_problem
    from mlagen.reference import mla_verify_reference

    for k in merge_kernels[i:i + 1]:
        v = k.variant
        assert k.module.fused_merge and k.module.max_active_clusters() > 0
        lens = [9, 40, 4099, 0, 20000] if v.nsplit == "auto" else [9, 40, 4099, 0]
        p = (make_fp8_problem if v.dtype == "fp8_e4m3" else make_problem)(v, lens, device="cuda")
        bs = len(lens)
        ws = k.alloc_workspace(bs, "cuda")
        assert k.merge_counters(ws) == ws.data_ptr()
        splits = k.num_splits(bs)
        # H16 at 5 requests: 2 row blocks x 13 splits x 5 = 130 clusters, two waves on an H200: the launch must run the
        # combine kernel instead (a merge would wait for clusters that cannot start), bit-identical to fused_merge False
        fits = bs * v.row_blocks * splits <= k.module.max_active_clusters()
        outs = []
        for fused in (True, False):
            k.fused_merge = fused
            out = torch.full((bs * p.q_len, v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((bs * p.q_len, v.heads), float("nan"), device="cuda")
            ws[16:].view(torch.int32).fill_(-1)  # partials poisoned (NaN as fp32 or bf16): only this launch's are read
            k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out, lse=lse, workspace=ws, **p.kernel_args())
            torch.cuda.synchronize()
            assert torch.equal(ws[:2], torch.zeros(2, device="cuda")), f"{v.uri}: merge counters not reset"
            outs.append((out.float(), lse))
        k.fused_merge = True
        (fo, fl), (co, cl) = outs
        assert torch.isfinite(fo).all() and torch.isfinite(co).all()
        pad = slice(3 * p.q_len, 4 * p.q_len)
        assert (fo[pad] == 0).all() and (co[pad] == 0).all()
        assert torch.isneginf(fl[pad]).all() and torch.isneginf(cl[pad]).all()
        live = torch.isfinite(cl)
        assert torch.equal(live, torch.isfinite(fl))
        if not fits:
            assert torch.equal(fo, co) and torch.equal(fl.nan_to_num(-1.0), cl.nan_to_num(-1.0))
        assert (fo - co).abs().max().item() <= 2 ** -7 * max(1.0, co.abs().max().item())
        assert (fl[live] - cl[live]).abs().max().item() < 1e-5
        ref_out = mla_verify_reference(p.q, p.kv_cache, p.block_table, p.kv_lens, **p.reference_args())[0]
        assert (fo - ref_out.float()).abs().max().item() < 3e-2
        # CUDA-graph replays of the fused launch: new lengths, counters back at 0 each time, equal to eager
        out = torch.empty(bs * p.q_len, v.heads, v.dim_v, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(bs * p.q_len, v.heads, device="cuda")
        kv_lens = p.kv_lens.clone()

        def run():
            k(p.q, p.kv_cache, p.block_table, kv_lens, out=out, lse=lse, workspace=ws, **p.kernel_args())

        g = capture_graph(run)
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
        orig = p.kv_lens.cpu().long()  # a request's block-table row covers its own length only
        for it in range(20):
            new = torch.minimum((torch.rand(bs, generator=gen) * orig).long().clamp(min=p.q_len), orig)
            new[(torch.rand(bs, generator=gen) < 0.2) | (orig == 0)] = 0
            kv_lens.copy_(new.to(torch.int32))
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(ws[:2], torch.zeros(2, device="cuda")), f"replay {it}: merge counters not reset"
            got = out.clone()
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            assert torch.isfinite(got.float()).all() and torch.equal(got, out), f"replay {it} vs eager: {new.tolist()}"
        # a workspace whose header mlagen did not zero: the combine kernel runs, the header is left alone
        own = torch.full((k.workspace_numel(bs),), 7.0, device="cuda")
        assert k.merge_counters(own) == 0
        out.fill_(float("nan"))
        k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out, workspace=own, **p.kernel_args())
        torch.cuda.synchronize()
        assert torch.equal(out.float(), co) and (own[:16] == 7.0).all()


def test_shipped_dimsplit_t_runs_the_combine_kernel():
    """Shipped dimsplit_t builds (MLAGEN_DST_MERGE 0) have no merge code: a launch never passes merge counters."""
    from mlagen.build import build_variants
    from mlagen.ops import VerifyKernel
    from mlagen.spec import Variant

    v = Variant.from_uri(MERGE_URIS[0])
    b = build_variants(v.spec_dict("gpu_dst_shipped"), kernels=v.uri)[0]
    k = VerifyKernel(b.variant, b.so_path)
    ws = k.alloc_workspace(2, "cuda")
    assert not k.module.fused_merge and k.merge_counters(ws) == 0


# dimsplit_t tiles built with bf16 partials in dim order (MLAGEN_DST_PARTIAL_BF16 1) and in the accumulator
# fragment's pair order (2): H8 q9 tree (st4, the shipped tile; and page size 64 st3), H16 two clusters, H1 q5 causal
# (one score warp, 5 of 24 rows live), H64 q2 no mask (the second cluster 56 rows live), q_len 1 causal st4, e4m3 st2
PAIRED_URIS = ["mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90",
               "mla_verify_h8_q9_kv512_rope64_ps64_ns7_lw128_bn32_w8_rt3_st3_dimsplit_t_tree_bf16_sm120_sm90",
               "mla_verify_h16_q9_kv512_rope64_ps64_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90",
               "mla_verify_h1_q5_kv512_rope64_ps16_ns8_lw128_bn32_w6_rt1_st2_dimsplit_t_causal_bf16_sm120_sm90",
               "mla_verify_h64_q2_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st2_dimsplit_t_none_bf16_sm120_sm90",
               "mla_verify_h8_q1_kv512_rope64_ps1_nsauto_lw128_bn32_w6_rt1_st4_dimsplit_t_causal_bf16_sm120_sm90",
               "mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st2_dimsplit_t_tree_fp8e4m3_sm120_sm90"]


@pytest.fixture(scope="module")
def paired_kernels(tmp_path_factory):
    """Per PAIRED_URIS entry, (dim-order build, paired build): MLAGEN_DST_PARTIAL_BF16 1 and 2 for this GPU's arch
    (outside the registry), compiled in parallel."""
    pairs = [(uri, (("MLAGEN_DST_PARTIAL_BF16", 1),), (("MLAGEN_DST_PARTIAL_BF16", 2),)) for uri in PAIRED_URIS]
    return _build_pairs(pairs, tmp_path_factory.mktemp("paired"))


@pytest.mark.parametrize("i", range(len(PAIRED_URIS)))
def test_dimsplit_t_paired_partials_equal_dim_order(paired_kernels, i):
    """The paired partial layout (MLAGEN_DST_PARTIAL_BF16 2, include/mlagen/mla_verify_partial_store.cuh) moves where
    each bf16 partial sits, not its value or the combine's summation order: on fresh random inputs (NaN in every slot
    no request reads, a padded request of kv_len 0; each build's workspace poisoned before its launch) its out and
    lse are bit-identical to the dim-order build's, finite where a key is visible, and the paired build passes the
    verify cases against the reference (the full set, with 128k and a pool past 4 GiB, for the shipped H8 tile; the
    quick set for the others)."""
    dim_order, paired = paired_kernels[i]
    _assert_same_outputs(dim_order, paired)
    _check(paired, quick=i > 0)


def _wait_or_fail(what, seconds=120.0):
    """Wait for the work queued so far on the current stream; fail the test, naming ``what``, when it has not finished
    after ``seconds`` (a kernel that deadlocks on its barriers would otherwise hang the run instead of failing it)."""
    import time

    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not finished after {seconds:.0f} s (a barrier deadlock?)")
        time.sleep(0.01)


def _launch(k, p, workspace=None):
    """(out, lse) of kernel ``k`` on problem ``p`` (both NaN before the launch; kv_scale 1; ``workspace``, else one
    the kernel allocates), waited for with :func:`_wait_or_fail`."""
    v = k.variant
    out = torch.full((p.q.shape[0], v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((p.q.shape[0], v.heads), float("nan"), device="cuda")
    ws = {} if workspace is None else dict(workspace=workspace)
    k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out, lse=lse, **ws, **p.kernel_args())
    _wait_or_fail(v.uri)
    return out, lse


def _assert_same_outputs(base, diag):
    """``base`` and ``diag`` (two builds of one variant) give bit-identical out and lse on fresh random inputs: NaN in
    every slot no request reads, a padded request of kv_len 0, 65,536 keys in one request (nsplit auto), each build's
    workspace poisoned before its launch; out / lse finite where a key is visible, 0 / -inf where none is. A launch
    that does not finish within 120 s fails the test."""
    from mlagen.cases import make_fp8_problem, make_problem

    v = diag.variant
    lens = [9, 40, 4099, 0, 65536] if v.nsplit == "auto" else [9, 40, 4099, 0]
    p = (make_fp8_problem(v, lens, special=True, device="cuda") if v.dtype == "fp8_e4m3"
         else make_problem(v, lens, device="cuda"))
    outs = []
    for k in (base, diag):
        ws = k.alloc_workspace(len(lens), "cuda")
        ws[16:].view(torch.int32).fill_(-1)  # partials poisoned (NaN as fp32 or bf16): only this launch's are read
        outs.append(_launch(k, p, ws))
    torch.cuda.synchronize()
    live = torch.repeat_interleave(torch.tensor([L > 0 for L in lens], device="cuda"), v.q_len)
    assert torch.isfinite(outs[1][0][live].float()).all() and torch.isfinite(outs[1][1][live]).all()
    assert (outs[1][0][~live] == 0).all() and torch.isneginf(outs[1][1][~live]).all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# dimsplit_t tiles built with a rescale slack of 8 (MLAGEN_DST_RESCALE_SLACK; the default of these tiles, with the
# rescale flags) and of 0, both with the flags off: H8 q9 tree st4, q_len 1 causal st4, H64 q2 no mask st2, e4m3 st2
SLACK_URIS = ["mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90",
              "mla_verify_h8_q1_kv512_rope64_ps1_nsauto_lw128_bn32_w6_rt1_st4_dimsplit_t_causal_bf16_sm120_sm90",
              "mla_verify_h64_q2_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st2_dimsplit_t_none_bf16_sm120_sm90",
              "mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st2_dimsplit_t_tree_fp8e4m3_sm120_sm90"]


@pytest.fixture(scope="module")
def slack_kernels(tmp_path_factory):
    """Per SLACK_URIS entry, (build without a slack, build with MLAGEN_DST_RESCALE_SLACK 8), both with
    MLAGEN_DST_RESCALE_FLAG 0 (every row's factor tested), for this GPU's arch (outside the registry), in parallel."""
    off = ("MLAGEN_DST_RESCALE_FLAG", 0)
    pairs = [(uri, (("MLAGEN_DST_RESCALE_SLACK", 0), off), (("MLAGEN_DST_RESCALE_SLACK", 8), off))
             for uri in SLACK_URIS]
    return _build_pairs(pairs, tmp_path_factory.mktemp("slack"))


@pytest.mark.parametrize("i", range(len(SLACK_URIS)))
def test_dimsplit_t_rescale_slack_matches_reference(slack_kernels, i):
    """With a rescale slack (MLAGEN_DST_RESCALE_SLACK 8: a row's running max moves only when a step's max exceeds it by
    more than 8 in log2 units, so P reaches 256) the kernel computes the same softmax: it passes the verify cases (the
    full set for the shipped H8 tile, the quick set for the others; both hold a rising-scores case whose max outgrows
    the slack). On a longer rising-scores batch (20k tokens: many steps per split) both builds are within the verify
    tolerance of the reference and their outputs differ (P is rounded at another scale), so the slack took effect."""
    from mlagen.cases import make_fp8_problem, make_problem
    from mlagen.verify import compare

    base, k = slack_kernels[i]
    _check(k, quick=i > 0)
    v = k.variant
    make = make_fp8_problem if v.dtype == "fp8_e4m3" else make_problem
    p = make(v, [v.q_len + 20000, v.q_len + 1500], device="cuda", kv_ramp=4.0, name="rising scores, 20k")
    outs = [_launch(kern, p) for kern in (base, k)]
    for kern, (out, lse) in zip((base, k), outs):
        r = compare(p, out, lse, v.dtype, v.kv_lora_rank)  # (kv_scale 1: no descale)
        assert r.passed, f"{kern.variant.uri}: {r.detail}"
    assert not torch.equal(outs[0][0], outs[1][0]), "the slack build's output equals the build without it"


@pytest.fixture(scope="module")
def flag_kernels(tmp_path_factory):
    """The first two SLACK_URIS (3 score warps and 1) built with MLAGEN_DST_RESCALE_SLACK 8 and MLAGEN_DST_RESCALE_FLAG 1
    for this GPU's arch (outside the registry), in parallel."""
    jobs = [(uri, (("MLAGEN_DST_RESCALE_SLACK", 8), ("MLAGEN_DST_RESCALE_FLAG", 1))) for uri in SLACK_URIS[:2]]
    return _build_with_defines(jobs, tmp_path_factory.mktemp("flag"))


@pytest.mark.parametrize("i", range(2))
def test_dimsplit_t_rescale_flag_equals_factor_test(slack_kernels, flag_kernels, i):
    """With MLAGEN_DST_RESCALE_FLAG the output warps decide whether to rescale O^T from one flag per score warp instead
    of testing every row's factor; a factor of exactly 1 leaves O^T as it is, so out and lse are bit-identical to the
    slack build without the flags: on i.i.d. scores (the rescale almost never runs) and on rising scores (it runs in
    many steps)."""
    from mlagen.cases import make_problem

    base, diag = slack_kernels[i][1], flag_kernels[i]
    _assert_same_outputs(base, diag)
    v = diag.variant
    p = make_problem(v, [v.q_len + 20000, v.q_len + 1500], device="cuda", kv_ramp=4.0, name="rising scores, 20k")
    outs = [_launch(k, p) for k in (base, diag)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_bad_tensor_raises_before_launch(kernels):
    from mlagen.cases import make_problem

    k = kernels["k2"][0]
    v = k.variant
    p = make_problem(v, [100, 200], device="cuda")
    out = torch.full((2 * v.q_len, v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="kv_lens must be torch.int32"):
        k(p.q, p.kv_cache, p.block_table, p.kv_lens.long(), out=out, **p.kernel_args())
    with pytest.raises(ValueError, match="q must have shape"):
        k(p.q[:-1], p.kv_cache, p.block_table, p.kv_lens, out=out, **p.kernel_args())
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        k(p.q, p.kv_cache, p.block_table.cpu(), p.kv_lens, out=out, **p.kernel_args())
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all(), "a rejected call must not write the output"


def test_cluster_builds_report_resident_clusters(kernels):
    """Every dimsplit_t build (not only the fused-merge diagnostic ones) answers cudaOccupancyMaxActiveClusters, and
    nsplit auto takes at most twice that many CTA slots: the cap that keeps bs 1's filled split count in one wave on a
    GPU whose GPCs fit fewer clusters than SMs / 2 (mlagen/ops.py VerifyKernel.cta_slots)."""
    k = kernels["k2_dst"][0]
    assert k.variant.nsplit == "auto" and k.variant.ctas_per_row_block == 2 and not k.module.fused_merge
    clusters = k.module.max_active_clusters()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 0 < clusters <= sms // 2
    assert k.cta_slots() == min(sms * k.module.max_active_ctas_per_sm(), 2 * clusters)
    assert k.num_splits(1) * 2 <= k.cta_slots()  # bs 1: one wave of two-CTA splits


def test_auto_split_fills_whole_waves(kernels):
    from mlagen.ops import auto_num_splits

    k = kernels["k2"][0]
    assert k.variant.nsplit == "auto"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    occ = k.module.max_active_ctas_per_sm()
    for bs in (1, 4, 16, 64):
        n = k.num_splits(bs)
        assert n == auto_num_splits(bs * k.variant.row_blocks * k.variant.ctas_per_row_block, sms * occ,
                                    slack=k.auto_slack)
        units, slots = bs * k.variant.row_blocks, sms * occ
        if units <= slots:  # a single request batch fills at least 90 % of one wave
            assert units * n >= 0.9 * min(slots, units * 256)
