"""Methods vLLM mixes into its GPU worker for rlcli (``EngineArgs(worker_extension_cls=...)``).

vLLM resolves the class by its qualified name (``rlcli_vllm.worker_extension.RlcliWorkerExtension``)
and appends it to the worker class's bases, so ``engine.collective_rpc("rlcli_load_weights", ...)``
calls the method on the worker. The plugin runs vLLM's engine in process with the "uni" executor,
so the tensors reach the worker as they are (no serialisation, no copy).
"""

from __future__ import annotations

import torch


class RlcliWorkerExtension:
    """Weight loading for rlcli's ``update_weights`` (runs inside vLLM's worker)."""

    def rlcli_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy Hugging Face-named tensors into the model in place; returns how many were given.

        ``model.load_weights`` maps Hugging Face names to vLLM's fused parameters (q/k/v into
        ``qkv_proj``, gate/up into ``gate_up_proj``) and copies into the existing storage, so CUDA
        graphs captured on those parameters stay valid. Names were checked by the plugin already.
        """
        model = self.model_runner.get_model()
        with torch.no_grad():
            model.load_weights(weights=iter(named_tensors))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return len(named_tensors)
