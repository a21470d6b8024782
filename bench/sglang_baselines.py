"""SGLang 0.5.23 Triton MLA attention kernels as timing / correctness baselines.

The problem ("MLA target-verify", DeepSeek-V3 / Kimi-K2 absorbed MLA):

    q            [T = bs*q_len, H, 576] bf16   (512 latent + 64 rope)
    kv_cache     [num_slots, 576]        bf16   (the KV pool; K = all 576, V = first 512)
    req_to_token [bs, ctx]               int32  slot id of token t of request b
    kv_lens      [bs]                    int32  = ctx, INCLUDING the q_len draft tokens
                                               (draft token i of request b sits at
                                               position ctx-q_len+i, slot req_to_token[b, ctx-q_len+i])
    tree_mask    [bs, q_len]             int64  bit j of row i: query i sees draft token j
    out          [T, H, 512]             bf16

Every query sees all ctx-q_len prefix tokens plus the draft tokens its tree row
allows (its ancestors and itself).

Two SGLang kernels are wrapped, called exactly the way SGLang 0.5.23 calls them
(read from sglang/srt/layers/attention/triton_backend.py; the kernels now live in
sglang/kernels/ops/attention/{extend,decode}_attention.py):

* ``extend_attention_fwd`` as ``TritonAttnBackend.forward_extend`` runs it in
  TARGET_VERIFY mode for MLA (``_extend_args`` below lists every argument):
  prefix KV read from the pool through kv_indptr/kv_indices (prefix only:
  SGLang's ``seq_lens`` exclude the draft tokens), the draft tokens' own KV
  passed densely as k_extend/v_extend, and the tree as SGLang's flattened
  ``custom_mask`` (bool, per request ``q_len x (prefix+q_len)`` row-major,
  prefix columns True), with ``mask_indptr``.
* ``decode_attention_fwd`` (split-KV flash decoding, MLA path ``has_mla=True``)
  with the q_len*H query rows of a request given as q_len*H heads sharing the
  single latent KV head (MLA is MQA).  It IGNORES the tree mask (every query
  sees every draft token), so it is a speed alternative, not a correct verify.

Nothing here imports torch, triton or sglang at module import time; every entry
point that needs them either returns a reason (``sglang_available``) or raises
``SglangUnavailable`` with the reason.  No numbers are ever invented.

Timing (``time_extend_verify`` / ``time_decode_splitkv``): after warm-up (which
also JIT-compiles the Triton kernels) one CUDA graph is captured that calls the
kernel once on each of ``n_copies`` independent copies of the problem (same
values, different buffers), and the graph is replayed; the result is the median
over replays of (replay time / n_copies) in microseconds, measured with CUDA
events.  ``n_copies`` is chosen so the copies together hold > 256 MB of the
data a call reads (KV + q + out), far more than the 50-60 MB L2, so each call
finds its KV in HBM, as in a real model where 61 layers each read their own
pool.  If graph capture fails, ``triton.testing.do_bench(return_mode="median")``
is used instead (it flushes L2 between calls itself); ``last_timing`` says
which method produced the last number.

Bytes (for bandwidth figures use ``bench/ceilings.py``'s ``verify_bytes``, the
algorithmic minimum: KV read once + q + out):

    verify_bytes = bs*ctx*576*2 + bs*q_len*H*576*2 + bs*q_len*H*512*2

What the SGLang kernels actually issue is larger (mostly served by L2):
``extend_issued_kv_bytes`` / ``decode_issued_bytes`` below give it.
"""

from __future__ import annotations

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))  # the mlagen package

import importlib
import importlib.util
import statistics
import sys
import types

# ---------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------

#: the light packages sglang imports at import time (name -> import name)
LIGHT_DEPS = {
    "numpy": "numpy",
    "orjson": "orjson",
    "psutil": "psutil",
    "pybase64": "pybase64",
    "requests": "requests",
    "packaging": "packaging",
    "pillow": "PIL",
    "starlette": "starlette",
    "pyzmq": "zmq",
    "tqdm": "tqdm",
    "ipython": "IPython",
    "pydantic": "pydantic",
    "aiohttp": "aiohttp",
    "msgspec": "msgspec",
    "typing_extensions": "typing_extensions",
}

ROTATE_BYTES = 256 << 20  # data rotated through per timing replay (> 4x L2)
MAX_COPIES = 256

#: filled by the timing functions: method ("cuda_graph" / "do_bench"), copies, ...
last_timing: dict = {}


class SglangUnavailable(RuntimeError):
    """Raised by the run/time functions when torch/CUDA/triton/sglang is missing."""


_kernels = None  # (extend_module, decode_module, how) once imported
_import_error = None  # reason string once an import attempt failed


def import_report() -> dict:
    """{package: "ok <version>" | "missing: <error>"} for torch, triton, sglang's
    light deps and sglang itself.  Never raises.  Imports the packages (but not
    sglang's kernel modules)."""
    rep = {}
    names = {"torch": "torch", "triton": "triton", **LIGHT_DEPS}
    for pkg, mod in names.items():
        try:
            m = importlib.import_module(mod)
            rep[pkg] = "ok " + str(getattr(m, "__version__", getattr(m, "VERSION", "?")))
        except Exception as e:  # noqa: BLE001 - report anything
            rep[pkg] = f"missing: {type(e).__name__}: {e}"
    try:
        spec = importlib.util.find_spec("sglang")
        rep["sglang"] = "found " + (spec.origin or "?") if spec else "missing: not installed"
    except Exception as e:  # noqa: BLE001
        rep["sglang"] = f"missing: {type(e).__name__}: {e}"
    return rep


def _drop_sglang_modules():
    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[k]


def _bare_import():
    """Import the two kernel modules without running sglang/__init__.py,
    sglang/kernels/__init__.py and sglang/kernels/ops/__init__.py (which pull in
    sglang's frontend: IPython, pydantic, ...).  Fallback only."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    root = list(spec.submodule_search_locations)[0]
    for name, sub in (("sglang", ""), ("sglang.kernels", "/kernels"),
                      ("sglang.kernels.ops", "/kernels/ops")):
        m = types.ModuleType(name)
        m.__path__ = [root + sub]
        m.__package__ = name
        sys.modules[name] = m
    ext = importlib.import_module("sglang.kernels.ops.attention.extend_attention")
    dec = importlib.import_module("sglang.kernels.ops.attention.decode_attention")
    return ext, dec


def _load_kernels():
    """Return (extend_module, decode_module); raise SglangUnavailable."""
    global _kernels, _import_error
    if _kernels is not None:
        return _kernels
    if _import_error is not None:
        raise SglangUnavailable(_import_error)
    try:
        import torch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        _import_error = f"torch not importable: {type(e).__name__}: {e}"
        raise SglangUnavailable(_import_error) from None
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        _import_error = f"triton not importable: {type(e).__name__}: {e}"
        raise SglangUnavailable(_import_error) from None
    try:
        ext = importlib.import_module("sglang.kernels.ops.attention.extend_attention")
        dec = importlib.import_module("sglang.kernels.ops.attention.decode_attention")
        _kernels = (ext, dec, "import sglang.kernels.ops.attention")
        return _kernels
    except Exception as e1:  # noqa: BLE001
        first = f"{type(e1).__name__}: {e1}"
    # fallback: skip the package __init__ files that pull in the frontend
    _drop_sglang_modules()
    try:
        ext, dec = _bare_import()
        _kernels = (ext, dec, f"bare import (package import failed: {first})")
        return _kernels
    except Exception as e2:  # noqa: BLE001
        _drop_sglang_modules()
        missing = [p for p, s in import_report().items() if s.startswith("missing")]
        _import_error = (f"sglang kernels not importable: {first}; bare import: "
                         f"{type(e2).__name__}: {e2}; missing packages: {missing or 'none'}")
        raise SglangUnavailable(_import_error) from None


def sglang_available() -> tuple[bool, str]:
    """(ok, reason).  ok is True when torch sees a CUDA GPU and SGLang's Triton
    extend/decode attention kernels import; reason then says how they were
    imported (and the sglang version).  Never raises."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return False, f"torch not importable: {type(e).__name__}: {e}"
    try:
        if not torch.cuda.is_available():
            return False, "no CUDA GPU visible to torch"
    except Exception as e:  # noqa: BLE001
        return False, f"torch.cuda check failed: {type(e).__name__}: {e}"
    try:
        ext, _dec, how = _load_kernels()
    except SglangUnavailable as e:
        return False, str(e)
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}"
    ver = "?"
    try:
        from importlib.metadata import version
        ver = version("sglang")
    except Exception:  # noqa: BLE001
        pass
    return True, f"sglang {ver} via {how} ({ext.__file__})"


def _require():
    ok, why = sglang_available()
    if not ok:
        raise SglangUnavailable(why)
    return _load_kernels()


# ---------------------------------------------------------------------------
# problem
# ---------------------------------------------------------------------------

D_QK = 576  # 512 latent (kv_lora_rank) + 64 rope
D_V = 512
DEFAULT_SOFTMAX_SCALE = 192 ** -0.5  # DeepSeek-V3: (128 nope + 64 rope) ** -0.5


def random_tree_parents(q_len: int, bs: int, seed: int) -> list[list[int]]:
    """parents[b][i] for each draft node: -1 for node 0 (the root), otherwise a
    uniformly random earlier node.  Pure python (testable without torch)."""
    import random
    rng = random.Random(seed)
    return [[-1] + [rng.randrange(i) for i in range(1, q_len)] for _ in range(bs)]


def tree_mask_bits(parents: list[list[int]]) -> list[list[int]]:
    """Row bitmasks (ancestors + self) as signed int64 values (bit 63 wraps)."""
    out = []
    for par in parents:
        vis = []
        for i, p in enumerate(par):
            m = (vis[p] if p >= 0 else 0) | (1 << i)
            vis.append(m)
        out.append([m - (1 << 64) if m >= (1 << 63) else m for m in vis])
    return out


def make_problem(H: int, q_len: int, bs: int, ctx: int, page_size: int = 1,
                 device="cuda", seed: int = 0, softmax_scale: float | None = None) -> dict:
    """Build one random verify problem (see the module docstring for layouts).

    Returns a dict with
      H, q_len, bs, ctx, page_size, softmax_scale (float), seed
      q            [bs*q_len, H, 576] bf16, N(0,1)
      kv_cache     [num_slots, 576]    bf16, N(0,1) (unreferenced rows random too)
      req_to_token [bs, ctx] int32: random pages (pages 1.. of the pool; page 0 is
                   left unused as SGLang keeps it for padding), slot = page*P + off;
                   for page_size 1 a random permutation of slots
      kv_lens      [bs] int32 = ctx (includes the q_len draft tokens)
      tree_mask    [bs, q_len] int64 bitmask from a random tree
      parents      [bs, q_len] int32 (-1 for the root)

    Raises:
      ValueError: q_len outside 1..64, ctx < q_len, or page_size < 1.
    """
    import torch

    if not (1 <= q_len <= 64):
        raise ValueError("q_len must be in 1..64 (int64 tree bitmask)")
    if ctx < q_len:
        raise ValueError("ctx (kv_len) includes the q_len draft tokens: need ctx >= q_len")
    if page_size < 1:
        raise ValueError("page_size >= 1")
    device = torch.device(device)
    scale = DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)
    P = page_size
    pages_per_req = -(-ctx // P)
    need = bs * pages_per_req
    total_pages = 1 + need + need // 8  # page 0 reserved + 12.5% unreferenced slack
    num_slots = total_pages * P

    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    pages = (torch.randperm(total_pages - 1, generator=g)[:need] + 1).view(bs, pages_per_req)
    t = torch.arange(ctx)
    req_to_token = (pages[:, t // P] * P + (t % P)).to(torch.int32)

    parents = random_tree_parents(q_len, bs, seed)
    bits = tree_mask_bits(parents)

    gd = torch.Generator(device=device)
    gd.manual_seed(seed + 1)
    q = torch.randn((bs * q_len, H, D_QK), generator=gd, device=device,
                    dtype=torch.float32).to(torch.bfloat16)
    kv = torch.randn((num_slots, D_QK), generator=gd, device=device,
                     dtype=torch.float32).to(torch.bfloat16)
    return {
        "H": H, "q_len": q_len, "bs": bs, "ctx": ctx, "page_size": P,
        "softmax_scale": scale, "seed": seed,
        "q": q,
        "kv_cache": kv,
        "req_to_token": req_to_token.to(device),
        "kv_lens": torch.full((bs,), ctx, dtype=torch.int32, device=device),
        "tree_mask": torch.tensor(bits, dtype=torch.int64, device=device),
        "parents": torch.tensor(parents, dtype=torch.int32, device=device),
    }


def _clone_problem(p: dict) -> dict:
    import torch
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}


def _dense_tree(p: dict):
    """[bs, q_len, q_len] bool: query i sees draft token j."""
    import torch
    q_len = p["q_len"]
    j = torch.arange(q_len, device=p["tree_mask"].device, dtype=torch.int64)
    return ((p["tree_mask"][:, :, None] >> j) & 1).bool()


def _problem_bytes(p: dict) -> int:
    """Bytes one call reads/writes at minimum: KV once (2 bytes per value, 1 for an e4m3 pool) + q + out."""
    return (p["bs"] * p["ctx"] * D_QK * p["kv_cache"].element_size() + p["q"].numel() * 2
            + p["bs"] * p["q_len"] * p["H"] * D_V * 2)


def _n_copies(bytes_per_copy: int) -> int:
    if bytes_per_copy >= (1 << 30):
        return 1
    return max(2, min(MAX_COPIES, -(-ROTATE_BYTES // max(1, bytes_per_copy))))


# ---------------------------------------------------------------------------
# SGLang argument construction
# ---------------------------------------------------------------------------

def _extend_args(p: dict):
    """(args, kwargs, out) for extend_attention_fwd, as TritonAttnBackend builds
    them for ForwardMode.TARGET_VERIFY with an MLA model (triton_backend.py
    init_forward_metadata + forward_extend; deepseek's forward_absorb passes
    k = cat(k_nope, k_pe) [T,1,576] and v = k_nope [T,1,512]).
    """
    import torch
    bs, q_len, H, ctx = p["bs"], p["q_len"], p["H"], p["ctx"]
    dev = p["q"].device
    prefix = ctx - q_len  # SGLang's seq_lens in TARGET_VERIFY (draft tokens excluded)
    T = bs * q_len
    r2t = p["req_to_token"].long()

    # token_to_kv_pool.get_key_buffer / get_value_buffer for MLATokenToKVPool
    k_buffer = p["kv_cache"].view(-1, 1, D_QK)
    v_buffer = k_buffer[..., :D_V]  # strided view, as the pool returns it

    # the draft tokens' own KV (already written to the pool by set_kv_buffer);
    # forward_extend passes k.contiguous(), v.contiguous()
    # (an e4m3 pool: the layer's k is bf16 — the draft rows' e4m3 values, exact in bf16)
    draft_slots = r2t[:, prefix:].reshape(-1)
    k_extend = p["kv_cache"][draft_slots].view(T, 1, D_QK).to(torch.bfloat16).contiguous()
    v_extend = k_extend[..., :D_V].contiguous()

    qo_indptr = torch.arange(0, (bs + 1) * q_len, q_len, dtype=torch.int32, device=dev)
    kv_indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * prefix
    kv_indices = r2t[:, :prefix].reshape(-1).contiguous()  # int64, as SGLang allocates
    if kv_indices.numel() == 0:
        kv_indices = torch.zeros(1, dtype=torch.int64, device=dev)

    # spec_info.custom_mask (EAGLE build_tree, TreeMaskMode.FULL_MASK): bool,
    # per request q_len rows x (seq_len + q_len) cols, prefix cols True
    tree = _dense_tree(p)  # [bs, q_len, q_len]
    custom_mask = torch.cat(
        [torch.ones(bs, q_len, prefix, dtype=torch.bool, device=dev), tree], dim=2
    ).reshape(-1).contiguous()
    mask_indptr = torch.arange(bs + 1, dtype=torch.int64, device=dev) * (q_len * ctx)

    o = torch.empty((T, H, D_V), dtype=torch.bfloat16, device=dev)
    args = (
        p["q"],          # q_extend [T, H, 576]
        k_extend,        # [T, 1, 576]
        v_extend,        # [T, 1, 512]
        o,               # o_extend [T, H, 512]
        k_buffer,        # [num_slots, 1, 576]
        v_buffer,        # [num_slots, 1, 512] view (row stride 576)
        qo_indptr,       # int32 [bs+1]
        kv_indptr,       # int32 [bs+1] over the prefix
        kv_indices,      # int64 [bs*prefix] slot ids
        custom_mask,     # bool [bs*q_len*ctx]
        True,            # is_causal (forward_extend's `causal`; the custom mask wins)
        mask_indptr,     # int64 [bs+1]
        q_len,           # max_len_extend
        1.0,             # k_scale (k_descale: bf16 cache, or an e4m3 one without KV scales)
        1.0,             # v_scale
    )
    kwargs = dict(
        sm_scale=p["softmax_scale"],
        logit_cap=0.0,
        sliding_window_size=-1,
        sinks=None,
        window_kv_offsets=None,
        xai_temperature_len=-1,
        page_size=p["page_size"],
        score_mod=None,
        aux_tensors=None,
        extend_seq_lens_cpu=[q_len] * bs,
    )
    return args, kwargs, o


def _use_pdl_default() -> bool:
    """SGLang: use_pdl = is_arch_support_pdl() on CUDA, i.e. compute capability >= 9."""
    import torch
    return torch.cuda.get_device_capability()[0] >= 9


def _decode_args(p: dict, num_kv_splits: int, use_pdl: bool | None = None,
                 workspace=None):
    """(args, kwargs, out, workspace) for decode_attention_fwd with the q_len*H
    query rows of each request as heads: q [bs, q_len*H, 576], one KV head,
    kv_indptr/kv_indices over all ctx tokens (prefix + drafts), attn_logits
    [bs, q_len*H, S, 512] fp32 and attn_lse [bs, q_len*H, S] fp32 (S =
    max_kv_splits = num_kv_splits) as TritonAttnBackend allocates them, and the
    per-request num_kv_splits tensor filled with num_kv_splits."""
    import torch
    bs, q_len, H, ctx = p["bs"], p["q_len"], p["H"], p["ctx"]
    dev = p["q"].device
    S = int(num_kv_splits)
    if S < 1:
        raise ValueError("num_kv_splits >= 1")
    heads = q_len * H
    q = p["q"].view(bs, heads, D_QK)  # request-major T: row (i, h) -> head i*H + h
    k_buffer = p["kv_cache"].view(-1, 1, D_QK)
    v_buffer = k_buffer[..., :D_V]
    kv_indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * ctx
    kv_indices = p["req_to_token"].long().reshape(-1).contiguous()
    if workspace is None or workspace[0].shape[2] != S:
        attn_logits = torch.empty((bs, heads, S, D_V), dtype=torch.float32, device=dev)
        attn_lse = torch.empty((bs, heads, S), dtype=torch.float32, device=dev)
        workspace = (attn_logits, attn_lse)
    attn_logits, attn_lse = workspace
    splits = torch.full((bs,), S, dtype=torch.int32, device=dev)
    o = torch.empty((bs, heads, D_V), dtype=torch.bfloat16, device=dev)
    if use_pdl is None:
        use_pdl = _use_pdl_default()
    args = (
        q,             # [bs, q_len*H, 576]
        k_buffer,      # [num_slots, 1, 576]
        v_buffer,      # [num_slots, 1, 512] view
        o,             # [bs, q_len*H, 512]
        kv_indptr,     # int32 [bs+1]
        kv_indices,    # int64 [bs*ctx]
        attn_logits,   # fp32 [bs, q_len*H, S, 512]
        attn_lse,      # fp32 [bs, q_len*H, S]
        splits,        # int32 [bs], all = S
        S,             # max_kv_splits
        p["softmax_scale"],  # sm_scale
        1.0,           # k_scale
        1.0,           # v_scale
    )
    kwargs = dict(
        logit_cap=0.0,
        sinks=None,
        xai_temperature_len=-1,
        has_mla=True,
        use_pdl=bool(use_pdl),
        page_size=p["page_size"],
        score_mod=None,
        aux_tensors=None,
        enable_lean=False,  # Lean is HIP-only; CUDA takes the grouped kernel anyway
    )
    return args, kwargs, o, workspace


# ---------------------------------------------------------------------------
# correctness helpers
# ---------------------------------------------------------------------------

def run_extend_verify(problem: dict):
    """SGLang extend_attention_fwd (TARGET_VERIFY, tree mask) -> out [T, H, 512] bf16."""
    ext, _dec, _how = _require()
    import torch
    args, kwargs, o = _extend_args(problem)
    ext.extend_attention_fwd(*args, **kwargs)
    torch.cuda.synchronize()
    return o


def run_decode(problem: dict, num_kv_splits: int, use_pdl: bool | None = None):
    """SGLang decode_attention_fwd (split-KV, tree mask IGNORED: every query sees
    all ctx tokens) -> out [T, H, 512] bf16.

    Raises:
      SglangUnavailable: torch / CUDA / triton / sglang missing (checked first).
      ValueError: num_kv_splits < 1.
    """
    _ext, dec, _how = _require()
    import torch
    args, kwargs, o, _ws = _decode_args(problem, num_kv_splits, use_pdl)
    dec.decode_attention_fwd(*args, **kwargs)
    torch.cuda.synchronize()
    return o.view(problem["bs"] * problem["q_len"], problem["H"], D_V)


def reference_verify(problem: dict, ignore_tree: bool = False):
    """mlagen's one reference (mlagen.reference) on this problem -> out [T, H, 512] float32.
    ignore_tree=True gives what run_decode computes (all ctx tokens visible: mask "none")."""
    from mlagen.reference import mla_verify_reference

    p = problem
    out, _lse = mla_verify_reference(p["q"], p["kv_cache"], p["req_to_token"], p["kv_lens"], q_len=p["q_len"],
                                     page_size=1, softmax_scale=p["softmax_scale"],
                                     mask="none" if ignore_tree else "tree", tree_mask=p["tree_mask"])
    return out


def sglang_default_num_kv_splits(problem: dict, max_context_len: int = 163840,
                                 base_max_kv_splits: int = 8) -> int:
    """The num_kv_splits SGLang's TritonAttnBackend would pick for this batch if
    the q_len*H rows were decoded as heads: max_kv_splits from
    _mla_decode_kv_splits_cap (max(8, min(next_pow2(SMs), next_pow2(ceil(
    max_context_len/32))))) and the per-request count from its
    get_num_kv_splits_triton kernel.  Returns the max over requests."""
    _require()
    import torch
    import triton
    meta = importlib.import_module("sglang.kernels.ops.attention.metadata")
    p = problem
    dev = p["q"].device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cap = max(base_max_kv_splits, min(triton.next_power_of_2(sms),
                                      triton.next_power_of_2(-(-max_context_len // 32))))
    out = torch.empty((p["bs"],), dtype=torch.int32, device=dev)
    seq_lens = p["kv_lens"].to(torch.int32)
    sched = 256 if p["bs"] < 256 else triton.next_power_of_2(p["bs"])
    meta.get_num_kv_splits_triton[(1,)](
        out, seq_lens, p["bs"], 1, p["q_len"] * p["H"], 1, cap, sms, MAX_NUM_SEQ=sched)
    torch.cuda.synchronize()
    return int(out.max().item())


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------

def _time_rotating(calls, n_rep_sets=None, bytes_per_call=0) -> float:
    """Median µs per call of a list of zero-arg callables (one per problem copy).

    CUDA graph of all calls, replayed; median over replays of time/len(calls).
    Falls back to triton.testing.do_bench(calls[0], return_mode="median")."""
    import torch
    global last_timing
    n = len(calls)
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for _ in range(2):
            for f in calls:
                f()
    cur.wait_stream(side)
    torch.cuda.synchronize()
    info = {"n_copies": n, "rotated_bytes": n * bytes_per_call}
    graph_err = None
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in calls:
                f()
        g.replay()
        torch.cuda.synchronize()
        # one timed replay to size the run
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        t_ms = max(e0.elapsed_time(e1), 1e-3)
        reps = n_rep_sets or int(min(100, max(10, 300.0 / t_ms)))
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(reps)]
        for a, b in evs:
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        per = [a.elapsed_time(b) * 1e3 / n for a, b in evs]
        del g
        info.update(method="cuda_graph", replays=reps,
                    min_us=min(per), max_us=max(per))
        last_timing = info
        return statistics.median(per)
    except Exception as e:  # noqa: BLE001
        graph_err = f"{type(e).__name__}: {e}"
        torch.cuda.synchronize()
    import triton.testing
    ms = triton.testing.do_bench(calls[0], warmup=25, rep=200, return_mode="median")
    info.update(method="do_bench", graph_error=graph_err, n_copies=1,
                rotated_bytes=bytes_per_call)
    last_timing = info
    return ms * 1e3


def time_extend_verify(problem: dict, n_rep_sets: int | None = None) -> float:
    """Median µs of one SGLang extend_attention_fwd TARGET_VERIFY call (tree mask)
    on `problem`, L2-cold (see module docstring: CUDA graph over rotated copies).
    n_rep_sets: graph replays (default: ~0.3 s worth, 10..100)."""
    ext, _dec, _how = _require()
    copies = [problem] + [_clone_problem(problem)
                          for _ in range(_n_copies(_problem_bytes(problem)) - 1)]
    calls = []
    for c in copies:
        args, kwargs, _o = _extend_args(c)
        calls.append(lambda a=args, k=kwargs: ext.extend_attention_fwd(*a, **k))
    us = _time_rotating(calls, n_rep_sets, _problem_bytes(problem))
    last_timing.update(kernel="extend_attention_fwd")
    return us


def time_decode_splitkv(problem: dict, num_kv_splits: int,
                        n_rep_sets: int | None = None, use_pdl: bool | None = None) -> float:
    """Median µs of one SGLang decode_attention_fwd call (split-KV, stage 1 +
    stage 2) with q viewed as [bs, q_len*H, 576] heads over all ctx tokens.
    IGNORES the tree mask (a speed alternative, not a correct verify).
    The attn_logits/attn_lse workspace is shared by the copies, as SGLang shares
    it across layers.  use_pdl: default as SGLang (True on sm_90+).

    Raises:
      SglangUnavailable: torch / CUDA / triton / sglang missing (checked first).
      ValueError: num_kv_splits < 1.
    """
    _ext, dec, _how = _require()
    per_copy = _problem_bytes(problem)
    copies = [problem] + [_clone_problem(problem) for _ in range(_n_copies(per_copy) - 1)]
    calls, ws = [], None
    for c in copies:
        args, kwargs, _o, ws = _decode_args(c, num_kv_splits, use_pdl, ws)
        calls.append(lambda a=args, k=kwargs: dec.decode_attention_fwd(*a, **k))
    us = _time_rotating(calls, n_rep_sets, per_copy)
    last_timing.update(kernel="decode_attention_fwd", num_kv_splits=int(num_kv_splits),
                       use_pdl=bool(use_pdl if use_pdl is not None else _use_pdl_default()))
    return us


# ---------------------------------------------------------------------------
# issued-traffic models (documentation / analysis; pure python)
# ---------------------------------------------------------------------------

def extend_issued_kv_bytes(H: int, q_len: int, bs: int, ctx: int, block_m: int = 32) -> int:
    """KV bytes SGLang's extend kernel LOADS (from L2 or HBM): its grid is
    (bs, H, ceil(q_len/BLOCK_M)) (BLOCK_M = 32 for Lq=576 on sm_90) and every
    program walks the whole prefix (576 dims) and the draft KV.  So the prefix is
    loaded H*ceil(q_len/BLOCK_M) times per request; HBM sees ~1x when L2 catches
    the re-reads across heads."""
    tiles = -(-q_len // block_m)
    prefix = ctx - q_len
    return bs * H * tiles * (prefix + q_len) * D_QK * 2


def decode_issued_bytes(H: int, q_len: int, bs: int, ctx: int, num_kv_splits: int,
                        block_h: int = 16) -> int:
    """Bytes SGLang's split-KV decode issues: stage 1 grid (bs, ceil(q_len*H/16),
    S) loads each request's ctx*576 KV once per 16-head tile and writes
    attn_logits+lse (S*(512+1) fp32 per head row); stage 2 reads them back and
    writes out (512 bf16 per row)."""
    heads = q_len * H
    tiles = -(-heads // block_h)
    kv = bs * tiles * ctx * D_QK * 2
    q = bs * heads * D_QK * 2
    ws = bs * heads * num_kv_splits * (D_V + 1) * 4
    return kv + q + 2 * ws + bs * heads * D_V * 2


__all__ = [
    "sglang_available", "import_report", "make_problem", "time_extend_verify",
    "time_decode_splitkv", "run_extend_verify", "run_decode", "reference_verify",
    "sglang_default_num_kv_splits", "extend_issued_kv_bytes", "decode_issued_bytes",
    "random_tree_parents", "tree_mask_bits", "SglangUnavailable", "last_timing",
]
