"""The report's tables of what a run was: its resolved recipe and plugins, and sample rollouts
(the best and worst of evaluation and training steps)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from rlcli.report.markup import Section, esc, fmt, missing, swatch, table
from rlcli.report.rundata import Run

SAMPLES_PER_SIDE = 5          # best k and worst k samples per table
MAX_SAMPLE_STEPS = 12         # eval steps with a sample table per run (evenly spaced, first and last kept)
CLIP_CHARS = 280              # longer prompts/responses are clipped, with the full text one click away
CLIP_LINES = 8


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
            rows = [[f"<code>{esc(k)}</code>"] + [esc(fmt(f.get(k, "(unset)"))) for f in flats] for k in diff]
            body += "<h3>Recipe differences</h3>" + table(["key"] + [r.label for r in have], rows)
        else:
            body += "<p class='ok'>The resolved recipes are identical.</p>"
    for i, r in enumerate(runs):
        if len(runs) > 1:
            body += f"<h3>{swatch(i)}{esc(r.label)}</h3>"
        if r.resolved is None:
            body += missing(f"{r.path / 'resolved.yaml'} is {r.resolved_state}: the recipe and plugin versions "
                             "of this run are unknown.")
            continue
        plugins = r.resolved.get("plugins") or {}
        if isinstance(plugins, dict) and plugins:
            rows = []
            for comp, desc in plugins.items():
                m = _PLUGIN_RE.match(str(desc))
                if m:
                    rows.append([f"<code>{esc(comp)}</code>", esc(m["kind"]), f"<b>{esc(m['name'])}</b>",
                                 esc(m["dist"]), esc(m["version"])])
                else:
                    rows.append([f"<code>{esc(comp)}</code>", esc(desc), "", "", ""])
            body += "<h4>Components</h4>" + table(["recipe path", "kind", "name", "distribution", "version"], rows)
        else:
            body += missing("resolved.yaml lists no plugins.")
        versions = r.resolved.get("versions") or {}
        if isinstance(versions, dict) and versions:
            body += "<h4>Library versions</h4>" + table(
                ["library", "version"], [[esc(k), f"<code>{esc(v)}</code>"] for k, v in versions.items()])
        text = yaml.safe_dump(r.recipe, sort_keys=False, allow_unicode=True) if r.recipe else "(empty)"
        body += (f"<details class='recipe'><summary>resolved recipe (YAML, {text.count(chr(10))} lines)</summary>"
                 f"<pre>{esc(text)}</pre></details>")
    return Section("config", title, body)


def _clip(text: Any) -> str:
    s = "" if text is None else text if isinstance(text, str) else str(text)
    lines = s.split("\n")
    if len(s) <= CLIP_CHARS and len(lines) <= CLIP_LINES:
        return f"<pre>{esc(s)}</pre>"
    preview = "\n".join(lines[:CLIP_LINES])[:CLIP_CHARS]
    return (f"<details class='clip'><summary><span class='pre'>{esc(preview)}…</span><span class='more'>show all "
            f"{len(s):,} characters</span></summary><pre>{esc(s)}</pre></details>")


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
                f"<b>{fmt(r)}</b>",
                esc(row.get("data_source")),
                _clip(row.get("prompt")),
                _clip(row.get("response")),
                _clip(row.get("label")),
                esc(status),
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
            body += f"<h3>{swatch(i)}{esc(r.label)}</h3>"
        eval_steps = list(r.eval_files)
        if eval_steps:
            steps, source = eval_steps, "eval"
        elif r.rollout_files:
            steps, source = list(r.rollout_files), "rollouts"
            body += missing(f"No eval samples in {r.path / 'eval'} (evaluation is off or has not run yet); "
                             "showing the dumped training rollouts instead.")
        else:
            body += missing(f"No samples: neither {r.path / 'eval'}/step-N.jsonl nor "
                             f"{r.path / 'rollouts'}/step-N.jsonl exist yet.")
            continue
        shown = _spread(steps, MAX_SAMPLE_STEPS)
        if len(shown) < len(steps):
            body += (f"<p class='note'>{len(shown)} of {len(steps)} {source} steps shown (evenly spaced); "
                     f"every sample is in <code>{esc(r.path / source)}/step-N.jsonl</code>.</p>")
        for j, step in enumerate(reversed(shown)):
            ev = r.read_eval(step) if source == "eval" else []
            tr = r.read_rollouts(step)
            parts = []
            summary = f"step {step}"
            if source == "eval":
                summary += f" · eval: {len(ev)} samples, mean reward {fmt(_mean_reward(ev))}"
                if ev:
                    b, w = best_and_worst(ev, SAMPLES_PER_SIDE)
                    parts.append(f"<h4>Eval samples: best {len(b)} and worst {len(w)} of {len(ev)}</h4>"
                                 + _sample_table(b, w))
                else:
                    parts.append(missing(f"{r.eval_files[step]} has no readable samples."))
            if tr:
                b, w = best_and_worst(tr, SAMPLES_PER_SIDE)
                summary += f" · training rollouts: {len(tr)} dumped, mean reward {fmt(_mean_reward(tr))}"
                parts.append(f"<h4>Training rollouts of step {step} (dumped best and worst groups): best {len(b)} "
                             f"and worst {len(w)} of {len(tr)}</h4>" + _sample_table(b, w))
            elif step > 0:
                parts.append(missing(f"No training rollouts dumped for step {step} "
                                      f"(rollouts/step-{step}.jsonl is missing)."))
            body += (f"<details class='step'{' open' if j == 0 else ''}><summary>{esc(summary)}</summary>"
                     + "".join(parts) + "</details>")
    return Section("samples", title, body)
