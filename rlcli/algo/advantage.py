"""Advantage estimators: one group's rewards in, one advantage per sample out.

Every estimator is a registered component of kind ``advantage_estimator`` with one method,
``compute(rewards, lengths) -> advantages``, over the ``k`` samples of one prompt. The math runs
in float64 and the result is returned as float32. ``compute_groups`` does many groups at once
(the runner calls it once per step); by default it calls ``compute`` per group, and the GRPO,
both Dr. GRPO and the RLOO estimators compute groups of equal size in one batched pass that gives
the same values (a few tensor operations per step instead of a dozen per group). Degenerate
groups never produce NaN: a group of one sample, or a group whose rewards are all equal, carries
no relative signal and gets advantage 0 (except RLOO with ``k = 1``, which by definition returns
the raw reward).

Two Dr. GRPOs: ``dr_grpo`` is the paper's (Liu et al., 2025: ``R - mean R``, no std; pair it with
``loss_agg: seq-mean-token-sum-norm`` for the paper's whole method), ``xtuner_dr_grpo`` is
XTuner's ``DrGRPOEstimator`` (the GRPO z-score, std kept, times ``length / max_length``). For
rewards [1, 0] and lengths [100, 100] the first gives ±0.5, the second ±0.00216.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field

from rlcli import hookimpl
from rlcli.component import Component, ComponentConfig


def _as_rewards(rewards: torch.Tensor | list[float]) -> torch.Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("advantage estimators need at least one reward, got an empty group")
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return r


def _all_equal(r: torch.Tensor) -> bool:
    return bool(r.max() == r.min())


class AdvantageEstimator(Component):
    """Base class: maps a group's rewards to per-sample advantages."""

    def compute(self, rewards: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """``rewards``: ``[k]`` scores of one group; ``lengths``: ``[k]`` response lengths (optional)."""
        raise NotImplementedError

    def compute_groups(self, rewards: list[list[float]], lengths: list[list[int]]) -> list[list[float]]:
        """The advantages of many groups: ``compute`` of each group's rewards and lengths (as
        float32 tensors), as lists."""
        return [self.compute(torch.tensor(r, dtype=torch.float32), torch.tensor(n, dtype=torch.float32)).tolist()
                for r, n in zip(rewards, lengths)]

    def _batched(self, rewards: list[list[float]]) -> torch.Tensor | None:
        """The rewards as one float64 ``[groups, k]`` tensor (rounded through float32, as
        ``compute_groups`` hands them to ``compute``) when every group has the same size of at
        least two and every reward is finite; None otherwise (the per-group path handles it)."""
        if not rewards or len({len(r) for r in rewards}) != 1 or len(rewards[0]) < 2:
            return None
        r = torch.tensor(rewards, dtype=torch.float32).double()
        return r if bool(torch.isfinite(r).all()) else None


def _zero_equal_rows(r: torch.Tensor, adv: torch.Tensor) -> list[list[float]]:
    """``adv`` with the rows of groups whose rewards are all equal set to 0, as lists."""
    adv[r.amax(1) == r.amin(1)] = 0.0
    return adv.tolist()


def _zscores(r: torch.Tensor, unbiased: bool, eps: float) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` of one group (float64; a caller handles degenerate groups)."""
    return (r - r.mean()) / (r.std(unbiased=unbiased) + eps)


def _zscore_rows(r: torch.Tensor, unbiased: bool, eps: float) -> torch.Tensor:
    """:func:`_zscores` of every row of ``[groups, k]``."""
    std = r.std(dim=1, unbiased=unbiased, keepdim=True)
    return (r - r.mean(dim=1, keepdim=True)) / (std + eps)


class GRPOAdvantage(AdvantageEstimator):
    """GRPO: reward minus the group mean, divided by the group std (+ eps)."""

    name: ClassVar[str] = "grpo"

    class Config(ComponentConfig):
        eps: float = Field(1e-6, ge=0, description="Added to the group std before dividing. XTuner's GRPO adds 1e-8, "
                           "so its advantages are larger by (std + 1e-6) / (std + 1e-8): under 1% for a group std "
                           "above 1e-4, about 13-fold when a group's two rewards differ by 1e-7. Set 1e-8 for "
                           "XTuner's values.")
        std: Literal["unbiased", "biased"] = Field(
            "unbiased", description="Group std with n-1 (unbiased, as XTuner) or n (biased) in the denominator."
        )

    def compute(self, rewards: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        r = _as_rewards(rewards)
        if r.numel() == 1 or _all_equal(r):
            return torch.zeros(r.numel(), dtype=torch.float32)
        return _zscores(r, self.config.std == "unbiased", self.config.eps).float()

    def compute_groups(self, rewards: list[list[float]], lengths: list[list[int]]) -> list[list[float]]:
        r = self._batched(rewards)
        if r is None:
            return super().compute_groups(rewards, lengths)
        return _zero_equal_rows(r, _zscore_rows(r, self.config.std == "unbiased", self.config.eps).float())


class DrGRPOAdvantage(AdvantageEstimator):
    """Dr. GRPO as in the paper: reward minus the group mean, no std (XTuner's differs: xtuner_dr_grpo)."""

    name: ClassVar[str] = "dr_grpo"

    class Config(ComponentConfig):
        pass

    def compute(self, rewards: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        r = _as_rewards(rewards)
        if _all_equal(r):
            return torch.zeros(r.numel(), dtype=torch.float32)
        return (r - r.mean()).float()

    def compute_groups(self, rewards: list[list[float]], lengths: list[list[int]]) -> list[list[float]]:
        r = self._batched(rewards)
        if r is None:
            return super().compute_groups(rewards, lengths)
        return _zero_equal_rows(r, (r - r.mean(dim=1, keepdim=True)).float())


class XTunerDrGRPOAdvantage(AdvantageEstimator):
    """XTuner's DrGRPOEstimator: the GRPO z-score times response length / max_length (std kept)."""

    name: ClassVar[str] = "xtuner_dr_grpo"

    class Config(ComponentConfig):
        max_length: float = Field(32768.0, gt=0, description="Each advantage, the GRPO z-score (n-1 std + eps), is "
                                  "multiplied by its response's length in tokens / max_length (XTuner's default "
                                  "32768). Rewards [1, 0] with lengths [100, 100] give +-0.00216, where dr_grpo (the "
                                  "paper's R - mean R) gives +-0.5.")
        eps: float = Field(1e-8, ge=0, description="Added to the group's unbiased std before dividing (XTuner's 1e-8).")

    def _scale(self, lengths: torch.Tensor | list, k: int) -> torch.Tensor:
        n = torch.as_tensor(lengths, dtype=torch.float64)
        if n.shape[-1] != k:
            raise ValueError(f"xtuner_dr_grpo needs one response length per reward, got {n.shape[-1]} for {k}")
        return n / self.config.max_length

    def compute(self, rewards: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """``A_i = (r_i - mean r) / (std r + eps) · len_i / max_length``, std with n - 1 (XTuner's
        formula). A group of one sample gets 0, where XTuner's n - 1 std is NaN; a group whose
        rewards are all equal gets 0, as in XTuner."""
        r = _as_rewards(rewards)
        if lengths is None:
            raise ValueError("xtuner_dr_grpo scales by response length: lengths are required")
        if r.numel() == 1 or _all_equal(r):
            return torch.zeros(r.numel(), dtype=torch.float32)
        return (_zscores(r, True, self.config.eps) * self._scale(lengths, r.numel())).float()

    def compute_groups(self, rewards: list[list[float]], lengths: list[list[int]]) -> list[list[float]]:
        r = self._batched(rewards)
        if r is None:
            return super().compute_groups(rewards, lengths)
        return _zero_equal_rows(r, (_zscore_rows(r, True, self.config.eps) * self._scale(lengths, r.shape[1])).float())


class RLOOAdvantage(AdvantageEstimator):
    """RLOO: reward minus the mean reward of the other samples of the group."""

    name: ClassVar[str] = "rloo"

    class Config(ComponentConfig):
        pass

    def compute(self, rewards: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        r = _as_rewards(rewards)
        k = r.numel()
        if k == 1:
            return r.float()
        if _all_equal(r):
            return torch.zeros(k, dtype=torch.float32)
        return (r - (r.sum() - r) / (k - 1)).float()

    def compute_groups(self, rewards: list[list[float]], lengths: list[list[int]]) -> list[list[float]]:
        r = self._batched(rewards)
        if r is None:
            return super().compute_groups(rewards, lengths)
        k = r.shape[1]
        return _zero_equal_rows(r, (r - (r.sum(dim=1, keepdim=True) - r) / (k - 1)).float())


class PassAtKAdvantage(AdvantageEstimator):
    """Pass@k: advantages that optimise the probability that one of k samples is correct."""

    name: ClassVar[str] = "pass_at_k"

    class Config(ComponentConfig):
        k: int = Field(4, ge=1, description="The k of pass@k; groups smaller than k fall back to pass@1.")
        eps: float = Field(1e-6, ge=0, description="Added to the std of the group's pass@k estimate.")

    def compute(self, rewards: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """XTuner's formula (rewards > 0 count as correct; ``c`` correct of ``n``)::

            rho   = 1 - C(n-c, k)/C(n, k)           (pass@k of the group)
            sigma = sqrt(rho (1 - rho)) + eps
            A(correct)   = (1 - rho) / sigma
            A(incorrect) = (1 - rho - C(n-c-1, k-1)/C(n-1, k-1)) / sigma

        Deviations, all where XTuner divides by zero or returns ``-1/eps``: a group smaller than
        ``k`` uses ``k = 1`` (XTuner's ``rho = c/n``; the formula then equals biased-std GRPO on
        the binarised rewards), and groups with one sample, no correct or only correct samples
        get 0 (the formula's own limit: no sample is better than another).
        """
        r = _as_rewards(rewards)
        n = r.numel()
        correct = r > 0
        c = int(correct.sum())
        if n == 1 or c == 0 or c == n:
            return torch.zeros(n, dtype=torch.float32)
        k = self.config.k if n >= self.config.k else 1
        rho = 1.0 - math.comb(n - c, k) / math.comb(n, k)
        sigma = math.sqrt(rho * (1.0 - rho)) + self.config.eps
        a_pos = (1.0 - rho) / sigma
        a_neg = (1.0 - rho - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)) / sigma
        return torch.where(correct, torch.tensor(a_pos), torch.tensor(a_neg)).float()


@hookimpl
def register_advantage_estimators() -> list[type]:
    return [GRPOAdvantage, DrGRPOAdvantage, XTunerDrGRPOAdvantage, RLOOAdvantage, PassAtKAdvantage]
