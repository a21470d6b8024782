"""FlashInfer MLA (``BatchMLAPagedAttentionWrapper``) as timing / correctness baselines for run_bench.

Three columns, each run on run_bench's problem (sglang_baselines.make_problem: the same q, KV pool,
page table and lengths mlagen is timed on):

* ``fa2``        backend="fa2" (mma.sync, FlashAttention-2 style) with the configuration FlashInfer picks
                 on this GPU (H200: 2 stages of 64 KV rows, QK shard; 228 KB of shared memory per SM).
* ``fa2@sm120``  backend="fa2" with the configuration FlashInfer picks on a GPU with 100 KB of shared
                 memory per SM (RTX PRO 6000 Blackwell, sm_120: 1 stage of 16 KV rows, no QK shard).
                 mla.cuh's DISPATCH_SMEM_CONFIG reads cudaDevAttrMaxSharedMemoryPerMultiprocessor in C++
                 at every launch, so no Python patch can reach it: the fa2 sources are built a second
                 time, under their own module name (``<fa2 uri>_mlagen_smem102400``), with
                 ``nvcc -include bench/fi_smem_override.h -DMLAGEN_FI_SMEM_PER_SM=102400``, a header that
                 wraps cudaDeviceGetAttribute so that attribute reads at most 102400. While planning, the
                 Python side is patched to match: ``_fa_common._get_fa_shared_memory_limits`` answers
                 (102400, 101376) (sm_120's per-SM and per-block opt-in limits; it picks the same tile
                 for its plan checks) and ``fa2_backend.get_batch_mla_module`` loads that module.
                 FlashInfer's files on disk are never edited. The persistent grid is one CTA per SM
                 either way, as the ~92 KB CTA would run on sm_120.
* ``fa3``        backend="fa3" (wgmma, Hopper only; left out on other GPUs).

FlashInfer's MLA has no tree mask: every column is planned ``causal=True`` (query i of a request sees
the prefix and draft tokens 0..i, the mask of the last q_len tokens), so run_bench compares it with a
causal mlagen output (its tree kernel with a chain tree, which is the causal mask).

One plan per (problem, column): the rotated copies run_bench times over (to defeat L2) share it and its
page list, as a model's layers share one FlashInfer plan; q, KV pool and output are per copy.
Timing: sglang_baselines._time_rotating (one CUDA graph over all copies, median of replays), the helper
run_bench times mlagen and SGLang with.

Nothing here imports torch or flashinfer at module import time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import sglang_baselines as sgl  # noqa: E402

COLUMNS = ("fa2", "fa2@sm120", "fa3")
KEYS = {"fa2": "fi_fa2", "fa2@sm120": "fi_fa2_sm120", "fa3": "fi_fa3"}  # row key prefix: <key>_us
LABELS = {"fa2": "FI fa2", "fa2@sm120": "FI fa2 @sm120", "fa3": "FI fa3 (Hopper only)"}
SM120_SMEM_PER_SM = 102400  # = mlagen.ops.SM120_SMEM_PER_SM (kept torch-free here)
SM120_SMEM_PER_BLOCK = 101376  # sm_120 opt-in per block (= mlagen.tables.SMEM_LIMIT["sm_120"])
OVERRIDE_HEADER = HERE / "fi_smem_override.h"
WORKSPACE_BYTES = 128 << 20  # FlashInfer's suggested float workspace
D_CKV, D_KPE = 512, 64


class FlashInferUnavailable(RuntimeError):
    """flashinfer (or torch / CUDA) is missing: the reason is the message."""


def label(column: str, smem_per_sm: int = SM120_SMEM_PER_SM) -> str:
    if column == "fa2@sm120" and smem_per_sm != SM120_SMEM_PER_SM:
        return f"FI fa2 @{smem_per_sm} B/SM"
    return LABELS[column]


def parse_columns(text: str) -> list[str]:
    """``--fi-columns`` value: comma-separated names from COLUMNS (order kept, duplicates dropped).

    Raises:
        ValueError: a name not in COLUMNS, or no name at all.
    """
    cols = []
    for c in (x.strip() for x in text.split(",")):
        if not c:
            continue
        if c not in COLUMNS:
            raise ValueError(f"unknown FlashInfer column {c!r}; choose from {', '.join(COLUMNS)}")
        if c not in cols:
            cols.append(c)
    if not cols:
        raise ValueError("no FlashInfer column named")
    return cols


def default_columns(cc_major: int, smem_mode: bool) -> list[str]:
    """Native run: fa2, fa2@sm120 and (Hopper) fa3; with --smem-per-sm (mlagen at sm_120 occupancy):
    fa2@sm120 only, the kernel an sm_120 user gets."""
    if smem_mode:
        return ["fa2@sm120"]
    return ["fa2", "fa2@sm120"] + (["fa3"] if cc_major == 9 else [])


def usable_columns(cols: list[str], cc_major: int) -> tuple[list[str], list[str]]:
    """(columns this GPU can run, one note per dropped column)."""
    keep, notes = [], []
    for c in cols:
        if c == "fa3" and cc_major != 9:
            notes.append(f"{LABELS[c]} left out: needs sm_90 (this GPU is sm_{cc_major}x)")
        else:
            keep.append(c)
    return keep, notes


def smem_per_block(smem_per_sm: int) -> int:
    """The opt-in shared memory per block of a GPU with ``smem_per_sm`` per SM: sm_120's 101376 for its
    102400, else 1 KB (the CTA reservation) less."""
    return SM120_SMEM_PER_BLOCK if smem_per_sm == SM120_SMEM_PER_SM else smem_per_sm - 1024


# --------------------------------------------------------------------------- import

_fi = None
_import_error: str | None = None


def _ensure_cuda_home() -> None:
    """FlashInfer's JIT takes the toolkit from CUDA_HOME, else from `which nvcc`'s parent's parent, which
    is wrong for an nvcc outside the toolkit tree (/usr/local/bin/nvcc: no /usr/local/lib64/libcudart):
    without CUDA_HOME, set it to the first of (the real nvcc's toolkit, /usr/local/cuda) that has both
    include/cuda_runtime.h and lib64/libcudart.so."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    cands = []
    try:
        from mlagen.ninja_gen import nvcc_path

        cands.append(Path(os.path.realpath(nvcc_path())).parent.parent)
    except Exception:  # noqa: BLE001 — FlashInfer then searches itself
        pass
    cands.append(Path("/usr/local/cuda"))
    for home in cands:
        if (home / "include" / "cuda_runtime.h").exists() and any((home / "lib64").glob("libcudart.so*")):
            os.environ["CUDA_HOME"] = str(home)
            return


def _load():
    global _fi, _import_error
    if _fi is not None:
        return _fi
    if _import_error is not None:
        raise FlashInferUnavailable(_import_error)
    try:
        import torch

        if not torch.cuda.is_available():
            raise FlashInferUnavailable("no CUDA GPU visible to torch")
        _ensure_cuda_home()
        import flashinfer
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata  # noqa: F401
    except FlashInferUnavailable as e:
        _import_error = str(e)
        raise
    except Exception as e:  # noqa: BLE001
        _import_error = f"flashinfer not importable: {type(e).__name__}: {e}"
        raise FlashInferUnavailable(_import_error) from None
    _fi = flashinfer
    return _fi


def flashinfer_available() -> tuple[bool, str]:
    """(ok, reason): ok when torch sees a GPU and flashinfer's MLA wrapper imports; reason names the
    version and location. Never raises."""
    try:
        fi = _load()
    except FlashInferUnavailable as e:
        return False, str(e)
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}"
    return True, f"flashinfer {getattr(fi, '__version__', '?')} ({Path(fi.__file__).parent})"


# --------------------------------------------------------------------------- modules

def _mla_spec(backend: str):
    import torch
    from flashinfer.jit import gen_batch_mla_module

    return gen_batch_mla_module(backend, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32,
                                D_CKV, D_KPE, False)


def smem_module_spec(smem_per_sm: int):
    """The fa2 MLA module built to see ``smem_per_sm`` bytes of shared memory per SM (see module doc)."""
    from flashinfer.jit.core import gen_jit_spec

    base = _mla_spec("fa2")
    return gen_jit_spec(f"{base.name}_mlagen_smem{int(smem_per_sm)}", base.sources,
                        extra_cuda_cflags=["-include", str(OVERRIDE_HEADER), f"-DMLAGEN_FI_SMEM_PER_SM={int(smem_per_sm)}"],
                        post_load_adapter=base.post_load_adapter)


def module_spec(column: str, smem_per_sm: int = SM120_SMEM_PER_SM):
    return smem_module_spec(smem_per_sm) if column == "fa2@sm120" else _mla_spec("fa3" if column == "fa3" else "fa2")


_smem_modules: dict[int, object] = {}


def _smem_module(smem_per_sm: int):
    if smem_per_sm not in _smem_modules:
        _smem_modules[smem_per_sm] = smem_module_spec(smem_per_sm).build_and_load()
    return _smem_modules[smem_per_sm]


def prebuild(columns: list[str], smem_per_sm: int = SM120_SMEM_PER_SM) -> dict[str, str]:
    """JIT-compile the columns' modules, each in its own thread (ninja and nvcc do the work, in
    parallel with whatever the caller builds meanwhile). Returns {column: error} for the columns whose module
    failed to build.

    Raises:
        FlashInferUnavailable: torch sees no GPU or flashinfer does not import (checked first; nothing is built).
    """
    _load()
    errors: dict[str, str] = {}
    specs = {}
    for c in columns:
        try:
            specs[c] = module_spec(c, smem_per_sm)
        except Exception as e:  # noqa: BLE001
            errors[c] = f"{type(e).__name__}: {e}"

    def one(c, spec):
        try:
            spec.build_and_load()
        except Exception as e:  # noqa: BLE001
            errors[c] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"

    threads = [threading.Thread(target=one, args=(c, s)) for c, s in specs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def prebuild_in_background(columns: list[str], smem_per_sm: int = SM120_SMEM_PER_SM):
    """Start prebuild() in a thread; returns a function that waits and gives (seconds, {column: error})."""
    t0, box = time.time(), {}
    th = threading.Thread(target=lambda: box.update(err=prebuild(columns, smem_per_sm)), daemon=True)
    th.start()

    def wait():
        th.join()
        return time.time() - t0, box.get("err", {c: "prebuild did not finish" for c in columns})
    return wait


@contextlib.contextmanager
def _sm120_planning(smem_per_sm: int, per_block: int):
    """While planning: FlashInfer's Python smem query answers the emulated GPU's limits and the fa2
    backend loads the module built with fi_smem_override.h."""
    from flashinfer.mla._batch_mla._backends import _fa_common, fa2_backend

    saved = (_fa_common._get_fa_shared_memory_limits, fa2_backend.get_batch_mla_module)
    module = _smem_module(smem_per_sm)
    _fa_common._get_fa_shared_memory_limits = lambda device: (smem_per_sm, per_block)
    fa2_backend.get_batch_mla_module = lambda *a, **k: module
    try:
        yield
    finally:
        _fa_common._get_fa_shared_memory_limits, fa2_backend.get_batch_mla_module = saved


# --------------------------------------------------------------------------- plan / run

def csr_metadata(p: dict) -> dict:
    """FlashInfer's CSR view of a run_bench problem: qo_indptr (q_len per request), kv_indptr over
    pages, kv_indices = page ids (the same page table mlagen gets), kv_len_arr = kv_lens (draft tokens
    included). All int32 on the problem's device."""
    import torch

    bs, q_len, P = p["bs"], p["q_len"], p["page_size"]
    table = p["req_to_token"] if P == 1 else (p["req_to_token"][:, ::P] // P)
    table = table.to(torch.int32).contiguous()
    dev = table.device
    return dict(qo_indptr=torch.arange(bs + 1, dtype=torch.int32, device=dev) * q_len,
                kv_indptr=torch.arange(bs + 1, dtype=torch.int32, device=dev) * table.shape[1],
                kv_indices=table.reshape(-1), kv_len_arr=p["kv_lens"].to(torch.int32))


def paged_kv(p: dict):
    """The KV pool [num_slots, 576] as FlashInfer's packed paged cache [num_pages, page_size, 576] (a view)."""
    return p["kv_cache"].view(-1, p["page_size"], D_CKV + D_KPE)


class FiMLA:
    """One planned causal BatchMLAPagedAttentionWrapper for problem ``p``; ``self(q, kv3, out)`` runs it
    on q [T, H, 576] and paged_kv(...) of any copy of ``p`` (same shapes, same page table)."""

    def __init__(self, p: dict, column: str, smem_per_sm: int = SM120_SMEM_PER_SM):
        import torch

        if column not in COLUMNS:
            raise ValueError(f"unknown FlashInfer column {column!r}")
        fi = _load()
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        self.column = column
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=p["q"].device)
        self.wrapper = BatchMLAPagedAttentionWrapper(self.workspace, backend="fa3" if column == "fa3" else "fa2")
        md = csr_metadata(p)
        ctx = _sm120_planning(smem_per_sm, smem_per_block(smem_per_sm)) if column == "fa2@sm120" else contextlib.nullcontext()
        with ctx:
            self.wrapper.plan(metadata=MLAPlanMetadata.csr(**md), num_heads=p["H"], head_dim_ckv=D_CKV,
                              head_dim_kpe=D_KPE, page_size=p["page_size"], causal=True,
                              sm_scale=p["softmax_scale"], q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        self.version = getattr(fi, "__version__", "?")

    def __call__(self, q, kv3, out):
        return self.wrapper.run(query=q, kv_cache=kv3, out=out)


def _out(p: dict):
    import torch

    return torch.empty(p["q"].shape[0], p["H"], D_CKV, dtype=torch.bfloat16, device=p["q"].device)


def run_fi(p: dict, column: str, smem_per_sm: int = SM120_SMEM_PER_SM):
    """FlashInfer's causal output on ``p`` -> [T, H, 512] bf16.

    Raises:
        ValueError: ``column`` is not in COLUMNS.
        FlashInferUnavailable: torch sees no GPU or flashinfer does not import.
    """
    import torch

    f = FiMLA(p, column, smem_per_sm)
    out = _out(p)
    f(p["q"], paged_kv(p), out)
    torch.cuda.synchronize()
    return out


def measure(p: dict, column: str, smem_per_sm: int = SM120_SMEM_PER_SM, ref=None) -> tuple[float, float | None]:
    """(median µs of one FlashInfer call on ``p``, max |FlashInfer - ref| or None without ``ref``).
    One plan; inputs rotated past L2 the way run_bench times mlagen: one CUDA graph over rotated copies
    of the problem (sglang_baselines._time_rotating). ``ref``: the expected causal output [T, H, 512]
    (any float dtype).

    Raises:
        ValueError: ``column`` is not in COLUMNS.
        FlashInferUnavailable: torch sees no GPU or flashinfer does not import.
    """
    import torch

    f = FiMLA(p, column, smem_per_sm)
    diff = None
    if ref is not None:
        out = _out(p)
        f(p["q"], paged_kv(p), out)
        torch.cuda.synchronize()
        diff = float((out.float() - ref.float()).abs().max())
        del out
    nbytes = sgl._problem_bytes(p)
    copies = [p] + [sgl._clone_problem(p) for _ in range(sgl._n_copies(nbytes) - 1)]
    calls = [(lambda q=c["q"], kv=paged_kv(c), o=_out(c): f(q, kv, o)) for c in copies]
    us = sgl._time_rotating(calls, None, nbytes)
    return us, diff


def time_fi(p: dict, column: str, smem_per_sm: int = SM120_SMEM_PER_SM) -> float:
    """Median µs of one FlashInfer call on ``p`` (see measure).

    Raises:
        ValueError: ``column`` is not in COLUMNS.
        FlashInferUnavailable: torch sees no GPU or flashinfer does not import.
    """
    return measure(p, column, smem_per_sm)[0]


def causal_tree_mask(bs: int, q_len: int, device):
    """int64 [bs, q_len] tree bitmasks of a chain (row i sees draft tokens 0..i): the causal mask, for
    running mlagen's tree kernels causally."""
    import torch

    return torch.tensor(sgl.tree_mask_bits([[-1] + list(range(q_len - 1))] * bs), dtype=torch.int64, device=device)


__all__ = ["COLUMNS", "KEYS", "LABELS", "FiMLA", "FlashInferUnavailable", "flashinfer_available", "run_fi", "measure",
           "time_fi", "prebuild", "prebuild_in_background", "default_columns", "usable_columns", "parse_columns",
           "causal_tree_mask", "csr_metadata", "paged_kv", "label", "smem_module_spec"]
