"""The TRL rows of ``grpo_step.py``: GRPOTrainer on the benchmark's work, with transformers
generate or with vLLM in colocate mode (the set-up a TRL user who cares about speed picks).

Both rows get the same work as rlcli's: ``prompts`` prompts of ``prompt_len`` words × ``k``
samples × ``new`` tokens (``full``: EOS ignored in the vLLM row; ``longtail``: EOS on, ``new`` the
cut, the model directory's ``generation_config.json`` holding the end ids, see lengths.py), one
optimizer step per batch, lr 1e-6, no KL, the length-mod-7 reward. Each step is split into rollout
(``_generate_single_turn``: generation, with vLLM its wake-up and sleep), weight sync (vLLM's
``sync_weights``) and the rest (train: scoring, logprobs, loss, optimizer), timed with the device
synchronised at each boundary.
A vLLM row takes its GRPOConfig settings from ``TRL_VLLM`` updated by the variant's own
(``--trl-vllm-variant NAME:KEY=VALUE,...`` in grpo_step.py), so every setting a run used is stated
in its result.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

# GRPOConfig settings of the vLLM colocate row before any variant: the ones the 2026-12-03
# measurement used. `vllm_max_model_length` is set per run to prompt + new tokens.
TRL_VLLM = {
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_enable_sleep_mode": True,
}

# The TRL + vLLM row a user tuning for speed would run (issue 32), on top of TRL_VLLM:
# - vllm_enable_sleep_mode off: TRL otherwise puts vLLM to sleep at level 2 after every generation
#   (weights and KV cache released) and wakes it before the next; the 0.5B-3B shapes fit without it.
# (The generation batch is one wave of 512 sequences; a micro-batch of 128 instead of 64 would double
# TRL's activations, 73 GiB at 0.5B, so it is left at 64.)
# - vllm_importance_sampling_correction off: TRL otherwise runs one more forward pass over the batch
#   (old logprobs) to correct for vLLM's sampling; rlcli's benchmark recipe has no such correction
#   (rollout_is unset), so both run the same algorithm.
# vLLM's own settings inside TRL stay TRL's: max_num_seqs = the generation batch (512 here, one
# wave), CUDA graphs and torch.compile on (vLLM's defaults), gpu_memory_utilization 0.3.
TRL_VLLM_TUNED = {"vllm_enable_sleep_mode": False, "vllm_importance_sampling_correction": False}
# What the larger shapes need to fit on one H200 (TRL trains in bf16: weights, gradients and AdamW
# moments 8 bytes a parameter; its torch peak was 73 GiB at 0.5B and 111 GiB at 1.5B without
# checkpointing, nearly all activations): gradient checkpointing from 3B on, and at 7B the engine
# also sleeps to make room for the 61 GB of training state.
TUNED_BY_SHAPE = {"3b": {"gradient_checkpointing": True},
                  "7b": {"gradient_checkpointing": True, "vllm_enable_sleep_mode": True}}


# Long-tailed lengths (responses up to 1,024 tokens) at every shape: without checkpointing TRL ran out of
# the H200's memory at 0.5B (2026-12-04, 139.7 GiB in use).
TUNED_BY_LENGTHS = {"longtail": {"gradient_checkpointing": True}}


def tuned_settings(shape: str, lengths: str = "full") -> dict:
    """TRL_VLLM_TUNED for a model shape and length regime, with what they need to fit (TUNED_BY_SHAPE,
    TUNED_BY_LENGTHS)."""
    return {**TRL_VLLM_TUNED, **TUNED_BY_SHAPE.get(shape, {}), **TUNED_BY_LENGTHS.get(lengths, {})}


def trl_config_kwargs(work: dict, steps: int, vllm: dict | None) -> dict:
    """GRPOConfig keyword arguments for ``work`` (prompts, k, new, prompt_len, device) and ``steps``."""
    cuda = work["device"] == "cuda"
    kw = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=work["prompts"] * work["k"] // 8,
              gradient_accumulation_steps=8, num_generations=work["k"], max_completion_length=work["new"],
              max_steps=steps + 1, learning_rate=1e-6, bf16=cuda, use_cpu=not cuda, logging_steps=1,
              report_to="none", save_strategy="no", temperature=1.0, beta=0.0, use_vllm=False,
              gradient_checkpointing=False)
    if vllm is not None:
        kw.update(TRL_VLLM, vllm_max_model_length=work["prompt_len"] + work["new"])
        if work.get("lengths", "full") == "full":  # full-length responses, as rlcli's benchmark recipe forces them
            kw["generation_kwargs"] = {"ignore_eos": True}
        kw.update(vllm)
    return kw


def trl_steps(model_dir: Path, steps: int, work: dict, vllm: dict | None = None) -> dict:
    """Time ``steps`` + 1 GRPO steps of TRL (the first is warm-up); the result row's fields."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = work["device"] == "cuda"
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    g = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, work["vocab"] - 3, (work["prompt_len"],), generator=g))
               for _ in range(work["prompts"] * (steps + 2))]
    times: list[float] = []
    phases: dict[str, float] = {"rollout": 0.0, "sync": 0.0}  # seconds of the step in progress
    split: list[dict] = []  # per step: rollout, sync seconds
    made: list[list[int]] = [[]]  # completion lengths (tokens) of each step

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(name: str, fn):
        def run(*a, **kw):
            sync()
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sync()
                phases[name] += time.perf_counter() - t
        return run

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            times.append(time.perf_counter() - self.t)
            split.append({"rollout_s": phases["rollout"] - phases["sync"], "sync_s": phases["sync"]})
            phases.update(rollout=0.0, sync=0.0)
            made.append([])

    def reward(completions, completion_ids=None, **kw):
        made[-1].extend(len(c) for c in completion_ids or [])
        return [float(len(c) % 7) for c in completions]

    settings = trl_config_kwargs(work, steps, vllm)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=work["dtype"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**settings),
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    startup = time.perf_counter() - t0
    trainer.add_callback(Timer())
    trainer._generate_single_turn = timed("rollout", trainer._generate_single_turn)
    if getattr(trainer, "vllm_generation", None) is not None:
        trainer.vllm_generation.sync_weights = timed("sync", trainer.vllm_generation.sync_weights)
    trainer.train()
    row = steps_row(times, split, made, work, startup)
    if vllm is not None:
        row["settings"] = {k: v for k, v in settings.items() if k.startswith("vllm_") or k == "generation_kwargs"}
        row["vllm"] = __import__("vllm").__version__
    if cuda:
        free, total = torch.cuda.mem_get_info()
        row["device_used_gib"] = round((total - free) / 2**30, 1)
    del trainer, model
    return row


def steps_row(times: list[float], split: list[dict], made: list[list[int]], work: dict, startup: float) -> dict:
    """The row's timings and work from the steps after the warm-up: step seconds (``times``), each
    step's rollout and sync seconds (``split``) and completion lengths (``made``)."""
    measured = times[1:]
    med = statistics.median
    rollout = med(x["rollout_s"] for x in split[1:])
    sync_s = med(x["sync_s"] for x in split[1:])
    lens = [n for m in made[1:len(times)] for n in m]
    # the tokens the model runs on per step: each sample's prompt and completion (no prompt sharing)
    tokens = med(work["prompts"] * work["k"] * work["prompt_len"] + sum(m) for m in made[1:len(times)])
    row = dict(version=__import__("trl").__version__, steps_measured=len(measured),
               step_s_median=round(med(measured), 3), step_s_min=round(min(measured), 3),
               step_s_max=round(max(measured), 3), startup_s=round(startup, 1),
               rollout_s=round(rollout, 3), sync_s=round(sync_s, 4),
               train_s=round(med(t - x["rollout_s"] - x["sync_s"] for t, x in zip(measured, split[1:])), 3),
               gen_tok_per_s=round(med(sum(m) / x["rollout_s"] for m, x in zip(made[1:len(times)], split[1:])), 0),
               completion_lengths=lens, trained_tokens=tokens,
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if work["device"] == "cuda" else None)
    return row


def parse_variant(spec: str) -> tuple[str, dict]:
    """``NAME:KEY=VALUE,KEY=VALUE`` -> (NAME, settings); values read as YAML scalars."""
    import yaml

    label, _, sets = spec.partition(":")
    out = {}
    for kv in filter(None, sets.split(",")):
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--trl-vllm-variant {spec!r}: {kv!r} is not KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return label, out
