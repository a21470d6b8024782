"""fp8 (e4m3) KV path of the reference and the fp8 case generator (issue #12), on CPU, fresh random inputs.

Semantics under test (docs/fp8-kv-cache.md): key = e4m3(byte) x k_scale, value = e4m3(byte)[:rank] x
v_scale, i.e. scores x k_scale and output x v_scale, as SGLang 0.5.23's Triton backend applies them.
"""

import random

import pytest
import torch

from mlagen.cases import (E4M3_MAX_BYTES, E4M3_NAN_BYTES, fp8_cases, make_fp8_problem, quantize_e4m3,
                          referenced_slots, verify_cases)
from mlagen.reference import (E4M3_MAX, dequantize_e4m3, e4m3_bytes, is_fp8_kv, mla_verify_naive,
                              mla_verify_reference, split_kv_scale)
from mlagen.spec import Variant


def _variant(heads=2, q_len=3, page_size=4, mask="tree"):
    return Variant(heads=heads, q_len=q_len, kv_lora_rank=512, qk_rope_head_dim=64, page_size=page_size,
                   nsplit="auto", load_width=128, block_n=32, num_warps=8, row_tiles=1, stages=3, mask=mask,
                   dtype="bf16", archs=("sm_90",), schedule="dimsplit")


def _ref(p, kv=None, **over):
    args = dict(p.reference_args(), **over)
    return mla_verify_reference(p.q, p.kv_cache if kv is None else kv, p.block_table, p.kv_lens, **args)


def _bits(x):
    return x.contiguous().view(torch.int32)


# ------------------------------------------------------------------ dequantization
def test_dequant_matches_torch_for_all_256_bytes():
    b = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    want = b.view(torch.float8_e4m3fn).float()  # torch's own conversion
    for kv in (b, b.view(torch.float8_e4m3fn), b.view(16, 16)):
        got = dequantize_e4m3(kv).reshape(-1)
        assert got.dtype == torch.float32
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert sorted(torch.nonzero(nan).flatten().tolist()) == sorted(E4M3_NAN_BYTES)
        assert torch.equal(_bits(got[~nan]), _bits(want[~nan]))  # bitwise, -0.0 (0x80) included
    assert dequantize_e4m3(torch.tensor([0x7E, 0xFE], dtype=torch.uint8)).tolist() == [E4M3_MAX, -E4M3_MAX]
    assert dequantize_e4m3(torch.tensor([0x01, 0x87], dtype=torch.uint8)).tolist() == [2.0**-9, -7 * 2.0**-9]
    with pytest.raises(TypeError):
        dequantize_e4m3(torch.zeros(3, dtype=torch.bfloat16))


def test_dequant_scale_is_one_fp32_product():
    s = random.uniform(0.05, 20.0)
    b = torch.randint(0, 256, (4096,), dtype=torch.int64).to(torch.uint8)
    got = dequantize_e4m3(b, s)
    s32 = torch.tensor(s, dtype=torch.float32)
    want = b.view(torch.float8_e4m3fn).float() * s32
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got[~nan]), _bits(want[~nan]))
    exact = b.view(torch.float8_e4m3fn).double()[~nan] * float(s32)  # 4 x 24 significant bits: exact in fp64
    assert torch.equal(got[~nan], exact.float())


def test_quantize_round_trip_and_edges():
    finite = torch.tensor([b for b in range(256) if b not in E4M3_NAN_BYTES], dtype=torch.int64).to(torch.uint8)
    assert torch.equal(quantize_e4m3(dequantize_e4m3(finite)), finite)  # every finite byte survives the round trip
    x = torch.tensor([448.0, 449.0, 500.0, -1e6, float("nan"), 2.0**-10, 1.5 * 2.0**-9, -0.0])
    got = quantize_e4m3(x).tolist()
    assert got[:4] == [0x7E, 0x7E, 0x7E, 0xFE]  # saturates to +-448 whatever torch does on overflow
    assert got[4] in E4M3_NAN_BYTES
    assert got[5] == 0x00 and got[6] == 0x02 and got[7] == 0x80  # round to nearest even in the subnormals
    s = random.uniform(0.2, 5.0)
    y = torch.randn(1000) * 3
    q = dequantize_e4m3(quantize_e4m3(y, s), s)
    # half an e4m3 ulp (2^-4 relative, s x 2^-10 in the subnormals) plus the two bf16 roundings of SGLang's k / k_scale
    assert ((q - y).abs() <= y.abs() * (2.0**-4 + 2.0**-7) + s * 2.0**-10).all()


def test_split_kv_scale():
    assert split_kv_scale(None) == (1.0, 1.0)
    assert split_kv_scale(0.37) == (0.37, 0.37)
    assert split_kv_scale((0.37, 3.1)) == (0.37, 3.1)
    for bad in (0.0, -1.0, float("nan"), float("inf"), (1.0, 2.0, 3.0)):
        with pytest.raises(ValueError):
            split_kv_scale(bad)


# ------------------------------------------------------------------ reference
@pytest.mark.parametrize("mask,P", [("tree", 1), ("tree", 4), ("causal", 4), ("none", 2)])
def test_fp8_reference_equals_bf16_reference_on_dequantized_kv(mask, P):
    p = make_fp8_problem(_variant(heads=3, q_len=4, page_size=P, mask=mask), [37, 4, 0, 61], device="cpu")
    assert p.kv_cache.dtype == torch.float8_e4m3fn and p.kv_scale == 1.0
    out, lse = _ref(p)
    # e4m3 values are exact in bf16: the bf16 path on the decoded cache is the same computation
    deq = dequantize_e4m3(p.kv_cache).to(torch.bfloat16)
    b_out, b_lse = _ref(p, kv=deq, kv_scale=None)
    assert torch.isfinite(out).all()
    assert torch.equal(out, b_out) and torch.equal(lse, b_lse)
    # and the uint8 view of the same bytes gives the same answer
    u_out, u_lse = _ref(p, kv=e4m3_bytes(p.kv_cache))
    assert torch.equal(out, u_out) and torch.equal(lse, u_lse)


@pytest.mark.parametrize("kv_scale", [1.0, 0.37, 3.1, (0.37, 3.1), "random"])
def test_fp8_reference_matches_naive_float64_loop(kv_scale):
    if kv_scale == "random":
        kv_scale = (random.uniform(0.1, 10.0), random.uniform(0.1, 10.0))
    p = make_fp8_problem(_variant(heads=2, q_len=3, page_size=4), [13, 3, 0, 9], kv_scale=kv_scale, special=True,
                         device="cpu")
    out, lse = _ref(p)
    args = {k: v for k, v in p.reference_args().items() if k != "req_pool_indices"}
    n_out, n_lse = mla_verify_naive(p.q, p.kv_cache, p.block_table, p.kv_lens, **args)
    assert torch.isfinite(out).all()
    fin = torch.isfinite(n_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    # fp32 scores of magnitude ~|lse| (up to ~1e3 with +-448 x scale) carry an absolute error of a few
    # |lse| x 2^-24 into the exponent: the tolerance follows the problem, not a fixed epsilon
    mag = 1.0 + float(n_lse[fin].abs().max())
    torch.testing.assert_close(out.double(), n_out, atol=2.0**-20 * mag * float(n_out.abs().max()), rtol=0)
    torch.testing.assert_close(lse.double()[fin], n_lse[fin], atol=2.0**-18 * mag, rtol=0)


def test_nan_bytes_in_stale_slots_do_not_change_the_output():
    P = 8
    lens = [P * 5 + 3, P + 1, 7]  # ragged last pages: stale slots inside referenced pages
    p = make_fp8_problem(_variant(heads=2, q_len=4, page_size=P), lens, kv_scale=0.37, device="cpu")
    b = e4m3_bytes(p.kv_cache)
    used = referenced_slots(p.block_table, p.kv_lens, P)
    unused = torch.ones(b.shape[0], dtype=torch.bool)
    unused[used] = False
    # stale slots of the ragged last pages and all unreferenced rows are NaN bytes, visible rows never
    stale = [int(p.block_table[r, L // P]) * P + j for r, L in enumerate(lens) for j in range(L % P, P)]
    assert stale and all(unused[s] for s in stale)
    nan_byte = (b == 0x7F) | (b == 0xFF)
    assert nan_byte[unused].all() and not nan_byte[used].any()
    assert torch.isnan(dequantize_e4m3(b[stale])).all()
    out, lse = _ref(p)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    # the same problem with random finite bytes where the NaNs were: bit-identical output
    clean = b.clone()
    rnd = torch.randint(0, 0x7F, clean.shape, dtype=torch.int64).to(torch.uint8) | (
        torch.randint(0, 2, clean.shape, dtype=torch.int64) << 7).to(torch.uint8)
    clean[unused] = rnd[unused]
    c_out, c_lse = _ref(p, kv=clean)
    assert torch.equal(out, c_out) and torch.equal(lse, c_lse)
    # while a NaN byte inside a visible row does poison it (the test can see a read)
    bad = b.clone()
    bad[used[torch.randint(0, used.numel(), (1,))], 5] = 0x7F
    bad_out, _ = _ref(p, kv=bad)
    assert torch.isnan(bad_out).any()


def test_scale_semantics_scores_times_k_scale_output_times_v_scale():
    ks, vs = random.uniform(0.2, 0.6), random.uniform(2.0, 4.0)
    p = make_fp8_problem(_variant(heads=4, q_len=5, page_size=2), [40, 17, 5], kv_scale=(ks, vs), device="cpu")
    out, lse = _ref(p)
    one_out, one_lse = _ref(p, kv_scale=1.0)
    assert not torch.allclose(out, one_out, rtol=1e-2)  # the scales matter
    # documented semantics: k_scale folds into the softmax scale, v_scale multiplies the output
    f_out, f_lse = _ref(p, kv_scale=1.0, softmax_scale=p.softmax_scale * ks)
    fin = torch.isfinite(lse)
    assert torch.equal(fin, torch.isfinite(f_lse))
    mag = 1.0 + float(lse[fin].abs().max())  # different fp32 roundings of the same scores (see above)
    torch.testing.assert_close(out, f_out * vs, atol=2.0**-18 * mag * float(out.abs().max()), rtol=0)
    torch.testing.assert_close(lse[fin], f_lse[fin], atol=2.0**-16 * mag, rtol=0)
    # one scale for both: the fp32 reference on the cache multiplied by it (the same computation)
    s = random.choice([0.37, 3.1])
    s_out, s_lse = _ref(p, kv_scale=s)
    m_out, m_lse = _ref(p, kv=dequantize_e4m3(p.kv_cache) * s, kv_scale=None)
    assert torch.equal(s_out, m_out) and torch.equal(s_lse, m_lse)


@pytest.mark.parametrize("byte", list(E4M3_MAX_BYTES) + [0x01, 0x87])
def test_extremes_survive_single_key(byte):
    """One visible key (kv_len = q_len = 1): softmax weight exactly 1, so out is the value row."""
    p = make_fp8_problem(_variant(heads=2, q_len=1, page_size=1), [1], kv_scale=(0.37, 3.1), device="cpu")
    b = e4m3_bytes(p.kv_cache).clone()
    slot = int(p.block_table[0, 0])
    signs = torch.randint(0, 2, (576,), dtype=torch.int64).to(torch.uint8) << 7
    b[slot] = (byte & 0x7F) | signs
    out, lse = _ref(p, kv=b)
    v = dequantize_e4m3(b[slot, :512], 3.1)
    assert (v.abs() == abs(dequantize_e4m3(torch.tensor([byte], dtype=torch.uint8), 3.1).item())).all()
    assert torch.equal(out[0], v.expand(2, 512))
    k = dequantize_e4m3(b[slot]).double()
    want_lse = (p.q[0].double() @ k) * p.softmax_scale * float(torch.tensor(0.37))
    torch.testing.assert_close(lse[0].double(), want_lse, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------ cases
def test_fp8_cases_layout_and_special_values():
    v = _variant(heads=2, q_len=5, page_size=16)
    seen = []
    for p in fp8_cases(v, device="cpu", quick=True):
        seen.append(p.name)
        assert is_fp8_kv(p.kv_cache) and p.kv_cache.shape[-1] == 576 and p.q.dtype == torch.bfloat16
        b = e4m3_bytes(p.kv_cache).reshape(-1, 576)
        used = referenced_slots(p.block_table, p.kv_lens, p.page_size, p.req_pool_indices)
        unused = torch.ones(b.shape[0], dtype=torch.bool)
        unused[used] = False
        nan_byte = (b == 0x7F) | (b == 0xFF)
        assert nan_byte[unused].all() and not nan_byte[used].any(), p.name
        assert ((b[unused] == 0x7F).any() and (b[unused] == 0xFF).any()) or not unused.any()
        if "448" in p.name or "ragged" in p.name:
            vis = b[used]
            assert (vis == 0x7E).any() or (vis == 0xFE).any()
            assert ((vis & 0x78) == 0).logical_and((vis & 0x07) != 0).any()  # subnormal bytes
        out, lse = mla_verify_reference(p.q, p.kv_cache, p.block_table, p.kv_lens, **p.reference_args())
        assert torch.isfinite(out).all() and not torch.isnan(lse).any(), p.name
    scales = {str(p.kv_scale) for p in fp8_cases(v, device="cpu", quick=True)}
    assert {"1.0", "0.37", "3.1", "(0.37, 3.1)"} <= scales
    assert any("uint8" in n for n in seen) and len(seen) == len(set(seen))


def test_fp8_problem_is_fresh_and_seeded():
    v = _variant()
    a = make_fp8_problem(v, [20, 9], device="cpu")
    b = make_fp8_problem(v, [20, 9], device="cpu")
    assert not torch.equal(e4m3_bytes(a.kv_cache), e4m3_bytes(b.kv_cache))
    c = make_fp8_problem(v, [20, 9], device="cpu", seed=5, kv3d=True, as_bytes=True)
    d = make_fp8_problem(v, [20, 9], device="cpu", seed=5)
    assert c.kv_cache.dtype == torch.uint8 and c.kv_cache.shape[1] == 1
    assert torch.equal(c.kv_cache.reshape(-1, 576), e4m3_bytes(d.kv_cache)) and torch.equal(c.q, d.q)


def test_verify_cases_stay_bf16():
    """fp8 is groundwork only: the verify case set (what `mlagen verify` runs) has no fp8 problem."""
    for p in verify_cases(_variant(heads=2, q_len=3, page_size=4), device="cpu", quick=True, big_pool=False):
        assert p.kv_cache.dtype == torch.bfloat16 and p.kv_scale is None
        assert "kv_scale" not in p.reference_args()


def test_verify_cases_of_an_fp8_variant_are_the_fp8_case_set():
    """`mlagen verify` and the GPU tests run an fp8_e4m3 variant on fp8_cases: e4m3 caches with descales,
    extremes and NaN-byte stale slots (quick: no 128k case, no pool past 4 GiB)."""
    from mlagen.cases import verify_cases
    from mlagen.spec import parse_spec

    (v,) = parse_spec(dict(heads_per_rank=2, q_len=3, page_size=4, nsplit="auto", load_width=128, block_n=32,
                           stages=3, row_tiles=1, num_warps=4, mask="tree", schedule="dimsplit",
                           dtype="fp8_e4m3")).variants()
    cases = list(verify_cases(v, device="cpu", quick=True))
    assert len(cases) >= 9 and all(c.name.startswith("fp8") for c in cases)
    assert all(c.kv_cache.dtype in (torch.float8_e4m3fn, torch.uint8) for c in cases)
    assert {c.kv_scale for c in cases} >= {1.0, 0.37, 3.1, (0.37, 3.1)}
    assert any(c.kv_lens.tolist() == [v.q_len] for c in cases)  # kv_len == q_len


# ------------------------------------------------------------------ tolerance of mlagen.verify.compare
def test_compare_bound_grows_with_the_output_magnitude_only_where_it_is_large():
    """An output rounded to bf16 passes even where it is large (v_scale 300: values in the hundreds, bf16
    rounding errors far over out_atol), while an error of a few out_atol at an element of small magnitude,
    a few times the bound at the largest, or one NaN, fails."""
    from mlagen.verify import TOLERANCE, compare

    v = _variant(heads=2, q_len=3, page_size=4)
    p = make_fp8_problem(v, [5, 4 * 3 + 3], special=True, kv_scale=(1.0, 300.0), device="cpu")
    ref, lse, mag = _ref(p, with_magnitude=True)
    got = ref.to(torch.bfloat16)
    r = compare(p, got, lse, "fp8_e4m3")
    assert r.passed, r.detail
    tol = TOLERANCE["fp8_e4m3"]
    assert float((got.float() - ref).abs().max()) > tol["out_atol"]  # the old absolute bound would refuse it
    small = int(mag.flatten().argmin())
    bad = got.clone().flatten()
    bad[small] += 3 * (tol["out_atol"] + tol["out_rtol_mag"] * float(mag.flatten()[small]))
    r = compare(p, bad.view_as(got), lse, "fp8_e4m3")
    assert not r.passed and "P|V|" in r.detail
    big = int(mag.flatten().argmax())
    bad = ref.clone().flatten()
    bad[big] += 4 * (tol["out_atol"] + tol["out_rtol_mag"] * float(mag.flatten()[big]))
    assert not compare(p, bad.view_as(got), lse, "fp8_e4m3").passed
    nan = got.clone().flatten()
    nan[big] = float("nan")
    assert not compare(p, nan.view_as(got), lse, "fp8_e4m3").passed


def test_compare_fails_when_the_reference_reads_a_nan():
    """A NaN in a visible row makes the reference (and its P|V| bound) NaN there: never a pass."""
    from mlagen.verify import compare

    v = _variant(heads=2, q_len=3, page_size=4)
    p = make_fp8_problem(v, [9, 4 * 3 + 3], device="cpu")
    ref, lse = _ref(p)
    b = e4m3_bytes(p.kv_cache).reshape(-1, 576)
    used = referenced_slots(p.block_table, p.kv_lens, p.page_size, p.req_pool_indices)
    b[used[0], 5] = 0x7F  # NaN byte in a row the first request reads
    r = compare(p, ref.to(torch.bfloat16), lse, "fp8_e4m3")
    assert not r.passed
