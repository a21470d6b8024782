"""CPU-only tests of bench/: floor formulas, problem construction, SGLang argument
layout (checked against a torch emulation of what SGLang's Triton kernels read),
and that everything degrades to "skipped: <reason>" without GPU/sglang."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

import ceilings  # noqa: E402
import sglang_baselines as sb  # noqa: E402


# --------------------------------------------------------------------------- floors

def test_verify_bytes_formula():
    H, q_len, bs, ctx = 128, 4, 8, 4096
    kv = bs * ctx * 576 * 2
    q = bs * q_len * H * 576 * 2
    out = bs * q_len * H * 512 * 2
    assert ceilings.verify_bytes(H, q_len, bs, ctx) == kv + q + out
    assert ceilings.verify_bytes(16, 1, 1, 1) == 1152 + 16 * 1152 + 16 * 1024


def test_verify_flops_formula():
    H, q_len, bs, ctx = 128, 4, 8, 4096
    rows = bs * q_len * H
    assert ceilings.verify_flops(H, q_len, bs, ctx) == 2 * rows * ctx * (576 + 512)
    assert ceilings.verify_flops(1, 1, 1, 1) == 2176


def test_floor_us_takes_the_larger_bound():
    # 4.8e9 B at 4800 GB/s = 1 ms; 6.4e14 FLOP at 640 TFLOP/s = 1 s
    assert ceilings.floor_us(4.8e9, 0, 4800, 640) == pytest.approx(1000.0)
    assert ceilings.floor_us(0, 6.4e14, 4800, 640) == pytest.approx(1e6)
    assert ceilings.floor_us(4.8e9, 6.4e14, 4800, 640) == pytest.approx(1e6)
    b, f = 1e9, 1e12
    t = ceilings.floor_us(b, f, 4000, 600)
    assert t == pytest.approx(max(b / 4e12, f / 6e14) * 1e6)
    with pytest.raises(ValueError):
        ceilings.floor_us(1, 1, 0, 600)


def test_verify_floor_compute_bound_at_many_rows():
    # q_len*H = 512 rows/request -> ~480 FLOP/byte: mma-bound at these ceilings
    H, q_len, bs, ctx = 128, 4, 32, 8192
    b = ceilings.verify_bytes(H, q_len, bs, ctx)
    f = ceilings.verify_flops(H, q_len, bs, ctx)
    t = ceilings.verify_floor_us(H, q_len, bs, ctx, 4300, 635)
    assert t == pytest.approx(max(b / 4.3e12, f / 6.35e14) * 1e6)
    assert t == pytest.approx(f / 6.35e14 * 1e6)


def test_nvcc_command_targets_sm90():
    pytest.importorskip("pybind11")
    cmd = ceilings.nvcc_command("x.cu", "y.so", (9, 0))
    s = " ".join(cmd)
    assert "-gencode arch=compute_90,code=sm_90" in s
    assert "-shared" in cmd and "-fPIC" in cmd and "-std=c++17" in cmd
    assert any(a.startswith("-I") for a in cmd)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_mma_probe_compiles(tmp_path):
    pytest.importorskip("pybind11")
    out = str(tmp_path / "mma_probe_ext.so")
    cmd = ceilings.nvcc_command(os.path.join(BENCH, "mma_probe.cu"), out, (9, 0))
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert os.path.getsize(out) > 0


def test_ceilings_raise_cleanly_without_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("GPU present")
    with pytest.raises(RuntimeError):
        ceilings.copy_bandwidth_gbs()
    with pytest.raises(RuntimeError):
        ceilings.mma_sync_tflops()
    res = ceilings.measure_ceilings()
    assert res["copy_gbs"] is None and res["mma_tflops"] is None
    assert set(res["errors"]) == {"copy_gbs", "mma_tflops"}


# --------------------------------------------------------------------------- import safety

def test_modules_import_without_torch_side_effects():
    code = ("import sys; sys.path.insert(0, %r); import sglang_baselines, ceilings; "
            "print(any(m in sys.modules for m in ('torch', 'triton', 'sglang')))" % BENCH)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_sglang_available_never_raises_and_gives_reason(monkeypatch):
    ok, why = sb.sglang_available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    try:
        import torch
    except Exception:  # noqa: BLE001
        assert not ok and "torch" in why
        return
    if not torch.cuda.is_available():
        assert not ok and "CUDA" in why
    # a broken sglang import is reported, not raised
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sb, "_kernels", None)
    monkeypatch.setattr(sb, "_import_error", None)
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    for name in [m for m in sys.modules if m.startswith("sglang.")]:  # submodules other tests imported
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sb, "_bare_import", lambda: (_ for _ in ()).throw(ImportError("nope")))
    ok2, why2 = sb.sglang_available()
    assert not ok2 and "sglang" in why2 and "nope" in why2


def test_run_and_time_raise_unavailable_without_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("GPU present")
    p = sb.make_problem(H=2, q_len=2, bs=1, ctx=8, device="cpu", seed=0)
    for fn in (lambda: sb.run_extend_verify(p), lambda: sb.run_decode(p, 2),
               lambda: sb.time_extend_verify(p), lambda: sb.time_decode_splitkv(p, 2)):
        with pytest.raises(sb.SglangUnavailable):
            fn()


def test_import_report_lists_light_deps():
    rep = sb.import_report()
    for name in ("torch", "triton", "sglang", "orjson", "pydantic", "pyzmq", "ipython"):
        assert name in rep
        assert rep[name].startswith(("ok", "missing", "found"))


# --------------------------------------------------------------------------- tree

def test_random_tree_parents_are_earlier_nodes():
    par = sb.random_tree_parents(16, 3, seed=1)
    assert len(par) == 3
    for row in par:
        assert row[0] == -1
        assert all(0 <= p < i for i, p in enumerate(row) if i > 0)


def test_tree_mask_bits_ancestors_and_self():
    bits = sb.tree_mask_bits([[-1, 0, 0, 1, 3]])[0]
    assert bits == [0b1, 0b11, 0b101, 0b1011, 0b11011]
    chain = sb.tree_mask_bits([[-1] + list(range(63))])[0]
    assert chain[62] == (1 << 63) - 1
    assert chain[63] == -1  # all 64 bits set, as signed int64


# --------------------------------------------------------------------------- problem + args (torch, CPU)

torch_cpu = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode != 0,
    reason="torch not installed")


@torch_cpu
@pytest.mark.parametrize("page_size", [1, 4])
def test_make_problem_layout(page_size):
    import torch
    H, q_len, bs, ctx = 4, 5, 3, 37
    p = sb.make_problem(H, q_len, bs, ctx, page_size, device="cpu", seed=3)
    assert p["q"].shape == (bs * q_len, H, 576) and p["q"].dtype == torch.bfloat16
    assert p["kv_cache"].shape[1] == 576 and p["kv_cache"].dtype == torch.bfloat16
    assert p["req_to_token"].shape == (bs, ctx) and p["req_to_token"].dtype == torch.int32
    assert p["kv_lens"].tolist() == [ctx] * bs and p["kv_lens"].dtype == torch.int32
    assert p["tree_mask"].shape == (bs, q_len) and p["tree_mask"].dtype == torch.int64
    slots = p["req_to_token"].long()
    assert slots.unique().numel() == bs * ctx
    assert int(slots.min()) >= page_size  # page 0 unused
    assert int(slots.max()) < p["kv_cache"].shape[0]
    t = torch.arange(ctx)
    assert torch.equal(slots % page_size, (t % page_size).expand(bs, ctx))
    # tokens of one page share the page
    pages = slots // page_size
    for j in range(0, ctx - 1):
        if (j + 1) % page_size:
            assert torch.equal(pages[:, j], pages[:, j + 1])
    # tree mask from parents
    bits = sb.tree_mask_bits(p["parents"].tolist())
    assert p["tree_mask"].tolist() == bits
    with pytest.raises(ValueError):
        sb.make_problem(H, 65, 1, 100, device="cpu")
    with pytest.raises(ValueError):
        sb.make_problem(H, 8, 1, 4, device="cpu")


def _emulate_extend(args, kwargs, block_m=32):
    """What SGLang's _fwd_kernel computes, written from its indexing: prefix
    from k/v_buffer[kv_indices] (custom mask NOT applied to the prefix:
    skip_prefix_custom_mask=True), draft columns from k/v_extend gated by
    custom_mask[mask_indptr[b] + i*(prefix+ext) + prefix + j] and, being causal,
    j < min(ext, (i//BLOCK_M + 1)*BLOCK_M)."""
    import torch
    (q, k_ext, v_ext, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, mask,
     causal, mask_indptr, max_len, k_scale, v_scale) = args
    assert kwargs.get("skip_prefix_custom_mask", True)
    out = torch.zeros(o.shape, dtype=torch.float32)
    sm = kwargs["sm_scale"]
    for b in range(len(qo_indptr) - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ks, ke = int(kv_indptr[b]), int(kv_indptr[b + 1])
        prefix, ext = ke - ks, qe - qs
        assert ext <= max_len
        idx = kv_indices[ks:ke].long()
        K = torch.cat([k_buf[idx, 0].float(), k_ext[qs:qe, 0].float()])
        V = torch.cat([v_buf[idx, 0].float(), v_ext[qs:qe, 0].float()])
        for i in range(ext):
            base = int(mask_indptr[b]) + i * (prefix + ext)
            vis = torch.zeros(prefix + ext, dtype=torch.bool)
            vis[:prefix] = True
            end = min(ext, (i // block_m + 1) * block_m) if causal else ext
            vis[prefix:prefix + end] = mask[base + prefix: base + prefix + end].bool()
            s = (q[qs + i].float() @ K.T) * sm * k_scale  # [H, prefix+ext]
            s = s.masked_fill(~vis, float("-inf"))
            out[qs + i] = torch.softmax(s, -1) @ V * v_scale
    return out


def _emulate_decode(args, kwargs):
    """What decode_attention_fwd computes: every head row of request b attends to
    all kv_indices[kv_indptr[b]:kv_indptr[b+1]] of the pool (no mask)."""
    import torch
    (q, k_buf, v_buf, o, kv_indptr, kv_indices, logits, lse, splits, max_splits,
     sm, k_scale, v_scale) = args
    assert kwargs["has_mla"] and logits.shape[2] == max_splits == int(splits.max())
    assert logits.shape[:2] == q.shape[:2] and logits.shape[3] == 512
    out = torch.zeros(o.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        idx = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        K, V = k_buf[idx, 0].float(), v_buf[idx, 0].float()
        s = (q[b].float() @ K.T) * sm * k_scale
        out[b] = torch.softmax(s, -1) @ V * v_scale
    return out


@torch_cpu
@pytest.mark.parametrize("page_size,q_len", [(1, 4), (16, 7), (1, 40)])
def test_extend_args_match_reference(page_size, q_len):
    import torch
    p = sb.make_problem(H=3, q_len=q_len, bs=2, ctx=q_len + 29, page_size=page_size,
                        device="cpu", seed=5)
    args, kwargs, o = sb._extend_args(p)
    # exact dtypes / shapes SGLang uses
    assert args[1].shape == (2 * q_len, 1, 576) and args[1].is_contiguous()
    assert args[2].shape == (2 * q_len, 1, 512) and args[2].is_contiguous()
    assert args[4].shape[1:] == (1, 576) and args[5].shape[1:] == (1, 512)
    assert args[5].stride(0) == 576  # V is a view of the pool
    assert args[6].dtype == torch.int32 and args[7].dtype == torch.int32
    assert args[8].dtype == torch.int64 and args[9].dtype == torch.bool
    assert args[11].dtype == torch.int64 and args[12] == q_len
    assert kwargs["page_size"] == page_size
    got = _emulate_extend(args, kwargs)
    ref = sb.reference_verify(p)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # the tree matters: without it the answer differs
    assert not torch.allclose(ref, sb.reference_verify(p, ignore_tree=True), atol=1e-3)


@torch_cpu
@pytest.mark.parametrize("page_size", [1, 8])
def test_decode_args_match_untreed_reference(page_size):
    import torch
    p = sb.make_problem(H=2, q_len=3, bs=2, ctx=21, page_size=page_size, device="cpu", seed=9)
    args, kwargs, o, ws = sb._decode_args(p, num_kv_splits=4, use_pdl=False)
    assert args[0].shape == (2, 6, 576)
    assert ws[0].shape == (2, 6, 4, 512) and ws[1].shape == (2, 6, 4)
    assert args[8].tolist() == [4, 4] and args[9] == 4
    got = _emulate_decode(args, kwargs).view(6, 2, 512)
    torch.testing.assert_close(got, sb.reference_verify(p, ignore_tree=True),
                               rtol=1e-4, atol=1e-4)


def test_issued_bytes_models():
    # extend: prefix+draft KV loaded once per (request, head, 32-row tile)
    assert sb.extend_issued_kv_bytes(H=2, q_len=33, bs=1, ctx=100) == 1 * 2 * 2 * 100 * 1152
    heads = 4 * 128
    got = sb.decode_issued_bytes(H=128, q_len=4, bs=1, ctx=1000, num_kv_splits=8)
    assert got == (32 * 1000 * 1152 + heads * 1152 + 2 * heads * 8 * 513 * 4 + heads * 1024)


def test_n_copies_rotates_enough_data():
    assert sb._n_copies(1 << 20) * (1 << 20) >= sb.ROTATE_BYTES
    assert sb._n_copies(300 << 20) == 2
    assert sb._n_copies(2 << 30) == 1
    assert sb._n_copies(1) == sb.MAX_COPIES


# --------------------------------------------------------------------------- run_bench --gpus

def test_assign_shards_covers_every_shape_once_and_balances():
    import run_bench

    grid = run_bench.FULL
    for n in (1, 2, 3, 4):
        shares = run_bench.assign_shards(grid, n)
        assert len(shares) == n
        flat = sorted(i for s in shares for i in s)
        assert flat == list(range(len(grid)))
        loads = [sum(run_bench._shape_cost(grid[i]) for i in s) for s in shares]
        # LPT: no GPU carries more than the mean plus the largest single shape
        assert max(loads) <= sum(loads) / n + max(run_bench._shape_cost(g) for g in grid) + 1e-9


def test_run_bench_gpus_argument_is_checked():
    import run_bench

    assert run_bench._parse(["--gpus", "all"]).gpus == "all"
    assert run_bench._parse(["--gpus", "2"]).gpus == 2
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            run_bench._parse(["--gpus", bad])


def test_run_bench_grid_filters():
    import run_bench

    a = run_bench._parse(["--grid", "full", "--heads", "64", "--page-sizes", "64", "--batches", "4"])
    g = run_bench._select_grid(a)
    assert g and all(s[0] == 64 and s[4] == 64 and s[2] == 4 for s in g)
    assert len(g) == 4  # four contexts
    q1 = run_bench._select_grid(run_bench._parse(["--grid", "full", "--q-lens", "1"]))
    assert q1 and len(q1) == 4 and all(s[:2] == (8, 1) for s in q1)  # H 8 plain decode, bs 1 / 4, 4k / 64k


def test_run_sharded_merges_only_this_runs_shards_on_the_visible_gpus(tmp_path, monkeypatch):
    """Workers get the parent's visible GPUs in order; a worker that dies before writing leaves a partial
    record (exit 1) and an earlier run's leftover shard record is never merged."""
    import json
    import types
    from pathlib import Path

    import run_bench

    grid = run_bench.FULL[:6]
    monkeypatch.setattr(run_bench, "build", lambda *a, **k: types.SimpleNamespace(built=[], failed=[]))
    monkeypatch.setattr(run_bench, "_versions", lambda: dict(device="fake"))
    finished = []
    monkeypatch.setattr(run_bench, "_finish", lambda rec, out: finished.append(rec))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    (tmp_path / "gpu1").mkdir()
    (tmp_path / "gpu1" / "bench.json").write_text(json.dumps(dict(rows=[dict(grid_index=99)], nsplit_sweep=[], ceilings={})))
    seen = {}

    class FakeWorker:
        def __init__(self, cmd, stdout, stderr, env):
            ids = [int(i) for i in cmd[cmd.index("--shard") + 1].split(",")]
            assert cmd[-2] == "--out" and cmd[cmd.index("--shard") - 1] == "1"  # --gpus 1 for the worker
            seen[env["CUDA_VISIBLE_DEVICES"]] = ids
            self.rc = 1 if env["CUDA_VISIBLE_DEVICES"] == "3" else 0  # GPU 3's worker dies before writing
            if self.rc == 0:
                rows = [dict(grid_index=i) for i in reversed(ids)]
                Path(cmd[-1], "bench.json").write_text(json.dumps(dict(rows=rows, nsplit_sweep=[], ceilings={})))

        def wait(self):
            return self.rc

    monkeypatch.setattr(subprocess, "Popen", FakeWorker)
    argv = ["--grid", "full", "--gpus", "2", "--skip-sglang"]
    rc = run_bench._run_sharded(run_bench._parse(argv), grid, 2, tmp_path, argv)
    assert rc == 1 and sorted(seen) == ["2", "3"]
    assert sorted(seen["2"] + seen["3"]) == list(range(len(grid)))
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert rec["partial"] is True
    assert [r["grid_index"] for r in rec["rows"]] == sorted(seen["2"])  # grid order, no stale row 99
    assert all(r["gpu"] == 0 for r in rec["rows"]) and len(finished) == 1
    assert not (tmp_path / "gpu1" / "bench.json").exists()


def test_fp8_sweep_columns_and_problem():
    """--fp8: each bucket's e4m3 sweep is dimsplit with a producer and two converter warps (all feasible at
    the grid's H8 / H16 shapes); the fp8 problem is the same problem with its KV cast to e4m3; the row text
    shows µs, the ratio to the bf16 dimsplit time and the fraction of the halved-KV floor; the tuning
    sweep includes the two-producer dimsplit build (num_warps = row_tiles + 2)."""
    torch = pytest.importorskip("torch")
    import run_bench

    from mlagen.feasibility import infeasible_reason
    from mlagen.spec import parse_spec

    assert run_bench._parse(["--fp8"]).fp8 and not run_bench._parse([]).fp8
    for H, q in ((8, 9), (16, 9), (8, 1)):
        for fn, schedule in ((run_bench.fp8_tuning_spec, "dimsplit"), (run_bench.dimsplit_t_fp8_tuning_spec, "dimsplit_t")):
            vs = parse_spec(fn(H, q, 1)).variants()
            ok = [v for v in vs if infeasible_reason(v) is None]
            assert ok and all(v.dtype == "fp8_e4m3" and v.schedule == schedule for v in ok), (H, q, schedule)
    assert 7 in run_bench.tuning_spec(8, 9, 1)["num_warps"]  # rt5 + 2: two producer warps
    p = dict(kv_cache=torch.randn(10, 1, 576).to(torch.bfloat16), q=torch.zeros(2))
    pf = run_bench.fp8_problem(p)
    assert pf["kv_cache"].dtype == torch.float8_e4m3fn and pf["q"] is p["q"]
    assert torch.equal(pf["kv_cache"].float(), p["kv_cache"].float().to(torch.float8_e4m3fn).float())
    (v,) = [v for v in parse_spec(run_bench.fp8_tuning_spec(8, 9, 1)).variants() if v.stages == 3]
    r = dict(H=8, q_len=9, bs=1, ctx=65536, page_size=1, mlagen_uri=v.uri.replace("fp8e4m3", "bf16"),
             mlagen_us=84.0, gbs=900.0, frac_floor=0.21, floor_us=18.1, fp8_uri=v.uri, fp8_us=70.0,
             fp8_schedule="dimsplit", fp8_over_bf16_schedule=70.0 / 84.0, fp8_frac_floor=0.13, fp8_floor_us=9.1)
    text = run_bench._fmt(r)  # a row of an older bench.json (one floor)
    assert "| fp8 lw128_bn32_w8_rt5_st3_dimsplit_fp8    70.0 us (0.83x bf16 dimsplit) 0.13 of fp8 floor (9.1 us)" in text
    r.update(fp8_mem_floor_us=9.0, fp8_frac_mem_floor=9.0 / 70.0, fp8_floor_us=16.1, fp8_frac_floor=16.1 / 70.0)
    text = run_bench._fmt(r)  # the memory floor and the roofline (MMA-bound at H8 q9), both
    assert ("| fp8 lw128_bn32_w8_rt5_st3_dimsplit_fp8    70.0 us (0.83x bf16 dimsplit) 0.13 of the fp8 memory floor "
            "(9.0 us; roofline 16.1 us: 0.23)") in text


def test_fp8_triton_column_and_extend_args():
    """--fp8 with SGLang: Triton's verify kernel gets the e4m3 pool as its k/v buffers and the draft rows'
    values in bf16 as k_extend (the layer's k is bf16); the copies rotate the pool's real bytes; the row
    text carries Triton's fp8 time and both errors against the fp32 reference."""
    torch = pytest.importorskip("torch")
    import run_bench
    import sglang_baselines as sgl
    from mlagen.spec import parse_spec

    p = sgl.make_problem(8, 3, 2, 40, 1, seed=int(torch.randint(0, 1000, (1,))), device="cpu")
    pf = run_bench.fp8_problem(p)
    args, _kw, _o = sgl._extend_args(pf)
    k_extend, k_buffer = args[1], args[4]
    assert k_buffer.dtype == torch.float8_e4m3fn and k_extend.dtype == torch.bfloat16
    slots = pf["req_to_token"][:, 40 - 3:].reshape(-1).long()
    assert torch.equal(k_extend.reshape(-1, 576), pf["kv_cache"][slots].to(torch.bfloat16))
    assert sgl._problem_bytes(p) - sgl._problem_bytes(pf) == 2 * 40 * 576
    (v,) = [v for v in parse_spec(run_bench.fp8_tuning_spec(8, 9, 1)).variants() if v.stages == 3]
    r = dict(H=8, q_len=9, bs=1, ctx=65536, page_size=1, mlagen_uri=v.uri.replace("fp8e4m3", "bf16"),
             mlagen_us=84.0, gbs=900.0, frac_floor=0.21, floor_us=18.1, fp8_uri=v.uri, fp8_us=90.0,
             fp8_frac_floor=0.18, fp8_floor_us=15.9, fp8_sglang_verify_us=9000.0, fp8_sglang_err=0.25,
             fp8_mlagen_err=0.004)
    text = run_bench._fmt(r)
    assert "triton fp8 verify    9000.0 us ( 100.0x), max err vs fp32 ref triton 0.25 mlagen 0.004" in text
    r2 = dict(r, fp8_sglang_error="RuntimeError: no fp8")
    for k in ("fp8_sglang_verify_us", "fp8_sglang_err", "fp8_mlagen_err"):
        r2.pop(k)
    assert "triton fp8: RuntimeError: no fp8" in run_bench._fmt(r2)


def test_build_only_compiles_both_sweeps_of_each_bucket_and_needs_no_gpu(monkeypatch, capsys):
    """--build-only builds the tuning sweep and the dimsplit_t sweep of every selected (H, q_len, page size)
    bucket (the --kernels glob passed through), never asks for a GPU, and exits 1 when a module failed."""
    import types

    import run_bench
    from mlagen.spec import parse_spec

    calls = []

    def fake_build(spec, kernels=None, jobs=None):
        calls.append((spec.name, kernels))
        return types.SimpleNamespace(built=[object()] * 2, failed=[])

    monkeypatch.setattr(run_bench, "build", fake_build)
    monkeypatch.setattr(run_bench.torch.cuda, "is_available", lambda: pytest.fail("--build-only asked for a GPU"))
    assert run_bench.main(["--grid", "small", "--heads", "8", "--page-sizes", "1", "--build-only",
                           "--kernels", "*dimsplit_t*"]) == 0
    assert sorted(calls) == sorted([("bench_h8_q9_ps1", "*dimsplit_t*"), ("bench_dst_h8_q9_ps1", "*dimsplit_t*"),
                                    ("bench_h8_q1_ps1", "*dimsplit_t*"), ("bench_dst_h8_q1_ps1", "*dimsplit_t*")])
    assert "built 8 variants, 0 failed" in capsys.readouterr().out
    (v,) = [v for v in parse_spec(run_bench.dimsplit_t_tuning_spec(8, 9, 1)).variants()
            if v.nsplit == "auto" and v.block_n == 32 and v.stages == 3]
    assert v.schedule == "dimsplit_t" and v.row_tiles == 3 and v.num_warps == 8
    failed = (types.SimpleNamespace(uri="mla_verify_x"), "nvcc: error")
    monkeypatch.setattr(run_bench, "build", lambda *a, **k: types.SimpleNamespace(built=[], failed=[failed]))
    assert run_bench.main(["--grid", "small", "--heads", "8", "--page-sizes", "1", "--build-only"]) == 1


def test_ncu_stall_groups_splits_samples_by_execution_count(tmp_path):
    """tools/ncu_stall_groups.py sums each execution count's samples and stall reasons, and charges an mbarrier
    wait with its try-wait and the spin branch after it (a synthetic ncu source-page CSV with random counts)."""
    import random
    import subprocess
    import sys
    from pathlib import Path

    rng = random.Random()
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
           "# Samples", "Instructions Executed", "stall_wait", "stall_long_sb", "stall_wait (Not Issued)"]
    a, b, c, d = (rng.randint(1, 500) for _ in range(4))
    rows = [  # (source, samples, executions, wait, long_sb); the 4096 group starts at 0x10, not at address 0
        ("LDG.E R5, desc[UR4][R6.64]", 7, 128, 7, 0),
        ("HMMA.16816.F32.BF16 R4, R8, R12, R4", a, 4096, a, 0),
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ+0x100], R3", b, 4096, 0, b),
        ("IMAD R1, R2, R3, R4", c, 4096, c, 0),
        ("@!P0 BRA 0x7f0", d, 4096, 0, d),
    ]
    path = tmp_path / "r.csv"
    with open(path, "w") as f:
        f.write('"Kernel Name","k"\n' + ",".join(f'"{h}"' for h in hdr) + "\n")
        for k, (src, s, ex, w, lsb) in enumerate(rows):
            f.write(",".join(f'"{x}"' for x in (hex(16 * k), src, s, s, s, ex, w, lsb, 0)) + "\n")
    tool = Path(__file__).resolve().parent.parent / "tools" / "ncu_stall_groups.py"
    out = subprocess.run([sys.executable, str(tool), str(path)], capture_output=True, text=True, check=True).stdout
    total = a + b + c + d + 7
    assert f"{total} warp-state samples, 5 instructions" in out
    assert f"| 4096 | 4 | {a + b + c + d} | {100 * (a + b + c + d) / total:.1f}% |" in out
    assert "| 128 | 1 | 7 |" in out
    assert f"[R2+URZ+0x100]  {b + d} samples" in out  # the try-wait and its spin branch, not the IMAD between
    # --group: one execution count's instructions by opcode (predicate stripped, mnemonic before the first '.')
    out = subprocess.run([sys.executable, str(tool), str(path), "--group", "4096", "--top", "2"], capture_output=True,
                         text=True, check=True).stdout
    grp = out.split("execution count 4096:", 1)[1]
    assert grp.startswith(f" 4 instructions, {a + b + c + d} samples; stall reasons: ")
    reasons = dict(kv.rsplit(" ", 1) for kv in grp.split("\n", 1)[0].split("stall reasons: ", 1)[1].split(", "))
    assert reasons == {"wait": str(a + c), "long_sb": str(b + d)}
    share = lambda s: f"{100 * s / (a + b + c + d):.1f}%"  # noqa: E731
    assert f"| HMMA | 1 | {a} | {share(a)} | wait {a} |" in grp and f"| IMAD | 1 | {c} | {share(c)} | wait {c} |" in grp
    assert f"| SYNCS | 1 | {b} | {share(b)} | long_sb {b} |" in grp
    assert f"| BRA | 1 | {d} | {share(d)} | long_sb {d} |" in grp
    assert "LDG" not in grp  # another execution count
    listed = grp.split("most-sampled instructions", 1)[1].strip().splitlines()[1:]
    top2 = sorted([(a, 0x0), (b, 0x10), (c, 0x20), (d, 0x30)], key=lambda t: -t[0])[:2]
    assert len(listed) == 2 and [ln.split()[0] for ln in listed] == [f"+0x{off:05x}" for _, off in top2]
    out = subprocess.run([sys.executable, str(tool), str(path), "--group", "5"], capture_output=True, text=True,
                         check=True).stdout
    assert "no instructions executed 5 times" in out


def test_device_session_refuses_an_unknown_mode_before_any_setup(tmp_path):
    """A misspelled mode stops with one line and exit 2 before device_env.sh runs (no wheel install, no
    `pip install -e .`, no $OUT written); it used to fall through to the bench."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "device_session.sh"), "test"], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(out)}, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "unknown mode 'test'" in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("defines, msg", [(None, "give AB_DEFINES"), ("   ", "give AB_DEFINES"),
                                          ("FOO", "'FOO' is not NAME=V0,V1"), ("FOO=1", "'FOO=1' is not NAME=V0,V1"),
                                          ("A=0,1 B=1,", "'B=1,' is not NAME=V0,V1"), ("1X=0,1", "'1X=0,1' is not")])
def test_device_session_ab_refuses_bad_defines_before_any_setup(tmp_path, defines, msg):
    """`device_session.sh ab` checks AB_DEFINES (words NAME=V0,V1[,..]) before device_env.sh runs: one line, exit 2,
    no $OUT, so a malformed A/B costs no device time on wheels, the install or KTESTS' GPU tests."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "AB_DEFINES"}
    env.update(OUT=str(out), KTESTS="x")
    if defines is not None:
        env["AB_DEFINES"] = defines
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "device_session.sh"), "ab"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and msg in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("trace_defines, msg", [("FOO", "'FOO' is not NAME=VALUE"), ("A=1 B=0,1", "'B=0,1' is not"),
                                                 ("A=", "'A=' is not"), ("A=x/y", "'A=x/y' is not"),
                                                 ("A=*", "'A=*' is not")])
@pytest.mark.parametrize("mode", ["ab", "trace"])
def test_device_session_refuses_bad_trace_defines_before_any_setup(tmp_path, trace_defines, msg, mode):
    """`device_session.sh trace` and `ab` check TRACE_DEFINES (words NAME=VALUE, one build each) before any set-up."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), AB_DEFINES="MLAGEN_ABLATE=0,1", TRACE="1", TRACE_DEFINES=trace_defines)
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "device_session.sh"), mode], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and msg in r.stderr
    assert not out.exists()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU host would build and run the variant")
def test_device_profile_needs_a_gpu_in_one_line():
    """tools/device_profile.py without a GPU: one line and exit 1, not a traceback from torch's CUDA generator."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "device_profile.py"),
                        "mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90",
                        "4096", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("masks, msg, uri", [
    ("2,x", "comma-separated integers expected", None), ("2,3", "no ablation [3]", None),
    ("64", "drop the e4m3 conversion of an fp8_e4m3 dimsplit_t build",  # the default uri is a bf16 rowblock one
     None),
    ("8", "uri:", "not_a_uri"),
    ("303", "drops the page-table loads of the bf16 dimsplit / dimsplit_t producer", None),  # rowblock: no such loads
    ("33", "drops the score exchange of a dimsplit_t build", None),  # rowblock: no exchange
    ("256", "drops the page-table loads",
     "mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st2_dimsplit_t_tree_fp8e4m3_sm120_sm90")])
def test_device_ablate_refuses_bad_masks_in_one_line(masks, msg, uri):
    """tools/device_ablate.py --masks: a non-integer, an unknown mask, an fp8-conversion mask on a build without the
    conversion, a page-table mask on a build whose producer has no such loads, or a bad uri stops with one line,
    before the GPU check and before any build."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "device_ablate.py"), *([uri] if uri else []),
                        "--masks", masks], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="on a GPU machine the tool would build and time")
def test_device_ablate_accepts_the_path_masks():
    """The two single-path ablations (33: math + handoffs, no KV loads and no exchange; 46: loads + handoffs, no math
    and no exchange; perf-notes v37) pass the mask check on a dimsplit_t build: the run stops only at the GPU check."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "device_ablate.py"),
                        "mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90",
                        "--masks", "46,33"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr and "no ablation" not in r.stderr, r.stderr


def test_run_bench_never_replaces_files_it_did_not_write(tmp_path, capsys):
    """--out: bench.json / bench.png (and gpuK/bench.json / bench.log of a --gpus run) may replace only what an earlier
    run wrote; anything else of those names stops the run before it measures or writes anything."""
    import json

    import run_bench

    from mlagen.plot import plot_time_vs_context

    out = tmp_path / "out"
    assert run_bench.out_dir_problem(out) is None  # not there yet
    out.mkdir()
    (out / "bench.json").write_text(json.dumps(dict(rows=[], ceilings={})))  # an earlier run's
    plot_time_vs_context({"a": [(1, 1.0), (2, 2.0)]}, str(out / "bench.png"), "t")
    (out / "gpu0").mkdir()
    (out / "gpu0" / "bench.log").write_text(run_bench.WORKER_LOG_HEADER + "measured ...\n")
    assert run_bench.out_dir_problem(out) is None
    for rel, text in [("bench.json", '{"my": "results"}'), ("bench.png", "my picture"),
                      ("gpu0/bench.log", "my notes\n"), ("gpu1/bench.json", "[1, 2]")]:
        user = out / rel
        user.parent.mkdir(exist_ok=True)
        saved = user.read_bytes() if user.exists() else None
        user.write_text(text)
        assert str(user) in run_bench.out_dir_problem(out)
        assert run_bench.main(["--out", str(out), "--grid", "small", "--skip-sglang"]) == 2
        assert user.read_text() == text and "was not written by bench/run_bench.py" in capsys.readouterr().err
        if saved is None:
            user.unlink()
        else:
            user.write_bytes(saved)
    (tmp_path / "afile").write_text("x")
    assert "is not a directory" in run_bench.out_dir_problem(tmp_path / "afile")


def _env_checkout(tmp_path):
    """A copy of tools/device_env.sh in a stand-in checkout, with a python3 that does nothing (no pip install)."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "co" / "tools").mkdir(parents=True)
    shutil.copy(root / "tools" / "device_env.sh", tmp_path / "co" / "tools" / "device_env.sh")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "bin" / "python3").chmod(0o755)
    return tmp_path / "co"


def _alive(marker: str) -> list[str]:
    import subprocess

    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    return [p for p in out if p.isdigit()]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_device_env_stops_every_step_and_its_children_on_a_signal(tmp_path, sig):
    """tools/device_env.sh's step(): a signal to the script (as Ctrl-C reaches a terminal's foreground group) stops
    the script, a parallel part's running step and the foreground step, children included, and no further step
    starts; a step past its limit has its whole process tree killed."""
    import os
    import signal as signal_mod
    import subprocess
    import time

    co = _env_checkout(tmp_path)
    marker = f"sleep 3{os.getpid() % 100:02d}.5"
    (co / "tools" / "s.sh").write_text(
        "set -u\n. \"$(dirname \"$0\")/device_env.sh\"\n"
        f"( step a 100 bash -c '{marker} & {marker}; wait'; step a2 100 {marker} ) > \"$OUT/p.txt\" 2>&1 &\n"
        f"step b 100 bash -c '{marker} & {marker}; wait'\necho after-b\nwait\n")
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", OUT=str(tmp_path / "out"))
    p = subprocess.Popen(["bash", str(co / "tools" / "s.sh")], env=env, start_new_session=True, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(_alive(marker)) < 4 and time.monotonic() < deadline:  # 2 steps x (timeout, bash, 2 sleeps)
            time.sleep(0.1)
        assert len(_alive(marker)) >= 4
        os.killpg(p.pid, getattr(signal_mod, sig))
        out = p.communicate(timeout=30)[0]
        time.sleep(1)
        assert p.returncode == 130 and "after-b" not in out, out
        assert _alive(marker) == [], "processes left running"
        assert not (tmp_path / "out" / "a2.log").exists(), "a step started after the signal"
        assert not [f for f in os.listdir(tmp_path / "out") if f.startswith(".steps.") or f.startswith(".session")]
    finally:
        for pid in _alive(marker):
            os.kill(int(pid), signal_mod.SIGKILL)
    (co / "tools" / "t.sh").write_text(
        "set -u\n. \"$(dirname \"$0\")/device_env.sh\"\n"
        f"step late 1 bash -c '{marker} & {marker}; wait'\n")
    r = subprocess.run(["bash", str(co / "tools" / "t.sh")], env=env, capture_output=True, text=True, timeout=60)
    time.sleep(0.5)
    assert "late: rc=124" in r.stdout and "TIMED OUT at 1s" in r.stdout, r.stdout
    assert _alive(marker) == []
