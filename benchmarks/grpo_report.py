"""The files ``grpo_step.py --out DIR`` writes: results.json, table.md and split.png.

``write_outputs`` is called after every section, so that a run cut short still leaves its results;
``versions`` states trl's and vllm's versions and the rlcli commit in the results' environment.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def versions() -> dict:
    """trl, vllm (when installed) and the rlcli commit of this checkout (``git describe``)."""
    import importlib.metadata
    import subprocess

    out = {}
    for name in ("trl", "vllm"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    try:
        out["rlcli_commit"] = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                                             capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["rlcli_commit"] = None
    return out


def write_outputs(out: Path, results: list[dict], device: str, shape_name: str, lengths_mode: str) -> None:
    """results.json (the environment and every result), table.md (a row per rlcli and TRL run) and
    split.png (the first rlcli run's step split against TRL's step) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (smoke test)"
    env = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "torch": torch.__version__,
           "transformers": transformers.__version__, **versions(), "shape": shape_name, "lengths": lengths_mode,
           "tiny": device == "cpu"}
    (out / "results.json").write_text(json.dumps({"env": env, "results": results}, indent=2))
    by = {r["what"]: r for r in reversed(results) if "error" not in r}  # first result of each kind
    variants = [r for r in results if r.get("what") == "rlcli" and "error" not in r]
    lines = [f"{env['date']}, {env['gpu']}, torch {env['torch']}, transformers {env['transformers']}", "",
             "| framework | step median (s) | min-max (s) | rollout (s) | train (s) | sync (s) | gen tok/s | MFU | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in variants:
        name = f"rlcli ({r.get('backend', 'embedded')})" if r.get("label", "embedded") == "embedded" else f"rlcli ({r['label']}: {' '.join(r['overrides'])})"
        lines.append(f"| {name} | {r['step_s_median']} | {r['step_s_min']}-{r['step_s_max']} | {r['rollout_s']} | "
                     f"{r['train_s']} | {r['sync_s']} | {r['gen_tok_per_s']:.0f} | {r['train_mfu']} | {r['peak_gib']} |")
    for r in results:
        if r.get("what") in ("trl", "trl-vllm") and "error" not in r:
            name = f"TRL {r['version']}" + (f" + vLLM {r['vllm']} colocate ({r['label'] or 'default'})" if "vllm" in r else "")
            lines.append(f"| {name} | {r['step_s_median']} | {r['step_s_min']}-{r['step_s_max']} | {r['rollout_s']} | "
                         f"{r['train_s']} | {r['sync_s']} | {r['gen_tok_per_s']:.0f} | {r.get('train_mfu')} | {r['peak_gib']} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    if "rlcli" in by:
        plot_split(out, by)


def plot_split(out: Path, by: dict[str, dict]) -> None:
    """split.png: the rlcli row's median rollout / train / sync seconds as one bar, TRL's step beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = by["rlcli"]
    fig, ax = plt.subplots(figsize=(6, 2.2))
    left = 0.0
    for key, color in (("rollout_s", "#4c72b0"), ("train_s", "#dd8452"), ("sync_s", "#55a868")):
        ax.barh(["rlcli"], [r[key]], left=left, color=color, label=key[:-2])
        left += r[key]
    if "trl" in by:
        ax.barh(["TRL"], [by["trl"]["step_s_median"]], color="#8172b3", label="TRL step")
    ax.set_xlabel("seconds per GRPO step (median)")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "split.png", dpi=120)
