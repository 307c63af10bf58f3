"""A sample an agent loop returns malformed fails alone (FAILED, counted, the loop named) instead
of ending the run in the trainer: lists of different lengths, ids that are no token ids, a response
over its budget, a prompt the loop changed (rlcli.agent_loops.base.sample_problem)."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest

from rlcli.agent_loops.base import AgentLoop, AgentLoopConfig, run_group_isolated
from rlcli.types import SampleParams, Sample, Status


def breaks(kind: str):
    def apply(s: Sample) -> None:
        s.response_ids, s.response_mask, s.token_versions, s.logprobs = [5, 6, 7], [1, 1, 1], [0, 0, 0], [-1.0] * 3
        if kind == "mask":
            s.response_mask.append(1)
        elif kind == "logprobs":
            s.logprobs.append(-1.0)
        elif kind == "negative":
            s.response_ids[1] = -3
        elif kind == "float":
            s.response_ids[1] = 6.0
        elif kind == "long":
            s.response_ids += [8] * 10
            s.response_mask += [1] * 10
            s.token_versions += [0] * 10
            s.logprobs += [-1.0] * 10
        elif kind == "prompt":
            s.prompt_ids.append(99)
        elif kind == "no-logprobs":  # return_logprob false: empty logprobs are fine
            s.logprobs = []
        s.status, s.reward = Status.COMPLETED, {"score": 1.0}
    return apply


class Faulty(AgentLoop):
    name: ClassVar[str] = "faulty"

    def __init__(self, kind: str):
        super().__init__(AgentLoopConfig(sample_params=SampleParams(max_tokens=8)), backend=None, judge_pool=None,
                         tokenizer=None, eos_token_ids=[2], seed=0)
        self.kind = kind

    async def run_sample(self, sample: Sample) -> Sample:
        breaks(self.kind if sample.uid == 0 else "fine")(sample)
        return sample


@pytest.mark.parametrize("kind, words", [
    ("mask", "4 response_mask for 3 response_ids"), ("logprobs", "4 logprobs for 3 response_ids"),
    ("negative", "holds -3 among its response_ids"), ("float", "holds 6.0 among its response_ids"),
    ("long", "13 response tokens, over sample_params.max_tokens=8"), ("prompt", "changed the sample's prompt_ids"),
])
def test_a_malformed_sample_fails_alone_and_names_the_loop(kind, words):
    loop = Faulty(kind)
    samples = [Sample(uid=i, group_id=0, task_name="t", prompt_ids=[1, 2]) for i in range(3)]
    asyncio.run(run_group_isolated(loop, samples))
    bad, *good = samples
    assert bad.status == Status.FAILED and bad.error.startswith("agent loop 'faulty' raised MalformedSample")
    assert words in bad.error, bad.error
    assert all(s.status == Status.COMPLETED for s in good)
    assert loop.pop_stats() == {"agent_loop/errors": 1.0}


def test_a_sample_without_logprobs_is_well_formed():
    loop = Faulty("no-logprobs")
    samples = [Sample(uid=0, group_id=0, task_name="t", prompt_ids=[1, 2])]
    asyncio.run(run_group_isolated(loop, samples))
    assert samples[0].status == Status.COMPLETED and loop.pop_stats() == {"agent_loop/errors": 0.0}


def test_a_token_id_beyond_the_models_vocabulary_is_left_out_of_training():
    """The loop cannot know the model's vocabulary; the runner can: such a sample is FAILED and left
    out (it would end the train step with an IndexError in the embedding)."""
    from rlcli.algo.advantage import GRPOAdvantage
    from rlcli.runner.sequences import sequences_from_groups
    from rlcli.types import Group

    def sample(uid, ids):
        return Sample(uid=uid, group_id=0, task_name="t", prompt_ids=[1, 2], response_ids=ids, logprobs=[-1.0] * 2,
                      response_mask=[1, 1], token_versions=[0, 0], status=Status.COMPLETED,
                      reward={"score": float(uid)})

    group = Group(group_id=0, task_name="t", samples=[sample(0, [3, 4]), sample(1, [3, 64]), sample(2, [5, 6])])
    seqs, _ = sequences_from_groups([group], GRPOAdvantage(), vocab_size=64)
    assert [s.seq_id for s in seqs] == [0, 2]
    bad = group.samples[1]
    assert bad.status == Status.FAILED and "token id 64 is beyond the model's vocabulary (64 ids)" in bad.error
    assert len(sequences_from_groups([Group(group_id=1, task_name="t", samples=[sample(3, [3, 64])])],
                                     GRPOAdvantage())[0]) == 1  # no vocabulary given: not checked
