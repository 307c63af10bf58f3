"""resources.expandable_segments: when a run turns the CUDA allocator's expandable segments on, and that it undoes it."""

import os

import pytest
import torch

from pydantic import ValidationError

from rlcli.backends.base import InferenceBackend
from rlcli.backends.embedded import EmbeddedBackend
from rlcli.config.sections import ResourcesConfig
from rlcli.runner import expandable_segments as segments


def _plugin_backend(name):
    """The installed engine plugin's backend class, as the recipe resolves it (skip if not installed)."""
    from rlcli.plugins import get_registry

    registry = get_registry()
    if name not in registry.names("inference_backend"):
        pytest.skip(f"rlcli-{name} is not installed")
    return registry.get("inference_backend", name)


@pytest.mark.parametrize("setting, rollout, environ, expected", [
    (None, "embedded", {}, True),  # auto: the embedded engine, nothing in the environment
    (None, "vllm", {}, None),  # an engine plugin's pool may refuse them: leave the allocator alone
    (None, "sglang", {}, None),
    (None, "lmdeploy", {}, None),
    (None, "embedded", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),  # the user's word wins
    (None, "embedded", {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}, None),
    (True, "vllm", {}, True),  # the recipe's word wins over the auto rule
    (False, "embedded", {}, False),
])
def test_the_auto_rule(setting, rollout, environ, expected):
    backend = EmbeddedBackend if rollout == "embedded" else _plugin_backend(rollout)
    assert segments.wanted(setting, backend, environ) is expected


def test_the_rule_follows_the_backend_classs_flag_not_its_name():
    """A backend allows expandable segments by its class flag (off on the base class), so a
    third-party engine that sets it gets them by default as the embedded one does."""
    assert InferenceBackend.allows_expandable_segments is False and EmbeddedBackend.allows_expandable_segments

    class ThirdParty(InferenceBackend):
        allows_expandable_segments = True

    assert segments.wanted(None, ThirdParty, {}) is True
    assert segments.wanted(None, InferenceBackend, {}) is None


def _recording(monkeypatch):
    calls = []
    monkeypatch.setattr(segments, "_set", calls.append)
    return calls


def test_a_cuda_run_sets_them_and_restores_the_previous_value(monkeypatch):
    calls = _recording(monkeypatch)
    restore = segments.apply(None, EmbeddedBackend, torch.device("cuda"), environ={})
    assert calls == [True]
    restore()
    assert calls == [True, False]


def test_an_explicit_false_turns_off_what_the_environment_turned_on(monkeypatch):
    calls = _recording(monkeypatch)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"}
    restore = segments.apply(False, EmbeddedBackend, torch.device("cuda"), environ=env)
    restore()
    assert calls == [False, True]


@pytest.mark.parametrize("setting, device, environ", [
    (None, "cpu", {}),  # nothing to set on the CPU
    (True, "cpu", {}),
    (True, "cuda", {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}),  # already so
    (None, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
])
def test_nothing_changes_when_nothing_needs_to(monkeypatch, setting, device, environ):
    calls = _recording(monkeypatch)
    segments.apply(setting, EmbeddedBackend, torch.device(device), environ=environ)()
    assert calls == []


def test_the_recipe_key_is_a_bool_or_unset():
    assert ResourcesConfig().expandable_segments is None
    assert ResourcesConfig(expandable_segments=True).expandable_segments is True
    with pytest.raises(ValidationError, match="expandable_segments"):
        ResourcesConfig(expandable_segments="sometimes")


def test_the_runner_applies_the_recipes_setting_and_undoes_it_after_the_run_or_a_failed_start(repo, tmp_path,
                                                                                                monkeypatch):
    """ColocateRunner hands resources.expandable_segments and the rollout backend's class to :func:`expandable_segments.apply`
    before anything touches the device, and calls what it returns once: at close, or when the
    runner fails to start (here: a fresh run in a work dir that already holds one)."""
    import yaml

    from rlcli.config import validate_recipe
    from rlcli.runner import colocate

    calls = []

    def fake_apply(setting, backend, device, environ=None):
        calls.append(("apply", setting, backend, device.type))
        return lambda: calls.append(("restore",))

    monkeypatch.setattr(colocate.expandable_segments, "apply", fake_apply)
    raw = yaml.safe_load((repo / "recipes" / "quickstart.yaml").read_text())
    raw["trainer"].update(total_train_steps=1, enable_evaluate=False, checkpoint_interval=-1, auto_resume=False,
                          train_batch_size=4, work_dir=str(tmp_path / "w"))
    raw["resources"] = {**raw.get("resources", {}), "device": "cpu", "expandable_segments": False}
    rec = validate_recipe(raw, base_dir=repo / "recipes")
    runner = colocate.ColocateRunner(rec, quiet=True)
    try:
        runner.fit()
    finally:
        runner.close()
    assert calls == [("apply", False, EmbeddedBackend, "cpu"), ("restore",)]
    calls.clear()
    with pytest.raises(Exception, match="already holds a run"):
        colocate.ColocateRunner(rec, quiet=True)
    assert calls == [("apply", False, EmbeddedBackend, "cpu"), ("restore",)]


def test_an_allocator_that_refuses_the_setting_leaves_the_run_without_it(monkeypatch, caplog):
    def refuse(enabled):
        raise RuntimeError("expandable_segments not supported on this platform")

    import logging

    monkeypatch.setattr(segments, "_set", refuse)
    monkeypatch.setattr(logging.getLogger("rlcli"), "propagate", True)  # a runner's setup_logging turns it off
    with caplog.at_level("WARNING", logger="rlcli"):
        restore = segments.apply(True, EmbeddedBackend, torch.device("cuda"), environ={})
    restore()  # nothing to undo, nothing raised
    assert "could not turn expandable segments on" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_setting_lets_a_freed_range_serve_a_larger_request():
    """What the setting is for, on the device: a freed 1 GiB range grows to serve a 1.5 GiB request
    (0.5 GiB more reserved), where fixed blocks reserve a new 1.5 GiB segment beside the cached one."""

    def reserved_growth() -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del a
        b = torch.empty(3 << 29, dtype=torch.uint8, device="cuda")
        grown = torch.cuda.memory_reserved() - base
        del b
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return grown

    original = segments._enabled_in(segments._env_conf(os.environ))
    try:
        segments._set(True)  # what apply() calls: the setting at run time, not from the environment
        with_segments = reserved_growth()
        segments._set(False)
        without = reserved_growth()
    finally:
        segments._set(original)
    gib = 1 << 30
    assert with_segments < 1.75 * gib and without >= 2.5 * gib, (with_segments / gib, without / gib)


def test_the_runner_reports_what_the_allocator_reserved_beside_what_it_held(monkeypatch):
    """memory/*_reserved_peak_gib: the caching allocator's reserved peak next to the allocated one, so
    fragmentation (reserved far above allocated) shows in metrics.jsonl; both peaks are reset per phase."""
    import types

    from rlcli.runner.colocate import ColocateRunner

    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: 106.5 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda dev: 138.25 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    stub = types.SimpleNamespace(env=types.SimpleNamespace(device=torch.device("cuda", 0)))
    assert ColocateRunner.peak_memory_gib(stub) == (106.5, 138.25)
    assert resets == [torch.device("cuda", 0)]
    stub.env.device = torch.device("cpu")
    assert ColocateRunner.peak_memory_gib(stub) is None
