"""The shape every registered component shares: a ``name`` and a pydantic ``Config``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class ComponentConfig(BaseModel):
    """Base for component configs: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Component:
    """Base for registered components. Subclasses set ``name`` and usually override ``Config``."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[ComponentConfig]] = ComponentConfig

    def __init__(self, config: ComponentConfig | None = None):
        self.config = config if config is not None else self.Config()
