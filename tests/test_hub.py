"""Hub model ids (``model.path: org/name``): resolved from a Hugging Face cache built here, offline;
a missing directory, an uncached id and a directory that is no model are three different errors."""

import json
import shutil

import pytest
import yaml
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.hub import ModelLocationError, locate, looks_like_path

REV = "0123456789abcdef0123456789abcdef01234567"


def cached_repo(cache, repo_id, src=None, files=None):
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<rev>/...}."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / REV
    if src is not None:
        shutil.copytree(src, snap)
    snap.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (snap / name).write_text(text)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(REV)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tiny_llama, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    cached_repo(cache, "org/tiny", src=tiny_llama)
    cached_repo(cache, "org/notes", files={"README.md": "a dataset card, no model"})
    return cache


@pytest.fixture()
def offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(offline, tmp_path, monkeypatch):
    snap = offline / "models--org--tiny" / "snapshots" / REV
    assert locate("org/tiny") == snap
    assert locate("org/tiny", field="model.tokenizer", need="tokenizer") == snap
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(offline.parent))  # HF_HOME/hub
    assert locate("org/tiny", download=False) == snap
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert [looks_like_path(s) for s in ("org/tiny", "gpt2", "./m", "/m", "~/m", "a/b/c", "models/x", "a b")] == [
        False, False, True, True, True, True, True, True]


def test_train_offline_from_a_hub_id(offline, repo, tmp_path):
    work = tmp_path / "w"
    out = CliRunner().invoke(cli, [
        "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
        "~model.from_scratch", "~model.tokenizer", "model.path=org/tiny", "trainer.total_train_steps=2",
        "trainer.train_batch_size=4", "tasks.0.sampler.prompt_repeat_k=2", "trainer.enable_evaluate=false",
        "trainer.checkpoint_interval=-1", "~eval"])
    assert out.exit_code == 0, out.output
    rows = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    resolved = yaml.safe_load((work / "resolved.yaml").read_text())
    assert resolved["recipe"]["model"]["path"] == "org/tiny"  # the id, not the cache path


@pytest.mark.parametrize("path, kind, words", [
    ("./no/such/model", "no_dir", "no such directory"),
    ("org/absent", "not_cached", "is not in the Hugging Face cache"),
    ("org/notes", "not_model", "is not a Hugging Face model: no config.json"),
])
def test_the_three_errors_differ_and_validate_exits_2(offline, repo, path, kind, words):
    with pytest.raises(ModelLocationError) as err:
        locate(path)
    assert err.value.kind == kind and words in str(err.value)
    out = CliRunner().invoke(cli, ["validate", str(repo / "recipes" / "quickstart.yaml"), "~model.from_scratch",
                                   "~model.tokenizer", f"model.path={path}"])
    assert out.exit_code == 2 and "model.path" in out.output and words in out.output, out.output
    if kind == "not_cached":
        assert "hf download org/absent" in out.output and "huggingface-cli download org/absent" in out.output
    assert "Traceback" not in out.output


def test_validate_reads_a_cached_ids_config_without_loading_weights(offline, repo, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("validate loaded a model"))
    out = CliRunner().invoke(cli, ["validate", str(repo / "recipes" / "quickstart.yaml"), "~model.from_scratch",
                                   "~model.tokenizer", "model.path=org/tiny", "tasks.0.agent_loop.sample_params."
                                   "max_tokens=100000"])
    # the context comes from the cached config.json: the fit rule names that file
    assert out.exit_code == 2 and "models--org--tiny" in out.output and "config.json" in out.output, out.output


def test_a_config_alone_validates_but_does_not_train_and_a_local_dir_needs_a_config(offline, tmp_path):
    cached_repo(offline, "org/half", files={"config.json": "{}"})  # what validate fetches online
    assert locate("org/half", download=False).name == REV
    with pytest.raises(ModelLocationError, match="only partly in the Hugging Face cache") as err:
        locate("org/half")
    assert err.value.kind == "not_cached"
    with pytest.raises(ModelLocationError, match="no config.json") as err:
        locate(str(tmp_path))
    assert err.value.kind == "not_model"
    with pytest.raises(ModelLocationError, match="is not a Hugging Face tokenizer") as err:
        locate("org/notes", field="model.tokenizer", need="tokenizer")


def test_load_tokenizer_takes_a_hub_id(offline, tiny_llama):
    from rlcli.tokenizer import load_tokenizer

    assert load_tokenizer("org/tiny").get_vocab() == load_tokenizer(tiny_llama).get_vocab()
    with pytest.raises(ModelLocationError, match="tokenizer: org/absent is not in the Hugging Face cache"):
        load_tokenizer("org/absent")


def test_a_model_dir_that_names_its_own_code_is_refused_before_anything_loads(repo, tiny_llama, tmp_path):
    """transformers imports ``module.Class`` entries of ``auto_map`` with trust_remote_code (which an
    engine such as LMDeploy passes itself): rlcli refuses such a directory, with the entry named;
    ``rlcli validate`` and ``rlcli train`` exit 2 and nothing in the directory runs."""
    evil = tmp_path / "evil"
    shutil.copytree(tiny_llama, evil)
    (evil / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    cfg = json.loads((evil / "config.json").read_text())
    (evil / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    with pytest.raises(ModelLocationError, match="auto_map.AutoConfig = evil.EvilConfig") as err:
        locate(str(evil))
    assert err.value.kind == "remote_code"
    for command, extra in (("validate", []), ("train", ["--work-dir", str(tmp_path / "w")])):
        out = CliRunner().invoke(cli, [command, str(repo / "recipes" / "quickstart.yaml"), "~model.from_scratch",
                                       "~model.tokenizer", f"model.path={evil}", *extra])
        assert out.exit_code == 2 and "model.path" in out.output and "never runs code" in out.output, out.output
    assert not (tmp_path / "ran").exists()
    # a tokenizer config naming a class transformers ships (no module) is not code
    (evil / "config.json").write_text(json.dumps(cfg))
    (evil / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((evil / "tokenizer_config.json").read_text()),
         "auto_map": {"AutoTokenizer": [None, "PreTrainedTokenizerFast"]}}))
    assert locate(str(evil), field="model.tokenizer", need="tokenizer") == evil


def test_the_engine_plugins_refuse_remote_code_through_engine_kwargs():
    import importlib

    for plugin, keys in (("rlcli_vllm", ["trust_remote_code"]), ("rlcli_sglang", ["trust_remote_code"]),
                         ("rlcli_lmdeploy", ["trust_remote_code", "custom_module_map"])):
        try:
            logic = importlib.import_module(f"{plugin}.logic")
        except ImportError:
            continue  # the plugin's own tests cover it where it is installed
        assert set(keys) <= set(logic.MANAGED_ENGINE_KWARGS), plugin
