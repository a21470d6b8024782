"""The ``mlagen`` attention backend for SGLang (MLA models, absorbed path).

TARGET_VERIFY runs the installed mlagen verify kernel; DECODE (no speculative info) runs the
installed q_len=1 variant when there is one; every other mode (prefill, extend, draft extend,
idle, and decode without a decode variant) goes to a private ``TritonAttnBackend`` built from the
same model runner, so the server is complete.

Shapes in the verify path (T = bs * q_len tokens, H = heads per rank):
    q  [T, H, 576] bf16 = absorbed q_nope (512) + q_pe (64), as DeepSeek's MLA code passes it to
       RadixAttention for backends outside FORWARD_ABSORB_CORE_ATTENTION_BACKENDS;
    k  [T, 1, 576], v [T, 1, 512] (written to the MLA KV pool at out_cache_loc first);
    KV pool rows [num_slots, 1, 576] bf16, or e4m3 bytes (uint8 storage read as float8_e4m3fn) for
       --kv-cache-dtype fp8_e4m3, served by dtype fp8_e4m3 variants; V = the first 512 dims;
    out [T, H * 512] bf16.
SGLang's verify seq_lens exclude the draft tokens, whose slots sit at req_to_token positions
seq_len .. seq_len + q_len - 1 (see EagleVerifyInput.generate_attn_arg_prefill), so the kernel's
kv_lens = seq_lens + q_len.

CUDA graphs (SGLang 0.5.22+ API): ``init_cuda_graph_state`` allocates every buffer for the
largest captured batch; ``init_forward_metadata_out_graph`` (run eagerly before capture and
before every replay) refills kv_lens / block table / tree bitmasks in place, zeroing the
``num_padding`` padded rows' kv_len so they output 0. The captured kernels only read these
private buffers, never req_to_token or the scheduler's seq_lens.

Host time per step: eager steps launch nothing before the kernel when its module has ``run_direct``:
the kernel reads SGLang's seq_lens, req_pool_indices, req_to_token and QLEN_ONLY custom mask itself
(include/mlagen/mla_verify_batch.cuh; a FULL_MASK custom mask or other layouts take the buffers below).
Every layer's launch reads them then (the metadata launch read them once, before the first layer), so they
must not change during the step's forward pass; SGLang updates them only after it, in stream order.
Otherwise, and for CUDA graphs, a kernel whose module has ``fill_metadata`` fills kv_lens / block table /
tree bitmasks in one launch (include/mlagen/mla_verify_metadata.cuh) instead of ~20 small torch ops
(the helpers in ``metadata.py``, still the CPU path); eager steps reuse persistent buffers (grown
when a larger batch / page count arrives; same-stream ordering makes reuse safe), and
``check_batch`` runs only when the tensors it validates change (pointers, shapes, strides, q_len,
workspace), not every step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

import torch

from mlagen.ops import INDEX_DTYPES
from mlagen.sglang_plugin import metadata as md
from mlagen.sglang_plugin.checks import MlagenSetupError, ServerFacts, run_startup_checks
from mlagen.sglang_plugin.installed import read_installed

logger = logging.getLogger(__name__)

try:  # SGLang is an optional dependency of mlagen; the factory below requires it.
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as _Base
except Exception:  # pragma: no cover - exercised only without a working SGLang
    _Base = object

BACKEND_NAME = "mlagen"


@dataclasses.dataclass
class MlagenMetadata:
    """Per-forward inputs of the mlagen kernel (tensors may be views of graph buffers)."""

    kind: str  # "verify" | "decode"
    kernel: Any  # mlagen.ops.VerifyKernel
    q_len: int
    kv_lens: Optional[torch.Tensor]  # int32 [bs]; None in a direct eager step (batch.direct)
    block_table: Optional[torch.Tensor]  # int32 [bs, >= pages]; None in a direct eager step
    tree_mask: Optional[torch.Tensor]  # int64 [bs, q_len] or None
    workspace: torch.Tensor  # fp32 1-D
    batch: Any = None  # mlagen.ops.VerifyBatch: the above, validated once for every layer's launch
    dims: tuple = ()  # the kernel's (heads, dim_qk, dim_v), read once per step instead of per layer
    new_kv: bool = False  # the kernel's module takes the step's draft rows (has_new_kv), read once per kernel

    @classmethod
    def _direct(cls, kind, kernel, q_len, workspace, batch, dims, new_kv) -> "MlagenMetadata":
        """The metadata of a direct eager step (no kv_lens / block_table / tree_mask buffers): the instance the
        constructor builds, without its keyword handling (part of a step's host time)."""
        m = object.__new__(cls)
        m.__dict__.update(kind=kind, kernel=kernel, q_len=q_len, kv_lens=None, block_table=None, tree_mask=None,
                          workspace=workspace, batch=batch, dims=dims, new_kv=new_kv)
        return m


class MlagenAttnBackend(_Base):
    """See the module docstring. Attributes not defined here resolve on the Triton fallback."""

    needs_cpu_seq_lens = False  # never reads seq_lens_cpu / seq_lens_sum (same as Triton)
    extend_dummy_seqs_capped_by_req_pool = True  # extend runs on Triton's req-pool sized buffers

    def __init__(self, model_runner, verify_kernel=None, decode_kernel=None, fallback=None,
                 verify_q_len: Optional[int] = None):
        """
        Args:
            model_runner: SGLang ModelRunner (or a stand-in with req_to_token_pool,
                token_to_kv_pool, page_size, device, model_config.context_len, kv_index_translator).
            verify_kernel / decode_kernel: loaded mlagen kernels (``mlagen.ops.VerifyKernel``) or None.
            fallback: the backend for every other mode (default: ``TritonAttnBackend(model_runner)``).
            verify_q_len: draft tokens per request (--speculative-num-draft-tokens); default: the
                Triton fallback's ``target_verify_num_tokens_per_req``.
        Raises:
            MlagenSetupError: with a verify kernel, verify_q_len outside [1, verify_kernel.variant.q_len].
        """
        super().__init__()
        if fallback is None:
            from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

            fallback = TritonAttnBackend(model_runner)
        self.fallback = fallback
        self.verify_kernel = verify_kernel
        self.decode_kernel = decode_kernel
        self.device = torch.device(model_runner.device)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)
        self.page_size = int(getattr(model_runner, "page_size", 1) or 1)
        self.max_context_len = model_runner.model_config.context_len
        self.verify_q_len = int(verify_q_len or getattr(fallback, "target_verify_num_tokens_per_req", 0) or 0)
        if verify_kernel is not None and not 1 <= self.verify_q_len <= verify_kernel.variant.q_len:
            raise MlagenSetupError(
                f"mlagen: {self.verify_q_len} draft tokens per request do not fit the verify variant "
                f"(q_len {verify_kernel.variant.q_len})")
        width = self.req_to_token.shape[1]
        self._cols = md.page_columns(width, self.page_size, self.device)
        self._causal = {}
        self._eager_ws = {}  # id(kernel) -> (kernel, workspace, largest bs it was checked for, smem cap then)
        self._eager = None  # persistent eager buffers: kv_lens [rows], block_table [rows, cols], tree [rows, q]
        self._plans = {}  # (kind, graph) -> the validated buffers, their MlagenMetadata and metadata filler
        self._direct_plans = {}  # (kind, bs, q_len) -> (kernel, its smem cap, kernel.direct_plan): eager steps
        self._kernel_info = {}  # id(kernel) -> (tree?, fused fill_metadata?, (heads, dim_qk, dim_v), kernel, run_direct?, has_new_kv?)
        self._kv_write_loc = None  # SGLang's KVWriteLoc, imported on the first KV write
        self._kv_checked = {}  # layer_id -> data_ptr of the KV pool buffer check_kv_cache accepted
        self._pool_write_ok = None  # whether the kernel may store the draft rows itself (see _kernel_writes_kv)
        self._layers = {}  # id(layer) -> _layer_consts entry (per-layer constants, read once)
        self._loc_ok = (None, 0, False)  # (out_cache_loc, T, whether it passed _new_kv's checks): once per step
        self._graph = None
        self._graph_dims = None
        self._fallback_graph_ready = False
        self._verify_mask = None
        self.forward_metadata: Optional[MlagenMetadata] = None
        # eager steps let the kernel read SGLang's batch state itself (no metadata launch), when it can
        self.direct_eager = True

    # ---------------------------------------------------------------- helpers
    def __getattr__(self, name):
        # Only called for attributes missing on self: delegate Triton-specific ones
        # (extend_attention_block_m, num_draft_tokens, ...) to the fallback.
        fb = self.__dict__.get("fallback")
        if fb is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(fb, name)

    def _kind(self, forward_batch) -> Optional[str]:
        mode = forward_batch.forward_mode
        if self.verify_kernel is not None and mode.is_target_verify():
            return "verify"
        if (self.decode_kernel is not None and mode.is_decode()
                and getattr(forward_batch, "spec_info", None) is None):
            return "decode"
        return None

    def _q_len(self, kind: str, spec_info) -> int:
        if kind == "decode":
            return 1
        n = getattr(spec_info, "num_tokens_per_req", -1) if spec_info is not None else -1
        return int(n) if n and n > 0 else self.verify_q_len

    def _causal_bits(self, q_len: int) -> torch.Tensor:
        """Causal tree rows int64 [q_len] (row i: bits 0..i) on req_to_token's device (with its index: a direct
        batch hands them to the kernel as they are)."""
        if q_len not in self._causal:
            self._causal[q_len] = md.causal_bits(q_len, self.req_to_token.device)
        return self._causal[q_len]

    def _eager_workspace(self, kernel, bs: int) -> torch.Tensor:
        """The kernel's eager workspace, grown for ``bs``. ``workspace_numel`` covers every batch size up
        to its argument (non-decreasing in bs), so a size up to the largest one checked needs no new
        look-up until the kernel's shared-memory cap (its split counts) changes."""
        cap = getattr(kernel, "smem_per_sm_cap", None)
        ent = self._eager_ws.get(id(kernel))
        if ent is not None and ent[0] is kernel and bs <= ent[2] and ent[3] == cap:
            return ent[1]
        ws = ent[1] if ent is not None and ent[0] is kernel else None
        if ws is None or ws.numel() < kernel.workspace_numel(bs, self.device):
            ws = kernel.alloc_workspace(bs, self.device)
            self._direct_plans.clear()  # plans of the old workspace: do not keep it alive
        self._eager_ws[id(kernel)] = (kernel, ws, bs, cap)  # reached only for a bs past the checked one (or a new cap)
        return ws

    def _info(self, kernel) -> tuple:
        """(tree variant?, fused ``fill_metadata`` available?, (heads, dim_qk, dim_v), the kernel, ``run_direct``
        available?, draft-row store (``has_new_kv``) available?) of a kernel, read once. Stand-in kernels (CPU
        tests) have none of the three unless they say so."""
        info = self._kernel_info.get(id(kernel))
        if info is None or info[3] is not kernel:
            v = kernel.variant
            info = (v.mask == "tree", bool(getattr(kernel, "has_fill_metadata", False)),
                    (getattr(v, "heads", None), getattr(v, "dim_qk", None), getattr(v, "dim_v", None)), kernel,
                    bool(getattr(kernel, "has_direct", False)), bool(getattr(kernel, "has_new_kv", False)))
            self._kernel_info[id(kernel)] = info
        return info

    def _direct_plan(self, kind: str, kernel, bs: int, q_len: int):
        """``kernel.direct_plan`` of req_to_token and the eager workspace for bs rows, kept per (kind, bs,
        q_len) (eager batch sizes vary step to step) and rebuilt when the kernel or its shared-memory cap (its
        split count) changes; all are dropped when the eager workspace is reallocated or another kernel takes a
        kind (the old kernel's plans would keep it and its workspace alive)."""
        cap = getattr(kernel, "smem_per_sm_cap", None)
        key = (kind, bs, q_len)
        p = self._direct_plans.get(key)
        if p is not None:
            if p[0] is kernel and p[1] == cap:
                return p[2]
            if p[0] is not kernel:
                self._direct_plans.clear()
        ws = self._eager_workspace(kernel, bs)
        plan = kernel.direct_plan(self.req_to_token, q_len=q_len, batch_size=bs, workspace=ws)
        self._direct_plans[key] = (kernel, cap, plan)
        return plan

    def _eager_buffers(self, bs: int, npages: int, q_len: int) -> dict:
        """Persistent eager buffers with >= bs rows, >= npages block-table columns and >= q_len tree
        columns; grown (rows and columns doubled, columns capped at the table's page count) when a
        batch needs more. Reuse is safe: every reader of a step's slices runs on the stream before
        the next step's fill."""
        e = self._eager
        if (e is not None and bs <= e["rows"] and npages <= e["block_table"].shape[1]
                and q_len <= e["tree"].shape[1]):
            return e
        full = -(-self.req_to_token.shape[1] // self.page_size)
        rows, cols, qc = bs, npages, max(q_len, 1)
        if e is not None:
            rows = max(bs, 2 * e["rows"]) if bs > e["rows"] else e["rows"]
            old = e["block_table"].shape[1]
            cols = max(npages, min(full, 2 * old)) if npages > old else old
            qc = max(qc, e["tree"].shape[1])
        dev = self.device
        self._eager = e = {
            "rows": rows,
            "kv_lens": torch.zeros(rows, dtype=torch.int32, device=dev),
            "block_table": torch.zeros(rows, cols, dtype=torch.int32, device=dev),
            "tree": torch.zeros(rows, qc, dtype=torch.int64, device=dev),
            "views": {},  # (bs, q_len) -> (kv_lens[:bs], block_table[:bs], tree[:bs, :q_len] or None)
        }
        return e

    def _eager_views(self, bs: int, npages: int, q_len: int) -> tuple:
        """(kv_lens, block_table, tree) views of the persistent eager buffers for a batch of bs rows (the
        block table at its full width: the kernel reads ceil(kv_len / page_size) <= npages columns, the
        metadata fill writes npages), built once per (bs, q_len) while the buffers stay the same."""
        e = self._eager_buffers(bs, npages, q_len)
        views = e["views"].get((bs, q_len))
        if views is None:
            views = e["views"][(bs, q_len)] = (e["kv_lens"][:bs], e["block_table"][:bs],
                                               e["tree"][:bs, :q_len] if q_len else None)
        return views

    def _plan(self, kind: str, graph: bool, kernel, kv_lens, table, q_len: int, tree, ws, fused: bool, dims: tuple):
        """(the step's :class:`MlagenMetadata`, a :class:`mlagen.ops.MetadataFill` of these buffers or None) for
        ``kernel.check_batch`` of these tensors, rebuilt only when one of the validated inputs changes: other
        buffer objects (the views are cached while their buffers live, and the plan holds them, so identity
        means the same pointers, shapes and strides), q_len, or the kernel's shared-memory cap (its split count)."""
        cap = getattr(kernel, "smem_per_sm_cap", None)
        slot = (kind, graph)
        p = self._plans.get(slot)
        if (p is not None and p[0] is kernel and p[1] is kv_lens and p[2] is table and p[3] is tree and p[4] is ws
                and p[5] == q_len and p[6] == cap):
            return p[7], p[8]
        batch = kernel.check_batch(kv_lens, table, q_len=q_len, tree_mask=tree, workspace=ws)
        meta = MlagenMetadata(kind=kind, kernel=kernel, q_len=q_len, kv_lens=kv_lens, block_table=table,
                              tree_mask=tree, workspace=ws, batch=batch, dims=dims, new_kv=self._info(kernel)[5])
        filler = (kernel.metadata_filler(kv_lens, table, self.req_to_token, tree_mask=tree, page_size=self.page_size)
                  if fused and kv_lens.is_cuda else None)
        self._plans[slot] = (kernel, kv_lens, table, tree, ws, q_len, cap, meta, filler)
        return meta, filler

    def _graph_views(self, bs: int, q_len: int, kind: str) -> tuple:
        """(kv_lens, block_table, tree or None, workspace) views of the CUDA-graph buffers for a batch of bs
        rows (q_len 0: no tree), built once per (bs, q_len, kind) while the buffers stay the same."""
        g = self._graph
        views = g.setdefault("views", {})
        key = (bs, q_len, kind)
        v = views.get(key)
        if v is None:
            v = views[key] = (g["kv_lens"][:bs], g["block_table"][:bs], g["tree"][:bs, :q_len] if q_len else None,
                              g["ws_verify"] if kind == "verify" else g["ws_decode"])
        return v

    def _num_pages(self, forward_batch, bs: int, extra: int, graph: bool, in_capture: bool) -> int:
        """Block-table columns to refresh, from host values only (no device sync): SGLang's
        ``max_seq_len_host`` (speculative decode), else the max of ``seq_lens_cpu`` (plain decode and
        most batches), else ``seq_lens_sum`` (an upper bound of the max), else the whole table
        (also during capture)."""
        width = self.req_to_token.shape[1]
        tokens = width
        if not in_capture:
            m = getattr(forward_batch, "max_seq_len_host", None)
            cpu = getattr(forward_batch, "seq_lens_cpu", None)
            total = getattr(forward_batch, "seq_lens_sum", None)
            if m is None and cpu is not None and bs > 0 and not cpu.is_cuda:
                m = max(cpu.tolist()[:bs])  # a Python list: ~1 µs at bs 4, against ~7 for a torch max + int()
            if m is None and isinstance(total, int) and total > 0:
                m = total
            if m is not None:
                tokens = int(m) + extra + self.page_size
        tokens = max(1, min(width, tokens))
        return -(-tokens // self.page_size)

    @staticmethod
    def _num_padding(forward_batch, bs: int) -> int:
        """Padded rows at the end of the batch: the replay view's ``num_padding``; in an eager batch
        padded for DP attention (``prepare_mlp_sync_batch``: req_pool_indices 0, seq_len 1, no
        spec-info rows), the rows past ``_original_batch_size``."""
        npad = int(getattr(forward_batch, "num_padding", 0) or 0)
        orig = getattr(forward_batch, "_original_batch_size", None)
        if not npad and isinstance(orig, int) and not isinstance(orig, bool) and 0 <= orig < bs:
            npad = bs - orig
        return npad

    def _is_qlen_only(self, custom: torch.Tensor, real: int, q_len: int) -> bool:
        """Whether the verify input's custom mask has the QLEN_ONLY layout this backend asks for (its
        verify-mask buffer, or SGLang's own allocation of exactly real * q * q cells for a batch past
        the buffer); else it is SGLang's FULL_MASK layout (q * (seq_len + q) cells per request, always more)."""
        vm = self._verify_mask
        return bool((vm is not None and vm.buffer.numel() and custom.data_ptr() == vm.buffer.data_ptr())
                    or custom.numel() == real * q_len * q_len)

    def _pack_tree(self, custom: torch.Tensor, seq_lens: torch.Tensor, real: int, q_len: int) -> torch.Tensor:
        """Tree bitmasks of the ``real`` requests from the verify input's custom mask (torch helpers;
        layout from :meth:`_is_qlen_only`)."""
        if self._is_qlen_only(custom, real, q_len):
            return md.pack_qlen_mask(custom, real, q_len)
        return md.pack_full_mask(custom, seq_lens, q_len)

    def _prepare(self, forward_batch, kind: str, graph: bool, in_capture: bool = False,
                 direct: bool = True) -> MlagenMetadata:
        """The step's metadata. CUDA graphs: the graph buffers, refilled (the fused fill launch or the torch
        helpers). Eager: with a kernel that has ``run_direct`` and SGLang's tensors in the layouts it reads
        (int32 / int64 contiguous seq_lens and req_pool_indices on the GPU; no custom mask, or a QLEN_ONLY one),
        nothing is launched: the kernel reads them itself (:meth:`mlagen.ops.VerifyKernel.direct_batch`); else
        the persistent eager buffers, filled as for graphs. ``direct=False`` forces the buffers."""
        kernel = self.verify_kernel if kind == "verify" else self.decode_kernel
        is_tree, fused, dims, _, has_direct, new_kv = self._info(kernel)
        spec_info = getattr(forward_batch, "spec_info", None)
        q_len = self._q_len(kind, spec_info)
        rpi = forward_batch.req_pool_indices
        bs = int(rpi.shape[0])
        seq_lens = forward_batch.seq_lens
        if seq_lens.shape[0] != bs:
            seq_lens = seq_lens[:bs]
        real = bs - self._num_padding(forward_batch, bs)
        npad = bs - real
        extra = q_len if kind == "verify" else 0
        # The step's tree rows: SGLang's custom mask (QLEN_ONLY or FULL_MASK layout), or causal rows for decode,
        # a batch without a custom mask (SGLang then runs the drafts causally) and capture.
        mode, custom = None, None
        if is_tree:
            custom = getattr(spec_info, "custom_mask", None) if kind == "verify" else None
            if kind == "decode" or custom is None or in_capture:
                mode, custom = "causal", None
            else:
                mode = "qlen_only" if self._is_qlen_only(custom, real, q_len) else "full_mask"
        # The layouts the kernels read (the fused fill's and run_direct's own checks, made once here).
        layout_ok = (rpi.dtype in INDEX_DTYPES and seq_lens.dtype in INDEX_DTYPES and rpi.is_contiguous()
                     and seq_lens.is_contiguous()
                     and (custom is None or (custom.dtype in (torch.bool, torch.uint8) and custom.is_contiguous())))
        dev = self.req_to_token.device  # with its index (self.device may be "cuda" without one)
        if (direct and has_direct and self.direct_eager and not graph and layout_ok and rpi.device == dev
                and seq_lens.device == dev and (custom is None or custom.device == dev)
                and (mode != "full_mask" or real == 0)):  # FULL_MASK: the buffers
            qlen_mask = custom if mode == "qlen_only" and real > 0 else None
            # causal rows, also when every row is padding (no row reads them then)
            tree_rows = self._causal_bits(q_len) if is_tree and qlen_mask is None else None
            plan = self._direct_plan(kind, kernel, bs, q_len)
            batch = kernel.direct_batch(plan, seq_lens, rpi, extra=extra, num_padding=npad, qlen_mask=qlen_mask,
                                        tree_rows=tree_rows, checked=False)
            return MlagenMetadata._direct(kind, kernel, q_len, plan.workspace, batch, dims, new_kv)
        npages = self._num_pages(forward_batch, bs, extra, graph, in_capture)
        if graph:
            g = self._graph
            if bs > g["kv_lens"].shape[0]:
                raise RuntimeError(f"mlagen: graph batch {bs} exceeds the captured max {g['kv_lens'].shape[0]}")
            if is_tree and q_len > g["tree"].shape[1]:  # before the fill writes past the buffer's rows
                raise RuntimeError(f"mlagen: graph batch of {q_len} draft tokens per request exceeds the "
                                   f"{g['tree'].shape[1]} the CUDA-graph buffers were sized for")
            kv_lens, table, tree, ws = self._graph_views(bs, q_len if is_tree else 0, kind)
        else:  # views of persistent buffers: no allocation per step
            # The kernel reads ceil(kv_len / page_size) <= npages columns: the batch is checked on the
            # buffer's full width, so a step whose page count moved (every step at page_size 1) hits the cache.
            kv_lens, table, tree = self._eager_views(bs, npages, q_len if is_tree else 0)
            ws = self._eager_workspace(kernel, bs)
        meta, filler = self._plan(kind, graph, kernel, kv_lens, table, q_len, tree, ws, fused, dims)

        if (filler is not None and rpi.is_cuda and seq_lens.is_cuda and (custom is None or custom.is_cuda)
                and layout_ok):
            # the fused fill writes npages columns of the full-width table
            filler.launch(seq_lens, rpi, extra=extra, num_padding=npad, npages=npages, q_len=q_len, tree_mode=mode,
                          custom_mask=custom)
        else:  # the torch helpers (CPU, stand-in kernels, modules built before fill_metadata, other masks)
            md.fill_kv_lens(kv_lens, seq_lens, extra, npad)
            md.fill_block_table(table[:, :npages], self.req_to_token, rpi, self._cols[:npages], self.page_size)
            if mode == "causal":
                tree.copy_(self._causal_bits(q_len).expand(bs, q_len))
            elif mode is not None:
                if real > 0:
                    tree[:real].copy_(self._pack_tree(custom, seq_lens[:real], real, q_len))
                if npad > 0:
                    tree[real:bs].zero_()
        return meta

    # ---------------------------------------------------------------- metadata API
    def init_forward_metadata(self, forward_batch):
        """Eager metadata (no CUDA graph) of a TARGET_VERIFY batch (verify kernel) or a plain decode batch (decode
        kernel); any other batch gets the Triton fallback's metadata (``forward_metadata`` None).

        By default (``direct_eager``) a kernel whose module has ``run_direct`` reads SGLang's seq_lens,
        req_pool_indices, req_to_token and QLEN_ONLY custom mask itself: nothing is launched and no buffer is
        filled here, only :meth:`mlagen.ops.VerifyKernel.direct_plan` (kept per (kind, bs, q_len)) and
        ``direct_batch``. Otherwise (a module without ``run_direct``, a FULL_MASK custom mask, other index layouts
        or devices) the persistent eager buffers are filled (the fused ``fill_metadata`` launch or the torch
        helpers of ``metadata.py``) and checked by ``check_batch`` when they changed.

        Raises:
            ValueError: from ``direct_plan`` / ``direct_batch`` / ``check_batch`` or the fill (e.g. a req_to_token
                or workspace the kernel cannot take, a QLEN_ONLY mask too small for the batch).
            RuntimeError: the metadata fill launch failed.
        """
        kind = self._kind(forward_batch)
        if kind is None:
            self.forward_metadata = None
            self.fallback.init_forward_metadata(forward_batch)
            return
        self.forward_metadata = self._prepare(forward_batch, kind, graph=False)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, **kwargs):
        """Allocate the static buffers for batches up to ``max_bs`` requests."""
        width = self.req_to_token.shape[1]
        pages = -(-width // self.page_size)
        qmax = max(self.verify_q_len, 1)
        dev = self.device
        g = {
            "kv_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "block_table": torch.zeros(max_bs, pages, dtype=torch.int32, device=dev),
            "tree": torch.zeros(max_bs, qmax, dtype=torch.int64, device=dev),
            "ws_verify": None,
            "ws_decode": None,
        }
        if self.verify_kernel is not None:
            g["ws_verify"] = self.verify_kernel.alloc_workspace(max_bs, dev)
            self._verify_mask = self._make_verify_mask(max_bs)
        if self.decode_kernel is not None:
            g["ws_decode"] = self.decode_kernel.alloc_workspace(max_bs, dev)
        self._graph = g
        for slot in [s for s in self._plans if s[1] is True]:  # the old graph buffers' plans: do not keep them alive
            del self._plans[slot]
        self._graph_dims = (max_bs, max_num_tokens, kwargs)
        self._fallback_graph_ready = False

    def _ensure_fallback_graph_state(self):
        if not self._fallback_graph_ready and self._graph_dims is not None:
            max_bs, max_num_tokens, kwargs = self._graph_dims
            self.fallback.init_cuda_graph_state(max_bs, max_num_tokens, **kwargs)
            self._fallback_graph_ready = True

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Refill the graph buffers (runs eagerly before capture and before every replay): kv_lens, block table and
        tree bitmasks of an mlagen batch (causal rows during capture), the fallback's for any other batch.

        Raises:
            RuntimeError: the batch has more requests than the captured max_bs, or (tree variants) more draft
                tokens per request than the graph's tree buffer holds (``verify_q_len``); or the fill launch failed.
            ValueError: from ``check_batch`` of the graph buffers, or the fill (a QLEN_ONLY mask too small).
        """
        kind = self._kind(forward_batch)
        if kind is None:
            self.forward_metadata = None
            self._ensure_fallback_graph_state()
            self.fallback.init_forward_metadata_out_graph(forward_batch, in_capture)
            return
        self.forward_metadata = self._prepare(forward_batch, kind, graph=True, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Metadata work inside the captured region: none for mlagen's batches (their kernels read the graph
        buffers that :meth:`init_forward_metadata_out_graph` refills); the fallback's for any other batch."""
        if self._kind(forward_batch) is None:
            self.fallback.init_forward_metadata_in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self):
        """The seq_len SGLang gives padded CUDA-graph rows: the Triton fallback's value (mlagen's fill gives the
        ``num_padding`` rows kv_len 0 whatever their seq_len)."""
        return self.fallback.get_cuda_graph_seq_len_fill_value()

    def _make_verify_mask(self, max_bs: int):
        """SGLang's VerifyMask in the QLEN_ONLY layout (q x q cells per request: all the kernel reads;
        FULL_MASK would be q x (context + q) per request, filled every draft step). The draft stage
        writes the tree into it in place (chains: SGLang's build_chain_tree fast path); a batch past
        ``max_bs`` gets a fresh QLEN_ONLY mask of its own. ``is_read`` is False for causal variants,
        which never read it."""
        from sglang.srt.layers.attention import verify_mask as vm

        mode = vm.TreeMaskMode.QLEN_ONLY
        n = vm.tree_mask_numel(mode, max_bs, self.verify_q_len, self.max_context_len)
        return vm.VerifyMask(buffer=torch.zeros(n, dtype=torch.uint8, device=self.device), mode=mode,
                          max_bs=max_bs, is_read=self.verify_kernel.variant.mask == "tree")

    @property
    def verify_mask(self):
        """The verify mask the draft stage fills (see :meth:`_make_verify_mask`); before
        ``init_cuda_graph_state`` (no CUDA graphs) one without a buffer, so that every batch still
        gets a QLEN_ONLY mask."""
        if self.verify_kernel is None:
            return self.fallback.verify_mask
        if self._verify_mask is None:
            self._verify_mask = self._make_verify_mask(0)
        return self._verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        """A no-op, as in SGLang's Triton backend: nothing here is derived from the draft's tree before the step's
        metadata call reads it (CUDA graphs: the plan stream's load_batch, which SGLang 0.5.23's run_eagle_verify
        starts after ``plan_stream.wait_stream(fwd_stream)``; eager: at forward time, or the kernel reads the
        QLEN_ONLY mask at launch), so there is nothing to redo."""
        pass

    def on_after_cuda_graph_warmup(self):
        """SGLang's hook between the warm-up pass and the capture: forwarded to the Triton fallback (mlagen's graph
        buffers are refilled before every capture and replay, so nothing of its own needs undoing)."""
        self.fallback.on_after_cuda_graph_warmup()

    # ---------------------------------------------------------------- forward
    def _kernel_writes_kv(self) -> bool:
        """Whether the verify launch may take over SGLang's KV write (``MLATokenToKVPool.set_kv_buffer``):
        only for an MLA pool whose write door is that method (not a subclass's, e.g. the FP4 pool's), with
        bf16 storage or e4m3 stored as uint8 (fp8_e4m3 variants quantize the rows as its cast does), no
        DSA fp8 store, no physical-loc plan and no decode-context-parallel write
        translation, where the write is a plain row store of ``k`` at ``out_cache_loc``. Read once."""
        if self._pool_write_ok is None:
            pool = self.token_to_kv_pool
            ok = False
            try:
                from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

                # bf16 pool, or an e4m3 pool stored as uint8 (the launch quantizes as set_kv_buffer's cast does)
                dtypes = ((pool.dtype == torch.bfloat16 and getattr(pool, "store_dtype", None) == torch.bfloat16)
                          or (pool.dtype == torch.float8_e4m3fn and getattr(pool, "store_dtype", None) == torch.uint8))
                ok = (isinstance(pool, MLATokenToKVPool) and type(pool).set_kv_buffer is MLATokenToKVPool.set_kv_buffer
                      and not getattr(pool, "requires_physical_write_loc", False) and dtypes
                      and not getattr(pool, "dsa_kv_cache_store_fp8", False)
                      and int(pool._write_loc_dcp_span) == 1)
            except Exception:  # another SGLang layout: SGLang's own write
                ok = False
            self._pool_write_ok = ok
        return self._pool_write_ok

    def _layer_consts(self, layer) -> tuple:
        """(H, D, DV, k_descale, v_descale, softmax scale, layer id) of a RadixAttention layer, with its
        unsupported features refused, read once per layer (re-read when its scaling or KV scales change).

        Raises:
            NotImplementedError: logit capping or sliding-window attention.
            MlagenSetupError: KV scale tensors without loaded float scales (see :func:`kv_descales`).
        """
        d = layer.__dict__
        key = (d.get("scaling"), d.get("k_scale_float"), d.get("v_scale_float"))
        ent = self._layers.get(id(layer))
        if ent is not None and ent[0] is layer and ent[1] == key:
            return ent[2]
        if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
            raise NotImplementedError("mlagen backend: logit capping is not supported")
        if (getattr(layer, "sliding_window_size", -1) or -1) > 0:
            raise NotImplementedError("mlagen backend: sliding-window attention layers are not supported")
        k_descale, v_descale = kv_descales(layer)
        consts = (layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim, k_descale, v_descale,
                  float(layer.scaling) * k_descale, layer.layer_id)
        self._layers[id(layer)] = (layer, key, consts)
        return consts

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs) -> torch.Tensor:
        meta = self.forward_metadata
        if kwargs:
            unsupported = [n for n, x in kwargs.items() if x is not None]
            if unsupported:
                raise NotImplementedError(f"mlagen backend: unsupported attention arguments {unsupported}")
        H, D, DV, k_descale, v_descale, scale, layer_id = self._layer_consts(layer)
        kernel, batch = meta.kernel, meta.batch
        qs = q.shape
        qv = q if len(qs) == 3 and qs[1] == H and qs[2] == D else q.reshape(-1, H, D)  # [T, H, 576] as DeepSeek passes it
        if qv.stride(-1) != 1:
            qv = qv.contiguous()
        # DP attention pads a batch's tokens to a multiple of attn_tp_size (ForwardBatch.prepare_mlp_sync_batch,
        # then bs = num_tokens // q_len): rows past bs * q_len belong to no request; they output 0.
        rows = qv.shape[0]
        T = batch.bs * batch.q_len
        fast = (qv.dtype == torch.bfloat16 and rows >= T and (H, D, DV) == meta.dims
                and not (qv.stride(0) % 2 or qv.stride(1) % 2 or qv.data_ptr() % 4))
        new_kv = ()
        if save_kv_cache and k is not None:
            if k_descale != 1.0:
                k = k / layer.k_scale  # as SGLang's Triton backend stores it (a new tensor: k stays unchanged)
            # The launch stores this step's rows itself (include/mlagen/mla_verify_new_kv.cuh) and reads the
            # draft tokens from k: one launch instead of SGLang's write + ours.
            if fast and meta.new_kv:
                new_kv = self._new_kv(k, forward_batch, T, D)
            if not new_kv:
                KVWriteLoc = self._kv_write_loc
                if KVWriteLoc is None:
                    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

                    self._kv_write_loc = KVWriteLoc
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v)
        out = q.new_empty((rows, H * DV))  # the layout returned; the launch takes it 2-D (heads DV apart)
        kv = self.token_to_kv_pool.get_key_buffer(layer_id)
        kv_ptr = kv.data_ptr()
        checked = self._kv_checked.get(layer_id)
        if checked is None or checked[0] != kv_ptr:  # each layer's pool buffer, once
            kernel.check_kv_cache(kv)
            self._kv_checked[layer_id] = checked = (kv_ptr, kv.shape[0])
        if fast:
            # the batch was checked in init_forward_metadata*
            q_b, out_b = qv, out
            if rows > T:
                q_b, out_b = qv[:T], out[:T]
                out[T:].zero_()
            if new_kv:
                kernel.launch(batch, q_b, kv, out_b, scale, new_kv=new_kv + (checked[1],))
            else:
                kernel.launch(batch, q_b, kv, out_b, scale)
        else:  # the checked call: a clear ValueError for what does not fit
            if meta.kv_lens is None:  # a direct eager step: fill the eager buffers the checked call reads
                meta = self.forward_metadata = self._prepare(forward_batch, meta.kind, graph=False, direct=False)
            kernel(qv, kv, meta.block_table, meta.kv_lens, q_len=meta.q_len, softmax_scale=scale,
                   tree_mask=meta.tree_mask, out=out.view(rows, H, DV), workspace=meta.workspace)
        if v_descale != 1.0:
            out.mul_(v_descale)
        return out

    def _new_kv(self, k, forward_batch, T: int, D: int) -> tuple:
        """(k_new address, row stride, out_cache_loc address) when the launch can store ``k`` itself
        (the caller checked the module's draft-row support; the pool allows it, k is bf16 [>= T, (1,) D] with 16-byte
        aligned contiguous rows, out_cache_loc int64 [>= T] contiguous on k's device; the loc is checked
        once per step; only the first T = bs * q_len rows are read and stored); else () and SGLang writes."""
        if not (self._pool_write_ok or (self._pool_write_ok is None and self._kernel_writes_kv())):
            return ()
        loc = getattr(forward_batch, "out_cache_loc", None)
        seen, seen_t, ok = self._loc_ok
        if seen is not loc or seen_t != T:
            ok = (isinstance(loc, torch.Tensor) and loc.dtype == torch.int64 and loc.dim() == 1
                  and loc.shape[0] >= T and loc.is_contiguous() and loc.device == k.device)
            self._loc_ok = (loc, T, ok)
        if not ok:
            return ()
        st = k.stride()
        shape = k.shape
        ptr = k.data_ptr()
        n = shape[0]  # >= T: DP-attention padding rows past bs * q_len are neither read nor stored
        if (k.dtype != torch.bfloat16 or n < T or shape[-1] != D or k.numel() != n * D
                or st[-1] != 1 or st[0] % 8 or ptr % 16):
            return ()
        return (ptr, st[0], loc.data_ptr())

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Extend-mode attention: a TARGET_VERIFY batch with verify metadata runs the mlagen verify kernel; any
        other batch (prefill, extend, draft extend) the Triton fallback's ``forward_extend``.

        Args (the mlagen path; T = bs * q_len tokens, H = heads per rank):
            q: bf16 [T', H, 576] (or a view that reshapes to it, e.g. [T', H * 576]), T' >= T; rows past T
                (DP-attention padding) output 0.
            k: [T', 1, 576] this step's cache rows (SGLang's ``k``), or None; v: [T', 1, 512].
            layer: the RadixAttention layer (heads, head dims, scaling, KV scales, layer_id).
            forward_batch: SGLang's ForwardBatch of the step.
            save_kv_cache: store k (divided by ``layer.k_scale`` when the layer has KV scales) at
                ``out_cache_loc`` first: in the verify launch itself when the pool and tensors allow it, else by
                the pool's ``set_kv_buffer``.
            kwargs: other attention arguments; only None values are accepted.
        Returns:
            out [T', H * 512] in q's dtype (bf16), times the layer's v_scale when it has KV scales.
        Raises:
            NotImplementedError: a keyword argument that is not None, logit capping, or a sliding-window layer.
            MlagenSetupError: the layer has KV scale tensors but no loaded float scales (:func:`kv_descales`).
            ValueError: a KV pool buffer the kernel cannot read (``check_kv_cache``), or, when q does not fit the
                unchecked launch (dtype, heads, dims, strides, alignment), the checked call's errors.
            RuntimeError: the CUDA launch failed.
        """
        meta = self.forward_metadata
        if meta is not None and meta.kind == "verify" and forward_batch.forward_mode.is_target_verify():
            return self._run(q, k, v, layer, forward_batch, save_kv_cache, kwargs)
        return self.fallback.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Decode-mode attention: a plain decode batch with decode metadata (no speculative info, a decode
        variant installed) runs the mlagen q_len=1 kernel; any other batch the Triton fallback's
        ``forward_decode``. Arguments, return value and errors of the mlagen path as :meth:`forward_extend`,
        with T = bs (one token per request).
        """
        meta = self.forward_metadata
        if meta is not None and meta.kind == "decode" and forward_batch.forward_mode.is_decode():
            return self._run(q, k, v, layer, forward_batch, save_kv_cache, kwargs)
        return self.fallback.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


def kv_descales(layer) -> tuple:
    """(k_descale, v_descale) of a RadixAttention layer over a bf16 or fp8_e4m3 MLA pool, as SGLang's Triton
    backend applies them: checkpoints with a quantization config (e.g. DeepSeek-V3 / Kimi-K2 fp8 weights) give
    every attention layer ``k_scale`` / ``v_scale`` (1.0 once loaded when the checkpoint has no KV
    scales). K is stored divided by ``k_scale``, scores are multiplied by ``k_scale_float`` and the
    output by ``v_scale_float``; (1.0, 1.0) when the layer has no scales.

    Raises:
        MlagenSetupError: the layer has scale tensors but no loaded float scales (weights not processed).
    """
    if getattr(layer, "k_scale", None) is None or getattr(layer, "v_scale", None) is None:
        return 1.0, 1.0
    ks, vs = getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None)
    if ks is None or vs is None:
        raise MlagenSetupError(f"mlagen backend: layer {getattr(layer, 'layer_id', '?')} has KV scales but no "
                               "k_scale_float / v_scale_float (its weights were not processed after loading)")
    return float(ks), float(vs)


# -------------------------------------------------------------------- factory
def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        import sglang

        return getattr(sglang, "__version__", "0")


def _device_arch() -> Optional[str]:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return {9: "sm_90", 12: "sm_120"}.get(major, f"sm_{major}{minor}")


def gather_facts(runner) -> ServerFacts:
    """Read a SGLang ModelRunner (and the published runtime context) into :class:`ServerFacts`."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.runtime_context import get_parallel, get_spec

    mc = runner.model_config
    hf = mc.hf_config
    text = getattr(mc, "hf_text_config", None) or hf
    spec, par = get_spec(), get_parallel()
    algo = spec.speculative_algorithm
    algo = None if algo in (None, "", "NONE", "none") else str(getattr(algo, "name", algo))
    heads = mc.get_max_num_attention_heads() if hasattr(mc, "get_max_num_attention_heads") else text.num_attention_heads
    translator = getattr(runner, "kv_index_translator", None)
    return ServerFacts(
        sglang_version=_sglang_version(),
        architectures=tuple(getattr(hf, "architectures", None) or ()),
        is_mla=mc.attention_arch == AttentionArch.MLA and bool(getattr(runner, "use_mla_backend", True)),
        kv_lora_rank=getattr(mc, "kv_lora_rank", None),
        qk_rope_head_dim=getattr(mc, "qk_rope_head_dim", None),
        num_attention_heads=int(heads),
        attn_tp_size=int(par.attn_tp_size),
        page_size=int(getattr(runner, "page_size", 1) or 1),
        kv_cache_dtype=str(runner.kv_cache_dtype).replace("torch.", ""),
        spec_algorithm=algo,
        num_draft_tokens=spec.speculative_num_draft_tokens,
        eagle_topk=spec.speculative_eagle_topk,
        draft_attention_backend=spec.speculative_draft_attention_backend,
        speculative_attention_mode=str(getattr(spec, "speculative_attention_mode", None) or "prefill"),
        prefill_attention_backend=getattr(runner, "prefill_attention_backend_str", BACKEND_NAME),
        decode_attention_backend=getattr(runner, "decode_attention_backend_str", BACKEND_NAME),
        is_draft_worker=bool(getattr(runner, "is_draft_worker", False)),
        uses_sparse_attention=getattr(text, "index_topk", None) is not None,
        dcp_size=int(getattr(par, "attn_dcp_size", 1) or 1),
        kv_pool_translating=bool(getattr(translator, "is_translating", False)),
        device_arch=_device_arch(),
    )


def load_entry(entry: dict):
    """Load the kernel of an installed entry and check it is the variant the entry describes.

    Raises:
        MlagenSetupError: the entry's .so is missing or cannot be loaded (e.g. replaced by another build, or its
            module name already loaded from another build), its uri is not an mlagen variant uri, or the kernel's
            heads, q_len, page_size, kv_lora_rank, qk_rope_head_dim, mask or KV dtype differ from the entry's; the
            message says to build and install again.
        KeyError: the entry lacks one of those fields, ``uri`` or ``so_path`` (``read_installed`` validates them).
    """
    from mlagen.ops import load_so

    again = "run `mlagen build SPEC` and `mlagen install` again (or `mlagen uninstall`)"
    if not os.path.isfile(entry["so_path"]):
        raise MlagenSetupError(f"mlagen: the module of installed entry {entry['uri']} is missing "
                               f"({entry['so_path']}); {again}.")
    try:
        k = load_so(entry["uri"], entry["so_path"])
    except (ImportError, ValueError) as e:
        raise MlagenSetupError(f"mlagen: cannot load installed entry {entry['uri']} from {entry['so_path']} "
                               f"({type(e).__name__}: {e}); {again}.") from e
    v = k.variant
    checks = [(f, getattr(v, f), entry[f]) for f in ("heads", "q_len", "page_size", "kv_lora_rank", "qk_rope_head_dim",
                                                    "mask")]
    for field, have, want in checks + [("kv_dtype", v.dtype, entry.get("kv_dtype", "bf16"))]:
        if have != want:
            raise MlagenSetupError(
                f"mlagen: installed entry {entry['uri']} says {field}={want!r} but its kernel has "
                f"{have!r}; run `mlagen uninstall` and install again."
            )
    return k


def _register_model_dispatch() -> None:
    """Tell DeepSeek's MLA dispatcher to treat ``mlagen`` like ``triton`` (absorbed MLA for decode
    and verify, MHA for fresh prefill). SGLang already falls back to the triton handler for
    unknown names; registering makes it explicit."""
    try:
        from sglang.srt.models.deepseek_common.attention_backend_handler import (
            AttentionBackendRegistry,
            handle_attention_triton,
        )
    except Exception:  # pragma: no cover - depends on the SGLang build
        return
    AttentionBackendRegistry.register(BACKEND_NAME, handle_attention_triton)


def create_mlagen_backend(runner):
    """SGLang attention-backend factory for ``--attention-backend mlagen``.

    Raises:
        MlagenSetupError: unsupported SGLang / model / server flags, no matching installed variant, an installed
            entry whose module is missing, cannot be loaded or is not the variant it describes (:func:`load_entry`),
            or draft tokens that do not fit the verify variant.
        InstalledStateError: installed.json exists but is not valid (from ``read_installed``; a ValueError, not a
            MlagenSetupError).
    """
    facts = gather_facts(runner)
    selection = run_startup_checks(facts, read_installed())
    for note in selection.notes:
        logger.info("mlagen: %s", note)
    verify = load_entry(selection.verify) if selection.verify else None
    decode = load_entry(selection.decode) if selection.decode else None
    _register_model_dispatch()
    logger.info("mlagen: verify=%s decode=%s", selection.verify and selection.verify["uri"],
                selection.decode and selection.decode["uri"])
    return MlagenAttnBackend(runner, verify_kernel=verify, decode_kernel=decode,
                             verify_q_len=facts.num_draft_tokens if verify is not None else None)
