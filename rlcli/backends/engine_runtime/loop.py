"""The engine thread: :class:`EngineLoop`, a daemon thread running its own asyncio event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Coroutine

log = logging.getLogger(__package__)  # "rlcli.backends.engine_runtime", as before the split


class EngineLoop:
    """A daemon thread running its own asyncio event loop."""

    def __init__(self, name: str):
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            except Exception:  # never let teardown raise in a daemon thread
                log.debug("engine loop teardown", exc_info=True)
            finally:
                self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule ``coro`` on the engine loop; the returned future is thread-safe."""
        if not self.alive:
            coro.close()
            raise RuntimeError(f"the {self.name} engine thread has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run ``coro`` on the engine loop and wait for its result (from any other thread)."""
        if self.in_thread():
            coro.close()
            raise RuntimeError("a blocking engine call was made from the engine thread itself (it would deadlock)")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"the {self.name} engine did not answer within {timeout} s") from None

    def stop(self, timeout: float = 60.0) -> None:
        if not self.alive:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_thread():
            self._thread.join(timeout)
