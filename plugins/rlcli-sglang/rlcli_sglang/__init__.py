"""rlcli plugin: the ``sglang`` inference backend (SGLang's offline engine).

Install with ``pip install "rlcli-sglang[engine]"`` on a CUDA machine (the extra pins the SGLang
version this release was written against); select it with ``rollout: {name: sglang}``. Without
SGLang installed the plugin still loads (``rlcli plugins`` lists it) and ``rlcli validate``
reports the install line.
"""

from __future__ import annotations

from rlcli import hookimpl
from rlcli_sglang.backend import SGLangBackend
from rlcli_sglang.logic import ENGINE

__version__ = "0.1.0"
__all__ = ["ENGINE", "SGLangBackend", "register_inference_backends"]


@hookimpl
def register_inference_backends() -> list[type]:
    """The ``sglang`` inference backend."""
    return [SGLangBackend]
