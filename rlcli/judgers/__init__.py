"""Built-in judgers, registered through the same ``register_judgers`` hook as third-party plugins.

* ``gsm8k``: the last ``#### <number>`` of the response against the label, as exact numbers.
* ``exact_match``: the stripped response (or its first word) equals the label.
* ``char_match``: partial credit, the fraction of positions where response and label agree.
* ``composed``: routes each sample by ``data_source`` to one of several judgers.
* ``overlong``: DAPO's overlong reward shaping (a length penalty, truncated responses out of the
  loss) around another judger.

The contract is in :mod:`rlcli.judgers.base`; :mod:`rlcli.judgers.pool` runs judgers with timeouts
in a thread or process pool so that a failing judger marks one sample FAILED, never the run. The
pool is not imported here: importing :mod:`rlcli.judgers` stays as light as the judgers.
"""

from __future__ import annotations

from rlcli import hookimpl
from rlcli.judgers.base import Judger, JudgerConfig
from rlcli.judgers.char_match import CharMatchJudger
from rlcli.judgers.composed import ComposedJudger
from rlcli.judgers.exact_match import ExactMatchJudger
from rlcli.judgers.gsm8k import GSM8KJudger
from rlcli.judgers.overlong import OverlongJudger

__all__ = ["CharMatchJudger", "ComposedJudger", "ExactMatchJudger", "GSM8KJudger", "Judger", "JudgerConfig",
           "OverlongJudger", "register_judgers"]


@hookimpl
def register_judgers() -> list[type]:
    return [GSM8KJudger, ExactMatchJudger, CharMatchJudger, ComposedJudger, OverlongJudger]
