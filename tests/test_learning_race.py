"""CPU test of ``benchmarks/learning_race.py`` at tiny scale: the warm start, rlcli (sync and async
production) for 2 GRPO steps, the report, the engine plugins' recipes, and TRL when it is installed
(not in the project's environment: ``pytest.importorskip("trl")``; run this file from a venv with
``trl==1.16.0`` to cover it). Nothing here measures anything: it checks what the GPU run will rely on."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "learning_race.py"
sys.path.insert(0, str(REPO / "benchmarks"))

import learning_race as lr  # noqa: E402
import race_report  # noqa: E402
import race_rlcli  # noqa: E402
import race_task as rt  # noqa: E402
import race_trl  # noqa: E402

slow = pytest.mark.slow  # every test that needs the race fixture (~45 s on a 2-core CPU)


def run_script(*args: str, timeout: float = 600) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          check=False, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def race(tmp_path_factory) -> dict:
    """One tiny race: warm start (a few seconds of SFT), rlcli and rlcli-async for 2 steps, report."""
    root = tmp_path_factory.mktemp("race")
    stdout = run_script("race", "--size", "tiny", "--work", str(root / "work"), "--out", str(root / "out"),
                        "--framework", "rlcli", "rlcli-async", "--sft-seconds", "4", "--threads", "1")
    ws = root / "work" / "warmstart"
    return {"root": root, "out": root / "out", "ws": ws, "stdout": stdout,
            "info": json.loads((ws / "warmstart.json").read_text())}


def test_task_format_and_disjoint_splits():
    assert rt.solution(4857, 968) == ("7+8=15, write 5 carry 1. 5+6+1=12, write 2 carry 1. 8+9+1=18, write 8 carry 1. "
                                      "4+0+1=5, write 5. #### 5825")
    assert rt.solution(95, 17).endswith("write the final carry 1. #### 112")
    assert rt.judge(rt.solution(4857, 968), "5825") == 1.0 and rt.judge("#### 5824", "5825") == 0.0
    assert rt.is_heldout(12, 345) == rt.is_heldout(345, 12)  # split by the unordered pair
    import random

    rng = random.Random(0)
    held = set(rt.draw_pairs(rng, 200, 3, heldout=True))
    train = set(rt.draw_pairs(rng, 2000, 3, heldout=False))
    assert not held & train and all(rt.is_heldout(*p) for p in held) and not any(rt.is_heldout(*p) for p in train)
    assert 0.05 < sum(rt.is_heldout(a, b) for a in range(100) for b in range(100)) / 10**4 < 0.15


def test_time_to_target_and_report(tmp_path):
    curve = [{"step": 0, "seconds": 10.0, "accuracy": 0.3}, {"step": 10, "seconds": 30.0, "accuracy": 0.5},
             {"step": 20, "seconds": 50.0, "accuracy": 0.9}]
    assert race_report.time_to_target(curve, 0.7) == pytest.approx(40.0)  # linear between 30 s (0.5) and 50 s (0.9)
    assert race_report.time_to_target(curve, 0.2) == 10.0 and race_report.time_to_target(curve, 0.95) is None
    evals = [{"step": 0, "accuracy": 0.3, "wall": 20.0, "eval_s": 12.0},  # a cold first evaluation (compilation)
             {"step": 1, "accuracy": 0.4, "wall": 30.0, "eval_s": 2.0}, {"step": 2, "accuracy": 0.5, "wall": 40.0,
                                                                          "eval_s": 2.0}]
    assert [p["seconds"] for p in race_report.curve_from_evals(evals)] == [18.0, 26.0, 34.0]  # first charged 2 s, not 12

    def run(fw: str, seed: int, scale: float) -> dict:
        return {"kind": "learning_race_run", "framework": fw, "seed": seed, "target": 0.7, "exit_code": 0,
                "curve": [{**p, "seconds": p["seconds"] * scale} for p in curve], "steps_done": 20,
                "median_step_s": 1.0 * scale, "settings": {"prompts": 4, "group": 8}, "warmstart": {"size": "tiny"}}

    for r in (run("rlcli", 0, 1.0), run("rlcli", 1, 1.1), run("trl", 0, 3.0), run("trl-vllm", 0, 2.0)):
        (tmp_path / f"{r['framework']}-seed{r['seed']}.json").write_text(json.dumps(r))
    (tmp_path / "unrelated.json").write_text("{}")
    text = race_report.report([tmp_path], tmp_path / "rep")
    assert "speed-up of rlcli's best (rlcli, 40.0 s) over trl (120.0 s): **3.00x**" in text
    assert "over trl-vllm (80.0 s): **2.00x**" in text
    assert "run-to-run noise, rlcli, 2 runs: time to target 40.0-44.0 s" in text
    assert len([x for x in text.splitlines() if x.startswith(("| rlcli ", "| trl"))]) == 4
    assert (tmp_path / "rep" / "race.png").read_bytes()[:4] == b"\x89PNG"

    # a second folder (another machine): runs are labelled by folder and recipe overrides, and
    # speed-ups are only computed within a folder
    other = tmp_path / "call-b"
    other.mkdir()
    nc = {**run("rlcli", 0, 0.5), "settings": {"prompts": 4, "group": 8, "rlcli_set": ["rollout.compile=false"]}}
    (other / "rlcli-seed0.json").write_text(json.dumps(nc))
    (other / "trl-seed0.json").write_text(json.dumps(run("trl", 0, 2.0)))
    merged = race_report.report([tmp_path, other], tmp_path / "merged")
    assert "| rlcli [rollout.compile=false] <call-b> | 0 |" in merged
    assert ("call-b, seed 0: speed-up of rlcli's best (rlcli [rollout.compile=false], 20.0 s) over trl (80.0 s): "
            "**4.00x**") in merged
    assert f"{tmp_path.name}, seed 0: speed-up of rlcli's best (rlcli, 40.0 s) over trl (120.0 s)" in merged


def test_watch_logits_processors_drops_truncation(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    seen = race_trl.watch_logits_processors(model)
    torch.manual_seed(0)
    model.generate(torch.tensor([[5, 6, 7]]), do_sample=True, top_k=5, top_p=0.9, max_new_tokens=2, pad_token_id=0)
    assert "removed:TopKLogitsWarper" in seen and "removed:TopPLogitsWarper" in seen


@slow
def test_warmstart_directory(race):
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    ws, info = race["ws"], race["info"]
    for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json", "train.jsonl", "valid.jsonl", "heldout.jsonl"):
        assert (ws / name).is_file(), name
    assert json.loads((ws / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    auto, fast = AutoTokenizer.from_pretrained(str(ws)), PreTrainedTokenizerFast.from_pretrained(str(ws))
    cfg, gen = AutoConfig.from_pretrained(str(ws)), json.loads((ws / "generation_config.json").read_text())
    assert cfg.model_type == "qwen2" and cfg.vocab_size >= len(auto)
    assert gen["eos_token_id"] == auto.eos_token_id == cfg.eos_token_id and auto.eos_token == "<|im_end|>"
    assert gen["top_k"] == 0 and gen["top_p"] == 1.0
    rows = {k: rt.read_rows(ws / f"{k}.jsonl") for k in ("train", "valid", "heldout")}
    assert len(rows["heldout"]) == info["heldout_n"] == rt.SIZES["tiny"].n_heldout
    for r in rows["heldout"][:4]:
        text = auto.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        ids = auto(text, add_special_tokens=False)["input_ids"]
        assert ids and ids == fast(text, add_special_tokens=False)["input_ids"] and auto.decode(ids) == text
    pairs = {k: {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in v} for k, v in rows.items()}
    assert not pairs["train"] & (pairs["valid"] | pairs["heldout"]) and not pairs["valid"] & pairs["heldout"]
    assert all(rt.is_heldout(*p) for p in pairs["heldout"] | pairs["valid"])
    assert all(r["reward_model"]["ground_truth"] == str(r["extra_info"]["a"] + r["extra_info"]["b"])
               for r in rows["train"])
    for key in ("params", "heldout_accuracy", "sft_steps", "sft_seconds", "stop_reason", "tokenizer", "rebuild"):
        assert key in info, key
    assert 0.0 <= info["heldout_accuracy"] <= 1.0 and info["tokenizer"]["class"] == "Qwen2Tokenizer"


@slow
@pytest.mark.parametrize("framework", ["rlcli", "rlcli-async"])
def test_rlcli_run_files(race, framework):
    r = json.loads((race["out"] / f"{framework}-seed0.json").read_text())
    ws_acc = race["info"]["heldout_accuracy"]
    assert r["kind"] == "learning_race_run" and r["exit_code"] == 0, r.get("log_tail")
    assert r["target"] == pytest.approx(ws_acc + (1 - ws_acc) / 2)
    assert [p["step"] for p in r["curve"]] == [0, 1, 2] and r["steps_done"] == 2
    secs = [p["seconds"] for p in r["curve"]]
    assert 0 < secs[0] <= secs[1] <= secs[2] < r["wall_s"]
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in r["curve"])
    assert len(r["step_s"]) == 2 and r["median_step_s"] > 0 and r["logprob_gap_mean"] is not None
    assert r["versions"]["torch"] and r["gpu"] and r["date"] and r["settings"]["group"] == 8
    recipe = __import__("yaml").safe_load(Path(r["recipe"]).read_text())
    loss = recipe["train_worker"]["loss"]
    assert (loss["loss_agg"], loss["clip_low"], loss["clip_high"]) == ("token-mean", 0.2, 0.2)
    assert loss["clip_ratio_c"] is None
    assert recipe["advantage"] == {"name": "grpo", "std": "unbiased", "eps": 1e-4}
    assert recipe["tasks"][0]["agent_loop"]["sample_params"] == {
        "max_tokens": rt.SIZES["tiny"].max_new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert recipe["eval"]["tasks"][0]["agent_loop"]["sample_params"]["temperature"] == 0.0
    assert recipe["train_worker"]["kl"]["coef"] == 0.0 and recipe["train_worker"]["optimizer_steps"] == 1
    strategy = recipe["tasks"][0]["produce_strategy"]["name"]
    assert strategy == ("async" if framework == "rlcli-async" else "sync")


@slow
def test_report_files(race, tmp_path):
    md = (race["out"] / "race.md").read_text()
    assert "| rlcli | 0 |" in md and "| rlcli-async | 0 |" in md
    assert (race["out"] / "race.png").read_bytes()[:4] == b"\x89PNG"
    run_script("report", "--inputs", str(race["out"]), "--out", str(tmp_path))
    assert (tmp_path / "race.md").read_text().count("| rlcli") == 2


@slow
@pytest.mark.parametrize("engine", ["vllm", "sglang", "lmdeploy"])
def test_engine_plugin_recipes_validate(race, engine):
    """Their options are accepted; the only problem allowed here is the engine itself being absent."""
    from rlcli.config import RecipeError, validate_recipe

    spec = json.loads((race["root"] / "work" / "runs" / "rlcli-seed0" / "spec.json").read_text())
    raw = lr.rlcli_recipe(f"rlcli-{engine}", spec)
    assert raw["rollout"]["name"] == engine and lr.KV_SHARE in raw["rollout"].values()
    try:
        validate_recipe(raw, registry=race_rlcli.rlcli_registry(raw))
    except RecipeError as exc:
        problems = [line for line in str(exc).splitlines() if line.strip().startswith("- ")]
        assert len(problems) == 1 and "not installed" in problems[0], str(exc)


@slow
def test_warmstart_rebuilds_from_its_record(race, tmp_path):
    info = race["info"]
    run_script("warmstart", "--size", "tiny", "--seed", str(info["seed"]), "--sft-steps", str(info["sft_steps"]),
               "--work", str(tmp_path))
    again = tmp_path / "warmstart"
    for name in ("model.safetensors", "vocab.json", "merges.txt", "train.jsonl", "heldout.jsonl"):
        digest = [hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (race["ws"], again)]
        assert digest[0] == digest[1], name


@slow
def test_trl_run(race):
    pytest.importorskip("trl")
    run_script("race", "--reuse", str(race["ws"]), "--work", str(race["root"] / "work"), "--out",
               str(race["root"] / "out-trl"), "--framework", "trl", "--threads", "1", "--trl-fake-sampling-logps")
    r = json.loads((race["root"] / "out-trl" / "trl-seed0.json").read_text())
    assert r["exit_code"] == 0, r.get("log_tail")
    assert [p["step"] for p in r["curve"]] == [0, 1, 2] and r["steps_done"] == 2 and len(r["step_s"]) == 2
    procs = r["logits_processors"]  # TRL's sampling: full distribution, nothing had to be removed
    assert procs and not {"TopKLogitsWarper", "TopPLogitsWarper"} & set(procs)
    assert not any(p.startswith("removed:") for p in procs)
    assert r["logprob_gap_mean"] > 0 and "race hook" in r["gap_metric"]  # the hook, fed zeros for vLLM's logprobs
    assert r["versions"]["trl"] and len(r["logs"]) == 2 and "reward" in r["logs"][0]
    spec = json.loads((race["root"] / "work" / "runs" / "trl-seed0" / "spec.json").read_text())
    cfg = race_trl.trl_config(spec, vllm=True)
    completions = spec["settings"]["prompts"] * 8
    assert cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps == completions
    assert cfg.steps_per_generation == cfg.gradient_accumulation_steps and cfg.num_iterations == 1
    assert (cfg.loss_type, cfg.scale_rewards, cfg.beta) == ("dapo", "group", 0.0)
    assert cfg.epsilon == cfg.epsilon_high == 0.2
    assert (cfg.top_k, cfg.top_p, cfg.temperature, cfg.num_generations) == (0, 1.0, 1.0, 8)
    assert cfg.use_vllm and cfg.vllm_mode == "colocate" and cfg.vllm_enable_sleep_mode
    assert cfg.vllm_gpu_memory_utilization == lr.KV_SHARE and not cfg.vllm_importance_sampling_correction
    assert getattr(cfg.lr_scheduler_type, "value", cfg.lr_scheduler_type) == "constant"
    assert cfg.weight_decay == 0.0 and cfg.max_grad_norm == 1.0 and cfg.warmup_steps == 0
    assert cfg.gradient_checkpointing is False  # TRL's default is True; rlcli does not checkpoint either
