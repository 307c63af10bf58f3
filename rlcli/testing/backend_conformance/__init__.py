"""Conformance checks for inference backends (the contract of :mod:`rlcli.backends.base`).

Every check is a plain function that raises ``AssertionError`` with an explanation when the
backend misbehaves, so a backend author can call it from any test runner::

    from rlcli.testing import backend_conformance as bc

    def make_backend(model_dir):
        return MyBackend(MyBackend.Config(), bc.default_context(model_dir))

    def test_my_backend(tmp_path):
        model_dir, other_dir = bc.make_tiny_model_dirs(tmp_path, arch="qwen2")
        bc.run_all(make_backend, model_dir, other_dir)

A *factory* ``make_backend(model_dir) -> InferenceBackend`` builds a fresh backend for a
Hugging Face model directory; checks shut down every backend they build, except inside
:func:`reusing_backends` (``run_all(..., reuse=True)``), where consecutive checks share one. References are
computed with ``transformers`` in float32 on CPU: greedy continuations with
``generate(do_sample=False)`` and logprobs with ``log_softmax(model(prompt + response).logits
/ T)``. Engines that compute in bfloat16 or whose kernels depend on the batch can loosen the
``atol`` / ``min_exact_fraction`` / ``exact_continuation`` / ``batch_invariant`` knobs;
:func:`engine_options` gives the settings the project's GPU engines use per dtype.

Checks that need CUDA (memory release in :func:`check_sleep_wake`) only run their CUDA part
when the backend's context names a CUDA device.
"""

from rlcli.testing.backend_conformance.concurrency import (
    check_invalid_requests_isolated,
    check_many_concurrent,
    many_concurrent_jobs,
)
from rlcli.testing.backend_conformance.generation import (
    check_greedy_matches_reference,
    check_logprobs_match_forward,
    check_min_tokens,
    check_seeded_sampling_batch_invariant,
    check_stop_and_length,
)
from rlcli.testing.backend_conformance.helpers import (  # noqa: F401 (public, outside __all__ as before)
    VALID_FINISH,
    BackendFactory,
    default_context,
    make_tiny_model_dirs,
    reference_greedy,
    reference_logprobs,
)
from rlcli.testing.backend_conformance.pause_sleep import (
    check_pause_returns_partial_and_continue,
    check_sleep_frees_device_memory,
    check_sleep_wake,
)
from rlcli.testing.backend_conformance.sharing import reusing_backends
from rlcli.testing.backend_conformance.suite import ALL_CHECKS, engine_options, run_all
from rlcli.testing.backend_conformance.weight_update import check_weight_update

__all__ = [
    "BackendFactory",
    "default_context",
    "make_tiny_model_dirs",
    "check_greedy_matches_reference",
    "check_logprobs_match_forward",
    "check_stop_and_length",
    "check_min_tokens",
    "check_seeded_sampling_batch_invariant",
    "check_pause_returns_partial_and_continue",
    "check_weight_update",
    "check_many_concurrent",
    "many_concurrent_jobs",
    "check_invalid_requests_isolated",
    "check_sleep_wake",
    "check_sleep_frees_device_memory",
    "ALL_CHECKS",
    "engine_options",
    "run_all",
    "reusing_backends",
]
