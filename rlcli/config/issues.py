"""A recipe problem with its dotted path, and the error that lists every one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Issue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<recipe>'}: {self.message}"


class RecipeError(Exception):
    """Raised with every problem of a recipe; ``issues`` lists them with dotted paths."""

    def __init__(self, issues: list[Issue], source: str | None = None):
        self.issues = issues
        self.source = source
        head = f"{source}: " if source else ""
        lines = "\n".join(f"  - {i}" for i in issues)
        super().__init__(f"{head}{len(issues)} problem(s) in recipe:\n{lines}")
