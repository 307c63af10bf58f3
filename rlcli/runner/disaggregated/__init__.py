"""The disaggregated GRPO runner: rollout ranks produce in the background while train ranks train.

One launch (``rlcli train RECIPE --nproc-per-node N``), two roles, set by
``resources.train_resources`` and ``resources.rollout_resources``:

* **train ranks** run FSDP2 over their own process group. Train rank 0 coordinates the run: the
  step loop, the console, trackers, logs and the trained-groups ledger;
* **rollout ranks** each host an inference replica and a :class:`~rlcli.produce.manager.RolloutManager`
  whose background producer (the ``async`` strategy's ``produce_loop``) keeps filling its replay
  buffer with groups for future steps - at most as far ahead of the policy it serves as the
  staleness bound allows. Each rollout rank rolls out its own shard of the prompts.

Step ``t``, driven by train rank 0 (messages: :mod:`~rlcli.runner.disaggregated.protocol`, carried by
:mod:`rlcli.runner.transport`)::

    get_batch(t) on every rollout rank           an empty EXPIRED_BATCH answer: that rank needs newer
                                                 weights - pause, push version t-1, continue, ask again
    advantages -> sequences split over the train ranks -> GRPO step (every train rank)
    sync point? (t % sync_weights_interval == 0, the last step, or a producer that reached its
    staleness bound and is waiting):
        pause_produce (in-flight groups drain into the buffers)
        -> weights, version t, broadcast in buckets from train rank 0
        -> evaluation if due, on the rollout ranks (production is still paused)
        -> log the step -> checkpoint if due -> continue_produce(t)
    HF export if due (train ranks only: overlaps the next step's production)

The checkpoint comes after the step's row is logged (as in the colocated runner): a run resumed
from it never lacks that row. Production is paused from the pause to ``continue_produce``, so
evaluation never runs beside training rollouts and the saved replay buffers hold no group in
flight. A checkpoint holds the train state (DCP, written by the train ranks), every rollout rank's
manager state (buffer, samplers, producer progress) and every rank's RNG. Resume: load ->
push weights -> ``continue_produce(saved step)``; nothing is generated before that.

Failures: a rank that raises first sends its error to the peer it works with (train rank 0 tells
the rollout ranks, a rollout rank tells train rank 0; bounded wait), then exits, and the launcher
stops the others and prints the traceback. A rank whose peer vanished fails with
:class:`~rlcli.runner.transport.PeerLost`; waits on peers are bounded by ``trainer.peer_timeout_s``.

The heap built at start-up (torch, transformers, the models) is frozen out of the cyclic garbage
collector: otherwise each full collection stalls a rank for ~0.2 s on a small CPU.

The code, one responsibility per module: ``boot`` (joining the job, the placement, the work dir),
``protocol`` (the typed messages: commands to the rollout ranks, their replies, orders to the other
train ranks; train rank 0's client; failure reports), ``train_side``
(:class:`TrainSide`), ``rollout_side`` (:class:`RolloutSide`), ``checkpoint`` (the collective
save, resume checks); :func:`run_disaggregated`, every rank's entry point, is here.
"""

from __future__ import annotations

from pathlib import Path

from rlcli.config import Recipe
from rlcli.models import resolve_device
from rlcli.runner import expandable_segments
from rlcli.runner.setup import freeze_heap, thaw_heap
from rlcli.runner.disaggregated.boot import _boot, _Boot
from rlcli.runner.disaggregated.checkpoint import _check_extra, _checkpoint_dir, _RolloutStub, _save_collective
from rlcli.runner.disaggregated.protocol import _report, _RolloutClient
from rlcli.runner.disaggregated.rollout_side import RolloutSide, _sums
from rlcli.runner.disaggregated.train_side import LEDGER, TrainSide, _Batch, _truncate_ledger, split_sequences
from rlcli.runner.transport import broadcast

__all__ = [
    "LEDGER", "RolloutSide", "TrainSide", "run_disaggregated", "split_sequences",
    "_Batch", "_Boot", "_RolloutClient", "_RolloutStub", "_boot", "_check_extra", "_checkpoint_dir",
    "_report", "_save_collective", "_sums", "_truncate_ledger",
]


def run_disaggregated(recipe: Recipe, work_dir: str | Path | None = None, *, quiet: bool = False,
                      overwrite: bool = False) -> tuple[Path, dict[str, float]]:
    """One rank of a disaggregated run (every launched rank calls it); returns train rank 0's
    work dir and last metrics on every rank."""
    restore_allocator = expandable_segments.apply(recipe.resources.expandable_segments, recipe.rollout.cls,
                                                  resolve_device(recipe.resources.device))
    try:
        boot = _boot(recipe, work_dir, quiet, overwrite)
        side: TrainSide | RolloutSide
        side = TrainSide(boot) if boot.placement.role(boot.rank) == "train" else RolloutSide(boot)
        freeze_heap()
        ok = False
        try:
            result = side.run()
            ok = True
        except BaseException as exc:
            side.report_failure(exc)
            raise
        finally:
            side.close(graceful=ok)
            thaw_heap()
    finally:
        restore_allocator()
    path, final = broadcast(result, boot.placement.train0, None)
    return Path(path), final
