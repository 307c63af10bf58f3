"""The agent-loop checks: each runs the loop under test against a :class:`ScriptedBackend` and raises
``AssertionError`` saying what broke the contract of :class:`rlcli.agent_loops.base.AgentLoop`."""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from rlcli.agent_loops.base import AgentLoop
from rlcli.testing.agent_loop_conformance.fakes import RecordingJudgePool, ScriptedBackend, Served, token_vocab
from rlcli.tokenizer import decode_tokens, load_tokenizer
from rlcli.types import Sample, SampleParams, Status, status_from_finish_reason

LoopFactory = Callable[..., AgentLoop]
"""``make_loop(sample_params, **runtime) -> AgentLoop``: the loop under test, built with these
:class:`~rlcli.types.SampleParams` and the runner's keyword arguments (``backend``, ``judge_pool``,
``tokenizer``, ``eos_token_ids``, ``seed``, ``salt``)."""

DEFAULT_PROMPTS = ("12+7=", "3*4-5=", "what is 9-2?")
FIRST_VERSION = 3  # the policy version of check_tokens_aligned's first request (then one more per request)


@dataclass
class Kit:
    """What the checks share: the tokenizer, the prompts and how the scripted model samples."""

    tokenizer: Any
    prompts: list[str]
    vocab: list[int]
    max_tokens: int = 24
    temperature: float = 1.0
    stop_prob: float = 0.15
    seed: int = 1234
    built: list[AgentLoop] = field(default_factory=list)

    @property
    def eos(self) -> int:
        return self.tokenizer.eos_token_id

    def backend(self, **kw: Any) -> ScriptedBackend:
        return ScriptedBackend(self.vocab, self.eos, **{"stop_prob": self.stop_prob, **kw})

    def loop(self, make_loop: LoopFactory, backend: ScriptedBackend, pool: RecordingJudgePool,
             max_tokens: int | None = None) -> AgentLoop:
        params = SampleParams(max_tokens=max_tokens or self.max_tokens, temperature=self.temperature)
        loop = make_loop(params, backend=backend, judge_pool=pool, tokenizer=self.tokenizer,
                         eos_token_ids=[self.eos], seed=self.seed, salt="train:kit")
        self.built.append(loop)
        return loop

    def sample(self, prompt_index: int, uid: int | None = None) -> Sample:
        text = self.prompts[prompt_index]
        uid = prompt_index if uid is None else uid
        return Sample(uid=uid, group_id=prompt_index, task_name="kit",
                      prompt_ids=list(self.tokenizer.encode(text, add_special_tokens=False)), prompt_text=text,
                      messages=[{"role": "user", "content": text}], label="0", extra_info={"index": prompt_index})

    def close(self) -> None:
        for loop in self.built:
            close = getattr(loop, "close", None)
            if callable(close):
                close()
        self.built.clear()


def make_kit(tokenizer: Any = "builtin:arith", prompts=DEFAULT_PROMPTS, vocab=None, max_tokens: int = 24,
             temperature: float = 1.0, stop_prob: float = 0.15) -> Kit:
    """A :class:`Kit`: ``tokenizer`` (a tokenizer or what :func:`rlcli.tokenizer.load_tokenizer`
    takes), ``prompts`` (texts), ``vocab`` (token ids the scripted model draws; default: every
    non-special token), ``max_tokens`` (the budget the loop is built with), the sampling
    ``temperature`` and ``stop_prob`` (the chance of EOS at each token)."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if tok.eos_token_id is None:
        raise ValueError("the kit's tokenizer needs an EOS token")
    return Kit(tok, list(prompts), list(vocab) if vocab is not None else token_vocab(tok), max_tokens,
               temperature, stop_prob)


def run_samples(loop: AgentLoop, samples: list[Sample]) -> list[Sample]:
    """``loop.run_group(samples)`` as the runner calls it, except that an exception the loop raises
    propagates (with its traceback) instead of failing the sample."""

    def reraise(sample: Sample, exc: BaseException) -> None:
        raise exc

    loop.fail_sample = reraise  # type: ignore[method-assign]
    asyncio.run(loop.run_group(samples))
    return samples


def _model_positions(sample: Sample) -> list[int]:
    return [i for i, m in enumerate(sample.response_mask) if m == 1]


def _generated(served: list[Served]) -> tuple[list[int], list[float], list[int]]:
    ids, lps, vers = [], [], []
    for s in served:
        ids += s.output.token_ids
        lps += s.output.logprobs
        vers += s.output.versions
    return ids, lps, vers


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _masks_problem(sample: Sample, served: list[Served]) -> str | None:
    """Why the mask-1 tokens are not exactly the backend's tokens, in order (None: they are)."""
    if any(m not in (0, 1) for m in sample.response_mask):
        return f"response_mask holds values other than 0 and 1: {sorted(set(sample.response_mask))}"
    if len(sample.response_mask) != len(sample.response_ids):
        return f"{len(sample.response_ids)} response_ids but {len(sample.response_mask)} response_mask entries"
    marked = [sample.response_ids[i] for i in _model_positions(sample)]
    generated = _generated(served)[0]
    if marked == generated:
        return None
    at = _first_difference(marked, generated)
    return (f"the tokens with response_mask 1 are not the backend's tokens: {len(marked)} marked, the backend "
            f"generated {len(generated)}, first difference at model token {at} "
            f"({marked[at:at + 3]} vs {generated[at:at + 3]}). Tokens the loop inserts itself must have mask 0, and "
            f"the backend's tokens must be appended as they are (never re-tokenized text), with mask 1")


def _check_each_prompt(make_loop: LoopFactory, kit: Kit, check: Callable[[Sample, ScriptedBackend], None],
                       **backend_kw: Any) -> None:
    for i in range(len(kit.prompts)):
        backend, pool = kit.backend(**backend_kw), RecordingJudgePool()
        sample = kit.sample(i)
        run_samples(kit.loop(make_loop, backend, pool), [sample])
        try:
            check(sample, backend)
        except AssertionError as exc:
            raise AssertionError(f"prompt {kit.prompts[i]!r}: {exc}") from None


# ---------------------------------------------------------------------------------- checks
def check_response_set(make_loop: LoopFactory, **options: Any) -> None:
    """Every sample of a group ends with a status that follows its ``finish_reason``; a COMPLETED
    one is judged exactly once, after ``sample.response`` was set, and keeps it; the responses are
    not all empty when the model wrote text."""
    kit = make_kit(**options)
    try:
        completed, with_response, written = 0, 0, []
        for g in range(len(kit.prompts)):
            pool = RecordingJudgePool()
            samples = [kit.sample(g, uid=10 * g + j) for j in range(3)]
            run_samples(kit.loop(make_loop, kit.backend(), pool), samples)
            for s in samples:
                where = f"sample uid={s.uid} (prompt {s.prompt_text!r})"
                assert isinstance(s.response, str), f"{where}: response is {type(s.response).__name__}, not str"
                assert s.status == status_from_finish_reason(s.finish_reason), (
                    f"{where}: status {s.status.value} does not follow finish_reason {s.finish_reason!r} "
                    f"(stop/length/tool_calls: COMPLETED, abort: ABORTED, anything else: FAILED)")
                assert s.status != Status.ABORTED, f"{where}: ABORTED although nothing paused the backend"
                calls = [c for c in pool.calls_for(s.uid) if c[1] == Status.COMPLETED]
                if s.status != Status.COMPLETED:
                    continue
                completed += 1
                assert len(calls) == 1, f"{where}: COMPLETED but judged {len(calls)} times (once: judge_pool.judge)"
                text = decode_tokens(kit.tokenizer, [t for t, m in zip(s.response_ids, s.response_mask) if m])
                if text.strip():
                    written.append(text)
                    with_response += bool(s.response)
                assert calls[0][2] == s.response, (
                    f"{where}: the judger read {calls[0][2][:60]!r} but the response is {s.response[:60]!r}: "
                    f"set sample.response before judging, and keep it")
                assert s.reward is not None, f"{where}: COMPLETED and judged, but its reward was dropped"
        assert completed, "no sample ended COMPLETED"
        assert with_response or not written, (
            f"sample.response is empty in every COMPLETED sample, although the model wrote text (e.g. "
            f"{written[0][:60]!r}): set sample.response (the text the judger reads) before judge_pool.judge")
    finally:
        kit.close()


def check_tokens_aligned(make_loop: LoopFactory, **options: Any) -> None:
    """``response_ids``, ``logprobs``, ``response_mask`` and ``token_versions`` have one entry per
    token; the model tokens carry the backend's logprobs and versions (the backend changes its
    version after every request here); inserted tokens have finite logprobs and versions within
    those served; each request's context is the prompt and the response before its tokens; and
    ``sample.temperature`` is the requests' sampling temperature (0.7 unless ``temperature`` is given,
    so that a loop that leaves the default 1.0 is caught)."""
    kit = make_kit(**{"temperature": 0.7, **options})

    def check(s: Sample, backend: ScriptedBackend) -> None:
        n = len(s.response_ids)
        lengths = (len(s.logprobs), len(s.response_mask), len(s.token_versions))
        assert lengths == (n, n, n), (
            f"{n} response_ids but {lengths[0]} logprobs, {lengths[1]} response_mask, {lengths[2]} token_versions")
        problem = _masks_problem(s, backend.served)
        assert problem is None, problem
        pos = _model_positions(s)
        _, lps, vers = _generated(backend.served)
        got_lps, got_vers = [s.logprobs[i] for i in pos], [s.token_versions[i] for i in pos]
        at = _first_difference(got_lps, lps)
        assert got_lps == lps, f"model token {at}: logprob {got_lps[at]} but the backend returned {lps[at]}"
        at = _first_difference(got_vers, vers)
        assert got_vers == vers, f"model token {at}: version {got_vers[at]} but the backend stamped {vers[at]}"
        lo, hi = FIRST_VERSION, backend.version
        for i, m in enumerate(s.response_mask):
            if not m:
                assert math.isfinite(s.logprobs[i]), f"inserted token {i} has logprob {s.logprobs[i]}"
                assert isinstance(s.token_versions[i], int) and lo <= s.token_versions[i] <= hi, (
                    f"inserted token {i} has version {s.token_versions[i]!r}, outside the versions served ({lo}..{hi})")
        done = 0
        for served in backend.served:
            k = len(served.output.token_ids)
            if k:
                want = s.prompt_ids + s.response_ids[:pos[done]]
                assert served.request.prompt_ids == want, (
                    f"a request's prompt_ids ({len(served.request.prompt_ids)} tokens) is not the sample's prompt and "
                    f"the {pos[done]} response tokens before what it generated: the trainer would score those "
                    f"tokens in another context")
            done += k
            t = served.request.params.temperature
            assert s.temperature == (t if t > 0 else 1.0), (
                f"sample.temperature is {s.temperature} but the loop sampled at {t}: the trainer recomputes the "
                f"logprobs at sample.temperature (1.0 for greedy)")

    try:
        _check_each_prompt(make_loop, kit, check, version=FIRST_VERSION, version_step=1)
    finally:
        kit.close()


def check_inserted_tokens_masked(make_loop: LoopFactory, **options: Any) -> None:
    """Exactly the tokens the backend generated have ``response_mask`` 1, in order; every token the
    loop inserts itself has 0 (and is never trained on)."""
    kit = make_kit(**options)

    def check(s: Sample, backend: ScriptedBackend) -> None:
        problem = _masks_problem(s, backend.served)
        assert problem is None, problem

    try:
        _check_each_prompt(make_loop, kit, check)
    finally:
        kit.close()


def check_budget_respected(make_loop: LoopFactory, budgets=(1, 2, 5), **options: Any) -> None:
    """The response never exceeds ``sample_params.max_tokens`` (model and inserted tokens
    together), and no request asks for more than what is left: for small budgets and the kit's, with
    the kit's model and with one that never writes EOS."""
    kit = make_kit(**options)
    try:
        for budget, stop_prob, i in itertools.product((*budgets, kit.max_tokens), (kit.stop_prob, 0.0),
                                                      range(len(kit.prompts))):
            backend, sample = kit.backend(stop_prob=stop_prob), kit.sample(i)
            run_samples(kit.loop(make_loop, backend, RecordingJudgePool(), max_tokens=budget), [sample])
            where = f"max_tokens={budget}, EOS chance {stop_prob}, prompt {kit.prompts[i]!r}"
            assert len(sample.response_ids) <= budget, f"{where}: the response has {len(sample.response_ids)} tokens"
            for served in backend.served:
                before = len(served.request.prompt_ids) - len(sample.prompt_ids)
                asked = served.request.params.max_tokens
                assert asked <= budget - before, (
                    f"{where}: a request after {before} response tokens asked for max_tokens={asked}, more than "
                    f"the {budget - before} left")
    finally:
        kit.close()


def _fields(s: Sample) -> dict[str, Any]:
    return {"response_ids": s.response_ids, "logprobs": s.logprobs, "response_mask": s.response_mask,
            "token_versions": s.token_versions, "response": s.response, "finish_reason": s.finish_reason,
            "status": s.status}


def _continued(make_loop, kit: Kit, i: int, abort_at=None, cancel_first: bool = False) -> tuple[Sample, list[str]]:
    """The sample of prompt ``i`` paused as asked, then continued; and what went wrong on the way."""
    backend, pool = kit.backend(abort_at=abort_at), RecordingJudgePool(cancel_first=cancel_first)
    loop, sample = kit.loop(make_loop, backend, pool), kit.sample(i)
    run_samples(loop, [sample])
    problems = []
    if sample.status != Status.ABORTED:
        problems.append(f"the sample is {sample.status.value} after the pause (finish_reason {sample.finish_reason!r}),"
                        f" not ABORTED")
    elif any(c[1] == Status.COMPLETED for c in pool.calls_for(sample.uid)) and not cancel_first:
        problems.append("a sample aborted by a pause was judged")
    sample.resumes += 1  # what the produce strategy does before continuing it
    run_samples(loop, [sample])
    judged = [c for c in pool.calls_for(sample.uid) if c[1] == Status.COMPLETED]
    if sample.status == Status.COMPLETED and len(judged) != 1 + cancel_first:
        problems.append(f"the continued sample was judged {len(judged)} times in all")
    return sample, problems


def check_pause_and_continue(make_loop: LoopFactory, max_cuts: int = 12, **options: Any) -> None:
    """A request cut by a pause (after 0, 1 or half of its tokens) leaves the sample ABORTED and
    unjudged; run again, the loop ends with the same tokens, logprobs, masks, versions, response and
    status as a run never paused. A judge call cut by a pause is simply redone."""
    kit = make_kit(**options)
    try:
        for i in range(len(kit.prompts)):
            backend = kit.backend()
            ref = kit.sample(i)
            run_samples(kit.loop(make_loop, backend, RecordingJudgePool()), [ref])
            cuts = [(r, k) for r, s in enumerate(backend.served)
                    for k in sorted({0, 1, len(s.output.token_ids) // 2}) if k < len(s.output.token_ids)][:max_cuts]
            runs = [(f"request {r} paused after {k} tokens", dict(abort_at=(r, k))) for r, k in cuts]
            if ref.status == Status.COMPLETED:
                runs.append(("its judge call cut by a pause", dict(cancel_first=True)))
            for what, kw in runs:
                got, problems = _continued(make_loop, kit, i, **kw)
                want = _fields(ref)
                for name, value in _fields(got).items():
                    if value != want[name]:
                        at = _first_difference(value, want[name]) if isinstance(value, list) else None
                        problems.append(f"{name} differs from the run never paused"
                                        + (f" (first at {at}: {value[at:at + 3]} vs {want[name][at:at + 3]})"
                                           if at is not None else f" ({value!r} vs {want[name]!r})"))
                assert not problems, (
                    f"prompt {kit.prompts[i]!r}, {what}: " + "; ".join(problems) + ". A continued sample must be "
                    "decided from its saved fields alone, with request seeds from saved fields (request_seed)")
    finally:
        kit.close()
