"""The building blocks of the recipe sections: strict models and component specs (``{name: ..., **options}``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from rlcli.hookspecs import Kind  # the kinds are declared once, in rlcli.hookspecs

__all__ = ["ComponentSpec", "Kind", "Strict"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ComponentSpec(BaseModel):
    """``{name: ..., **options}``: a registered component and its options."""

    model_config = ConfigDict(extra="allow")
    name: str
    _cls: type | None = PrivateAttr(None)
    _cfg: BaseModel | None = PrivateAttr(None)

    @property
    def cls(self) -> type:
        if self._cls is None:
            raise RuntimeError(f"component {self.name!r} was not resolved (use rlcli.config.load_recipe)")
        return self._cls

    @property
    def cfg(self) -> Any:
        if self._cfg is None:
            raise RuntimeError(f"component {self.name!r} was not resolved (use rlcli.config.load_recipe)")
        return self._cfg

    def build(self, **runtime: Any) -> Any:
        """Instantiate the component: ``cls(cfg, **runtime)``."""
        return self.cls(self.cfg, **runtime)


def _spec(kind: str, default: dict | None = None, **kw: Any) -> Any:
    if default is None:
        return Annotated[ComponentSpec, Kind(kind)]
    return Annotated[ComponentSpec, Kind(kind), Field(default_factory=lambda: ComponentSpec(**default), **kw)]
