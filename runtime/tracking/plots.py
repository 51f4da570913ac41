"""Adapter: Pareto plots of a tuning (goodput per GPU vs TTFT and vs ITL) as PNG and self-contained HTML."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

from runtime.tuner.search import Candidate, TuneResult


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (latency, goodput) not dominated by another with lower-or-equal latency and higher-or-equal
    goodput, sorted by latency. Points with a NaN or infinite coordinate are left out first (NaN compares
    false both ways, so sorting with it is order-dependent and could drop valid points)."""
    front: list[tuple[float, float]] = []
    best = -math.inf
    finite = [(lat, good) for lat, good in points if math.isfinite(lat) and math.isfinite(good)]
    for lat, good in sorted(finite, key=lambda p: (p[0], -p[1])):
        if good > best:
            front.append((lat, good))
            best = good
    return front


def pareto_png(result: TuneResult, path: Path) -> Path:
    """Write a two-panel PNG (goodput/GPU vs TTFT p90 and vs ITL p90; winner starred, SLO lines dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    feas = [c for c in result.candidates if c.feasible]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    panels = [("ttft_ms", "TTFT p90 (ms)", result.slo.ttft_p90_ms),
              ("itl_ms", "ITL p90 (ms)", result.slo.itl_p90_ms)]
    for ax, (attr, label, slo) in zip(axes, panels):
        xs = [getattr(c, attr) for c in feas]
        ys = [c.goodput_per_gpu for c in feas]
        ax.scatter(xs, ys, c="tab:blue", label="feasible candidates")
        for c, x, y in zip(feas, xs, ys):
            ax.annotate(_label(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        front = pareto_front(list(zip(xs, ys)))
        if front:
            ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="tab:green", label="Pareto front")
        b = result.best
        ax.scatter([getattr(b, attr)], [b.goodput_per_gpu], marker="*", s=250, c="tab:red", label="champion")
        ax.axvline(slo, color="gray", linestyle=":", label="SLO")
        ax.set_xlabel(label)
        ax.set_ylabel("goodput per GPU (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result.model.name} on {result.gpu.name} ({result.precision})", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def pareto_html(result: TuneResult, png_path: Path) -> str:
    """A self-contained HTML page: the PNG inlined (base64) and the candidate table (for KFP Output[HTML])."""
    b64 = base64.b64encode(Path(png_path).read_bytes()).decode()
    rows = "".join(
        f"<tr><td>{c.prefill_tp}</td><td>{c.decode_tp}</td><td>{_num(c.ttft_ms)}</td><td>{_num(c.itl_ms)}</td>"
        f"<td>{c.goodput_per_gpu:.3f}</td><td>{c.prefill_replicas}:{c.decode_replicas}</td>"
        f"<td>{'' if c.usd_per_mtok is None else f'{c.usd_per_mtok:.3f}'}</td>"
        f"<td>{'champion' if c == result.best else ('ok' if c.feasible else html.escape(c.reason))}</td></tr>"
        for c in result.candidates
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>pdserve tuning</title></head><body>"
        f"<h3>{html.escape(result.model.name)} on {html.escape(result.gpu.name)} ({result.precision})</h3>"
        f"<img alt='Pareto plot' src='data:image/png;base64,{b64}'/>"
        "<table border='1'><tr><th>prefill TP</th><th>decode TP</th><th>TTFT p90 ms</th><th>ITL p90 ms</th>"
        f"<th>goodput/GPU</th><th>P:D</th><th>$/Mtok</th><th>status</th></tr>{rows}</table></body></html>"
    )


def _label(c: Candidate) -> str:
    return f"P{c.prefill_tp}/D{c.decode_tp}"


def _num(x: float) -> str:
    return "-" if math.isinf(x) else f"{x:.1f}"
