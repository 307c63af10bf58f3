"""The real SGLang engine through the plugin (GPU only; skipped with the reason elsewhere).

The conformance kit runs with every check but ``sleep_wake``, whose CUDA part reads
``torch.cuda.memory_allocated()`` of this process and cannot see the memory of SGLang's scheduler
process; the plugin check below reads free device memory (``torch.cuda.mem_get_info``) instead.
``many_concurrent`` compares greedy copies of a prompt only in SGLang's deterministic mode (below).
``RLCLI_GPU_TEST_DTYPE`` (default bfloat16; float16 also works) picks the engine dtype. float32 is
refused by the plugin: SGLang 0.5.17's fused RMSNorm (sgl-kernel) has no float32 path. The kit's
tolerances are loosened for 16-bit kernels against its float32 CPU reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from rlcli.testing import backend_conformance as bc
from rlcli.testing.engine_plugins import check_quickstart_with_defaults
from rlcli_sglang import SGLangBackend

pytestmark = pytest.mark.gpu

TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
DTYPE = getattr(torch, os.environ.get("RLCLI_GPU_TEST_DTYPE", "bfloat16"))
KIT_SKIP = ["sleep_wake"]
# 16-bit kernels against the fp32 CPU reference: greedy paths diverge after a near-tie, logprobs
# differ by bf16 rounding, and a paused-then-continued sequence need not match token for token.
KIT_OPTIONS = bc.engine_options(DTYPE)
KIT_SKIP += ["seeded_sampling_batch_invariant"]  # use_request_seeds is off by default (deterministic mode)
# SGLang's default kernels compute a sequence differently beside different neighbours: in the kit's
# 320-request load, greedy copies of one prompt parted at a near tie (1 prompt of 10), while alone,
# one at a time, and with enable_deterministic_inference they agreed (H200, 2026-12-02,
# benchmarks/backends.py --sections copies). The copies are compared in deterministic mode below.
KIT_OPTIONS["many_concurrent"] = {**KIT_OPTIONS.get("many_concurrent", {}), "copies_agree": False}


def make_backend(model_dir, **options):
    ctx = bc.default_context(model_dir, device="cuda", dtype=DTYPE)
    cfg = dict(mem_fraction_static=0.25, max_model_len=512)
    cfg.update(options)
    return SGLangBackend(SGLangBackend.Config(**cfg), ctx)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return bc.make_tiny_model_dirs(tmp_path_factory.mktemp("sglang-kit"), arch="qwen2", **TINY)


def test_conformance_kit(dirs):
    ran = bc.run_all(make_backend, dirs[0], dirs[1], skip=KIT_SKIP, options=KIT_OPTIONS)
    assert ran == [n for n in bc.ALL_CHECKS if n not in KIT_SKIP]


def test_seeded_sampling_in_deterministic_mode(dirs):
    def make(model_dir):  # use_request_seeds starts SGLang with enable_deterministic_inference
        return make_backend(model_dir, use_request_seeds=True)

    bc.check_seeded_sampling_batch_invariant(make, dirs[0])


def test_greedy_copies_agree_in_deterministic_mode(dirs):
    def make(model_dir):
        return make_backend(model_dir, use_request_seeds=True)

    bc.check_many_concurrent(make, dirs[0], batch_invariant=False)


def test_sleep_releases_device_memory_and_wake_restores_outputs(dirs):
    bc.check_sleep_frees_device_memory(lambda d: make_backend(d, mem_fraction_static=0.3), dirs[0], min_fraction={1: 0.3, 2: 0.5})


def test_quickstart_trains_with_the_default_kv_pool_sized_from_the_recipe(tmp_path):
    def kv_tokens(backend):  # the pool size the scheduler reported at start-up
        infos = getattr(getattr(backend._sgl, "_scheduler_init_result", None), "scheduler_infos", None)
        return int(infos[0]["max_total_num_tokens"]) if infos else None

    # SGLang serves bfloat16/float16 only; otherwise the quickstart as it is
    check_quickstart_with_defaults("sglang", tmp_path / "work", kv_tokens, ["model.dtype=bfloat16"])
