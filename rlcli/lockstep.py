"""Lockstep between a colocated engine and the rollout's event loop, so that runs repeat exactly.

An engine that decodes in a worker thread while the event loop handles what its last step
finished (text decoding, judging, the produce strategy's decisions) makes the outcome depend on
timing: a weight-sync pause lands a varying number of decode steps after the group that filled the
batch, and a request made in reaction to a finish joins a varying step. In lockstep the engine
takes its next step only once the loop is **settled**: it has no callback ready to run and no work
it awaits is running off its thread. What a rollout awaits off the loop's thread is ``track``ed
where rlcli hands it to another thread or process (judge calls, background text decoding, tool
calls); work of a third-party component that runs elsewhere and is not tracked is not waited for.

``settled`` reads the loop's queue of ready callbacks (``_ready`` of asyncio's own loops; other
loop implementations are given a fixed number of turns instead).

An engine in lockstep hands out what finished only every :data:`ENGINE_STEPS` steps, counted
from when it last ran out of work (so a resumed run has the same boundaries), or when its work
runs out; the loop handles finishes, and the engine waits for it, once per that many steps
rather than after every step that finished a row (with responses of many lengths, nearly every
step), and a request made in reaction joins at most that many steps later.
"""

from __future__ import annotations

import asyncio
import weakref

__all__ = ["ENGINE_STEPS", "settled", "track"]

ENGINE_STEPS = 8  # a lockstep engine hands out finishes every this many steps since it last ran out of work

_TURNS_WITHOUT_READY_QUEUE = 64  # loops that do not expose their ready queue get this many turns


class _Outstanding:
    """Tracked futures of one event loop that are not done yet."""

    def __init__(self) -> None:
        self.count = 0
        self.none_left = asyncio.Event()
        self.none_left.set()

    def done(self, _fut: asyncio.Future) -> None:
        self.count -= 1
        if self.count == 0:
            self.none_left.set()


_BY_LOOP: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Outstanding]" = weakref.WeakKeyDictionary()


def _outstanding(loop: asyncio.AbstractEventLoop) -> _Outstanding:
    out = _BY_LOOP.get(loop)
    if out is None:
        out = _BY_LOOP[loop] = _Outstanding()
    return out


def track(fut: asyncio.Future) -> asyncio.Future:
    """Count ``fut`` (of the running loop; resolved by work off the loop's thread) as outstanding
    until it is done; returns it. Call it on the loop's thread."""
    out = _outstanding(fut.get_loop())
    out.count += 1
    out.none_left.clear()
    fut.add_done_callback(out.done)
    return fut


async def settled() -> None:
    """Return once the running loop has nothing to do but wait: no callback ready to run (other
    than this coroutine's own turn) and no ``track``ed future outstanding."""
    loop = asyncio.get_running_loop()
    out = _outstanding(loop)
    ready = getattr(loop, "_ready", None)
    turns = 0
    while True:
        await asyncio.sleep(0)  # whatever was scheduled before this turn runs first
        if out.count:
            await out.none_left.wait()
            continue
        if ready is not None:
            if not ready:
                return
        else:
            turns += 1
            if turns >= _TURNS_WITHOUT_READY_QUEUE:
                return
