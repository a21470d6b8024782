"""GPU parity test: mlagen backend vs SGLang's TritonAttnBackend on identical MLA batches.

Runs TARGET_VERIFY (tree and chain drafts; rowblock and dimsplit_t variants) and DECODE (rowblock and dimsplit_t),
H = 8 and 16,
page_size 1 and 64, 1..16 requests: eager, then CUDA-graph capture at the runner's batch buckets and 1000 replays
with random lengths and padded rows (kv_len 0 on our side), each replay checked against Triton
and the padded rows checked to be 0. Prints the max errors.

Skips (with the reason) without CUDA, SGLang, or a working ``mlagen.build``.

Stand-ins (instead of a full SGLang ModelRunner, which needs a checkpoint): ``_Runner`` carries
exactly what ``TritonAttnBackend.__init__`` and ``MlagenAttnBackend.__init__`` read
(req_to_token_pool, token_to_kv_pool, token_to_kv_pool_allocator, kv_index_translator, page_size,
device, gpu_id, model_config, sliding_window_size, is_draft_worker, spec_algorithm,
decode_num_tokens_per_req, kv_cache_dtype); ``_Pool`` is an MLA KV pool (one [slots, 1, 576]
bf16 buffer, set/get_key/get_value_buffer); forward batches are SimpleNamespaces with the fields
both backends and the runner's replay view (``build_replay_fb_view``) provide. The layer is a real
``RadixAttention`` and the verify input a real ``EagleVerifyInput``. Speculative settings are set
on the Triton instance after construction (num_draft_tokens, topk) instead of publishing a
speculative ServerArgs.
"""

from __future__ import annotations

import os
import types

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from sglang_gpu_variants import H_LIST, PAGE_SIZES, Q_CHAIN, Q_TREE, case_key, spec_for, variant_key  # noqa: E402

MAX_BS = 16
CAPTURE_BS = (1, 2, 4, 8, 16)
WIDTH = 1024  # req_to_token columns (max context)
REPLAYS = int(os.environ.get("MLAGEN_SGLANG_REPLAYS", "1000"))  # the bar is 1000
# bf16 outputs of two kernels (Triton's and ours) each round once: they may differ by an ulp of the
# value (0.031 for |out| in [4, 8)), so the bound is atol + rtol * |ref| (rtol: torch.testing's bf16).
ATOL, RTOL = 2e-2, 1.6e-2


# e4m3 pools: SGLang 0.5.23's Triton extend kernel rounds q to e4m3 for the cached-KV dot (q.to(k.dtype))
# and P to e4m3 for P V (kernels/ops/attention/extend_attention.py:619, :703); mlagen keeps both in bf16.
# Measured on the H200: Triton's fp8-pool output is 0.26 from mlagen's at H8. So on an fp8 pool both are
# compared with the fp32 reference on the same bytes: mlagen within the bf16 bound above, and no further
# from it than Triton is (plus that bound).


def _check(ref: torch.Tensor, out: torch.Tensor, what: str, atol: float = ATOL, rtol: float = RTOL) -> float:
    """Max |out - ref| (fp32 of bf16 outputs); asserts it is within atol + rtol * |ref| everywhere (NaN fails)."""
    d = (out - ref).abs()
    excess = (d - atol - rtol * ref.abs()).max().item()
    assert excess <= 0.0, f"{what}: max err {d.max().item():.4g} exceeds atol {atol} + rtol {rtol} * |ref| by {excess:.3g}"
    return d.max().item()
SCALE = 0.1352 * 1.1  # 1/sqrt(192) times a yarn-like mscale


class _Missing:
    """Any attribute of a missing compiled package: attribute chains resolve (SGLang reads constants
    such as ``scalar_types.uint4b8`` at import), every call raises, so a test that really needed the
    package fails loudly instead of computing garbage."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} called, but it is not installed here")

    def __mro_entries__(self, bases):  # allow "class X(sgl_kernel.Base)" at import time
        return (object,)


class _MissingKernelModule(types.ModuleType):
    """Stand-in for a compiled package SGLang only *binds* on the Triton MLA path (sgl_kernel is
    hundreds of MB and cannot be carried to the GPU machine)."""

    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _MissingKernelFinder:
    """Meta-path finder that answers every ``<top>.*`` import with a :class:`_MissingKernelModule`
    (SGLang imports many sgl_kernel submodules at module level but calls none on this path)."""

    def __init__(self, tops):
        self.tops = set(tops)

    def find_spec(self, fullname, path=None, target=None):
        import importlib.machinery

        if fullname.split(".")[0] not in self.tops:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        mod = _MissingKernelModule(spec.name)
        mod.__spec__ = spec
        return mod

    def exec_module(self, module):
        pass


def _stub_if_missing(*tops):
    """Install the stand-in for each top-level package in ``tops`` that is not installed."""
    import importlib.util
    import sys

    missing = [t for t in tops if t not in sys.modules and importlib.util.find_spec(t) is None]
    if not missing:
        return None
    finder = _MissingKernelFinder(missing)
    sys.meta_path.append(finder)
    return finder


def _remove_stubs(finder):
    """Undo :func:`_stub_if_missing` for later imports (modules already imported keep their stand-ins)."""
    import sys

    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
        for name in [n for n, m in sys.modules.items() if isinstance(m, _MissingKernelModule)]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def sgl():
    """Import SGLang and set up a 1-process world + published runtime context."""
    ns = import_sglang(pytest.skip)
    yield ns
    _remove_stubs(ns.stub_finder)


def import_sglang(on_missing, master_port=29661):
    """SGLang's classes this file needs (a namespace); ``on_missing(reason)`` when it does not import."""
    # sgl_kernel: compiled, hundreds of MB; datasets: imported by sglang.test.test_utils for benchmarks only.
    finder = _stub_if_missing("sgl_kernel", "datasets")
    try:
        import sglang  # noqa: F401
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput
        from sglang.test.layer_ut_utils import init_single_process_dist
    except Exception as e:  # noqa: BLE001 - any import problem means "cannot run here"
        _remove_stubs(finder)
        return on_missing(f"sglang is not importable: {e!r}")
    import sglang.srt.layers.attention.triton_backend as triton_backend

    # TritonAttnBackend.__init__ calls sgl_kernel.utils.is_arch_support_pdl(), bound at import; with
    # the stand-in it would raise. False = Triton decode launched without PDL (same results).
    if isinstance(triton_backend.__dict__.get("is_arch_support_pdl"), _Missing):
        triton_backend.is_arch_support_pdl = lambda: False
    init_single_process_dist(master_port=master_port)
    return types.SimpleNamespace(Triton=TritonAttnBackend, RadixAttention=RadixAttention,
                                 ForwardMode=ForwardMode, EagleVerifyInput=EagleVerifyInput, stub_finder=finder)


@pytest.fixture(scope="module")
def kernels(gpu_arch):
    """{case key (sglang_gpu_variants.case_key): VerifyKernel}, each variant built (or reused) when a case first
    asks for it: rowblock bf16, dimsplit for e4m3 pools, dimsplit_t (sglang_gpu_variants.spec_for)."""
    try:
        from mlagen.build import build_variants  # noqa: F401
        from mlagen.ops import load_so  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"mlagen.build / mlagen.ops not importable: {e!r}")
    return _LazyKernels(gpu_arch)


class _LazyKernels(dict):
    """Case key -> VerifyKernel, the key's one-module spec built on first use (KeyError: no variant serves it)."""

    def __init__(self, arch: str):
        super().__init__()
        self.arch = arch

    def __missing__(self, key):
        from mlagen.build import build_variants
        from mlagen.ops import load_so

        for bv in build_variants(spec_for(key, self.arch)):
            self[variant_key(bv.variant)] = load_so(bv.uri, str(bv.so_path))
        if not dict.__contains__(self, key):
            raise KeyError(key)
        return dict.__getitem__(self, key)


# ----------------------------------------------------------------------------- stand-ins
def _make_pool(slots, page_size, dev, kv_fp8=False):
    """MLA KV pool: one layer, rows [slots, 1, 576] bf16, V = first 512 dims. An ``MLATokenToKVPool`` whose
    buffers are built here (SGLang's constructor needs a server context) and whose write door is
    SGLang's own ``set_kv_buffer``, so the backend treats it as the plain bf16 MLA pool it is.
    ``kv_fp8``: an e4m3 pool as SGLang builds it for --kv-cache-dtype fp8_e4m3 (dtype float8_e4m3fn,
    uint8 storage, readers get the float8 view), filled with N(0, 1) values cast to e4m3."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    class _Pool(MLATokenToKVPool):
        write_loc_is_dcp_resolved = True  # no decode-context parallelism here (SGLang's own flag)

        def __init__(self):  # noqa: D401 - SGLang's __init__ is not run (see above)
            self.size, self.page_size, self.start_layer, self.layer_num = slots, page_size, 0, 1
            self.dtype = self.store_dtype = torch.bfloat16
            self.dsa_kv_cache_store_fp8 = False
            self.kv_lora_rank, self.qk_rope_head_dim = 512, 64
            values = torch.randn(slots + page_size, 1, 576, device=dev)
            if kv_fp8:
                self.dtype, self.store_dtype = torch.float8_e4m3fn, torch.uint8
                self.kv_buffer = [values.to(torch.float8_e4m3fn).view(torch.uint8)]
            else:
                self.kv_buffer = [values.to(torch.bfloat16)]

        def get_key_buffer(self, layer_id):
            buf = self.kv_buffer[layer_id]
            return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

        def get_value_buffer(self, layer_id):
            return self.get_key_buffer(layer_id)[..., :512]

        def get_kv_buffer(self, layer_id):
            return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    return _Pool()


class _Config(types.SimpleNamespace):
    """Stand-in for SGLang's ModelConfig / a transformers config: the fields set here, and None for
    any other attribute (SGLang probes many optional ones, e.g. hybrid linear-attention layouts,
    whose "absent" answer is None for a DeepSeek-V3 style MLA model)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _Runner:
    def __init__(self, H, page_size, q_len, spec, kv_fp8=False):
        from sglang.srt.configs.model_config import AttentionArch

        dev = "cuda"
        rows = MAX_BS + 2
        pages_per_row = WIDTH // page_size
        # Disjoint random pages per request row (page 0 = padding slots).
        perm = torch.randperm(rows * pages_per_row, device=dev) + 1
        pages = perm.reshape(rows, pages_per_row)
        r2t = (pages[:, :, None] * page_size + torch.arange(page_size, device=dev)).reshape(rows, WIDTH)
        self.req_to_token_pool = types.SimpleNamespace(req_to_token=r2t.to(torch.int32).contiguous(), size=rows)
        self.token_to_kv_pool = _make_pool((rows * pages_per_row + 1) * page_size, page_size, dev, kv_fp8)
        self.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=page_size)
        self.page_size, self.device, self.gpu_id = page_size, dev, torch.cuda.current_device()
        self.sliding_window_size, self.is_draft_worker = None, False
        self.kv_cache_dtype = torch.float8_e4m3fn if kv_fp8 else torch.bfloat16
        self.use_mla_backend = True
        self._q_len = q_len
        self.spec_algorithm = types.SimpleNamespace(
            is_speculative=lambda: spec, is_dspark=lambda: False, is_none=lambda: not spec)
        hf = _Config(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
        hf.get_text_config = lambda *a, **k: hf  # transformers' PretrainedConfig API
        self.model_config = _Config(
            attention_arch=AttentionArch.MLA, context_len=WIDTH, head_dim=576, v_head_dim=512,
            swa_v_head_dim=None, is_encoder_decoder=False, hf_config=hf, hf_text_config=hf,
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, num_attention_heads=H,
            get_max_num_attention_heads=lambda: H, get_num_kv_heads=lambda *a: 1, is_draft_model=False)
        try:
            from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

            self.kv_index_translator = KVIndexTranslator(
                req_to_token=self.req_to_token_pool.req_to_token,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                token_to_kv_pool=self.token_to_kv_pool, page_size=page_size, device=dev)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"cannot build SGLang's KVIndexTranslator for the stand-in runner: {e!r}")

    def decode_num_tokens_per_req(self, *, num_draft_tokens=None):
        return self._q_len


def _make_backends(sgl, kernels, H, ps, q_len, role, mask, fp8_checkpoint=False, kv_fp8=False, schedule=None):
    from mlagen.sglang_plugin.backend import MlagenAttnBackend

    spec = role == "verify"
    runner = _Runner(H, ps, q_len if spec else 1, spec, kv_fp8)
    try:
        ref = sgl.Triton(runner)
        fb_triton = sgl.Triton(runner)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"TritonAttnBackend does not build on the stand-in runner: {e!r}")
    for t in (ref, fb_triton):
        t.num_draft_tokens = q_len if spec else None
        t.topk = 1
        t.target_verify_num_tokens_per_req = q_len if spec else 1
    key = case_key(role, H, ps, mask, kv_fp8, schedule)
    try:
        k = kernels[key]
    except KeyError:
        pytest.fail(f"mlagen built no variant for {key}; built: {sorted(kernels)}")
    ours = MlagenAttnBackend(runner, verify_kernel=k if spec else None, decode_kernel=None if spec else k,
                             fallback=fb_triton)
    layer = _layer(sgl, H, fp8_checkpoint)
    return runner, ref, ours, layer


def _layer(sgl, H, fp8_checkpoint=False):
    """A RadixAttention as deepseek_v2.py builds ``attn_mqa``. ``fp8_checkpoint``: under the quantization
    config of DeepSeek-V3 / Kimi-K2's fp8 checkpoints (quant_method fp8, 128x128 weight blocks), whose
    KV-cache quant method gives the layer k_scale / v_scale; the checkpoint has no KV scales, so they
    load as 1.0 (process_weights_after_loading), as on a server."""
    if not fp8_checkpoint:
        return sgl.RadixAttention(num_heads=H, head_dim=576, scaling=SCALE, num_kv_heads=1, layer_id=0,
                                  v_head_dim=512)
    kw = dict(num_heads=H, head_dim=576, scaling=SCALE, num_kv_heads=1, layer_id=0, v_head_dim=512,
              prefix="model.layers.0.self_attn.attn_mqa")
    try:
        from sglang.srt.layers.quantization.fp8 import Fp8Config

        quant = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                          weight_block_size=[128, 128])
        layer = sgl.RadixAttention(**kw, quant_config=quant)
    except Exception as e:  # noqa: BLE001 - fp8.py imports MoE / linear kernels; the KV-cache method is the same code
        print(f"\n[fp8 layer] Fp8Config does not build here ({e!r}); using its KV-cache method's base class")
        from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod

        layer = sgl.RadixAttention(**kw)
        layer.quant_method = BaseKVCacheMethod(None)
        layer.quant_method.create_weights(layer)
    assert layer.k_scale is not None, f"the fp8 config gave the layer no KV scales ({layer.quant_method!r})"
    layer.to("cuda")
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.k_scale_float == 1.0 and layer.v_scale_float == 1.0 and float(layer.k_scale) == 1.0
    return layer


def _parents(q_len, tree, gen):
    if not tree:
        return [i - 1 for i in range(q_len)]
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_len)]


def _full_mask(parents, L):
    from sglang_masks import full_mask_from_parents

    return full_mask_from_parents(parents, L).reshape(-1)


class _Batch:
    """One random batch (host side), turned into forward-batch namespaces on demand."""

    def __init__(self, sgl, runner, role, q_len, bs, tree, gen, lens=None):
        self.sgl, self.role, self.q_len, self.bs = sgl, role, q_len, bs
        spec = role == "verify"
        rows = torch.randperm(MAX_BS + 2, generator=gen)[:bs]
        hi = WIDTH - q_len if spec else WIDTH
        lens = torch.randint(1, hi + 1, (bs,), generator=gen) if lens is None else torch.tensor(lens)
        self.rpi = rows.cuda()
        self.seq_lens = lens.cuda()
        r2t = runner.req_to_token_pool.req_to_token
        if spec:
            pos = lens[:, None] + torch.arange(q_len)  # draft positions seq_len .. seq_len+q-1
        else:
            pos = (lens - 1)[:, None]  # decode: seq_lens include the new token
        self.out_cache_loc = r2t[self.rpi[:, None], pos.cuda()].reshape(-1).to(torch.int64)
        T = bs * (q_len if spec else 1)
        self.q = torch.randn(T, runner_heads(runner), 576, device="cuda").to(torch.bfloat16)
        self.k = torch.randn(T, 1, 576, device="cuda").to(torch.bfloat16)
        self.mask = self.qlen_mask = None
        if spec:
            parents = [_parents(q_len, tree, gen) for _ in lens]
            self.mask = torch.cat([_full_mask(p, int(L)) for p, L in zip(parents, lens)]).cuda()  # FULL_MASK
            self.qlen_mask = torch.cat([_full_mask(p, 0) for p in parents]).cuda()  # QLEN_ONLY: [q, q] blocks

    def spec_info(self, custom_mask=None):
        if self.role != "verify":
            return None
        return self.sgl.EagleVerifyInput(
            draft_token=None, custom_mask=self.mask if custom_mask is None else custom_mask, positions=None,
            retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None,
            spec_steps=self.q_len - 1, topk=1, draft_token_num=self.q_len, capture_hidden_mode=None,
            seq_lens_sum=int(self.seq_lens.sum()), seq_lens_cpu=None)

    def forward_batch(self, custom_mask=None):
        mode = self.sgl.ForwardMode.TARGET_VERIFY if self.role == "verify" else self.sgl.ForwardMode.DECODE
        return _fb(mode, self.bs, self.rpi, self.seq_lens, self.out_cache_loc, self.spec_info(custom_mask),
                   max_seq_len_host=int(self.seq_lens.max()))


def runner_heads(runner):
    return runner.model_config.num_attention_heads


def _fb(mode, bs, rpi, seq_lens, out_cache_loc, spec_info, num_padding=0, max_seq_len_host=None):
    return types.SimpleNamespace(
        forward_mode=mode, batch_size=bs, req_pool_indices=rpi, seq_lens=seq_lens,
        seq_lens_sum=int(seq_lens.sum()), seq_lens_cpu=None, out_cache_loc=out_cache_loc,
        out_cache_loc_is_physical=True, kv_loc_plan=None, kv_loc_cols=None, spec_info=spec_info,
        extend_seq_lens_cpu=None, extend_prefix_lens_cpu=None, mha_one_shot=False,
        attn_attend_prefix_cache=False, encoder_lens=None, num_padding=num_padding,
        max_seq_len_host=max_seq_len_host, positions=None, dcp_kv_mask=None)


def _forward(backend, layer, fb, q, k, role):
    v = k[..., :512]
    if role == "verify":
        return backend.forward_extend(q, k, v, layer, fb, save_kv_cache=True)
    return backend.forward_decode(q, k, v, layer, fb, save_kv_cache=True)


# ----------------------------------------------------------------------------- the test
CASES = [(role, H, ps, draft) for H in H_LIST for ps in PAGE_SIZES
         for role, draft in (("verify", "tree"), ("verify", "chain"), ("decode", "-"))]


@pytest.mark.parametrize("role, H, ps, draft", CASES, ids=[f"{r}-h{h}-ps{p}-{d}" for r, h, p, d in CASES])
def test_backend_matches_triton(sgl, kernels, role, H, ps, draft):
    _parity(sgl, kernels, role, H, ps, draft, REPLAYS)


DST_CASES = [(H, ps, draft) for H in H_LIST for ps in PAGE_SIZES for draft in ("tree", "chain")]


@pytest.mark.parametrize("H, ps, draft", DST_CASES, ids=[f"verify-h{h}-ps{p}-{d}" for h, p, d in DST_CASES])
def test_dimsplit_t_verify_matches_triton(sgl, kernels, H, ps, draft):
    """Target verify on the dimsplit_t schedule (a two-CTA cluster per split; the H200 bench's fastest for H 8
    target verify), served the same way as the other cases: eager (run_direct on SGLang's tensors, or the
    metadata launch for a FULL_MASK mask) and replayed beside SGLang's Triton backend."""
    _parity(sgl, kernels, "verify", H, ps, draft, REPLAYS, schedule="dimsplit_t")


DST_DECODE_CASES = [(H, ps) for H in H_LIST for ps in PAGE_SIZES]


@pytest.mark.parametrize("H, ps", DST_DECODE_CASES, ids=[f"decode-h{h}-ps{p}" for h, p in DST_DECODE_CASES])
def test_dimsplit_t_decode_matches_triton(sgl, kernels, H, ps):
    """Plain decode (q_len 1) on the dimsplit_t schedule with one score warp (H 8: 8 rows, H 16: 16 rows of its 24),
    which specs/kimi-k2-tp8-decode.yaml offers beside rowblock: eager and replayed beside SGLang's Triton backend."""
    _parity(sgl, kernels, "decode", H, ps, "-", REPLAYS, schedule="dimsplit_t")


FP8_CASES = [(role, H, ps, draft) for H in H_LIST for ps in PAGE_SIZES
             for role, draft in (("verify", "tree"), ("decode", "-"))]


@pytest.mark.parametrize("role, H, ps, draft", FP8_CASES, ids=[f"{r}-h{h}-ps{p}-{d}" for r, h, p, d in FP8_CASES])
def test_fp8_kv_pool_matches_triton(sgl, kernels, role, H, ps, draft):
    """--kv-cache-dtype fp8_e4m3: an e4m3 pool (uint8 storage, float8 view), dtype fp8_e4m3 variants; eager
    and replayed beside SGLang's Triton backend on the same pool. Both are compared with the fp32
    reference on the pool's bytes (Triton rounds q and P to e4m3, mlagen does not): mlagen within the
    bf16 bound and no further from it than Triton; the rows at out_cache_loc stored as SGLang's cast
    stores them, padded rows 0."""
    _parity(sgl, kernels, role, H, ps, draft, REPLAYS, kv_fp8=True)


DST_FP8_CASES = [(H, ps) for H in H_LIST for ps in PAGE_SIZES]


@pytest.mark.parametrize("H, ps", DST_FP8_CASES, ids=[f"verify-h{h}-ps{p}-tree" for h, p in DST_FP8_CASES])
def test_dimsplit_t_fp8_kv_pool_matches_triton(sgl, kernels, H, ps):
    """--kv-cache-dtype fp8_e4m3 with the dimsplit_t fp8_e4m3 variant (tree target verify): as
    test_fp8_kv_pool_matches_triton, eager and replayed beside SGLang's Triton backend on the same e4m3 pool."""
    _parity(sgl, kernels, "verify", H, ps, "tree", REPLAYS, kv_fp8=True, schedule="dimsplit_t")


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_fp8_checkpoint_layer_matches_triton(sgl, kernels, ps):
    """A layer built under an fp8 checkpoint's quantization config (k_scale / v_scale loaded as 1.0) over
    the bf16 pool: eager and replayed, the same outputs as Triton's backend with that layer."""
    _parity(sgl, kernels, "verify", 8, ps, "tree", min(REPLAYS, 200), fp8_checkpoint=True)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_eager_dp_padded_verify_matches_triton(sgl, kernels, ps):
    """DP attention (--enable-dp-attention) pads an eager verify batch to the largest rank's size
    (ForwardBatch.prepare_mlp_sync_batch: req_pool_indices 0, seq_len 1, _original_batch_size = the real
    count) while the custom mask covers only the real rows. The padded rows must not index the mask (a
    device-side assert otherwise); the real rows equal Triton's on the unpadded batch, the padded rows 0.
    With attn_tp_size > 1 the tokens are also padded past bs * q_len (extra rows of q, k, out_cache_loc):
    served the same way, the real rows' KV stored at out_cache_loc."""
    gen = torch.Generator().manual_seed(4242 + ps)
    H, q_len = 8, Q_TREE
    runner, ref, ours, layer = _make_backends(sgl, kernels, H, ps, q_len, "verify", "tree")
    # extra: token rows past bs * q_len, as with attn_tp_size > 1 (num_tokens aligned to it, bs = num_tokens // q_len)
    for real, bs, extra in ((1, 2, 0), (3, 8, 0), (5, 16, 0), (9, 9, 0), (1, 1, 3), (4, 5, 7)):
        b = _Batch(sgl, runner, "verify", q_len, real, True, gen)
        fb = b.forward_batch()
        ref.init_forward_metadata(fb)
        want = _forward(ref, layer, fb, b.q, b.k, "verify").float()
        npad, T = bs - real, real * q_len
        dev = b.seq_lens.device
        padded = _fb(sgl.ForwardMode.TARGET_VERIFY, bs,
                     torch.cat([b.rpi, torch.zeros(npad, dtype=b.rpi.dtype, device=dev)]),
                     torch.cat([b.seq_lens, torch.ones(npad, dtype=b.seq_lens.dtype, device=dev)]),
                     torch.cat([b.out_cache_loc, torch.zeros((npad * q_len + extra), dtype=torch.int64, device=dev)]),
                     b.spec_info())
        if npad:
            padded._original_batch_size = real
        pad_rows = npad * q_len + extra
        q = torch.cat([b.q, torch.randn(pad_rows, H, 576, device=dev).to(torch.bfloat16)])
        k = torch.cat([b.k, torch.zeros(pad_rows, 1, 576, device=dev, dtype=torch.bfloat16)])
        ours.init_forward_metadata(padded)
        _poison_rows(runner, layer, b.out_cache_loc)
        got = _forward(ours, layer, padded, q, k, "verify").float()
        torch.cuda.synchronize()
        assert got.shape[0] == bs * q_len + extra
        _check_written(runner, layer, b.out_cache_loc, b.k, f"DP-padded {real} of {bs} (+{extra} tokens)")
        err = _check(want, got[:T], f"eager DP-padded verify, {real} real of {bs} rows, {extra} extra tokens")
        if pad_rows:
            assert got[T:].abs().max().item() == 0.0, "padded rows must output 0"
        print(f"\n[dp-padded eager] ps={ps} real={real} bs={bs} extra tokens={extra}: max err {err:.3e}")


def _poison_rows(runner, layer, loc):
    """NaN into the pool rows this step writes: the backend must read the draft tokens from k and store them."""
    buf = runner.token_to_kv_pool.kv_buffer[layer.layer_id]
    if buf.dtype == torch.uint8:
        buf[loc] = 0x7F  # e4m3 NaN
    else:
        buf[loc] = float("nan")


def _check_written(runner, layer, loc, k, what):
    """The pool rows at out_cache_loc hold exactly this step's k (what SGLang's KV write stores)."""
    pool = runner.token_to_kv_pool
    got = pool.kv_buffer[layer.layer_id][loc]  # the stored bytes
    want = k.to(torch.bfloat16).reshape(got.shape).to(pool.dtype)  # SGLang's write: cache_k.to(pool dtype)
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), \
        f"{what}: KV rows at out_cache_loc differ from k after the step"


def _exact(runner, layer, b, role, q_len):
    """fp32 reference of batch ``b`` on the pool after its step (mlagen.reference): the prefix is the
    pool's e4m3 values (exact in bf16), this step's tokens are ``b.k`` in bf16 (both backends read them
    from k), tree / chain masks from the batch's [q, q] blocks, SGLang's req_to_token as a page-1 table."""
    from mlagen.reference import dequantize_e4m3, mla_verify_reference

    buf = runner.token_to_kv_pool.kv_buffer[layer.layer_id]
    kv = dequantize_e4m3(buf.reshape(buf.shape[0], -1)).to(torch.bfloat16)
    kv[b.out_cache_loc] = b.k.reshape(-1, kv.shape[1])
    spec = role == "verify"
    tree, mask = None, "causal"
    if spec:
        blocks = b.qlen_mask.view(b.bs, q_len, q_len).to(torch.int64)
        tree = (blocks << torch.arange(q_len, device=blocks.device)).sum(-1)
        mask = "tree"
    kv_lens = (b.seq_lens + q_len) if spec else b.seq_lens
    out, _ = mla_verify_reference(b.q, kv, runner.req_to_token_pool.req_to_token, kv_lens.to(torch.int32),
                                  q_len=q_len if spec else 1, page_size=1, softmax_scale=float(layer.scaling),
                                  mask=mask, tree_mask=tree, req_pool_indices=b.rpi)
    return out


def _vs_exact(runner, layer, b, role, q_len, triton_out, ours_out, what):
    """fp8 pool: (mlagen's, Triton's) max error against :func:`_exact`; mlagen within the bf16 bound and
    no further from the exact result than Triton plus that bound."""
    exact = _exact(runner, layer, b, role, q_len).reshape(ours_out.shape)  # [T, H, 512] -> the backend's [T, H * 512]
    e_ours = _check(exact, ours_out, f"{what}: mlagen vs the fp32 reference")
    e_tri = (triton_out - exact).abs().max().item()
    assert e_ours <= e_tri + ATOL, f"{what}: mlagen {e_ours:.3g} from the fp32 reference, Triton {e_tri:.3g}"
    return e_ours, e_tri


def _parity(sgl, kernels, role, H, ps, draft, replays, fp8_checkpoint=False, kv_fp8=False, schedule=None):
    gen = torch.Generator().manual_seed(1000 * H + ps + (7 if draft == "chain" else 0) + (3 if fp8_checkpoint else 0)
                                        + (5 if kv_fp8 else 0))
    q_len = (Q_TREE if draft == "tree" else Q_CHAIN) if role == "verify" else 1
    mask = "causal" if (role == "decode" or draft == "chain") else "tree"
    runner, ref, ours, layer = _make_backends(sgl, kernels, H, ps, q_len, role, mask, fp8_checkpoint, kv_fp8, schedule)
    tree = draft == "tree"
    errs = {"eager": 0.0, "replay": 0.0, "replay_vs_eager": 0.0}
    if kv_fp8:  # errors against the fp32 reference (mlagen's keys) and Triton's, for the print
        errs = {"eager": 0.0, "replay": 0.0, "triton eager": 0.0, "triton replay": 0.0, "replay_vs_eager": 0.0}

    # ---- eager, 1..16 requests; mlagen reads SGLang's FULL_MASK (even bs) or its QLEN_ONLY mask (odd bs:
    # what SGLang allocates for a batch past the verify-mask buffer, exactly bs * q * q cells)
    for bs in range(1, MAX_BS + 1):
        b = _Batch(sgl, runner, role, q_len, bs, tree, gen)
        outs = []
        for be in (ref, ours):
            fb = b.forward_batch(b.qlen_mask if be is ours and bs % 2 else None)
            be.init_forward_metadata(fb)
            if be is ours:
                # the kernel reads SGLang's tensors itself (run_direct) unless the mask is FULL_MASK (a tree
                # variant's even batches here), which takes the metadata launch
                want_direct = mask != "tree" or bs % 2 == 1
                got_direct = bool(getattr(ours.forward_metadata.batch, "direct", False))
                assert got_direct == want_direct, f"eager bs {bs}: direct batch {got_direct}, expected {want_direct}"
                _poison_rows(runner, layer, b.out_cache_loc)
            outs.append(_forward(be, layer, fb, b.q, b.k, role).float())
            if be is ours:
                _check_written(runner, layer, b.out_cache_loc, b.k, "eager")
        assert ours.forward_metadata is not None, "mlagen did not take the batch"
        assert ours._kernel_writes_kv(), "the launch should store the KV rows itself on a plain bf16 MLA pool"
        if kv_fp8:
            e, t = _vs_exact(runner, layer, b, role, q_len, outs[0], outs[1], f"eager bs {bs}")
            errs["eager"], errs["triton eager"] = max(errs["eager"], e), max(errs["triton eager"], t)
        else:
            errs["eager"] = max(errs["eager"], _check(outs[0], outs[1], "eager"))

    # ---- CUDA graphs: static buffers like the decode runner's, capture per bucket
    per = q_len if role == "verify" else 1
    T_max = MAX_BS * per
    bufs = dict(q=torch.zeros(T_max, H, 576, device="cuda", dtype=torch.bfloat16),
                k=torch.zeros(T_max, 1, 576, device="cuda", dtype=torch.bfloat16),
                loc=torch.zeros(T_max, dtype=torch.int64, device="cuda"),
                rpi=torch.zeros(MAX_BS, dtype=torch.int64, device="cuda"),
                seq=torch.ones(MAX_BS, dtype=torch.int64, device="cuda"))
    mode = sgl.ForwardMode.TARGET_VERIFY if role == "verify" else sgl.ForwardMode.DECODE
    fill = ours.get_cuda_graph_seq_len_fill_value()
    assert fill == ref.get_cuda_graph_seq_len_fill_value()
    graphs = {}
    for name, be in (("ref", ref), ("ours", ours)):
        be.init_cuda_graph_state(MAX_BS, T_max)
    if role == "verify":  # the draft stage fills q*q cells per request, not q*(context + q)
        vm = ours.verify_mask
        assert vm.mode.name == "QLEN_ONLY" and vm.buffer.numel() == MAX_BS * q_len * q_len, vm
    for name, be in (("ref", ref), ("ours", ours)):
        for bs in CAPTURE_BS:
            T = bs * per
            bufs["seq"][:bs].fill_(fill)
            spec = None
            if role == "verify":
                spec = b.spec_info(custom_mask=torch.ones(T_max * (WIDTH + per), dtype=torch.bool, device="cuda"))
                spec.draft_token_num = spec.num_tokens_per_req = q_len
            fb = _fb(mode, bs, bufs["rpi"][:bs], bufs["seq"][:bs], bufs["loc"][:T], spec)
            be.init_forward_metadata_out_graph(fb, in_capture=True)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up, as the runner does
                    be.init_forward_metadata_in_graph(fb)
                    _forward(be, layer, fb, bufs["q"][:T], bufs["k"][:T], role)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                be.init_forward_metadata_in_graph(fb)
                out = _forward(be, layer, fb, bufs["q"][:T], bufs["k"][:T], role)
            graphs[(name, bs)] = (g, out)

    n_pad_seen = 0
    for it in range(replays):
        raw = int(torch.randint(1, MAX_BS + 1, (1,), generator=gen))
        bs = min(c for c in CAPTURE_BS if c >= raw)
        b = _Batch(sgl, runner, role, q_len, raw, tree, gen)
        T_raw, T = raw * per, bs * per
        bufs["q"][:T_raw].copy_(b.q)
        bufs["q"][T_raw:T].zero_()
        bufs["k"][:T_raw].copy_(b.k)
        bufs["loc"][:T_raw].copy_(b.out_cache_loc)
        bufs["loc"][T_raw:T].zero_()  # padded tokens write the padding slot
        bufs["rpi"][:raw].copy_(b.rpi)
        bufs["rpi"][raw:bs].zero_()
        bufs["seq"][:raw].copy_(b.seq_lens)
        bufs["seq"][raw:bs].fill_(fill)
        outs = {}
        for name, be in (("ref", ref), ("ours", ours)):
            spec = b.spec_info()
            if name == "ours" and role == "verify" and it % 2:
                # as SGLang's draft stage does: the tree written in place into the backend's verify mask
                vm = ours.verify_mask
                vm.buffer.fill_(1)
                vm.buffer[: b.qlen_mask.numel()].copy_(b.qlen_mask)
                spec = b.spec_info(custom_mask=vm.buffer)
            view = _fb(mode, bs, bufs["rpi"][:bs], bufs["seq"][:bs], bufs["loc"][:T], spec,
                       num_padding=bs - raw, max_seq_len_host=int(b.seq_lens.max()))
            be.init_forward_metadata_out_graph(view)
            g, out = graphs[(name, bs)]
            if name == "ours":
                _poison_rows(runner, layer, b.out_cache_loc)
            g.replay()
            outs[name] = out.float().clone()
            if name == "ours":
                _check_written(runner, layer, b.out_cache_loc, b.k, f"replay {it}")
        n_pad_seen += bs - raw
        if kv_fp8:
            err, t = _vs_exact(runner, layer, b, role, q_len, outs["ref"][:T_raw], outs["ours"][:T_raw],
                               f"replay {it}: raw bs {raw} (bucket {bs})")
            errs["triton replay"] = max(errs["triton replay"], t)
        else:
            err = _check(outs["ref"][:T_raw], outs["ours"][:T_raw], f"replay {it}: raw bs {raw} (bucket {bs})")
        errs["replay"] = max(errs["replay"], err)
        if bs > raw:
            assert outs["ours"][T_raw:T].abs().max().item() == 0.0, "padded rows must output 0"
        if it % 100 == 0:  # replay == eager on the same batch
            fb = b.forward_batch()
            ours.init_forward_metadata(fb)
            eager = _forward(ours, layer, fb, b.q, b.k, role).float()
            d = _check(eager, outs["ours"][:T_raw], f"replay {it} vs eager")
            errs["replay_vs_eager"] = max(errs["replay_vs_eager"], d)
            # Same batch size => same split count => bitwise equal; a padded bucket may split
            # the KV differently, so only bf16 rounding may differ.
            if bs == raw:
                assert d == 0.0, f"replay {it} differs from eager by {d} at the same batch size"
    assert n_pad_seen > 0
    print(f"\n[mlagen vs triton] {role} H={H} ps={ps} draft={draft} q_len={q_len}{' fp8-ckpt' if fp8_checkpoint else ''}"
          f"{' fp8-kv' if kv_fp8 else ''}: "
          + ", ".join(f"max err {k} {v:.3e}" for k, v in errs.items()))
