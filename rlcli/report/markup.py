"""Small HTML building blocks shared by the report's sections: escaping, number formats, tables,
figures and the :class:`Section` every section builder returns."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from rlcli.report import plots
from rlcli.report.plots import Line, Panel
from rlcli.report.rundata import Run


@dataclass
class Section:
    id: str
    title: str
    body: str


def esc(x: Any) -> str:
    return escape("" if x is None else str(x), quote=True)


def fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v == int(v) and abs(v) < 1e9:
            return str(int(v))
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.4g}"
    return str(v)


def duration(s: float | None) -> str:
    if s is None:
        return "—"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h {m:02d}m {sec:02d}s" if h else (f"{m}m {sec:02d}s" if m else f"{sec}s")


def missing(text: str) -> str:
    return f'<p class="missing">{esc(text)}</p>'


def img(uri: str, alt: str) -> str:
    return f'<img class="plot" src="{uri}" alt="{esc(alt)}">'


def figure(runs: Sequence[Run], panels: Sequence[Panel], **kw) -> str:
    """A grid of panels as an <img>; its alt text names the panels (what a screen reader, or a test, can read)."""
    return img(plots.panels_figure(runs, panels, **kw), "plots: " + "; ".join(p.title for p in panels))


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """A table; ``rows`` cells are HTML already (escape with ``_e`` before)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def swatch(i: int) -> str:
    return f'<span class="swatch" style="background:{plots.run_color(i)}"></span>'


def present(runs: Sequence[Run], lines: Sequence[Line]) -> list[Line]:
    return [ln for ln in lines if plots.has_data(runs, ln)]


def no_metrics_reason(runs: Sequence[Run]) -> str:
    states = {r.label: r.metrics_state for r in runs}
    bad = [f"{lab}: metrics.jsonl {st}" for lab, st in states.items() if st != "ok"]
    return "; ".join(bad) if bad else ""


def all_zero(runs: Sequence[Run], key: str) -> bool:
    return all(all(v == 0 for v in r.series(key)[1]) for r in runs)


def constant(runs: Sequence[Run], key: str) -> float | None:
    """The one value ``key`` takes at every logged step of every run (two values or more logged), else None."""
    values = [v for r in runs for v in r.series(key)[1]]
    return values[0] if len(values) > 1 and all(v == values[0] for v in values) else None


def constants_note(runs: Sequence[Run], keys: Sequence[str]) -> str:
    """One line naming the metrics of ``keys`` left undrawn because they never change."""
    if not keys:
        return ""
    return ("<p class='note'>The same at every step, not drawn: "
            + ", ".join(f"<code>{esc(k)}</code> = {fmt(constant(runs, k))}" for k in keys) + ".</p>")


# ----------------------------------------------------------------------------------- sections
