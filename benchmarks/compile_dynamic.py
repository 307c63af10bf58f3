"""How `torch.compile`'s shape handling changes the speed of rlcli's compiled logits kernels (GPU).

    python benchmarks/compile_dynamic.py [--out results.json]

Each function is compiled three times, from scratch:
- with ``dynamic=True`` (every dimension symbolic, vocabulary included);
- with automatic dynamic shapes (``dynamic=None``: a dimension becomes symbolic only once it has
  been seen to change; warm-up calls at two row counts make the row dimension symbolic, the
  vocabulary stays a constant);
- with ``rlcli.compiling.compile_rows_dynamic``, what rlcli runs (the row dimension marked
  symbolic before the first compilation). The 2026-12-02 figures in docs/benchmarks.md predate
  this third mode.

Timed at the workload's shapes (bf16,
vocabulary 151,936): the training logprob math on a 4,096-token chunk (``_softmax_stats``,
``_dlogits``) and the engine's sampler on 512 rows (``sample_plain_keyed``), median of 20 calls
with CUDA events, against a plain copy of the same logits (the memory-bandwidth yardstick).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlcli.backends.embedded import sample_plain_keyed  # noqa: E402
from rlcli.compiling import compile_rows_dynamic  # noqa: E402
from rlcli.train.logprobs import _dlogits, _softmax_stats  # noqa: E402

V = 151936


def timed(fn, *args, reps: int = 20) -> float:
    """Median microseconds per call."""
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return round(statistics.median(times), 1)


def cases(rows: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, V, (rows,), device="cuda", generator=g)
    lse = torch.logsumexp(logits.float(), dim=-1)
    grad = torch.randn(rows, device="cuda", generator=g)
    keys = torch.randint(0, 2**62, (2, rows), device="cuda", generator=g)
    pos = torch.arange(rows, device="cuda")
    return {
        "softmax_stats": (_softmax_stats, (logits, labels, None, True)),
        "dlogits": (_dlogits, (logits, lse, labels, grad, None)),
        "sampler": (sample_plain_keyed, (logits, None, keys[0], keys[1], pos)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shapes = {"softmax_stats": (4096, 1000), "dlogits": (4096, 1000), "sampler": (512, 300)}
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "results": {}}
    for name, (rows, other) in shapes.items():
        big, small = cases(rows)[name], cases(other)[name]
        copy_us = timed(torch.clone, big[1][0])
        row = {"rows": rows, "clone_logits_us": copy_us}
        modes = (("dynamic_true", lambda f: torch.compile(f, dynamic=True)),
                 ("automatic", lambda f: torch.compile(f, dynamic=None)),
                 ("rlcli", compile_rows_dynamic))  # what rlcli runs: rows marked symbolic up front
        for mode, compile_fn in modes:
            torch._dynamo.reset()
            counters.clear()
            fn = compile_fn(big[0])
            fn(*big[1])
            fn(*small[1])  # a second row count: automatic dynamic makes that dimension symbolic
            fn(*cases(rows - 7)[name][1])  # a third: no further compilation expected
            row[f"{mode}_us"] = timed(fn, *big[1])
            row[f"{mode}_compilations"] = counters["frames"]["ok"]
        out["results"][name] = row
        print(name, row, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
