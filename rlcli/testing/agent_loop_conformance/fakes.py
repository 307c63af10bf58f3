"""The stand-ins an agent loop runs against in the kit: a scripted backend and a recording judge pool."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import ClassVar, Iterable, Sequence

from rlcli.backends.base import GenerateOutput, GenerateRequest, InferenceBackend
from rlcli.types import Sample, Status


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


@dataclass
class Served:
    """One ``generate`` call: the request and what the backend returned."""

    request: GenerateRequest
    output: GenerateOutput


class ScriptedBackend(InferenceBackend):
    """A stand-in model that samples the way the embedded engine does, without a model.

    The token after a context is drawn from ``vocab`` by a hash of the request's seed, the token's
    absolute position and the context's last four tokens; with probability ``stop_prob`` it is
    EOS instead (never before ``min_tokens``, never with ``ignore_eos``). So the same seed and
    context give the same tokens, a continuation (``prompt + tokens so far``, same seed) carries
    on exactly where a request stopped, and a request without a seed (``seed=None``) draws a
    fresh one, as a real engine would. At ``temperature`` 0 the seed is ignored (greedy). A token
    in ``stop_token_ids`` ends the response too. Logprobs are a hash of the same inputs, in
    [-5, -0.01].

    Every token of a request carries ``version``, which grows by ``version_step`` after each
    request. ``abort_at=(i, k)`` makes the ``i``-th request (from 0) return only its first ``k``
    tokens with ``finish_reason "abort"`` - what a pause in the middle of it returns; ``pause()``
    makes every request return "abort" with no tokens until ``resume()``. ``served`` records
    every call in order.
    """

    name: ClassVar[str] = "scripted"

    def __init__(self, vocab: Sequence[int], eos: int, *, stop_prob: float = 0.15, version: int = 0,
                 version_step: int = 0, abort_at: tuple[int, int] | None = None):
        if not vocab:
            raise ValueError("ScriptedBackend needs a non-empty vocab")
        self.vocab, self.eos, self.stop_prob = list(vocab), eos, stop_prob
        self._version, self.version_step = version, version_step
        self.abort_at = abort_at
        self.paused = False
        self.served: list[Served] = []

    @property
    def version(self) -> int:
        return self._version

    def _next(self, seed: int, ctx: list[int], allowed: list[int], can_stop: bool) -> tuple[int, float]:
        h = _hash(seed, len(ctx), tuple(ctx[-4:]))
        logprob = -(1 + (h >> 40) % 500) / 100
        if can_stop and (h % 10_000) < self.stop_prob * 10_000:
            return self.eos, logprob
        return allowed[(h >> 16) % len(allowed)], logprob

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        index = len(self.served)
        out = GenerateOutput(finish_reason="abort")
        self.served.append(Served(request, out))
        if self.paused:
            return out
        p = request.params
        seed = 0 if p.temperature == 0 else (request.seed if request.seed is not None else random.getrandbits(62))
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {self.eos})
        free = [t for t in self.vocab if t not in stops] or self.vocab
        ctx = list(request.prompt_ids)
        out.finish_reason = "length"
        for _ in range(p.max_tokens):
            can_stop = len(out.token_ids) >= p.min_tokens
            tok, lp = self._next(seed, ctx, self.vocab if can_stop else free, can_stop and not p.ignore_eos)
            ctx.append(tok)
            out.token_ids.append(tok)
            out.logprobs.append(lp)
            out.versions.append(self._version)
            if tok in stops and can_stop:
                out.finish_reason = "stop"
                break
        if self.abort_at is not None and self.abort_at[0] == index:
            k = self.abort_at[1]
            del out.token_ids[k:], out.logprobs[k:], out.versions[k:]
            out.finish_reason = "abort"
        self._version += self.version_step
        return out

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, named_tensors, version: int) -> None:
        self._version = version


class RecordingJudgePool:
    """A judge pool that records what it was asked to judge (``judged``: (uid, status, response) at
    the call) and scores ``len(response) % 2``. With ``cancel_first`` its first call on each sample
    does what a pause does to a judge call in flight: the sample becomes ABORTED with ``reward``
    None and ``finish_reason "abort"``."""

    def __init__(self, cancel_first: bool = False):
        self.cancel_first = cancel_first
        self.judged: list[tuple[int, Status, str]] = []
        self.pending = 0

    async def judge(self, sample: Sample) -> None:
        self.judged.append((sample.uid, sample.status, sample.response))
        if sample.status != Status.COMPLETED:
            return
        if self.cancel_first and sum(uid == sample.uid for uid, _, _ in self.judged) == 1:
            sample.status, sample.reward, sample.finish_reason = Status.ABORTED, None, "abort"
            sample.error = "judge call cancelled by a pause (kit)"
            return
        sample.reward = {"score": float(len(sample.response) % 2)}

    def calls_for(self, uid: int) -> list[tuple[int, Status, str]]:
        return [j for j in self.judged if j[0] == uid]

    async def cancel_pending(self, grace_s: float) -> int:
        return 0


def token_vocab(tokenizer, exclude: Iterable[int] = ()) -> list[int]:
    """The ids a scripted model draws from: every token of ``tokenizer`` but its special ones."""
    special = set(tokenizer.all_special_ids) | set(exclude)
    return sorted(i for i in tokenizer.get_vocab().values() if i not in special)
