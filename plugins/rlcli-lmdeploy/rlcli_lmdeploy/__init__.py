"""rlcli plugin: the ``lmdeploy`` inference backend (LMDeploy's PyTorch engine in process).

Install with ``pip install "rlcli-lmdeploy[engine]"`` on a CUDA machine (the extra pins the
LMDeploy version this release was written against); select it with ``rollout: {name: lmdeploy}``.
Without LMDeploy installed the plugin still loads (``rlcli plugins`` lists it) and
``rlcli validate`` reports the install line.
"""

from __future__ import annotations

from rlcli import hookimpl
from rlcli_lmdeploy.backend import LMDeployBackend
from rlcli_lmdeploy.logic import ENGINE

__version__ = "0.1.0"
__all__ = ["ENGINE", "LMDeployBackend", "register_inference_backends"]


@hookimpl
def register_inference_backends() -> list[type]:
    """The ``lmdeploy`` inference backend."""
    return [LMDeployBackend]
