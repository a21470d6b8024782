"""Plots (matplotlib, Agg backend): time vs context per kernel, with the roofline floor."""

from __future__ import annotations


def plot_time_vs_context(series: dict[str, list[tuple[int, float]]], path: str, title: str,
                         floor: list[tuple[int, float]] | None = None) -> None:
    """Log-log plot of median µs vs context length, one line per kernel; ``floor`` drawn dashed.

    Args:
        series: kernel label -> [(context tokens, µs)].
        path: PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pts in series.items():
        pts = sorted(pts)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if floor:
        floor = sorted(floor)
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="floor max(bytes/copy BW, FLOPs/mma rate)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("median time (µs)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bench(results, path: str, copy_gbs: float) -> None:
    """Plot ``mlagen bench`` results ([(uri, Shape, result dict, frac)]): one line per (variant, bs)."""
    from mlagen.roofline import verify_bytes

    series: dict[str, list] = {}
    floor: dict[int, float] = {}
    for uri, shape, r, _ in results:
        series.setdefault(f"{uri[:48]}… bs={shape.batch_size}", []).append((shape.context, r["median_us"]))
        if shape.batch_size == 1:
            floor[shape.context] = verify_bytes(shape.heads, shape.q_len, 1, shape.context) / (copy_gbs * 1e3)
    plot_time_vs_context(series, path, "mlagen bench", sorted(floor.items()) or None)
