"""The TRL side of the learning race (``benchmarks/learning_race.py``): the ``GRPOConfig`` of a run,
``GRPOTrainer`` with the logprob-gap measurement, the callback that evaluates, times the steps and
applies the time bound, and the run itself in the child process (``trl`` and ``trl-vllm``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar

import race_task as rt
from race_common import GROUP, KV_SHARE, device_facts
from race_model import greedy_accuracy
from race_tokenizer import check_prompt_ids


def trl_config(spec: dict, vllm: bool):
    """GRPOConfig with the race's settings (``learning_race.py``'s docstring gives the mapping)."""
    import torch
    from trl import GRPOConfig

    s, cuda = spec["settings"], torch.cuda.is_available()
    completions = s["prompts"] * GROUP  # one generation batch = one optimizer step, in `accum` micro-batches
    accum = next(a for a in range(-(-completions // s["trl_micro_batch"]), completions + 1) if completions % a == 0)
    extra = {}
    if vllm:
        extra = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": KV_SHARE,
                 "vllm_enable_sleep_mode": True, "vllm_max_model_length": 512,
                 "vllm_importance_sampling_correction": bool(s["trl_vllm_is"])}
    return GRPOConfig(
        output_dir=str(Path(spec["run_dir"]) / "trl"), per_device_train_batch_size=completions // accum,
        gradient_accumulation_steps=accum, num_generations=GROUP, max_completion_length=s["max_new_tokens"],
        max_steps=s["steps"], learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, beta=0.0, num_iterations=1,
        epsilon=0.2, epsilon_high=0.2, loss_type="dapo", scale_rewards="group", mask_truncated_completions=False,
        bf16=cuda, use_cpu=not cuda, seed=s["seed"], logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False, gradient_checkpointing=False, **extra)


def trl_trainer_class():
    """GRPOTrainer plus the logprob-gap measurement: mean |trainer logprob - sampling logprob| over
    completion tokens, from the training forward TRL runs anyway and the ``sampling_per_token_logps``
    its vLLM path returns (only in vLLM mode; transformers generate returns none)."""
    import torch
    from trl import GRPOTrainer

    class RaceGRPOTrainer(GRPOTrainer):
        race_gaps: ClassVar[list] = []  # (sum, count, max) per micro-batch
        race_fake_sampling = False  # the CPU test's stand-in for vLLM's logprobs (zeros): exercises the hook

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.race_fake_sampling and out.get("sampling_per_token_logps") is None:
                out["sampling_per_token_logps"] = torch.zeros_like(out["completion_mask"], dtype=torch.float32)
            return out

        def _compute_loss(self, model, inputs):
            self._race_pending = (inputs.get("sampling_per_token_logps"), inputs["completion_mask"])
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._race_pending = None

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            pending = getattr(self, "_race_pending", None)
            if pending is not None and pending[0] is not None and torch.is_grad_enabled():
                self._race_pending = None
                sampling, mask = pending
                logps = out[0].detach().float()
                if logps.shape == sampling.shape:
                    keep = mask.bool() & ~torch.isnan(sampling)
                    diff = (logps - sampling.to(logps.device)).abs()[keep]
                    if diff.numel():
                        self.race_gaps.append((diff.sum().item(), diff.numel(), diff.max().item()))
            return out

    return RaceGRPOTrainer


def trl_callback(spec: dict, tok, heldout: list[dict], record: dict):
    """Held-out evaluation (step 0 and every ``eval_every`` steps), step timing, the time bound."""
    import torch
    from transformers import TrainerCallback

    s, t0, cuda = spec["settings"], spec["t_launch"], torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class RaceCallback(TrainerCallback):
        def __init__(self):
            self.eval_s, self.t_step, self.last_step = 0.0, 0.0, None

        def evaluate(self, step: int, model) -> None:
            sync()
            t = time.time()
            train_s = t - t0 - self.eval_s
            acc = greedy_accuracy(model, tok, heldout, s["max_new_tokens"])
            sync()
            dt = time.time() - t
            self.eval_s += dt
            record["evals"].append({"step": step, "accuracy": acc, "wall": t + dt - t0, "eval_s": dt})
            print(f"[eval] step {step} acc {acc:.3f} train {train_s:.1f}s", flush=True)
            write_progress(spec, record)

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.evaluate(0, model)

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t_step = time.time()

        def on_step_end(self, args, state, control, model=None, **kw):
            sync()
            record["step_s"].append(time.time() - self.t_step)
            record["steps_done"] = state.global_step
            train_s = time.time() - t0 - self.eval_s
            if self.last_step is None and (train_s >= s["max_seconds"]
                                           or time.time() - t0 >= spec["wall_budget"] - spec["stop_reserve"]):
                self.last_step = state.global_step + 1  # as the rlcli runs: one more step, then the final eval
                print(f"[stop] time bound reached at step {state.global_step}: step {self.last_step} is the last",
                      flush=True)
            last = state.global_step >= min(state.max_steps, self.last_step or state.max_steps)
            control.should_training_stop = control.should_training_stop or last
            if state.global_step % s["eval_every"] == 0 or last:
                self.evaluate(state.global_step, model)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:  # TRL's own per-step metrics (its vLLM gap too when its IS is on)
                keep = ("reward", "completions", "step_time", "sampling", "clip_ratio")
                record["logs"].append({k: v for k, v in logs.items() if k.split("/")[0] in keep})

    return RaceCallback()


def write_progress(spec: dict, record: dict) -> None:
    (Path(spec["run_dir"]) / "progress.json").write_text(json.dumps(record))


def trl_child(spec: dict, vllm: bool) -> None:
    """One TRL GRPOTrainer run in this process."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    ws, s = Path(spec["warmstart"]), spec["settings"]
    torch.set_num_threads(s.get("threads") or torch.get_num_threads())  # CPU runs: --threads
    tok = AutoTokenizer.from_pretrained(str(ws))
    train, heldout = rt.read_rows(ws / "train.jsonl"), rt.read_rows(ws / "heldout.jsonl")
    check_prompt_ids(tok, train[:16])
    record: dict[str, Any] = {"evals": [], "step_s": [], "logs": [], "steps_done": 0}

    def addition_reward(completions, answer, **kw) -> list[float]:
        """rlcli's gsm8k judger on the decoded completion (special tokens skipped, as rlcli)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [rt.judge(t, a) for t, a in zip(texts, answer)]

    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]} for r in train])
    model = AutoModelForCausalLM.from_pretrained(str(ws), dtype=torch.float32)  # fp32 master weights
    cls = trl_trainer_class()
    cls.race_fake_sampling = bool(s.get("trl_fake_sampling_logps"))
    trainer = cls(model=model, reward_funcs=addition_reward, args=trl_config(spec, vllm), train_dataset=dataset,
                  processing_class=tok)
    [trainer.remove_callback(cb) for cb in (PrinterCallback, ProgressCallback)]  # our own progress lines only
    record["logits_processors"] = watch_logits_processors(trainer.model)
    trainer.add_callback(trl_callback(spec, tok, heldout, record))
    trainer.train()
    gaps = cls.race_gaps
    if gaps:
        record["logprob_gap_mean"] = sum(g[0] for g in gaps) / sum(g[1] for g in gaps)
        record["logprob_gap_max"] = max(g[2] for g in gaps)
        record["gap_metric"] = "|trainer logprob - sampling_per_token_logps| (race hook)"
    record.update(device_facts())
    write_progress(spec, record)


def watch_logits_processors(model) -> list[str]:
    """Record the logits processors of TRL's sampling ``generate`` calls, and drop truncating ones
    (top-k, top-p, min-p; recorded as ``removed:<name>``): rlcli samples from the full distribution,
    and transformers' global default is top_k=50 (TRL passes top_k=0, which should survive the merge
    with the model's generation config; the CPU test checks that nothing is removed)."""
    seen: list[str] = []
    orig = getattr(model, "_get_logits_processor", None)
    if orig is None:
        return ["(not watched: this transformers has no _get_logits_processor)"]

    def wrapped(*args, **kwargs):
        procs = orig(*args, **kwargs)
        gen = kwargs.get("generation_config", args[0] if args else None)
        if getattr(gen, "do_sample", False):
            bad = [p for p in procs if type(p).__name__ in ("TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")]
            for p in bad:
                procs.remove(p)
            if not seen:
                seen.extend([type(p).__name__ for p in procs] + [f"removed:{type(p).__name__}" for p in bad]
                            or ["(none)"])
        return procs

    model._get_logits_processor = wrapped
    return seen
