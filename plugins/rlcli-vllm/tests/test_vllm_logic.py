"""The vLLM plugin's pure logic: config -> engine args, sampling params, output parsing, checks."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from fake_vllm import FlatLogprobs

from rlcli.types import SampleParams
from rlcli_vllm import VLLMBackend
from rlcli_vllm.logic import (
    ENGINE,
    MANAGED_ENGINE_KWARGS,
    WORKER_EXTENSION,
    check_engine_kwargs,
    engine_environment,
    engine_kwargs,
    finish_reason,
    logprob_caveat,
    memory_kwargs,
    request_problem,
    sampling_kwargs,
    token_logprobs,
)


def cfg(**kw):
    return VLLMBackend.Config(**kw)


def test_engine_kwargs_defaults_and_managed_values():
    kw = engine_kwargs(cfg(), model_dir="/m", dtype=torch.bfloat16, seed=7)
    assert kw["model"] == "/m" and kw["dtype"] == "bfloat16" and kw["seed"] == 7
    assert kw["skip_tokenizer_init"] is True and kw["enable_sleep_mode"] is True
    assert kw["worker_extension_cls"] == WORKER_EXTENSION == "rlcli_vllm.worker_extension.RlcliWorkerExtension"
    assert kw["generation_config"] == "vllm" and kw["distributed_executor_backend"] == "uni"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["gpu_memory_utilization"] == 0.5
    # options left at None are not passed: vLLM's own defaults apply
    assert "max_model_len" not in kw and "max_num_seqs" not in kw and "enable_prefix_caching" not in kw


def test_engine_kwargs_maps_options_and_passes_extras_through():
    c = cfg(max_model_len=1024, max_batch_size=512, enable_prefix_caching=False, cuda_graphs=False,
            logprobs_mode="raw_logprobs", engine_kwargs={"kv_cache_dtype": "fp8", "async_scheduling": False})
    kw = engine_kwargs(c, model_dir="/m", dtype=torch.float32, seed=0)
    assert kw["max_model_len"] == 1024 and kw["max_num_seqs"] == 512
    assert kw["enable_prefix_caching"] is False and kw["enforce_eager"] is True
    assert kw["logprobs_mode"] == "raw_logprobs" and kw["dtype"] == "float32"
    assert kw["kv_cache_dtype"] == "fp8" and kw["async_scheduling"] is False


def test_engine_kwargs_refuses_unsupported_dtype():
    with pytest.raises(ValueError, match="float64"):
        engine_kwargs(cfg(), model_dir="/m", dtype=torch.float64, seed=0)


def test_engine_kwargs_conflicts_are_reported():
    issues = check_engine_kwargs({"dtype": "half", "max_num_seqs": 4, "kv_cache_dtype": "fp8"})
    assert [f for f, _ in issues] == ["engine_kwargs", "engine_kwargs"]
    assert "'dtype' is set by the plugin" in issues[0][1]
    assert "use the max_batch_size option" in issues[1][1]
    assert check_engine_kwargs({"bogus": 1}, known={"kv_cache_dtype"}) == [
        ("engine_kwargs", "'bogus' is not a vllm.EngineArgs field")
    ]
    assert set(MANAGED_ENGINE_KWARGS) >= {"model", "skip_tokenizer_init", "enable_sleep_mode", "worker_extension_cls"}


def test_sampling_kwargs_sampled_request():
    p = SampleParams(max_tokens=64, min_tokens=3, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[5])
    kw = sampling_kwargs(p, stop_ids=[2, 5], budget=40, seed=123)
    assert kw["max_tokens"] == 40 and kw["min_tokens"] == 3
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.7, 0.9, 20)
    assert kw["stop_token_ids"] == [2, 5] and kw["ignore_eos"] is True  # vLLM's own EOS off, ours in the list
    assert kw["logprobs"] == 0 and kw["flat_logprobs"] is True and kw["detokenize"] is False
    skip = sampling_kwargs(p.model_copy(update={"return_logprob": False}), stop_ids=[2, 5], budget=40, seed=123)
    assert "logprobs" not in skip and "flat_logprobs" not in skip and skip["max_tokens"] == 40
    assert kw["seed"] == 123 and kw["n"] == 1
    assert (kw["repetition_penalty"], kw["presence_penalty"], kw["frequency_penalty"], kw["min_p"]) == (1.0, 0.0, 0.0, 0.0)


def test_sampling_kwargs_greedy_and_disabled_top_k():
    kw = sampling_kwargs(SampleParams(temperature=0.0, top_p=0.5, top_k=3), stop_ids=[], budget=8, seed=None)
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.0, 1.0, 0)
    assert "seed" not in kw and kw["stop_token_ids"] == []
    kw = sampling_kwargs(SampleParams(temperature=1.0, top_k=0), stop_ids=[], budget=8, seed=None)
    assert kw["top_k"] == 0  # 0 disables top-k in rlcli and in vLLM


def test_sampling_kwargs_min_tokens_never_exceeds_the_budget():
    kw = sampling_kwargs(SampleParams(max_tokens=10, min_tokens=10), stop_ids=[2], budget=4, seed=None)
    assert kw["max_tokens"] == 4 and kw["min_tokens"] == 4


def test_token_logprobs_from_flat_logprobs_delta():
    flat = FlatLogprobs(
        start_indices=[0, 2, 3], end_indices=[2, 3, 5],
        token_ids=[9, 4, 6, 1, 8], logprobs=[-0.1, -0.7, -0.3, -0.2, -2.0],
        ranks=[1, 2, 1, 1, 3], decoded_tokens=[None] * 5,
    )
    assert token_logprobs([4, 6, 8], flat) == [-0.7, -0.3, -2.0]  # sampled token not always first
    assert token_logprobs([6, 8], flat) == [-0.3, -2.0]  # the last len(token_ids) positions
    assert token_logprobs([], None) == []
    with pytest.raises(ValueError, match="lack the sampled token 7"):
        token_logprobs([4, 6, 7], flat)
    with pytest.raises(ValueError, match="no logprobs"):
        token_logprobs([1], None)
    with pytest.raises(ValueError, match="3 positions, 4 tokens"):
        token_logprobs([0, 4, 6, 8], flat)


def test_token_logprobs_from_list_of_dicts():
    class Logprob:  # vllm.logprobs.Logprob(logprob, rank, decoded_token)
        def __init__(self, logprob):
            self.logprob, self.rank, self.decoded_token = logprob, 1, None

    positions = [{3: Logprob(-0.5)}, {1: Logprob(-0.1), 4: Logprob(-1.5)}]
    assert token_logprobs([3, 4], positions) == [-0.5, -1.5]
    assert token_logprobs([4], [{4: -0.25}]) == [-0.25]
    with pytest.raises(ValueError, match="lack the sampled token 9"):
        token_logprobs([3, 9], positions)


@pytest.mark.parametrize(
    "vllm_reason, ours",
    [("stop", "stop"), ("length", "length"), ("abort", "abort"), ("error", "error"), ("repetition", "length"),
     ("something new", "error"), (None, None)],
)
def test_finish_reason_mapping(vllm_reason, ours):
    assert finish_reason(vllm_reason) == ours


def test_logprob_caveats_name_the_inexact_cases():
    assert logprob_caveat("processed_logprobs", SampleParams(temperature=0.6)) is None
    assert logprob_caveat("processed_logprobs", SampleParams(temperature=0.0, top_k=5)) is None
    assert "top-k/top-p" in logprob_caveat("processed_logprobs", SampleParams(temperature=1.0, top_p=0.9))
    assert logprob_caveat("raw_logprobs", SampleParams(temperature=1.0, top_k=5, top_p=0.5)) is None
    assert "temperature 0.6" in logprob_caveat("raw_logprobs", SampleParams(temperature=0.6))


def test_logprob_caveats_for_clamped_temperatures_and_min_tokens():
    assert "raises temperatures below 0.01" in logprob_caveat("processed_logprobs", SampleParams(temperature=0.004))
    assert "raises temperatures below 0.01" in logprob_caveat("raw_logprobs", SampleParams(temperature=0.004))
    assert "min_tokens" in logprob_caveat("processed_logprobs", SampleParams(max_tokens=8, min_tokens=8))
    assert "min_tokens" in logprob_caveat("processed_logprobs", SampleParams(temperature=0.0, min_tokens=2))
    assert logprob_caveat("raw_logprobs", SampleParams(max_tokens=8, min_tokens=8)) is None  # raw: no mask


def test_request_problem_mirrors_vllm_temperature_range():
    assert request_problem(SampleParams(temperature=2.0)) is None
    assert request_problem(SampleParams(temperature=0.0)) is None
    assert "[0, 2]" in request_problem(SampleParams(temperature=2.01))
    many = list(range(129))
    assert "at most 128 stop ids" in request_problem(SampleParams(min_tokens=1), many)
    assert request_problem(SampleParams(min_tokens=0), many) is None  # no mask without min_tokens
    assert request_problem(SampleParams(min_tokens=1), many[:128] + [0]) is None


def test_engine_environment_keeps_float32_attention_out_of_tf32():
    assert engine_environment(torch.float32, {}) == {"TRITON_F32_DEFAULT": "ieee"}
    assert engine_environment(torch.float32, {"TRITON_F32_DEFAULT": "tf32"}) == {}  # the user's choice stays
    assert engine_environment(torch.bfloat16, {}) == {} and engine_environment(torch.float16, {}) == {}


def test_sampling_kwargs_are_accepted_by_vllms_validation():
    from fake_vllm import RequestOutputKind, SamplingParams  # validates like vllm/sampling_params.py

    for p in (SampleParams(), SampleParams(temperature=0.0, top_k=7, top_p=0.3), SampleParams(temperature=2.0),
              SampleParams(max_tokens=4, min_tokens=4, top_k=100000, stop_token_ids=[3, 4])):
        sp = SamplingParams(**sampling_kwargs(p, stop_ids=p.stop_token_ids, budget=p.max_tokens, seed=2**63 - 1),
                            output_kind=RequestOutputKind.FINAL_ONLY)
        assert sp.max_tokens == p.max_tokens and sp.logprobs == 0


def test_check_config_names_the_exact_install_line(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else _real_find_spec(name))
    issues = VLLMBackend.check_config(cfg())
    assert issues == [
        ("name", 'the vLLM engine is not installed (the \'vllm\' package cannot be imported); install it with: '
                 'pip install "rlcli-vllm[engine]"  (that is vllm==0.26.0, on a CUDA machine whose torch matches it)')
    ]


def test_check_config_version_and_options(monkeypatch):
    monkeypatch.setattr(type(ENGINE), "installed_version", lambda self: "0.25.1")
    issues = dict(VLLMBackend.check_config(cfg(tensor_parallel_size=2, engine_kwargs={"seed": 1})))
    assert "vllm 0.25.1 is older than 0.26.0" in issues["name"] and 'pip install "rlcli-vllm[engine]"' in issues["name"]
    assert "tensor_parallel_size must be 1" in issues["tensor_parallel_size"]
    assert "'seed' is set by the plugin" in issues["engine_kwargs"]
    monkeypatch.setattr(type(ENGINE), "installed_version", lambda self: "0.27.1")
    assert VLLMBackend.check_config(cfg()) == []  # newer: allowed (untested)
    assert ENGINE.describe() == "vllm 0.27.1, tested with 0.26.0"


def test_config_validation():
    with pytest.raises(Exception, match="logprobs_mode"):
        cfg(logprobs_mode="processed_logits")
    with pytest.raises(Exception, match="gpu_memory_utilization"):
        cfg(gpu_memory_utilization=1.5)
    with pytest.raises(Exception, match="extra"):
        cfg(max_num_seqs=4)  # the rlcli name is max_batch_size


_real_find_spec = importlib.util.find_spec


def test_auto_share_is_what_the_weights_and_the_kv_cache_take_of_the_device():
    kv = SimpleNamespace(nbytes=10 * 2**30)
    mem = memory_kwargs(cfg(), kv, weight_bytes=2**30, device_bytes=140 * 2**30)
    assert mem == {"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": 10 * 2**30}  # 11/140, rounded up
    assert memory_kwargs(cfg()) == {"gpu_memory_utilization": 0.5}  # no workload to size from
    assert memory_kwargs(cfg(gpu_memory_utilization=0.2), kv) == {"gpu_memory_utilization": 0.2}
    assert check_engine_kwargs({"kv_cache_memory_bytes": 2**30})  # sized by the option, not engine_kwargs
