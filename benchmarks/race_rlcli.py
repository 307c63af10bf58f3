"""The rlcli side of the learning race (``benchmarks/learning_race.py``): the recipe of an rlcli run,
the run itself in the child process (``ColocateRunner`` as ``rlcli train`` builds it, plus the time
bound), and its curve and per-step figures read back from ``metrics.jsonl``."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from profiling import maybe_profile
from race_common import GROUP, KV_SHARE, REPO, device_facts

ENGINE_PLUGINS = {"vllm": "rlcli_vllm", "sglang": "rlcli_sglang", "lmdeploy": "rlcli_lmdeploy"}


def rlcli_recipe(framework: str, spec: dict) -> dict:
    """The recipe of one rlcli run (the embedded engine, an engine plugin, or async production)."""
    ws, s = Path(spec["warmstart"]), spec["settings"]
    n = s["prompts"] * GROUP
    engine = framework.split("-", 1)[1] if framework in ("rlcli-vllm", "rlcli-sglang", "rlcli-lmdeploy") else "embedded"
    share = {"vllm": "gpu_memory_utilization", "sglang": "mem_fraction_static", "lmdeploy": "cache_max_entry_count"}
    rollout = {"name": engine, "max_batch_size": n, "max_model_len": 512}
    if engine in share:
        rollout[share[engine]] = KV_SHARE
    produce: dict[str, Any] = {"name": "sync"}
    if framework == "rlcli-async":  # recipes/quickstart-async.yaml's production, weights synced every step
        produce = {"name": "async", "over_sample_threshold": 0.5, "enable_partial_rollout": True,
                   "max_staleness": 1, "tail_batch_trigger_size": 0, "tail_batch_max_tries": 3}
    judger = {"name": "gsm8k", "executor": "inline"}
    return {
        "description": f"learning race: {framework} GRPO from the warm start {ws}",
        "model": {"path": str(ws), "dtype": "auto"},
        "trainer": {"total_train_steps": s["steps"], "train_batch_size": s["prompts"], "sync_weights_interval": 1,
                    "seed": s["seed"], "enable_evaluate": True, "enable_initial_evaluate": True,
                    "evaluate_step": s["eval_every"], "checkpoint_interval": -1, "hf_interval": -1,
                    "exp_tracker": [{"name": "jsonl"}], "log_samples_per_step": 0, "dump_rollout_groups": 0},
        "resources": {"device": "auto", **({"num_threads": s["threads"]} if s.get("threads") else {})},
        "rollout": rollout,
        "train_worker": {"optimizer": {"lr": s["lr"], "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8},
                         "lr_scheduler": {"name": "constant", "warmup_steps": 0},
                         "loss": {"name": "vanilla", "clip_low": 0.2, "clip_high": 0.2, "clip_ratio_c": None,
                                  "loss_agg": "token-mean"},
                         "optimizer_steps": 1, "max_grad_norm": 1.0, "kl": {"coef": 0.0},
                         "pack_max_length": 32768, "share_prompts": True},
        "advantage": {"name": "grpo", "std": "unbiased", "eps": 1e-4},
        "replay_buffer": {"name": "async" if framework == "rlcli-async" else "sync"},
        "tasks": [{"task_name": "addition",
                   "sampler": {"name": "jsonl", "path": str(ws / "train.jsonl"), "prompt_repeat_k": GROUP},
                   "agent_loop": {"name": "single_turn", "sample_params": {
                       "max_tokens": s["max_new_tokens"], "temperature": 1.0, "top_p": 1.0, "top_k": 0}},
                   "judger": judger, "produce_strategy": produce}],
        "eval": {"tasks": [{"task_name": "heldout",
                            "sampler": {"name": "jsonl", "path": str(ws / "heldout.jsonl"), "prompt_repeat_k": 1,
                                        "shuffle": False},
                            "agent_loop": {"name": "single_turn", "sample_params": {
                                "max_tokens": s["max_new_tokens"], "temperature": 0.0}},
                            "judger": judger}],
                 "evaluator": {"sample_num": 0, "metrics": [{"name": "accuracy"}]}},
    }


def rlcli_registry(raw: dict):
    """The plugin registry with the recipe's engine plugin imported from ``plugins/`` (the GPU machine
    has the engine wheels but not the plugins installed)."""
    from rlcli.plugins import registry_with

    mod = ENGINE_PLUGINS.get(raw["rollout"]["name"])
    if mod is None:
        return registry_with()
    sys.path.insert(0, str(REPO / "plugins" / f"rlcli-{raw['rollout']['name']}"))
    return registry_with(importlib.import_module(mod))


def rlcli_child(spec: dict) -> None:
    """One rlcli run in this process: ``ColocateRunner`` exactly as ``rlcli train`` builds it, plus the
    time bound (a log hook that makes the next step the last one)."""
    import yaml

    from rlcli.config import validate_recipe
    from rlcli.runner.colocate import ColocateRunner

    run_dir, t0 = Path(spec["run_dir"]), spec["t_launch"]
    t_imported = time.time()
    raw = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    rec = validate_recipe(raw, registry=rlcli_registry(raw), source=str(run_dir / "recipe.yaml"))
    t_valid = time.time()
    with maybe_profile(os.environ.get("RACE_PROFILE"), f"startup-{spec['framework']}"):
        runner = ColocateRunner(rec, run_dir / "work", quiet=True, overwrite=True)
    print(f"[startup] imports {t_imported - t0:.1f}s, recipe {t_valid - t_imported:.1f}s, "
          f"runner {time.time() - t_valid:.1f}s", flush=True)
    orig_log, eval_s = runner.log, [0.0]

    def log(step, metrics, groups=None):
        row = orig_log(step, metrics, groups)
        eval_s[0] += row.get("timing/eval_s", 0.0)
        train_s = time.time() - t0 - eval_s[0]
        if "eval/accuracy" in row:
            print(f"[eval] step {step} acc {row['eval/accuracy']:.3f} train {train_s:.1f}s", flush=True)
        out_of_time = train_s >= spec["max_seconds"] or time.time() - t0 >= spec["wall_budget"] - spec["stop_reserve"]
        if step >= 1 and out_of_time and runner.schedule.total_steps > step + 1:
            print(f"[stop] time bound reached at step {step}: step {step + 1} is the last", flush=True)
            runner.schedule = dataclasses.replace(runner.schedule, total_steps=step + 1)
        return row

    runner.log = log
    try:
        runner.fit()
    finally:
        runner.close()
    (run_dir / "child.json").write_text(json.dumps(device_facts()))


def rlcli_result(run_dir: Path, t_launch: float) -> dict[str, Any]:
    """Curve and per-step figures from ``metrics.jsonl`` (what rlcli logs; nothing re-measured)."""
    path = run_dir / "work" / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    evals = [{"step": r["step"], "accuracy": r["eval/accuracy"], "wall": r["time"] - t_launch,
              "eval_s": r.get("timing/eval_s", 0.0)} for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if r["step"] >= 1]

    def every(key: str) -> list:
        return [r[key] for r in steps if r.get(key) is not None]

    gap = every("mismatch/logprob_abs_diff")
    return {"evals": evals, "steps_done": max((r["step"] for r in steps), default=0),
            "step_s": [r["timing/step_s"] - r.get("timing/eval_s", 0.0) for r in steps],
            "rollout_s": every("timing/rollout_s"), "train_s": every("timing/train_s"), "reward": every("reward/mean"),
            "sync_s": every("timing/sync_s"), "sleep_s": every("timing/sleep_s"), "wake_up_s": every("timing/wake_up_s"),
            "peak_gib_torch": max(every("memory/rollout_peak_gib") + every("memory/train_peak_gib"), default=None),
            "logprob_gap_mean": statistics.fmean(gap) if gap else None,
            "logprob_gap_max": max(every("mismatch/logprob_abs_diff_max"), default=None),
            "k3_kl_mean": statistics.fmean(every("mismatch/k3_kl")) if every("mismatch/k3_kl") else None,
            "gap_metric": "mismatch/logprob_abs_diff (rlcli's metrics.jsonl)" if gap else None}
