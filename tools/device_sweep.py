"""Device sweep: build a tuning sweep, quick-verify each module, time key shapes. Prints a table."""
import sys, time, json, os, torch
from mlagen.build import build
from mlagen.spec import parse_spec
from mlagen.ops import VerifyKernel
from mlagen.verify import verify_kernel, summarize
from mlagen.bench import bench_kernel, Shape, copy_bandwidth_gbs

spec = parse_spec(json.loads(sys.argv[1]))
shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]  # ctx x bs
t = time.time()
rep = build(spec, jobs=16)
print(f"build {time.time()-t:.1f}s built={len(rep.built)} failed={len(rep.failed)} infeasible={len(rep.infeasible)}")
for v, m in rep.failed:
    print("FAILED", v.uri, m[:1500])
bw = copy_bandwidth_gbs()
print(f"copy bw {bw:.0f} GB/s")
rows = []
for b in rep.built:
    k = VerifyKernel(b.variant, b.so_path)
    res = verify_kernel(k, quick=True)
    s = summarize(res)
    bad = [r for r in res if not r.passed]
    regs = {a: r["registers"] for a, r in b.resources.items() if a.startswith("sm")}
    line = f"{b.uri} occ={k.module.max_active_ctas_per_sm()} regs={regs} verify={s['passed']}/{s['cases']} err={s['max_abs_err']:.4f}"
    for r in bad:
        line += f"\n   FAIL {r.name}: {r.detail}"
    if not bad:
        for ctx, bs in shapes:
            r = bench_kernel(k, Shape(b.variant.heads, b.variant.q_len, bs, ctx, b.variant.page_size))
            line += f"\n   ctx={ctx:6d} bs={bs} {r['median_us']:8.1f} us {r['gbs']:6.0f} GB/s frac={r['gbs']/bw:.2f} splits={k.num_splits(bs)}"
    print(line, flush=True)
