"""CLI behaviour without a GPU (click's CliRunner)."""

import re
import time

import pytest
from click.testing import CliRunner

from mlagen.cli import main


@pytest.fixture
def runner(cache_env):
    return CliRunner()


def test_bad_spec_is_one_line_error(runner, tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("heads_per_rank: 8\nq_len: 9\npage_size: 3\n")
    r = runner.invoke(main, ["build", str(p)])
    assert r.exit_code == 1
    assert "Error: spec key 'page_size': value 3 not allowed; allowed: 1, 2, 4, 8, 16, 32, 64, 128, 256" in r.output
    assert "Traceback" not in r.output


def test_missing_spec_file(runner):
    r = runner.invoke(main, ["build", "does-not-exist.yaml"])
    assert r.exit_code != 0 and "does-not-exist.yaml" in r.output


@pytest.mark.parametrize("args,want,where", [
    (["build", "specs/kimi-k2-tp8-verify.yaml", "--jobs", "0"], "Invalid value for '--jobs'", "build"),
    (["build", "specs/kimi-k2-tp8-verify.yaml", "--kernels", ",,"], "names no glob", "build"),
    (["bench", "--contexts", "1,,2"], "expected comma-separated positive integers", "bench"),
    (["build", "-j"], "Option '-j' requires an argument", "build"),
    (["bench", "--contexts"], "Option '--contexts' requires an argument", "bench"),
    (["build"], "Missing argument 'SPEC'", "build"),
    (["biuld"], "Did you mean 'build'?", ""),
    (["--bogus"], "No such option '--bogus'", ""),
])
def test_usage_errors_are_one_line(runner, args, want, where):
    """A bad option, argument or command: exit 2 and one `Error:` line naming the --help to read (the subcommand's
    when there is one), not click's usage block (usage, hint, blank line, error)."""
    r = runner.invoke(main, args, prog_name="mlagen")
    assert r.exit_code == 2 and len(r.output.splitlines()) == 1, r.output
    assert r.output.startswith("Error: ") and want in r.output, r.output
    assert r.output.rstrip().endswith(f"(see `mlagen{' ' + where if where else ''} --help`)"), r.output


def test_bad_jobs_and_glob(runner):
    r = runner.invoke(main, ["build", "specs/kimi-k2-tp8-verify.yaml", "--jobs", "0"])
    assert r.exit_code == 2 and "--jobs" in r.output
    r = runner.invoke(main, ["build", "specs/kimi-k2-tp8-verify.yaml", "--kernels", "nomatch*"])
    assert r.exit_code == 1 and "no variant of kimi-k2-tp8-verify matches --kernels 'nomatch*'" in r.output
    assert "module name" not in r.output
    # a glob copied from a module name (generate prints them: no _nsN_ after the page size) gets a hint
    r = runner.invoke(main, ["build", "specs/kimi-k2-tp8-verify.yaml", "--kernels", "*ps64_lw128*"])
    assert r.exit_code == 1 and "matches --kernels '*ps64_lw128*'" in r.output and "_nsN_" in r.output, r.output
    for cmd in (["build", "specs/kimi-k2-tp8-verify.yaml"], ["list"], ["verify"]):
        r = runner.invoke(main, [*cmd, "--kernels", " , "])
        assert r.exit_code == 2 and "names no glob" in r.output and "Traceback" not in r.output


def test_registry_variants_take_comma_separated_globs(cache_env):
    from mlagen.registry import Registry
    from mlagen.spec import load_spec

    reg = Registry()
    vs = load_spec("specs/kimi-k2-tp8-verify.yaml").variants()
    for v in vs[:6]:
        reg.put_variant(uri=v.uri, spec="k2", variant=v.spec_dict("k2"), bucket="b", source_hash="h", nvcc_version="13.0",
                        archs=["sm_120", "sm_90"], so_path="/nonexistent.so", build_seconds=0.0, resources={})
    one, two = vs[0].uri, vs[5].uri
    assert [r["uri"] for r in reg.variants(one)] == [one]
    assert [r["uri"] for r in reg.variants(f"{two}, {one}")] == sorted([one, two])
    assert len(reg.variants()) == 6


def test_bench_bad_contexts(runner, monkeypatch):
    """--contexts / --batches are validated before the GPU check (which would fail first on a CPU machine)."""
    from mlagen import cli

    monkeypatch.setattr(cli, "_gpu_available", lambda: pytest.fail("GPU check reached before option validation"))
    for opt, bad in (("--contexts", "4k"), ("--batches", "1,0")):
        r = runner.invoke(main, ["bench", opt, bad])
        assert r.exit_code == 2, r.output
        assert f"Invalid value for '{opt}': expected comma-separated positive integers (< 2**31), got '{bad}'" in r.output
        assert "needs a GPU" not in r.output


def test_generate_lists_and_drops(runner, tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("name: t\nheads_per_rank: 8\nq_len: 9\nblock_n: [16, 64]\nstages: 3\n")
    r = runner.invoke(main, ["generate", str(p)])
    assert r.exit_code == 0, r.output
    assert "dropped mla_verify_h8_q9" in r.output and "shared memory" in r.output
    assert "1 variant in 1 module" in r.output


def test_dropped_reasons_grouped_and_printed_literally(runner, tmp_path):
    """Many infeasible variants: one line per reason with its count; [brackets] in reasons survive."""
    p = tmp_path / "s.yaml"
    p.write_text("name: t\nheads_per_rank: 8\nq_len: 9\nschedule: dimsplit\nload_width: 128\nblock_n: 32\n"
                 "row_tiles: 5\nstages: 3\nnum_warps: 16\nnsplit: [auto, 8, 16, 32, 64]\npage_size: [1, 64]\n")
    r = runner.invoke(main, ["generate", str(p)])
    assert r.exit_code == 1, r.output
    assert ("dropped 10 variant(s): schedule dimsplit needs num_warps 2 x row_tiles + 1 = 11 (two warps per row tile) "
            "or in [row_tiles + 1, 8] = [6, 8] (one), got 16") in r.output
    assert r.output.count("dropped 10 variant(s)") == 1 and r.output.count("\n") <= 3


def test_dropped_shared_memory_reasons_grouped_by_limit(runner, tmp_path):
    """Shared-memory reasons that differ only in the byte count are one line per limit and arch, with the range."""
    p = tmp_path / "s.yaml"
    p.write_text("name: t\nheads_per_rank: 8\nq_len: 9\nblock_n: [32, 64]\nstages: [3, 4]\nrow_tiles: [1, 2]\n"
                 "nsplit: [auto, 16, 64]\n")
    r = runner.invoke(main, ["generate", str(p)])
    lines = [l for l in r.output.splitlines() if "shared memory" in l]
    assert len(lines) == 1, r.output
    m = re.search(r"dropped (\d+) variant\(s\): shared memory (\d+)-(\d+) B > 101376 B per block on sm_120", lines[0])
    assert m and int(m.group(1)) > 8 and int(m.group(2)) < int(m.group(3)), lines[0]


def test_verify_without_gpu_says_so(runner):
    r = runner.invoke(main, ["verify"])
    assert r.exit_code == 1 and "verify needs a GPU" in r.output


def test_show_unknown_and_empty_list(runner):
    r = runner.invoke(main, ["show", "mla_verify_nope"])
    assert r.exit_code == 1 and "unknown variant 'mla_verify_nope'" in r.output
    long_uri = "mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm99"
    r = runner.invoke(main, ["show", long_uri])  # printed whole, so the user sees which part is wrong
    assert r.exit_code == 1 and f"unknown variant '{long_uri}'" in r.output, r.output
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 0 and "0 variants" in r.output


@pytest.mark.slow
def test_build_without_gpu_compiles_then_stops(runner):
    r = runner.invoke(main, ["build", "specs/kimi-k2-tp8-decode.yaml", "--kernels", "*ps64_ns32_lw128_bn16_w8_rt1_st2*"])
    assert r.exit_code == 0, r.output
    assert "built 1 variant (0 cached)" in r.output
    assert "no GPU" in r.output and "stopping after compile" in r.output
    r = runner.invoke(main, ["list"])
    assert "mla_verify_h8_q1_kv512_rope64_ps64_ns32_lw128_bn16_w8_rt1_st2_causal_bf16_sm120_sm90" in r.output
    r = runner.invoke(main, ["build", "specs/kimi-k2-tp8-decode.yaml", "--kernels", "*ps64_ns32_lw128_bn16_w8_rt1_st2*"])
    assert "built 1 variant (1 cached)" in r.output


def test_bad_max_jobs_is_one_line_error(runner, monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "abc")
    r = runner.invoke(main, ["build", "specs/kimi-k2-tp8-decode.yaml", "--kernels", "*ps64_ns32_lw128_bn16_w8_rt1_st2*"])
    assert r.exit_code == 1 and "MAX_JOBS must be a positive integer, got 'abc'" in r.output


def test_nothing_feasible_fails(runner, tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("name: t\nheads_per_rank: 8\nq_len: 9\nblock_n: 64\nstages: 4\n")
    r = runner.invoke(main, ["generate", str(p)])
    assert r.exit_code == 1 and "no feasible variant" in r.output


def test_status_with_corrupt_state(runner, cache_env):
    import os

    d = cache_env / "cache"
    d.mkdir(parents=True, exist_ok=True)
    (d / "installed.json").write_text("{not json")
    r = runner.invoke(main, ["status"])
    assert r.exit_code == 1 and "Traceback" not in r.output and "installed.json" in r.output


def test_clean_never_deletes_by_name(runner, cache_env):
    """Entries named like mlagen's but not recorded by it (a user's) stay; see test_cli_robust_cpu.py
    for a clean after a real (stand-in compiler) build."""
    gen = cache_env / "generated"
    (gen / "mla_verify_x").mkdir(parents=True)
    (gen / "build_a_1.ninja").write_text("")
    (gen / "precious.txt").write_text("keep me")
    r = runner.invoke(main, ["clean", "--all", "--yes"])
    assert r.exit_code == 0, r.output
    assert "nothing to remove" in r.output
    assert (gen / "mla_verify_x").is_dir() and (gen / "build_a_1.ninja").exists()
    assert (gen / "precious.txt").read_text() == "keep me"


def test_environment_errors_are_one_line(runner, cache_env, monkeypatch):
    bad = cache_env / "afile"
    bad.write_text("x")
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(bad))
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 1 and "check MLAGEN_CACHE_DIR" in r.output and "Traceback" not in r.output


def test_spec_arch_not_a_string_and_binary_spec(runner, tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("heads_per_rank: 8\nq_len: 9\narch: [[sm_90]]\n")
    r = runner.invoke(main, ["generate", str(p)])
    assert r.exit_code == 1 and "spec key 'arch'" in r.output
    p.write_bytes(b"\xff\xfe\x00bad")
    r = runner.invoke(main, ["generate", str(p)])
    assert r.exit_code == 1 and "not UTF-8" in r.output


def _register(uris_spec: dict, n: int | None = None):
    from mlagen.registry import Registry
    from mlagen.spec import parse_spec

    reg = Registry()
    vs = parse_spec(uris_spec).variants()[:n]
    res = {a: dict(registers=168, smem=99000, spill_stores=0, spill_loads=0, stack=0) for a in ("sm_120", "sm_90")}
    for v in vs:
        reg.put_variant(uri=v.uri, spec="t", variant=v.to_dict(), bucket=v.bucket, source_hash="h", nvcc_version="13.0",
                        archs=list(v.archs), so_path="/nonexistent.so", build_seconds=1.0, resources=res)
    return reg, [v.uri for v in vs]


@pytest.mark.parametrize("width", [60, 80, 120, 200])
def test_list_always_shows_whole_uris(runner, monkeypatch, width):
    """At any width every uri is printed whole, on one line (it can be copied into `mlagen show`)."""
    from rich.console import Console

    from mlagen import cli

    _, uris = _register(dict(heads_per_rank=8, q_len=9, load_width="bulk", overlap=[0, 1], row_tiles=[1, 2],
                             nsplit=["auto", 32], page_size=[1, 64]))
    monkeypatch.setattr(cli, "console", Console(highlight=False, width=width))
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    for u in uris:
        assert any(u in l for l in lines), (u, r.output)
    assert "…" not in r.output
    r = runner.invoke(main, ["list", "--format", "tsv"])
    assert [l.split("\t")[0] for l in r.output.splitlines()[1:]] == sorted(uris)
    r = runner.invoke(main, ["show", uris[0]])
    assert r.exit_code == 0


def test_show_prints_iso_times(runner):
    reg, uris = _register(dict(heads_per_rank=8, q_len=9), 1)
    row = reg.get_variant(uris[0])
    reg.add_verification(uri=uris[0], source_hash=row["source_hash"], device="d", arch="sm_90", cases=1, max_err=0.0,
                         passed=True)
    reg.add_benchmark(uri=uris[0], source_hash=row["source_hash"], device="d", arch="sm_90",
                      shape=dict(context=4096), median_us=10.0, gbs=1.0, frac_copy_bw=0.1)
    r = runner.invoke(main, ["show", uris[0]])
    assert r.exit_code == 0, r.output
    iso = r'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d"'
    assert re.search(r'"built_at": ' + iso, r.output), r.output
    assert len(re.findall(r'"at": ' + iso, r.output)) == 2, r.output
    assert not re.search(r'"(built_at|at)": \d', r.output)


def test_spec_errors_truncate_large_values(runner, tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("heads_per_rank: 8\nq_len: {a: [" + ", ".join(str(i) for i in range(5000)) + "]}\n")
    r = runner.invoke(main, ["generate", str(p)])
    assert r.exit_code == 1
    assert len(r.output.splitlines()) == 1 and len(r.output) < 400, r.output[:500]
    assert r.output.startswith("Error: spec key 'q_len': expected int, got dict {'a': [0, 1, 2,")
    assert "...]}; allowed: int in [1, 64]" in r.output


def test_sweep_over_the_limit_is_refused_naming_its_size(runner, tmp_path, cache_env):
    p = tmp_path / "big.yaml"
    p.write_text("name: big\nheads_per_rank: [" + ", ".join(map(str, range(1, 129))) + "]\n"
                 "q_len: [" + ", ".join(map(str, range(1, 65))) + "]\n"
                 "nsplit: [" + ", ".join(map(str, range(1, 257))) + "]\n")
    t0 = time.monotonic()
    for cmd in (["generate"], ["build"], ["build", "--max-variants", "100000"]):
        r = runner.invoke(main, [cmd[0], str(p), *cmd[1:]])
        assert r.exit_code == 1
        assert r.output.startswith("Error: spec big sweeps 2,097,152 variants (heads_per_rank 128 x q_len 64 x nsplit 256), "
                                   "more than the limit of "), r.output
        assert "allow it with --max-variants 2097152" in r.output
    assert time.monotonic() - t0 < 10  # counted, never expanded
    assert not (cache_env / "generated").exists()
    p.write_text("name: mid\nheads_per_rank: 8\nq_len: 9\nnsplit: [" + ", ".join(map(str, range(1, 257))) + "]\n"
                 "row_tiles: [1, 2, 3]\n")  # 768 variants
    r = runner.invoke(main, ["generate", str(p)])
    assert r.exit_code == 1 and "sweeps 768 variants (nsplit 256 x row_tiles 3), more than the limit of 512" in r.output
    from mlagen.spec import load_spec

    load_spec(p).check_size(768)  # --max-variants 768 allows it


def test_readme_setup_block_and_gpu_scripts():
    """The set-up block creates the virtual environment setup.sh installs into; the offline route is
    described for a user; every script in tools/ is named with what it runs in tools/README.md."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text()
    tools_text = (root / "tools" / "README.md").read_text()
    assert "tools/README.md" in text
    setup = text.split("## Setup and the main job", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [l.split("#")[0].strip() for l in setup.strip().splitlines()]
    assert lines[0] == "python3 -m venv --system-site-packages .venv && . .venv/bin/activate", setup
    assert lines.index("bash setup.sh") > 0
    assert "a gpu machine without internet access" in text.lower()
    for doc in (text, tools_text, (root / "bench" / "README.md").read_text()):
        for word in ("lent", "device call", "carrying"):  # how it was developed, not what a user does
            assert not re.search(rf"\b{word}\b", doc), word
    for script in sorted((root / "tools").iterdir()):
        if script.suffix in (".sh", ".py") and script.name != "device_env.sh":
            rows = [l for l in tools_text.splitlines() if l.startswith("| `") and f"tools/{script.name}" in l.split("|")[1]]
            assert rows and len(rows[0].split("|")[2].strip()) > 20, f"tools/{script.name} not described in tools/README.md"


def test_bench_checks_spec_plot_and_int32_before_the_gpu(runner, monkeypatch, tmp_path):
    from mlagen import cli

    monkeypatch.setattr(cli, "_gpu_available", lambda: pytest.fail("GPU check reached before validation"))
    for opt, bad in (("--contexts", "99999999999999999999"), ("--contexts", ""), ("--batches", "2147483648")):
        r = runner.invoke(main, ["bench", opt, bad])
        assert r.exit_code == 2 and "positive integers (< 2**31)" in r.output, r.output
    r = runner.invoke(main, ["bench", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 1 and "cannot read spec" in r.output and "needs a GPU" not in r.output
    r = runner.invoke(main, ["bench", "--plot", str(tmp_path / "missing" / "b.png")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_show_hints_at_a_module_name(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "c"))
    r = runner.invoke(main, ["show", "mla_verify_h8_q9_kv512_rope64_ps1_lwbulk_bn32_w8_rt1_st2_tree_bf16_sm120_sm90"])
    assert r.exit_code == 1 and "looks like a module name" in r.output
