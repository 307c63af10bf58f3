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

This file holds the command line and runs each framework in a process of its own; that process runs
``race_rlcli.py`` or ``race_trl.py`` (what both share: ``race_common.py``). ``race_report.py`` writes
``race.md`` and ``race.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

import race_task as rt  # noqa: E402
from race_common import GROUP, KV_SHARE  # noqa: E402
from race_report import curve_from_evals, report  # noqa: E402

# rlcli_registry, trl_config and watch_logits_processors are imported for the tests (lr.<name>)
from race_rlcli import rlcli_child, rlcli_recipe, rlcli_result  # noqa: E402
from race_trl import trl_child  # noqa: E402
from race_warmstart import warmstart  # noqa: E402

FRAMEWORKS = ("rlcli", "rlcli-async", "rlcli-vllm", "rlcli-sglang", "rlcli-lmdeploy", "trl", "trl-vllm")
RL_DEFAULTS = {  # per warm-start size; stop_reserve: wall seconds kept for the last step, eval and exit
    "tiny": {"prompts": 4, "steps": 2, "eval_every": 1, "lr": 1e-4, "max_seconds": 120.0, "stop_reserve": 5.0},
    "small": {"prompts": 64, "steps": 400, "eval_every": 10, "lr": 2e-5, "max_seconds": 150.0, "stop_reserve": 45.0},
}


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
