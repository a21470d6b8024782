"""Codegen, ninja generation and a real nvcc build (sm_120 + sm_90) without a GPU."""

import os
import re
from pathlib import Path

import jinja2
import pytest

from mlagen import codegen, ninja_gen, owned, paths, ptxas
from mlagen.spec import parse_spec

V = parse_spec(dict(heads_per_rank=8, q_len=9, page_size=64, load_width=64, nsplit=32)).variants()[0]


def test_render_binds_constants_only():
    src = codegen.render_variant(V)
    assert f"PYBIND11_MODULE({V.build_key}, m)" in src
    assert "mlagen::MaskKind::kTree" in src and "/*kPageSize=*/64" in src and "/*kLoadBits=*/64" in src
    assert "__global__" not in src  # kernel logic lives in include/mlagen/*.cuh
    with pytest.raises(jinja2.UndefinedError):
        codegen.render(codegen.MODULE_TEMPLATE, uri="x")


def test_write_if_changed(tmp_path):
    p = tmp_path / "a" / "f.cu"
    assert codegen.write_if_changed(p, "x")
    mtime = p.stat().st_mtime_ns
    assert not codegen.write_if_changed(p, "x")
    assert p.stat().st_mtime_ns == mtime
    assert codegen.write_if_changed(p, "y") and p.read_text() == "y"


def test_source_hash_covers_source_flags_and_nvcc():
    h = codegen.source_hash("a", ["-O3"], "nvcc 13")
    assert h != codegen.source_hash("b", ["-O3"], "nvcc 13")
    assert h != codegen.source_hash("a", ["-O2"], "nvcc 13")
    assert h != codegen.source_hash("a", ["-O3"], "nvcc 12")


def test_cache_key_covers_the_nvcc_environment(cache_env, monkeypatch):
    """NVCC_APPEND_FLAGS / NVCC_PREPEND_FLAGS / NVCC_CCBIN change what nvcc builds without changing its command line:
    a module built with one of them set is not the module built without it."""
    from mlagen.build import generate

    for k in ninja_gen.NVCC_ENV_VARS:
        monkeypatch.delenv(k, raising=False)
    (plain,) = generate([V])
    keys = {plain.source_hash}
    for k, val in (("NVCC_APPEND_FLAGS", "-Xptxas -O1"), ("NVCC_PREPEND_FLAGS", "-G"), ("NVCC_CCBIN", "/usr/bin/g++")):
        monkeypatch.setenv(k, val)
        (job,) = generate([V])
        keys.add(job.source_hash)
        monkeypatch.delenv(k)
    assert len(keys) == 4
    (again,) = generate([V])
    assert again.source_hash == plain.source_hash
    for blank in ("", "  "):  # an empty variable counts as unset, as every MLAGEN_* / CUDA_HOME one does
        monkeypatch.setenv("NVCC_APPEND_FLAGS", blank)
        (job,) = generate([V])
        assert job.source_hash == plain.source_hash


def test_ninja_files(cache_env):
    text = ninja_gen.variant_ninja(V)
    assert "arch=compute_120,code=sm_120" in text and "arch=compute_90,code=sm_90" in text
    assert "-lineinfo" in text and "-Xptxas -v" in text and "deps = gcc" in text
    # the intermediates it deletes after a compile: only its own names in its own keep/ (never a user's file there)
    assert f"keep_names = '{V.build_key}.*'" in text and "-maxdepth 1 -type f -name $keep_names" in text
    top = ninja_gen.top_ninja([V])
    assert f"subninja {ninja_gen.variant_outputs(V)['ninja']}" in top.replace("$:", ":")


def test_ptxas_parser_and_ptx_scan():
    log = """ptxas info    : Compiling entry function '_Z3foov' for 'sm_120'
ptxas info    : Function properties for _Z3foov
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1040 bytes smem
ptxas info    : Compiling entry function '_Z3foov' for 'sm_90'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 100 registers, used 1 barriers"""
    s = ptxas.summarize(ptxas.parse_ptxas(log))
    assert s["sm_120"] == dict(registers=255, smem_static=1040, stack=8, spill_stores=4, spill_loads=4,
                               smem_static_partial=0)
    # a block's shared memory: the partial kernel's static + dynamic bytes; the combine's static bytes are its own
    two = """ptxas info    : Compiling entry function '_ZN6mlagen28mla_verify_dimsplit_t_kernelIXEEvNS_15MlaVerifyParamsE' for 'sm_120'
ptxas info    : Used 242 registers, used 1 barriers, 16 bytes smem
ptxas info    : Compiling entry function '_ZN6mlagen25mla_verify_combine_kernelILi8EEEvNS_15MlaVerifyParamsE' for 'sm_120'
ptxas info    : Used 39 registers, used 1 barriers, 2832 bytes smem"""
    s2 = ptxas.summarize(ptxas.parse_ptxas(two))["sm_120"]
    assert s2["smem_static"] == 2832 and s2["smem_static_partial"] == 16
    assert ptxas.block_smem(s2, 99232) == 99248 and ptxas.block_smem(s2, 1000) == 2832
    assert s["sm_90"]["registers"] == 100 and s["sm_90"]["spill_stores"] == 0
    assert ptxas.forbidden_in_ptx("\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {..};") == ["wgmma"]
    assert ptxas.forbidden_in_ptx("  @%p1 setmaxnreg.inc.sync.aligned.u32 240;") == ["setmaxnreg"]
    assert ptxas.forbidden_in_ptx("\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 ...;\n// wgmma in a comment") == []
    assert ptxas.forbidden_in_ptx(
        "\tcp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%r1], [%rd2], 1152, [%r3], %rs1;"
    ) == [".multicast"]
    assert ptxas.forbidden_in_ptx("\tcp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd2], 512, [%r3];\n"
                                  "\tmapa.shared::cluster.u32 %r4, %r5, %r6;\n\tst.shared::cluster.v4.f32 [%r4], {%f1, %f2, %f3, %f4};") == []


@pytest.mark.slow
def test_real_build_sm120_sm90(built_small):
    """Compiles a K2 TP8 variant with nvcc 13 for sm_120 and sm_90 and checks the reports."""
    from mlagen.registry import Registry

    rep = built_small["report"]
    assert {b.variant.nsplit for b in rep.built} == {32, "auto"}
    assert len({b.so_path for b in rep.built}) == 1  # nsplit is a launch argument: one module
    b = rep.built[0]
    for arch in ("sm_120", "sm_90"):
        r = b.resources[arch]
        assert r["smem"] <= 101376 and r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0
        assert 0 < r["registers"] <= 255
    keep = Path(ninja_gen.variant_outputs(b.variant)["keep"])
    ptx = sorted(keep.glob("*.ptx"))
    assert {re.search(r"compute_(\d+)", p.name).group(1) for p in ptx} == {"120", "90"}
    for p in ptx:
        text = p.read_text()
        assert "mma.sync.aligned.m16n8k16" in text and "ldmatrix" in text and "cp.async" in text
        assert ptxas.forbidden_in_ptx(text) == []
    # of nvcc's -keep intermediates (~45 MB) the compile leaves the PTX and the cubins (ninja_gen.variant_ninja)
    left = sorted(p.name for p in keep.iterdir() if p.name != owned.MANIFEST)
    assert any(n.endswith(".cubin") for n in left) and all(n.endswith((".ptx", ".cubin")) for n in left), left
    row = Registry().get_variant(b.uri)
    assert row and row["so_path"] == str(b.so_path) and row["resources"]["sm_120"]["smem"] <= 101376
    # the module imports without a GPU and reports its configuration
    from mlagen.ops import load_variant

    k = load_variant(b.uri)
    assert k.module.heads == 8 and k.module.dim_qk == 576 and k.module.row_blocks == 3


@pytest.mark.slow
def test_cached_rebuild_is_fast_and_noop(built_small):
    from mlagen.build import build

    rep = build(built_small["spec"], jobs=2)
    assert all(b.cached for b in rep.built) and not rep.failed
    assert rep.seconds < 2.0


@pytest.mark.slow
def test_another_nsplit_of_an_installed_module_compiles_nothing(built_small, monkeypatch):
    """A spec asking for an NSPLIT no build registered yet gets the installed module (NSPLIT is a launch argument),
    registered under that spec with the module's resources; ninja does not run."""
    from mlagen.build import build
    from mlagen.registry import Registry

    def no_ninja(*args, **kwargs):
        raise AssertionError("ninja ran for a module that is installed")

    monkeypatch.setattr(ninja_gen, "run_ninja", no_ninja)
    first = built_small["report"].built[0]
    spec = parse_spec(dict(name="ci_ns48", heads_per_rank=8, q_len=9, page_size=1, nsplit=[48, 32], load_width=128,
                           mask="tree", arch=["sm_120", "sm_90"]))
    rep = build(spec, jobs=2)
    assert not rep.failed and sorted(b.variant.nsplit for b in rep.built) == [32, 48]
    assert all(b.cached and b.so_path == first.so_path for b in rep.built)
    reg = Registry()
    new = reg.get_variant(next(b.uri for b in rep.built if b.variant.nsplit == 48))
    assert new["spec"] == "ci_ns48" and new["so_path"] == str(first.so_path) and new["resources"] == first.resources
    assert reg.get_variant(next(b.uri for b in rep.built if b.variant.nsplit == 32))["spec"] == "ci"  # left as it was


@pytest.mark.slow
def test_failed_build_registers_nothing(cache_env, monkeypatch):
    from mlagen import build as b
    from mlagen.registry import Registry

    monkeypatch.setattr(b.codegen, "render_variant", lambda v: "#error deliberately broken\n")
    spec = parse_spec(dict(name="broken", heads_per_rank=1, q_len=1, mask="none", row_tiles=1, arch="sm_90"))
    rep = b.build(spec, jobs=1)
    assert not rep.built and len(rep.failed) == 1
    assert "deliberately broken" in rep.failed[0][1]
    assert Registry().variants() == []
    with pytest.raises(b.BuildError, match="deliberately broken"):
        b.build_variants(spec)


def test_build_id_in_ninja_command_and_all_include_files_hashed(cache_env, tmp_path, monkeypatch):
    assert "-DMLAGEN_BUILD_ID=0123456789abcdef" in ninja_gen.variant_ninja(V, "0123456789abcdef" + "0" * 48)
    inc = tmp_path / "inc"
    (inc / "mlagen").mkdir(parents=True)
    (inc / "mlagen" / "a.cuh").write_text("x")
    (inc / "mlagen" / "b.h").write_text("y")
    monkeypatch.setattr(codegen.paths, "INCLUDE_DIR", inc)
    d1 = codegen.headers_digest()
    (inc / "mlagen" / "b.h").write_text("z")
    assert codegen.headers_digest() != d1


def test_ablation_build_drops_phases_and_default_is_the_full_kernel(tmp_path):
    """tools/device_ablate.py: the phase-dropping diagnostic build compiles, and its mask really
    removes code (fewer MMAs in the PTX); MLAGEN_ABLATE unset is the full kernel."""
    import dataclasses
    import subprocess
    import sys

    try:
        ninja_gen.nvcc_path()
    except ninja_gen.ToolchainError:
        pytest.skip("nvcc not available")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import device_ablate

    from mlagen.spec import Variant

    v = dataclasses.replace(Variant.from_uri(device_ablate.DEFAULT_URI), archs=("sm_120",))
    src = tmp_path / "k.cu"
    counts = {}
    for mask in (0, 2 | 8):
        src.write_text(f"#define MLAGEN_ABLATE {mask}\n" + codegen.render_variant(v))
        ptx = tmp_path / f"k{mask}.ptx"
        flags = [f for f in ninja_gen.nvcc_flags(v) if f not in ("-shared", "-Xptxas", "-v")]
        flags = [f for f in flags if not f.startswith("arch=") and f != "-gencode"]
        r = subprocess.run([ninja_gen.nvcc_path(), *flags, "-arch=sm_120", "-ptx", str(src), "-o", str(ptx)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        counts[mask] = ptx.read_text().count("mma.sync.aligned")
    assert counts[0] > 0 and counts[2 | 8] == 0, counts


@pytest.mark.slow
def test_real_build_dimsplit_sm120_sm90(tmp_path, monkeypatch):
    """The dimsplit schedule (two-CTA cluster, DSMEM score exchange) compiles for sm_120 and sm_90 with
    0 spills, within sm_120's shared memory, using cluster PTX but no multicast / wgmma / setmaxnreg."""
    from mlagen.build import build

    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "generated"))
    spec = parse_spec(dict(name="ci_ds", heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", schedule="dimsplit",
                           load_width=128, block_n=32, stages=3, row_tiles=5, mask="tree", arch=["sm_120", "sm_90"]))
    rep = build(spec, jobs=2)
    assert not rep.failed, rep.failed
    (b,) = rep.built
    assert b.variant.schedule == "dimsplit" and b.uri.endswith("_st3_dimsplit_tree_bf16_sm120_sm90")
    for arch in ("sm_120", "sm_90"):
        r = b.resources[arch]
        assert r["smem"] <= 101376 and r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0
    ptx = sorted(Path(ninja_gen.variant_outputs(b.variant)["keep"]).glob("*.ptx"))
    assert {re.search(r"compute_(\d+)", p.name).group(1) for p in ptx} == {"120", "90"}
    for p in ptx:
        text = p.read_text()
        assert ".maxclusterrank" in text or ".reqnctapercluster" in text or ".explicitcluster" in text
        assert "mapa.shared::cluster" in text and "st.async.shared::cluster" in text and "barrier.cluster" in text
        assert "mma.sync.aligned.m16n8k16" in text and "cp.async.mbarrier.arrive.noinc" in text
        assert ptxas.forbidden_in_ptx(text) == []


def _compile_without_spills(nvcc, v, tmp_path, what: str, appended: str = ""):
    """nvcc -c of variant ``v``'s rendered source plus ``appended`` (e.g. a static_assert on its Cfg), for every
    arch of the variant; asserts it compiles and that ptxas reports no spills and no stack for any arch.
    Returns the source path."""
    import subprocess

    src = tmp_path / f"{v.build_key}.cu"
    src.write_text(codegen.render_variant(v) + appended)
    flags = [f for f in ninja_gen.nvcc_flags(v) if f != "-shared"]
    r = subprocess.run([nvcc, *flags, "-c", str(src), "-o", str(tmp_path / f"{v.build_key}.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"{v.uri}: {what}:\n{r.stderr[-1500:]}"
    for arch, s in ptxas.summarize(ptxas.parse_ptxas(r.stdout + r.stderr)).items():
        assert s["spill_stores"] == s["spill_loads"] == s["stack"] == 0, (v.uri, arch, s)
    return src


def _allowed_ptx(nvcc, src, arch: str) -> str:
    """The PTX of ``src`` for ``arch`` (e.g. compute_90); asserts it has none of the instructions sm_120 lacks."""
    import subprocess

    flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", f"-I{paths.INCLUDE_DIR}", *ninja_gen.python_includes(),
             f"-arch={arch}", "-ptx"]
    ptx = subprocess.run([nvcc, *flags, str(src), "-o", "-"], capture_output=True, text=True)
    assert ptx.returncode == 0, ptx.stderr[-1500:]
    assert ptxas.forbidden_in_ptx(ptx.stdout) == []
    return ptx.stdout


@pytest.mark.slow
def test_dimsplit_python_feasible_compiles_at_other_dims(tmp_path):
    """Every dimsplit variant the Python model accepts at other kv_lora_rank / qk_rope_head_dim values
    compiles (MlaDimSplitConfig's static_asserts) without spills, for sm_120 and sm_90. kv 512 with rope
    0 or 96 and load_width 128 used to be accepted in Python but failed the cp.async loader's
    32 % kRopeChunks static_assert (a division by zero for rope 0)."""
    from mlagen.feasibility import infeasible_reason

    try:
        nvcc = ninja_gen.nvcc_path()
    except ninja_gen.ToolchainError:
        pytest.skip("nvcc not available")
    # (kv_lora_rank, rope, load_width, num_warps): 11 = two consumer warps per row tile (pairs)
    dims = [(512, 0, 128, 8), (512, 96, 128, 8), (512, 0, "bulk", 8), (256, 128, "bulk", 8), (128, 32, "bulk", 8),
            (512, 64, 128, 11)]
    built = 0
    for kv, rope, lw, warps in dims:
        (v,) = parse_spec(dict(heads_per_rank=8, q_len=9, kv_lora_rank=kv, qk_rope_head_dim=rope, load_width=lw,
                               page_size=64, nsplit="auto", block_n=32, stages=2, row_tiles=5, mask="tree",
                               num_warps=warps, schedule="dimsplit", arch=["sm_120", "sm_90"])).variants()
        if infeasible_reason(v) is not None:
            continue
        _compile_without_spills(nvcc, v, tmp_path, "Python accepts it, nvcc does not")
        built += 1
    assert built >= 3


@pytest.mark.slow
def test_fp8_and_two_producer_dimsplit_compile_without_spills(tmp_path):
    """The e4m3-KV dimsplit build (producer + two converter warps; cvt e4m3x2 -> f16x2 for the stages,
    bf16x2 -> e4m3x2 with satfinite for the KV store) and the two-producer bf16 build (num_warps =
    row_tiles + 2) compile for sm_120 and sm_90 with no spills and only the allowed instructions."""
    try:
        nvcc = ninja_gen.nvcc_path()
    except ninja_gen.ToolchainError:
        pytest.skip("nvcc not available")
    base = dict(heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", load_width=128, block_n=32, stages=3,
                row_tiles=5, mask="tree", schedule="dimsplit", arch=["sm_120", "sm_90"])
    for extra in (dict(dtype="fp8_e4m3", num_warps=8), dict(num_warps=7)):
        (v,) = parse_spec(dict(base, **extra)).variants()
        ptx = _allowed_ptx(nvcc, _compile_without_spills(nvcc, v, tmp_path, "nvcc refuses it"), "compute_90")
        if v.dtype == "fp8_e4m3":
            assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.rn.satfinite.e4m3x2" in ptx


@pytest.mark.slow
def test_dimsplit_t_compiles_without_spills_and_matches_the_python_model(tmp_path):
    """The dimsplit_t schedule (S^T = K Q^T in score warps, O^T = V^T P^T in output warps) compiles for
    sm_120 and sm_90 with no spills and only the allowed instructions, at H8 q9 (3 score warps, 72 rows,
    3 or 4 stages of 32 tokens, two m16 token tiles per score step; with 4, one score exchange buffer) and q_len 1 (one score warp, 8 stages of
    16 tokens, two accumulator chains), with an e4m3 cache (2 e4m3 stages, 3 bf16 stages the output warps fill)
    and with 2 score warps (H1 q_len 40: no rescale slack or flags there);
    its shared memory equals the Python model's (a static_assert appended
    to the rendered source), which is what the feasibility filter drops variants by; the softmax uses
    ex2.approx.ftz and the producer prefetches into L2, except in the bf16 builds of 3 score warps and 4 stages
    (MLAGEN_DST_L2_PREFETCH's default, docs/perf-notes.md v25)."""
    from mlagen.feasibility import infeasible_reason, resources

    try:
        nvcc = ninja_gen.nvcc_path()
    except ninja_gen.ToolchainError:
        pytest.skip("nvcc not available")
    base = dict(page_size=1, nsplit="auto", load_width=128, schedule="dimsplit_t", arch=["sm_120", "sm_90"])
    for extra in (dict(heads_per_rank=8, q_len=9, row_tiles=3, num_warps=8, mask="tree", block_n=32, stages=3),
                  dict(heads_per_rank=8, q_len=9, row_tiles=3, num_warps=8, mask="tree", block_n=32, stages=4),
                  dict(heads_per_rank=8, q_len=1, row_tiles=1, num_warps=6, mask="causal", block_n=16, stages=8),
                  # e4m3 KV: a 2-stage e4m3 ring, the output warps convert into 3 bf16 stages (one exchange buffer)
                  dict(heads_per_rank=8, q_len=9, row_tiles=3, num_warps=8, mask="tree", block_n=32, stages=2,
                       dtype="fp8_e4m3"),
                  # 2 score warps: no rescale slack and no flags (kRescaleSlack 0; with the slack this tile spills on
                  # sm_90), which the Python model mirrors (no flags' 32 B)
                  dict(heads_per_rank=1, q_len=40, row_tiles=2, num_warps=7, mask="tree", block_n=32, stages=3,
                       page_size=16, nsplit=8)):
        (v,) = parse_spec(dict(base, **extra)).variants()
        assert infeasible_reason(v) is None
        model = (f"\nstatic_assert(Cfg::kSmemBytes == {resources(v).smem_bytes}, "
                 '"the Python shared-memory model of dimsplit_t differs from MlaDimSplitTConfig");\n')
        src = _compile_without_spills(nvcc, v, tmp_path, "nvcc refuses it", appended=model)
        ptx = _allowed_ptx(nvcc, src, "compute_120")
        assert "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx and "st.async.shared::cluster" in ptx
        # one MUFU per exponential (no exp2f range fix-up); the producer's L2 prefetch of the tile kStages ahead, but
        # not in bf16 builds of 3 score warps with 4 stages (there it measured slower than none)
        assert "ex2.approx.ftz.f32" in ptx
        no_prefetch = extra.get("dtype") != "fp8_e4m3" and extra["row_tiles"] == 3 and extra["stages"] >= 4
        assert ("prefetch.global.L2" in ptx) != no_prefetch
        # 4 stages of 32 tokens fit in 99 KB beside one fp32 score exchange buffer, whose reuse the peer's warp
        # signals with a remote arrival at CTA scope (no fence); no fp16 exchange and no L1-allocating copies in
        # shipped builds (MLAGEN_DST_XCHG_F16 / MLAGEN_DST_COPY_L1 0)
        fp8 = extra.get("dtype") == "fp8_e4m3"
        one_xbuf = extra["block_n"] == 32 and (extra["stages"] == 4 or fp8)
        assert ("mbarrier.arrive.shared::cluster.b64" in ptx) == one_xbuf
        assert "cvt.rn.satfinite.f16x2.f32" not in ptx and "cp.async.ca.shared.global" not in ptx
        # e4m3 -> f16x2 conversions for the stages and the satfinite e4m3 store of the draft rows, fp8 builds only
        assert ("cvt.rn.f16x2.e4m3x2" in ptx) == fp8 and ("cvt.rn.satfinite.e4m3x2" in ptx) == fp8


def test_compile_diagnostic_compiles_once_per_build_key_and_leaves_no_module_on_failure(tmp_path, monkeypatch):
    """mlagen.ninja_gen.compile_diagnostic (the diagnostic tools' builds): the same source twice runs nvcc once; a
    changed source, an edited kernel header or another arch runs it again; a failed compile raises with nvcc's
    output and leaves no module (nor the temporary one) behind."""
    import dataclasses

    from mlagen.spec import Variant

    calls = tmp_path / "calls"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/usr/bin/env bash\n"
                    "[ \"$1\" = --version ] && { echo 'Cuda compilation tools, release 13.0, V13.0.0'; exit 0; }\n"
                    "echo x >> " + str(calls) + "\n"
                    "for a; do [ \"$prev\" = -o ] && out=$a; prev=$a; done\n"
                    "echo partial > \"$out\"\n"
                    "grep -q FAIL \"${@: -3:1}\" && { echo 'error: bad source' >&2; exit 2; }\n"
                    "echo built > \"$out\"\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(ninja_gen, "nvcc_path", lambda: str(nvcc))
    include = tmp_path / "include"
    (include / "mlagen").mkdir(parents=True)
    (include / "mlagen" / "h.cuh").write_text("// v1\n")
    monkeypatch.setattr(paths, "INCLUDE_DIR", include)
    v = dataclasses.replace(Variant.from_uri("mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lwbulk_bn32_w8_rt1_st2_tree_bf16_"
                                             "sm120_sm90"), archs=("sm_90",))
    n = lambda: len(calls.read_text().splitlines()) if calls.exists() else 0  # noqa: E731
    out = tmp_path / "out"
    out.mkdir()
    so = ninja_gen.compile_diagnostic(v, "#define A 1\n", "m", out)
    assert so.read_text() == "built\n" and n() == 1
    assert ninja_gen.compile_diagnostic(v, "#define A 1\n", "m", out) == so and n() == 1
    ninja_gen.compile_diagnostic(v, "#define A 2\n", "m", out)
    assert n() == 2
    (include / "mlagen" / "h.cuh").write_text("// v2\n")
    ninja_gen.compile_diagnostic(v, "#define A 2\n", "m", out)
    assert n() == 3
    ninja_gen.compile_diagnostic(dataclasses.replace(v, archs=("sm_120",)), "#define A 2\n", "m", out)
    assert n() == 4
    with pytest.raises(RuntimeError, match="bad source"):  # nvcc wrote part of its output, then failed
        ninja_gen.compile_diagnostic(v, "#define FAIL 1\n", "m", out)
    assert not so.exists() and not list(out.glob("*partial*"))
    with pytest.raises(RuntimeError, match="bad source"):  # the same failing source again: nvcc runs again
        ninja_gen.compile_diagnostic(v, "#define FAIL 1\n", "m", out)
    assert n() == 6 and not so.exists()


def test_compile_diagnostic_two_processes_build_a_module_once(tmp_path):
    """Two processes asking for the same diagnostic module at once (e.g. two tools' --build-only passes that share
    the full-kernel build): one compiles under the module's lock, the other waits and reuses it; the module is the
    complete output, not a torn one."""
    import subprocess
    import sys

    calls = tmp_path / "calls"
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/usr/bin/env bash\n"
                    "[ \"$1\" = --version ] && { echo 'Cuda compilation tools, release 13.0, V13.0.0'; exit 0; }\n"
                    "echo x >> " + str(calls) + "\n"
                    "for a; do [ \"$prev\" = -o ] && out=$a; prev=$a; done\n"
                    "echo start > \"$out\"; sleep 1; echo end >> \"$out\"\n")
    nvcc.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    code = ("import dataclasses, sys; from pathlib import Path; from mlagen import ninja_gen; "
            "from mlagen.spec import Variant; "
            "v = dataclasses.replace(Variant.from_uri('mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lwbulk_bn32_w8_rt1_st2_"
            "tree_bf16_sm120_sm90'), archs=('sm_90',)); "
            "print(ninja_gen.compile_diagnostic(v, '#define A 1\\n', 'm', Path(sys.argv[1])).read_text())")
    env = dict(os.environ, CUDA_HOME=str(tmp_path / "cuda"))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert [r[0] for r in results] == ["start\nend\n\n"] * 2
    assert len(calls.read_text().splitlines()) == 1


def test_diagnostic_module_name_stays_short_enough_for_nvcc():
    """A diagnostic build's module name says its defines while it is short; past 160 characters (nvcc's temporary
    files add ~70 to it, and nvlink fails on file names over 255 bytes) it is the build key plus a digest of the
    defines: deterministic, distinct per define set, a valid module identifier."""
    from mlagen.ninja_gen import diagnostic_module_name

    key = "mla_verify_h8_q9_kv512_rope64_ps1_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm90"
    two = (("MLAGEN_DST_RESCALE_SLACK", 8), ("MLAGEN_DST_RESCALE_FLAG", 0))
    assert diagnostic_module_name(key, two) == key + "_mlagen_dst_rescale_slack_8_mlagen_dst_rescale_flag_0"
    four = two + (("MLAGEN_COMBINE_UNROLL", 16), ("MLAGEN_DST_HALF_K", 4))
    four_b = two + (("MLAGEN_COMBINE_UNROLL", 8), ("MLAGEN_DST_HALF_K", 4))
    a, b = diagnostic_module_name(key, four), diagnostic_module_name(key, four_b)
    assert a != b and a == diagnostic_module_name(key, list(four))
    neg = diagnostic_module_name(key, (("MLAGEN_DST_RESCALE_SLACK", -1),))  # a value that is no identifier part
    for name in (a, b, neg):
        assert name.startswith(key + "_d") and len(name) <= 160 and name.isidentifier()


def test_build_with_defines_puts_the_defines_ahead_of_the_rendered_module(tmp_path, monkeypatch):
    """mlagen.build.build_with_defines (the diagnostic tools' and GPU tests' builds): ``#define NAME VALUE`` lines in
    order ahead of the variant's rendered source, under the module name diagnostic_module_name gives, which the
    rendered module also declares; the compile goes through compile_diagnostic into the given directory."""
    from mlagen import build as build_mod
    from mlagen.codegen import render_variant
    from mlagen.ninja_gen import diagnostic_module_name
    from mlagen.spec import Variant

    v = Variant.from_uri("mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90")
    seen = {}

    def fake_compile(var, src, mod, out_dir):
        seen.update(var=var, src=src, mod=mod, out_dir=out_dir)
        return out_dir / f"{mod}.so"

    monkeypatch.setattr(build_mod.ninja_gen, "compile_diagnostic", fake_compile)
    defines = (("MLAGEN_DST_TRACE", 1), ("MLAGEN_DST_RESCALE_SLACK", -1))
    mod, so = build_mod.build_with_defines(v, defines, tmp_path)
    assert mod == diagnostic_module_name(v.build_key, defines) and so == tmp_path / f"{mod}.so"
    assert seen["src"] == "#define MLAGEN_DST_TRACE 1\n#define MLAGEN_DST_RESCALE_SLACK -1\n" + render_variant(v, mod)
    assert seen["var"] is v and seen["out_dir"] == tmp_path and mod in seen["src"]
