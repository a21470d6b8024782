"""CLI robustness without a GPU or a real compile (issue 11): only mlagen's own files are deleted,
interrupts stop the whole compile tree and keep finished modules, toolchain and input errors are one
line, output reads well in a terminal, a pipe and CI.

The build tests use tests/data/fake_nvcc (a stand-in nvcc that writes the files mlagen's rule expects)
and a stand-in source, so they exercise ninja, the process handling and the registry in seconds."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlagen import ninja_gen, owned, paths
from mlagen.cli import main

ROOT = Path(__file__).resolve().parent.parent
FAKE_NVCC = Path(__file__).resolve().parent / "data" / "fake_nvcc"
SPEC = """name: fk
heads_per_rank: 8
q_len: 9
block_n: 16
stages: 2
load_width: 128
page_size: [1, 64]
row_tiles: [1, 2]
nsplit: [32, auto]
"""  # 8 variants in 4 modules
DRIVER = """import sys
from mlagen import codegen
codegen.render_variant = lambda v, module_name=None: f"// stand-in source of {v.build_key}\\n"
from mlagen.cli import main
main(sys.argv[1:], prog_name="mlagen")
"""


@pytest.fixture
def fake_cuda(tmp_path, monkeypatch):
    """PATH with the stand-in nvcc first (CUDA_HOME unset), stand-in sources, fresh cache dirs."""
    bindir = tmp_path / "cuda" / "bin"
    bindir.mkdir(parents=True)
    shutil.copy(FAKE_NVCC, bindir / "nvcc")
    (bindir / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "generated"))
    from mlagen import codegen

    monkeypatch.setattr(codegen, "render_variant", lambda v, module_name=None: f"// stand-in source of {v.build_key}\n")
    spec = tmp_path / "fk.yaml"
    spec.write_text(SPEC)
    return spec


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _procs_mentioning(text: str) -> list[str]:
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and _alive(int(d.name)) and int(d.name) != os.getpid():
            out.append(f"{d.name}: {cmd[:200]}")
    return out


# ---- item 1: an empty variable means unset; clean deletes only what mlagen recorded

def test_empty_env_means_unset_and_clean_keeps_unrecorded_dirs(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    (work / "lib").mkdir(parents=True)
    (work / "generated").mkdir()
    (work / "lib" / "keep.c").write_text("x")
    (work / "generated" / "notes.txt").write_text("y")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MLAGEN_CACHE_DIR", "")
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "gen"))
    monkeypatch.chdir(work)
    assert paths.cache_dir() == home / ".cache" / "mlagen"
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", " ")
    assert paths.generated_dir() != Path(" ") and paths.generated_dir().is_absolute()
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "gen"))
    r = CliRunner().invoke(main, ["list"])
    assert r.exit_code == 0, r.output
    assert str(home / ".cache" / "mlagen") in r.output.replace("\n", "")  # "0 variants built in <the default cache>"
    assert not (work / "registry.sqlite").exists() and not (home / ".cache").exists()  # `list` writes nothing
    r = CliRunner().invoke(main, ["clean", "--all", "--yes"])
    assert r.exit_code == 0, r.output
    assert (work / "lib" / "keep.c").read_text() == "x" and (work / "generated" / "notes.txt").read_text() == "y"


def test_clean_removes_recorded_files_only(fake_cuda, tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    cache, gen = tmp_path / "cache", tmp_path / "generated"
    vdir = next(gen.glob("mla_verify_*"))
    # files a user put next to mlagen's, some with names mlagen would use
    mine = [gen / "mla_verify_mine" / "a.cu", gen / "build_mine.ninja", vdir / "notes.txt", cache / "lib" / "mine.so",
            cache / "locks" / "mine.lock", cache / "generated" / "x.cu", cache / "keep.txt"]
    for p in mine:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("user")
    assert (cache / "registry.sqlite").exists() and list((cache / "lib").glob("mla_verify_*.so"))
    r = runner.invoke(main, ["clean", "--all", "--yes"])
    assert r.exit_code == 0, r.output
    assert all(p.read_text() == "user" for p in mine)
    assert not (cache / "registry.sqlite").exists() and not list((cache / "lib").glob("mla_verify_*.so"))
    assert not list((cache / "locks").glob("mla_verify_*.lock")) and not list(gen.glob("build_fk_*.ninja"))
    assert sorted(p.name for p in vdir.iterdir()) == ["notes.txt"]  # its own files gone, the user's kept
    assert sorted(p.name for p in gen.iterdir()) == sorted([vdir.name, "mla_verify_mine", "build_mine.ninja"])
    assert not list(gen.rglob(owned.MANIFEST)) and not list(cache.rglob(owned.MANIFEST))
    r = runner.invoke(main, ["clean", "--all", "--yes"])
    assert "nothing to remove" in r.output


# ---- item 2: the prompt lists what goes

def test_clean_all_prompt_lists_what_goes(fake_cuda, tmp_path):
    from mlagen.registry import Registry

    runner = CliRunner()
    r = runner.invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    reg = Registry()
    row = reg.variants()[0]
    reg.add_verification(uri=row["uri"], source_hash=row["source_hash"], device="x", arch="sm_90", cases=1,
                         max_err=0.0, passed=True)
    r = runner.invoke(main, ["install", "--uri", row["uri"], "--arch", "sm_90"])
    assert r.exit_code == 0, r.output
    installed = tmp_path / "cache" / "installed.json"
    r = runner.invoke(main, ["clean"], input="n\n")
    assert r.exit_code == 1 and "generated sources" in r.output
    assert "registry" not in r.output and "installed" not in r.output
    r = runner.invoke(main, ["clean", "--all"], input="n\n")
    assert r.exit_code == 1, r.output
    for what in ("generated sources", "the registry", "built modules (.so)", "build lock files",
                 f"the installed state {installed} (un-installs SGLang's `mlagen` backend)"):
        assert what in r.output, (what, r.output)
    assert installed.exists() and (tmp_path / "cache" / "registry.sqlite").exists()  # answered no
    r = runner.invoke(main, ["clean", "--all"], input="")  # no terminal, no answer: a hint, not click's "Aborted!"
    assert r.exit_code == 1 and "nothing deleted: no answer on stdin; pass --yes" in r.output, r.output
    assert installed.exists()
    r = runner.invoke(main, ["clean", "--all"], input="y\n")
    assert r.exit_code == 0 and not installed.exists()
    assert re.search(r"removed \d+ file\(s\) and \d+ director\(ies\) in all", r.output), r.output
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 0 and "0 variants built in" in r.output and "mlagen build SPEC" in r.output


# ---- item 3: interrupts stop ninja and nvcc, finished modules are registered

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGQUIT])
def test_interrupt_stops_compile_tree_and_keeps_finished(fake_cuda, tmp_path, sig):
    pids = tmp_path / "pids"
    env = dict(os.environ, FAKE_NVCC_SLOW="*ps64*", FAKE_NVCC_PIDS=str(pids))
    cmd = [sys.executable, "-c", DRIVER, "build", str(fake_cuda), "--jobs", "4", "--compile-only"]
    # its own session: the signal goes to the mlagen process alone, not to a process group
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (pids.exists() and len(pids.read_text().split()) >= 4):
        time.sleep(0.1)
    time.sleep(1.0)  # the two fast modules finish in milliseconds
    hung = [int(p) for p in pids.read_text().split()]
    assert all(_alive(p) for p in hung)
    os.kill(proc.pid, sig)
    out, _ = proc.communicate(timeout=60)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, out
    assert f"interrupted ({name}): stopped ninja and nvcc; 4 variant(s) compiled before that are registered" in out
    assert "Traceback" not in out and "Aborted" not in out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (any(_alive(p) for p in hung) or _procs_mentioning(str(tmp_path))):
        time.sleep(0.1)
    assert not [p for p in hung if _alive(p)], "nvcc / its children left running"
    assert not _procs_mentioning(str(tmp_path)), "ninja or nvcc left running"
    env.pop("FAKE_NVCC_SLOW")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "built 8 variants (4 cached)" in r.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_killed_build_leaves_no_ninja_or_nvcc(fake_cuda, tmp_path):
    """SIGKILL (no handler runs): ninja gets SIGTERM from the kernel as its parent dies and stops the compiles."""
    pids = tmp_path / "pids"
    env = dict(os.environ, FAKE_NVCC_SLOW="*ps64*", FAKE_NVCC_PIDS=str(pids))
    cmd = [sys.executable, "-c", DRIVER, "build", str(fake_cuda), "--jobs", "4", "--compile-only"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (pids.exists() and len(pids.read_text().split()) >= 4):
        time.sleep(0.1)
    hung = [int(p) for p in pids.read_text().split()]
    assert hung and all(_alive(p) for p in hung)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (any(_alive(p) for p in hung) or _procs_mentioning(str(tmp_path))):
        time.sleep(0.1)
    assert not [p for p in hung if _alive(p)], "nvcc / its children left running"
    assert not _procs_mentioning(str(tmp_path)), "ninja or nvcc left running"


def test_error_during_compile_stops_ninja(fake_cuda, tmp_path, monkeypatch):
    """An error in mlagen itself while ninja runs (here: in the progress callback) stops the tree too."""
    from mlagen import build as b
    from mlagen.spec import load_spec

    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_NVCC_SLOW", "*ps64*")
    monkeypatch.setenv("FAKE_NVCC_PIDS", str(pids))
    # the two fast modules take 1 s, so the two hanging compiles have started (and written their pids) before
    # the error; without it a loaded machine could finish the fast ones first and leave nothing to check
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1")

    def on_progress(p):
        if p.modules_done >= 2:
            raise RuntimeError("display broke")

    with pytest.raises(b.BuildInterrupted) as ei:
        b.build(load_spec(fake_cuda), jobs=4, on_progress=on_progress)
    assert isinstance(ei.value.cause, RuntimeError) and len(ei.value.built) == 4
    hung = [int(p) for p in pids.read_text().split()]
    assert len(hung) == 4  # two hanging fake nvcc processes, each with its sleep child
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in hung):
        time.sleep(0.1)
    assert not [p for p in hung if _alive(p)]


# ---- items 4 and 7: toolchain problems are one line, once

def _one_error_line(r) -> str:
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    errors = [l for l in r.output.splitlines() if l.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    return errors[0]


@pytest.mark.parametrize("cmd", [["generate"], ["build"], ["build", "--compile-only"]])
def test_missing_nvcc_is_one_line_for_every_compiling_subcommand(fake_cuda, tmp_path, monkeypatch, cmd):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", "")
    r = CliRunner().invoke(main, [cmd[0], str(fake_cuda), *cmd[1:]])
    assert r.exit_code == 1
    assert _one_error_line(r) == "Error: nvcc not found: install the CUDA toolkit (13.x) or set CUDA_HOME"
    assert not (tmp_path / "cache").exists() and not (tmp_path / "generated").exists()  # nothing written


def test_build_with_nothing_feasible_writes_nothing(fake_cuda, tmp_path):
    """Every variant dropped: the reasons and one error line, and no cache directory or registry created."""
    p = tmp_path / "none.yaml"
    p.write_text("name: t\nheads_per_rank: 8\nq_len: 9\nblock_n: 64\nstages: 4\n")
    r = CliRunner().invoke(main, ["build", str(p), "--compile-only"])
    assert r.exit_code == 1 and "dropped" in r.output
    assert _one_error_line(r).startswith("Error: no feasible variant in")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "generated").exists()


@pytest.mark.parametrize("cmd", [["list"], ["show", "mla_verify_x"], ["verify"], ["bench"], ["clean", "--yes"],
                                 ["status"], ["uninstall"], ["install", "--uri", "mla_verify_x", "--arch", "sm_90"]])
def test_other_subcommands_without_toolchain_never_trace(fake_cuda, tmp_path, monkeypatch, cmd):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    r = CliRunner().invoke(main, cmd)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    if r.exit_code:
        _one_error_line(r)


@pytest.mark.parametrize("cmd", ["generate", "build"])
def test_old_nvcc_is_one_upfront_message(fake_cuda, monkeypatch, tmp_path, cmd):
    monkeypatch.setenv("FAKE_NVCC_RELEASE", "12.4")
    r = CliRunner().invoke(main, [cmd, str(fake_cuda)])
    assert r.exit_code == 1
    line = _one_error_line(r)
    assert re.fullmatch(r"Error: nvcc 12\.4 \(.*/nvcc\) is too old for sm_120: mlagen needs CUDA 13\.0 or newer; "
                        r"install it and put its bin/ on PATH or set CUDA_HOME", line), line
    assert "Unsupported gpu architecture" not in r.output and "FAILED" not in r.output
    assert not (tmp_path / "generated").exists()  # refused before anything was written
    # sm_90 alone builds with CUDA 12
    (tmp_path / "s90.yaml").write_text(SPEC + "arch: sm_90\n")
    r = CliRunner().invoke(main, ["build", str(tmp_path / "s90.yaml"), "--compile-only"])
    assert r.exit_code == 0, r.output


# ---- item 10: progress in a pipe / CI, known totals, lock waits

def test_build_progress_plain_lines_when_not_a_terminal(fake_cuda, monkeypatch):
    from mlagen import cli

    monkeypatch.setattr(cli._BuildProgress, "interval", 0.3)
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1")
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--jobs", "2", "--compile-only"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "compiling 4 module(s) (8 variants; 0 cached) with 2 parallel job(s)"
    assert any(l.startswith("still compiling: 0/4 modules (0/8 variants), ") for l in lines), r.output
    assert any(l.startswith("compiled 4/4 modules (8/8 variants), ") for l in lines), r.output
    assert "built 8 variants (0 cached) from 4 modules" in r.output


def test_plain_progress_prints_a_finished_module_right_after_a_heartbeat(monkeypatch):
    """A "still compiling" line does not use up the rate limit of the "compiled" lines: a module that finishes
    just after one is printed (with one clock for both, a pipe saw only heartbeats until the last module)."""
    import io

    from rich.console import Console

    from mlagen import cli
    from mlagen.build import Progress

    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, force_terminal=False, width=200))
    with cli._BuildProgress(2) as prog:
        prog.update(Progress(modules_total=4, variants_total=8, modules_done=0, variants_done=0, cached=0))
        prog.last_module_line -= prog.interval  # the first module line is due
        prog._print("still compiling: (a heartbeat just now)")
        prog.update(Progress(modules_total=4, variants_total=8, modules_done=1, variants_done=2, cached=0))
        prog.update(Progress(modules_total=4, variants_total=8, modules_done=2, variants_done=4, cached=0))
    lines = out.getvalue().splitlines()
    assert [l.split(",")[0] for l in lines if l.startswith("compiled ")] == ["compiled 1/4 modules (2/8 variants)"], lines


def test_terminal_bar_has_totals_before_the_first_module(monkeypatch):
    import io

    from rich.console import Console

    from mlagen import cli
    from mlagen.build import Progress

    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), force_terminal=True, width=100))
    with cli._BuildProgress(2) as prog:
        prog.update(Progress(modules_total=4, variants_total=8, modules_done=1, variants_done=2, cached=2))
        task = prog.bar.tasks[0]
        assert task.total == 8 and task.completed == 2 and "1/4 modules" in task.description


def _hold_first_lock(spec_path, seconds):
    """Another process holding the build lock of the spec's first module for ``seconds``: (its build key, lock path,
    the holder process), returned once the lock is held."""
    from mlagen.spec import load_spec

    key = load_spec(spec_path).variants()[0].build_key
    lock_path = paths.lock_dir() / f"{key}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    return key, lock_path, _hold_lock(lock_path, seconds)


def _hold_lock(lock_path, seconds):
    """Another process holding ``lock_path`` for ``seconds``, returned once the lock is held."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from filelock import FileLock; "
                               "l = FileLock(sys.argv[1]); l.acquire(); print('held', flush=True); "
                               "time.sleep(float(sys.argv[2]))", str(lock_path), str(seconds)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _build_waits_for(spec_path, key, lock_path, holder):
    """`mlagen build` while ``holder`` holds ``lock_path``: it says it waits, then builds, and leaves the lock free."""
    from filelock import FileLock

    r = CliRunner().invoke(main, ["build", str(spec_path), "--compile-only"])
    holder.wait()
    assert r.exit_code == 0, r.output
    assert f"waiting for another build of {key} (lock {lock_path})" in r.output
    assert FileLock(str(lock_path)).acquire(timeout=0)


def test_build_waiting_on_a_lock_says_so(fake_cuda, tmp_path):
    _build_waits_for(fake_cuda, *_hold_first_lock(fake_cuda, 1.5))


def test_builds_sharing_a_generated_directory_take_its_lock(fake_cuda, tmp_path, monkeypatch):
    """Two caches, one MLAGEN_GENERATED_DIR: a build waits on the module's lock in the generated directory (not only on
    its cache's), so two nvcc never write one module's outputs at once."""
    from mlagen.build import _generated_lock
    from mlagen.ninja_gen import variant_outputs
    from mlagen.spec import load_spec

    v = load_spec(fake_cuda).variants()[0]
    lock_path = _generated_lock(variant_outputs(v))
    assert CliRunner().invoke(main, ["generate", str(fake_cuda)]).exit_code == 0  # (records the lock's name as mlagen's)
    holder = _hold_lock(lock_path, 1.5)
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "other-cache"))  # another cache: its own cache locks
    _build_waits_for(fake_cuda, v.build_key, lock_path, holder)


def test_sources_another_checkout_wrote_are_rewritten_under_the_lock(fake_cuda, tmp_path, monkeypatch):
    """Between this build's generation and its locks another checkout sharing the generated directory wrote its own
    .cu and build.ninja (another include path): the build writes its own again before compiling, and registers."""
    from mlagen import build as build_mod
    from mlagen import ninja_gen

    real_generate = build_mod.generate

    def overwritten_after(variants, **kw):
        jobs = real_generate(variants, **kw)
        for j in jobs:
            Path(j.outputs["source"]).write_text("// another checkout's source\n")
            other = ninja_gen.variant_ninja(j.variants[0], j.source_hash).replace(" -I", " -I/elsewhere -I")
            Path(j.outputs["ninja"]).write_text(other)
        return jobs

    monkeypatch.setattr(build_mod, "generate", overwritten_after)
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0 and "0 failed" in r.output, r.output
    for cu in (tmp_path / "generated").rglob("mla_verify_*.cu"):
        assert cu.read_text().startswith("// stand-in source of ")
        assert "/elsewhere" not in (cu.parent / "build.ninja").read_text()


def test_a_second_build_with_another_cache_key_does_not_spoil_a_running_one(fake_cuda, tmp_path):
    """One generated directory, one cache; build B (another nvcc environment: another cache key, other build.ninja
    files) starts while build A compiles. B writes its files only once it holds the modules' locks, so A's files stay
    A's and A registers its modules; then B builds its own."""
    started = tmp_path / "started"
    cmd = [sys.executable, "-c", DRIVER, "build", str(fake_cuda), "--compile-only", "--jobs", "4"]
    a = subprocess.Popen(cmd, env=dict(os.environ, FAKE_NVCC_SLEEP="2", FAKE_NVCC_STARTED=str(started)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not started.exists():
        time.sleep(0.05)
    assert started.exists(), "build A never started a compile"
    b = subprocess.run(cmd, env=dict(os.environ, NVCC_APPEND_FLAGS="-Xptxas -O1"), capture_output=True, text=True,
                       timeout=120)
    out_a, _ = a.communicate(timeout=120)
    assert a.returncode == 0 and "0 failed" in out_a, out_a
    assert b.returncode == 0 and "0 failed" in b.stdout and "(0 cached)" in b.stdout, b.stdout + b.stderr


def test_a_build_ninja_rewritten_during_the_build_is_not_registered(fake_cuda, tmp_path, monkeypatch):
    """`mlagen generate` of another checkout (no lock) rewrote build.ninja while ninja ran: the module may have been
    compiled with the other include path, so it is not registered."""
    from mlagen import build as build_mod
    from mlagen.registry import Registry

    real_register = build_mod._register

    def rewritten_first(spec, j, secs, reg):
        ninja = Path(j.outputs["ninja"])
        ninja.write_text(ninja.read_text().replace(" -I", " -I/elsewhere -I"))
        return real_register(spec, j, secs, reg)

    monkeypatch.setattr(build_mod, "_register", rewritten_first)
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 1 and "source or build.ninja changed during the build" in r.output, r.output
    assert Registry(create=False).variants() == []


@pytest.mark.parametrize("name", ["source", "ninja"])
def test_generate_refuses_to_overwrite_a_users_file(fake_cuda, tmp_path, name):
    """A file of a name mlagen writes in a module's directory that mlagen did not write: one error line, and nothing
    written (the user's file as it was, no other module generated)."""
    from mlagen.ninja_gen import variant_outputs
    from mlagen.spec import load_spec

    vs = load_spec(fake_cuda).variants()
    mine = Path(variant_outputs(vs[-1])[name])
    mine.parent.mkdir(parents=True)
    mine.write_text("a user's file")
    r = CliRunner().invoke(main, ["generate", str(fake_cuda)])
    assert r.exit_code == 1 and _one_error_line(r) == (
        f"Error: {mine} exists and was not written by mlagen: move it away, or set MLAGEN_GENERATED_DIR to another "
        "directory"), r.output
    assert mine.read_text() == "a user's file"
    assert sorted(p for p in (tmp_path / "generated").rglob("*") if p.is_file()) == [mine]


def test_signal_whose_exception_is_lost_still_stops_ninja(tmp_path):
    """A KeyboardInterrupt raised by the signal handler can be dropped (Python ignores exceptions raised inside
    finalizers, where a handler may happen to run): run_ninja stops ninja on the signal itself and raises once
    ninja's output ends, instead of reading the hung compile forever. Here the line callback swallows it."""
    import signal as sig_mod

    from mlagen import ninja_gen

    (tmp_path / "build.ninja").write_text(
        "rule run\n  command = $cmd\n"
        "build fast: run\n  cmd = echo fast\n"
        "build slow: run\n  cmd = sleep 61.37\n")
    seen = []

    def on_line(line):
        seen.append(line)
        if len(seen) == 1:
            try:
                os.kill(os.getpid(), sig_mod.SIGTERM)
                time.sleep(0.5)  # the handler runs here; its exception is caught below, as a finalizer would drop it
            except KeyboardInterrupt:
                pass

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        ninja_gen.run_ninja(tmp_path / "build.ninja", ["fast", "slow"], 2, on_line)
    assert time.monotonic() - t0 < 30, "ninja was not stopped by the signal"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _procs_mentioning("sleep 61.37"):
        time.sleep(0.1)
    assert not _procs_mentioning("sleep 61.37"), "the hung compile was left running"


# ---- a file that already had the name of one of mlagen's is someone else's; relative and spaced directories

def test_files_named_like_mlagens_stay_untouched(fake_cuda, tmp_path):
    """A user's registry.sqlite, installed.json or ninja log of the same name as mlagen's is never recorded, so neither
    `clean --all` nor `uninstall` deletes it, and a build does not write ninja's log over one (ninja's builddir)."""
    cache, gen = tmp_path / "cache", tmp_path / "generated"
    cache.mkdir()
    gen.mkdir()
    user = {cache / "registry.sqlite": "my data", gen / ".ninja_log": "my log", gen / ".ninja_deps": "my deps"}
    for p, text in user.items():
        p.write_text(text)
    runner = CliRunner()
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    r = runner.invoke(main, ["clean", "--all", "--yes"])
    assert r.exit_code == 0, r.output
    (cache / "registry.sqlite").rename(tmp_path / "registry.mine")  # out of the way for a build
    r = runner.invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    assert (gen / ninja_gen.NINJA_BUILDDIR / ".ninja_log").exists()
    (tmp_path / "registry.mine").rename(tmp_path / "registry.mine.txt")
    installed = cache / "installed.json"
    installed.write_text('{"my": "settings"}')
    r = runner.invoke(main, ["uninstall"])
    assert r.exit_code == 1 and "was not written by mlagen" in _one_error_line(r)
    r = runner.invoke(main, ["clean", "--all", "--yes"])
    assert r.exit_code == 0, r.output
    assert installed.read_text() == '{"my": "settings"}'
    assert (gen / ".ninja_log").read_text() == "my log" and (gen / ".ninja_deps").read_text() == "my deps"
    assert not (gen / ninja_gen.NINJA_BUILDDIR).exists() and not list(cache.rglob("*.so"))
    installed.write_bytes(b"\xff\xfe not text")
    r = runner.invoke(main, ["uninstall"])
    assert r.exit_code == 1 and "was not written by mlagen" in _one_error_line(r) and installed.exists()
    # an installed.json of mlagen's format that no manifest lists (e.g. copied from another machine) may go
    installed.write_text('{"mlagen_version": "0", "arch": "sm_90", "entries": []}')
    r = runner.invoke(main, ["uninstall"])
    assert r.exit_code == 0 and not installed.exists(), r.output


def test_installed_json_is_mlagens_once_install_writes_it_and_not_after_uninstall(fake_cuda, tmp_path):
    """install over an installed.json of mlagen's format that no manifest lists makes it mlagen's (so `clean --all`
    removes it with the modules it names); uninstall forgets the name, so a user's later file of that name is kept."""
    from mlagen.registry import Registry

    cache = tmp_path / "cache"
    cache.mkdir()
    installed = cache / "installed.json"
    installed.write_text('{"mlagen_version": "0", "arch": "sm_90", "entries": []}')  # copied from elsewhere
    runner = CliRunner()
    r = runner.invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    reg = Registry()
    uri = reg.variants()[0]["uri"]
    reg.add_verification(uri=uri, source_hash=reg.get_variant(uri)["source_hash"], device="x", arch="sm_90", cases=1,
                         max_err=0.0, passed=True)
    r = runner.invoke(main, ["install", "--arch", "sm_90", "--uri", uri])
    assert r.exit_code == 0, r.output
    assert owned.is_recorded(installed)
    r = runner.invoke(main, ["clean", "--all", "--yes"])
    assert r.exit_code == 0 and not installed.exists() and not list(cache.rglob("*.so")), r.output
    r = runner.invoke(main, ["build", str(fake_cuda), "--compile-only"])
    reg = Registry()
    reg.add_verification(uri=uri, source_hash=reg.get_variant(uri)["source_hash"], device="x", arch="sm_90", cases=1,
                         max_err=0.0, passed=True)
    r = runner.invoke(main, ["install", "--arch", "sm_90", "--uri", uri])
    assert r.exit_code == 0 and owned.is_recorded(installed), r.output
    r = runner.invoke(main, ["uninstall"])
    assert r.exit_code == 0 and not installed.exists() and not owned.is_recorded(installed), r.output
    installed.write_text('{"my": "settings"}')
    for cmd in (["uninstall"], ["clean", "--all", "--yes"]):
        runner.invoke(main, cmd)
        assert installed.read_text() == '{"my": "settings"}', cmd


def test_relative_and_spaced_cache_and_generated_dirs(fake_cuda, tmp_path, monkeypatch):
    """Relative MLAGEN_CACHE_DIR / MLAGEN_GENERATED_DIR are taken from the current directory and kept absolute (ninja
    runs in the generated directory; the registry's module paths hold from anywhere); spaces in them reach nvcc as one
    word each (the rule's shell quoting)."""
    work = tmp_path / "work dir"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("MLAGEN_CACHE_DIR", "my cache")
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", "gen 7")
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    assert "built 8 variants" in r.output
    from mlagen.registry import Registry

    sos = [Path(row["so_path"]) for row in Registry().variants()]
    assert len(sos) == 8 and all(p.is_absolute() and p.is_relative_to(work / "my cache") for p in sos)
    assert not [p for p in tmp_path.iterdir() if p.name not in ("work dir", "cuda", "fk.yaml")]  # nothing beside
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(work / "my cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(work / "gen 7"))
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0 and "built 8 variants (8 cached)" in r.output, r.output


def test_spec_input_errors_are_one_line(tmp_path):
    """A key given twice (PyYAML would keep the last), nesting past Python's recursion limit, and a file name that
    cannot name a spec: each a one-line error that says which."""
    cases = {"dup.yaml": ("name: d\nheads_per_rank: 8\nq_len: 9\npage_size: 1\nheads_per_rank: 16\n",
                          "key 'heads_per_rank' given twice"),
             "deep.yaml": ("name: deep\nq_len: 9\npage_size: 1\nheads_per_rank: " + "[" * 5000 + "8" + "]" * 5000 + "\n",
                           "nested too deeply"),
             "my spec.yaml": ("heads_per_rank: 8\nq_len: 9\npage_size: 1\n",
                              "no 'name' key: taken from the file name 'my spec.yaml'")}
    for name, (text, want) in cases.items():
        (tmp_path / name).write_text(text)
        r = CliRunner().invoke(main, ["generate", str(tmp_path / name)])
        assert r.exit_code == 1 and want in _one_error_line(r), (name, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cases)
    merged = tmp_path / "merged.yaml"  # a key that overrides a merged one (`<<: *anchor`) is not a duplicate
    merged.write_text("name: m\nheads_per_rank: 8\npage_size: 1\nsweeps:\n  - &s1 {q_len: 9, mask: tree}\n"
                      "  - &s2 {<<: *s1, q_len: 4}\n<<: *s2\n")
    r = CliRunner().invoke(main, ["generate", str(merged)], env={"MLAGEN_GENERATED_DIR": str(tmp_path / "gen"),
                                                                  "MLAGEN_CACHE_DIR": str(tmp_path / "cache")})
    assert r.exit_code == 0 and "2 variants" in r.output, r.output


def test_read_only_commands_write_nothing_on_a_fresh_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "gen"))
    for cmd in (["list"], ["show", "mla_verify_bogus"], ["install", "--arch", "sm_90", "--uri", "mla_verify_bogus"],
                ["status"], ["uninstall"]):
        r = CliRunner().invoke(main, cmd)
        assert "Traceback" not in r.output and (r.exit_code == 0 or _one_error_line(r)), (cmd, r.output)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "afile").write_text("x")  # a cache path below a file: the usual hint, not an empty registry
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "afile" / "sub"))
    for cmd in (["list"], ["show", "mla_verify_bogus"]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 1 and "check MLAGEN_CACHE_DIR" in _one_error_line(r), (cmd, r.output)


def test_cuda_home_without_nvcc_is_one_line(fake_cuda, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-such-toolkit"))
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 1
    assert "CUDA_HOME=" in _one_error_line(r) and "has no bin/nvcc" in r.output


def test_bench_plot_path_is_checked_before_anything_runs(tmp_path):
    """--plot: a name without an image suffix, a missing directory, or an existing file mlagen did not write is a
    one-line error before the GPU check; a PNG that mlagen wrote (its Software text) may be replaced."""
    from mlagen.plot import PNG_SOFTWARE, plot_path_problem, plot_time_vs_context

    mine = tmp_path / "user.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\nnot mlagen's")
    for arg, want in [(tmp_path / "out.txt", "does not end in .png"),
                      (tmp_path / "myplot", "does not end in .png"),
                      (tmp_path / "nodir" / "a.png", "does not exist"),
                      (mine, "exists and is not a plot mlagen wrote")]:
        r = CliRunner().invoke(main, ["bench", "--plot", str(arg)])
        assert r.exit_code == 2 and want in r.output and "Traceback" not in r.output, (arg, r.output)
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\nnot mlagen's"
    ours = tmp_path / "ours.PNG"
    plot_time_vs_context({"a": [(4096, 10.0), (16384, 20.0)]}, str(ours), "t")
    assert plot_path_problem(str(ours)) is None and PNG_SOFTWARE.encode() in ours.read_bytes()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    fig.savefig(tmp_path / "theirs.png")  # matplotlib's own "Software" text: someone else's plot
    plt.close(fig)
    assert "is not a plot mlagen wrote" in plot_path_problem(str(tmp_path / "theirs.png"))


def test_bench_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the `plot` extra not installed: import fails
    r = CliRunner().invoke(main, ["bench", "--plot", str(tmp_path / "a.png")])
    assert r.exit_code == 2 and "needs matplotlib" in r.output and "Traceback" not in r.output, r.output


def test_signal_while_waiting_for_another_builds_lock(fake_cuda, tmp_path):
    """SIGTERM while another process holds a module's lock: the interrupted message and exit 143, as during a compile
    (not click's bare "Aborted!")."""
    _, _, holder = _hold_first_lock(fake_cuda, 60)
    try:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, "build", str(fake_cuda), "--compile-only"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        line = ""
        while "waiting for another build" not in line:
            line = proc.stdout.readline()
            assert line, "the build ended before it waited"
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 143, out
        assert "interrupted (SIGTERM)" in out and "Aborted" not in out and "Traceback" not in out
    finally:
        holder.kill()
        holder.wait()


def test_clean_follows_a_symlinked_cache_root(fake_cuda, tmp_path, monkeypatch):
    """MLAGEN_CACHE_DIR / MLAGEN_GENERATED_DIR as symlinks to another disk: `clean --all` still removes what mlagen
    wrote there, and nothing else."""
    disk = tmp_path / "disk"
    (disk / "cache").mkdir(parents=True)
    (disk / "gen").mkdir()
    (tmp_path / "cache_link").symlink_to(disk / "cache")
    (tmp_path / "gen_link").symlink_to(disk / "gen")
    (disk / "cache" / "notes.txt").write_text("mine")
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache_link"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "gen_link"))
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    assert list((disk / "cache").rglob("*.so"))
    r = CliRunner().invoke(main, ["clean", "--all", "--yes"])
    assert r.exit_code == 0 and "nothing to remove" not in r.output, r.output
    assert not list((disk / "cache").rglob("*.so")) and not list(disk.rglob(owned.MANIFEST))
    assert (disk / "cache" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "cache_link").is_symlink() and (tmp_path / "gen_link").is_symlink()


def _record_names(d: str, names: list[str]) -> None:
    for n in names:
        owned.record(Path(d) / n)


def _record_and_forget(d: str, rounds: int) -> None:
    for _ in range(rounds):
        owned.record(Path(d) / "installed.json")
        owned.forget(Path(d) / "installed.json")


def test_forget_never_drops_a_concurrent_writers_line(tmp_path, monkeypatch):
    """`uninstall` (forget: the manifest rewritten without one name) racing builds that add lines to the same manifest:
    every line another process added survives, so `clean` still finds every file mlagen wrote."""
    import multiprocessing

    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "generated"))
    d = owned.ensure_dir(tmp_path / "cache" / "lib")
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_record_names, args=(str(d), [f"m{w}_{i}.so" for i in range(150)])) for w in range(3)]
    writers.append(ctx.Process(target=_record_and_forget, args=(str(d), 300)))
    for p in writers:
        p.start()
    for p in writers:
        p.join(60)
        assert p.exitcode == 0
    lines = (d / owned.MANIFEST).read_text().splitlines()
    missing = [f"m{w}_{i}.so" for w in range(3) for i in range(150) if f"m{w}_{i}.so" not in lines]
    assert not missing, f"{len(missing)} lines lost, e.g. {missing[:3]}"
    assert "installed.json" not in lines and len(lines) == len(set(lines)) == 450 + 1  # and the "." line


@pytest.mark.parametrize("legacy", ["*{ext}.tmp*", "*{ext}.tmp[0-9]*"])
def test_legacy_tmp_glob_covers_only_interrupted_module_copies(fake_cuda, tmp_path, legacy):
    """lib/ manifests of earlier versions list the interrupted-copy glob "*<ext suffix>.tmp*" (or ".tmp[0-9]*"):
    clean removes an interrupted copy of a module there but not a user's file that the old glob also matched; a
    build now records its copy by name and forgets it once renamed, so no glob is written."""
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    ext = ninja_gen.ext_suffix()
    lib = next(p.parent for p in (tmp_path / "cache").rglob(f"*{ext}"))
    manifest = lib / owned.MANIFEST
    assert not any("tmp" in l for l in manifest.read_text().splitlines()), manifest.read_text()
    manifest.write_text(manifest.read_text() + legacy.format(ext=ext) + "\n")  # as an earlier version wrote it
    stale = lib / f"mod{ext}.tmp4242"
    stale.write_bytes(b"partial")
    mine = [lib / f"notes{ext}.tmp-keep", lib / f"mod{ext}.tmp1-notes"]
    for m in mine:
        m.write_text("mine")
    r = CliRunner().invoke(main, ["clean", "--all", "--yes"])
    assert r.exit_code == 0, r.output
    assert not stale.exists() and all(m.read_text() == "mine" for m in mine)


def test_commands_that_record_nothing_new_never_open_a_manifest_for_writing(fake_cuda, tmp_path, monkeypatch):
    """A cache others built (read-only to this user, or on a read-only mount): list, show, a cached build and
    uninstall with nothing installed work without writing any manifest (simulated: every write-open of a manifest
    fails as on a read-only file system)."""
    import errno

    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    from mlagen.registry import Registry

    uri = Registry().variants()[0]["uri"]
    real_open = os.open

    def read_only_manifests(path, flags, *args, **kwargs):
        if owned.MANIFEST in os.path.basename(os.fspath(path)) and flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    import builtins

    real_builtin_open = builtins.open

    def read_only_manifests_io(file, mode="r", *args, **kwargs):
        if (isinstance(file, (str, os.PathLike)) and owned.MANIFEST in os.path.basename(os.fspath(file))
                and any(c in mode for c in "wax+")):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(file))
        return real_builtin_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_manifests)
    monkeypatch.setattr(builtins, "open", read_only_manifests_io)
    for cmd in (["list"], ["show", uri], ["build", str(fake_cuda), "--compile-only"], ["uninstall"]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 0, (cmd, r.output)


def test_a_manifest_that_is_not_a_regular_file_is_never_written_or_waited_on(tmp_path, monkeypatch):
    """A symlink named .mlagen-manifest (to a user's file) is neither edited by forget nor appended to by record; a
    FIFO of that name does not block a read or a record."""
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "generated"))
    lib = owned.ensure_dir(tmp_path / "cache" / "lib")
    (lib / owned.MANIFEST).unlink()
    notes = tmp_path / "notes.txt"
    notes.write_text("my todo list\ninstalled.json\nbuy milk\n")
    (lib / owned.MANIFEST).symlink_to(notes)
    owned.forget(lib / "installed.json")
    owned.record(lib / "x.so")
    assert notes.read_text() == "my todo list\ninstalled.json\nbuy milk\n"
    assert not owned.is_recorded(lib / "installed.json")
    (lib / owned.MANIFEST).unlink()
    os.mkfifo(lib / owned.MANIFEST)
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("blocked on a FIFO manifest"))
    signal.alarm(10)
    try:
        assert not owned.is_recorded(lib / "x.so")
        owned.record(lib / "x.so")
        owned.forget(lib / "x.so")
        assert owned.plan(tmp_path / "cache") == [] or all(p.name != "x.so" for p in owned.plan(tmp_path / "cache"))
    finally:
        signal.alarm(0)
    assert stat_is_fifo(lib / owned.MANIFEST)


def stat_is_fifo(p: Path) -> bool:
    import stat

    return stat.S_ISFIFO(os.lstat(p).st_mode)


def test_forget_interrupted_before_the_rename_leaves_the_manifest_whole(tmp_path, monkeypatch):
    """forget rewrites through a temporary file: an interruption before the rename leaves the old manifest as it
    was (no half-written line that could name a user's file), and clean removes the temporary file."""
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "generated"))
    cache = owned.ensure_dir(tmp_path / "cache")
    for name in ("registry.sqlite", "locks", "installed.json", "lib"):
        owned.record(cache / name)
    before = (cache / owned.MANIFEST).read_text()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(owned.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        owned.forget(cache / "installed.json")
    monkeypatch.undo()
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "generated"))
    assert (cache / owned.MANIFEST).read_text() == before
    leftovers = [p for p in cache.iterdir() if p.name.startswith(owned.MANIFEST + ".")]
    assert leftovers
    (cache / "mine.txt").write_text("mine")
    owned.clean(cache)
    assert not any(p.exists() for p in leftovers) and (cache / "mine.txt").read_text() == "mine"


def test_clean_keeps_the_manifest_of_a_file_recorded_after_its_plan(tmp_path, monkeypatch):
    """A build records and writes a module while `clean` runs (after clean made its plan): the manifest that lists it
    stays, so a later clean still removes it."""
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "generated"))
    lib = owned.ensure_dir(tmp_path / "cache" / "lib")
    owned.record(lib / "old.so").write_text("x")
    (lib / "users_notes.txt").write_text("mine")
    planned = owned.plan(tmp_path / "cache")
    owned.record(lib / "new.so").write_text("built")  # the concurrent build
    owned.remove(planned)
    assert not (lib / "old.so").exists() and (lib / "new.so").exists() and owned.is_recorded(lib / "new.so")
    owned.clean(tmp_path / "cache")
    assert not (lib / "new.so").exists() and (lib / "users_notes.txt").read_text() == "mine"


def test_a_fork_while_a_manifest_lock_is_held_does_not_keep_it(tmp_path):
    """A library user forks (without exec) while another thread records: the child does not keep the directory
    lock, so the parent's release frees it."""
    import fcntl

    d = tmp_path / "d"
    d.mkdir()
    with owned._dir_locked(d, exclusive=True):
        pid = os.fork()
        if pid == 0:
            time.sleep(5)
            os._exit(0)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + 2.0  # (the child closes its copy right after the fork; it then sleeps 5 s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # still held by the child
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
    finally:
        os.close(fd)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_registry_damage_and_a_held_lock_are_one_line_errors(fake_cuda, tmp_path, monkeypatch):
    """A registry row that is not JSON, a file that is not SQLite, and another process holding the write lock past
    the wait: each a one-line error naming the registry, for list, show and install."""
    import sqlite3

    from mlagen import registry as registry_mod
    from mlagen.registry import Registry

    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    reg = Registry()
    uri = reg.variants()[0]["uri"]
    with sqlite3.connect(reg.path) as c:
        c.execute("UPDATE variants SET variant_json='{not json' WHERE uri=?", (uri,))
    for cmd in (["list"], ["show", uri], ["install", "--arch", "sm_90", "--uri", uri]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 1 and "damaged row" in _one_error_line(r) and str(reg.path) in r.output, (cmd, r.output)
    monkeypatch.setattr(registry_mod, "_LOCK_WAIT_S", 0.2)
    holder = sqlite3.connect(reg.path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        r = CliRunner().invoke(main, ["list"])
        assert r.exit_code == 1 and "held the registry's write lock" in _one_error_line(r), r.output
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    reg.path.write_bytes(b"not a database at all" * 100)
    r = CliRunner().invoke(main, ["list"])
    assert r.exit_code == 1 and "not a usable mlagen registry" in _one_error_line(r), r.output


def test_list_shows_this_builds_verifications_per_arch_and_its_best_time(fake_cuda, tmp_path):
    """`mlagen list` after a rebuild from new sources: the old build's benchmark no longer shows as the best time;
    verifications of the current build show per arch."""
    from mlagen.registry import Registry

    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 0, r.output
    reg = Registry()
    row = reg.variants()[0]
    uri, src = row["uri"], row["source_hash"]
    shape = dict(heads=8, q_len=9, batch_size=1, context=4096, page_size=1)
    reg.add_benchmark(uri=uri, source_hash="older-build", device="H200", arch="sm_90", shape=shape, median_us=12.5,
                      gbs=1.0, frac_copy_bw=0.1)
    reg.add_benchmark(uri=uri, source_hash=src, device="H200", arch="sm_90", shape=shape, median_us=20.25, gbs=1.0,
                      frac_copy_bw=0.1)
    for arch, ok in (("sm_90", True), ("sm_120", False)):
        reg.add_verification(uri=uri, source_hash=src, device="x", arch=arch, cases=9, max_err=0.0, passed=ok)
    r = CliRunner().invoke(main, ["list", "--format", "tsv", "--kernels", uri])
    line = next(l for l in r.output.splitlines() if l.startswith(uri))
    verdicts = {"sm_90": "pass (sm_90)", "sm_120": "FAIL (sm_120)"}
    assert line.split("\t")[2:] == [", ".join(verdicts[a] for a in row["archs"]), "20.2"], line


def test_installed_json_that_is_a_fifo_or_nested_too_deeply_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    installed = tmp_path / "cache" / "installed.json"
    os.mkfifo(installed)
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("blocked on a FIFO installed.json"))
    signal.alarm(10)
    try:
        for cmd in (["status"], ["uninstall"], ["install", "--arch", "sm_90", "--uri", "mla_verify_x"]):
            r = CliRunner().invoke(main, cmd)
            assert r.exit_code == 1 and "Traceback" not in r.output, (cmd, r.output)
        assert "not a regular file" in _one_error_line(CliRunner().invoke(main, ["status"]))
    finally:
        signal.alarm(0)
    installed.unlink()
    installed.write_text("[" * 100000 + "]" * 100000)
    r = CliRunner().invoke(main, ["status"])
    assert r.exit_code == 1 and "nested too deeply" in _one_error_line(r), r.output
    r = CliRunner().invoke(main, ["uninstall"])  # not mlagen's (unrecorded, not of its format): left in place
    assert r.exit_code == 1 and "left in place" in _one_error_line(r) and installed.exists(), r.output


def test_generated_file_that_is_not_utf8_is_rewritten(fake_cuda, tmp_path):
    r = CliRunner().invoke(main, ["generate", str(fake_cuda)])
    assert r.exit_code == 0, r.output
    src = next((tmp_path / "generated").rglob("*.cu"))
    src.write_bytes(b"\xff\xfe stale bytes")
    r = CliRunner().invoke(main, ["generate", str(fake_cuda)])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert src.read_bytes().startswith(b"// stand-in source of ")


def test_a_source_rewritten_during_the_build_is_not_registered(fake_cuda, tmp_path, monkeypatch):
    """Another build of the same module from other sources rewrote the .cu after this build generated it: this
    build's registration refuses the module (its hash would not describe what nvcc compiled)."""
    from mlagen import build as build_mod

    real_register = build_mod._register

    def rewritten_first(spec, j, secs, reg):
        Path(j.outputs["source"]).write_text("// another build's source\n")
        return real_register(spec, j, secs, reg)

    monkeypatch.setattr(build_mod, "_register", rewritten_first)
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
    assert r.exit_code == 1 and "generated source or build.ninja changed during the build" in r.output, r.output
    from mlagen.registry import Registry

    assert Registry(create=False).variants() == []


def test_each_module_records_its_own_compile_time_from_ninjas_log(fake_cuda, tmp_path, monkeypatch):
    """build_seconds of a variant is its module's compile time as ninja logged it (end - start of its edge), not the
    build's wall time shared out over the modules."""
    from mlagen import ninja_gen
    from mlagen.registry import Registry

    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.3")
    r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only", "--jobs", "4"])
    assert r.exit_code == 0, r.output
    log = tmp_path / "generated" / ninja_gen.NINJA_BUILDDIR / ".ninja_log"
    edges = {}
    for line in log.read_text().splitlines()[1:]:
        start, end, _mtime, out = line.split("\t")[:4]
        edges[out] = (int(end) - int(start)) / 1000.0
    rows = Registry(create=False).variants()
    assert rows
    for row in rows:
        assert row["build_seconds"] == pytest.approx(edges[_ninja_output_of(row)], abs=1e-9)
        assert row["build_seconds"] >= 0.3


def _ninja_output_of(row) -> str:
    """ninja's output path (the module in the generated directory) of a registry row."""
    from mlagen import ninja_gen
    from mlagen.spec import Variant

    return str(ninja_gen.variant_outputs(Variant.from_dict(row["variant"]))["so"])


def test_logged_build_seconds_reads_the_latest_line_of_each_target(tmp_path, monkeypatch):
    from mlagen import ninja_gen

    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path))
    d = tmp_path / ninja_gen.NINJA_BUILDDIR
    d.mkdir()
    (d / ".ninja_log").write_text("# ninja log v7\n0\t1500\t1\t/g/a.so\tff\n10\t20\t1\t/g/b.so\tff\ngarbage line\n"
                                  "5\tx\t1\t/g/a.so\tff\n100\t2600\t1\t/g/a.so\tff\n")
    assert ninja_gen.logged_build_seconds(["/g/a.so", "/g/c.so"]) == {"/g/a.so": 2.5}
    assert ninja_gen.logged_build_seconds(["/g/sub/../b.so"]) == {"/g/sub/../b.so": 0.01}  # ninja logs it normalised
    (d / ".ninja_log").unlink()
    assert ninja_gen.logged_build_seconds(["/g/a.so"]) == {}


def test_a_cache_reached_through_a_symlink_is_still_a_cache_hit(fake_cuda, tmp_path, monkeypatch):
    """The registry's .so paths are spelled as the first build spelled them: a later build through another spelling of
    the same directories (a symlinked home, say) reuses the modules."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    for base, want in ((real, "(0 cached)"), (tmp_path / "link", "(8 cached)"), (real, "(8 cached)")):
        monkeypatch.setenv("MLAGEN_CACHE_DIR", str(base / "cache"))
        monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(base / "generated"))
        r = CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"])
        assert r.exit_code == 0 and want in r.output, (base, r.output)


def test_clean_leaves_a_lock_a_build_holds(fake_cuda, tmp_path):
    """`mlagen clean` deletes a build's lock file only while no build holds it: a later build would otherwise lock a
    new file of that name while the running one still compiles."""
    from mlagen.build import _generated_lock
    from mlagen.ninja_gen import variant_outputs
    from mlagen.spec import load_spec

    assert CliRunner().invoke(main, ["build", str(fake_cuda), "--compile-only"]).exit_code == 0
    lock_path = _generated_lock(variant_outputs(load_spec(fake_cuda).variants()[0]))
    holder = _hold_lock(lock_path, 30)
    try:
        r = CliRunner().invoke(main, ["clean", "--yes"])
        assert r.exit_code == 0 and lock_path.exists(), r.output
    finally:
        holder.kill()
        holder.wait()
    r = CliRunner().invoke(main, ["clean", "--yes"])
    assert r.exit_code == 0 and not lock_path.exists(), r.output
