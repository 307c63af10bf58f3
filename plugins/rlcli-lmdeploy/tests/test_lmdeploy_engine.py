"""The real LMDeploy engine through the plugin (GPU only; skipped with the reason elsewhere).

LMDeploy's PyTorch engine serves bf16/fp16 only, so the conformance kit runs with the bf16
tolerances, without ``sleep_wake`` (its CUDA part reads ``memory_allocated``; the plugin check
below reads free device memory) and with the logprob check restricted to temperature 1 and greedy
(LMDeploy returns temperature-1 logprobs; the kit's own check also samples at 0.7 and 0.8).
"""

from __future__ import annotations


import pytest
import torch

from rlcli.testing import backend_conformance as bc
from rlcli.testing.engine_plugins import check_quickstart_with_defaults
from rlcli_lmdeploy import LMDeployBackend

pytestmark = pytest.mark.gpu

TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
KIT_SKIP = ["sleep_wake", "logprobs_match_forward"]
KIT_OPTIONS = bc.engine_options(torch.bfloat16)


def make_backend(model_dir, **options):
    ctx = bc.default_context(model_dir, device="cuda", dtype=torch.bfloat16)
    cfg = dict(cache_max_entry_count=0.25, max_model_len=512, max_batch_size=256)
    cfg.update(options)
    return LMDeployBackend(LMDeployBackend.Config(**cfg), ctx)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return bc.make_tiny_model_dirs(tmp_path_factory.mktemp("lmdeploy-kit"), arch="qwen2", **TINY)


def test_conformance_kit(dirs):
    ran = bc.run_all(make_backend, dirs[0], dirs[1], skip=KIT_SKIP, options=KIT_OPTIONS)
    assert ran == [n for n in bc.ALL_CHECKS if n not in KIT_SKIP]


def test_logprobs_at_temperature_one_and_greedy(dirs):
    bc.check_logprobs_match_forward(make_backend, dirs[0], temperatures=(1.0, 0.0),
                                    **KIT_OPTIONS["logprobs_match_forward"])


def test_sleep_releases_device_memory_and_wake_restores_outputs(dirs):
    bc.check_sleep_frees_device_memory(lambda d: make_backend(d, cache_max_entry_count=0.3), dirs[0], min_fraction=0.5)


def test_the_engines_logits_are_float32(dirs):
    """``float32_logits``: LMDeploy's real model agent returns float32 logits (its logprobs are
    computed from them), and bfloat16 ones with the option off."""
    for upcast, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        be = make_backend(dirs[0], float32_logits=upcast)
        try:
            hidden = torch.randn(2, TINY["hidden_size"], dtype=torch.bfloat16, device="cuda")
            assert be._lmd.executor.model_agent.get_logits(hidden[None])[0].dtype == dtype
        finally:
            be.shutdown()


def test_quickstart_trains_with_the_default_kv_cache_sized_from_the_recipe(tmp_path):
    def kv_tokens(backend):  # LMDeploy's cache config after start-up (its reserved block included)
        cache = backend._lmd.cache_config
        return cache.num_gpu_blocks * cache.block_size

    # LMDeploy serves bfloat16/float16 only; otherwise the quickstart as it is
    check_quickstart_with_defaults("lmdeploy", tmp_path / "work", kv_tokens, ["model.dtype=bfloat16"])
