"""Plugin manager and component registry.

Third-party plugins are Python distributions with an entry point in the ``rlcli`` group; the
built-in components live in the modules of :data:`DEFAULT_PLUGINS` and are registered through
the very same hooks. A broken plugin (an import error, a hook pluggy refuses, a component without
``name`` or ``Config``) is recorded and reported, never fatal to ``rlcli --help`` or ``rlcli plugins``. A component name claimed by two providers is a clash: the name is unusable (a
recipe naming it fails with an error naming both providers) while every other name works and
``rlcli plugins`` lists the clash.

Environment switches:
  RLCLI_DISABLE_PLUGIN_AUTOLOAD=1  load no entry-point plugins (built-ins only)
  RLCLI_LOAD_PLUGINS=a,b            load only these entry-point names
  RLCLI_PLUGINS=mod[:attr],...      also register these importable modules (or their attribute) as
                                    plugins, without packaging them; every rank of a multi-process
                                    run inherits it (loaded even with autoload disabled)
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import os
from dataclasses import dataclass, field
from typing import Any

import pluggy

from rlcli import __version__, hookspecs

# kind (as written in recipes and docs) -> hook name, in declaration order (rlcli.hookspecs.COMPONENT_KINDS)
KINDS: dict[str, str] = {k.name: k.hook for k in hookspecs.COMPONENT_KINDS}

# the modules that register the built-in components, each once, in declaration order
DEFAULT_PLUGINS: tuple[str, ...] = tuple(dict.fromkeys(k.builtins for k in hookspecs.COMPONENT_KINDS))


class PluginError(Exception):
    """A plugin or component problem the user must fix (bad name, duplicate, broken import)."""


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    cls: type
    dist: str
    version: str
    plugin: str

    @property
    def provider(self) -> str:
        """The distribution and the module that registered it: ``rlcli (rlcli.judgers.builtin)``."""
        return f"{self.dist} ({self.cls.__module__})"

    @property
    def description(self) -> str:
        doc = (self.cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


@dataclass
class Registry:
    entries: dict[str, dict[str, Entry]] = field(default_factory=lambda: {k: {} for k in KINDS})
    broken: list[tuple[str, str, str]] = field(default_factory=list)  # (dist, entry point, error)
    dists: dict[int, tuple[str, str]] = field(default_factory=dict)  # id(plugin) -> (dist, version)
    clashes: dict[tuple[str, str], list[Entry]] = field(default_factory=dict)  # (kind, name) -> every provider
    pm: pluggy.PluginManager | None = None

    def get(self, kind: str, name: str) -> type:
        return self.entry(kind, name).cls

    def entry(self, kind: str, name: str) -> Entry:
        table = self.entries[kind]
        if name in table:
            return table[name]
        if (kind, name) in self.clashes:
            raise PluginError(self.clash_message(kind, name))
        raise PluginError(self.unknown_message(kind, name))

    def clash_message(self, kind: str, name: str) -> str:
        providers = " and by ".join(e.provider for e in self.clashes[(kind, name)])
        return (f"{kind} name {name!r} is claimed twice: by {providers}; remove one of them (pip uninstall, "
                f"or leave it out of {ENV_PLUGINS}); `rlcli plugins` lists every clash")

    def unknown_message(self, kind: str, name: Any) -> str:
        available = sorted(self.entries[kind])
        msg = f"unknown {kind} {name!r}; available: {', '.join(available) or '(none)'}"
        same_case = [a for a in available if a.lower() == str(name).lower()]
        close = same_case or difflib.get_close_matches(str(name), available, n=1)
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        if self.broken:
            msg += "; plugins that failed to load: " + ", ".join(f"{d} ({e})" for d, _, e in self.broken)
        return msg

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])




def _load_entry_points(pm: pluggy.PluginManager, registry: Registry) -> None:
    if os.environ.get("RLCLI_DISABLE_PLUGIN_AUTOLOAD"):
        return
    only = os.environ.get("RLCLI_LOAD_PLUGINS")
    wanted = None if only is None else {x.strip() for x in only.split(",") if x.strip()}
    for ep in md.entry_points(group="rlcli"):
        if wanted is not None and ep.name not in wanted:
            continue
        dist_name = ep.dist.metadata["name"] if ep.dist else ep.value
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not break the CLI
            registry.broken.append((dist_name, ep.name, f"{type(exc).__name__}: {exc}"))
            continue
        if _register(pm, registry, plugin, ep.name, dist_name):
            registry.dists[id(plugin)] = (dist_name, ep.dist.version if ep.dist else "?")


ENV_PLUGINS = "RLCLI_PLUGINS"


def _load_env_plugins(pm: pluggy.PluginManager, registry: Registry) -> None:
    """Register the plugins named in ``RLCLI_PLUGINS`` (``module`` or ``module:attribute``). One
    that fails to import is recorded as broken, as an entry point would be."""
    for spec in (x.strip() for x in os.environ.get(ENV_PLUGINS, "").split(",")):
        if not spec:
            continue
        modname, _, attr = spec.partition(":")
        label = f"{ENV_PLUGINS}={spec}"
        try:
            plugin = importlib.import_module(modname)
            for part in filter(None, attr.split(".")):
                plugin = getattr(plugin, part)
        except Exception as exc:
            registry.broken.append((label, spec, f"{type(exc).__name__}: {exc}"))
            continue
        if pm.is_registered(plugin):
            continue
        if _register(pm, registry, plugin, f"env:{spec}", label):
            registry.dists[id(plugin)] = (label, "-")


def _register(pm: pluggy.PluginManager, registry: Registry, plugin: Any, name: str, dist: str) -> bool:
    """Register one installed plugin; one pluggy refuses (a misspelt hook, a wrong signature) is
    recorded as broken, as a failed import is."""
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except Exception as exc:
        if pm.is_registered(plugin):
            pm.unregister(plugin)
        registry.broken.append((dist, name, f"{type(exc).__name__}: {exc}"))
        return False
    return True


def build_plugin_manager() -> tuple[pluggy.PluginManager, Registry]:
    pm = pluggy.PluginManager("rlcli")
    pm.add_hookspecs(hookspecs)
    registry = Registry(pm=pm)
    _load_entry_points(pm, registry)
    _load_env_plugins(pm, registry)
    for modname in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(modname), name=modname)
    pm.check_pending()
    return pm, registry


def _fill(pm: pluggy.PluginManager, registry: Registry) -> None:
    for kind, hook_name in KINDS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            dist, version = registry.dists.get(id(impl.plugin), ("rlcli", __version__))
            try:
                classes = impl.function() or []
            except Exception as exc:
                registry.broken.append((dist, impl.plugin_name, f"{hook_name} raised {type(exc).__name__}: {exc}"))
                continue
            for cls in classes:
                name = getattr(cls, "name", None)
                if not isinstance(name, str) or not name:  # recorded like a broken plugin, never fatal
                    registry.broken.append((dist, impl.plugin_name, f"{hook_name} returned {cls!r} without a "
                                            "string 'name' attribute"))
                elif not hasattr(cls, "Config"):
                    registry.broken.append((dist, impl.plugin_name, f"{kind} {name!r} ({cls.__qualname__}) has "
                                            "no 'Config' model"))
                else:
                    _add(registry, Entry(kind, name, cls, dist, version, impl.plugin_name))


def _add(registry: Registry, entry: Entry) -> None:
    """Register ``entry``; a name another class already claims becomes a clash (neither is usable)."""
    table, key = registry.entries[entry.kind], (entry.kind, entry.name)
    if key in registry.clashes:
        if all(e.cls is not entry.cls for e in registry.clashes[key]):
            registry.clashes[key].append(entry)
        return
    prev = table.get(entry.name)
    if prev is not None and prev.cls is not entry.cls:
        registry.clashes[key] = [table.pop(entry.name), entry]
        return
    table[entry.name] = entry


_REGISTRY: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        pm, registry = build_plugin_manager()
        _fill(pm, registry)
        _REGISTRY = registry
    return _REGISTRY


def registry_with(*plugins: Any) -> Registry:
    """A fresh registry with extra in-process plugin objects registered (for tests and embedding).
    A plugin module that its installed distribution already registered is not registered twice."""
    pm, registry = build_plugin_manager()
    for i, plugin in enumerate(plugins):
        if pm.is_registered(plugin):
            continue
        pm.register(plugin, name=f"inline-{i}-{getattr(plugin, '__name__', type(plugin).__name__)}")
        registry.dists[id(plugin)] = ("<inline>", "-")
    _fill(pm, registry)
    return registry
