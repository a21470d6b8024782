"""build.ninja generation: one file per variant (nvcc for every arch of the spec, -lineinfo,
ptxas -v captured to a log, depfile for header tracking, PTX kept for the instruction scan)
and one top-level file that includes many variants so ninja builds them in parallel.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

from mlagen import paths
from mlagen.spec import Variant
from mlagen.tables import ARCHS


class ToolchainError(RuntimeError):
    """nvcc or ninja is missing or unusable."""


# Oldest CUDA toolkit (nvcc release) that compiles mlagen for each arch.
MIN_NVCC = {"sm_120": (13, 0), "sm_90": (12, 0)}


def nvcc_path() -> str:
    """nvcc from $CUDA_HOME/bin (or $CUDA_PATH/bin) when set, else from PATH.

    Raises:
        ToolchainError: CUDA_HOME / CUDA_PATH is set but has no bin/nvcc (a typo would otherwise build with another
            toolkit without a word), or nvcc is not on PATH.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        cuda_home = paths.env(var)
        if cuda_home:
            nvcc = Path(cuda_home).expanduser() / "bin" / "nvcc"
            if not nvcc.is_file():
                raise ToolchainError(f"{var}={cuda_home} has no bin/nvcc: point it at a CUDA toolkit (13.x) or unset it")
            return str(nvcc)
    found = shutil.which("nvcc")
    if not found:
        raise ToolchainError("nvcc not found: install the CUDA toolkit (13.x) or set CUDA_HOME")
    return found


def ninja_path() -> str:
    """ninja from the `ninja` Python package or PATH. Raises ToolchainError when absent."""
    try:
        import ninja  # type: ignore

        p = Path(ninja.BIN_DIR) / "ninja"
        if p.exists():
            return str(p)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise ToolchainError("ninja not found: pip install ninja")
    return found


@functools.lru_cache(maxsize=None)
def _nvcc_version_text(nvcc: str) -> str:
    try:
        r = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"{nvcc} --version failed: {e}") from None
    if r.returncode != 0 or not r.stdout.strip():
        raise ToolchainError(f"{nvcc} --version failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[:200]}")
    return r.stdout.strip()


def nvcc_version() -> str:
    """The release line of ``nvcc --version`` (e.g. 'Build cuda_13.0.r13.0/compiler.36424714_0'); the output is
    cached per nvcc path.

    Raises:
        ToolchainError: nvcc not found (:func:`nvcc_path`), or ``nvcc --version`` failed.
    """
    return _nvcc_version_text(nvcc_path()).splitlines()[-1]


NVCC_ENV_VARS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")  # read by nvcc itself (CUDA docs, "NVCC
# environment variables"): they change what a build produces without changing its command line


def toolchain_key() -> str:
    """What identifies the compiler of a build, for the cache key (:func:`mlagen.codegen.source_hash`): nvcc's release
    line and the nvcc environment variables that are set (an empty or blank value counts as unset), so a build made
    with ``NVCC_APPEND_FLAGS='-Xptxas -O1'`` is not reused without it.

    Raises:
        ToolchainError: as :func:`nvcc_version`.
    """
    env = "".join(f"\0{k}={os.environ[k]}" for k in NVCC_ENV_VARS if os.environ.get(k, "").strip())  # empty: unset
    return nvcc_version() + env


def nvcc_release() -> tuple[int, int]:
    """(major, minor) of the CUDA release nvcc reports ('release 13.0' -> (13, 0)).

    Raises:
        ToolchainError: nvcc not found, ``nvcc --version`` failed, or its output names no release.
    """
    text = _nvcc_version_text(nvcc_path())
    m = re.search(r"release (\d+)\.(\d+)", text)
    if not m:
        raise ToolchainError(f"cannot read the CUDA release from `{nvcc_path()} --version`: {text.splitlines()[-1][:200]!r}")
    return int(m.group(1)), int(m.group(2))


def check_nvcc(archs) -> None:
    """One up-front check that nvcc exists and is new enough for every arch in ``archs``.

    Raises:
        ToolchainError: nvcc missing, unusable, or older than :data:`MIN_NVCC` for an arch.
    """
    rel = nvcc_release()
    old = [a for a in dict.fromkeys(archs) if rel < MIN_NVCC.get(a, (0, 0))]
    if old:
        need = max(MIN_NVCC[a] for a in old)
        raise ToolchainError(
            f"nvcc {rel[0]}.{rel[1]} ({nvcc_path()}) is too old for {', '.join(old)}: mlagen needs CUDA "
            f"{need[0]}.{need[1]} or newer; install it and put its bin/ on PATH or set CUDA_HOME")


def python_includes() -> list[str]:
    """nvcc ``-I`` flags of pybind11's headers and the running Python's headers (duplicates dropped).

    Raises:
        ImportError: pybind11 is not installed.
    """
    import pybind11

    incs = [pybind11.get_include(), sysconfig.get_paths()["include"]]
    return [f"-I{p}" for p in dict.fromkeys(incs)]


def ext_suffix() -> str:
    """File suffix of an extension module for the running Python (e.g. ``.cpython-311-x86_64-linux-gnu.so``);
    ``.so`` when sysconfig has none."""
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def nvcc_flags(v: Variant) -> list[str]:
    """Every nvcc flag of a variant's build (part of its cache hash)."""
    flags = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", "-Xptxas", "-v",
             "--expt-relaxed-constexpr", f"-I{paths.INCLUDE_DIR}"]
    flags += python_includes()
    for a in v.archs:
        flags += ["-gencode", ARCHS[a][0]]
    return flags


def diagnostic_module_name(build_key: str, defines: list[tuple[str, object]] | tuple) -> str:
    """The module name of a diagnostic build of ``build_key`` with ``#define NAME VALUE`` for each (NAME, VALUE) of
    ``defines``: ``<build_key>_<name>_<value>...`` (lower case), or, where that would exceed 160 characters or not be
    an identifier (a value of -1), ``<build_key>_d<12 hex digits of the defines' SHA-1>``: nvcc's temporary files
    add ~70 characters to the module name, and nvlink fails on a file name over 255 bytes ("Could not open output
    file")."""
    import hashlib

    name = build_key + "".join(f"_{n.lower()}_{val}" for n, val in defines)
    if len(name) <= 160 and name.isidentifier():  # (a value such as -1 is not part of an identifier: hashed)
        return name
    digest = hashlib.sha1(" ".join(f"{n}={val}" for n, val in defines).encode()).hexdigest()[:12]
    return f"{build_key}_d{digest}"


def compile_diagnostic(v: Variant, source: str, module: str, out_dir: Path) -> Path:
    """Compile a diagnostic build of ``v`` (tools/device_ablate.py, tools/device_ab_define.py): ``source`` (the
    rendered module, with its ``#define`` lines ahead) as ``out_dir/<module>.cu`` into ``out_dir/<module><ext>``.
    nvcc runs only when the module is missing or its build key changed: the key is the registry's
    (:func:`mlagen.codegen.source_hash`: the source, every kernel header, the nvcc flags and nvcc's version), kept
    in ``<module>.key`` beside it. So a second run of the same builds (e.g. after a parallel ``--build-only`` pass)
    compiles nothing, and an edited header or another arch rebuilds. One process at a time builds a module
    (``<module>.lock``); nvcc writes a temporary file of its own that replaces the module when it succeeds, and the
    key is written after it, so an interrupted compile leaves no module that looks built.

    Returns:
        The path of the compiled module.
    Raises:
        RuntimeError: nvcc failed (the tail of its output in the message); no module is left.
    """
    import tempfile

    from filelock import FileLock

    from mlagen.codegen import source_hash, write_if_changed  # (codegen does not import this module: no cycle)

    flags = nvcc_flags(v)
    src, so = out_dir / f"{module}.cu", out_dir / f"{module}{ext_suffix()}"
    stamp = out_dir / f"{module}.key"
    key = source_hash(source, flags, toolchain_key())
    with FileLock(str(out_dir / f"{module}.lock")):
        if so.exists() and stamp.exists() and stamp.read_text() == key and src.exists() and src.read_text() == source:
            return so
        so.unlink(missing_ok=True)
        stamp.unlink(missing_ok=True)
        write_if_changed(src, source)
        fd, tmp_name = tempfile.mkstemp(dir=out_dir, prefix=f"{module}.", suffix=f".partial{ext_suffix()}")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            r = subprocess.run([nvcc_path(), *flags, str(src), "-o", str(tmp)], capture_output=True, text=True)
            if r.returncode != 0 or not tmp.stat().st_size:
                raise RuntimeError(f"nvcc failed for {module}:\n{(r.stderr or r.stdout)[-3000:]}")
            os.replace(tmp, so)
        finally:
            tmp.unlink(missing_ok=True)
        stamp.write_text(key)
    return so


def _q(s: str) -> str:
    """Escape for ninja ($, space, colon)."""
    return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _sq(s: str) -> str:
    """A value the rule's shell command uses as one word: shell-quoted (unchanged when it has no character the shell
    treats specially, so the usual paths give the same command), then escaped for ninja. ($in and $out need no
    quoting: ninja shell-escapes them itself.)"""
    return _q(shlex.quote(s))


NINJA_BUILDDIR = ".mlagen-ninja"  # ninja's .ninja_log / .ninja_deps go here (its `builddir`), not next to a user's


def variant_outputs(v: Variant) -> dict[str, Path]:
    """Paths of a variant's build, all under :func:`mlagen.paths.variant_dir` of its build key: ``dir``,
    ``source`` (<build_key>.cu), ``so`` (<build_key><ext suffix>, ninja's output before installation), ``log``
    (nvcc.log: ptxas -v), ``keep`` (nvcc -keep intermediates, PTX included) and ``ninja`` (build.ninja)."""
    d = paths.variant_dir(v.build_key)
    return dict(dir=d, source=d / f"{v.build_key}.cu", so=d / f"{v.build_key}{ext_suffix()}", log=d / "nvcc.log",
                keep=d / "keep", ninja=d / "build.ninja")


def variant_ninja(v: Variant, build_id: str = "") -> str:
    """Text of the per-variant build.ninja (absolute paths). ``build_id`` (the source hash) is part
    of the command line, so ninja rebuilds whenever the cache key changes (e.g. a new nvcc). Of nvcc's ``-keep``
    intermediates (~45 MB per module at two archs) a successful compile keeps only the PTX (checked by
    :func:`mlagen.build.check_build`) and the cubins (for cuobjdump): ~3 MB. Only files named ``<build_key>.*``
    in the module's own ``keep/`` directory are deleted, the names mlagen records there (mlagen.owned)."""
    o = variant_outputs(v)
    flags = " ".join(_sq(f) for f in nvcc_flags(v)) + (f" -DMLAGEN_BUILD_ID={build_id[:16]}" if build_id else "")
    return f"""# generated by mlagen for {v.build_key}
ninja_required_version = 1.3
rule nvcc_module
  command = mkdir -p $keep && $nvcc $flags -MD -MF $out.d -keep -keep-dir $keep $in -o $out > $log 2>&1 || {{ cat $log; rm -f $out; exit 1; }}; find $keep -maxdepth 1 -type f -name $keep_names ! -name '*.ptx' ! -name '*.cubin' -delete 2>/dev/null; true
  depfile = $out.d
  deps = gcc
  description = nvcc {v.build_key}
build {_q(str(o['so']))}: nvcc_module {_q(str(o['source']))}
  nvcc = {_sq(nvcc_path())}
  flags = {flags}
  log = {_sq(str(o['log']))}
  keep = {_sq(str(o['keep']))}
  keep_names = {_sq(v.build_key + '.*')}
"""


def top_ninja(variants: list[Variant]) -> str:
    """Top-level build.ninja including each variant's file (subninja keeps their rules scoped); ninja's own log
    files go to :data:`NINJA_BUILDDIR` in the generated directory (``builddir``)."""
    lines = ["# generated by mlagen: builds many variants in parallel", "ninja_required_version = 1.3",
             f"builddir = {_q(str(paths.generated_dir() / NINJA_BUILDDIR))}"]
    for v in variants:
        lines.append(f"subninja {_q(str(variant_outputs(v)['ninja']))}")
    return "\n".join(lines) + "\n"


def default_jobs() -> int:
    """MAX_JOBS from the environment (unset or empty: not set), else the CPU count.

    Raises:
        ToolchainError: MAX_JOBS is not a positive integer.
    """
    env = paths.env("MAX_JOBS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ToolchainError(f"MAX_JOBS must be a positive integer, got {env!r}")
        return int(env)
    return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def sigterm_as_interrupt(on_signal=None):
    """Within the block, SIGINT, SIGTERM, SIGHUP and SIGQUIT raise KeyboardInterrupt (its text the signal's name), so
    every ``finally`` / ``except BaseException`` that stops the compile tree runs (main thread only).
    ``on_signal(name)`` runs first: Python drops an exception raised by a signal handler that happens to run
    inside a finalizer (``Exception ignored in ...``), so whoever must stop on the signal should not rely on
    the exception alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        if on_signal is not None:
            on_signal(name)
        raise KeyboardInterrupt(name)

    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _die_with_parent(parent_pid: int):
    """A ``preexec_fn`` for ninja (Linux): SIGTERM to it when the process that started it dies, however it dies
    (SIGKILL, a crash: no handler of ours runs then), prctl(2) PR_SET_PDEATHSIG; ninja then stops its compiles as on
    any SIGTERM. If that process is already gone when the child starts, the child ends at once."""

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: no dlopen in the forked child
    except (OSError, AttributeError):
        return None
    sigterm = int(signal.SIGTERM)

    def pre_exec() -> None:
        prctl(1, sigterm, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sigterm)

    return pre_exec


def _session_members(sid: int) -> list[int]:
    """Pids of the live processes in session ``sid`` (Linux /proc; empty elsewhere)."""
    pids = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(d.name))
    return pids


def stop_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop ninja and every compiler under it. ninja was started as a session leader; SIGTERM lets it
    stop its commands (each in a process group of its own) and delete their partial outputs; whatever
    of the session is still alive after ``grace`` seconds is killed."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    for pid in _session_members(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_ninja(build_file: Path, targets: list[str], jobs: int, on_line=None) -> tuple[int, str]:
    """Run ninja on ``targets`` with -k 0 (keep going). Streams stdout lines to ``on_line``.

    ninja runs in a session of its own; an interrupt (SIGINT, SIGTERM, SIGHUP, SIGQUIT) or an error in this
    process stops it and every nvcc under it (:func:`stop_tree`) before the exception propagates.

    Returns (exit code, full output).
    """
    cmd = [ninja_path(), "-f", str(build_file), "-j", str(jobs), "-k", "0", *targets]
    env = dict(os.environ, NINJA_STATUS="[%f/%t] ")
    out = []
    signals: list[str] = []  # received during the compile
    ninja: list[subprocess.Popen] = []

    def on_signal(name: str) -> None:
        # ninja stops now even if the KeyboardInterrupt is lost; the loop then ends and raises below
        signals.append(name)
        if ninja:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(ninja[0].pid, signal.SIGTERM)

    with sigterm_as_interrupt(on_signal):
        # PR_SET_PDEATHSIG belongs to the thread that forks: only from the main thread, which outlives the compile
        pdeath = (_die_with_parent(os.getpid()) if sys.platform.startswith("linux")
                  and threading.current_thread() is threading.main_thread() else None)

        def start(pre_exec):
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    cwd=str(build_file.parent), start_new_session=True, preexec_fn=pre_exec)

        try:
            proc = start(pdeath)
        except RuntimeError:  # preexec_fn is refused in a subinterpreter: start ninja without it
            if pdeath is None:
                raise
            proc = start(None)
        ninja.append(proc)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.append(line)
                if on_line:
                    on_line(line)
            rc = proc.wait()
            if signals:
                raise KeyboardInterrupt(signals[0])
        except BaseException:
            stop_tree(proc)
            raise
        finally:
            if proc.stdout:
                proc.stdout.close()
    return rc, "".join(out)


def logged_build_seconds(targets: list[str]) -> dict[str, float]:
    """Seconds each of ``targets`` took in its latest build, from ninja's log in the generated directory's builddir
    (``.ninja_log``, formats v5-v7: a line per finished edge with its start and end in ms, then its output; a
    target's last line is its latest build). A target the log does not name (or an unreadable log) is left out.
    """
    log = paths.generated_dir() / NINJA_BUILDDIR / ".ninja_log"
    want, found = {os.path.normpath(t): t for t in targets}, {}  # ninja logs paths normalised (no "..")
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines[1:]:
        f = line.split("\t")
        if len(f) >= 4 and f[3] in want and f[0].isdigit() and f[1].isdigit():
            found[want[f[3]]] = (int(f[1]) - int(f[0])) / 1000.0
    return found


def target_up_to_date(build_file: Path, target: str) -> bool:
    """True when ninja has nothing left to do for ``target`` (it built, or was already built)."""
    r = subprocess.run([ninja_path(), "-f", str(build_file), "-n", target], capture_output=True, text=True,
                       cwd=str(build_file.parent))
    return r.returncode == 0 and "no work to do" in r.stdout


