"""Replay buffers (public import path): they live in :mod:`rlcli.produce.replay_buffer`.

``rlcli.replay_buffer`` is also the module ``DEFAULT_PLUGINS`` registers the built-in buffers
from, hence the hook among the re-exports.
"""

from rlcli.produce.replay_buffer import AsyncReplayBuffer, ReplayBuffer, ReplayBufferConfig, register_replay_buffers
from rlcli.produce.staleness import StalenessRule, token_keep_mask

__all__ = [
    "AsyncReplayBuffer", "ReplayBuffer", "ReplayBufferConfig", "StalenessRule", "register_replay_buffers",
    "token_keep_mask",
]
