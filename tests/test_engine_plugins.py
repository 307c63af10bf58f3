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
