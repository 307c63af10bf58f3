"""The engine-independent half of an inference-engine plugin (rlcli-vllm, rlcli-sglang,
rlcli-lmdeploy, or a third party's): subclass :class:`EngineBackend` and fill in the engine hooks.

:class:`EngineBackend` implements the parts of the :mod:`rlcli.backends.base` contract that do not
depend on the engine, once for all engines:

* **One engine thread.** The engine lives on a daemon thread that runs its own asyncio event loop
  (:class:`EngineLoop`). ``generate`` hands each request to that loop and awaits the result from the
  caller's loop (through :class:`Relay`: the requests a caller's loop makes in one turn cross
  together, and results cross back once per engine-loop turn), so the caller's loop never blocks on the engine and the engine's own asyncio
  machinery (SGLang's tokenizer manager, LMDeploy's request manager) sees one loop for its whole
  life, whatever loops its callers use (the conformance kit starts a new loop per check). The
  synchronous control calls (``pause``, ``update_weights``, ``sleep``, ``wake_up``, ``shutdown``)
  run as coroutines on that loop and block the calling thread until they are done.
* **Pause.** ``pause()`` asks the engine to abort every in-flight request (engines return the
  tokens generated so far; :class:`Job` accumulates them as they stream in) and makes later
  requests return ``"abort"`` at once with no tokens until ``resume()``.
* **Gate.** While the backend is asleep or loading weights, new requests wait before reaching
  the engine; they are admitted (and stamped with the policy version) when the gate opens.
* **Weight updates drain.** ``update_weights`` closes the gate, waits until no request is in
  flight (requests aborted by ``pause()`` end at once; others run to completion on the old
  weights), loads the tensors, sets the version and reopens the gate. So every token of a
  response comes from the weights of one policy version - the version stamped when the request
  was admitted - whatever the engine, and engines never have to swap weights under a running
  batch. Callers that do not want to wait call ``pause()`` first (as rlcli's runners do).
* **Checks before the engine.** Prompt validation (empty, ids outside the vocabulary, too long)
  and update validation (unknown names, wrong shapes: ``ValueError`` before anything changes)
  happen here, against the model's Hugging Face config and a meta-device instance of it.

An engine plugin subclasses :class:`EngineBackend` and implements the ``_engine_*`` hooks, which
always run on the engine loop.

Its files, one concept each (every name is importable from ``rlcli.backends.engine_runtime``,
the path plugins import from):

* ``package.py`` - :class:`EnginePackage` (the engine's distribution, version checks, install
  line) and :func:`managed_kwarg_issues`.
* ``model_info.py`` - :class:`ModelInfo` and :func:`read_model_info` (names and shapes from a
  meta-device instance of the model's config).
* ``kv_budget.py`` - :func:`plan_kv_cache`, the KV cache a run's workload needs (the engine
  plugins' ``auto`` memory option), :class:`KVBudget`, :class:`KVShape` and :func:`kv_shape_from_config`.
* ``helpers.py`` - the pure helpers: :func:`validate_request`, :func:`stop_ids_for`,
  :func:`response_budget`, :func:`prepare_weight_update`, :func:`normalize_finish` and
  :class:`SeedSequence`.
* ``loop.py`` - :class:`EngineLoop`, the engine thread.
* ``relay.py`` - :class:`Relay`, the requests' way between callers' loops and the engine loop,
  and :class:`EngineStopped`.
* ``backend.py`` - :class:`EngineBackend` and :class:`Job`.

Patching a name here (``mock.patch("rlcli.backends.engine_runtime.xyz")``) does not reach the
code that uses it: patch it in the module that holds it (``...engine_runtime.backend.xyz``).
"""

from __future__ import annotations

import logging

from rlcli.backends.base import (  # noqa: F401 - importable from here before the split
    BackendContext,
    GenerateOutput,
    GenerateRequest,
    InferenceBackend,
)
from rlcli.backends.engine_runtime.backend import EngineBackend, Job
from rlcli.backends.engine_runtime.helpers import (  # noqa: F401 - the private names too
    _SEED_MASK,
    SeedSequence,
    normalize_finish,
    prepare_weight_update,
    response_budget,
    stop_ids_for,
    validate_request,
)
from rlcli.backends.engine_runtime.kv_budget import (
    AUTO_MAX_SHARE,
    KV_MARGIN_PERCENT,
    KVBudget,
    KVShape,
    MemoryShare,
    kv_shape_from_config,
    memory_option,
    plan_kv_cache,
)
from rlcli.backends.engine_runtime.loop import EngineLoop
from rlcli.backends.engine_runtime.relay import EngineStopped, Relay
from rlcli.backends.engine_runtime.model_info import ModelInfo, read_model_info
from rlcli.backends.engine_runtime.package import EnginePackage, _version_tuple, managed_kwarg_issues  # noqa: F401
from rlcli.types import SampleParams  # noqa: F401 - importable from here before the split

log = logging.getLogger(__name__)  # the logger the submodules log to

__all__ = [
    "AUTO_MAX_SHARE",
    "EngineBackend",
    "EngineLoop",
    "EngineStopped",
    "EnginePackage",
    "Job",
    "KVBudget",
    "KVShape",
    "KV_MARGIN_PERCENT",
    "MemoryShare",
    "ModelInfo",
    "Relay",
    "SeedSequence",
    "kv_shape_from_config",
    "managed_kwarg_issues",
    "memory_option",
    "normalize_finish",
    "plan_kv_cache",
    "prepare_weight_update",
    "read_model_info",
    "response_budget",
    "stop_ids_for",
    "validate_request",
]
