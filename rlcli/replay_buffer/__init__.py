"""Replay buffers, public import path (what plugins import; the kind table names it): the code lives
in :mod:`rlcli.produce.replay_buffer`, beside the rest of production.

``rlcli.replay_buffer`` is also the module ``DEFAULT_PLUGINS`` registers the built-in buffers
from, hence the hook among the re-exports.
"""

from rlcli.produce.replay_buffer import (AsyncReplayBuffer, ReplayBuffer, ReplayBufferConfig, SyncReplayBuffer,
                                         register_replay_buffers)
from rlcli.produce.staleness import StalenessRule, token_keep_mask

__all__ = [
    "AsyncReplayBuffer", "ReplayBuffer", "ReplayBufferConfig", "StalenessRule", "SyncReplayBuffer",
    "register_replay_buffers", "token_keep_mask",
]
