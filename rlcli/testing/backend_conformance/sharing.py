"""Building backends for the checks, and sharing one between consecutive checks
(:func:`reusing_backends`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Callable

from rlcli.backends.base import InferenceBackend
from rlcli.testing.backend_conformance.helpers import BackendFactory


def _run(main: Callable[[], Any]) -> Any:
    """Run an async check body on a fresh event loop. A failing check shuts down the backend it
    shares (:func:`reusing_backends`), so the next check starts clean."""
    try:
        return asyncio.run(main())
    except BaseException:
        if _SHARED is not None:
            _SHARED.close()
        raise


class _Shared:
    """The one live backend that checks share inside :func:`reusing_backends`."""

    def __init__(self) -> None:
        self.key: tuple[int, str] | None = None
        self.backend: InferenceBackend | None = None
        self.built = 0

    def close(self) -> None:
        backend, self.backend, self.key = self.backend, None, None
        if backend is not None:
            backend.shutdown()


_SHARED: _Shared | None = None  # rebound by reusing_backends: read it as sharing._SHARED, never import it


@contextlib.contextmanager
def reusing_backends():
    """Within this block, consecutive checks on the same factory and model directory share one
    backend instead of building one each: for engines whose start-up takes a minute, this is
    what makes the whole kit fit in one sitting. At most one backend is alive at a time (some
    engines allow one per process); a check that fails shuts its backend down, so the next check
    starts clean; each check hands the backend back resumed. :func:`check_sleep_wake` always
    builds its own (it measures the memory a backend holds). Yields an object whose ``built``
    counts the backends built."""
    global _SHARED
    previous, _SHARED = _SHARED, _Shared()
    shared = _SHARED
    try:
        yield shared
    finally:
        _SHARED = previous
        shared.close()


def _build(make_backend: BackendFactory, model_dir, fresh: bool = False) -> InferenceBackend:
    shared = _SHARED
    key = (id(make_backend), str(model_dir))
    if shared is not None:
        if not fresh and shared.key == key and shared.backend is not None:
            return shared.backend
        shared.close()  # one live backend at a time
    backend = make_backend(model_dir)
    if not isinstance(backend, InferenceBackend):
        raise AssertionError(f"the factory returned {type(backend).__name__}, not an InferenceBackend")
    if shared is not None:
        shared.built += 1
        if not fresh:
            shared.key, shared.backend = key, backend
    return backend


def _done(backend: InferenceBackend) -> None:
    """End a check's use of ``backend``: shut it down, unless it is the shared backend of
    :func:`reusing_backends` (then it is handed back resumed; :func:`_run` shuts it down if the
    check fails)."""
    shared = _SHARED
    if shared is not None and shared.backend is backend:
        backend.resume()
        return
    backend.shutdown()
