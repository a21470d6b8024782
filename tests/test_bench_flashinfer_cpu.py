"""CPU-only tests of run_bench's FlashInfer columns (bench/flashinfer_baselines.py), the wheel repack
(bench/wheels.py) and the ncu L2-traffic tool (tools/l2_bytes.py): argument parsing, table / JSON /
plot columns from fake timings, the sm_120 planning patch against a stand-in flashinfer, the causal
mask and CSR metadata, the trimmed wheel's include closure, and the one-line skip without flashinfer."""

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import types
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import flashinfer_baselines as fib  # noqa: E402
import wheels  # noqa: E402

torch_cpu = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode != 0,
    reason="torch not installed")


# --------------------------------------------------------------------------- columns / arguments

def test_default_and_usable_columns():
    assert fib.default_columns(9, smem_mode=False) == ["fa2", "fa2@sm120", "fa3"]
    assert fib.default_columns(12, smem_mode=False) == ["fa2", "fa2@sm120"]
    assert fib.default_columns(9, smem_mode=True) == ["fa2@sm120"]
    keep, notes = fib.usable_columns(["fa2", "fa3"], 12)
    assert keep == ["fa2"] and len(notes) == 1 and "fa3" in notes[0] and "sm_90" in notes[0]
    assert fib.usable_columns(["fa3"], 9) == (["fa3"], [])
    assert fib.label("fa2@sm120") == "FI fa2 @sm120"
    assert fib.label("fa2@sm120", 150000) == "FI fa2 @150000 B/SM"
    assert fib.label("fa3") == "FI fa3 (Hopper only)"
    assert fib.smem_per_block(102400) == 101376 and fib.smem_per_block(150000) == 148976


def test_parse_columns():
    assert fib.parse_columns("fa3, fa2,fa3") == ["fa3", "fa2"]
    for bad in ("fa4", "", ","):
        with pytest.raises(ValueError):
            fib.parse_columns(bad)


def test_run_bench_flashinfer_arguments():
    import run_bench

    a = run_bench._parse([])
    assert a.flashinfer is True and a.fi_columns is None
    assert run_bench._parse(["--no-flashinfer"]).flashinfer is False
    assert run_bench._parse(["--fi-columns", "fa2@sm120"]).fi_columns == ["fa2@sm120"]
    with pytest.raises(SystemExit):
        run_bench._parse(["--fi-columns", "fa9"])


def test_flashinfer_available_never_raises(monkeypatch):
    monkeypatch.setattr(fib, "_fi", None)
    monkeypatch.setattr(fib, "_import_error", None)
    ok, why = fib.flashinfer_available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    try:
        import torch
    except Exception:  # noqa: BLE001
        assert not ok
        return
    if not torch.cuda.is_available():
        assert not ok and "CUDA" in why
    # a GPU but no importable flashinfer: a reason, not an exception
    monkeypatch.setattr(fib, "_fi", None)
    monkeypatch.setattr(fib, "_import_error", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    ok2, why2 = fib.flashinfer_available()
    assert not ok2 and "flashinfer not importable" in why2


def test_fi_setup_skips_with_one_line(monkeypatch, capsys):
    import run_bench

    monkeypatch.setattr(fib, "flashinfer_available", lambda: (False, "flashinfer not importable: ModuleNotFoundError"))
    cols, smem = run_bench._fi_setup(run_bench._parse([]), None)
    assert cols == [] and smem == fib.SM120_SMEM_PER_SM
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["FlashInfer columns skipped: flashinfer not importable: ModuleNotFoundError"]
    cols, _ = run_bench._fi_setup(run_bench._parse(["--no-flashinfer"]), None)
    assert cols == [] and capsys.readouterr().out.strip() == "FlashInfer columns skipped: --no-flashinfer"


@torch_cpu
def test_fi_setup_picks_columns(monkeypatch, capsys):
    import run_bench
    import torch

    monkeypatch.setattr(fib, "flashinfer_available", lambda: (True, "flashinfer 0.7.4 (/x)"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert run_bench._fi_setup(run_bench._parse([]), None) == (["fa2", "fa2@sm120", "fa3"], 102400)
    assert run_bench._fi_setup(run_bench._parse(["--smem-per-sm", "sm120"]), 102400) == (["fa2@sm120"], 102400)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (12, 0))
    cols, _ = run_bench._fi_setup(run_bench._parse(["--fi-columns", "fa3,fa2"]), None)
    assert cols == ["fa2"]
    assert "FI fa3 (Hopper only) left out" in capsys.readouterr().out


# --------------------------------------------------------------------------- table / JSON / plot

def _row(**kw):
    r = dict(H=8, q_len=9, bs=1, ctx=65536, page_size=1,
             mlagen_uri="mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lwbulk_bn32_w8_rt1_st2_tree_bf16_sm120_sm90",
             mlagen_us=100.0, gbs=750.0, floor_us=18.0, frac_floor=0.18, candidates={})
    r.update(kw)
    return r


def test_table_and_row_line_carry_flashinfer_columns(capsys):
    import run_bench

    rows = [_row(fi_fa2_us=96.0, fi_fa2_sm120_us=250.0, fi_fa3_us=57.0,
                 fi_max_abs_diff={"fa2": 1e-3, "fa2@sm120": 2e-3, "fa3": 1.5e-3}),
            _row(ctx=4096, mlagen_us=20.0, fi_fa2_us=25.0, fi_errors={"fa3": "RuntimeError: boom"})]
    run_bench._table(rows, [])
    out = capsys.readouterr().out.splitlines()
    head = [ln for ln in out if ln.startswith("| H |")][0]
    for h in ("FI fa2 µs (x mlagen)", "FI fa2 @sm120 µs (x mlagen)", "FI fa3 (Hopper only) µs (x mlagen)",
              "causal max abs diff vs FI"):
        assert h in head
    body = [ln for ln in out if ln.startswith("| 8 |")]
    assert "96.0 (0.96x)" in body[0] and "250.0 (2.50x)" in body[0] and "57.0 (0.57x)" in body[0]
    assert body[0].rstrip().endswith("| 0.002 |")
    assert "25.0 (1.25x)" in body[1] and body[1].count(" - |") >= 2  # no fa2@sm120 / fa3 value, no diff
    ncols = head.count("|")
    assert all(ln.count("|") == ncols for ln in body)  # markdown columns line up
    line = run_bench._fmt(rows[0])
    assert "FI fa2    96.0 us (0.96x)" in line and "FI fa3 (Hopper only)" in line and "causal max|diff| vs FI fa2 0.001" in line
    assert "FI fa3 (Hopper only) error: RuntimeError: boom" in run_bench._fmt(rows[1])
    # a custom label from the record (fa2 configured for another shared memory size)
    run_bench._table(rows[:1], [], {"fi_fa2_sm120": "FI fa2 @150000 B/SM"})
    assert "FI fa2 @150000 B/SM µs" in capsys.readouterr().out


def test_table_without_flashinfer_is_unchanged(capsys):
    import run_bench

    run_bench._table([_row()], [])
    head = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| H |")][0]
    assert "FI" not in head and head.endswith("auto / best fixed NSPLIT |")


def test_fi_record_and_plot_series(monkeypatch, tmp_path):
    import json

    import run_bench

    rec = run_bench._fi_record(["fa2", "fa2@sm120"], 102400)
    assert rec == {"flashinfer_columns": {"fi_fa2": "FI fa2", "fi_fa2_sm120": "FI fa2 @sm120"}, "fi_smem_per_sm": 102400}
    assert run_bench._fi_record(["fa3"], 102400)["fi_smem_per_sm"] is None
    json.dumps(rec)
    got = {}
    import mlagen.plot

    monkeypatch.setattr(mlagen.plot, "plot_time_vs_context", lambda series, path, title, floor: got.update(series))
    rows = [_row(fi_fa2_us=96.0, fi_fa3_us=57.0), _row(ctx=4096, mlagen_us=20.0, fi_fa2_us=25.0), _row(bs=4, fi_fa2_us=1.0)]
    run_bench._plot(rows, tmp_path / "b.png", "fake", rec["flashinfer_columns"])
    assert got["FI fa2 (FlashInfer MLA, causal)"] == [(65536, 96.0), (4096, 25.0)]  # bs 4 row not in the plot
    assert got["FI fa3 (Hopper only) (FlashInfer MLA, causal)"] == [(65536, 57.0)]
    assert not any("sm120" in k for k in got)


@torch_cpu
def test_measure_fi_row_keys(monkeypatch):
    import run_bench

    monkeypatch.setattr(run_bench, "_mlagen_causal_out", lambda p, k: "REF")

    def fake_measure(p, c, smem, ref):
        assert ref == "REF" and smem == 102400
        if c == "fa3":
            raise RuntimeError("no sm_90a here\nmore")
        return {"fa2": 96.0, "fa2@sm120": 250.0}[c], 1e-3

    monkeypatch.setattr(fib, "measure", fake_measure)
    res = run_bench._measure_fi({}, None, ["fa2", "fa2@sm120", "fa3"], 102400)
    assert res["fi_fa2_us"] == 96.0 and res["fi_fa2_sm120_us"] == 250.0 and "fi_fa3_us" not in res
    assert res["fi_max_abs_diff"] == {"fa2": 1e-3, "fa2@sm120": 1e-3}
    assert res["fi_errors"] == {"fa3": "RuntimeError: no sm_90a here"}


def test_run_sharded_passes_the_ready_columns_to_workers(tmp_path, monkeypatch):
    import json
    import types as _t
    from pathlib import Path

    import run_bench

    monkeypatch.setattr(run_bench, "build", lambda *a, **k: _t.SimpleNamespace(built=[], failed=[]))
    monkeypatch.setattr(run_bench, "_versions", lambda: dict(device="fake"))
    monkeypatch.setattr(run_bench, "_finish", lambda rec, out: None)
    monkeypatch.setattr(run_bench, "_fi_setup", lambda a, smem: (["fa2", "fa2@sm120", "fa3"], 102400))
    monkeypatch.setattr(fib, "prebuild_in_background", lambda cols, smem: (lambda: (1.0, {"fa3": "nvcc failed"})))
    cmds = []

    class FakeWorker:
        def __init__(self, cmd, stdout, stderr, env):
            cmds.append(cmd)
            ids = [int(i) for i in cmd[cmd.index("--shard") + 1].split(",")]
            Path(cmd[-1], "bench.json").write_text(json.dumps(dict(rows=[dict(grid_index=i) for i in ids],
                                                                   nsplit_sweep=[], ceilings={})))

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeWorker)
    argv = ["--grid", "full", "--gpus", "2", "--skip-sglang"]
    assert run_bench._run_sharded(run_bench._parse(argv), run_bench.FULL[:4], 2, tmp_path, argv) == 0
    for cmd in cmds:
        assert cmd[cmd.index("--fi-columns") + 1] == "fa2,fa2@sm120"  # fa3 failed to build: not retried
        assert cmd[-2] == "--out" and cmd[cmd.index("--shard") - 1] == "1"
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert rec["flashinfer_columns"] == {"fi_fa2": "FI fa2", "fi_fa2_sm120": "FI fa2 @sm120"}


# --------------------------------------------------------------------------- problem views

@torch_cpu
def test_causal_tree_mask_is_a_chain():
    m = fib.causal_tree_mask(2, 4, "cpu")
    assert m.tolist() == [[1, 3, 7, 15]] * 2
    assert fib.causal_tree_mask(1, 64, "cpu")[0, 63].item() == -1


@torch_cpu
@pytest.mark.parametrize("page_size", [1, 4])
def test_csr_metadata_and_paged_kv_are_views_of_the_problem(page_size):
    import sglang_baselines as sgl
    import torch

    p = sgl.make_problem(H=2, q_len=3, bs=2, ctx=16, page_size=page_size, device="cpu", seed=1)
    md = fib.csr_metadata(p)
    assert md["qo_indptr"].tolist() == [0, 3, 6] and all(t.dtype == torch.int32 for t in md.values())
    per_req = 16 // page_size
    assert md["kv_indptr"].tolist() == [0, per_req, 2 * per_req]
    pages = (p["req_to_token"][:, ::page_size] // page_size).reshape(-1)
    assert md["kv_indices"].tolist() == pages.tolist() and md["kv_len_arr"].tolist() == [16, 16]
    kv3 = fib.paged_kv(p)
    assert kv3.shape[1:] == (page_size, 576) and kv3.data_ptr() == p["kv_cache"].data_ptr()
    slot = int(p["req_to_token"][1, 5])  # token 5 of request 1 = row (page, offset) of the paged view
    assert torch.equal(kv3[slot // page_size, slot % page_size], p["kv_cache"][slot])


@torch_cpu
def test_fimla_plans_causal_and_patches_smem_only_while_planning(monkeypatch):
    """FiMLA against a stand-in flashinfer: the plan FlashInfer gets, and the sm_120 patch's scope."""
    import sglang_baselines as sgl
    import torch

    seen = []
    fa_common = types.SimpleNamespace(_get_fa_shared_memory_limits=lambda device: (233472, 232448))
    fa2_backend = types.SimpleNamespace(get_batch_mla_module=lambda *a: "native module")

    class Wrapper:
        def __init__(self, ws, backend):
            self.backend = backend

        def plan(self, **kw):
            seen.append(dict(kw, backend=self.backend, smem=fa_common._get_fa_shared_memory_limits(None),
                             module=fa2_backend.get_batch_mla_module()))

        def run(self, query, kv_cache, out):
            seen.append(("run", query.shape, kv_cache.shape, out.shape))
            return out

    class Meta:
        @staticmethod
        def csr(**kw):
            return kw

    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.7.4-fake"
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper, mla.MLAPlanMetadata = Wrapper, Meta
    backends = types.ModuleType("flashinfer.mla._batch_mla._backends")
    backends._fa_common, backends.fa2_backend = fa_common, fa2_backend
    for name, mod in (("flashinfer", fake), ("flashinfer.mla", mla), ("flashinfer.mla._batch_mla", types.ModuleType("x")),
                      ("flashinfer.mla._batch_mla._backends", backends)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(fib, "_fi", fake)
    monkeypatch.setattr(fib, "_smem_module", lambda n: f"module built for {n}")
    p = sgl.make_problem(H=8, q_len=9, bs=1, ctx=64, page_size=1, device="cpu", seed=0)
    f = fib.FiMLA(p, "fa2@sm120")
    plan = seen[0]
    assert plan["backend"] == "fa2" and plan["causal"] is True and plan["num_heads"] == 8
    assert (plan["head_dim_ckv"], plan["head_dim_kpe"], plan["page_size"]) == (512, 64, 1)
    assert plan["sm_scale"] == p["softmax_scale"] and plan["q_data_type"] == torch.bfloat16
    assert plan["smem"] == (102400, 101376) and plan["module"] == "module built for 102400"
    assert fa_common._get_fa_shared_memory_limits(None) == (233472, 232448)  # restored after planning
    assert fa2_backend.get_batch_mla_module() == "native module"
    out = fib._out(p)
    f(p["q"], fib.paged_kv(p), out)
    assert seen[1] == ("run", (9, 8, 576), (p["kv_cache"].shape[0], 1, 576), (9, 8, 512))
    fib.FiMLA(p, "fa3")
    assert seen[2]["backend"] == "fa3" and seen[2]["smem"] == (233472, 232448)
    with pytest.raises(ValueError):
        fib.FiMLA(p, "fa4")


def test_override_header_wraps_only_the_smem_attribute():
    text = open(fib.OVERRIDE_HEADER).read()
    assert "#define cudaDeviceGetAttribute mlagen_fi_device_get_attribute" in text
    assert "cudaDevAttrMaxSharedMemoryPerMultiprocessor" in text and "MLAGEN_FI_SMEM_PER_SM" in text


@pytest.mark.skipif(not os.path.exists("/usr/local/cuda/include/cuda_runtime.h") and
                    subprocess.run(["which", "nvcc"], capture_output=True).returncode != 0, reason="no CUDA toolkit")
def test_override_header_clamps_the_attribute_it_reports(tmp_path):
    """Compile a host program with the header pre-included against a stand-in cudaDeviceGetAttribute."""
    src = tmp_path / "t.cu"
    src.write_text("""
#include <cstdio>
cudaError_t fake(int* v, cudaDeviceAttr a, int) { *v = a == cudaDevAttrMaxSharedMemoryPerMultiprocessor ? 233472 : 7; return cudaSuccess; }
int main() {
  int smem = 0, other = 0;
  cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0);
  cudaDeviceGetAttribute(&other, cudaDevAttrMultiProcessorCount, 0);
  std::printf("%d %d\\n", smem, other);
}
""")
    # route the wrapper's ::cudaDeviceGetAttribute to `fake` (no GPU here): preprocess-level stand-in
    shim = tmp_path / "shim.h"
    shim.write_text("#include <cuda_runtime.h>\ncudaError_t fake(int*, cudaDeviceAttr, int);\n"
                    "#define cudaDeviceGetAttribute fake\n"
                    f'#include "{fib.OVERRIDE_HEADER}"\n')
    exe = tmp_path / "t"
    r = subprocess.run(["nvcc", "-include", str(shim), "-DMLAGEN_FI_SMEM_PER_SM=102400", str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("nvcc could not build the host test: " + r.stderr[-300:])
    assert subprocess.run([str(exe)], capture_output=True, text=True).stdout.split() == ["102400", "7"]


# --------------------------------------------------------------------------- wheels

def _write_wheel(path, files: dict[str, str], dist="flashinfer_python", ver="0.7.4"):
    di = f"{dist}-{ver}.dist-info/"
    files = dict(files)
    files[di + "WHEEL"] = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[di + "METADATA"] = f"Name: {dist}\nVersion: {ver}\n"
    rec = io.StringIO()
    w = csv.writer(rec, lineterminator="\n")
    for n, t in files.items():
        w.writerow([n, wheels.rec_hash(t.encode()), len(t.encode())])
    w.writerow([di + "RECORD", "", ""])
    with zipfile.ZipFile(path, "w") as z:
        for n, t in files.items():
            z.writestr(n, t)
        z.writestr(di + "RECORD", rec.getvalue())


FAKE_FI = {
    "flashinfer/__init__.py": "",
    "flashinfer/mla/_core.py": "",
    "flashinfer/experimental/op.cu": "// other operator",
    "flashinfer/experimental/op.py": "",
    "flashinfer/experimental/table.json": "{}",
    "flashinfer/data/include/flashinfer/attention/mla.cuh": '#include "../utils.cuh"\n#include <cuda_runtime.h>\n',
    "flashinfer/data/include/flashinfer/utils.cuh": "#include <flashinfer/math.cuh>\n",
    "flashinfer/data/include/flashinfer/math.cuh": "",
    "flashinfer/data/include/flashinfer/gemm/unused.cuh": "",
    "flashinfer/data/cutlass/include/cute/tensor.hpp": "",
    "flashinfer/data/csrc/tvm_ffi_utils.h": '#include "tvm/ffi/function.h"\n',
    "flashinfer/data/csrc/other_op.cu": "",
    "flashinfer/data/csrc/other_helper.h": "",
    "flashinfer/data/csrc/batch_mla_config.jinja": "#include <flashinfer/math.cuh>\n",
    **{f"flashinfer/data/csrc/batch_mla{s}_{k}.cu": ('#include <flashinfer/attention/mla.cuh>\n#include "batch_mla_config.inc"\n'
                                                     '#include "batch_mla_sm90_config.inc"\n#include "tvm_ffi_utils.h"\n')
       for s in ("", "_sm90") for k in ("plan", "run", "binding")},
}


def test_slim_fi_keeps_the_mla_closure_and_python(tmp_path, capsys):
    src = tmp_path / "flashinfer_python-0.7.4-py3-none-any.whl"
    _write_wheel(src, FAKE_FI)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    wheels.cmd_slim_fi(str(src), str(out_dir))
    out = out_dir / "flashinfer_python-0.7.4-1mla-py3-none-any.whl"
    z = zipfile.ZipFile(out)
    names = set(z.namelist())
    for keep in ("flashinfer/__init__.py", "flashinfer/experimental/op.py", "flashinfer/experimental/table.json",
                 "flashinfer/data/csrc/tvm_ffi_utils.h", "flashinfer/data/csrc/batch_mla_config.jinja",
                 "flashinfer/data/csrc/batch_mla_sm90_run.cu", "flashinfer/data/include/flashinfer/gemm/unused.cuh",
                 "flashinfer/data/cutlass/include/cute/tensor.hpp"):
        assert keep in names, keep
    for drop in ("flashinfer/experimental/op.cu", "flashinfer/data/csrc/other_op.cu", "flashinfer/data/csrc/other_helper.h"):
        assert drop not in names, drop
    di = "flashinfer_python-0.7.4.dist-info/"
    assert "Build: 1mla" in z.read(di + "WHEEL").decode() and "Tag: py3-none-any" in z.read(di + "WHEEL").decode()
    rows = list(csv.reader(io.StringIO(z.read(di + "RECORD").decode())))
    recorded = {r[0] for r in rows}
    assert recorded == names  # every member recorded, nothing else
    for n, h, size in rows:
        if h:
            data = z.read(n)
            assert h == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)
    assert "kept from data/csrc:" in capsys.readouterr().out
    wheels.cmd_check_fi(str(out), str(src))  # nothing the full wheel resolves is lost


def test_check_fi_fails_on_a_lost_header(tmp_path):
    full = tmp_path / "flashinfer_python-0.7.4-py3-none-any.whl"
    _write_wheel(full, FAKE_FI)
    broken = tmp_path / "flashinfer_python-0.7.4-1mla-py3-none-any.whl"
    _write_wheel(broken, {k: v for k, v in FAKE_FI.items() if not k.endswith("utils.cuh")})
    with pytest.raises(SystemExit) as e:
        wheels.cmd_check_fi(str(broken), str(full))
    assert e.value.code == 1


def test_slim_fi_refuses_a_wheel_without_the_mla_sources(tmp_path):
    src = tmp_path / "flashinfer_python-0.7.4-py3-none-any.whl"
    _write_wheel(src, {k: v for k, v in FAKE_FI.items() if "batch_mla_sm90_run" not in k})
    with pytest.raises(SystemExit) as e:
        wheels.cmd_slim_fi(str(src), str(tmp_path))
    assert "batch_mla_sm90_run.cu" in str(e.value.code)


def test_sglang_slim_drops_extensions(tmp_path):
    src = tmp_path / "sglang-0.5.23-cp312-cp312-linux_x86_64.whl"
    _write_wheel(src, {"sglang/__init__.py": "", "sglang/_ext.so": "x", "sglang/multimodal_gen/a.py": "",
                       "sglang/test/t.py": ""}, dist="sglang", ver="0.5.23")
    wheels.cmd_slim(str(src), str(tmp_path))
    z = zipfile.ZipFile(tmp_path / "sglang-0.5.23-1slim-py3-none-any.whl")
    names = set(z.namelist())
    assert "sglang/__init__.py" in names and "sglang/test/t.py" in names
    assert "sglang/_ext.so" not in names and "sglang/multimodal_gen/a.py" not in names
    wheel = z.read("sglang-0.5.23.dist-info/WHEEL").decode()
    assert "Tag: py3-none-any" in wheel and "Build: 1slim" in wheel and "Root-Is-Purelib: true" in wheel


def test_have_and_clean(tmp_path):
    (tmp_path / "flashinfer_python-0.7.4-1mla-py3-none-any.whl").write_text("")
    with pytest.raises(SystemExit) as e:
        wheels.cmd_have(str(tmp_path), "flashinfer-python", "0.7.4")
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        wheels.cmd_have(str(tmp_path), "flashinfer-python", "0.7.3")
    assert e.value.code == 1
    wheels.cmd_clean(str(tmp_path), "flashinfer_python")
    assert not list(tmp_path.iterdir())


def test_requirements_pin_one_tvm_ffi_version():
    def pins(name):
        out = {}
        for ln in open(os.path.join(BENCH, name)):
            ln = ln.split("#")[0].strip()
            if ln:
                n, v = ln.split("==")
                out[wheels.norm(n)] = v
        return out

    sgl, fi = pins("requirements.txt"), pins("requirements-flashinfer.txt")
    assert fi["flashinfer_python"].startswith("0.7.")
    assert fi["apache_tvm_ffi"] == sgl["apache_tvm_ffi"]  # both sets installed together keep one version


# --------------------------------------------------------------------------- tools/l2_bytes.py

NCU_CSV = '''==PROF== Connected to process 4242 (/usr/bin/python3)
splits 66
==PROF== Profiling "mla_verify_partial_kernel": 0%....50%....100% - 3 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3","127.0.0.1","void mla_verify_partial_kernel<Cfg<8, 9>>(MlaVerifyParams)","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","75,912,448"
"0","4242","python3","127.0.0.1","void mla_verify_partial_kernel<Cfg<8, 9>>(MlaVerifyParams)","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","98,112"
"0","4242","python3","127.0.0.1","void mla_verify_partial_kernel<Cfg<8, 9>>(MlaVerifyParams)","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","l1tex__m_xbar2l1tex_read_bytes.sum","byte","430,243,840"
"0","4242","python3","127.0.0.1","void mla_verify_partial_kernel<Cfg<8, 9>>(MlaVerifyParams)","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sectors_srcunit_tex_op_read.sum","sector","2,477,000"
"1","4242","python3","127.0.0.1","mla_verify_combine_kernel(MlaVerifyParams)","1","7","(128, 1, 1)","(72, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,000,000"
"1","4242","python3","127.0.0.1","mla_verify_combine_kernel(MlaVerifyParams)","1","7","(128, 1, 1)","(72, 1, 1)","0","9.0","Command line profiler metrics","l1tex__m_xbar2l1tex_read_bytes.sum","byte","n/a"
==PROF== Disconnected from process 4242
'''


def test_l2_bytes_parses_ncu_csv_and_reports_per_kernel():
    import l2_bytes

    ks = l2_bytes.parse_ncu_csv(NCU_CSV)
    assert [k["id"] for k in ks] == [0, 1]
    assert ks[0]["metrics"]["l1tex__m_xbar2l1tex_read_bytes.sum"] == 430243840
    assert "l1tex__m_xbar2l1tex_read_bytes.sum" not in ks[1]["metrics"]  # n/a skipped
    kv = l2_bytes.kv_bytes(1, 65536)
    assert kv == 75497472
    lines = l2_bytes.report_lines(ks, kv, "URI")
    assert len(lines) == 2
    assert lines[0].startswith("mla_verify_partial_kernel: L2->SM    430.2 MB =  5.70 x KV")
    assert "DRAM read     75.9 MB =  1.01 x KV" in lines[0] and "98.1 us" in lines[0] and lines[0].endswith("| URI")
    assert "L2 read by SMs     79.3 MB =  1.05 x KV" in lines[0]  # 2,477,000 sectors x 32 B
    assert lines[1].startswith("mla_verify_combine_kernel: L2->SM n/a") and "L2 read by SMs" not in lines[1]


def test_l2_bytes_ncu_command():
    import l2_bytes

    cmd = l2_bytes.ncu_command("URI", 65536, 1, "ncu")
    s = " ".join(cmd)
    assert cmd[0] == "ncu" and "--clock-control none" in s and "--profile-from-start off" in s
    assert "l1tex__m_xbar2l1tex_read_bytes.sum" in s and "dram__bytes_read.sum" in s and "--print-units base" in s
    assert "lts__t_sectors_srcunit_tex_op_read.sum" in s
    assert cmd[-6:] == ["--child", "URI", "--ctx", "65536", "--bs", "1"]


def test_l2_bytes_json_record_sums_every_kernel():
    import l2_bytes

    ks = l2_bytes.parse_ncu_csv(NCU_CSV)
    kv = l2_bytes.kv_bytes(1, 65536)
    rec = l2_bytes.summary_record(ks, kv, "URI")
    assert rec["uri"] == "URI" and rec["kv_bytes"] == kv
    assert [k["name"] for k in rec["kernels"]] == ["mla_verify_partial_kernel", "mla_verify_combine_kernel"]
    assert rec["kernels"][1]["l2_sm_bytes"] is None and rec["kernels"][1]["us"] is None
    assert rec["l2_sm_per_kv"] == 430243840 / kv  # the combine's n/a is left out, not counted as 0 bytes
    assert rec["dram_per_kv"] == (75912448 + 1000000) / kv
    assert rec["kernels"][0]["us"] == 98.112
    assert rec["l2_read_per_kv"] == 2477000 * 32 / kv and rec["kernels"][1]["l2_read_bytes"] is None
    assert l2_bytes.summary_record([], kv, "URI")["l2_sm_per_kv"] is None


def test_run_bench_reads_the_l2_json_line(capsys):
    import json

    import run_bench

    ks = __import__("l2_bytes").parse_ncu_csv(NCU_CSV)
    rec = __import__("l2_bytes").summary_record(ks, 75497472, "URI")
    out = "==PROF== noise\n" + json.dumps(rec) + "\n"
    row = run_bench.parse_l2_json(out)
    assert row["l2_sm_per_kv"] == rec["l2_sm_per_kv"] and row["l2_kv_bytes"] == 75497472
    assert row["l2_read_per_kv"] == rec["l2_read_per_kv"] == 2477000 * 32 / 75497472
    old = {k: v for k, v in rec.items() if k != "l2_read_per_kv"}  # a record from the tool before the L2-side metric
    assert run_bench.parse_l2_json(json.dumps(old))["l2_read_per_kv"] is None
    assert len(row["l2_kernels"]) == 2
    assert run_bench.parse_l2_json(json.dumps(dict(uri="URI", error="ncu exit 1, 0 kernels profiled"))) == dict(
        l2_error="ncu exit 1, 0 kernels profiled")
    assert run_bench.parse_l2_json("ncu: command failed")["l2_error"].startswith("no JSON line")
    r = dict(H=8, q_len=9, bs=1, ctx=65536, page_size=1, mlagen_uri="mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_"
             "w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90", mlagen_us=54.4, gbs=1390.0, frac_floor=0.33, floor_us=18.0,
             **row)
    assert "L2->SM 5.70 B per KV B (read from L2 1.05) (DRAM 1.02)" in run_bench._fmt(r)
    run_bench._table([r], [], None)
    table = capsys.readouterr().out
    assert "L2 -> SM at H=8 q=9 bs=1 ctx=65536 ps=1" in table and "read from the L2 by the SMs 1.05" in table


def test_run_bench_finds_ncu_as_mlagen_finds_nvcc(tmp_path, monkeypatch):
    """$NCU first (when executable), then $CUDA_HOME/bin, $CUDA_PATH/bin, PATH; a non-executable or missing
    candidate is passed over, never returned."""
    import run_bench

    def tool(d):
        p = tmp_path / d / "bin" / "ncu"
        p.parent.mkdir(parents=True)
        p.write_text("#!/bin/sh\n")
        p.chmod(0o755)
        return str(p)

    home, path_ncu = tool("cuda_home"), tool("on_path")
    noexec = tmp_path / "noexec"
    noexec.write_text("")
    monkeypatch.setattr(run_bench.shutil, "which", lambda name: path_ncu if name == "ncu" else None)
    monkeypatch.setenv("NCU", str(noexec))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda_home"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert run_bench._ncu_path() == home  # $NCU not executable: passed over
    monkeypatch.setenv("NCU", path_ncu)
    assert run_bench._ncu_path() == path_ncu
    monkeypatch.delenv("NCU")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "missing"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "cuda_home"))
    assert run_bench._ncu_path() == home
    monkeypatch.delenv("CUDA_PATH")
    assert run_bench._ncu_path() == path_ncu
