"""What the kits of :mod:`rlcli.testing` share: running a kit's checks by name."""

from __future__ import annotations

from typing import Callable, Iterable


def run_checks(checks: dict[str, Callable[..., None]], call: Callable[[str, Callable[..., None]], None],
               skip: Iterable[str] = (), named: Iterable[str] = ()) -> list[str]:
    """``call(name, check)`` for every check but those in ``skip``; returns the names run. The first
    failure raises ``AssertionError`` prefixed with the check's name; a name in ``skip`` or ``named``
    (e.g. the keys of per-check options) that is no check is a ``ValueError``."""
    skip = set(skip)
    unknown = (skip | set(named)) - set(checks)
    if unknown:
        raise ValueError(f"unknown check name(s) {sorted(unknown)}; known: {', '.join(checks)}")
    ran = []
    for name, check in checks.items():
        if name in skip:
            continue
        try:
            call(name, check)
        except AssertionError as exc:
            raise AssertionError(f"[{name}] {exc}") from exc
        ran.append(name)
    return ran
