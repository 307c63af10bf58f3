"""The built-in inference backend: a continuous-batching engine in pure PyTorch.

``EmbeddedBackend`` (registered as ``embedded``) serves the RL loop from the process that runs
it: no server, no extra dependency, the same code on a laptop CPU (float32) and on a GPU
(bfloat16). It is built from three parts:

* :class:`LlamaFamilyModel` (``model.py``) - a batched prefill/decode forward for the llama
  family (model types ``llama``, ``mistral``, ``qwen2``, ``qwen3``). It reuses the Hugging Face
  model's own modules (embedding, q/k/v/o projections, RMSNorms, q/k norms, MLP, lm_head and the
  model's ``rotary_emb``, so every RoPE scaling variant stays correct) and replaces only
  attention (``attention.py`` for SDPA, :mod:`rlcli.backends.decode_attention` for Triton) and
  the KV cache.
* :class:`KVCache` (``kv_cache.py``) - per layer, one preallocated ``[max_batch_size, kv_heads,
  max_model_len, head_dim]`` tensor for keys and one for values. Active sequences always occupy
  rows ``0..B-1`` ("slot compaction": when a sequence finishes, the last active rows move into
  the freed rows), so decode attention reads the contiguous views ``cache[:B, :, :L]`` with no
  gather.
* :class:`EmbeddedEngine` (``engine.py``) - the synchronous scheduler. One
  :meth:`~EmbeddedEngine.step` admits waiting requests into free rows (``admission.py``: their
  prompts are prefilled in padded batches of at most ``max_prefill_tokens``; identical prompts
  admitted together - the ``prompt_repeat_k`` copies of a group - are prefilled once and their
  KV written to every copy's row), then runs one batched decode step for all active rows
  (``decode_step.py``). Sampling happens on the device (``row_sampling.py``); the only
  device-to-host transfer of a decode step is one boolean per row ("sampled a stop token"), and
  token ids, logprobs and versions stay in device buffers (``state.py``) until a sequence
  finishes (``finishing.py``).

Sampling (``sampling.py``) is a function of (request seed, token position, logits) only: each
row draws one uniform number from a counter-based hash of its seed and the absolute position of
the token and inverts the CDF of its (temperature-scaled, top-k/top-p filtered) distribution. A
request therefore yields the same tokens whatever else is in the batch and whenever it is
admitted, and a partial response continued with the same seed draws the same numbers it would
have drawn uninterrupted. (Logits themselves can differ in the last bits with the batch shape -
more so on GPUs, where matrix kernels are chosen per shape - so a draw within that distance of a
CDF boundary could still flip.) The logprob returned for a token is ``log_softmax(logits / T)``
with ``T`` the temperature (1.0 for greedy) and *no* top-k/top-p renormalisation, which is what
the trainer recomputes.

CPU vs GPU: everything here runs on both; nothing is CPU-only. On CUDA with ``cuda_graphs:
true`` the decode forward runs on bucketed shapes (rows padded to 1, 2, 4, ..., 32 then
multiples of 32; key length padded to a multiple of 128, 512 past 1024, a power of two past
4096) and each shape's forward is captured once into a CUDA graph (:class:`CudaGraphDecoder`,
``cuda_graphs.py``) and replayed afterwards; ``sleep(1)`` keeps the graphs when the KV cache
comes back at the same address. Prefill and sampling run eagerly (outside graphs, cuDNN
attention is avoided: it plans per shape). The cache is a dense per-row tensor (no paging),
sized ``max_batch_size x max_model_len``.

:class:`EmbeddedBackend` (``backend.py``) wraps the engine in the :mod:`rlcli.backends.base`
contract. Every name below is importable from ``rlcli.backends.embedded``.
"""

from rlcli.backends.embedded.attention import _attention_backends, decode_mask, sdpa_decode_attention
from rlcli.backends.embedded.backend import EmbeddedBackend
from rlcli.backends.embedded.cuda_graphs import CudaGraphDecoder
from rlcli.backends.embedded.engine import EmbeddedEngine
from rlcli.backends.embedded.kv_cache import KVCache
from rlcli.backends.embedded.model import SUPPORTED_MODEL_TYPES, LlamaFamilyModel
from rlcli.backends.embedded.sampling import (
    counter_uniform,
    filter_top_k_top_p,
    sample_plain,
    sample_plain_keyed,
    sample_tokens,
    seed_keys,
)
from rlcli.backends.embedded.state import RowState, Sequence

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CudaGraphDecoder",
    "EmbeddedBackend",
    "EmbeddedEngine",
    "KVCache",
    "LlamaFamilyModel",
    "RowState",
    "Sequence",
    "_attention_backends",
    "counter_uniform",
    "decode_mask",
    "filter_top_k_top_p",
    "sample_plain",
    "sample_plain_keyed",
    "sample_tokens",
    "sdpa_decode_attention",
    "seed_keys",
]
