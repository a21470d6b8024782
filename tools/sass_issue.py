"""Static issue view of a variant's loops, from its SASS (no GPU): what one warp's instruction stream costs per
iteration before any other warp or memory gets in the way.

    python3 tools/sass_issue.py URI [--arch sm_90|sm_120] [--define NAME=VALUE ...] [--min-hmma 20] [--sass FILE]
        [--cuobjdump PATH] [--skip-blocks N]

Builds the variant for one arch as tools/device_ab_define.py builds a diagnostic module (``#define`` lines ahead
of the rendered source; under $MLAGEN_ABLATE_DIR, cached by build key), disassembles it with cuobjdump, finds
every loop of the partial kernel (a branch back to an earlier address) that holds at least --min-hmma HMMA
instructions, and prints per loop:

- instructions, HMMA / LDSM / SHFL / MUFU / STS counts;
- the sum of the stall counts ptxas wrote into the control bits (the cycles the warp waits after each instruction
  before issuing its next one; bits 41-44 of the second 64-bit word, as decoded by the open Volta-and-later SASS
  encoders, e.g. Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018): the
  loop's shortest issue time for one warp alone;
- a single-warp scoreboard model: each instruction also waits for the scoreboards in its wait mask, which a
  variable-latency instruction (LDSM, LDS, SHFL, MUFU, ...) releases LATENCY cycles after it issues (assumed
  latencies below, not measured); barrier waits succeed at once, and a branch inside the loop is taken as not taken;
- the shared-memory bytes its ldmatrix instructions read per iteration (x4: 512 B, x2: 256 B per warp);
- with --skip-blocks N, for each forward conditional branch in the loop that jumps over at least N instructions
  (e.g. the dimsplit_t output warps' O^T rescale, 144 FMULs, which runs only when a row max moved), the same counts
  for the iteration that takes the branch: the path a step runs when the block is skipped;

and then the code outside those loops (what a warp runs once per call: prologue, epilogue, untaken paths): its
instructions, subroutine calls (slow paths), branch-sync regions, global stores and loads. That code is fetched cold
and issued in order; on the H200 the dimsplit_t epilogue's per-row divisions cost ~1.6 µs per call (perf-notes v31b).

These are lower bounds for one warp; a measured step (docs/perf-notes.md) adds the other warps of the scheduler
(tensor pipe and issue slots), the shared-memory pipe of the SM and every wait. --sass FILE writes the whole
disassembly. Needs nvcc and cuobjdump (next to nvcc, or on PATH).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from device_ab_define import diagnostic_dir  # noqa: E402  (tools/ is this script's directory)
from mlagen.build import build_with_defines  # noqa: E402
from mlagen.ninja_gen import nvcc_path  # noqa: E402
from mlagen.spec import Variant  # noqa: E402

# Assumed result latencies (cycles) of variable-latency instructions, for the scoreboard model only.
LATENCY = {"LDSM": 33, "LDS": 30, "SHFL": 26, "MUFU": 22, "S2R": 25, "S2UR": 25, "LDC": 25, "LDG": 600,
           "SYNCS": 30, "VOTE": 6, "F2FP": 6, "STAS": 30, "STS": 20, "BAR": 20}
DEFAULT_LATENCY = 10
READ_RELEASE = 15  # cycles after issue at which an instruction's read scoreboard (source registers) is released

_INS_RE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]+) \*/")
_HI_RE = re.compile(r"/\* (0x[0-9a-f]+) \*/")
_PRED_RE = re.compile(r"^@!?U?P\w+\s+")


def parse_sass(text: str, function_substr: str) -> list[dict]:
    """Instructions of the first function whose name contains ``function_substr`` in cuobjdump -sass ``text``:
    dicts with addr, text, op (opcode without predicate), stall, yield_, wbar, rbar, wait (mask)."""
    out, inside = [], False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "Function :" in line:
            if inside:
                break
            inside = function_substr in line
            continue
        if not inside:
            continue
        m = _INS_RE.match(line)
        if not m or i + 1 >= len(lines):
            continue
        hi_m = _HI_RE.search(lines[i + 1])
        if not hi_m:
            continue
        hi = int(hi_m.group(1), 16)
        body = m.group(2).strip()
        out.append(dict(addr=int(m.group(1), 16), text=body, op=_PRED_RE.sub("", body).split()[0],
                        stall=(hi >> 41) & 0xF, yield_=(hi >> 45) & 1, wbar=(hi >> 46) & 7, rbar=(hi >> 49) & 7,
                        wait=(hi >> 52) & 0x3F))
    return out


def loop_spans(ins: list[dict]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of every loop: a branch back to an earlier address within the function,
    with no EXIT between (a retry branch placed after the function's exit, e.g. of an mbarrier try-wait, jumps back
    over the rest of the function: not a loop of its own). Nested loops give a span each."""
    index = {x["addr"]: k for k, x in enumerate(ins)}
    spans = []
    for k, x in enumerate(ins):
        if not x["op"].startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)\s*$", x["text"])
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < x["addr"] and target in index:
            first = index[target]
            if not any(y["op"] == "EXIT" for y in ins[first:k + 1]):
                spans.append((first, k))
    return spans


def loops(ins: list[dict], min_hmma: int) -> list[tuple[int, int]]:
    """The spans of :func:`loop_spans` holding at least ``min_hmma`` HMMA; a loop that contains a listed one is
    left out (the innermost hot loops)."""
    found = [(a, b) for a, b in loop_spans(ins) if sum(1 for y in ins[a:b + 1] if y["op"].startswith("HMMA")) >= min_hmma]
    found.sort(key=lambda r: r[1] - r[0])
    kept = []
    for r in found:
        if not any(r[0] <= s[0] and s[1] <= r[1] for s in kept):
            kept.append(r)
    return sorted(kept)


def skipped_blocks(body: list[dict], min_len: int) -> list[tuple[int, int]]:
    """(branch, target) indices in ``body`` (one loop iteration) of each predicated forward branch whose target lies in
    ``body`` at least ``min_len`` instructions past the branch: the blocks an iteration can skip."""
    index = {x["addr"]: k for k, x in enumerate(body)}
    out = []
    for k, x in enumerate(body):
        if not (x["op"].startswith("BRA") and x["text"].startswith("@")):
            continue
        m = re.search(r"0x([0-9a-f]+)\s*$", x["text"])
        target = index.get(int(m.group(1), 16)) if m else None
        if target is not None and target - k - 1 >= min_len:
            out.append((k, target))
    return out


def _latency(op: str) -> int:
    for k, v in LATENCY.items():
        if op.startswith(k):
            return v
    return DEFAULT_LATENCY


def issue_model(body: list[dict]) -> int:
    """Cycles for one warp to issue ``body`` once: stall counts plus scoreboard waits (see the module text)."""
    t, board = 0, [0] * 6
    for x in body:
        start = max([t] + [board[k] for k in range(6) if (x["wait"] >> k) & 1])
        if x["wbar"] != 7:
            board[x["wbar"]] = start + _latency(x["op"])
        if x["rbar"] != 7:
            board[x["rbar"]] = max(board[x["rbar"]], start + READ_RELEASE)
        t = start + max(x["stall"], 1)
    return t


def ldsm_bytes(body: list[dict]) -> int:
    """Shared-memory bytes a warp's ldmatrix instructions in ``body`` read (x4: 512, x2: 256, x1: 128)."""
    n = 0
    for x in body:
        if x["op"].startswith("LDSM"):
            n += 512 if x["op"].endswith(".4") else 256 if x["op"].endswith(".2") else 128
    return n


def summary(body: list[dict]) -> dict:
    """Counts and the two issue times of one loop body."""
    ops = collections.Counter(x["op"].split(".")[0] for x in body)
    return dict(instructions=len(body), hmma=ops["HMMA"], ldsm=ops["LDSM"], shfl=ops["SHFL"], mufu=ops["MUFU"],
                sts=ops["STS"] + ops["STAS"], stall_sum=sum(max(x["stall"], 1) for x in body),
                model=issue_model(body), ldsm_bytes=ldsm_bytes(body),
                hmma_stall_mean=(sum(x["stall"] for x in body if x["op"].startswith("HMMA")) / ops["HMMA"]
                                 if ops["HMMA"] else 0.0))


def outside_loops(ins: list[dict]) -> dict:
    """Counts over the instructions of ``ins`` in no loop at all (:func:`loop_spans`: hot or not, inner or outer; the
    code a warp runs once per call: its prologue and epilogue, plus paths it never takes): instructions, subroutine
    calls (CALL: e.g. the slow paths of IEEE division and log2f), branch-sync regions (BSSY), global stores (STG) and
    loads (LDG)."""
    inside = set()
    for first, last in loop_spans(ins):
        inside.update(range(first, last + 1))
    rest = [x for k, x in enumerate(ins) if k not in inside]
    ops = collections.Counter(x["op"].split(".")[0] for x in rest)
    return dict(instructions=len(rest), call=ops["CALL"], bssy=ops["BSSY"], stg=ops["STG"], ldg=ops["LDG"])


def cuobjdump_path(given: str | None = None) -> str:
    """``given`` (--cuobjdump), else cuobjdump next to nvcc, else on PATH.

    Raises:
        SystemExit: none of them exists.
    """
    if given:
        if not Path(given).is_file():
            raise SystemExit(f"sass_issue.py: --cuobjdump {given}: no such file")
        return given
    beside = Path(nvcc_path()).parent / "cuobjdump"
    if beside.exists():
        return str(beside)
    found = shutil.which("cuobjdump")
    if not found:
        raise SystemExit("sass_issue.py: cuobjdump not found next to nvcc or on PATH (give it with --cuobjdump)")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("uri")
    ap.add_argument("--arch", default="sm_90", choices=("sm_90", "sm_120"))
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--min-hmma", type=int, default=20)
    ap.add_argument("--kernel", default="partial_kernel|dimsplit_t_kernel|dimsplit_kernel",
                    help="regex: which kernel of the module (first match)")
    ap.add_argument("--sass", metavar="FILE", help="also write the whole disassembly here")
    ap.add_argument("--cuobjdump", metavar="PATH", help="the cuobjdump to use (default: next to nvcc, else on PATH)")
    ap.add_argument("--skip-blocks", type=int, default=0, metavar="N",
                    help="also count each loop's path past every conditional block of at least N instructions")
    a = ap.parse_args()
    cuobjdump = cuobjdump_path(a.cuobjdump)
    try:
        v = Variant.from_uri(a.uri)
    except ValueError as e:
        raise SystemExit(f"sass_issue.py: {e}") from None
    defines = []
    for d in a.define:
        name, sep, value = d.partition("=")
        if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            raise SystemExit(f"sass_issue.py: --define wants NAME=VALUE, got {d!r}")
        defines.append((name, value))
    # the project's diagnostic build (tools/device_ab_define.py: cached by build key), for this one arch
    try:
        _, so = build_with_defines(dataclasses.replace(v, archs=(a.arch,)), defines, diagnostic_dir())
    except RuntimeError as e:  # nvcc failed (compile_diagnostic: the tail of its output)
        raise SystemExit(f"sass_issue.py: {e}") from None
    r = subprocess.run([cuobjdump, "-sass", "-arch", a.arch, str(so)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"sass_issue.py: cuobjdump failed: {r.stderr.strip()[-500:]}")
    text = r.stdout
    if a.sass:
        Path(a.sass).write_text(text)
    names = [ln.split("Function :", 1)[1].strip() for ln in text.splitlines() if "Function :" in ln]
    pick = next((n for n in names if re.search(a.kernel, n)), None)
    if pick is None:
        raise SystemExit(f"sass_issue.py: no kernel matching {a.kernel!r} in {', '.join(names)}")
    ins = parse_sass(text, pick)
    print(f"{a.uri} ({a.arch}{', ' + ', '.join(a.define) if a.define else ''}): {len(ins)} instructions in {pick[:90]}")
    print("| loop (addresses) | instructions | HMMA | LDSM | SHFL | MUFU | STS | HMMA stall mean | stall sum (cycles) "
          "| scoreboard model (cycles) | ldmatrix bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    found = loops(ins, a.min_hmma)
    def row(label: str, body: list[dict]) -> None:
        s = summary(body)
        print(f"| {label} | {s['instructions']} | {s['hmma']} | {s['ldsm']} | {s['shfl']} | {s['mufu']} | {s['sts']} | "
              f"{s['hmma_stall_mean']:.1f} | {s['stall_sum']} | {s['model']} | {s['ldsm_bytes']} |")

    for first, last in found:
        body = ins[first:last + 1]
        row(f"{ins[first]['addr']:#x}-{ins[last]['addr']:#x}", body)
        for k, target in skipped_blocks(body, a.skip_blocks) if a.skip_blocks > 0 else []:
            row(f"  past {body[k + 1]['addr']:#x}-{body[target - 1]['addr']:#x} ({target - k - 1} skipped)",
                body[:k + 1] + body[target:])
    o = outside_loops(ins)
    print(f"outside every loop (run once per call, from a cold instruction cache): {o['instructions']} instructions, "
          f"{o['call']} CALL, {o['bssy']} BSSY, {o['stg']} STG, {o['ldg']} LDG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
