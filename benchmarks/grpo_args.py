"""The command line of ``grpo_step.py``: the flags of its sections, of the work and of what it writes."""

from __future__ import annotations

import argparse
from pathlib import Path


def build_parser(shapes: list[str]) -> argparse.ArgumentParser:
    """The flags of grpo_step.py; ``shapes`` are the choices of --shape."""
    ap = argparse.ArgumentParser()
    for flag in ("ceilings", "engine", "rlcli", "trl", "trl_vllm", "all"):
        ap.add_argument(f"--{flag.replace('_', '-')}", action="store_true")
    ap.add_argument("--trl-vllm-tuned", action="store_true",
                    help="a TRL + vLLM colocate run with grpo_trl.TRL_VLLM_TUNED (for this --shape) on top")
    ap.add_argument("--trl-vllm-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="one more TRL + vLLM colocate run with these GRPOConfig settings, e.g. "
                    "nosleep:vllm_enable_sleep_mode=false,vllm_gpu_memory_utilization=0.5 (repeatable)")
    ap.add_argument("--steps", type=int, default=5, help="GRPO steps per framework (the first is warm-up)")
    ap.add_argument("--shape", default="0.5b", choices=shapes,
                    help="random-init Qwen2.5 shape of the model (with --tiny: the tiny model, this shape's presets)")
    ap.add_argument("--lengths", default="full", choices=["full", "longtail"],
                    help="full: 256 new tokens, EOS ignored; longtail: EOS on, geometric lengths of mean 256 cut at "
                    "1024 (benchmarks/lengths.py)")
    ap.add_argument("--model-cache", type=Path, metavar="DIR",
                    help="keep the random-init model of a shape in DIR/<shape...> and reuse it (default: a temp dir)")
    ap.add_argument("--label", default="embedded", help="label of the --rlcli run (its row in the table)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script, measures nothing")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="recipe override for the rlcli section (repeatable), e.g. train_worker.pack_max_length=4096")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="one more rlcli run with these overrides (on top of --set), labelled NAME (repeatable)")
    ap.add_argument("--engine-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="one more engine run with these backend settings, e.g. compiled:compile=true (repeatable)")
    ap.add_argument("--engine-plugin", action="append", default=[], choices=["vllm", "sglang", "lmdeploy"],
                    help="register plugins/rlcli-<NAME> for the rlcli runs without installing it (repeatable); "
                    "then e.g. --variant sglang:rollout.name=sglang,rollout.mem_fraction_static=0.3")
    ap.add_argument("--profile", nargs="?", const="all", choices=["all", "train"],
                    help="torch.profiler tables (into --out, else printed): 'all' = one engine call, one whole "
                    "GRPO step and one train step; 'train' = the train step only (cheaper)")
    ap.add_argument("--memory", action="store_true",
                    help="record allocation stacks (slows the steps) and write, for the third train step of each rlcli "
                    "run, what was allocated at its peak and what it leaves allocated (memory-train-<label>.txt, into --out)")
    return ap
