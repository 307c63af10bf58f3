"""The SGLang plugin's pure logic: config -> server args, request phases, output parsing, checks."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from rlcli.types import SampleParams
from rlcli_sglang import SGLangBackend
from rlcli_sglang.logic import (
    ENGINE,
    batch_outputs,
    check_engine_kwargs,
    dtype_name,
    engine_kwargs,
    finish_reason,
    first_stop,
    parse_output,
    plan_phases,
    settle_finish,
    usable_context,
)

INF = float("-inf")


def cfg(**kw):
    return SGLangBackend.Config(**kw)


def test_engine_kwargs_defaults_and_managed_values():
    kw = engine_kwargs(cfg(), model_dir="/m", dtype=torch.bfloat16, seed=3, gpu_id=1)
    assert kw == dict(
        model_path="/m", skip_tokenizer_init=True, dtype="bfloat16", random_seed=3, base_gpu_id=1,
        enable_memory_saver=True, enable_weights_cpu_backup=True, incremental_streaming_output=False,
        mem_fraction_static=0.5, tp_size=1, disable_cuda_graph=False, log_level="error",
    )


def test_engine_kwargs_maps_rlcli_names_to_sglang_ones():
    kw = engine_kwargs(cfg(max_model_len=2048, max_batch_size=256, engine_kwargs={"attention_backend": "fa3"}),
                       model_dir="/m", dtype=torch.float16, seed=0, gpu_id=0)
    assert kw["context_length"] == 2048 and kw["max_running_requests"] == 256 and kw["attention_backend"] == "fa3"
    assert kw["dtype"] == "float16"


def test_decode_graphs_cover_the_run_batch_unless_told_otherwise():
    def kw(**c):
        return engine_kwargs(cfg(**c), model_dir="/m", dtype=torch.bfloat16, seed=0, gpu_id=0)

    assert kw(max_batch_size=512)["cuda_graph_max_bs_decode"] == 512  # SGLang's own stops at 256 on an H200
    assert kw(max_batch_size=64)["cuda_graph_max_bs_decode"] == 64
    assert kw(max_batch_size=4096)["cuda_graph_max_bs_decode"] == 1024  # bounded start-up and memory
    run = engine_kwargs(cfg(), model_dir="/m", dtype=torch.bfloat16, seed=0, gpu_id=0, max_batch_size=768)
    assert run["max_running_requests"] == 768 and run["cuda_graph_max_bs_decode"] == 768  # the run's batch
    assert "cuda_graph_max_bs_decode" not in kw()  # no batch known: SGLang's default
    assert "cuda_graph_max_bs_decode" not in kw(max_batch_size=512, cuda_graphs=False)
    assert kw(max_batch_size=512, engine_kwargs={"cuda_graph_max_bs_decode": 128})["cuda_graph_max_bs_decode"] == 128
    listed = kw(max_batch_size=512, engine_kwargs={"cuda_graph_bs_decode": [1, 8, 64]})
    assert "cuda_graph_max_bs_decode" not in listed and listed["cuda_graph_bs_decode"] == [1, 8, 64]


def test_float32_is_refused_with_the_measured_reason():
    # SGLang 0.5.17 on an H200: sgl-kernel's RMSNorm has no float32 path, the scheduler dies at start-up
    with pytest.raises(ValueError, match="model.dtype: bfloat16") as exc:
        engine_kwargs(cfg(), model_dir="/m", dtype=torch.float32, seed=0, gpu_id=0)
    assert "failed to dispatch data type Float" in str(exc.value) and "RMSNorm" in str(exc.value)
    with pytest.raises(ValueError, match="bfloat16"):
        dtype_name(torch.float64)
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(torch.float16) == "float16"


def test_validate_reports_a_float32_recipe():
    from types import SimpleNamespace as NS

    def recipe(dtype):
        return NS(rollout=NS(name="sglang"), resources=NS(device="cuda"), model=NS(dtype=dtype))

    issues = SGLangBackend.check_recipe(recipe("float32"))
    assert [f for f, _ in issues] == ["model.dtype"] and "bfloat16" in issues[0][1]
    assert SGLangBackend.check_recipe(recipe("bfloat16")) == SGLangBackend.check_recipe(recipe("auto")) == []


def test_request_seeds_turn_on_sglang_deterministic_mode():
    # SGLang reads sampling_seed only with enable_deterministic_inference
    assert engine_kwargs(cfg(use_request_seeds=True), model_dir="/m", dtype=torch.bfloat16, seed=0,
                         gpu_id=0)["enable_deterministic_inference"] is True
    assert "enable_deterministic_inference" not in engine_kwargs(cfg(), model_dir="/m", dtype=torch.bfloat16,
                                                                 seed=0, gpu_id=0)


def test_usable_context():
    assert usable_context(512) == 510  # max_req_len = 511, max_new_tokens <= max_req_len - prompt - 1
    assert usable_context(512, 506) == 510 and usable_context(512, 100) == 104  # KV-pool bound


def test_engine_kwargs_conflicts():
    issues = check_engine_kwargs({"context_length": 4, "skip_tokenizer_init": False, "attention_backend": "fa3"})
    assert len(issues) == 2 and all(f == "engine_kwargs" for f, _ in issues)
    assert "use the max_model_len option" in issues[0][1] and "token-in/token-out" in issues[1][1]


def test_single_phase_engine_stops():
    p = SampleParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=0, stop_token_ids=[7])
    (phase,) = plan_phases(p, stop_ids=[2, 7], budget=16, seed=5)
    assert not phase.stream and phase.max_new == 16
    s = phase.sampling
    assert s["max_new_tokens"] == 16 and s["stop_token_ids"] == [2, 7] and s["ignore_eos"] is False
    assert (s["temperature"], s["top_p"], s["top_k"]) == (0.8, 0.9, -1)  # top_k 0 -> SGLang's -1
    assert s["sampling_seed"] == 5 and s["min_new_tokens"] == 0 and "logit_bias" not in s
    assert (s["repetition_penalty"], s["frequency_penalty"], s["presence_penalty"], s["min_p"]) == (1.0, 0.0, 0.0, 0.0)


def test_greedy_phase():
    (phase,) = plan_phases(SampleParams(temperature=0.0, top_k=4, top_p=0.5), stop_ids=[2], budget=3, seed=None)
    s = phase.sampling
    assert (s["temperature"], s["top_p"], s["top_k"]) == (0.0, 1.0, -1) and "sampling_seed" not in s


def test_ignore_eos_alone_is_sglang_ignore_eos():
    (phase,) = plan_phases(SampleParams(ignore_eos=True), stop_ids=[], budget=8, seed=None)
    assert phase.sampling["ignore_eos"] is True and not phase.stream and "stop_token_ids" not in phase.sampling


def test_ignore_eos_with_stop_ids_becomes_plugin_side_stops():
    p = SampleParams(ignore_eos=True, stop_token_ids=[4, 9])
    (phase,) = plan_phases(p, stop_ids=[4, 9], budget=8, seed=None)
    assert phase.stream and phase.plugin_stops == frozenset({4, 9}) and phase.sampling["ignore_eos"] is True


def test_min_tokens_is_two_phases_with_stop_ids_banned_first():
    p = SampleParams(max_tokens=10, min_tokens=3, stop_token_ids=[6])
    first, rest = plan_phases(p, stop_ids=[2, 6], budget=10, seed=100)
    assert first.max_new == 3 and first.sampling["max_new_tokens"] == 3 and first.sampling["ignore_eos"] is True
    assert first.sampling["logit_bias"] == {"2": INF, "6": INF} and not first.stream
    assert rest.max_new == 7 and rest.sampling["stop_token_ids"] == [2, 6] and "logit_bias" not in rest.sampling
    assert first.sampling["sampling_seed"] == 100 and rest.sampling["sampling_seed"] == 101
    # min_tokens equal to the budget: one phase, stop ids banned throughout
    (only,) = plan_phases(SampleParams(max_tokens=3, min_tokens=3), stop_ids=[2], budget=3, seed=None)
    assert only.sampling["logit_bias"] == {"2": INF}
    # nothing to suppress: min_tokens needs no phase of its own
    (one,) = plan_phases(SampleParams(max_tokens=5, min_tokens=5, ignore_eos=True), stop_ids=[], budget=5, seed=None)
    assert "logit_bias" not in one.sampling and one.max_new == 5


def test_first_stop():
    assert first_stop([1, 2, 3, 2], frozenset({2})) == 1
    assert first_stop([1, 3], frozenset({2})) is None
    assert first_stop([], frozenset({2})) is None


def test_parse_output_converts_what_is_not_plain_ints_and_floats():
    out = {"output_ids": (5, np.int64(6)), "meta_info": {"finish_reason": "length",
                                                         "output_token_logprobs": [(-1, 5, None), (-0.5, 6, None)]}}
    ids, lps, ftype, _ = parse_output(out)
    assert (ids, lps, ftype) == ([5, 6], [-1.0, -0.5], "length")
    assert [type(t) for t in ids] == [int, int] and [type(v) for v in lps] == [float, float]


def test_parse_output_without_logprobs_reads_output_ids():
    out = {"output_ids": [5, 6, 2], "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 2}}}
    assert parse_output(out, with_logprobs=False) == ([5, 6, 2], [], "stop", None)
    aborted = {"output_ids": [5], "meta_info": {"finish_reason": {"type": "abort", "message": "Aborted"}}}
    assert parse_output(aborted, with_logprobs=False) == ([5], [], "abort", "Aborted")
    assert parse_output({"output_ids": [], "meta_info": {"finish_reason": "length"}}, with_logprobs=False) == (
        [], [], "length", None)


def test_parse_output_final_and_stream_chunks():
    out = {"output_ids": [5, 6, 2], "meta_info": {
        "id": "r", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "completion_tokens": 3,
        "output_token_logprobs": [(-0.5, 5, None), (-1.0, 6, None), (-0.25, 2, None)]}}
    assert parse_output(out) == ([5, 6, 2], [-0.5, -1.0, -0.25], "stop", None)
    chunk = {"output_ids": [5, 6], "meta_info": {"finish_reason": None, "output_token_logprobs": [(-0.5, 5, None)]}}
    assert parse_output(chunk) == ([5], [-0.5], None, None)  # only tokens with their logprob
    aborted = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "Abort before prefill"}}}
    assert parse_output(aborted) == ([], [], "abort", "Abort before prefill")
    # _handle_abort_req of a queued streamed request: output_ids is the last token, logprobs cumulative
    echo = {"output_ids": [6], "meta_info": {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                                             "output_token_logprobs": [(-0.5, 5, None), (-1.0, 6, None)]}}
    assert parse_output(echo) == ([5, 6], [-0.5, -1.0], "abort", "Abort in waiting queue")
    bad = {"output_ids": [5], "meta_info": {"output_token_logprobs": [(-0.5, 7, None)]}}
    with pytest.raises(ValueError, match="for token 7"):
        parse_output(bad)
    missing = {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [(-0.5, 5, None), (None, 6, None)]}}
    with pytest.raises(ValueError, match=r"no logprob for output position 1: \(None, 6, None\)"):
        parse_output(missing)
    later = {"output_ids": [5, 6, 8], "meta_info": {"output_token_logprobs": [(-0.5, 5, None), (-1.0, 6, None),
                                                                              (-1.0, 7, None)]}}
    with pytest.raises(ValueError, match="entry 2 is for token 7"):
        parse_output(later)
    short = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                                 "output_token_logprobs": [(-0.5, 5, None)]}}
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        parse_output(short)


def test_batch_outputs_are_one_list_in_batch_order():
    outs = [{"output_ids": [], "meta_info": {"id": rid}} for rid in ("a.0", "b.0")]
    assert batch_outputs(outs, ["a.0", "b.0"]) == outs
    with pytest.raises(ValueError, match="output 0 is for request 'a.0', not 'b.0'"):
        batch_outputs(outs, ["b.0", "a.0"])
    with pytest.raises(ValueError, match="batch of 3 requests with list of 2 outputs"):
        batch_outputs(outs, ["a.0", "b.0", "c.0"])
    with pytest.raises(ValueError, match="with dict of no outputs"):
        batch_outputs(outs[0], ["a.0"])  # a single request's answer


def test_settle_finish():
    # SGLang checks the length limit before stop ids, and a pending abort before both
    assert settle_finish("length", None, [4, 2], [2], 2) == ("stop", None)
    assert settle_finish("length", None, [4, 5], [2], 2) == ("length", None)
    assert settle_finish("abort", None, [4, 2], [2], 9) == ("stop", None)
    assert settle_finish("abort", None, [4, 5], [2], 2) == ("length", None)
    assert settle_finish("abort", None, [4], [2], 2) == ("abort", None)
    assert settle_finish("abort", None, [], [2], 2) == ("abort", None)
    assert settle_finish("error", "boom", [2], [2], 1) == ("error", "boom")


@pytest.mark.parametrize("ftype, expected", [("stop", "stop"), ("length", "length"), ("abort", "abort"),
                                              (None, "error"), ("weird", "error")])
def test_finish_reason(ftype, expected):
    assert finish_reason(ftype, None)[0] == expected


def test_check_config_names_the_exact_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name))
    assert SGLangBackend.check_config(cfg()) == [
        ("name", 'the SGLang engine is not installed (the \'sglang\' package cannot be imported); install it with: '
                 'pip install "rlcli-sglang[engine]"  (that is sglang==0.5.17, on a CUDA machine whose torch matches it)')
    ]


def test_check_config_versions(monkeypatch):
    monkeypatch.setattr(type(ENGINE), "installed_version", lambda self: "0.5.16")
    assert "sglang 0.5.16 is older than 0.5.17" in dict(SGLangBackend.check_config(cfg()))["name"]
    monkeypatch.setattr(type(ENGINE), "installed_version", lambda self: "0.5.17")
    assert SGLangBackend.check_config(cfg()) == [] and ENGINE.describe() == "sglang 0.5.17"
