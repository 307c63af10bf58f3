"""The metrics of one train step, accumulated per micro-batch on the device."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class StepMetrics:
    """Token-weighted means and extremes, kept on the device (no host sync per micro-batch);
    reduced over ranks and read back once per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}
        self.mins: dict[str, torch.Tensor] = {}

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def add_sum(self, name: str, total: torch.Tensor, weight: torch.Tensor | float) -> None:
        """Add ``total`` (a sum over ``weight`` tokens) to the mean metric ``name``."""
        self.sums[name] = self.sums.get(name, self._zero()) + total.detach().double()
        self.weights[name] = self.weights.get(name, self._zero()) + weight

    def add_extreme(self, name: str, value: torch.Tensor) -> None:
        """Fold ``value`` into the running maximum (``*_max``) or minimum (``*_min``) ``name``."""
        v = value.detach().double()
        if name.endswith("_max"):
            self.maxes[name] = torch.maximum(self.maxes[name], v) if name in self.maxes else v
        elif name.endswith("_min"):
            self.mins[name] = torch.minimum(self.mins[name], v) if name in self.mins else v
        else:
            raise ValueError(f"extreme metric names end with _max or _min, got {name!r}")

    def add_loss_metrics(self, metrics: dict[str, torch.Tensor], weight: int | torch.Tensor) -> None:
        """A loss's metrics: extremes by name, everything else a mean over ``weight`` tokens."""
        for k, v in metrics.items():
            if k.endswith(("_max", "_min")):
                self.add_extreme(k, v)
            else:
                self.add_sum(k, v.detach().double() * weight, weight)

    def reduce(self, world_size: int, group: dist.ProcessGroup | None = None,
               absent_when_empty: str | None = None) -> dict[str, float]:
        """Means, maxima and minima over every rank. ``absent_when_empty``: a name prefix whose
        metrics are left out when none of its means counted a token on any rank (e.g. ``mismatch/``
        when no sequence carries the engine's logprobs), rather than logged as 0."""
        names_mean, names_max, names_min = sorted(self.sums), sorted(self.maxes), sorted(self.mins)
        z = self._zero()
        sums = torch.stack([self.sums[k] for k in names_mean] + [self.weights[k] for k in names_mean] + [z])
        ext = torch.stack([self.maxes[k] for k in names_max] + [-self.mins[k] for k in names_min] + [z])
        if world_size > 1:
            # Every rank added the same names (same loss, same code path), so the layouts agree.
            dist.all_reduce(sums, group=group)
            dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
        s, e = sums.tolist(), ext.tolist()
        n = len(names_mean)
        out = {k: (s[i] / s[n + i] if s[n + i] > 0 else 0.0) for i, k in enumerate(names_mean)}
        out.update({k: e[i] for i, k in enumerate(names_max)})
        out.update({k: -e[len(names_max) + i] for i, k in enumerate(names_min)})
        if absent_when_empty and not any(s[n + i] > 0 for i, k in enumerate(names_mean)
                                         if k.startswith(absent_when_empty)):
            out = {k: v for k, v in out.items() if not k.startswith(absent_when_empty)}
        return {k: (v if math.isfinite(v) else 0.0) if k in self.maxes or k in self.mins else v
                for k, v in out.items()}

