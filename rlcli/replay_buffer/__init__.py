"""Replay buffers (public import path): they live in :mod:`rlcli.produce.replay_buffer`."""

from rlcli.produce.replay_buffer import AsyncReplayBuffer, ReplayBuffer, ReplayBufferConfig
from rlcli.produce.staleness import StalenessRule, token_keep_mask

__all__ = ["AsyncReplayBuffer", "ReplayBuffer", "ReplayBufferConfig", "StalenessRule", "token_keep_mask"]
