import dataclasses
import os
import random
import threading
import tracemalloc
import pytest

from mlagen.feasibility import infeasible_reason, resources, split_feasible
from mlagen.spec import SpecError, Variant, filter_by_glob, load_spec, parse_spec

BASE = dict(heads_per_rank=8, q_len=9)


def test_shipped_specs_parse_and_sweep():
    s = load_spec("specs/kimi-k2-tp8-verify.yaml")
    vs = s.variants()
    assert len(vs) == 2 * 3 * 2 * 4 * 3 * 3  # page_size x nsplit x load_width x row_tiles x stages x schedule
    assert {v.page_size for v in vs} == {1, 64} and {v.nsplit for v in vs} == {"auto", 16, 64}
    assert {v.schedule for v in vs} == {"rowblock", "dimsplit", "dimsplit_t"}
    assert {v.load_width for v in vs} == {"bulk", 128}
    assert all(v.heads == 8 and v.q_len == 9 and v.mask == "tree" for v in vs)
    assert all(v.archs == ("sm_120", "sm_90") for v in vs)
    assert len({v.uri for v in vs}) == len(vs)
    ok, bad = split_feasible(vs)
    # rowblock: rt1/rt2 at 2 stages (3 stages and 5 row tiles exceed sm_120's shared memory); dimsplit:
    # one cluster of 5 row tiles, 2 or 3 stages, both loaders
    assert len([v for v in ok if v.schedule == "rowblock"]) == 24
    assert all(v.row_tiles in (1, 2) and v.stages == 2 for v in ok if v.schedule == "rowblock")
    assert len([v for v in ok if v.schedule == "dimsplit"]) == 24
    assert all(v.row_tiles == 5 for v in ok if v.schedule == "dimsplit")
    # dimsplit_t: 3 score warps of 24 rows, 2-4 stages (4: one score exchange buffer), cp.async loader
    assert {(v.row_tiles, v.num_warps, v.load_width) for v in ok if v.schedule == "dimsplit_t"} == {(3, 8, 128)}
    assert len([v for v in ok if v.schedule == "dimsplit_t"]) == 18
    assert {v.stages for v in ok if v.schedule == "dimsplit_t"} == {2, 3, 4}
    assert all(reason for _, reason in bad) and len(ok) + len(bad) == len(vs)
    assert load_spec("specs/kimi-k2-tp4-verify.yaml").variants()[0].heads == 16
    # the decode spec: one sweep per schedule (rowblock 8 warps, 2-3 stages; dimsplit_t 1 score warp, 3-4 stages)
    dec = load_spec("specs/kimi-k2-tp8-decode.yaml")
    ok, bad = split_feasible(dec.variants())
    assert not bad and len(ok) == 30  # (rowblock bn32 st3 is over sm_120's shared memory: not in the spec)
    assert all(v.q_len == 1 and v.mask == "causal" for v in ok)
    assert {(v.schedule, v.num_warps, v.row_tiles) for v in ok} == {("rowblock", 8, 1), ("dimsplit_t", 6, 1)}
    assert len([v for v in ok if v.schedule == "dimsplit_t"]) == 2 * 3 * 2  # page_size x nsplit x stages
    # the fp8 KV cache spec: both e4m3 schedules, every bucket fp8_e4m3 (3 feasible tiles per page size and NSPLIT)
    ok, _ = split_feasible(load_spec("specs/kimi-k2-tp8-verify-fp8kv.yaml").variants())
    assert {(v.schedule, v.stages) for v in ok} == {("dimsplit", 2), ("dimsplit", 3), ("dimsplit_t", 2)}
    assert len(ok) == 18 and all(v.bucket.endswith("_tree_fp8_e4m3") for v in ok)


def test_uri_has_every_parameter_and_round_trips():
    v = parse_spec(dict(BASE, page_size=64, nsplit="auto", load_width=64)).variants()[0]
    assert v.uri.startswith("mla_verify_h8_q9_kv512_rope64_ps64_nsauto_lw64_bn16_w8_rt2_st3_tree_bf16_sm120_sm90")
    assert Variant.from_uri(v.uri) == v
    assert "_ns" not in v.build_key
    b = parse_spec(dict(BASE, load_width="bulk")).variants()[0]
    assert "_lwbulk_" in b.uri and Variant.from_uri(b.uri) == b
    o = parse_spec(dict(BASE, load_width="bulk", overlap=1)).variants()[0]
    assert "_st3_ov1_tree_" in o.uri and Variant.from_uri(o.uri) == o and "_ov" not in b.uri
    from mlagen.feasibility import infeasible_reason

    bad = parse_spec(dict(BASE, load_width=128, overlap=1, stages=2)).variants()[0]
    assert infeasible_reason(bad) == "overlap needs load_width bulk, got 128"
    for x in (v, b, o):  # spec_dict is the inverse of Spec.variants
        assert parse_spec(x.spec_dict()).variants() == [x]
    with pytest.raises(ValueError, match="not an mlagen variant uri"):
        Variant.from_uri("mla_verify_h8")


@pytest.mark.parametrize(
    "patch, message",
    [
        (dict(nsplits=4), "unknown spec key 'nsplits'; allowed keys: arch, block_n"),
        (dict(heads_per_rank="eight"), "spec key 'heads_per_rank': expected int, got str 'eight'; allowed: int in [1, 128]"),
        (dict(heads_per_rank=129), "spec key 'heads_per_rank': value 129 out of range; allowed: int in [1, 128]"),
        (dict(page_size=3), "spec key 'page_size': value 3 not allowed; allowed: 1, 2, 4, 8, 16, 32, 64, 128, 256"),
        (dict(load_width=96), "spec key 'load_width': value 96 not allowed; allowed: 32, 64, 128 or 'bulk'"),
        (dict(load_width="tma"), "spec key 'load_width': expected int, got str 'tma'; allowed: 32, 64, 128 or 'bulk'"),
        (dict(qk_rope_head_dim=4, load_width="bulk"), "spec key 'load_width': bulk (16-byte) loads do not divide a 516-dim bf16 row"),
        (dict(mask="sliding"), "spec key 'mask': value 'sliding' not allowed; allowed: none, causal, tree"),
        (dict(nsplit="many"), "spec key 'nsplit': expected int, got str 'many'; allowed: int in [1, 256] or 'auto'"),
        (dict(arch="sm_100"), "spec key 'arch': value 'sm_100' not allowed; allowed: sm_120, sm_90"),
        (dict(q_len=[]), "spec key 'q_len': empty list"),
        (dict(qk_rope_head_dim=2), "spec key 'load_width': 128-bit loads do not divide a 514-dim bf16 row"),
        (dict(qk_rope_head_dim=8, load_width=32), "spec key 'qk_rope_head_dim': kv_lora_rank + qk_rope_head_dim = 520 is not a multiple of 16"),
        (dict(heads_per_rank=True), "spec key 'heads_per_rank': expected int, got bool"),
    ],
)
def test_bad_spec_names_key_and_allowed_values(patch, message):
    with pytest.raises(SpecError) as e:
        parse_spec(dict(BASE, **patch))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_required_key():
    with pytest.raises(SpecError, match="spec key 'q_len' is required; allowed: int in \\[1, 64\\]"):
        parse_spec(dict(heads_per_rank=8))


def test_yaml_errors(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("heads_per_rank: [8\n")
    with pytest.raises(SpecError, match="invalid YAML"):
        load_spec(p)
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path / "missing.yaml")
    p.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="top level must be a mapping"):
        load_spec(p)
    p.write_text("# nothing but a comment\n")
    with pytest.raises(SpecError, match="is empty: it needs at least heads_per_rank and q_len"):
        load_spec(p)


def test_spec_from_a_pipe_is_read_and_one_over_1_mib_is_refused(tmp_path):
    """A pipe (a shell's `<(...)`) is read like a file; no more than 1 MiB and a byte is read, so /dev/zero and an
    oversized file end in one error."""
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("name: piped\nheads_per_rank: 8\nq_len: 9\n"))
    writer.start()
    assert load_spec(fifo).name == "piped"
    writer.join()
    with pytest.raises(SpecError, match="is over 1,048,576 bytes"):
        load_spec("/dev/zero")
    big = tmp_path / "big.yaml"
    big.write_text("heads_per_rank: 8\nq_len: 9\n" + "#" * (1 << 20) + "\n")
    with pytest.raises(SpecError, match="is over 1,048,576 bytes"):
        load_spec(big)
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path)  # a directory


def test_yaml_alias_bomb_gets_a_short_error_without_expanding_it(tmp_path):
    """Seven levels of aliases (10**7 leaves, a ~30 MB repr; two more levels would not fit in memory): the message
    quotes a bounded repr, built without the whole one."""
    levels = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    p = tmp_path / "bomb.yaml"
    p.write_text("q_len: 9\nheads_per_rank: [[" + ", ".join(levels) + "]]\n")  # one sweep value: the whole bomb
    tracemalloc.start()
    try:
        with pytest.raises(SpecError, match="spec key 'heads_per_rank': expected int") as e:
            load_spec(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20 and len(str(e.value)) < 400, (peak, str(e.value)[:500])


def test_infeasible_variants_are_dropped_with_reason():
    vs = parse_spec(dict(BASE, block_n=[16, 64], stages=[2, 4])).variants()
    ok, bad = split_feasible(vs)
    assert ok and bad
    for v, reason in bad:
        assert "shared memory" in reason and "sm_120" in reason
        assert resources(v).smem_bytes > 101376
    for v in ok:
        assert resources(v).smem_bytes <= 101376
    big = parse_spec(dict(BASE, row_tiles=8, num_warps=4)).variants()[0]
    assert "would spill" in infeasible_reason(big) or "shared memory" in infeasible_reason(big)


def test_glob_filter():
    vs = [v for v in load_spec("specs/kimi-k2-tp8-verify.yaml").variants()
          if v.schedule == "rowblock" and v.stages == 2 and v.row_tiles in (1, 2)]
    assert len(vs) == 24
    sel = filter_by_glob(vs, "*_ps64_*_lw128_*")
    assert len(sel) == 6 and all(v.page_size == 64 and v.load_width == 128 for v in sel)
    sel = filter_by_glob(vs, "*_lwbulk_*_rt1_*")
    assert len(sel) == 6 and all(v.load_width == "bulk" and v.row_tiles == 1 for v in sel)
    assert filter_by_glob(vs, "nothing*") == []
    # several globs: the union, each variant once, in spec order
    both = filter_by_glob(vs, "*_ps64_*_lw128_*,*_lwbulk_*_rt1_*")
    assert [v.uri for v in both] == [v.uri for v in vs if v in filter_by_glob(vs, "*_ps64_*_lw128_*")
                                     or v in filter_by_glob(vs, "*_lwbulk_*_rt1_*")]
    assert len(both) == 12
    assert filter_by_glob(vs, " *_ps64_*_lw128_* , *_lwbulk_*_rt1_* ") == both  # spaces around globs ignored
    assert filter_by_glob(vs, None) == vs and filter_by_glob(vs, "") == vs
    with pytest.raises(ValueError, match="names no glob"):
        filter_by_glob(vs, " , ")


@pytest.mark.parametrize("name", ["../../evil", "a/b", "..", "has space"])
def test_spec_name_is_a_safe_file_name(name):
    with pytest.raises(SpecError, match="spec key 'name'"):
        parse_spec(dict(BASE, name=name))


def test_sm90_only_uses_sm90_smem_limit_and_template_agrees():
    from mlagen.codegen import template_context

    v = parse_spec(dict(BASE, block_n=64, row_tiles=1, stages=2, arch="sm_90")).variants()[0]
    assert resources(v).smem_bytes > 101376 and infeasible_reason(v) is None
    assert template_context(v)["smem_limit"] == 232448
    both = parse_spec(dict(BASE)).variants()[0]
    assert template_context(both)["smem_limit"] == 101376


def test_schedule_key_uri_and_feasibility():
    from mlagen.feasibility import dimsplit_row_tiles, infeasible_reason, resources
    from mlagen.spec import Variant

    base = dict(heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", load_width=128, block_n=32, stages=3,
                row_tiles=5, mask="tree")
    (rb,) = parse_spec(base).variants()
    assert rb.schedule == "rowblock" and "dimsplit" not in rb.uri  # default: uris of earlier builds unchanged
    (ds,) = parse_spec(dict(base, schedule="dimsplit")).variants()
    assert ds.uri.endswith("_rt5_st3_dimsplit_tree_bf16_sm120_sm90")
    assert Variant.from_uri(ds.uri) == ds and Variant.from_uri(rb.uri) == rb
    assert ds.build_key != rb.build_key and ds.ctas_per_row_block == 2 and rb.ctas_per_row_block == 1
    assert infeasible_reason(ds) is None and resources(ds).smem_bytes <= 101376
    assert infeasible_reason(rb)  # 80 rows in one rowblock CTA: over sm_120 shared memory and the register tiles
    # one row-tile count per shape: the fewest clusters of at most 7 m16 tiles, balanced
    assert [dimsplit_row_tiles(r) for r in (1, 8, 72, 144, 576, 128)] == [1, 1, 5, 5, 6, 4]
    reasons = {
        "load_width": infeasible_reason(dataclasses.replace(ds, load_width=64)),
        "block_n": infeasible_reason(dataclasses.replace(ds, block_n=16)),
        "row_tiles": infeasible_reason(dataclasses.replace(ds, row_tiles=2)),
        "num_warps": infeasible_reason(dataclasses.replace(ds, num_warps=4)),
        "stages": infeasible_reason(dataclasses.replace(ds, stages=6)),
        "overlap": infeasible_reason(dataclasses.replace(ds, overlap=1)),
    }
    assert "bulk or 128" in reasons["load_width"] and "block_n must be 32" in reasons["block_n"]
    assert "row_tiles must be 5, got 2" in reasons["row_tiles"] and "num_warps" in reasons["num_warps"]
    assert "shared memory" in reasons["stages"] and "101376" in reasons["stages"]
    assert "overlap must be 0" in reasons["overlap"]
    with pytest.raises(SpecError, match="schedule"):
        parse_spec(dict(base, schedule="onepass"))


def test_dimsplit_pairs_num_warps_rules_and_resources():
    """num_warps = 2 x row_tiles + 1 selects two consumer warps per row tile (MlaDimSplitConfig::kPairs):
    half the score tiles and output dims per warp, a P / row-max exchange buffer, 4 Q k-steps from shared
    memory; at most 5 row tiles (168 registers at 11 warps), the cp.async loader from 4 row tiles up
    (the bulk loader spills), and rowblock keeps 4 / 8 / 16 warps."""
    from mlagen.feasibility import dimsplit_pairs, infeasible_reason, resources

    base = dict(heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", load_width=128, block_n=32, stages=3,
                row_tiles=5, mask="tree", schedule="dimsplit")
    (pair,) = parse_spec(dict(base, num_warps=11)).variants()
    (single,) = parse_spec(dict(base, num_warps=8)).variants()
    assert "_w11_rt5_st3_dimsplit_" in pair.uri and dimsplit_pairs(pair) and not dimsplit_pairs(single)
    assert infeasible_reason(pair) is None and infeasible_reason(single) is None
    rp, rs = resources(pair), resources(single)
    # KV ring 3 x 32 x 296 x 2 + score exchange 10,240 + 26 mbarriers + Q (4 steps) 11,520 + pair buffer 10,240
    assert rp.smem_bytes == 56832 + 10240 + 26 * 8 + 11520 + 10240 == 89040
    assert (rp.regs_q, rp.regs_s, rp.regs_o) == (56, 8, 64) and (rs.regs_q, rs.regs_s, rs.regs_o) == (40, 16, 128)
    assert "load_width must be 128" in infeasible_reason(dataclasses.replace(pair, load_width="bulk"))
    (h64,) = parse_spec(dict(base, heads_per_rank=64, row_tiles=6, num_warps=13)).variants()
    assert "at most 5 row tiles" in infeasible_reason(h64)
    (h4q16,) = parse_spec(dict(base, heads_per_rank=4, q_len=16, row_tiles=4, num_warps=9)).variants()
    assert "spills at row_tiles 4" in infeasible_reason(h4q16)  # nvcc 13.0, sm_90: 8 B at 168 registers
    (h1,) = parse_spec(dict(base, heads_per_rank=1, q_len=5, row_tiles=1, num_warps=3, load_width="bulk",
                            mask="causal")).variants()
    assert dimsplit_pairs(h1) and infeasible_reason(h1) is None  # 3 warps: 255 registers, bulk fits
    for w in (9, 10, 12):  # neither one warp per tile (<= 8) nor a pair per tile (11)
        assert "num_warps 2 x row_tiles + 1 = 11" in infeasible_reason(dataclasses.replace(pair, num_warps=w))
    (rb,) = parse_spec(dict(base, schedule="rowblock", row_tiles=1, num_warps=11, stages=2)).variants()
    assert "schedule rowblock needs num_warps 4, 8 or 16, got 11" in infeasible_reason(rb)
    with pytest.raises(SpecError, match="num_warps"):
        parse_spec(dict(base, num_warps=17))


def test_dimsplit_cp_async_loader_needs_whole_tokens_of_rope_per_instruction():
    """MlaDimSplitConfig's cp.async loader (load_width 128) static_asserts 32 % kRopeChunks == 0 with
    kRopeChunks = qk_rope_head_dim / 16: rope 0 (division by zero) and 96 (6 chunks) do not compile,
    so the Python model must reject them; the bulk loader has no such rule (both compile)."""
    base = dict(heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", block_n=32, stages=2, row_tiles=5,
                mask="tree", schedule="dimsplit")
    for rope in (0, 96):
        (lw128,) = parse_spec(dict(base, qk_rope_head_dim=rope, load_width=128)).variants()
        assert "qk_rope_head_dim must be 32, 64 or 128" in (infeasible_reason(lw128) or ""), rope
        (bulk,) = parse_spec(dict(base, qk_rope_head_dim=rope, load_width="bulk")).variants()
        assert infeasible_reason(bulk) is None, rope
    for rope in (32, 64, 128):
        (lw128,) = parse_spec(dict(base, qk_rope_head_dim=rope, load_width=128)).variants()
        assert infeasible_reason(lw128) is None, rope


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: t\nheads_per_rank: 8\nq_len: 9: 3\n")
    with pytest.raises(SpecError, match=r"invalid YAML at line 3, column 9: mapping values are not allowed here"):
        load_spec(p)


def test_fp8_e4m3_dtype_uri_and_feasibility():
    """dtype fp8_e4m3 (an e4m3 KV cache) is a dimsplit variant with the cp.async loader, a producer and two
    converter warps (num_warps = row_tiles + 3); its shared memory is MlaDimSplitConfig's with kKvFp8: a
    bf16 ring of 2 stages, an e4m3 ring of `stages` stages (rows of 288 + 16 bytes), 4 more mbarriers per
    stage pair. The uri carries it (fp8e4m3) and parses back."""
    from mlagen.codegen import template_context
    from mlagen.feasibility import infeasible_reason, resources
    from mlagen.spec import Variant

    base = dict(heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", load_width=128, block_n=32, stages=3,
                row_tiles=5, num_warps=8, mask="tree", schedule="dimsplit", dtype="fp8_e4m3")
    (v,) = parse_spec(base).variants()
    assert v.uri.endswith("_w8_rt5_st3_dimsplit_tree_fp8e4m3_sm120_sm90") and Variant.from_uri(v.uri) == v
    assert v.bucket.endswith("_tree_fp8_e4m3") and template_context(v)["kv_fp8"] == 1
    assert infeasible_reason(v) is None
    # bf16 ring 2 x 32 x 296 x 2 + e4m3 ring 3 x 32 x 304 + exchange 10,240 + 20 mbarriers + Q 21,760
    assert resources(v).smem_bytes == 37888 + 29184 + 10240 + 20 * 8 + 21760 == 99232
    assert resources(dataclasses.replace(v, stages=2)).smem_bytes == 89488
    assert "shared memory" in infeasible_reason(dataclasses.replace(v, stages=4))  # 108,976 B > 101,376
    assert "load_width must be 128" in infeasible_reason(dataclasses.replace(v, load_width="bulk"))
    assert "num_warps must be row_tiles + 3 = 8, got 7" in infeasible_reason(dataclasses.replace(v, num_warps=7))
    assert "needs schedule dimsplit or dimsplit_t" in infeasible_reason(dataclasses.replace(v, schedule="rowblock", row_tiles=1,
                                                                               stages=2))
    (bf16,) = parse_spec(dict(base, dtype="bf16")).variants()
    assert bf16.uri == v.uri.replace("fp8e4m3", "bf16") and template_context(bf16)["kv_fp8"] == 0
    with pytest.raises(SpecError, match="dtype"):
        parse_spec(dict(base, dtype="fp8_e5m2"))


def test_fp8_e4m3_on_dimsplit_t():
    """dtype fp8_e4m3 on dimsplit_t (MlaDimSplitTConfig with kKvFp8): an e4m3 ring of `stages` stages beside a
    3-stage bf16 ring the output warps fill; the resource model matches the C++ sizes, the uri carries the dtype,
    only the 2-stage ring fits sm_120's 101,376 B, block_n must be 32; other dtypes' schedules say where fp8 runs."""
    from mlagen.codegen import template_context
    from mlagen.feasibility import infeasible_reason, resources

    base = dict(heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", load_width=128, block_n=32, stages=2,
                row_tiles=3, num_warps=8, mask="tree", schedule="dimsplit_t", dtype="fp8_e4m3")
    (v,) = parse_spec(base).variants()
    assert v.uri.endswith("_w8_rt3_st2_dimsplit_t_tree_fp8e4m3_sm120_sm90") and Variant.from_uri(v.uri) == v
    assert template_context(v)["kv_fp8"] == 1 and infeasible_reason(v) is None
    # bf16 ring 3 x 32 x 296 x 2 + e4m3 ring 2 x 32 x 304 + one exchange buffer 9,216 + P^T 2 x 32 x 72 x 2
    # + factors 576 + row sums 288 + tree rows 72 + 21 mbarriers (full / empty 6, exchange 3, P 4, xempty 3, tree 1,
    # full8 / empty8 4) + the score warps' rescale flags 2 x 16 (3 score warps: the default rescale slack's)
    assert resources(v).smem_bytes == 56832 + 19456 + 9216 + 9216 + 576 + 288 + 72 + 21 * 8 + 32 == 95856
    assert "shared memory 105600 B" in infeasible_reason(dataclasses.replace(v, stages=3))  # > 101,376 on sm_120
    assert "an e4m3 ring of stages 2 fits" in infeasible_reason(dataclasses.replace(v, stages=3))
    assert "block_n must be 32" in infeasible_reason(dataclasses.replace(v, block_n=16))
    (bf16,) = parse_spec(dict(base, dtype="bf16", stages=4)).variants()
    assert resources(bf16).smem_bytes == 95328 and template_context(bf16)["kv_fp8"] == 0
    assert "schedule dimsplit or dimsplit_t" in infeasible_reason(
        dataclasses.replace(v, schedule="rowblock", row_tiles=1, num_warps=8))


def test_fp8_e4m3_at_two_row_tiles_is_one_warp_per_tile():
    """num_warps = row_tiles + 3 is also 2 x row_tiles + 1 at row_tiles 2 (e.g. H16 q2): an fp8 variant there
    is one consumer warp per tile, a producer and two converters (not a pair build), in the Python model
    and in MlaDimSplitConfig; beyond 5 row tiles fp8 would need more than 8 warps and is refused."""
    from mlagen.feasibility import dimsplit_pairs, infeasible_reason, resources

    base = dict(page_size=1, nsplit="auto", load_width=128, block_n=32, stages=3, mask="tree", schedule="dimsplit",
                dtype="fp8_e4m3")
    (v,) = parse_spec(dict(base, heads_per_rank=16, q_len=2, row_tiles=2, num_warps=5)).variants()
    assert not dimsplit_pairs(v) and infeasible_reason(v) is None
    assert resources(v).regs_o == 128  # a warp owns all 256 output dims of its tile
    (h64,) = parse_spec(dict(base, heads_per_rank=64, q_len=9, row_tiles=6, num_warps=8)).variants()
    assert "at most 5 row tiles" in infeasible_reason(h64)


def test_dimsplit_t_rules_and_uri():
    """dimsplit_t: score warps of 24 rows (the fewest clusters of <= 72 rows), num_warps = row_tiles + 5,
    cp.async loader, block_n 32 (16 for bf16 only), kv 512 / rope 64; its uri round-trips and its row blocks are 24-row
    multiples; the rowblock / dimsplit uris are unchanged."""
    from mlagen.feasibility import dimsplit_t_row_tiles, infeasible_reason, resources

    assert [dimsplit_t_row_tiles(r) for r in (1, 8, 24, 25, 72, 73, 144, 128, 576)] == [1, 1, 1, 2, 3, 2, 3, 3, 3]
    base = dict(heads_per_rank=8, q_len=9, page_size=1, nsplit="auto", load_width=128, block_n=32, stages=3,
                row_tiles=3, num_warps=8, mask="tree", schedule="dimsplit_t")
    (v,) = parse_spec(base).variants()
    assert v.uri.endswith("_w8_rt3_st3_dimsplit_t_tree_bf16_sm120_sm90") and Variant.from_uri(v.uri) == v
    assert infeasible_reason(v) is None and v.rows_per_cta == 72 and v.row_blocks == 1 and v.ctas_per_row_block == 2
    assert resources(v).smem_bytes <= 101376
    for bn, st in ((32, 4), (16, 8)):  # the deepest rings of the bench sweep that fit sm_120's 99 KB
        (deep,) = parse_spec(dict(base, block_n=bn, stages=st)).variants()
        assert infeasible_reason(deep) is None, infeasible_reason(deep)
    (h16,) = parse_spec(dict(base, heads_per_rank=16)).variants()
    assert infeasible_reason(h16) is None and h16.row_blocks == 2
    for bad, text in ((dict(num_warps=7), "num_warps must be 8"), (dict(row_tiles=2), "row_tiles must be 3"),
                      (dict(load_width="bulk"), "load_width must be 128"), (dict(block_n=64), "block_n must be 16 or 32"),
                      (dict(dtype="fp8_e4m3", block_n=16), "block_n must be 32"), (dict(stages=5), "shared memory"),
                      (dict(kv_lora_rank=256), "kv_lora_rank 512")):
        (w,) = parse_spec(dict(base, **bad)).variants()
        assert text in (infeasible_reason(w) or ""), (bad, infeasible_reason(w))


def test_sweeps_share_the_top_level_keys_and_join_their_variants():
    """``sweeps``: each entry is swept over the top-level keys with its own keys replacing them; the variants of all
    sweeps are joined in order, a variant two sweeps both yield listed once."""
    spec = parse_spec(dict(BASE, page_size=[1, 64], nsplit=16, sweeps=[
        dict(schedule="rowblock", row_tiles=[1, 2], stages=2),
        dict(schedule="dimsplit_t", row_tiles=3, num_warps=8, block_n=32, stages=[3, 4]),
        dict(schedule="rowblock", row_tiles=1, stages=2),  # all already in the first sweep
    ]))
    vs = spec.variants()
    assert spec.n_variants == 4 + 4 + 2 and len(vs) == 8 == len({v.uri for v in vs})
    assert [v.schedule for v in vs] == ["rowblock"] * 4 + ["dimsplit_t"] * 4
    assert {(v.row_tiles, v.stages) for v in vs if v.schedule == "rowblock"} == {(1, 2), (2, 2)}
    assert {(v.num_warps, v.block_n, v.stages) for v in vs if v.schedule == "dimsplit_t"} == {(8, 32, 3), (8, 32, 4)}
    assert all(v.nsplit == 16 and v.heads == 8 for v in vs) and {v.page_size for v in vs} == {1, 64}
    # a required key may come from every sweep; the top level alone is then not a sweep
    two = parse_spec(dict(heads_per_rank=8, sweeps=[dict(q_len=9), dict(q_len=1, mask="causal")])).variants()
    assert [(v.q_len, v.mask) for v in two] == [(9, "tree"), (1, "causal")]
    with pytest.raises(SpecError, match=r"spec key 'q_len' is required \(at the top level or in every sweep; "
                                        r"sweeps\[1\] lacks it\)"):
        parse_spec(dict(heads_per_rank=8, sweeps=[dict(q_len=9), dict(mask="causal")]))
    # the size limit counts distinct variants: 10 combinations, 8 variants
    assert spec.n_distinct_variants() == 8
    spec.check_size(8)
    with pytest.raises(SpecError, match=r"sweeps 8 variants \(\(page_size 2 x row_tiles 2\) \+ "
                       r"\(page_size 2 x stages 2\) \+ \(page_size 2\), 10 before the duplicates across sweeps are "
                       r"dropped\), more than the limit of 7: narrow its lists, or allow it with --max-variants 8$"):
        spec.check_size(7)


def test_distinct_count_matches_the_variants_and_stops_at_its_limit(monkeypatch):
    """n_distinct_variants counts what variants() lists, for random overlapping sweeps; past
    DISTINCT_COUNT_LIMIT combinations the limit falls back to the count with duplicates."""
    import random
    import mlagen.spec as spec_mod
    rng = random.Random()
    for _ in range(20):
        sweeps = [dict(stages=rng.sample([2, 3, 4], rng.randint(1, 3)), page_size=rng.sample([1, 16, 64], rng.randint(1, 3)),
                       nsplit=rng.sample([16, 32, "auto"], rng.randint(1, 3))) for _ in range(rng.randint(2, 4))]
        spec = parse_spec(dict(BASE, sweeps=sweeps))
        assert spec.n_distinct_variants() == len(spec.variants()) <= spec.n_variants, sweeps
    spec = parse_spec(dict(BASE, sweeps=[dict(stages=[2, 3]), dict(stages=[2, 3])]))
    assert spec.n_variants == 4 and spec.n_distinct_variants() == 2
    spec.check_size(2)
    monkeypatch.setattr(spec_mod, "DISTINCT_COUNT_LIMIT", 3)
    assert spec.n_distinct_variants() is None
    with pytest.raises(SpecError, match=r"sweeps 4 variants \(\(stages 2\) \+ \(stages 2\); duplicates across sweeps "
                                        r"included: past 3 combinations they are not counted out\), more than the limit "
                                        r"of 2: narrow its lists, or allow it with --max-variants 4$"):
        spec.check_size(2)


def test_size_error_lists_a_few_sweeps_then_the_count():
    """A spec of many sweeps gets a one-line size error of bounded length that still ends with the way out."""
    n = random.randint(8, 300)
    spec = parse_spec(dict(BASE, nsplit=[16, 32, 64], sweeps=[dict(stages=[2, 3], row_tiles=[1, 2, 3])] * n))
    with pytest.raises(SpecError) as e:
        spec.check_size(17)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert f"({n} sweeps in all)" in msg and msg.endswith("allow it with --max-variants 18"), msg


@pytest.mark.parametrize("sweeps, message", [
    ([], "spec key 'sweeps': expected a non-empty list of mappings"),
    (dict(stages=2), "spec key 'sweeps': expected a non-empty list of mappings"),
    ([dict(stages=2), 3], r"spec key 'sweeps\[1\]': expected a mapping of keys to values, got int 3"),
    (["rowblock"], r"spec key 'sweeps\[0\]': expected a mapping of keys to values, got str 'rowblock'"),
    ([dict(arch="sm_90")], r"spec key 'sweeps\[0\]': unknown key 'arch'; allowed in a sweep: "),
    ([dict(stages=2), dict(name="x")], r"spec key 'sweeps\[1\]': unknown key 'name'"),
    ([dict(stages=9)], r"spec key 'sweeps\[0\].stages': value 9 out of range; allowed: int in \[2, 8\]"),
    ([dict(schedule="wide")], r"spec key 'sweeps\[0\].schedule': value 'wide' not allowed; allowed: rowblock"),
    ([dict(stages=[])], r"spec key 'sweeps\[0\].stages': empty list"),
    ([dict(stages=2), dict(load_width=128, qk_rope_head_dim=4)], "loads do not divide a 516-dim bf16 row"),
])
def test_bad_sweeps_name_the_entry_and_key(sweeps, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(dict(BASE, sweeps=sweeps))


def test_kernels_pattern_with_a_comma_inside_a_set_is_refused():
    """`--kernels '*_st[3,4]_*'` would split into '*_st[3' and '4]_*' and match nothing: an error that says why."""
    from mlagen.spec import uri_globs

    with pytest.raises(ValueError, match=r"comma inside \[...\]"):
        uri_globs("*_st[3,4]_*")
    assert uri_globs("*_st[34]_*,*_rt1_*") == ["*_st[34]_*", "*_rt1_*"]
    assert uri_globs("*]*") == ["*]*"]
