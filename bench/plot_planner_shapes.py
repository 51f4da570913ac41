"""Plot a ``planner_shapes`` JSON line (bench/planner.py development-set mode): one panel per shape and
rate scale, each planner a point at (GPU-hours / the sequential oracle's, attainment), the
``pdserve_sla_q*`` rows (``--sweep-quantiles``) joined as pdserve_sla's frontier, the oracle at (1, its
attainment) and the oracle launched a worker start ahead.

    .venv/bin/python bench/plot_planner_shapes.py bench/results/planner_shapes.json \\
        --out bench/results/planner_shapes.png [--achievable]

``--per-shape`` writes one PNG per shape instead (``<out stem>_<shape>.png`` beside ``--out``, a panel per
rate scale). ``--achievable`` plots ``slo_attainment_achievable`` (each prompt against its achievable TTFT) instead of
``slo_attainment``. Every ``planner_shapes`` line of the file adds its panels (one run per rate scale
may be one line); the title names the last line's model and SLO. Raises SystemExit naming a file that
holds no ``planner_shapes`` line.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

STYLE = {"pdserve_sla": ("o", "C0"), "pdserve_load": ("s", "C1"), "dynamo_sla": ("^", "C2"),
         "dynamo_sla_load": ("v", "C2"), "dynamo_planner": ("D", "C4"), "static_peak": ("P", "C7"),
         "static_equal_cost": ("X", "C5")}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--achievable", action="store_true")
    ap.add_argument("--per-shape", action="store_true", help="one PNG per shape beside --out, a panel per rate scale")
    a = ap.parse_args(argv)
    lines = [json.loads(ln) for ln in a.results.read_text().splitlines() if ln.strip()]
    lines = [ln for ln in lines if ln.get("bench") == "planner_shapes"]
    if not lines:
        raise SystemExit(f"{a.results}: no planner_shapes line")
    line = lines[-1]
    key = "slo_attainment_achievable" if a.achievable else "slo_attainment"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(s, k, r) for ln in lines for s, by_k in ln["shapes"].items() for k, r in by_k.items()]
    title = (f"{line['model']} TP{line['prefill_tp']}/TP{line['decode_tp']}, TTFT {line['slo']['ttft_s']} s, "
             f"ITL {line['slo']['itl_s']} s, {'achievable ' if a.achievable else ''}attainment")
    if not a.per_shape:
        draw(plt, panels, key, title, a.out)
        return a.out
    for shape in dict.fromkeys(s for s, _, _ in panels):
        out = a.out.with_name(f"{a.out.stem}_{shape}.png")
        draw(plt, [p for p in panels if p[0] == shape], key, title, out)
    return a.out


def draw(plt, panels: list, key: str, title: str, out: Path) -> None:
    """One figure of ``(shape, rate scale, result)`` panels, saved to ``out``."""
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows + 0.8), squeeze=False)
    for ax, (shape, k, r) in zip(axes.flat, panels):
        oracle_h = r["oracle"]["gpu_hours"]
        sweep = sorted((float(n.removeprefix("pdserve_sla_q")), p) for n, p in r["planners"].items()
                       if n.startswith("pdserve_sla_q"))
        if sweep:
            ax.plot([p["gpu_hours"] / oracle_h for _, p in sweep], [100 * p.get(key, p["slo_attainment"]) for _, p in sweep],
                    "-", color="C0", alpha=0.5, label="pdserve_sla, slo_quantile sweep")
        for name, p in r["planners"].items():
            if name.startswith(("pdserve_sla_q", "pdserve_sla_hold", "ablation_")):
                continue
            marker, color = STYLE.get(name, ("x", "C9"))
            ax.plot(p["gpu_hours"] / oracle_h, 100 * p.get(key, p["slo_attainment"]), marker, color=color, label=name)
        ax.plot(1.0, 100 * r["oracle"].get(key, r["oracle"]["slo_attainment"]), "*", color="k", ms=10,
                label="sequential oracle")
        hold = r["oracle_hold_1window_sim"]
        ax.plot(hold["gpu_hours"] / oracle_h, 100 * hold.get(key, hold["slo_attainment"]), "*", color="C3", ms=8,
                label="oracle, a worker start ahead")
        react = r.get("oracle_reacting_sim")  # absent from results written before the reference existed
        if react:
            ax.plot(react["gpu_hours"] / oracle_h, 100 * react.get(key, react["slo_attainment"]), "P", color="C3",
                    ms=7, label="oracle, reacting (no foresight)")
        ax.set_title(f"{shape} x{k}", fontsize=9)
        ax.set_xlabel("GPU-hours / oracle")
        ax.set_ylabel("attainment, %")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5 if cols >= 3 else 2, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 if rows > 1 else 0.12 if cols >= 3 else 0.3, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
