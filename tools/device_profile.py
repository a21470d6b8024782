"""One shape, one variant, for ncu / compute-sanitizer: python tools/device_profile.py URI CTX BS [quick-verify]."""
import sys, torch

if len(sys.argv) < 4:
    sys.exit("usage: python tools/device_profile.py URI CTX BS [quick-verify]")
if not torch.cuda.is_available():
    sys.exit("tools/device_profile.py needs a CUDA GPU (none visible to torch); nothing run")
from mlagen.build import build_variants
from mlagen.spec import Variant
from mlagen.ops import VerifyKernel
from mlagen.cases import make_problem

v = Variant.from_uri(sys.argv[1])
b = build_variants(v.spec_dict("prof"), kernels=v.uri)[0]
k = VerifyKernel(b.variant, b.so_path)
if len(sys.argv) > 4:
    from mlagen.verify import verify_kernel
    for r in verify_kernel(k, quick=True):
        print(("ok  " if r.passed else "FAIL"), r.name, r.detail, flush=True)
    sys.exit(0)
ctx, bs = int(sys.argv[2]), int(sys.argv[3])
p = make_problem(v, [ctx] * bs, device="cuda", poison_pool=False)
ws = k.alloc_workspace(bs, "cuda")
for _ in range(3):
    k(p.q, p.kv_cache, p.block_table, p.kv_lens, workspace=ws, **p.kernel_args())
torch.cuda.synchronize()
print("splits", k.num_splits(bs))
