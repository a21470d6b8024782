"""Device sweep: build a tuning sweep, quick-verify each module, time key shapes. Prints a table.

    python3 tools/device_sweep.py SPEC_JSON SHAPES     e.g. '{"name": "t", "heads_per_rank": 8, "q_len": 9}' 65536x1,4096x1

SPEC_JSON is a spec as JSON (the YAML keys of specs/*.yaml); SHAPES are CTXxBS pairs (context in tokens, batch size).
Needs a CUDA GPU (checked before anything is built)."""
import argparse
import json
import sys
import time


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected CTXxBS pairs like 65536x1,4096x4, got {text!r}")
    return shapes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("spec_json", metavar="SPEC_JSON")
    ap.add_argument("shapes", metavar="SHAPES", type=_shapes)
    ap.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (default: mlagen's, MAX_JOBS)")
    a = ap.parse_args(argv)
    import torch

    from mlagen.spec import SpecError, parse_spec

    try:
        spec = parse_spec(json.loads(a.spec_json), source="SPEC_JSON")
    except (json.JSONDecodeError, SpecError) as e:
        ap.error(f"SPEC_JSON: {e}")
    if not torch.cuda.is_available():
        sys.exit("device_sweep: needs a CUDA GPU (none visible to torch)")
    from mlagen.bench import Shape, bench_kernel, copy_bandwidth_gbs
    from mlagen.build import build
    from mlagen.ops import VerifyKernel
    from mlagen.verify import summarize, verify_kernel

    t = time.time()
    rep = build(spec, jobs=a.jobs)
    print(f"build {time.time() - t:.1f}s built={len(rep.built)} failed={len(rep.failed)} infeasible={len(rep.infeasible)}")
    for v, m in rep.failed:
        print("FAILED", v.uri, m[:1500])
    bw = copy_bandwidth_gbs()
    print(f"copy bw {bw:.0f} GB/s")
    for b in rep.built:
        k = VerifyKernel(b.variant, b.so_path)
        res = verify_kernel(k, quick=True)
        s = summarize(res)
        bad = [r for r in res if not r.passed]
        regs = {arch: r["registers"] for arch, r in b.resources.items() if arch.startswith("sm")}
        line = (f"{b.uri} occ={k.module.max_active_ctas_per_sm()} regs={regs} verify={s['passed']}/{s['cases']} "
                f"err={s['max_abs_err']:.4f}")
        for r in bad:
            line += f"\n   FAIL {r.name}: {r.detail}"
        if not bad:
            for ctx, bs in a.shapes:
                r = bench_kernel(k, Shape(b.variant.heads, b.variant.q_len, bs, ctx, b.variant.page_size))
                line += (f"\n   ctx={ctx:6d} bs={bs} {r['median_us']:8.1f} us {r['gbs']:6.0f} GB/s frac={r['gbs'] / bw:.2f} "
                         f"splits={k.num_splits(bs)}")
        print(line, flush=True)
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
