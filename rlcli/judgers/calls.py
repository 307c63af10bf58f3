"""One judge call: calling a judger, and what a call yields.

A call ends as an :class:`_Outcome` (a raw result, a timeout or an error reason) that
:class:`~rlcli.judgers.pool.JudgePool` applies to the sample; :func:`normalize_reward` checks a
raw result. Every reason is clipped to ``_MAX_ERROR_CHARS`` so one sample's error stays short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import math
import numbers
from typing import Any, Literal

import numpy as np

from rlcli.types import EXCLUDE_FROM_LOSS, Sample

_MAX_ERROR_CHARS = 2000
MAX_ABS_SCORE = 1e6
"""The largest score a judger may return (either sign); beyond it the sample is FAILED."""
MAX_REWARD_CHARS = 65536
"""The most characters (as JSON) a reward may take: a reward is kept with its sample in rollout
dumps, the replay buffer and async checkpoints, so beyond it the values over ``_CUT_VALUE_CHARS``
are replaced by a note of their size (and, if that is not enough, every key but the score)."""
_CUT_VALUE_CHARS = 1024
_SCALARS = (str, int, float, bool, type(None))
_PLAIN_TYPES = "dict, list, tuple, str, int, float, bool, None"

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


class _NotPlain(ValueError):
    """Internal: a reward value that is not plain data (the message names where it is and what it is)."""


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: Any, where: str) -> Any:
    """``value`` as plain data: numpy scalars become Python values, dict / list / tuple subclasses
    their base type; :class:`_NotPlain` naming ``where`` (its key path, "" for the reward itself)
    for anything else."""
    if isinstance(value, np.generic):
        value = value.item()  # np.float64(1.0) -> 1.0; np.bytes_ / np.datetime64 stay non-plain
    if type(value) in _SCALARS:
        return value
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            plain_key = key.item() if isinstance(key, np.generic) else key
            if type(plain_key) not in _SCALARS:
                raise _NotPlain(f"{where} has a key {key!r} of type {_type_name(key)}" if where else
                                f"a key is {key!r}, of type {_type_name(key)}")
            out[plain_key] = _plain(item, f"{where}[{plain_key!r}]" if where else repr(plain_key))
        return out
    if isinstance(value, (list, tuple)):
        items = [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise _NotPlain(f"{where} is of type {_type_name(value)}")


def _plain_reward(reward: dict) -> tuple[dict[str, Any] | None, str | None]:
    """``reward`` (a dict) as plain data, checked; ``(None, reason)`` naming the first bad key."""
    try:
        reward = _plain(reward, "")
    except _NotPlain as exc:
        return None, _clip(f"judger returned a reward in which {exc}: a reward holds only plain data ({_PLAIN_TYPES}; "
                           "numpy scalars are converted), so that it can be checkpointed and logged")
    except RecursionError:
        return None, "judger returned a reward nested too deeply (or holding itself)"
    flag = reward.get(EXCLUDE_FROM_LOSS, False)
    if not isinstance(flag, bool):
        return None, _clip(f"judger returned {EXCLUDE_FROM_LOSS!r} = {flag!r} ({_type_name(flag)}); it must be a "
                           "bool: true (leave the sample out of the loss) or false")
    return reward, None


def normalize_reward(result: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Turn a judger result into ``(reward, None)`` or ``(None, reason)``.

    A real number becomes ``{"score": float(x)}``; a dict must hold a real, finite ``"score"``
    (it is converted to ``float``, other keys are kept); anything else is rejected, and so is a
    score beyond ``+-MAX_ABS_SCORE``. A reward holds only plain data (dict, list, tuple, str, int,
    float, bool, None, with str/int/float/bool/None keys): numpy scalars (``np.float64(1.0)``) are
    converted to Python values, at any depth, and any other value (a set, bytes, an object) is
    rejected naming its key; so is an ``exclude_from_loss`` that is not a bool.
    """
    if isinstance(result, np.generic):
        result = result.item()
    if isinstance(result, numbers.Real):
        score, reward = result, {}
    elif isinstance(result, dict):
        if "score" not in result:
            return None, _clip(f"judger returned a dict without 'score' (keys: {sorted(map(str, result))})")
        score = result["score"]
        score = score.item() if isinstance(score, np.generic) else score
        if not isinstance(score, numbers.Real):
            return None, _clip(f"judger returned a non-numeric score {score!r} ({type(score).__name__})")
        reward, reason = _plain_reward({**result, "score": 0.0})  # the score is checked below, in place
        if reward is None:
            return None, reason
    else:
        return None, _clip(f"judger returned {type(result).__name__} {result!r}; expected a number or a dict with 'score'")
    try:
        score = float(score)
    except OverflowError:  # an int beyond float's range
        return None, f"judger returned a score too large for a float, far beyond +-{MAX_ABS_SCORE:g}"
    if not math.isfinite(score):
        return None, f"judger returned a non-finite score {score}"
    if abs(score) > MAX_ABS_SCORE:
        return None, (f"judger returned the score {score:g}, beyond +-{MAX_ABS_SCORE:g}: a reward that large is a "
                      "bug, and would swamp its group's advantages and the run's reward metrics")
    reward["score"] = score
    return _capped(reward), None


def _json_len(value: Any) -> int:
    """Characters of ``value`` as JSON; past the cap for what JSON refuses (an int of 4,300+ digits)."""
    try:
        return len(json.dumps(value))
    except (ValueError, OverflowError, RecursionError):
        return MAX_REWARD_CHARS + 1


def _capped(reward: dict[str, Any]) -> dict[str, Any]:
    """``reward`` within ``MAX_REWARD_CHARS``: its large values cut, with a warning once per process."""
    size = _json_len(reward)
    if size <= MAX_REWARD_CHARS:
        return reward
    kept = {EXCLUDE_FROM_LOSS, "score"}
    out = {}
    for key, value in reward.items():
        n = _json_len(value)
        out[key] = value if key in kept or n <= _CUT_VALUE_CHARS else f"<cut by rlcli: {n} characters>"
    if _json_len(out) > MAX_REWARD_CHARS:
        out = {k: v for k, v in reward.items() if k in kept}
        out["cut"] = f"<cut by rlcli: every other key, {size} characters>"
    if "<cut>" not in _warned:
        _warned.add("<cut>")
        log.warning("a judger returned a reward of %d characters as JSON, more than %d: its values over %d "
                    "characters were replaced by a note of their size (a reward is kept in rollout dumps, the "
                    "replay buffer and checkpoints; shown once)", size, MAX_REWARD_CHARS, _CUT_VALUE_CHARS)
    return out


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
