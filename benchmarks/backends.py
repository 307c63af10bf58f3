"""Inference engines behind rlcli on one GPU: conformance kit, a 3-step GRPO run, and throughput
through rlcli against the same engine driven bare.

    python benchmarks/backends.py --engine vllm --out results/backends      # GPU machine with vLLM
    python benchmarks/backends.py --engine sglang --out results/backends
    python benchmarks/backends.py --engine lmdeploy --out results/backends
    python benchmarks/backends.py --engine embedded --tiny                   # CPU: checks the script, measures nothing

Sections (``--sections run,conformance`` by default; each failure is recorded and the rest runs):

run
    The Qwen2.5-0.5B-shaped random model, tokenizer and prompts of ``benchmarks/grpo_step.py``;
    ``ColocateRunner`` builds the trainer and the backend (``rollout.name=<engine>``) as
    ``rlcli train`` would. Before training, with the trainer already on the GPU:

    * **throughput through rlcli**: 64 prompts x 8 copies = 512 concurrent ``backend.generate``
      calls (as the agent loop sends them), 256 forced new tokens each (``ignore_eos``,
      ``min_tokens``), temperature 1, in generated tokens per second; once without and once with
      per-request seeds;
    * **bare**: the same engine object, same prompts and sampling, driven through the engine's own
      offline path on the plugin's engine thread - vLLM: ``LLMEngine.add_request`` + ``step()``
      until done (``LLM.generate``'s loop, ``FINAL_ONLY`` outputs); SGLang: one batched
      ``generate_request`` (what ``Engine.generate(input_ids=[...])`` sends); LMDeploy: one
      ``EngineInstance.async_stream_infer`` stream per prompt (the pipeline without text);
      embedded: ``EmbeddedEngine.step()`` until done.
    * **bare_each** (SGLang only, a diagnostic): the bare engine fed one ``generate_request`` per
      sequence, as rlcli feeds it.
    * **batched** (SGLang only): through rlcli as above (no seeds), with the plugin's
      ``batch_requests`` switched on for the round (``backend.batch_requests``): the 512 calls go
      to SGLang as one batched ``generate_request``, as in bare.

    The paths run in interleaved rounds: one warm-up round of each, then five timed rounds of
    each. Reported: the best round of each path and its ratio to the best bare round, and the
    median over rounds of each round's ratio to that round's bare rate, for plain, seeded and
    batched (all rounds are in the JSON).

    With ``--kernel-profile``, one more round of bare and of plain runs under the GPU profiler
    (``engine_kernels.py``: SGLang's own profiler in its scheduler process, ``torch.profiler``
    for the engines in rlcli's process), summarised per 512-row decode step: GPU busy and idle
    time and GPU time by kernel class (``kernel_profile`` results, a table in the markdown).

    Then three GRPO steps (``runner.fit()``: rollout, sleep, train, weight sync, wake up), the
    recipe of ``grpo_step.py`` (reward = response length mod 7, lr 1e-6).

    After start-up the settings the engine chose that size the work (concurrency, CUDA-graph batch
    sizes, KV cache, chunked prefill; ``backends_run.ENGINE_SETTINGS``) are recorded
    (``engine_settings``) and stated under the markdown row.

    The engine's rollout config is ``max_batch_size`` 512, ``max_model_len`` 512 and a 0.35 memory
    share; ``--run-set KEY=VALUE`` (repeatable) tunes it for the workload (concurrency, CUDA-graph
    batch sizes, chunked prefill: ``engine_kwargs.*``), and the bare path drives the same engine.
conformance
    Every check of ``rlcli.testing.backend_conformance`` on two tiny qwen2 models (hidden 256,
    head dim 64, as engines' attention kernels want), with the engine's tolerances, each check
    recorded as pass / FAIL (message) / not run; then the plugin checks of the same properties
    the kit cannot see for an engine: logprobs against the forward pass in the range the engine's
    logprob mode is exact, and free device memory after ``sleep(1)``/``sleep(2)``
    (``torch.cuda.mem_get_info``: the kit reads ``memory_allocated``, blind to vLLM's sleep-mode
    pool and to SGLang's scheduler process).

copies (a diagnostic, only when named)
    Why greedy copies of one prompt differ in the kit's ``many_concurrent``: for each
    ``--kit-variant NAME:KEY=VALUE,...`` one kit engine, whose greedy copies are compared inside the
    check's whole load, sent together alone, and sent one at a time (``section_copies``).

Output: ``RESULT {json}`` lines; with ``--out DIR``: ``results-<engine>.json`` and
``backends-<engine>.md`` (rows for docs/backends.md). ``--deadline-s`` (default 540) stops
starting new work when the device call's 600 s limit comes close; what did not run says so.

On the project's offline H200 (no network; read ../shared/tools/README.md first). Here, build the
carry folders of the engine plus what the device lacks for rlcli itself (pydantic):

    ../shared/tools/wheelhouse --exclude pynvvideocodec vllm==0.26.0 pydantic      # 17 chunks for vLLM
    ../shared/tools/wheelhouse --exclude pynvvideocodec sglang==0.5.17 pydantic    # 21 chunks
    ../shared/tools/wheelhouse --exclude pynvvideocodec --split-mb 54.5 lmdeploy==0.18.0 pydantic  # 25 chunks

then, on the device, one call per chunk back to back (the machine and its /tmp are given back
~30 s after a call): ``carry [".carry/wh-NN"]``, command ``mkdir -p /tmp/wh && cp .carry/wh-NN/*
/tmp/wh/``; and finally, in one call of at most 600 s:

    bash /tmp/wh/INSTALL.sh && export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH && \\
        python benchmarks/backends.py --engine vllm --out $OUT

Neither rlcli nor the plugin needs installing there: this script puts the repository and
``plugins/rlcli-<engine>`` on ``sys.path`` and registers the plugin in the recipe's registry
itself. If one call cannot hold everything, run ``--sections run`` and ``--sections conformance``
in two calls.

The code: this file is the command line (``main``); ``backends_common.py`` holds what the parts
share (the engines, the ``RESULT`` records, the options and the time budget of the device call),
``backends_run.py`` the section "run" and ``backends_throughput.py`` its throughput paths,
``backends_conformance.py`` the section "conformance" and the kit engines' settings,
``backends_copies.py`` the section "copies", and ``backends_report.py`` the markdown.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import torch

import backends_common as common  # puts the repository and the engine plugins on sys.path
import grpo_step as gs  # (model, tokenizer, prompts and recipe of the GRPO benchmark)
from backends_common import ENGINES, PLUGIN_MODULES, REPO, NotRun, engine_version, result, time_left
from backends_conformance import conformance_setup, section_conformance
from backends_copies import copies_summary, parse_variant, section_copies
from backends_report import markdown
from backends_run import section_run
from backends_throughput import bare, host_profile, paired_ratio, through_rlcli, throughput, workload

# Called as backends.NAME by tests/test_engine_plugins.py (the run's state is backends_common's: ``common``).
__all__ = ["NotRun", "bare", "conformance_setup", "copies_summary", "host_profile", "main", "markdown",
           "paired_ratio", "parse_variant", "section_conformance", "section_copies", "through_rlcli", "throughput",
           "workload"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=ENGINES, required=True)
    ap.add_argument("--sections", default="run,conformance",
                    help="comma-separated: run, conformance, copies (a diagnostic, not run by default)")
    ap.add_argument("--out", type=Path, help="write results-<engine>.json and backends-<engine>.md here")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script, measures nothing")
    ap.add_argument("--host-profile", action="store_true",
                    help="after the throughput rounds, profile one plain and one bare round on the engine thread "
                         "(host-profile-<engine>-{plain,bare}.txt in --out)")
    ap.add_argument("--paths", default="",
                    help="comma-separated throughput paths to time besides bare (default: all of the engine's), "
                         "e.g. plain for a longer run of the rlcli/bare ratio alone")
    ap.add_argument("--rounds", type=int, default=0, help="timed throughput rounds (default 7), after one warm-up round")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="after the throughput rounds, one bare and one plain round under the GPU profiler, "
                         "summarised per decode step by kernel class (engine_kernels.py; kernel_profile results)")
    ap.add_argument("--checks", default="", help="comma-separated conformance checks to run (default: all)")
    ap.add_argument("--kit-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a backend setting of the conformance kit's engines, on top of the script's (repeatable; "
                         "dotted keys, YAML values), e.g. engine_kwargs.disable_radix_cache=true")
    ap.add_argument("--run-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a rollout setting of the run section's engine on top of the script's (repeatable; dotted "
                         "keys, YAML values): the engine tuned for the workload, through rlcli and bare alike, "
                         "e.g. engine_kwargs.chunked_prefill_size=16384 (SGLang) or use_request_seeds=false")
    ap.add_argument("--kit-variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="for --sections copies: one kit engine per variant, with these settings on top of "
                         "--kit-set (repeatable; 'NAME:' for none), e.g. no_radix:engine_kwargs.disable_radix_cache=true")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="start no new work after this many seconds")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    sections = apply_args(ap, args)
    if args.engine != "embedded":
        problem = importlib.import_module(PLUGIN_MODULES[args.engine]).ENGINE.problem()
        if problem is not None:
            result(what="engine", engine=args.engine, error=problem)
    env = environment(args.engine, sections)
    result(what="env", **env)
    root = Path(tempfile.mkdtemp(prefix=f"backends-{args.engine}-"))
    run_sections(args.engine, sections, root)
    table = markdown(args.engine, env)
    print(table, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"results-{args.engine}.json").write_text(json.dumps({"env": env, "results": common.RESULTS},
                                                                         indent=2, default=str))
        (args.out / f"backends-{args.engine}.md").write_text(table)


def apply_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Sets the options of ``backends_common`` and, for ``--tiny``, the GRPO benchmark's shapes from
    the command line (``ap.error`` on a bad one); returns the sections to run."""
    common.DEADLINE_S = args.deadline_s
    common.CHECKS[:] = [c.strip() for c in args.checks.split(",") if c.strip()]
    common.KIT_SET[:] = args.kit_set
    common.RUN_SET[:] = args.run_set
    try:
        common.KIT_VARIANTS[:] = [parse_variant(v) for v in args.kit_variant]
    except ValueError as exc:
        ap.error(str(exc))
    common.HOST_PROFILE = (args.out or Path(".")) if args.host_profile else None
    common.KERNEL_PROFILE = args.kernel_profile
    common.PATHS[:] = [p.strip() for p in args.paths.split(",") if p.strip()]
    known_paths = {"plain", "seeded", "bare"} | ({"bare_each", "batched"} if args.engine == "sglang" else set())
    if set(common.PATHS) - known_paths:
        ap.error(f"--paths: unknown for {args.engine}: {sorted(set(common.PATHS) - known_paths)}; "
                 f"known: {', '.join(sorted(known_paths))}")
    if args.rounds < 0:
        ap.error("--rounds must be 0 (the default) or more")
    common.ROUNDS = args.rounds
    from rlcli.testing import backend_conformance as bc

    known = [*bc.ALL_CHECKS, "logprobs_in_exact_range", "sleep_releases_device_memory"]
    if set(common.CHECKS) - set(known):
        ap.error(f"--checks: unknown {sorted(set(common.CHECKS) - set(known))}; known: {', '.join(known)}")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"run", "conformance", "copies"}
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    if args.tiny:
        gs.SHAPE.update(gs.SHAPES["tiny"])
        gs.DEVICE, gs.PROMPTS, gs.NEW, gs.PROMPT_LEN = "cpu", 4, 8, 8
    elif not torch.cuda.is_available():
        ap.error("no CUDA device: use --tiny on a CPU machine")
    gs.DTYPE = torch.bfloat16 if gs.DEVICE == "cuda" else torch.float32
    return sections


def environment(engine: str, sections: list[str]) -> dict:
    """The run's ``env`` record: date, engine and versions, device, the measured commit, sections."""
    import transformers

    try:
        # "-dirty": the measured tree had uncommitted changes (say which in the write-up)
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO,
                                capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        commit = "unknown"
    return {"date": time.strftime("%Y-%m-%d"), "engine": engine, "engine_version": engine_version(engine),
            "device": torch.cuda.get_device_name(0) if gs.DEVICE == "cuda" else "CPU (smoke test)",
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit,
            "sections": sections, **({"kit_set": list(common.KIT_SET)} if common.KIT_SET else {}),
            **({"run_set": list(common.RUN_SET)} if common.RUN_SET else {})}


def run_sections(engine: str, sections: list[str], root: Path) -> None:
    """The named sections in order, each skipped when the device call's time is nearly up; a
    section's failure is recorded and the next one runs."""
    for name, fn in (("run", section_run), ("conformance", section_conformance), ("copies", section_copies)):
        if name not in sections:
            continue
        if time_left() < 60:
            result(what=name, engine=engine, error="not run: time budget of the device call")
            continue
        t = time.perf_counter()
        try:
            fn(engine, root)
        except Exception:
            result(what={"run": "grpo"}.get(name, name), engine=engine, error=traceback.format_exc()[-3000:])
        print(f"[{name}] done in {time.perf_counter() - t:.1f}s", flush=True)


if __name__ == "__main__":
    main()
