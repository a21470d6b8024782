"""Plots (matplotlib, Agg backend): time vs context per kernel, with the roofline floor."""

from __future__ import annotations

import os
from pathlib import Path

PNG_SOFTWARE = "mlagen"  # the PNG "Software" text of every plot mlagen writes: a later run may replace that file


def is_mlagen_png(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a PNG that mlagen's plotting wrote: its "Software" text (read by Pillow, which matplotlib
    requires) is :data:`PNG_SOFTWARE`."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.format == "PNG" and im.info.get("Software") == PNG_SOFTWARE
    except OSError:  # not an image Pillow reads (UnidentifiedImageError is an OSError), or unreadable
        return False


def plot_path_problem(path: str) -> str | None:
    """Why ``path`` cannot take ``mlagen bench --plot`` (checked before any timing), or None when it can.

    The name must end in ``.png`` (any case), its directory must exist, and matplotlib (the ``plot`` extra) must be
    installed. An existing file is replaced only when it is a PNG this mlagen wrote (its "Software" text is
    :data:`PNG_SOFTWARE`); any other existing file is never overwritten.
    """
    p = Path(path)
    if p.suffix.lower() != ".png":
        return f"{path!r} does not end in .png"
    if not p.resolve().parent.is_dir():
        return f"the directory of {path!r} does not exist"
    if p.is_dir():
        return f"{path!r} is a directory"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "needs matplotlib: pip install 'mlagen[plot]' (or matplotlib)"
    if os.path.lexists(p) and not is_mlagen_png(p):
        return f"{path!r} exists and is not a plot mlagen wrote: choose another name or move it away"
    return None


def plot_time_vs_context(series: dict[str, list[tuple[int, float]]], path: str, title: str,
                         floor: list[tuple[int, float]] | None = None) -> None:
    """Log-log plot of median µs vs context length, one line per kernel; ``floor`` drawn dashed.

    Args:
        series: kernel label -> [(context tokens, µs)].
        path: image file to write (its suffix picks the format; a PNG is tagged with :data:`PNG_SOFTWARE`).
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
    png = Path(path).suffix.lower() == ".png"
    fig.savefig(path, dpi=120, metadata={"Software": PNG_SOFTWARE} if png else None)
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
