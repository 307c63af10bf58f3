"""Cross-plugin checks of the engine plugins (rlcli-vllm, rlcli-sglang, rlcli-lmdeploy).

* The three plugins share one runtime (``rlcli.backends.engine_runtime``).
* Installed plugins register through the ``rlcli`` entry points with their distribution, version
  and the engine's install state, and ``rlcli validate`` names the exact install line.
* The runtime's state machine (engine thread, pause with partial results, gate while asleep or
  updating, drained weight updates, version stamps, shutdown) is run through the backend
  conformance kit on CPU, over the embedded engine's synchronous scheduler standing in for an
  engine: every check the embedded backend passes must pass through the runtime too.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from pydantic import Field

from rlcli.backends import engine_runtime as runtime
from rlcli.backends.base import GenerateRequest
from rlcli.component import ComponentConfig
from rlcli.testing import backend_conformance as bc
from rlcli.types import SampleParams

REPO = Path(__file__).resolve().parent.parent
PLUGINS = {"vllm": "rlcli-vllm", "sglang": "rlcli-sglang", "lmdeploy": "rlcli-lmdeploy"}
ENGINE_VERSIONS = {"vllm": "0.26.0", "sglang": "0.5.17", "lmdeploy": "0.18.0"}


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_each_plugin_pins_its_engine_as_an_extra_not_a_dependency(engine):
    import tomllib

    meta = tomllib.loads((REPO / "plugins" / PLUGINS[engine] / "pyproject.toml").read_text())["project"]
    assert meta["name"] == PLUGINS[engine] and meta["version"] == "0.1.0"
    assert "rlcli" in meta["dependencies"]
    assert not any(d.split("=")[0].split("<")[0].split(">")[0].strip() == engine for d in meta["dependencies"])
    assert meta["optional-dependencies"]["engine"] == [f"{engine}=={ENGINE_VERSIONS[engine]}"]
    assert meta["entry-points"]["rlcli"] == {engine: f"rlcli_{engine}"}


def _installed(engine: str) -> bool:
    return importlib.util.find_spec(f"rlcli_{engine}") is not None


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_installed_plugins_register_with_distribution_and_engine_state(engine):
    if not _installed(engine):
        pytest.skip(f"{PLUGINS[engine]} is not installed (pip install -e ./plugins/{PLUGINS[engine]})")
    from rlcli.plugins import get_registry

    entry = get_registry(refresh=True).entry("inference_backend", engine)
    assert (entry.dist, entry.version) == (PLUGINS[engine], "0.1.0")
    desc = entry.description
    assert engine in desc and (f"{engine} not installed: pip install \"{PLUGINS[engine]}[engine]\"" in desc
                               or f"{engine} {ENGINE_VERSIONS[engine]}" in desc or "tested with" in desc)


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_validate_names_the_install_line_when_the_engine_is_missing(engine):
    if not _installed(engine):
        pytest.skip(f"{PLUGINS[engine]} is not installed")
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    from rlcli.cli import cli
    from rlcli.plugins import get_registry

    get_registry(refresh=True)
    out = CliRunner().invoke(cli, ["validate", str(REPO / "recipes" / "quickstart.yaml"), f"rollout.name={engine}"])
    assert out.exit_code == 2, out.output
    assert f'pip install "{PLUGINS[engine]}[engine]"' in out.output
    assert f"{engine}=={ENGINE_VERSIONS[engine]}" in out.output
    assert "resources.device: " in out.output and "runs on CUDA GPUs" in out.output  # the quickstart runs on CPU
    # float32: LMDeploy serves bf16/fp16 only; SGLang's fused RMSNorm kernel has no float32 path
    assert ("model.dtype: " in out.output) == (engine in ("lmdeploy", "sglang"))


def test_recipe_checks_apply_only_to_the_chosen_backend():
    class Fake:
        pass

    recipe = Fake()
    recipe.rollout, recipe.resources, recipe.model = Fake(), Fake(), Fake()
    recipe.rollout.name, recipe.resources.device, recipe.model.dtype = "embedded", "cpu", "float32"
    assert _KitEngine.check_recipe(recipe) == []  # requires_cuda is False for the kit engine
    for engine in PLUGINS:
        if not _installed(engine):
            continue
        mod = importlib.import_module(f"rlcli_{engine}")
        cls = next(v for k, v in vars(mod).items() if k.endswith("Backend"))
        assert cls.check_recipe(recipe) == []  # another backend's recipe
        recipe.rollout.name = engine
        assert [f for f, _ in cls.check_recipe(recipe)] == (
            ["resources.device", "model.dtype"] if engine in ("lmdeploy", "sglang") else ["resources.device"])
        recipe.resources.device, recipe.model.dtype = "cuda", "bfloat16"
        assert cls.check_recipe(recipe) == []
        recipe.rollout.name, recipe.resources.device, recipe.model.dtype = "embedded", "cpu", "float32"


# ------------------------------------------------------------------------------------------
# Pure helpers of the runtime
# ------------------------------------------------------------------------------------------
def _job(return_logprob: bool = True) -> runtime.Job:
    return runtime.Job(rid="r", prompt=[1], params=SampleParams(return_logprob=return_logprob), seed=None,
                       stop_ids=[], budget=8, version=0)


def test_job_add_keeps_valid_logprobs_and_refuses_invalid_ones():
    job = _job()
    job.add([3, np.int64(4)], [-0.5, np.float64(-1.0)])
    job.add([5, 6, 7], [0, float("-inf"), float("inf")])  # ints and infinities are logprob values
    assert job.token_ids == [3, 4, 5, 6, 7] and all(type(t) is int for t in job.token_ids)
    assert job.logprobs == [-0.5, -1.0, 0.0, float("-inf"), float("inf")]
    assert all(type(lp) is float for lp in job.logprobs)
    for bad in ([float("nan")], [None], ["-0.5"], [np.float32(-0.5)]):
        with pytest.raises(RuntimeError, match="invalid logprob"):
            _job().add([1], bad)
    with pytest.raises(RuntimeError, match="1 logprobs for 2 tokens"):
        _job().add([1, 2], [-0.5])
    src_ids, src_lps = [8, 9], [-0.1, -0.2]  # plain lists are taken as they are: copied, not kept
    plain = _job()
    plain.add(src_ids, src_lps)
    src_ids.append(1)
    src_lps[0] = 5.0
    assert (plain.token_ids, plain.logprobs) == ([8, 9], [-0.1, -0.2])
    unlogged = _job(return_logprob=False)
    unlogged.add([1, 2], [float("nan")])  # logprobs not asked for are not kept, nor checked
    assert (unlogged.token_ids, unlogged.logprobs) == ([1, 2], [])


def test_stop_ids_validation_budget_and_finish():
    p = SampleParams(max_tokens=10, stop_token_ids=[5, 2])
    assert runtime.stop_ids_for(p, [2, 3]) == [2, 3, 5]
    assert runtime.stop_ids_for(SampleParams(ignore_eos=True, stop_token_ids=[5]), [2]) == [5]
    req = GenerateRequest([1, 2], SampleParams())
    assert runtime.validate_request(req, vocab_size=10, max_model_len=8) is None
    assert "empty prompt" in runtime.validate_request(GenerateRequest([], SampleParams()), 10, 8)
    assert "out of range" in runtime.validate_request(GenerateRequest([1, 10], SampleParams()), 10, 8)
    assert "out of range" in runtime.validate_request(GenerateRequest([1, True], SampleParams()), 10, 8)
    assert "max_model_len is 3" in runtime.validate_request(GenerateRequest([1, 2, 3], SampleParams()), 10, 3)
    # the fast path (plain ints) and the per-token path agree: numpy ints pass, floats and bools fail
    assert runtime.validate_request(GenerateRequest(list(np.array([1, 9])), SampleParams()), 10, 8) is None
    assert "out of range" in runtime.validate_request(GenerateRequest([1, 2.0], SampleParams()), 10, 8)
    assert "out of range" in runtime.validate_request(GenerateRequest([-1, 2], SampleParams()), 10, 8)
    assert runtime.response_budget(SampleParams(max_tokens=10), 5, 8) == 3
    assert runtime.response_budget(SampleParams(max_tokens=10), 5, None) == 10
    assert runtime.normalize_finish("abort", None, aborted=True) == ("abort", None)
    assert runtime.normalize_finish("abort", "KV cache full", aborted=False) == ("error", "KV cache full")
    assert runtime.normalize_finish("length", None, aborted=True) == ("length", None)
    assert runtime.normalize_finish("weird", None, aborted=False)[0] == "error"


def test_seed_sequence_is_reproducible_and_distinct():
    a, b = runtime.SeedSequence(1, 0), runtime.SeedSequence(1, 0)
    seeds = [a(None) for _ in range(100)]
    assert seeds == [b(None) for _ in range(100)] and len(set(seeds)) == 100
    assert all(0 <= s < 2**63 for s in seeds)
    assert runtime.SeedSequence(1, 1)(None) not in seeds
    assert a(-1) == 2**63 - 1 and a(7) == 7


def test_model_info_and_weight_update_preparation(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlcli.models import tiny_model_dir

    d = tiny_model_dir(tmp_path / "m", arch="qwen2")
    info = runtime.read_model_info(d)
    sd = AutoModelForCausalLM.from_pretrained(str(d)).state_dict()
    assert info.shapes == {k: tuple(v.shape) for k, v in sd.items()}
    assert info.aliases == {"lm_head.weight": "model.embed_tokens.weight"} and info.tied
    assert info.model_type == "qwen2" and info.vocab_size == sd["lm_head.weight"].shape[0]
    items = list(sd.items())
    prepared = runtime.prepare_weight_update(items, info)
    assert [n for n, _ in prepared] == [n for n, _ in items if n != "lm_head.weight"]
    alone = runtime.prepare_weight_update([("lm_head.weight", sd["lm_head.weight"])], info)
    assert [n for n, _ in alone] == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match=r"2 unknown tensor name\(s\): a\.b, c"):
        runtime.prepare_weight_update([("a.b", torch.zeros(1)), ("c", torch.zeros(1))] + items, info)
    with pytest.raises(ValueError, match="shape mismatch for model.norm.weight"):
        runtime.prepare_weight_update([("model.norm.weight", torch.zeros(3))], info)
    with pytest.raises(ValueError, match="not tensors"):
        runtime.prepare_weight_update([("model.norm.weight", [1.0])], info)


def test_engine_package_status(monkeypatch):
    pkg = runtime.EnginePackage(label="Foo", distribution="foo-dist", module="foo_mod_xyz", tested="1.2.0",
                                minimum="1.1.0", plugin="rlcli-foo")
    assert pkg.install_line == 'pip install "rlcli-foo[engine]"'
    assert pkg.installed_version() is None
    assert pkg.problem().startswith("the Foo engine is not installed") and 'pip install "rlcli-foo[engine]"' in pkg.problem()
    assert pkg.describe() == 'foo-dist not installed: pip install "rlcli-foo[engine]"'
    for version, ok in (("1.0.9", False), ("1.1.0", True), ("1.3.0", True)):
        monkeypatch.setattr(type(pkg), "installed_version", lambda self, v=version: v)
        assert (pkg.problem() is None) == ok


# ------------------------------------------------------------------------------------------
# The runtime through the conformance kit (CPU), over the embedded engine's scheduler
# ------------------------------------------------------------------------------------------
class _KitEngine(runtime.EngineBackend):
    """An :class:`EngineBackend` whose "engine" is rlcli's ``EmbeddedEngine`` stepped on the
    engine loop - the same shape as the vLLM plugin's driver - so that the kit exercises the
    runtime's pause / gate / drain / version logic against a model it can check."""

    name: ClassVar[str] = "runtime-kit"
    requires_cuda = False
    engine = runtime.EnginePackage(label="kit", distribution="rlcli", module="rlcli", tested="0", minimum="0",
                                   plugin="rlcli")

    class Config(ComponentConfig):
        max_batch_size: int = Field(64, gt=0)
        max_model_len: int | None = None

    async def _engine_start(self) -> None:
        from transformers import AutoModelForCausalLM

        from rlcli.backends.embedded import EmbeddedEngine, LlamaFamilyModel

        hf = AutoModelForCausalLM.from_pretrained(str(self.ctx.model_dir), dtype=torch.float32).eval()
        hf.requires_grad_(False)
        self.model = LlamaFamilyModel(hf)
        self.engine_ = EmbeddedEngine(self.model, max_batch_size=self.config.max_batch_size,
                                      max_model_len=self.max_model_len, max_prefill_tokens=4096,
                                      eos_token_ids=self.ctx.eos_token_ids)
        self.waiters: dict[int, tuple[asyncio.Future, Any]] = {}
        self.driver: asyncio.Task | None = None
        self.load_calls = 0

    def _resolve_max_model_len(self) -> int | None:
        return self.model_info.max_position_embeddings

    async def _engine_generate(self, job):
        seq = self.engine_.make_sequence(GenerateRequest(job.prompt, job.params, seed=job.seed), job.seed or 0)
        job.handle = seq
        fut = asyncio.get_running_loop().create_future()
        self.waiters[id(seq)] = (fut, job)
        self.engine_.submit(seq)
        if self.driver is None or self.driver.done():
            self.driver = asyncio.get_running_loop().create_task(self._drive())
        return await fut

    def _deliver(self, done):
        for seq, out in done:
            fut, job = self.waiters.pop(id(seq), (None, None))
            if fut is not None and not fut.done():
                job.add(out.token_ids, out.logprobs)
                fut.set_result((out.finish_reason, out.error))

    async def _drive(self):
        while self.waiters:
            self._deliver(self.engine_.step())
            await asyncio.sleep(0)

    async def _engine_abort(self, jobs):
        if len(jobs) == len(self.waiters):
            self._deliver(self.engine_.abort_all())
            return
        for job in jobs:
            self.engine_.cancel(job.handle)
            fut, _ = self.waiters.pop(id(job.handle), (None, None))
            if fut is not None and not fut.done():
                fut.set_result(("abort", None))

    async def _engine_load_weights(self, named_tensors):
        assert not self.waiters, "weights loaded under running requests"
        self.model.load_named_tensors(named_tensors)
        self.load_calls += 1

    async def _engine_sleep(self, level):
        assert not self.waiters
        self.engine_.cache.free()

    async def _engine_wake_up(self):
        with torch.inference_mode():
            self.engine_.cache.allocate()

    async def _engine_shutdown(self):
        self._deliver(self.engine_.abort_all())
        self.engine_.cache.free()


def _make_kit_backend(model_dir):
    return _KitEngine(_KitEngine.Config(), bc.default_context(model_dir))


@pytest.fixture(scope="module")
def kit_dirs(tmp_path_factory):
    return bc.make_tiny_model_dirs(tmp_path_factory.mktemp("runtime-kit"), arch="qwen2", seed=21)


@pytest.mark.parametrize("check", [n for n in bc.ALL_CHECKS if n != "weight_update"])
def test_runtime_passes_the_conformance_kit(kit_dirs, check):
    bc.ALL_CHECKS[check](_make_kit_backend, kit_dirs[0])


def test_runtime_passes_the_weight_update_check(kit_dirs):
    bc.check_weight_update(_make_kit_backend, kit_dirs[0], kit_dirs[1])


def test_update_weights_waits_for_requests_in_flight_unless_paused(kit_dirs):
    """Without pause() a weight update lets running requests finish on the old weights (all their
    tokens carry the old version) and admits new requests only afterwards (new version)."""
    from transformers import AutoModelForCausalLM

    be = _make_kit_backend(kit_dirs[0])
    other = list(AutoModelForCausalLM.from_pretrained(str(kit_dirs[1]), dtype=torch.float32).state_dict().items())
    try:
        async def main():
            loop = asyncio.get_running_loop()
            running = asyncio.ensure_future(be.generate(GenerateRequest([3, 4, 5], SampleParams(
                max_tokens=60, ignore_eos=True, temperature=0.0))))
            await asyncio.sleep(0.05)
            update = loop.run_in_executor(None, be.update_weights, other, 5)
            await asyncio.sleep(0.05)
            late = asyncio.ensure_future(be.generate(GenerateRequest([3, 4, 5], SampleParams(
                max_tokens=5, ignore_eos=True, temperature=0.0))))
            first = await running
            await update
            return first, await late

        first, late = asyncio.run(main())
    finally:
        be.shutdown()
    assert first.finish_reason == "length" and first.versions == [0] * 60
    assert late.versions == [5] * 5 and be.version == 5


def test_cancelled_caller_aborts_only_its_request(kit_dirs):
    be = _make_kit_backend(kit_dirs[0])
    try:
        async def main():
            keep = asyncio.ensure_future(be.generate(GenerateRequest([5, 6], SampleParams(max_tokens=40, ignore_eos=True))))
            drop = asyncio.ensure_future(be.generate(GenerateRequest([7, 8], SampleParams(max_tokens=400, ignore_eos=True))))
            await asyncio.sleep(0.05)
            drop.cancel()
            with pytest.raises(asyncio.CancelledError):
                await drop
            return await keep

        out = asyncio.run(main())
    finally:
        be.shutdown()
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    stats = be.stats()
    assert stats["running"] == 0 and stats["requests"] >= 1


def test_shutdown_ends_requests_waiting_at_the_gate(kit_dirs):
    be = _make_kit_backend(kit_dirs[0])
    be.sleep(1)

    async def main():
        waiting = asyncio.ensure_future(be.generate(GenerateRequest([1, 2], SampleParams(max_tokens=3))))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.get_running_loop().run_in_executor(None, be.shutdown)
        return await asyncio.wait_for(waiting, 10)

    out = asyncio.run(main())
    assert out.finish_reason == "error" and "shut down" in out.error
    with pytest.raises(RuntimeError, match="shut down"):
        be.sleep(1)


# ------------------------------------------------------------------------------------------
# benchmarks/backends.py's engine-specific code over the plugins' CPU stand-ins
# ------------------------------------------------------------------------------------------
@pytest.fixture
def bench(monkeypatch):
    """benchmarks/backends.py with the tiny workload of its --tiny mode (its run state, ``RESULTS`` and the
    options, is in ``bench.common``: benchmarks/backends_common.py)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import backends
    import grpo_step as gs

    monkeypatch.setitem(gs.SHAPE, "vocab", 50)  # the tiny models below have 53 tokens
    for name, value in (("DEVICE", "cpu"), ("PROMPTS", 3), ("NEW", 6), ("PROMPT_LEN", 5)):
        monkeypatch.setattr(gs, name, value)
    return backends


@pytest.mark.parametrize("engine", sorted(PLUGINS))
def test_benchmark_throughput_paths_run_over_the_fake_engines(engine, bench, tmp_path, monkeypatch):
    if not _installed(engine):
        pytest.skip(f"{PLUGINS[engine]} is not installed")
    from rlcli.models import tiny_model_dir

    monkeypatch.syspath_prepend(str(REPO / "plugins" / PLUGINS[engine] / "tests"))
    fake = importlib.import_module(f"fake_{engine}")
    cls = {"vllm": "FakeVLLMBackend", "sglang": "FakeSGLangBackend", "lmdeploy": "FakeLMDeployBackend"}[engine]
    backend_cls = getattr(fake, cls)
    d = tiny_model_dir(tmp_path / "m", arch="qwen2")
    be = backend_cls(backend_cls.Config(), fake.context(d))
    try:
        prompts = bench.workload()
        assert len(prompts) == 3 and all(len(p) == 5 for p in prompts)
        for seeded in (False, True):
            assert bench.through_rlcli(be, prompts, seeded=seeded) > 0
        assert be._use_seeds is True  # the seeded round left the switch on
        assert bench.bare(engine, be, prompts) > 0
        if engine == "sglang":  # the diagnostic path: one request per call on the bare engine
            assert bench.bare(engine, be, prompts, each=True) > 0
        else:
            with pytest.raises(ValueError, match="SGLang's diagnostic path"):
                bench.bare(engine, be, prompts, each=True)
        import backends_throughput

        monkeypatch.setattr(backends_throughput, "THROUGHPUT_ROUNDS", 2)
        rates = bench.throughput(engine, be, prompts)  # warm-up + 2 interleaved rounds of each path
        paths = ["bare", "plain", "seeded"] + (["bare_each", "batched"] if engine == "sglang" else [])
        assert sorted(rates) == sorted(paths) and all(len(v) == 2 and min(v) > 0 for v in rates.values())
        # --paths plain --rounds 3: the ratio alone, in more rounds, recorded with its quartiles
        monkeypatch.setattr(bench.common, "PATHS", ["plain"])
        monkeypatch.setattr(bench.common, "ROUNDS", 3)
        monkeypatch.setattr(bench.common, "RESULTS", [])
        import backends_run

        backends_run.report_throughput(engine, be, prompts)
        (rec,) = bench.common.RESULTS
        assert sorted(rec["rounds"]) == ["bare", "plain"] and all(len(v) == 3 for v in rec["rounds"].values())
        assert "rlcli_seeded_tok_s" not in rec and len(rec["ratio_paired_quartiles"]) == 3
        assert rec["ratio_paired_median"] == rec["ratio_paired_quartiles"][1]
        monkeypatch.setattr(bench.common, "PATHS", ["nonesuch"])
        with pytest.raises(ValueError, match="has no path"):
            bench.throughput(engine, be, prompts)
    finally:
        be.shutdown()


def test_benchmark_rounds_rotate_the_order_of_the_paths(bench):
    import backends_throughput as bt

    names = ["plain", "seeded", "bare"]
    orders = [bt.round_order(names, i) for i in range(4)]
    assert orders == [names, ["seeded", "bare", "plain"], ["bare", "plain", "seeded"], names]
    # over len(names) rounds each path runs once in each position
    assert all(sorted(o[j] for o in orders[:3]) == sorted(names) for j in range(3))


def test_benchmark_ratio_pairs_each_round_with_its_bare_round(bench):
    # SGLang's rounds of 2026-12-02: the machine sped up in the last round, plain did not
    rates = {"plain": [17955, 17926, 19903], "seeded": [16906, 17966, 25775], "bare": [17358, 19399, 26138]}
    assert round(max(rates["plain"]) / max(rates["bare"]), 2) == 0.76  # best against best
    assert round(bench.paired_ratio(rates, "plain"), 2) == 0.92
    assert round(bench.paired_ratio(rates, "seeded"), 2) == 0.97


def test_benchmark_markdown_reports_what_ran(bench, monkeypatch):
    monkeypatch.setattr(bench.common, "RESULTS", [
        {"what": "check", "check": "greedy_matches_reference", "status": "pass", "detail": ""},
        {"what": "check", "check": "sleep_wake", "status": "FAIL", "detail": "AssertionError: x | y",
         "by_design": "memory_allocated() is blind"},
        {"what": "check", "check": "many_concurrent", "status": "not run", "detail": "time budget"},
        {"what": "throughput", "rlcli_tok_s": 20000, "rlcli_seeded_tok_s": 15000, "bare_tok_s": 21000, "ratio": 0.952},
    ])
    env = {"date": "2026-12-01", "device": "NVIDIA H200", "torch": "2.11.0", "commit": "abc", "engine_version": "vllm 0.26.0"}
    md = bench.markdown("vllm", env)
    assert "| vllm 0.26.0 | 2026-12-01 | NVIDIA H200 | 1/3 pass; FAIL: sleep_wake; not run: many_concurrent | not run |" in md
    assert "| 20,000 | 15,000 | 21,000 | 0.95 |" in md
    bench.common.RESULTS[-1]["ratio_paired_median"] = 0.9
    assert "| 20,000 | 15,000 | 21,000 | 0.95 (per-round median 0.90) |" in bench.markdown("vllm", env)
    bench.common.RESULTS[-1]["ratio_paired_quartiles"] = [0.85, 0.9, 0.97]
    del bench.common.RESULTS[-1]["rlcli_seeded_tok_s"]  # --paths plain
    assert "| 20,000 | not run | 21,000 | 0.95 (per-round median 0.90, quartiles 0.85, 0.90, 0.97) |" in \
        bench.markdown("vllm", env)
    assert "| sleep_wake | FAIL | AssertionError: x / y | memory_allocated() is blind |" in md


def test_benchmark_markdown_states_the_kernel_profile(bench, monkeypatch):
    summary = {"rows": 512, "wall_ms": 3.0, "span_ms": 2.9, "busy_ms": 2.5, "idle_ms": 0.4, "kernels": 310.0,
               "classes_ms": {"matmul": 1.2, "attention": 0.6}, "top_kernels": []}
    monkeypatch.setattr(bench.common, "RESULTS", [
        {"what": "kernel_profile", "engine": "sglang", "path": "bare", "summary": summary},
        {"what": "kernel_profile", "engine": "sglang", "path": "plain", "error": "Traceback\nValueError: no GPU activity"},
    ])
    env = {"date": "2026-12-05", "device": "NVIDIA H200", "torch": "2.11.0", "commit": "abc", "engine_version": "sglang 0.5.17"}
    md = bench.markdown("sglang", env)
    assert "| ms per 512-row decode step | bare |" in md and "| GPU busy | 2.500 |" in md
    assert "| GPU time: attention | 0.600 |" in md
    assert "Kernel profile of plain: error: ValueError: no GPU activity" in md


def test_benchmark_copies_diagnostic(bench, tmp_path, monkeypatch):
    """``--sections copies``: variants parse, the summary counts parting copies, and the section runs
    each variant's engine through the three loads and reports them in the markdown."""
    assert bench.parse_variant("base:") == ("base", [])
    assert bench.parse_variant("nr:engine_kwargs.disable_radix_cache=true, batch_requests=true") == (
        "nr", ["engine_kwargs.disable_radix_cache=true", "batch_requests=true"])
    for bad in ("noname", ":a=1", "x:a"):
        with pytest.raises(ValueError, match="--kit-variant"):
            bench.parse_variant(bad)
    s = bench.copies_summary([[1], [2], [3]], {(1,): [[5, 6, 7]] * 3, (2,): [[5, 6, 7], [5, 6, 8], [5, 9, 7]],
                                               (3,): [[4, 4], [4, 4, 4]]})
    assert (s["prompts"], s["diverging"], s["most_distinct"], s["earliest_divergence"]) == (3, 2, 3, 1)
    assert s["example"] == {"prompt": [2], "a": [5, 6, 7], "b": [5, 6, 8]}

    monkeypatch.setattr(bench.common, "RESULTS", [])
    monkeypatch.setattr(bench.common, "KIT_VARIANTS", [("base", []), ("mb4", ["max_batch_size=4"]), ("bad", ["nope=1"])])
    bench.section_copies("embedded", tmp_path)
    got = {r["variant"]: r for r in bench.common.RESULTS if r["what"] == "copies"}
    for name in ("base", "mb4"):  # the embedded engine's copies agree under every load
        assert [got[name][k]["diverging"] for k in ("mixed", "alone", "serial")] == [0, 0, 0], got[name]
        assert got[name]["mixed"]["prompts"] == 10
    assert "nope" in got["bad"]["error"]  # a variant that cannot build is reported, the others ran
    env = {"date": "2026-12-02", "device": "CPU", "torch": "2", "commit": "abc", "engine_version": "rlcli 0.1.0"}
    md = bench.markdown("embedded", env)
    assert "| mb4 | max_batch_size=4 | 0 / 10, 1, None | 0 / 10, 1, None | 0 / 10, 1, None |" in md
    assert "| bad | nope=1 | error: " in md


def test_shared_runtime_passes_the_kit_with_reused_backends(kit_dirs):
    """The engine runtime serves consecutive checks from one backend (each check runs on a new
    event loop), as benchmarks/backends.py runs the kit against engines with a slow start-up."""
    with bc.reusing_backends() as shared:
        ran = bc.run_all(_make_kit_backend, kit_dirs[0], kit_dirs[1])
    assert len(ran) == len(bc.ALL_CHECKS) and shared.built == 4


def test_float32_refusal_is_reported_in_validate_and_before_the_engine_starts(kit_dirs):
    class NoFloat32(_KitEngine):
        float32_refusal = "this engine has no float32 kernels; set model.dtype: bfloat16"

    class Fake:
        pass

    recipe = Fake()
    recipe.rollout, recipe.resources, recipe.model = Fake(), Fake(), Fake()
    recipe.rollout.name, recipe.resources.device, recipe.model.dtype = NoFloat32.name, "cpu", "float32"
    assert NoFloat32.check_recipe(recipe) == [("model.dtype", NoFloat32.float32_refusal)]
    assert _KitEngine.check_recipe(recipe) == []  # no refusal set: float32 is fine
    recipe.model.dtype = "bfloat16"
    assert NoFloat32.check_recipe(recipe) == []
    with pytest.raises(ValueError, match="no float32 kernels"):
        NoFloat32(NoFloat32.Config(), bc.default_context(kit_dirs[0], dtype=torch.float32))


def test_engine_plugin_gpu_tests_skip_with_the_exact_reason(tmp_path):
    """A plugin's gpu tests are skipped with the engine's install line when it is missing; tests
    elsewhere and non-gpu tests are left alone."""
    from types import SimpleNamespace

    from rlcli.testing.engine_plugins import gpu_skip_reason, skip_gpu_tests_without_engine

    missing = runtime.EnginePackage(label="Nope", distribution="nope-engine", module="nope_engine_xyz",
                                    tested="1.0", minimum="1.0", plugin="rlcli-nope")
    reason = gpu_skip_reason(missing)
    assert "cannot be imported" in reason and 'pip install "rlcli-nope[engine]"' in reason

    class Item(SimpleNamespace):
        def add_marker(self, marker, append=True):
            self.markers.append(marker)

    ours_gpu = Item(keywords={"gpu": 1}, path=tmp_path / "tests" / "test_a.py", markers=[])
    ours_cpu = Item(keywords={}, path=tmp_path / "tests" / "test_b.py", markers=[])
    other_gpu = Item(keywords={"gpu": 1}, path=tmp_path / "elsewhere" / "test_c.py", markers=[])
    skip_gpu_tests_without_engine(missing, [ours_gpu, ours_cpu, other_gpu], tmp_path / "tests")
    assert [m.kwargs["reason"] for m in ours_gpu.markers] == [reason]
    assert not ours_cpu.markers and not other_gpu.markers


def test_benchmark_conformance_runs_only_the_checks_named(bench, tmp_path, monkeypatch):
    """``--checks``: a later device call reruns the checks an earlier one had no time for."""
    monkeypatch.setattr(bench.common, "RESULTS", [])
    monkeypatch.setattr(bench.common, "CHECKS", ["min_tokens", "sleep_releases_device_memory"])
    bench.section_conformance("embedded", tmp_path)
    checks = {r["check"]: r["status"] for r in bench.common.RESULTS if r["what"] == "check"}
    assert checks == {"min_tokens": "pass", "sleep_releases_device_memory": "not run"}  # no CUDA here


def test_benchmark_host_profile_over_a_fake_engine(bench, tmp_path, monkeypatch):
    """``--host-profile``: one plain and one bare round, profiled on the engine thread."""
    if not _installed("lmdeploy"):
        pytest.skip("rlcli-lmdeploy is not installed")
    from rlcli.models import tiny_model_dir

    monkeypatch.syspath_prepend(str(REPO / "plugins" / "rlcli-lmdeploy" / "tests"))
    fake = importlib.import_module("fake_lmdeploy")
    be = fake.FakeLMDeployBackend(fake.FakeLMDeployBackend.Config(), fake.context(tiny_model_dir(tmp_path / "m", arch="qwen2")))
    try:
        texts = bench.host_profile("lmdeploy", be, bench.workload(), top=40)
    finally:
        be.shutdown()
    assert sorted(texts) == ["bare", "plain"]
    assert re.match(r"# lmdeploy, plain path: [\d,]+ tok/s under the profiler", texts["plain"])
    assert "_engine_generate" in texts["plain"]  # the plugin's own stream handling, seen on the engine thread
    assert "_engine_generate" not in texts["bare"]
    with pytest.raises(bench.NotRun, match="not an engine plugin"):
        bench.host_profile("embedded", object(), [])


def test_benchmark_kit_set_reaches_the_kit_engines_config(bench, monkeypatch):
    """--kit-set KEY=VALUE lands in the kit engines' backend config, dotted keys into engine_kwargs,
    on top of the script's own settings; a key the config does not know fails by name."""
    import pydantic

    mod = pytest.importorskip("rlcli_sglang")
    seen = {}
    real = mod.SGLangBackend.Config

    def capture(**kw):
        seen.update(kw)
        return real(**kw)

    monkeypatch.setattr(mod.SGLangBackend, "Config", capture)
    monkeypatch.setattr(bench.common, "KIT_SET", ["engine_kwargs.disable_radix_cache=true", "use_request_seeds=true"])
    bench.conformance_setup("sglang", "cpu")
    assert seen["use_request_seeds"] is True
    assert seen["engine_kwargs"] == {"disable_prefill_cuda_graph": True, "cuda_graph_max_bs_decode": 32,
                                     "disable_radix_cache": True}
    monkeypatch.setattr(bench.common, "KIT_SET", ["no_such_setting=1"])
    with pytest.raises(pydantic.ValidationError, match="no_such_setting"):
        bench.conformance_setup("sglang", "cpu")


def test_benchmark_run_set_tunes_the_run_sections_engine(bench, monkeypatch):
    """``--run-set``: the run section's rollout config with the tuned settings on top (dotted keys, YAML values)."""
    import backends_run

    monkeypatch.setattr(bench.common, "RUN_SET", ["engine_kwargs.cuda_graph_max_bs=512", "use_request_seeds=false",
                                                  "mem_fraction_static=0.5"])
    cfg = backends_run.run_rollout_config("sglang", 512)
    assert cfg == {"name": "sglang", "mem_fraction_static": 0.5, "max_model_len": 512, "max_batch_size": 512,
                   "engine_kwargs": {"cuda_graph_max_bs": 512}, "use_request_seeds": False}
    monkeypatch.setattr(bench.common, "RUN_SET", [])
    assert backends_run.run_rollout_config("embedded", 8) == {"name": "embedded", "max_model_len": 512,
                                                              "max_batch_size": 8}


def test_benchmark_states_the_engine_settings_it_ran_with(bench, tmp_path, monkeypatch):
    """The run section records what the engine chose after start-up (concurrency, CUDA-graph sizes,
    KV cache, chunked prefill), a list as its length and largest value, missing settings left out,
    and the markdown states them."""
    import types

    import backends_run

    ns = types.SimpleNamespace
    vllm = ns(_engine=ns(vllm_config=ns(scheduler_config=ns(max_num_seqs=512, max_num_batched_tokens=16384),
                                        cache_config=ns(block_size=16, num_gpu_blocks=11265),
                                        compilation_config=ns(cudagraph_capture_sizes=[1, 2, 4, 8, 512]))))
    assert backends_run.engine_settings("vllm", vllm) == {
        "scheduler_config.max_num_seqs": 512, "scheduler_config.max_num_batched_tokens": 16384,
        "cache_config.block_size": 16, "cache_config.num_gpu_blocks": 11265,
        "compilation_config.cudagraph_capture_sizes": {"count": 5, "max": 512}}
    sglang = ns(_sgl=ns(server_args=ns(max_running_requests=512, cuda_graph_max_bs_decode=512,
                                       disable_cuda_graph=False)))
    assert backends_run.engine_settings("sglang", sglang) == {
        "max_running_requests": 512, "cuda_graph_max_bs_decode": 512, "disable_cuda_graph": False}
    assert backends_run.engine_settings("sglang", ns()) == {}  # not started: nothing, no error
    assert backends_run.engine_settings("embedded", vllm) == {}
    if _installed("lmdeploy"):  # the real plugin over its stand-in engine
        from rlcli.models import tiny_model_dir

        monkeypatch.syspath_prepend(str(REPO / "plugins" / PLUGINS["lmdeploy"] / "tests"))
        fake = importlib.import_module("fake_lmdeploy")
        be = fake.FakeLMDeployBackend(fake.FakeLMDeployBackend.Config(), fake.context(tiny_model_dir(tmp_path / "m")))
        try:
            got = backends_run.engine_settings("lmdeploy", be)
        finally:
            be.shutdown()
        assert got.get("block_size") == 64 and got.get("max_batch_size") is not None, got
    monkeypatch.setattr(bench.common, "RESULTS", [
        {"what": "engine_settings", "engine": "sglang", "settings": {"max_running_requests": 512}}])
    env = {"date": "2026-12-04", "device": "NVIDIA H200", "torch": "2.11.0", "commit": "abc",
           "engine_version": "sglang 0.5.17"}
    assert "Engine settings after start-up: `max_running_requests` 512." in bench.markdown("sglang", env)
