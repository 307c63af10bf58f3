"""The ``--memory`` summaries of ``grpo_step.py``: CUDA allocations grouped by the stack that made them.

``summarize_snapshot`` groups the blocks a ``torch.cuda.memory._snapshot()`` holds live;
``peak_in_trace`` replays the snapshot's allocation trace and groups what was live at the highest
point of a time window (a train step). Both return plain text, largest group first.
"""

from __future__ import annotations

from pathlib import Path


def _where(frames: list[dict]) -> str:
    """The innermost frames of an allocation outside torch's own machinery (torch.nn kept)."""
    # Python frames only: with C++ stacks recorded as well (torch's default), the innermost frames are
    # the allocator's own (seen on the H200: every block grouped under CUDACachingAllocator::malloc).
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    kept = [f for f in py if "site-packages/torch/" not in f["filename"] or "torch/nn/" in f["filename"]][:4]
    return " <- ".join(f"{Path(f.get('filename', '?')).name}:{f.get('line', '?')} {f.get('name', '?')}"
                       for f in kept) or "(no stack recorded)"


def _grouped(title: str, blocks: list[tuple[int, list[dict]]], top: int) -> str:
    groups: dict[str, list[int]] = {}
    for size, frames in blocks:
        groups.setdefault(_where(frames), []).append(size)
    lines = [f"{title}: {sum(s for s, _ in blocks) / 2**30:.2f} GiB in {len(blocks)} blocks"]
    for where, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{sum(sizes) / 2**30:8.3f} GiB  {len(sizes):5d} blocks  {where}")
    return "\n".join(lines)


def summarize_snapshot(snapshot: dict, top: int = 25) -> str:
    """The live (``active_allocated``) blocks of ``torch.cuda.memory._snapshot()``, grouped by the
    innermost frames that allocated them, largest total first."""
    blocks = [(int(b.get("size", 0)), b.get("frames", [])) for seg in snapshot.get("segments", [])
              for b in seg.get("blocks", []) if b.get("state") == "active_allocated"]
    return _grouped("live", blocks, top)


def peak_in_trace(snapshot: dict, start_us: float | None = None, end_us: float | None = None, top: int = 25) -> str:
    """What was allocated at the highest point of a window of the recorded allocation trace
    (``device_traces`` of a snapshot taken with memory history on since before the model was
    built): the trace is replayed from its start (``alloc`` adds a block, ``free_requested`` removes
    it), the peak inside ``[start_us, end_us]`` is found, and the live blocks at that moment are
    grouped by allocation stack."""
    trace = (snapshot.get("device_traces") or [[]])[0]

    def replay(stop: int | None) -> tuple[dict[int, tuple[int, list[dict]]], int]:
        """The live blocks after event ``stop`` (None: the end), and the index of the peak event."""
        live: dict[int, tuple[int, list[dict]]] = {}
        total = best = 0
        best_i = -1
        for i, ev in enumerate(trace):
            if stop is not None and i > stop:
                break
            action, addr = ev.get("action"), ev.get("addr")
            if action == "alloc":
                live[addr] = (int(ev.get("size", 0)), ev.get("frames", []))
                total += live[addr][0]
            elif action in ("free_requested", "free_completed") and addr in live:
                total -= live.pop(addr)[0]
            t = ev.get("time_us")
            inside = (start_us is None or t is None or t >= start_us) and (end_us is None or t is None or t <= end_us)
            if inside and total > best:
                best, best_i = total, i
        return live, best_i

    _, best_i = replay(None)
    what = "in the window"
    if best_i < 0 and (start_us is not None or end_us is not None):  # clock mismatch: the whole trace
        start_us = end_us = None
        _, best_i = replay(None)
        what = "in the whole trace (no event time fell in the window)"
    if best_i < 0:
        return "peak: no allocation recorded"
    live, _ = replay(best_i)
    return _grouped(f"peak {what} (trace event {best_i} of {len(trace)})", list(live.values()), top)
