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


def test_duplicate_name_is_an_error_naming_both():
    class Fake(Judger):
        """Duplicate."""

        name = "gsm8k"

    class Plugin:
        @hookimpl
        def register_judgers(self):
            return [Fake]

    with pytest.raises(PluginError, match=r"claimed twice.*rlcli.*<inline>|claimed twice.*<inline>.*rlcli"):
        registry_with(Plugin())


def test_component_without_name_is_rejected():
    class NoName(Component):
        """x"""

    class Plugin:
        @hookimpl
        def register_judgers(self):
            return [NoName]

    with pytest.raises(PluginError, match="without a string 'name'"):
        registry_with(Plugin())


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
