"""The documentation stays true: the plugin walkthrough's code runs as written."""

import re
import subprocess
import sys

import pytest


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@pytest.fixture(scope="module")
def walkthrough(repo, tmp_path_factory):
    text = (repo / "docs" / "writing-plugins.md").read_text()
    root = tmp_path_factory.mktemp("plugin") / "rlcli-keyword"
    (root / "rlcli_keyword").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text(_blocks(text, "toml")[0])
    for code in _blocks(text, "python"):
        first = code.splitlines()[0]
        assert first.startswith("# "), "each python block starts with its file name"
        (root / first[2:].strip()).write_text(code)
    return root


def test_walkthrough_plugin_tests_pass(walkthrough):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                       cwd=walkthrough, env={**__import__("os").environ, "PYTHONPATH": str(walkthrough)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_walkthrough_recipe_snippet_validates(walkthrough, repo, monkeypatch):
    import yaml

    sys.path.insert(0, str(walkthrough))
    try:
        import rlcli_keyword
        from rlcli.config import validate_recipe
        from rlcli.plugins import registry_with

        raw = yaml.safe_load((repo / "recipes" / "quickstart.yaml").read_text())
        text = (repo / "docs" / "writing-plugins.md").read_text()
        snippet = yaml.safe_load(_blocks(text, "yaml")[0])
        raw["tasks"][0]["judger"] = snippet["tasks"][0]["judger"]
        rec = validate_recipe(raw, registry=registry_with(rlcli_keyword), base_dir=repo / "recipes")
        assert rec.tasks[0].judger.cfg.keyword == "please"
    finally:
        sys.path.remove(str(walkthrough))


def test_recipe_reference_is_generated_from_the_code(repo, monkeypatch):
    from rlcli.docgen import BEGIN, END, recipe_reference
    from rlcli.plugins import get_registry

    monkeypatch.setenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD", "1")  # built-ins only, like the generator
    get_registry(refresh=True)
    try:
        text = (repo / "docs" / "recipes.md").read_text()
        current = text[text.index(BEGIN): text.index(END) + len(END)]
        assert current == recipe_reference(), "run: RLCLI_DISABLE_PLUGIN_AUTOLOAD=1 python -m rlcli.docgen --write docs/recipes.md"
    finally:
        monkeypatch.delenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD")
        get_registry(refresh=True)
