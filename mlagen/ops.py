"""Python front of a built variant: tensor checks (ValueError before any launch), workspace
sizing, split-count policy, and the launch through the variant's pybind11 module (which takes
device pointers, strides and the stream; no torch headers in the compiled code).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import numbers
import operator
import os
import weakref
from pathlib import Path

import torch

from mlagen.spec import Variant

# nsplit "auto": the split count whose CTAs fill the GPU's CTA slots (occupancy x SMs, for cluster schedules at most
# 2 x the resident clusters: VerifyKernel.cta_slots) in whole
# waves (see auto_num_splits), and at least this many KV tokens per split (shorter splits cost more
# in combine traffic than they win: on an H200, 64 was 0.4-1.7 µs faster than 128 at 4k bs 1 and level
# from 16k up, 32 no faster than 64; docs/perf-notes.md v14).
AUTO_MIN_TOKENS_PER_SPLIT = 64
# Cluster schedules (dimsplit, dimsplit_t) take at least 96: H200, H8 q9 bs 1 at 4k, 66 splits, dimsplit_t: 96 tokens
# (43 live splits) 16.6 µs, 64 (64 live) 17.2, 128 (32 live) 17.8 (docs/perf-notes.md v23).
AUTO_MIN_TOKENS_PER_SPLIT_CLUSTER = 96
MAX_SPLITS = 256
SM120_SMEM_PER_SM = 102400  # shared memory per SM on sm_120 (RTX PRO 6000 Blackwell): 100 KB
CTA_RESERVED_SMEM = 1024  # shared memory the runtime reserves per resident CTA (sm_80 and later)
AUTO_WAVE_SLACK = 1.03  # take the smallest split count within 3 % of the best wave cost
# Cluster schedules (dimsplit: 2 CTAs per split, one CTA per SM) take the fewest splits within 5 %: on
# 132 SMs one wave of 128 CTAs costs 3.1 % over a perfect fill in the wave model, but each split also
# pays a fixed prologue (its Q half) and a partial write + combine read, so two waves of 264 CTAs lose.
# H200, H8 q9 bs4 dimsplit (one run, docs/perf-notes.md): fixed 16 splits (one wave) ran 1.28 / 1.15 /
# 1.06 / 1.02x faster than the 33 the 3 % slack picked, at 4k / 16k / 64k / 128k. The slack picks the waves; the
# count then fills them (auto_num_splits' fill_waves: bs 1 takes 66 splits, bs 4 16).
AUTO_WAVE_SLACK_CLUSTER = 1.05
# The workspace starts with a 64-byte header: the fused merge's two arrival counters
# (include/mlagen/mla_verify_merge.cuh), zeroed by alloc_workspace for the modules that read them (the fused-merge
# diagnostic builds) and left at zero by every launch; other modules never read it. o_part and lse_part follow it.
WS_HEADER_FLOATS = 16
# Workspaces whose header mlagen zeroed (alloc_workspace), by address: only those are given to the fused merge, since a
# header that is not zero would make its wait fail (a trap, not a hang). Entries leave with their tensors.
_ZEROED_WORKSPACES: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()

# fill_metadata: index dtypes the kernel reads, and its tree modes (the MetaTreeMode ints of
# include/mlagen/mla_verify_metadata.cuh).
INDEX_DTYPES = (torch.int32, torch.int64)  # seq_lens / req_pool_indices / req_to_token index dtypes
_TREE_NONE, _TREE_CAUSAL, _TREE_QLEN, _TREE_FULL = 0, 1, 2, 3
_TREE_MODES = {"causal": _TREE_CAUSAL, "qlen_only": _TREE_QLEN, "full_mask": _TREE_FULL}


@functools.lru_cache(maxsize=1024)  # called on every launch of an auto variant: compute each (units, slots) once
def auto_num_splits(units: int, slots: int, max_splits: int = MAX_SPLITS, slack: float = AUTO_WAVE_SLACK,
                    fill_waves: bool = True) -> int:
    """Split count for ``units`` = batch x row blocks independent CTA groups on ``slots`` CTA slots.

    Model: every CTA of a request does 1/s of its KV, CTAs run in ceil(units*s/slots) waves, so the
    time is proportional to cost(s) = ceil(units*s/slots) / s (its floor is units/slots, reached
    when the CTAs fill whole waves). Returns the smallest s with cost(s) <= ``slack`` (AUTO_WAVE_SLACK, or
    AUTO_WAVE_SLACK_CLUSTER for cluster schedules) x the
    minimum over [1, max_splits]. The same wave-quantization argument as FlashAttention-2's
    num_splits heuristic; mlagen's own form. Checked against the H200 grid in docs/perf-notes.md
    (e.g. H=64 bs=4: one wave of 72 CTAs on 132 slots vs 16 splits, model 1.78x, measured 1.64-1.81x).

    With ``fill_waves`` (the default) the count then grows to the most splits that run in as many waves
    (floor(waves x slots / units), at most max_splits): the same waves, each CTA's share of the KV smaller.
    H200, H8 q9 bs 1 dimsplit_t: 66 splits instead of 63 (132 of 132 SMs), 1.4-2.8 % faster from 32k to 128k
    (a split of 128k held 66 tiles of 32 tokens, now 63); docs/perf-notes.md v23.

    Raises:
        ValueError: units, slots or max_splits < 1, or slack < 1 (or NaN).
    """
    if units < 1 or slots < 1 or max_splits < 1 or not slack >= 1.0:
        raise ValueError(f"auto_num_splits needs positive units, slots, max_splits and slack >= 1; got {units}, "
                         f"{slots}, {max_splits}, {slack}")
    costs = [-(-units * s // slots) / s for s in range(1, max_splits + 1)]
    best = min(costs)
    s = next(s for s, c in enumerate(costs, start=1) if c <= best * slack)
    if fill_waves:
        s = min(max_splits, -(-units * s // slots) * slots // units)
    return s


_PREFIX_MAX: dict[tuple[int, int, float], list[int]] = {}


def _max_request_splits(units_per_request: int, slots: int, batch_size: int, slack: float = AUTO_WAVE_SLACK) -> int:
    """max over bs in [1, batch_size] of bs * auto_num_splits(bs * units_per_request, slots, slack=slack):
    request-splits of the largest auto workspace up to ``batch_size``. Prefix maxima are kept per (units,
    slots, slack), so a size seen before is a list lookup and a new one costs one split count per new size."""
    pm = _PREFIX_MAX.setdefault((units_per_request, slots, slack), [0])
    while len(pm) <= batch_size:
        b = len(pm)
        pm.append(max(pm[-1], b * auto_num_splits(b * units_per_request, slots, slack=slack)))
    return pm[batch_size]


_LOADED: dict[str, tuple[Path, object]] = {}


def load_module(key: str, so_path: str | Path):
    """Import the compiled module named ``key`` from ``so_path``.

    CPython keeps the first extension module imported under a name: importing another .so under the
    same name silently returns the first one, so a differently compiled build would run stale code.
    A second file is accepted only when it is the same build: the same file name (the registry names
    modules ``<build_key>.<source hash>``) or the same bytes; the module loaded first is returned.

    Raises:
        ImportError: the file cannot be loaded, or ``key`` was already loaded from a different build.
    """
    path = Path(so_path).resolve()
    if key in _LOADED:
        prev, mod = _LOADED[key]
        if path == prev or path.name == prev.name or path.read_bytes() == prev.read_bytes():
            return mod
        raise ImportError(
            f"module {key} is already loaded from {prev}; a process can load only one build of it "
            f"(asked for {path}, a different build). Restart the process, or build under another module name."
        )
    spec = importlib.util.spec_from_file_location(key, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {so_path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _LOADED[key] = (path, mod)
    return mod


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class VerifyKernel:
    """A loaded MLA verify variant; call it like a function.

    Attributes:
        variant: the :class:`~mlagen.spec.Variant` (heads, q_len max, page_size, mask, nsplit, ...).
        so_path: ``Path`` of the compiled module's .so file, as given.
        module: the loaded pybind11 module (:func:`load_module`); variants differing only in nsplit share it.
        fused_merge: whether launches may fold the combine into the partial kernel (default
            :func:`fused_merge_default`; only modules built with it use it, see :meth:`merge_counters`). May be set
            per kernel; read when a launch's arguments are built.
        smem_per_sm_cap: bytes of shared memory per SM that :meth:`limit_smem_per_sm` emulates, or None (the
            device's own).
    """

    def __init__(self, variant: Variant, so_path: str | Path, module_name: str | None = None):
        """Load the compiled module of ``variant``.

        Args:
            variant: the variant the module was built for (its parameters drive every check and launch).
            so_path: path of the compiled .so.
            module_name: the name the module was compiled under (its PyInit symbol); default ``variant.build_key``.
        Raises:
            ImportError: the file cannot be loaded, or the name was already loaded from a different build
                (:func:`load_module`).
        """
        self.variant = variant
        self.so_path = Path(so_path)
        self.module = load_module(module_name or variant.build_key, so_path)
        self._sm: dict[int, int] = {}
        self.smem_per_sm_cap: int | None = None  # set by limit_smem_per_sm
        # dimsplit_t: fold the combine into the partial kernel when the grid is co-resident (one launch instead of
        # two; docs/perf-notes.md v21). MLAGEN_FUSED_MERGE=0 keeps the separate combine kernel; the attribute may be
        # set per kernel (read when a launch's arguments are built: check_batch / direct_plan / __call__).
        self.fused_merge = fused_merge_default()

    @property
    def has_new_kv(self) -> bool:
        """Whether the module's run() takes this step's draft rows (k_new, kv_write_loc; ABI 2). Modules
        built before it have no such arguments: rebuild them with ``mlagen build``."""
        return int(getattr(self.module, "run_abi", 1)) >= 2

    # ---- split policy
    @property
    def auto_slack(self) -> float:
        """Wave-cost slack of the auto split count: AUTO_WAVE_SLACK_CLUSTER for cluster schedules (more
        than one CTA per split), else AUTO_WAVE_SLACK."""
        return AUTO_WAVE_SLACK_CLUSTER if self.variant.ctas_per_row_block > 1 else AUTO_WAVE_SLACK

    def num_splits(self, batch_size: int, device: torch.device | None = None) -> int:
        """Grid split count for ``batch_size`` (fixed per batch size, so CUDA-graph safe).

        Fixed variants return their nsplit. ``auto``: :func:`auto_num_splits` of bs * row_blocks *
        ctas_per_row_block (2 for dimsplit's clusters) CTAs per split on :meth:`cta_slots` slots (whole waves,
        slack :attr:`auto_slack`, the waves filled), in [1, 256]; each request then spreads its tiles over
        those splits on the device (at least :meth:`min_tiles_per_split` tiles per non-empty split).

        Raises:
            ValueError / RuntimeError: ``auto`` on a device that is not a GPU, or with no GPU (:meth:`cta_slots`).
        """
        v = self.variant
        if v.nsplit != "auto":
            return int(v.nsplit)
        return auto_num_splits(max(1, batch_size) * v.row_blocks * v.ctas_per_row_block, self.cta_slots(device),
                               slack=self.auto_slack)

    def cta_slots(self, device: torch.device | None = None) -> int:
        """CTAs of the partial kernel resident at once on ``device`` (default: the current one): SMs x CTAs per SM,
        the latter capped as :meth:`limit_smem_per_sm` emulates; queried once per device, then cached.

        Cluster schedules (dimsplit, dimsplit_t: ``ctas_per_row_block`` 2) are also capped at the module's
        ``max_active_clusters()`` (cudaOccupancyMaxActiveClusters) x 2: a cluster's CTAs run on SMs of one GPC, so a
        GPU whose GPCs hold an odd number of SMs fits fewer clusters than SMs / 2, and a split count filled to SMs / 2
        would run its last clusters in a second wave. On the H200 the query gives 66 (132 SMs, the cap changes nothing);
        a query that fails (0), or a module built without it, leaves the SM count.

        Raises:
            ValueError: ``device`` is not a CUDA device.
            RuntimeError: no CUDA GPU, where ``device`` names none (None, or ``"cuda"`` without an index).
        """
        dev = torch.device("cuda" if device is None else device)
        if dev.type != "cuda":
            raise ValueError(f"{dev} is not a CUDA device: nsplit auto's split count and the workspace size are those "
                             "of a GPU")
        if dev.index is None and not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU: nsplit auto's split count and the workspace size are those of a GPU")
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        if idx not in self._sm:
            with torch.cuda.device(idx):
                occ = max(1, self.module.max_active_ctas_per_sm())
                if self.smem_per_sm_cap is not None:  # as on the emulated GPU (see limit_smem_per_sm)
                    occ = max(1, min(occ, self.smem_per_sm_cap // (int(self.module.smem_bytes) + CTA_RESERVED_SMEM)))
                slots = _sm_count(torch.device("cuda", idx)) * occ
                per_cluster = self.variant.ctas_per_row_block
                query = getattr(self.module, "max_active_clusters", None)  # absent in modules built before it
                if per_cluster > 1 and query is not None:
                    clusters = int(query())
                    if clusters > 0:
                        slots = min(slots, clusters * per_cluster)
                self._sm[idx] = slots
        return self._sm[idx]

    def limit_smem_per_sm(self, nbytes: int | None, device: torch.device | None = None) -> None:
        """Run the partial kernel as if an SM had only ``nbytes`` of shared memory (None: the device's own).

        Timing an H200 (228 KB per SM) for an sm_120 target (RTX PRO 6000: about 100 KB per SM,
        ``SM120_SMEM_PER_SM``) otherwise lets variants of 50-100 KB run 2-4 CTAs per SM where the target
        fits one or two. Sets the kernel's preferred shared-memory carveout (CUDA runtime API,
        cudaFuncAttributePreferredSharedMemoryCarveout) to floor(nbytes / capacity x 100) percent; the
        driver rounds a preference up to a carveout size the SM supports (Hopper: ..., 64, 100, 132, ...
        KB), so pass a supported size (the default use, 100 KB, is one) for an exact emulation. The auto
        split count uses ``nbytes // (smem_bytes + 1 KB reserved)`` CTAs per SM. The carveout belongs to
        the loaded module, which variants differing only in nsplit share: give them all the same limit,
        and ``None`` restores the driver default.

        Raises:
            ValueError: nbytes < the variant's shared memory + 1 KB, or above the device's capacity.
        """
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(dev):  # the carveout is set on the current device
            if nbytes is None:
                self.module.set_smem_carveout(-1)
                self.smem_per_sm_cap = None
            else:
                cap = torch.cuda.get_device_properties(dev).shared_memory_per_multiprocessor
                need = int(self.module.smem_bytes) + CTA_RESERVED_SMEM
                if not need <= nbytes <= cap:
                    raise ValueError(f"{self.variant.uri}: shared memory per SM {nbytes} B must be in [{need}, {cap}] "
                                     f"(one CTA needs {need} B; the device has {cap} B)")
                self.module.set_smem_carveout(nbytes * 100 // cap)
                self.smem_per_sm_cap = int(nbytes)
        self._sm.clear()

    def min_tiles_per_split(self) -> int:
        """Least KV tiles of a non-empty split: 1 for fixed nsplit; auto: AUTO_MIN_TOKENS_PER_SPLIT tokens
        (AUTO_MIN_TOKENS_PER_SPLIT_CLUSTER for cluster schedules) in tiles of block_n, at least 1."""
        if self.variant.nsplit != "auto":
            return 1
        tokens = AUTO_MIN_TOKENS_PER_SPLIT_CLUSTER if self.variant.ctas_per_row_block > 1 else AUTO_MIN_TOKENS_PER_SPLIT
        return max(1, tokens // self.variant.block_n)

    def workspace_numel(self, batch_size: int, device: torch.device | None = None) -> int:
        """fp32 elements of split workspace needed for every batch size up to ``batch_size``: a 16-float
        header (WS_HEADER_FLOATS) + o_part [bs, splits, H*q_len, kv_lora_rank] + lse_part [bs, splits, H*q_len].
        o_part keeps this fp32 size when a build writes bf16 partials (include/mlagen/mla_verify_partial_store.cuh):
        they fill its first half, and lse_part stays where it is.
        O(1): fixed nsplit in closed form; auto from running maxima kept per CTA-slot count (a batch size not
        seen before costs one split count per new size, once).

        Raises:
            ValueError / RuntimeError: ``auto`` on a device that is not a GPU, or with no GPU (:meth:`cta_slots`).
        """
        v = self.variant
        n = max(1, batch_size)
        if v.nsplit != "auto":
            return self.workspace_floats(n * int(v.nsplit))
        return self.workspace_floats(_max_request_splits(v.row_blocks * v.ctas_per_row_block, self.cta_slots(device),
                                                         n, self.auto_slack))

    def workspace_floats(self, request_splits: int) -> int:
        """fp32 elements of a workspace for ``request_splits`` = batch size x splits (request, split) pairs: the
        16-float header, o_part [request_splits, rows_max, dim_v] and lse_part [request_splits, rows_max]."""
        v = self.variant
        return WS_HEADER_FLOATS + request_splits * v.rows_max * (v.dim_v + 1)

    def alloc_workspace(self, batch_size: int, device) -> torch.Tensor:
        """Allocate the 1-D fp32 workspace for batches up to ``batch_size`` (:meth:`workspace_numel` elements) on
        ``device``: a 64-byte header, then o_part and lse_part. The header holds the fused merge's counters: when the
        module can fold the combine in (a diagnostic dimsplit_t build with MLAGEN_DST_MERGE=1, run ABI 3) it is
        zeroed here on the current stream and the workspace is registered as zeroed (every launch leaves the
        counters at zero); other modules never read it, and it is left uninitialized.
        Use one workspace per stream: two launches in flight on one workspace would share its partials.

        Raises:
            ValueError / RuntimeError: nsplit auto with a ``device`` that is not a GPU, or with no GPU
                (:meth:`cta_slots`).
        """
        return _new_workspace(self.workspace_numel(batch_size, torch.device(device)), device, self._can_fuse)

    # ---- launch
    def __call__(self, q, kv_cache, block_table, kv_lens, *, q_len: int, softmax_scale: float, tree_mask=None,
                 req_pool_indices=None, out=None, lse=None, workspace=None, k_new=None, kv_write_loc=None):
        """Verify attention for a batch.

        Args:
            q: bf16 [bs*q_len, H, D] (D = kv_lora_rank + qk_rope_head_dim = 576), last dim contiguous.
            kv_cache: bf16 [num_slots, D] or [num_slots, 1, D]; V is the first kv_lora_rank dims of a row.
                dtype fp8_e4m3 variants: float8_e4m3fn or uint8 (its bytes) of the same shape, dequantized
                exactly in the kernel; SGLang's k_scale / v_scale stay outside (softmax_scale x k_scale,
                out x v_scale), k_new stays bf16 and is stored quantized (round to nearest even, +-448
                saturation).
            block_table: int32 [rows, max_pages] page ids, last dim contiguous (page_size 1: SGLang's
                req_to_token). It must cover ceil(kv_len / page_size) pages of every request.
            kv_lens: int32 [bs] cached tokens per request including the draft tokens; 0 = padded row.
            q_len: draft tokens per request, 1 <= q_len <= variant.q_len (any integer type, numpy's included).
            softmax_scale: float > 0 (the layer's scaling, yarn mscale included; a numpy float is taken too).
            tree_mask: int64 [bs, q_len] bitmasks (mask 'tree' only): bit j of row i = query i sees draft j.
            req_pool_indices: optional int32/int64 [bs]: request b reads block_table[req_pool_indices[b]].
            out: optional bf16 [bs*q_len, H, kv_lora_rank], any strides whose rows (last dim, contiguous) do not
                overlap (token-major or head-major); lse: optional fp32 [bs*q_len, H] (natural log).
            workspace: optional fp32 1-D from :meth:`alloc_workspace` (its 64-byte header is mlagen's: write
                only the rest; a workspace made otherwise works, but never folds the combine in). With out and
                workspace given, the call allocates nothing and never synchronizes (CUDA-graph safe).
            k_new: optional bf16 [bs*q_len, D] or [bs*q_len, 1, D]: this step's draft rows (SGLang's ``k``
                of the layer). Draft token i of request b (position kv_len - q_len + i) is then read from
                row b*q_len + i of k_new, never from kv_cache. Rows contiguous and 16-byte aligned.
            kv_write_loc: optional int64 [bs*q_len] cache slots (SGLang's ``out_cache_loc``); with k_new,
                the launch also stores the k_new rows to those kv_cache rows (the KV write SGLang's
                ``set_kv_buffer`` does, in the same launch); slots outside [0, num_slots) are skipped. The
                store is not ordered against the launch's cache reads, so no kv_write_loc slot may be a
                slot that a request reads at a prefix position (< kv_len - q_len): SGLang's out_cache_loc
                are freshly allocated slots (or its padding slot); give -1 for rows not to store.
        Returns:
            ``(out, lse)``: out bf16 [bs*q_len, H, kv_lora_rank] (the given buffer, else a new one on q's device);
            lse fp32 [bs*q_len, H], the given buffer, or None when none was passed (lse is then not computed).
        Raises:
            ValueError: nothing is launched when: q_len is not an int in [1, variant.q_len]; softmax_scale is not
                a finite number in (0, 3e38); a tensor has the wrong type, dtype, shape, device, strides or
                alignment (out / lse rows overlapping included); out, lse and kv_lens overlap each other; bs >
                65,535; block_table is empty or has fewer than bs rows without req_pool_indices; a tree variant gets no tree_mask; the workspace is too small,
                not contiguous, not 16-byte aligned or overlaps an input or output; kv_write_loc comes without
                k_new; k_new is given to a module built before draft-row support; with kv_write_loc, k_new or any
                other tensor of the call overlaps kv_cache (which the launch then writes) or kv_cache rows are not
                16-byte (e4m3: 8-byte) aligned for the draft-row store; kv_cache has no slots.
            RuntimeError: the CUDA launch failed.
        """
        v = self.variant
        D, DV, H = v.dim_qk, v.dim_v, v.heads
        q_len = self._checked_q_len(q_len)
        if not (isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
                and math.isfinite(softmax_scale) and 0 < softmax_scale < 3.0e38):  # (numpy floats are Real)
            raise ValueError(f"softmax_scale must be a finite float > 0 (fp32 range), got {softmax_scale!r}")
        softmax_scale = float(softmax_scale)
        bs = self._check_batch_tensors(kv_lens, block_table, q_len, tree_mask, req_pool_indices)
        _check(q, "q", torch.bfloat16, shape=(bs * q_len, H, D))
        if q.stride(2) != 1 or q.stride(0) % 2 or q.stride(1) % 2 or q.data_ptr() % 4:
            raise ValueError(f"q must have a contiguous last dim, even strides and 4-byte alignment; strides {q.stride()}")
        kv2 = self.check_kv_cache(kv_cache)
        if out is None:
            out = torch.empty(bs * q_len, H, DV, dtype=torch.bfloat16, device=q.device)
        _check(out, "out", torch.bfloat16, shape=(bs * q_len, H, DV))
        if out.stride(2) != 1 or out.stride(0) % 2 or out.stride(1) % 2 or out.data_ptr() % 4:
            raise ValueError(f"out must have a contiguous last dim, even strides and 4-byte alignment; strides {out.stride()}")
        if _rows_overlap(out):
            raise ValueError(f"out rows must not overlap: strides {out.stride()} for shape {tuple(out.shape)}")
        if lse is not None:
            _check(lse, "lse", torch.float32, shape=(bs * q_len, H))
            if lse.stride(1) != 1 or lse.stride(0) < H:
                raise ValueError(f"lse must have a contiguous last dim and non-overlapping rows; strides {lse.stride()}")
        if workspace is not None:
            _check(workspace, "workspace", torch.float32, ndim=1)
        named = dict(out=out, lse=lse, kv_lens=kv_lens)  # the combine writes out and lse while it reads kv_lens
        for a, b in (("out", "lse"), ("out", "kv_lens"), ("lse", "kv_lens")):
            if named[a] is not None and named[b] is not None and _overlap(named[a], named[b]):
                raise ValueError(f"{a} overlaps {b}")
        k_new2 = self._check_new_kv(k_new, kv_write_loc, bs * q_len, kv2)
        if kv_write_loc is not None:  # the launch writes kv_cache: none of its other tensors may lie in it
            for name, t in dict(q=q, out=out, lse=lse, block_table=block_table, kv_lens=kv_lens, tree_mask=tree_mask,
                                req_pool_indices=req_pool_indices, kv_write_loc=kv_write_loc).items():
                if t is not None and _overlap(kv2, t):
                    raise ValueError(f"{name} overlaps kv_cache, which the launch writes (kv_write_loc)")
        _check_devices(q.device, [q, kv2, block_table, kv_lens, out, tree_mask, req_pool_indices, lse, workspace,
                                  k_new2, kv_write_loc])
        splits = self.num_splits(bs, q.device)
        workspace = self._checked_workspace(workspace, bs, splits, q.device, dict(
            q=q, kv_cache=kv2, block_table=block_table, kv_lens=kv_lens, out=out, lse=lse, tree_mask=tree_mask,
            req_pool_indices=req_pool_indices, k_new=k_new2, kv_write_loc=kv_write_loc))
        return self._launch(q, kv2, block_table, req_pool_indices, kv_lens, tree_mask, workspace, out, lse,
                            bs, q_len, splits, softmax_scale, self._new_kv_args(k_new2, kv_write_loc, kv2))

    def _checked_q_len(self, q_len) -> int:
        """``q_len`` as an int in [1, variant.q_len] (any integer type: numpy's too; not bool, and not a tensor, whose
        value would be read by a device synchronization), else ValueError."""
        v = self.variant
        try:
            n = operator.index(q_len) if not isinstance(q_len, (bool, torch.Tensor)) else None
        except TypeError:
            n = None
        if n is None or not 1 <= n <= v.q_len:
            raise ValueError(f"q_len must be an int in [1, {v.q_len}] for {v.uri}, got {q_len!r}")
        return n

    def _check_new_kv(self, k_new, kv_write_loc, tokens: int, kv2):
        """Validate ``k_new`` / ``kv_write_loc`` of :meth:`__call__`; returns k_new's [tokens, D] view or None."""
        if k_new is None:
            if kv_write_loc is not None:
                raise ValueError("kv_write_loc needs k_new (the rows to store)")
            return None
        if not self.has_new_kv:
            raise ValueError(f"{self.variant.uri}: this build has no draft-row support (k_new); rebuild it with "
                             f"`mlagen build`")
        D = self.variant.dim_qk
        if isinstance(k_new, torch.Tensor) and k_new.dim() == 3:
            if k_new.shape[1] != 1:
                raise ValueError(f"k_new must be [{tokens}, {D}] or [{tokens}, 1, {D}], got {tuple(k_new.shape)}")
            k_new = k_new.select(1, 0)
        _check(k_new, "k_new", torch.bfloat16, shape=(tokens, D))
        if k_new.stride(1) != 1 or (k_new.stride(0) * 2) % 16 or k_new.data_ptr() % 16:
            raise ValueError(f"k_new rows must be contiguous and 16-byte aligned; strides {k_new.stride()}, "
                             f"address % 16 = {k_new.data_ptr() % 16}")
        if kv_write_loc is not None:
            _check(kv_write_loc, "kv_write_loc", torch.int64, shape=(tokens,))
            if not kv_write_loc.is_contiguous():
                raise ValueError("kv_write_loc must be contiguous")
            # the store writes 8 values per instruction (mla_verify_new_kv.cuh): 16 bytes of bf16, 8 of e4m3
            align = 8 if kv2.element_size() == 1 else 16
            if kv2.data_ptr() % align or (kv2.stride(0) * kv2.element_size()) % align:
                raise ValueError(f"kv_cache rows must be {align}-byte aligned for the draft-row store (kv_write_loc); "
                                 f"row stride {kv2.stride(0)} elements, address % {align} = {kv2.data_ptr() % align}")
            if _overlap(k_new, kv2):
                raise ValueError("k_new overlaps kv_cache, which the launch writes")
        return k_new

    @staticmethod
    def _new_kv_args(k_new, kv_write_loc, kv2) -> tuple:
        """module.run's draft-row arguments: (k_new, its row stride, kv_write_loc, cache slots)."""
        if k_new is None:
            return ()
        return (k_new.data_ptr(), k_new.stride(0), kv_write_loc.data_ptr() if kv_write_loc is not None else 0,
                kv2.shape[0])

    # ---- per-batch validation + per-layer launch (the SGLang backend's path)
    def check_batch(self, kv_lens, block_table, *, q_len: int, tree_mask=None, req_pool_indices=None,
                    workspace=None) -> "VerifyBatch":
        """Validate a batch's metadata once for :meth:`launch` (every layer of a step shares it).

        Args: as :meth:`__call__` (kv_lens int32 [bs], block_table int32 [rows, pages], tree_mask int64
            [bs, q_len] for tree variants, req_pool_indices int32/int64 [bs], workspace fp32 1-D; a
            workspace is allocated when None). All on one CUDA device.
        Returns:
            A :class:`VerifyBatch` holding these tensors, the batch size and the split count.
        Raises:
            ValueError: as :meth:`__call__` for these tensors (dtype, shape, device, strides, workspace size,
                alignment or overlap).
        """
        q_len = self._checked_q_len(q_len)
        bs = self._check_batch_tensors(kv_lens, block_table, q_len, tree_mask, req_pool_indices)
        if workspace is not None:
            _check(workspace, "workspace", torch.float32, ndim=1)
        dev = kv_lens.device
        _check_devices(dev, [kv_lens, block_table, tree_mask, req_pool_indices, workspace])
        splits = self.num_splits(bs, dev)
        workspace = self._checked_workspace(workspace, bs, splits, dev, dict(
            block_table=block_table, kv_lens=kv_lens, tree_mask=tree_mask, req_pool_indices=req_pool_indices))
        head, tail = self._batch_run_args(block_table, req_pool_indices, kv_lens, tree_mask, workspace, bs, q_len,
                                          splits)  # resolved once for every layer's launch
        return VerifyBatch(bs, q_len, splits, kv_lens, block_table, tree_mask, req_pool_indices, workspace,
                           (head, tail, dev.index))

    # ---- SGLang's batch state read by the kernel itself (eager steps: no metadata launch)
    @property
    def has_direct(self) -> bool:
        """Whether the compiled module has ``run_direct`` (reads seq_lens / req_to_token / a QLEN_ONLY mask
        itself; modules built before it do not: rebuild them with ``mlagen build``)."""
        return hasattr(self.module, "run_direct")

    def direct_plan(self, req_to_token, *, q_len: int, batch_size: int, workspace=None) -> "DirectPlan":
        """Validate what stays fixed across steps of one batch size for :meth:`direct_batch`: SGLang's
        req_to_token and the workspace.

        Args:
            req_to_token: int32 [pool_rows, width] cache slots, one per token position (SGLang's
                ``ReqToTokenPool.req_to_token``; any page size: a page's slots are contiguous), last dim
                contiguous.
            q_len: draft tokens per request, 1 <= q_len <= variant.q_len.
            batch_size: requests per launch (padded rows included), 0..65,535.
            workspace: optional fp32 1-D (:meth:`alloc_workspace`); allocated when None.
        Returns:
            A :class:`DirectPlan`.
        Raises:
            ValueError: a wrong dtype, shape, device or stride, a batch size out of range, a workspace too
                small, misaligned or overlapping req_to_token, or a module without ``run_direct``.
        """
        v = self.variant
        if not self.has_direct:
            raise ValueError(f"{v.uri}: this build has no run_direct; rebuild it with `mlagen build`")
        q_len = self._checked_q_len(q_len)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 0 <= batch_size <= 65535:
            raise ValueError(f"batch_size must be an int in [0, 65535], got {batch_size!r}")
        _check(req_to_token, "req_to_token", torch.int32, ndim=2)
        if req_to_token.stride(1) != 1 or req_to_token.shape[0] < 1:
            raise ValueError(f"req_to_token must have >= 1 row and a contiguous last dim; shape "
                             f"{tuple(req_to_token.shape)}, strides {req_to_token.stride()}")
        dev = req_to_token.device
        _check_devices(dev, [req_to_token, workspace])
        splits = self.num_splits(batch_size, dev)
        workspace = self._checked_workspace(workspace, batch_size, splits, dev, dict(req_to_token=req_to_token))
        table = (req_to_token.data_ptr(), req_to_token.stride(0), req_to_token.shape[0], req_to_token.shape[1])
        return DirectPlan(batch_size, q_len, splits, req_to_token, workspace, table,
                          self._workspace_parts(workspace, batch_size, splits),
                          self._run_tail(batch_size, q_len, splits, workspace), dev.index)

    def direct_batch(self, plan: "DirectPlan", seq_lens, req_pool_indices, *, extra: int, num_padding: int = 0,
                     qlen_mask=None, tree_rows=None, checked: bool = True) -> "VerifyBatch":
        """A step's batch for :meth:`launch` that the kernel reads from SGLang's own tensors
        (include/mlagen/mla_verify_batch.cuh): no metadata launch, no host sync.

        Request b (< bs - num_padding) attends to kv_len = seq_lens[b] + extra positions of row
        req_pool_indices[b] of the plan's req_to_token (clamped to its width); the last num_padding rows
        (SGLang's DP-attention padding) have kv_len 0 and output 0, and never read the mask.

        Args:
            plan: from :meth:`direct_plan` (its batch size is bs).
            seq_lens: int32 / int64 [>= bs] contiguous (SGLang's verify seq_lens exclude the draft tokens).
            req_pool_indices: int32 / int64 [>= bs] contiguous.
            extra: int >= 0 added to seq_lens (q_len for target verify, 0 for decode).
            num_padding: int in [0, bs].
            qlen_mask: tree variants: bool / uint8 1-D contiguous, SGLang's TreeMaskMode.QLEN_ONLY custom
                mask (request b's [q_len, q_len] block at b * q_len^2; cell [i, j] != 0: draft i sees draft
                j), >= (bs - num_padding) * q_len^2 cells; or
            tree_rows: tree variants: int64 [q_len] contiguous bitmask rows shared by every request (bit j
                of row i: draft i sees draft j; e.g. causal bits for chain drafts). With every row padded
                nothing reads either, and both may be empty / None.
            checked: False skips the dtype / layout / device checks above (a caller that made them, as the
                SGLang backend does once per step); the mask size check and the one-of qlen_mask / tree_rows
                check always run.
        Returns:
            A :class:`VerifyBatch` (direct) for :meth:`launch`; it keeps the step's tensors alive.
        Raises:
            ValueError: an argument out of the contract above; nothing is launched.
        """
        bs, q_len = plan.bs, plan.q_len
        tree = self.variant.mask == "tree"
        if checked:
            for name, t in (("seq_lens", seq_lens), ("req_pool_indices", req_pool_indices)):
                if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES or t.dim() != 1:
                    raise ValueError(f"{name} must be a 1-D int32 / int64 tensor, got {getattr(t, 'dtype', t)}")
                if t.shape[0] < bs or not t.is_contiguous():
                    raise ValueError(f"{name} must be contiguous with >= {bs} elements, got {tuple(t.shape)}")
            if isinstance(extra, bool) or not isinstance(extra, int) or not 0 <= extra < 2**31:
                raise ValueError(f"extra must be an int >= 0, got {extra!r}")
            if isinstance(num_padding, bool) or not isinstance(num_padding, int) or not 0 <= num_padding <= bs:
                raise ValueError(f"num_padding must be an int in [0, {bs}], got {num_padding!r}")
            if qlen_mask is not None and (not isinstance(qlen_mask, torch.Tensor) or qlen_mask.dim() != 1
                                          or qlen_mask.dtype not in (torch.bool, torch.uint8)
                                          or not qlen_mask.is_contiguous()):
                raise ValueError(f"qlen_mask must be a contiguous 1-D bool / uint8 tensor, got "
                                 f"{getattr(qlen_mask, 'dtype', qlen_mask)}")
            if tree_rows is not None:
                _check(tree_rows, "tree_rows", torch.int64, shape=(q_len,))
                if not tree_rows.is_contiguous():
                    raise ValueError("tree_rows must be contiguous")
            _check_devices(plan.req_to_token.device, [seq_lens, req_pool_indices, qlen_mask, tree_rows])
            _check_no_overlap(plan.workspace, plan.workspace.numel(), dict(
                seq_lens=seq_lens, req_pool_indices=req_pool_indices, qlen_mask=qlen_mask, tree_rows=tree_rows))
        if tree and num_padding < bs and (qlen_mask is None) == (tree_rows is None):  # also unchecked: else a null read
            raise ValueError(f"{self.variant.uri} uses a tree mask: pass exactly one of qlen_mask / tree_rows")
        mask_ptr = tree_ptr = 0
        if tree and qlen_mask is not None:
            need = (bs - num_padding) * q_len * q_len
            if qlen_mask.numel() < need:
                raise ValueError(f"QLEN_ONLY verify mask has {qlen_mask.numel()} elements, {need} needed "
                                 f"for {bs - num_padding} requests of {q_len} draft tokens")
            mask_ptr = qlen_mask.data_ptr()
        elif tree and tree_rows is not None:
            tree_ptr = tree_rows.data_ptr()
        head = (*plan.table, req_pool_indices.data_ptr(), int(req_pool_indices.dtype is torch.int64),
                seq_lens.data_ptr(), int(seq_lens.dtype is torch.int64), extra, bs - num_padding, mask_ptr, tree_ptr,
                0, *plan.ws_args)
        return VerifyBatch._new(bs, q_len, plan.splits, None, plan.req_to_token, tree_rows, req_pool_indices,
                                plan.workspace, (head, plan.tail, plan.device_index), True, (seq_lens, qlen_mask))

    # ---- per-batch metadata in one launch (the SGLang backend's path)
    @property
    def has_fill_metadata(self) -> bool:
        """Whether the compiled module has :meth:`fill_metadata` (modules built before it do not)."""
        return hasattr(self.module, "fill_metadata")

    def fill_metadata(self, kv_lens, block_table, seq_lens, req_pool_indices, req_to_token, *, extra: int,
                      num_padding: int, npages: int, page_size: int, q_len: int = 0, tree_mask=None,
                      tree_mode: str | None = None, custom_mask=None) -> None:
        """Fill a batch's kernel inputs from SGLang's batch state in one launch on the current stream
        (include/mlagen/mla_verify_metadata.cuh); the fused form of the torch helpers in
        ``mlagen.sglang_plugin.metadata``, with exactly their results. No allocation, no host sync
        (CUDA-graph safe). Called once per step by the backend, which owns the output buffers: only
        cheap checks here (dtypes, devices, the sizes the buffers hold, the mask mode and size).

        Args:
            kv_lens: int32 [>= bs], contiguous; [:bs] gets seq_lens + extra, 0 for the last ``num_padding``.
            block_table: int32 [>= bs, >= npages], last dim contiguous; [b, p] for p < npages gets
                floor(req_to_token[req_pool_indices[b], p * page_size] / page_size); other columns untouched.
            seq_lens: int32/int64 [bs], contiguous: prefix lengths (bs = its length).
            req_pool_indices: int32/int64 [bs], contiguous: rows of req_to_token (padded rows: a valid row);
                a row outside the pool gets page 0 in every column.
            req_to_token: int32 [pool_rows, width], last dim contiguous; (npages - 1) * page_size < width.
            extra: added to seq_lens (q_len for verify, 0 for decode).
            num_padding: padded rows at the end of the batch, 0 <= num_padding <= bs.
            npages: block-table columns to write; page_size: tokens per page (>= 1).
            q_len: draft tokens per request: 1..64 with a tree_mask (its rows [:bs, :q_len] are written);
                unused without one, where the default 0 fits.
            tree_mask: int64 [>= bs, >= q_len], last dim contiguous, or None (no tree output).
            tree_mode: with tree_mask: ``"causal"`` (every row: query i sees drafts 0..i, as
                ``causal_bits``), ``"qlen_only"`` (SGLang TreeMaskMode.QLEN_ONLY custom mask, as
                ``pack_qlen_mask``) or ``"full_mask"`` (TreeMaskMode.FULL_MASK, as ``pack_full_mask`` over
                the real rows); mask modes write 0 to the padded rows, which never index the mask.
            custom_mask: bool/uint8 1-D contiguous verify mask (the mask modes); FULL_MASK cells past its
                end read as 0 (the torch helper would fail on such a mask).
        Raises:
            ValueError: a wrong dtype or device, a non-contiguous input / last dim, a page_size below 1, sizes
                the buffers do not hold (bs rows of kv_lens / block_table / req_pool_indices /
                tree_mask, npages columns, q_len tree columns; npages pages reaching past req_to_token's width;
                extra, num_padding, npages, q_len ints in range), an unknown tree_mode, a mask mode without a custom
                mask, or a QLEN_ONLY mask of fewer than (bs - num_padding) * q_len * q_len cells (the message of
                ``pack_qlen_mask``). Nothing is launched.
            RuntimeError: sizes out of range for the kernel, or the launch failed.
        """
        self.metadata_filler(kv_lens, block_table, req_to_token, tree_mask=tree_mask, page_size=page_size)(
            seq_lens, req_pool_indices, extra=extra, num_padding=num_padding, npages=npages, q_len=q_len,
            tree_mode=tree_mode, custom_mask=custom_mask)

    def metadata_filler(self, kv_lens, block_table, req_to_token, *, tree_mask=None, page_size: int) -> "MetadataFill":
        """:meth:`fill_metadata` bound to its output buffers and req_to_token, which are checked here once; each
        call then checks only the step's own inputs (seq_lens, req_pool_indices, the mask). The SGLang backend
        keeps one per set of persistent buffers, so a step's host time carries no re-check of its own buffers.

        Args: kv_lens, block_table, req_to_token, tree_mask, page_size as :meth:`fill_metadata`.
        Returns:
            A :class:`MetadataFill`; ``filler(seq_lens, req_pool_indices, extra=, num_padding=, npages=, q_len=,
            tree_mode=, custom_mask=)`` is ``fill_metadata`` with these buffers.
        Raises:
            ValueError: a buffer of the wrong dtype, rank or device, or with a non-contiguous (last) dim; a page_size
                below 1. (The fill does not depend on the variant: the kernel that reads the table must use the same
                page_size, which the SGLang backend's startup checks ensure.)
        """
        for name, t in dict(kv_lens=kv_lens, block_table=block_table, req_to_token=req_to_token).items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tree_mask is not None and not isinstance(tree_mask, torch.Tensor):
            raise ValueError(f"tree_mask must be a torch.Tensor or None, got {type(tree_mask).__name__}")
        if kv_lens.dtype != torch.int32 or block_table.dtype != torch.int32 or req_to_token.dtype != torch.int32:
            raise ValueError(f"kv_lens, block_table and req_to_token must be int32, got {kv_lens.dtype}, "
                             f"{block_table.dtype} and {req_to_token.dtype}")
        if not (kv_lens.is_contiguous() and block_table.stride(-1) == 1 and req_to_token.stride(-1) == 1):
            raise ValueError("kv_lens must be contiguous; block_table and req_to_token need a contiguous last dim")
        if tree_mask is not None and (tree_mask.dtype != torch.int64 or tree_mask.stride(-1) != 1
                                      or tree_mask.dim() != 2):
            raise ValueError(f"tree_mask must be torch.int64, 2-D, with a contiguous last dim; got {tree_mask.dtype} "
                             f"strides {tree_mask.stride()}")
        if kv_lens.dim() != 1 or block_table.dim() != 2 or req_to_token.dim() != 2:
            raise ValueError(f"kv_lens must be 1-D, block_table and req_to_token 2-D; got {kv_lens.dim()}, "
                             f"{block_table.dim()} and {req_to_token.dim()} dims")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        _check_devices(kv_lens.device, [kv_lens, block_table, req_to_token, tree_mask])
        return MetadataFill(self.module, kv_lens.device.index,
                            (req_to_token.data_ptr(), req_to_token.stride(0), req_to_token.shape[0]),
                            (kv_lens.data_ptr(), block_table.data_ptr(), block_table.stride(0),
                             tree_mask.data_ptr() if tree_mask is not None else 0,
                             tree_mask.stride(0) if tree_mask is not None else 0),
                            tree_mask is not None, page_size, (kv_lens, block_table, req_to_token, tree_mask))

    def check_kv_cache(self, kv_cache) -> torch.Tensor:
        """Validate a KV cache for this variant; returns its [num_slots, D] view.

        Args:
            kv_cache: bf16 (fp8_e4m3 variants: float8_e4m3fn or uint8) [num_slots, D] or [num_slots, 1, D]
                (D = 576), rows contiguous and aligned to
                the variant's load width (16 B for bulk).
        Raises:
            ValueError: wrong dtype, shape, strides or alignment.
        """
        v = self.variant
        D = v.dim_qk
        lw_bytes = 16 if v.load_width == "bulk" else v.load_width // 8
        if not isinstance(kv_cache, torch.Tensor):
            raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        if kv_cache.dim() == 3:
            if kv_cache.shape[1] != 1:
                raise ValueError(f"kv_cache must be [num_slots, {D}] or [num_slots, 1, {D}], got {tuple(kv_cache.shape)}")
            kv2 = kv_cache.select(1, 0)
        else:
            kv2 = kv_cache
        if v.dtype == "fp8_e4m3":  # e4m3 bytes: SGLang's fp8 pool stores uint8 and reads a float8_e4m3fn view
            if kv2.dtype not in _FP8_KV_DTYPES:
                raise ValueError(f"kv_cache must be torch.float8_e4m3fn or its uint8 bytes for {v.uri}, got {kv2.dtype}")
            _check(kv2, "kv_cache", kv2.dtype, ndim=2)
        else:
            _check(kv2, "kv_cache", torch.bfloat16, ndim=2)
        if kv2.shape[1] != D:
            raise ValueError(f"kv_cache last dim must be {D} (kv_lora_rank {v.kv_lora_rank} + rope {v.qk_rope_head_dim}), got {kv2.shape[1]}")
        if kv2.shape[0] == 0:
            raise ValueError("kv_cache has no slots: the page table's entries index its rows")
        if kv2.stride(1) != 1 or (kv2.stride(0) * kv2.element_size()) % lw_bytes or kv2.data_ptr() % lw_bytes:
            raise ValueError(
                f"kv_cache rows must be contiguous and {lw_bytes}-byte aligned for load_width {v.load_width}; "
                f"row stride {kv2.stride(0)} elements, address % {lw_bytes} = {kv2.data_ptr() % lw_bytes}")
        return kv2

    def launch(self, batch: "VerifyBatch", q, kv_cache, out, softmax_scale: float, lse=None, new_kv: tuple = ()):
        """Launch on a batch from :meth:`check_batch` without re-checking anything; returns ``(out, lse)``.

        The caller guarantees what :meth:`__call__` would check: q bf16 [bs*q_len, H, 576] and out bf16
        [bs*q_len, H, 512] (or their 2-D forms [bs*q_len, H*576] / [bs*q_len, H*512], heads 576 / 512
        elements apart: the SGLang backend's layout, which saves a view per layer) (lse fp32 [bs*q_len, H]
        or None) with contiguous last dims, even strides and
        4-byte alignment, kv_cache passed by :meth:`check_kv_cache`, all on the batch's device, none
        overlapping the workspace; softmax_scale a finite float > 0. A wrong tensor is undefined
        behavior (out-of-bounds reads), not an error: use :meth:`__call__` for unchecked inputs.
        CUDA-graph safe (no allocation, no synchronization). The batch's pointers and sizes were resolved by
        check_batch; per layer only q, kv_cache, out, lse and the scale are read (a few µs of host time).
        ``new_kv``: () or :meth:`new_kv_args` of k_new / kv_write_loc as :meth:`__call__` takes them
        (checked by the caller as __call__ checks them; the module must have ``has_new_kv``).

        Raises:
            ValueError: ``new_kv`` given for a batch from :meth:`check_batch` to a module without ``has_new_kv``
                (nothing is launched).
            RuntimeError: the CUDA launch failed.
        """
        if batch.launch_args and batch.launch_args[2] == torch.cuda.current_device():
            head, tail, idx = batch.launch_args
            self._run_module(q, kv_cache, head, tail, out, lse, softmax_scale, _raw_stream(idx), new_kv, batch.direct)
            return out, lse
        if batch.direct:  # another current device: launch on the batch's
            head, tail, idx = batch.launch_args
            with torch.cuda.device(idx):
                self._run_module(q, kv_cache, head, tail, out, lse, softmax_scale, _raw_stream(idx), new_kv, True)
            return out, lse
        # another current device, or a batch built by hand (no resolved arguments)
        return self._launch(q, kv_cache, batch.block_table, batch.req_pool_indices, batch.kv_lens, batch.tree_mask,
                            batch.workspace, out, lse, batch.bs, batch.q_len, batch.splits, softmax_scale, new_kv)

    def new_kv_args(self, batch: "VerifyBatch", k_new, kv_write_loc, kv_cache) -> tuple:
        """Checked draft-row arguments of ``batch`` (bs * q_len rows) for :meth:`launch` (see :meth:`__call__`
        for k_new / kv_write_loc).

        Returns:
            () without k_new; else (k_new address, its row stride in elements, kv_write_loc address or 0,
            kv_cache rows).
        Raises:
            ValueError: as :meth:`__call__` for these tensors.
        """
        kv2 = self.check_kv_cache(kv_cache)
        k2 = self._check_new_kv(k_new, kv_write_loc, batch.bs * batch.q_len, kv2)
        _check_devices(batch.workspace.device, [kv2, k2, kv_write_loc])
        return self._new_kv_args(k2, kv_write_loc, kv2)

    def _check_batch_tensors(self, kv_lens, block_table, q_len, tree_mask, req_pool_indices) -> int:
        """dtype / shape / stride checks of the per-batch tensors; returns bs."""
        v = self.variant
        _check(kv_lens, "kv_lens", torch.int32, ndim=1)
        if tree_mask is not None and not isinstance(tree_mask, torch.Tensor):
            raise ValueError(f"tree_mask must be a torch.Tensor or None, got {type(tree_mask).__name__}")
        if not kv_lens.is_contiguous():
            raise ValueError("kv_lens must be contiguous")
        bs = kv_lens.shape[0]
        if bs > 65535:
            raise ValueError(f"batch size {bs} exceeds the 65,535 requests one launch supports")
        _check(block_table, "block_table", torch.int32, ndim=2)
        if block_table.stride(1) != 1:
            raise ValueError("block_table must have a contiguous last dim")
        if bs > 0 and (block_table.shape[0] == 0 or block_table.shape[1] == 0):
            raise ValueError(f"block_table {tuple(block_table.shape)} is empty: it must hold a page per "
                             f"page_size tokens of every request")
        if req_pool_indices is not None:
            if not isinstance(req_pool_indices, torch.Tensor) or req_pool_indices.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"req_pool_indices must be int32 or int64, got {getattr(req_pool_indices, 'dtype', req_pool_indices)}")
            _check(req_pool_indices, "req_pool_indices", req_pool_indices.dtype, shape=(bs,))
            if not req_pool_indices.is_contiguous():
                raise ValueError("req_pool_indices must be contiguous")
        elif block_table.shape[0] < bs:
            raise ValueError(f"block_table has {block_table.shape[0]} rows for a batch of {bs} (pass req_pool_indices?)")
        if v.mask == "tree":
            if tree_mask is None:
                raise ValueError(f"{v.uri} uses a tree mask: pass tree_mask int64 [bs, q_len]")
            _check(tree_mask, "tree_mask", torch.int64, shape=(bs, q_len))
            if tree_mask.stride(1) != 1:
                raise ValueError("tree_mask must have a contiguous last dim")
        return bs

    def _checked_workspace(self, workspace, bs: int, splits: int, device, others: dict) -> torch.Tensor:
        """The workspace for (bs, splits), allocated when None; checks size, alignment, no overlap with ``others``."""
        need = self.workspace_floats(bs * splits)
        if workspace is None:
            workspace = _new_workspace(need, device, self._can_fuse)
        _check(workspace, "workspace", torch.float32, ndim=1)
        if not workspace.is_contiguous() or workspace.numel() < need or workspace.data_ptr() % 16:
            raise ValueError(f"workspace must be contiguous, 16-byte aligned fp32 with >= {need} elements "
                             f"(alloc_workspace({bs})), got {workspace.numel()} elements, contiguous "
                             f"{workspace.is_contiguous()}, address % 16 = {workspace.data_ptr() % 16}")
        _check_no_overlap(workspace, need, others)
        return workspace

    def _batch_run_args(self, block_table, req_pool_indices, kv_lens, tree_mask, workspace, bs: int, q_len: int,
                        splits: int) -> tuple[tuple, tuple]:
        """module.run's per-batch arguments, in its order: (those between kv_cache and out, those between lse
        and the scale). The workspace holds its header, o_part [bs, splits, rows_max, dim_v], then lse_part (fp32)."""
        o_part, lse_part = self._workspace_parts(workspace, bs, splits)
        head = (block_table.data_ptr(), block_table.stride(0),
                req_pool_indices.data_ptr() if req_pool_indices is not None else 0,
                int(req_pool_indices is not None and req_pool_indices.dtype == torch.int64), kv_lens.data_ptr(),
                tree_mask.data_ptr() if tree_mask is not None else 0, tree_mask.stride(0) if tree_mask is not None else 0,
                o_part, lse_part)
        return head, self._run_tail(bs, q_len, splits, workspace)

    def _workspace_parts(self, workspace, bs: int, splits: int) -> tuple[int, int]:
        """Addresses of the workspace's o_part [bs, splits, rows_max, dim_v] (after the header; fp32-sized, bf16
        partials in its first half) and the fp32 lse_part after it."""
        o_part = workspace.data_ptr() + WS_HEADER_FLOATS * 4
        return o_part, o_part + bs * splits * self.variant.rows_max * self.variant.dim_v * 4

    def merge_counters(self, workspace) -> int:
        """The address of ``workspace``'s merge counters when this launch may fold the combine in (the module
        supports it, :attr:`fused_merge` is set and mlagen zeroed the workspace's header), else 0. The module then
        uses them only if the grid is co-resident on the device (include/mlagen/mla_verify_launch.cuh)."""
        if not (self.fused_merge and self._can_fuse):
            return 0
        ptr = workspace.data_ptr()
        return ptr if _ZEROED_WORKSPACES.get(ptr) is not None else 0

    @property
    def _can_fuse(self) -> bool:
        """Whether this module can fold the combine in (a diagnostic build: MLAGEN_DST_MERGE=1, run ABI 3)."""
        return bool(getattr(self.module, "fused_merge", False)) and self._run_abi >= 3

    @property
    def _run_abi(self) -> int:
        return int(getattr(self.module, "run_abi", 1))

    def _run_tail(self, bs: int, q_len: int, splits: int, workspace) -> tuple:
        """module.run's arguments after the draft rows and before the scale: (bs, q_len, splits, min tiles per
        split[, merge counters: ABI 3])."""
        tail = (bs, q_len, splits, self.min_tiles_per_split())
        return tail + (self.merge_counters(workspace),) if self._run_abi >= 3 else tail

    def _run_module(self, q, kv2, head: tuple, tail: tuple, out, lse, softmax_scale: float, stream: int,
                    new_kv: tuple = (), direct: bool = False) -> None:
        lse_args = (lse.data_ptr(), lse.stride(0)) if lse is not None else (0, 0)
        if direct or self.has_new_kv:  # ABI 2 (run_direct too): the draft-row arguments sit between lse and bs
            kv_args = new_kv or _NO_NEW_KV
        elif new_kv:
            raise ValueError(f"{self.variant.uri}: this build has no draft-row support (k_new); rebuild it")
        else:
            kv_args = ()
        # one stride() tuple per tensor (a third of the host time of stride(i) + dim() calls); a 2-D q / out
        # ([T, H * D]) has its heads D elements apart
        qs, os_ = q.stride(), out.stride()
        v = self.variant
        (self.module.run_direct if direct else self.module.run)(
            q.data_ptr(), qs[0], qs[1] if len(qs) == 3 else v.dim_qk, kv2.data_ptr(), kv2.stride()[0], *head,
            out.data_ptr(), os_[0], os_[1] if len(os_) == 3 else v.dim_v, *lse_args, *kv_args, *tail,
            float(softmax_scale), stream)

    def _launch(self, q, kv2, block_table, req_pool_indices, kv_lens, tree_mask, workspace, out, lse, bs, q_len, splits,
                softmax_scale, new_kv: tuple = ()):
        head, tail = self._batch_run_args(block_table, req_pool_indices, kv_lens, tree_mask, workspace, bs, q_len,
                                          splits)
        with torch.cuda.device(q.device):
            self._run_module(q, kv2, head, tail, out, lse, softmax_scale, torch.cuda.current_stream(q.device).cuda_stream,
                             new_kv)
        return out, lse


class MetadataFill:
    """:meth:`VerifyKernel.fill_metadata` with its output buffers and req_to_token already checked (from
    :meth:`VerifyKernel.metadata_filler`, which holds them alive). Calling it checks the step's inputs and
    launches include/mlagen/mla_verify_metadata.cuh on the current stream (no allocation, no host sync)."""

    def _check_sizes(self, bs: int, rpi_len: int, extra, num_padding, npages, q_len) -> None:
        """The step's sizes against the bound buffers (host ints only): every write and read of the fill stays inside
        kv_lens [:bs], block_table [:bs, :npages], tree_mask [:bs, :q_len] and req_to_token's width."""
        kv_lens, block_table, req_to_token, tree_mask = self._keep
        for name, x, lo, hi in (("extra", extra, 0, 2**31 - 1), ("num_padding", num_padding, 0, bs),
                                ("npages", npages, 0, block_table.shape[1]), ("q_len", q_len, 0, 64)):
            if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
                raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {x!r}")
        if rpi_len < bs or kv_lens.shape[0] < bs or block_table.shape[0] < bs:
            raise ValueError(f"a batch of {bs} requests needs >= {bs} req_pool_indices, kv_lens and block_table rows; "
                             f"got {rpi_len}, {kv_lens.shape[0]} and {block_table.shape[0]}")
        if npages > 0 and (npages - 1) * self._page_size >= req_to_token.shape[1]:
            raise ValueError(f"npages {npages} at page_size {self._page_size} reads past req_to_token's "
                             f"{req_to_token.shape[1]} columns")
        if tree_mask is not None and (tree_mask.shape[0] < bs or q_len > tree_mask.shape[1]):
            raise ValueError(f"tree_mask {tuple(tree_mask.shape)} is smaller than the batch's [{bs}, {q_len}]")

    __slots__ = ("_module", "_device_index", "_table", "_outs", "_has_tree", "_page_size", "_keep")

    def __init__(self, module, device_index, table: tuple, outs: tuple, has_tree: bool, page_size: int, keep: tuple):
        self._module, self._device_index, self._table, self._outs = module, device_index, table, outs
        self._has_tree, self._page_size, self._keep = has_tree, page_size, keep

    def __call__(self, seq_lens, req_pool_indices, *, extra: int, num_padding: int, npages: int, q_len: int = 0,
                 tree_mode: str | None = None, custom_mask=None) -> None:
        """Fill the bound buffers for this step (arguments and errors as :meth:`VerifyKernel.fill_metadata`)."""
        for name, t in (("seq_lens", seq_lens), ("req_pool_indices", req_pool_indices)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"{name} must be a 1-D torch.Tensor, got "
                                 f"{f'shape {tuple(t.shape)}' if isinstance(t, torch.Tensor) else type(t).__name__}")
        if seq_lens.dtype not in INDEX_DTYPES or req_pool_indices.dtype not in INDEX_DTYPES:
            raise ValueError(f"seq_lens and req_pool_indices must be int32 or int64, got {seq_lens.dtype} and "
                             f"{req_pool_indices.dtype}")
        if not (seq_lens.is_contiguous() and req_pool_indices.is_contiguous()):
            raise ValueError("seq_lens and req_pool_indices must be contiguous")
        _check_devices(self._keep[0].device, [seq_lens, req_pool_indices, custom_mask])
        self._check_sizes(seq_lens.shape[0], req_pool_indices.shape[0], extra, num_padding, npages, q_len)
        if self._has_tree:
            mode = _TREE_MODES.get(tree_mode)
            if mode is None:
                raise ValueError(f"tree_mode must be one of {sorted(_TREE_MODES)} with a tree_mask, got {tree_mode!r}")
            if mode != _TREE_CAUSAL and (custom_mask is None or custom_mask.dtype not in (torch.bool, torch.uint8)
                                         or not custom_mask.is_contiguous()):
                raise ValueError(f"tree_mode {tree_mode!r} needs a contiguous bool/uint8 custom_mask, got "
                                 f"{getattr(custom_mask, 'dtype', None)}")
        self.launch(seq_lens, req_pool_indices, extra=extra, num_padding=num_padding, npages=npages, q_len=q_len,
                    tree_mode=tree_mode, custom_mask=custom_mask)

    def launch(self, seq_lens, req_pool_indices, *, extra: int, num_padding: int, npages: int, q_len: int = 0,
               tree_mode: str | None = None, custom_mask=None) -> None:
        """:meth:`__call__` without its layout and size checks, for a caller that made them (the SGLang backend, once
        per step: it picks this path or its torch helpers by the same tests and sizes its own buffers for the batch):
        seq_lens / req_pool_indices int32 or int64, contiguous, on the buffers' device; sizes the bound buffers hold
        (:meth:`_check_sizes`); with a tree_mask, tree_mode one of ``causal`` / ``qlen_only`` / ``full_mask`` and,
        unless causal, a contiguous bool/uint8 custom_mask.

        Raises:
            ValueError: a QLEN_ONLY custom_mask with fewer cells than (bs - num_padding) * q_len^2.
            RuntimeError: sizes out of range for the kernel, or the launch failed.
        """
        bs = seq_lens.shape[0]
        mode, mask_ptr, mask_numel = _TREE_NONE, 0, 0
        if self._has_tree:
            mode = _TREE_MODES[tree_mode]
            if mode != _TREE_CAUSAL:
                mask_ptr, mask_numel = custom_mask.data_ptr(), custom_mask.numel()
                need = (bs - num_padding) * q_len * q_len
                if mode == _TREE_QLEN and mask_numel < need:
                    raise ValueError(f"QLEN_ONLY verify mask has {mask_numel} elements, {need} needed "
                                     f"for {bs - num_padding} requests of {q_len} draft tokens")
        idx = self._device_index
        args = (seq_lens.data_ptr(), int(seq_lens.dtype == torch.int64), req_pool_indices.data_ptr(),
                int(req_pool_indices.dtype == torch.int64), *self._table, mask_ptr, mask_numel, *self._outs, bs,
                num_padding, extra, npages, self._page_size, q_len, mode, _raw_stream(idx))
        if idx == torch.cuda.current_device():
            self._module.fill_metadata(*args)
        else:
            with torch.cuda.device(idx):
                self._module.fill_metadata(*args)


_NO_NEW_KV = (0, 0, 0, 0)
_FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def fused_merge_default() -> bool:
    """The default of :attr:`VerifyKernel.fused_merge`: True unless the environment sets MLAGEN_FUSED_MERGE=0."""
    return os.environ.get("MLAGEN_FUSED_MERGE", "1") != "0"


def _new_workspace(numel: int, device, zero_header: bool) -> torch.Tensor:
    """An fp32 workspace of ``numel`` elements; with ``zero_header`` its merge-counter header is zeroed (on the current
    stream) and registered as such, else left as allocated (a module that cannot merge never reads it)."""
    ws = torch.empty(numel, dtype=torch.float32, device=device)
    if zero_header:
        ws[:WS_HEADER_FLOATS].zero_()
        _ZEROED_WORKSPACES[ws.data_ptr()] = ws
    return ws


_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent in CPU-only torch builds


def _raw_stream(device_index: int) -> int:
    """The current stream's cudaStream_t on a device (what ``torch.cuda.current_stream().cuda_stream``
    returns, without building a Stream object: the per-layer launch's host time; Triton's launcher
    reads it the same way)."""
    if _GET_RAW_STREAM is not None:
        return _GET_RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) that a strided tensor can touch."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _rows_overlap(t: torch.Tensor) -> bool:
    """Whether two of the last-dim rows of a 3-D tensor with a contiguous last dim share memory: with its two outer
    dims ordered by stride (a dim of size 1 left out), the smaller stride must be at least the row length and the
    larger at least the smaller dim's extent (any order: token-major or head-major)."""
    dims = sorted((st, n) for n, st in zip(t.shape[:2], t.stride()[:2]) if n > 1)
    extent = t.shape[2]
    for st, n in dims:
        if st < extent:
            return True
        extent = st * n
    return False


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of two tensors intersect (empty tensors never do)."""
    return bool(a.numel() and b.numel() and _span(a)[0] < _span(b)[1] and _span(b)[0] < _span(a)[1])


def _check_no_overlap(workspace: torch.Tensor, numel: int, others: dict) -> None:
    """ValueError when the first ``numel`` fp32 elements of ``workspace`` overlap a tensor of ``others`` (name ->
    tensor or None)."""
    ws_lo, ws_hi = workspace.data_ptr(), workspace.data_ptr() + numel * 4
    for name, t in others.items():
        if t is not None and t.numel() and _span(t)[0] < ws_hi and ws_lo < _span(t)[1]:
            raise ValueError(f"workspace overlaps {name}")


def _check_devices(device, tensors) -> None:
    """Every tensor (None skipped) on ``device``, a CUDA device."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"all tensors must be on a CUDA device; got a tensor on {t.device}")
        if t.device != device:
            raise ValueError(f"all tensors must be on {device}; got a tensor on {t.device}")


@dataclasses.dataclass(frozen=True)
class VerifyBatch:
    """A batch's metadata validated by :meth:`VerifyKernel.check_batch` (tensors as passed to it), or a step of
    SGLang's batch state from :meth:`VerifyKernel.direct_batch` (``direct``: kv_lens None, block_table the
    req_to_token, tree_mask the shared tree rows or None)."""

    bs: int
    q_len: int
    splits: int
    kv_lens: torch.Tensor | None
    block_table: torch.Tensor
    tree_mask: torch.Tensor | None
    req_pool_indices: torch.Tensor | None
    workspace: torch.Tensor
    launch_args: tuple = ()  # (run's batch arguments before out, after lse, device index): see check_batch
    direct: bool = False  # launched by module.run_direct (mla_verify_batch.cuh)
    keep: tuple = ()  # the step's other tensors (seq_lens, the QLEN_ONLY mask), held while the batch lives

    @classmethod
    def _new(cls, bs, q_len, splits, kv_lens, block_table, tree_mask, req_pool_indices, workspace, launch_args,
             direct, keep) -> "VerifyBatch":
        """The same instance as ``VerifyBatch(...)`` with every field given, without the frozen dataclass's
        per-field ``object.__setattr__`` (4 µs of the SGLang backend's ~20 µs eager step metadata, on a 2-core
        x86 host; ~0.7 µs this way)."""
        b = object.__new__(cls)
        b.__dict__.update(bs=bs, q_len=q_len, splits=splits, kv_lens=kv_lens, block_table=block_table,
                          tree_mask=tree_mask, req_pool_indices=req_pool_indices, workspace=workspace,
                          launch_args=launch_args, direct=direct, keep=keep)
        return b


@dataclasses.dataclass(frozen=True)
class DirectPlan:
    """What :meth:`VerifyKernel.direct_plan` validated for one batch size: req_to_token int32 [rows, width],
    the workspace, and module.run_direct's arguments derived from them."""

    bs: int
    q_len: int
    splits: int
    req_to_token: torch.Tensor
    workspace: torch.Tensor
    table: tuple  # (address, row stride, rows, width)
    ws_args: tuple  # (o_part address, lse_part address)
    tail: tuple  # (bs, q_len, splits, min tiles per split[, merge counters: run ABI 3])
    device_index: int


def _check(t, name: str, dtype: torch.dtype, shape: tuple | None = None, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def load_so(uri: str, so_path: str | Path) -> VerifyKernel:
    """Load a variant from an explicit .so path (as recorded in the registry or the installed state);
    the variant's parameters come from its uri.

    Raises:
        ValueError: ``uri`` is not an mlagen variant uri (:meth:`~mlagen.spec.Variant.from_uri`).
        ImportError: the .so cannot be loaded, or its module name is already loaded from another build.
    """
    return VerifyKernel(Variant.from_uri(uri), so_path)


def load_variant(uri: str) -> VerifyKernel:
    """Load a built variant by uri from the registry.

    Raises:
        KeyError: the uri was never built (run ``mlagen build SPEC``).
        ImportError: the registered .so cannot be loaded, or its module name is already loaded from another build.
    """
    from mlagen.registry import Registry

    row = Registry().get_variant(uri)
    if row is None:
        raise KeyError(f"{uri} is not in the registry; build it with `mlagen build SPEC`")
    return VerifyKernel(Variant.from_dict(row["variant"]), row["so_path"])
