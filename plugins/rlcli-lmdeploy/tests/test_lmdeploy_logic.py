"""The LMDeploy plugin's pure logic: config -> engine config, generation config, outputs, checks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlcli.types import SampleParams
from rlcli_lmdeploy import LMDeployBackend
from rlcli_lmdeploy.logic import (
    ENGINE,
    check_engine_kwargs,
    engine_config_kwargs,
    finish_from_status,
    generation_kwargs,
    logprob_caveat,
    request_problem,
    token_logprobs,
)


def cfg(**kw):
    return LMDeployBackend.Config(**kw)


def test_engine_config_defaults_and_managed_values():
    kw = engine_config_kwargs(cfg(), dtype=torch.bfloat16)
    assert kw == dict(dtype="bfloat16", tp=1, device_type="cuda", logprobs_mode="raw_logprobs",
                      enable_prefix_caching=False, enable_mp_engine=False, distributed_executor_backend="uni",
                      cache_max_entry_count=0.5, eager_mode=False, hf_overrides={"pad_token_id": None})


def test_the_pad_token_row_is_served_as_the_checkpoint_has_it():
    """LMDeploy zeroes the pad token's embedding row (and so, tied, its LM head row) at every weight
    load; measured on the H200 as a 2.4-nat logprob error, reproduced on CPU by zeroing that row."""
    kw = engine_config_kwargs(cfg(engine_kwargs={"hf_overrides": {"rope_scaling": {"factor": 2.0}}}),
                              dtype=torch.bfloat16)
    assert kw["hf_overrides"] == {"pad_token_id": None, "rope_scaling": {"factor": 2.0}}
    own = engine_config_kwargs(cfg(engine_kwargs={"hf_overrides": {"pad_token_id": 7}}), dtype=torch.bfloat16)
    assert own["hf_overrides"] == {"pad_token_id": 7}  # a run that sets its own keeps it


def test_engine_config_maps_rlcli_names_and_passes_extras():
    kw = engine_config_kwargs(cfg(max_model_len=1024, max_batch_size=512, engine_kwargs={"block_size": 32}),
                              dtype=torch.float16)
    assert kw["session_len"] == 1024 and kw["max_batch_size"] == 512 and kw["block_size"] == 32
    assert kw["dtype"] == "float16"
    # without max_model_len: the model's context (LMDeploy's Engine would take the KV cache's size)
    assert engine_config_kwargs(cfg(), dtype=torch.bfloat16, session_len=32768)["session_len"] == 32768
    assert engine_config_kwargs(cfg(max_model_len=512), dtype=torch.bfloat16, session_len=32768)["session_len"] == 512


def test_fp32_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        engine_config_kwargs(cfg(), dtype=torch.float32)


def test_engine_kwargs_conflicts():
    issues = check_engine_kwargs({"enable_prefix_caching": True, "logprobs_mode": "raw_logits", "block_size": 16})
    assert [f for f, _ in issues] == ["engine_kwargs", "engine_kwargs"]
    assert "cannot invalidate cached prefixes" in issues[0][1]


def test_generation_kwargs_sampled():
    p = SampleParams(max_tokens=50, min_tokens=4, temperature=0.7, top_p=0.8, top_k=0, stop_token_ids=[9])
    kw = generation_kwargs(p, stop_ids=[2, 9], budget=30, seed=77)
    assert kw["max_new_tokens"] == 30 and kw["min_new_tokens"] == 4 and kw["do_sample"] is True
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"]) == (0.7, 0.8, 0, 0.0)  # top_k 0: disabled
    assert kw["stop_token_ids"] == [2, 9] and kw["ignore_eos"] is False  # never LMDeploy's ignore_eos (it bans)
    assert kw["logprobs"] == 1 and kw["random_seed"] == 77 and kw["repetition_penalty"] == 1.0
    assert generation_kwargs(p.model_copy(update={"return_logprob": False}), stop_ids=[2], budget=30,
                             seed=None)["logprobs"] is None


def test_generation_kwargs_greedy_and_ignore_eos():
    kw = generation_kwargs(SampleParams(temperature=0.0, top_k=9, ignore_eos=True), stop_ids=[], budget=5, seed=None)
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["do_sample"]) == (1.0, 1, 1.0, False)
    assert kw["stop_token_ids"] is None and "random_seed" not in kw
    assert generation_kwargs(SampleParams(max_tokens=9, min_tokens=9), stop_ids=[2], budget=3,
                             seed=None)["min_new_tokens"] == 3


def test_token_logprobs():
    assert token_logprobs([5, 6], [{5: -0.5, 1: -0.1}, {6: -2.0}]) == [-0.5, -2.0]
    assert token_logprobs([], None) == []
    with pytest.raises(ValueError, match="no logprobs"):
        token_logprobs([5], None)
    with pytest.raises(ValueError, match="1 positions, 2 tokens"):
        token_logprobs([5, 6], [{5: -0.5}])
    with pytest.raises(ValueError, match="lack the sampled token 6"):
        token_logprobs([6], [{5: -0.5}])


@pytest.mark.parametrize(
    "status, tokens, expected",
    [("SUCCESS", [1], (None, None)), ("FINISH", [1, 2], ("stop", None)), ("FINISH", [1, 3], ("length", None)),
     ("FINISH", [], ("length", None)), ("CANCEL", [1], ("abort", None)),
     ("INPUT_LENGTH_ERROR", [], ("error", "LMDeploy ended the request with INPUT_LENGTH_ERROR"))],
)
def test_finish_from_status(status, tokens, expected):
    assert finish_from_status(status, tokens, [2]) == expected


def test_request_problem_and_caveat():
    assert "up to 2.0" in request_problem(SampleParams(temperature=2.5))
    assert request_problem(SampleParams(temperature=2.0)) is None
    assert logprob_caveat(SampleParams(temperature=1.0, top_k=3)) is None
    assert logprob_caveat(SampleParams(temperature=0.0)) is None
    assert "temperature 0.5" in logprob_caveat(SampleParams(temperature=0.5))


def test_check_config_names_the_exact_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lmdeploy" else real(name))
    assert LMDeployBackend.check_config(cfg()) == [
        ("name", 'the LMDeploy engine is not installed (the \'lmdeploy\' package cannot be imported); install it '
                 'with: pip install "rlcli-lmdeploy[engine]"  (that is lmdeploy==0.18.0, on a CUDA machine whose '
                 'torch matches it)')
    ]


def test_check_config_versions(monkeypatch):
    monkeypatch.setattr(type(ENGINE), "installed_version", lambda self: "0.17.0")
    assert "lmdeploy 0.17.0 is older than 0.18.0" in dict(LMDeployBackend.check_config(cfg()))["name"]
    monkeypatch.setattr(type(ENGINE), "installed_version", lambda self: "0.18.0")
    assert LMDeployBackend.check_config(cfg(engine_kwargs={"tp": 2})) == [
        ("engine_kwargs", "'tp' is set by the plugin (one GPU per engine (the plugin loads weights in process))")
    ]


def test_upcast_logits_wraps_get_logits_once():
    from types import SimpleNamespace

    from rlcli_lmdeploy.logic import upcast_logits

    calls = []
    agent = SimpleNamespace(get_logits=lambda h: calls.append(1) or h.to(torch.bfloat16))
    upcast_logits(agent)
    upcast_logits(agent)  # idempotent: one float() around the original
    out = agent.get_logits(torch.ones(2, 3))
    assert out.dtype == torch.float32 and calls == [1]
