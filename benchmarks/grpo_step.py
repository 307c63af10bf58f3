"""GRPO step benchmark on one GPU: rlcli (embedded engine) against TRL, on identical work.

    python benchmarks/grpo_step.py --all --out results/            # everything below, in one process
    python benchmarks/grpo_step.py --engine --rlcli                # skip TRL
    python benchmarks/grpo_step.py --all --engine-plugin sglang \
        --variant sglang:rollout.name=sglang,rollout.mem_fraction_static=0.3   # + a backend plugin, same run

Work (the issue's reference workload): a random-init Qwen2.5-0.5B-shaped model (24 layers,
hidden 896, 14/2 heads, vocab 151,936, tied embeddings) in bf16 with an offline word-level
tokenizer; 64 prompts of 64 tokens × 8 samples × 256 new tokens (forced: EOS ignored), one
optimizer step per batch, lr 1e-6, reward = response length mod 7 (as the TRL baseline).
`--shape 1.5b|3b|7b` builds another Qwen2.5 shape (SHAPES; 7b adds SHAPE_PRESETS' bfloat16 AdamW
moments to the rlcli runs); `--lengths longtail` turns EOS on, with geometric response lengths of mean 256 cut
at 1024 (benchmarks/lengths.py: many end ids in the model's generation_config.json). The sweep
over shapes, lengths and frameworks is benchmarks/step_sweep.py (one process of this script per run).

Sections:
  --ceilings  bf16 matmul TFLOP/s and device copy TB/s (the roofline the MFU is relative to)
  --engine    embedded engine alone: 512 sequences × 256 new tokens, generated tok/s (longtail: the
              measured lengths against the truncated geometric mean)
  --rlcli     `ColocateRunner` steps: median and min-max step time, split rollout / train / sync,
              generated tok/s, training MFU (6·N·T FLOPs, T the tokens the model runs on), weight sync s/GB, peak GPU memory
  --trl       TRL GRPOTrainer (transformers generate) on the same work, step times split into
              rollout / sync / the rest, generated tok/s, MFU of the rest, peak memory
  --trl-vllm  TRL GRPOTrainer with vLLM in colocate mode (grpo_trl.TRL_VLLM settings), same work;
              --trl-vllm-tuned adds a run with grpo_trl.TRL_VLLM_TUNED on top (sleep mode and the
              importance-sampling pass off); --trl-vllm-variant NAME:KEY=VALUE,... a run with other
              GRPOConfig settings
Each section prints `RESULT {json}` lines; `--out DIR` also writes results.json, table.md and
split.png. A failing section prints its exact error and the others still run. `--profile` adds
torch.profiler tables; `--memory` writes, for the third train step of each rlcli run, what was
allocated at its peak and what it leaves allocated, grouped by allocation stack (recording the
stacks slows the steps: use it in a run of its own, not for timings).
Beside this script: grpo_args.py (its flags), grpo_trl.py (the TRL rows), grpo_report.py (the --out
files), torch_profile.py (--profile), memory_stacks.py (--memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

import bench_plugin  # noqa: E402  (the benchmark judger, a plugin module)
import grpo_args  # noqa: E402  (the command line)
import grpo_report  # noqa: E402  (--out: results.json, table.md, split.png)
import host_memory  # noqa: E402  (host_peak_gib: what the offload settings hold in host RAM)
import torch_profile  # noqa: E402  (--profile)
from memory_stacks import peak_in_trace, summarize_snapshot  # noqa: E402  (--memory; tests import them from here)

# Random-init Qwen2.5 shapes (--shape); "tiny" is the CPU smoke-test model of --tiny. The numbers are
# those of the published config.json files (vocab_size, num_hidden_layers, hidden_size,
# num_attention_heads / num_key_value_heads, intermediate_size, tie_word_embeddings), checked against
# copies of Qwen/Qwen2.5-3B's (huggingface.co/unsloth/Qwen2.5-3B/blob/main/config.json, whose
# _name_or_path is Qwen/Qwen2.5-3B) and Qwen/Qwen2.5-7B's (a fine-tune's config.json with _name_or_path
# Qwen/Qwen2.5-7B, huggingface.co/AmberYifan/Qwen2.5-7B-gen-dpo-10k; Qwen2.5-7B-Instruct's has the same
# shape numbers), and against the Qwen2.5 size presets of a public training library (3B: 2048, 11008,
# 16/2 heads, 36 layers, tied; 7B: 3584, 18944, 28/4, 28 layers, untied).
SHAPES = {
    "0.5b": dict(vocab=151936, layers=24, hidden=896, heads=14, kv=2, inter=4864, tied=True),
    "1.5b": dict(vocab=151936, layers=28, hidden=1536, heads=12, kv=2, inter=8960, tied=True),
    "3b": dict(vocab=151936, layers=36, hidden=2048, heads=16, kv=2, inter=11008, tied=True),
    "7b": dict(vocab=152064, layers=28, hidden=3584, heads=28, kv=4, inter=18944, tied=False),
    "tiny": dict(vocab=1000, layers=2, hidden=64, heads=4, kv=2, inter=128, tied=True),
}
# rlcli recipe overrides a shape needs on one H200, applied before --set (and stated in each result).
# 7B: float32 master weights, gradients and AdamW moments (16 bytes a parameter, 122 GB) do not fit
# beside the engine, nor in the 1-GPU machine's 125 GiB of host RAM with FSDP2's CPU offload (the
# kernel's OOM killer ended that run: 108 GiB pinned, 2026-12-04). Moments in bfloat16 bring the state
# to 12 bytes a parameter (91 GB) on the GPU; 32,768-token packs keep the activations beside it.
SHAPE_PRESETS: dict[str, list[str]] = {"7b": ["train_worker.optimizer.moment_dtype=bfloat16",
                                              "train_worker.pack_max_length=32768"]}
SHAPE_NAME = "0.5b"
SHAPE = dict(SHAPES[SHAPE_NAME])  # the shape the model is built with (the workload)
PROMPTS, K, NEW, PROMPT_LEN = 64, 8, 256, 64
LENGTHS = "full"  # --lengths: full (NEW tokens, EOS ignored) or longtail (lengths.py)
DEVICE = "cuda"
DTYPE = torch.bfloat16
RESULTS: list[dict] = []
PROFILE_DIR: Path | None = None  # --profile: torch.profiler tables are written here
PROFILE_WHAT = "all"  # or "train": only the train step is profiled
ENGINE_PLUGINS: list = []  # --engine-plugin: plugin modules registered for the rlcli runs (not pip-installed here)
MEMORY_DIR: Path | None = None  # --memory: a train step's peak and what it leaves allocated, by allocation stack
PEAK_TFLOPS = 787.0  # the bf16 matmul ceiling MFU is relative to (measured by --ceilings when it runs)


def profiled(name: str):
    """Context manager: torch.profiler over the block when --profile is on; writes a kernel table."""
    return torch_profile.profiled(name, PROFILE_DIR, PROFILE_WHAT, DEVICE)


def result(**kw) -> dict:
    kw = {"shape": SHAPE_NAME, "lengths": LENGTHS, **kw}
    RESULTS.append(kw)
    print("RESULT " + json.dumps(kw), flush=True)
    return kw


def make_model_dir(d: Path) -> Path:
    """Random-init model + word-level tokenizer ("w0".."wN" are single tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    v = SHAPE["vocab"]
    words = {f"w{i}": i for i in range(v - 3)}
    words.update({"<unk>": v - 3, "<pad>": v - 2, "<eos>": v - 1})
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(str(d))
    cfg_file = d / "tokenizer_config.json"
    tcfg = json.loads(cfg_file.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 5 otherwise gives a `model_type: qwen2` directory Qwen2Tokenizer, which encodes these
    # words to nothing (seen inside the vLLM of the TRL + vLLM row)
    tcfg["auto_map"] = {"AutoTokenizer": [None, "PreTrainedTokenizerFast"]}
    cfg_file.write_text(json.dumps(tcfg))
    cfg = Qwen2Config(vocab_size=v, hidden_size=SHAPE["hidden"], num_hidden_layers=SHAPE["layers"],
                      num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv"],
                      intermediate_size=SHAPE["inter"], max_position_embeddings=4096,
                      tie_word_embeddings=SHAPE.get("tied", True),
                      eos_token_id=v - 1, pad_token_id=v - 2, bos_token_id=None)
    torch.manual_seed(0)
    # on the GPU when there is one: 7B in ~40 s with its file writes (tenth session), where the CPU's
    # random init took most of 320 s (ninth); the GPU's values differ, not their distribution
    try:
        with torch.device(DEVICE):
            model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPE)
    except Exception as exc:  # a GPU without room for the model (a failure here must not cost the run)
        print(f"[model] random init on {DEVICE} failed ({exc!r}); building on the CPU", flush=True)
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPE)
    model.save_pretrained(str(d))
    del model
    if DEVICE == "cuda":  # the runs after the build start with its memory freed and out of the peaks
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return d


def prepare_model(root: Path, cache: Path | None) -> Path:
    """The model directory of this run's shape and lengths: built under ``root``, or reused from
    (else built into) ``cache/<shape>`` when a cache is given; ``longtail`` adds a directory that
    links to those files and has its own ``generation_config.json`` (lengths.py)."""
    import lengths

    key = f"{SHAPE_NAME}-v{SHAPE['vocab']}-h{SHAPE['hidden']}-l{SHAPE['layers']}"  # --tiny has its own
    base = (cache or root) / (key if cache else "model")
    if not (base / "model.safetensors.index.json").exists() and not (base / "model.safetensors").exists():
        tmp = base.with_name(base.name + ".partial")
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        make_model_dir(tmp)
        tmp.rename(base)  # a build cut short is never taken for a model
    if LENGTHS == "full":
        return base
    return lengths.longtail_model_dir(base, base.with_name(base.name + "-longtail"), SHAPE["vocab"], SHAPE["vocab"] - 2)


def sample_params() -> dict:
    """The single-turn loop's sample params of the work (--lengths)."""
    import lengths

    if LENGTHS == "longtail":
        return {"max_tokens": lengths.MAX_NEW, "min_tokens": 0, "ignore_eos": False, "temperature": 1.0}
    return {"max_tokens": NEW, "min_tokens": NEW, "ignore_eos": True, "temperature": 1.0}


def max_new() -> int:
    import lengths

    return lengths.MAX_NEW if LENGTHS == "longtail" else NEW


def write_prompts(path: Path, n: int, seed: int = 1) -> Path:
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for i in range(n):
            words = " ".join(f"w{int(x)}" for x in torch.randint(0, SHAPE["vocab"] - 3, (PROMPT_LEN,), generator=g))
            f.write(json.dumps({"data_source": "bench", "prompt": words, "reward_model": {"ground_truth": "0"}}) + "\n")
    return path


def n_params(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    return sum(p.numel() for p in m.parameters())


def ceilings() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    tflops = 2 * 8192**3 / ((time.perf_counter() - t) / 10) / 1e12
    result(what="ceilings", bf16_matmul_tflops=round(tflops, 1))
    del a, b
    torch.cuda.empty_cache()
    return tflops


def engine(model_dir: Path, overrides: list[str] | None = None, label: str = "embedded") -> None:
    import asyncio

    from rlcli.backends.base import BackendContext, GenerateRequest
    from rlcli.backends.embedded import EmbeddedBackend
    from rlcli.types import SampleParams

    import lengths
    from rlcli.tokenizer import eos_token_ids, load_tokenizer

    eos = eos_token_ids(load_tokenizer(str(model_dir)), model_dir)  # as a run reads them (longtail: the list)
    ctx = BackendContext(model_dir=str(model_dir), device=torch.device(DEVICE), dtype=DTYPE,
                         eos_token_ids=eos, seed=0)
    from rlcli.overrides import apply_overrides

    conf = apply_overrides({"max_batch_size": 512, "max_model_len": PROMPT_LEN + max_new()}, list(overrides or []))
    t0 = time.perf_counter()
    be = EmbeddedBackend(EmbeddedBackend.Config(**conf), ctx)
    params = SampleParams(**sample_params())
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, SHAPE["vocab"] - 3, (PROMPT_LEN,), generator=g).tolist() for _ in range(512 // K)]
    made: list[list[int]] = []  # response lengths of every call

    async def once() -> float:
        t = time.perf_counter()
        reqs = [GenerateRequest(prompt_ids=p, params=params, seed=len(made) * 512 + i * K + j)
                for i, p in enumerate(prompts) for j in range(K)]
        outs = await asyncio.gather(*(be.generate(r) for r in reqs))
        dt = time.perf_counter() - t
        made.append([len(o.token_ids) for o in outs])
        assert LENGTHS == "longtail" or all(n == NEW for n in made[-1])
        return dt

    loop = asyncio.new_event_loop()
    times = [loop.run_until_complete(once()) for _ in range(3)]
    first_s = time.perf_counter() - t0 - sum(times[1:])  # start-up + first call (graphs, compilation)
    with profiled(f"engine-{label}"):
        loop.run_until_complete(once())

    def direct() -> float:  # the scheduler driven on this thread: no event loop, no worker thread
        eng = be.engine
        seqs = [eng.make_sequence(GenerateRequest(prompt_ids=p, params=params, seed=i * K + j), 0)
                for i, p in enumerate(prompts) for j in range(K)]
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for sq in seqs:
            eng.submit(sq)
        while eng.has_work():
            eng.step()
        return time.perf_counter() - t

    direct_s = min(direct() for _ in range(2))
    with profiled(f"engine-direct-{label}"):
        direct()
    tokens = [sum(m) for m in made]  # generated tokens of each timed call (varies with longtail)
    best = min(range(1, len(times)), key=lambda i: times[i])
    extra = {}
    if LENGTHS == "longtail":  # the measured lengths against the truncated geometric distribution
        p = lengths.stop_probability(SHAPE["vocab"])
        extra = dict(response_lengths=lengths.length_stats([n for m in made for n in m], lengths.MAX_NEW),
                     expected_mean=round(lengths.truncated_geometric_mean(p, lengths.MAX_NEW), 1),
                     stop_p=round(p, 6), eos_ids=len(lengths.eos_ids(SHAPE["vocab"])))
    result(what="engine", engine="embedded", label=label, overrides=list(overrides or []),
           startup_and_first_s=round(first_s, 1), sequences=512, new_tokens=max_new(),
           seconds=[round(t, 3) for t in times], tok_per_s=round(tokens[best] / times[best], 0),
           direct_s=round(direct_s, 3), direct_tok_per_s=round(512 * NEW / direct_s, 0) if LENGTHS == "full" else None,
           peak_gib=peak_gib(), **extra)
    be.shutdown()
    loop.close()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None


def bench_recipe(model_dir: Path, data: Path, work: Path, steps: int, rollout: dict | None = None) -> dict:
    """The benchmark's recipe tree: colocated GRPO on the prompts of ``data``, ``K`` responses each
    (forced full-length, or long-tailed: --lengths), one optimizer step per batch, the
    ``bench_len_mod7`` judger; the embedded engine unless ``rollout`` is given."""
    return {
        "model": {"path": str(model_dir), "dtype": "bfloat16" if DEVICE == "cuda" else "float32"},
        "trainer": {"total_train_steps": steps, "train_batch_size": PROMPTS, "enable_evaluate": False,
                    "hf_interval": -1, "checkpoint_interval": -1, "work_dir": str(work), "log_every": 1},
        "resources": {"device": DEVICE},
        "rollout": rollout or {"name": "embedded", "max_batch_size": PROMPTS * K,
                               "max_model_len": max(512, PROMPT_LEN + max_new())},
        "train_worker": {"optimizer": {"lr": 1e-6}, "optimizer_steps": 1, "pack_max_length": 16384,
                         "max_grad_norm": 1.0},
        "tasks": [{"task_name": "bench", "sampler": {"name": "jsonl", "path": str(data), "prompt_repeat_k": K},
                   "agent_loop": {"name": "single_turn", "sample_params": sample_params()},
                   "judger": {"name": "bench_len_mod7", "executor": "inline"}}],
    }


def rlcli_steps(model_dir: Path, data: Path, work: Path, steps: int, peak_tflops: float,
                overrides: list[str] | None = None, label: str = "embedded") -> None:
    preset = SHAPE_PRESETS.get(SHAPE_NAME, [])
    host_memory.reset_peak()  # the host peak of this run: its offloaded state, not the model build before it
    rec, runner = colocate_runner(model_dir, data, work, steps, preset + list(overrides or []))
    rows = []
    watch_train_step(runner, label)
    work_of_step = []  # (response lengths, tokens the trainer runs on) of each step's trained groups
    watch_log(runner, label, rows, work_of_step, rec.train_worker.share_prompts)
    # the parameters the optimizer trains (all of them; with model.lora, the adapters alone)
    trainable = sum(p.numel() for p in runner.worker.model.parameters() if p.requires_grad)
    try:
        runner.fit()
    finally:
        if MEMORY_DIR is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
        runner.close()
    rlcli_result(model_dir, rec.rollout.name, label, preset, overrides, rows, work_of_step, trainable, peak_tflops)


def colocate_runner(model_dir: Path, data: Path, work: Path, steps: int, overrides: list[str]):
    """The validated benchmark recipe (``overrides`` applied) and its ``ColocateRunner``; with
    --memory, allocation stacks are recorded from before the model is built."""
    from rlcli.config import validate_recipe
    from rlcli.overrides import apply_overrides
    from rlcli.plugins import registry_with
    from rlcli.runner.colocate import ColocateRunner

    raw = bench_recipe(model_dir, data, work, steps)
    raw = apply_overrides(raw, overrides)
    rec = validate_recipe(raw, registry=registry_with(bench_plugin, *ENGINE_PLUGINS))
    if MEMORY_DIR is not None:  # from before the model is built: the trace holds every live block
        torch.cuda.memory._record_memory_history(max_entries=3_000_000)
    return rec, ColocateRunner(rec, quiet=True, overwrite=True)


def watch_train_step(runner, label: str) -> None:
    """Wrap the runner's train step: --profile profiles the fourth, --memory writes the third's peak."""
    orig_train = runner.worker.train_step
    calls = []

    def train_step(seqs):  # --profile: the third train step (warm) under torch.profiler
        calls.append(1)
        t_start = time.time() * 1e6
        with profiled(f"train-{label}") if len(calls) == 4 else contextlib.nullcontext():
            out = orig_train(seqs)
        if MEMORY_DIR is not None and len(calls) == 3:  # --memory: the warm train step's peak, and what it leaves
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            text = (summarize_snapshot(snap) + "\n\n" + peak_in_trace(snap, t_start, time.time() * 1e6)
                    + f"\n\ntorch.cuda.memory_allocated now: {torch.cuda.memory_allocated() / 2**30:.2f} GiB")
            MEMORY_DIR.mkdir(parents=True, exist_ok=True)
            (MEMORY_DIR / f"memory-train-{label}.txt").write_text(text + "\n")
            print(f"[memory, train step 3, {label}]\n{text}", flush=True)
        return out

    runner.worker.train_step = train_step


def watch_log(runner, label: str, rows: list, work_of_step: list, share_prompts: bool) -> None:
    """Wrap the runner's log: each step's metrics go to ``rows`` and its trained work to
    ``work_of_step``; with --profile, the whole of step 3 of the embedded run is profiled."""
    orig_log = runner.log
    step_prof = []

    def log(step, metrics, groups=None):
        out = orig_log(step, metrics, groups)
        rows.append(out)
        work_of_step.append(trained_work(groups or [], share_prompts))
        if label == "embedded" and PROFILE_DIR is not None:  # --profile: the whole of step 3
            if step == 2:
                step_prof.append(profiled("step"))
                step_prof[0].__enter__()
            elif step == 3:
                step_prof[0].__exit__(None, None, None)
        return out

    runner.log = log


def measured_rows(rows: list[dict], label: str) -> list[dict]:
    """The steps that count: all but the warm-up, and but those --profile ran under the profiler."""
    measured = rows[1:]  # step 1 warms up (CUDA graphs, allocator)
    if PROFILE_DIR is not None:  # steps 3 (whole step) and 4 (train) may have run under the profiler
        skip = (1, 3, 4) if PROFILE_WHAT == "all" and label == "embedded" else (1, 4)
        measured = [r for i, r in enumerate(rows, 1) if i not in skip] or measured
    return measured


def rlcli_result(model_dir: Path, backend: str, label: str, preset: list[str], overrides: list[str] | None,
                 rows: list[dict], work_of_step: list, trainable: int, peak_tflops: float) -> None:
    """The RESULT of one rlcli run from its steps' metrics (``rows``) and trained work."""
    measured = measured_rows(rows, label)
    step_s = [r["timing/step_s"] for r in measured]
    roll = [r["timing/rollout_s"] for r in measured]
    train = [r["timing/train_s"] for r in measured]
    sync = [r["timing/sync_s"] for r in measured]
    kept = [w for w, r in zip(work_of_step, rows) if any(r is m for m in measured)]
    # the tokens the model is run on (with share_prompts each prompt once for its K responses), per step
    tokens = statistics.median(t for _, t in kept)
    flops = 6 * n_params(model_dir) * tokens
    # generated tokens per second of rollout: the engine's new tokens of the step (with async, those of
    # responses left in flight or continued included)
    gen = statistics.median(r.get("rollout/tokens", PROMPTS * K * NEW) / r["timing/rollout_s"] for r in measured)
    gb = measured[-1].get("sync/bytes", 0) / 1e9
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    import lengths

    result(what="rlcli", backend=backend, label=label, preset=preset, overrides=list(overrides or []),
           steps_measured=len(measured), response_lengths=lengths.length_stats(
               [n for w, _ in kept for n in w], max_new()), trained_tokens=tokens, trainable_params=trainable,
           step_s_median=round(statistics.median(step_s), 3), step_s_min=round(min(step_s), 3),
           step_s_max=round(max(step_s), 3), rollout_s=round(statistics.median(roll), 3),
           train_s=round(statistics.median(train), 3), sync_s=round(statistics.median(sync), 4),
           gen_tok_per_s=round(gen, 0),
           train_mfu=round(flops / statistics.median(train) / (peak_tflops * 1e12), 3),
           sync_s_per_gb=round(statistics.median(sync) / gb, 4) if gb else None,
           **memory_peaks(measured), host_peak_gib=host_memory.peak_gib(), per_step=per_step(rows, measured))


def memory_peaks(measured: list[dict]) -> dict:
    """peak_gib (rollout or train), rollout_peak_gib and train_peak_gib of the measured steps (None off CUDA)."""
    return dict(
        peak_gib=max((r.get(k, 0.0) for r in measured for k in ("memory/rollout_peak_gib", "memory/train_peak_gib")),
                     default=None) if DEVICE == "cuda" else None,
        rollout_peak_gib=max((r.get("memory/rollout_peak_gib", 0.0) for r in measured), default=None)
        if DEVICE == "cuda" else None,
        train_peak_gib=max((r.get("memory/train_peak_gib", 0.0) for r in measured), default=None)
        if DEVICE == "cuda" else None)


def per_step(rows: list[dict], measured: list[dict]) -> list[dict]:
    """Every step, warm-up and profiled ones included, so that an outlier can be placed."""
    return [{"step": i, "step_s": round(r["timing/step_s"], 3), "rollout_s": round(r["timing/rollout_s"], 3),
             "train_s": round(r["timing/train_s"], 3), "sync_s": round(r["timing/sync_s"], 4),
             **{k: round(r[f"timing/{k}"], 4) for k in ("sleep_s", "wake_up_s") if f"timing/{k}" in r},
             # the engine's own view of the rollout: time with work, scheduler steps, graphs captured,
             # tokens made and prefilled (a resumed partial response is prefilled again)
             **{k: round(r[f"engine/{k}"], 4) for k in ("busy_s", "steps", "cuda_graph_captures", "generated_tokens",
                                                        "prefill_tokens", "shared_prefill_tokens")
                if f"engine/{k}" in r},
             **{k: r[f"rollout/{k}"] for k in ("partial_resumed_samples", "rerolled_samples") if f"rollout/{k}" in r},
             "measured": any(r is m for m in measured)} for i, r in enumerate(rows, 1)]


def trained_work(groups, share_prompts: bool) -> tuple[list[int], int]:
    """The response lengths of the completed samples of ``groups`` and the tokens the trainer runs
    on for them (each prompt once per group with ``share_prompts``, else once per sample)."""
    lens, tokens = [], 0
    for g in groups:
        done = [s for s in g.samples if s.response_ids]
        lens += [len(s.response_ids) for s in done]
        prompt = len(done[0].prompt_ids) if done else 0
        tokens += sum(len(s.response_ids) for s in done) + prompt * (min(1, len(done)) if share_prompts else len(done))
    return lens, tokens


def trl_row(model_dir: Path, steps: int, vllm: dict | None = None, label: str = "") -> None:
    """One TRL row (grpo_trl.py) on this benchmark's work."""
    import grpo_trl
    import lengths

    work = dict(vocab=SHAPE["vocab"], prompts=PROMPTS, k=K, new=max_new(), prompt_len=PROMPT_LEN, device=DEVICE,
                dtype=DTYPE, lengths=LENGTHS)
    host_memory.reset_peak()
    row = grpo_trl.trl_steps(model_dir, steps, work, vllm)
    row["host_peak_gib"] = host_memory.peak_gib()
    row["response_lengths"] = lengths.length_stats(row.pop("completion_lengths"), max_new())
    if row["train_s"] > 0:  # 6·N·T over the step's non-rollout, non-sync time (TRL's whole training side)
        row["train_mfu"] = round(6 * n_params(model_dir) * row["trained_tokens"] / row["train_s"] / (PEAK_TFLOPS * 1e12), 3)
    result(what="trl-vllm" if vllm is not None else "trl", label=label, **row)


def write_outputs(out: Path) -> None:
    """results.json, table.md and split.png of this run's results into ``out`` (grpo_report.py)."""
    grpo_report.write_outputs(out, RESULTS, DEVICE, SHAPE_NAME, LENGTHS)


def use_shape(name: str, lengths: str = "full", tiny: bool = False) -> None:
    """Make ``name`` the shape this process builds and runs, with the ``lengths`` regime; ``tiny``
    builds the CPU smoke-test model instead and moves the work to the CPU at its small sizes (the
    other scripts that reuse this module's model call this too)."""
    global DEVICE, DTYPE, PROMPTS, NEW, PROMPT_LEN, SHAPE_NAME, LENGTHS
    SHAPE_NAME, LENGTHS = name, lengths
    SHAPE.clear()
    SHAPE.update(SHAPES["tiny" if tiny else name])
    if tiny:
        DEVICE, PROMPTS, NEW, PROMPT_LEN = "cpu", 8, 8, 8
    DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def configure(args: argparse.Namespace) -> None:
    """The work of this run (--shape, --lengths, --tiny) and the sections --all turns on."""
    use_shape(args.shape, args.lengths, args.tiny)
    if args.tiny:
        args.ceilings = False
    if args.all:
        args.ceilings = args.engine = args.rlcli = args.trl = args.trl_vllm = args.trl_vllm_tuned = True


def load_engine_plugins(names: list[str]) -> None:
    """--engine-plugin: import plugins/rlcli-<NAME> from this checkout for the rlcli runs."""
    for name in names:
        import importlib

        sys.path.insert(0, str(REPO / "plugins" / f"rlcli-{name}"))
        ENGINE_PLUGINS.append(importlib.import_module(f"rlcli_{name}"))


def configure_outputs(args: argparse.Namespace, ap: argparse.ArgumentParser, root: Path) -> None:
    """Where --profile and --memory write (--out, else under ``root``), and what --profile covers."""
    global PROFILE_DIR, MEMORY_DIR, PROFILE_WHAT
    if args.profile:
        PROFILE_DIR = args.out or (root / "profile")
    if args.memory:
        if DEVICE != "cuda":
            ap.error("--memory needs a CUDA device")
        MEMORY_DIR = args.out or (root / "memory")
    PROFILE_WHAT = args.profile or "all"


def sections(args: argparse.Namespace, model_dir: Path, data: Path, root: Path) -> list:
    """(name, function) of every section, in run order; rlcli runs read PEAK_TFLOPS (--ceilings sets it) then."""
    out = [("ceilings", lambda: ceilings()), ("engine", lambda: engine(model_dir)),
           ("rlcli", lambda: rlcli_steps(model_dir, data, root / "work", args.steps, PEAK_TFLOPS, args.set,
                                         args.label))]
    for spec in args.engine_variant:
        label, _, sets = spec.partition(":")
        extra = [kv for kv in sets.split(",") if kv]
        out.insert(2, (f"engine:{label}", lambda label=label, extra=extra: engine(model_dir, extra, label)))
    out.append(("trl", lambda: trl_row(model_dir, args.steps)))  # same run as the main rlcli row
    out.append(("trl_vllm", lambda: trl_row(model_dir, args.steps, vllm={}, label="default")))
    import grpo_trl

    tuned = grpo_trl.tuned_settings(SHAPE_NAME, LENGTHS)
    out.append(("trl_vllm_tuned", lambda: trl_row(model_dir, args.steps, vllm=tuned, label="tuned")))
    for spec in args.trl_vllm_variant:  # run with or without --trl-vllm
        label, settings = grpo_trl.parse_variant(spec)
        out.append((f"trl_vllm_variant:{label}", lambda label=label, settings=settings: trl_row(
            model_dir, args.steps, vllm=settings, label=label)))
    for spec in args.variant:
        label, _, sets = spec.partition(":")
        extra = [kv for kv in sets.split(",") if kv]
        out.append((f"rlcli:{label}", lambda label=label, extra=extra: rlcli_steps(
            model_dir, data, root / f"work-{label}", args.steps, PEAK_TFLOPS, args.set + extra, label)))
    return out


def run_sections(args: argparse.Namespace, todo: list) -> None:
    """Run the sections asked for; a failing one is a RESULT with its error, and the next one runs."""
    global PEAK_TFLOPS
    for name, fn in todo:
        if not getattr(args, name.split(":")[0]):
            continue
        try:
            t = time.perf_counter()
            value = fn()
            if name == "ceilings":
                PEAK_TFLOPS = value
            print(f"[{name}] done in {time.perf_counter() - t:.1f}s", flush=True)
        except Exception:
            result(what=name, error=traceback.format_exc()[-2000:])
        if args.out:  # after every section: a run cut short still leaves its results
            write_outputs(args.out)


def main() -> None:
    ap = grpo_args.build_parser([k for k in SHAPES if k != "tiny"])
    args = ap.parse_args()
    configure(args)
    root = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    model_dir = prepare_model(root, args.model_cache)
    data = write_prompts(root / "prompts.jsonl", PROMPTS * (args.steps + 2))
    load_engine_plugins(args.engine_plugin)
    configure_outputs(args, ap, root)
    run_sections(args, sections(args, model_dir, data, root))


if __name__ == "__main__":
    main()
