"""Phase costs of the partial kernel by ablation (GPU): build one variant with MLAGEN_ABLATE masks
(include/mlagen/mla_verify_partial.cuh drops the masked phases; outputs are then wrong) and time each
build at the same shapes in one process. The differences against the full kernel place the time.

    python3 tools/device_ablate.py [URI] [--contexts 4096,65536] [--batch 1] [--masks 1,2] [--build-only]

Builds go to $MLAGEN_ABLATE_DIR (default /tmp/mlagen-ablate), never into the registry. Prints a
markdown table: ablation, µs per context, and the time saved against the full build.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlagen.bench import Shape, bench_kernel  # noqa: E402
from mlagen.build import build_with_defines  # noqa: E402
from mlagen.ops import VerifyKernel  # noqa: E402
from mlagen.spec import Variant  # noqa: E402

MASKS = {0: "full kernel", 1: "no KV loads", 2: "no Q K^T MMAs", 4: "no softmax pass", 8: "no P V MMAs",
         16: "no in-tile barriers", 2 | 8: "no MMAs at all", 4 | 16: "no softmax, no in-tile barriers",
         2 | 4 | 8 | 16: "loads + loop skeleton only", 1 | 2 | 4 | 8 | 16: "loop skeleton only",
         # dimsplit_t (no in-tile barriers there; 32: no score exchange between the cluster's CTAs)
         1 | 2 | 8: "no KV loads, no MMAs", 2 | 4 | 8: "loads + handoffs + exchange (no math)",
         1 | 2 | 4 | 8: "handoffs + exchange (no loads, no math)", 32: "no score exchange",
         1 | 2 | 4 | 8 | 32: "handoffs only (no loads, math, exchange)",
         # each path alone (perf-notes v37): 46 also drops Q's loads (they feed only the Q K^T MMAs); 33 also drops the
         # page-table reads (they feed only the copies) and zeroes the ring first, as 1 does
         2 | 4 | 8 | 32: "KV copies + handoffs (no math, Q, exchange)", 1 | 32: "math + handoffs (no KV copies, exchange)",
         # fp8 (e4m3) dimsplit_t: the output warps' conversion into the bf16 stages (perf-notes v18)
         64: "no e4m3 conversion (barriers kept)", 128: "conversion without the stage-release wait",
         64 | 128: "neither conversion nor its wait",
         # bf16 dimsplit / dimsplit_t: the producer's page-table loads (position as slot; perf-notes v19)
         256: "no page-table loads", 1 | 2 | 4 | 8 | 32 | 256: "handoffs only, no page-table loads"}
FP8_DIMSPLIT_T_MASKS = (64, 128, 64 | 128)  # only an fp8_e4m3 dimsplit_t build has the conversion they drop
TABLE_MASK = 256  # only the bf16 cluster producer (dimsplit, dimsplit_t) implements it
EXCHANGE_MASK = 32  # only dimsplit_t implements it (its score warps' st.async exchange)
DEFAULT_URI = "mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lwbulk_bn32_w8_rt1_st2_tree_bf16_sm120_sm90"


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("uri", nargs="?", default=DEFAULT_URI)
    ap.add_argument("--contexts", default="4096,65536")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--build-only", action="store_true",
                    help="compile the builds and stop (a later run with the same arguments reuses them)")
    ap.add_argument("--masks", help="comma-separated MLAGEN_ABLATE masks to build (default: every mask above that the "
                    "variant has; dimsplit_t implements 1, 2, 4, 8 and 32, its fp8 build also 64 and 128, its bf16 "
                    "build (and dimsplit's) 256; 32 only dimsplit_t)")
    a = ap.parse_args()
    try:
        picked = [int(m) for m in a.masks.split(",") if m] if a.masks else None
    except ValueError:
        sys.exit(f"--masks: comma-separated integers expected, got {a.masks!r}")
    try:
        uv = Variant.from_uri(a.uri)
    except ValueError as e:
        sys.exit(f"uri: {e}")
    fp8_t = uv.schedule == "dimsplit_t" and uv.dtype == "fp8_e4m3"
    table_ok = uv.schedule in ("dimsplit", "dimsplit_t") and uv.dtype == "bf16"
    exchange_ok = uv.schedule == "dimsplit_t"
    if picked is None:
        picked = [m for m in MASKS if (fp8_t or m not in FP8_DIMSPLIT_T_MASKS) and (table_ok or not m & TABLE_MASK)
                  and (exchange_ok or not m & EXCHANGE_MASK)]
    unknown = [m for m in picked if m not in MASKS]
    if unknown:
        sys.exit(f"--masks: no ablation {unknown}; known: {sorted(MASKS)}")
    if not fp8_t and any(m in FP8_DIMSPLIT_T_MASKS for m in picked):
        sys.exit(f"--masks: {sorted(FP8_DIMSPLIT_T_MASKS)} drop the e4m3 conversion of an fp8_e4m3 dimsplit_t build; "
                 f"{a.uri} has none")
    if not table_ok and any(m & TABLE_MASK for m in picked):
        sys.exit(f"--masks: {TABLE_MASK} drops the page-table loads of the bf16 dimsplit / dimsplit_t producer; "
                 f"{a.uri} has none")
    if not exchange_ok and any(m & EXCHANGE_MASK for m in picked):
        sys.exit(f"--masks: {EXCHANGE_MASK} drops the score exchange of a dimsplit_t build; {a.uri} has none")
    masks = {0: MASKS[0]} | {m: MASKS[m] for m in picked}
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the builds are compiled for its arch); nothing built or measured", file=sys.stderr)
        return 1
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"  # (--build-only too: the device's arch, the one the timing run builds)
    v = dataclasses.replace(uv, archs=(arch,))
    out_dir = Path(os.environ.get("MLAGEN_ABLATE_DIR", "/tmp/mlagen-ablate"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ctxs = [int(c) for c in a.contexts.split(",")]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(masks), os.cpu_count() or 1)) as pool:
        # each mask its own module (build_with_defines names it by the define: CPython keeps the first module
        # imported under a name), nothing recompiled while its build key is unchanged
        built = dict(zip(masks, pool.map(lambda m: build_with_defines(v, (("MLAGEN_ABLATE", m),), out_dir), masks)))
    if a.build_only:
        print(f"built {len(built)} ablations of {a.uri} in {out_dir}")
        return 0
    rows = {}
    kernels = {mask: VerifyKernel(v, so, mod) for mask, (mod, so) in built.items()}
    for mask, k in kernels.items():
        rows[mask] = [bench_kernel(k, Shape(v.heads, v.q_len, a.batch, c, v.page_size))["median_us"] for c in ctxs]
        print(f"ablate {mask:2d} {masks[mask]:34s} " + " ".join(f"{t:8.1f}" for t in rows[mask]), flush=True)
    print(f"\n{a.uri} on {torch.cuda.get_device_name()}, bs {a.batch}, splits {kernels[0].num_splits(a.batch)}")
    print("| ablation | " + " | ".join(f"{c} µs (saved)" for c in ctxs) + " |")
    print("|---|" + "---|" * len(ctxs))
    for mask, ts in rows.items():
        cells = [f"{t:.1f} ({rows[0][i] - t:+.1f})" for i, t in enumerate(ts)]
        print(f"| {masks[mask]} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
