"""``resources.expandable_segments``: the CUDA caching allocator's expandable segments, for the length of a run.

A long-tailed rollout makes training packs of every length from step to step, and the caching
allocator keeps the blocks it carved for each: at 7B on one H200 (tenth device session) a step
failed with 31.7 GiB reserved but unallocated, while the same run with expandable segments trained
at a 126 GiB peak. Expandable segments map one growing range per stream instead of fixed blocks,
so a freed range is reused whatever the next request's size.

``None`` (auto) turns them on when the inference backend's class allows them
(``InferenceBackend.allows_expandable_segments``: the embedded engine) and the process environment
does not configure the allocator itself (``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``): an
engine plugin's memory pools may not mix with them (vLLM's sleep mode refuses them). The setting
is process-wide; :func:`apply` returns the function that puts the previous value back, which
the runner calls when it closes, so a second run in the same process (a benchmark's TRL + vLLM
row) starts from the allocator as it was.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

import torch

log = logging.getLogger("rlcli")

ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch >= 2.9 reads the first, older the second


def _env_conf(environ: Mapping[str, str]) -> str | None:
    for var in ENV_VARS:
        if environ.get(var):
            return environ[var]
    return None


def wanted(setting: bool | None, backend: type, environ: Mapping[str, str] = os.environ) -> bool | None:
    """True / False to set the allocator so; None to leave it as the environment made it.
    ``backend``: the run's inference-backend class."""
    if setting is not None:
        return setting
    if not getattr(backend, "allows_expandable_segments", False) or _env_conf(environ) is not None:
        return None
    return True


def _enabled_in(conf: str | None) -> bool:
    """Whether an allocator configuration string (``key:value,key:value``) turns expandable segments on."""
    for item in (conf or "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def _set(enabled: bool) -> None:
    conf = f"expandable_segments:{'True' if enabled else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(conf)


def apply(setting: bool | None, backend: type, device: torch.device,
          environ: Mapping[str, str] = os.environ) -> Callable[[], None]:
    """Set expandable segments for a run on ``device``; returns what undoes it (a no-op when nothing changed)."""
    want = wanted(setting, backend, environ)
    before = _enabled_in(_env_conf(environ))
    if device.type != "cuda" or want is None or want == before:
        return lambda: None
    try:
        _set(want)
    except RuntimeError as exc:  # a build or platform whose allocator refuses the setting: run without it
        log.warning("CUDA allocator: could not turn expandable segments %s (%s); resources.expandable_segments "
                    "has no effect in this run", "on" if want else "off", exc)
        return lambda: None
    log.info("CUDA allocator: expandable segments %s (resources.expandable_segments)", "on" if want else "off")
    return lambda: _set(before)
