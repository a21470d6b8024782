"""Tensor checks of the Python wrapper: every bad input raises ValueError before any launch."""

import types

import pytest
import torch

import mlagen.ops as ops_mod
from mlagen.ops import VerifyKernel, auto_num_splits
from mlagen.spec import parse_spec


class RecordingModule:
    """Stands in for the compiled module; records launches (there must be none on bad input)."""

    def run(self, *args):
        self.calls += 1

    smem_bytes = 87520  # the K2 bulk bn32 rt1 variant's shared memory

    def __init__(self, occupancy=1, clusters=0):
        self.calls = 0
        self.occupancy = occupancy
        self.clusters = clusters  # cudaOccupancyMaxActiveClusters of a cluster build (0: the query failed)

    def max_active_ctas_per_sm(self):
        return self.occupancy

    def max_active_clusters(self):
        return self.clusters


def _kernel(**kw):
    v = parse_spec(dict(dict(heads_per_rank=8, q_len=9, nsplit=16, load_width=128), **kw)).variants()[0]
    k = VerifyKernel.__new__(VerifyKernel)
    k.variant, k.so_path, k.module, k._sm, k.smem_per_sm_cap = v, None, RecordingModule(), {}, None
    k.fused_merge = True
    return k


def _inputs(bs=2, q_len=9, H=8):
    return dict(
        q=torch.randn(bs * q_len, H, 576).to(torch.bfloat16),
        kv_cache=torch.randn(100, 576).to(torch.bfloat16),
        block_table=torch.randint(0, 100, (bs, 20), dtype=torch.int32),
        kv_lens=torch.randint(9, 20, (bs,), dtype=torch.int32),
        tree_mask=torch.ones(bs, q_len, dtype=torch.int64),
    )


def _call(k, d, **kw):
    d = dict(d)
    q_len = kw.pop("q_len", 9)
    return k(d.pop("q"), d.pop("kv_cache"), d.pop("block_table"), d.pop("kv_lens"), q_len=q_len,
             softmax_scale=kw.pop("softmax_scale", 0.1), **d, **kw)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(q=d["q"].float()), "q must be torch.bfloat16, got torch.float32"),
        (lambda d: d.update(q=d["q"][:, :4]), "q must have shape (18, 8, 576), got (18, 4, 576)"),
        (lambda d: d.update(q=torch.randn(18, 8, 1152).to(torch.bfloat16)[..., ::2]), "q must have a contiguous last dim"),
        (lambda d: d.update(kv_cache=d["kv_cache"][:, :512]), "kv_cache last dim must be 576"),
        (lambda d: d.update(kv_cache=d["kv_cache"].view(100, 2, 288)), "kv_cache must be [num_slots, 576] or [num_slots, 1, 576]"),
        (lambda d: d.update(kv_cache=torch.randn(101 * 576 + 4).to(torch.bfloat16)[4:].view(101, 576)),
         "kv_cache rows must be contiguous and 16-byte aligned for load_width 128"),
        (lambda d: d.update(block_table=d["block_table"].long()), "block_table must be torch.int32, got torch.int64"),
        (lambda d: d.update(block_table=d["block_table"][:1]), "block_table has 1 rows for a batch of 2"),
        (lambda d: d.update(kv_lens=d["kv_lens"].long()), "kv_lens must be torch.int32, got torch.int64"),
        (lambda d: d.update(tree_mask=None), "uses a tree mask: pass tree_mask int64 [bs, q_len]"),
        (lambda d: d.update(tree_mask=d["tree_mask"].int()), "tree_mask must be torch.int64"),
        (lambda d: d.update(tree_mask=d["tree_mask"][:, :3]), "tree_mask must have shape (2, 9)"),
        (lambda d: d.update(out=torch.empty(18, 8, 512)), "out must be torch.bfloat16"),
        (lambda d: d.update(lse=torch.empty(18, 8, dtype=torch.float64)), "lse must be torch.float32"),
        (lambda d: d.update(req_pool_indices=torch.zeros(2, dtype=torch.int16)), "req_pool_indices must be int32 or int64"),
        (lambda d: d.update(workspace=torch.empty(10, dtype=torch.float64)), "workspace must be torch.float32"),
        (lambda d: None, "all tensors must be on a CUDA device"),
    ],
)
def test_bad_tensor_raises_before_launch(mutate, message):
    k = _kernel()
    d = _inputs()
    mutate(d)
    with pytest.raises(ValueError) as e:
        _call(k, d)
    assert message in str(e.value)
    assert k.module.calls == 0


@pytest.mark.parametrize("q_len, scale, message", [(10, 0.1, "q_len must be an int in [1, 9]"),
                                                    (0, 0.1, "q_len must be an int in [1, 9]"),
                                                    (9, float("nan"), "softmax_scale must be a finite float > 0"),
                                                    (9, -1.0, "softmax_scale must be a finite float > 0")])
def test_bad_scalars(q_len, scale, message):
    k = _kernel()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _call(k, _inputs(), q_len=q_len, softmax_scale=scale)
    assert k.module.calls == 0


def test_workspace_sizing_and_split_policy():
    k = _kernel()
    v = k.variant
    assert k.num_splits(4) == 16
    assert k.workspace_numel(4) == 16 + 4 * 16 * v.rows_max * (512 + 1)  # the merge-counter header, then the partials
    a = _kernel(nsplit="auto")
    a._sm[0] = 132  # 132 SMs x 1 CTA/SM, as on an H200 at this variant's occupancy
    assert a.num_splits(1, torch.device("cuda", 0)) == 44  # 3 row blocks x 44 = all 132 slots, one wave
    assert a.num_splits(64, torch.device("cuda", 0)) == auto_num_splits(64 * 3, 132)
    assert a.min_tiles_per_split() == ops_mod.AUTO_MIN_TOKENS_PER_SPLIT // a.variant.block_n
    assert k.min_tiles_per_split() == 1  # fixed nsplit: every split its share, however short


def test_split_count_and_workspace_off_a_gpu_are_one_line_errors():
    """nsplit auto's split count and workspace size are a GPU's: asked for a CPU device they are a ValueError, and with
    no GPU at all (device None or "cuda") a RuntimeError, both before any CUDA query (not torch's assertion); a fixed
    nsplit needs no GPU to count."""
    a, k = _kernel(nsplit="auto"), _kernel()
    for call in (lambda: a.num_splits(1, torch.device("cpu")), lambda: a.workspace_numel(4, "cpu"),
                 lambda: a.alloc_workspace(2, "cpu")):
        with pytest.raises(ValueError, match="cpu is not a CUDA device"):
            call()
    assert k.num_splits(4, torch.device("cpu")) == 16 and a._sm == {}
    if not torch.cuda.is_available():
        for call in (lambda: a.num_splits(1), lambda: a.workspace_numel(4), lambda: a.cta_slots("cuda")):
            with pytest.raises(RuntimeError, match="no CUDA GPU"):
                call()


@pytest.mark.parametrize("units, slots", [(1, 132), (3, 132), (5, 264), (20, 264), (72, 132), (80, 132),
                                          (288, 132), (1000, 188), (7, 188), (1, 264), (1, 376), (2, 600)])
def test_auto_num_splits_fills_whole_waves(units, slots):
    """The waves are those of the smallest count within the slack of the best wave cost over every legal
    count, and the count is the largest that runs in that many waves (brute force over 1..256, so the test
    fails if the search or the fill is wrong)."""
    s = auto_num_splits(units, slots)
    waves = lambda n: -(-units * n // slots)  # noqa: E731
    cost = lambda n: waves(n) / n  # noqa: E731 - waves per unit of work
    best = min(cost(n) for n in range(1, 257))
    s0 = next(n for n in range(1, 257) if cost(n) <= best * 1.03)
    assert s == max(n for n in range(s0, 257) if waves(n) == waves(s0))
    assert cost(s) <= cost(s0) <= best * 1.03
    assert auto_num_splits(units, slots, fill_waves=False) == s0
    if units < slots:  # never fewer CTAs than a single split per slot-filling wave would give
        assert units * s >= min(slots, units * 256) * 0.9


def test_cluster_schedule_takes_one_full_wave_over_two():
    """dimsplit (2 CTAs per split, 1 CTA per SM on 132 SMs): at bs 4 the 3 % slack took 33 splits (two waves
    of 264 CTAs); fixed 16 (one wave of 128) ran 1.02-1.28x faster on the H200. The cluster slack takes 16
    there and keeps bs 1 at about one wave of 2-CTA splits; rowblock variants keep the 3 % slack."""
    assert auto_num_splits(4 * 2, 132) == 33
    assert auto_num_splits(4 * 2, 132, slack=ops_mod.AUTO_WAVE_SLACK_CLUSTER) == 16
    # bs 1: the slack's 63 splits fill to 66 (132 CTAs on 132 SMs); H200 dimsplit_t 1.4-2.8 % faster at 32k-128k
    assert auto_num_splits(1 * 2, 132, slack=ops_mod.AUTO_WAVE_SLACK_CLUSTER, fill_waves=False) == 63
    assert auto_num_splits(1 * 2, 132, slack=ops_mod.AUTO_WAVE_SLACK_CLUSTER) == 66
    assert auto_num_splits(1 * 2, 188, slack=ops_mod.AUTO_WAVE_SLACK_CLUSTER) == 94  # RTX PRO 6000: 188 SMs
    ds = _kernel(nsplit="auto", schedule="dimsplit", row_tiles=5, block_n=32, load_width=128, stages=3)
    ds._sm[0] = 132
    dev = torch.device("cuda", 0)
    assert ds.variant.ctas_per_row_block == 2 and ds.auto_slack == ops_mod.AUTO_WAVE_SLACK_CLUSTER
    assert ds.num_splits(4, dev) == 16
    assert ds.min_tiles_per_split() == ops_mod.AUTO_MIN_TOKENS_PER_SPLIT_CLUSTER // 32 == 3
    # the workspace covers every batch size's splits under the same slack
    for bs in range(1, 40):
        assert ds.workspace_numel(bs, dev) >= bs * ds.num_splits(bs, dev) * ds.variant.rows_max * 513
    rb = _kernel(nsplit="auto")
    assert rb.auto_slack == ops_mod.AUTO_WAVE_SLACK
    with pytest.raises(ValueError, match="slack"):
        auto_num_splits(8, 132, slack=0.9)


def test_auto_split_beats_one_wave_when_few_ctas_per_request():
    # H=64, bs=4, 18 row blocks on 132 SMs: one split = 72 CTAs (55 % of the slots); measured on the
    # H200 grid, 16 fixed splits ran 1.64-1.81x faster than that. The policy must not pick 1 there.
    assert auto_num_splits(72, 132) > 1
    with pytest.raises(ValueError, match="positive"):
        auto_num_splits(0, 132)


def test_workspace_overlapping_an_input_is_rejected(monkeypatch):
    k = _kernel()
    d = _inputs()
    big = torch.empty(k.workspace_numel(2) + 18 * 8 * 512, dtype=torch.float32)
    out = big[: 18 * 8 * 512 // 2].view(torch.bfloat16).view(18, 8, 512)  # out lives inside the workspace
    # pretend every tensor is on a GPU so that only the overlap check can refuse
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    with pytest.raises(ValueError, match="workspace overlaps out"):
        _call(k, d, out=out, workspace=big)
    assert k.module.calls == 0


def test_bool_q_len_and_huge_scale_rejected():
    k = _kernel()
    with pytest.raises(ValueError, match="q_len must be an int"):
        _call(k, _inputs(), q_len=True)
    with pytest.raises(ValueError, match="fp32 range"):
        _call(k, _inputs(), softmax_scale=1e300)


def test_auto_split_uses_the_emulated_occupancy(monkeypatch):
    """With an sm_120-sized shared memory per SM, a variant that fits 2 CTAs per H200 SM counts as 1."""
    import contextlib

    import mlagen.ops as ops

    monkeypatch.setattr(ops, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(torch.cuda, "device", lambda idx: contextlib.nullcontext())
    a = _kernel(nsplit="auto")
    a.module.occupancy = 2
    two = a.num_splits(1, torch.device("cuda", 0))
    assert a._sm[0] == 264
    a._sm.clear()
    a.smem_per_sm_cap = ops.SM120_SMEM_PER_SM
    one = a.num_splits(1, torch.device("cuda", 0))
    assert a._sm[0] == 132  # 102,400 // (87,520 + 1,024) = 1 CTA per SM
    assert one < two


@pytest.mark.parametrize("clusters, slots, bs1_splits", [(66, 132, 66), (0, 132, 66), (93, 186, 93), (200, 188, 94)])
def test_cluster_slots_are_capped_by_resident_clusters(monkeypatch, clusters, slots, bs1_splits):
    """A GPU whose GPCs hold an odd number of SMs fits fewer 2-CTA clusters than SMs / 2: the split count filled to the
    SM count would run its last clusters in a second wave. cta_slots takes at most max_active_clusters() x 2 (the H200:
    66 clusters on 132 SMs, no change; a failed query, 0, keeps the SM count). Rowblock builds never ask."""
    import contextlib

    import mlagen.ops as ops

    sms = 188 if clusters >= 93 else 132
    monkeypatch.setattr(ops, "_sm_count", lambda dev: sms)
    monkeypatch.setattr(torch.cuda, "device", lambda idx: contextlib.nullcontext())
    dst = _kernel(nsplit="auto", schedule="dimsplit_t", row_tiles=3, num_warps=8, block_n=32, stages=4)
    dst.module.clusters = clusters
    dev = torch.device("cuda", 0)
    assert dst.cta_slots(dev) == slots
    assert dst.num_splits(1, dev) == bs1_splits
    assert dst.workspace_numel(1, dev) >= dst.num_splits(1, dev) * dst.variant.rows_max * 513
    rb = _kernel(nsplit="auto")
    rb.module.clusters = 1  # would cap a cluster build to 2 slots; a rowblock build ignores it
    assert rb.cta_slots(dev) == sms
    # a module built before the query existed (an installed state from an older mlagen): no cap, no error
    old = _kernel(nsplit="auto", schedule="dimsplit_t", row_tiles=3, num_warps=8, block_n=32, stages=4)
    old.module = types.SimpleNamespace(smem_bytes=95296, max_active_ctas_per_sm=lambda: 1)
    assert old.cta_slots(dev) == sms and old.num_splits(1, dev) == sms // 2


def test_load_module_refuses_a_second_file_under_one_name(tmp_path):
    """CPython silently returns the first extension imported under a name: load_module must refuse a
    different build, and accept the same build from another cache (same file name or same bytes)."""
    import shutil
    import subprocess
    import sysconfig

    import pybind11

    from mlagen.ops import load_module

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    name = f"mlagen_ldtest_{tmp_path.name.replace('-', '_')}"
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    sos = []
    for value in (7, 11):
        src = tmp_path / f"m{value}.cpp"
        src.write_text(f"#include <pybind11/pybind11.h>\nPYBIND11_MODULE({name}, m) {{ m.def(\"v\", [] {{ return {value}; }}); }}\n")
        so = tmp_path / f"{name}.v{value}{ext}"  # registry-style names: module name + build hash
        subprocess.run([cxx, "-O0", "-shared", "-fPIC", f"-I{pybind11.get_include()}",
                        f"-I{sysconfig.get_paths()['include']}", str(src), "-o", str(so)], check=True)
        sos.append(so)
    first = load_module(name, sos[0])
    assert first.v() == 7
    assert load_module(name, sos[0]) is first  # the same file again
    other_cache = tmp_path / "other-cache"
    other_cache.mkdir()
    assert load_module(name, shutil.copy(sos[0], other_cache / sos[0].name)) is first  # same build elsewhere
    assert load_module(name, shutil.copy(sos[0], other_cache / "renamed.so")) is first  # same bytes
    with pytest.raises(ImportError, match="already loaded from"):
        load_module(name, sos[1])


def test_workspace_numel_is_constant_time_and_exact(monkeypatch):
    """workspace_numel(bs) (auto) is the max over every batch size up to bs, and a repeated call costs no
    split-count search (it ran one per batch size, every eager step)."""
    import mlagen.ops as ops

    calls = []
    real = ops.auto_num_splits

    def counting(units, slots, max_splits=ops.MAX_SPLITS, slack=ops.AUTO_WAVE_SLACK):
        calls.append(units)
        return real(units, slots, max_splits, slack)

    monkeypatch.setattr(ops, "auto_num_splits", counting)
    monkeypatch.setattr(ops, "_PREFIX_MAX", {}, raising=False)
    slots = int(torch.randint(100, 300, (1,)))
    a = _kernel(nsplit="auto")
    a._sm[0] = slots
    dev = torch.device("cuda", 0)
    v = a.variant
    per_req = v.row_blocks * v.ctas_per_row_block
    bs = int(torch.randint(200, 400, (1,)))
    want = 16 + max(b * real(b * per_req, slots) for b in range(1, bs + 1)) * v.rows_max * (v.dim_v + 1)
    assert a.workspace_numel(bs, dev) == want
    calls.clear()
    for n in (bs, bs - 7, 1, bs):
        a.workspace_numel(n, dev)
    assert len(calls) <= 4, f"{len(calls)} split-count searches for 4 sizes already seen"
    f = _kernel(nsplit=32)
    assert f.workspace_numel(bs) == 16 + bs * 32 * f.variant.rows_max * (f.variant.dim_v + 1)


class _ArgsModule(RecordingModule):
    def run(self, *args):
        self.calls += 1
        self.args = args


def _on_gpu(monkeypatch):
    """Pretend every tensor is on a GPU (the launch itself is recorded, not run)."""
    import contextlib

    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_check_batch_then_launch_equals_the_checked_call(monkeypatch):
    """The backend's path (check_batch once, launch per layer) launches exactly what __call__ does, and
    launch itself checks nothing."""
    import mlagen.ops as ops

    _on_gpu(monkeypatch)
    k = _kernel()
    k.module = _ArgsModule()
    d = _inputs(bs=3)
    ws = torch.empty(k.workspace_numel(3), dtype=torch.float32)
    out = torch.empty(27, 8, 512, dtype=torch.bfloat16)
    scale = float(torch.rand(1)) + 0.01
    _call(k, d, out=out, workspace=ws, softmax_scale=scale)
    want = k.module.args
    batch = k.check_batch(d["kv_lens"], d["block_table"], q_len=9, tree_mask=d["tree_mask"], workspace=ws)
    kv = k.check_kv_cache(d["kv_cache"].view(100, 1, 576))
    assert kv.shape == (100, 576)

    def no_checks(*a, **kw):
        raise AssertionError("launch re-checked a tensor")

    monkeypatch.setattr(ops, "_check", no_checks)
    monkeypatch.setattr(ops, "_check_devices", no_checks, raising=False)
    k.launch(batch, d["q"], d["kv_cache"].view(100, 1, 576), out, scale)
    assert k.module.calls == 2 and k.module.args == want
    # another current device: launch goes through the device guard, with the same arguments
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    k.launch(batch, d["q"], d["kv_cache"].view(100, 1, 576), out, scale)
    assert k.module.calls == 3 and k.module.args == want
    # a batch built by hand (no resolved launch arguments) takes the same guarded path
    import dataclasses
    k.launch(dataclasses.replace(batch, launch_args=()), d["q"], d["kv_cache"].view(100, 1, 576), out, scale)
    assert k.module.calls == 4 and k.module.args == want


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(kv_lens=d["kv_lens"].long()), "kv_lens must be torch.int32"),
    (lambda d: d.update(block_table=d["block_table"][:1]), "block_table has 1 rows for a batch of 2"),
    (lambda d: d.update(tree_mask=None), "uses a tree mask"),
    (lambda d: d.update(tree_mask=d["tree_mask"][:, :3]), "tree_mask must have shape (2, 9)"),
    (lambda d: d.update(workspace=torch.empty(10, dtype=torch.float32)), "workspace must be contiguous, 16-byte aligned"),
])
def test_check_batch_rejects_bad_metadata(monkeypatch, mutate, message):
    _on_gpu(monkeypatch)
    k = _kernel()
    d = _inputs()
    d["workspace"] = torch.empty(k.workspace_numel(2), dtype=torch.float32)
    mutate(d)
    with pytest.raises(ValueError) as e:
        k.check_batch(d["kv_lens"], d["block_table"], q_len=9, tree_mask=d["tree_mask"], workspace=d["workspace"])
    assert message in str(e.value)
    with pytest.raises(ValueError, match="kv_cache last dim must be 576"):
        k.check_kv_cache(d["kv_cache"][:, :512])
    assert k.module.calls == 0


class _FillModule(RecordingModule):
    def fill_metadata(self, *args):
        self.calls += 1
        self.args = args


def _meta_inputs(bs=3, q_len=9, npages=4):
    return dict(kv_lens=torch.zeros(bs + 1, dtype=torch.int32),
                block_table=torch.zeros(bs + 1, npages + 2, dtype=torch.int32),
                seq_lens=torch.tensor([5, 7, 1][:bs]), req_pool_indices=torch.tensor([2, 1, 0][:bs], dtype=torch.int32),
                req_to_token=torch.zeros(4, 32, dtype=torch.int32)[:, :20],
                tree_mask=torch.zeros(bs + 1, q_len + 3, dtype=torch.int64))


def test_fill_metadata_passes_pointers_strides_and_flags(monkeypatch):
    """fill_metadata hands the module the device addresses, row strides, dtype flags, sizes and the tree
    mode in the order of the template's binding (mla_verify_module.cu.j2), on the current stream."""
    _on_gpu(monkeypatch)
    k = _kernel()
    k.module = _FillModule()
    assert k.has_fill_metadata and not _kernel().has_fill_metadata
    d = _meta_inputs()
    mask = torch.ones(100, dtype=torch.bool)
    k.fill_metadata(d["kv_lens"], d["block_table"][:3, :4], d["seq_lens"], d["req_pool_indices"], d["req_to_token"],
                    extra=9, num_padding=1, npages=4, page_size=1, q_len=9, tree_mask=d["tree_mask"][:3, :9],
                    tree_mode="full_mask", custom_mask=mask)
    assert k.module.args == (
        d["seq_lens"].data_ptr(), 1, d["req_pool_indices"].data_ptr(), 0, d["req_to_token"].data_ptr(), 32, 4,
        mask.data_ptr(), 100, d["kv_lens"].data_ptr(), d["block_table"].data_ptr(), 6, d["tree_mask"].data_ptr(), 12,
        3, 1, 9, 4, 1, 9, 3, 7)
    k.fill_metadata(d["kv_lens"], d["block_table"], d["seq_lens"], d["req_pool_indices"], d["req_to_token"],
                    extra=0, num_padding=0, npages=4, page_size=1)
    assert k.module.args[12:14] == (0, 0) and k.module.args[7:9] == (0, 0) and k.module.args[-2] == 0
    for mode, code in (("causal", 1), ("qlen_only", 2)):
        k.fill_metadata(d["kv_lens"], d["block_table"], d["seq_lens"], d["req_pool_indices"], d["req_to_token"],
                        extra=9, num_padding=0, npages=4, page_size=1, q_len=9, tree_mask=d["tree_mask"],
                        tree_mode=mode, custom_mask=torch.ones(243, dtype=torch.uint8))
        assert k.module.args[-2] == code
        assert k.module.args[7:9] == ((0, 0) if mode == "causal" else (k.module.args[7], 243))
    assert k.module.calls == 4


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(seq_lens=d["seq_lens"].float()), "seq_lens and req_pool_indices must be int32 or int64"),
    (lambda d: d.update(req_pool_indices=d["req_pool_indices"].to(torch.int16)), "must be int32 or int64"),
    (lambda d: d.update(kv_lens=d["kv_lens"].long()), "kv_lens, block_table and req_to_token must be int32"),
    (lambda d: d.update(seq_lens=torch.tensor([5, 0, 7, 0, 1, 0])[::2]), "must be contiguous"),
    (lambda d: d.update(block_table=d["block_table"].t()), "need a contiguous last dim"),
    (lambda d: d.update(tree_mode="tree"), "tree_mode must be one of"),
    (lambda d: d.update(tree_mask=d["tree_mask"].int()), "tree_mask must be torch.int64"),
    (lambda d: d.update(custom_mask=None), "needs a contiguous bool/uint8 custom_mask"),
    (lambda d: d.update(custom_mask=torch.ones(300)), "needs a contiguous bool/uint8 custom_mask"),
    (lambda d: d.update(custom_mask=torch.ones(161, dtype=torch.bool)),
     "QLEN_ONLY verify mask has 161 elements, 162 needed for 2 requests of 9 draft tokens"),
])
def test_fill_metadata_rejects_bad_input(monkeypatch, mutate, message):
    _on_gpu(monkeypatch)
    k = _kernel()
    k.module = _FillModule()
    d = dict(_meta_inputs(), tree_mode="qlen_only", custom_mask=torch.ones(162, dtype=torch.bool))
    mutate(d)
    with pytest.raises(ValueError) as e:
        k.fill_metadata(d["kv_lens"], d["block_table"], d["seq_lens"], d["req_pool_indices"], d["req_to_token"],
                        extra=9, num_padding=1, npages=4, page_size=1, q_len=9, tree_mask=d["tree_mask"],
                        tree_mode=d["tree_mode"], custom_mask=d["custom_mask"])
    assert message in str(e.value)
    assert k.module.calls == 0


def _draft_row_case(k):
    """A bs 3, q_len 9 batch for ``k`` with its workspace, out, k_new [27, 1, 576] and kv_write_loc [27]."""
    ws = torch.empty(k.workspace_numel(3), dtype=torch.float32)
    out = torch.empty(27, 8, 512, dtype=torch.bfloat16)
    k_new = torch.randn(27, 1, 576).to(torch.bfloat16)
    return _inputs(bs=3), ws, out, k_new, torch.randint(0, 100, (27,), dtype=torch.int64)


class _AbiModule(_ArgsModule):
    run_abi = 2  # run() takes k_new, its row stride, kv_write_loc, num_slots after lse


def test_new_kv_arguments_reach_run_in_order(monkeypatch):
    """k_new / kv_write_loc go to run() between lse and the batch size (the template's order), the same
    from __call__ and from launch(new_kv=new_kv_args(...)); an ABI-1 module gets the old argument list
    and refuses k_new; bad draft-row tensors raise before anything is launched."""
    _on_gpu(monkeypatch)
    k = _kernel()
    k.module = _AbiModule()
    d, ws, out, k_new, loc = _draft_row_case(k)
    _call(k, d, out=out, workspace=ws, k_new=k_new, kv_write_loc=loc)
    args = k.module.args
    i = args.index(k_new.data_ptr())
    assert args[i:i + 4] == (k_new.data_ptr(), 576, loc.data_ptr(), 100)
    assert args[i + 4:i + 6] == (3, 9)  # batch size, q_len follow
    _call(k, d, out=out, workspace=ws)
    assert k.module.args[i:i + 4] == (0, 0, 0, 0) and len(k.module.args) == len(args)
    batch = k.check_batch(d["kv_lens"], d["block_table"], q_len=9, tree_mask=d["tree_mask"], workspace=ws)
    k.launch(batch, d["q"], d["kv_cache"], out, 0.1, new_kv=k.new_kv_args(batch, k_new, loc, d["kv_cache"]))
    assert k.module.args[i:i + 4] == args[i:i + 4]
    with pytest.raises(ValueError, match="k_new must have shape"):  # checked against the batch's bs * q_len
        k.new_kv_args(batch, k_new[:-1], loc[:-1], d["kv_cache"])
    assert k.module.args[i:i + 4] == args[i:i + 4]

    calls = k.module.calls
    for kw, msg in ((dict(kv_write_loc=loc), "kv_write_loc needs k_new"),
                    (dict(k_new=k_new[:-1]), "k_new must have shape"),
                    (dict(k_new=k_new.float()), "k_new must be torch.bfloat16"),
                    (dict(k_new=torch.randn(27, 2, 576).to(torch.bfloat16)), r"k_new must be \[27, 576\]"),
                    (dict(k_new=torch.randn(27, 577).to(torch.bfloat16)[:, 1:]), "16-byte aligned"),
                    (dict(k_new=k_new, kv_write_loc=loc.int()), "kv_write_loc must be torch.int64"),
                    (dict(k_new=k_new, kv_write_loc=loc[:-1]), "kv_write_loc must have shape"),
                    (dict(k_new=d["kv_cache"][:27], kv_write_loc=loc), "overlaps kv_cache")):
        with pytest.raises(ValueError, match=msg):
            _call(k, d, out=out, workspace=ws, **kw)
    assert k.module.calls == calls, "a rejected call launched"

    old = _kernel()
    old.module = _ArgsModule()
    assert not old.has_new_kv
    _call(old, d, out=out, workspace=ws)
    assert len(old.module.args) == len(args) - 4
    with pytest.raises(ValueError, match="no draft-row support"):
        _call(old, d, out=out, workspace=ws, k_new=k_new)
    assert old.module.calls == 1


def test_fp8_variant_takes_e4m3_caches_and_bf16_variants_refuse_them():
    """An fp8_e4m3 variant reads float8_e4m3fn or uint8 caches ([slots, 576] / [slots, 1, 576], SGLang's
    pool and its byte storage) and refuses bf16; a bf16 variant refuses both fp8 dtypes."""
    fp8 = _kernel(schedule="dimsplit", row_tiles=5, num_warps=8, block_n=32, stages=3, dtype="fp8_e4m3")
    assert fp8.variant.dtype == "fp8_e4m3"
    raw = torch.randint(0, 256, (100, 1, 576), dtype=torch.uint8)
    for cache in (raw, raw.view(torch.float8_e4m3fn), raw.view(100, 576)):
        kv2 = fp8.check_kv_cache(cache)
        assert kv2.shape == (100, 576) and kv2.data_ptr() == cache.data_ptr()
    with pytest.raises(ValueError, match="float8_e4m3fn or its uint8 bytes"):
        fp8.check_kv_cache(torch.zeros(100, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows must be contiguous and 16-byte aligned"):
        fp8.check_kv_cache(torch.zeros(100, 584, dtype=torch.uint8)[:, 4:580])
    bf16 = _kernel()
    for cache in (raw, raw.view(torch.float8_e4m3fn)):
        with pytest.raises(ValueError, match="kv_cache must be torch.bfloat16"):
            bf16.check_kv_cache(cache)


class _DirectModule(_AbiModule):
    """A module with run_direct (and the fused merge's counters, ABI 3): records its arguments."""

    run_abi = 3
    fused_merge = True

    def run_direct(self, *args):
        self.calls += 1
        self.direct_args = args


def _template_params(fn: str) -> list[str]:
    """Parameter names of ``fn`` in templates/mla_verify_module.cu.j2, in order."""
    import re
    from pathlib import Path

    src = (Path(__file__).resolve().parent.parent / "templates" / "mla_verify_module.cu.j2").read_text()
    sig = re.search(rf"\nvoid {fn}\((.*?)\)\s*{{", src, re.S).group(1)
    return [p.split()[-1] for p in sig.replace("\n", " ").split(",")]


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_direct_batch_arguments_reach_run_direct_by_name(monkeypatch, idx_dtype):
    """direct_plan / direct_batch / launch hand run_direct each value under the template's parameter name
    (req_to_token and its shape, req_pool_indices / seq_lens with their dtype flags, extra, the real-row count,
    the QLEN_ONLY mask or the shared tree rows with stride 0, the workspace halves, the draft rows, bs, q_len,
    splits); bad inputs raise before anything is launched."""
    _on_gpu(monkeypatch)
    k = _kernel()
    k.module = _DirectModule()
    assert k.has_direct and not _kernel().has_direct
    bs, q_len, npad = 4, 9, 1
    r2t = torch.zeros(6, 48, dtype=torch.int32)[:, :40]  # row stride 48, 40 token columns
    ws = torch.empty(k.workspace_numel(bs), dtype=torch.float32)
    plan = k.direct_plan(r2t, q_len=q_len, batch_size=bs, workspace=ws)
    seq = torch.tensor([5, 17, 30, 1], dtype=idx_dtype)
    rpi = torch.tensor([2, 0, 5, 0], dtype=idx_dtype)
    mask = torch.ones((bs - npad) * q_len * q_len, dtype=torch.bool)
    batch = k.direct_batch(plan, seq, rpi, extra=q_len, num_padding=npad, qlen_mask=mask)
    q = torch.randn(bs * q_len, 8, 576).to(torch.bfloat16)
    out = torch.empty(bs * q_len, 8, 512, dtype=torch.bfloat16)
    kv = k.check_kv_cache(torch.randn(100, 576).to(torch.bfloat16))
    k_new = torch.randn(bs * q_len, 576).to(torch.bfloat16)
    loc = torch.zeros(bs * q_len, dtype=torch.int64)
    k.launch(batch, q, kv, out, 0.25, new_kv=k.new_kv_args(batch, k_new, loc, kv))
    names = _template_params("run_direct")
    got = dict(zip(names, k.module.direct_args))
    assert len(k.module.direct_args) == len(names)
    is64 = int(idx_dtype == torch.int64)
    o_part = ws.data_ptr() + 64  # after the merge-counter header
    want = dict(q=q.data_ptr(), q_stride_tok=8 * 576, q_stride_head=576, kv=kv.data_ptr(), kv_stride_slot=576,
                req_to_token=r2t.data_ptr(), table_stride=48, table_rows=6, table_cols=40,
                req_pool_indices=rpi.data_ptr(), rpi_is_int64=is64, seq_lens=seq.data_ptr(), seq_lens_is_int64=is64,
                kv_len_extra=q_len, num_real=bs - npad, qlen_mask=mask.data_ptr(), tree_mask=0, tree_mask_stride=0,
                o_part=o_part, lse_part=o_part + bs * plan.splits * k.variant.rows_max * 512 * 4,
                out=out.data_ptr(), out_stride_tok=8 * 512, out_stride_head=512, lse=0, lse_stride_tok=0,
                k_new=k_new.data_ptr(), k_new_stride_tok=576, kv_write_loc=loc.data_ptr(), kv_num_slots=100,
                batch_size=bs, q_len=q_len, num_splits=plan.splits, min_tiles_per_split=k.min_tiles_per_split(),
                merge_counters=0, softmax_scale=0.25, stream=7)  # 0: this workspace's header was not zeroed by mlagen
    assert got == want
    rows = torch.zeros(q_len, dtype=torch.int64)
    k.launch(k.direct_batch(plan, seq, rpi, extra=q_len, num_padding=npad, tree_rows=rows), q, kv, out, 0.25)
    got = dict(zip(names, k.module.direct_args))
    assert (got["qlen_mask"], got["tree_mask"], got["tree_mask_stride"]) == (0, rows.data_ptr(), 0)
    calls = k.module.calls
    for kw, msg in ((dict(qlen_mask=mask[:-1]), "QLEN_ONLY verify mask has 242 elements, 243 needed"),
                    (dict(), "pass exactly one of qlen_mask / tree_rows"),
                    (dict(qlen_mask=mask, tree_rows=rows), "pass exactly one of qlen_mask / tree_rows"),
                    (dict(qlen_mask=mask.float()), "qlen_mask must be a contiguous 1-D bool / uint8"),
                    (dict(tree_rows=rows[:3]), "tree_rows must have shape"),
                    (dict(qlen_mask=mask, num_padding=5), "num_padding must be an int in"),
                    (dict(qlen_mask=mask, extra=-1), "extra must be an int >= 0")):
        with pytest.raises(ValueError, match=msg):
            kw = dict(dict(extra=q_len, num_padding=npad), **kw)
            k.direct_batch(plan, seq, rpi, **kw)
    for kw in (dict(), dict(qlen_mask=mask, tree_rows=rows)):  # unchecked batches too: else the kernel reads null
        with pytest.raises(ValueError, match="pass exactly one of qlen_mask / tree_rows"):
            k.direct_batch(plan, seq, rpi, extra=q_len, num_padding=npad, checked=False, **kw)
    with pytest.raises(ValueError, match="seq_lens must be contiguous with >= 4 elements"):
        k.direct_batch(plan, seq[:3], rpi, extra=q_len, num_padding=npad, qlen_mask=mask)
    with pytest.raises(ValueError, match="overlaps seq_lens"):
        k.direct_batch(plan, ws[:4].view(torch.int32), rpi, extra=q_len, num_padding=npad, qlen_mask=mask)
    # every row padded: no mask needed
    k.direct_batch(plan, seq, rpi, extra=q_len, num_padding=bs)
    with pytest.raises(ValueError, match="req_to_token must be torch.int32"):
        k.direct_plan(r2t.long(), q_len=q_len, batch_size=bs)
    assert k.module.calls == calls


def test_verify_batch_fast_constructor_equals_the_dataclass():
    """VerifyBatch._new (the direct path's per-step constructor) builds the same frozen instance as the dataclass
    constructor: every field, in order, and still frozen."""
    import dataclasses

    from mlagen.ops import VerifyBatch

    vals = (3, 9, 16, None, torch.zeros(2, 5, dtype=torch.int32), torch.ones(9, dtype=torch.int64),
            torch.arange(3), torch.zeros(64), ((1, 2), (3, 4), 0), True, (torch.ones(3),))
    fast, ref = VerifyBatch._new(*vals), VerifyBatch(*vals)
    names = [f.name for f in dataclasses.fields(VerifyBatch)]
    assert len(names) == len(vals)
    assert all(getattr(fast, n) is getattr(ref, n) is v for n, v in zip(names, vals))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.bs = 4
    assert dataclasses.replace(fast, launch_args=()).launch_args == ()


def test_merge_counters_only_for_workspaces_mlagen_zeroed(monkeypatch):
    """The fused merge gets the workspace's header address only when alloc_workspace (or the call's own
    allocation) zeroed it, the module supports the merge (ABI 3, fused_merge) and the kernel's fused_merge flag is
    set; otherwise 0 (the combine kernel runs). The header is 16 floats of zeros ahead of o_part."""
    _on_gpu(monkeypatch)
    k = _kernel()
    k.module = _DirectModule()
    ws = k.alloc_workspace(3, "cpu")
    assert ws.numel() == k.workspace_numel(3) and torch.equal(ws[:16], torch.zeros(16))
    # run()'s arguments by the template's names: the counters after min_tiles_per_split, the partials after the header
    d = _inputs(bs=3)
    batch = k.check_batch(d["kv_lens"], d["block_table"], q_len=9, tree_mask=d["tree_mask"], workspace=ws)
    q, out = torch.randn(27, 8, 576).to(torch.bfloat16), torch.empty(27, 8, 512, dtype=torch.bfloat16)
    k.launch(batch, q, k.check_kv_cache(d["kv_cache"]), out, 0.5)
    got = dict(zip(_template_params("run"), k.module.args))
    assert len(k.module.args) == len(_template_params("run"))
    assert (got["merge_counters"], got["o_part"], got["batch_size"], got["softmax_scale"]) == (
        ws.data_ptr(), ws.data_ptr() + 64, 3, 0.5)
    assert got["lse_part"] == ws.data_ptr() + 64 + 3 * k.num_splits(3) * k.variant.rows_max * 512 * 4
    assert k.merge_counters(ws) == ws.data_ptr()
    own = torch.full((k.workspace_numel(3),), float("nan"))
    assert k.merge_counters(own) == 0  # a header mlagen did not zero would make the merge's wait fail
    assert k.merge_counters(ws[:100]) == ws.data_ptr()  # a view starting at the same address: the same memory
    assert k.merge_counters(ws[16:]) == 0
    r2t = torch.zeros(6, 40, dtype=torch.int32)
    assert k.direct_plan(r2t, q_len=9, batch_size=3, workspace=ws).tail[-1] == ws.data_ptr()
    assert k.direct_plan(r2t, q_len=9, batch_size=3, workspace=own).tail[-1] == 0
    mine = k._checked_workspace(None, 3, 16, "cpu", {})  # what a call without a workspace allocates: zeroed, merged
    assert k.merge_counters(mine) == mine.data_ptr() and torch.equal(mine[:16], torch.zeros(16))
    k.fused_merge = False
    assert k.merge_counters(ws) == 0
    k.fused_merge = True
    k.module = _AbiModule()  # ABI 2: no counters argument at all
    assert k.merge_counters(ws) == 0
    assert len(k._run_tail(3, 9, 16, ws)) == 4
    nomerge = _DirectModule()
    nomerge.fused_merge = False  # a shipped dimsplit_t (MLAGEN_DST_MERGE 0), rowblock or dimsplit module
    k.module = nomerge
    assert k.merge_counters(ws) == 0 and k._run_tail(3, 9, 16, ws)[-1] == 0
    plain = k.alloc_workspace(3, "cpu")  # a module that cannot merge: no header memset, nothing registered
    k.module = _DirectModule()
    assert k.merge_counters(plain) == 0
    import mlagen.ops as ops

    monkeypatch.setenv("MLAGEN_FUSED_MERGE", "0")
    assert ops.fused_merge_default() is False
    monkeypatch.setenv("MLAGEN_FUSED_MERGE", "1")
    assert ops.fused_merge_default() is True


def _on_gpu_but_host(monkeypatch):
    """As _on_gpu, but tensors tagged ``_host = True`` report the CPU (a host tensor passed by mistake)."""
    _on_gpu(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "device", property(
        lambda self: torch.device("cpu") if getattr(self, "_host", False) else torch.device("cuda", 0)))


def _host(t: torch.Tensor) -> torch.Tensor:
    t._host = True
    return t


@pytest.mark.parametrize("kw, message", [
    (dict(npages=7), "npages must be an int in [0, 6]"),
    (dict(extra=2**31), "extra must be an int in [0, 2147483647]"),
    (dict(num_padding=4), "num_padding must be an int in [0, 3]"),
    (dict(q_len=13), "tree_mask (4, 12) is smaller than the batch's [3, 13]"),
    (dict(seq_lens=torch.tensor([5, 7, 1, 2, 3])), "needs >= 5 req_pool_indices, kv_lens and block_table rows"),
    (dict(req_to_token=torch.zeros(4, 3, dtype=torch.int32)), "npages 4 at page_size 1 reads past req_to_token's 3"),
    (dict(page_size=0), "page_size must be an int >= 1"),
    (dict(seq_lens=_host(torch.tensor([5, 7, 1]))), "all tensors must be on a CUDA device"),
    (dict(custom_mask=_host(torch.ones(243, dtype=torch.bool))), "all tensors must be on a CUDA device"),
    (dict(req_to_token=_host(torch.zeros(4, 32, dtype=torch.int32))), "all tensors must be on a CUDA device"),
])
def test_fill_metadata_refuses_sizes_its_buffers_do_not_hold_and_host_tensors(monkeypatch, kw, message):
    """The fill writes kv_lens [:bs], block_table [:bs, :npages], tree_mask [:bs, :q_len] and reads req_to_token up to
    column (npages - 1) * page_size, all from device pointers: a size past a buffer, a page_size below 1 or a host
    tensor is refused before the launch."""
    _on_gpu_but_host(monkeypatch)
    k = _kernel()
    k.module = _FillModule()
    d = dict(_meta_inputs(), extra=9, num_padding=1, npages=4, page_size=1, q_len=9, tree_mode="qlen_only",
             custom_mask=torch.ones(243, dtype=torch.bool))
    d.update(kw)
    with pytest.raises(ValueError) as e:
        k.fill_metadata(d.pop("kv_lens"), d.pop("block_table"), d.pop("seq_lens"), d.pop("req_pool_indices"),
                        d.pop("req_to_token"), **d)
    assert message in str(e.value)
    assert k.module.calls == 0


def test_draft_row_store_alignment_devices_and_output_overlaps_are_refused(monkeypatch):
    """The draft-row store writes 16 bytes of bf16 per instruction, so a cache whose rows are 4- but not 16-byte
    aligned (enough for load_width 32) is refused with kv_write_loc; new_kv_args refuses host tensors as __call__
    does; out overlapping lse or kv_lens (the combine writes one while reading the other) and an empty block table
    are refused. Nothing launches."""
    _on_gpu_but_host(monkeypatch)
    k = _kernel(load_width=32)
    k.module = _AbiModule()
    d, ws, out, k_new, loc = _draft_row_case(k)
    odd = torch.randn(100 * 580 + 2).to(torch.bfloat16)[2:].view(100, 580)[:, :576]  # 4-byte aligned rows
    assert k.check_kv_cache(odd) is not None  # fine to read at load_width 32
    _call(k, dict(d, kv_cache=odd), out=out, workspace=ws)  # and to launch without the store
    calls = k.module.calls
    with pytest.raises(ValueError, match="16-byte aligned for the draft-row store"):
        _call(k, dict(d, kv_cache=odd), out=out, workspace=ws, k_new=k_new, kv_write_loc=loc)
    batch = k.check_batch(d["kv_lens"], d["block_table"], q_len=9, tree_mask=d["tree_mask"], workspace=ws)
    for args in ((_host(torch.randn(27, 576).to(torch.bfloat16)), loc), (k_new, _host(loc.clone()))):
        with pytest.raises(ValueError, match="all tensors must be on a CUDA device"):
            k.new_kv_args(batch, *args, d["kv_cache"])
    lse = torch.empty(27, 8, dtype=torch.float32)
    overlapping_lse = out.view(-1).view(torch.float32)[:27 * 8].view(27, 8)
    with pytest.raises(ValueError, match="out overlaps lse"):
        _call(k, d, out=out, lse=overlapping_lse, workspace=ws)
    kv_lens_in_out = out.view(-1)[:6].view(torch.int32)
    with pytest.raises(ValueError, match="out overlaps kv_lens"):
        _call(k, dict(d, kv_lens=kv_lens_in_out), out=out, lse=lse, workspace=ws)
    with pytest.raises(ValueError, match="block_table .* is empty"):
        _call(k, dict(d, block_table=torch.zeros(3, 0, dtype=torch.int32)), out=out, workspace=ws)
    assert k.module.calls == calls, "a rejected call launched"


def test_numpy_scalars_are_taken_and_a_head_major_out_is_not_an_overlap(monkeypatch):
    """q_len as a numpy integer and softmax_scale as a numpy float are numbers like any other (passed on as Python
    int / float); an out laid out head-major ([H, T, 512] transposed to [T, H, 512]) has rows that do not overlap."""
    np = pytest.importorskip("numpy")
    _on_gpu(monkeypatch)
    k = _kernel()
    k.module = _ArgsModule()
    d = dict(_inputs(), workspace=torch.empty(k.workspace_numel(2), dtype=torch.float32))
    head_major = torch.empty(8, 18, 512, dtype=torch.bfloat16).transpose(0, 1)
    assert head_major.stride() == (512, 18 * 512, 1)
    out, _ = _call(k, d, q_len=np.int64(9), softmax_scale=np.float32(0.125), out=head_major)
    assert out is head_major and k.module.calls == 1
    assert type(k.module.args[-2]) is float and k.module.args[-2] == 0.125
    for bad in (torch.empty(18, 8, 512, dtype=torch.bfloat16).as_strided((18, 8, 512), (512, 256, 1)),
                torch.empty(8, 18, 512, dtype=torch.bfloat16).as_strided((18, 8, 512), (512, 8 * 512, 1))):
        with pytest.raises(ValueError, match="out rows must not overlap"):
            _call(k, d, out=bad)
    for bad in (np.float64(9.0), torch.tensor(9)):  # (a tensor's value would cost a device synchronization)
        with pytest.raises(ValueError, match=r"q_len must be an int in \[1, 9\]"):
            _call(k, d, q_len=bad)
    assert k.module.calls == 1


def test_a_written_kv_cache_may_hold_no_other_tensor_and_needs_slots(monkeypatch):
    """With kv_write_loc the launch writes kv_cache, so q, out, lse, the metadata and kv_write_loc itself must lie
    outside it; a kv_cache without slots is refused. Nothing launches."""
    _on_gpu(monkeypatch)
    k = _kernel()
    k.module = _AbiModule()
    d, ws, out, k_new, loc = _draft_row_case(k)
    pool = d["kv_cache"]
    inside = dict(block_table=pool.view(-1)[:120].view(torch.int32).view(3, 20),
                  kv_lens=pool.view(-1)[:6].view(torch.int32),
                  kv_write_loc=pool.view(-1)[:108].view(torch.int64))
    for name, t in inside.items():
        dd = dict(d, **{name: t}) if name != "kv_write_loc" else d
        with pytest.raises(ValueError, match=f"{name} overlaps kv_cache, which the launch writes"):
            _call(k, dd, out=out, workspace=ws, k_new=k_new, kv_write_loc=t if name == "kv_write_loc" else loc)
    with pytest.raises(ValueError, match="kv_cache has no slots"):
        _call(k, dict(d, kv_cache=torch.empty(0, 576, dtype=torch.bfloat16)), out=out, workspace=ws)
    assert k.module.calls == 0
    _call(k, d, out=out, workspace=ws, k_new=k_new, kv_write_loc=loc)  # the same call with separate tensors runs
    assert k.module.calls == 1


@pytest.mark.parametrize("where, value, message", [
    ("tree_mask", [[1] * 9] * 3, "tree_mask must be a torch.Tensor or None, got list"),
    ("kv_lens", [5, 7, 1, 0], "kv_lens must be a torch.Tensor, got list"),
    ("seq_lens", torch.tensor(5), "seq_lens must be a 1-D torch.Tensor, got shape ()"),
    ("seq_lens", torch.tensor([[5, 7, 1, 2]]), "seq_lens must be a 1-D torch.Tensor, got shape (1, 4)"),
    ("req_pool_indices", (2, 1, 0), "req_pool_indices must be a 1-D torch.Tensor, got tuple"),
])
def test_metadata_arguments_of_the_wrong_kind_are_value_errors(monkeypatch, where, value, message):
    """Not a tensor, or a tensor of the wrong rank: a ValueError naming it, not an AttributeError or IndexError."""
    _on_gpu(monkeypatch)
    k = _kernel()
    k.module = _FillModule()
    d = dict(_meta_inputs(), **{where: value})
    with pytest.raises(ValueError) as e:
        k.fill_metadata(d["kv_lens"], d["block_table"], d["seq_lens"], d["req_pool_indices"], d["req_to_token"],
                        extra=9, num_padding=1, npages=4, page_size=1, q_len=9, tree_mask=d["tree_mask"],
                        tree_mode="causal")
    assert message in str(e.value)
    assert k.module.calls == 0


def test_a_tree_mask_that_is_not_a_tensor_is_a_value_error_on_a_causal_variant():
    k = _kernel(mask="causal")
    with pytest.raises(ValueError, match="tree_mask must be a torch.Tensor or None, got list"):
        _call(k, dict(_inputs(), tree_mask=[[1] * 9] * 2))
    with pytest.raises(ValueError, match="tree_mask must be a torch.Tensor or None, got list"):
        k.check_batch(_inputs()["kv_lens"], _inputs()["block_table"], q_len=9, tree_mask=[[1] * 9] * 2)
    assert k.module.calls == 0
