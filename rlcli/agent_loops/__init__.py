"""Agent loops: how one prompt becomes a judged response.

An agent loop is built per task with the run's backend, judge pool and tokenizer. The runner
calls ``await run_group(samples)``; the loop generates every sample concurrently, appends the
new tokens (with logprobs and per-token policy versions) to what the sample already holds
- which is how partial rollouts are continued after a pause - sets the status from the finish
reason, and judges COMPLETED samples. Nothing here re-tokenizes text: training uses the token
ids exactly as generated.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, ClassVar

from pydantic import Field

from rlcli import hookimpl
from rlcli.backends.base import GenerateRequest, InferenceBackend
from rlcli.component import Component, ComponentConfig
from rlcli.tokenizer import DecodeBatcher
from rlcli.types import Sample, SampleParams, Status, status_from_finish_reason


def request_seed(run_seed: int, sample: Sample, salt: str = "") -> int:
    """A per-request sampling seed that survives checkpoints (depends only on saved fields)."""
    key = f"{run_seed}:{salt}:{sample.task_name}:{sample.uid}:{sample.tries}:{len(sample.response_ids)}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)


class AgentLoopConfig(ComponentConfig):
    sample_params: SampleParams = Field(default_factory=SampleParams, description="How responses are sampled.")


class AgentLoop(Component):
    """Base class of agent loops."""

    Config: ClassVar[type[AgentLoopConfig]] = AgentLoopConfig

    def __init__(self, config: AgentLoopConfig, *, backend: InferenceBackend, judge_pool: Any, tokenizer: Any,
                 eos_token_ids: list[int], seed: int, salt: str = ""):
        super().__init__(config)
        self.backend, self.judge_pool, self.tokenizer = backend, judge_pool, tokenizer
        self.decoder = DecodeBatcher(tokenizer)  # the responses one engine step finished: one batch decode
        self.eos = set(eos_token_ids)
        self.seed, self.salt = seed, salt

    async def run_group(self, samples: list[Sample]) -> list[Sample]:
        await asyncio.gather(*(self.run_sample(s) for s in samples))
        return samples

    async def run_sample(self, sample: Sample) -> Sample:
        raise NotImplementedError


class SingleTurnAgentLoop(AgentLoop):
    """One model turn per prompt, then the judger (partial responses are continued)."""

    name: ClassVar[str] = "single_turn"

    async def run_sample(self, sample: Sample) -> Sample:
        if sample.status == Status.COMPLETED:  # a fresh sibling kept from an expired group
            return sample
        params = self.config.sample_params
        sample.temperature = params.temperature if params.temperature > 0 else 1.0
        done = len(sample.response_ids)
        if done and (sample.response_ids[-1] in self.eos or done >= params.max_tokens):
            reason = "stop" if sample.response_ids[-1] in self.eos else "length"
        else:
            t0 = time.perf_counter()
            req_params = params if not done else params.model_copy(update={  # a continuation asks for the rest
                "max_tokens": params.max_tokens - done,
                "min_tokens": max(params.min_tokens - done, 0),
            })
            out = await self.backend.generate(GenerateRequest(
                prompt_ids=sample.prompt_ids + sample.response_ids,
                params=req_params,
                request_id=sample.uid,
                seed=request_seed(self.seed, sample, self.salt),
            ))
            sample.gen_time_s += time.perf_counter() - t0
            sample.response_ids += out.token_ids
            sample.logprobs += out.logprobs
            sample.token_versions += out.versions
            sample.response_mask += [1] * len(out.token_ids)
            reason = out.finish_reason
            if out.error:
                sample.error = out.error
        sample.finish_reason = reason
        sample.status = status_from_finish_reason(reason)
        if sample.status != Status.ABORTED:
            sample.response = await self.decoder.decode(sample.response_ids)
        if sample.status == Status.COMPLETED:
            await self.judge_pool.judge(sample)
        return sample


@hookimpl
def register_agent_loops():
    from rlcli.agent_loops.multi_turn import MultiTurnAgentLoop

    return [SingleTurnAgentLoop, MultiTurnAgentLoop]
