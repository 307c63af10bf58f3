"""The documentation stays true: the plugin walkthrough's code runs as written."""

import re
import subprocess
import sys

import pytest


UNITS_HEADING = "## A tool and an agent loop: `rlcli-units`"


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _sections(repo) -> tuple[str, str]:
    """The judger walkthrough and the tool + agent-loop walkthrough of docs/writing-plugins.md."""
    text = (repo / "docs" / "writing-plugins.md").read_text()
    assert UNITS_HEADING in text
    first, _, second = text.partition(UNITS_HEADING)
    return first, second


def _write_package(text: str, root):
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(_blocks(text, "toml")[0])
    for code in _blocks(text, "python"):
        first = code.splitlines()[0]
        assert first.startswith("# "), "each python block starts with its file name"
        path = root / first[2:].strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    return root


@pytest.fixture(scope="module")
def walkthrough(repo, tmp_path_factory):
    return _write_package(_sections(repo)[0], tmp_path_factory.mktemp("plugin") / "rlcli-keyword")


@pytest.fixture(scope="module")
def units_walkthrough(repo, tmp_path_factory):
    return _write_package(_sections(repo)[1], tmp_path_factory.mktemp("plugin") / "rlcli-units")


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


def test_units_walkthrough_builds_and_its_tests_pass(units_walkthrough):
    """The tool + agent-loop plugin of the walkthrough builds as a wheel with its entry point, and
    its own tests pass against this rlcli."""
    import os
    import shutil
    import zipfile

    root = units_walkthrough
    src = shutil.copytree(root, root.parent / "build-src")  # a build leaves metadata next to the sources
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(src / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (src / "dist").glob("rlcli_units-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        eps = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "rlcli_units/__init__.py" in names and "[rlcli]" in eps and "units = rlcli_units" in eps
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout


def test_units_recipe_snippet_validates(units_walkthrough, repo):
    import yaml

    sys.path.insert(0, str(units_walkthrough))
    try:
        import rlcli_units
        from rlcli.config import RecipeError, validate_recipe
        from rlcli.plugins import registry_with

        raw = yaml.safe_load((repo / "recipes" / "tool-calculator.yaml").read_text())
        snippet = yaml.safe_load(_blocks(_sections(repo)[1], "yaml")[0])
        raw["tasks"][0]["agent_loop"] = snippet["tasks"][0]["agent_loop"]
        raw["model"]["from_scratch"]["max_position_embeddings"] = 128  # room for a prompt and 64 tokens
        reg = registry_with(rlcli_units)
        rec = validate_recipe(raw, registry=reg, base_dir=repo / "recipes")
        loop = rec.tasks[0].agent_loop
        assert loop.cls is rlcli_units.ParenToolsLoop and [t.name for t in loop.cfg.tools] == ["convert", "calculator"]
        raw["tasks"][0]["agent_loop"]["tools"][0]["decimals"] = 99
        with pytest.raises(RecipeError, match="tasks.0.agent_loop.tools.0.decimals"):
            validate_recipe(raw, registry=reg, base_dir=repo / "recipes")
    finally:
        sys.path.remove(str(units_walkthrough))
        sys.modules.pop("rlcli_units", None)


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
