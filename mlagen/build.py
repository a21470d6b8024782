"""Building variants (:func:`build`, :func:`build_variants`): render, write, ninja-build, check resources,
install the .so atomically and register it. A file lock per variant makes concurrent processes build a variant once; the
registry is checked again after the lock is taken (FlashInfer ``jit/core.py`` pattern).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from mlagen import codegen, feasibility, ninja_gen, owned, paths, ptxas
from mlagen.registry import Registry
from mlagen.spec import Spec, Variant, filter_by_glob, load_spec, parse_spec
from mlagen.tables import SMEM_LIMIT


class BuildError(RuntimeError):
    """One or more variants failed to compile or failed the resource / instruction checks."""


@dataclasses.dataclass
class BuiltVariant:
    """A variant whose .so is built, checked and registered."""

    variant: Variant
    so_path: Path
    source_hash: str
    build_seconds: float
    resources: dict  # per arch: registers, smem (static + dynamic), stack, spills
    cached: bool

    @property
    def uri(self) -> str:
        """The variant's uri (:attr:`mlagen.spec.Variant.uri`)."""
        return self.variant.uri


@dataclasses.dataclass
class BuildReport:
    """What :func:`build` did: ``built`` (compiled or reused from the registry, in spec order), ``failed``
    ((variant, compiler / check error excerpt), nothing registered), ``infeasible`` ((variant, reason), never
    compiled) and the wall time in ``seconds``."""

    built: list[BuiltVariant]
    failed: list[tuple[Variant, str]]
    infeasible: list[tuple[Variant, str]]
    seconds: float


@dataclasses.dataclass
class _Job:
    """One compiled module (build key) and the variants it serves (they differ only in nsplit)."""

    variants: list[Variant]
    source: str
    source_hash: str
    outputs: dict

    @property
    def key(self) -> str:
        return self.variants[0].build_key


def generate(variants: list[Variant], write: bool = True) -> list[_Job]:
    """Render sources and build.ninja files; one job per build key. ``write``: write them now (only where they
    changed), each under its module's generated-directory lock, as ``mlagen generate`` does; :func:`build` passes
    False and writes a module's files only once it holds that lock, so a build that shares the generated directory
    (another checkout, another nvcc environment) never rewrites them under a running compile.

    Raises:
        ninja_gen.ToolchainError: nvcc missing, or too old for an arch of ``variants`` (checked once,
            before anything is written).
        owned.NotOwnedError: a file of a name a module's build writes exists and mlagen did not write it.
    """
    ninja_gen.check_nvcc([a for v in variants for a in v.archs])
    toolchain = ninja_gen.toolchain_key()  # nvcc's release and NVCC_* environment: part of the cache key
    first = {}
    for v in variants:
        first.setdefault(v.build_key, v)
    for v in first.values():  # a user's file where a module's output goes: refused before anything is written
        owned.refuse_foreign(_written_files(ninja_gen.variant_outputs(v)),
                             "move it away, or set MLAGEN_GENERATED_DIR to another directory")
    by_key: dict[str, _Job] = {}
    for v in variants:
        if v.build_key in by_key:
            by_key[v.build_key].variants.append(v)
            continue
        src = codegen.render_variant(v)
        h = codegen.source_hash(src, ninja_gen.nvcc_flags(v), toolchain)
        o = ninja_gen.variant_outputs(v)
        _record_outputs(v, o)
        job = _Job([v], src, h, o)
        if write:
            with FileLock(str(_generated_lock(o))):
                _write_sources(job)
        by_key[v.build_key] = job
    return list(by_key.values())


def _written_files(o: dict) -> list[Path]:
    """The files of a module's build directory that mlagen writes (ninja_gen.variant_outputs ``o``): the source, its
    build.ninja, ninja's output, nvcc's log and depfile, and the lock of builds sharing this generated directory."""
    return [Path(o[k]) for k in ("source", "ninja", "so", "log")] + [Path(str(o["so"]) + ".d"), _generated_lock(o)]


def _generated_lock(o: dict) -> Path:
    """Lock of a module's build directory: builds with different caches may share one generated directory."""
    return Path(o["dir"]) / "build.lock"


def _record_outputs(v: Variant, o: dict) -> None:
    """Record in the manifests (:mod:`mlagen.owned`) every file a variant's build writes, so that
    `mlagen clean` removes exactly these."""
    owned.ensure_dir(o["dir"])
    for p in _written_files(o):
        owned.record(p)
    owned.ensure_dir(o["keep"])
    owned.record_glob(o["keep"], f"{v.build_key}.*")  # nvcc -keep intermediates


def _write_sources(job: _Job) -> None:
    """Write the job's source and build.ninja (only where they differ); the caller holds the module's generated-directory
    lock (:func:`_generated_lock`), as every writer of these files does."""
    codegen.write_if_changed(job.outputs["source"], job.source)
    codegen.write_if_changed(job.outputs["ninja"], ninja_gen.variant_ninja(job.variants[0], job.source_hash))


def check_build(v: Variant, outputs: dict) -> tuple[dict, str | None]:
    """Resources per arch from the ptxas log plus the PTX instruction scan.

    Returns (resources, failure reason or None). Fails on spills, smem over the arch limit, or
    wgmma / tcgen05 / setmaxnreg in the PTX.
    """
    log = Path(outputs["log"]).read_text() if Path(outputs["log"]).exists() else ""
    summary = ptxas.summarize(ptxas.parse_ptxas(log))
    dyn = feasibility.resources(v).smem_bytes
    res = {}
    for arch in v.archs:
        s = summary.get(arch)
        if s is None:
            return {}, f"no ptxas report for {arch} in {outputs['log']}"
        s = dict(s, smem_dynamic=dyn, smem=ptxas.block_smem(s, dyn))
        res[arch] = s
        if s["spill_stores"] or s["spill_loads"] or s["stack"]:
            return res, f"{arch}: {s['spill_stores']} B spill stores, {s['spill_loads']} B spill loads, {s['stack']} B stack"
        if s["smem"] > SMEM_LIMIT[arch]:
            return res, f"{arch}: {s['smem']} B shared memory > {SMEM_LIMIT[arch]} B"
    ptx_files = sorted(Path(outputs["keep"]).glob("*.ptx"))
    if len(ptx_files) < len(v.archs):
        return res, f"expected PTX for {len(v.archs)} archs in {outputs['keep']}, found {len(ptx_files)}"
    for name, bad in ptxas.scan_ptx_files(ptx_files).items():
        if bad:
            return res, f"{name} contains forbidden instructions: {', '.join(bad)}"
    res["ptx_files"] = [p.name for p in ptx_files]
    return res, None


def build_with_defines(v: Variant, defines, out_dir: Path) -> tuple[str, Path]:
    """A diagnostic build of ``v``: (module name, .so path) of its rendered source with ``#define NAME VALUE`` ahead
    for each (NAME, VALUE) of ``defines``, compiled into ``out_dir`` (never the registry), named by
    :func:`mlagen.ninja_gen.diagnostic_module_name`; nothing is recompiled while its build key is unchanged
    (:func:`mlagen.ninja_gen.compile_diagnostic`, which raises RuntimeError with nvcc's output on a failed compile).
    Used by tools/device_ab_define.py (and the tools built on it) and the GPU tests of diagnostic builds."""
    mod = ninja_gen.diagnostic_module_name(v.build_key, defines)
    src = "".join(f"#define {name} {value}\n" for name, value in defines) + codegen.render_variant(v, mod)
    return mod, ninja_gen.compile_diagnostic(v, src, mod, out_dir)


def _installed_so(key: str, source_hash: str) -> Path:
    return paths.so_dir() / f"{key}.{source_hash[:16]}{ninja_gen.ext_suffix()}"


def _registered(reg: Registry, job: _Job, spec_name: str) -> list[BuiltVariant] | None:
    """The job's variants from the registry when its module is registered from this source hash and its .so exists,
    else None. A variant not registered yet (another NSPLIT of a module some spec built) is registered with the
    module's row (its .so, resources and build time) under ``spec_name``: NSPLIT is a launch argument, nothing
    compiles."""
    def usable(row) -> bool:
        return bool(row) and row["source_hash"] == job.source_hash and Path(row["so_path"]).exists()

    rows = [reg.get_variant(v.uri) for v in job.variants]
    sib = next((r for r in rows if usable(r)), None) or next(
        (r for r in reg.module_variants(job.source_hash) if usable(r)), None)
    if sib is None:
        return None
    out = []
    for v, row in zip(job.variants, rows):
        if not usable(row):
            _put_variant(reg, spec_name, v, job.source_hash, sib["nvcc_version"], sib["so_path"],
                         sib["build_seconds"] or 0.0, sib["resources"])
            row = sib
        out.append(BuiltVariant(v, Path(row["so_path"]), job.source_hash, row["build_seconds"] or 0.0,
                                row["resources"], cached=True))
    return out


def _put_variant(reg: Registry, spec_name: str, v: Variant, source_hash: str, nvcc_version: str, so_path: str,
                 secs: float, resources: dict) -> None:
    """Register variant ``v`` as built into the module at ``so_path`` (compiled, or an NSPLIT sibling's)."""
    reg.put_variant(uri=v.uri, spec=spec_name, variant=v.to_dict(), bucket=v.bucket, source_hash=source_hash,
                    nvcc_version=nvcc_version, archs=list(v.archs), so_path=so_path, build_seconds=secs,
                    resources=resources)


def _split_registered(reg: Registry, jobs: list[_Job], spec_name: str) -> tuple[list[BuiltVariant], list[_Job]]:
    """(variants whose module is installed from the same source hash, jobs still to build)."""
    built, todo = [], []
    for j in jobs:
        hit = _registered(reg, j, spec_name)
        if hit:
            built += hit
        else:
            todo.append(j)
    return built, todo


@dataclasses.dataclass
class Progress:
    """Build progress for a display; the totals are known before the first compile starts."""

    modules_total: int
    variants_total: int
    modules_done: int = 0
    variants_done: int = 0
    cached: int = 0  # variants reused from the registry (included in variants_done)
    last: str = ""  # build key of the module that finished last


class BuildInterrupted(KeyboardInterrupt):
    """The build stopped on SIGINT / SIGTERM / SIGHUP / SIGQUIT or an error; ninja and every nvcc under it were
    stopped. ``built``: variants whose modules had finished before, now registered."""

    def __init__(self, built: list[BuiltVariant], cause: BaseException | None = None):
        super().__init__(str(cause or "interrupted"))
        self.built = built
        self.cause = cause


def build(spec: Spec, kernels: str | None = None, jobs: int | None = None,
          on_progress: Callable[[Progress], None] | None = None, registry: Registry | None = None,
          on_wait: Callable[[str, Path], None] | None = None) -> BuildReport:
    """Generate and compile every feasible variant of ``spec`` matching ``kernels`` (uri glob).

    Variants differing only in nsplit share one compiled module. Already-registered variants
    with the same source hash are reused. Failed variants leave nothing registered and carry the
    compiler's output in the report. ``on_progress`` gets a :class:`Progress` before compiling and
    after each module; ``on_wait(build_key, lock_path)`` is called when another process holds the
    lock of a module (its build is then awaited).

    Raises:
        ValueError: ``kernels`` names no glob (only commas / spaces; :func:`mlagen.spec.filter_by_glob`).
        ninja_gen.ToolchainError: nvcc missing, unusable or too old for an arch of the selected variants
            (checked before anything is written, even when every module is cached); MAX_JOBS not a positive
            integer (read when ``jobs`` is None and a module must compile).
        BuildInterrupted: SIGINT / SIGTERM / SIGHUP / SIGQUIT while waiting for another process's lock, or any exception
            during the compile, ninja missing included (ninja and nvcc are stopped; modules finished before it
            are registered; the cause is ``.cause``).
    """
    t0 = time.perf_counter()
    selected = filter_by_glob(spec.variants(), kernels)
    feasible, infeasible = feasibility.split_feasible(selected)
    all_jobs = generate(feasible, write=False)  # (the toolchain is checked before anything is written)
    if not all_jobs:  # nothing to build: no registry (or cache directory) is created
        return BuildReport([], [], infeasible, time.perf_counter() - t0)
    reg = registry or Registry()
    failed: list[tuple[Variant, str]] = []
    built, todo = _split_registered(reg, all_jobs, spec.name)
    prog = Progress(len(all_jobs), len(feasible), modules_done=len(all_jobs) - len(todo), variants_done=len(built),
                    cached=len(built))
    if on_progress:
        on_progress(prog)
    if todo:
        with ninja_gen.sigterm_as_interrupt(), ExitStack() as stack:
            try:
                # per module: its generated directory's lock, then its cache's, in the modules' sorted order (every
                # process takes them in this order: no deadlock)
                for j in sorted(todo, key=lambda j: j.key):
                    for lock_path in (_generated_lock(j.outputs), owned.record(paths.lock_dir() / f"{j.key}.lock")):
                        lock = FileLock(str(lock_path))
                        try:
                            lock.acquire(timeout=0)
                        except Timeout:
                            if on_wait:
                                on_wait(j.key, lock_path)
                            lock.acquire()
                        stack.callback(lock.release)
            except KeyboardInterrupt as e:  # a signal while waiting for another process's build: nothing compiled here
                raise BuildInterrupted([], e) from e
            hits, still = _split_registered(reg, todo, spec.name)  # second check: another process may have built it
            built += hits
            if hits:
                prog.modules_done += len(todo) - len(still)
                prog.variants_done += len(hits)
                prog.cached += len(hits)
                if on_progress:
                    on_progress(prog)
            if still:
                for j in still:
                    _write_sources(j)  # under its locks: no other build writes these files until it is registered
                b2, f2 = _compile(spec, still, jobs or ninja_gen.default_jobs(), prog, on_progress, reg)
                built += b2
                failed += f2
    order = {v.uri: i for i, v in enumerate(feasible)}
    built.sort(key=lambda b: order[b.uri])
    return BuildReport(built, failed, infeasible, time.perf_counter() - t0)


def _compile(spec: Spec, jobs_: list[_Job], n_jobs: int, prog: Progress, on_progress, reg: Registry):
    tag = hashlib.sha256("\n".join(sorted(j.key for j in jobs_)).encode()).hexdigest()[:12]
    top = paths.generated_dir() / f"build_{spec.name}_{tag}.ninja"  # per target set: concurrent builds don't collide
    owned.record(top)
    logs = owned.ensure_dir(top.parent / ninja_gen.NINJA_BUILDDIR)  # ninja's builddir (top_ninja)
    for name in (".ninja_log", ".ninja_deps"):
        owned.record(logs / name)
    codegen.write_if_changed(top, ninja_gen.top_ninja([j.variants[0] for j in jobs_]))
    targets = [str(j.outputs["so"]) for j in jobs_]
    by_key = {j.key: j for j in jobs_}

    def on_line(line: str):
        if line.startswith("[") and "] nvcc " in line:  # ninja's status line of a finished module
            key = line.split("] nvcc ", 1)[1].strip()
            prog.modules_done += 1
            prog.variants_done += len(by_key[key].variants) if key in by_key else 1
            prog.last = key
            if on_progress:
                on_progress(prog)

    t0 = time.perf_counter()
    try:
        rc, output = ninja_gen.run_ninja(top, targets, n_jobs, on_line)
    except BaseException as e:  # interrupt or error: ninja and nvcc are stopped; keep what finished
        secs = (time.perf_counter() - t0) * min(n_jobs, len(jobs_)) / len(jobs_)
        logged = ninja_gen.logged_build_seconds(targets)
        done = []
        for j in jobs_:
            if Path(j.outputs["so"]).exists() and ninja_gen.target_up_to_date(top, str(j.outputs["so"])):
                ok, _ = _register(spec, j, logged.get(str(j.outputs["so"]), secs), reg)
                done += ok
        raise BuildInterrupted(done, e) from e
    wall = time.perf_counter() - t0
    secs = wall * min(n_jobs, len(jobs_)) / len(jobs_)  # per-module share of the parallel build, if ninja logged none
    logged = ninja_gen.logged_build_seconds(targets)  # each module's own compile time
    built, failed = [], []
    for j in jobs_:
        so = Path(j.outputs["so"])
        ok = so.exists() and (rc == 0 or ninja_gen.target_up_to_date(top, str(so)))
        if not ok:
            log = Path(j.outputs["log"])
            text = log.read_text() if log.exists() else output
            failed += [(v, _error_excerpt(text)) for v in j.variants]
            continue
        b, f = _register(spec, j, logged.get(str(so), secs), reg)
        built += b
        failed += f
    return built, failed


def _register(spec: Spec, j: _Job, secs: float, reg: Registry):
    """Check a compiled module, install its .so atomically and register its variants.
    Returns (built, failed)."""
    def text_of(path) -> bytes:
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return b""

    # the .cu and build.ninja (its include path and build id) ninja used are this job's: another process sharing this
    # MLAGEN_GENERATED_DIR may write them (`mlagen generate` takes no lock)
    if (text_of(j.outputs["source"]) != j.source.encode()
            or text_of(j.outputs["ninja"]) != ninja_gen.variant_ninja(j.variants[0], j.source_hash).encode()):
        reason = ("its generated source or build.ninja changed during the build (another mlagen process wrote the "
                  "same module's files into this MLAGEN_GENERATED_DIR?): not registered; build again")
        return [], [(v, reason) for v in j.variants]
    resources, reason = check_build(j.variants[0], j.outputs)
    if reason:
        return [], [(v, reason) for v in j.variants]
    dest = owned.record(_installed_so(j.key, j.source_hash))
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    if os.path.lexists(tmp) and not owned.is_recorded(tmp):
        reason = f"{tmp} (not written by mlagen) is in the way of installing the module: move it away"
        return [], [(v, reason) for v in j.variants]
    owned.record(tmp, written=True)  # recorded before the copy: an interrupted copy is mlagen's to clean
    shutil.copyfile(j.outputs["so"], tmp)
    os.replace(tmp, dest)
    owned.forget(tmp)
    reg.drop_stale_build(j.key, j.source_hash)  # nsplit siblings built from older sources
    built = []
    for v in j.variants:
        _put_variant(reg, spec.name, v, j.source_hash, ninja_gen.nvcc_version(), str(dest), secs, resources)
        built.append(BuiltVariant(v, dest, j.source_hash, secs, resources, cached=False))
    return built, []


def _error_excerpt(text: str, limit: int = 40) -> str:
    lines = [l for l in text.splitlines() if "error" in l.lower()] or text.splitlines()
    return "\n".join(lines[:limit])


def build_variants(spec: Spec | dict | str | os.PathLike, kernels: str | None = None,
                   jobs: int | None = None) -> list[BuiltVariant]:
    """Build (or reuse) the variants of ``spec`` (a Spec, a spec dict or a YAML path) matching ``kernels``.

    Raises:
        SpecError: invalid spec.
        BuildError: any selected variant failed to build or check; the message carries the errors.
        ValueError, ninja_gen.ToolchainError, BuildInterrupted: as :func:`build`.
    """
    if isinstance(spec, Spec):
        s = spec
    elif isinstance(spec, dict):
        s = parse_spec(spec)
    else:
        s = load_spec(spec)
    rep = build(s, kernels=kernels, jobs=jobs)
    if rep.failed:
        raise BuildError("; ".join(f"{v.uri}: {msg}" for v, msg in rep.failed))
    return rep.built
