"""Decode attention of the embedded engine: today's SDPA formulation against the Triton kernel.

    python benchmarks/decode_attention.py                          # CUDA: the two shapes below
    python benchmarks/decode_attention.py --out results/decode_attention.json
    python benchmarks/decode_attention.py --sweep                  # + block_n / warps / stages / splits variants
    python benchmarks/decode_attention.py --tiny                   # CPU, Triton interpreter: checks the script

Shapes (Qwen2.5-0.5B attention: 14 query heads, 2 KV heads, head dim 64, bf16; the cache is a
``[rows, 2, max_len, 64]`` slot tensor as in ``KVCache``):

* ``rollout``: 512 rows, positions uniform in 64..320, ``key_len`` 384 (a 512 x 256-token
  rollout: 64-token prompts, bucketed key length);
* ``long``: 8 rows, positions uniform in 3072..4095, ``key_len`` 4096 (few rows, long context:
  the split-K path).

Paths:

* ``sdpa``: the engine's ``attention: sdpa`` path, ``rlcli.backends.embedded.attention.sdpa_decode_attention``
  (SDPA over ``q.view(n, KVH, group, hd)`` and the cache's first ``L`` positions with a boolean
  ``[n, 1, 1, L]`` :func:`decode_mask`) with the kernels the engine allows eagerly (flash,
  efficient, math); the mask is built once per step and shared by the layers, so it is built
  outside the timed region;
* ``sdpa_cudnn``: the same with cuDNN attention tried first (what the engine's CUDA graphs ran,
  by the fourth session's profile);
* ``triton``: ``rlcli.backends.decode_attention.decode_attention``;
* ``triton_prefix`` (cases with a ``group``): the same, with the rows of each group of ``group``
  (the samples of one prompt) reading the first ``lo`` positions (the prompt) from the group's
  first row (``prefix_rows`` / ``prefix_lens``, as the engine does). In those cases every row of
  a group holds the same keys and values there, so all paths compute the same attention.

Each path is timed two ways with CUDA events, median of ``--iters`` (default 50) samples after
warm-up: ``graph`` - one sample is the replay of a CUDA graph holding ``--calls`` calls (default 10),
divided by the calls: GPU time, as the engine sees it under graph replay; ``eager`` - one call per
sample, which includes any CPU launch overhead the GPU waits for. Reported: microseconds per call
and the achieved bandwidth over the K/V bytes actually needed (per row ``min(pos + 1, L)`` keys and
values x KVH x hd x itemsize), and the max abs difference of each path's output to ``sdpa``.
``--tiny`` runs tiny shapes on the CPU in Triton's interpreter (wall-clock timing, meaningless)
just to exercise the script. Output: ``RESULT {json}`` lines, and with ``--out`` one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Triton itself is imported when the kernels are first built (after --tiny sets TRITON_INTERPRET)
from rlcli.backends import decode_attention as da  # noqa: E402
from rlcli.backends.embedded import _attention_backends, decode_mask, sdpa_decode_attention  # noqa: E402

CASES = {
    "rollout": dict(n=512, heads=14, kv_heads=2, head_dim=64, lo=64, hi=320, key_len=384, group=8),
    "long": dict(n=8, heads=14, kv_heads=2, head_dim=64, lo=3072, hi=4095, key_len=4096),
}
TINY_CASES = {
    "rollout": dict(n=4, heads=4, kv_heads=2, head_dim=64, lo=8, hi=40, key_len=48, group=2),
    "long": dict(n=2, heads=4, kv_heads=1, head_dim=64, lo=300, hi=511, key_len=512),
}


def _sdpa_context(device: torch.device, cudnn_first: bool):
    """The engine's eager choice of SDPA kernels (no cuDNN), or cuDNN first (what its graphs used)."""
    if not cudnn_first or device.type != "cuda":
        return _attention_backends(device, allow_cudnn=False)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def make_case(case: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    n, kvh, hd, key_len = case["n"], case["kv_heads"], case["head_dim"], case["key_len"]
    g = torch.Generator(device=device).manual_seed(seed)
    rows, max_len = n, key_len
    k_cache = torch.randn(rows, kvh, max_len, hd, generator=g, device=device).to(dtype)
    v_cache = torch.randn(rows, kvh, max_len, hd, generator=g, device=device).to(dtype)
    q = torch.randn(n, case["heads"], hd, generator=g, device=device).to(dtype)
    positions = torch.randint(case["lo"], case["hi"] + 1, (n,), generator=g, device=device)
    return q, k_cache, v_cache, positions, decode_mask(positions, torch.arange(key_len, device=device))


def needed_bytes(positions: torch.Tensor, key_len: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    keys = int((positions + 1).clamp(max=key_len).sum())
    return 2 * keys * kv_heads * head_dim * itemsize


def time_cuda(fn, iters: int, calls: int, graph: bool) -> float:
    """Median microseconds per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        run, per_sample = g.replay, calls
    else:
        run, per_sample = fn, 1
    for _ in range(3):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / per_sample


def time_cpu(fn, iters: int) -> float:
    fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def run_case(name: str, case: dict, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    q, k_cache, v_cache, positions, mask = make_case(case, device, dtype)
    n, kvh, hd, key_len = case["n"], case["kv_heads"], case["head_dim"], case["key_len"]
    prefix = None
    if case.get("group"):  # each group's rows hold one prompt's keys and values (its first row's)
        lead = torch.arange(n, device=device) // case["group"] * case["group"]
        k_cache[:, :, :case["lo"]] = k_cache[lead, :, :case["lo"]]
        v_cache[:, :, :case["lo"]] = v_cache[lead, :, :case["lo"]]
        prefix = dict(prefix_rows=lead, prefix_lens=torch.full((n,), case["lo"], dtype=torch.int32, device=device))
    scale = hd**-0.5
    nbytes = needed_bytes(positions, key_len, kvh, hd, q.element_size())

    def sdpa(cudnn_first: bool):
        def fn():
            with _sdpa_context(device, cudnn_first):
                return sdpa_decode_attention(q, k_cache, v_cache, mask, scale)
        return fn

    def triton(**knobs):
        return lambda: da.decode_attention(q, k_cache, v_cache, positions, key_len, scale, **knobs)

    paths = {"sdpa": sdpa(False), "triton": triton()}
    if prefix is not None:
        paths["triton_prefix"] = triton(**prefix)
    if device.type == "cuda":
        paths["sdpa_cudnn"] = sdpa(True)
    if args.sweep and device.type == "cuda":
        default_splits = da.choose_num_splits(n, kvh, key_len, da._sm_count(device))
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    paths[f"triton_bn{block_n}_w{warps}_s{stages}"] = triton(block_n=block_n, num_warps=warps,
                                                                              num_stages=stages)
        for splits in sorted({1, 2, 4, 8, 16, 32, default_splits}):
            paths[f"triton_splits{splits}"] = triton(num_splits=splits)

    reference = paths["sdpa"]().float()
    rows = []
    for path, fn in paths.items():
        row = dict(case=name, path=path, n=n, heads=case["heads"], kv_heads=kvh, head_dim=hd, key_len=key_len,
                   positions=[case["lo"], case["hi"]], dtype=str(dtype).removeprefix("torch."), kv_bytes=nbytes)
        try:
            row["max_abs_diff"] = (fn().float() - reference).abs().max().item()
            if device.type == "cuda":
                row["us_graph"] = time_cuda(fn, args.iters, args.calls, graph=True)
                row["us_eager"] = time_cuda(fn, args.iters, args.calls, graph=False)
                row["gbps_graph"] = nbytes / row["us_graph"] / 1e3
                row["gbps_eager"] = nbytes / row["us_eager"] / 1e3
            else:
                row["us_wall_cpu"] = time_cpu(fn, args.iters)
        except Exception as e:  # one failing path (say cuDNN on this shape) must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        print("RESULT " + json.dumps(row), flush=True)
    if args.sweep and device.type == "cuda":
        timed = [r for r in rows if r["path"].startswith("triton") and "us_graph" in r]
        best = min(timed, key=lambda r: r["us_graph"])
        print(f"best triton variant for {name}: {best['path']} {best['us_graph']:.1f} us", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write all results to this JSON file")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes on the CPU in Triton's interpreter (checks the script)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--iters", type=int, default=50, help="timed samples per path (median reported)")
    ap.add_argument("--calls", type=int, default=10, help="calls per captured CUDA graph")
    ap.add_argument("--sweep", action="store_true", help="also time block_n / num_warps / num_stages / split variants")
    args = ap.parse_args(argv)

    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are built, on the first call
        device, dtype, cases, args.iters = torch.device("cpu"), torch.bfloat16, TINY_CASES, min(args.iters, 2)
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --tiny)", file=sys.stderr)
            return 2
        device, dtype, cases = torch.device("cuda"), torch.bfloat16, CASES
    if not da.triton_decode_attention_available(device):
        print("Triton is not available for this device", file=sys.stderr)
        return 2

    results = []
    for name in args.cases.split(","):
        results += run_case(name, cases[name], args, device, dtype)

    print(f"\n{'case':<8} {'path':<28} {'us/call':>9} {'GB/s':>8} {'max|diff|':>10}")
    for r in results:
        us = r.get("us_graph", r.get("us_wall_cpu", float("nan")))
        gbps = r.get("gbps_graph", float("nan"))
        print(f"{r['case']:<8} {r['path']:<28} {us:>9.1f} {gbps:>8.0f} {r.get('max_abs_diff', float('nan')):>10.2e}"
              + (f"  {r['error']}" if "error" in r else ""))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                    torch=torch.__version__, tiny=args.tiny, iters=args.iters, calls=args.calls)
        args.out.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    main_paths = {"sdpa", "sdpa_cudnn", "triton"}  # a sweep variant may fail (out of shared memory): not an error
    return 1 if any("error" in r for r in results if r["path"] in main_paths) else 0


if __name__ == "__main__":
    sys.exit(main())
