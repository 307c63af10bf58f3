"""Race to a held-out accuracy: rlcli against TRL, GRPO from the same warm start, same everything.

Measures held-out greedy accuracy against *training seconds* per framework: wall-clock seconds since
the framework's process was started (imports, model load, engine start-up included) minus the seconds
spent in held-out evaluation. Per run also: median step time (evaluation excluded), peak GPU memory
(``torch.cuda.max_memory_allocated`` of the run's process, and the device's ``memory.used`` from
nvidia-smi, which also sees engine processes and vLLM's allocator), mean engine-vs-trainer logprob gap.

    python benchmarks/learning_race.py warmstart --size small --work /tmp/race           # <= ~3 min on an H200
    python benchmarks/learning_race.py race --size small --work /tmp/race --out $OUT \
        --framework rlcli trl --max-seconds 150                                            # warm start if missing
    python benchmarks/learning_race.py race --reuse /tmp/race/warmstart --work /tmp/race --out $OUT \
        --framework trl-vllm rlcli-vllm --max-seconds 200                                  # needs vLLM's wheels
    python benchmarks/learning_race.py report --inputs call1/ call2/ --out merged/         # anywhere, CPU
    python benchmarks/learning_race.py race --size tiny --work /tmp/t --out /tmp/t/out --framework rlcli  # CPU

Warm start (``race_warmstart.py``; the task in ``race_task.py``): a ~76M-parameter Qwen2 (``--size
small``) trained from scratch on multi-digit addition with written carries, stopped at 0.3 greedy
accuracy on held-out data.

GRPO, the same for every framework: ``train.jsonl``'s prompts, group size 8, ``--prompts`` prompts
per step, one optimizer step per rollout batch (AdamW 0.9/0.999, eps 1e-8, no weight decay, constant
``--lr``, gradient norm clipped at 1), temperature 1, top-p 1, top-k off, the warm start's
``max_new_tokens``, responses end at EOS, no KL, rlcli's ``gsm8k`` judger as the reward, fp32 master
weights and bf16 compute on GPU (rlcli: FSDP2 mixed precision; TRL: float32 model, ``bf16=True``).

* loss aggregation: rlcli ``loss_agg: token-mean`` = TRL 1.16 ``loss_type="dapo"``, whose normaliser
  is ``num_items_in_batch`` (active completion tokens of the whole generation batch) times
  ``gradient_accumulation_steps / steps_per_generation`` (= 1: one generation batch per optimizer
  step); ``loss_is_scaled_for_ga`` stops the Trainer dividing again (grpo_trainer.py ``_compute_loss``).
* advantages: rlcli ``{name: grpo, std: unbiased, eps: 1e-4}`` = TRL ``scale_rewards="group"``:
  (r - group mean) / (Bessel-corrected group std + 1e-4).
* clip: rlcli ``vanilla`` 0.2/0.2 without dual clip = TRL ``epsilon = epsilon_high = 0.2``. Gradient
  checkpointing off in both (TRL's default is on).
* trl-vllm: ``vllm_mode="colocate"``, sleep mode, ``vllm_gpu_memory_utilization=0.3`` (rlcli-vllm
  ``gpu_memory_utilization``, SGLang ``mem_fraction_static``, LMDeploy ``cache_max_entry_count``: 0.3).
  TRL's vLLM importance-sampling correction is off (rlcli applies none; ``--trl-vllm-is`` turns it on);
  the gap then comes from TRL's own ``sampling_per_token_logps`` and training forward.

Evaluation: greedy accuracy on the same N held-out problems every ``--eval-every`` steps and at step
0, judged by gsm8k. rlcli: its ``eval`` section (its engine, temperature 0). TRL: a callback running
transformers ``generate`` (batched, left padding, ``do_sample=False``, bf16 autocast on GPU). The first
evaluation is subtracted at most at a warm one's cost (``race_report.curve_from_evals``). A run
stops after ``--steps`` or, once its training seconds pass ``--max-seconds``, after one more step and
a final evaluation. rlcli runs ``ColocateRunner`` as ``rlcli train`` does, on ``<run dir>/recipe.yaml``.

Output (``--out``): ``<framework>-seed<N>.json`` per run, ``race.png``, ``race.md``. The H200 needs the
wheels of ``trl==1.16.0 datasets pydantic`` (+ ``vllm==0.26.0``) first: ../shared/tools/wheelhouse.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata as md
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

import race_task as rt  # noqa: E402
from race_model import greedy_accuracy  # noqa: E402
from race_report import curve_from_evals, report  # noqa: E402
from race_tokenizer import check_prompt_ids  # noqa: E402
from race_warmstart import warmstart  # noqa: E402
from profiling import maybe_profile  # noqa: E402

FRAMEWORKS = ("rlcli", "rlcli-async", "rlcli-vllm", "rlcli-sglang", "rlcli-lmdeploy", "trl", "trl-vllm")
ENGINE_PLUGINS = {"vllm": "rlcli_vllm", "sglang": "rlcli_sglang", "lmdeploy": "rlcli_lmdeploy"}
KV_SHARE = 0.3  # device memory share of each external engine's KV cache (all engines, both frameworks)
GROUP = 8
RL_DEFAULTS = {  # per warm-start size; stop_reserve: wall seconds kept for the last step, eval and exit
    "tiny": {"prompts": 4, "steps": 2, "eval_every": 1, "lr": 1e-4, "max_seconds": 120.0, "stop_reserve": 5.0},
    "small": {"prompts": 64, "steps": 400, "eval_every": 10, "lr": 2e-5, "max_seconds": 150.0, "stop_reserve": 45.0},
}


def device_facts() -> dict[str, Any]:
    """GPU, date, versions of every package in the comparison (None: not installed), peak memory."""
    import torch

    def version(name: str) -> str | None:
        return next((d.version for d in md.distributions(name=name)), None)

    cuda = torch.cuda.is_available()
    names = ("torch", "transformers", "trl", "vllm", "sglang", "lmdeploy", "accelerate", "datasets")
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO, check=False,
                                capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on the machine
        commit = ""
    return {"gpu": torch.cuda.get_device_name(0) if cuda else "CPU (smoke test)", "date": time.strftime("%Y-%m-%d"),
            "python": sys.version.split()[0], "versions": {n: version(n) for n in names}, "commit": commit or "?",
            "peak_gib_torch": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}


# ------------------------------------------------------------------------------------------ rlcli
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


# -------------------------------------------------------------------------------------------- TRL
def trl_config(spec: dict, vllm: bool):
    """GRPOConfig with the race's settings (see the module docstring for the mapping)."""
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


# ---------------------------------------------------------------------------------- orchestration
def poll_gpu_memory(stop: threading.Event, out: list[float]) -> None:
    """Device-wide memory.used (MiB) every second, while a run's process lives."""
    while not stop.is_set():
        try:
            text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  check=False, capture_output=True, text=True, timeout=10).stdout
            out.append(max(float(x) for x in text.split()))
        except (OSError, ValueError, subprocess.SubprocessError):
            return
        stop.wait(1.0)


def run_process(cmd: list[str], log_path: Path, wall_budget: float, prefix: str) -> tuple[int, list[float]]:
    """Run ``cmd`` in its own process group, echo its output, kill the group at ``wall_budget`` s.
    Returns the exit code and the nvidia-smi samples."""
    stop, mem = threading.Event(), []
    poller = threading.Thread(target=poll_gpu_memory, args=(stop, mem), daemon=True)
    poller.start()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, cwd=str(REPO))

        def pump():
            for line in proc.stdout:
                if log.closed:  # an engine's leftover process still writing after the run ended
                    return
                log.write(line)
                if line.startswith("[") or "Error" in line or "Traceback" in line:
                    print(f"{prefix}{line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=max(1.0, wall_budget))
        except subprocess.TimeoutExpired:
            print(f"{prefix}[race] wall budget {wall_budget:.0f}s spent: stopping the run", flush=True)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        reader.join(timeout=10)
    stop.set()
    poller.join(timeout=5)
    return rc, mem


def settings_for(args) -> dict[str, Any]:
    d = RL_DEFAULTS[args.size]
    ws = json.loads((Path(args.warmstart) / "warmstart.json").read_text())
    return {"prompts": args.prompts or d["prompts"], "group": GROUP, "steps": args.steps or d["steps"],
            "eval_every": args.eval_every or d["eval_every"], "lr": args.lr or d["lr"],
            "max_seconds": args.max_seconds or d["max_seconds"], "max_new_tokens": ws["shape"]["max_new_tokens"],
            "seed": args.seed, "temperature": 1.0, "top_p": 1.0, "top_k": "off", "kl_beta": 0.0, "clip": [0.2, 0.2],
            "threads": args.threads, "trl_micro_batch": args.trl_micro_batch, "trl_vllm_is": args.trl_vllm_is,
            "trl_fake_sampling_logps": args.trl_fake_sampling_logps, "kv_share": KV_SHARE,
            "heldout_n": ws["heldout_n"], "rlcli_set": list(args.rlcli_set)}


def run_framework(framework: str, args, target: float, wall_budget: float) -> Path:
    """One framework in a fresh process; writes ``<out>/<framework>-seed<N>.json``."""
    import yaml

    settings = settings_for(args)
    ws = json.loads((Path(args.warmstart) / "warmstart.json").read_text())
    run_dir = Path(args.work) / "runs" / f"{framework}-seed{args.seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("progress.json", "child.json"):
        (run_dir / stale).unlink(missing_ok=True)
    spec = {"framework": framework, "warmstart": str(Path(args.warmstart).resolve()), "run_dir": str(run_dir.resolve()),
            "settings": settings, "max_seconds": settings["max_seconds"], "wall_budget": wall_budget,
            "stop_reserve": RL_DEFAULTS[args.size]["stop_reserve"], "t_launch": 0.0}
    if framework.startswith("rlcli"):
        from rlcli.overrides import apply_overrides

        raw = apply_overrides(rlcli_recipe(framework, spec), settings["rlcli_set"])
        (run_dir / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    spec_path = run_dir / "spec.json"
    spec["t_launch"] = time.time()  # the run's clock starts here, just before its process does
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "_child", str(spec_path)]
    rc, mem = run_process(cmd, run_dir / "log.txt", wall_budget, f"[{framework}] ")
    result: dict[str, Any] = {
        "kind": "learning_race_run", "framework": framework, "seed": args.seed, "target": target, "exit_code": rc,
        "settings": settings, "warmstart": {k: v for k, v in ws.items() if k not in ("curve", "shape", "tokenizer")},
        "peak_gib_nvidia_smi": round(max(mem) / 1024, 2) if mem else None,
        "wall_s": round(time.time() - spec["t_launch"], 1)}
    if framework.startswith("rlcli"):
        result.update(rlcli_result(run_dir, spec["t_launch"]))
        result["recipe"] = str(run_dir / "recipe.yaml")
    facts = run_dir / ("child.json" if framework.startswith("rlcli") else "progress.json")
    got = json.loads(facts.read_text()) if facts.exists() else {}
    result.update(got if framework.startswith("trl") else
                  {k: v for k, v in got.items() if k != "peak_gib_torch"})  # rlcli: peaks come from its metrics
    result["curve"] = curve_from_evals(result.get("evals", []))
    steps = result.get("step_s", [])[1:]  # the first step warms up (compilation, graphs, allocator)
    result["median_step_s"] = round(statistics.median(steps), 3) if steps else None
    result["log_tail"] = (run_dir / "log.txt").read_text()[-6000:]
    out = Path(args.out) / f"{framework}-seed{args.seed}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"[race] {framework}: exit {rc}, {len(result['curve'])} eval points, wrote {out}", flush=True)
    return out


def ensure_warmstart(args, deadline: float) -> Path:
    """``--reuse DIR``, else ``<work>/warmstart`` if complete, else build it in a fresh process."""
    ws = Path(args.reuse) if args.reuse else Path(args.work) / "warmstart"
    if (ws / "warmstart.json").exists():
        print(f"[race] reusing the warm start {ws}", flush=True)
        return ws
    if args.reuse:
        raise SystemExit(f"--reuse {ws}: no warmstart.json there")
    args.size = args.size or "small"
    cmd = [sys.executable, str(Path(__file__).resolve()), "warmstart", "--size", args.size, "--seed", str(args.ws_seed),
           "--work", str(args.work), "--sft-seconds", str(args.sft_seconds)]
    Path(args.work).mkdir(parents=True, exist_ok=True)
    rc, _ = run_process(cmd, Path(args.work) / "warmstart-log.txt", deadline - time.time(), "")
    if rc != 0 or not (ws / "warmstart.json").exists():
        raise SystemExit(f"warm start failed (exit {rc}); log: {Path(args.work) / 'warmstart-log.txt'}")
    return ws


def cmd_race(args) -> None:
    t_start = time.time()
    deadline = t_start + args.deadline_s
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.warmstart = str(ensure_warmstart(args, deadline))
    ws = json.loads((Path(args.warmstart) / "warmstart.json").read_text())
    if args.size not in (None, ws["size"]):
        raise SystemExit(f"--size {args.size} but the warm start is {ws['size']}")
    args.size = ws["size"]
    target = args.target if args.target is not None else ws["heldout_accuracy"] + (1 - ws["heldout_accuracy"]) / 2
    print(f"[race] warm start accuracy {ws['heldout_accuracy']:.3f}, target {target:.3f} (fixed before the runs)",
          flush=True)
    for fw in args.framework:
        left = deadline - time.time() - 15
        if left < (60 if args.size != "tiny" else 20):
            print(f"[race] {fw}: not run, {left:.0f}s left of --deadline-s", flush=True)
            continue
        run_framework(fw, args, target, left)
    report([Path(args.out)], Path(args.out))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_child":  # one run, in the process run_framework started
        spec = json.loads(Path(sys.argv[2]).read_text())
        fw = spec["framework"]
        return rlcli_child(spec) if fw.startswith("rlcli") else trl_child(spec, vllm=fw == "trl-vllm")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warmstart", help="build the warm-start model directory <work>/warmstart")
    w.add_argument("--seed", type=int, default=0)
    race = sub.add_parser("race", help="warm start if needed, then each --framework in its own process, then report")
    race.add_argument("--framework", nargs="+", choices=FRAMEWORKS, default=["rlcli", "trl"])
    race.add_argument("--out", required=True, help="run files, race.png and race.md go here")
    race.add_argument("--reuse", help="an existing warm-start directory (with warmstart.json)")
    race.add_argument("--seed", type=int, default=0, help="seed of the RL runs")
    race.add_argument("--ws-seed", type=int, default=0, help="seed of the warm start, when built here")
    race.add_argument("--target", type=float, help="default: warm-start accuracy + half of what it lacks to 1.0")
    for flag, kind, what in (("prompts", int, "prompts per GRPO step"), ("steps", int, "most GRPO steps"),
                             ("max-seconds", float, "most training seconds per run"), ("lr", float, "learning rate"),
                             ("eval-every", int, "steps between held-out evaluations")):
        race.add_argument(f"--{flag}", type=kind, help=f"{what} (default: RL_DEFAULTS of the size)")
    race.add_argument("--threads", type=int, help="CPU threads of each run (CPU only)")
    race.add_argument("--trl-micro-batch", type=int, default=256, help="TRL completions per forward/backward")
    race.add_argument("--trl-vllm-is", action="store_true", help="trl-vllm: TRL's vLLM importance sampling on")
    race.add_argument("--trl-fake-sampling-logps", action="store_true", help=argparse.SUPPRESS)  # CPU test
    race.add_argument("--rlcli-set", action="append", default=[], metavar="KEY=VALUE",
                      help="recipe override for the rlcli runs (repeatable), e.g. train_worker.fsdp.torch_compile=true")
    race.add_argument("--deadline-s", type=float, default=570.0, help="start no run after this many seconds")
    rep = sub.add_parser("report", help="merge run files into race.png and race.md")
    rep.add_argument("--inputs", nargs="+", required=True)
    rep.add_argument("--out", required=True)
    w.add_argument("--size", choices=sorted(rt.SIZES), default="small")
    race.add_argument("--size", choices=sorted(rt.SIZES), help="default: the reused warm start's, else small")
    for p in (w, race):
        p.add_argument("--work", default="/tmp/learning-race", help="warm start and run directories")
        p.add_argument("--sft-seconds", type=float, default=150.0, help="warm start: supervised training budget")
    w.add_argument("--sft-steps", type=int, help="exactly this many SFT steps (rebuilds a recorded warm start)")
    w.add_argument("--stop-at", type=float, default=0.3, help="stop SFT at this validation accuracy")
    w.add_argument("--band-lo", type=float, default=0.2)
    w.add_argument("--band-hi", type=float, default=0.6)
    args = ap.parse_args()
    if args.cmd == "warmstart":
        warmstart(args)
    elif args.cmd == "race":
        cmd_race(args)
    else:
        report([Path(d) for d in args.inputs], Path(args.out))


if __name__ == "__main__":
    main()
