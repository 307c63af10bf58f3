"""Engine package status, for ``check_config`` and ``rlcli plugins``: :class:`EnginePackage` (the
engine a plugin drives and whether it is installed) and :func:`managed_kwarg_issues`."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any


def managed_kwarg_issues(extra: Any, managed: dict[str, str]) -> list[tuple[str, str]]:
    """``engine_kwargs`` keys that the plugin sets itself (the user may not override them)."""
    return [("engine_kwargs", f"{key!r} is set by the plugin ({managed[key]})") for key in extra if key in managed]


@dataclass(frozen=True)
class EnginePackage:
    """The engine a plugin drives: its distribution, import name, tested version and install line."""

    label: str  # "vLLM"
    distribution: str  # "vllm"
    module: str  # "vllm"
    tested: str  # "0.26.0": the version this plugin release was written and checked against
    minimum: str  # oldest version whose API the plugin supports
    plugin: str  # "rlcli-vllm"

    @property
    def install_line(self) -> str:
        return f'pip install "{self.plugin}[engine]"'

    def installed_version(self) -> str | None:
        """The installed engine version, or None when the package is missing (nothing is imported)."""
        if importlib.util.find_spec(self.module) is None:
            return None
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    def problem(self) -> str | None:
        """Why this engine cannot be used here (with the exact install line), or None."""
        version = self.installed_version()
        hint = (
            f"install it with: {self.install_line}  (that is {self.distribution}=={self.tested}, on a CUDA machine "
            f"whose torch matches it)"
        )
        if version is None:
            return f"the {self.label} engine is not installed (the '{self.module}' package cannot be imported); {hint}"
        if version != "unknown" and _version_tuple(version) < _version_tuple(self.minimum):
            return (
                f"{self.distribution} {version} is older than {self.minimum}, the oldest {self.plugin} "
                f"supports; {hint}"
            )
        return None

    def describe(self) -> str:
        """One line for ``rlcli plugins``: which engine version is installed."""
        version = self.installed_version()
        if version is None:
            return f"{self.distribution} not installed: {self.install_line}"
        note = "" if version == self.tested else f", tested with {self.tested}"
        return f"{self.distribution} {version}{note}"


def _version_tuple(version: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return ()
