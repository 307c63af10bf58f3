"""The producer side: everything between the prompts and the training batch.

* :mod:`~rlcli.produce.base` - the produce-strategy contract (:class:`ProduceStrategy`) and the
  task and window it works on (:class:`Task`, :class:`ProduceContext`, :class:`ProduceStatus`);
* :mod:`~rlcli.produce.strategies` - the built-in strategies ``sync`` and ``async``;
* :mod:`~rlcli.produce.filters` - group filters (drop judged groups before training);
* :mod:`~rlcli.produce.replay_buffer` - where groups wait between production and training
  (also importable as ``rlcli.replay_buffer``);
* :mod:`~rlcli.produce.staleness` - the staleness rule and the token-staleness mask;
* :mod:`~rlcli.produce.manager` - :class:`~rlcli.produce.manager.RolloutManager`, which drives
  the strategies of every task into one batch (colocated) or a background producer
  (disaggregated).

This package re-exports the names plugins use, and the hook that registers the built-in
strategies (``rlcli.produce`` is the module ``DEFAULT_PLUGINS`` names for them).
"""

from rlcli.produce.base import (
    ProduceContext, ProduceStats, ProduceStatus, ProduceStrategy, ProduceStrategyConfig, Task,
)
from rlcli.produce.staleness import StalenessRule
from rlcli.produce.strategies import (
    AsyncProduceStrategy, AsyncProduceStrategyConfig, SyncProduceStrategy, register_produce_strategies,
)

__all__ = [
    "AsyncProduceStrategy", "AsyncProduceStrategyConfig", "ProduceContext", "ProduceStats", "ProduceStatus",
    "ProduceStrategy", "ProduceStrategyConfig", "StalenessRule", "SyncProduceStrategy", "Task",
    "register_produce_strategies",
]
