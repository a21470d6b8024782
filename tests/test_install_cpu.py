"""`mlagen install` selection logic on a registry filled by hand (no GPU, no build)."""

import pytest
from click.testing import CliRunner

from mlagen.cli import main
from mlagen.install import InstallError, entry_for, merge_state, pick_fastest
from mlagen.registry import Registry
from mlagen.spec import parse_spec

SPEC = parse_spec(dict(name="inst", heads_per_rank=8, q_len=9, page_size=[1, 64], nsplit=[16, 32]))


def _register(reg, v, tmp_path, verified_on="sm_90", passed=True, times=None):
    so = tmp_path / f"{v.build_key}.so"
    so.write_bytes(b"")
    reg.put_variant(uri=v.uri, spec="inst", variant=v.to_dict(), bucket=v.bucket, source_hash="h" + v.uri,
                    nvcc_version="13.0", archs=list(v.archs), so_path=str(so), build_seconds=1.0, resources={})
    if verified_on:
        reg.add_verification(uri=v.uri, source_hash="h" + v.uri, device="H200", arch=verified_on, cases=12,
                             max_err=0.01, passed=passed)
    for ctx, us in (times or {}).items():
        reg.add_benchmark(uri=v.uri, source_hash="h" + v.uri, device="H200", arch="sm_90",
                          shape=dict(heads=8, q_len=9, batch_size=1, context=ctx, page_size=v.page_size),
                          median_us=us, gbs=1.0, frac_copy_bw=0.1)


def test_picks_fastest_geomean_per_bucket(cache_env, tmp_path):
    reg = Registry()
    v16_p1, v32_p1, v16_p64, v32_p64 = SPEC.variants()
    _register(reg, v16_p1, tmp_path, times={4096: 30.0, 65536: 300.0})
    _register(reg, v32_p1, tmp_path, times={4096: 40.0, 65536: 150.0})  # geomean 77 < 95: wins
    _register(reg, v16_p64, tmp_path, times={4096: 20.0, 65536: 100.0})  # wins its bucket
    _register(reg, v32_p64, tmp_path, passed=False, times={4096: 1.0, 65536: 1.0})  # fast but failed verify
    chosen = {e["bucket"]: e["uri"] for e in pick_fastest(reg, SPEC, "sm_90")}
    assert chosen == {v32_p1.bucket: v32_p1.uri, v16_p64.bucket: v16_p64.uri}
    e = entry_for(reg, v16_p64.uri, "sm_90")
    assert e["role"] == "verify" and e["heads"] == 8 and e["page_size"] == 64 and e["mask"] == "tree"


def test_refuses_other_arch_and_unverified(cache_env, tmp_path):
    reg = Registry()
    v = SPEC.variants()[0]
    _register(reg, v, tmp_path, verified_on="sm_90")
    with pytest.raises(InstallError, match="verified on sm_90, but the server GPU is sm_120"):
        entry_for(reg, v.uri, "sm_120")
    with pytest.raises(InstallError, match="no variant of bucket .* is verified on sm_120"):
        pick_fastest(reg, SPEC, "sm_120")
    with pytest.raises(InstallError, match="unknown or unbuilt variant"):
        entry_for(reg, "mla_verify_nope", "sm_90")


def test_merge_replaces_same_bucket_and_drops_other_arch():
    a = dict(bucket="b1", uri="u1")
    b = dict(bucket="b2", uri="u2")
    new = dict(bucket="b1", uri="u3")
    st = merge_state(dict(arch="sm_90", entries=[a, b]), [new], "sm_90")
    assert [e["uri"] for e in st["entries"]] == ["u2", "u3"] and st["arch"] == "sm_90"
    assert merge_state(dict(arch="sm_120", entries=[a, b]), [new], "sm_90")["entries"] == [new]


def test_cli_install_status_uninstall(cache_env, tmp_path):
    reg = Registry()
    v = SPEC.variants()[0]
    _register(reg, v, tmp_path)
    r = CliRunner().invoke(main, ["install", "--arch", "sm_90", "--uri", v.uri])
    assert r.exit_code == 0, r.output
    assert f"installed verify {v.bucket}: {v.uri}" in r.output
    r = CliRunner().invoke(main, ["status"])
    assert r.exit_code == 0 and v.uri in r.output and "ok" in r.output
    r = CliRunner().invoke(main, ["uninstall"])
    assert r.exit_code == 0 and "removed" in r.output
    r = CliRunner().invoke(main, ["status"])
    assert "nothing installed" in r.output


def test_install_rejects_two_uris_of_one_bucket_and_ranks_current_benchmarks(cache_env, tmp_path):
    reg = Registry()
    v16, v32 = SPEC.variants()[:2]
    _register(reg, v16, tmp_path, times={4096: 50.0})
    _register(reg, v32, tmp_path, times={4096: 100.0})
    # a stale benchmark of v32 from an older build must not count
    reg.add_benchmark(uri=v32.uri, source_hash="old", device="H200", arch="sm_90",
                      shape=dict(heads=8, q_len=9, batch_size=1, context=4096, page_size=1),
                      median_us=1.0, gbs=1.0, frac_copy_bw=0.1)
    one_bucket = parse_spec(dict(name="inst", heads_per_rank=8, q_len=9, page_size=1, nsplit=[16, 32]))
    assert [e["uri"] for e in pick_fastest(reg, one_bucket, "sm_90")] == [v16.uri]
    r = CliRunner().invoke(main, ["install", "--arch", "sm_90", "--uri", v16.uri, "--uri", v32.uri])
    assert r.exit_code == 1 and "more than one --uri for bucket" in r.output
    r = CliRunner().invoke(main, ["install", "--arch", "sm_90", "--uri", v16.uri, "--uri", v16.uri])
    assert r.exit_code == 0, r.output


def test_install_counts_the_verification_on_the_server_arch(cache_env, tmp_path):
    """A build verified on sm_90 and later on sm_120 installs for either arch (the latest verification on that arch
    counts, not the latest of any arch); one that failed its latest sm_90 verification does not install there."""
    reg = Registry()
    v = SPEC.variants()[0]
    _register(reg, v, tmp_path, verified_on="sm_90")
    reg.add_verification(uri=v.uri, source_hash="h" + v.uri, device="RTX PRO 6000", arch="sm_120", cases=12,
                         max_err=0.01, passed=True)
    assert entry_for(reg, v.uri, "sm_90")["uri"] == v.uri
    assert entry_for(reg, v.uri, "sm_120")["uri"] == v.uri
    reg.add_verification(uri=v.uri, source_hash="h" + v.uri, device="H200", arch="sm_90", cases=12, max_err=1.0,
                         passed=False)
    with pytest.raises(InstallError, match="failed its latest verification on sm_90"):
        entry_for(reg, v.uri, "sm_90")
    assert entry_for(reg, v.uri, "sm_120")["uri"] == v.uri


def test_install_refuses_a_variant_whose_module_is_gone(cache_env, tmp_path):
    reg = Registry()
    v = SPEC.variants()[0]
    _register(reg, v, tmp_path)
    (tmp_path / f"{v.build_key}.so").unlink()
    with pytest.raises(InstallError, match="module .* is missing"):
        entry_for(reg, v.uri, "sm_90")
    r = CliRunner().invoke(main, ["install", "--arch", "sm_90", "--uri", v.uri])
    assert r.exit_code == 1 and "is missing" in r.output and not (tmp_path / "cache" / "installed.json").exists()


def test_install_spec_leaves_out_buckets_without_a_feasible_variant(cache_env, tmp_path):
    """A spec whose e4m3 bucket has no feasible variant (rowblock has no e4m3 path): `mlagen build` drops it, so
    install takes the other buckets instead of asking for a build that cannot help."""
    from mlagen.feasibility import split_feasible

    spec = parse_spec(dict(name="f8", heads_per_rank=8, q_len=9, page_size=1, nsplit=16,
                           dtype=["bf16", "fp8_e4m3"]))
    feasible, infeasible = split_feasible(spec.variants())
    assert [v.dtype for v in feasible] == ["bf16"] and [v.dtype for v, _ in infeasible] == ["fp8_e4m3"]
    reg = Registry()
    _register(reg, feasible[0], tmp_path)
    assert [e["uri"] for e in pick_fastest(reg, spec, "sm_90")] == [feasible[0].uri]
    with pytest.raises(InstallError, match="no feasible variant"):
        pick_fastest(reg, parse_spec(dict(name="f8only", heads_per_rank=8, q_len=9, page_size=1, nsplit=16,
                                          dtype="fp8_e4m3")), "sm_90")


def test_concurrent_installs_keep_every_bucket(cache_env, tmp_path):
    """Two `mlagen install --uri` of different buckets at once: installed.json ends with both (the read, merge and
    write run under one lock)."""
    import os
    import subprocess
    import sys

    reg = Registry()
    a, b = (v for v in SPEC.variants() if v.nsplit == 16)
    assert a.bucket != b.bucket
    for v in (a, b):
        _register(reg, v, tmp_path)
    code = "import sys; from mlagen.cli import main; sys.exit(main(sys.argv[1:]))"
    for _ in range(4):
        procs = [subprocess.Popen([sys.executable, "-c", code, "install", "--arch", "sm_90", "--uri", v.uri],
                                  env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for v in (a, b)]
        for p in procs:
            out = p.communicate(timeout=120)[0]
            assert p.returncode == 0, out
        from mlagen.sglang_plugin.installed import read_installed

        assert sorted(e["uri"] for e in read_installed()["entries"]) == sorted([a.uri, b.uri])
        assert CliRunner().invoke(main, ["uninstall"]).exit_code == 0


def test_status_marks_an_install_that_was_rebuilt_since(cache_env, tmp_path):
    reg = Registry()
    v = SPEC.variants()[0]
    _register(reg, v, tmp_path)
    assert CliRunner().invoke(main, ["install", "--arch", "sm_90", "--uri", v.uri]).exit_code == 0
    newer = tmp_path / "newer.so"
    newer.write_bytes(b"")
    row = reg.get_variant(v.uri)
    reg.put_variant(uri=v.uri, spec="inst", variant=row["variant"], bucket=v.bucket, source_hash="newer",
                    nvcc_version="13.0", archs=row["archs"], so_path=str(newer), build_seconds=1.0, resources={})
    r = CliRunner(env={"COLUMNS": "250"}).invoke(main, ["status"])
    assert r.exit_code == 0 and "rebuilt since installed" in r.output and "install` again" in r.output, r.output
