"""Device smoke: build a few variants, run the verify set, time a few shapes. Prints a table."""
import sys, time, torch
from mlagen.build import build
from mlagen.spec import parse_spec
from mlagen.ops import VerifyKernel
from mlagen.verify import verify_kernel, summarize
from mlagen.bench import bench_kernel, Shape, copy_bandwidth_gbs

spec = parse_spec(dict(name="smoke", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit=[64, "auto"],
                       load_width=[64, 128], mask="tree", arch=["sm_120", "sm_90"]))
t = time.time()
rep = build(spec, jobs=16)
print(f"build {time.time()-t:.1f}s built={len(rep.built)} failed={len(rep.failed)}")
for v, m in rep.failed:
    print("FAILED", v.uri, m[:2000])
for b in rep.built:
    print(b.uri, {a: (r["registers"], r["spill_stores"]) for a, r in b.resources.items() if a.startswith("sm")})
bw = copy_bandwidth_gbs()
print(f"copy bw {bw:.0f} GB/s")
for b in rep.built:
    k = VerifyKernel(b.variant, b.so_path)
    res = verify_kernel(k, quick=("quick" in sys.argv))
    s = summarize(res)
    print(b.uri, s)
    for r in res:
        if not r.passed:
            print("   FAIL", r.name, r.detail)
    if s["passed"] != s["cases"]:
        continue
    for ctx in (4096, 16384, 65536):
        for bs in (1, 4):
            r = bench_kernel(k, Shape(8, 9, bs, ctx, b.variant.page_size))
            print(f"   ctx={ctx:6d} bs={bs} {r['median_us']:9.1f} us {r['gbs']:7.0f} GB/s  frac={r['gbs']/bw:.2f}")
