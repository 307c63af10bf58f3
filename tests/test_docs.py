"""The documentation stays true: the plugin walkthrough's code runs as written."""

import re
import subprocess
import sys

import pytest


UNITS_HEADING = "## A tool and an agent loop: `rlcli-units`"
RECHECK_HEADING = "## A multi-turn agent loop without tools: `rlcli-recheck`"


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _sections(repo) -> tuple[str, str, str]:
    """The judger walkthrough, the tool + agent-loop walkthrough and the agent-loop walkthrough of
    docs/writing-plugins.md."""
    text = (repo / "docs" / "writing-plugins.md").read_text()
    assert UNITS_HEADING in text and RECHECK_HEADING in text
    first, _, rest = text.partition(UNITS_HEADING)
    second, _, third = rest.partition(RECHECK_HEADING)
    return first, second, third


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


def _env(root) -> dict:
    """The environment of a walkthrough's own test run: its package first, then this rlcli."""
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def walkthrough(repo, tmp_path_factory):
    return _write_package(_sections(repo)[0], tmp_path_factory.mktemp("plugin") / "rlcli-keyword")


@pytest.fixture(scope="module")
def units_walkthrough(repo, tmp_path_factory):
    return _write_package(_sections(repo)[1], tmp_path_factory.mktemp("plugin") / "rlcli-units")


@pytest.fixture(scope="module")
def recheck_walkthrough(repo, tmp_path_factory):
    return _write_package(_sections(repo)[2], tmp_path_factory.mktemp("plugin") / "rlcli-recheck")


def test_walkthrough_plugin_tests_pass(walkthrough):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                       cwd=walkthrough, env=_env(walkthrough),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout  # the judger's own test, and the judger kit


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
                       env=_env(root), capture_output=True, text=True, timeout=120)
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


def test_recheck_walkthrough_loop_passes_its_tests_and_the_kit(recheck_walkthrough, repo):
    """The agent loop written from the docs alone: its tests (the agent-loop kit, and one episode's
    layout) pass, run here in-process; its recipe snippet validates."""
    import importlib.util

    import yaml

    root = recheck_walkthrough
    assert (root / "pyproject.toml").read_text().count("recheck = \"rlcli_recheck\"") == 1
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location("test_recheck", root / "tests" / "test_recheck.py")
        tests = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tests)
        names = [n for n in vars(tests) if n.startswith("test_")]
        assert names == ["test_recheck_keeps_the_agent_loop_contract", "test_answer_follow_up_answer"]
        for name in names:
            getattr(tests, name)()

        from rlcli.config import validate_recipe
        from rlcli.plugins import registry_with

        raw = yaml.safe_load((repo / "recipes" / "quickstart.yaml").read_text())
        raw["tasks"][0]["agent_loop"] = yaml.safe_load(_blocks(_sections(repo)[2], "yaml")[0])["tasks"][0]["agent_loop"]
        rec = validate_recipe(raw, registry=registry_with(tests.rlcli_recheck), base_dir=repo / "recipes")
        assert rec.tasks[0].agent_loop.cfg.turns == 2 and rec.tasks[0].agent_loop.cls is tests.LOOP
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("rlcli_recheck", None)


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
