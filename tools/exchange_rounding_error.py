"""Output error of rounding one CTA's half of the partial scores to fp16 in dimsplit_t's score exchange, emulated on
the CPU (no GPU, no kernel): the arithmetic of ``MLAGEN_DST_XCHG_F16`` 2 (docs/perf-notes.md v40).

    python3 tools/exchange_rounding_error.py [--keys 65536] [--rows 16] [--dims 64]

Per case, each row's logits (softmax scale included) are drawn as N(0, sigma^2), optionally with 8 keys set near a
top value (Kimi-K2's QK-clip caps a head's largest logits near 100); each logit's raw score (logit / scale, scale =
192^-0.5) is split at random into the two CTAs' partial scores, and the peer's is rounded to fp16 (round to nearest),
as the kernel's receiver sees it. The output (float64 softmax @ V, V ~ N(0, 1)) is compared with the unrounded one:
the largest |error| over the rows and dims, and its largest ratio to mlagen.verify's bf16 bound
(out_atol + out_rtol_mag x P|V|). Prints one markdown row per case.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlagen.verify import TOLERANCE  # noqa: E402

CASES = ((1.0, None), (3.0, None), (5.0, 30.0), (5.0, 60.0), (5.0, 100.0))


def case_error(sigma: float, top: float | None, keys: int, rows: int, dims: int,
               gen: torch.Generator) -> tuple[float, float]:
    """(max |out error|, max error / verify bound) over ``rows`` rows of ``keys`` keys and ``dims`` output dims."""
    tol = TOLERANCE["bf16"]
    scale = 192 ** -0.5
    worst_abs = worst_ratio = 0.0
    for _ in range(rows):
        logit = torch.randn(keys, dtype=torch.float64, generator=gen) * sigma
        if top is not None:
            idx = torch.randperm(keys, generator=gen)[:8]
            logit[idx] = top - 2 * torch.rand(8, dtype=torch.float64, generator=gen)
        s = logit / scale
        s0 = s * torch.rand(keys, dtype=torch.float64, generator=gen)
        s1 = s - s0
        s1_f16 = s1.to(torch.float16).to(torch.float64)  # the peer's half, through the fp16 exchange
        v = torch.randn(keys, dims, dtype=torch.float64, generator=gen)
        p = torch.softmax(s * scale, 0)
        p16 = torch.softmax((s0 + s1_f16) * scale, 0)
        err = (p16 @ v - p @ v).abs()
        bound = tol["out_atol"] + tol["out_rtol_mag"] * (p @ v.abs())
        worst_abs = max(worst_abs, float(err.max()))
        worst_ratio = max(worst_ratio, float((err / bound).max()))
    return worst_abs, worst_ratio


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--keys", type=int, default=65536)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--dims", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(a.seed)
    print("| logits | max \\|out error\\| | of the verify bound |")
    print("|---|---|---|")
    for sigma, top in CASES:
        e, r = case_error(sigma, top, a.keys, a.rows, a.dims, gen)
        what = f"N(0, {sigma ** 2:g})" + (f", 8 keys near {top:g}" if top is not None else "")
        print(f"| {what} | {e:.2g} | {r:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
