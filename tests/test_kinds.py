"""Each component kind is declared once (``rlcli.hookspecs.COMPONENT_KINDS``); everything that names
kinds must agree with that declaration: the hookspecs, the registry's kinds, the built-in
registrations, the recipe's component fields, ``rlcli plugins`` and the kind table of docs/plugins.md."""

from __future__ import annotations

import importlib
import json
import re

import pytest
from click.testing import CliRunner

from rlcli import hookspecs
from rlcli.hookspecs import COMPONENT_KINDS, KIND_NAMES, Kind

HOOKS = [k.hook for k in COMPONENT_KINDS]


@pytest.fixture(scope="module")
def builtins_only():
    """The process registry holding the built-ins only (as docgen runs), restored afterwards."""
    from rlcli.plugins import get_registry

    mp = pytest.MonkeyPatch()
    mp.setenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD", "1")
    mp.delenv("RLCLI_PLUGINS", raising=False)
    try:
        yield get_registry(refresh=True)
    finally:
        mp.undo()
        get_registry(refresh=True)


def _import(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_each_kind_is_declared_once_and_the_registry_derives_from_it():
    from rlcli.plugins import DEFAULT_PLUGINS, KINDS

    assert len(set(KIND_NAMES)) == len(KIND_NAMES) and len(set(HOOKS)) == len(HOOKS)
    assert all(re.fullmatch(r"[a-z_]+", k) for k in KIND_NAMES)
    assert KINDS == {k.name: k.hook for k in COMPONENT_KINDS}  # same kinds, same order
    assert DEFAULT_PLUGINS == tuple(dict.fromkeys(k.builtins for k in COMPONENT_KINDS))


def test_every_kind_has_its_hookspec_and_no_hookspec_is_undeclared():
    specs = [n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), "rlcli_spec")]
    assert sorted(specs) == sorted(HOOKS)
    for k in COMPONENT_KINDS:
        spec = getattr(hookspecs, k.hook)
        assert spec.__name__ == k.hook and spec.__doc__ == k.doc
    from rlcli.plugins import build_plugin_manager

    pm, _ = build_plugin_manager()
    for hook in HOOKS:
        assert getattr(pm.hook, hook).spec is not None, f"{hook} has no hookspec"


def test_built_in_modules_register_exactly_the_declared_kinds():
    """Each module of DEFAULT_PLUGINS implements the hooks of the kinds that name it there, and
    no other hook; together they implement every declared hook."""
    from rlcli.plugins import DEFAULT_PLUGINS

    implemented: dict[str, set[str]] = {}
    for modname in DEFAULT_PLUGINS:
        mod = importlib.import_module(modname)
        implemented[modname] = {n for n in dir(mod) if hasattr(getattr(mod, n), "rlcli_impl")}
    for modname, hooks in implemented.items():
        assert hooks == {k.hook for k in COMPONENT_KINDS if k.builtins == modname}, modname
    assert set().union(*implemented.values()) == set(HOOKS)


def test_every_kind_has_built_ins_that_subclass_its_base_class(builtins_only):
    for k in COMPONENT_KINDS:
        base = _import(k.base)
        entries = [builtins_only.entry(k.name, n) for n in builtins_only.names(k.name)]
        assert entries, f"no built-in {k.name}"
        for e in entries:
            assert e.dist == "rlcli"
            assert issubclass(e.cls, base), f"{k.name} {e.name!r} ({e.cls.__qualname__}) is not a {k.base}"


def test_recipe_fields_name_declared_kinds_and_reach_every_kind(builtins_only):
    """Every ``Kind(...)`` field of the recipe (and of a built-in component's options) names a
    declared kind, and every declared kind can be configured from a recipe."""
    from rlcli.config import Recipe
    from rlcli.config.tree import component_fields

    with pytest.raises(ValueError, match="unknown component kind 'nope'"):
        Kind("nope")
    top = component_fields(Recipe)
    nested = [(f"{path}.{sub}", sub_kind)
              for path, kind in top for name in builtins_only.names(kind)
              for sub, sub_kind in component_fields(builtins_only.get(kind, name).Config)]
    used = {kind for _, kind in top + nested}
    assert used <= set(KIND_NAMES)
    assert used == set(KIND_NAMES), f"declared kinds no recipe can configure: {set(KIND_NAMES) - used}"


def test_rlcli_plugins_lists_the_declared_kinds_in_order(builtins_only):
    from rlcli.cli import cli

    out = CliRunner().invoke(cli, ["plugins", "--json"])
    assert out.exit_code == 0, out.output
    kinds = list(dict.fromkeys(c["kind"] for c in json.loads(out.output)["components"]))
    assert kinds == list(KIND_NAMES)


def test_docs_kind_table_is_generated_from_the_declaration(repo, builtins_only):
    from rlcli.docgen import KINDS_BEGIN, KINDS_END, kind_table

    text = (repo / "docs" / "plugins.md").read_text()
    assert KINDS_BEGIN in text and KINDS_END in text, "docs/plugins.md lost its kind table markers"
    current = text[text.index(KINDS_BEGIN): text.index(KINDS_END) + len(KINDS_END)]
    rows = re.findall(r"^\| `([a-z_]+)` \|", current, re.M)
    assert rows == list(KIND_NAMES), "docs/plugins.md's kind table does not list the declared kinds in order"
    assert current == kind_table(), (
        "run: RLCLI_DISABLE_PLUGIN_AUTOLOAD=1 python -m rlcli.docgen --write docs/plugins.md")


def test_each_hook_section_of_the_docs_names_its_built_ins(repo, builtins_only):
    """The prose under ``## `register_x()``` mentions every built-in of that kind."""
    text = (repo / "docs" / "plugins.md").read_text()
    for k in COMPONENT_KINDS:
        m = re.search(rf"^## `{k.hook}\(\)`\n(.*?)(?=^## |\Z)", text, re.M | re.S)
        assert m, f"docs/plugins.md has no section for {k.hook}()"
        missing = [n for n in builtins_only.names(k.name) if f"`{n}`" not in m.group(1)]
        assert not missing, f"docs/plugins.md, {k.hook}(): built-ins not mentioned: {missing}"
