"""The real vLLM engine through the plugin (GPU only; skipped with the reason elsewhere).

The conformance kit runs with the checks vLLM can pass by design; the two it cannot are replaced
by plugin checks of the same property: logprobs are compared with the forward pass in the range
where the chosen ``logprobs_mode`` is exact (the kit also samples with top-k/top-p), and device
memory after ``sleep`` is read with ``torch.cuda.mem_get_info`` (the kit reads
``memory_allocated``, which does not see vLLM's sleep-mode memory pool).
"""

from __future__ import annotations


import pytest
import torch

from rlcli.testing import backend_conformance as bc
from rlcli.testing.engine_plugins import check_quickstart_with_defaults
from rlcli_vllm import VLLMBackend

pytestmark = pytest.mark.gpu

TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
KIT_SKIP = ["logprobs_match_forward", "sleep_wake"]
KIT_OPTIONS = bc.engine_options(torch.float32)  # fp32 on GPU (TF32 off): kernels differ in the last bits


def make_backend(model_dir, **options):
    ctx = bc.default_context(model_dir, device="cuda", dtype=torch.float32)
    cfg = dict(gpu_memory_utilization=0.25, cuda_graphs=False, max_model_len=512)
    cfg.update(options)
    return VLLMBackend(VLLMBackend.Config(**cfg), ctx)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return bc.make_tiny_model_dirs(tmp_path_factory.mktemp("vllm-kit"), arch="qwen2", **TINY)


def test_conformance_kit(dirs):
    torch.backends.cuda.matmul.allow_tf32 = False
    ran = bc.run_all(make_backend, dirs[0], dirs[1], skip=KIT_SKIP, options=KIT_OPTIONS)
    assert ran == [n for n in bc.ALL_CHECKS if n not in KIT_SKIP]


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_logprobs_match_the_forward_pass_where_the_mode_is_exact(dirs, mode):
    if mode == "processed_logprobs":
        settings = [dict(temperature=t) for t in (1.0, 0.7, 0.0)]
    else:
        settings = [dict(temperature=1.0), dict(temperature=1.0, top_k=5, top_p=0.9), dict(temperature=0.0)]
    bc.check_logprobs_match_forward(lambda d: make_backend(d, logprobs_mode=mode), dirs[0], settings=settings,
                                    max_tokens=12, **KIT_OPTIONS["logprobs_match_forward"])


def test_sleep_releases_device_memory_and_wake_restores_outputs(dirs):
    bc.check_sleep_frees_device_memory(lambda d: make_backend(d, gpu_memory_utilization=0.3), dirs[0], min_fraction=0.5)


def test_quickstart_trains_with_the_default_kv_cache_sized_from_the_recipe(tmp_path):
    def kv_tokens(backend):  # vLLM's cache as the engine core set it up (in process: the same config)
        cache = backend._engine.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None

    check_quickstart_with_defaults("vllm", tmp_path / "work", kv_tokens)
