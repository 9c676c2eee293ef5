"""PNG plots for `mirrorckpt plan --plot DIR`: goodput per strategy against MTBF and against model
size, everything else as given. matplotlib is an optional dependency (the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from mirrorckpt.tools import planner
from mirrorckpt.tools.progress import Progress

STYLE = {"synchronous": ("tab:red", "-"), "asynchronous": ("tab:orange", "-"), "gockpt": ("tab:blue", "--"),
         "mirror": ("tab:green", "-")}
POINTS = 80


def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise RuntimeError("--plot needs matplotlib: pip install 'mirrorckpt[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write(inp: planner.Inputs, out_dir) -> list[str]:
    """Writes goodput_vs_mtbf.png, and goodput_vs_model_size.png when the size is known; returns the paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweeps = [("mtbf_s", np.geomspace(inp.mtbf_s / 30, inp.mtbf_s * 30, POINTS), "goodput_vs_mtbf.png")]
    if inp.params:
        sweeps.append(("params", np.geomspace(inp.params / 100, inp.params * 100, POINTS),
                       "goodput_vs_model_size.png"))
    paths = []
    with Progress("plan: plots", total=POINTS * len(sweeps), unit="points") as bar:
        for name, xs, fname in sweeps:
            ys = {s: [] for s in planner.STRATEGIES}
            for x in xs:
                for s, v in planner.sweep(inp, name, [x]).items():
                    ys[s] += v
                bar.update(1)
            paths.append(str(_figure(plt, inp, name, xs, ys, out / fname)))
    return paths


def _figure(plt, inp, name, xs, ys, path):
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    scale, here = (3600, inp.mtbf_s) if name == "mtbf_s" else (1, inp.params)
    drawn, low = 0, 100.0
    for s, vals in ys.items():
        v = np.array([np.nan if y is None else 100 * y for y in vals])
        if np.isnan(v).all():
            continue
        color, ls = STYLE[s]
        label = s if s != "mirror" else f"mirror ({inp.mirrors} of {inp.ranks} ranks mirrored)"
        ax.plot(xs / scale, v, ls, color=color, label=label, lw=2)
        drawn, low = drawn + 1, min(low, np.nanmin(v))
    ax.axvline(here / scale, color="grey", lw=1, ls=":", label="as given")
    ax.set_xscale("log")
    ax.set_xlabel("MTBF of the job, hours" if name == "mtbf_s" else "model parameters")
    ax.set_ylabel("goodput, % of wall time")
    ax.set_ylim(max(0.0, low - 0.05 * (100 - low) - 1), 100)
    ax.grid(True, which="both", alpha=0.3)
    fixed = "model size and costs as given" if name == "mtbf_s" else \
        "step time, bandwidths, MTBF fixed; given costs scale with size"
    ax.set_title(f"Expected goodput per checkpoint strategy\n({fixed})", fontsize=10)
    if drawn:
        ax.legend(loc="lower right" if name == "mtbf_s" else "lower left", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
