"""Checks for judgers (the contract of :class:`rlcli.judgers.base.Judger`), for a plugin's own tests.

Every check calls the judger directly (in a worker thread, so a hang is reported, not waited for)
and raises ``AssertionError`` saying what broke the contract::

    from rlcli.testing import judger_conformance as jc

    def test_my_judger_keeps_the_judger_contract():
        judger = MyJudger(MyJudger.Config())
        jc.run_all(judger, [("the answer is 4", "4"), ("5", "4")])

A *case* is ``(response, label)`` or ``(response, label, {Sample field: value})`` (e.g.
``{"data_source": "openai/gsm8k"}``); give a few right and a few wrong answers. The checks
(:data:`ALL_CHECKS`):

* ``scores_in_range``: every case gets a usable result (a finite number, or a dict with a finite
  ``"score"``) within the judger's ``score_range()``;
* ``garbage_handled``: empty, blank and garbage responses (:data:`GARBAGE`) get a score in range
  too, never an exception (in a run an exception fails the sample, so the model is never told the
  garbage is wrong);
* ``deterministic``: the same input gets the same score, again and from a pickled copy (which
  ``executor: process`` needs);
* ``respects_timeout``: every call, huge responses (:data:`HUGE`) included, returns within the
  judger's ``timeout_s`` (in a run a slower call fails its sample: ``judger/timeouts``).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from rlcli.judgers.calls import normalize_reward
from rlcli.testing.checks import run_checks
from rlcli.types import Sample, Status

GARBAGE: tuple[str, ...] = (
    "", " ", "\n\t\n", "\x00\x01\x7f", "<unk><unk><unk>", "}{)(][", "####", "#### ", "#### ####", "\\boxed{",
    "\\boxed{}", "\\frac{1}{0}", "$$", "$", "nan", "inf", "-inf", "1e999", "1/0", "0.1.2.3", "--5", "None", "{}",
    "[]", "💥 ünïcödé ½ ∞ 中文", "=" * 300,
)
"""Responses every judger must score without raising."""

HUGE: tuple[str, ...] = ("9" * 5000, "a " * 50_000, "(" * 5000 + ")" * 5000, "#### 1 " * 10_000, "\\boxed{" * 2000)
"""Huge responses (a model that never stops) that must be judged within ``timeout_s``."""

Case = Sequence[Any]
"""``(response, label)`` or ``(response, label, {Sample field: value})``."""


@dataclass
class _Call:
    result: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def _sample(fields: dict[str, Any]) -> Sample:
    return Sample(**{"uid": 0, "group_id": 0, "task_name": "kit", "prompt_ids": [0], "status": Status.COMPLETED,
                     "finish_reason": "stop", **fields})


def _call(judger: Any, response: str, label: Any, fields: dict[str, Any], limit: float) -> _Call:
    """``judger.judge`` in a daemon thread, waited for at most ``limit`` seconds (an async result is awaited)."""
    box = _Call()

    def target() -> None:
        try:
            result = judger.judge(response, label, _sample(dict(fields, response=response)))
            if inspect.isawaitable(result):
                async def wait() -> Any:
                    return await result

                result = asyncio.run(wait())
            box.result = result
        except BaseException as exc:  # noqa: BLE001 - reported by the check
            box.error = exc

    thread = threading.Thread(target=target, name="judger-kit", daemon=True)
    thread.start()
    thread.join(limit)
    box.timed_out = thread.is_alive()
    return box


def _timeout(judger: Any, timeout_s: float | None) -> float:
    if timeout_s is not None:
        return timeout_s
    return float(getattr(getattr(judger, "config", None), "timeout_s", 30.0))


def _declared_range(judger: Any) -> tuple[float, float]:
    lo, hi = (float(x) for x in judger.score_range())
    assert math.isfinite(lo) and math.isfinite(hi) and lo <= hi, f"score_range() is ({lo}, {hi}): not a finite range"
    return lo, hi


def _split(case: Case) -> tuple[str, Any, dict[str, Any]]:
    response, label, *rest = case
    return response, label, dict(rest[0]) if rest else {}


def _show(text: str) -> str:
    return repr(text) if len(text) <= 40 else f"{text[:30]!r}... ({len(text)} characters)"


def _score(judger: Any, response: str, label: Any, fields: dict[str, Any], limit: float) -> float:
    """The score of one call, checked: it returned in time, did not raise, is usable and in range."""
    what = f"judge({_show(response)}, {label!r})"
    call = _call(judger, response, label, fields, limit)
    assert not call.timed_out, f"{what} did not return within {limit:g}s"
    if call.error is not None:
        raise AssertionError(f"{what} raised {type(call.error).__name__}: {call.error}") from call.error
    reward, reason = normalize_reward(call.result)
    assert reward is not None, f"{what}: {reason}"
    lo, hi = _declared_range(judger)
    assert lo <= reward["score"] <= hi, (
        f"{what} scored {reward['score']}, outside its score_range() ({lo}, {hi}); override score_range() if "
        f"the scores are right")
    return reward["score"]


def _labels(cases: Iterable[Case]) -> list[tuple[Any, dict[str, Any]]]:
    seen: dict[str, tuple[Any, dict[str, Any]]] = {}
    for case in cases:
        _, label, fields = _split(case)
        seen.setdefault(repr((label, sorted(fields.items()))), (label, fields))
    return list(seen.values())[:3]


# ---------------------------------------------------------------------------------- checks
def check_scores_in_range(judger: Any, cases: Iterable[Case], timeout_s: float | None = None) -> None:
    """Every case gets a finite score within ``judger.score_range()``."""
    cases = list(cases)
    assert cases, "give the kit a few cases: (response, label) pairs, right and wrong answers"
    for case in cases:
        _score(judger, *_split(case), _timeout(judger, timeout_s))


def check_garbage_handled(judger: Any, cases: Iterable[Case], timeout_s: float | None = None) -> None:
    """Empty, blank and garbage responses (:data:`GARBAGE`) get a score in range, never an exception."""
    for label, fields in _labels(cases):
        for response in GARBAGE:
            try:
                _score(judger, response, label, fields, _timeout(judger, timeout_s))
            except AssertionError as exc:
                raise AssertionError(f"{exc}. A response the judger cannot read must get a score (usually the "
                                     f"lowest), not an error: an error fails the sample (judger/errors), so the "
                                     f"model is never told it was wrong") from exc


def check_deterministic(judger: Any, cases: Iterable[Case], repeats: int = 3, timeout_s: float | None = None) -> None:
    """The same input gets the same score every time, and from a pickled copy of the judger (which
    ``executor: process`` needs; a judger that cannot be pickled must not default to it)."""
    limit = _timeout(judger, timeout_s)
    inputs = [_split(c) for c in cases] + [(g, label, fields) for label, fields in _labels(cases) for g in GARBAGE[:4]]
    try:
        copy = pickle.loads(pickle.dumps(judger))
    except Exception as exc:  # noqa: BLE001
        executor = getattr(getattr(judger, "config", None), "executor", None)
        assert executor != "process", f"the judger cannot be pickled ({type(exc).__name__}: {exc}) but its " \
                                      f"executor is 'process'"
        copy = None
    for response, label, fields in inputs:
        scores = [_score(judger, response, label, fields, limit) for _ in range(repeats)]
        if copy is not None:
            scores.append(_score(copy, response, label, fields, limit))
        assert len(set(scores)) == 1, (
            f"judge({_show(response)}, {label!r}) scored {scores} over {repeats} calls"
            + (" and a pickled copy" if copy is not None else "") + ": a judger must score the same input the same "
            "way (seed any randomness from the input)")


def check_respects_timeout(judger: Any, cases: Iterable[Case], timeout_s: float | None = None) -> None:
    """Every call - the cases, the garbage and the huge responses (:data:`HUGE`) - returns within the
    judger's ``timeout_s``."""
    limit = _timeout(judger, timeout_s)
    inputs = [_split(c) for c in cases] + [(r, label, fields) for label, fields in _labels(cases)
                                           for r in (*GARBAGE, *HUGE)]
    for response, label, fields in inputs:
        call = _call(judger, response, label, fields, limit)
        assert not call.timed_out, (
            f"judge({_show(response)}, {label!r}) ran longer than timeout_s={limit:g}s: in a run that sample is "
            f"FAILED (judger/timeouts). Bound the work (cut the input, a cheaper parse) or raise timeout_s")


ALL_CHECKS: dict[str, Callable[..., None]] = {
    "scores_in_range": check_scores_in_range,
    "garbage_handled": check_garbage_handled,
    "deterministic": check_deterministic,
    "respects_timeout": check_respects_timeout,
}
"""Every check by short name (what ``run_all``'s ``skip`` refers to)."""


def run_all(judger: Any, cases: Iterable[Case], *, skip: Iterable[str] = (),
            timeout_s: float | None = None) -> list[str]:
    """Run every check but those named in ``skip``; ``timeout_s`` replaces the judger's own. Returns
    the names run; the first failure raises ``AssertionError`` prefixed with the check's name."""
    cases = list(cases)
    return run_checks(ALL_CHECKS, lambda name, check: check(judger, cases, timeout_s=timeout_s), skip)


__all__ = ["ALL_CHECKS", "GARBAGE", "HUGE", "Case", "check_deterministic", "check_garbage_handled",
           "check_respects_timeout", "check_scores_in_range", "run_all"]
