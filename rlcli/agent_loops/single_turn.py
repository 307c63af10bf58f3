"""The ``single_turn`` agent loop: one model turn per prompt, then the judger."""

from __future__ import annotations

import time
from typing import ClassVar

from rlcli.agent_loops.base import AgentLoop, request_seed
from rlcli.backends.base import GenerateRequest
from rlcli.types import Sample, Status, status_from_finish_reason


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
                seed=request_seed(self.seed, sample, self.salt),  # the first request's seed: continued exactly
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
