"""``rlcli report``: one self-contained HTML page about one run, or several runs overlaid.

The page has no external references at all (no scripts, fonts, stylesheets or images from
anywhere): figures are base64 PNG ``data:`` URIs, the stylesheet is inline, and the only
interactivity is HTML's own ``<details>``. It opens offline and can be mailed as one file.

Every section is built from what the work dirs hold *now*: a run in progress (or a crashed one)
gets a report of what it has logged so far, and a section whose inputs are missing says which
file is missing instead of failing the whole page.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from rlcli.report import plots
from rlcli.report.plots import Line, Panel, metric, ratio
from rlcli.report.rundata import Run, load_runs

log = logging.getLogger(__name__)

SAMPLES_PER_SIDE = 5          # best k and worst k samples per table
MAX_SAMPLE_STEPS = 12         # eval steps with a sample table per run (evenly spaced, first and last kept)
CLIP_CHARS = 280              # longer prompts/responses are clipped, with the full text one click away
CLIP_LINES = 8
MAX_EVAL_PANELS = 12

# rollout/* keys that are volumes, latencies or staleness, not event counters
_ROLLOUT_NON_COUNTERS = {"rollout/groups", "rollout/samples", "rollout/tokens", "rollout/produced_samples",
                         "rollout/staleness_mean", "rollout/staleness_max"}
_JUDGER_NON_COUNTERS = {"judger/calls", "judger/time_s"}
_TRAIN_PANELS = [("train/loss", "loss"), ("train/grad_norm", "grad norm (before clipping)"),
                 ("train/entropy", "entropy"), ("train/lr", "learning rate"), ("train/clipfrac", "clip fraction"),
                 ("train/kl_k3", "KL to rollout policy (k3)")]


@dataclass
class Section:
    id: str
    title: str
    body: str


# ----------------------------------------------------------------------------------- helpers
def _e(x: Any) -> str:
    return escape("" if x is None else str(x), quote=True)


def _fmt(v: Any) -> str:
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


def _duration(s: float | None) -> str:
    if s is None:
        return "—"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h {m:02d}m {sec:02d}s" if h else (f"{m}m {sec:02d}s" if m else f"{sec}s")


def _missing(text: str) -> str:
    return f'<p class="missing">{_e(text)}</p>'


def _img(uri: str, alt: str) -> str:
    return f'<img class="plot" src="{uri}" alt="{_e(alt)}">'


def _figure(runs: Sequence[Run], panels: Sequence[Panel], **kw) -> str:
    """A grid of panels as an <img>; its alt text names the panels (what a screen reader, or a test, can read)."""
    return _img(plots.panels_figure(runs, panels, **kw), "plots: " + "; ".join(p.title for p in panels))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """A table; ``rows`` cells are HTML already (escape with ``_e`` before)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _swatch(i: int) -> str:
    return f'<span class="swatch" style="background:{plots.run_color(i)}"></span>'


def _present(runs: Sequence[Run], lines: Sequence[Line]) -> list[Line]:
    return [ln for ln in lines if plots.has_data(runs, ln)]


def _no_metrics_reason(runs: Sequence[Run]) -> str:
    states = {r.label: r.metrics_state for r in runs}
    bad = [f"{lab}: metrics.jsonl {st}" for lab, st in states.items() if st != "ok"]
    return "; ".join(bad) if bad else ""


def _all_zero(runs: Sequence[Run], key: str) -> bool:
    return all(all(v == 0 for v in r.series(key)[1]) for r in runs)


# ----------------------------------------------------------------------------------- sections
def section_summary(runs: Sequence[Run]) -> Section:
    rows = []
    for i, r in enumerate(runs):
        evals = [k for k in _eval_keys(runs) if r.has(k)][:3]
        ev = "<br>".join(_first_last_best(k[5:], r.series(k)[1]) for k in evals) or "—"
        rows.append([
            f"{_swatch(i) if len(runs) > 1 else ''}<b>{_e(r.label)}</b>",
            f"<code>{_e(r.path.resolve())}</code>",
            _e(r.description) or "—",
            _e(r.status()),
            _fmt(r.last("reward/mean")),
            ev,
            _duration(r.wall_time_s),
        ])
    body = _table(["run", "work dir", "description", "status", "last reward/mean", "eval (first → last)",
                   "wall time"], rows, "summary")
    notes = [(r.label, n) for r in runs for n in r.notes]
    if notes:
        body += '<ul class="notes">' + "".join(
            f"<li><b>{_e(lab)}</b>: {_e(n)}</li>" for lab, n in notes) + "</ul>"
    return Section("summary", "Runs", body)


def _first_last_best(name: str, values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    best = f" (best {_fmt(max(finite))})" if finite else ""
    return f"{_e(name)}: {_fmt(values[0])} → <b>{_fmt(values[-1])}</b>{best}"


def _eval_keys(runs: Sequence[Run]) -> list[str]:
    keys = sorted({k for r in runs for k in r.keys("eval/")
                   if "judger/" not in k})
    keys = [k for k in keys if not (re.search(r"(^|/)failed$", k[5:]) and _all_zero(runs, k))]
    first = [k for k in keys if k == "eval/accuracy"]
    return first + [k for k in keys if k != "eval/accuracy"]


def section_reward(runs: Sequence[Run]) -> Section:
    panels: list[Panel] = []
    mean = Line("mean", metric("reward/mean"))
    if plots.has_data(runs, mean):
        panels.append(Panel("training reward (mean; band: min–max)", [mean],
                            band=(metric("reward/min"), metric("reward/max"))))
    tasks = sorted({k.split("/")[1] for r in runs for k in r.keys("task/") if k.endswith("/reward_mean")})
    if len(tasks) > 1:
        panels.append(Panel("training reward by task", [Line(t, metric(f"task/{t}/reward_mean")) for t in tasks]))
    ekeys = _eval_keys(runs)
    for k in ekeys[:MAX_EVAL_PANELS]:
        panels.append(Panel(k, [Line(k[5:], metric(k), markers=True)]))
    body = ""
    if not panels:
        why = _no_metrics_reason(runs) or "no reward/* or eval/* metrics logged yet"
        return Section("reward", "Reward and eval", _missing(f"Nothing to plot: {why}."))
    body += _figure(runs, panels)
    if len(ekeys) > MAX_EVAL_PANELS:
        body += f"<p class='note'>{len(ekeys) - MAX_EVAL_PANELS} more eval metrics are in metrics.jsonl.</p>"
    if not ekeys:
        body += _missing("No eval metrics yet (evaluation is off, or no eval step has been reached).")
    return Section("reward", "Reward and eval", body)


def section_length(runs: Sequence[Run]) -> Section:
    panels = []
    lines = _present(runs, [Line("mean", metric("response/length_mean")), Line("max", metric("response/length_max"))])
    if lines:
        panels.append(Panel("response length (tokens)", lines, ylabel="tokens"))
    trunc = Line("truncated", metric("response/truncated_frac"))
    if plots.has_data(runs, trunc):
        panels.append(Panel("fraction cut at max_tokens", [trunc], ylim=(-0.02, 1.02)))
    prompt = Line("mean", metric("prompt/length_mean"))
    if plots.has_data(runs, prompt):
        panels.append(Panel("prompt length (tokens)", [prompt], ylabel="tokens"))
    if not panels:
        why = _no_metrics_reason(runs) or "no response/* metrics logged yet"
        return Section("length", "Response length", _missing(f"Nothing to plot: {why}."))
    return Section("length", "Response length", _figure(runs, panels, ncols=3))


def _counter_keys(runs: Sequence[Run]) -> list[str]:
    keys = set()
    for r in runs:
        for k in r.keys("rollout/"):
            if k not in _ROLLOUT_NON_COUNTERS and not k.startswith("rollout/group_time"):
                keys.add(k)
        for k in r.keys("judger/"):
            if k not in _JUDGER_NON_COUNTERS:
                keys.add(k)
    return sorted(keys, key=lambda k: (not k.startswith("rollout/"), k))


def section_health(runs: Sequence[Run]) -> Section:
    title = "Staleness and rollout health"
    panels = []
    stale = _present(runs, [Line("mean", metric("rollout/staleness_mean")),
                            Line("max", metric("rollout/staleness_max"))])
    if stale:
        panels.append(Panel("staleness (policy versions behind)", stale, ylabel="versions"))
    counters = _counter_keys(runs)
    nonzero = [k for k in counters if not _all_zero(runs, k)]
    zero = [k for k in counters if k not in nonzero]
    for k in nonzero:
        panels.append(Panel(k, [Line(k.split("/", 1)[1], metric(k))], ylabel="per step"))
    if not panels and not counters:
        why = _no_metrics_reason(runs) or "no rollout/* metrics logged yet"
        return Section("health", title, _missing(f"Nothing to plot: {why}."))
    body = ""
    if panels:
        body = _figure(runs, panels, ncols=3, row_h=2.4)
    if zero:
        body += ("<p class='ok'>Zero at every step: " + ", ".join(f"<code>{_e(k)}</code>" for k in zero) + ".</p>")
    if counters:
        heads = ["counter"] + [f"{r.label}: total / max per step" for r in runs]
        rows = []
        for k in counters:
            cells = [f"<code>{_e(k)}</code>"]
            for r in runs:
                v = [x for x in r.series(k)[1] if math.isfinite(x)]
                cells.append(f"{_fmt(sum(v))} / {_fmt(max(v))}" if v else "—")
            rows.append(cells)
        body += _table(heads, rows, "num")
    return Section("health", title, body)


def section_time(runs: Sequence[Run]) -> Section:
    title = "Where the step time goes"
    phases = plots.step_phases(runs)
    if not phases:
        why = _no_metrics_reason(runs) or "no timing/* metrics logged yet"
        return Section("time", title, _missing(f"Nothing to plot: {why}."))
    body = _img(plots.step_time_figure(runs), "stacked bars: seconds per step by phase")
    heads = ["phase"] + [f"{r.label}: mean s/step (share)" for r in runs]
    per_run = []
    for r in runs:
        steps, table = plots.step_time_table(r, phases)
        train_steps = [i for i, s in enumerate(steps) if s > 0] or list(range(len(steps)))
        means = {p: (sum(table[p][i] for i in train_steps) / len(train_steps) if train_steps else 0.0)
                 for p in table}
        per_run.append(means)
    rows = []
    for p in phases:
        cells = [_e(plots.phase_label(p))]
        for means in per_run:
            total = sum(means.values())
            v = means.get(p)
            cells.append("—" if v is None else f"{v:.3f} ({100 * v / total:.0f}%)" if total > 0 else f"{v:.3f}")
        rows.append(cells)
    rows.append(["<b>step (total)</b>"] + [f"<b>{sum(m.values()):.3f}</b>" for m in per_run])
    body += _table(heads, rows, "num")
    body += ("<p class='note'>Means over training steps (step 0, the initial eval, is left out). "
             "<i>other</i> is <code>timing/step_s</code> minus the named phases.</p>")
    return Section("time", title, body)


def _total_ratio(run: Run, num: str, den: str) -> float | None:
    ns, nv = run.series(num)
    d = dict(zip(*run.series(den)))
    pairs = [(n, d[s]) for s, n in zip(ns, nv) if s in d and math.isfinite(n) and math.isfinite(d[s])]
    tot = sum(q for _, q in pairs)
    return sum(n for n, _ in pairs) / tot if pairs and tot > 0 else None


def section_throughput(runs: Sequence[Run]) -> Section:
    title = "Throughput"
    specs = [
        ("generated tokens/s (rollout phase)", "rollout/tokens", "timing/rollout_s", "tokens/s"),
        ("samples/s (whole step)", "rollout/samples", "timing/step_s", "samples/s"),
        ("trained tokens/s (train phase)", "train/tokens", "timing/train_s", "tokens/s"),
    ]
    panels = []
    for t, num, den, unit in specs:
        ln = Line(unit, ratio(num, den))
        if plots.has_data(runs, ln):
            panels.append(Panel(t, [ln], ylabel=unit))
    lat = _present(runs, [Line("p50", metric("rollout/group_time_p50")), Line("p99", metric("rollout/group_time_p99"))])
    if lat:
        panels.append(Panel("rollout time per group (s)", lat, ylabel="s"))
    if not panels:
        why = _no_metrics_reason(runs) or "needs rollout/tokens and timing/rollout_s"
        return Section("throughput", title, _missing(f"Nothing to plot: {why}."))
    body = _figure(runs, panels, ncols=2, row_h=2.5)
    rows = []
    for t, num, den, _ in specs:
        rows.append([_e(t)] + [_fmt(_total_ratio(r, num, den)) for r in runs])
    body += _table(["whole run"] + [r.label for r in runs], rows, "num")
    body += ("<p class='note'>Per step: <code>rollout/tokens / timing/rollout_s</code>, "
             "<code>rollout/samples / timing/step_s</code>, <code>train/tokens / timing/train_s</code>; "
             "the table divides the run's totals.</p>")
    return Section("throughput", title, body)


def section_training(runs: Sequence[Run]) -> Section:
    title = "Training"
    panels = [Panel(t, [Line(k.split("/", 1)[1], metric(k))]) for k, t in _TRAIN_PANELS
              if any(r.has(k) for r in runs)]
    if not panels:
        why = _no_metrics_reason(runs) or "no train/* metrics logged yet"
        return Section("training", title, _missing(f"Nothing to plot: {why}."))
    body = _figure(runs, panels, ncols=3, row_h=2.4)
    others = sorted({k for r in runs for k in r.keys("train/")} - {k for k, _ in _TRAIN_PANELS})
    if others:
        body += ("<p class='note'>Also in metrics.jsonl and TensorBoard: "
                 + ", ".join(f"<code>{_e(k)}</code>" for k in others) + ".</p>")
    return Section("training", title, body)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(d, list) and d and any(isinstance(x, (dict, list)) for x in d):
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}.{i}"))
    else:
        out[prefix] = d
    return out


_PLUGIN_RE = re.compile(r"^(?P<kind>\S+) (?P<name>\S+) from (?P<dist>\S+) (?P<version>\S+)$")


def section_config(runs: Sequence[Run]) -> Section:
    import yaml

    title = "Recipe and plugins"
    body = ""
    have = [r for r in runs if r.resolved is not None]
    if len(have) > 1:
        flats = [_flatten(r.recipe) for r in have]
        keys = sorted(set().union(*flats))
        diff = [k for k in keys if len({repr(f.get(k, "<unset>")) for f in flats}) > 1]
        if diff:
            rows = [[f"<code>{_e(k)}</code>"] + [_e(_fmt(f.get(k, "(unset)"))) for f in flats] for k in diff]
            body += "<h3>Recipe differences</h3>" + _table(["key"] + [r.label for r in have], rows)
        else:
            body += "<p class='ok'>The resolved recipes are identical.</p>"
    for i, r in enumerate(runs):
        if len(runs) > 1:
            body += f"<h3>{_swatch(i)}{_e(r.label)}</h3>"
        if r.resolved is None:
            body += _missing(f"{r.path / 'resolved.yaml'} is {r.resolved_state}: the recipe and plugin versions "
                             "of this run are unknown.")
            continue
        plugins = r.resolved.get("plugins") or {}
        if isinstance(plugins, dict) and plugins:
            rows = []
            for comp, desc in plugins.items():
                m = _PLUGIN_RE.match(str(desc))
                if m:
                    rows.append([f"<code>{_e(comp)}</code>", _e(m["kind"]), f"<b>{_e(m['name'])}</b>",
                                 _e(m["dist"]), _e(m["version"])])
                else:
                    rows.append([f"<code>{_e(comp)}</code>", _e(desc), "", "", ""])
            body += "<h4>Components</h4>" + _table(["recipe path", "kind", "name", "distribution", "version"], rows)
        else:
            body += _missing("resolved.yaml lists no plugins.")
        versions = r.resolved.get("versions") or {}
        if isinstance(versions, dict) and versions:
            body += "<h4>Library versions</h4>" + _table(
                ["library", "version"], [[_e(k), f"<code>{_e(v)}</code>"] for k, v in versions.items()])
        text = yaml.safe_dump(r.recipe, sort_keys=False, allow_unicode=True) if r.recipe else "(empty)"
        body += (f"<details class='recipe'><summary>resolved recipe (YAML, {text.count(chr(10))} lines)</summary>"
                 f"<pre>{_e(text)}</pre></details>")
    return Section("config", title, body)


def _clip(text: Any) -> str:
    s = "" if text is None else text if isinstance(text, str) else str(text)
    lines = s.split("\n")
    if len(s) <= CLIP_CHARS and len(lines) <= CLIP_LINES:
        return f"<pre>{_e(s)}</pre>"
    preview = "\n".join(lines[:CLIP_LINES])[:CLIP_CHARS]
    return (f"<details class='clip'><summary><span class='pre'>{_e(preview)}…</span><span class='more'>show all "
            f"{len(s):,} characters</span></summary><pre>{_e(s)}</pre></details>")


def _reward_of(row: dict) -> float | None:
    v = row.get("reward")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def best_and_worst(rows: list[dict], k: int) -> tuple[list[dict], list[dict]]:
    """The ``k`` highest-reward rows and the ``k`` lowest (no row in both; no reward counts as lowest)."""
    order = sorted(range(len(rows)), key=lambda i: (_reward_of(rows[i]) is None, -(_reward_of(rows[i]) or 0.0), i))
    best = order[:k]
    taken = set(best)
    rest = [i for i in order if i not in taken]
    worst = rest[::-1][:k]
    return [rows[i] for i in best], [rows[i] for i in worst]


def _sample_table(best: list[dict], worst: list[dict]) -> str:
    rows = []
    for tag, group in (("best", best), ("worst", worst)):
        for row in group:
            r = _reward_of(row)
            status = row.get("finish_reason") or row.get("status") or ""
            if row.get("error"):
                status = f"{status} · error: {row['error']}"
            rows.append((tag, [
                f"<span class='tag {tag}'>{tag}</span>",
                f"<b>{_fmt(r)}</b>",
                _e(row.get("data_source")),
                _clip(row.get("prompt")),
                _clip(row.get("response")),
                _clip(row.get("label")),
                _e(status),
            ]))
    head = "".join(f"<th>{h}</th>" for h in ("", "reward", "data_source", "prompt", "response", "label", "finish"))
    body = "".join(f"<tr class='{tag}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>" for tag, cells in rows)
    return f"<table class='samples'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _spread(steps: list[int], n: int) -> list[int]:
    """At most ``n`` of ``steps``, evenly spaced, always keeping the first and the last."""
    if len(steps) <= n:
        return steps
    idx = sorted({round(i * (len(steps) - 1) / (n - 1)) for i in range(n)})
    return [steps[i] for i in idx]


def _mean_reward(rows: list[dict]) -> float | None:
    v = [x for x in (_reward_of(r) for r in rows) if x is not None]
    return sum(v) / len(v) if v else None


def section_samples(runs: Sequence[Run]) -> Section:
    title = "Sample rollouts"
    body = ""
    for i, r in enumerate(runs):
        if len(runs) > 1:
            body += f"<h3>{_swatch(i)}{_e(r.label)}</h3>"
        eval_steps = list(r.eval_files)
        if eval_steps:
            steps, source = eval_steps, "eval"
        elif r.rollout_files:
            steps, source = list(r.rollout_files), "rollouts"
            body += _missing(f"No eval samples in {r.path / 'eval'} (evaluation is off or has not run yet); "
                             "showing the dumped training rollouts instead.")
        else:
            body += _missing(f"No samples: neither {r.path / 'eval'}/step-N.jsonl nor "
                             f"{r.path / 'rollouts'}/step-N.jsonl exist yet.")
            continue
        shown = _spread(steps, MAX_SAMPLE_STEPS)
        if len(shown) < len(steps):
            body += (f"<p class='note'>{len(shown)} of {len(steps)} {source} steps shown (evenly spaced); "
                     f"every sample is in <code>{_e(r.path / source)}/step-N.jsonl</code>.</p>")
        for j, step in enumerate(reversed(shown)):
            ev = r.read_eval(step) if source == "eval" else []
            tr = r.read_rollouts(step)
            parts = []
            summary = f"step {step}"
            if source == "eval":
                summary += f" · eval: {len(ev)} samples, mean reward {_fmt(_mean_reward(ev))}"
                if ev:
                    b, w = best_and_worst(ev, SAMPLES_PER_SIDE)
                    parts.append(f"<h4>Eval samples: best {len(b)} and worst {len(w)} of {len(ev)}</h4>"
                                 + _sample_table(b, w))
                else:
                    parts.append(_missing(f"{r.eval_files[step]} has no readable samples."))
            if tr:
                b, w = best_and_worst(tr, SAMPLES_PER_SIDE)
                summary += f" · training rollouts: {len(tr)} dumped, mean reward {_fmt(_mean_reward(tr))}"
                parts.append(f"<h4>Training rollouts of step {step} (dumped best and worst groups): best {len(b)} "
                             f"and worst {len(w)} of {len(tr)}</h4>" + _sample_table(b, w))
            elif step > 0:
                parts.append(_missing(f"No training rollouts dumped for step {step} "
                                      f"(rollouts/step-{step}.jsonl is missing)."))
            body += (f"<details class='step'{' open' if j == 0 else ''}><summary>{_e(summary)}</summary>"
                     + "".join(parts) + "</details>")
    return Section("samples", title, body)


SECTIONS: list[Callable[[Sequence[Run]], Section]] = [
    section_summary, section_reward, section_length, section_health, section_time, section_throughput,
    section_training, section_config, section_samples,
]


_CSS = """
:root { --fg:#1d1d1f; --muted:#666; --line:#e3e3e3; --bg2:#f6f7f9; --best:#2e7d32; --worst:#c62828; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: var(--fg);
       margin: 0; background: #fff; }
header { padding: 14px 24px 8px; border-bottom: 1px solid var(--line); }
header h1 { margin: 0 0 4px; font-size: 20px; }
header .meta { color: var(--muted); font-size: 12px; }
nav { position: sticky; top: 0; background: #fff; border-bottom: 1px solid var(--line); padding: 6px 24px; z-index: 1; }
nav a { margin-right: 14px; color: #0b57d0; text-decoration: none; font-size: 13px; }
main { padding: 0 24px 40px; max-width: 1180px; }
section { margin-top: 22px; }
h2 { font-size: 17px; border-bottom: 2px solid var(--line); padding-bottom: 4px; margin: 0 0 10px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
h4 { font-size: 13px; margin: 12px 0 4px; color: #333; }
img.plot { display: block; max-width: 100%; height: auto; margin: 6px 0; }
table { border-collapse: collapse; margin: 8px 0; font-size: 12.5px; }
th, td { border: 1px solid var(--line); padding: 4px 7px; text-align: left; vertical-align: top; }
th { background: var(--bg2); font-weight: 600; }
table.summary td:first-child { white-space: nowrap; }
table.num td:not(:first-child) { text-align: right; font-variant-numeric: tabular-nums; }
table.samples { width: 100%; table-layout: fixed; }
table.samples th:nth-child(1) { width: 52px; } table.samples th:nth-child(2) { width: 64px; }
table.samples th:nth-child(3) { width: 100px; } table.samples th:nth-child(6) { width: 120px; }
table.samples th:nth-child(7) { width: 90px; }
table.samples tr.best td:first-child { border-left: 3px solid var(--best); }
table.samples tr.worst td:first-child { border-left: 3px solid var(--worst); }
pre, span.pre { margin: 0; white-space: pre-wrap; word-break: break-word;
                font: 12px/1.35 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
span.pre { display: block; }
details.clip > summary { cursor: pointer; list-style: none; }
details.clip > summary::-webkit-details-marker { display: none; }
details.clip .more { color: #0b57d0; font-size: 11px; }
details.clip[open] > summary { display: none; }
details.step, details.recipe { border: 1px solid var(--line); border-radius: 4px; padding: 4px 10px; margin: 8px 0; }
details.step > summary, details.recipe > summary { cursor: pointer; font-weight: 600; }
details.recipe pre { background: var(--bg2); padding: 8px; max-height: 640px; overflow: auto; }
.tag { font-size: 11px; font-weight: 600; }
.tag.best { color: var(--best); } .tag.worst { color: var(--worst); }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px;
          vertical-align: -1px; }
.missing { color: #8a5a00; background: #fff6e0; border-left: 3px solid #e0a800; padding: 6px 10px; }
.ok { color: #1b5e20; }
.note { color: var(--muted); font-size: 12px; }
ul.notes { color: #8a5a00; font-size: 12.5px; }
code { font: 12px ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
"""


def _safe(build: Callable[[Sequence[Run]], Section], runs: Sequence[Run]) -> Section:
    try:
        return build(runs)
    except Exception as exc:  # one odd file must not cost the whole report
        log.warning("report section %s failed", build.__name__, exc_info=True)
        name = build.__name__.removeprefix("section_")
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Section(name, name.capitalize(), _missing(f"This section could not be built: {tb}"))


def render_report(runs: Sequence[Run]) -> str:
    """The whole page as a string."""
    sections = [_safe(b, runs) for b in SECTIONS]
    names = ", ".join(r.label for r in runs)
    title = f"rlcli report: {names}"
    when = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    nav = "".join(f'<a href="#{s.id}">{_e(s.title)}</a>' for s in sections)
    body = "".join(f'<section id="{s.id}"><h2>{_e(s.title)}</h2>{s.body}</section>' for s in sections)
    from rlcli import __version__

    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>{_e(title)}</h1><div class='meta'>generated {_e(when)} by rlcli {_e(__version__)} · "
        f"{len(runs)} run{'s' if len(runs) != 1 else ''}</div></header>"
        f"<nav>{nav}</nav><main>{body}</main></body></html>\n"
    )


def write_report(work_dirs: list[Path], out: Path | None = None) -> Path:
    """Render the report of ``work_dirs`` (overlaid when several) to ``out`` (default: first dir's report.html).

    Raises :class:`rlcli.report.ReportError` when a path is not a run's work dir at all.
    """
    t0 = time.perf_counter()
    runs = load_runs([Path(w) for w in work_dirs])
    page = render_report(runs)
    out = Path(out) if out is not None else Path(work_dirs[0]) / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)  # a browser reloading the page never sees half a file
    log.info("report %s written in %.2fs", out, time.perf_counter() - t0)
    return out
