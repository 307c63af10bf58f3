"""Where the GPU waits: gaps between kernels in a torch.profiler trace, by rlcli profiler range.

    python benchmarks/trace_gaps.py results/trace-step.json.gz            # the trace `grpo_step.py --profile` writes
    python benchmarks/trace_gaps.py TRACE --window 126 772 --top 20      # kernel classes between two times (ms)
    python benchmarks/trace_gaps.py TRACE --json out.json

Times are milliseconds from the start of the first ``rlcli/*`` range on the host (for a step
trace, the start of ``rlcli/rollout``). Reported:

* the host ranges ``rlcli/*`` with their start and duration (repeated ranges, such as one per
  decoded batch, are summed into one line);
* the GPU's span (first kernel start to last kernel end), the time some kernel, copy or memset
  was running in it, and the rest (idle);
* the largest idle gaps, each with the innermost ``rlcli/*`` host range that was open when it
  began - what the host was doing while the GPU waited;
* idle time summed per innermost range, counting only gaps of at least ``--min-gap-us`` (launch
  spacing below that is inherent);
* with ``--window A B``: GPU time by kernel class (matrix products, attention, Triton kernels by
  name, copies, other) for kernels starting between A and B, with counts and mean durations.

It reads the Chrome-trace JSON that ``torch.profiler`` exports (``.json`` or ``.json.gz``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def kernel_class(name: str) -> str:
    """A coarse class for a GPU activity's name."""
    low = name.lower()
    if name.startswith(("nvjet", "sm90_", "sm80_")) or "gemm" in low or "cutlass" in low:
        return "matmul"
    if "attn" in low or "sdpa" in low or "flash" in low or "fmha" in low:
        return "attention"
    if name.startswith("triton"):
        return "triton " + re.sub(r"_\d+$", "", name)
    if "memcpy" in low:
        return "copy " + name.split("(")[0].strip()
    if "memset" in low:
        return "memset"
    return "other " + name[:80]


def busy_span_gaps(gpu: list[dict]) -> tuple[float, float, list[tuple[float, float]]]:
    """Of GPU activities sorted by start: the time some activity ran (overlapping streams counted
    once), the span from the first start to the last end, and the idle gaps as (start, length), in
    the trace's microseconds."""
    busy, end, gaps = 0.0, None, []
    for e in gpu:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is None:
            busy += e["dur"]
            end = stop
        elif start >= end:
            gaps.append((end, start - end))
            busy += e["dur"]
            end = stop
        elif stop > end:  # overlaps the running activity (another stream)
            busy += stop - end
            end = stop
    return busy, end - gpu[0]["ts"], gaps


def analyse(events: list[dict], min_gap_us: float = 20.0, top: int = 15,
            window: tuple[float, float] | None = None) -> dict:
    ranges = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("rlcli")]
    if not ranges:
        raise ValueError("no rlcli/* profiler ranges in the trace (was it written by an rlcli run?)")
    t0 = min(e["ts"] for e in ranges)
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError("no GPU activity in the trace")

    def ms(ts: float) -> float:
        return round((ts - t0) / 1e3, 3)

    def innermost(ts: float) -> str:
        open_ = [r for r in ranges if r["ts"] <= ts <= r["ts"] + r["dur"]]
        return min(open_, key=lambda r: r["dur"])["name"] if open_ else "-"

    busy, span, gaps = busy_span_gaps(gpu)

    per_range: dict[str, list[float]] = {}
    for r in sorted(ranges, key=lambda r: r["ts"]):
        row = per_range.setdefault(r["name"], [ms(r["ts"]), 0.0, 0])
        row[1] += r["dur"] / 1e3
        row[2] += 1
    idle_by_range: dict[str, float] = defaultdict(float)
    for start, length in gaps:
        if length >= min_gap_us:
            idle_by_range[innermost(start)] += length / 1e3
    out = {
        "ranges": [{"name": n, "first_start_ms": s, "total_ms": round(d, 3), "count": c}
                   for n, (s, d, c) in per_range.items()],
        "gpu_first_ms": ms(gpu[0]["ts"]),
        "gpu_span_ms": round(span / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "gpu_idle_ms": round((span - busy) / 1e3, 3),
        "largest_gaps": [{"at_ms": ms(s), "gap_ms": round(g / 1e3, 3), "host_range": innermost(s)}
                         for s, g in sorted(gaps, key=lambda x: -x[1])[:top]],
        "idle_by_range_ms": {k: round(v, 3) for k, v in sorted(idle_by_range.items(), key=lambda kv: -kv[1])},
        "min_gap_us": min_gap_us,
    }
    if window is not None:
        lo, hi = window
        classes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in gpu:
            if lo <= (e["ts"] - t0) / 1e3 <= hi:
                c = classes[kernel_class(e.get("name", ""))]
                c[0] += e["dur"]
                c[1] += 1
        out["window_ms"] = [lo, hi]
        out["window_classes"] = [{"class": k, "total_ms": round(d / 1e3, 3), "count": n, "mean_us": round(d / n, 2)}
                                 for k, (d, n) in sorted(classes.items(), key=lambda kv: -kv[1][0])[:top]]
    return out


def report(r: dict) -> str:
    lines = ["host ranges (ms from the first rlcli range):"]
    for x in r["ranges"]:
        times = f" x{x['count']}" if x["count"] > 1 else ""
        lines.append(f"  {x['name']:<28} start {x['first_start_ms']:9.1f}  total {x['total_ms']:8.1f}{times}")
    lines.append(f"GPU from {r['gpu_first_ms']:.1f} ms: span {r['gpu_span_ms']:.1f} ms, busy {r['gpu_busy_ms']:.1f}, "
                 f"idle {r['gpu_idle_ms']:.1f}")
    lines.append("largest idle gaps:")
    for g in sorted(r["largest_gaps"], key=lambda g: g["at_ms"]):
        lines.append(f"  at {g['at_ms']:9.1f} ms  {g['gap_ms']:8.2f} ms  host in {g['host_range']}")
    lines.append(f"idle by host range (gaps of {r['min_gap_us']:g} us or more):")
    for k, v in r["idle_by_range_ms"].items():
        lines.append(f"  {k:<28} {v:8.1f} ms")
    if "window_classes" in r:
        lo, hi = r["window_ms"]
        lines.append(f"GPU time by kernel class, kernels starting {lo:g}-{hi:g} ms:")
        for c in r["window_classes"]:
            lines.append(f"  {c['total_ms']:8.1f} ms {c['count']:7d} x {c['mean_us']:8.2f} us  {c['class']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a torch.profiler Chrome trace (.json or .json.gz)")
    ap.add_argument("--window", nargs=2, type=float, metavar=("FROM_MS", "TO_MS"),
                    help="also break down GPU time by kernel class in this window")
    ap.add_argument("--top", type=int, default=15, help="gaps and kernel classes listed")
    ap.add_argument("--min-gap-us", type=float, default=20.0, help="shortest gap counted in the per-range idle sums")
    ap.add_argument("--json", type=Path, help="also write the analysis as JSON")
    args = ap.parse_args(argv)
    try:
        r = analyse(load_events(args.trace), args.min_gap_us, args.top, tuple(args.window) if args.window else None)
    except (OSError, ValueError, KeyError) as e:
        print(f"{args.trace}: {e}", file=sys.stderr)
        return 2
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
