"""The report of the learning race (``python benchmarks/learning_race.py report``): a run's curve from its
evaluations, the time to the target accuracy, and the merged ``race.md`` table and ``race.png`` chart of
the run files (kind ``learning_race_run``) of one or more folders."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def time_to_target(curve: list[dict], target: float) -> float | None:
    """Training seconds at which held-out accuracy first reaches ``target``: linear interpolation
    between the last evaluation below it and the first at or above it (the first point if already
    there); None if never reached."""
    prev = None
    for p in curve:
        if p["accuracy"] >= target:
            if prev is None or p["accuracy"] == prev["accuracy"]:
                return p["seconds"]
            frac = (target - prev["accuracy"]) / (p["accuracy"] - prev["accuracy"])
            return prev["seconds"] + frac * (p["seconds"] - prev["seconds"])
        prev = p
    return None


def curve_from_evals(evals: list[dict]) -> list[dict]:
    """Eval points ``{step, accuracy, wall: s since launch at the eval's end, eval_s}`` -> ``{step, seconds,
    accuracy}``, seconds = wall minus the evaluations so far. The first evaluation is charged at most a warm one's
    cost (the median of the others): warm-up it does on the run's behalf (an engine's first compilation and CUDA
    graphs, cuBLAS start-up) counts as the run's start-up, as it would for a run that never evaluates."""
    warm = statistics.median(e["eval_s"] for e in evals[1:]) if len(evals) > 1 else None
    curve, spent = [], 0.0
    for i, e in enumerate(evals):
        spent += min(e["eval_s"], warm) if i == 0 and warm is not None else e["eval_s"]
        curve.append({"step": e["step"], "seconds": round(e["wall"] - spent, 2), "accuracy": e["accuracy"],
                      "eval_s": round(e["eval_s"], 2)})
    return curve


def load_runs(dirs: list[Path]) -> list[dict]:
    runs = []
    for d in dirs:
        for f in sorted(Path(d).glob("*.json")):
            try:
                r = json.loads(f.read_text())
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and r.get("kind") == "learning_race_run":
                r["source"] = Path(d).name
                runs.append(r)
    return runs


def run_label(r: dict, sources: int = 1) -> str:
    """``framework [recipe overrides]``, and the run's folder when several are merged."""
    sets = (r.get("settings") or {}).get("rlcli_set") or []
    return r["framework"] + (f" [{', '.join(sets)}]" if sets else "") + (f" <{r['source']}>" if sources > 1 else "")


def _fmt(x: Any, nd: int = 3) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def plot(runs: list[dict], target: float, path: Path, sources: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for r in runs:
        c = r.get("curve") or []
        if c:
            ax.plot([p["seconds"] for p in c], [p["accuracy"] for p in c], marker="o", ms=3,
                    label=f"{run_label(r, sources)} (seed {r['seed']})")
    ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.2f}")
    ax.set_xlabel("training seconds since process start (evaluation time excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(inputs: list[Path], out: Path) -> str:
    """Merge the run files of ``inputs`` into ``out/race.png`` and ``out/race.md``; returns the table."""
    runs = sorted(load_runs(inputs), key=lambda r: (r["framework"], r["seed"], r["source"]))
    sources = len({r["source"] for r in runs})
    out.mkdir(parents=True, exist_ok=True)
    if not runs:
        raise SystemExit(f"no run files (kind learning_race_run) in {', '.join(map(str, inputs))}")
    targets = sorted({round(r["target"], 6) for r in runs})
    target = runs[0]["target"]
    steps = [{p["step"] for p in r.get("curve") or []} for r in runs]
    common = max(set.intersection(*steps), default=None) if all(steps) else None
    lines = ["# Learning race: held-out greedy accuracy vs training seconds", "",
             f"Target accuracy {target:.3f}, fixed before the runs"
             + (f" (WARNING: the runs record different targets {targets})" if len(targets) > 1 else "")
             + "; time to target interpolates linearly between the last evaluation below it and the first at or "
             "above it. Training seconds: since the framework's process started, evaluation time subtracted.", "",
             (f"| framework | seed | acc step 0 | time to target (s) | acc @ step {_fmt(common)} | last eval (step: "
              "acc) | steps | median step (s) | peak GPU GiB torch / nvidia-smi | logprob gap mean / max | exit |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        c = r.get("curve") or []
        t = time_to_target(c, target)
        at = next((p["accuracy"] for p in c if p["step"] == common), None)
        last = f"{c[-1]['step']}: {c[-1]['accuracy']:.3f}" if c else "-"
        span = f"> {c[-1]['seconds']:.0f} (not reached)" if c and t is None else _fmt(t, 1)
        lines.append(f"| {run_label(r, sources)} | {r['seed']} | {_fmt(c[0]['accuracy'] if c else None)} | {span} | "
                     f"{_fmt(at)} | {last} | {r.get('steps_done', '-')} | {_fmt(r.get('median_step_s'))} | "
                     f"{_fmt(r.get('peak_gib_torch'), 2)} / {_fmt(r.get('peak_gib_nvidia_smi'), 2)} | "
                     f"{_fmt(r.get('logprob_gap_mean'), 4)} / {_fmt(r.get('logprob_gap_max'), 3)} | "
                     f"{r.get('exit_code')} |")
    lines += ["", *speedups(runs, target), "", *run_notes(runs, sources)]
    text = "\n".join(lines) + "\n"
    plot(runs, target, out / "race.png", sources)
    (out / "race.md").write_text(text)
    print(text, flush=True)
    return text


def speedups(runs: list[dict], target: float) -> list[str]:
    """rlcli's best time to target against ``trl`` and ``trl-vllm``, per seed, within each run folder
    (runs in one folder ran back to back on one machine; across folders machines may differ)."""
    lines = []
    for source in sorted({r["source"] for r in runs}):
        group = [r for r in runs if r["source"] == source]
        ttt = {(run_label(r), r["seed"]): time_to_target(r.get("curve") or [], target) for r in group}
        prefix = f"{source}, " if len({r["source"] for r in runs}) > 1 else ""
        for seed in sorted({r["seed"] for r in group}):
            mine = {fw: t for (fw, s), t in ttt.items() if s == seed}
            best = min(((t, fw) for fw, t in mine.items() if fw.startswith("rlcli") and t is not None), default=None)
            for base in ("trl", "trl-vllm"):
                if base not in mine or not any(fw.startswith("rlcli") for fw in mine):
                    continue
                last = max((p["seconds"] for r in group if run_label(r) == base and r["seed"] == seed
                            for p in r.get("curve") or []), default=0.0)
                head = f"- {prefix}seed {seed}:"
                if best is None:
                    lines.append(f"{head} no rlcli run reached the target; {base}: {_fmt(mine[base], 1)} s")
                elif not last:
                    lines.append(f"{head} {base} has no evaluation (see its exit code and log_tail)")
                elif mine[base] is None:
                    lines.append(f"{head} {base} did not reach the target in {last:.0f} s; rlcli's best "
                                 f"({best[1]}) took {best[0]:.1f} s: speed-up > {last / best[0]:.2f}x")
                else:
                    lines.append(f"{head} speed-up of rlcli's best ({best[1]}, {best[0]:.1f} s) over {base} "
                                 f"({mine[base]:.1f} s): **{mine[base] / best[0]:.2f}x**")
    by_fw: dict[str, list] = {}
    for r in runs:
        by_fw.setdefault(run_label(r), []).append(time_to_target(r.get("curve") or [], target))
    for fw, ts in by_fw.items():
        if len(ts) > 1:
            ok = [t for t in ts if t is not None]
            lines.append(f"- run-to-run noise, {fw}, {len(ts)} runs: time to target "
                         + (f"{min(ok):.1f}-{max(ok):.1f} s" if ok else "never reached")
                         + (f" ({len(ts) - len(ok)} not reached)" if len(ok) < len(ts) else ""))
    return lines


def run_notes(runs: list[dict], sources: int = 1) -> list[str]:
    r0 = runs[0]
    ws, s = r0.get("warmstart", {}), r0.get("settings", {})
    lines = [(f"Warm start: {ws.get('size')} model, {_fmt(ws.get('params'))} parameters, {ws.get('sft_steps')} SFT "
              f"steps in {ws.get('sft_seconds')} s, held-out accuracy {_fmt(ws.get('heldout_accuracy'))} on "
              f"{ws.get('heldout_n')} problems ({ws.get('stop_reason')})."),
             (f"Settings: {s.get('prompts')} prompts x {s.get('group')} samples per step, lr {s.get('lr')}, "
              f"max new tokens {s.get('max_new_tokens')}, temperature 1, top-p 1, top-k off, beta 0, clip 0.2/0.2, "
              f"eval every {s.get('eval_every')} steps, at most {s.get('steps')} steps or {s.get('max_seconds')} "
              "training seconds."), ""]
    for r in runs:
        v = {k: x for k, x in (r.get("versions") or {}).items() if x}
        lines.append(f"- {run_label(r, sources)} seed {r['seed']}: {r.get('gpu', '?')}, {r.get('date', '?')}, rlcli "
                     f"{r.get('commit', '?')}, {', '.join(f'{k} {x}' for k, x in v.items())}; gap metric: "
                     f"{r.get('gap_metric') or '-'}")
    return lines
