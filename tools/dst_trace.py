"""Where a dimsplit_t step's cycles go, per warp role (GPU): the tile built with MLAGEN_DST_TRACE=1
(include/mlagen/mla_verify_dimsplit_t.cuh), whose consumer warps time their mbarrier waits with %clock64 and print,
for every cluster of row block 0 (blockIdx.x < 2: all splits and requests) of each launch, one line per warp. This script launches it on one problem per shape, reads
those lines (device printf, captured from fd 1) and prints per role the mean over the launches after the first,
those clusters' CTAs and the role's warps:

- cycles per sub-tile between the warp's first sub-tile and the end of its last one, and how many of them it spent
  inside each wait: the stage's copies (full), the peer CTA's scores (score warps) or the P^T buffer (output
  warps), the P^T buffer's release (score warps), the peer's read of the exchange buffer (score warps); in bf16
  builds the producer warp has a row too, its waits for a stage to empty in the first wait column; "busy" is the
  rest (the producer: its copies' issue and page-table reads);
- the cycles before the first sub-tile (the score warps' Q loads, the first stage) and after the last (row sums,
  epilogue), and the SM clock in GHz (%clock64 cycles over %globaltimer ns across the warp's whole span);
- the launch's timeline (%globaltimer ns): how far apart the CTAs start, a CTA's start to its cluster barrier, a
  CTA's start to its roles' end, and the first CTA's start to the last end (compare with the kernel's duration under
  ncu: what lies outside is launch and exit); and the cycles from the cluster barrier until a score warp's Q
  fragments have all landed, then until the first stage has (which of the two the first sub-tile waits for).

    python3 tools/dst_trace.py URI [--contexts 65536] [--batches 1,4] [--launches 4] [--define NAME=VALUE ...]
        [--per-warp] [--cold] [--build-only]

By default the launches repeat on one problem, so whatever fits in the L2 (at H8 bs 1: the KV up to ~32k tokens, Q,
the page table) is served from it after the first launch. ``--cold`` writes a buffer of
mlagen.bench.L2_ROTATE_BYTES before each launch, so every launch reads its inputs from DRAM, as the bench's rotated
CUDA-graph replays do.

The clock reads add a few instructions per wait, so the traced build is a little slower than the shipped one;
the bench, not this, gives µs. Builds go to $MLAGEN_ABLATE_DIR as tools/device_ab_define.py's do.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import math
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlagen.bench import L2_ROTATE_BYTES, make_problem  # noqa: E402
from mlagen.build import build_with_defines  # noqa: E402
from mlagen.ops import VerifyKernel  # noqa: E402
from mlagen.spec import Variant  # noqa: E402

LINE = re.compile(r"dst_trace cta (\d+) warp (\d+) role (\w+) sub (\d+) cycles (\d+) ns (\d+) before (\d+) "
                  r"after (\d+) wait (\d+) (\d+) (\d+) (\d+)(?: split (\d+) entry (\d+) t0 (\d+) end (\d+) q (\d+) s0 (\d+))?")
# the four wait slots of mla_verify_dimsplit_t.cuh (kTraceStage, kTracePeer, kTraceP, kTraceXEmpty) per role
# (bf16 builds: the producer warp has a row too, its waits for a stage to empty in the stage slot; its busy cycles
# are its copies' issue and its page-table reads)
WAITS = {"score": ("stage", "peer scores", "P^T free", "peer read"),
         "output": ("stage", "-", "P^T", "-"),
         "producer": ("ring free", "-", "-", "-")}


def parse(text: str) -> list[dict]:
    """The MLAGEN_DST_TRACE lines of ``text`` as dicts (ints; role a str); other lines are ignored."""
    rows = []
    for m in LINE.finditer(text):
        g = m.groups()
        row = dict(cta=int(g[0]), warp=int(g[1]), role=g[2], sub=int(g[3]), cycles=int(g[4]), ns=int(g[5]),
                   before=int(g[6]), after=int(g[7]), wait=[int(x) for x in g[8:12]])
        if g[12] is not None:  # the launch's timeline (absolute %globaltimer ns)
            row.update(split=int(g[12]), entry=int(g[13]), t0=int(g[14]), end=int(g[15]), q=int(g[16]),
                       s0=int(g[17]))
        rows.append(row)
    return rows


def timeline(launches: list[list[dict]]) -> dict | None:
    """The launch's timeline from the printed %globaltimer stamps, in ns, mean over every launch but the first
    (unless there is one): ``start_spread`` (last CTA start - first), ``to_barrier`` (a CTA's start to its cluster
    barrier, mean over CTAs), ``cta_span`` (a CTA's start to its last traced role's end, mean), ``span`` (first CTA
    start to the last role's end), ``q_ready`` (cycles from the cluster barrier until a score warp's Q fragments have
    all landed, mean over score warps; NaN without score lines), ``s0_ready`` (the same until the first stage has landed
    too: the score warps wait for Q first, then for the stage). Each warp reads the clocks itself, so a CTA's start
    and barrier are the earliest of its warps' stamps (the lines come in any order). Only the CTAs of row block 0
    print: with one row block (e.g. H8 q_len 9) that is the whole launch. None when some line carries no stamps (a
    build older than perf-notes v35)."""
    use = launches[1:] if len(launches) > 1 else launches
    if not use or any(not rows or any("entry" not in r for r in rows) for rows in use):
        return None
    per = []
    for rows in use:
        ctas = {}  # (split, cta) -> [earliest entry, earliest barrier, last end] over its traced warps
        for r in rows:
            c = ctas.setdefault((r["split"], r["cta"]), [r["entry"], r["t0"], r["end"]])
            c[0], c[1], c[2] = min(c[0], r["entry"]), min(c[1], r["t0"]), max(c[2], r["end"])
        entries = [c[0] for c in ctas.values()]
        q = [r["q"] for r in rows if r["role"] == "score"]
        s0 = [r["s0"] for r in rows if r["role"] == "score"]
        per.append(dict(start_spread=max(entries) - min(entries),
                        to_barrier=statistics.fmean(c[1] - c[0] for c in ctas.values()),
                        cta_span=statistics.fmean(c[2] - c[0] for c in ctas.values()),
                        span=max(c[2] for c in ctas.values()) - min(entries),
                        q_ready=statistics.fmean(q) if q else math.nan,
                        s0_ready=statistics.fmean(s0) if s0 else math.nan))
    return {k: statistics.fmean(x[k] for x in per) for k in per[0]}


def summarize(launches: list[list[dict]], per_warp: bool = False) -> list[dict]:
    """Per role (per_warp: per role and warp index), the mean over every launch but the first (unless there is
    one), those clusters' CTAs and the role's warps: cycles per sub-tile of the loop span and of each wait slot, before / after
    cycles, GHz. Raises ValueError when a launch printed no line (not a MLAGEN_DST_TRACE build, or the printf buffer
    overflowed)."""
    if not launches or any(not rows for rows in launches):
        raise ValueError("a launch printed no dst_trace line: is the module built with MLAGEN_DST_TRACE=1?")
    use = launches[1:] if len(launches) > 1 else launches
    out = []
    groups = sorted({(r["role"] != "score", r["role"], r["warp"] if per_warp else -1) for rows in use for r in rows})
    for _, role, warp in groups:
        rows = [r for rows in use for r in rows if r["role"] == role and warp in (-1, r["warp"])]
        per = []
        for r in rows:
            span = r["cycles"] - r["before"] - r["after"]
            sub = max(r["sub"], 1)
            per.append(dict(loop=span / sub, wait=[w / sub for w in r["wait"]], before=r["before"], after=r["after"],
                            ghz=r["cycles"] / max(r["ns"], 1), sub=r["sub"]))
        mean = lambda key: statistics.fmean(p[key] for p in per)  # noqa: E731
        waits = [statistics.fmean(p["wait"][i] for p in per) for i in range(4)]
        out.append(dict(role=role if warp < 0 else f"{role} warp {warp}", warps=len({(r["cta"], r["warp"]) for r in rows}), sub=mean("sub"),
                        loop=mean("loop"), wait=waits, busy=mean("loop") - sum(waits), before=mean("before"),
                        after=mean("after"), ghz=mean("ghz")))
    return out


def capture_fd1(fn) -> str:
    """What ``fn()`` and the kernels it launches write to file descriptor 1 (device printf goes there at the
    next synchronization), returned as text; fd 1 is restored even when ``fn`` raises."""
    libc = ctypes.CDLL(None)
    torch.cuda.synchronize()
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            fn()
            torch.cuda.synchronize()
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read().decode(errors="replace")


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("uri")
    ap.add_argument("--contexts", default="65536")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--launches", type=int, default=4, help="launches per shape (the first is not averaged)")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE: a further define of the build")
    ap.add_argument("--per-warp", action="store_true", help="a row per warp index instead of per role")
    ap.add_argument("--build-only", action="store_true",
                    help="build the trace module (cached for a later run) and stop")
    ap.add_argument("--cold", action="store_true",
                    help="evict the L2 before each launch (inputs from DRAM, as in the bench's rotated replays)")
    a = ap.parse_args()
    if a.launches < 1:
        sys.exit("--launches must be at least 1")
    defines = [("MLAGEN_DST_TRACE", "1")]
    for d in a.define:
        name, eq, value = d.partition("=")
        if not eq or not name or not value:
            sys.exit(f"--define takes NAME=VALUE, not {d!r}")
        if name == "MLAGEN_DST_TRACE":
            sys.exit("--define MLAGEN_DST_TRACE: the trace build sets it itself")
        defines.append((name, value))
    try:
        v = Variant.from_uri(a.uri)
    except ValueError as e:
        ap.error(str(e))
    if v.schedule != "dimsplit_t":
        sys.exit(f"{a.uri}: MLAGEN_DST_TRACE is a dimsplit_t define (schedule {v.schedule})")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU; nothing built or measured", file=sys.stderr)
        return 1
    from device_ab_define import diagnostic_dir

    major, minor = torch.cuda.get_device_capability()
    v = dataclasses.replace(v, archs=(f"sm_{major}{minor}",))
    mod, so = build_with_defines(v, defines, diagnostic_dir())
    if a.build_only:
        print(f"built 1 variant ({mod})")
        return 0
    k = VerifyKernel(v, so, mod)
    evict = torch.zeros(L2_ROTATE_BYTES // 4, dtype=torch.int32, device="cuda") if a.cold else None
    cold = ", L2 evicted before each launch" if a.cold else ""
    print(f"{a.uri} on {torch.cuda.get_device_name()}, build {mod}{cold}")
    for bs in map(int, a.batches.split(",")):
        for ctx in map(int, a.contexts.split(",")):
            pr = make_problem(v, [ctx] * bs, device="cuda", seed=5, poison_pool=False, name="trace")
            if v.dtype == "fp8_e4m3":
                pr = dataclasses.replace(pr, kv_cache=pr.kv_cache.to(torch.float8_e4m3fn))
            launches = []
            for _ in range(a.launches):
                if evict is not None:
                    evict.add_(1)  # (its own kernel, done before the traced launch starts)
                text = capture_fd1(lambda: k(pr.q, pr.kv_cache, pr.block_table, pr.kv_lens, **pr.kernel_args()))
                launches.append(parse(text))
            rows = summarize(launches, a.per_warp)
            print(f"\nbs {bs} ctx {ctx}: {k.num_splits(bs)} splits; cycles per sub-tile (mean of "
                  f"{len(launches) - 1 or 1} launches, every cluster of row block 0)")
            print("| role | warps | sub-tiles | cycles / sub-tile | wait: stage | wait 2 | wait 3 | wait 4 | busy | "
                  "before | after | GHz |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                names = WAITS[r["role"].split()[0]]
                w = " | ".join(f"{x:.0f} ({n})" for x, n in zip(r["wait"][1:], names[1:]))
                w0 = f"{r['wait'][0]:.0f}" + ("" if names[0] == "stage" else f" ({names[0]})")  # producer: ring free
                print(f"| {r['role']} | {r['warps']} | {r['sub']:.0f} | {r['loop']:.0f} | {w0} | {w} | "
                      f"{r['busy']:.0f} | {r['before']:.0f} | {r['after']:.0f} | {r['ghz']:.2f} |", flush=True)
            tl = timeline(launches)
            if tl is not None:
                how = "eager launch, cold L2" if a.cold else "eager launch"
                print(f"timeline (ns, {how}, printf build): CTA starts spread over {tl['start_spread']:.0f}; "
                      f"a CTA's start to its cluster barrier {tl['to_barrier']:.0f}; a CTA's start to its last role's "
                      f"end {tl['cta_span']:.0f}; first CTA start to the last end {tl['span']:.0f}; score warps' Q "
                      f"landed {tl['q_ready']:.0f} and the first stage {tl['s0_ready']:.0f} cycles after the cluster "
                      f"barrier", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
