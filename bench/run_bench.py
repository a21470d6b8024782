"""Side-by-side benchmark of mlagen verify kernels and SGLang's Triton MLA kernels (one GPU job).

For each shape: mlagen's fastest verified variant (a small tuning sweep per bucket, each module
verified first), SGLang's verify path (extend_attention_fwd + custom tree mask) and SGLang's
split-KV decode kernel (decode_attention_fwd, q_len*H rows as heads, best of num_kv_splits 8/16/64;
it ignores the tree mask, a speed alternative only) on identical inputs. Ceilings are measured in
the same run: copy bandwidth (read + write) and the mma.sync bf16 rate. Floor per shape:
max(bytes / copy BW, FLOPs / mma rate), bytes = KV once + q + out, FLOPs = 2*rows*ctx*(576+512).

    python3 bench/run_bench.py --grid small --out bench_out     # writes bench.json, bench.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ceilings  # noqa: E402
import sglang_baselines as sgl  # noqa: E402

import mlagen  # noqa: E402
from mlagen.roofline import verify_bytes, verify_flops  # noqa: E402
from mlagen.build import build  # noqa: E402
from mlagen.ops import VerifyKernel  # noqa: E402
from mlagen.registry import Registry  # noqa: E402
from mlagen.spec import parse_spec  # noqa: E402
from mlagen.verify import summarize, verify_kernel  # noqa: E402

# (H, q_len, bs, ctx, page_size)
SMALL = ([(8, 9, bs, c, ps) for ps in (1, 64) for bs in (1, 4) for c in (4096, 16384, 65536, 131072)]
         + [(16, 9, 4, c, 1) for c in (16384, 65536)] + [(64, 9, 4, 16384, 1)] + [(8, 1, 1, 65536, 1)])
FULL = ([(H, 9, bs, c, ps) for H in (8, 16, 64) for ps in (1, 64) for bs in (1, 4, 16)
         for c in (4096, 16384, 65536, 131072)] + [(8, 1, bs, c, 1) for bs in (1, 4) for c in (4096, 65536)])
NSPLIT_SWEEP = (16, 32, 64)
DECODE_SPLITS = (8, 16, 64)


def tuning_spec(H: int, q_len: int, ps: int) -> dict:
    """The per-bucket tile sweep (infeasible combinations are dropped by the generator). Fixed
    NSPLIT variants share the auto variant's module (nsplit is a launch argument)."""
    mask = "tree" if q_len > 1 else "causal"
    rows = H * q_len
    rt = [1] if rows <= 16 else [1, 2] if rows <= 96 else [2, 3]
    return dict(name=f"bench_h{H}_q{q_len}_ps{ps}", heads_per_rank=H, q_len=q_len, page_size=ps, mask=mask,
                nsplit=["auto", *NSPLIT_SWEEP], block_n=[16, 32], stages=[2, 3], row_tiles=rt, num_warps=[4, 8],
                overlap=[0, 1],
                load_width="bulk")  # bulk beat 128-bit cp.async at every shape of the H200 grid; 4 warps
                                    # (bn16 rt1: 45.5 KB, 2 CTAs/SM on sm_120) not measured yet


def mlagen_args(p: dict, k: VerifyKernel):
    """mlagen's view of an SGLang problem: same q / pool / lengths / tree; page ids from req_to_token."""
    P = p["page_size"]
    table = p["req_to_token"] if P == 1 else (p["req_to_token"][:, ::P] // P).contiguous()
    out = torch.empty(p["q"].shape[0], p["H"], 512, dtype=torch.bfloat16, device="cuda")
    ws = k.alloc_workspace(p["bs"], "cuda")
    tree = p["tree_mask"] if k.variant.mask == "tree" else None
    return lambda: k(p["q"], p["kv_cache"], table, p["kv_lens"], q_len=p["q_len"], softmax_scale=p["softmax_scale"],
                     tree_mask=tree, out=out, workspace=ws)


def time_mlagen(p: dict, k: VerifyKernel) -> float:
    copies = [p] + [sgl._clone_problem(p) for _ in range(sgl._n_copies(sgl._problem_bytes(p)) - 1)]
    return sgl._time_rotating([mlagen_args(c, k) for c in copies], None, sgl._problem_bytes(p))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", choices=["small", "full"], default="small")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--skip-sglang", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--heads", help="only these H (comma-separated), to split the full grid over several jobs")
    ap.add_argument("--batches", help="only these batch sizes (comma-separated)")
    ap.add_argument("--page-sizes", help="only these page sizes (comma-separated)")
    ap.add_argument("--contexts", help="only these contexts in tokens (comma-separated)")
    ap.add_argument("--kernels", metavar="GLOB", help="only tuning variants whose uri matches this shell glob "
                    "(e.g. '*_bn32_w8_rt2_st2_tree_*'; keep the ns field free so auto and fixed NSPLIT both build)")
    ap.add_argument("--smem-per-sm", type=_smem_arg, help="time mlagen as if an SM had this much shared memory: bytes, or "
                    "'sm120' (102400, RTX PRO 6000) so CTAs per SM match the sm_120 target")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU; nothing measured")
        return 1
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    grid = SMALL if a.grid == "small" else FULL
    if a.heads:
        grid = [g for g in grid if g[0] in {int(x) for x in a.heads.split(",")}]
    if a.batches:
        grid = [g for g in grid if g[2] in {int(x) for x in a.batches.split(",")}]
    if a.page_sizes:
        grid = [g for g in grid if g[4] in {int(x) for x in a.page_sizes.split(",")}]
    if a.contexts:
        grid = [g for g in grid if g[3] in {int(x) for x in a.contexts.split(",")}]
    if not grid:
        print("no shape left after --heads / --batches / --page-sizes / --contexts")
        return 1
    from mlagen.ops import SM120_SMEM_PER_SM

    smem_cap = SM120_SMEM_PER_SM if a.smem_per_sm == "sm120" else a.smem_per_sm
    ok_sgl, why = (False, "--skip-sglang") if a.skip_sglang else sgl.sglang_available()
    if not ok_sgl:
        print(f"SGLang columns skipped: {why}")
    ceil = ceilings.measure_ceilings()
    bw, mma = ceil["copy_gbs"], ceil["mma_tflops"]
    print(f"ceilings: copy {bw:.0f} GB/s, mma.sync bf16 {mma:.0f} TFLOP/s {ceil['errors'] or ''}", flush=True)

    # build + verify the tuning sweep of every bucket
    kernels: dict[tuple, list[VerifyKernel]] = {}
    t0 = time.time()
    for H, q, ps in sorted({(H, q, ps) for H, q, _, _, ps in grid}):
        rep = build(parse_spec(tuning_spec(H, q, ps)), kernels=a.kernels, jobs=a.jobs)
        for v, m in rep.failed:
            print(f"build failed {v.uri}: {m.splitlines()[0] if m else ''}")
        ks = []
        verified: dict[str, bool] = {}
        for b in rep.built:
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
            print(f"no verified nsplit-auto variant for H={H} q_len={q} page_size={ps}"
                  + (f" matching --kernels {a.kernels} (keep the ns field free)" if a.kernels else ""))
            return 1
        kernels[(H, q, ps)] = ks
    print(f"built + verified {sum(len(v) for v in kernels.values())} variants in {time.time() - t0:.0f} s", flush=True)

    rows, sweep = [], []
    for H, q, bs, ctx, ps in grid:
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
        if fixed:
            ns_best = min(fixed, key=fixed.get)
            row.update(nsplit_fixed_us=fixed, best_fixed_nsplit=ns_best, auto_over_best_fixed=best / fixed[ns_best])
        if (H, q, bs, ps) == (8, 9, 1, 1):  # the NSPLIT sweep shown in the output
            sweep.extend(dict(ctx=ctx, nsplit=ns, us=us) for ns, us in fixed.items())
            sweep.append(dict(ctx=ctx, nsplit="auto", us=best))
        if ok_sgl:
            try:
                if q > 1:
                    ref = sgl.run_extend_verify(p)
                    mine = torch.empty_like(ref)
                    k_best = [k for k in cands if k.variant.uri == best_uri][0]
                    P = p["page_size"]
                    table = p["req_to_token"] if P == 1 else (p["req_to_token"][:, ::P] // P).contiguous()
                    k_best(p["q"], p["kv_cache"], table, p["kv_lens"], q_len=q, softmax_scale=p["softmax_scale"],
                           tree_mask=p["tree_mask"], out=mine)
                    row["max_abs_diff_vs_sglang"] = float((mine.float() - ref.float()).abs().max())
                    row["sglang_verify_us"] = sgl.time_extend_verify(p)
                dec = {s: sgl.time_decode_splitkv(p, s) for s in DECODE_SPLITS}
                s_best = min(dec, key=dec.get)
                row.update(sglang_decode_us=dec[s_best], sglang_decode_splits=s_best, sglang_decode_all=dec)
            except Exception as e:  # noqa: BLE001 — report, never fake
                row["sglang_error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        print(_fmt(row), flush=True)
        if len(times) > 1:  # the tile sweep of this shape, fastest first
            print("    tiles: " + ", ".join(f"{_tile(u)} {t:.1f}" for u, t in sorted(times.items(), key=lambda x: x[1])), flush=True)
        # partial record after every shape: a job cut short by its time limit still leaves its rows
        (out_dir / "bench.json").write_text(json.dumps(dict(partial=True, ceilings=ceil, rows=rows, nsplit_sweep=sweep), indent=1))
        del p
        torch.cuda.empty_cache()

    record = dict(device=torch.cuda.get_device_name(), driver=_driver(), torch=torch.__version__,
                  triton=_ver("triton"), sglang=_ver("sglang"), mlagen=mlagen.__version__, python=platform.python_version(),
                  ceilings=ceil, grid=a.grid, rows=rows, nsplit_sweep=sweep, at=time.time(),
                  mlagen_smem_per_sm=smem_cap)
    (out_dir / "bench.json").write_text(json.dumps(record, indent=1))
    Registry().add_bench_run(record)
    _table(rows, sweep)
    _plot(rows, out_dir / "bench.png", record["device"])
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
    return 0


def _smem_arg(text: str):
    """--smem-per-sm value: 'sm120' or a positive byte count."""
    if text == "sm120":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'sm120' or bytes, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {n}")
    return n


def _tile(uri: str) -> str:
    """The tuning part of a uri: load width, block_n, warps, row tiles, stages, overlap."""
    from mlagen.spec import Variant

    v = Variant.from_uri(uri)
    return (f"lw{v.load_width}_bn{v.block_n}_w{v.num_warps}_rt{v.row_tiles}_st{v.stages}"
            f"{'_ov1' if v.overlap else ''}")


def _fmt(r: dict) -> str:
    tile = _tile(r["mlagen_uri"])
    s = (f"H={r['H']:3d} q={r['q_len']} bs={r['bs']:2d} ctx={r['ctx']:6d} ps={r['page_size']:2d} | mlagen {tile} "
         f"{r['mlagen_us']:8.1f} us {r['gbs']:6.0f} GB/s {r['frac_floor']:.2f} of floor ({r['floor_us']:.1f} us)")
    if "sglang_verify_us" in r:
        s += f" | triton verify {r['sglang_verify_us']:9.1f} us ({r['sglang_verify_us'] / r['mlagen_us']:6.1f}x)"
    if "sglang_decode_us" in r:
        s += f" | triton split-KV S={r['sglang_decode_splits']} {r['sglang_decode_us']:7.1f} us ({r['sglang_decode_us'] / r['mlagen_us']:5.1f}x)"
    if "auto_over_best_fixed" in r:
        s += f" | auto/best fixed (ns{r['best_fixed_nsplit']}) {r['auto_over_best_fixed']:.2f}"
    if "max_abs_diff_vs_sglang" in r:
        s += f" | max|diff| {r['max_abs_diff_vs_sglang']:.3g}"
    if "sglang_error" in r:
        s += f" | sglang error: {r['sglang_error'][:80]}"
    return s


def _table(rows, sweep) -> None:
    print("\n| H | q | bs | ctx | ps | mlagen µs | GB/s | of floor | floor µs | Triton verify µs | speedup | Triton split-KV µs (S) | speedup | auto / best fixed NSPLIT |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tv, td, us = r.get("sglang_verify_us"), r.get("sglang_decode_us"), r["mlagen_us"]
        tv_s = "-" if tv is None else f"{tv:.0f}"
        tv_x = "-" if tv is None else f"{tv / us:.0f}x"
        td_s = "-" if td is None else f"{td:.0f} ({r['sglang_decode_splits']})"
        td_x = "-" if td is None else f"{td / us:.1f}x"
        print(f"| {r['H']} | {r['q_len']} | {r['bs']} | {r['ctx']} | {r['page_size']} | {us:.1f} | {r['gbs']:.0f} | "
              f"{r['frac_floor']:.2f} | {r['floor_us']:.1f} | {tv_s} | {tv_x} | {td_s} | {td_x} | "
              + (f"{r['auto_over_best_fixed']:.2f} (ns{r['best_fixed_nsplit']})" if "auto_over_best_fixed" in r else "-") + " |")
    if sweep:
        print("\nNSPLIT sweep, H=8 q=9 bs=1 ps=1 (µs):")
        for ctx in sorted({s["ctx"] for s in sweep}):
            print(f"  ctx={ctx}: " + ", ".join(f"ns{s['nsplit']}={s['us']:.1f}" for s in sweep if s["ctx"] == ctx))


def _plot(rows, path, device) -> None:
    from mlagen.plot import plot_time_vs_context

    sel = [r for r in rows if (r["H"], r["q_len"], r["bs"], r["page_size"]) == (8, 9, 1, 1)]
    series = {"mlagen (best verified)": [(r["ctx"], r["mlagen_us"]) for r in sel]}
    if any("sglang_verify_us" in r for r in sel):
        series["SGLang extend_attention_fwd (verify path)"] = [(r["ctx"], r["sglang_verify_us"]) for r in sel if "sglang_verify_us" in r]
    if any("sglang_decode_us" in r for r in sel):
        series["SGLang decode_attention_fwd (best splits, no tree mask)"] = [(r["ctx"], r["sglang_decode_us"]) for r in sel if "sglang_decode_us" in r]
    plot_time_vs_context(series, str(path), f"H=8 q_len=9 tree bs=1 page_size=1 on {device}",
                         [(r["ctx"], r["floor_us"]) for r in sel])


def _driver() -> str:
    try:
        import subprocess

        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.strip()
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
