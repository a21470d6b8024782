"""The variants tests/test_sglang_backend_gpu.py builds per case (tests/sglang_gpu_variants.py), checked without a GPU:
every case key the GPU test asks for maps to a spec of exactly one feasible variant that serves that key."""

import pytest

from mlagen.feasibility import infeasible_reason
from mlagen.spec import parse_spec
from sglang_gpu_variants import (H_LIST, PAGE_SIZES, Q_TREE, _UnionSpec, gpu_case_keys, main, prebuild_keys,
                                 spec_for, variant_key)


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_every_gpu_case_key_builds_one_feasible_variant_that_serves_it(arch):
    keys = gpu_case_keys()
    assert len(keys) == len(H_LIST) * len(PAGE_SIZES) * 9
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


def test_the_prebuild_spec_holds_every_case_module_once():
    """``python3 tests/sglang_gpu_variants.py`` builds one union spec: every case key's variant, each once."""
    keys = gpu_case_keys()
    vs = _UnionSpec([spec_for(k, "sm_90") for k in sorted(keys)]).variants()
    assert len(vs) == len(keys) and len({v.uri for v in vs}) == len(keys)
    assert {variant_key(v) for v in vs} == keys


def test_prebuild_only_selects_the_keys_holding_every_item():
    """``--only fp8_e4m3 --only 16``: the H16 e4m3 keys (verify on dimsplit and dimsplit_t, decode; both page sizes)."""
    assert prebuild_keys() == sorted(gpu_case_keys())
    fp8_h16 = prebuild_keys(("fp8_e4m3", 16))
    assert len(fp8_h16) == 3 * len(PAGE_SIZES)
    assert all("fp8_e4m3" in k and k[1] == 16 for k in fp8_h16)
    assert prebuild_keys(("fp8_e5m2",)) == []


@pytest.mark.parametrize("argv, msg", [(["--arch", "sm_90", "--only", "fp8"], "no case key holds all of ['fp8']"),
                                       (["--arch", "sm_90", "--only", "chain"], "items: "),
                                       (["--arch", "sm90"], "invalid choice")])
def test_prebuild_refuses_a_selection_of_nothing_and_unknown_archs(argv, msg, capsys):
    """The prebuild script exits 2 with one line, before any build, for an --only that selects no case (else the GPU
    test would quietly compile its modules one at a time) and for an arch mlagen does not build."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err
