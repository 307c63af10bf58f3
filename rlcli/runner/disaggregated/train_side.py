"""The train side of a disaggregated run: train rank 0 drives the step loop (batches from the rollout
ranks, the GRPO step, weight syncs, evaluation, logs, checkpoints, HF exports); the other train
ranks follow its orders over the train group."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm.auto import tqdm

from rlcli.fsutil import write_jsonl, write_text
from rlcli.runner.disaggregated.boot import _Boot
from rlcli.runner.disaggregated.checkpoint import _check_extra, _save_collective
from rlcli.runner.disaggregated.protocol import (
    BatchReply, Evaluate, ExportHF, GetBatch, Order, SaveCheckpoint, Stop, SyncWeights, TrainStep, _report,
    _RolloutClient,
)
from rlcli.runner.evaluation import eval_metrics
from rlcli.runner.ranks import merge_metrics
from rlcli.runner.records import (
    Timer, add_train_throughput, build_trackers, dump_rollout_groups, log_to_trackers, mean, prune_step_dirs,
    sample_row, step_summary,
)
from rlcli.runner.schedule import Schedule, total_train_steps
from rlcli.runner.sequences import sequences_from_groups
from rlcli.runner.transport import WeightSender, broadcast
from rlcli.runner.workdir import export_missing, mark_finished, note_recipe_changes
from rlcli.types import Group

log = logging.getLogger("rlcli")

LEDGER = "trained_groups.jsonl"  # one row per trained step: the (task, group id) of every trained group


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
    write_text(path, "".join(x + "\n" for x in kept))



@dataclass
class _Batch:
    groups: list[Group]
    metrics: dict[str, float]
    expired: bool  # some rollout rank's producer is waiting for newer weights: sync after this step



class TrainSide:
    """One train rank. Train rank 0 runs the step loop; the other train ranks follow its orders
    (train on their share, gather weights, save) over the train group."""

    def __init__(self, boot: _Boot):
        self.boot, self.recipe, self.cfg = boot, boot.recipe, boot.recipe.trainer
        self.placement, self.ch = boot.placement, boot.channels
        self.main = boot.rank == self.placement.train0
        self.quiet = boot.quiet
        self.work_dir = boot.work_dir
        env = boot.env
        self.n_train = len(self.placement.train)
        self.schedule = Schedule.of(self.cfg, self.recipe.eval,
                                    total_train_steps(self.cfg, self.recipe.tasks, env.tokenizer))
        self.worker = env.build_train_worker(self.schedule.total_steps, process_group=self.ch.train)
        self.bucket_bytes = self.cfg.update_weight_bucket_mb * 1024 * 1024
        self.step = 0
        self.timer = Timer()
        self.trackers: list = []
        self.sync_bytes = 0
        self.sync_weights_s = 0.0
        if self.main:
            self.estimator = self.recipe.advantage.build()
            self.trackers = build_trackers(self.cfg.exp_tracker, self.work_dir, self.recipe._registry)
            self.rollout = _RolloutClient(self.ch)
            if self.schedule.evaluate:
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
        sched, ro, total = self.schedule, self.rollout, self.schedule.total_steps
        with self.timer("sync"):  # the replicas serve exactly the trainer's weights (a resume: the saved ones)
            self._push_weights(self.step)
        # the start-up push is no step's: a resumed run's first row must read as the uninterrupted run's
        self.sync_weights_s, self.sync_bytes = 0.0, 0
        if export_missing(self.work_dir, self.step, sched):  # killed while writing it: resumed, redo it
            self._export_hf(self.step)
        last: dict[str, float] = {}
        if sched.initial_eval_due(self.step):
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
            synced = sched.sync_due(step, expired=batch.expired)
            if synced:
                with self.timer("sync"):
                    ro.pause()
                    self._push_weights(step)
                if sched.eval_due(step, expired=batch.expired):
                    metrics.update(self._evaluate(step))  # before production resumes
            metrics["sync/synced"] = float(synced)
            metrics["sync/early"] = float(sched.early_sync(step, expired=batch.expired))
            metrics["timing/step_s"] = time.perf_counter() - t0
            self._record(step, batch.groups)
            last = self._log(step, metrics, batch.groups)
            if sched.checkpoint_due(step, expired=batch.expired):
                with self.timer("checkpoint"):  # after the row is logged: a resume never loses it
                    self._save_checkpoint(step)
            if sched.last(step):
                ro.stop()
                stopped = True
            elif synced:
                ro.continue_(step)
            if sched.hf_export_due(step):
                with self.timer("hf_export"):  # train ranks only: the rollout ranks produce meanwhile
                    self._export_hf(step)
            bar.update(1)
            bar.set_postfix_str(step_summary(last), refresh=False)
        bar.close()
        if not stopped:  # resumed from the last step's checkpoint: nothing left to train
            ro.stop()
        self._op(Stop())
        mark_finished(self.work_dir, self.step, self.recipe)
        return last

    def _collect(self, step: int) -> _Batch:
        """The batch of ``step`` from every rollout rank; a rank that answers an empty EXPIRED_BATCH
        needs the trainer's newer weights first: sync at ``step - 1`` and ask it again."""
        ro = self.rollout
        parts: dict[int, BatchReply] = {}
        need = list(range(len(ro)))
        waited, retries = 0.0, 0
        while need:
            t0 = time.perf_counter()
            for i in need:
                ro.send(i, GetBatch(step))
            replies = {i: ro.recv(i, BatchReply) for i in need}
            waited += time.perf_counter() - t0
            for i, rep in replies.items():
                if not rep.waits_for_weights:
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
        groups = [g for i in range(len(ro)) for g in parts[i].groups]
        metrics = merge_metrics([parts[i].metrics for i in range(len(ro))])
        metrics.update({
            "timing/wait_for_batch_s": waited,  # the trainer idle, waiting for rollout
            "timing/rollout_s": waited,  # rollout time not hidden behind training
            "sync/expired_retries": float(retries),
        })
        return _Batch(groups, metrics, any(parts[i].expired for i in parts))

    def _train(self, groups: list[Group]) -> dict[str, float]:
        seqs, adv = sequences_from_groups(groups, self.estimator, self.worker.vocab_size)
        parts = split_sequences(seqs, self.n_train)
        mine = parts[0]
        if self.n_train > 1:
            self._op(TrainStep())
            box: list[Any] = [None]
            dist.scatter_object_list(box, parts, src=self.placement.train0, group=self.ch.train)
            mine = box[0]
        return {**self.worker.train_step(mine), "advantage/mean": mean(adv)}

    def _push_weights(self, version: int) -> None:
        """Broadcast the trainer's weights (policy ``version``) to every rollout rank, bucket by bucket."""
        t0 = time.perf_counter()
        self._op(SyncWeights(version))
        self.rollout.send_all(SyncWeights(version))
        sender = WeightSender(self.ch.weights, self.placement.train0)
        for bucket in self.worker.iter_weights(self.bucket_bytes):
            sender.send(bucket, version)
        sender.finish()
        self.sync_bytes += sender.bytes
        self.sync_weights_s += time.perf_counter() - t0

    def _evaluate(self, step: int) -> dict[str, float]:
        """The rollout ranks evaluate their shares of the eval prompts; train rank 0 reduces and writes them."""
        with self.timer("eval"):
            replies = self.rollout.request_all(Evaluate(step))
        samples = sorted((s for r in replies for s in r.samples), key=lambda s: (s.task_name, s.uid))
        metrics = eval_metrics(samples, self.eval_tasks, self.eval_components)
        for r in replies:
            for k, v in r.judge_stats.items():
                metrics[k] = metrics.get(k, 0.0) + v
        write_jsonl(self.work_dir / "eval" / f"step-{step}.jsonl", [sample_row(s) for s in samples])
        return metrics

    def _save_checkpoint(self, step: int) -> None:
        self._op(SaveCheckpoint(step))
        self.rollout.send_all(SaveCheckpoint(step))
        self._save(step)

    def _export_hf(self, step: int) -> None:
        self._op(ExportHF(step))
        self._hf(step)

    def _op(self, order: Order) -> None:
        """Tell the other train ranks what to do next (a no-op with one train rank)."""
        if self.n_train > 1:
            broadcast(order, self.placement.train0, self.ch.train)

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
        add_train_throughput(row)
        row["time"] = time.time()
        log_to_trackers(self.trackers, step, row, groups, self.cfg.log_samples_per_step)
        if step % self.cfg.log_every == 0 and not self.quiet:
            tqdm.write(f"step {step}/{self.schedule.total_steps} {step_summary(row)}")
        return row

    # ------------------------------------------------------------------- other train ranks
    def _follow(self) -> None:
        src, group = self.placement.train0, self.ch.train
        while True:
            order = broadcast(None, src, group)
            match order:
                case TrainStep():
                    box: list[Any] = [None]
                    dist.scatter_object_list(box, None, src=src, group=group)
                    self.worker.train_step(box[0])
                case SyncWeights():
                    for _ in self.worker.iter_weights(self.bucket_bytes):  # every tensor is gathered collectively
                        pass
                case SaveCheckpoint(step=step):
                    self._save(step)
                case ExportHF(step=step):
                    self._hf(step)
                case Stop():
                    return
                case _:
                    raise RuntimeError(f"train rank {self.boot.rank}: unknown order {order!r} from train rank {src}")

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
            note_recipe_changes(extra.get("recipe"), self.recipe, path)

    def report_failure(self, exc: BaseException) -> None:
        """Train rank 0 failing: tell the rollout ranks why (bounded wait), so they stop with the cause."""
        if self.main:
            _report(exc, self.boot.rank, "train",
                    [(r, self.ch.command) for r in self.placement.rollout])

    def close(self, graceful: bool) -> None:
        for t in self.trackers:
            t.close()
