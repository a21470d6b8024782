"""One shape, one variant, for ncu / compute-sanitizer:

    python tools/device_profile.py URI CTX BS [quick-verify] [NAME=VALUE ...]

With quick-verify (any fourth argument without "="), the variant's quick verification set instead of the shape.
NAME=VALUE arguments build a diagnostic module with ``#define NAME VALUE`` ahead of the rendered source, as
tools/device_ab_define.py does (built under $MLAGEN_ABLATE_DIR, never into the registry), e.g. racecheck of a
diagnostic build: compute-sanitizer --tool racecheck python3 tools/device_profile.py URI 0 0 quick MLAGEN_DST_HALF_K=9
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
args = [a for a in sys.argv[1:] if "=" not in a]
defines = [tuple(a.split("=", 1)) for a in sys.argv[1:] if "=" in a]
if len(args) < 3:
    sys.exit("usage: python tools/device_profile.py URI CTX BS [quick-verify] [NAME=VALUE ...]")
if not torch.cuda.is_available():
    sys.exit("tools/device_profile.py needs a CUDA GPU (none visible to torch); nothing run")
from mlagen.build import build_variants, build_with_defines  # noqa: E402
from mlagen.spec import Variant  # noqa: E402
from mlagen.ops import VerifyKernel  # noqa: E402
from mlagen.cases import make_problem  # noqa: E402

v = Variant.from_uri(args[0])
if defines:
    from device_ab_define import diagnostic_dir  # noqa: E402  (tools/ is this script's directory)
    mod, so = build_with_defines(v, defines, diagnostic_dir())
    k = VerifyKernel(v, so, mod)
    print("diagnostic build:", mod, flush=True)
else:
    b = build_variants(v.spec_dict("prof"), kernels=v.uri)[0]
    k = VerifyKernel(b.variant, b.so_path)
if len(args) > 3:
    from mlagen.verify import verify_kernel
    for r in verify_kernel(k, quick=True):
        print(("ok  " if r.passed else "FAIL"), r.name, r.detail, flush=True)
    sys.exit(0)
ctx, bs = int(args[1]), int(args[2])
p = make_problem(v, [ctx] * bs, device="cuda", poison_pool=False)
ws = k.alloc_workspace(bs, "cuda")
for _ in range(3):
    k(p.q, p.kv_cache, p.block_table, p.kv_lens, workspace=ws, **p.kernel_args())
torch.cuda.synchronize()
print("splits", k.num_splits(bs))
