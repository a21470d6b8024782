"""A/B timing of split policies (num_kv_splits and the least tokens per split) of one built variant (GPU), in one
process: every policy runs the same module on the same problems, shapes timed for every policy in alternating
rounds (the median of the rounds is printed), outputs first compared with the first policy's (split boundaries
move, so sums run in another order: --atol).

A policy is ``auto`` (the variant's own split count and least tokens per split), ``waves`` (auto_num_splits
without fill_waves: the smallest count within the slack), or a fixed split count; ``:mtN`` sets the least tokens
per non-empty split (default: the variant's own). The policy before perf-notes v23 is ``waves:mt64``. e4m3 variants
are timed on an e4m3 cache (N(0, 1) rows cast on the device, as mlagen.bench does).

    python3 tools/device_split_ab.py URI --policies waves:mt64,auto,auto:mt64,auto:mt128 --cases 1x4096,1x131072

URI (a uri or a glob) must match one auto variant in the registry ($MLAGEN_CACHE_DIR; build it first).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlagen import ops  # noqa: E402
from mlagen.bench import L2_ROTATE_BYTES, graph_time_us  # noqa: E402
from mlagen.cases import make_problem  # noqa: E402
from mlagen.roofline import verify_bytes  # noqa: E402


class PolicyKernel(ops.VerifyKernel):
    """The module of ``base`` launched with another split count (per batch size) and least tokens per split."""

    def __init__(self, base: ops.VerifyKernel, policy: str):
        self.__dict__.update(base.__dict__)
        self._sm = {}
        self.policy = policy
        kind, _, mt = policy.partition(":mt")
        self._kind = kind
        self._min_tokens = int(mt) if mt else None
        if kind not in ("auto", "waves") and not kind.isdigit():
            raise SystemExit(f"policy {policy!r}: auto, waves or a split count, with an optional :mtN")

    def num_splits(self, batch_size, device=None):
        if self._kind.isdigit():
            return int(self._kind)
        if self._kind == "auto":
            return ops.VerifyKernel.num_splits(self, batch_size, device)
        v = self.variant
        return ops.auto_num_splits(max(1, batch_size) * v.row_blocks * v.ctas_per_row_block, self.cta_slots(device),
                                   slack=self.auto_slack, fill_waves=False)

    def min_tiles_per_split(self):
        if self._min_tokens is None:
            return ops.VerifyKernel.min_tiles_per_split(self)
        return max(1, self._min_tokens // self.variant.block_n)

    def workspace_numel(self, batch_size, device=None):
        return self.workspace_floats(max(1, batch_size) * self.num_splits(batch_size, device))


def split_shape(kv_len: int, block_n: int, splits: int, min_tiles: int) -> tuple[int, int]:
    """(tiles per non-empty split, non-empty splits) as include/mlagen/mla_verify_split.cuh partitions a request."""
    tiles = -(-kv_len // block_n)
    per = max(min_tiles, -(-tiles // splits))
    return per, min(splits, -(-tiles // per))


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("uri")
    ap.add_argument("--policies", default="waves:mt64,auto")
    ap.add_argument("--cases", default="1x4096,1x16384,1x65536,1x131072", help="BSxCTX,...")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--atol", type=float, default=1 / 64)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU; nothing measured", file=sys.stderr)
        return 1
    from mlagen.registry import Registry

    rows = Registry().variants(a.uri)
    if len(rows) != 1:
        sys.exit(f"{a.uri}: {len(rows)} registry entries match ({', '.join(r['uri'] for r in rows)}); "
                 "name one built variant (mlagen build)")
    base = ops.load_variant(rows[0]["uri"])
    if base.variant.nsplit != "auto":
        sys.exit(f"{a.uri}: not an auto variant")
    kernels = [PolicyKernel(base, pol) for pol in a.policies.split(",")]
    v = base.variant
    cases = [tuple(map(int, c.split("x"))) for c in a.cases.split(",")]
    print(f"{v.uri} on {torch.cuda.get_device_name()}, {a.rounds} rounds")
    rows = []
    for bs, ctx in cases:
        fp8 = v.dtype == "fp8_e4m3"
        per = verify_bytes(v.heads, v.q_len, bs, ctx, v.dim_qk, v.dim_v, kv_bytes=1 if fp8 else 2)
        n_rot = max(2, min(64, -(-L2_ROTATE_BYTES // per)))
        probs = [make_problem(v, [ctx] * bs, q_len=v.q_len, device="cuda", seed=r, poison_pool=False, name="split")
                 for r in range(n_rot)]
        if fp8:  # N(0, 1) rows cast to e4m3 on the device, as mlagen.bench times e4m3 variants
            probs = [dataclasses.replace(p, kv_cache=p.kv_cache.to(torch.float8_e4m3fn)) for p in probs]
        launches, outs = [], []
        for k in kernels:
            ls, os_ = [], []
            for p in probs:
                out = torch.full((p.q.shape[0], v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device="cuda")
                ws = k.alloc_workspace(bs, "cuda")
                ls.append(lambda k=k, p=p, out=out, ws=ws: k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out,
                                                            workspace=ws, **p.kernel_args()))
                os_.append(out)
            launches.append(ls)
            outs.append(os_)
            ls[0]()
        torch.cuda.synchronize()
        nan = any(o[0].isnan().any().item() for o in outs)
        diff = max((float((o[0].float() - outs[0][0].float()).abs().max()) for o in outs[1:]), default=0.0)
        if nan or diff > a.atol:
            print(f"bs {bs} ctx {ctx}: outputs DIFFER (max |diff| {diff:.3g}{', NaN' if nan else ''})")
            return 1
        times = [[] for _ in kernels]
        for rnd in range(a.rounds):
            order = range(len(kernels)) if rnd % 2 == 0 else reversed(range(len(kernels)))
            for i in order:
                times[i].append(graph_time_us(launches[i]))
        med = [statistics.median(t) for t in times]
        splits = [k.num_splits(bs) for k in kernels]
        tiles = [split_shape(ctx, v.block_n, s, k.min_tiles_per_split()) for s, k in zip(splits, kernels)]
        rows.append((bs, ctx, med, splits, tiles, diff))
        print(f"bs {bs} ctx {ctx}: " + ", ".join(f"{k.policy} {t:.1f} us (ns {s}, {tl[0]} tiles x {tl[1]} live)"
                                                  for k, t, s, tl in zip(kernels, med, splits, tiles))
              + f"; max |diff| {diff:.3g}", flush=True)
        del probs, launches, outs
        torch.cuda.empty_cache()
    print("\n| bs | ctx | " + " | ".join(f"{k.policy} µs (ns, tiles x live)" for k in kernels) + " | " +
          " | ".join(f"{k.policy} / first" for k in kernels[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(kernels) - 1))
    for bs, ctx, med, splits, tiles, _ in rows:
        print(f"| {bs} | {ctx} | " + " | ".join(f"{t:.1f} ({s}, {tl[0]}x{tl[1]})" for t, s, tl in zip(med, splits, tiles))
              + " | " + " | ".join(f"{t / med[0]:.3f}" for t in med[1:]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
