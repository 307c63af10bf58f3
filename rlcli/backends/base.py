"""The inference-backend contract every engine implements (embedded, vLLM, SGLang, LMDeploy, ...).

A backend is built once per run from ``(config, ctx)`` and then used from one asyncio event loop:

* ``await generate(request)`` for many concurrent requests. Each response token comes with its
  logprob under the *sampling temperature applied to the raw logits* (no top-k/top-p
  renormalisation), so it matches the trainer's recomputed logprob, and with the policy version
  of the weights that produced it. A request whose ``params.return_logprob`` is false gets no
  logprobs (``logprobs`` empty): the engine may skip computing them.
* ``pause()`` aborts every in-flight request: each returns promptly with ``finish_reason
  "abort"`` and the tokens generated so far; requests made while paused return "abort" at once
  with no tokens. ``resume()`` accepts requests again. A caller continues a partial response by
  sending ``prompt + partial tokens`` with the remaining budget.
* ``update_weights(named_tensors, version)`` loads Hugging Face-named tensors (any subset, in
  any number of calls); ``version`` becomes the policy version of tokens generated afterwards.
  It is called while no generation step runs (between steps or while paused). A backend whose
  class sets ``accepts_live_weights = True`` copies every tensor before ``update_weights``
  returns and casts it itself: a colocated trainer may then hand it its own parameters (no
  copy, any floating dtype) instead of cast copies. One whose class sets
  ``allows_expandable_segments = True`` runs with the CUDA allocator's expandable segments, which
  the runner then turns on unless the recipe or the environment says otherwise.
* ``sleep()`` / ``wake_up()`` release and restore device memory (KV cache; weights too at
  ``level=2``) so a colocated trainer can use it. ``shutdown()`` frees everything.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

import torch

from rlcli.component import Component
from rlcli.types import SampleParams


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    params: SampleParams
    request_id: Any = None
    # Sampling seed. With the same seed, prompt, parameters and weights a backend that supports it
    # returns the same tokens whatever else it is serving; None lets the backend choose one.
    seed: int | None = None


@dataclass
class GenerateOutput:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per token; empty when return_logprob is false
    versions: list[int] = field(default_factory=list)  # policy version per token
    finish_reason: str = "stop"  # "stop" | "length" | "abort" | "error"
    error: str | None = None


@dataclass(frozen=True)
class RolloutWorkload:
    """The most a run asks of one backend replica at once, from its recipe: what an engine sizes its
    KV cache for (``rlcli.runner.workload`` computes it).

    ``max_sequences``: sequences in flight at once - the training tasks' groups of one step
    (over-sampled ones included) times their group size, or the largest eval task's prompts times
    its group size, whichever is more. ``max_sequence_tokens``: prompt + response tokens of the
    longest sequence (the longest prompt of the data plus the task's ``max_tokens``); None when a
    task does not say (a third-party sampler or agent loop). ``train_sequences``: the training part
    of ``max_sequences`` alone (0 when the replica trains nothing), which an engine with a fixed
    number of decode slots should hold at once.
    """

    max_sequences: int
    max_sequence_tokens: int | None = None
    train_sequences: int = 0


@dataclass
class BackendContext:
    """What the runner tells a backend about the model, the machine and the workload."""

    model_dir: str  # Hugging Face directory: config.json, weights, tokenizer
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: list[int]
    pad_token_id: int | None = None
    seed: int = 0
    version: int = 0  # policy version of the weights in model_dir
    rank: int = 0
    world_size: int = 1
    # What the recipe will ask of this replica at most at once; None when unknown (a context built
    # outside rlcli's runners): backends then fall back to their own sizing.
    workload: RolloutWorkload | None = None


class InferenceBackend(Component, abc.ABC):
    """Base class of inference backends (see module docstring for the contract)."""

    #: ``update_weights`` has copied (and cast) every tensor when it returns, so it may be given
    #: tensors that alias a trainer's live parameters, in their training dtype.
    accepts_live_weights: ClassVar[bool] = False
    #: The engine works with the CUDA caching allocator's expandable segments (the runner turns them
    #: on by default for such a backend: ``resources.expandable_segments``). False when its memory
    #: pools may not mix with them (vLLM's sleep mode refuses them) or nobody has checked.
    allows_expandable_segments: ClassVar[bool] = False

    def __init__(self, config, ctx: BackendContext):
        super().__init__(config)
        self.ctx = ctx

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights currently loaded."""

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateOutput: ...

    @abc.abstractmethod
    def pause(self) -> None: ...

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def sleep(self, level: int = 1) -> None:  # noqa: B027 - optional
        """Release device memory (level 1: KV cache; level 2: weights too)."""

    def wake_up(self) -> None:  # noqa: B027 - optional
        """Restore what :meth:`sleep` released."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        """Free all resources; the backend is unusable afterwards."""

    def stats(self) -> dict[str, float]:
        """Counters since the last call (e.g. generated tokens, busy seconds); reset on read."""
        return {}
