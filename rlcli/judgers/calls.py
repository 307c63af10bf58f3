"""One judge call: calling a judger, and what a call yields.

A call ends as an :class:`_Outcome` (a raw result, a timeout or an error reason) that
:class:`~rlcli.judgers.pool.JudgePool` applies to the sample; :func:`normalize_reward` checks a
raw result. Every reason is clipped to ``_MAX_ERROR_CHARS`` so one sample's error stays short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import numbers
from typing import Any, Literal

from rlcli.types import Sample

_MAX_ERROR_CHARS = 2000
MAX_ABS_SCORE = 1e6
"""The largest score a judger may return (either sign); beyond it the sample is FAILED."""

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def _describe_exception(exc: BaseException) -> str:
    return _clip(f"judger raised {type(exc).__name__}: {exc}")


def _call_judger(judger: Any, response: str, label: Any, sample: Sample) -> Any:
    """Call ``judger.judge`` in a worker thread or process, running an async judger to completion."""
    result = judger.judge(response, label, sample)
    if inspect.isawaitable(result):
        async def _await() -> Any:
            return await result

        result = asyncio.run(_await())
    return result


def normalize_reward(result: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Turn a judger result into ``(reward, None)`` or ``(None, reason)``.

    A real number becomes ``{"score": float(x)}``; a dict must hold a real, finite ``"score"``
    (it is converted to ``float``, other keys are kept); anything else is rejected, and so is a
    score beyond ``+-MAX_ABS_SCORE``.
    """
    if isinstance(result, numbers.Real):
        score, reward = result, {}
    elif isinstance(result, dict):
        if "score" not in result:
            return None, _clip(f"judger returned a dict without 'score' (keys: {sorted(map(str, result))})")
        score, reward = result["score"], dict(result)
        if not isinstance(score, numbers.Real):
            return None, _clip(f"judger returned a non-numeric score {score!r} ({type(score).__name__})")
    else:
        return None, _clip(f"judger returned {type(result).__name__} {result!r}; expected a number or a dict with 'score'")
    score = float(score)
    if not math.isfinite(score):
        return None, f"judger returned a non-finite score {score}"
    if abs(score) > MAX_ABS_SCORE:
        return None, (f"judger returned the score {score:g}, beyond +-{MAX_ABS_SCORE:g}: a reward that large is a "
                      "bug, and would swamp its group's advantages and the run's reward metrics")
    reward["score"] = score
    return reward, None


def warn_bad_result(judger: str, reason: str) -> None:
    """Log, once per judger and process, that ``judger`` returned a result that is not a usable score."""
    if judger not in _warned:
        _warned.add(judger)
        log.warning("judger %r returned an unusable result, so its sample is FAILED and counted in judger/errors "
                    "(shown once; the rest at debug level): %s", judger, reason)


@dataclasses.dataclass
class _Outcome:
    """What one judge call produced; applied to the sample by :meth:`JudgePool.judge`."""

    kind: Literal["ok", "timeout", "error", "crash", "memory"]
    value: Any = None  # the raw result for "ok", the reason otherwise


class _Abort(Exception):
    """Internal: the call could not run (pool closed, worker failed to boot)."""


def _timed_out(timeout_s: float) -> _Outcome:
    return _Outcome("timeout", f"judger timeout after {timeout_s}s")


def _stuck_after(timeout_s: float) -> float:
    """How long a call runs before its worker no longer counts as free capacity: the calls behind
    it go to other workers, so that hung calls run out their timeouts side by side."""
    return min(0.5, timeout_s / 10)
