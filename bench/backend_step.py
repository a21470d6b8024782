"""Verify-step time of the mlagen SGLang backend vs SGLang's own Triton backend (one GPU job).

Same stand-ins as tests/test_sglang_backend_gpu.py (a real RadixAttention layer, EagleVerifyInput
with SGLang's custom tree mask, req_to_token, an MLA KV pool): each backend captures
``init_forward_metadata_in_graph`` + ``forward_extend`` (TARGET_VERIFY) in a CUDA graph as SGLang's
CUDA-graph runner does; the time is the median of CUDA-event-timed replays (µs) of the captured
step, with the batch's metadata set once out of graph after capture. Also reports the eager step
(metadata + forward, timed together) and its excess over the captured step (the bar: <= 60 µs for
one layer), also with the metadata launch the kernel's run_direct replaces (same process), and, for the first batch size and context, the host time of an eager step through
``--layers`` layers (61: DeepSeek-V3 / Kimi-K2) with mlagen's per-batch check + per-layer launch, with
the fully checked call per layer (``VerifyKernel.__call__``), and Triton's.

    python3 bench/backend_step.py --contexts 16384,65536 --batches 1,4     # H=8, q_len=9, page_size 1
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from mlagen.bench import events_median_us, events_times_us  # noqa: E402


def _load_test_module():
    spec = importlib.util.spec_from_file_location("sgl_gpu_test", ROOT / "tests" / "test_sglang_backend_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _profile(fn, title: str, reps: int = 5) -> None:
    """Print the ops with the most host (self CPU) time over ``reps`` calls of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    print(f"\n# {title} ({reps} calls)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def _timeline(fn, title: str, reps: int = 7) -> None:
    """Print one eager step's timeline from torch.profiler (kineto: CPU and GPU on one clock): the host's
    launches and the GPU's kernels / copies, µs from the step's start, for the step of median length of
    ``reps`` (each started on an idle GPU, as the eager timing is)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    import warnings

    fn()
    with warnings.catch_warnings(record=True) as caught:  # torch ops that wait for the GPU (pageable copies, .item())
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sorted({str(w.message).splitlines()[0][:120] for w in caught})
    print(f"\n# {title}: {len(syncs)} synchronizing torch ops" + "".join(f"\n    {m}" for m in syncs))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            torch.cuda.synchronize()
            with record_function(f"eager_step_{i}"):
                fn()
            torch.cuda.synchronize()
    evs = list(prof.events())
    steps = sorted((e for e in evs if e.name.startswith("eager_step_") and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    ends = [s.time_range.start for s in steps[1:]] + [float("inf")]
    rows_of = []
    for st, nxt in zip(steps, ends):
        t0 = st.time_range.start
        gpu = [e for e in evs if e.device_type == DeviceType.CUDA and t0 <= e.time_range.start < nxt]
        api = [e for e in evs if e.device_type == DeviceType.CPU and t0 <= e.time_range.start < nxt
               and (("Launch" in e.name and e.name.startswith("cu")) or "Memcpy" in e.name or "Memset" in e.name
                    or "Synchronize" in e.name)]
        end = max([st.time_range.end] + [e.time_range.end for e in gpu])
        rows_of.append((end - t0, st, gpu, api))
    rows_of.sort(key=lambda r: r[0])
    span, st, gpu, api = rows_of[len(rows_of) // 2]
    t0 = st.time_range.start
    print(f"\n# timeline of {title}: host {st.time_range.end - t0:.1f} µs, last GPU work ends at {span:.1f} µs "
          f"(median of {reps}; spans {', '.join(f'{r[0]:.0f}' for r in rows_of)})")
    marks = [(e.time_range.start - t0, f"host  {e.name} ({e.time_range.end - e.time_range.start:.1f} µs)") for e in api]
    marks += [(e.time_range.start - t0, f"GPU   {e.name[:70]} until {e.time_range.end - t0:.1f} "
               f"({e.time_range.end - e.time_range.start:.1f} µs)") for e in gpu]
    for t, what in sorted(marks):
        print(f"  {t:8.1f}  {what}")


EAGER_BAR_US = 60.0  # eager step <= captured step + this, for one layer


def _set_direct(be, on: bool) -> None:
    """Whether mlagen's eager steps let the kernel read SGLang's batch state (run_direct) or launch the
    metadata fill first."""
    be.direct_eager = on


def _host_us(fn, reps: int) -> float:
    """Median host (wall) time of ``fn`` in µs: from the call to its return, the GPU idle at the start."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def _checked_launch(kernel):
    """``kernel.launch`` through the fully checked call (every tensor checked on every layer)."""
    def launch(batch, q, kv_cache, out, softmax_scale, lse=None, new_kv=()):
        out3 = out.view(out.shape[0], -1, kernel.variant.dim_v)  # the backend passes out 2-D [T, H * 512]
        kernel(q, kv_cache, batch.block_table, batch.kv_lens, q_len=batch.q_len, softmax_scale=softmax_scale,
               tree_mask=batch.tree_mask, out=out3, lse=lse, workspace=batch.workspace)
        return out, lse
    return launch


def _breakdown(be, layer, fb, b, T, reps: int) -> None:
    """Host µs (median, GPU idle at each start) of the parts of one eager step of mlagen's backend."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    be.init_forward_metadata(fb)
    meta = be.forward_metadata
    kern, batch = meta.kernel, meta.batch
    H = layer.tp_q_head_num
    qv = b.q.reshape(-1, H, layer.qk_head_dim)
    out = b.q.new_empty((qv.shape[0], H, layer.v_head_dim))
    kv = be.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v = b.k[..., :512]
    parts = [
        ("init_forward_metadata", lambda: be.init_forward_metadata(fb)),
        ("forward_extend (KV write + launch)", lambda: T._forward(be, layer, fb, b.q, b.k, "verify")),
        ("metadata + forward_extend", lambda: (be.init_forward_metadata(fb), T._forward(be, layer, fb, b.q, b.k, "verify"))),
        ("pool.set_kv_buffer (SGLang)", lambda: be.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(fb), b.k, v)),
        ("kernel.launch (partial + combine)", lambda: kern.launch(batch, qv, kv, out, 0.1)),
        ("empty CUDA launch (torch add_)", lambda: out.add_(0)),
        ("out = q.new_empty([T, H * 512]) (CUDA caching allocator)", lambda: b.q.new_empty((qv.shape[0], H * 512))),
        ("pool.get_key_buffer (SGLang)", lambda: be.token_to_kv_pool.get_key_buffer(layer.layer_id)),
        ("draft-row arguments (backend._new_kv)", lambda: be._new_kv(b.k, fb, qv.shape[0], layer.qk_head_dim)),
    ]
    print("\nhost µs of the parts of one eager step (median; GPU idle at each start)\n\n| part | host µs |\n|---|---|")
    for label, fn in parts:
        fn()
        print(f"| {label} | {_host_us(fn, reps):.1f} |")
    plan = be._plans.get(("verify", False))
    filler = plan[8] if plan is not None else None
    if filler is not None:  # the step's filler launches through the module it holds
        import types

        module = filler._module
        try:
            filler._module = types.SimpleNamespace(fill_metadata=lambda *x: None)
            print(f"| init_forward_metadata, the metadata launch a no-op (Python only) | "
                  f"{_host_us(lambda: be.init_forward_metadata(fb), reps):.1f} |")
        finally:
            filler._module = module
    be.init_forward_metadata(fb)
    try:
        kern.launch = lambda *x, **kw: None
        print(f"| forward_extend, kernel.launch a no-op (Python only) | "
              f"{_host_us(lambda: T._forward(be, layer, fb, b.q, b.k, 'verify'), reps):.1f} |")
    finally:
        kern.__dict__.pop("launch", None)


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--q-len", type=int, default=9)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--contexts", default="16384,65536")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile-eager", action="store_true",
                    help="also print torch.profiler's top ops of each backend's eager step (first bs and context)")
    ap.add_argument("--timeline", action="store_true",
                    help="also print one eager step's host launches and GPU kernels on one clock (torch.profiler), "
                         "for each backend and shape")
    ap.add_argument("--layers", type=int, default=61,
                    help="layers of the host-time eager step (first bs and context; 0: skip)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print the host time (µs, GPU idle at the start) of each part of mlagen's one-layer eager "
                         "step (first bs and context): metadata, the KV write, the kernel launch")
    ap.add_argument("--schedule", choices=("dimsplit_t", "rowblock"), default="dimsplit_t",
                    help="the variant's schedule: dimsplit_t (default; lw128 bn32 st4, the H200 bench's fastest tile for H 8 "
                         "target verify) or rowblock (bulk bn32 w8 rt1 st2)")
    ap.add_argument("--uri", help="which of the variants built here to use (default: the one built)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU; nothing measured", file=sys.stderr)
        return 1
    T = _load_test_module()
    sgl = T.import_sglang(lambda why: sys.exit(f"SGLang backend step not measured: {why}"), master_port=29671)
    from mlagen.build import build_variants
    from mlagen.ops import load_so

    H, q, ps = a.heads, a.q_len, a.page_size
    ctxs = [int(c) for c in a.contexts.split(",")]
    bss = [int(b) for b in a.batches.split(",")]
    T.WIDTH = max(ctxs) + 2 * q + ps  # req_to_token columns
    T.MAX_BS = max(bss)
    if a.schedule == "dimsplit_t":
        from mlagen.feasibility import dimsplit_t_num_warps, dimsplit_t_row_tiles

        rt = dimsplit_t_row_tiles(H * q)
        spec = dict(name="backend-step-dst", heads_per_rank=H, q_len=q, page_size=ps, nsplit="auto", load_width=128,
                    block_n=32, num_warps=dimsplit_t_num_warps(rt), row_tiles=rt, stages=4, schedule="dimsplit_t", mask="tree")
    else:
        spec = dict(name="backend-step", heads_per_rank=H, q_len=q, page_size=ps, nsplit="auto", load_width="bulk",
                    block_n=32, num_warps=8, row_tiles=1, stages=2, mask="tree")
    built = build_variants(spec)
    if a.uri:
        built = [b for b in built if b.uri == a.uri] or sys.exit(f"--uri {a.uri} is not built by {spec}")
    k = load_so(built[0].uri, str(built[0].so_path))
    print(f"mlagen variant: {built[0].uri}")
    runner, ref, ours, layer = T._make_backends(sgl, {("verify", H, ps, "tree"): k}, H, ps, q, "verify", "tree")
    gen = torch.Generator().manual_seed(7)
    print(f"\n| H | q_len | bs | ctx | mlagen graph µs | Triton graph µs | speedup | mlagen eager µs | Triton eager µs "
          f"| mlagen eager - graph µs (<= {EAGER_BAR_US:.0f}) | the same with the metadata launch | mlagen eager GPU µs "
          f"(host hidden) | mlagen eager µs quartiles | max |diff| |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    host_rows, failed = [], []
    for bs in bss:
        T_tok = bs * q
        for name, be in (("ref", ref), ("ours", ours)):
            be.init_cuda_graph_state(bs, T_tok)
        for ctx in ctxs:
            b = T._Batch(sgl, runner, "verify", q, bs, True, gen, lens=[ctx] * bs)
            res, outs = {}, {}
            for name, be in (("ref", ref), ("ours", ours)):
                # host lengths read here once, as the scheduler hands them over; the custom mask each backend gets
                # from SGLang's draft stage: mlagen's verify mask is QLEN_ONLY (q x q cells per request), Triton's
                # FULL_MASK
                fb_eager = b.forward_batch(b.qlen_mask if name == "ours" else None)

                def eager(be=be, fb=fb_eager):
                    be.init_forward_metadata(fb)
                    return T._forward(be, layer, fb, b.q, b.k, "verify")
                outs[name] = eager().float()
                for _ in range(10):  # warm the host path (allocator, caches, the interpreter's specializations)
                    eager()
                torch.cuda.synchronize()
                # each eager step starts on an idle GPU; its time varies with the host (scheduling, clocks),
                # so the median of --reps steps, with the quartiles printed beside it
                ts = events_times_us(eager, max(4, a.reps))
                res[name + "_eager"] = statistics.median(ts)
                q1, _, q3 = statistics.quantiles(ts, n=4)
                res[name + "_eager_iqr"] = f"{q1:.0f}-{q3:.0f}"
                if name == "ours":
                    res["direct"] = bool(getattr(be.forward_metadata.batch, "direct", False))
                # the eager step's GPU time with the host hidden (~1 ms of sleep queued ahead of it)
                res[name + "_eager_gpu"] = events_median_us(eager, max(4, a.reps), hide_host_cycles=2_000_000)
                # the host's own time (call to return, GPU idle at the start): with the GPU time above it splits
                # the eager step into host and GPU; printed, not tabled
                res[name + "_host"] = _host_us(eager, max(4, a.reps))
                print(f"# {name} eager step, bs {bs} ctx {ctx}: host µs (call to return) {res[name + '_host']:.1f}, "
                      f"eager {res[name + '_eager']:.1f}, eager GPU (host hidden) {res[name + '_eager_gpu']:.1f}",
                      flush=True)
                if name == "ours":  # the same step with the metadata launch (the path before run_direct), same host
                    _set_direct(be, False)
                    try:
                        for _ in range(10):
                            eager()
                        res["ours_eager_fill"] = statistics.median(events_times_us(eager, max(4, a.reps)))
                    finally:
                        _set_direct(be, True)
                if a.timeline:
                    try:
                        _timeline(eager, f"{name} eager step, bs {bs} ctx {ctx}")
                    except Exception as e:  # a diagnostic: never stops the measurement
                        print(f"timeline not printed: {type(e).__name__}: {e}")
                if a.profile_eager and bs == bss[0] and ctx == ctxs[0]:
                    _profile(eager, f"{name} eager step, bs {bs} ctx {ctx}")
                if a.breakdown and name == "ours" and bs == bss[0] and ctx == ctxs[0]:
                    _breakdown(be, layer, fb_eager, b, T, max(20, a.reps))
                if a.layers and bs == bss[0] and ctx == ctxs[0]:
                    def step(be=be, fb=fb_eager):
                        be.init_forward_metadata(fb)
                        for _ in range(a.layers):
                            T._forward(be, layer, fb, b.q, b.k, "verify")
                    variants = [("Triton", None, True)] if name == "ref" else [
                        ("mlagen", None, True), ("mlagen, metadata launch (no run_direct)", None, False),
                        ("mlagen, SGLang's KV write + checked call per layer", _checked_launch(k), False)]
                    for label, launch, direct in variants:
                        if launch is not None:  # the per-layer path before the launch took over the KV write
                            k.launch = launch
                            be._pool_write_ok = False
                        if name == "ours":
                            _set_direct(be, direct)
                        try:
                            step()
                            host_rows.append((label, _host_us(step, max(5, a.reps // 5)),
                                              events_median_us(step, max(5, a.reps // 5))))
                            if a.profile_eager:
                                _profile(step, f"{label}: {a.layers}-layer eager step, bs {bs} ctx {ctx}", reps=2)
                        finally:
                            k.__dict__.pop("launch", None)
                            be._pool_write_ok = None
                            if name == "ours":
                                _set_direct(be, True)
                fb = b.forward_batch()
                be.init_forward_metadata_out_graph(fb, in_capture=True)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        be.init_forward_metadata_in_graph(fb)
                        T._forward(be, layer, fb, b.q, b.k, "verify")
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    be.init_forward_metadata_in_graph(fb)
                    T._forward(be, layer, fb, b.q, b.k, "verify")
                be.init_forward_metadata_out_graph(b.forward_batch())
                res[name + "_graph"] = events_median_us(g.replay, a.reps)
                del g
            diff = (outs["ref"] - outs["ours"]).abs().max().item()
            excess = res["ours_eager"] - res["ours_graph"]
            if not excess <= EAGER_BAR_US:
                failed.append((bs, ctx, excess))
            print(f"| {H} | {q} | {bs} | {ctx} | {res['ours_graph']:.1f} | {res['ref_graph']:.1f} | "
                  f"{res['ref_graph'] / res['ours_graph']:.1f}x | {res['ours_eager']:.1f} | {res['ref_eager']:.1f} | "
                  f"{excess:.1f}{'' if excess <= EAGER_BAR_US else ' (over)'}{'' if res['direct'] else ' (not direct)'} | "
                  f"{res['ours_eager_fill'] - res['ours_graph']:.1f} | {res['ours_eager_gpu']:.1f} | "
                  f"{res['ours_eager_iqr']} | {diff:.3g} |",
                  flush=True)
    if host_rows:
        print(f"\n{a.layers}-layer eager verify step, bs {bss[0]} ctx {ctxs[0]} (median; host = Python to return, "
              f"GPU idle at the start)\n\n| path | host µs | step µs (CUDA events) |\n|---|---|---|")
        for label, host, dev in host_rows:
            print(f"| {label} | {host:.0f} | {dev:.0f} |")
    if failed:
        print(f"\neager step over the captured step + {EAGER_BAR_US:.0f} µs at (bs, ctx, excess µs): {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
