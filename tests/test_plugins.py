"""The plugin registry: built-ins through hooks, duplicates, broken plugins, docs coverage."""

import re

import pytest

from rlcli import hookimpl
from rlcli.component import Component
from rlcli.judgers.base import Judger
from rlcli.plugins import KINDS, PluginError, get_registry, registry_with


def test_builtins_register_through_hooks():
    reg = get_registry()
    assert reg.entry("judger", "gsm8k").dist == "rlcli"
    for kind in ("agent_loop", "judger", "produce_strategy", "replay_buffer", "inference_backend",
                 "advantage_estimator", "policy_loss", "evaluator_metric", "tracker", "sampler", "group_filter"):
        assert reg.names(kind), f"no built-in {kind}"
        for e in reg.entries[kind].values():
            assert e.description, f"{kind} {e.name} has no docstring"


def test_third_party_plugin_object_registers():
    class Shout(Judger):
        """Scores 1 when the response is upper case."""

        name = "shout"

        def judge(self, response, label, sample):
            return float(response.isupper())

    class Plugin:
        @hookimpl
        def register_judgers(self):
            return [Shout]

    reg = registry_with(Plugin())
    e = reg.entry("judger", "shout")
    assert e.cls is Shout and e.dist == "<inline>"


def test_duplicate_name_is_a_clash_naming_both_and_only_that_name_fails():
    class Fake(Judger):
        """Duplicate."""

        name = "gsm8k"

    class Plugin:
        @hookimpl
        def register_judgers(self):
            return [Fake]

    reg = registry_with(Plugin())
    assert [e.dist for e in reg.clashes[("judger", "gsm8k")]] == ["rlcli", "<inline>"]
    with pytest.raises(PluginError, match=r"judger name 'gsm8k' is claimed twice: by rlcli \(rlcli\.judgers.*\) "
                                          r"and by <inline> \(tests\.test_plugins\)"):
        reg.get("judger", "gsm8k")
    assert reg.get("judger", "exact_match") and "gsm8k" not in reg.names("judger")


CLASH_PLUGIN = """
from rlcli import hookimpl
from rlcli.judgers.base import Judger
class Exact(Judger):
    '''Another exact_match.'''
    name = 'exact_match'
    def judge(self, response, label, sample):
        return 1.0
@hookimpl
def register_judgers():
    return [Exact]
"""


def test_a_clashing_installed_plugin_fails_only_recipes_using_the_name(repo, tmp_path, monkeypatch):
    """Acceptance 5 of issue 29: a pip-installed plugin (an ``rlcli`` entry point) claiming
    ``exact_match``: ``rlcli plugins`` exits 0 and names the clash, a recipe without that name
    trains, one with it exits 2 naming both providers."""
    import importlib
    import importlib.metadata as md
    import json

    from click.testing import CliRunner

    from rlcli import plugins as plugmod
    from rlcli.cli import cli

    (tmp_path / "clashplug.py").write_text(CLASH_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))

    class Dist:
        metadata = {"name": "rlcli-clashplug"}
        version = "9.9"

    class EP:
        name, value, dist = "clashplug", "clashplug", Dist()

        def load(self):
            return importlib.import_module("clashplug")

    real = md.entry_points
    monkeypatch.setattr(plugmod.md, "entry_points",
                        lambda group=None: [EP()] if group == "rlcli" else real(group=group))
    monkeypatch.delenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("RLCLI_LOAD_PLUGINS", raising=False)
    monkeypatch.setattr(plugmod, "_REGISTRY", None)  # the CLI's registry, built afresh with the plugin
    run = CliRunner().invoke
    text = run(cli, ["plugins"])
    assert text.exit_code == 0, text.output
    line = next(x for x in text.output.splitlines() if x.startswith("name clash: judger 'exact_match' is "))
    assert "rlcli 0.1.0 (rlcli.judgers" in line and "rlcli-clashplug 9.9 (clashplug)" in line, line
    js = run(cli, ["plugins", "--json"])
    assert js.exit_code == 0, js.output
    (clash,) = json.loads(js.output)["clashes"]
    assert (clash["kind"], clash["name"]) == ("judger", "exact_match")
    assert sorted(p["distribution"] for p in clash["providers"]) == ["rlcli", "rlcli-clashplug"]

    recipe = str(repo / "recipes" / "quickstart.yaml")
    used = run(cli, ["validate", recipe])
    assert used.exit_code == 2
    assert "tasks.0.judger.name: judger name 'exact_match' is claimed twice: by " in used.output
    assert "rlcli-clashplug (clashplug)" in used.output and "rlcli (rlcli.judgers" in used.output
    other = ["tasks.0.judger={name: char_match, executor: inline}", "trainer.enable_evaluate=false",
             "trainer.enable_initial_evaluate=false", "~eval"]
    ok = run(cli, ["train", recipe, *other, "--quiet", "--work-dir", str(tmp_path / "w"),
                   "trainer.total_train_steps=1", "trainer.train_batch_size=2"])
    assert ok.exit_code == 0, ok.output
    assert re.fullmatch(rf"done: {re.escape(str(tmp_path / 'w'))} \| reward/mean [\d.]+\n", ok.output)  # --quiet
    rows = [json.loads(x) for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["judger/calls"] > 0


def test_component_without_name_is_rejected():
    class NoName(Component):
        """x"""

    class Plugin:
        @hookimpl
        def register_judgers(self):
            return [NoName]

    reg = registry_with(Plugin())  # recorded as broken, never fatal to the other components
    assert "without a string 'name'" in reg.broken[0][2] and reg.get("judger", "gsm8k")
    with pytest.raises(PluginError, match="failed to load.*without a string 'name'"):
        reg.get("judger", "nope")


def test_a_plugin_pluggy_refuses_is_reported_not_fatal(monkeypatch):
    """A misspelt hook name in an installed plugin: recorded as broken, the rest works."""
    import importlib.metadata as md
    import types

    from rlcli import plugins as plugmod

    mod = types.ModuleType("misspelt")

    @hookimpl
    def register_judger():  # the hook is register_judgers
        return []

    mod.register_judger = register_judger

    class EP:
        name, value, dist = "misspelt", "misspelt", None

        def load(self):
            return mod

    real = md.entry_points
    monkeypatch.setattr(plugmod.md, "entry_points",
                        lambda group=None: [EP()] if group == "rlcli" else real(group=group))
    monkeypatch.delenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("RLCLI_LOAD_PLUGINS", raising=False)
    reg = plugmod.registry_with()
    assert [b[:2] for b in reg.broken] == [("misspelt", "misspelt")] and "register_judger" in reg.broken[0][2]
    assert reg.get("judger", "gsm8k")


def test_unknown_name_lists_available():
    with pytest.raises(PluginError, match=r"unknown judger 'gsm9k'; available: .*gsm8k.*did you mean 'gsm8k'"):
        get_registry().get("judger", "gsm9k")


def test_broken_entry_point_plugin_is_reported_not_fatal(monkeypatch):
    import importlib.metadata as md

    from rlcli import plugins as plugmod

    class EP:
        name = "broken_thing"
        value = "rlcli_no_such_module_xyz"
        dist = None

        def load(self):
            raise ImportError("No module named 'rlcli_no_such_module_xyz'")

    real = md.entry_points
    monkeypatch.setattr(plugmod.md, "entry_points",
                        lambda group=None: [EP()] if group == "rlcli" else real(group=group))
    monkeypatch.delenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    reg = plugmod.registry_with()
    assert reg.broken and "rlcli_no_such_module_xyz" in reg.broken[0][0]
    assert "gsm8k" in reg.names("judger")
    with pytest.raises(PluginError, match="failed to load"):
        reg.get("judger", "nope")


def test_every_hook_is_documented(repo):
    from rlcli import hookspecs

    text = (repo / "docs" / "plugins.md").read_text()
    hooks = [n for n in dir(hookspecs) if n.startswith("register_")]
    assert set(hooks) == set(KINDS.values())
    for h in hooks:
        assert re.search(rf"^##+ `{h}\(\)`", text, re.M), f"docs/plugins.md does not document {h}()"


def test_registry_with_skips_a_plugin_its_distribution_already_registered():
    """Benchmarks register plugin modules by hand for machines where they are not installed;
    where the distribution is installed too, the module is registered once, not refused."""
    mod = pytest.importorskip("rlcli_math_verify")
    reg = registry_with(mod)
    assert "math_verify" in reg.names("judger")


def test_rlcli_plugins_env_registers_unpackaged_modules(tmp_path, monkeypatch):
    """``RLCLI_PLUGINS=module[:attr],...``: plugins without packaging (every rank inherits the env)."""
    (tmp_path / "envplug.py").write_text(
        "from rlcli import hookimpl\n"
        "from rlcli.judgers.base import Judger\n"
        "class Half(Judger):\n"
        "    '''Scores 0.5.'''\n"
        "    name = 'env_half'\n"
        "    def judge(self, response, label, sample):\n"
        "        return 0.5\n"
        "@hookimpl\n"
        "def register_judgers():\n"
        "    return [Half]\n"
        "class _Obj:\n"
        "    class Inner(Judger):\n"
        "        '''Scores 1.'''\n"
        "        name = 'env_one'\n"
        "    @hookimpl\n"
        "    def register_judgers(self):\n"
        "        return [self.Inner]\n"
        "OBJ = _Obj()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD", "1")  # still loaded: they were asked for by name
    monkeypatch.setenv("RLCLI_PLUGINS", "envplug, envplug:OBJ,rlcli_no_such_module_xyz")
    from rlcli import plugins as plugmod

    reg = plugmod.registry_with()
    assert reg.entry("judger", "env_half").dist == "RLCLI_PLUGINS=envplug"
    assert reg.entry("judger", "env_one").dist == "RLCLI_PLUGINS=envplug:OBJ"
    assert [b[0] for b in reg.broken] == ["RLCLI_PLUGINS=rlcli_no_such_module_xyz"]
    with pytest.raises(PluginError, match="RLCLI_PLUGINS=rlcli_no_such_module_xyz"):
        reg.get("judger", "nope")
