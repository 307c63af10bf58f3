"""The process's peak resident host memory over a stretch of a run (Linux ``/proc``): what the
offload settings (``fsdp.cpu_offload``, ``kl.ref_offload``) move into host RAM, next to the GPU
peaks the rows already report.

``reset_peak()`` clears the kernel's high-water mark of the resident set (``VmHWM``; writing 5 to
``/proc/self/clear_refs``, Linux 4.0 on); ``peak_gib()`` reads it. Pinned (page-locked) buffers
count once touched. None where ``/proc`` does not say (other systems, or a refused write)."""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def reset_peak() -> bool:
    """Start a new high-water mark; False when the kernel refuses (the peak then covers the whole process)."""
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


def peak_gib() -> float | None:
    """The resident set's high-water mark since the last :func:`reset_peak`, in GiB."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) * 1024 / 2**30, 2)
    except (OSError, ValueError, IndexError):
        pass
    return None
