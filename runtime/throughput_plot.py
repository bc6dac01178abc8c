"""The throughput benchmark's plot: output tok/s and p50 TTFT against concurrency (needs matplotlib)."""

from __future__ import annotations

import io
from pathlib import Path

from camshaft.outdir import write_user_file
from camshaft.runtime.throughput_report import ThroughputResult, fmt


def plot_sweep(results: list[ThroughputResult], path: str | Path, peers: dict[str, list[dict]] | None = None,
               title: str | None = None) -> None:
    """Output tok/s and p50 TTFT vs concurrency (needs matplotlib); `peers` adds other systems' points as
    {name: [{"concurrency", "output_tok_s", "ttft_p50_ms"}]}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=lambda r: r.concurrency)
    xs = [r.concurrency for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = [("output tokens/s (higher is better)", [r.output_tok_s for r in results], "output_tok_s",
               "output tokens/s"),
              ("p50 time to first token, ms (lower is better)", [r.ttft_ms["p50"] for r in results], "ttft_p50_ms",
               "ms")]
    markers = iter(["s", "^", "D", "v"])
    peer_styles = {name: next(markers, "x") for name in (peers or {})}
    for ax, (label, ys, key, unit) in zip(axes, panels, strict=True):
        ax.plot(xs, ys, "o-", color="#2b6cb0", label="camshaft")
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(value_label(y), (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
        for name, points in (peers or {}).items():
            px, py = [p["concurrency"] for p in points], [p[key] for p in points]
            ax.plot(px, py, peer_styles[name], color="#c05621", markersize=8, label=name, linestyle="none")
            for x, y in zip(px, py, strict=True):
                ax.annotate(value_label(y), (x, y), textcoords="offset points", xytext=(0, -14), ha="center",
                            fontsize=8, color="#c05621")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(unit)
        ax.set_title(label, fontsize=10)
        ax.set_ylim(bottom=0, top=max(ys + [p[key] for pts in (peers or {}).values() for p in pts]) * 1.15)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    save_figure(fig, path, title)


def value_label(y: float) -> str:
    """A point's value: whole above 10, two significant digits below (0.7 ms is not "1")."""
    return fmt(y, None)


def save_figure(fig, path: str | Path, title: str | None = None) -> None:
    """The benchmarks' figures: optional title, tight layout, PNG at 120 dpi, closed after."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, dpi=120, format="png")
    plt.close(fig)
    write_user_file(path, png.getvalue())  # an earlier plot stays whole if this one cannot be written
