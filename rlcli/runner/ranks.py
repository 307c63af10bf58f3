"""Helpers for runs on several ranks: gather Python objects to rank 0 and merge per-rank metrics.

Each rank rolls out its own share of the batch, so rollout metrics are merged on rank 0:
counters (tokens, samples, groups, judge calls, errors, ...) and the ``throughput/*`` rates are
summed, ``*max`` keys take the maximum, ``*min`` keys the minimum, and everything else (means,
ratios, timings) is averaged over ranks weighted by each rank's number of trained samples.
Training metrics (``train/*``) are already reduced across ranks by the trainer and are taken from
rank 0.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rlcli.dist import rank, world_size

_SUM_PREFIXES = ("judger/", "data/", "throughput/")  # throughput: per-rank rates add up to the job's
_SUM_WORDS = ("tokens", "samples", "groups", "calls", "errors", "timeouts", "aborted", "failed", "filtered",
              "expired", "resumed", "dropped", "skipped", "bytes")


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order); None on the other ranks."""
    if world_size() == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def merge_rule(key: str) -> str:
    """How a metric key is merged across ranks: "first", "sum", "max", "min" or "mean"."""
    if key.startswith("train/") or key.startswith("eval/") or key == "time":
        return "first"
    last = key.rsplit("/", 1)[-1]
    if last.endswith("max") or last == "max":
        return "max"
    if last.endswith("min") or last == "min":
        return "min"
    if key.startswith(_SUM_PREFIXES) or any(w in last for w in _SUM_WORDS):
        return "sum"
    return "mean"


def merge_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    if len(per_rank) == 1:
        return dict(per_rank[0])
    weights = [max(m.get("rollout/samples", 1.0), 1e-9) for m in per_rank]
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        vals = [(m[key], w) for m, w in zip(per_rank, weights) if key in m and isinstance(m[key], (int, float))]
        if not vals:
            continue
        rule = merge_rule(key)
        if rule == "first":
            out[key] = per_rank[0].get(key, vals[0][0])
        elif rule == "sum":
            out[key] = float(sum(v for v, _ in vals))
        elif rule == "max":
            out[key] = float(max(v for v, _ in vals))
        elif rule == "min":
            out[key] = float(min(v for v, _ in vals))
        else:
            out[key] = float(sum(v * w for v, w in vals) / sum(w for _, w in vals))
    return out
