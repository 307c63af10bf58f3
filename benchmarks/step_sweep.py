"""The GRPO-step sweep of issue 32: model shapes × length regimes × frameworks, one table.

    python benchmarks/step_sweep.py --plan                                  # the runs, seconds each, calls
    python benchmarks/step_sweep.py --only '0.5b-*' --out results/sweep-1   # a subset (one device call)
    python benchmarks/step_sweep.py --merge results/sweep-* --out results/sweep   # one table of all calls
    python benchmarks/step_sweep.py --tiny --out /tmp/sweep                 # CPU: every path once, measures nothing

Each run is one ``benchmarks/grpo_step.py`` process (``--shape``, ``--lengths``, one section), so
every run starts with the GPU's memory free. The random-init model of a shape is built once per
``--model-cache`` (default ``/tmp/rlcli-sweep-models``) and reused by the runs after it.

Runs (``--plan`` lists them with their arguments):
  <shape>-<lengths>-rlcli        rlcli, embedded engine, sync production, the HEADLINE settings
  <shape>-longtail-rlcli-async   the same with the async produce strategy (ASYNC): issue acceptance 5
  <shape>-<lengths>-trl-vllm     TRL GRPOTrainer + vLLM colocate, tuned (grpo_trl.TRL_VLLM_TUNED)
  0.5b-full-trl-vllm-default     the same with the settings first measured (grpo_trl.TRL_VLLM only)
  <shape>-<lengths>-trl          TRL GRPOTrainer with transformers generate (0.5b, 1.5b only)
  0.5b-full-rlcli-lora           LoRA r 16, alpha 32 against full fine-tuning (issue 30, acceptance 3)
  0.5b-full-rlcli-kl[-refoffload] the KL penalty, without and with the reference model in CPU memory
  0.5b-longtail-rlcli-async-free the async row with rollout.lockstep=false: what lockstep (the default
                                 in colocated runs, so that runs repeat exactly) costs on the long tail
  0.5b-<lengths>-rlcli-free      the sync rows with rollout.lockstep=false (the default since the fourteenth
                                 session; the earlier sync figures ran without it): its cost on both lengths
  3b-full-rlcli-cpuoffload       fsdp.cpu_offload where it is not needed: its cost against 3b-full-rlcli
  7b-full-rlcli-cpuoffload       7b with fsdp.cpu_offload as well as its preset: the GPU memory it frees, its cost
  0.5b-full-rlcli-<engine>       rlcli with an engine plugin's rollout (vllm, sglang, lmdeploy; the plugin's
                                 defaults): its step against 0.5b-full-rlcli (issue 32, acceptance 4). The
                                 engine must be importable (its wheels); --tiny leaves these rows out
  0.5b-full-rlcli-<engine>-nolp  the same with sample_params.return_logprob false: the engine is asked for
                                 no logprobs (bare vLLM decoded 2.3x faster without them); no mismatch/*
  0.5b-full-rlcli-sglang-idle    the SGLang plugin with engine_kwargs.sleep_on_idle: SGLang's scheduler
                                 process sleeps when idle instead of spinning on a core (training ran
                                 0.14 s slower beside it than beside the embedded engine); -nolp-idle: both
for shapes 0.5b, 1.5b, 3b, 7b and lengths full (256 tokens, EOS ignored) and longtail (EOS on,
geometric lengths of mean 256 cut at 1024: benchmarks/lengths.py). 7b's rlcli runs add the
grpo_step.SHAPE_PRESETS overrides (AdamW moments in bfloat16, 32,768-token packs), which win over
HEADLINE where both set a key.

``--profile-train`` adds ``grpo_step.py --profile train`` to each run (its fourth train step under
torch.profiler, not counted in the medians) and copies the kernel tables to ``--out`` as
``profile-<run>.txt``: where a row's training phase is slower than another's, they say which
kernels or gaps.

``--out DIR`` gets ``sweep-results.json`` (every run: its arguments, estimate, wall time, exit
code, grpo_step's results and environment, the tail of its log) and ``table.md``, rewritten after
each run; the runs' own files stay under ``--work``. A run that fails is recorded with its error
and the next one starts. ``--deadline-s`` (default 540, a device call's 600 s less a margin) starts
no run whose estimate exceeds the time left and stops a run at the deadline.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import grpo_step as gs  # noqa: E402  (shapes and presets)
from machine_state import foreign_note, gpu_state, host_cpu, run_alone  # noqa: E402

SHAPE_ORDER = ["0.5b", "1.5b", "3b", "7b"]
TRL_GENERATE_SHAPES = {"0.5b", "1.5b"}  # transformers generate at 3b/7b takes minutes a step
TRL_DEFAULT_SHAPES = {"0.5b"}  # TRL + vLLM with the untuned settings too (grpo_trl.TRL_VLLM), for reference
# every rlcli run: the fastest configuration measured on the 0.5b work (docs/benchmarks.md, headline)
HEADLINE = ["train_worker.fsdp.torch_compile=true", "train_worker.fsdp.activation_memory_budget=0.0",
            "train_worker.pack_max_length=65536", "train_worker.logprob_chunk_size=4096",
            "train_worker.share_prompts=true"]
CUDA_ONLY = ("train_worker.fsdp.torch_compile", "train_worker.fsdp.activation_memory_budget")  # left out by --tiny
# the async row: recipes/quickstart-async.yaml's production with weights synced every step (as the
# learning race's rlcli-async). Over-sampling by 0.5 puts 768 sequences in flight (512 + 256): the
# embedded engine gets a slot for each, as the sync row has one for each of its 512 (with 512
# slots, runs up to the eighth session's, the over-sampled 256 waited for free slots).
ASYNC = ["rollout.max_batch_size=768", "replay_buffer.name=async", "tasks.0.produce_strategy.name=async",
         "tasks.0.produce_strategy.over_sample_threshold=0.5", "tasks.0.produce_strategy.enable_partial_rollout=true",
         "tasks.0.produce_strategy.max_staleness=1", "tasks.0.produce_strategy.tail_batch_trigger_size=0",
         "tasks.0.produce_strategy.tail_batch_max_tries=3"]
# steps of a long-tailed rlcli row (the first warms up): in the ninth session's async rows the engine
# captured 10-22 CUDA graphs in each of steps 2-4 (partial rollouts meet new (rows, keys) shapes),
# and 0-1 in step 5; a sync row sees its shapes in step 1
LONGTAIL_STEPS = 8
EXTRAS = {  # run id -> (shape, lengths, row name, overrides on top of HEADLINE[, steps])
    # the async row without the embedded engine's lockstep (on by default with async since the
    # thirteenth session: the engine waits for the event loop after each finish): what it costs
    "0.5b-longtail-rlcli-async-free": ("0.5b", "longtail", "rlcli async, lockstep off",
                                       ASYNC + ["rollout.lockstep=false"], LONGTAIL_STEPS),
    # the sync rows without lockstep (the default for sync too since the fourteenth session): the
    # earlier sync figures ran so; the headline work finishes every row at once, the long tail spreads them
    "0.5b-full-rlcli-free": ("0.5b", "full", "rlcli, lockstep off", ["rollout.lockstep=false"]),
    "0.5b-longtail-rlcli-free": ("0.5b", "longtail", "rlcli, lockstep off", ["rollout.lockstep=false"],
                                 LONGTAIL_STEPS),
    "0.5b-full-rlcli-lora": ("0.5b", "full", "rlcli LoRA", ["model.lora.r=16", "model.lora.alpha=32"]),
    "0.5b-full-rlcli-kl": ("0.5b", "full", "rlcli KL", ["train_worker.kl.coef=0.001"]),
    "0.5b-full-rlcli-kl-refoffload": ("0.5b", "full", "rlcli KL, ref_offload",
                                      ["train_worker.kl.coef=0.001", "train_worker.kl.ref_offload=true"]),
    "3b-full-rlcli-cpuoffload": ("3b", "full", "rlcli cpu_offload", ["train_worker.fsdp.cpu_offload=true"]),
    # with the 7b preset's bfloat16 moments: 12 bytes a parameter, 91 GB of host RAM (16, 122 GB, were killed)
    "7b-full-rlcli-cpuoffload": ("7b", "full", "rlcli cpu_offload", ["train_worker.fsdp.cpu_offload=true"]),
}
# rows with an engine plugin's rollout instead of the embedded engine: its step beside the embedded one's
ENGINE_PLUGINS = ("vllm", "sglang", "lmdeploy")
NO_LOGPROBS = ["tasks.0.agent_loop.sample_params.return_logprob=false"]
# each engine plugin's rows: id suffix -> (row label suffix, overrides, engines); "-idle": SGLang's scheduler
# process spins while idle (through the whole training phase) unless sleep_on_idle is set
PLUGIN_ROWS: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "": ("", [], ENGINE_PLUGINS),
    "-nolp": (", no logprobs", NO_LOGPROBS, ENGINE_PLUGINS),
    "-idle": (", sleep_on_idle", ["rollout.engine_kwargs.sleep_on_idle=true"], ("sglang",)),
    "-nolp-idle": (", no logprobs, sleep_on_idle", NO_LOGPROBS + ["rollout.engine_kwargs.sleep_on_idle=true"],
                   ("sglang",)),
}
CALL_S = 540.0


@dataclass
class Run:
    id: str
    shape: str
    lengths: str
    row: str
    args: list[str]  # grpo_step.py arguments besides --shape, --lengths, --steps, --model-cache, --out
    steps: int = 5
    extra: list[str] = field(default_factory=list)  # the row's own rlcli overrides (the table's settings)


def rlcli_run(rid: str, shape: str, lengths: str, row: str, extra: list[str], steps: int = 5,
              engine: str | None = None) -> Run:
    """An rlcli row: HEADLINE, the shape's preset, ``extra``; ``engine`` registers that engine
    plugin (from plugins/ of this checkout) and rolls out through it."""
    preset = {kv.split("=", 1)[0] for kv in gs.SHAPE_PRESETS.get(shape, [])}
    base = [kv for kv in HEADLINE if kv.split("=", 1)[0] not in preset]  # the shape's preset wins
    extra = extra + ([f"rollout.name={engine}"] if engine else [])
    sets = [a for kv in base + extra for a in ("--set", kv)]
    plugin = ["--engine-plugin", engine] if engine else []
    return Run(rid, shape, lengths, row, ["--rlcli", "--label", rid.split("-", 2)[2]] + plugin + sets, steps,
               extra=gs.SHAPE_PRESETS.get(shape, []) + extra)


def plan_runs() -> list[Run]:
    runs = []
    for shape in SHAPE_ORDER:
        for lengths in ("full", "longtail"):
            base = f"{shape}-{lengths}"
            # long-tailed rows take LONGTAIL_STEPS: async meets new decode shapes (CUDA graphs) for
            # several steps, and sync is measured over as many steps to compare like with like
            steps = LONGTAIL_STEPS if lengths == "longtail" else 5
            runs.append(rlcli_run(f"{base}-rlcli", shape, lengths, "rlcli", [], steps))
            if lengths == "longtail":
                runs.append(rlcli_run(f"{base}-rlcli-async", shape, lengths, "rlcli async", ASYNC, steps))
            slow = shape in ("3b", "7b")
            runs.append(Run(f"{base}-trl-vllm", shape, lengths, "TRL + vLLM colocate, tuned", ["--trl-vllm-tuned"],
                            3 if slow else 5))
            if shape in TRL_DEFAULT_SHAPES and lengths == "full":
                runs.append(Run(f"{base}-trl-vllm-default", shape, lengths, "TRL + vLLM colocate, TRL_VLLM",
                                ["--trl-vllm"]))
            if shape in TRL_GENERATE_SHAPES:
                runs.append(Run(f"{base}-trl", shape, lengths, "TRL generate", ["--trl"]))
        runs += [rlcli_run(rid, *spec) for rid, spec in EXTRAS.items() if spec[0] == shape]
        if shape == "0.5b":
            for e in ENGINE_PLUGINS:  # one engine's rows together: one set of wheels on the machine
                runs += [rlcli_run(f"0.5b-full-rlcli-{e}{suffix}", "0.5b", "full", f"rlcli, {e} plugin{label}", sets,
                                   engine=e)
                         for suffix, (label, sets, engines) in PLUGIN_ROWS.items() if e in engines]
    return runs


def n_params(shape: str) -> float:
    """Parameters of a shape (decoder layers, embeddings, LM head when untied), from its numbers."""
    s = gs.SHAPES[shape]
    h, hd = s["hidden"], s["hidden"] // s["heads"]
    layer = 2 * h * h + 2 * h * s["kv"] * hd + h + 2 * s["kv"] * hd + 3 * h * s["inter"] + 2 * h
    return s["layers"] * layer + s["vocab"] * h * (1 if s["tied"] else 2) + h


def engine_of(run: Run) -> str | None:
    """The engine plugin a run rolls out through (None: the embedded engine, or not rlcli)."""
    return run.args[run.args.index("--engine-plugin") + 1] if "--engine-plugin" in run.args else None


def estimate_s(run: Run, cold: bool = True) -> float:
    """Rough seconds of a run: process start, the model build (``cold``), start-up, steps. Scaled from
    the 0.5b figures (rlcli 0.63 s rollout + 1.08 s train, TRL 8 s per step) by the parameter count;
    TRL + vLLM from its measured 9.3 s (0.5b) and 9.5 s (1.5b) a step and ~110 s of start-up, on
    the long tail from its measured 17.4 s (0.5b), 26.4 s (1.5b) and 41.8 s (3b, all with gradient
    checkpointing); the rlcli long tail's rollout ×2.5 sync (the batch waits for its longest
    response), ×1.2 async, TRL generate ×3; CPU offload +10 s a step (guesses)."""
    r = n_params(run.shape) / n_params("0.5b")
    tail = run.lengths == "longtail"
    build = (10 + 2 * r) if cold else 0.0  # random init on the GPU + safetensors write (7b: ~40 s, tenth session)
    if run.args[0] == "--rlcli":
        roll = 0.63 * r ** 0.7 * ((1.2 if "async" in run.id else 2.5) if tail else 1.0)
        offload = 10.0 if any("cpu_offload=true" in kv for kv in run.extra) else 0.0
        step, start, n = roll + 1.08 * r + offload, 60 + 4 * r, run.steps
        if engine_of(run):  # the engine's start-up (55-110 s) and its slower rollout (5 s at most)
            step, start = 1.08 * r + 5.0, start + 110
    elif run.args[0] == "--trl":
        step, start, n = 8 * r ** 0.8 * (3 if tail else 1), 15 + 3 * r, run.steps + 1
    else:
        step, start, n = 17.4 * r ** 0.48 if tail else 9.3 * r ** 0.3, 100 + 4 * r, run.steps + 1
    return round(15 + build + start + n * step)


def pack_calls(runs: list[Run], budget: float = CALL_S) -> list[list[Run]]:
    """Runs grouped into device calls of at most ``budget`` estimated seconds, in plan order; each
    call builds the models it needs (a machine starts bare). A run over budget gets a call alone,
    and an engine plugin's rows share calls with rows of that engine only (each engine's wheels go
    on the machine in their own site)."""
    calls: list[list[Run]] = []
    cur: list[Run] = []
    total = 0.0
    for run in runs:
        cost = estimate_s(run, cold=not any(x.shape == run.shape for x in cur))
        other_engine = len({engine_of(x) for x in cur + [run]}) > 1
        if cur and (total + cost > budget or other_engine):
            calls.append(cur)
            cur, total = [], 0.0
            cost = estimate_s(run, cold=True)
        cur.append(run)
        total += cost
    return calls + ([cur] if cur else [])


def print_plan(runs: list[Run], budget: float) -> None:
    print("| run | row | settings beyond HEADLINE | steps | estimate (s, model built) |")
    print("| --- | --- | --- | --- | --- |")
    for run in runs:
        print(f"| {run.id} | {run.row} | {settings(run.extra)} | {run.steps} | {estimate_s(run)} |")
    print(f"\nHEADLINE (every rlcli run): {' '.join(HEADLINE)}\nASYNC: {' '.join(ASYNC)}\n")
    for run in runs:
        if any("cpu_offload=true" in kv for kv in run.extra):
            per = 12 if any("moment_dtype=bfloat16" in kv for kv in run.extra) else 16
            print(f"{run.id}: parameters, gradients and AdamW moments in CPU memory, about "
                  f"{per * n_params(run.shape) / 1e9:.0f} GB of the host's RAM (the 1-GPU machine has 125 GiB)")
    print()
    for i, call in enumerate(pack_calls(runs, budget), 1):
        est = sum(estimate_s(r, cold=not any(x.shape == r.shape for x in call[:j])) for j, r in enumerate(call))
        flag = "  (over the budget: run it alone, or with fewer --steps)" if est > budget else ""
        print(f"call {i} (~{est:.0f} s){flag}: python benchmarks/step_sweep.py --only {','.join(r.id for r in call)} "
              f"--out $OUT/sweep-{i}")


# ------------------------------------------------------------------------------ running
def command(run: Run, args) -> list[str]:
    cmd = [sys.executable, str(HERE / "grpo_step.py"), *run.args, "--shape", run.shape, "--lengths", run.lengths,
           "--steps", str(args.steps or (2 if args.tiny else run.steps)), "--model-cache", str(args.model_cache),
           "--out", str(args.work / run.id)]
    if args.profile_train:
        cmd += ["--profile", "train"]  # grpo_step profiles its fourth train step and leaves it out of the medians
    if args.tiny:
        cmd.append("--tiny")
        cmd = [c for i, c in enumerate(cmd) if not (c.startswith(CUDA_ONLY) or (c == "--set" and cmd[i + 1].startswith(CUDA_ONLY)))]
    else:
        cmd.append("--ceilings")  # MFU against this machine's measured bf16 ceiling
    return cmd


def run_one(run: Run, args, time_left: float) -> dict:
    rec = {"id": run.id, "shape": run.shape, "lengths": run.lengths, "row": run.row, "extra": run.extra,
           "estimate_s": estimate_s(run)}
    if time_left < rec["estimate_s"] and not args.tiny:
        return {**rec, "error": f"not run: estimated {rec['estimate_s']} s, {time_left:.0f} s left in the call"}
    cmd = command(run, args)
    rec["command"] = " ".join(cmd)
    log = args.work / f"{run.id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    print(f"[{run.id}] {rec['command']}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)}
    rec["host_cpu"] = host_cpu()
    rec["gpu_at_start"] = gpu_state()  # who else held the GPU: a row timed beside another process is no figure
    if foreign_note(rec["gpu_at_start"]):
        print(f"[{run.id}] WARNING: {foreign_note(rec['gpu_at_start'])}", flush=True)
    with log.open("w") as f:  # in a session of its own: an engine's worker process cannot outlive the row
        rc, left = run_alone(cmd, stdout=f, env=env, cwd=str(REPO), timeout=None if args.tiny else max(1.0, time_left))
    rec.update(wall_s=round(time.perf_counter() - t, 1), rc=rc, log_tail=log.read_text()[-3000:])
    if left:
        rec["leftover_processes_killed"] = left
    res = args.work / run.id / "results.json"
    if res.exists():
        data = json.loads(res.read_text())
        rec.update(env=data["env"], results=data["results"])
    prof = args.work / run.id / "profiles.txt"
    if args.profile_train and args.out and prof.exists():  # beside sweep-results.json: it comes back from the device
        args.out.mkdir(parents=True, exist_ok=True)
        rec["profile"] = f"profile-{run.id}.txt"
        (args.out / rec["profile"]).write_text(prof.read_text())
    errors = [r["error"] for r in rec.get("results", []) if "error" in r]
    if errors or rc != 0 or not rec.get("results"):
        rec["error"] = errors[0] if errors else f"exit {rc}{killed_by(rc)}: {rec['log_tail'][-1500:]}"
    print(f"[{run.id}] {'error' if 'error' in rec else 'done'} in {rec['wall_s']} s", flush=True)
    return rec


def killed_by(rc) -> str:
    """For a run ended by SIGKILL: the kernel's last out-of-memory kill, when ``dmesg`` shows one
    (the host's RAM, not the GPU's: a CUDA out-of-memory error is an exception, not a kill)."""
    if rc != -signal.SIGKILL:
        return ""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        log = ""
    oom = [x.strip() for x in log.splitlines() if "Killed process" in x]
    return f" (SIGKILL; {oom[-1]})" if oom else " (SIGKILL: the host's OOM killer, or another process)"


# ------------------------------------------------------------------------------ the table
def main_result(rec: dict) -> dict | None:
    return next((r for r in rec.get("results", []) if r.get("what") in ("rlcli", "trl", "trl-vllm")
                 and "error" not in r), None)


def settings(extra: list[str]) -> str:
    """A row's own overrides, the ASYNC list named as such."""
    if all(kv in extra for kv in ASYNC):
        extra = [kv for kv in extra if kv not in ASYNC] + ["ASYNC"]
    return " ".join(f"`{kv}`" for kv in extra) or "-"


def _error_line(text: str) -> str:
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    return (lines[-1] if lines else "?")[:200].replace("|", "/")


def table(records: list[dict]) -> str:
    envs = [r["env"] for r in records if r.get("env")]

    def seen(key: str) -> str:
        # a run without the package (an rlcli-only call has no TRL or vLLM) records None: not a version
        return ", ".join(sorted({str(e[key]) for e in envs if e.get(key) is not None})) or "-"

    cpus = ", ".join(sorted({r["host_cpu"] for r in records if r.get("host_cpu")})) or "-"
    lines = [f"Dates: {seen('date')}; GPU: {seen('gpu')}; host CPU: {cpus}; torch {seen('torch')}, "
             f"transformers {seen('transformers')}, "
             f"trl {seen('trl')}, vllm {seen('vllm')}; rlcli {seen('rlcli_commit')}.", "",
             f"Every rlcli row: `{' '.join(HEADLINE)}`; the row's own settings are in the settings column "
             "(7b: its preset). Lengths: full = 256 new tokens, EOS ignored; longtail = EOS on, geometric "
             "lengths of mean 256 cut at 1024. ASYNC: `" + " ".join(ASYNC) + "`.", "",
             "| shape | lengths | row | settings | step median s (min-max) | rollout s | train s | sync s | gen tok/s "
             "| train MFU | peak GiB | response length mean / p50 / p90 / p99 / max (cut) | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rec in records:
        r = main_result(rec)
        head = f"| {rec['shape']} | {rec['lengths']} | {rec['row']} | {settings(rec.get('extra') or [])} "
        if r is None:
            lines.append(head + "| - | - | - | - | - | - | - | - | " + _error_line(rec.get("error", "no result")) + " |")
            continue
        ln = r.get("response_lengths") or {}
        lens = (f"{ln['mean']} / {ln['p50']} / {ln['p90']} / {ln['p99']} / {ln['max']} ({ln['cut_frac']:.1%})"
                if ln else "-")
        peak = r.get("peak_gib")
        if r.get("rollout_peak_gib") is not None:
            peak = f"{r['rollout_peak_gib']} / {r['train_peak_gib']}"
        if r.get("device_used_gib") is not None:
            peak = f"{peak} (device {r['device_used_gib']})"
        if r.get("host_peak_gib") is not None:
            peak = f"{peak}; host {r['host_peak_gib']}"
        note = "vLLM " + ", ".join(f"{k}={v}" for k, v in (r.get("settings") or {}).items()) if "vllm" in r else ""
        if r.get("trainable_params"):
            note = rlcli_note(r)
        note = "; ".join(x for x in (foreign_note(rec.get("gpu_at_start")), note) if x)
        lines.append(head + f"| {r['step_s_median']} ({r['step_s_min']}-{r['step_s_max']}) | {r.get('rollout_s')} | "
                     f"{r.get('train_s')} | {r.get('sync_s')} | {r.get('gen_tok_per_s')} | {r.get('train_mfu')} | "
                     f"{peak} | {lens} | {note.replace('|', '/')} |")
    return "\n".join(lines + [""] + ratios(records)) + "\n"


def rlcli_note(r: dict) -> str:
    """An rlcli row's note: the parameters it trains, and the CUDA graphs its engine captured in
    the measured steps (a capture is time that a step past them no longer pays)."""
    note = f"trains {r['trainable_params'] / 1e6:.1f}M parameters"
    caps = [int(s.get("cuda_graph_captures") or 0) for s in r.get("per_step") or [] if s.get("measured")]
    if any(caps):
        note += f"; CUDA graphs captured in the measured steps: {' + '.join(map(str, caps))}"
    return note


def ratios(records: list[dict]) -> list[str]:
    """rlcli (sync) against TRL + vLLM and TRL generate, and async against sync, per shape and lengths."""
    step = {rec["id"]: main_result(rec)["step_s_median"] for rec in records if main_result(rec)}
    out = []
    for shape in SHAPE_ORDER:
        for lengths in ("full", "longtail"):
            base = f"{shape}-{lengths}"
            mine = step.get(f"{base}-rlcli")
            for other, name in ((f"{base}-trl-vllm", "TRL + vLLM tuned"), (f"{base}-trl-vllm-default", "TRL + vLLM"),
                                (f"{base}-trl", "TRL generate")):
                if mine and step.get(other):
                    out.append(f"- {base}: rlcli {mine} s, {name} {step[other]} s: **{step[other] / mine:.2f}×**")
            if mine and step.get(f"{base}-rlcli-async"):
                out.append(f"- {base}: async {step[f'{base}-rlcli-async']} s against sync {mine} s: "
                           f"**{mine / step[f'{base}-rlcli-async']:.2f}×**")
    for a, b in (("0.5b-longtail-rlcli-async", "0.5b-longtail-rlcli-async-free"),
                 ("0.5b-full-rlcli", "0.5b-full-rlcli-free"), ("0.5b-longtail-rlcli", "0.5b-longtail-rlcli-free"),
                 ("0.5b-full-rlcli-kl-refoffload", "0.5b-full-rlcli-kl"), ("0.5b-full-rlcli-kl", "0.5b-full-rlcli"),
                 ("3b-full-rlcli-cpuoffload", "3b-full-rlcli"), ("7b-full-rlcli-cpuoffload", "7b-full-rlcli"),
                 ("0.5b-full-rlcli-lora", "0.5b-full-rlcli")):
        if step.get(a) and step.get(b):
            out.append(f"- {a} against {b}: {step[a]} s against {step[b]} s ({step[a] - step[b]:+.3f} s)")
    embedded = step.get("0.5b-full-rlcli")
    for engine, what in ((e, w) for e in ENGINE_PLUGINS for w in PLUGIN_ROWS):
        plugin = step.get(f"0.5b-full-rlcli-{engine}{what}")  # acceptance 4: within 1.5x of the embedded step
        if plugin and embedded:
            name = f"the {engine} plugin{PLUGIN_ROWS[what][0]}"
            out.append(f"- 0.5b-full: {name} {plugin} s against the embedded engine {embedded} s: "
                       f"**{plugin / embedded:.2f}×** the embedded step")
    return out


def merge(paths: list[Path]) -> list[dict]:
    """Records of several sweep-results.json (files, or directories holding one): for each run id
    the last one given that has a result, else the last one; in plan order, unknown ids last."""
    by: dict[str, dict] = {}
    for p in paths:
        f = p / "sweep-results.json" if p.is_dir() else p
        for rec in json.loads(f.read_text())["runs"]:
            if main_result(rec) or not main_result(by.get(rec["id"], {})):
                by[rec["id"]] = rec
    order = {r.id: i for i, r in enumerate(plan_runs())}
    return sorted(by.values(), key=lambda r: (order.get(r["id"], len(order)), r["id"]))


def write(out: Path, records: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep-results.json").write_text(json.dumps({"runs": records}, indent=1))
    (out / "table.md").write_text(table(records))


def select(runs: list[Run], only: str | None) -> list[Run]:
    if not only:
        return runs
    pats = [p for p in only.split(",") if p]
    unknown = [p for p in pats if not any(fnmatch.fnmatch(r.id, p) for r in runs)]
    if unknown:
        raise SystemExit(f"--only: {', '.join(unknown)} match no run; --plan lists them")
    return [r for r in runs if any(fnmatch.fnmatch(r.id, p) for p in pats)]


def cpu_runs(runs: list[Run]) -> list[Run]:
    """The runs ``--tiny`` can check on the CPU: not the engine plugins' rows (CUDA only)."""
    return [r for r in runs if engine_of(r) is None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", action="store_true", help="list the runs, their estimated seconds and device calls")
    ap.add_argument("--only", help="comma-separated run ids or patterns (fnmatch: '0.5b-*', '*-trl-vllm')")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="DIR", help="merge these calls' results into one table")
    ap.add_argument("--out", type=Path, help="where sweep-results.json and table.md go")
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlcli-sweep-work"), help="the runs' own outputs and logs")
    ap.add_argument("--model-cache", type=Path, default=Path("/tmp/rlcli-sweep-models"))
    ap.add_argument("--steps", type=int, help="override every run's --steps")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny model (grpo_step --tiny): checks every path")
    ap.add_argument("--deadline-s", type=float, default=CALL_S, help="no run starts that would end after this")
    ap.add_argument("--profile-train", action="store_true",
                    help="torch.profiler over each run's fourth train step (grpo_step --profile train, left out of "
                         "the step medians); its kernel tables go to --out as profile-<run>.txt")
    args = ap.parse_args()
    runs = select(plan_runs(), args.only)
    if args.plan:
        print_plan(runs, args.deadline_s)
        return
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        records = merge(args.merge)
        write(args.out, records)
        print(table(records))
        return
    if args.tiny:
        runs = cpu_runs(runs)
    start, records = time.monotonic(), []
    for run in runs:
        records.append(run_one(run, args, args.deadline_s - (time.monotonic() - start)))
        if args.out:
            write(args.out, records)
    print(table(records))


if __name__ == "__main__":
    main()
