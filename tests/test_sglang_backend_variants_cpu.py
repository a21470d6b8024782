"""The variants tests/test_sglang_backend_gpu.py builds per case (tests/sglang_gpu_variants.py), checked without a GPU:
every case key the GPU test asks for maps to a spec of exactly one feasible variant that serves that key."""

import pytest

from mlagen.feasibility import infeasible_reason
from mlagen.spec import parse_spec
from sglang_gpu_variants import H_LIST, PAGE_SIZES, Q_TREE, case_key, spec_for, variant_key


def _gpu_case_keys() -> set:
    """The keys of every GPU case: bf16 verify (tree, chain = causal) and decode on rowblock; dimsplit_t verify (tree,
    chain); e4m3 pools: dimsplit verify (tree) and decode, dimsplit_t verify (tree); the fp8-checkpoint and DP-padded
    cases use the H8 tree verify key."""
    keys = set()
    for H in H_LIST:
        for ps in PAGE_SIZES:
            keys |= {case_key("verify", H, ps, "tree"), case_key("verify", H, ps, "causal"),
                     case_key("decode", H, ps, "causal")}
            keys |= {case_key("verify", H, ps, m, schedule="dimsplit_t") for m in ("tree", "causal")}
            keys |= {case_key("verify", H, ps, "tree", kv_fp8=True), case_key("decode", H, ps, "causal", kv_fp8=True)}
            keys.add(case_key("verify", H, ps, "tree", kv_fp8=True, schedule="dimsplit_t"))
    return keys


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_every_gpu_case_key_builds_one_feasible_variant_that_serves_it(arch):
    keys = _gpu_case_keys()
    assert len(keys) == len(H_LIST) * len(PAGE_SIZES) * 8
    for key in keys:
        vs = parse_spec(spec_for(key, arch)).variants()
        assert len(vs) == 1, (key, [v.uri for v in vs])
        (v,) = vs
        assert infeasible_reason(v) is None, (key, infeasible_reason(v))
        assert variant_key(v) == key and v.archs == (arch,) and v.nsplit == "auto"
        assert v.q_len == (1 if key[0] == "decode" else Q_TREE)


@pytest.mark.parametrize("key", [("prefill", 8, 1, "tree"), ("verify", 8, 1, "tree", "fp8_e5m2")])
def test_an_unknown_case_key_is_a_key_error(key):
    with pytest.raises(KeyError):
        spec_for(key, "sm_90")
