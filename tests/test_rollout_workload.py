"""The workload a run asks of its inference backend (rlcli.runner.workload) and the KV cache the engine
plugins size from it (rlcli.backends.engine_runtime.kv_budget)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from rlcli.backends.base import RolloutWorkload
from rlcli.backends.engine_runtime import KV_MARGIN_PERCENT, KVShape, kv_shape_from_config, plan_kv_cache, read_model_info
from rlcli.config import load_recipe
from rlcli.runner.workload import rollout_workload


class Sampler:
    """A prepared sampler as the workload reads it: its prompts' lengths and their number."""

    def __init__(self, lengths):
        self.lengths = lengths

    def prompt_lengths(self):
        return self.lengths

    def __len__(self):
        return len(self.lengths or [0] * 100)


@pytest.fixture(scope="module")
def quickstart(repo):
    return load_recipe(repo / "recipes" / "quickstart.yaml")


def test_the_runner_passes_the_recipe_workload_to_the_backend(quickstart, tmp_path):
    from rlcli.runner.setup import Environment

    env = Environment(quickstart, tmp_path)
    samplers = dict(env.prepare_samplers(quickstart.tasks + quickstart.eval.tasks, trained=quickstart.tasks))
    env.rollout_spec = SimpleNamespace(build=lambda ctx: ctx)  # the context the backend would get
    ctx = env.build_backend()
    longest = max(samplers["arith"].prompt_lengths() + samplers["arith_eval"].prompt_lengths())
    # 100 groups of 8 (train) against 100 eval prompts of 1; the response is max_tokens=1 token
    assert ctx.workload == RolloutWorkload(max_sequences=100 * 8, max_sequence_tokens=longest + 1,
                                           train_sequences=100 * 8)


def test_workload_counts_over_sampling_shards_and_the_largest_eval_task(repo):
    recipe = load_recipe(repo / "recipes" / "quickstart.yaml", [
        "tasks.0.produce_strategy={name: async, over_sample_threshold: 0.5}",
        "tasks.0.agent_loop.sample_params.max_tokens=20"])
    train, ev = recipe.tasks[0], recipe.eval.tasks[0]
    prepared = [(train, Sampler([5, 9])), (ev, Sampler([7] * 90))]
    # replica 1 of 3: 33 groups of the step's 100, +ceil(0.5 x 33) over-sampled, 8 samples each
    w = rollout_workload(prepared, recipe.tasks, 100, recipe.eval.evaluator, (1, 3))
    assert w == RolloutWorkload(max_sequences=(33 + 17) * 8, max_sequence_tokens=9 + 20, train_sequences=(33 + 17) * 8)
    # an eval task larger than a training step sets the number; eval alone (`rlcli eval`) too
    big = [(train, Sampler([5])), (ev, Sampler([7] * 5000))]
    assert rollout_workload(big, recipe.tasks, 100, None, (0, 1)) == RolloutWorkload(5000, 5 + 20, (100 + 50) * 8)
    eval_cfg = recipe.eval.evaluator.model_copy(update={"sample_num": 300})
    assert rollout_workload(big[1:], recipe.tasks, 100, eval_cfg, (0, 2)) == RolloutWorkload(150, 7 + 1, 0)  # eval alone: its max_tokens 1
    # a sampler that cannot tell its prompts' lengths (and sets no max_prompt_length): length unknown
    unknown = rollout_workload([(train, Sampler(None))], recipe.tasks, 4, None, (0, 1))
    assert unknown == RolloutWorkload((4 + 2) * 8, None, (4 + 2) * 8)  # 4 groups + ceil(0.5 x 4) over-sampled
    assert rollout_workload([], recipe.tasks, 100, None, (0, 1)) is None


def test_kv_shape_reads_the_model_config_and_fills_in_head_dim():
    shape = kv_shape_from_config(SimpleNamespace(num_hidden_layers=3, num_attention_heads=8, hidden_size=256))
    assert shape == KVShape(layers=3, kv_heads=8, head_dim=32)  # no kv heads: MHA; head_dim = 256 / 8
    assert shape.bytes_per_token(2) == 2 * 3 * 8 * 32 * 2
    # GQA with an explicit head_dim (a multimodal model's text config: read_model_info passes get_text_config())
    gqa = SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                          hidden_size=512)
    assert kv_shape_from_config(gqa) == KVShape(layers=2, kv_heads=2, head_dim=128)


def test_model_info_carries_the_kv_shape_of_the_served_model(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)
    assert read_model_info(tmp_path).kv_shape == KVShape(layers=3, kv_heads=2, head_dim=16)


def test_plan_sizes_for_the_sequences_in_flight_with_the_margin_and_a_floor():
    shape = KVShape(layers=24, kv_heads=2, head_dim=64)  # the Qwen2.5-0.5B shape: 12 KiB per bf16 token
    w = RolloutWorkload(max_sequences=512, max_sequence_tokens=300)
    plan = plan_kv_cache(w, shape, dtype_bytes=2, block_size=16, max_model_len=32768, reserved_blocks=1)
    assert KV_MARGIN_PERCENT == 10
    blocks = 512 * 19 + math.ceil(512 * 19 / 10) + 1  # 300 tokens -> 19 blocks of 16; +10 %; +1 reserved
    assert (plan.blocks, plan.tokens, plan.nbytes) == (blocks, blocks * 16, blocks * 16 * 12 * 1024)
    # the engine's concurrency limit bounds the sequences; one max_model_len sequence is the floor
    assert plan_kv_cache(w, shape, dtype_bytes=2, block_size=16, max_model_len=32768, concurrency=8).blocks == \
        2049 + math.ceil(2049 / 10)
    # no workload: the concurrency limit x max_model_len, else nothing to size from
    assert plan_kv_cache(None, shape, dtype_bytes=2, block_size=64, max_model_len=640, concurrency=4).blocks == \
        40 + 4
    assert plan_kv_cache(None, shape, dtype_bytes=2, block_size=16, max_model_len=640) is None
    # on a device: at most half of (free memory - weights); the engine queues the rest
    free, weights = 10 * 2**30, 1 * 2**30
    big = plan_kv_cache(RolloutWorkload(100_000, 4096), shape, dtype_bytes=2, block_size=16, max_model_len=4096,
                        free_bytes=free, weight_bytes=weights)
    assert big.blocks == (free - weights) // 2 // (16 * 12 * 1024) and big.capped_blocks > big.blocks
    assert "more than 50% of the free device memory" in big.describe()


def test_a_config_without_head_counts_leaves_the_kv_cache_to_the_engine():
    from rlcli.backends.engine_runtime import EngineBackend
    from rlcli.backends.engine_runtime.model_info import _kv_shape

    assert _kv_shape(SimpleNamespace(num_hidden_layers=4)) is None  # no num_attention_heads (e.g. a state-space model)
    backend = SimpleNamespace(model_info=SimpleNamespace(kv_shape=None), engine=SimpleNamespace(label="x"), kv_plan=0)
    assert EngineBackend.kv_budget(backend, block_size=16) is None and backend.kv_plan is None
