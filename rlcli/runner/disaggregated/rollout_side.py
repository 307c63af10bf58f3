"""The rollout side of a disaggregated run: an inference replica and a RolloutManager producing in
the background on each rollout rank, serving train rank 0's commands."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Callable

from rlcli.produce.manager import RolloutManager
from rlcli.runner.disaggregated.boot import _Boot
from rlcli.runner.disaggregated.checkpoint import _check_extra, _RolloutStub, _save_collective
from rlcli.runner.disaggregated.protocol import (
    BatchReply, ContinueProduce, EvalReply, Evaluate, GetBatch, Paused, PauseProduce, SaveCheckpoint, Stop, Stopped,
    SyncWeights, _report,
)
from rlcli.runner.evaluation import Evaluator
from rlcli.runner.records import ROLLOUT_TOKENS_PER_S, per_second, write_skipped_rows
from rlcli.runner.schedule import share
from rlcli.runner.setup import build_tasks
from rlcli.runner.transport import RemoteFailure, receive_weights, recv, send
from rlcli.stall import StallWatchdog


def _sums(key: str) -> bool:
    """Keys that add up across two batch answers of one step (counters and times)."""
    from rlcli.runner.ranks import merge_rule  # the rule that also sums them across ranks

    return key.startswith("timing/") or merge_rule(key) == "sum"


class RolloutSide:
    """One rollout rank: an inference replica, a RolloutManager producing in the background, and a
    command loop serving train rank 0.

    The asyncio event loop that runs the producer, the backend and the judges lives in a thread of
    its own; the main thread waits for commands and runs each on that loop. A blocking wait for a
    command therefore never stops production.
    """

    def __init__(self, boot: _Boot):
        self.boot, self.recipe, self.cfg = boot, boot.recipe, boot.recipe.trainer
        self.ch = boot.channels
        self.placement = boot.placement
        self.index = self.placement.rollout.index(boot.rank)
        n = len(self.placement.rollout)
        shard = (self.index, n)
        self.share = share(self.cfg.train_batch_size, self.index, n)  # this rank's groups of every step
        env = boot.env
        # the data before any model: a dataset without a usable prompt stops the run here
        eval_tasks = self.recipe.eval.tasks if self.cfg.enable_evaluate else []
        samplers = env.prepare_samplers(self.recipe.tasks + eval_tasks)  # the train ranks read no data
        if self.index == 0:
            write_skipped_rows(boot.work_dir, samplers)
        self.backend = env.build_backend(shard=shard)
        interval = self.cfg.sync_weights_interval
        tasks, pools = build_tasks(env, self.recipe.tasks, self.backend, salt="train", sync_weights_interval=interval,
                                   shard=shard)
        self.manager = RolloutManager(tasks, self.recipe.replay_buffer.build(), self.backend, pools)
        self.evaluator = (Evaluator(env, self.recipe.eval, self.backend, sync_weights_interval=interval, shard=shard)
                          if self.cfg.enable_evaluate else None)
        self.loop = asyncio.new_event_loop()
        self.watchdog = StallWatchdog(self.loop)  # started with the loop's thread: a stalled rollout says where
        self._thread = threading.Thread(target=self._run_loop, name="rlcli-rollout-loop", daemon=True)
        self._idle_s = self._busy_s = 0.0
        self._evaluating = False
        self._stash: dict[str, float] = {}  # metrics of an empty EXPIRED answer, added to the next batch's
        resumed = boot.checkpoint is not None
        if resumed:
            self._resume(boot.checkpoint)
        self._thread.start()
        self.watchdog.start()
        self.call(self._start(resumed))

    # ------------------------------------------------------------------------ event loop
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro) -> Any:
        """Run a coroutine on the rollout event loop and wait for its result (or error)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def call_sync(self, fn: Callable[[], Any]) -> Any:
        async def run():
            return fn()

        return self.call(run())

    async def _start(self, resumed: bool) -> None:
        if not resumed:  # a restored manager is paused already; a fresh one waits for the first weights too
            await self.manager.pause_produce()
        self.manager.start_produce_loop(self.share)
        self._watcher = asyncio.ensure_future(self._watch_idle())

    async def _watch_idle(self) -> None:
        """Time with no training rollout in flight and no evaluation (``timing/rollout_idle_s``), and
        time with training rollouts in flight (the denominator of ``throughput/rollout_tokens_per_s``)."""
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            if not self._evaluating:
                if self.manager.pending == 0:
                    self._idle_s += now - last
                else:
                    self._busy_s += now - last
            last = now

    # --------------------------------------------------------------------------- serving
    def run(self) -> None:
        src = self.placement.train0
        while True:
            msg = recv(src, self.ch.command)
            match msg:
                case GetBatch(step=step):
                    self._reply(self._batch(step))
                case PauseProduce():
                    self.call(self.manager.pause_produce())
                    self._reply(Paused())
                case ContinueProduce(model_step=model_step):
                    self.call(self.manager.continue_produce(model_step))
                case SyncWeights():
                    self._receive_weights()
                case Evaluate(step=step):
                    self._reply(self._evaluate(step))
                case SaveCheckpoint(step=step):
                    self._save(step)
                case Stop():
                    self.call(self.manager.shutdown())
                    self._reply(Stopped())
                    return
                case _:
                    raise RuntimeError(f"rollout rank {self.boot.rank}: unknown command {msg!r} "
                                       f"from train rank {src}")

    def _reply(self, obj: BatchReply | Paused | EvalReply | Stopped) -> None:
        send(obj, self.placement.train0, self.ch.reply)

    def _batch(self, step: int) -> BatchReply:
        res = self.call(self.manager.get_batch(self.share, step))
        metrics = dict(res.metrics)
        for k, v in self._stash.items():
            if _sums(k):
                metrics[k] = metrics.get(k, 0.0) + v
        if not res.groups:  # EXPIRED_BATCH: this step is asked again after a sync; keep its counters
            self._stash = metrics
            return BatchReply([], res.status, {})
        self._stash = {}
        idle, self._idle_s = self._idle_s, 0.0
        busy, self._busy_s = self._busy_s, 0.0
        metrics["timing/rollout_idle_s"] = idle
        # this rank's rate since its previous batch; the train side's merge_metrics sums the ranks'
        metrics[ROLLOUT_TOKENS_PER_S] = per_second(metrics.get("rollout/tokens", 0.0), busy)
        metrics["rollout/producer_lead_steps"] = float(self.manager.producer_future_step - step - 1)
        return BatchReply(res.groups, res.status, metrics)

    def _receive_weights(self) -> None:
        for bucket, version in receive_weights(self.ch.weights, self.placement.train0, self.boot.env.device):
            self.call_sync(lambda b=bucket, v=version: self.backend.update_weights(b, v))

    def _evaluate(self, step: int) -> EvalReply:
        if self.evaluator is None:
            raise RuntimeError("evaluation requested but trainer.enable_evaluate is false on this rank")
        self._evaluating = True
        try:
            samples = self.call(self.evaluator.run(step))
            stats = self.call_sync(self.evaluator.pop_stats)
        finally:
            self._evaluating = False
        self.call_sync(self.backend.pause)  # production stays paused until continue_produce
        return EvalReply(samples, stats)

    def _save(self, step: int) -> None:
        from rlcli.train import checkpoint as ckpt

        state = self.call_sync(self.manager.state_dict)  # paused: nothing in flight
        contribution = {"role": "rollout", "index": self.index, "manager": state}
        _save_collective(self.boot, step, contribution,
                         lambda path, extra: ckpt.save_checkpoint(path, _RolloutStub(self.boot.rank), None, None,
                                                                  extra, lora=self._lora))

    def _resume(self, path: Path) -> None:
        from rlcli.train import checkpoint as ckpt

        # joins the job-wide load; restores this rank's RNG
        extra = ckpt.load_checkpoint(path, _RolloutStub(self.boot.rank), None, None, lora=self._lora)
        _check_extra(extra, self.placement, path)
        self.manager.load_state_dict(extra["managers"][self.index])  # paused until continue_produce

    @property
    def _lora(self):
        """The recipe's LoRA as checkpoints record it (rank 0 may be this rank: it writes meta.json)."""
        from rlcli.train.lora import checkpoint_meta

        return checkpoint_meta(self.recipe.model.lora)

    def report_failure(self, exc: BaseException) -> None:
        """Tell train rank 0 why this rank fails (bounded wait), unless the failure came from it."""
        if not isinstance(exc, RemoteFailure):
            _report(exc, self.boot.rank, "rollout", [(self.placement.train0, self.ch.reply)])

    def close(self, graceful: bool) -> None:
        if graceful:
            async def finish():
                me = asyncio.current_task()
                rest = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)

            with contextlib.suppress(Exception):
                self.call(finish())
            for p in self.manager.judge_pools:
                p.close()
            if self.evaluator:
                self.evaluator.close()
            self.backend.shutdown()
        self.watchdog.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30 if graceful else 2)
        if graceful and not self._thread.is_alive():
            self.loop.close()
