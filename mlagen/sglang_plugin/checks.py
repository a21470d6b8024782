"""Startup checks for the ``mlagen`` SGLang attention backend (pure Python, CPU-testable).

The backend factory gathers a :class:`ServerFacts` from the model runner and calls
:func:`run_startup_checks`; any problem raises :class:`MlagenSetupError` whose message says what
is wrong and what to build / pass instead. Nothing here imports torch or SGLang.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

# SGLang releases whose interfaces this backend was written against (see README.md, "Use with SGLang"):
# the plugin entry-point group + add_attention_backend_choices, the out_graph/in_graph
# metadata ABC, build_replay_fb_view(num_padding=...), VerifyMask, KVWriteLoc.for_batch and the
# Triton backend's target_verify_num_tokens_per_req. 0.5.23 was read in full and 0.5.22 has the
# same interfaces; 0.5.20/0.5.21 lack KVWriteLoc.for_batch, <= 0.5.19 the choice adder,
# <= 0.5.12 the out_graph/in_graph metadata API.
SGLANG_MIN_VERSION = "0.5.22"
SGLANG_MAX_VERSION_EXCLUSIVE = "0.5.24"
SUPPORTED_SGLANG_RANGE = f">={SGLANG_MIN_VERSION},<{SGLANG_MAX_VERSION_EXCLUSIVE}"

# DeepSeek-V2/V3 and Kimi-K2 family checkpoints served by SGLang's deepseek_v2.py MLA code, the ones the
# tests build. Any other architecture SGLang runs as dense MLA (ModelConfig.attention_arch MLA: e.g.
# MistralLarge3, LongcatFlash, GigaChat35) is served when an installed variant matches its heads,
# kv_lora_rank and qk_rope_head_dim; the layer's scaling is used as is.
TESTED_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM",
    "KimiK25ForConditionalGeneration",
)
SUPPORTED_ARCHITECTURES = TESTED_ARCHITECTURES  # the previous name
# Speculative algorithms whose target verify carries an EagleVerifyInput tree mask.
SUPPORTED_SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
MAX_TREE_DRAFT_TOKENS = 64  # the kernel's tree mask is one int64 bitmask per query row
KV_CACHE_DTYPES_OK = ("bfloat16", "bf16", "auto")
FP8_KV_CACHE_DTYPES = ("float8_e4m3fn", "fp8_e4m3")  # --kv-cache-dtype fp8_e4m3: served by dtype fp8_e4m3 variants


def server_kv_dtype(f: "ServerFacts") -> str:
    """The installed-variant dtype ("bf16" or "fp8_e4m3") this server's KV pool needs (None: neither)."""
    d = str(f.kv_cache_dtype).replace("torch.", "")
    if d in KV_CACHE_DTYPES_OK:
        return "bf16"
    if d in FP8_KV_CACHE_DTYPES:
        return "fp8_e4m3"
    return None


class MlagenSetupError(ValueError):
    """The server configuration cannot be served by the installed mlagen kernels."""


@dataclasses.dataclass
class ServerFacts:
    """What the checks need to know about one model runner (all plain values).

    ``num_attention_heads`` is the model total; heads per rank = total // attn_tp_size.
    ``kv_cache_dtype`` is the torch dtype name of the KV pool (e.g. "bfloat16").
    ``spec_algorithm`` is None without speculative decoding, else e.g. "EAGLE".
    """

    sglang_version: str
    architectures: tuple
    is_mla: bool
    kv_lora_rank: Optional[int]
    qk_rope_head_dim: Optional[int]
    num_attention_heads: int
    attn_tp_size: int = 1
    page_size: int = 1
    kv_cache_dtype: str = "bfloat16"
    spec_algorithm: Optional[str] = None
    num_draft_tokens: Optional[int] = None
    eagle_topk: Optional[int] = None
    draft_attention_backend: Optional[str] = None
    prefill_attention_backend: Optional[str] = "mlagen"
    decode_attention_backend: Optional[str] = "mlagen"
    speculative_attention_mode: str = "prefill"  # --speculative-attention-mode: which backend verifies
    is_draft_worker: bool = False
    uses_sparse_attention: bool = False
    dcp_size: int = 1
    kv_pool_translating: bool = False
    device_arch: Optional[str] = None  # "sm_90" / "sm_120" when known

    @property
    def heads_per_rank(self) -> int:
        return self.num_attention_heads // max(1, self.attn_tp_size)

    @property
    def speculative(self) -> bool:
        return self.spec_algorithm is not None

    @property
    def verify_backend(self) -> Optional[str]:
        """The backend SGLang routes target verify to (HybridAttnBackend: the decode backend under
        --speculative-attention-mode decode, else the prefill backend)."""
        return (self.decode_attention_backend if self.speculative_attention_mode == "decode"
                else self.prefill_attention_backend)

    @property
    def serves_verify(self) -> bool:
        """Speculative decoding with target verify routed to mlagen."""
        return self.speculative and self.verify_backend == "mlagen"


@dataclasses.dataclass
class Selection:
    """Installed entries the backend will load: ``verify`` for TARGET_VERIFY (None without
    speculative decoding), ``decode`` for plain decode (None: SGLang's Triton decode)."""

    verify: Optional[dict]
    decode: Optional[dict]
    notes: list


def _version_tuple(v: str) -> tuple:
    """(major, minor, micro) of a PEP 440-ish version; ``.postN``/``+local`` are ignored,
    pre-releases (``rc``, ``dev``, ``a``, ``b``) count as the release they precede minus one step."""
    m = re.match(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(.*)$", str(v))
    if not m:
        raise MlagenSetupError(f"mlagen: cannot parse the SGLang version {v!r}")
    nums = tuple(int(x or 0) for x in m.group(1, 2, 3))
    rest = m.group(4).lower()
    pre = bool(re.match(r"^[.\-_]?(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", rest))
    return nums + ((-1,) if pre else (0,))


def check_sglang_version(version: str) -> None:
    """Check that ``version`` is inside :data:`SUPPORTED_SGLANG_RANGE` (pre-releases of the first unsupported
    release are outside it).

    Raises:
        MlagenSetupError: the version is unparsable or outside the range.
    """
    t = _version_tuple(version)
    # Pre-releases of the first unsupported release are unsupported too (compare releases only).
    if not (_version_tuple(SGLANG_MIN_VERSION) <= t and t[:3] < _version_tuple(SGLANG_MAX_VERSION_EXCLUSIVE)[:3]):
        raise MlagenSetupError(
            f"mlagen: SGLang {version} is not supported; the mlagen attention backend supports "
            f"sglang{SUPPORTED_SGLANG_RANGE}. Install a supported release, e.g. "
            f"`pip install sglang==0.5.23`, or use another --attention-backend."
        )


def check_model(f: ServerFacts) -> None:
    """Check that the model / server layout is one the backend can serve.

    Raises:
        MlagenSetupError: a draft worker, a model without MLA attention or with sparse attention (index_topk), no
            kv_lora_rank / qk_rope_head_dim, a KV cache dtype other than bf16 / fp8 e4m3, decode context
            parallelism, a translating KV pool, heads that do not split over attention TP, or (speculative) an
            unsupported algorithm or a draft-token count outside [1, 64].
    """
    if f.is_draft_worker:
        raise MlagenSetupError(
            "mlagen: the mlagen backend serves the target model only; the draft model needs its own "
            "backend: pass --speculative-draft-attention-backend triton (or flashinfer / fa3)."
        )
    archs = tuple(f.architectures or ())
    if not f.is_mla:
        raise MlagenSetupError(
            f"mlagen: model architecture {list(archs)} does not run SGLang's MLA attention (mlagen serves "
            f"MLA models such as {', '.join(TESTED_ARCHITECTURES)}); use another --attention-backend."
        )
    if f.uses_sparse_attention:
        raise MlagenSetupError(
            "mlagen: this checkpoint uses DeepSeek sparse attention (index_topk); mlagen kernels are "
            "dense MLA. Use --attention-backend dsa."
        )
    if f.kv_lora_rank is None or f.qk_rope_head_dim is None:
        raise MlagenSetupError("mlagen: the model config has no kv_lora_rank / qk_rope_head_dim (not MLA)")
    if server_kv_dtype(f) is None:
        raise MlagenSetupError(
            f"mlagen: KV cache dtype {f.kv_cache_dtype} is not supported; mlagen kernels read a bf16 or an "
            f"fp8 e4m3 KV cache. Use --kv-cache-dtype auto (bf16 models), bfloat16 or fp8_e4m3."
        )
    if f.dcp_size > 1:
        raise MlagenSetupError("mlagen: decode context parallelism (--dcp-size > 1) is not supported")
    if f.kv_pool_translating:
        raise MlagenSetupError(
            "mlagen: this server uses a translating (unified / hybrid) KV pool; mlagen reads "
            "req_to_token slot ids directly and supports only the plain MLA KV pool."
        )
    if f.num_attention_heads % max(1, f.attn_tp_size):
        raise MlagenSetupError(
            f"mlagen: {f.num_attention_heads} attention heads do not split over attention TP {f.attn_tp_size}"
        )
    if f.speculative:
        if str(f.spec_algorithm).upper() not in SUPPORTED_SPEC_ALGORITHMS:
            raise MlagenSetupError(
                f"mlagen: speculative algorithm {f.spec_algorithm} is not supported "
                f"(supported: {', '.join(SUPPORTED_SPEC_ALGORITHMS)})."
            )
        if not f.num_draft_tokens or f.num_draft_tokens < 1:
            raise MlagenSetupError("mlagen: speculative decoding needs --speculative-num-draft-tokens >= 1")
        if f.num_draft_tokens > MAX_TREE_DRAFT_TOKENS:
            raise MlagenSetupError(
                f"mlagen: {f.num_draft_tokens} draft tokens exceed the kernel's tree-mask limit of "
                f"{MAX_TREE_DRAFT_TOKENS}."
            )


def _describe(e: dict) -> str:
    return (f"{e.get('uri')} (role={e.get('role')}, heads={e.get('heads')}, q_len={e.get('q_len')}, "
            f"page_size={e.get('page_size')}, kv_lora_rank={e.get('kv_lora_rank')}, "
            f"qk_rope_head_dim={e.get('qk_rope_head_dim')}, mask={e.get('mask')}, kv_dtype={e.get('kv_dtype', 'bf16')})")


def _mismatches(e: dict, f: ServerFacts, q_len_needed: int, masks_ok: tuple) -> list:
    out = []
    if e["heads"] != f.heads_per_rank:
        out.append(f"heads_per_rank {e['heads']} != {f.heads_per_rank}")
    if e["kv_lora_rank"] != f.kv_lora_rank:
        out.append(f"kv_lora_rank {e['kv_lora_rank']} != {f.kv_lora_rank}")
    if e["qk_rope_head_dim"] != f.qk_rope_head_dim:
        out.append(f"qk_rope_head_dim {e['qk_rope_head_dim']} != {f.qk_rope_head_dim}")
    if e["page_size"] != f.page_size:
        out.append(f"page_size {e['page_size']} != {f.page_size}")
    if e["q_len"] < q_len_needed:
        out.append(f"q_len {e['q_len']} < {q_len_needed} draft tokens")
    if e["mask"] not in masks_ok:
        out.append(f"mask {e['mask']!r} not in {list(masks_ok)}")
    want = server_kv_dtype(f)
    if e.get("kv_dtype", "bf16") != want:
        out.append(f"KV cache dtype {e.get('kv_dtype', 'bf16')} != {want} (--kv-cache-dtype {f.kv_cache_dtype})")
    return out


def _build_hint(f: ServerFacts, role: str, q_len: int, mask: str) -> str:
    return (
        f"Build and install a {role} variant with heads_per_rank: {f.heads_per_rank}, q_len: {q_len}, "
        f"page_size: {f.page_size}, kv_lora_rank: {f.kv_lora_rank}, qk_rope_head_dim: {f.qk_rope_head_dim}, "
        f"mask: {mask}{', dtype: fp8_e4m3' if server_kv_dtype(f) == 'fp8_e4m3' else ''} "
        f"(`mlagen build SPEC.yaml`, then `mlagen install SPEC.yaml` or `mlagen install --uri URI`)."
    )


def _pick(entries: list, f: ServerFacts, role: str, q_len_needed: int, masks_ok: tuple,
          hint_mask: str) -> dict:
    cands = [e for e in entries if e["role"] == role]
    good = [e for e in cands if not _mismatches(e, f, q_len_needed, masks_ok)]
    if good:
        # Exact q_len first, then the cheaper mask (order of masks_ok), then install order.
        return min(good, key=lambda e: (e["q_len"] != q_len_needed, masks_ok.index(e["mask"]), e["q_len"]))
    lines = [f"  - {_describe(e)}: " + "; ".join(_mismatches(e, f, q_len_needed, masks_ok)) for e in cands]
    installed = "\n".join(lines) if lines else f"  (no {role} variant is installed)"
    raise MlagenSetupError(
        f"mlagen: no installed {role} variant matches this server (heads_per_rank={f.heads_per_rank}, "
        f"page_size={f.page_size}, kv_lora_rank={f.kv_lora_rank}, qk_rope_head_dim={f.qk_rope_head_dim}, "
        f"q_len>={q_len_needed}, mask in {list(masks_ok)}). Installed {role} variants:\n{installed}\n"
        + _build_hint(f, role, q_len_needed, hint_mask)
    )


def select_entries(state: Optional[dict], f: ServerFacts) -> Selection:
    """Choose the installed entries for this server, or raise :class:`MlagenSetupError`.

    Verify (speculative runs whose target verify SGLang routes to mlagen): heads/page_size/kv_lora_rank/rope must match, q_len >= draft
    tokens, mask 'tree' when the draft is a tree (topk > 1), 'causal' or 'tree' for a chain.
    Decode: optional; when decode entries are installed one of them must match.
    """
    notes = []
    archs = tuple(f.architectures or ())
    if archs and not any(a in TESTED_ARCHITECTURES for a in archs):
        notes.append(f"architecture {list(archs)} runs SGLang's MLA attention but is not among the tested "
                     f"{', '.join(TESTED_ARCHITECTURES)}; served by the installed variants that match it")
    if f.speculative and not f.draft_attention_backend:
        notes.append("no --speculative-draft-attention-backend: SGLang gives the draft model its default "
                     "draft backend (mlagen is not a draft backend)")
    if f.speculative and not f.serves_verify:
        notes.append(f"target verify runs on {f.verify_backend} (--speculative-attention-mode "
                     f"{f.speculative_attention_mode}); mlagen serves the modes routed to it")
    if state is None or not state.get("entries"):
        if f.serves_verify:
            q = int(f.num_draft_tokens or 1)
            raise MlagenSetupError(
                "mlagen: no mlagen kernels are installed (installed.json missing or empty). "
                + _build_hint(f, "verify", q, "tree" if (f.eagle_topk or 1) > 1 else "causal")
            )
        raise MlagenSetupError(
            "mlagen: no mlagen kernels are installed (installed.json missing or empty). "
            + _build_hint(f, "decode", 1, "causal")
        )
    if f.device_arch and state.get("arch") and state["arch"] != f.device_arch:
        raise MlagenSetupError(
            f"mlagen: installed kernels are for {state['arch']} but this GPU is {f.device_arch}; "
            f"rebuild for {f.device_arch} and install again."
        )
    entries = state["entries"]
    verify = None
    if f.serves_verify:
        q = int(f.num_draft_tokens)
        tree = (f.eagle_topk or 1) > 1
        masks_ok = ("tree",) if tree else ("causal", "tree")
        verify = _pick(entries, f, "verify", q, masks_ok, "tree" if tree else "causal")
    decode = None
    if any(e["role"] == "decode" for e in entries):
        decode = _pick(entries, f, "decode", 1, ("causal", "none", "tree"), "causal")
    elif f.speculative:
        notes.append("no decode variant installed: non-speculative decode batches run SGLang's Triton kernel")
    if not f.serves_verify and decode is None and not f.speculative:
        raise MlagenSetupError(
            "mlagen: without speculative decoding mlagen only serves decode, and no decode variant is "
            "installed. " + _build_hint(f, "decode", 1, "causal")
        )
    return Selection(verify=verify, decode=decode, notes=notes)


def run_startup_checks(f: ServerFacts, state: Optional[dict]) -> Selection:
    """All checks in order (version, model, installed variants); returns the selection.

    Raises:
        MlagenSetupError: the first failed check (:func:`check_sglang_version`, :func:`check_model`,
            :func:`select_entries`).
    """
    check_sglang_version(f.sglang_version)
    check_model(f)
    return select_entries(state, f)
