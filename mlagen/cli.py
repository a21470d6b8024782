"""mlagen command line: generate, build, verify, bench, list, show, clean (click group).

User errors raise click.ClickException: one line, no traceback, exit code 1.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape  # messages carry [brackets] (nvcc output, reasons): printed literally
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mlagen import __version__, feasibility, owned, paths
from mlagen.spec import MAX_VARIANTS, Spec, SpecError, filter_by_glob, load_spec, short_repr, uri_globs

# Piped output: tables 240 columns wide, and a printed line is never broken (a module path and its variants stay
# on one line for grep and scripts).
console = Console(highlight=False, width=None if sys.stdout.isatty() else 240, soft_wrap=not sys.stdout.isatty())


def _n(count: int, noun: str, plural: str | None = None) -> str:
    """"1 variant", "3 variants" ("1 entry", "2 entries" with ``plural``)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def _spec(path: str, max_variants: int | None = None) -> Spec:
    """The validated spec at ``path``; its sweep may hold at most ``max_variants`` variants."""
    try:
        spec = load_spec(path)
        spec.check_size(max_variants)
        return spec
    except SpecError as e:
        raise click.ClickException(str(e)) from None


_max_variants_option = click.option(
    "--max-variants", type=click.IntRange(min=1), metavar="N",
    help=f"Allow a sweep of up to N variants (default {MAX_VARIANTS}; a larger sweep is refused, naming its size).")


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=not console.is_terminal)


class _BuildProgress:
    """Compile progress of `mlagen build`. In a terminal: a bar over variants, the totals set before
    the first nvcc starts. Otherwise (CI, a pipe): plain lines: one before compiling, one when a
    module finishes (at most one per ``interval`` seconds, the last always; a "still compiling" line does not
    count against it), and a "still compiling" line after ``interval`` seconds without any line. Both say when
    the build waits for another's lock."""

    interval = 15.0

    def __init__(self, jobs: int):
        self.jobs = jobs
        self.t0 = time.monotonic()
        self.last_line = self.t0  # any line (the heartbeat's test)
        self.last_module_line = self.t0  # the last "compiled" line (the rate limit of those lines)
        self.state = None  # the latest mlagen.build.Progress
        self.plain = not console.is_terminal
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.bar = None if self.plain else Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("variants"),
            TimeElapsedColumn(), console=console, transient=True)
        self.task = None

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        else:
            threading.Thread(target=self._heartbeat, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False

    def _print(self, text: str) -> None:
        with self._lock:
            console.print(text, soft_wrap=True, markup=False)
            self.last_line = time.monotonic()

    def _counts(self, p) -> str:
        return (f"{p.modules_done}/{p.modules_total} modules ({p.variants_done}/{p.variants_total} variants), "
                f"{time.monotonic() - self.t0:.0f} s")

    def update(self, p) -> None:
        first = self.state is None
        self.state = p
        if first:
            todo = p.modules_total - p.modules_done
            if todo:
                self._print(f"compiling {todo} module(s) ({p.variants_total - p.variants_done} variants; "
                            f"{p.cached} cached) with {self.jobs} parallel job(s)")
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task("", total=p.variants_total)
            self.bar.update(self.task, completed=p.variants_done, total=p.variants_total,
                            description=f"compiling: {p.modules_done}/{p.modules_total} modules")
        elif not first and (p.modules_done == p.modules_total or
                            time.monotonic() - self.last_module_line >= self.interval):
            self._print(f"compiled {self._counts(p)}" + (f"; last {p.last}" if p.last else ""))
            self.last_module_line = self.last_line

    def waiting(self, key: str, lock: Path) -> None:
        self._print(f"waiting for another build of {key} (lock {lock})")

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.interval / 4)):
            p = self.state
            if p is not None and p.modules_done < p.modules_total and time.monotonic() - self.last_line >= self.interval:
                self._print(f"still compiling: {self._counts(p)}")


def _gpu_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to torch"
    return True, torch.cuda.get_device_name()


def _device_arch() -> str:
    """mlagen arch key of the current GPU; ClickException for an arch mlagen does not build."""
    import torch

    from mlagen.tables import arch_of_capability

    try:
        return arch_of_capability(*torch.cuda.get_device_capability())
    except KeyError as e:
        raise click.ClickException(str(e).strip("'\"")) from None


DROPPED_LISTED = 8  # up to this many infeasible variants are listed one per line; more are grouped by reason


def _print_infeasible(infeasible) -> None:
    """One line per infeasible variant (uri: reason), or, for more than DROPPED_LISTED, one line per
    distinct reason with its count and one example uri (a swept spec repeats each reason per NSPLIT,
    page size, ...). Reasons and uris are printed literally (no rich markup)."""
    if len(infeasible) <= DROPPED_LISTED:
        for v, reason in infeasible:
            console.print(f"[yellow]dropped[/] {escape(v.uri)}: {escape(reason)}", soft_wrap=True)
        return
    # shared-memory reasons differ only in the byte count: one group per limit and arch, the counts as a range
    smem = re.compile(r"^shared memory (\d+) B > (.*)$")
    groups: dict[str, list] = {}
    sizes: dict[str, list[int]] = {}
    for v, reason in infeasible:
        m = smem.match(reason)
        key = f"shared memory {{}} B > {m.group(2)}" if m else reason
        groups.setdefault(key, []).append(v)
        if m:
            sizes.setdefault(key, []).append(int(m.group(1)))
    for key, vs in groups.items():
        lo, hi = min(sizes.get(key, [0])), max(sizes.get(key, [0]))
        reason = key.format(f"{lo}" if lo == hi else f"{lo}-{hi}") if key in sizes else key
        console.print(f"[yellow]dropped[/] {len(vs)} variant(s): {escape(reason)} (e.g. {escape(vs[0].uri)})",
                      soft_wrap=True)


class _OneLineUsageError(click.ClickException):
    """A usage error printed as one ``Error:`` line, with click's exit status for usage errors (2)."""

    exit_code = 2


class _Group(click.Group):
    """Maps environment failures (missing or old toolchain, unreadable cache, corrupt registry) and usage errors to
    one-line errors, for every subcommand."""

    @staticmethod
    def _one_line(e: click.UsageError, where: str) -> _OneLineUsageError:
        return _OneLineUsageError(f"{e.format_message()} (see `{where} --help`)")

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:  # an option of `mlagen` itself: one line, as for the subcommands (invoke)
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `mlagen` (click 8.2+): its help, as click prints it
                raise
            raise self._one_line(e, ctx.command_path) from None

    def invoke(self, ctx):
        import sqlite3

        from mlagen.ninja_gen import ToolchainError
        from mlagen.registry import RegistryError

        # the subcommand's name, read before click's Group.invoke consumes the arguments (click 8 keeps it apart in
        # _protected_args; click 9 in args)
        first = next(iter([*getattr(ctx, "_protected_args", []), *ctx.args]), None)
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a bad option or command: one line (click would add its usage and a hint)
            if e.ctx is not None:
                where = e.ctx.command_path
            else:  # (e.g. "Option '-j' requires an argument": no context; the subcommand is the first argument)
                where = f"{ctx.command_path} {first}" if first in self.commands else ctx.command_path
            raise self._one_line(e, where) from None
        except BrokenPipeError:  # `mlagen list | head`: the reader is gone; stop quietly, like a SIGPIPE
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, AttributeError):
                pass
            ctx.exit(141)
        except (ToolchainError, RegistryError, owned.NotOwnedError) as e:
            raise click.ClickException(str(e)) from None
        except (OSError, sqlite3.DatabaseError) as e:
            raise click.ClickException(f"{type(e).__name__}: {e} (check MLAGEN_CACHE_DIR / MLAGEN_GENERATED_DIR)") from None


def _check_kernels(_ctx, _param, value: str | None) -> str | None:
    try:
        uri_globs(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


_kernels_option = click.option("--kernels", metavar="GLOB", callback=_check_kernels,
                               help="Only variants whose uri matches this shell glob (several: comma-separated, any matches).")


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="mlagen")
def main() -> None:
    """Generate, build, verify and benchmark specialized MLA verify-attention kernels."""


# The hint for a uri or --kernels glob that is (part of) a module name, i.e. a build key without the split count.
_MODULE_NAME_HINT = " (that looks like a module name: a variant uri also carries its split count, _nsN_ or _nsauto_)"


def _feasible_selection(spec: Spec, spec_path: str, kernels: str | None) -> tuple[list, list]:
    """(feasible, dropped) variants of ``spec`` matching ``kernels``, for `generate` and `build`: the toolchain checked
    (one line if missing or old) and the dropped ones listed, both before anything is written.

    Raises:
        click.ClickException: no variant matches ``kernels``, or none of them is feasible.
        ToolchainError: nvcc missing or too old for an arch of the feasible variants.
    """
    from mlagen.ninja_gen import check_nvcc

    selected = filter_by_glob(spec.variants(), kernels)
    if not selected:
        # a glob copied from a module name (generate / build print them): no _nsN_ between page size and load width
        hint = _MODULE_NAME_HINT if kernels and re.search(r"ps\d+_lw", kernels) else ""
        raise click.ClickException(f"no variant of {spec.name} matches --kernels {short_repr(kernels)}{hint}")
    ok, bad = feasibility.split_feasible(selected)
    if ok:
        check_nvcc([a for v in ok for a in v.archs])  # a missing / old toolchain: one line, before any listing
    _print_infeasible(bad)
    if not ok:
        raise click.ClickException(f"no feasible variant in {spec_path} ({len(bad)} dropped, reasons above)")
    return ok, bad


@main.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False))
@_kernels_option
@_max_variants_option
def generate(spec_path: str, kernels: str | None, max_variants: int | None) -> None:
    """Validate SPEC and render the sources of its feasible variants (no compile)."""
    from mlagen.build import generate as gen

    spec = _spec(spec_path, max_variants)
    ok, bad = _feasible_selection(spec, spec_path, kernels)
    jobs = gen(ok)
    for j in jobs:
        console.print(f"{j.outputs['source']}  ({len(j.variants)} variant(s): nsplit {', '.join(str(v.nsplit) for v in j.variants)})")
    console.print(f"{_n(len(ok), 'variant')} in {_n(len(jobs), 'module')} under {paths.generated_dir()}; "
                  f"{len(bad)} dropped")


@main.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False))
@_kernels_option
@click.option("--jobs", "-j", type=click.IntRange(min=1), help="Parallel nvcc jobs (default: MAX_JOBS or CPU count).")
@click.option("--compile-only", is_flag=True, help="Stop after compiling, even on a GPU machine.")
@click.option("--quick", is_flag=True, help="Verify without the 128k-token and >4 GiB cases.")
@_max_variants_option
@click.pass_context
def build(ctx: click.Context, spec_path: str, kernels: str | None, jobs: int | None, compile_only: bool, quick: bool,
          max_variants: int | None) -> None:
    """Generate and compile every variant of SPEC; on a GPU also verify and benchmark them."""
    from mlagen import build as b
    from mlagen.ninja_gen import default_jobs

    spec = _spec(spec_path, max_variants)
    _feasible_selection(spec, spec_path, kernels)  # (the dropped variants listed before the compile)
    jobs = jobs or default_jobs()
    try:
        with _BuildProgress(jobs) as prog:
            rep = b.build(spec, kernels=kernels, jobs=jobs, on_progress=prog.update, on_wait=prog.waiting)
    except b.BuildInterrupted as e:
        n = len(e.built)
        kept = f"{n} variant(s) compiled before that are registered (a re-run reuses them)"
        if isinstance(e.cause, KeyboardInterrupt) or e.cause is None:
            sig = str(e.cause) if str(e.cause) in ("SIGTERM", "SIGHUP", "SIGQUIT") else "SIGINT"
            console.print(f"interrupted ({sig}): stopped ninja and nvcc; {kept}")
            ctx.exit(128 + {"SIGINT": 2, "SIGHUP": 1, "SIGQUIT": 3, "SIGTERM": 15}[sig])
        raise click.ClickException(f"build stopped by {type(e.cause).__name__}: {short_repr(str(e.cause))}; "
                                   f"stopped ninja and nvcc; {kept}") from None
    cached = sum(x.cached for x in rep.built)
    modules = len({x.variant.build_key for x in rep.built})
    console.print(f"built {_n(len(rep.built), 'variant')} ({cached} cached) from {_n(modules, 'module')} in "
                  f"{rep.seconds:.1f} s; "
                  f"{len(rep.failed)} failed; {len(rep.infeasible)} dropped")
    for v, msg in rep.failed:
        console.print(f"[red]FAILED[/] {escape(v.uri)}\n{escape(msg)}")
    if rep.failed:
        raise click.ClickException(f"{len(rep.failed)} variant(s) failed to build")
    if compile_only:
        return
    ok, why = _gpu_available()
    if not ok:
        console.print(f"no GPU ({why}): stopping after compile")
        return
    uris = [x.uri for x in rep.built]
    failures = _verify(uris, quick)
    if failures:
        raise click.ClickException(f"{failures} variant(s) failed verification")
    _bench(uris, None, None, None)


def _verify(uris: list[str], quick: bool) -> int:
    import torch

    from mlagen.ops import load_variant
    from mlagen.registry import Registry
    from mlagen.verify import verify_kernel, summarize

    reg = Registry()
    dev = torch.cuda.get_device_name()
    arch = _device_arch()
    done_keys: dict[str, tuple] = {}
    table = Table("variant", "cases", "max |err|", "max lse err", "result", title=f"verify on {dev}")
    failures = 0
    with _progress() as prog:
        task = prog.add_task("verifying", total=len(uris))
        for uri in uris:
            k = load_variant(uri)
            row = reg.get_variant(uri)
            results = verify_kernel(k, quick=quick)
            s = summarize(results)
            passed = s["passed"] == s["cases"]
            failures += not passed
            reg.add_verification(uri=uri, source_hash=row["source_hash"], device=dev, arch=arch, cases=s["cases"],
                                 max_err=s["max_abs_err"], passed=passed,
                                 detail=[dict(name=r.name, passed=r.passed, err=r.max_abs_err, detail=r.detail)
                                         for r in results])
            table.add_row(uri, f"{s['passed']}/{s['cases']}", f"{s['max_abs_err']:.4g}", f"{s['max_lse_err']:.3g}",
                          "[green]pass[/]" if passed else "[red]FAIL[/]")
            for r in results:
                if not r.passed:
                    console.print(f"[red]FAIL[/] {escape(uri)} / {escape(r.name)}: {escape(str(r.detail))}")
            prog.advance(task)
            done_keys[uri] = (passed,)
    console.print(table)
    return failures


def _bench(uris: list[str], contexts, batches, plot: str | None) -> None:
    import torch

    from mlagen import bench as bm
    from mlagen.ops import load_variant
    from mlagen.registry import Registry

    reg = Registry()
    dev = torch.cuda.get_device_name()
    arch = _device_arch()
    contexts = contexts or bm.CONTEXTS
    batches = batches or bm.BATCHES
    verified = []
    for uri in uris:
        row = reg.get_variant(uri)
        ver = reg.last_verification(uri, row["source_hash"], arch)
        if ver and ver["passed"]:
            verified.append(uri)
        else:
            console.print(f"[yellow]skip[/] {escape(uri)}: not verified on {arch} (run `mlagen verify`)")
    if not verified:
        raise click.ClickException("no verified variant to benchmark")
    bw = bm.copy_bandwidth_gbs()
    console.print(f"device {dev}: copy bandwidth {bw:.0f} GB/s (read + write)")
    results = []
    with _progress() as prog:
        task = prog.add_task("benchmarking", total=len(verified) * len(contexts) * len(batches))
        for uri in verified:
            k = load_variant(uri)
            v = k.variant
            for ctx in contexts:
                for bs in batches:
                    shape = bm.Shape(v.heads, v.q_len, bs, ctx, v.page_size)
                    r = bm.bench_kernel(k, shape)
                    frac = r["gbs"] / bw
                    reg.add_benchmark(uri=uri, source_hash=reg.get_variant(uri)["source_hash"], device=dev, arch=arch,
                                      shape=shape.as_dict(), median_us=r["median_us"], gbs=r["gbs"], frac_copy_bw=frac)
                    results.append((uri, shape, r, frac))
                    prog.advance(task)
    table = Table("variant", "H", "q", "ps", "bs", "ctx", "µs", "GB/s", "of copy bw", title=f"bench on {dev}")
    for uri, shape, r, frac in results:
        table.add_row(uri, str(shape.heads), str(shape.q_len), str(shape.page_size), str(shape.batch_size),
                      str(shape.context), f"{r['median_us']:.1f}", f"{r['gbs']:.0f}", f"{frac:.2f}")
    console.print(table)
    best: dict[tuple, tuple] = {}
    for uri, shape, r, _ in results:
        key = (load_variant(uri).variant.bucket, shape.batch_size, shape.context)
        if key not in best or r["median_us"] < best[key][1]:
            best[key] = (uri, r["median_us"])
    for (bucket, bs, ctx), (uri, us) in sorted(best.items()):
        console.print(f"fastest {bucket} bs={bs} ctx={ctx}: {uri} ({us:.1f} µs)")
    if plot:
        from mlagen.plot import plot_bench

        plot_bench(results, plot, bw)
        console.print(f"wrote {plot}")


def _uris_for(spec_path: str | None, kernels: str | None, max_variants: int | None = None) -> list[str]:
    from mlagen.registry import Registry

    reg = Registry(create=False)
    if spec_path:
        spec = _spec(spec_path, max_variants)
        uris = [v.uri for v in filter_by_glob(spec.variants(), kernels) if reg.get_variant(v.uri)]
    else:
        uris = [r["uri"] for r in reg.variants(kernels)]
    if not uris:
        raise click.ClickException("no built variant matches; run `mlagen build SPEC` first")
    return uris


@main.command()
@click.argument("spec_path", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False))
@_kernels_option
@click.option("--quick", is_flag=True, help="Skip the 128k-token and >4 GiB cases.")
@_max_variants_option
def verify(spec_path: str | None, kernels: str | None, quick: bool, max_variants: int | None) -> None:
    """Run built variants against the reference on the GPU; exits non-zero on any failure."""
    ok, why = _gpu_available()
    if not ok:
        raise click.ClickException(f"verify needs a GPU: {why}")
    failures = _verify(_uris_for(spec_path, kernels, max_variants), quick)
    if failures:
        raise click.ClickException(f"{failures} variant(s) failed verification")


@main.command()
@click.argument("spec_path", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False))
@_kernels_option
@click.option("--contexts", callback=lambda _c, _p, v: _ints(v), metavar="N,N,...",
              help="Comma-separated context lengths (default 4096,16384,65536).")
@click.option("--batches", callback=lambda _c, _p, v: _ints(v), metavar="N,N,...",
              help="Comma-separated batch sizes (default 1,4).")
@click.option("--plot", metavar="PNG", help="Also write time vs context to this PNG (an existing file only if mlagen "
              "wrote it).")
@_max_variants_option
def bench(spec_path: str | None, kernels: str | None, contexts: list[int] | None, batches: list[int] | None,
          plot: str | None, max_variants: int | None) -> None:
    """Time verified variants (CUDA graph replay, median) and name the fastest per shape."""
    if spec_path is not None:
        _spec(spec_path, max_variants)  # a missing or invalid SPEC is reported before the GPU check
    if plot is not None:
        from mlagen.plot import plot_path_problem

        why = plot_path_problem(plot)
        if why:
            raise click.BadParameter(why, param_hint="'--plot'")
    ok, why = _gpu_available()  # after click has validated every option (--contexts, --batches)
    if not ok:
        raise click.ClickException(f"bench needs a GPU: {why}")
    _bench(_uris_for(spec_path, kernels, max_variants), contexts, batches, plot)


INT32_MAX = 2**31 - 1  # kv lengths and batch sizes reach the kernels as int32


def _ints(text: str | None) -> list[int] | None:
    """Option callback: comma-separated positive integers below 2**31 (None when not given; an empty
    string is an error, not the default)."""
    if text is None:
        return None
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        vals = [0]
    if not vals or any(not 0 < x <= INT32_MAX for x in vals):
        raise click.BadParameter(f"expected comma-separated positive integers (< 2**31), got {short_repr(text)}")
    return vals


@main.command(name="list")
@_kernels_option
@click.option("--format", "fmt", type=click.Choice(["auto", "table", "lines", "tsv"]), default="auto", show_default=True,
              help="table: one row per variant; lines: the uri on a line of its own, its details below; tsv: "
                   "tab-separated, for scripts; auto: table when it fits the width with whole uris, else lines. "
                   "Uris are never shortened.")
def list_(kernels: str | None, fmt: str) -> None:
    """Built variants: per-arch registers / smem / spills, verify status, best time."""
    from mlagen.registry import Registry

    reg = Registry(create=False)
    rows = []
    for r in reg.variants(kernels):
        res = r["resources"]
        per_arch = "  ".join(f"{a}: {res[a]['registers']} / {res[a]['smem']} / {res[a]['spill_stores']}"
                             for a in r["archs"] if a in res)
        vers = [v for v in (reg.last_verification(r["uri"], r["source_hash"], a) for a in r["archs"]) if v]
        vs = ", ".join(f"{'pass' if v['passed'] else 'FAIL'} ({v['arch']})" for v in vers) or "-"
        best = reg.best_time(r["uri"], r["source_hash"])
        rows.append((r["uri"], per_arch, vs, "-" if best is None else f"{best:.1f}"))
    head = ("variant", "archs: regs / smem B / spill B", "verify", "best µs")
    if not rows and fmt != "tsv":
        what = f"matching {short_repr(kernels)}" if kernels else "built"
        console.print(f"0 variants {what} in {reg.path}; `mlagen build SPEC` builds and registers them")
        return
    if fmt == "tsv":
        for row in [head, *rows]:
            click.echo("\t".join(row))
        return
    uri_w = max([len(r[0]) for r in rows] + [len(head[0])])
    table = Table(title=_n(len(rows), "variant"))
    table.add_column(head[0], no_wrap=True, min_width=uri_w)
    for h in head[1:]:
        table.add_column(h, overflow="fold")
    for row in rows:
        table.add_row(*row)
    # the width with every column at its natural width (nothing folded), measured without the console's limit
    need = console.measure(table, options=console.options.update_width(1 << 16)).maximum
    if fmt == "table" or (fmt == "auto" and need <= console.width):
        console.print(table, width=max(console.width, need), crop=False)
        return
    console.print(f"{_n(len(rows), 'variant')} (registers / smem B / spill B per arch; verify; best µs)")
    for uri, per_arch, vs, best in rows:
        console.print(uri, soft_wrap=True, markup=False, highlight=False)
        console.print(f"    {per_arch}   verify {vs}   best {best if best == '-' else best + ' µs'}", soft_wrap=True,
                      markup=False)


def _iso(ts) -> str | None:
    """A registry time (epoch seconds) as local ISO 8601 with its UTC offset."""
    import datetime

    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(float(ts), datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


@main.command()
@click.argument("uri")
def show(uri: str) -> None:
    """Everything recorded about one variant (times in ISO 8601).

    `spec` is the spec whose build registered it last, `build_seconds` its module's compile time as ninja logged it.
    """
    import json

    from mlagen.registry import Registry

    reg = Registry(create=False)
    row = reg.get_variant(uri)
    if row is None:
        hint = ""
        if "_ns" not in uri and uri.startswith("mla_verify_"):  # a module name (build key), as build prints
            hint = _MODULE_NAME_HINT
        shown = repr(uri) if len(uri) <= 300 else short_repr(uri)  # a uri whole, so the mistyped part shows
        raise click.ClickException(f"unknown variant {shown}{hint}; see `mlagen list`")
    ver = reg.last_verification(uri, row["source_hash"])
    if ver is not None:
        ver = dict(ver, at=_iso(ver["at"]))
    benches = [dict(b, at=_iso(b["at"])) for b in reg.benchmarks(uri)]
    console.print_json(json.dumps(dict(row, built_at=_iso(row["built_at"]), verification=ver, benchmarks=benches),
                                  default=str))


def _clean_summary(planned: list[Path]) -> list[str]:
    """What a clean plan deletes, one line per kind."""
    from mlagen.sglang_plugin.installed import installed_path

    gen, lib, locks = paths.generated_dir(), paths.so_dir(), paths.lock_dir()
    files = [p for p in planned if not p.is_dir() and p.name != owned.MANIFEST]
    kinds: dict[str, list[Path]] = {}
    for p in files:
        if p == paths.registry_path():
            k = f"the registry {p} (every build, verification and benchmark record)"
        elif p == installed_path():
            k = f"the installed state {p} (un-installs SGLang's `mlagen` backend)"
        elif p.parent == lib:
            k = f"built modules (.so) in {lib}"
        elif p.parent == locks:
            k = f"build lock files in {locks}"
        elif gen == p.parent or gen in p.parents:
            k = f"generated sources, build files, nvcc logs and intermediates in {gen}"
        else:
            k = f"other files mlagen wrote in {p.parent}"
        kinds.setdefault(k, []).append(p)
    return [f"{len(v)} file(s): {k}" if len(v) > 1 else k for k, v in kinds.items()]


@main.command()
@click.option("--all", "all_", is_flag=True,
              help="Also delete, in the cache: the registry, built .so files, lock files and the installed state "
                   "(which un-installs SGLang's backend).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def clean(all_: bool, yes: bool) -> None:
    """Delete the generated sources mlagen wrote (with --all also its cache). Only files mlagen recorded
    as its own are deleted (each directory mlagen writes to lists them in a .mlagen-manifest); anything else in
    those directories stays."""
    roots = [paths.generated_dir()] + ([paths.cache_dir()] if all_ else [])
    planned = list(dict.fromkeys(p for r in roots for p in owned.plan(r)))
    lines = _clean_summary(planned)
    if not planned:
        console.print("nothing to remove (no files mlagen recorded under " + " or ".join(map(str, roots)) + ")")
        return
    if not yes:
        try:
            ok = click.confirm("This deletes:\n" + "".join(f"  - {l}\n" for l in lines) + "Delete?")
        except click.Abort:  # end of input (no terminal): say how to proceed instead of click's bare "Aborted!"
            raise click.ClickException("nothing deleted: no answer on stdin; pass --yes to delete without asking") from None
        if not ok:
            console.print("nothing deleted")
            sys.exit(1)
    planned_dirs = {p for p in planned if p.is_dir()}
    removed = owned.remove(planned)
    files = [p for p in removed if p.name != owned.MANIFEST and p not in planned_dirs]
    dirs = [p for p in removed if p in planned_dirs]
    for l in lines:
        console.print(f"removed {l}", soft_wrap=True, markup=False)
    kept = [p for p in planned if p.exists()]
    console.print(f"removed {len(files)} file(s) and {len(dirs)} director(ies) in all"
                  + (f"; kept {len(kept)} director(ies) holding files mlagen did not write" if kept else ""))


def _installed_lock():
    """The file lock install and uninstall hold around their read and write of installed.json."""
    from filelock import FileLock

    return FileLock(str(owned.record(paths.lock_dir() / "installed.json.lock")))


def _server_arch(arch: str | None) -> str:
    if arch:
        return arch
    ok, why = _gpu_available()
    if not ok:
        raise click.ClickException(f"cannot detect the server GPU ({why}); pass --arch sm_120 or --arch sm_90")
    return _device_arch()


@main.command()
@click.argument("spec_path", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False))
@click.option("--uri", "uris", multiple=True, help="Install this variant instead of picking (repeatable).")
@click.option("--arch", type=click.Choice(["sm_120", "sm_90"]), help="Server GPU arch (default: this machine's GPU).")
@_max_variants_option
def install(spec_path: str | None, uris: tuple[str, ...], arch: str | None, max_variants: int | None) -> None:
    """Install the fastest verified variant of each shape bucket of SPEC (or the --uri variants) as SGLang's `mlagen` backend."""
    from mlagen.install import InstallError, entry_for, merge_state, pick_fastest
    from mlagen.registry import Registry
    from mlagen.sglang_plugin.installed import InstalledStateError, read_installed, write_installed

    if not spec_path and not uris:
        raise click.ClickException("give a SPEC or at least one --uri")
    arch = _server_arch(arch)
    reg = Registry(create=False)
    if spec_path and uris:
        raise click.ClickException("give a SPEC or --uri, not both")
    try:
        entries = ([entry_for(reg, u, arch) for u in dict.fromkeys(uris)] if uris
                   else pick_fastest(reg, _spec(spec_path, max_variants), arch))
    except InstallError as e:
        raise click.ClickException(str(e)) from None
    buckets = [e["bucket"] for e in entries]
    dup = sorted({b for b in buckets if buckets.count(b) > 1})
    if dup:
        raise click.ClickException(f"more than one --uri for bucket {dup[0]}: install one variant per bucket")
    with _installed_lock():  # read, merge, write: a concurrent install's entries are not lost
        try:
            old = read_installed()
        except InstalledStateError as e:
            raise click.ClickException(str(e)) from None
        try:
            path = write_installed(merge_state(old, entries, arch))
        except InstalledStateError as e:
            raise click.ClickException(str(e)) from None
        owned.record(path, written=True)  # absent before, or of mlagen's format (read above): `clean --all` removes it
    if old and old["arch"] != arch and old["entries"]:
        console.print(f"replaced the {old['arch']} installed state ({_n(len(old['entries']), 'entry', 'entries')}): "
                      "installed.json holds one arch")
    for e in entries:
        console.print(f"installed {e['role']} {e['bucket']}: {e['uri']}")
    console.print(f"wrote {path}; launch SGLang with --attention-backend mlagen")


@main.command()
def status() -> None:
    """Show which variants the SGLang backend will load."""
    from mlagen.sglang_plugin.installed import InstalledStateError, installed_path, read_installed

    try:
        state = read_installed()
    except InstalledStateError as e:
        raise click.ClickException(str(e)) from None
    if not state or not state.get("entries"):
        console.print(f"nothing installed ({installed_path()}); run `mlagen install SPEC`")
        return
    from mlagen.registry import Registry

    reg = Registry(create=False)
    table = Table("role", "bucket", "variant", ".so", title=f"installed for {state['arch']} ({installed_path()})")
    missing = stale = 0
    for e in state["entries"]:
        ok = Path(e["so_path"]).exists()
        row = reg.get_variant(e["uri"])
        rebuilt = ok and row is not None and row["so_path"] != e["so_path"]
        missing += not ok
        stale += rebuilt
        table.add_row(e["role"], e["bucket"], e["uri"],
                      "[red]missing[/]" if not ok else "[yellow]ok, rebuilt since[/]" if rebuilt else "ok")
    console.print(table)
    if stale:
        console.print(f"{_n(stale, 'variant')} rebuilt since installed (the server loads the module installed): "
                      "run `mlagen install` again to serve the new build")
    if missing:
        raise click.ClickException(f"{missing} installed module(s) missing: rebuild and run `mlagen install` again")


@main.command()
def uninstall() -> None:
    """Remove the installed state (SGLang's `mlagen` backend will then refuse to start): installed.json, when mlagen
    wrote it (recorded in the cache's manifest) or it is of mlagen's format; another file of that name stays."""
    from mlagen.sglang_plugin.installed import InstalledStateError, clear_installed, installed_path

    if not os.path.lexists(installed_path()):  # (no lock file on a machine with nothing installed)
        console.print("nothing was installed")
        return
    try:
        with _installed_lock():
            removed = clear_installed()
    except InstalledStateError as e:
        raise click.ClickException(str(e)) from None
    console.print(f"removed {installed_path()}" if removed else "nothing was installed")


if __name__ == "__main__":
    sys.exit(main())
