"""The report's figures, drawn with matplotlib's Agg canvas and returned as ``data:`` URIs (base64 PNG).

No pyplot: figures are built as ``matplotlib.figure.Figure`` objects on an Agg canvas, so nothing
here touches a display, the global backend, or pyplot's figure registry.

Colour rules, the same in every figure: with one run, each line of a panel has its own colour;
with several runs, each run has one colour everywhere (named in a legend above the figure) and the
lines of a panel differ by line style.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlcli.report.rundata import Run

XY = tuple[list[float], list[float]]
Getter = Callable[[Run], XY]

RUN_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22"]
LINE_STYLES = ["-", "--", ":", "-."]
PHASE_COLORS = {"rollout": "#4c72b0", "train": "#dd8452", "sync": "#55a868", "eval": "#c44e52",
                "checkpoint": "#8172b3", "hf_export": "#937860", "other": "#bbbbbb"}
EXTRA_PHASE_COLORS = ["#da8bc3", "#ccb974", "#64b5cd", "#4d4d4d"]
PHASE_LABELS = {"sync": "weight sync", "hf_export": "HF export"}
FIG_WIDTH_IN = 10.8
DPI = 100
MAX_BARS = 200
LOG_LINTHRESH = 1e-9  # a log-scale panel is linear below this, so exact zeros still show


def run_color(i: int) -> str:
    return RUN_COLORS[i % len(RUN_COLORS)]


@dataclass
class Line:
    """One curve of a panel: ``get(run) -> (x, y)``."""

    label: str
    get: Getter
    markers: bool = False


@dataclass
class Panel:
    title: str
    lines: list[Line]
    ylabel: str = ""
    band: tuple[Getter, Getter] | None = None  # (low, high) shaded around the first line
    band_label: str = ""
    note: str = ""
    ylim: tuple[float | None, float | None] | None = None
    xlabel: str = "step"
    log_y: bool = False  # values spanning decades (log-prob gaps); zero stays drawable (symlog)


def metric(key: str) -> Getter:
    def get(run: Run) -> XY:
        s, v = run.series(key)
        return list(s), list(v)

    get.__name__ = f"metric({key})"
    return get


def ratio(num: str, den: str) -> Getter:
    """``num / den`` per step, over the steps that logged both with a positive denominator."""

    def get(run: Run) -> XY:
        ns, nv = run.series(num)
        ds, dv = run.series(den)
        d = dict(zip(ds, dv))
        xs, ys = [], []
        for s, n in zip(ns, nv):
            q = d.get(s)
            if q is not None and q > 0 and math.isfinite(n) and math.isfinite(q):
                xs.append(s)
                ys.append(n / q)
        return xs, ys

    get.__name__ = f"ratio({num}/{den})"
    return get


def has_data(runs: Sequence[Run], line: Line) -> bool:
    return any(line.get(r)[0] for r in runs)


def _figure(nrows: int, ncols: int, row_h: float, top_legend: bool):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    extra = 0.45 if top_legend else 0.0
    fig = Figure(figsize=(FIG_WIDTH_IN, nrows * row_h + extra), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def to_data_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None}, facecolor="white")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _style_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel(xlabel, fontsize=8)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _run_legend(fig, runs: Sequence[Run]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=run_color(i), linewidth=2.5) for i in range(len(runs))]
    fig.legend(handles, [r.label for r in runs], loc="outside upper center", ncols=min(len(runs), 4),
               fontsize=9, frameon=False)


def panels_figure(runs: Sequence[Run], panels: Sequence[Panel], ncols: int = 2, row_h: float = 2.7) -> str:
    """A grid of line panels (``ncols`` wide) as a data URI; every run of ``runs`` on every panel."""
    multi = len(runs) > 1
    ncols = max(1, min(ncols, max(2, len(panels))))  # one lone panel takes half the width, not all of it
    nrows = math.ceil(len(panels) / ncols)
    fig = _figure(nrows, ncols, row_h, multi)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for idx, ax in enumerate(axes.flat):
        if idx >= len(panels):
            ax.set_visible(False)
            continue
        p = panels[idx]
        _style_axes(ax, p.title, p.xlabel, p.ylabel)
        drawn = 0
        for ri, run in enumerate(runs):
            for li, line in enumerate(p.lines):
                xs, ys = line.get(run)
                if not xs:
                    continue
                color = run_color(ri) if multi else run_color(li)
                style = LINE_STYLES[li % len(LINE_STYLES)] if multi else "-"
                few = len(xs) <= 40
                ax.plot(xs, ys, color=color, linestyle=style, linewidth=1.4,
                        marker="o" if (line.markers or len(xs) == 1) else None,
                        markersize=3.5 if few else 2.0,
                        label=line.label if (ri == 0 or not multi) else None)
                drawn += 1
                if li == 0 and p.band is not None:
                    lx, lo = p.band[0](run)
                    hx, hi = p.band[1](run)
                    hmap = dict(zip(hx, hi))
                    bx = [x for x in lx if x in hmap]
                    if bx:
                        lmap = dict(zip(lx, lo))
                        ax.fill_between(bx, [lmap[x] for x in bx], [hmap[x] for x in bx], color=color,
                                        alpha=0.12 if multi else 0.18, linewidth=0,
                                        label=(p.band_label or None) if ri == 0 else None)
        if not drawn:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="#888")
        if p.ylim is not None:
            ax.set_ylim(*p.ylim)
        if p.log_y and drawn:
            ax.set_yscale("symlog", linthresh=LOG_LINTHRESH)
        if p.note:
            ax.text(0.99, 0.02, p.note, transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="#666")
        handles, labels = ax.get_legend_handles_labels()
        if len(labels) > 1:
            if multi:  # styles, not colours, tell the lines apart: show them in neutral grey
                leg = ax.legend(handles, labels, fontsize=7, frameon=False, loc="best")
                for lh in leg.legend_handles:
                    if hasattr(lh, "set_color"):
                        lh.set_color("#555")
            else:
                ax.legend(fontsize=7, frameon=False, loc="best")
    if multi:
        _run_legend(fig, runs)
    return to_data_uri(fig)


def phase_label(name: str) -> str:
    return PHASE_LABELS.get(name, name.replace("_", " "))


def step_phases(runs: Sequence[Run]) -> list[str]:
    """The phases of the step-time split, in a fixed order: known ones, then any other ``timing/*_s``, then other."""
    known = ["rollout", "train", "sync", "eval", "checkpoint", "hf_export"]
    found = set()
    for r in runs:
        for k in r.keys("timing/"):
            if k.endswith("_s") and k != "timing/step_s":
                found.add(k[len("timing/"):-2])
    phases = [p for p in known if p in found] + sorted(found - set(known))
    if any(r.has("timing/step_s") for r in runs):
        phases.append("other")
    return phases


def step_time_table(run: Run, phases: Sequence[str]) -> tuple[list[int], dict[str, list[float]]]:
    """Per-step seconds of each phase; ``other`` is ``timing/step_s`` minus the named phases (never negative)."""
    steps = sorted({s for p in phases if p != "other" for s in run.series(f"timing/{p}_s")[0]}
                   | set(run.series("timing/step_s")[0]))
    table: dict[str, list[float]] = {}
    for p in phases:
        if p == "other":
            continue
        d = dict(zip(*run.series(f"timing/{p}_s")))
        table[p] = [max(0.0, d.get(s, 0.0)) if math.isfinite(d.get(s, 0.0)) else 0.0 for s in steps]
    if "other" in phases:
        tot = dict(zip(*run.series("timing/step_s")))
        named = [sum(table[p][i] for p in table) for i in range(len(steps))]
        table["other"] = [max(0.0, tot[s] - named[i]) if s in tot and math.isfinite(tot[s]) else 0.0
                          for i, s in enumerate(steps)]
    return steps, table


def _bin(steps: list[int], table: dict[str, list[float]]
         ) -> tuple[list[float], list[float], dict[str, list[float]], int]:
    """At most MAX_BARS bars: consecutive steps averaged into equal bins (x = bin centre, width = bin span)."""
    n = len(steps)
    if n <= MAX_BARS:
        return [float(s) for s in steps], [0.8] * n, table, 1
    k = math.ceil(n / MAX_BARS)
    xs, ws, out = [], [], {p: [] for p in table}
    for i in range(0, n, k):
        chunk = steps[i:i + k]
        xs.append((chunk[0] + chunk[-1]) / 2)
        ws.append(max(0.8, (chunk[-1] - chunk[0] + 1) * 0.9))
        for p, vals in table.items():
            seg = vals[i:i + k]
            out[p].append(sum(seg) / len(seg))
    return xs, ws, out, k


def step_time_figure(runs: Sequence[Run]) -> str | None:
    """Stacked bars of where each step's wall time went; one panel per run, shared axes."""
    from matplotlib.patches import Patch

    phases = step_phases(runs)
    if not phases:
        return None
    extra = iter(EXTRA_PHASE_COLORS * 4)
    colors = {p: PHASE_COLORS.get(p) or next(extra) for p in phases}
    fig = _figure(len(runs), 1, 2.6, True)
    axes = fig.subplots(len(runs), 1, squeeze=False, sharex=True, sharey=True)
    for ax, (ri, run) in zip(axes.flat, enumerate(runs)):
        steps, table = step_time_table(run, phases)
        title = run.label if len(runs) > 1 else "seconds per step"
        if not steps:
            _style_axes(ax, title, "step", "s")
            ax.text(0.5, 0.5, "no timing logged", transform=ax.transAxes, ha="center", va="center", color="#888")
            continue
        xs, ws, binned, k = _bin(steps, table)
        bottom = [0.0] * len(xs)
        for p in phases:
            vals = binned.get(p)
            if vals is None:
                continue
            ax.bar(xs, vals, width=ws, bottom=bottom, color=colors[p], linewidth=0)
            bottom = [b + v for b, v in zip(bottom, vals)]
        if k > 1:
            title += f" (mean over {k}-step bins)"
        _style_axes(ax, title, "step", "s")
        if len(runs) > 1:
            ax.title.set_color(run_color(ri))
    fig.legend([Patch(color=colors[p]) for p in phases], [phase_label(p) for p in phases],
               loc="outside upper center", ncols=min(len(phases), 7), fontsize=9, frameon=False)
    return to_data_uri(fig)
