"""rlcli plugin: the ``vllm`` inference backend (vLLM's engine in process).

Install with ``pip install "rlcli-vllm[engine]"`` on a CUDA machine (the extra pins the vLLM
version this release was written against); select it with ``rollout: {name: vllm}``. Without
vLLM installed the plugin still loads (``rlcli plugins`` lists it) and ``rlcli validate`` reports
the install line.
"""

from __future__ import annotations

from rlcli import hookimpl
from rlcli_vllm.backend import VLLMBackend
from rlcli_vllm.logic import ENGINE

__version__ = "0.1.0"
__all__ = ["ENGINE", "VLLMBackend", "register_inference_backends"]


@hookimpl
def register_inference_backends() -> list[type]:
    """The ``vllm`` inference backend."""
    return [VLLMBackend]
