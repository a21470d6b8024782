"""Side-by-side benchmark of mlagen verify kernels and SGLang's Triton MLA kernels (one GPU job).

For each shape: mlagen's fastest verified variant (a small tuning sweep per bucket, each module
verified first), SGLang's verify path (extend_attention_fwd + custom tree mask) and SGLang's
split-KV decode kernel (decode_attention_fwd, q_len*H rows as heads, best of num_kv_splits 8/16/64;
it ignores the tree mask, a speed alternative only) and FlashInfer's MLA kernels (fa2 as it picks it
on this GPU, fa2 as it would pick it on a 100 KB-per-SM sm_120 GPU, fa3 on Hopper; causal, outputs
compared with a causal mlagen run: bench/flashinfer_baselines.py) on identical inputs. Ceilings are measured in
the same run: copy bandwidth (read + write) and the mma.sync bf16 rate. Floor per shape:
max(bytes / copy BW, FLOPs / mma rate), bytes = KV once + q + out, FLOPs = 2*rows*ctx*(576+512).
At 64k context (``--l2-bytes``) the winning variant is also profiled by Nsight Compute (tools/l2_bytes.py, a child
process): bytes moved L2 -> SM (l1tex__m_xbar2l1tex_read_bytes) and read from DRAM by all its kernels of one call,
per KV byte.

    python3 bench/run_bench.py --grid small --out bench_out     # writes bench.json, bench.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ceilings  # noqa: E402
import flashinfer_baselines as fib  # noqa: E402
import sglang_baselines as sgl  # noqa: E402

import mlagen  # noqa: E402
from mlagen.roofline import verify_bytes, verify_flops  # noqa: E402
from mlagen.build import build  # noqa: E402
from mlagen.ops import SM120_SMEM_PER_SM, VerifyKernel  # noqa: E402
from mlagen.registry import Registry  # noqa: E402
from mlagen.spec import Variant, parse_spec  # noqa: E402
from mlagen.verify import summarize, verify_kernel  # noqa: E402
from mlagen.feasibility import dimsplit_row_tiles, dimsplit_t_num_warps, dimsplit_t_row_tiles  # noqa: E402

# (H, q_len, bs, ctx, page_size)
SMALL = ([(8, 9, bs, c, ps) for ps in (1, 64) for bs in (1, 4) for c in (4096, 16384, 65536, 131072)]
         + [(16, 9, 4, c, 1) for c in (16384, 65536)] + [(64, 9, 4, 16384, 1)] + [(8, 1, 1, 65536, 1)])
FULL = ([(H, 9, bs, c, ps) for H in (8, 16, 64) for ps in (1, 64) for bs in (1, 4, 16)
         for c in (4096, 16384, 65536, 131072)] + [(8, 1, bs, c, 1) for bs in (1, 4) for c in (4096, 65536)])
NSPLIT_SWEEP = (16, 32, 64)
L2_CTX = 65536  # the context whose winners --l2-bytes profiles
L2_TOOL = Path(__file__).resolve().parent.parent / "tools" / "l2_bytes.py"
DECODE_SPLITS = (8, 16, 64)


def tuning_spec(H: int, q_len: int, ps: int) -> dict:
    """The per-bucket tile sweep (infeasible combinations are dropped by the generator). Fixed
    NSPLIT variants share the auto variant's module (nsplit is a launch argument)."""
    mask = "tree" if q_len > 1 else "causal"
    rows = H * q_len
    rt = [1] if rows <= 16 else [1, 2] if rows <= 96 else [2, 3]
    rt = sorted(set(rt) | {dimsplit_row_tiles(rows)})  # dimsplit: one row-tile count per shape
    return dict(name=f"bench_h{H}_q{q_len}_ps{ps}", heads_per_rank=H, q_len=q_len, page_size=ps, mask=mask,
                nsplit=["auto", *NSPLIT_SWEEP], block_n=[16, 32], stages=[2, 3, 4], row_tiles=rt,
                # dimsplit with row_tiles + 2 warps: two producer warps (cp.async loader; MlaDimSplitConfig)
                num_warps=sorted({4, 8, 16, dimsplit_row_tiles(rows) + 2}), overlap=[0, 1],
                schedule=["rowblock", "dimsplit"],
                load_width=["bulk", 128])  # rowblock: bulk beat 128-bit cp.async at every H200 grid shape


def dimsplit_t_tuning_spec(H: int, q_len: int, ps: int) -> dict:
    """The dimsplit_t tiles of a bucket (built beside :func:`tuning_spec`'s): score warps of 24 rows, 4
    output warps and a producer, cp.async loader; 32-token steps (block_n 32: 3 stages beside two score exchange
    buffers, 4 beside one; the 6-8 stage points are dropped as infeasible) and 16-token steps (block_n 16, rings
    of 3-8 stages)."""
    rt = dimsplit_t_row_tiles(H * q_len)
    return dict(name=f"bench_dst_h{H}_q{q_len}_ps{ps}", heads_per_rank=H, q_len=q_len, page_size=ps,
                mask="tree" if q_len > 1 else "causal", nsplit=["auto", *NSPLIT_SWEEP], block_n=[16, 32], stages=[4, 6, 8, 3],
                row_tiles=rt, num_warps=dimsplit_t_num_warps(rt), schedule="dimsplit_t", load_width=128)


def fp8_tuning_spec(H: int, q_len: int, ps: int) -> dict:
    """The dimsplit e4m3-KV sweep of a bucket (``--fp8``): a producer and two converter warps; its other keys
    are fixed by the schedule (cp.async loader, block_n 32, one row-tile count per shape)."""
    rt = dimsplit_row_tiles(H * q_len)
    return dict(name=f"bench_fp8_h{H}_q{q_len}_ps{ps}", heads_per_rank=H, q_len=q_len, page_size=ps,
                mask="tree" if q_len > 1 else "causal", nsplit="auto", block_n=32, stages=[2, 3], row_tiles=rt,
                num_warps=rt + 3, schedule="dimsplit", load_width=128, dtype="fp8_e4m3")


def dimsplit_t_fp8_tuning_spec(H: int, q_len: int, ps: int) -> dict:
    """The dimsplit_t e4m3-KV sweep of a bucket (``--fp8``): a 2-stage e4m3 ring that the output warps dequantize
    into 3 bf16 stages (the one ring depth that fits sm_120's 99 KB; 3 e4m3 stages do not)."""
    rt = dimsplit_t_row_tiles(H * q_len)
    return dict(name=f"bench_dst_fp8_h{H}_q{q_len}_ps{ps}", heads_per_rank=H, q_len=q_len, page_size=ps,
                mask="tree" if q_len > 1 else "causal", nsplit="auto", block_n=32, stages=2, row_tiles=rt,
                num_warps=dimsplit_t_num_warps(rt), schedule="dimsplit_t", load_width=128, dtype="fp8_e4m3")


def fp8_problem(p: dict) -> dict:
    """``p`` with its KV cache cast to e4m3 (N(0, 1) values: nothing near +-448), the pool SGLang's
    --kv-cache-dtype fp8_e4m3 holds; the same q, lengths, table and tree."""
    return dict(p, kv_cache=p["kv_cache"].to(torch.float8_e4m3fn))


def mlagen_args(p: dict, k: VerifyKernel):
    """mlagen's view of an SGLang problem: same q / pool / lengths / tree; page ids from req_to_token.

    Allocates the output bf16 [T, H, 512] and ``k``'s workspace on "cuda" (the current device) once, here.
    Returns:
        A zero-argument launcher: each call runs ``k`` on ``p`` (the random tree for tree variants, no mask
        otherwise) into that output and returns ``(out, None)`` (no lse).
    """
    P = p["page_size"]
    table = p["req_to_token"] if P == 1 else (p["req_to_token"][:, ::P] // P).contiguous()
    out = torch.empty(p["q"].shape[0], p["H"], 512, dtype=torch.bfloat16, device="cuda")
    ws = k.alloc_workspace(p["bs"], "cuda")
    tree = p["tree_mask"] if k.variant.mask == "tree" else None
    return lambda: k(p["q"], p["kv_cache"], table, p["kv_lens"], q_len=p["q_len"], softmax_scale=p["softmax_scale"],
                     tree_mask=tree, out=out, workspace=ws)


def time_mlagen(p: dict, k: VerifyKernel) -> float:
    """Median µs of one ``k`` call on ``p``, timed as SGLang's kernels are (sglang_baselines._time_rotating):
    one CUDA graph over enough copies of the problem to rotate past L2, replayed, median of replay time /
    copies; triton's do_bench on one copy when graph capture fails."""
    copies = [p] + [sgl._clone_problem(p) for _ in range(sgl._n_copies(sgl._problem_bytes(p)) - 1)]
    return sgl._time_rotating([mlagen_args(c, k) for c in copies], None, sgl._problem_bytes(p))


def _parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--grid", choices=["small", "full"], default="small")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--skip-sglang", action="store_true")
    ap.add_argument("--flashinfer", action=argparse.BooleanOptionalAction, default=True,
                    help="FlashInfer MLA columns (default on; skipped with one line when flashinfer does not import)")
    ap.add_argument("--fi-columns", type=_fi_columns_arg, metavar="LIST",
                    help="FlashInfer columns, comma-separated from fa2, fa2@sm120, fa3 (default: all three, fa3 on "
                    "Hopper only; with --smem-per-sm: fa2@sm120 only)")
    ap.add_argument("--fp8", action="store_true",
                    help="also time the fastest verified dtype fp8_e4m3 variant on the same problem with its KV cast "
                         "to e4m3 (columns: µs, x the fastest bf16 time of its schedule, fraction of the fp8 memory "
                         "floor and of the fp8 roofline floor)")
    ap.add_argument("--l2-bytes", choices=["bs1", "all", "off"], default="bs1",
                    help="profile the winner of the 64k rows with Nsight Compute for bytes L2 -> SM and DRAM reads per "
                    "KV byte: 'bs1' (default) the batch-1 rows, 'all' every 64k row (~20 s each), 'off'; skipped "
                    "with one line when ncu is not found or under --smem-per-sm")
    ap.add_argument("--build-only", action="store_true",
                    help="compile the tuning sweeps of the selected shapes into the build cache and stop (no GPU needed)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--heads", type=_int_list, help="only these H (comma-separated), to split the full grid over several jobs")
    ap.add_argument("--batches", type=_int_list, help="only these batch sizes (comma-separated)")
    ap.add_argument("--q-lens", type=_int_list, help="only these q_len (comma-separated; the grids hold 9 and, for H 8, 1)")
    ap.add_argument("--page-sizes", type=_int_list, help="only these page sizes (comma-separated)")
    ap.add_argument("--contexts", type=_int_list, help="only these contexts in tokens (comma-separated)")
    ap.add_argument("--kernels", metavar="GLOB", type=_kernels_arg, help="only tuning variants whose uri matches this shell glob, or any of "
                    "several comma-separated ones (e.g. '*_bn32_w8_rt[12]_st2_t*,*_w16_*'; keep the ns field free so "
                    "auto and fixed NSPLIT both build)")
    ap.add_argument("--smem-per-sm", type=_smem_arg, help="time mlagen as if an SM had this much shared memory: bytes, or "
                    "'sm120' (102400, RTX PRO 6000) so CTAs per SM match the sm_120 target")
    ap.add_argument("--gpus", type=_gpus_arg, default=1, help="spread the shapes over this many GPUs of the host "
                    "('all': every visible one): the variants are built once, then one worker process per GPU "
                    "measures its shapes (ceilings, mlagen and SGLang side by side on that GPU) and the rows are merged")
    ap.add_argument("--shard", help=argparse.SUPPRESS)  # internal (--gpus): grid indices this worker measures
    return ap.parse_args(argv)


def _int_list(text: str) -> list[int]:
    """argparse type of the comma-separated filters (--heads 8,16): the positive ints."""
    items = [x.strip() for x in text.split(",")]
    if not items or not all(x.isdigit() and int(x) > 0 for x in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [int(x) for x in items]


def _select_grid(a: argparse.Namespace) -> list[tuple]:
    grid = SMALL if a.grid == "small" else FULL
    for opt, i in (("heads", 0), ("q_lens", 1), ("batches", 2), ("contexts", 3), ("page_sizes", 4)):
        if getattr(a, opt):
            keep = set(getattr(a, opt))
            grid = [g for g in grid if g[i] in keep]
    return grid


def _build_buckets(buckets, a) -> tuple[dict, int]:
    """Build (or find cached) the tuning sweeps of each (H, q_len, page_size) bucket (:func:`tuning_spec`'s and
    :func:`dimsplit_t_tuning_spec`'s), and with ``--fp8`` its e4m3 sweep (key (H, q_len, page_size,
    "fp8_e4m3")); failures printed. Returns ({key: the built variants of its sweeps}, variants that failed)."""
    built, failed = {}, 0
    for H, q, ps in buckets:
        specs = [((H, q, ps), tuning_spec(H, q, ps), a.kernels), ((H, q, ps), dimsplit_t_tuning_spec(H, q, ps), a.kernels)]
        if getattr(a, "fp8", False):
            specs.append(((H, q, ps, "fp8_e4m3"), fp8_tuning_spec(H, q, ps), None))
            specs.append(((H, q, ps, "fp8_e4m3"), dimsplit_t_fp8_tuning_spec(H, q, ps), None))
        for key, spec, glob in specs:
            rep = build(parse_spec(spec), kernels=glob, jobs=a.jobs)
            for v, m in rep.failed:
                print(f"build failed {v.uri}: {m.splitlines()[0] if m else ''}")
            failed += len(rep.failed)
            built.setdefault(key, []).extend(rep.built)
    return built, failed


def _build_and_verify(buckets, a, smem_cap) -> dict[tuple, list[VerifyKernel]] | None:
    """Build the tuning sweep of every (H, q_len, page_size) bucket and keep the variants that pass
    the quick verification set on this GPU; None when a bucket has no verified nsplit-auto variant."""
    kernels: dict[tuple, list[VerifyKernel]] = {}
    for key, built in _build_buckets(buckets, a)[0].items():
        H, q, ps = key[:3]
        ks = []
        verified: dict[str, bool] = {}
        for b in built:
            k = VerifyKernel(b.variant, b.so_path)
            if smem_cap is not None:
                try:
                    k.limit_smem_per_sm(smem_cap)
                except ValueError as e:  # the variant cannot run at that shared memory per SM
                    print(f"excluded: {e}")
                    continue
            if b.variant.build_key not in verified:
                s = summarize(verify_kernel(k, quick=True))
                verified[b.variant.build_key] = s["passed"] == s["cases"]
                Registry().add_verification(uri=b.uri, source_hash=b.source_hash, device=torch.cuda.get_device_name(),
                                            arch="sm_%d%d" % torch.cuda.get_device_capability(), cases=s["cases"],
                                            max_err=s["max_abs_err"], passed=verified[b.variant.build_key])
            if verified[b.variant.build_key]:
                ks.append(k)
            else:
                print(f"NOT verified, excluded: {b.uri}")
        if not any(k.variant.nsplit == "auto" for k in ks):  # the timed candidates are the auto variants
            if len(key) > 3:  # the fp8 columns stay empty for this bucket
                print(f"no verified fp8_e4m3 variant for H={H} q_len={q} page_size={ps}: fp8 columns left out")
                continue
            print(f"no verified nsplit-auto variant for H={H} q_len={q} page_size={ps}"
                  + (f" matching --kernels {a.kernels} (keep the ns field free)" if a.kernels else ""))
            return None
        kernels[key] = ks
    return kernels


def _mlagen_causal_out(p: dict, k: VerifyKernel):
    """mlagen's output on ``p`` under the causal mask (a tree kernel runs a chain tree, which is that mask),
    to compare with FlashInfer's causal MLA; None for a variant with mask "none" at q_len > 1."""
    q = p["q_len"]
    if k.variant.mask == "none" and q > 1:
        return None
    P = p["page_size"]
    table = p["req_to_token"] if P == 1 else (p["req_to_token"][:, ::P] // P).contiguous()
    tree = fib.causal_tree_mask(p["bs"], q, p["q"].device) if k.variant.mask == "tree" else None
    out = torch.empty(p["q"].shape[0], p["H"], 512, dtype=torch.bfloat16, device=p["q"].device)
    k(p["q"], p["kv_cache"], table, p["kv_lens"], q_len=q, softmax_scale=p["softmax_scale"], tree_mask=tree, out=out)
    torch.cuda.synchronize()
    return out


def _measure_fi(p: dict, k_best: VerifyKernel, fi_cols, fi_smem: int) -> dict:
    """FlashInfer columns of one row: <key>_us per column, fi_max_abs_diff {column: max |FI - mlagen|}
    against mlagen's causal output, fi_errors {column: message} for a column that failed."""
    res, diffs, errs = {}, {}, {}
    try:
        ref = _mlagen_causal_out(p, k_best)
    except Exception as e:  # noqa: BLE001 — report, never fake
        ref, errs["mlagen causal"] = None, f"{type(e).__name__}: {e}"
    for c in fi_cols:
        try:
            us, diff = fib.measure(p, c, fi_smem, ref)
            res[f"{fib.KEYS[c]}_us"] = us
            if sgl.last_timing.get("method") != "cuda_graph":  # e.g. capture failed: do_bench's median instead
                res.setdefault("fi_timing", {})[c] = dict(sgl.last_timing)
            if diff is not None:
                diffs[c] = diff
        except Exception as e:  # noqa: BLE001
            errs[c] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    if diffs:
        res["fi_max_abs_diff"] = diffs
    if errs:
        res["fi_errors"] = errs
    torch.cuda.empty_cache()
    return res


def _measure_shape(shape, kernels, ceil, ok_sgl, fi_cols=(), fi_smem=SM120_SMEM_PER_SM) -> tuple[dict, list[dict]]:
    """One row: mlagen's fastest verified auto variant, fixed NSPLIT on its tile, SGLang's kernels,
    FlashInfer's MLA kernels (``fi_cols``; fa2@sm120 configured for ``fi_smem`` bytes of shared memory per SM)."""
    H, q, bs, ctx, ps = shape
    bw, mma = ceil["copy_gbs"], ceil["mma_tflops"]
    p = sgl.make_problem(H, q, bs, ctx, ps, seed=ctx + bs)
    nbytes, flops = verify_bytes(H, q, bs, ctx), verify_flops(H, q, bs, ctx)
    floor = max(nbytes / (bw * 1e3), flops / (mma * 1e6))  # µs
    cands = [k for k in kernels[(H, q, ps)] if k.variant.nsplit == "auto"]
    times = {k.variant.uri: time_mlagen(p, k) for k in cands}
    best_uri = min(times, key=times.get)
    best = times[best_uri]
    row = dict(H=H, q_len=q, bs=bs, ctx=ctx, page_size=ps, mlagen_uri=best_uri, mlagen_us=best,
               gbs=nbytes / best / 1e3, floor_us=floor, frac_floor=floor / best, candidates=times)
    # fixed NSPLIT with the winning tile config, at every shape: auto must be within 10 % of the best
    bk = [k for k in kernels[(H, q, ps)] if k.variant.uri == best_uri][0].variant.build_key
    fixed = {k.variant.nsplit: time_mlagen(p, k) for k in kernels[(H, q, ps)]
             if k.variant.build_key == bk and k.variant.nsplit != "auto"}
    sweep = []
    if fixed:
        ns_best = min(fixed, key=fixed.get)
        row.update(nsplit_fixed_us=fixed, best_fixed_nsplit=ns_best, auto_over_best_fixed=best / fixed[ns_best])
    if (H, q, bs, ps) == (8, 9, 1, 1):  # the NSPLIT sweep shown in the output
        sweep = [dict(ctx=ctx, nsplit=ns, us=us) for ns, us in fixed.items()] + [dict(ctx=ctx, nsplit="auto", us=best)]
    if ok_sgl:
        try:
            if q > 1:
                ref = sgl.run_extend_verify(p)
                mine = mlagen_args(p, next(k for k in cands if k.variant.uri == best_uri))()[0]
                row["max_abs_diff_vs_sglang"] = float((mine.float() - ref.float()).abs().max())
                row["sglang_verify_us"] = sgl.time_extend_verify(p)
            dec = {s: sgl.time_decode_splitkv(p, s) for s in DECODE_SPLITS}
            s_best = min(dec, key=dec.get)
            row.update(sglang_decode_us=dec[s_best], sglang_decode_splits=s_best, sglang_decode_all=dec)
        except Exception as e:  # noqa: BLE001 — report, never fake
            row["sglang_error"] = f"{type(e).__name__}: {e}"
    if fi_cols:
        row.update(_measure_fi(p, [k for k in cands if k.variant.uri == best_uri][0], fi_cols, fi_smem))
    f8 = kernels.get((H, q, ps, "fp8_e4m3"))
    if f8:
        row.update(_measure_fp8(p, f8, times, ceil, sglang=ok_sgl and q > 1))
    del p
    torch.cuda.empty_cache()
    return row, sweep


def _measure_fp8(p: dict, ks: list[VerifyKernel], bf16_times: dict, ceil: dict, sglang: bool = False) -> dict:
    """fp8 columns of a row: the fastest verified e4m3 variant on ``p`` with its KV cast to e4m3, its ratio
    to the fastest bf16 candidate of the same row on its schedule (the issue's "same schedule"), its fraction of the
    fp8 memory floor (minimum bytes, KV at one byte per element, over the measured copy bandwidth) and of the fp8
    roofline floor (the larger of that and the MMA term, which fp8 does not shrink: q and P stay bf16). ``sglang``:
    also SGLang's Triton verify kernel (``extend_attention_fwd``) on the same e4m3 pool, µs, and the max
    |Triton - fp32 reference| and |mlagen - fp32 reference| on it (Triton rounds q and P to e4m3; mlagen keeps them
    bf16)."""
    H, q, bs, ctx = p["H"], p["q_len"], p["bs"], p["ctx"]
    pf = fp8_problem(p)
    times = {k.variant.uri: time_mlagen(pf, k) for k in ks if k.variant.nsplit == "auto"}
    uri = min(times, key=times.get)
    us = times[uri]
    nbytes = verify_bytes(H, q, bs, ctx, kv_bytes=1)
    mem_floor = nbytes / (ceil["copy_gbs"] * 1e3)
    floor = max(mem_floor, verify_flops(H, q, bs, ctx) / (ceil["mma_tflops"] * 1e6))
    res = dict(fp8_uri=uri, fp8_us=us, fp8_floor_us=floor, fp8_frac_floor=floor / us, fp8_mem_floor_us=mem_floor,
               fp8_frac_mem_floor=mem_floor / us, fp8_candidates=times)
    schedule = Variant.from_uri(uri).schedule
    same = {u: t for u, t in bf16_times.items() if Variant.from_uri(u).schedule == schedule}
    if same:
        res.update(fp8_schedule=schedule, fp8_over_bf16_schedule=us / min(same.values()))
    if sglang:
        try:
            exact = sgl.reference_verify(pf)
            tri = sgl.run_extend_verify(pf)
            mine = mlagen_args(pf, next(k for k in ks if k.variant.uri == uri))()[0]
            res.update(fp8_sglang_verify_us=sgl.time_extend_verify(pf),
                       fp8_sglang_err=float((tri.float() - exact).abs().max()),
                       fp8_mlagen_err=float((mine.float() - exact).abs().max()))
        except Exception as e:  # noqa: BLE001 — report, never fake
            res["fp8_sglang_error"] = f"{type(e).__name__}: {e}"
    del pf
    return res


def _ncu_path() -> str | None:
    """Nsight Compute's command line: $NCU, else the toolkit's under $CUDA_HOME / $CUDA_PATH (where mlagen finds
    nvcc: mlagen/ninja_gen.py), else ``ncu`` on PATH, else /usr/local/cuda/bin/ncu; None if none runs."""
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    for c in (os.environ.get("NCU"), *(os.path.join(h, "bin", "ncu") for h in homes if h), shutil.which("ncu"),
              "/usr/local/cuda/bin/ncu"):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def parse_l2_json(stdout: str) -> dict:
    """The row fields from tools/l2_bytes.py --json output (its last JSON line): l2_sm_per_kv, l2_read_per_kv and
    dram_per_kv (bytes per KV byte, all kernels of one call: into the SMs over the crossbar, read from the L2 by the
    SMs, read from DRAM; l2_read_per_kv is None in records of older tools), l2_kernels (per kernel: name, bytes, µs)
    and l2_kv_bytes; or l2_error (no JSON line, or an ``error`` record).

    Raises:
        json.JSONDecodeError: the last line starting with ``{`` is not valid JSON.
        KeyError: a record without ``error`` lacks one of the fields.
    """
    recs = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not recs:
        return dict(l2_error="no JSON line from tools/l2_bytes.py: " + stdout.strip()[-200:])
    rec = json.loads(recs[-1])
    if "error" in rec:
        return dict(l2_error=rec["error"])
    return dict(l2_sm_per_kv=rec["l2_sm_per_kv"], l2_read_per_kv=rec.get("l2_read_per_kv"),
                dram_per_kv=rec["dram_per_kv"], l2_kernels=rec["kernels"], l2_kv_bytes=rec["kv_bytes"])


def measure_l2_bytes(uri: str, ctx: int, bs: int, ncu: str, timeout_s: float = 600) -> dict:
    """Bytes L2 -> SM and DRAM reads per KV byte of one call of ``uri`` at (ctx, bs) under Nsight Compute
    (tools/l2_bytes.py --json in a child process; its own inputs, same shape; clocks not locked). Returns
    :func:`parse_l2_json`'s fields; a timeout, an ``error`` record, or output without a JSON line (a failed
    run's stderr tail included) becomes ``l2_error``. Not caught: a last ``{`` line that is not valid JSON
    (json.JSONDecodeError) or lacks a field (KeyError), from :func:`parse_l2_json`."""
    cmd = [sys.executable, str(L2_TOOL), uri, "--ctx", str(ctx), "--bs", str(bs), "--ncu", ncu, "--json"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(l2_error=f"tools/l2_bytes.py did not finish in {timeout_s:.0f} s")
    return parse_l2_json(r.stdout + ("" if r.returncode == 0 else r.stderr[-500:]))


def _versions() -> dict:
    return dict(device=torch.cuda.get_device_name(), driver=_driver(), torch=torch.__version__, triton=_ver("triton"),
                sglang=_ver("sglang"), flashinfer=_ver("flashinfer-python"), mlagen=mlagen.__version__,
                python=platform.python_version())


WORKER_LOG_HEADER = "# bench/run_bench.py: one GPU's share of the shapes (--gpus N worker log)\n"


def out_dir_problem(out_dir: Path) -> str | None:
    """Why this script must not write into ``out_dir`` (checked before anything runs), or None when it may.

    It writes bench.json and bench.png there and, with --gpus N, gpuK/bench.json and gpuK/bench.log; each may replace
    only a file an earlier run of this script wrote (a JSON object with ``rows``, a PNG tagged by mlagen's plotting, a
    log that starts with :data:`WORKER_LOG_HEADER`). Anything else of those names is someone else's and stays."""

    def ours_json(p: Path) -> bool:
        try:
            rec = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return isinstance(rec, dict) and isinstance(rec.get("rows"), list)

    def ours_log(p: Path) -> bool:
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                return f.readline() == WORKER_LOG_HEADER
        except OSError:
            return False

    from mlagen.plot import is_mlagen_png

    if os.path.lexists(out_dir) and not out_dir.is_dir():
        return f"--out {out_dir} exists and is not a directory"
    checks = [(out_dir / "bench.json", ours_json), (out_dir / "bench.png", is_mlagen_png)]
    for sub in sorted(out_dir.glob("gpu*")) if out_dir.is_dir() else []:
        if sub.is_dir():
            checks += [(sub / "bench.json", ours_json), (sub / "bench.log", ours_log)]
    for path, ours in checks:
        if os.path.lexists(path) and not ours(path):
            return f"{path} exists and was not written by bench/run_bench.py: choose another --out or move it away"
    return None


def main(argv=None) -> int:
    a = _parse(argv)
    if a.build_only:  # compile only (e.g. while the GPU runs other work): the timed run then finds every module built
        grid = _select_grid(a)
        if not grid:
            print("no shape left after --heads / --batches / --page-sizes / --contexts", file=sys.stderr)
            return 1
        built, failed = _build_buckets(sorted({(g[0], g[1], g[4]) for g in grid}), a)
        n_built = sum(len(b) for b in built.values())
        if n_built == 0 and failed == 0:
            print(f"no variant of the tuning sweeps matches --kernels {a.kernels!r}; nothing built", file=sys.stderr)
            return 1
        print(f"built {n_built} variants, {failed} failed")
        return 1 if failed else 0
    why = out_dir_problem(Path(a.out))
    if why:
        print(f"run_bench: {why}; nothing measured", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU; nothing measured", file=sys.stderr)
        return 1
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    grid = _select_grid(a)
    if not grid:
        print("no shape left after --heads / --batches / --page-sizes / --contexts", file=sys.stderr)
        return 1
    n_gpus = torch.cuda.device_count() if a.gpus == "all" else a.gpus
    if n_gpus > torch.cuda.device_count():
        print(f"--gpus {n_gpus}: only {torch.cuda.device_count()} GPU(s) visible; nothing measured", file=sys.stderr)
        return 1
    if a.shard is None and n_gpus > 1:
        return _run_sharded(a, grid, n_gpus, out_dir, sys.argv[1:] if argv is None else list(argv))
    ids = list(range(len(grid))) if a.shard is None else [int(i) for i in a.shard.split(",")]
    smem_cap = SM120_SMEM_PER_SM if a.smem_per_sm == "sm120" else a.smem_per_sm
    ok_sgl, why = (False, "--skip-sglang") if a.skip_sglang else sgl.sglang_available()
    if not ok_sgl:
        print(f"SGLang columns skipped: {why}")
    fi_cols, fi_smem = _fi_setup(a, smem_cap)
    wait_fi = fib.prebuild_in_background(fi_cols, fi_smem) if fi_cols else None  # JIT while mlagen builds
    ceil = ceilings.measure_ceilings()
    if ceil["copy_gbs"] is None or ceil["mma_tflops"] is None:  # the floor columns need both
        if wait_fi is not None:
            wait_fi()  # (its JIT threads' nvcc processes finish before this process exits)
        sys.exit(f"run_bench: a ceiling could not be measured on this GPU: {ceil['errors']}")
    print(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s, mma.sync bf16 {ceil['mma_tflops']:.0f} TFLOP/s {ceil['errors'] or ''}",
          flush=True)

    t0 = time.time()
    kernels = _build_and_verify(sorted({(g[0], g[1], g[4]) for g in (grid[i] for i in ids)}), a, smem_cap)
    if wait_fi is not None:
        fi_cols = _fi_ready(wait_fi, fi_cols)
    if kernels is None:
        return 1
    print(f"built + verified {sum(len(v) for v in kernels.values())} variants in {time.time() - t0:.0f} s", flush=True)

    ncu = _ncu_path() if a.l2_bytes != "off" and smem_cap is None else None
    if a.l2_bytes != "off" and smem_cap is not None:
        print("L2 -> SM column skipped: --smem-per-sm (its ncu child would run at the native occupancy)")
    elif a.l2_bytes != "off" and ncu is None:
        print("L2 -> SM column skipped: ncu not found ($NCU, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin)")
    rows, sweep = [], []
    for i in ids:
        row, sw = _measure_shape(grid[i], kernels, ceil, ok_sgl, fi_cols, fi_smem)
        row["grid_index"] = i
        if ncu is not None and row["ctx"] == L2_CTX and (a.l2_bytes == "all" or row["bs"] == 1):
            row.update(measure_l2_bytes(row["mlagen_uri"], row["ctx"], row["bs"], ncu))
        rows.append(row)
        sweep += sw
        print(_fmt(row), flush=True)
        if len(row["candidates"]) > 1:  # the tile sweep of this shape, fastest first
            print("    tiles: " + ", ".join(f"{_tile(u)} {t:.1f}" for u, t in sorted(row["candidates"].items(),
                                                                                 key=lambda x: x[1])), flush=True)
        # partial record after every shape: a job cut short by its time limit still leaves its rows
        (out_dir / "bench.json").write_text(json.dumps(dict(partial=True, ceilings=ceil, rows=rows, nsplit_sweep=sweep), indent=1))

    record = dict(_versions(), ceilings=ceil, grid=a.grid, rows=rows, nsplit_sweep=sweep, at=time.time(),
                  mlagen_smem_per_sm=smem_cap, **_fi_record(fi_cols, fi_smem))
    (out_dir / "bench.json").write_text(json.dumps(record, indent=1))
    if a.shard is None:
        _finish(record, out_dir)
    return 0


def _fi_setup(a: argparse.Namespace, smem_cap) -> tuple[list[str], int]:
    """(FlashInfer columns to measure, shared memory per SM the fa2@sm120 column is configured for);
    one line saying which, or why none."""
    fi_smem = smem_cap if smem_cap is not None else SM120_SMEM_PER_SM
    if not a.flashinfer:
        print("FlashInfer columns skipped: --no-flashinfer")
        return [], fi_smem
    ok, why = fib.flashinfer_available()
    if not ok:
        print(f"FlashInfer columns skipped: {why}")
        return [], fi_smem
    cc = torch.cuda.get_device_capability()[0]
    cols, notes = fib.usable_columns(a.fi_columns or fib.default_columns(cc, smem_cap is not None), cc)
    for n in notes:
        print(n)
    print(f"FlashInfer columns: {', '.join(fib.label(c, fi_smem) for c in cols) or 'none'} ({why})", flush=True)
    return cols, fi_smem


def _fi_ready(wait, cols: list[str]) -> list[str]:
    """Wait for the FlashInfer JIT builds; the columns whose module built."""
    secs, errs = wait()
    for c, e in errs.items():
        print(f"{fib.LABELS[c]} left out: JIT build failed: {e}")
    print(f"FlashInfer modules ready after {secs:.0f} s (JIT-compiled on first use, then cached)", flush=True)
    return [c for c in cols if c not in errs]


def _fi_record(cols: list[str], fi_smem: int) -> dict:
    return dict(flashinfer_columns={fib.KEYS[c]: fib.label(c, fi_smem) for c in cols},
                fi_smem_per_sm=fi_smem if "fa2@sm120" in cols else None)


def _finish(record: dict, out_dir: Path) -> None:
    """Registry entry, printed table and plot of a complete run."""
    Registry().add_bench_run(record)
    _table(record["rows"], record["nsplit_sweep"], record.get("flashinfer_columns"))
    _plot(record["rows"], out_dir / "bench.png", record["device"], record.get("flashinfer_columns"))
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")


def _shape_cost(shape) -> float:
    """Rough relative seconds to measure a shape (the Triton verify path dominates at long context)."""
    H, q, bs, ctx, _ps = shape
    return 1.0 + ctx / 4096 * (1 + bs * H / 32) * (1 if q > 1 else 0.3)


def assign_shards(grid: list[tuple], n: int) -> list[list[int]]:
    """Grid indices per GPU: longest shape first, each to the least-loaded GPU (LPT); sorted per GPU."""
    load, shares = [0.0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(grid)), key=lambda i: -_shape_cost(grid[i])):
        g = load.index(min(load))
        shares[g].append(i)
        load[g] += _shape_cost(grid[i])
    return [sorted(s) for s in shares]


def _run_sharded(a: argparse.Namespace, grid: list[tuple], n_gpus: int, out_dir: Path, argv: list[str]) -> int:
    """--gpus N: build every variant here (CPU), then one worker per GPU measures a share of the shapes
    (longest first, to the least-loaded GPU); rows are merged in grid order. Worker i sees only the i-th
    GPU this process sees (CUDA_VISIBLE_DEVICES narrowed, so a parent limited to GPUs 2,3 uses 2 and 3).
    ``argv``: this run's arguments, passed on to the workers with their --shard / --out / --gpus 1."""
    import subprocess

    t0 = time.time()
    smem_cap = SM120_SMEM_PER_SM if a.smem_per_sm == "sm120" else a.smem_per_sm
    fi_cols, fi_smem = _fi_setup(a, smem_cap)
    wait_fi = fib.prebuild_in_background(fi_cols, fi_smem) if fi_cols else None  # the workers find them built
    _build_buckets(sorted({(g[0], g[1], g[4]) for g in grid}), a)
    if wait_fi is not None:
        fi_cols = _fi_ready(wait_fi, fi_cols)
    print(f"built the tuning sweeps in {time.time() - t0:.0f} s; measuring on {n_gpus} GPUs", flush=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(n_gpus)]
    procs = []
    for g, share in enumerate(assign_shards(grid, n_gpus)):
        if not share:
            continue
        sub = out_dir / f"gpu{g}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / "bench.json").unlink(missing_ok=True)  # a record left by an earlier run must not be merged
        fi_args = ["--fi-columns", ",".join(fi_cols)] if fi_cols else ["--no-flashinfer"]  # the columns that built
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, *fi_args, "--gpus", "1", "--shard",
               ",".join(map(str, share)), "--out", str(sub)]
        log = open(sub / "bench.log", "w")
        log.write(WORKER_LOG_HEADER)  # out_dir_problem: a later run may replace this log
        log.flush()
        procs.append((g, sub, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                    env=dict(os.environ, CUDA_VISIBLE_DEVICES=devices[g]))))
    rows, sweep, shards, rc = [], [], [], 0
    for g, sub, log, pr in procs:
        code = pr.wait()
        log.close()
        print(f"--- gpu {g} (exit {code}) ---")
        print((sub / "bench.log").read_text(), end="", flush=True)
        path = sub / "bench.json"
        if not path.exists():
            rc = 1
            continue
        part = json.loads(path.read_text())
        rc = rc or code or (1 if part.get("partial") else 0)
        for r in part["rows"]:
            r["gpu"] = g
        rows += part["rows"]
        sweep += part["nsplit_sweep"]
        shards.append(dict(gpu=g, partial=bool(part.get("partial")), ceilings=part["ceilings"],
                           **{k: part[k] for k in ("device", "driver") if k in part}))
    rows.sort(key=lambda r: r["grid_index"])
    record = dict(_versions(), ceilings=shards[0]["ceilings"] if shards else None, shards=shards, grid=a.grid,
                  rows=rows, nsplit_sweep=sorted(sweep, key=lambda s: (s["ctx"], str(s["nsplit"]))), at=time.time(),
                  mlagen_smem_per_sm=smem_cap, partial=rc != 0 or len(rows) < len(grid), **_fi_record(fi_cols, fi_smem))
    (out_dir / "bench.json").write_text(json.dumps(record, indent=1))
    if rows:
        _finish(record, out_dir)
    print(f"{len(rows)}/{len(grid)} shapes measured on {len(shards)} GPUs")
    return rc


def _word_or_count(word: str, what: str):
    """argparse type: the literal ``word`` or a positive integer (``what`` names it in the error)."""
    def parse(text: str):
        if text == word:
            return text
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {word!r} or {what}, got {text!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {n}")
        return n
    return parse


_smem_arg = _word_or_count("sm120", "byte count")  # --smem-per-sm
_gpus_arg = _word_or_count("all", "GPU count")  # --gpus


def _fi_columns_arg(text: str) -> list[str]:
    """--fi-columns value: FlashInfer column names (fa2, fa2@sm120, fa3), comma-separated."""
    try:
        return fib.parse_columns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kernels_arg(text: str) -> str:
    """--kernels value: one uri glob or several comma-separated ones."""
    from mlagen.spec import uri_globs

    try:
        uri_globs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _tile(uri: str) -> str:
    """The tuning part of a uri: load width, block_n, warps, row tiles, stages, overlap, schedule."""
    v = Variant.from_uri(uri)
    return (f"lw{v.load_width}_bn{v.block_n}_w{v.num_warps}_rt{v.row_tiles}_st{v.stages}"
            f"{'_ov1' if v.overlap else ''}{'_' + v.schedule if v.schedule != 'rowblock' else ''}"
            f"{'_fp8' if v.dtype == 'fp8_e4m3' else ''}")


def _fmt(r: dict) -> str:
    tile = _tile(r["mlagen_uri"])
    s = (f"H={r['H']:3d} q={r['q_len']} bs={r['bs']:2d} ctx={r['ctx']:6d} ps={r['page_size']:2d} | mlagen {tile} "
         f"{r['mlagen_us']:8.1f} us {r['gbs']:6.0f} GB/s {r['frac_floor']:.2f} of floor ({r['floor_us']:.1f} us)")
    if "sglang_verify_us" in r:
        s += f" | triton verify {r['sglang_verify_us']:9.1f} us ({r['sglang_verify_us'] / r['mlagen_us']:6.1f}x)"
    if "sglang_decode_us" in r:
        s += f" | triton split-KV S={r['sglang_decode_splits']} {r['sglang_decode_us']:7.1f} us ({r['sglang_decode_us'] / r['mlagen_us']:5.1f}x)"
    for c in fib.COLUMNS:
        us = r.get(f"{fib.KEYS[c]}_us")
        if us is not None:
            s += f" | {fib.LABELS[c]} {us:7.1f} us ({us / r['mlagen_us']:4.2f}x)"
    if "fp8_us" in r:
        s += (f" | fp8 {_tile(r['fp8_uri'])} {r['fp8_us']:7.1f} us"
              + (f" ({r['fp8_over_bf16_schedule']:.2f}x bf16 {r['fp8_schedule']})" if "fp8_over_bf16_schedule" in r
                 else "")
              + (f" {r['fp8_frac_mem_floor']:.2f} of the fp8 memory floor ({r['fp8_mem_floor_us']:.1f} us;"
                 f" roofline {r['fp8_floor_us']:.1f} us: {r['fp8_frac_floor']:.2f})" if "fp8_mem_floor_us" in r
                 else f" {r['fp8_frac_floor']:.2f} of fp8 floor ({r['fp8_floor_us']:.1f} us)"))
        if "fp8_sglang_verify_us" in r:
            s += (f" | triton fp8 verify {r['fp8_sglang_verify_us']:9.1f} us "
                  f"({r['fp8_sglang_verify_us'] / r['fp8_us']:6.1f}x), max err vs fp32 ref triton "
                  f"{r['fp8_sglang_err']:.3g} mlagen {r['fp8_mlagen_err']:.3g}")
        elif "fp8_sglang_error" in r:
            s += f" | triton fp8: {r['fp8_sglang_error'][:80]}"
    if "auto_over_best_fixed" in r:
        s += f" | auto/best fixed (ns{r['best_fixed_nsplit']}) {r['auto_over_best_fixed']:.2f}"
    if r.get("l2_sm_per_kv") is not None:
        s += f" | L2->SM {r['l2_sm_per_kv']:.2f} B per KV B" + (
            f" (read from L2 {r['l2_read_per_kv']:.2f})" if r.get("l2_read_per_kv") is not None else "") + (
            f" (DRAM {r['dram_per_kv']:.2f})" if r.get("dram_per_kv") is not None else "")
    elif "l2_error" in r:
        s += f" | L2->SM: {r['l2_error'][:80]}"
    if "max_abs_diff_vs_sglang" in r:
        s += f" | max|diff| {r['max_abs_diff_vs_sglang']:.3g}"
    if r.get("fi_max_abs_diff"):
        s += " | causal max|diff| vs " + ", ".join(f"{fib.LABELS[c]} {d:.3g}" for c, d in r["fi_max_abs_diff"].items())
    if "sglang_error" in r:
        s += f" | sglang error: {r['sglang_error'][:80]}"
    for c, e in r.get("fi_errors", {}).items():
        s += f" | {fib.LABELS.get(c, c)} error: {e[:100]}"
    for c, t in r.get("fi_timing", {}).items():
        s += f" | {fib.LABELS[c]} timed by {t.get('method')} ({str(t.get('graph_error', ''))[:80]})"
    return s


def _table(rows, sweep, fi_labels: dict | None = None) -> None:
    """The printed table; FlashInfer columns (``fi_labels``: row key -> header, default fib.LABELS) for
    those present in any row: µs and FlashInfer / mlagen, then the largest causal max|diff| vs mlagen."""
    labels = {fib.KEYS[c]: lab for c, lab in fib.LABELS.items()}
    labels.update(fi_labels or {})
    fi_keys = [fib.KEYS[c] for c in fib.COLUMNS if any(f"{fib.KEYS[c]}_us" in r for r in rows)]
    fi_head = "".join(f" {labels[k]} µs (x mlagen) |" for k in fi_keys) + (" causal max abs diff vs FI |" if fi_keys else "")
    print("\n| H | q | bs | ctx | ps | mlagen µs | GB/s | of floor | floor µs | Triton verify µs | speedup | Triton split-KV µs (S) | speedup | auto / best fixed NSPLIT |" + fi_head)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (len(fi_keys) + (1 if fi_keys else 0)))
    for r in rows:
        tv, td, us = r.get("sglang_verify_us"), r.get("sglang_decode_us"), r["mlagen_us"]
        tv_s = "-" if tv is None else f"{tv:.0f}"
        tv_x = "-" if tv is None else f"{tv / us:.0f}x"
        td_s = "-" if td is None else f"{td:.0f} ({r['sglang_decode_splits']})"
        td_x = "-" if td is None else f"{td / us:.1f}x"
        print(f"| {r['H']} | {r['q_len']} | {r['bs']} | {r['ctx']} | {r['page_size']} | {us:.1f} | {r['gbs']:.0f} | "
              f"{r['frac_floor']:.2f} | {r['floor_us']:.1f} | {tv_s} | {tv_x} | {td_s} | {td_x} | "
              + (f"{r['auto_over_best_fixed']:.2f} (ns{r['best_fixed_nsplit']})" if "auto_over_best_fixed" in r else "-") + " |"
              + "".join(f" {r[k + '_us']:.1f} ({r[k + '_us'] / us:.2f}x) |" if k + "_us" in r else " - |" for k in fi_keys)
              + ((f" {max(r['fi_max_abs_diff'].values()):.2g} |" if r.get("fi_max_abs_diff") else " - |") if fi_keys else ""))
    for r in rows:
        if r.get("l2_sm_per_kv") is not None:
            print(f"\nL2 -> SM at H={r['H']} q={r['q_len']} bs={r['bs']} ctx={r['ctx']} ps={r['page_size']} "
                  f"({_tile(r['mlagen_uri'])}; Nsight Compute, caches flushed before each kernel): {r['l2_sm_per_kv']:.2f} "
                  "bytes per KV byte over all kernels of one call" + "".join(
                      f"; {k['name']} {k['l2_sm_bytes'] / r['l2_kv_bytes']:.2f}" for k in r.get("l2_kernels", [])
                      if k.get("l2_sm_bytes") is not None)
                  + (f"; read from the L2 by the SMs {r['l2_read_per_kv']:.2f} (the crossbar bytes less the "
                     "cluster's SM-to-SM exchange)" if r.get("l2_read_per_kv") is not None else "")
                  + (f"; DRAM reads {r['dram_per_kv']:.2f}" if r.get("dram_per_kv") is not None else ""))
    if sweep:
        print("\nNSPLIT sweep, H=8 q=9 bs=1 ps=1 (µs):")
        for ctx in sorted({s["ctx"] for s in sweep}):
            print(f"  ctx={ctx}: " + ", ".join(f"ns{s['nsplit']}={s['us']:.1f}" for s in sweep if s["ctx"] == ctx))


def _plot(rows, path, device, fi_labels: dict | None = None) -> None:
    from mlagen.plot import plot_time_vs_context

    sel = [r for r in rows if (r["H"], r["q_len"], r["bs"], r["page_size"]) == (8, 9, 1, 1)]
    series = {"mlagen (best verified)": [(r["ctx"], r["mlagen_us"]) for r in sel]}
    if any("sglang_verify_us" in r for r in sel):
        series["SGLang extend_attention_fwd (verify path)"] = [(r["ctx"], r["sglang_verify_us"]) for r in sel if "sglang_verify_us" in r]
    if any("sglang_decode_us" in r for r in sel):
        series["SGLang decode_attention_fwd (best splits, no tree mask)"] = [(r["ctx"], r["sglang_decode_us"]) for r in sel if "sglang_decode_us" in r]
    for c in fib.COLUMNS:
        k = fib.KEYS[c] + "_us"
        if any(k in r for r in sel):
            series[f"{(fi_labels or {}).get(fib.KEYS[c], fib.LABELS[c])} (FlashInfer MLA, causal)"] = [
                (r["ctx"], r[k]) for r in sel if k in r]
    plot_time_vs_context(series, str(path), f"H=8 q_len=9 tree bs=1 page_size=1 on {device}",
                         [(r["ctx"], r["floor_us"]) for r in sel])


def _driver() -> str:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.split()
        return out[0] if out else "unknown"  # one line per GPU, the same driver
    except Exception:  # noqa: BLE001
        return "unknown"


def _ver(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
