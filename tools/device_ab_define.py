"""A/B timing of one variant built with a diagnostic define at several values (GPU), in one process:
each value is its own module (``#define NAME value`` ahead of the rendered source), every shape is timed
for every build in alternating rounds (the median of the rounds is printed), so clock and machine drift
fall on all builds alike; first, each build's output is compared bit for bit with the first's on one problem
per shape (a difference stops the run; with --atol, a max |difference| above it). Diagnostic defines:
MLAGEN_DST_PROLOGUE, MLAGEN_DST_PRODUCER, MLAGEN_DST_TREE_ROWS, MLAGEN_DST_FP8_CONVERT, MLAGEN_DST_MASK_PEEL,
MLAGEN_DST_MERGE, MLAGEN_DST_L2_PREFETCH, MLAGEN_DST_BULK, MLAGEN_DST_HALF_K, MLAGEN_DST_PBUFS, MLAGEN_DST_XBUFS,
MLAGEN_DST_EPILOGUE, MLAGEN_DST_RESCALE_SLACK, MLAGEN_DST_RESCALE_FLAG, MLAGEN_DST_PDL, MLAGEN_DST_XCHG_F16,
MLAGEN_DST_COPY_L1,
MLAGEN_DST_TRACE (include/mlagen/mla_verify_dimsplit_t.cuh; read by tools/dst_trace.py),
MLAGEN_DST_PARTIAL_BF16 (mla_verify_partial_store.cuh), MLAGEN_COMBINE_UNROLL (mla_verify_combine.cuh),
MLAGEN_MERGE_DIAG (include/mlagen/mla_verify_merge.cuh),
MLAGEN_MBAR_WAIT, MLAGEN_CP_ASYNC_CA (include/mlagen/ptx.cuh),
MLAGEN_ROWBLOCK_PDL (include/mlagen/mla_verify_config.cuh),
MLAGEN_BATCH_DIRECT (include/mlagen/mla_verify_batch.cuh), MLAGEN_ABLATE (include/mlagen/mla_verify_partial.cuh).
Several --define options are zipped: build i gets the i-th value of each (all must list as many values).

    python3 tools/device_ab_define.py URI --define MLAGEN_DST_PROLOGUE=0,1 [--contexts 4096,65536] [--batches 1,4]
        [--build-only]
    python3 tools/device_ab_define.py URI --define MLAGEN_DST_PRODUCER=1,0,1,0 --define MLAGEN_DST_TREE_ROWS=1,1,0,0
    python3 tools/device_ab_define.py URI --define MLAGEN_DST_MERGE=0,1,1 --define AB_TAG=0,0,1 --fused-merge 1,0,1 \
        --define MLAGEN_DST_PARTIAL_BF16=0,0,0 --atol 0.0625
        # the merge code built but unused, and used (its fp32 sums run in another order; the merge reads fp32 partials)
    python3 tools/device_ab_define.py URI --define MLAGEN_DST_PARTIAL_BF16=0,1 --atol 0.0625  # fp32 vs bf16 partials
    python3 tools/device_ab_define.py URI --define MLAGEN_DST_XCHG_F16=0,2 --atol 0.0625  # fp32 vs fp16 score exchange
    python3 tools/device_ab_define.py URI_st4 --variants URI_st6,URI_st8  # deeper rings (this GPU's smem limit)

Builds go to $MLAGEN_ABLATE_DIR (default /tmp/mlagen-ablate), never into the registry. Prints a markdown
table: shape, µs per build (median of --rounds CUDA-graph medians), and each build's ratio to the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlagen.bench import Shape, bench_kernel, make_problem  # noqa: E402
from mlagen.build import build_with_defines  # noqa: E402
from mlagen.ops import VerifyKernel  # noqa: E402
from mlagen.spec import Variant  # noqa: E402


def diagnostic_dir() -> Path:
    """Where diagnostic builds go: $MLAGEN_ABLATE_DIR (default /tmp/mlagen-ablate), created if missing; never the
    registry."""
    out_dir = Path(os.environ.get("MLAGEN_ABLATE_DIR", "/tmp/mlagen-ablate"))
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("uri")
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=v1,v2[,...]: the builds to compare (the first is the base); repeated: zipped")
    ap.add_argument("--variants", default="",
                    help="URI[,URI...]: further builds of other tiles of the same shape fields (e.g. another stage "
                    "count; built for this GPU's arch only, so its shared-memory limit applies), each with the first "
                    "build's defines")
    ap.add_argument("--contexts", default="4096,16384,65536,131072")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--atol", type=float, default=0.0,
                    help="largest max |difference| of a build's output from the first's (default 0: bit-identical; "
                    "inf: no comparison, for builds whose outputs are wrong by design, e.g. MLAGEN_MERGE_DIAG)")
    ap.add_argument("--fused-merge", help="per build, 1 or 0: whether its launches may fold the combine in "
                    "(VerifyKernel.fused_merge; default 1 for every build)")
    ap.add_argument("--build-only", action="store_true",
                    help="compile the builds and stop (a later run with the same arguments reuses them)")
    a = ap.parse_args()
    defs = []
    extra = [u for u in a.variants.split(",") if u]
    if not a.define and not extra:
        sys.exit("give --define NAME=v1,v2[,...] and / or --variants URI[,...]")
    if not a.define:
        a.define = ["AB_BASE=0"]  # (one build of URI, a define nothing reads)
    for d in a.define:
        name, _, vals = d.partition("=")
        vals = [x for x in vals.split(",") if x]
        if not name or len(vals) < (1 if extra else 2):
            sys.exit("--define takes NAME=v1,v2[,...]")
        defs.append((name, vals))
    if len({len(vals) for _, vals in defs}) != 1:
        sys.exit("every --define must list as many values")
    if len({name for name, _ in defs}) != len(defs):
        sys.exit("each NAME may be given by one --define only")
    builds = [[(name, vals[i]) for name, vals in defs] for i in range(len(defs[0][1]))]
    if len({tuple(b) for b in builds}) != len(builds):
        sys.exit("two builds have the same values (one module name): list each combination once")
    values = [" ".join(f"{n}={x}" for n, x in b) if len(defs) > 1 else b[0][1] for b in builds]
    name = defs[0][0] if len(defs) == 1 else "build"
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the builds are compiled for its arch); nothing built or measured", file=sys.stderr)
        return 1
    major, minor = torch.cuda.get_device_capability()
    v = dataclasses.replace(Variant.from_uri(a.uri), archs=(f"sm_{major}{minor}",))
    out_dir = diagnostic_dir()
    from concurrent.futures import ThreadPoolExecutor

    # (variant, defines) per build: URI at each define value, then each --variants URI with the first value's defines
    plan = [(v, b) for b in builds]
    for u in extra:
        vx = dataclasses.replace(Variant.from_uri(u), archs=(f"sm_{major}{minor}",))
        if (vx.heads, vx.q_len, vx.page_size, vx.mask, vx.dtype) != (v.heads, v.q_len, v.page_size, v.mask, v.dtype):
            sys.exit(f"--variants {u}: heads, q_len, page_size, mask and dtype must be those of {a.uri}")
        plan.append((vx, builds[0]))
        values.append(u)
    if extra:
        name = "build"
    with ThreadPoolExecutor(max_workers=min(len(plan), os.cpu_count() or 1)) as pool:
        built = list(pool.map(lambda vb: build_with_defines(vb[0], vb[1], out_dir), plan))
    if a.build_only:
        print(f"built {len(built)} builds of {a.uri} in {out_dir}")
        return 0
    kernels = [VerifyKernel(vb[0], so, mod) for vb, (mod, so) in zip(plan, built)]
    if a.fused_merge:
        flags = a.fused_merge.split(",")
        if len(flags) != len(kernels) or any(f not in ("0", "1") for f in flags):
            sys.exit(f"--fused-merge takes one 0 / 1 per build ({len(kernels)})")
        for k, f in zip(kernels, flags):
            k.fused_merge = f == "1"
    tag = [f"merge {int(k.fused_merge and bool(getattr(k.module, 'fused_merge', False)))}" for k in kernels]
    print("builds: " + ", ".join(f"{x} ({t})" for x, t in zip(values, tag)))
    shapes = [Shape(v.heads, v.q_len, b, c, v.page_size) for b in map(int, a.batches.split(","))
              for c in map(int, a.contexts.split(","))]
    # the builds must compute the same thing: outputs compared bit for bit on one problem per shape
    for shape in shapes if a.atol != float("inf") else []:
        pr = make_problem(v, [shape.context] * shape.batch_size, q_len=shape.q_len, device="cuda", seed=11,
                          poison_pool=False, name="ab")
        if v.dtype == "fp8_e4m3":  # the e4m3 cache bench_kernel times (N(0, 1) rows cast on the device)
            pr = dataclasses.replace(pr, kv_cache=pr.kv_cache.to(torch.float8_e4m3fn))
        outs = []
        for k in kernels:
            out = torch.full((pr.q.shape[0], v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
            k(pr.q, pr.kv_cache, pr.block_table, pr.kv_lens, out=out, **pr.kernel_args())
            outs.append(out)
        torch.cuda.synchronize()
        nan = any(o.isnan().any().item() for o in outs)
        diff = max((float((o.float() - outs[0].float()).abs().max()) for o in outs[1:]), default=0.0)
        same = not nan and (diff == 0.0 if a.atol == 0 else diff <= a.atol)
        print(f"bs {shape.batch_size} ctx {shape.context}: outputs of every build "
              f"{'equal' if same and diff == 0 else f'within {a.atol} (max |diff| {diff:.3g})' if same else 'DIFFER'}"
              + (" (NaN)" if nan else ""))
        if not same:
            return 1
    times = {(i, s): [] for i in range(len(kernels)) for s in range(len(shapes))}
    for rnd in range(a.rounds):
        for s, shape in enumerate(shapes):
            order = range(len(kernels)) if rnd % 2 == 0 else reversed(range(len(kernels)))
            for i in order:
                times[(i, s)].append(bench_kernel(kernels[i], shape, seed=rnd)["median_us"])
    print(f"\n{a.uri} on {torch.cuda.get_device_name()}: {name} = {', '.join(values)} (median of {a.rounds} rounds)")
    label = (lambda x: f"{name}={x}") if len(defs) == 1 else (lambda x: x)
    if extra:  # long URIs: columns b0, b1, ... and a legend
        for i, x in enumerate(values):
            print(f"b{i}: {x}")
        values = [f"b{i}" for i in range(len(values))]
        label = lambda x: x  # noqa: E731
    print("| bs | ctx | " + " | ".join(f"{label(x)} µs" for x in values) + " | " +
          " | ".join(f"{label(x)} / first" for x in values[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(values) - 1))
    for s, shape in enumerate(shapes):
        med = [statistics.median(times[(i, s)]) for i in range(len(kernels))]
        print(f"| {shape.batch_size} | {shape.context} | " + " | ".join(f"{t:.1f}" for t in med) + " | " +
              " | ".join(f"{t / med[0]:.3f}" for t in med[1:]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
