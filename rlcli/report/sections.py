"""The report's sections built from ``metrics.jsonl``: the runs' summary, reward and evaluation,
response length, rollout health, step time, throughput, training, and engine-trainer agreement."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from rlcli.report import plots
from rlcli.report.markup import (
    Section,
    all_zero,
    constant,
    constants_note,
    duration,
    esc,
    figure,
    fmt,
    img,
    missing,
    no_metrics_reason,
    present,
    swatch,
    table,
)
from rlcli.report.plots import Getter, Line, Panel, metric, ratio
from rlcli.report.rundata import Run

MAX_EVAL_PANELS = 12

# rollout/* keys that are volumes, latencies or staleness, not event counters
_ROLLOUT_NON_COUNTERS = {"rollout/groups", "rollout/samples", "rollout/tokens", "rollout/produced_samples",
                         "rollout/staleness_mean", "rollout/staleness_max"}
_JUDGER_NON_COUNTERS = {"judger/calls", "judger/time_s"}
_TRAIN_PANELS = [("train/loss", "loss"), ("train/grad_norm", "grad norm (before clipping)"),
                 ("train/entropy", "entropy"), ("train/lr", "learning rate"), ("train/clipfrac", "clip fraction"),
                 ("train/kl_k3", "KL to rollout policy (k3)")]


def section_summary(runs: Sequence[Run]) -> Section:
    rows = []
    for i, r in enumerate(runs):
        evals = [k for k in _eval_keys(runs) if r.has(k)][:3]
        ev = "<br>".join(_first_last_best(k[5:], r.series(k)[1]) for k in evals) or "—"
        rows.append([
            f"{swatch(i) if len(runs) > 1 else ''}<b>{esc(r.label)}</b>",
            f"<code>{esc(r.path.resolve())}</code>",
            esc(r.description) or "—",
            esc(r.status()),
            fmt(r.last("reward/mean")),
            ev,
            duration(r.wall_time_s),
        ])
    body = table(["run", "work dir", "description", "status", "last reward/mean", "eval (first → last)",
                   "time in steps"], rows, "summary")
    notes = [(r.label, n) for r in runs for n in r.notes]
    if notes:
        body += '<ul class="notes">' + "".join(
            f"<li><b>{esc(lab)}</b>: {esc(n)}</li>" for lab, n in notes) + "</ul>"
    return Section("summary", "Runs", body)


def _first_last_best(name: str, values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    best = f" (best {fmt(max(finite))})" if finite else ""
    return f"{esc(name)}: {fmt(values[0])} → <b>{fmt(values[-1])}</b>{best}"


def _eval_keys(runs: Sequence[Run]) -> list[str]:
    keys = sorted({k for r in runs for k in r.keys("eval/")  # counters, not eval results
                   if "judger/" not in k and "agent_loop/" not in k and "engine/" not in k})
    keys = [k for k in keys if not (re.search(r"(^|/)failed$", k[5:]) and all_zero(runs, k))]
    first = [k for k in keys if k == "eval/accuracy"]
    return first + [k for k in keys if k != "eval/accuracy"]


def _reward_spread(sign: int) -> Getter:
    """``reward/mean`` plus ``sign`` times ``reward/std`` per step, kept within ``reward/min``..``max``."""

    def get(run: Run) -> tuple[list[float], list[float]]:
        std = dict(zip(*run.series("reward/std")))
        bound = dict(zip(*run.series("reward/min" if sign < 0 else "reward/max")))
        xs, ys = [], []
        for x, m in zip(*run.series("reward/mean")):
            if x in std:
                y = m + sign * std[x]
                xs.append(x)
                ys.append(max(y, bound.get(x, y)) if sign < 0 else min(y, bound.get(x, y)))
        return xs, ys

    return get


def section_reward(runs: Sequence[Run]) -> Section:
    panels: list[Panel] = []
    mean = Line("mean", metric("reward/mean"))
    if plots.has_data(runs, mean):
        spread = any(r.has("reward/std") for r in runs)  # runs older than reward/std: no band
        panels.append(Panel("training reward (mean" + ("; band: ±1 std over samples)" if spread else ")"), [mean],
                            band=(_reward_spread(-1), _reward_spread(1)) if spread else None, band_label="±1 std"))
    tasks = sorted({k.split("/")[1] for r in runs for k in r.keys("task/") if k.endswith("/reward_mean")})
    if len(tasks) > 1:
        panels.append(Panel("training reward by task", [Line(t, metric(f"task/{t}/reward_mean")) for t in tasks]))
    ekeys = _eval_keys(runs)
    flat = [k for k in ekeys if constant(runs, k) is not None]
    drawn = [k for k in ekeys if k not in flat]
    for k in drawn[:MAX_EVAL_PANELS]:
        panels.append(Panel(k, [Line(k[5:], metric(k), markers=True)]))
    if not panels and not flat:
        why = no_metrics_reason(runs) or "no reward/* or eval/* metrics logged yet"
        return Section("reward", "Reward and eval", missing(f"Nothing to plot: {why}."))
    body = figure(runs, panels) if panels else ""
    if len(drawn) > MAX_EVAL_PANELS:
        body += f"<p class='note'>{len(drawn) - MAX_EVAL_PANELS} more eval metrics are in metrics.jsonl.</p>"
    body += constants_note(runs, flat)
    if not ekeys:
        body += missing("No eval metrics yet (evaluation is off, or no eval step has been reached).")
    return Section("reward", "Reward and eval", body)


def section_length(runs: Sequence[Run]) -> Section:
    panels = []
    lines = present(runs, [Line("mean", metric("response/length_mean")), Line("max", metric("response/length_max"))])
    if lines:
        panels.append(Panel("response length (tokens)", lines, ylabel="tokens"))
    trunc = Line("truncated", metric("response/truncated_frac"))
    if plots.has_data(runs, trunc):
        panels.append(Panel("fraction cut at max_tokens", [trunc], ylim=(-0.02, 1.02)))
    prompt = Line("mean", metric("prompt/length_mean"))
    if plots.has_data(runs, prompt):
        panels.append(Panel("prompt length (tokens)", [prompt], ylabel="tokens"))
    if not panels:
        why = no_metrics_reason(runs) or "no response/* metrics logged yet"
        return Section("length", "Response length", missing(f"Nothing to plot: {why}."))
    return Section("length", "Response length", figure(runs, panels, ncols=3))


def _counter_keys(runs: Sequence[Run]) -> list[str]:
    keys = set()
    for r in runs:
        for k in r.keys("rollout/"):
            if k not in _ROLLOUT_NON_COUNTERS and not k.startswith("rollout/group_time"):
                keys.add(k)
        for k in [*r.keys("judger/"), *r.keys("agent_loop/")]:
            if k not in _JUDGER_NON_COUNTERS:
                keys.add(k)
    return sorted(keys, key=lambda k: (not k.startswith("rollout/"), k))


def section_health(runs: Sequence[Run]) -> Section:
    title = "Staleness and rollout health"
    panels = []
    stale = present(runs, [Line("mean", metric("rollout/staleness_mean")),
                            Line("max", metric("rollout/staleness_max"))])
    if stale:
        panels.append(Panel("staleness (policy versions behind)", stale, ylabel="versions"))
    counters = _counter_keys(runs)
    nonzero = [k for k in counters if not all_zero(runs, k)]
    zero = [k for k in counters if k not in nonzero]
    for k in nonzero:
        panels.append(Panel(k, [Line(k.split("/", 1)[1], metric(k))], ylabel="per step"))
    if not panels and not counters:
        why = no_metrics_reason(runs) or "no rollout/* metrics logged yet"
        return Section("health", title, missing(f"Nothing to plot: {why}."))
    body = ""
    if panels:
        body = figure(runs, panels, ncols=3, row_h=2.4)
    if zero:
        body += ("<p class='ok'>Zero at every step: " + ", ".join(f"<code>{esc(k)}</code>" for k in zero) + ".</p>")
    if counters:
        heads = ["counter"] + [f"{r.label}: total / max per step" for r in runs]
        rows = []
        for k in counters:
            cells = [f"<code>{esc(k)}</code>"]
            for r in runs:
                v = [x for x in r.series(k)[1] if math.isfinite(x)]
                cells.append(f"{fmt(sum(v))} / {fmt(max(v))}" if v else "—")
            rows.append(cells)
        body += table(heads, rows, "num")
    return Section("health", title, body)


def section_time(runs: Sequence[Run]) -> Section:
    title = "Where the step time goes"
    phases = plots.step_phases(runs)
    if not phases:
        why = no_metrics_reason(runs) or "no timing/* metrics logged yet"
        return Section("time", title, missing(f"Nothing to plot: {why}."))
    body = img(plots.step_time_figure(runs), "stacked bars: seconds per step by phase")
    heads = ["phase"] + [f"{r.label}: mean s/step (share)" for r in runs]
    per_run = []
    for r in runs:
        steps, by_phase = plots.step_time_table(r, phases)
        train_steps = [i for i, s in enumerate(steps) if s > 0] or list(range(len(steps)))
        means = {p: (sum(by_phase[p][i] for i in train_steps) / len(train_steps) if train_steps else 0.0)
                 for p in by_phase}
        per_run.append(means)
    rows = []
    for p in phases:
        cells = [esc(plots.phase_label(p))]
        for means in per_run:
            total = sum(means.values())
            v = means.get(p)
            cells.append("—" if v is None else f"{v:.3f} ({100 * v / total:.0f}%)" if total > 0 else f"{v:.3f}")
        rows.append(cells)
    rows.append(["<b>step (total)</b>"] + [f"<b>{sum(m.values()):.3f}</b>" for m in per_run])
    body += table(heads, rows, "num")
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
    lat = present(runs, [Line("p50", metric("rollout/group_time_p50")), Line("p99", metric("rollout/group_time_p99"))])
    if lat:
        panels.append(Panel("rollout time per group (s)", lat, ylabel="s"))
    if not panels:
        why = no_metrics_reason(runs) or "needs rollout/tokens and timing/rollout_s"
        return Section("throughput", title, missing(f"Nothing to plot: {why}."))
    body = figure(runs, panels, ncols=2, row_h=2.5)
    rows = []
    for t, num, den, _ in specs:
        rows.append([esc(t)] + [fmt(_total_ratio(r, num, den)) for r in runs])
    body += table(["whole run"] + [r.label for r in runs], rows, "num")
    body += ("<p class='note'>Per step: <code>rollout/tokens / timing/rollout_s</code>, "
             "<code>rollout/samples / timing/step_s</code>, <code>train/tokens / timing/train_s</code>; "
             "the table divides the run's totals.</p>")
    return Section("throughput", title, body)


def section_training(runs: Sequence[Run]) -> Section:
    title = "Training"
    logged = [k for k, _ in _TRAIN_PANELS if any(r.has(k) for r in runs)]
    flat = [k for k in logged if constant(runs, k) is not None]
    panels = [Panel(t, [Line(k.split("/", 1)[1], metric(k))]) for k, t in _TRAIN_PANELS if k in logged and k not in flat]
    if not logged:
        why = no_metrics_reason(runs) or "no train/* metrics logged yet"
        return Section("training", title, missing(f"Nothing to plot: {why}."))
    body = (figure(runs, panels, ncols=3, row_h=2.4) if panels else "") + constants_note(runs, flat)
    others = sorted({k for r in runs for k in r.keys("train/")} - {k for k, _ in _TRAIN_PANELS})
    if others:
        body += ("<p class='note'>Also in metrics.jsonl and TensorBoard: "
                 + ", ".join(f"<code>{esc(k)}</code>" for k in others) + ".</p>")
    return Section("training", title, body)


_MISMATCH_NOTE = ("Per response token, the inference engine's log-probability of the token it sampled against the "
                  "trainer's before the update: the two must agree (a float32 embedded engine on the CPU: about "
                  "1e-7). A growing gap means weights that did not reach the engine, or another precision or "
                  "kernel; train_worker.rollout_is corrects for it.")


def section_mismatch(runs: Sequence[Run]) -> Section:
    title = "Engine-trainer agreement"
    gap = present(runs, [Line("mean", metric("mismatch/logprob_abs_diff")),
                         Line("max", metric("mismatch/logprob_abs_diff_max"))])
    kl = present(runs, [Line("k3", metric("mismatch/k3_kl")), Line("k1", metric("mismatch/kl"))])
    panels = []
    if gap:
        panels.append(Panel("|log p engine - log p trainer| per token", gap, ylabel="nats", log_y=True))
    if kl:
        panels.append(Panel("KL(engine || trainer)", kl, ylabel="nats"))
    if not panels:
        why = no_metrics_reason(runs) or "no mismatch/* metrics logged (runs older than this rlcli)"
        return Section("mismatch", title, missing(f"Nothing to plot: {why}."))
    rows = [[f"{swatch(i) if len(runs) > 1 else ''}{esc(r.label)}",
             fmt(_mean(r.series("mismatch/logprob_abs_diff")[1])),
             fmt(max(r.series("mismatch/logprob_abs_diff_max")[1], default=None))] for i, r in enumerate(runs)]
    body = figure(runs, panels, ncols=2, row_h=2.5) + f"<p class='note'>{esc(_MISMATCH_NOTE)}</p>"
    body += table(["run", "mean gap over the run", "largest token gap"], rows, "num")
    return Section("mismatch", title, body)


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None
