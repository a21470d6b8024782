"""Verify built variants against the torch reference on the GPU over the case set of
:mod:`mlagen.cases`. Outputs are NaN-poisoned before every launch; NaN never passes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mlagen.cases import Problem, verify_cases
from mlagen.ops import WS_HEADER_FLOATS, VerifyKernel
from mlagen.reference import mla_verify_reference, split_kv_scale

# bf16 output (8 significant bits: round-to-nearest moves a value by at most 2^-8 of it) of fp32-accumulated
# attention; P is rounded to bf16 before P V. Each output element may differ from the fp32 reference by
# out_atol + out_rtol_mag x (P |V|) for that element: rounding P moves it by at most 2^-8 x P |V|, rounding
# dimsplit_t's bf16 split partials (include/mlagen/mla_verify_partial_store.cuh; other schedules keep fp32) by
# at most 2^-8 x P |V| after the combine's weighting, and rounding the output by 2^-8 x |out| <= 2^-8 x P |V|,
# so 3 x 2^-8 is the worst case of the three roundings (they rarely align); fp32 accumulation adds ~1e-6
# relative, which out_atol covers. With N(0, 1) values
# P |V| is about 1 and out_atol dominates; with fp8 rows at +-448 (outputs in the hundreds, a bf16 ulp of
# 2) the magnitude term does.
# fp8_e4m3 KV: every e4m3 value is exact in bf16 and q / accumulation are not quantized, so the same bounds.
TOLERANCE = {"bf16": dict(out_atol=2e-2, out_rtol_mag=3 * 2.0 ** -8, out_rel_l2=1e-2, lse_atol=2e-3, lse_rtol=1e-3)}
TOLERANCE["fp8_e4m3"] = TOLERANCE["bf16"]


@dataclasses.dataclass
class CaseResult:
    name: str
    passed: bool
    max_abs_err: float
    rel_l2_err: float
    lse_max_err: float
    detail: str = ""


def compare(p: Problem, out: torch.Tensor, lse: torch.Tensor, dtype: str = "bf16", kv_lora_rank: int = 512) -> CaseResult:
    """Compare a kernel result with the reference for problem ``p`` (tolerances per dtype: ``TOLERANCE``).

    An output element passes when |out - ref| <= out_atol + out_rtol_mag x (P |V|) of that element (the
    reference's ``with_magnitude``); NaN / inf never passes; rel L2 and lse are bounded as well.

    Args:
        p: the problem the kernel ran on (the reference runs on it here, on p.q's device).
        out: [bs*q_len, H, kv_lora_rank], bf16 or fp32 (compared as fp32), on p.q's device.
        lse: fp32 [bs*q_len, H] (natural log; -inf where no key is visible), on p.q's device.
        dtype: the variant's KV dtype, a key of ``TOLERANCE`` ("bf16" or "fp8_e4m3").
        kv_lora_rank: the variant's kv_lora_rank.
    Returns:
        A :class:`CaseResult` named after ``p``; ``detail`` lists every failed bound.
    Raises:
        KeyError: ``dtype`` is not a key of ``TOLERANCE``.
        ValueError: from :func:`mlagen.reference.mla_verify_reference` (unknown mask, tree mask missing, bad
            kv_scale).
    """
    tol = TOLERANCE[dtype]
    ref_out, ref_lse, ref_mag = mla_verify_reference(p.q, p.kv_cache, p.block_table, p.kv_lens,
                                                     kv_lora_rank=kv_lora_rank, with_magnitude=True,
                                                     **p.reference_args())
    o = out.float()
    problems = []
    if not torch.isfinite(o).all():
        problems.append(f"{int((~torch.isfinite(o)).sum())} non-finite outputs")
    diff = (o - ref_out).abs().nan_to_num(float("inf"))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    denom = float(ref_out.norm()) or 1.0
    if not math.isfinite(denom):
        problems.append("non-finite reference output")
    rel_l2 = float((o - ref_out).nan_to_num(float("inf")).norm()) / denom
    bound = tol["out_atol"] + tol["out_rtol_mag"] * ref_mag
    over = ~(diff <= bound)  # a NaN bound (a NaN the reference read) fails too
    if over.any():
        i = int((diff - bound).flatten().argmax())
        problems.append(f"{int(over.sum())} outputs over {tol['out_atol']} + {tol['out_rtol_mag']:.3g} x P|V|: "
                        f"max |out - ref| {max_abs:.3g}; worst {float(diff.flatten()[i]):.3g} > "
                        f"{float(bound.flatten()[i]):.3g}")
    if rel_l2 > tol["out_rel_l2"]:
        problems.append(f"rel L2 {rel_l2:.3g} > {tol['out_rel_l2']}")
    if torch.isnan(lse).any():
        problems.append("NaN in lse")
    fin = torch.isfinite(ref_lse)
    if not torch.equal(torch.isfinite(lse), fin) or not torch.equal(lse[~fin], ref_lse[~fin]):
        problems.append("lse -inf pattern differs from reference")
    lse_err = float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
    lse_bound = tol["lse_atol"] + tol["lse_rtol"] * (float(ref_lse[fin].abs().max()) if fin.any() else 0.0)
    if lse_err > lse_bound:
        problems.append(f"max |lse - ref| {lse_err:.3g} > {lse_bound:.3g}")
    return CaseResult(p.name, not problems, max_abs, rel_l2, lse_err, "; ".join(problems))


def run_case(kernel: VerifyKernel, p: Problem) -> CaseResult:
    """Launch ``kernel`` on ``p`` with NaN-poisoned out / lse / workspace and compare. A problem with KV
    descales (fp8) runs as SGLang's backends run it: softmax_scale x k_scale into the kernel, the output
    times v_scale after it (in fp32 here)."""
    v = kernel.variant
    out = torch.full((p.q.shape[0], v.heads, v.dim_v), float("nan"), dtype=torch.bfloat16, device=p.q.device)
    lse = torch.full((p.q.shape[0], v.heads), float("nan"), dtype=torch.float32, device=p.q.device)
    ws = kernel.alloc_workspace(p.batch_size, p.q.device)
    # the partials, all bits set: NaN as fp32 and as bf16 partials alike; the header holds the merge counters (zero)
    ws[WS_HEADER_FLOATS:].view(torch.int32).fill_(-1)
    args = p.kernel_args()
    k_scale, v_scale = split_kv_scale(p.kv_scale)
    args["softmax_scale"] = p.softmax_scale * k_scale
    kernel(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out, lse=lse, workspace=ws, **args)
    torch.cuda.synchronize()
    return compare(p, out.float() * v_scale if v_scale != 1.0 else out, lse, v.dtype, v.kv_lora_rank)


def verify_kernel(kernel: VerifyKernel, *, quick: bool = False, big_pool: bool = True) -> list[CaseResult]:
    """Run the whole case set; frees each problem before the next (the >4 GiB pool is large)."""
    results = []
    for p in verify_cases(kernel.variant, quick=quick, big_pool=big_pool):
        results.append(run_case(kernel, p))
        del p
        torch.cuda.empty_cache()
    return results


def summarize(results: list[CaseResult]) -> dict:
    return dict(cases=len(results), passed=sum(r.passed for r in results),
                max_abs_err=max((r.max_abs_err for r in results), default=math.nan),
                max_lse_err=max((r.lse_max_err for r in results), default=math.nan))
