"""Hardware ceilings and the byte/FLOP floor of the MLA verify problem.

Pure-python part (no torch needed, unit-tested on CPU):

    verify_bytes(H, q_len, bs, ctx)  bytes   KV read once + q read + out written
        = bs*ctx*576*2 + bs*q_len*H*576*2 + bs*q_len*H*512*2
    verify_flops(H, q_len, bs, ctx)  FLOP    QK^T (576) + PV (512) over all kv
        = 2 * rows * ctx * (576 + 512),  rows = bs*q_len*H
    floor_us(bytes, flops, copy_gbs, mma_tflops)  µs
        = max(bytes / copy_bw, flops / mma_rate)

ctx is the kv length INCLUDING the q_len draft tokens.  verify_flops counts every
(row, kv) pair, i.e. it ignores the few masked-out draft columns (< q_len/ctx).

Measured on the GPU (need torch + CUDA; mma also needs nvcc + pybind11):

    copy_bandwidth_gbs(device, nbytes=2<<30)  GB/s (1e9), read+write bytes counted
    mma_sync_tflops()                          TFLOP/s (1e12) of mma.sync m16n8k16 bf16
                                               (bench/mma_probe.cu; ~630-640 on H200)
    mma_sync_stream_table()                    the rate of 1-8 warps per scheduler with 1-12
                                               independent accumulators each, A from registers or
                                               ldmatrix (python3 bench/ceilings.py --mma-streams)
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlagen.roofline import verify_bytes, verify_flops  # noqa: E402,F401  (one definition, torch-free)

FLOP_PER_MMA = 2 * 16 * 8 * 16  # mma.sync m16n8k16


def copy_bandwidth_gbs(device=None, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 B/s, bytes read + written): mlagen.bench.copy_bandwidth_gbs
    (imported lazily: this module stays importable without torch), here with a 2 GiB copy by default.

    Raises:
        RuntimeError: no CUDA GPU visible to torch.
    """
    from mlagen.bench import copy_bandwidth_gbs as measure

    return measure(device, nbytes, reps)



# ---------------------------------------------------------------------------
# floors (pure python)
# ---------------------------------------------------------------------------

def floor_us(nbytes: float, flops: float, copy_gbs: float, mma_tflops: float) -> float:
    """Roofline floor in µs: max(bytes / (copy_gbs*1e9), flops / (mma_tflops*1e12)).

    Raises:
        ValueError: copy_gbs <= 0 or mma_tflops <= 0.
    """
    if copy_gbs <= 0 or mma_tflops <= 0:
        raise ValueError("ceilings must be positive")
    return max(nbytes / (copy_gbs * 1e9), flops / (mma_tflops * 1e12)) * 1e6


def verify_floor_us(H: int, q_len: int, bs: int, ctx: int,
                    copy_gbs: float, mma_tflops: float) -> float:
    """floor_us(verify_bytes(...), verify_flops(...), copy_gbs, mma_tflops), in µs.

    Raises:
        ValueError: copy_gbs <= 0 or mma_tflops <= 0.
    """
    return floor_us(verify_bytes(H, q_len, bs, ctx), verify_flops(H, q_len, bs, ctx),
                    copy_gbs, mma_tflops)


# ---------------------------------------------------------------------------
# copy bandwidth
# ---------------------------------------------------------------------------

# ---------------------------------------------------------------------------
# mma.sync rate
# ---------------------------------------------------------------------------

_HERE = os.path.dirname(os.path.abspath(__file__))
_ext = None


def nvcc_command(src: str, out: str, arch: tuple[int, int] | None = None) -> list[str]:
    """nvcc command line that builds mma_probe.cu into the extension `out`.
    arch=(9, 0) -> -gencode arch=compute_90,code=sm_90."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    import pybind11  # noqa: F401 - raise early if missing
    inc = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                         capture_output=True, text=True).stdout.split()
    cmd = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17", *inc]
    if arch is not None:
        a = f"{arch[0]}{arch[1]}"
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return cmd + [src, "-o", out]


def build_mma_probe(arch: tuple[int, int] | None = None, build_dir: str | None = None):
    """Compile bench/mma_probe.cu into ``build_dir`` (default: a new temp dir) and import it (module
    mma_probe_ext).  arch defaults to the current GPU's compute capability.  The first module is cached
    for the process: later calls return it and ignore their arch and build_dir.

    Raises:
        RuntimeError: nvcc failed (its command line and output in the message).
        ImportError: pybind11 is not installed.
    """
    global _ext
    if _ext is not None:
        return _ext
    if arch is None:
        import torch
        arch = torch.cuda.get_device_capability()
    build_dir = build_dir or tempfile.mkdtemp(prefix="mma_probe_")
    out = os.path.join(build_dir, "mma_probe_ext" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = nvcc_command(os.path.join(_HERE, "mma_probe.cu"), out, arch)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{r.stdout}\n{r.stderr}")
    loader = importlib.machinery.ExtensionFileLoader("mma_probe_ext", out)
    spec = importlib.util.spec_from_file_location("mma_probe_ext", out, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    _ext = mod
    return mod


def mma_sync_tflops(iters: int = 16384, threads: int = 256, ctas_per_sm: int = 4,
                    reps: int = 7, chains: int | None = None, ldsm: bool = False) -> float:
    """Sustained TFLOP/s (1e12) of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32:
    (threads/32) warps per CTA, ctas_per_sm * SMs CTAs, each warp iters*chains mmas
    (chains independent accumulators, default NACC = 8; ldsm: A fragments from shared
    memory by ldmatrix.x4 each round, one per two chains) on random bf16 fragments
    loaded from global.  Median of `reps` launches timed with CUDA events after 2
    warm-ups.  Raises RuntimeError on failure (no GPU, nvcc error, non-finite output)
    and ValueError (from the extension) for an unsupported chains / ldsm pair."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"torch not importable: {e}") from None
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible to torch")
    ext = build_mma_probe()
    chains = ext.NACC if chains is None else chains
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    blocks = sms * ctas_per_sm
    words = 1 << 16
    inp = torch.randn(2 * words, device=dev).to(torch.bfloat16).view(torch.int32)
    out = torch.empty(blocks * threads, dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream()
    sp = stream.cuda_stream

    def launch():
        ext.launch(inp.data_ptr(), words, out.data_ptr(), blocks, threads, iters, sp, chains, ldsm)

    for _ in range(2):
        launch()
    ext.sync(sp)
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(reps)]
    for a, b in evs:
        a.record(stream)
        launch()
        b.record(stream)
    ext.sync(sp)
    ms = statistics.median(a.elapsed_time(b) for a, b in evs)
    if not torch.isfinite(out).all():
        raise RuntimeError("mma_probe produced non-finite results")
    flop = blocks * (threads // 32) * iters * chains * ext.FLOP_PER_MMA
    return flop / (ms * 1e-3) / 1e12


def mma_sync_stream_table(warps_per_scheduler=(1, 2, 3, 4), chains=(1, 2, 3, 4, 6, 8, 12),
                          iters: int = 8192, report=None) -> list[dict]:
    """The mma.sync rate a few dependent instruction streams reach: one CTA per SM of
    4 x w warps (w per scheduler, at most 4: 512 threads), each warp `chains` independent
    accumulators, A in registers and (even chains) A by ldmatrix.  Rows: {'warps_per_scheduler',
    'chains', 'ldsm', 'tflops', 'fraction'} with fraction = tflops / the NACC = 8,
    32-warps-per-SM rate of mma_sync_tflops() measured first; `report(row)` is called with
    each row as it is measured.  Raises RuntimeError as mma_sync_tflops, ValueError for w > 4."""
    if any(not 1 <= w <= 4 for w in warps_per_scheduler):
        raise ValueError("warps_per_scheduler must be in [1, 4] (one CTA of at most 512 threads per SM)")
    peak = mma_sync_tflops()
    rows = []
    for w in warps_per_scheduler:
        for c in chains:
            for lds in (False, True):
                if lds and c % 2:
                    continue
                t = mma_sync_tflops(iters=iters, threads=128 * w, ctas_per_sm=1, chains=c, ldsm=lds)
                rows.append(dict(warps_per_scheduler=w, chains=c, ldsm=lds, tflops=t, fraction=t / peak))
                if report is not None:
                    report(rows[-1])
    return [dict(peak_tflops=peak)] + rows


def measure_ceilings(device=None) -> dict:
    """{'copy_gbs': float|None, 'mma_tflops': float|None, 'errors': {...}}; never raises."""
    res, errs = {"copy_gbs": None, "mma_tflops": None}, {}
    try:
        res["copy_gbs"] = copy_bandwidth_gbs(device)
    except Exception as e:  # noqa: BLE001
        errs["copy_gbs"] = f"{type(e).__name__}: {e}"
    try:
        res["mma_tflops"] = mma_sync_tflops()
    except Exception as e:  # noqa: BLE001
        errs["mma_tflops"] = f"{type(e).__name__}: {e}"
    res["errors"] = errs
    return res


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Measure this GPU's copy bandwidth (GB/s) and mma.sync rate (TFLOP/s) "
                                 "and print them as JSON.")
    ap.add_argument("--mma-streams", action="store_true",
                    help="instead: the mma.sync rate of 1-8 warps per scheduler with 1-12 independent accumulators "
                         "(a markdown table)")
    mma_streams = ap.parse_args().mma_streams
    if mma_streams:
        import torch

        if not torch.cuda.is_available():
            sys.exit("ceilings.py --mma-streams: needs a CUDA GPU (none visible to torch)")
        print("| warps per scheduler | chains per warp | A from | TFLOP/s | fraction of the 32-warp rate |")
        print("|---|---|---|---|---|")
        table = mma_sync_stream_table(report=lambda r: print(
            f"| {r['warps_per_scheduler']} | {r['chains']} | {'ldmatrix' if r['ldsm'] else 'registers'} | "
            f"{r['tflops']:.1f} | {r['fraction']:.3f} |", flush=True))
        print(f"mma.sync m16n8k16 bf16, 32 warps per SM x 8 chains: {table[0]['peak_tflops']:.1f} TFLOP/s")
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("ceilings.py: needs a CUDA GPU (none visible to torch); nothing measured")
        res = measure_ceilings()
        print(json.dumps(res, indent=1))
        if res["errors"]:
            sys.exit(1)  # (the JSON above names what could not be measured)
