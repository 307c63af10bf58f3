"""LoRA (``model.lora``): only the adapters train; the engine, the merged export and peft see
``W + (alpha / r) B A``; checkpoints hold the adapters; a SIGKILLed LoRA run resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlcli.algo.loss import VanillaPolicyLoss
from rlcli.config import LoraConfig, ModelConfig, RecipeError, TrainWorkerConfig, validate_recipe
from rlcli.models import tiny_model_dir
from rlcli.train.checkpoint_files import CheckpointError
from rlcli.train.data import TrainSequence
from rlcli.train.worker import TrainWorker

from .test_e2e import _short
from .test_resume import RLCLI, kill_after_checkpoint, metrics, run

LORA = {"r": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("lora") / "m", arch="qwen2", seed=0)


def make_worker(model_dir, lora=LORA, **kw) -> TrainWorker:
    return TrainWorker(model_dir, ModelConfig(lora=LoraConfig(**lora, **kw) if lora else None),
                       TrainWorkerConfig(optimizer={"lr": 1e-2}), VanillaPolicyLoss(), device="cpu", seed=0,
                       total_steps=10)


def batch() -> list[TrainSequence]:
    return [TrainSequence([3, 4, 5 + i % 4], [6 + i % 3], [1], [-2.0], 1.0 if i % 3 == 0 else -0.5, 1.0, i)
            for i in range(12)]


def params(worker) -> dict[str, torch.Tensor]:
    """Every state-dict entry of the trainer's model (tied names included), whole."""
    return {n: p.full_tensor().detach().clone() for n, p in worker.hf_model.state_dict(keep_vars=True).items()}


def merged_by_hand(p: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The base model's state computed from the trainer's parameters, independently of the code under test."""
    out = {}
    for n, t in p.items():
        if ".lora_" in n:
            continue
        if ".base_layer.weight" in n:
            layer = n[: -len(".base_layer.weight")]
            a, b = p[f"{layer}.lora_A.default.weight"], p[f"{layer}.lora_B.default.weight"]
            out[f"{layer}.weight"] = t + (b @ a) * scaling
        else:
            out[n.replace(".base_layer.", ".")] = t
    return out


def test_only_the_adapters_train_and_sync_sends_the_merged_weights(model_dir):
    w = make_worker(model_dir)
    before = params(w)
    trainable = {n for n, p in w.hf_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for p in w.optimizer.param_groups[0]["params"]} == {
        id(p) for p in w.hf_model.parameters() if p.requires_grad}
    for _ in range(2):
        w.train_step(batch())
    after = params(w)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)  # base: bit for bit
    assert all(not torch.equal(before[n], after[n]) for n in trainable)
    want = merged_by_hand(after, LORA["alpha"] / LORA["r"])
    plain = set(load_file(str(model_dir / "model.safetensors")))
    for live in (True, False):
        got = {n: t.clone() for bucket in w.iter_weights(live=live) for n, t in bucket}
        assert set(got) == set(want) and plain <= set(got)  # the base model's names (tied lm_head too)
        assert all(torch.equal(got[n], want[n]) for n in want), live
    assert any(not torch.equal(want[n], before[n.replace(".weight", ".base_layer.weight")])
               for n in want if n.replace(".weight", ".base_layer.weight") in before)
    assert all(torch.equal(before[n], t) for n, t in params(w).items() if n not in trainable)  # sync wrote nothing


def test_engine_gets_the_merged_weights(repo, tmp_path):
    """After LoRA steps the embedded engine holds exactly base + scale·B·A (it borrows the trainer's
    parameters: the merge must leave them untouched)."""
    from rlcli.runner.colocate import ColocateRunner

    def short(raw):
        raw["trainer"].update(total_train_steps=2, enable_evaluate=False, train_batch_size=40)  # some reward
        raw["model"]["lora"] = dict(LORA)

    rec = validate_recipe(_short(repo, tmp_path / "w", short), base_dir=repo / "recipes")
    runner = ColocateRunner(rec, quiet=True)
    before = params(runner.worker)
    try:
        runner.fit()
        after = params(runner.worker)
        assert any(not torch.equal(before[n], after[n]) for n in after if ".lora_B." in n)  # it trained
        assert all(torch.equal(before[n], after[n]) for n in after if ".lora_" not in n)
        engine = dict(runner.backend.engine.model.named_parameters())
        want = merged_by_hand(after, LORA["alpha"] / LORA["r"])
        assert set(engine) <= set(want)
        for name, t in engine.items():
            assert torch.equal(t.detach().cpu(), want[name].to(t.dtype)), name
    finally:
        runner.close()


def test_checkpoint_holds_the_adapters_and_resumes_exactly(model_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    a = make_worker(model_dir)
    a.train_step(batch())
    a.save_checkpoint(tmp_path / "step-1", {"step": 1})
    keys = set(FileSystemReader(str(tmp_path / "step-1" / "weights")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)  # no copy of the base
    assert any(k.startswith("optim.state.") for k in keys)
    a.train_step(batch())
    b = make_worker(model_dir)
    b.load_checkpoint(tmp_path / "step-1")
    b.train_step(batch())
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    with pytest.raises(CheckpointError, match=r"written with LoRA .*model\.lora gives no LoRA"):
        make_worker(model_dir, lora=None).load_checkpoint(tmp_path / "step-1")
    with pytest.raises(CheckpointError, match=r'"r": 4.*"r": 2'):
        make_worker(model_dir, lora={"r": 2, "alpha": 8.0}).load_checkpoint(tmp_path / "step-1", weights_only=True)


def test_export_is_a_peft_adapter_whose_merge_equals_ours(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    w = make_worker(model_dir, export_merged=True)
    w.train_step(batch())
    out = w.save_hf(tmp_path / "hf" / "step-1")
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= {p.name for p in out.iterdir()}
    ours = w.full_state_dict()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(out)).merge_and_unload().state_dict()
    assert set(merged) == set(ours) and all(torch.equal(merged[n], ours[n]) for n in ours)
    exported = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32).state_dict()
    assert all(torch.equal(exported[n], ours[n]) for n in ours)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir.resolve())
    fresh = make_worker(model_dir)  # what `rlcli eval --checkpoint hf/step-N` does with an adapter
    fresh.load_adapter(out)
    assert all(torch.equal(t, ours[n]) for n, t in fresh.full_state_dict().items())
    with pytest.raises(CheckpointError, match="is a LoRA adapter"):
        make_worker(model_dir, lora=None).load_adapter(out)
    with pytest.raises(CheckpointError, match="an adapter of r=4"):
        make_worker(model_dir, lora={"r": 2, "alpha": 8.0}).load_adapter(out)


def test_lora_recipe_errors(repo, model_dir, monkeypatch):
    raw = _short(repo, "/tmp/unused", lambda r: r["model"].update(lora={"r": 0, "target_modules": ["lm_head"]}))
    with pytest.raises(RecipeError) as e:
        validate_recipe(raw, base_dir=repo / "recipes")
    assert "model.lora.r" in str(e.value) and "model.lora.target_modules" in str(e.value)
    with pytest.raises(RecipeError, match=r"model\.lora\.target_modules: \['qkv'\].*linear layers are .*q_proj"):
        make_worker(model_dir, lora={"r": 2, "alpha": 2.0, "target_modules": ["qkv"]})
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(RecipeError, match=r"model\.lora: .*peft.*pip install 'rlcli\[lora\]'"):
        validate_recipe(_short(repo, "/tmp/unused", lambda r: r["model"].update(lora={})), base_dir=repo / "recipes")


def _args(repo: Path, work: Path) -> list[str]:
    return [*RLCLI, "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
            "trainer.total_train_steps=8", "trainer.train_batch_size=20", "trainer.checkpoint_interval=2",
            "trainer.checkpoint_maxkeep=-1", "trainer.evaluate_step=8", "trainer.auto_resume=true",
            "eval.evaluator.sample_num=20", "resources.num_threads=1", "model.lora={r: 4, alpha: 8}"]


@pytest.mark.slow  # three short `rlcli train` processes: ~40 s on 2 idle cores
def test_sigkill_then_resume_is_identical(repo, tmp_path):
    full = tmp_path / "full"
    r = run(_args(repo, full))
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path / "run"
    kill_after_checkpoint(_args(repo, work), work, 2, 8)
    r = run(_args(repo, work))
    assert r.returncode == 0, r.stderr[-3000:]
    assert metrics(full) == metrics(work)
    wa, wb = (load_file(str(d / "hf" / "step-8" / "adapter_model.safetensors")) for d in (full, work))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_quickstart_learns_with_lora(repo, tmp_path):
    work = tmp_path / "run"
    r = run([*RLCLI, "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
             "trainer.total_train_steps=100", "trainer.evaluate_step=100", "trainer.checkpoint_interval=-1",
             "model.lora={r: 16, alpha: 32}", "train_worker.optimizer.lr=2.0e-3"])
    assert r.returncode == 0, r.stderr[-3000:]
    acc = {row["step"]: row["eval/accuracy"] for row in metrics(work) if "eval/accuracy" in row}
    assert acc[0] <= 0.1 and acc[100] >= 0.35, acc
