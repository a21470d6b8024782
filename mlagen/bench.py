"""Benchmark verified variants: CUDA-graph replay, median, inputs rotated so L2 cannot serve them.

Bytes per launch (the floor's memory term) = KV read once (bs * ctx * D * 2; * 1 for an fp8 e4m3 cache) + q (bs * q_len * H * D * 2)
+ out (bs * q_len * H * kv_lora_rank * 2); FLOPs = 2 * rows * ctx * (D + kv_lora_rank), rows = bs * q_len * H.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from mlagen.cases import make_problem
from mlagen.ops import VerifyKernel
from mlagen.roofline import verify_bytes, verify_flops

L2_ROTATE_BYTES = 256 << 20  # rotate inputs over at least this many bytes (H200 L2: 50 MB)
CONTEXTS = (4096, 16384, 65536)
BATCHES = (1, 4)


@dataclasses.dataclass
class Shape:
    """One benchmark shape: heads per rank, draft tokens per request, requests, context in tokens per request
    (draft tokens included: each request's kv_len), tokens per page."""

    heads: int
    q_len: int
    batch_size: int
    context: int
    page_size: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def copy_bandwidth_gbs(device=None, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 B/s), counting bytes read and written
    (2 * nbytes per copy): median of ``reps`` copies timed with CUDA events after 3 warm-ups.

    Raises:
        RuntimeError: no CUDA GPU visible to torch.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible to torch")
    device = torch.device(device if device is not None else "cuda")
    n = int(nbytes) // 16 * 16
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * n / (events_median_us(lambda: dst.copy_(src), reps) * 1e-6) / 1e9


def events_times_us(fn, reps: int, hide_host_cycles: int = 0) -> list[float]:
    """µs of each of ``reps`` calls of ``fn()``, each timed by a CUDA event pair on the current stream.

    hide_host_cycles > 0: before each call, a sleep kernel of that many GPU cycles is queued ahead of the
    start event (after a synchronize), so the host enqueues ``fn`` while the GPU is busy and the events
    time only ``fn``'s GPU work (pick more cycles than ``fn``'s host time)."""
    times = []
    for _ in range(reps):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hide_host_cycles:
            torch.cuda.synchronize()
            torch.cuda._sleep(int(hide_host_cycles))
        st.record()
        fn()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) * 1e3)
    return times


def events_median_us(fn, reps: int, hide_host_cycles: int = 0) -> float:
    """Median µs of ``fn()`` over ``reps`` calls (:func:`events_times_us`)."""
    return statistics.median(events_times_us(fn, reps, hide_host_cycles))


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``fn()``: run once on a side stream first (module load, shared-memory attribute,
    allocator warm-up, as torch's capture requires), then captured on the current device."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_time_us(launches: list, replays: int = 20, warmup: int = 3) -> float:
    """Median µs per launch: capture all ``launches`` (callables) in one CUDA graph, replay it."""
    def all_launches():
        for f in launches:
            f()
    g = capture_graph(all_launches)
    for _ in range(warmup):
        g.replay()
    return events_median_us(g.replay, replays) / len(launches)


def bench_kernel(kernel: VerifyKernel, shape: Shape, device="cuda", seed: int = 0) -> dict:
    """Time ``kernel`` at ``shape`` (CUDA-graph replay over input copies rotated past L2, :func:`graph_time_us`).

    Returns:
        dict: median_us (µs per launch), bytes (:func:`mlagen.roofline.verify_bytes`, the algorithmic minimum:
        KV once + q + out), gbs = bytes / median time in GB/s (1e9 B/s), flops
        (:func:`mlagen.roofline.verify_flops`), rotations (input copies).
    """
    v = kernel.variant
    fp8 = v.dtype == "fp8_e4m3"
    per = verify_bytes(shape.heads, shape.q_len, shape.batch_size, shape.context, v.dim_qk, v.dim_v,
                       kv_bytes=1 if fp8 else 2)
    n_rot = max(2, min(64, -(-L2_ROTATE_BYTES // per)))
    launches = []
    for r in range(n_rot):
        p = make_problem(v, [shape.context] * shape.batch_size, q_len=shape.q_len, device=device, seed=seed + r,
                         poison_pool=False, name="bench")
        if fp8:  # N(0, 1) rows cast to e4m3 on the device (no value near +-448: the cast cannot overflow)
            p = dataclasses.replace(p, kv_cache=p.kv_cache.to(torch.float8_e4m3fn))
        out = torch.empty(p.q.shape[0], v.heads, v.dim_v, dtype=torch.bfloat16, device=device)
        ws = kernel.alloc_workspace(shape.batch_size, device)
        launches.append(lambda p=p, out=out, ws=ws: kernel(p.q, p.kv_cache, p.block_table, p.kv_lens, out=out,
                                                           workspace=ws, **p.kernel_args()))
    us = graph_time_us(launches)
    return dict(median_us=us, gbs=per / (us * 1e-6) / 1e9, bytes=per,
                flops=verify_flops(shape.heads, shape.q_len, shape.batch_size, shape.context, v.dim_qk, v.dim_v),
                rotations=n_rot)
