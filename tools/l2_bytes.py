"""L2 -> SM and DRAM read bytes per KV byte of an mlagen variant, measured with Nsight Compute.

    python3 tools/l2_bytes.py URI [URI ...] [--ctx 65536] [--bs 1] [--ncu ncu] [--json] [--define NAME=VALUE ...]

For each uri (its H, q_len and page size are the uri's; default shape: 64k context, batch 1) this builds
the variant, runs it three times to warm up, then once between cudaProfilerStart and cudaProfilerStop,
which is all ncu profiles (`ncu --clock-control none --profile-from-start off`: every kernel of that one
call, partial and combine or whatever the variant launches), with the metrics

    l1tex__m_xbar2l1tex_read_bytes.sum   bytes L2 -> SM (L1TEX / shared memory, cp.async and bulk copies)
    dram__bytes_read.sum                 bytes read from DRAM
    lts__t_sectors_srcunit_tex_op_read.sum  32-byte sectors the L2 served to SM reads (the L2 side: a cluster's
                                         SM-to-SM distributed shared memory traffic, which the first metric
                                         counts too, never touches the L2)
    gpu__time_duration.sum               the kernel's time under the profiler (clocks not locked)

and prints one line per kernel: each byte count and its ratio to the KV bytes of the call
(bs * ctx * 576 * 2; 75.5 MB at 64k bs1). A kernel that reads each KV row once through L2 shows an
L2 -> SM ratio near 1; the rt1 bulk bn32 64k winner of b461c26 read 5.7x (430 MB). With --json, one JSON
object per uri instead (summary_record: per-kernel bytes and µs, and the call's totals over the KV bytes);
bench/run_bench.py reads that for its L2 -> SM column.
Needs a GPU and ncu; the CSV parsing and the report lines are CPU-tested.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("l1tex__m_xbar2l1tex_read_bytes.sum", "dram__bytes_read.sum", "gpu__time_duration.sum",
           "lts__t_sectors_srcunit_tex_op_read.sum")
SECTOR_BYTES = 32  # an L2 sector
D_QK = 576


def kv_bytes(bs: int, ctx: int, dim_qk: int = D_QK, elem_bytes: int = 2) -> int:
    """KV bytes one call must read: bs * ctx * dim_qk * elem_bytes (2: bf16, 1: an e4m3 cache)."""
    return bs * ctx * dim_qk * elem_bytes


def uri_kv_bytes(uri: str, bs: int, ctx: int) -> int:
    """:func:`kv_bytes` of a variant: its dim_qk and its KV cache's element size (fp8_e4m3: 1 byte).

    Raises:
        ValueError: ``uri`` is not an mlagen variant uri.
    """
    from mlagen.spec import Variant

    v = Variant.from_uri(uri)
    return kv_bytes(bs, ctx, v.dim_qk, 1 if v.dtype == "fp8_e4m3" else 2)


def ncu_command(uri: str, ctx: int, bs: int, ncu: str = "ncu", defines: list[str] | None = None) -> list[str]:
    """The ncu command line that profiles one call of ``uri`` (built with ``#define`` NAME VALUE for each
    "NAME=VALUE" of ``defines``: a diagnostic build, tools/device_ab_define.py's, outside the registry)."""
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--metrics", ",".join(METRICS),
            "--csv", "--print-units", "base", sys.executable, str(Path(__file__).resolve()), "--child", uri,
            "--ctx", str(ctx), "--bs", str(bs)] + [x for d in (defines or []) for x in ("--define", d)]


def _num(text: str) -> float:
    return float(text.replace(",", "").strip())


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu --csv (details page) -> [{id, name, metrics: {metric: value in base units}}] in launch order.
    Lines that are not part of the CSV report (==PROF== messages, the program's own output) are skipped."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    kernels: dict[str, dict] = {}
    header = None
    for row in csv.reader(io.StringIO("\n".join(lines))):
        if "Metric Name" in row and "Kernel Name" in row:
            header = {name: i for i, name in enumerate(row)}
            continue
        if header is None or len(row) < len(header):
            continue
        kid = row[header["ID"]]
        k = kernels.setdefault(kid, dict(id=int(kid), name=row[header["Kernel Name"]], metrics={}))
        try:
            k["metrics"][row[header["Metric Name"]]] = _num(row[header["Metric Value"]])
        except ValueError:
            pass  # a metric ncu could not collect ("n/a")
    return sorted(kernels.values(), key=lambda k: k["id"])


def short_name(name: str) -> str:
    """'void mla_verify_partial_kernel<Cfg<...>>(MlaVerifyParams)' -> 'mla_verify_partial_kernel'."""
    base = name.split("(")[0].split("<")[0].strip()
    return base.split()[-1] if base else name


def report_lines(kernels: list[dict], kv: int, uri: str = "") -> list[str]:
    """One line per kernel: L2 -> SM and DRAM read bytes, each over the KV bytes, and the time."""
    out = []
    for k in kernels:
        m = k["metrics"]
        l2, dram, t = m.get(METRICS[0]), m.get(METRICS[1]), m.get(METRICS[2])
        s = f"{short_name(k['name'])}:"
        s += f" L2->SM {l2 / 1e6:8.1f} MB = {l2 / kv:5.2f} x KV" if l2 is not None else " L2->SM n/a"
        s += f" | DRAM read {dram / 1e6:8.1f} MB = {dram / kv:5.2f} x KV" if dram is not None else " | DRAM read n/a"
        l2r = m.get(METRICS[3])
        if l2r is not None:  # read at the L2 side: excludes the cluster's SM-to-SM (distributed shared memory) bytes
            s += f" | L2 read by SMs {l2r * SECTOR_BYTES / 1e6:8.1f} MB = {l2r * SECTOR_BYTES / kv:5.2f} x KV"
        s += f" | {t / 1e3:7.1f} us" if t is not None else ""
        s += f" | KV {kv / 1e6:.1f} MB" + (f" | {uri}" if uri else "")
        out.append(s)
    return out


def summary_record(kernels: list[dict], kv: int, uri: str) -> dict:
    """One call's traffic as a JSON-ready dict: {uri, kv_bytes, kernels: [{name, l2_sm_bytes, dram_read_bytes, us}],
    l2_sm_per_kv, dram_per_kv} where the two ratios sum every kernel of the call (partial and combine) over the KV
    bytes; a ratio is None when ncu reported the metric for no kernel."""
    rows = [dict(name=short_name(k["name"]), l2_sm_bytes=k["metrics"].get(METRICS[0]),
                 dram_read_bytes=k["metrics"].get(METRICS[1]),
                 us=k["metrics"][METRICS[2]] / 1e3 if METRICS[2] in k["metrics"] else None,
                 l2_read_bytes=(k["metrics"][METRICS[3]] * SECTOR_BYTES if METRICS[3] in k["metrics"] else None))
            for k in kernels]

    def ratio(key: str):
        vals = [r[key] for r in rows if r[key] is not None]
        return sum(vals) / kv if vals else None

    return dict(uri=uri, kv_bytes=kv, kernels=rows, l2_sm_per_kv=ratio("l2_sm_bytes"),
                dram_per_kv=ratio("dram_read_bytes"), l2_read_per_kv=ratio("l2_read_bytes"))


def _child(uri: str, ctx: int, bs: int, defines: list[str] | None = None) -> None:
    """Build and run the variant; the fourth call is the profiled one (between profiler start and stop). With
    ``defines``, a diagnostic build for this GPU's arch in $MLAGEN_ABLATE_DIR (tools/device_ab_define.py's)."""
    sys.path.insert(0, str(ROOT))
    import dataclasses

    import torch

    from mlagen.build import build_variants
    from mlagen.cases import make_problem
    from mlagen.ops import VerifyKernel
    from mlagen.spec import Variant

    v = Variant.from_uri(uri)
    if defines:
        sys.path.insert(0, str(ROOT / "tools"))
        from device_ab_define import diagnostic_dir

        from mlagen.build import build_with_defines

        major, minor = torch.cuda.get_device_capability()
        v = dataclasses.replace(v, archs=(f"sm_{major}{minor}",))
        mod, so = build_with_defines(v, [tuple(d.split("=", 1)) for d in defines], diagnostic_dir())
        k = VerifyKernel(v, so, mod)
    else:
        b = build_variants(v.spec_dict("l2bytes"), kernels=v.uri)[0]
        k = VerifyKernel(b.variant, b.so_path)
    p = make_problem(v, [ctx] * bs, device="cuda", poison_pool=False, seed=0)
    ws = k.alloc_workspace(bs, "cuda")
    out = torch.empty(p.q.shape[0], v.heads, v.dim_v, dtype=torch.bfloat16, device="cuda")
    call = lambda: k(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out, workspace=ws, **p.kernel_args())  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"splits {k.num_splits(bs)}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("uris", nargs="+", metavar="URI")
    ap.add_argument("--ctx", type=int, default=65536, help="context (kv length, draft tokens included); default 64k")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--ncu", default=os.environ.get("NCU", "ncu"))
    ap.add_argument("--json", action="store_true", help="one JSON object per uri (summary_record) instead of text")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="profile a diagnostic build with #define NAME VALUE (repeatable; e.g. MLAGEN_ABLATE=1)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # internal: the profiled process
    a = ap.parse_args(argv)
    bad = [d for d in a.define if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=[A-Za-z0-9_]+", d)]
    if bad:
        ap.error(f"--define takes NAME=VALUE (an upper-case macro name, a plain value), got {bad[0]!r}")
    if a.child:
        _child(a.uris[0], a.ctx, a.bs, a.define)
        return 0
    try:
        kvs = {uri: uri_kv_bytes(uri, a.bs, a.ctx) for uri in a.uris}
    except ValueError as e:
        ap.error(str(e))
    if shutil.which(a.ncu) is None:
        ap.error(f"ncu not found ({a.ncu!r}; set --ncu or NCU, e.g. /usr/local/cuda/bin/ncu)")
    rc = 0
    for uri in a.uris:
        kv = kvs[uri]
        r = subprocess.run(ncu_command(uri, a.ctx, a.bs, a.ncu, a.define), capture_output=True, text=True)
        kernels = parse_ncu_csv(r.stdout)
        if r.returncode != 0 or not kernels:
            why = f"ncu exit {r.returncode}, {len(kernels)} kernels profiled"
            if a.json:
                print(json.dumps(dict(uri=uri, error=why, tail=(r.stdout + r.stderr)[-2000:])), flush=True)
            else:
                print(f"{uri}: {why}\n{(r.stdout + r.stderr)[-2000:]}")
            rc = 1
            continue
        if a.json:
            print(json.dumps(summary_record(kernels, kv, uri)), flush=True)
            continue
        for line in report_lines(kernels, kv, uri):
            print(line, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
