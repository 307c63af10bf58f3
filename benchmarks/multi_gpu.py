"""Multi-GPU runs of one host: FSDP2 scaling, disaggregated async against colocated sync, two "nodes".

    python benchmarks/multi_gpu.py --gpus 2 --out results/multi                # every run below
    python benchmarks/multi_gpu.py --gpus 4 --runs scale --shapes 0.5b,1.5b --out results/multi
    python benchmarks/multi_gpu.py --tiny --gpus 2 --out /tmp/multi            # CPU, gloo: checks the script

Work (as ``grpo_step.py``): a random-init Qwen2.5-shaped model in bf16 with an offline word-level
tokenizer, 64 prompts of 64 tokens x 8 samples x 256 new tokens (forced), one optimizer step per
batch, reward = response length mod 7 (``bench_plugin.py``, loaded in every rank through
``RLCLI_PLUGINS``). Every run is ``rlcli train RECIPE --nproc-per-node N`` in a subprocess (the
recipe is written next to its work dir); its ``metrics.jsonl`` gives the figures. The global batch
is the same whatever the number of GPUs, so a perfect scaling divides the step time by N.

Runs (``--runs``):
  scale   colocated FSDP2 on 1 and on ``--gpus`` GPUs, per ``--shapes``: median step time after the
          warm-up, generated tokens/s per GPU, scaling efficiency ``t1 / (N * tN)``, peak memory of
          rank 0 in rollout and in training.
  async   on ``--gpus`` GPUs: disaggregated (half train, half roll out; ``max_staleness`` 1, partial
          rollout on) against colocated sync, same work: speed-up of the median step, staleness
          (mean and max over the steps), trainer idle time per step (``timing/wait_for_batch_s``),
          weight sync seconds per GB across GPUs. Several rollout ranks are data-parallel replicas.
  nodes   the colocated run of ``scale`` as two "nodes" of ``--gpus / 2`` GPUs on this host: two
          ``rlcli train --nnodes 2 --node-rank R --master-addr 127.0.0.1 --master-port P``
          processes (each sees its half of the GPUs), against the one-launch run.

Prints ``RESULT {json}`` lines; ``--out DIR`` also writes ``results.json`` and ``table.md``. A
failing run is recorded with the tail of its output and the others still run. ``--deadline-s``
starts no new run after that many seconds (device calls are limited to 600 s).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grpo_step as gs  # noqa: E402  (the model, tokenizer and prompts of the single-GPU benchmark)

STEPS = 6  # per run; the first WARMUP are left out of the medians
WARMUP = 2
RESULTS = gs.RESULTS  # RESULT lines as grpo_step.py prints them
result = gs.result
START = time.monotonic()
DEADLINE_S = 540.0


def recipe(model_dir: Path, data: Path, work: Path, *, mode: str, gpus: int, steps: int) -> dict:
    """The benchmark recipe of ``grpo_step.py``: colocated sync, or disaggregated async with half the
    ranks rolling out."""
    raw = gs.bench_recipe(model_dir, data, work, steps)
    raw["trainer"].update(mode=mode, sync_weights_interval=1)
    raw["tasks"][0]["produce_strategy"] = {"name": "sync"}
    if mode == "disaggregated":
        half = gpus // 2
        raw["resources"].update(train_resources={"num_workers": gpus - half}, rollout_resources={"num_workers": half})
        raw["replay_buffer"] = {"name": "async"}
        raw["tasks"][0]["produce_strategy"] = {"name": "async", "over_sample_threshold": 0.0, "max_staleness": 1,
                                               "enable_partial_rollout": True, "tail_batch_trigger_size": 0}
    return raw


def launch(raw: dict, work: Path, nproc: int, label: str, node: tuple[int, int, int] | None = None,
           devices: str | None = None) -> subprocess.Popen:
    """Start ``rlcli train`` for ``raw`` (``node``: ``(nnodes, node_rank, master_port)``)."""
    import yaml

    work.mkdir(parents=True, exist_ok=True)
    path = work.parent / f"{work.name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cmd = [sys.executable, "-c", "from rlcli.cli import main; main()", "train", str(path),
           "--nproc-per-node", str(nproc), "--quiet", "--work-dir", str(work)]
    if node is not None:
        nnodes, rank, port = node
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                "--master-port", str(port)]
    env = dict(os.environ)
    env["RLCLI_PLUGINS"] = ",".join(x for x in (env.get("RLCLI_PLUGINS", ""), "bench_plugin") if x)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(HERE), str(REPO), env.get("PYTHONPATH", "")) if x)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device machines' rule)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    print(f"[{label}] {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(REPO))


def finish(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait for ``procs``; the error (exit codes and the tail of the output), or None."""
    errors = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            errors.append(f"timed out after {timeout:.0f} s; output: {out[-1500:]}")
            continue
        if p.returncode != 0:
            errors.append(f"exit {p.returncode}; output: {out[-1500:]}")
    return "; ".join(errors) or None


def summarize(work: Path, gpus: int) -> dict:
    """Medians (after the warm-up steps) of a run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing/step_s" in r]
    timed = rows[WARMUP:] or rows

    def med(key: str) -> float | None:
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return round(statistics.median(vals), 4) if vals else None

    def peak(key: str) -> float | None:
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return round(max(vals), 3) if vals else None

    step = med("timing/step_s")
    gen = med("rollout/tokens")
    out = {"steps": len(rows), "step_s": step, "step_s_all": [round(r["timing/step_s"], 3) for r in rows],
           "rollout_s": med("timing/rollout_s"), "train_s": med("timing/train_s"), "sync_s": med("timing/sync_s"),
           "generated_tok_s_per_gpu": round(gen / step / gpus) if gen and step else None,
           "rollout_peak_gib": peak("memory/rollout_peak_gib"), "train_peak_gib": peak("memory/train_peak_gib"),
           "trainer_idle_s": med("timing/wait_for_batch_s"),
           "staleness_mean": med("rollout/staleness_mean"), "staleness_max": peak("rollout/staleness_max")}
    sync_s, sync_b = med("sync/weights_s"), med("sync/bytes")
    if sync_s is not None and sync_b:
        out["sync_s_per_gb"] = round(sync_s / (sync_b / 1e9), 4)
    return out


def time_left() -> float:
    return DEADLINE_S - (time.monotonic() - START)


def run_one(label: str, raw_fn, root: Path, nproc: int, gpus_counted: int, steps: int) -> dict | None:
    if time_left() < 60:
        result(what="run", label=label, error="not run: time budget of the device call")
        return None
    work = root / label
    raw = raw_fn(work)
    t = time.perf_counter()
    error = finish([launch(raw, work, nproc, label)], time_left())
    wall = round(time.perf_counter() - t, 1)
    if error is not None:
        result(what="run", label=label, error=error, wall_s=wall)
        return None
    return result(what="run", label=label, gpus=gpus_counted, wall_s=wall, **summarize(work, gpus_counted))


def section_scale(root: Path, gpus: int, shapes: list[str], steps: int) -> None:
    for shape in shapes:
        model_dir, data = prepare(root, shape, steps)
        base = None
        for n in sorted({1, gpus}):
            r = run_one(f"scale-{shape}-{n}gpu",
                        lambda w, n=n: recipe(model_dir, data, w, mode="colocate", gpus=n, steps=steps),
                        root, n, n, steps)
            if r is None:
                continue
            if n == 1:
                base = r
            elif base is not None and r["step_s"]:
                result(what="scaling", shape=shape, gpus=n, step_s_1gpu=base["step_s"], step_s=r["step_s"],
                       efficiency=round(base["step_s"] / (n * r["step_s"]), 3))


def section_async(root: Path, gpus: int, steps: int) -> None:
    model_dir, data = prepare(root, SHAPE_FOR_RUNS, steps)
    runs = {}
    for mode in ("colocate", "disaggregated"):
        runs[mode] = run_one(f"async-{mode}-{gpus}gpu",
                             lambda w, mode=mode: recipe(model_dir, data, w, mode=mode, gpus=gpus, steps=steps),
                             root, gpus, gpus, steps)
    col, dis = runs["colocate"], runs["disaggregated"]
    if col and dis and col["step_s"] and dis["step_s"]:
        result(what="async_speedup", gpus=gpus, colocated_sync_step_s=col["step_s"],
               disaggregated_async_step_s=dis["step_s"], speedup=round(col["step_s"] / dis["step_s"], 3),
               staleness_mean=dis["staleness_mean"], staleness_max=dis["staleness_max"],
               trainer_idle_s=dis["trainer_idle_s"], sync_s_per_gb=dis.get("sync_s_per_gb"))


def section_nodes(root: Path, gpus: int, steps: int) -> None:
    if gpus < 2 or gpus % 2:
        result(what="run", label="nodes", error=f"not run: needs an even --gpus >= 2, got {gpus}")
        return
    if time_left() < 60:
        result(what="run", label="nodes", error="not run: time budget of the device call")
        return
    model_dir, data = prepare(root, SHAPE_FOR_RUNS, steps)
    half = gpus // 2
    work = root / f"nodes-2x{half}gpu"
    raw = recipe(model_dir, data, work, mode="colocate", gpus=gpus, steps=steps)
    port = free_port()
    cuda = gs.DEVICE == "cuda"
    procs = []
    for node in range(2):
        devices = ",".join(str(node * half + i) for i in range(half)) if cuda else None
        # node 1 writes its (empty) work dir beside node 0's: one work dir per node, as on two machines
        procs.append(launch(raw, work if node == 0 else root / f"nodes-2x{half}gpu-node1", half,
                            f"nodes-node{node}", node=(2, node, port), devices=devices))
    t = time.perf_counter()
    error = finish(procs, time_left())
    wall = round(time.perf_counter() - t, 1)
    if error is not None:
        result(what="run", label=work.name, error=error, wall_s=wall)
        return
    result(what="run", label=work.name, gpus=gpus, wall_s=wall, **summarize(work, gpus))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHAPE_FOR_RUNS = "0.5b"
_PREPARED: dict[str, tuple[Path, Path]] = {}


def prepare(root: Path, shape: str, steps: int) -> tuple[Path, Path]:
    """The model dir and prompts of ``shape`` (built once per process)."""
    if shape not in _PREPARED:
        gs.SHAPE.clear()
        gs.SHAPE.update(gs.SHAPES[shape])
        d = root / f"model-{shape}"
        d.mkdir(parents=True, exist_ok=True)
        model_dir = gs.make_model_dir(d) if not (d / "config.json").exists() else d
        data = gs.write_prompts(root / f"prompts-{shape}.jsonl", gs.PROMPTS * (steps + 2))
        _PREPARED[shape] = (model_dir, data)
    return _PREPARED[shape]


def markdown(env: dict) -> str:
    lines = [f"<!-- benchmarks/multi_gpu.py: {env['date']}, {env['device']} x{env['gpus']}, torch {env['torch']}, "
             f"rlcli {env['commit']} -->",
             "| run | GPUs | step s (median) | rollout s | train s | gen tok/s per GPU | peak GiB rollout / train "
             "| staleness mean / max | trainer idle s | sync s/GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in RESULTS:
        if r["what"] != "run":
            continue
        if "error" in r:
            lines.append(f"| {r['label']} | - | {r['error'][:160].replace('|', '/')} | | | | | | | |")
            continue
        lines.append(f"| {r['label']} | {r['gpus']} | {r['step_s']} | {r['rollout_s']} | {r['train_s']} | "
                     f"{r['generated_tok_s_per_gpu']} | {r['rollout_peak_gib']} / {r['train_peak_gib']} | "
                     f"{r['staleness_mean']} / {r['staleness_max']} | {r['trainer_idle_s']} | {r.get('sync_s_per_gb')} |")
    for r in RESULTS:
        if r["what"] == "scaling":
            lines.append(f"\nScaling, {r['shape']}: {r['step_s_1gpu']} s on 1 GPU, {r['step_s']} s on {r['gpus']}: "
                         f"efficiency {r['efficiency']:.2f}")
        elif r["what"] == "async_speedup":
            lines.append(f"\nDisaggregated async vs colocated sync on {r['gpus']} GPUs: {r['speedup']:.2f}x "
                         f"({r['colocated_sync_step_s']} s -> {r['disaggregated_async_step_s']} s per step)")
    return "\n".join(lines) + "\n"


def main() -> None:
    global DEADLINE_S, STEPS, WARMUP, SHAPE_FOR_RUNS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, required=True, help="GPUs of this host to use (or CPU ranks with --tiny)")
    ap.add_argument("--runs", default="scale,async,nodes", help="comma-separated: scale, async, nodes")
    ap.add_argument("--shapes", default="0.5b", help="model shapes for 'scale': 0.5b, 1.5b")
    ap.add_argument("--steps", type=int, default=STEPS, help="train steps per run")
    ap.add_argument("--out", type=Path, help="write results.json and table.md here")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (gloo ranks): checks the script")
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="start no new run after this many seconds")
    args = ap.parse_args()
    DEADLINE_S, STEPS = args.deadline_s, args.steps
    WARMUP = min(WARMUP, max(0, args.steps - 1))
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - {"scale", "async", "nodes"})
    if unknown:
        ap.error(f"--runs: unknown {unknown}; known: scale, async, nodes")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    import torch

    if args.tiny:
        shapes, SHAPE_FOR_RUNS = ["tiny"], "tiny"
        gs.DEVICE, gs.PROMPTS, gs.K, gs.NEW, gs.PROMPT_LEN = "cpu", 4, 4, 8, 8
    else:
        if set(shapes) - {"0.5b", "1.5b"}:
            ap.error(f"--shapes: unknown {sorted(set(shapes) - {'0.5b', '1.5b'})}; known: 0.5b, 1.5b")
        if torch.cuda.device_count() < args.gpus:
            ap.error(f"--gpus {args.gpus}: this host has {torch.cuda.device_count()} CUDA device(s); "
                     "use --tiny on a CPU machine")
    gs.DTYPE = torch.bfloat16 if gs.DEVICE == "cuda" else torch.float32
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "?"
    env = {"date": time.strftime("%Y-%m-%d"), "gpus": args.gpus, "torch": torch.__version__, "commit": commit,
           "device": torch.cuda.get_device_name(0) if gs.DEVICE == "cuda" else "CPU (smoke test)"}
    result(what="env", **env, runs=runs, shapes=shapes, steps=args.steps)
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="multi-gpu-"))
    sections = {"scale": lambda: section_scale(root, args.gpus, shapes, args.steps),
                "async": lambda: section_async(root, args.gpus, args.steps),
                "nodes": lambda: section_nodes(root, args.gpus, args.steps)}
    for name in runs:
        sections[name]()
    table = markdown(env)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"env": env, "results": RESULTS}, indent=2))
        (args.out / "table.md").write_text(table)


if __name__ == "__main__":
    main()
