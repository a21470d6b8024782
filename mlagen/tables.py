"""One table per enum: spec value -> C++ spelling and short uri token.

Templates receive only ints and the vetted strings from these tables, never raw spec text
(pattern of CUTLASS ``library.py`` DataTypeTag / ShortDataTypeNames).
"""

MASKS = {
    # spec value: (C++ enumerator, uri token)
    "none": ("mlagen::MaskKind::kNone", "none"),
    "causal": ("mlagen::MaskKind::kCausal", "causal"),
    "tree": ("mlagen::MaskKind::kTree", "tree"),
}

SCHEDULES = {
    # spec value: uri token ("" = absent from the uri, the default). rowblock: row-block CTAs, each
    # reads its split's KV (mla_verify_partial.cuh); dimsplit: a two-CTA cluster splits the 576 dims
    # and reads the KV once per split (mla_verify_dimsplit.cuh); dimsplit_t: the same cluster with the
    # MMAs transposed (tokens / output dims as M, rows as N) and separate score and output warps
    # (mla_verify_dimsplit_t.cuh).
    "rowblock": "",
    "dimsplit": "dimsplit",
    "dimsplit_t": "dimsplit_t",
}

# Schedules that run a two-CTA cluster per (row block, split, request) and read the KV once per split.
CLUSTER_SCHEDULES = ("dimsplit", "dimsplit_t")
DIMSPLIT_T_ROWS_PER_SCORE_WARP = 24  # dimsplit_t: a score warp holds 3 n8 row tiles of Q (MlaDimSplitTConfig)

DTYPES = {
    # spec value (the KV cache's dtype; q and out are bf16): (C++ KV element type, uri token)
    "bf16": ("__nv_bfloat16", "bf16"),
    # e4m3 KV cache (SGLang --kv-cache-dtype fp8_e4m3), dequantized to bf16 in shared memory (dimsplit, dimsplit_t)
    "fp8_e4m3": ("__nv_fp8_e4m3", "fp8e4m3"),
}

ARCHS = {
    # spec value: (nvcc -gencode argument, compute capability)
    "sm_120": ("arch=compute_120,code=sm_120", (12, 0)),
    "sm_90": ("arch=compute_90,code=sm_90", (9, 0)),
}

# Per-arch limits used by the feasibility filter (bytes of dynamic shared memory per block).
SMEM_LIMIT = {"sm_120": 101376, "sm_90": 232448}


def arch_of_capability(major: int, minor: int) -> str:
    """Map a CUDA compute capability (e.g. ``(9, 0)``) to an arch key of :data:`ARCHS` ("sm_90").

    Raises:
        KeyError: the capability has no entry (mlagen builds only sm_120 and sm_90).
    """
    for name, (_, cc) in ARCHS.items():
        if cc == (major, minor):
            return name
    raise KeyError(f"no mlagen arch for compute capability {major}.{minor}; supported: {sorted(ARCHS)}")
