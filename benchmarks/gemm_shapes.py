"""The matrix products of the GRPO step, timed as cuBLAS runs them and as Inductor's autotuner would.

    python benchmarks/gemm_shapes.py                   # every shape below, on this machine's GPU
    python benchmarks/gemm_shapes.py --shapes decode   # the engine's decode-step products only

The embedded engine's decode products have 512 rows (one per sequence of the benchmark's batch)
and a short inner dimension (the hidden size, 896, for three of them); in the seventh session's
profile they ran at 170-550 TFLOP/s. This script answers whether another kernel does better,
before any engine code changes: for each shape it times
``F.linear`` (cuBLAS, what runs today) and ``torch.compile(mode="max-autotune-no-cudagraphs")`` of
the same call (Inductor benchmarks its Triton templates against cuBLAS and keeps the fastest), in
bf16: 200 calls captured in one CUDA graph, replayed between two CUDA events (the device time of
the products alone, as in the engine's captured decode step). Prints one ``RESULT {json}`` line
per shape. (Its first run, 2026-12-02, timed back-to-back eager calls instead; those times of the
small decode products were most likely the host's launch rate.)
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import torch.nn.functional as F

# (name, rows, out features, in features) of a Qwen2.5-0.5B-shaped model
DECODE = [
    ("decode qkv (fused)", 512, 1152, 896),
    ("decode o_proj", 512, 896, 896),
    ("decode gate_up (fused)", 512, 9728, 896),
    ("decode down_proj", 512, 896, 4864),
    ("decode lm_head", 512, 151936, 896),
]
TRAIN = [  # forward products of a 16,384-token slice of a training pack
    ("train qkv", 16384, 1152, 896),
    ("train gate_up", 16384, 9728, 896),
    ("train down_proj", 16384, 896, 4864),
    ("train lm_head chunk", 4096, 151936, 896),
]


def time_us(fn, *args, iters: int = 200) -> float:
    """Mean device time of one call: ``iters`` calls captured in one CUDA graph and replayed, so
    that the host's launch rate does not set the pace of the small products."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (and compilation, autotuning) outside the capture
        for _ in range(5):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=["all", "decode", "train"], default="all")
    args = ap.parse_args()
    shapes = {"all": DECODE + TRAIN, "decode": DECODE, "train": TRAIN}[args.shapes]
    dev = torch.device("cuda")
    for name, m, n, k in shapes:
        row = {"shape": name, "m": m, "n": n, "k": k}
        try:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            flops = 2.0 * m * n * k
            cublas = time_us(F.linear, x, w)
            row.update(cublas_us=round(cublas, 2), cublas_tflops=round(flops / cublas / 1e6, 1))
            tuned = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
            auto = time_us(tuned, x, w)
            row.update(autotuned_us=round(auto, 2), autotuned_tflops=round(flops / auto / 1e6, 1),
                       speedup=round(cublas / auto, 3))
            torch._dynamo.reset()
        except Exception:
            row["error"] = traceback.format_exc()[-1500:]
        print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
