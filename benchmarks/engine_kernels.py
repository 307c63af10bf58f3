"""Where an inference engine's decode time goes on the GPU, engine beside engine.

``benchmarks/backends.py --kernel-profile`` runs one round of its throughput workload (64 prompts
x 8 copies, 256 forced tokens each) under the GPU profiler after the timed rounds, once through the
engine's own offline path ("bare") and once through rlcli ("plain"), and records this module's
summary of each trace. This file also merges the summaries of several device calls (each engine
needs its own wheel set, so each runs in a call of its own) into one table:

    python benchmarks/engine_kernels.py results/a/results-sglang.json results/b/results-vllm.json
    python benchmarks/engine_kernels.py --trace TRACE.json.gz --tokens 131072 --rows 512   # one trace

Every figure is milliseconds per decode step of the workload's 512 rows (the trace's total scaled
by rows / generated tokens, so a round's prefill is spread over its steps): the round's wall time,
the GPU's span (first kernel start to last kernel end), the time some kernel, copy or memset ran
(busy, counting overlapping streams once), the rest (idle), and GPU time by kernel class (summed
per kernel, so overlapping streams can add up to more than busy), with the costliest kernels by
name. What it says: an engine whose busy time per step is above the embedded engine's spends it in
its kernels (the classes say which); one with much idle time per step waits on its own host code.

How a trace is taken: the embedded engine, vLLM and LMDeploy run in rlcli's process (the plugins'
"uni" executors), so ``torch.profiler`` with CUDA activity alone records their kernels from any
thread. SGLang's kernels run in its scheduler process: there its own profiler is started and
stopped (``TokenizerManager.start_profile`` with GPU activity, no stacks or shapes), and it writes
the trace file this module reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace_gaps import GPU_CATS, busy_span_gaps, load_events  # noqa: E402

# (class, name fragments), first match wins: lower-case substrings of a kernel's name. The order
# matters where names share words (vLLM's reshape_and_cache_flash writes the KV cache; a compiled
# kernel fusing a norm is "compiled", not "norm").
KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("copy and memset", ("memcpy", "memset")),
    ("matmul", ("gemm", "cutlass", "cublas", "xmma", "nvjet", "sm90_", "sm80_", "sm100_", "splitkreduce", "wgmma")),
    ("kv-cache write", ("reshape_and_cache", "store_cache", "store_kv", "fill_kv", "set_kv", "kv_buffer",
                        "copy_cache")),
    ("attention", ("attn", "attention", "flash", "fmha", "sdpa", "batchdecode", "batchprefill", "paged",
                   "split_kernel", "merge_state")),
    ("torch.compile fused", ("triton_poi", "triton_red", "triton_per", "triton_tem")),
    ("sampling and logprobs", ("softmax", "topk", "top_k", "top_p", "sampl", "argmax", "logsumexp", "multinomial",
                               "exponential", "radixsort", "radix_sort", "cumsum", "gumbel", "logit", "sort")),
    ("norm", ("rmsnorm", "rms_norm", "layernorm", "layer_norm")),
    ("rotary", ("rotary", "rope")),
    ("activation", ("silu", "act_and_mul", "gelu", "swiglu")),
    ("eager elementwise and reductions", ("elementwise", "reduce_kernel", "index", "catarray", "fill")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, fragments in KERNEL_CLASSES:
        if any(f in low for f in fragments):
            return cls
    return "other"


def load_gpu_events(path: Path) -> list[dict]:
    """The GPU activities (kernels, copies, memsets) of a Chrome trace, ``.json`` or ``.json.gz``."""
    return [e for e in load_events(path) if e.get("cat") in GPU_CATS]


def summarise(events: list[dict], tokens: int, rows: int, wall_s: float | None = None, top: int = 12) -> dict:
    """Per decode step of ``rows`` rows (totals scaled by ``rows / tokens``): wall (when given), GPU
    span, busy and idle in ms, kernel count, GPU ms by class and of the ``top`` costliest kernels."""
    if not events:
        raise ValueError("no GPU activity in the trace (was it taken on a GPU?)")
    if tokens <= 0 or rows <= 0:
        raise ValueError(f"tokens ({tokens}) and rows ({rows}) must be positive")
    gpu = sorted(events, key=lambda e: e["ts"])
    busy, span, _ = busy_span_gaps(gpu)
    by_class: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        name = str(e.get("name", ""))
        by_class[kernel_class(name)] += e["dur"]
        by_name[name][0] += e["dur"]
        by_name[name][1] += 1
    scale = rows / tokens / 1e3  # microseconds in the round -> ms per step

    def per_step(us: float) -> float:
        return round(us * scale, 4)

    out = {"tokens": tokens, "rows": rows, "steps": round(tokens / rows, 1),
           "span_ms": per_step(span), "busy_ms": per_step(busy), "idle_ms": per_step(span - busy),
           "kernels": round(len(gpu) * rows / tokens, 1),
           "classes_ms": {k: per_step(v) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
           "top_kernels": [{"name": n[:120], "ms": per_step(d), "count": round(c * rows / tokens, 2),
                            "class": kernel_class(n)}
                           for n, (d, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]}
    if wall_s is not None:
        out["wall_ms"] = round(wall_s * 1e3 * rows / tokens, 4)
    return out


def profiled_round(engine: str, backend: Any, run: Callable[[], float], where: Path, name: str) -> tuple[Path, float]:
    """Runs ``run`` (one round; returns generated tok/s) under the engine's GPU profiler and returns
    the trace file and the round's rate."""
    where.mkdir(parents=True, exist_ok=True)
    if engine == "sglang":
        return _sglang_round(backend, run, where, name)
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        rate = run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path = where / f"{name}.trace.json.gz"
    prof.export_chrome_trace(str(path))
    return path, rate


def _sglang_round(backend: Any, run: Callable[[], float], where: Path, name: str) -> tuple[Path, float]:
    """SGLang's scheduler profiles itself: start and stop its profiler around the round (its
    ``ProfileReq``, GPU activity only) and find the trace it wrote."""
    from sglang.srt.managers.io_struct import ProfileReq

    req = ProfileReq(output_dir=str(where), activities=["GPU"], with_stack=False, record_shapes=False,
                     profile_id=name)
    backend._loop.call(backend._tm.start_profile(req))
    try:
        rate = run()
    finally:
        backend._loop.call(backend._tm.stop_profile())
    found = sorted(where.glob(f"{name}*.trace.json*"))
    if not found:
        raise FileNotFoundError(f"SGLang wrote no trace named {name}* in {where}")
    return found[0], rate


def markdown(columns: dict[str, dict]) -> str:
    """One table, a column per summary (engine and path), a row per figure and kernel class."""
    if not columns:
        return ""
    names = list(columns)
    classes: dict[str, float] = defaultdict(float)
    for s in columns.values():
        for k, v in s["classes_ms"].items():
            classes[k] += v
    rows = {s.get("rows") for s in columns.values()}
    head = [f"ms per {rows.pop()}-row decode step" if len(rows) == 1 else "ms per decode step", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]

    def row(label: str, values: list[Any]) -> None:
        lines.append(f"| {label} | " + " | ".join("-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
                                                 for v in values) + " |")

    row("round wall time (profiled)", [s.get("wall_ms") for s in columns.values()])
    for key, label in (("span_ms", "GPU span"), ("busy_ms", "GPU busy"), ("idle_ms", "GPU idle")):
        row(label, [s[key] for s in columns.values()])
    row("kernels a step", [s["kernels"] for s in columns.values()])
    for cls in sorted(classes, key=lambda c: -classes[c]):
        row(f"GPU time: {cls}", [s["classes_ms"].get(cls) for s in columns.values()])
    return "\n".join(lines) + "\n"


def top_kernels_markdown(columns: dict[str, dict]) -> str:
    """Each column's costliest kernels by name, ms and launches per decode step."""
    out = []
    for col, s in columns.items():
        out += [f"{col}: " + "; ".join(f"`{k['name'][:60]}` {k['ms']:.3f} ms x{k['count']:g} ({k['class']})"
                                      for k in s["top_kernels"])]
    return "\n\n".join(out) + "\n"


def columns_from_results(paths: list[Path]) -> dict[str, dict]:
    """The ``kernel_profile`` records of ``backends.py`` results files, by "engine path" (a later
    file's column replaces an earlier one of the same name)."""
    cols: dict[str, dict] = {}
    for p in paths:
        data = json.loads(p.read_text())
        version = data.get("env", {}).get("engine_version", "")
        for r in data.get("results", []):
            if r.get("what") == "kernel_profile" and "summary" in r:
                cols[f"{version or r['engine']} {r['path']}"] = r["summary"]
    return cols


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="*", type=Path, help="results-<engine>.json files of backends.py --kernel-profile")
    ap.add_argument("--trace", type=Path, help="summarise this Chrome trace instead")
    ap.add_argument("--tokens", type=int, default=131072, help="with --trace: tokens the traced round generated")
    ap.add_argument("--rows", type=int, default=512, help="with --trace: rows decoded together")
    ap.add_argument("--md", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    try:
        if args.trace is not None:
            cols = {args.trace.name: summarise(load_gpu_events(args.trace), args.tokens, args.rows)}
        else:
            cols = columns_from_results(args.results)
    except (OSError, ValueError, KeyError) as exc:
        print(f"engine_kernels: {exc}", file=sys.stderr)
        return 2
    if not cols:
        print("engine_kernels: no kernel_profile records (run backends.py with --kernel-profile)", file=sys.stderr)
        return 2
    text = markdown(cols) + "\n" + top_kernels_markdown(cols)
    print(text)
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
