"""CPU tests of the SGLang integration: installed state, startup checks, plugin loading through
SGLang's own entry-point loader, the --attention-backend choice, and the metadata builders.

Needs ``sglang==0.5.23`` (installed with --no-deps) and its light import deps for the SGLang parts;
those tests skip when ``sglang.srt.plugins`` / ``sglang.srt.server_args`` cannot be imported.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as im
import json
import math
import sys
import types

import pytest
import torch

from mlagen.sglang_plugin import checks, installed
from mlagen.sglang_plugin import metadata as md
from mlagen.sglang_plugin.checks import MlagenSetupError, ServerFacts


# ----------------------------------------------------------------------------- helpers
def _entry(**kw):
    e = dict(uri="mla_verify_h16_q4_tree", so_path="/x/h16.so", role="verify", heads=16, q_len=4,
             page_size=64, kv_lora_rank=512, qk_rope_head_dim=64, mask="tree", nsplit="auto",
             bucket="h16_q4_kv512_rope64_ps64_tree_bf16")
    e.update(kw)
    return e


def _state(*entries, arch="sm_90"):
    return {"mlagen_version": "0.1.0", "arch": arch, "entries": list(entries)}


def _facts(**kw):
    f = dict(sglang_version="0.5.23", architectures=("DeepseekV3ForCausalLM",), is_mla=True,
             kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=128, attn_tp_size=8,
             page_size=64, kv_cache_dtype="bfloat16", spec_algorithm="EAGLE", num_draft_tokens=4,
             eagle_topk=2, draft_attention_backend="triton")
    f.update(kw)
    return ServerFacts(**f)


# ----------------------------------------------------------------------------- installed.json
def test_installed_roundtrip_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert installed.installed_path() == tmp_path / "cache" / "installed.json"
    assert installed.read_installed() is None
    st = _state(_entry(), _entry(uri="dec", role="decode", q_len=1, mask="causal", nsplit=32))
    p = installed.write_installed(st)
    assert p == installed.installed_path()
    assert installed.read_installed() == st
    assert json.loads(p.read_text())["entries"][1]["nsplit"] == 32
    assert [x.name for x in p.parent.iterdir()] == ["installed.json"]  # no temp file left behind
    assert installed.clear_installed() is True
    assert installed.clear_installed() is False
    assert installed.read_installed() is None


@pytest.mark.parametrize("bad, text", [
    (_state(_entry(role="prefill")), "role must be one of"),
    (_state(_entry(heads=0)), "'heads' must be a positive int"),
    (_state(_entry(nsplit="many")), "nsplit must be"),
    (_state(_entry(mask="sliding")), "mask must be one of"),
    (_state(_entry(role="decode", q_len=4)), "decode entry must have q_len 1"),
    (_state(_entry(), _entry()), "listed twice"),
    (_state(_entry(), arch="sm_80"), "'arch' must be one of"),
])
def test_installed_schema_rejects(tmp_path, bad, text):
    with pytest.raises(installed.InstalledStateError, match=text):
        installed.write_installed(bad, tmp_path / "i.json")
    assert not (tmp_path / "i.json").exists()
    (tmp_path / "i.json").write_text(json.dumps(bad))
    with pytest.raises(installed.InstalledStateError, match=text):
        installed.read_installed(tmp_path / "i.json")


def test_installed_bad_json(tmp_path):
    (tmp_path / "i.json").write_text("{not json")
    with pytest.raises(installed.InstalledStateError, match="not valid JSON"):
        installed.read_installed(tmp_path / "i.json")


# ----------------------------------------------------------------------------- startup checks
@pytest.mark.parametrize("v", ["0.5.22", "0.5.23", "0.5.23.post1", "0.5.23+cu129"])
def test_version_supported(v):
    checks.check_sglang_version(v)


@pytest.mark.parametrize("v", ["0.5.12", "0.5.21", "0.5.22rc1", "0.5.24", "0.5.24rc0", "0.6.0", "0.4.10"])
def test_version_rejected(v):
    with pytest.raises(MlagenSetupError) as ei:
        checks.check_sglang_version(v)
    msg = str(ei.value)
    assert f"SGLang {v} is not supported" in msg
    assert "sglang>=0.5.22,<0.5.24" in msg


def test_select_matching_verify_prefers_exact_qlen():
    st = _state(_entry(uri="q9", q_len=9), _entry(uri="q4"), _entry(uri="q4_ps1", page_size=1))
    sel = checks.run_startup_checks(_facts(), st)
    assert sel.verify["uri"] == "q4" and sel.decode is None


def test_chain_prefers_causal_and_tree_requires_tree():
    st = _state(_entry(uri="tree"), _entry(uri="causal", mask="causal"))
    assert checks.select_entries(st, _facts(eagle_topk=1)).verify["uri"] == "causal"
    assert checks.select_entries(st, _facts(eagle_topk=4)).verify["uri"] == "tree"
    with pytest.raises(MlagenSetupError, match=r"mask 'causal' not in \['tree'\]"):
        checks.select_entries(_state(_entry(uri="causal", mask="causal")), _facts(eagle_topk=4))


def test_mismatched_heads_message():
    st = _state(_entry(uri="mla_verify_h8", heads=8))
    with pytest.raises(MlagenSetupError) as ei:
        checks.run_startup_checks(_facts(), st)  # 128 heads / TP8 = 16 per rank
    msg = str(ei.value)
    assert "no installed verify variant matches this server (heads_per_rank=16, page_size=64" in msg
    assert "mla_verify_h8 (role=verify, heads=8" in msg
    assert "heads_per_rank 8 != 16" in msg
    assert ("Build and install a verify variant with heads_per_rank: 16, q_len: 4, page_size: 64, "
            "kv_lora_rank: 512, qk_rope_head_dim: 64, mask: tree") in msg


@pytest.mark.parametrize("entry_kw, text", [
    (dict(page_size=1), "page_size 1 != 64"),
    (dict(kv_lora_rank=256), "kv_lora_rank 256 != 512"),
    (dict(qk_rope_head_dim=32), "qk_rope_head_dim 32 != 64"),
    (dict(q_len=2), "q_len 2 < 4 draft tokens"),
])
def test_mismatched_variant_fields(entry_kw, text):
    with pytest.raises(MlagenSetupError, match=text):
        checks.run_startup_checks(_facts(), _state(_entry(**entry_kw)))


def test_decode_entries_checked_and_used():
    dec = _entry(uri="dec16", role="decode", q_len=1, mask="causal")
    sel = checks.run_startup_checks(_facts(spec_algorithm=None), _state(dec))
    assert sel.verify is None and sel.decode["uri"] == "dec16"
    with pytest.raises(MlagenSetupError, match=r"(?s)no installed decode variant matches.*heads_per_rank 16 != 8"):
        checks.run_startup_checks(_facts(spec_algorithm=None, attn_tp_size=16), _state(dec))
    with pytest.raises(MlagenSetupError, match="only serves decode, and no decode variant is installed"):
        checks.run_startup_checks(_facts(spec_algorithm=None), _state(_entry()))


def test_nothing_installed_says_what_to_build():
    with pytest.raises(MlagenSetupError, match="no mlagen kernels are installed.*Build and install a verify variant "
                                               "with heads_per_rank: 16, q_len: 4, page_size: 64"):
        checks.run_startup_checks(_facts(), None)


@pytest.mark.parametrize("kw, text", [
    (dict(architectures=("LlamaForCausalLM",), is_mla=False), "does not run SGLang's MLA attention"),
    (dict(architectures=("DeepseekV32ForCausalLM",), uses_sparse_attention=True), "sparse attention"),
    (dict(uses_sparse_attention=True), "sparse attention"),
    (dict(kv_cache_dtype="float8_e5m2"), "KV cache dtype float8_e5m2 is not supported"),
    (dict(is_draft_worker=True), "serves the target model only"),
    (dict(spec_algorithm="NGRAM"), "speculative algorithm NGRAM is not supported"),
    (dict(num_draft_tokens=65), "exceed the kernel's tree-mask limit"),
    (dict(dcp_size=2), "decode context parallelism"),
    (dict(kv_pool_translating=True), "translating"),
    (dict(sglang_version="0.5.12"), "SGLang 0.5.12 is not supported"),
])
def test_model_and_server_rejected(kw, text):
    with pytest.raises(MlagenSetupError, match=text):
        checks.run_startup_checks(_facts(**kw), _state(_entry()))


@pytest.mark.parametrize("kw, serves_verify, note", [
    # no draft backend named: SGLang gives the draft its default draft backend (mlagen is not one)
    (dict(draft_attention_backend=None), True, "no --speculative-draft-attention-backend"),
    # split backends: verify goes to the decode backend under --speculative-attention-mode decode
    (dict(prefill_attention_backend="fa3", decode_attention_backend="mlagen", speculative_attention_mode="decode"),
     True, None),
    (dict(prefill_attention_backend="mlagen", decode_attention_backend="fa3"), True, None),
    (dict(prefill_attention_backend="fa3", decode_attention_backend="mlagen"), False, "target verify runs on fa3"),
    # another architecture on SGLang's MLA code, with a matching installed variant
    (dict(architectures=("MistralLarge3ForCausalLM",)), True, "not among the tested"),
])
def test_valid_deployments_accepted(kw, serves_verify, note):
    """Refuse only what mlagen cannot serve: these deployments start, verify on mlagen where SGLang
    routes target verify to it."""
    sel = checks.run_startup_checks(_facts(**kw), _state(_entry(), _entry(uri="dec", role="decode", q_len=1,
                                                                             mask="causal")))
    assert (sel.verify is not None) == serves_verify and sel.decode["uri"] == "dec"
    if serves_verify:
        assert sel.verify["uri"] == "mla_verify_h16_q4_tree"
    if note:
        assert any(note in n for n in sel.notes), sel.notes
    # the variants must still match the model
    with pytest.raises(MlagenSetupError, match="kv_lora_rank 512 != 256"):
        checks.run_startup_checks(_facts(**dict(kw, kv_lora_rank=256)),
                                  _state(_entry(), _entry(uri="dec", role="decode", q_len=1, mask="causal")))


def test_arch_mismatch():
    with pytest.raises(MlagenSetupError, match="installed kernels are for sm_120 but this GPU is sm_90"):
        checks.run_startup_checks(_facts(device_arch="sm_90"), _state(_entry(), arch="sm_120"))


# ----------------------------------------------------------------------------- metadata builders
from sglang_masks import full_mask_from_parents as _full_mask_from_parents  # noqa: E402


def test_pack_full_mask_matches_tree():
    trees = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0]]
    lens = [3, 0, 7]
    blocks = [_full_mask_from_parents(p, L) for p, L in zip(trees, lens)]
    flat = torch.cat([b.reshape(-1) for b in blocks] + [torch.ones(11, dtype=torch.bool)])
    for dtype in (torch.bool, torch.uint8):
        got = md.pack_full_mask(flat.to(dtype), torch.tensor(lens), 5)
        for b, (p, L) in enumerate(zip(trees, lens)):
            for i in range(5):
                want = sum(1 << j for j in range(5) if blocks[b][i, L + j])
                assert int(got[b, i]) == want, (b, i)
    assert md.causal_bits(4).tolist() == [1, 3, 7, 15]
    assert int(md.causal_bits(64)[63]) == -1  # all 64 bits set


def test_fill_block_table_pages():
    ps = 4
    r2t = torch.zeros(3, 16, dtype=torch.int32)
    r2t[2] = torch.cat([torch.arange(ps) + 8 * ps, torch.arange(ps) + 3 * ps, torch.arange(8) + 5 * ps])
    out = torch.full((2, 4), -7, dtype=torch.int32)
    md.fill_block_table(out, r2t, torch.tensor([2]), md.page_columns(16, ps), ps)
    assert out[0].tolist() == [8, 3, 5, 6] and out[1].tolist() == [-7] * 4
    out1 = torch.zeros(1, 16, dtype=torch.int32)
    md.fill_block_table(out1, r2t, torch.tensor([2], dtype=torch.int32), md.page_columns(16, 1)[:9], 1)
    assert out1[0, :9].tolist() == r2t[2, :9].tolist() and out1[0, 9:].tolist() == [0] * 7
    kv = torch.zeros(4, dtype=torch.int32)
    md.fill_kv_lens(kv, torch.tensor([5, 6, 1, 1]), 3, num_padding=2)
    assert kv.tolist() == [8, 9, 0, 0]


# ----------------------------------------------------------------------------- backend metadata (CPU stand-ins)
class _Mode:
    def __init__(self, name):
        self.name = name

    def is_target_verify(self):
        return self.name == "verify"

    def is_decode(self):
        return self.name == "decode"


class _Variant:
    def __init__(self, q_len, mask):
        self.q_len, self.mask = q_len, mask


class _Kernel:
    """A kernel stand-in for the metadata tests: records check_batch calls (validation is ops' own test)."""

    def __init__(self, q_len, mask):
        self.variant = _Variant(q_len, mask)
        self.batches = []

    def workspace_numel(self, bs, device=None):
        return 8 * bs

    def alloc_workspace(self, bs, device):
        return torch.zeros(self.workspace_numel(bs), dtype=torch.float32, device=device)

    def check_batch(self, kv_lens, block_table, *, q_len, tree_mask=None, req_pool_indices=None, workspace=None):
        b = types.SimpleNamespace(bs=kv_lens.shape[0], q_len=q_len, kv_lens=kv_lens, block_table=block_table,
                                  tree_mask=tree_mask, workspace=workspace)
        self.batches.append(b)
        return b


class _Fallback:
    target_verify_num_tokens_per_req = 5

    def __init__(self):
        self.calls = []

    def init_forward_metadata(self, fb):
        self.calls.append(("eager", fb.forward_mode.name))

    def init_cuda_graph_state(self, max_bs, max_num_tokens, **kw):
        self.calls.append(("state", max_bs))

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.calls.append(("out_graph", fb.forward_mode.name, in_capture))


def _runner(ps, width=32, rows=6):
    r2t = (torch.arange(rows * width, dtype=torch.int32).reshape(rows, width) * 3) % 1000
    if ps > 1:  # page-aligned contiguous slots per page
        pages = torch.randperm(rows * width // ps)[: rows * (width // ps)].reshape(rows, width // ps)
        r2t = (pages[:, :, None] * ps + torch.arange(ps)).reshape(rows, width).to(torch.int32)
    mr = types.SimpleNamespace(
        device="cpu", req_to_token_pool=types.SimpleNamespace(req_to_token=r2t), token_to_kv_pool=None,
        kv_index_translator=None, page_size=ps, model_config=types.SimpleNamespace(context_len=width))
    return mr, r2t


@pytest.mark.parametrize("ps", [1, 4])
def test_backend_prepare_eager_and_graph(ps):
    pytest.importorskip("sglang")
    from mlagen.sglang_plugin.backend import MlagenAttnBackend

    mr, r2t = _runner(ps)
    fbk = _Fallback()
    be = MlagenAttnBackend(mr, verify_kernel=_Kernel(8, "tree"), decode_kernel=None, fallback=fbk)
    trees = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]]
    lens = [6, 11]
    mask = torch.cat([_full_mask_from_parents(p, L).reshape(-1) for p, L in zip(trees, lens)])
    spec = types.SimpleNamespace(custom_mask=mask.to(torch.uint8), num_tokens_per_req=5)
    fb = types.SimpleNamespace(forward_mode=_Mode("verify"), spec_info=spec, batch_size=2,
                               req_pool_indices=torch.tensor([4, 1]), seq_lens=torch.tensor(lens))
    be.init_forward_metadata(fb)
    m = be.forward_metadata
    assert m.kind == "verify" and m.q_len == 5 and m.kv_lens.tolist() == [11, 16]
    want_pages = (r2t[[4, 1]][:, ::ps] // ps)[:, : m.block_table.shape[1]]
    assert torch.equal(m.block_table, want_pages)
    assert m.tree_mask.tolist() == [[1, 3, 5, 11, 21], [1, 3, 7, 15, 31]]
    assert fbk.calls == []

    # graph: capture at bs 4, then replay with 2 real rows + 2 padded rows
    be._graph = {"kv_lens": torch.full((4,), 99, dtype=torch.int32),
                 "block_table": torch.full((4, 32 // ps), -1, dtype=torch.int32),
                 "tree": torch.full((4, 5), -1, dtype=torch.int64), "ws_verify": torch.zeros(64), "ws_decode": None}
    rpi_buf, seq_buf = torch.tensor([4, 1, 0, 0]), torch.tensor([lens[0], lens[1], 1, 1])
    cap = types.SimpleNamespace(forward_mode=_Mode("verify"), spec_info=types.SimpleNamespace(
        custom_mask=torch.ones(1000, dtype=torch.bool), num_tokens_per_req=5), batch_size=4,
        req_pool_indices=rpi_buf, seq_lens=seq_buf)
    be.init_forward_metadata_out_graph(cap, in_capture=True)
    mc = be.forward_metadata
    assert mc.tree_mask.tolist() == [[1, 3, 7, 15, 31]] * 4  # capture: causal placeholder
    view = types.SimpleNamespace(forward_mode=_Mode("verify"), spec_info=spec, batch_size=4,
                                 req_pool_indices=rpi_buf, seq_lens=seq_buf, num_padding=2,
                                 max_seq_len_host=max(lens))
    be.init_forward_metadata_out_graph(view)
    mr_ = be.forward_metadata
    assert mr_.kv_lens.data_ptr() == mc.kv_lens.data_ptr() and mr_.tree_mask.data_ptr() == mc.tree_mask.data_ptr()
    assert be._graph["kv_lens"].tolist() == [11, 16, 0, 0]
    assert be._graph["tree"].tolist() == [[1, 3, 5, 11, 21], [1, 3, 7, 15, 31], [0] * 5, [0] * 5]
    npg = -(-16 // ps)
    assert torch.equal(be._graph["block_table"][:2, :npg], (r2t[[4, 1]][:, ::ps] // ps)[:, :npg])

    # other modes go to the fallback
    ext = types.SimpleNamespace(forward_mode=_Mode("extend"), spec_info=None)
    be.init_forward_metadata(ext)
    assert be.forward_metadata is None and fbk.calls == [("eager", "extend")]
    dec = types.SimpleNamespace(forward_mode=_Mode("decode"), spec_info=None)
    be._graph_dims = (4, 20, {})
    be.init_forward_metadata_out_graph(dec, in_capture=True)
    assert fbk.calls[1:] == [("state", 4), ("out_graph", "decode", True)]


def test_graph_batch_with_more_draft_tokens_than_the_buffers_is_refused_before_any_fill():
    """A replay whose num_tokens_per_req exceeds the tree buffer's width (sized from verify_q_len at
    init_cuda_graph_state) raises before the metadata fill, which would write past the buffer."""
    pytest.importorskip("sglang")
    from mlagen.sglang_plugin.backend import MlagenAttnBackend

    mr, _ = _runner(1)
    be = MlagenAttnBackend(mr, verify_kernel=_Kernel(8, "tree"), decode_kernel=None, fallback=_Fallback())
    tree = torch.full((2, 4), -7, dtype=torch.int64)
    be._graph = {"kv_lens": torch.zeros(2, dtype=torch.int32), "block_table": torch.zeros(2, 32, dtype=torch.int32),
                 "tree": tree, "ws_verify": torch.zeros(64), "ws_decode": None}
    spec = types.SimpleNamespace(custom_mask=torch.ones(2 * 6 * 6, dtype=torch.uint8), num_tokens_per_req=6)
    fb = types.SimpleNamespace(forward_mode=_Mode("verify"), spec_info=spec, batch_size=2,
                               req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([5, 9]), max_seq_len_host=9)
    with pytest.raises(RuntimeError, match="6 draft tokens per request exceeds the 4"):
        be.init_forward_metadata_out_graph(fb)
    assert (tree == -7).all() and be.verify_kernel.batches == []


# ----------------------------------------------------------------------------- SGLang plugin loading
@pytest.fixture
def sgl_plugins(monkeypatch):
    """SGLang's plugin module with a fresh load guard and the attention choices restored after."""
    plugins = pytest.importorskip("sglang.srt.plugins", reason="sglang (0.5.23) is not importable")
    choices = pytest.importorskip("sglang.srt.arg_groups.choices")
    saved = list(choices.ATTENTION_BACKEND_CHOICES)
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    if "mlagen" in choices.ATTENTION_BACKEND_CHOICES:
        choices.ATTENTION_BACKEND_CHOICES.remove("mlagen")
    yield plugins, choices
    choices.ATTENTION_BACKEND_CHOICES[:] = saved


def _parser():
    server_args = pytest.importorskip("sglang.srt.server_args")
    p = argparse.ArgumentParser(prog="sglang serve")
    server_args.ServerArgs.add_cli_args(p)
    return p


def _fake_dist(tmp_path, monkeypatch):
    d = tmp_path / "site" / "mlagen_testplugin-0.0.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: mlagen-testplugin\nVersion: 0.0\n")
    (d / "entry_points.txt").write_text("[sglang.srt.plugins]\nmlagen = mlagen.sglang_plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()


def test_plugin_loaded_by_sglang_loader(sgl_plugins, tmp_path, monkeypatch):
    plugins, choices = sgl_plugins
    with pytest.raises(SystemExit):  # not a choice before the plugin runs
        _parser().parse_args(["--model-path", "m", "--attention-backend", "mlagen"])
    _fake_dist(tmp_path, monkeypatch)
    eps = {ep.name: ep.value for ep in im.entry_points(group="sglang.srt.plugins")}
    assert eps.get("mlagen") == "mlagen.sglang_plugin:register"
    plugins.load_plugins()
    assert "mlagen" in choices.ATTENTION_BACKEND_CHOICES
    args = _parser().parse_args(["--model-path", "m", "--attention-backend", "mlagen",
                                 "--speculative-draft-attention-backend", "triton"])
    assert args.attention_backend == "mlagen"
    assert _parser().parse_args(["--model-path", "m", "--decode-attention-backend", "mlagen"]
                                ).decode_attention_backend == "mlagen"
    plugins.load_plugins()  # idempotent: the guard, and add_backend_choice itself
    from mlagen.sglang_plugin import add_backend_choice

    assert add_backend_choice() is False
    assert choices.ATTENTION_BACKEND_CHOICES.count("mlagen") == 1


def test_plugin_respects_sglang_plugins_allowlist(sgl_plugins, tmp_path, monkeypatch):
    plugins, choices = sgl_plugins
    _fake_dist(tmp_path, monkeypatch)
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    plugins.load_plugins()
    assert "mlagen" not in choices.ATTENTION_BACKEND_CHOICES


def test_register_factory_into_registry(sgl_plugins, monkeypatch):
    """The factory goes into ATTENTION_BACKENDS (a stand-in registry module when SGLang's real one
    cannot be imported on this CPU box, e.g. without torchvision)."""
    name = "sglang.srt.layers.attention.attention_registry"
    try:
        real = importlib.import_module(name)
    except Exception:
        real = None
    if real is None:
        fake = types.ModuleType(name)
        fake.ATTENTION_BACKENDS = {}

        def register_attention_backend(n):
            def deco(fn):
                fake.ATTENTION_BACKENDS[n] = fn
                return fn
            return deco

        fake.register_attention_backend = register_attention_backend
        monkeypatch.setitem(sys.modules, name, fake)
        pkg = importlib.import_module("sglang.srt.layers.attention")
        monkeypatch.setattr(pkg, "attention_registry", fake, raising=False)
        reg = fake
    else:
        reg = real
        monkeypatch.delitem(reg.ATTENTION_BACKENDS, "mlagen", raising=False)
    from mlagen.sglang_plugin import register

    register()
    assert "mlagen" in reg.ATTENTION_BACKENDS and callable(reg.ATTENTION_BACKENDS["mlagen"])
    assert "mlagen" in sgl_plugins[1].ATTENTION_BACKEND_CHOICES
    if real is not None:
        monkeypatch.delitem(reg.ATTENTION_BACKENDS, "mlagen", raising=False)


def test_installed_package_entry_point():
    """Passes once pyproject.toml declares the entry point and the package is (re)installed."""
    eps = [ep for ep in im.entry_points(group="sglang.srt.plugins")
           if ep.value == "mlagen.sglang_plugin:register" and ep.dist is not None
           and ep.dist.name.lower().replace("_", "-") == "mlagen"]
    if not eps:
        pytest.skip("mlagen's sglang.srt.plugins entry point is not installed (add the pyproject "
                    "lines in pyproject.toml and `pip install -e .`)")
    assert eps[0].name == "mlagen"
    assert eps[0].load().__name__ == "register"


# ----------------------------------------------------------------------------- forward through the backend (CPU)
# A torch-reference kernel stands in for a compiled variant; the pool, layer and forward batch are
# stand-ins with the fields SGLang's MLA pool / RadixAttention / ForwardBatch give the backend.
from mlagen.reference import mla_verify_reference  # noqa: E402


class _RefKernel:
    """CPU stand-in for a loaded ``VerifyKernel``: mlagen's torch reference written into ``out``, with
    the checked call (``__call__``) and the per-batch check + unchecked per-layer ``launch`` path."""

    def __init__(self, H, q_len, mask, page_size):
        self.variant = types.SimpleNamespace(heads=H, q_len=q_len, mask=mask, page_size=page_size,
                                             kv_lora_rank=512, dim_v=512, dim_qk=576)
        self.calls = 0
        self.counts = {"check_batch": 0, "check_kv_cache": 0, "launch": 0, "call": 0}

    def check_batch(self, kv_lens, block_table, *, q_len, tree_mask=None, req_pool_indices=None, workspace=None):
        self.counts["check_batch"] += 1
        assert kv_lens.dtype == torch.int32 and block_table.dtype == torch.int32 and 1 <= q_len <= self.variant.q_len
        return types.SimpleNamespace(bs=kv_lens.shape[0], q_len=q_len, kv_lens=kv_lens, block_table=block_table,
                                     tree_mask=tree_mask, workspace=workspace)

    def check_kv_cache(self, kv_cache):
        self.counts["check_kv_cache"] += 1
        assert kv_cache.dtype == torch.bfloat16 and kv_cache.shape[-1] == 576

    def launch(self, batch, q, kv_cache, out, softmax_scale, lse=None):
        self.counts["launch"] += 1
        return self._run(q, kv_cache, batch.block_table, batch.kv_lens, batch.q_len, softmax_scale, batch.tree_mask,
                         out)

    def workspace_numel(self, bs, device=None):
        return 8 * bs

    def alloc_workspace(self, bs, device):
        return torch.zeros(self.workspace_numel(bs), dtype=torch.float32, device=device)

    def __call__(self, q, kv_cache, block_table, kv_lens, *, q_len, softmax_scale, tree_mask=None,
                 req_pool_indices=None, out=None, lse=None, workspace=None):
        self.counts["call"] += 1
        return self._run(q, kv_cache, block_table, kv_lens, q_len, softmax_scale, tree_mask, out)

    def _run(self, q, kv_cache, block_table, kv_lens, q_len, softmax_scale, tree_mask, out):
        self.calls += 1
        assert q.shape == (kv_lens.shape[0] * q_len, self.variant.heads, 576) and out.shape[0] == q.shape[0]
        o, _ = mla_verify_reference(q, kv_cache, block_table, kv_lens, q_len=q_len,
                                    page_size=self.variant.page_size, softmax_scale=softmax_scale,
                                    mask=self.variant.mask, tree_mask=tree_mask)
        out.copy_(o.to(out.dtype).reshape(out.shape))  # out [T, H, 512] or 2-D [T, H * 512], as VerifyKernel.launch takes it
        return out, None


class _Pool:
    """MLA KV pool stand-in: one [slots, 1, 576] bf16 buffer per layer (V = the first 512 dims)."""

    def __init__(self, slots, layers=1, gen=None):
        self.kv_buffer = [torch.randn(slots, 1, 576, generator=gen).to(torch.bfloat16) for _ in range(layers)]

    def get_key_buffer(self, layer_id):
        return self.kv_buffer[layer_id]

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v):
        self.kv_buffer[layer.layer_id][loc_info.loc] = cache_k.reshape(-1, 1, 576).to(torch.bfloat16)


@pytest.fixture
def kv_write_loc(monkeypatch):
    """SGLang's KVWriteLoc (a stand-in with its ``for_batch`` when memory_pool does not import here)."""
    pytest.importorskip("sglang")
    try:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc  # noqa: F401
        return
    except Exception:  # noqa: BLE001 - transformers etc. are not installed with sglang --no-deps
        pass

    class KVWriteLoc:
        def __init__(self, loc, swa_loc=None, full_loc=None, physical=True):
            self.loc = loc

        @classmethod
        def for_batch(cls, fb, *, swa_loc=None, full_loc=None):
            return cls(fb.out_cache_loc, physical=fb.out_cache_loc_is_physical)

    mod = types.ModuleType("sglang.srt.mem_cache.memory_pool")
    mod.KVWriteLoc = KVWriteLoc
    monkeypatch.setitem(sys.modules, mod.__name__, mod)


def _layer(H, scale, layer_id=0, kv_scale=None):
    """A RadixAttention stand-in; ``kv_scale``: the scales an fp8 checkpoint's quant method gives every
    attention layer (BaseKVCacheMethod: k_scale / v_scale parameters, loaded as ``kv_scale`` or 1.0)."""
    layer = types.SimpleNamespace(tp_q_head_num=H, qk_head_dim=576, v_head_dim=512, scaling=scale,
                                  layer_id=layer_id, logit_cap=0.0, k_scale=None, v_scale=None,
                                  k_scale_float=None, v_scale_float=None)
    if kv_scale is not None:
        layer.k_scale = torch.nn.Parameter(torch.tensor(float(kv_scale)), requires_grad=False)
        layer.v_scale = torch.nn.Parameter(torch.tensor(float(kv_scale)), requires_grad=False)
        layer.k_scale_float = layer.v_scale_float = float(kv_scale)
    return layer


def _verify_setup(gen, *, H=2, q_len=5, ps=1, bs=3, width=48, rows=8, mask="tree", real=None, layers=1):
    """A backend over a random req_to_token and pool, and one random verify batch of ``bs`` rows
    (``real`` of them real: the rest padded the way SGLang pads a DP-attention batch)."""
    from mlagen.sglang_plugin.backend import MlagenAttnBackend

    real = bs if real is None else real
    pages = torch.randperm(rows * width // ps, generator=gen).reshape(rows, width // ps) + 1
    r2t = (pages[:, :, None] * ps + torch.arange(ps)).reshape(rows, width).to(torch.int32)
    pool = _Pool((rows * width // ps + 2) * ps, layers, gen)
    mr = types.SimpleNamespace(
        device="cpu", req_to_token_pool=types.SimpleNamespace(req_to_token=r2t), token_to_kv_pool=pool,
        kv_index_translator=None, page_size=ps, model_config=types.SimpleNamespace(context_len=width))
    be = MlagenAttnBackend(mr, verify_kernel=_RefKernel(H, q_len, mask, ps), decode_kernel=None,
                           fallback=_Fallback(), verify_q_len=q_len)
    rpi = torch.randperm(rows - 1, generator=gen)[:real] + 1  # row 0: the padding row
    lens = torch.randint(1, width - q_len + 1, (real,), generator=gen)
    parents = [_parents(q_len, gen) for _ in range(real)]
    full = torch.cat([_full_mask_from_parents(p, int(L)).reshape(-1) for p, L in zip(parents, lens)])
    loc = r2t[rpi[:, None], lens[:, None] + torch.arange(q_len)].reshape(-1).to(torch.int64)
    npad = bs - real
    fb = types.SimpleNamespace(
        forward_mode=_Mode("verify"), batch_size=bs,
        req_pool_indices=torch.cat([rpi, torch.zeros(npad, dtype=rpi.dtype)]),
        seq_lens=torch.cat([lens, torch.ones(npad, dtype=lens.dtype)]),  # the Triton fill value 1
        out_cache_loc=torch.cat([loc, torch.zeros(npad * q_len, dtype=loc.dtype)]),
        out_cache_loc_is_physical=True,
        spec_info=types.SimpleNamespace(custom_mask=full.to(torch.uint8), num_tokens_per_req=q_len))
    if npad:
        fb._original_batch_size = real  # ForwardBatch.prepare_mlp_sync_batch
    tree = torch.tensor([[sum(1 << j for j in range(q_len) if m[i, int(L) + j]) for i in range(q_len)]
                         for m, L in ((_full_mask_from_parents(p, int(L)), L) for p, L in zip(parents, lens))],
                        dtype=torch.int64).reshape(real, q_len)
    q = torch.randn(bs * q_len, H, 576, generator=gen).to(torch.bfloat16)
    k = torch.randn(bs * q_len, 1, 576, generator=gen).to(torch.bfloat16)
    return types.SimpleNamespace(be=be, pool=pool, r2t=r2t, fb=fb, q=q, k=k, rpi=rpi, lens=lens, loc=loc,
                                 tree=tree, real=real, q_len=q_len, ps=ps, H=H, parents=parents)


def _parents(q_len, gen):
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_len)]


def _expected(s, pool_layer, scale):
    """Reference output of the real rows on ``pool_layer`` (after the draft K was written)."""
    q_len, ps = s.q_len, s.ps
    table = (s.r2t[s.rpi][:, ::ps] // ps).contiguous()
    o, _ = mla_verify_reference(s.q[: s.real * q_len], pool_layer, table, (s.lens + q_len).to(torch.int32),
                                q_len=q_len, page_size=ps, softmax_scale=scale, mask="tree", tree_mask=s.tree)
    return o


def _verify_forward(s, layer):
    s.be.init_forward_metadata(s.fb)
    out = s.be.forward_extend(s.q, s.k, s.k[..., :512], layer, s.fb, save_kv_cache=True)
    assert out.shape == (s.fb.batch_size * s.q_len, s.H * 512) and not out.float().isnan().any()
    return out.float().view(-1, s.H, 512)


@pytest.mark.parametrize("kv_scale", [1.0, "pow2", "other"])
def test_fp8_checkpoint_layers_served_like_triton(kv_write_loc, kv_scale):
    """Checkpoints with an fp8 quantization config (DeepSeek-V3/R1, Kimi-K2) give every attention layer
    k_scale / v_scale (1.0 when the checkpoint has no KV scales). Over a bf16 pool the backend serves
    them as SGLang's Triton backend does: K stored divided by k_scale, scores times k_scale, output
    times v_scale, so the output equals the unscaled layer's (exactly for 1.0 and powers of two)."""
    gen = torch.Generator().manual_seed(11)
    s = _verify_setup(gen)
    if kv_scale == "pow2":
        kv_scale = 2.0 ** int(torch.randint(-3, 4, (1,), generator=gen).item() or 1)
    elif kv_scale == "other":
        kv_scale = float(torch.empty(1).uniform_(0.3, 3.0, generator=gen))
    plain_pool = s.pool.kv_buffer[0].clone()
    # the prefix as SGLang wrote it for this layer (Triton's extend / prefill also store K / k_scale)
    s.pool.kv_buffer[0].copy_((plain_pool.float() / kv_scale).to(torch.bfloat16))
    scale = float(torch.empty(1).uniform_(0.05, 0.2, generator=gen))
    out_scaled = _verify_forward(s, _layer(s.H, scale, kv_scale=kv_scale))
    stored = s.pool.kv_buffer[0][s.loc, 0].float()
    s.pool.kv_buffer[0].copy_(plain_pool)
    out_plain = _verify_forward(s, _layer(s.H, scale))
    assert torch.equal(s.pool.kv_buffer[0][s.loc, 0], s.k[:, 0])  # unscaled layer: K stored as is
    want = _expected(s, s.pool.kv_buffer[0], scale)
    assert (out_plain - want).abs().max().item() < 2e-2
    if kv_scale == 1.0 or math.log2(kv_scale).is_integer():
        assert torch.equal(stored, (s.k[:, 0].float() / kv_scale))
        assert torch.equal(out_scaled, out_plain)
    else:
        assert torch.allclose(stored, s.k[:, 0].float() / kv_scale, rtol=1e-2, atol=1e-2)
        assert (out_scaled - out_plain).abs().max().item() < 5e-2


def test_kv_scales_without_loaded_floats_are_a_clear_error(kv_write_loc):
    gen = torch.Generator().manual_seed(12)
    s = _verify_setup(gen)
    layer = _layer(s.H, 0.1, kv_scale=1.0)
    layer.k_scale_float = None
    with pytest.raises(MlagenSetupError, match="no k_scale_float / v_scale_float"):
        _verify_forward(s, layer)


@pytest.mark.parametrize("real, bs", [(3, 5), (1, 4), (4, 4)])
def test_eager_dp_padded_verify_never_reads_past_the_mask(kv_write_loc, real, bs):
    """DP attention pads an eager verify batch to the largest rank's size (req_pool_indices 0, seq_len 1,
    ForwardBatch._original_batch_size = the real count) while the custom mask covers the real rows only:
    padded rows must not index it; the real rows match the reference and the padded rows output 0."""
    gen = torch.Generator().manual_seed(100 * real + bs)
    s = _verify_setup(gen, real=real, bs=bs)
    scale = float(torch.empty(1).uniform_(0.05, 0.2, generator=gen))
    out = _verify_forward(s, _layer(s.H, scale))
    m = s.be.forward_metadata
    assert m.kv_lens.tolist() == (s.lens + s.q_len).tolist() + [0] * (bs - real)
    assert m.tree_mask[:real].tolist() == s.tree.tolist() and m.tree_mask[real:].abs().sum() == 0
    want = _expected(s, s.pool.kv_buffer[0], scale)
    assert (out[: real * s.q_len] - want).abs().max().item() < 2e-2
    assert out[real * s.q_len:].abs().max().item() == 0.0 if bs > real else True


@pytest.fixture
def verify_mask_module(monkeypatch):
    """SGLang's verify_mask module. Without transformers (sglang installed --no-deps) its import of
    speculative.eagle_utils fails; that module then stands in with SGLang's own TreeMaskMode and the
    GPU platforms' default_tree_mask_mode (FULL_MASK)."""
    pytest.importorskip("sglang")
    name = "sglang.srt.layers.attention.verify_mask"
    try:
        mod, stubbed = importlib.import_module(name), False
    except Exception:  # noqa: BLE001
        spec_tree = pytest.importorskip("sglang.kernels.ops.speculative.spec_tree")
        eu = types.ModuleType("sglang.srt.speculative.eagle_utils")
        eu.TreeMaskMode = spec_tree.TreeMaskMode
        eu.default_tree_mask_mode = lambda: spec_tree.TreeMaskMode.FULL_MASK
        monkeypatch.setitem(sys.modules, eu.__name__, eu)
        sys.modules.pop(name, None)
        mod, stubbed = importlib.import_module(name), True
    yield mod
    if stubbed:
        sys.modules.pop(name, None)  # imported over the stand-in: not for other tests


def _qlen_blocks(parents_list):
    """SGLang's QLEN_ONLY layout: per request a row-major [q, q] block (draft i sees draft j)."""
    return torch.cat([_full_mask_from_parents(p, 0).reshape(-1) for p in parents_list])


@pytest.mark.parametrize("mask", ["tree", "causal"])
def test_verify_mask_asks_only_for_the_draft_blocks(verify_mask_module, kv_write_loc, mask):
    """The backend's VerifyMask is QLEN_ONLY (q*q cells per request, SGLang's chain fast path stays on),
    also without CUDA graphs, and is_read only for tree variants; the kernel's tree bits come from it:
    from the buffer the draft stage fills in place (replay), and from SGLang's own exact-sized QLEN_ONLY
    mask of a batch past the buffer (eager), DP-padded or not."""
    from mlagen.sglang_plugin.backend import MlagenAttnBackend

    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode  # eagle_utils re-exports it
    gen = torch.Generator().manual_seed(31 if mask == "tree" else 32)
    q_len, max_bs, width = 6, 4, 64
    mr, r2t = _runner(1, width=width, rows=8)
    be = MlagenAttnBackend(mr, verify_kernel=_Kernel(8, mask), decode_kernel=None, fallback=_Fallback(),
                           verify_q_len=q_len)
    vm0 = be.verify_mask  # an eager-only server (no init_cuda_graph_state)
    assert vm0 is not None and vm0.mode == TreeMaskMode.QLEN_ONLY and not vm0.fits(1)
    be.init_cuda_graph_state(max_bs, max_bs * q_len)
    vm = be.verify_mask
    assert vm.mode == TreeMaskMode.QLEN_ONLY and vm.max_bs == max_bs and vm.fits(max_bs)
    assert vm.buffer.numel() == max_bs * q_len * q_len  # FULL_MASK: max_bs * q * (context + q)
    assert vm.is_read == (mask == "tree")
    if mask == "causal":
        return

    def batch(n, pad=0, custom=None):
        parents = [_parents(q_len, gen) for _ in range(n)]
        lens = torch.randint(1, width - q_len, (n,), generator=gen)
        blocks = _qlen_blocks(parents)
        fb = types.SimpleNamespace(
            forward_mode=_Mode("verify"), batch_size=n + pad,
            req_pool_indices=torch.randperm(8, generator=gen)[: n + pad],
            seq_lens=torch.cat([lens, torch.ones(pad, dtype=lens.dtype)]),
            spec_info=types.SimpleNamespace(custom_mask=blocks.to(torch.uint8) if custom is None else custom,
                                            num_tokens_per_req=q_len))
        want = [[sum(1 << j for j in range(q_len) if blk[i, j]) for i in range(q_len)]
                for blk in blocks.view(n, q_len, q_len)]
        return fb, blocks, want

    # replay: the draft stage wrote the tree into the buffer in place, then the view carries the buffer
    fb, blocks, want = batch(3, custom=vm.buffer)
    vm.buffer.fill_(1)
    vm.buffer[: blocks.numel()].copy_(blocks)
    fb.num_padding = 1
    fb.batch_size, fb.req_pool_indices = 4, torch.cat([fb.req_pool_indices, torch.zeros(1, dtype=torch.int64)])
    fb.seq_lens = torch.cat([fb.seq_lens, torch.ones(1, dtype=fb.seq_lens.dtype)])
    be.init_forward_metadata_out_graph(fb)
    assert be.forward_metadata.tree_mask.tolist() == want + [[0] * q_len]
    # eager, a batch past the buffer: SGLang allocates exactly n*q*q cells
    fb, _, want = batch(6)
    be.init_forward_metadata(fb)
    assert be.forward_metadata.tree_mask.tolist() == want
    # eager DP-padded: the mask covers the real rows only
    fb, _, want = batch(5, pad=2)
    fb._original_batch_size = 5
    be.init_forward_metadata(fb)
    assert be.forward_metadata.tree_mask.tolist() == want + [[0] * q_len] * 2
    assert be.forward_metadata.kv_lens[5:].tolist() == [0, 0]


def test_pack_qlen_mask_matches_tree():
    gen = torch.Generator().manual_seed(33)
    parents = [_parents(9, gen) for _ in range(4)]
    blocks = _qlen_blocks(parents)
    for dtype in (torch.bool, torch.uint8):
        got = md.pack_qlen_mask(torch.cat([blocks, torch.ones(20, dtype=torch.bool)]).to(dtype), 4, 9)
        for b, p in enumerate(parents):
            for i in range(9):
                anc, j = set(), i
                while j >= 0:
                    anc.add(j)
                    j = p[j]
                assert int(got[b, i]) == sum(1 << j for j in anc), (b, i)
    with pytest.raises(ValueError, match="324 needed"):
        md.pack_qlen_mask(blocks[:-1], 4, 9)


class _DeviceOnly(torch.Tensor):
    """A tensor whose values never reach the host: item()/int()/tolist()/bool() raise, as a stand-in for
    the device-to-host synchronization they cost on a GPU tensor."""

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__", "numpy"):
            raise AssertionError(f"host sync: {name} on a device tensor")
        return super().__torch_function__(func, types_, args, kwargs or {})


@pytest.mark.parametrize("ps", [1, 4])
def test_block_table_refresh_sized_from_host_lengths(ps):
    """Plain decode (SGLang sets max_seq_len_host only in speculative decode) sizes the block-table
    refresh from seq_lens_cpu, else seq_lens_sum: a replay re-gathers only the pages the batch can
    read, and the eager path never reads device lengths on the host."""
    from mlagen.sglang_plugin.backend import MlagenAttnBackend

    gen = torch.Generator().manual_seed(40 + ps)
    width = 64
    mr, r2t = _runner(ps, width=width, rows=6)
    be = MlagenAttnBackend(mr, verify_kernel=None, decode_kernel=_Kernel(1, "causal"), fallback=_Fallback())
    be.init_cuda_graph_state(4, 4)
    lens = torch.randint(1, width // 3, (3,), generator=gen)
    rpi = torch.randperm(6, generator=gen)[:3]
    need = -(-(int(lens.max()) + ps) // ps)  # pages covering every row's length (+ one page of slack)
    cols = width // ps

    def fb(**kw):
        d = dict(forward_mode=_Mode("decode"), spec_info=None, batch_size=3, req_pool_indices=rpi,
                 seq_lens=lens.clone().as_subclass(_DeviceOnly), seq_lens_cpu=lens.clone(),
                 seq_lens_sum=int(lens.sum()), max_seq_len_host=None)
        d.update(kw)
        return types.SimpleNamespace(**d)

    be._graph["block_table"].fill_(-1)
    be.init_forward_metadata_out_graph(fb())  # replay (after capture)
    table = be._graph["block_table"][:3]
    assert torch.equal(table[:, :need], (r2t[rpi][:, ::ps] // ps)[:, :need])
    assert (table[:, need:] == -1).all(), "columns past the batch's pages were re-gathered"
    assert torch.equal(be.forward_metadata.kv_lens, lens.to(torch.int32))

    # the whole table first, so that the eager buffer has its full width before the -1 fills
    for kw, pages in ((dict(seq_lens_cpu=None, seq_lens_sum=None), cols), (dict(), need),
                      (dict(seq_lens_cpu=None), -(-(int(lens.sum()) + ps) // ps))):
        if be._eager is not None:
            be._eager["block_table"].fill_(-1)
        be.init_forward_metadata(fb(**kw))  # eager: no host sync on seq_lens
        table = be.forward_metadata.block_table  # the persistent eager buffer's rows, at its full width
        n = min(cols, pages)
        assert torch.equal(table[:, :n], (r2t[rpi][:, ::ps] // ps)[:, :n])
        assert (table[:, n:] == -1).all(), "columns past the batch's pages were re-gathered"


def test_graph_state_again_drops_the_old_buffers_plan():
    """init_cuda_graph_state a second time (new graph buffers): the cached plan of the old buffers is dropped at
    once, and the next replay's metadata is checked again and written into the new buffers."""
    from mlagen.sglang_plugin.backend import MlagenAttnBackend

    gen = torch.Generator().manual_seed(41)
    mr, r2t = _runner(1, width=64, rows=6)
    k = _Kernel(1, "causal")
    be = MlagenAttnBackend(mr, verify_kernel=None, decode_kernel=k, fallback=_Fallback())
    lens = torch.randint(1, 20, (3,), generator=gen)
    fb = types.SimpleNamespace(forward_mode=_Mode("decode"), spec_info=None, batch_size=3,
                               req_pool_indices=torch.randperm(6, generator=gen)[:3], seq_lens=lens,
                               seq_lens_cpu=lens.clone(), seq_lens_sum=int(lens.sum()), max_seq_len_host=None)
    for n in (1, 2):
        be.init_cuda_graph_state(4, 4)
        assert not [slot for slot in be._plans if slot[1]], "a plan of the previous graph buffers survived"
        be.init_forward_metadata_out_graph(fb)
        m = be.forward_metadata
        assert len(k.batches) == n
        assert m.kv_lens.data_ptr() == be._graph["kv_lens"].data_ptr() and m.kv_lens.tolist() == lens.tolist()
        assert m.block_table.data_ptr() == be._graph["block_table"].data_ptr()


def test_eager_step_checks_the_batch_once_and_launches_each_layer(kv_write_loc):
    """Host time per eager step: the batch metadata is validated once (init_forward_metadata; a later
    step of the same shape reuses that check), each layer's pool buffer once per backend, and every
    layer launches without re-checking; outputs still match the reference layer by layer."""
    gen = torch.Generator().manual_seed(50)
    n_layers = 4
    s = _verify_setup(gen, layers=n_layers, bs=2)
    k = s.be.verify_kernel
    for step in range(2):
        s.be.init_forward_metadata(s.fb)
        for lid in range(n_layers):
            scale = float(torch.empty(1).uniform_(0.05, 0.2, generator=gen))
            out = s.be.forward_extend(s.q, s.k, s.k[..., :512], _layer(s.H, scale, layer_id=lid), s.fb)
            want = _expected(s, s.pool.kv_buffer[lid], scale)
            assert (out.float().view(-1, s.H, 512) - want).abs().max().item() < 2e-2
        assert k.counts == {"check_batch": 1, "check_kv_cache": n_layers, "launch": n_layers * (step + 1),
                            "call": 0}
    # a q that does not fit the checked batch goes through the checked call (a clear error there)
    s.be.init_forward_metadata(s.fb)
    s.be.forward_extend(s.q.float(), s.k, s.k[..., :512], _layer(s.H, 0.1), s.fb)
    assert k.counts["call"] == 1


@pytest.mark.parametrize("ps", [1, 4])
def test_eager_buffers_reused_and_batch_revalidated_only_on_change(ps):
    """Eager steps write into persistent buffers (no allocation per step; grown when a larger page
    count arrives) and call check_batch only when what it validates changes (bs, npages, q_len, the
    buffers); every step's values equal the torch helpers'. A replay re-checks on a new bs, never on a
    new page count (the graph table is passed whole)."""
    from mlagen.sglang_plugin.backend import MlagenAttnBackend

    gen = torch.Generator().manual_seed(60 + ps)
    width, rows = 64, 8
    mr, r2t = _runner(ps, width=width, rows=rows)
    kern = _Kernel(8, "tree")
    be = MlagenAttnBackend(mr, verify_kernel=kern, decode_kernel=None, fallback=_Fallback(), verify_q_len=5)

    def batch(bs, q_len, max_len, pad=0):
        real = bs - pad
        lens = torch.randint(1, max_len + 1, (real,), generator=gen)
        lens[0] = max_len
        parents = [_parents(q_len, gen) for _ in range(real)]
        rpi = torch.cat([torch.randperm(rows - 1, generator=gen)[:real] + 1, torch.zeros(pad, dtype=torch.int64)])
        fb = types.SimpleNamespace(
            forward_mode=_Mode("verify"), batch_size=bs, req_pool_indices=rpi,
            seq_lens=torch.cat([lens, torch.ones(pad, dtype=lens.dtype)]), max_seq_len_host=max_len,
            spec_info=types.SimpleNamespace(custom_mask=_qlen_blocks(parents).to(torch.uint8), num_tokens_per_req=q_len))
        if pad:
            fb._original_batch_size = real
        return fb

    def step(fb, graph=False):
        if graph:
            be.init_forward_metadata_out_graph(fb)
        else:
            be.init_forward_metadata(fb)
        m = be.forward_metadata
        bs, q_len = fb.batch_size, fb.spec_info.num_tokens_per_req
        real = getattr(fb, "_original_batch_size", bs)
        npages = -(-min(width, fb.max_seq_len_host + q_len + ps) // ps)
        assert m.kv_lens.tolist() == (fb.seq_lens[:real] + q_len).tolist() + [0] * (bs - real)
        want = torch.zeros(bs, npages, dtype=torch.int32)
        md.fill_block_table(want, r2t, fb.req_pool_indices, md.page_columns(width, ps)[:npages], ps)
        assert torch.equal(m.block_table[:, :npages], want)
        tree = md.pack_qlen_mask(fb.spec_info.custom_mask, real, q_len)
        assert m.tree_mask.tolist() == tree.tolist() + [[0] * q_len] * (bs - real)
        return m, len(kern.batches)

    m1, n = step(batch(3, 5, 20))
    assert n == 1 and m1.block_table.shape == (3, -(-(20 + 5 + ps) // ps))
    ptrs = (m1.kv_lens.data_ptr(), m1.block_table.data_ptr(), m1.tree_mask.data_ptr())
    for _ in range(3):  # same shape, new values: the same buffers, no new check
        m, n = step(batch(3, 5, 20))
        assert n == 1 and m.batch is m1.batch
        assert (m.kv_lens.data_ptr(), m.block_table.data_ptr(), m.tree_mask.data_ptr()) == ptrs
    m, n = step(batch(3, 5, 20, pad=1))  # padded rows: same tensors, same check
    assert n == 1
    _, n = step(batch(3, 5, 20 + 2 * ps))  # more pages: checked again (the buffer grows)
    assert n == 2
    _, n = step(batch(3, 5, 20 + 2 * ps))
    assert n == 2
    big = be._eager["block_table"]
    _, n = step(batch(2, 5, 20 + 2 * ps))  # smaller bs: checked again, same buffers
    assert n == 3 and be._eager["block_table"] is big
    _, n = step(batch(2, 4, 20 + 2 * ps))  # another q_len: checked again
    assert n == 4
    _, n = step(batch(2, 4, 20 + 2 * ps))
    assert n == 4
    _, n = step(batch(2, 4, 20))  # fewer pages: the batch is checked on the buffer's full width, no new check
    assert n == 4 and be._eager["block_table"] is big

    # graph replays: the whole table row is passed, so only bs / q_len re-check
    be._graph = {"kv_lens": torch.zeros(4, dtype=torch.int32), "block_table": torch.zeros(4, width // ps, dtype=torch.int32),
                 "tree": torch.zeros(4, 5, dtype=torch.int64), "ws_verify": torch.zeros(64), "ws_decode": None}
    _, n = step(batch(4, 5, 20), graph=True)
    assert n == 5
    _, n = step(batch(4, 5, 30), graph=True)
    assert n == 5
    _, n = step(batch(3, 5, 30), graph=True)
    assert n == 6
    _, n = step(batch(2, 4, 20))  # the eager slot kept its own check
    assert n == 6


# ----------------------------------------------------------------------------- docs: heads per rank
ATTENTION_HEADS = {"Kimi-K2": 64, "DeepSeek-V3": 128}  # num_attention_heads of the checkpoints' configs


def test_heads_per_rank_in_readme_and_spec_comments():
    """Every "<model> ... TP<n> → <h>" the README's install table states, and every spec comment's
    "<model> (<N> attention heads) at TP<n>" with its heads_per_rank, is the model's heads / TP."""
    import re
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parent.parent
    row = next(l for l in (root / "README.md").read_text().splitlines() if l.endswith("| `heads_per_rank` |"))
    claims = re.findall(r"(Kimi-K2|DeepSeek-V3): (\d+) heads, so ((?:TP\d+ → \d+(?:, )?)+)", row)
    assert {m for m, _, _ in claims} == set(ATTENTION_HEADS), row
    for model, n, pairs in claims:
        assert int(n) == ATTENTION_HEADS[model], row
        for tp, h in re.findall(r"TP(\d+) → (\d+)", pairs):
            assert int(n) // int(tp) == int(h), (model, tp, h)
    for spec in sorted((root / "specs").glob("*.yaml")):
        text = spec.read_text()
        heads = yaml.safe_load(text)["heads_per_rank"]
        comment = " ".join(l.lstrip("# ") for l in text.splitlines() if l.startswith("#"))
        found = re.findall(r"(Kimi-K2|DeepSeek-V3) \((\d+)(?: attention heads)?\)(?: has \d+)? at TP(\d+)", comment)
        assert found, f"{spec.name}: the comment names no model / TP size: {comment!r}"
        for model, n, tp in found:
            assert int(n) == ATTENTION_HEADS[model] and int(n) // int(tp) == heads, (spec.name, model, n, tp)


@pytest.mark.parametrize("real, bs, extra", [(1, 1, 1), (3, 3, 3), (2, 3, 2)])
def test_eager_dp_token_padding_past_the_batch(kv_write_loc, real, bs, extra):
    """With DP attention and attn_tp_size > 1, SGLang pads the verify batch's tokens to a multiple of
    attn_tp_size (prepare_mlp_sync_batch: num_tokens = ceil_align(real tokens, attn_tp_size), bs =
    num_tokens // q_len; q, k and out_cache_loc get the extra rows). The backend must serve the
    bs * q_len rows of the batch, output 0 for the rows past them, and never fail on the row count."""
    gen = torch.Generator().manual_seed(500 + 10 * real + extra)
    s = _verify_setup(gen, real=real, bs=bs)
    s.q = torch.cat([s.q, torch.randn(extra, s.H, 576, generator=gen).to(torch.bfloat16)])
    s.k = torch.cat([s.k, torch.randn(extra, 1, 576, generator=gen).to(torch.bfloat16)])
    s.fb.out_cache_loc = torch.cat([s.fb.out_cache_loc, torch.zeros(extra, dtype=torch.int64)])
    scale = float(torch.empty(1).uniform_(0.05, 0.2, generator=gen))
    layer = _layer(s.H, scale)
    s.be.init_forward_metadata(s.fb)
    out = s.be.forward_extend(s.q, s.k, s.k[..., :512], layer, s.fb, save_kv_cache=True)
    assert out.shape == (bs * s.q_len + extra, s.H * 512) and not out.float().isnan().any()
    out = out.float().view(-1, s.H, 512)
    assert s.be.verify_kernel.counts["call"] == 0, "the padded batch took the checked call"
    want = _expected(s, s.pool.kv_buffer[0], scale)
    assert (out[: real * s.q_len] - want).abs().max().item() < 2e-2
    assert out[real * s.q_len:].abs().max().item() == 0.0


def test_fp8_kv_server_selects_fp8_variants_only():
    """--kv-cache-dtype fp8_e4m3 (pool dtype float8_e4m3fn) is served by installed dtype fp8_e4m3 variants;
    a bf16 variant does not match it (nor an fp8 variant a bf16 pool), and the refusal says what to
    build; entries written before kv_dtype existed count as bf16; other fp8 formats are refused."""
    bf16 = _entry()
    fp8 = _entry(uri="mla_verify_h16_q4_fp8", kv_dtype="fp8_e4m3", bucket="h16_q4_kv512_rope64_ps64_tree_fp8_e4m3")
    sel = checks.run_startup_checks(_facts(kv_cache_dtype="float8_e4m3fn"), _state(bf16, fp8))
    assert sel.verify["uri"] == "mla_verify_h16_q4_fp8"
    sel = checks.run_startup_checks(_facts(), _state(fp8, bf16))
    assert sel.verify["uri"] == "mla_verify_h16_q4_tree"
    with pytest.raises(MlagenSetupError, match=r"(?s)KV cache dtype bf16 != fp8_e4m3.*dtype: fp8_e4m3"):
        checks.run_startup_checks(_facts(kv_cache_dtype="float8_e4m3fn"), _state(bf16))
    with pytest.raises(MlagenSetupError, match="KV cache dtype fp8_e4m3 != bf16"):
        checks.run_startup_checks(_facts(), _state(fp8))
    with pytest.raises(MlagenSetupError, match="float8_e5m2 is not supported.*fp8_e4m3"):
        checks.run_startup_checks(_facts(kv_cache_dtype="float8_e5m2"), _state(fp8))
    with pytest.raises(installed.InstalledStateError, match="kv_dtype must be one of"):
        installed.validate_state(_state(_entry(kv_dtype="fp4")))


class _DirectRefKernel(_RefKernel):
    """A ``_RefKernel`` whose module has ``run_direct``: ``direct_batch`` records what the backend hands the
    kernel and turns it into the reference's inputs the way include/mlagen/mla_verify_batch.cuh reads them
    (kv_len = seq_lens + extra for real rows, 0 for padded ones; pages from req_to_token's token slots;
    tree rows from the QLEN_ONLY mask or the shared rows)."""

    has_direct = True

    def __init__(self, *a):
        super().__init__(*a)
        self.counts.update(direct_plan=0, direct_batch=0)
        self.direct_args = []

    def direct_plan(self, req_to_token, *, q_len, batch_size, workspace=None):
        self.counts["direct_plan"] += 1
        return types.SimpleNamespace(r2t=req_to_token, q_len=q_len, bs=batch_size, workspace=workspace)

    def direct_batch(self, plan, seq_lens, req_pool_indices, *, extra, num_padding=0, qlen_mask=None,
                     tree_rows=None, checked=True):
        self.counts["direct_batch"] += 1
        self.direct_args.append(dict(extra=extra, num_padding=num_padding, qlen_mask=qlen_mask, tree_rows=tree_rows))
        bs, q_len, ps = plan.bs, plan.q_len, self.variant.page_size
        real = bs - num_padding
        kv_lens = (seq_lens[:bs] + extra).to(torch.int32)
        kv_lens[real:] = 0
        table = (plan.r2t[req_pool_indices[:bs].long()][:, ::ps] // ps).contiguous()
        tree = None
        if self.variant.mask == "tree":
            tree = torch.zeros(bs, q_len, dtype=torch.int64)
            if qlen_mask is not None:
                tree[:real] = md.pack_qlen_mask(qlen_mask, real, q_len)
            else:
                tree[:] = tree_rows
        return types.SimpleNamespace(bs=bs, q_len=q_len, kv_lens=kv_lens, block_table=table, tree_mask=tree,
                                     workspace=plan.workspace, direct=True)


@pytest.mark.parametrize("mask_layout", ["qlen_only", "none", "full_mask"])
@pytest.mark.parametrize("real, bs", [(3, 3), (2, 4)])
def test_eager_step_reads_sglang_state_directly(kv_write_loc, mask_layout, real, bs):
    """Eager target verify with a kernel that has run_direct: no metadata fill; the kernel gets SGLang's
    seq_lens / req_pool_indices, extra = q_len, the DP padding count, and the QLEN_ONLY custom mask (or the
    causal rows when there is none). A FULL_MASK custom mask takes the filled buffers instead. Real rows
    match the reference, padded rows output 0; a q the launch cannot take goes through the checked call
    on freshly filled buffers."""
    gen = torch.Generator().manual_seed(900 + 10 * real + bs + len(mask_layout))
    s = _verify_setup(gen, real=real, bs=bs)
    s.be.verify_kernel = k = _DirectRefKernel(s.H, s.q_len, "tree", s.ps)
    if mask_layout == "qlen_only":
        s.fb.spec_info.custom_mask = _qlen_blocks(s.parents).to(torch.uint8)
    elif mask_layout == "none":
        s.fb.spec_info.custom_mask = None
        s.tree = md.causal_bits(s.q_len, "cpu").expand(real, s.q_len).clone()
    scale = float(torch.empty(1).uniform_(0.05, 0.2, generator=gen))
    out = _verify_forward(s, _layer(s.H, scale))
    want = _expected(s, s.pool.kv_buffer[0], scale)
    assert (out[: real * s.q_len] - want).abs().max().item() < 2e-2
    assert out[real * s.q_len:].abs().max().item() == 0.0 if bs > real else True
    direct = mask_layout != "full_mask"
    assert k.counts["direct_batch"] == int(direct) and k.counts["check_batch"] == int(not direct)
    assert k.counts["launch"] == 1 and k.counts["call"] == 0
    if direct:
        a = k.direct_args[0]
        assert a["extra"] == s.q_len and a["num_padding"] == bs - real
        if mask_layout == "qlen_only":
            assert a["qlen_mask"] is s.fb.spec_info.custom_mask and a["tree_rows"] is None
        else:
            assert a["qlen_mask"] is None and a["tree_rows"].tolist() == s.tree[0].tolist()
        assert s.be.forward_metadata.kv_lens is None  # nothing filled
        s.be.init_forward_metadata(s.fb)  # a second step reuses the plan
        assert k.counts["direct_plan"] == 1 and k.counts["direct_batch"] == 2
        out2 = s.be.forward_extend(s.q.float(), s.k, s.k[..., :512], _layer(s.H, scale), s.fb)
        assert k.counts["call"] == 1 and s.be.forward_metadata.kv_lens.tolist() == (
            (s.lens + s.q_len).tolist() + [0] * (bs - real))
        assert (out2.float().view(-1, s.H, 512)[: real * s.q_len] - want).abs().max().item() < 2e-2


def test_eager_direct_plans_kept_per_batch_size(kv_write_loc):
    """Eager batch sizes vary step to step: each (bs, q_len) keeps its direct plan (a step of a size seen before
    builds none), and a batch past the eager workspace reallocates it and drops every plan of the old one (the
    next step of an old size builds its plan again, on the new workspace). A new shared-memory cap rebuilds the
    plans on a workspace of the new size; another kernel drops the old kernel's plans. Each step still matches
    the reference on its own rows."""
    gen = torch.Generator().manual_seed(4242)
    s = _verify_setup(gen, bs=4)
    s.be.verify_kernel = k = _DirectRefKernel(s.H, s.q_len, "tree", s.ps)
    scale = float(torch.empty(1).uniform_(0.05, 0.2, generator=gen))
    layer = _layer(s.H, scale)

    def step(bs):
        fb = types.SimpleNamespace(**vars(s.fb))
        fb.batch_size, fb.req_pool_indices, fb.seq_lens = bs, s.fb.req_pool_indices[:bs], s.fb.seq_lens[:bs]
        fb.out_cache_loc = s.fb.out_cache_loc[: bs * s.q_len]
        fb.spec_info = types.SimpleNamespace(custom_mask=None, num_tokens_per_req=s.q_len)  # causal drafts
        s.be.init_forward_metadata(fb)
        out = s.be.forward_extend(s.q[: bs * s.q_len], s.k[: bs * s.q_len], s.k[: bs * s.q_len, ..., :512], layer, fb,
                                  save_kv_cache=False)
        table = s.r2t[fb.req_pool_indices.long()]
        tree = md.causal_bits(s.q_len, "cpu").expand(bs, s.q_len).clone()
        want, _ = mla_verify_reference(s.q[: bs * s.q_len], s.pool.kv_buffer[0], table,
                                       (fb.seq_lens + s.q_len).to(torch.int32), q_len=s.q_len, page_size=s.ps,
                                       softmax_scale=scale, mask="tree", tree_mask=tree)
        assert (out.float().view(-1, s.H, 512) - want).abs().max().item() < 2e-2
        return s.be.forward_metadata.workspace

    ws3 = step(3)
    for bs in (2, 3, 2, 3):
        step(bs)
    assert k.counts["direct_plan"] == 2 and k.counts["direct_batch"] == 5
    ws4 = step(4)  # past the workspace sized for 3 rows: reallocated, the old plans dropped
    assert ws4 is not ws3 and ws4.numel() >= k.workspace_numel(4)
    assert [key[1] for key in s.be._direct_plans] == [4] and k.counts["direct_plan"] == 3
    assert step(3) is ws4 and k.counts["direct_plan"] == 4

    # the kernel's shared-memory cap changes (limit_smem_per_sm: other split counts, a larger workspace): every
    # size's plan is rebuilt, on a workspace of the new size
    k.smem_per_sm_cap = 102_400
    k.workspace_numel = lambda bs, device=None: 64 * bs
    ws3c = step(3)
    assert k.counts["direct_plan"] == 5 and ws3c is not ws4 and ws3c.numel() >= 64 * 3
    assert step(4).numel() >= 64 * 4 and k.counts["direct_plan"] == 6
    # another kernel takes the kind: its plans only (the old kernel's are dropped, not kept alive)
    s.be.verify_kernel = k2 = _DirectRefKernel(s.H, s.q_len, "tree", s.ps)
    step(3)
    assert k2.counts["direct_plan"] == 1 and all(p[0] is k2 for p in s.be._direct_plans.values())
    assert len(s.be._direct_plans) == 1


def test_load_entry_refuses_missing_unloadable_and_mislabelled_modules(tmp_path, monkeypatch):
    """At server start an installed entry whose .so is gone, is not a loadable module, whose uri is not a variant
    uri, or whose kv_dtype is not its kernel's: a MlagenSetupError saying to build and install again (not an
    ImportError / ValueError from deep inside, and not a failure at the first launch)."""
    pytest.importorskip("sglang")
    from mlagen import ops
    from mlagen.sglang_plugin.backend import load_entry
    from mlagen.spec import parse_spec

    v = parse_spec(dict(name="e", heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", dtype="fp8_e4m3",
                        schedule="dimsplit_t", row_tiles=3, num_warps=8, stages=2, block_n=32)).variants()[0]
    so = tmp_path / "m.so"
    entry = dict(uri=v.uri, so_path=str(so), heads=8, q_len=9, page_size=1, kv_lora_rank=512, qk_rope_head_dim=64,
                 mask="tree", kv_dtype="fp8_e4m3")
    with pytest.raises(MlagenSetupError, match="is missing"):
        load_entry(entry)
    so.write_bytes(b"\x7fELF not really")
    with pytest.raises(MlagenSetupError, match="cannot load installed entry .*ImportError"):
        load_entry(entry)
    with pytest.raises(MlagenSetupError, match="cannot load installed entry .*ValueError"):
        load_entry(dict(entry, uri="mla_verify_garbage"))
    monkeypatch.setattr(ops, "load_so", lambda uri, path: types.SimpleNamespace(variant=v))
    assert load_entry(entry).variant is v
    with pytest.raises(MlagenSetupError, match="kv_dtype='bf16' but its kernel has 'fp8_e4m3'"):
        load_entry(dict(entry, kv_dtype="bf16"))
