"""The disaggregated GRPO runner: rollout ranks produce in the background while train ranks train.

One launch (``rlcli train RECIPE --nproc-per-node N``), two roles, set by
``resources.train_resources`` and ``resources.rollout_resources``:

* **train ranks** run FSDP2 over their own process group. Train rank 0 coordinates the run: the
  step loop, the console, trackers, logs and the trained-groups ledger;
* **rollout ranks** each host an inference replica and a :class:`~rlcli.manager.RolloutManager`
  whose background producer (the ``async`` strategy's ``produce_loop``) keeps filling its replay
  buffer with groups for future steps - at most as far ahead of the policy it serves as the
  staleness bound allows. Each rollout rank rolls out its own shard of the prompts.

Step ``t``, driven by train rank 0 (messages: :mod:`rlcli.runner.transport`)::

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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from rlcli.config import Recipe, check_launch, resolve_placement
from rlcli.dist import barrier, init_distributed
from rlcli.manager import RolloutManager
from rlcli.models import resolve_device
from rlcli.produce import ProduceStatus
from rlcli.runner.common import (
    Environment, Evaluator, Timer, build_tasks, build_trackers, default_work_dir, dump_rollout_groups,
    eval_metrics, freeze_heap, log_to_trackers, mean, prepare_work_dir, prune_step_dirs, sample_row, seed_everything,
    sequences_from_groups, setup_logging, step_summary, thaw_heap, total_train_steps, write_jsonl, write_resolved,
)
from rlcli.runner.ranks import gather_to_main, merge_metrics
from rlcli.runner.transport import (
    Channels, Placement, RemoteError, RemoteFailure, WeightSender, broadcast, receive_weights, recv, send,
)
from rlcli.types import Group

log = logging.getLogger("rlcli")

LEDGER = "trained_groups.jsonl"  # one row per trained step: the (task, group id) of every trained group
_EXPIRED = ProduceStatus.EXPIRED_BATCH.value


# ====================================================================================== boot
@dataclass
class _Boot:
    recipe: Recipe
    work_dir: Path
    rank: int
    placement: Placement
    channels: Channels
    checkpoint: Path | None
    quiet: bool
    env: Environment


def _boot(recipe: Recipe, work_dir: str | Path | None, quiet: bool, overwrite: bool) -> _Boot:
    """Join the job, check the placement, create the groups, prepare the work dir (every rank)."""
    from rlcli.train.checkpoint import latest_checkpoint

    cfg = recipe.trainer
    device = resolve_device(recipe.resources.device)
    rank, world = init_distributed(device)
    issues = check_launch(recipe, world)
    if issues:
        raise ValueError("disaggregated placement: " + "; ".join(str(i) for i in issues))
    train, rollout, _ = resolve_placement(recipe.resources, world)
    placement = Placement(train, rollout)
    channels = Channels.create(placement, device, cfg.peer_timeout_s)
    work_dir = Path(work_dir) if work_dir else default_work_dir(recipe)
    coordinator = rank == placement.train0
    ckpt = None
    if rank == 0:  # rank 0 decides between resuming and starting fresh (and cleans up)
        ckpt = prepare_work_dir(work_dir, auto_resume=cfg.auto_resume, overwrite=overwrite)
        write_resolved(recipe, work_dir)
    barrier()
    if coordinator:
        setup_logging(work_dir, quiet)
    if rank != 0 and cfg.auto_resume and not overwrite:
        ckpt = latest_checkpoint(work_dir / "checkpoints")
    seed_everything(cfg.seed + rank)
    env = Environment(recipe, work_dir)
    return _Boot(recipe, work_dir, rank, placement, channels, ckpt, quiet or not coordinator, env)


class _RolloutStub(torch.nn.Module):
    """What a rollout rank brings to the job-wide checkpoint collectives: no model, one scalar buffer
    naming the rank (DCP needs a non-empty state; the name cannot collide with the policy's keys)."""

    def __init__(self, rank: int):
        super().__init__()
        self.register_buffer(f"rollout_rank_{rank}", torch.tensor(rank))


def _checkpoint_dir(boot: _Boot, step: int) -> Path:
    return boot.work_dir / "checkpoints" / f"step-{step}"


def _save_collective(boot: _Boot, step: int, contribution: Any, save: Callable[[Path, Any], Any]) -> None:
    """Every rank: gather the pieces of the extra state on rank 0, then save (DCP is collective)."""
    from rlcli.train.checkpoint import prune

    gathered = gather_to_main(contribution)
    extra = None
    if boot.rank == 0:
        n = len(boot.placement.rollout)
        managers: list[Any] = [None] * n
        train_step = None
        for part in gathered:
            if part and part["role"] == "rollout":
                managers[part["index"]] = part["manager"]
            elif part and part["role"] == "train":
                train_step = part["step"]
        if train_step != step or any(m is None for m in managers):
            raise RuntimeError(f"checkpoint step {step}: incomplete state from the ranks (train step {train_step}, "
                               f"{sum(m is not None for m in managers)}/{n} rollout managers)")
        extra = {"step": step, "mode": "disaggregated", "placement": boot.placement.as_dict(), "managers": managers}
    save(_checkpoint_dir(boot, step), extra)
    prune(boot.work_dir / "checkpoints", boot.recipe.trainer.checkpoint_maxkeep)  # rank 0 only
    barrier()


def _check_extra(extra: dict, placement: Placement, path: Path) -> None:
    if extra.get("mode") != "disaggregated":
        raise RuntimeError(f"{path} was written by a colocated run; resume it with trainer.mode=colocate")
    if extra.get("placement") != placement.as_dict():
        raise RuntimeError(f"{path} was written with train ranks {extra['placement']['train']} and rollout ranks "
                           f"{extra['placement']['rollout']}; resume it with the same resources.train_resources and "
                           f"resources.rollout_resources (this run: {placement.as_dict()})")


def split_sequences(seqs: list, n: int) -> list[list]:
    """Split training sequences over ``n`` train ranks, balancing tokens (largest first, to the lightest rank);
    each rank keeps the sequences' original order."""
    if n == 1:
        return [list(seqs)]
    loads, owner = [0] * n, [0] * len(seqs)
    for i in sorted(range(len(seqs)), key=lambda i: (-seqs[i].num_tokens, i)):
        r = min(range(n), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += seqs[i].num_tokens
    return [[s for s, o in zip(seqs, owner) if o == r] for r in range(n)]


def _truncate_ledger(path: Path, step: int) -> None:
    """Drop the ledger rows of steps after ``step`` (they were trained after the checkpoint resumed from)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line from a killed process
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    os.replace(tmp, path)


def _report(exc: BaseException, rank: int, role: str, peers: list[tuple[int, Any]], timeout_s: float = 5.0) -> None:
    """Best effort: send a :class:`RemoteError` to each peer, waiting at most ``timeout_s`` for each."""
    import traceback

    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: just go
        return
    err = RemoteError(rank, role, f"{type(exc).__name__}: {exc}",
                      "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    for peer, group in peers:
        try:
            send(err, peer, group, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - the peer is gone or busy; the launcher stops it anyway
            log.debug("could not report the failure to rank %d", peer, exc_info=True)


# ================================================================================ train side
@dataclass
class _Batch:
    groups: list[Group]
    metrics: dict[str, float]
    expired: bool  # some rollout rank's producer is waiting for newer weights: sync after this step


class _RolloutClient:
    """Train rank 0's handle on the rollout ranks (commands out, replies in, in rank order)."""

    def __init__(self, channels: Channels):
        self.ch = channels
        self.ranks = channels.placement.rollout

    def __len__(self) -> int:
        return len(self.ranks)

    def send(self, i: int, msg: tuple) -> None:
        send(msg, self.ranks[i], self.ch.command)

    def send_all(self, msg: tuple) -> None:
        for i in range(len(self.ranks)):
            self.send(i, msg)

    def recv(self, i: int) -> Any:
        return recv(self.ranks[i], self.ch.reply)

    def request_all(self, msg: tuple) -> list[Any]:
        self.send_all(msg)
        return [self.recv(i) for i in range(len(self.ranks))]

    def pause(self) -> None:
        """``pause_produce`` everywhere; returns once every rank has drained what was in flight."""
        for ack in self.request_all(("pause",)):
            assert ack == "paused", ack

    def continue_(self, model_step: int) -> None:
        self.send_all(("continue", model_step))

    def stop(self) -> None:
        for ack in self.request_all(("stop",)):
            assert ack == "stopped", ack


class TrainSide:
    """One train rank. Train rank 0 runs the step loop; the other train ranks follow its orders
    (train on their share, gather weights, save) over the train group."""

    def __init__(self, boot: _Boot):
        from rlcli.train.worker import TrainWorker

        self.boot, self.recipe, self.cfg = boot, boot.recipe, boot.recipe.trainer
        self.placement, self.ch = boot.placement, boot.channels
        self.main = boot.rank == self.placement.train0
        self.quiet = boot.quiet
        self.work_dir = boot.work_dir
        env = boot.env
        self.n_train = len(self.placement.train)
        self.total_steps = total_train_steps(self.recipe, env.tokenizer)
        self.worker = TrainWorker(env.model_dir, self.recipe.model, self.recipe.train_worker,
                                  self.recipe.train_worker.loss.build(), device=env.device, dtype=env.dtype,
                                  seed=self.cfg.seed, total_steps=self.total_steps, process_group=self.ch.train)
        self.bucket_bytes = self.cfg.update_weight_bucket_mb * 1024 * 1024
        self.step = 0
        self.timer = Timer()
        self.trackers: list = []
        self.sync_bytes = 0
        self.sync_weights_s = 0.0
        self.evaluating = bool(self.cfg.enable_evaluate and self.recipe.eval is not None and self.recipe.eval.tasks)
        if self.main:
            self.estimator = self.recipe.advantage.build()
            self.trackers = build_trackers(self.recipe, self.work_dir)
            self.rollout = _RolloutClient(self.ch)
            if self.evaluating:
                self.eval_tasks = [t.task_name for t in self.recipe.eval.tasks]
                self.eval_components = [m.build() for m in self.recipe.eval.evaluator.metrics]
        if boot.checkpoint is not None:
            self._resume(boot.checkpoint)

    def run(self) -> tuple[str, dict[str, float]] | None:
        if self.main:
            return str(self.work_dir), self._coordinate()
        self._follow()
        return None

    # ---------------------------------------------------------------------- train rank 0
    def _coordinate(self) -> dict[str, float]:
        cfg, ro, total = self.cfg, self.rollout, self.total_steps
        interval = cfg.sync_weights_interval
        with self.timer("sync"):  # the replicas serve exactly the trainer's weights (a resume: the saved ones)
            self._push_weights(self.step)
        last: dict[str, float] = {}
        if self.evaluating and cfg.enable_initial_evaluate and self.step == 0:
            last = self._log(0, self._evaluate(0))
        ro.continue_(self.step)
        stopped = False
        bar = tqdm(total=total, initial=self.step, desc="train", unit="step", disable=self.quiet, dynamic_ncols=True)
        while self.step < total:
            step, t0 = self.step + 1, time.perf_counter()
            batch = self._collect(step)
            with self.timer("train"):  # advantages -> sequences -> GRPO loss -> optimizer step(s), all train ranks
                metrics = {**batch.metrics, **self._train(batch.groups)}
            self.step = step
            synced = batch.expired or step % interval == 0 or step == total
            if synced:
                with self.timer("sync"):
                    ro.pause()
                    self._push_weights(step)
                if self.evaluating and (step % cfg.evaluate_step == 0 or step == total):
                    metrics.update(self._evaluate(step))  # before production resumes
            metrics["sync/synced"] = float(synced)
            metrics["sync/early"] = float(synced and batch.expired and step % interval != 0 and step != total)
            metrics["timing/step_s"] = time.perf_counter() - t0
            self._record(step, batch.groups)
            last = self._log(step, metrics, batch.groups)
            if synced and cfg.checkpoint_interval and cfg.checkpoint_interval > 0 \
                    and step % cfg.checkpoint_interval == 0:
                with self.timer("checkpoint"):  # after the row is logged: a resume never loses it
                    self._save_checkpoint(step)
            if step == total:
                ro.stop()
                stopped = True
            elif synced:
                ro.continue_(step)
            if (cfg.hf_interval is not None and cfg.hf_interval > 0 and step % cfg.hf_interval == 0) \
                    or step == total:
                with self.timer("hf_export"):  # train ranks only: the rollout ranks produce meanwhile
                    self._export_hf(step)
            bar.update(1)
            bar.set_postfix_str(step_summary(last), refresh=False)
        bar.close()
        if not stopped:  # resumed from the last step's checkpoint: nothing left to train
            ro.stop()
            if not (self.work_dir / "hf" / f"step-{total}").exists():  # killed between checkpoint and export
                self._export_hf(total)
        self._op("stop")
        return last

    def _collect(self, step: int) -> _Batch:
        """The batch of ``step`` from every rollout rank; a rank that answers an empty EXPIRED_BATCH
        needs the trainer's newer weights first: sync at ``step - 1`` and ask it again."""
        ro = self.rollout
        parts: dict[int, dict] = {}
        need = list(range(len(ro)))
        waited, retries = 0.0, 0
        while need:
            t0 = time.perf_counter()
            for i in need:
                ro.send(i, ("batch", step))
            replies = {i: ro.recv(i) for i in need}
            waited += time.perf_counter() - t0
            for i, rep in replies.items():
                if rep["groups"] or rep["status"] != _EXPIRED:
                    parts[i] = rep
            need = [i for i in need if i not in parts]
            if need:
                retries += 1
                log.info("step %d: rollout rank(s) %s wait for newer weights (EXPIRED_BATCH); syncing version %d",
                         step, [ro.ranks[i] for i in need], step - 1)
                with self.timer("sync"):
                    ro.pause()
                    self._push_weights(step - 1)
                ro.continue_(step - 1)
        groups = [g for i in range(len(ro)) for g in parts[i]["groups"]]
        metrics = merge_metrics([parts[i]["metrics"] for i in range(len(ro))])
        metrics.update({
            "timing/wait_for_batch_s": waited,  # the trainer idle, waiting for rollout
            "timing/rollout_s": waited,  # rollout time not hidden behind training
            "sync/expired_retries": float(retries),
        })
        return _Batch(groups, metrics, any(parts[i]["status"] == _EXPIRED for i in parts))

    def _train(self, groups: list[Group]) -> dict[str, float]:
        seqs, adv = sequences_from_groups(groups, self.estimator)
        parts = split_sequences(seqs, self.n_train)
        mine = parts[0]
        if self.n_train > 1:
            self._op("train")
            box: list[Any] = [None]
            dist.scatter_object_list(box, parts, src=self.placement.train0, group=self.ch.train)
            mine = box[0]
        return {**self.worker.train_step(mine), "advantage/mean": mean(adv)}

    def _push_weights(self, version: int) -> None:
        """Broadcast the trainer's weights (policy ``version``) to every rollout rank, bucket by bucket."""
        t0 = time.perf_counter()
        self._op("weights", version)
        self.rollout.send_all(("weights", version))
        sender = WeightSender(self.ch.weights, self.placement.train0)
        for bucket in self.worker.iter_weights(self.bucket_bytes):
            sender.send(bucket, version)
        sender.finish()
        self.sync_bytes += sender.bytes
        self.sync_weights_s += time.perf_counter() - t0

    def _evaluate(self, step: int) -> dict[str, float]:
        """The rollout ranks evaluate their shares of the eval prompts; train rank 0 reduces and writes them."""
        with self.timer("eval"):
            replies = self.rollout.request_all(("eval", step))
        samples = sorted((s for r in replies for s in r["samples"]), key=lambda s: (s.task_name, s.uid))
        metrics = eval_metrics(samples, self.eval_tasks, self.eval_components)
        for r in replies:
            for k, v in r["judge_stats"].items():
                metrics[k] = metrics.get(k, 0.0) + v
        write_jsonl(self.work_dir / "eval" / f"step-{step}.jsonl", [sample_row(s) for s in samples])
        return metrics

    def _save_checkpoint(self, step: int) -> None:
        self._op("checkpoint", step)
        self.rollout.send_all(("checkpoint", step))
        self._save(step)

    def _export_hf(self, step: int) -> None:
        self._op("hf", step)
        self._hf(step)

    def _op(self, name: str, *args: Any) -> None:
        """Tell the other train ranks what to do next (a no-op with one train rank)."""
        if self.n_train > 1:
            broadcast((name, args), self.placement.train0, self.ch.train)

    def _record(self, step: int, groups: list[Group]) -> None:
        """Ledger row (which groups this step trained) and the rollout dump of the step."""
        row = {"step": step, "groups": [[g.task_name, g.group_id] for g in groups]}
        with open(self.work_dir / LEDGER, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        dump_rollout_groups(self.work_dir, step, groups, self.cfg.dump_rollout_groups)

    def _log(self, step: int, metrics: dict[str, float], groups=None) -> dict[str, float]:
        row = {"timing/rollout_s": 0.0, "timing/train_s": 0.0, "timing/sync_s": 0.0, **self.timer.pop(), **metrics}
        if self.sync_weights_s > 0:
            row["sync/weights_s"], row["sync/bytes"] = self.sync_weights_s, float(self.sync_bytes)
            self.sync_weights_s, self.sync_bytes = 0.0, 0
        row["time"] = time.time()
        log_to_trackers(self.trackers, step, row, groups, self.cfg.log_samples_per_step)
        if step % self.cfg.log_every == 0 and not self.quiet:
            tqdm.write(f"step {step}/{self.total_steps} {step_summary(row)}")
        return row

    # ------------------------------------------------------------------- other train ranks
    def _follow(self) -> None:
        src, group = self.placement.train0, self.ch.train
        while True:
            name, args = broadcast(None, src, group)
            if name == "train":
                box: list[Any] = [None]
                dist.scatter_object_list(box, None, src=src, group=group)
                self.worker.train_step(box[0])
            elif name == "weights":
                for _ in self.worker.iter_weights(self.bucket_bytes):  # every tensor is gathered collectively
                    pass
            elif name == "checkpoint":
                self._save(args[0])
            elif name == "hf":
                self._hf(args[0])
            elif name == "stop":
                return
            else:
                raise RuntimeError(f"train rank {self.boot.rank}: unknown order {name!r} from train rank {src}")

    # --------------------------------------------------------------------------- shared
    def _hf(self, step: int) -> None:
        """HF export (collective over the train ranks; train rank 0 writes)."""
        self.worker.save_hf(self.work_dir / "hf" / f"step-{step}", self.boot.env.tokenizer)
        if self.main:
            prune_step_dirs(self.work_dir / "hf", self.cfg.hf_maxkeep)

    def _save(self, step: int) -> None:
        contribution = {"role": "train", "step": step} if self.main else None
        _save_collective(self.boot, step, contribution, lambda path, extra: self.worker.save_checkpoint(
            path, extra, no_optimizer=self.cfg.checkpoint_no_save_optimizer))

    def _resume(self, path: Path) -> None:
        extra = self.worker.load_checkpoint(path)
        _check_extra(extra, self.placement, path)
        self.step = int(extra["step"])
        if self.main:
            for t in self.trackers:
                t.truncate_after(self.step)
            _truncate_ledger(self.work_dir / LEDGER, self.step)
            log.info("resumed from %s at step %d", path, self.step)
            if not self.quiet:
                print(f"resumed from {path} (step {self.step})")

    def report_failure(self, exc: BaseException) -> None:
        """Train rank 0 failing: tell the rollout ranks why (bounded wait), so they stop with the cause."""
        if self.main:
            _report(exc, self.boot.rank, "train",
                    [(r, self.ch.command) for r in self.placement.rollout])

    def close(self, graceful: bool) -> None:
        for t in self.trackers:
            t.close()


# ============================================================================== rollout side
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
        bs = self.cfg.train_batch_size
        self.share = bs // n + (self.index < bs % n)  # this rank's groups of every step
        env = boot.env
        self.backend = env.build_backend(shard=shard)
        tasks, pools = build_tasks(env, self.recipe.tasks, self.backend, salt="train", shard=shard)
        self.manager = RolloutManager(tasks, self.recipe.replay_buffer.build(), self.backend, pools)
        self.evaluator = Evaluator(env, self.backend, shard=shard) if self.cfg.enable_evaluate else None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="rlcli-rollout-loop", daemon=True)
        self._idle_s = 0.0
        self._evaluating = False
        self._stash: dict[str, float] = {}  # metrics of an empty EXPIRED answer, added to the next batch's
        resumed = boot.checkpoint is not None
        if resumed:
            self._resume(boot.checkpoint)
        self._thread.start()
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
        """Time with no training rollout in flight and no evaluation: ``timing/rollout_idle_s``."""
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            if not self._evaluating and self.manager.pending == 0:
                self._idle_s += now - last
            last = now

    # --------------------------------------------------------------------------- serving
    def run(self) -> None:
        src = self.placement.train0
        while True:
            msg = recv(src, self.ch.command)
            op, args = msg[0], msg[1:]
            if op == "batch":
                self._reply(self._batch(*args))
            elif op == "pause":
                self.call(self.manager.pause_produce())
                self._reply("paused")
            elif op == "continue":
                self.call(self.manager.continue_produce(args[0]))
            elif op == "weights":
                self._receive_weights()
            elif op == "eval":
                self._reply(self._evaluate(args[0]))
            elif op == "checkpoint":
                self._save(args[0])
            elif op == "stop":
                self.call(self.manager.shutdown())
                self._reply("stopped")
                return
            else:
                raise RuntimeError(f"rollout rank {self.boot.rank}: unknown command {op!r} from train rank {src}")

    def _reply(self, obj: Any) -> None:
        send(obj, self.placement.train0, self.ch.reply)

    def _batch(self, step: int) -> dict[str, Any]:
        res = self.call(self.manager.get_batch(self.share, step))
        metrics = dict(res.metrics)
        for k, v in self._stash.items():
            if _sums(k):
                metrics[k] = metrics.get(k, 0.0) + v
        if not res.groups:  # EXPIRED_BATCH: this step is asked again after a sync; keep its counters
            self._stash = metrics
            return {"groups": [], "status": res.status.value, "metrics": {}}
        self._stash = {}
        idle, self._idle_s = self._idle_s, 0.0
        metrics["timing/rollout_idle_s"] = idle
        metrics["rollout/producer_lead_steps"] = float(self.manager.producer_future_step - step - 1)
        return {"groups": res.groups, "status": res.status.value, "metrics": metrics}

    def _receive_weights(self) -> None:
        for bucket, version in receive_weights(self.ch.weights, self.placement.train0, self.boot.env.device):
            self.call_sync(lambda b=bucket, v=version: self.backend.update_weights(b, v))

    def _evaluate(self, step: int) -> dict[str, Any]:
        if self.evaluator is None:
            raise RuntimeError("evaluation requested but trainer.enable_evaluate is false on this rank")
        self._evaluating = True
        try:
            samples = self.call(self.evaluator.run(step))
            stats = self.call_sync(self.evaluator.pop_stats)
        finally:
            self._evaluating = False
        self.call_sync(self.backend.pause)  # production stays paused until continue_produce
        return {"samples": samples, "judge_stats": stats}

    def _save(self, step: int) -> None:
        from rlcli.train import checkpoint as ckpt

        state = self.call_sync(self.manager.state_dict)  # paused: nothing in flight
        contribution = {"role": "rollout", "index": self.index, "manager": state}
        _save_collective(self.boot, step, contribution,
                         lambda path, extra: ckpt.save_checkpoint(path, _RolloutStub(self.boot.rank), None, None,
                                                                  extra))

    def _resume(self, path: Path) -> None:
        from rlcli.train import checkpoint as ckpt

        # joins the job-wide load; restores this rank's RNG
        extra = ckpt.load_checkpoint(path, _RolloutStub(self.boot.rank), None, None)
        _check_extra(extra, self.placement, path)
        self.manager.load_state_dict(extra["managers"][self.index])  # paused until continue_produce

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
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30 if graceful else 2)
        if graceful and not self._thread.is_alive():
            self.loop.close()


# ===================================================================================== entry
def run_disaggregated(recipe: Recipe, work_dir: str | Path | None = None, *, quiet: bool = False,
                      overwrite: bool = False) -> tuple[Path, dict[str, float]]:
    """One rank of a disaggregated run (every launched rank calls it); returns train rank 0's
    work dir and last metrics on every rank."""
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
    path, final = broadcast(result, boot.placement.train0, None)
    return Path(path), final
