"""PNG plots of a run: latency CDFs (TTFT, TPOT, ITL, E2EL; one curve per load point) and, for
a sweep, output throughput and p99 latencies against the load.

Figures are built on `matplotlib.figure.Figure` with the Agg canvas: no pyplot state, no
display needed. Inputs are load-point results as `metrics.calculate_metrics` returns them
(with their per-request lists); only completed requests are drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


def latencies_ms(result: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-request (ITL: per-gap) latencies of the completed requests, in ms."""
    done = [i for i, e in enumerate(result["errors"]) if not e]
    ttft = [result["ttfts"][i] for i in done]
    e2el = [result["e2els"][i] for i in done]
    lens = [result["output_lens"][i] for i in done]
    tpot = [(e - t) / (n - 1) for t, e, n in zip(ttft, e2el, lens) if n > 1]
    itl = [gap for i in done for gap in result["itls"][i]]
    return {
        k: np.asarray(v, dtype=float) * 1000
        for k, v in {"ttft": ttft, "tpot": tpot, "itl": itl, "e2el": e2el}.items()
    }


def _figure(ncols: int, nrows: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * ncols, 4.0 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False).ravel()


def plot_latency_cdfs(points: list[tuple[str, dict[str, Any]]], path: Path) -> Path:
    """One panel per latency; one CDF per (label, result)."""
    fig, axes = _figure(2, 2)
    for ax, (key, name) in zip(axes, LATENCIES):
        for label, result in points:
            values = np.sort(latencies_ms(result)[key])
            if values.size:
                ax.step(
                    values, np.arange(1, values.size + 1) / values.size, where="post", label=label
                )
        ax.set(
            title=f"{name} CDF",
            xlabel=f"{name} (ms)",
            ylabel="fraction of gaps" if key == "itl" else "fraction of requests",
            ylim=(0, 1.02),
        )
        ax.grid(alpha=0.3)
        if ax.has_data() and len(points) > 1:
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def plot_load_curves(axis: str, points: list[tuple[float, dict[str, Any]]], path: Path) -> Path:
    """Output throughput and p99 latencies against the load (`axis`: concurrency or rate)."""
    loads = [load for load, _ in points]
    fig, (tput, p99) = _figure(2, 1)
    tput.plot(loads, [r["output_throughput"] for _, r in points], marker="o")
    tput.set(title="Output throughput", ylabel="tokens/s")
    for key, name in LATENCIES:
        series = [latencies_ms(r)[key] for _, r in points]
        p99.plot(
            loads,
            [np.percentile(s, 99) if s.size else np.nan for s in series],
            marker="o",
            label=name,
        )
    p99.set(title="p99 latency", ylabel="ms", yscale="log")
    p99.legend(fontsize="small")
    xlabel = "max concurrency" if axis == "concurrency" else "request rate (req/s)"
    for ax in (tput, p99):
        ax.set_xlabel(xlabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, labels=[f"{load:g}" for load in loads])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    return path
