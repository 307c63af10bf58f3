"""Produce-strategy behaviour in colocated windows, driven by the scripted fake backend.

Covers the strategy configuration (staleness thresholds, model expiry, config warnings),
over-sampling, tail-batch re-rolls of expired groups, partial rollout, the judge grace period
and drain timeout at pause, and the sync strategy with group filters and failing agent loops.
The fakes and helpers (ScriptedBackend, make_task, make_manager, ...) live in
test_async_produce.py, which also tests the rollout manager and disaggregated production.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from rlcli.agent_loops import SingleTurnAgentLoop
from rlcli.produce import AsyncProduceStrategy, ProduceContext, ProduceStatus, SyncProduceStrategy
from rlcli.produce.filters import AllEqualRewards
from rlcli.replay_buffer import AsyncReplayBuffer, StalenessRule, SyncReplayBuffer
from rlcli.types import Group, Status
from tests.test_async_produce import (
    EOS, PROMPT, TOK, RejectGroups, ScoreJudger, ScriptedBackend, Tok, done_sample, expired_group, make_manager,
    make_task, run, window,
)
from tests.test_async_produce import _close_managers  # noqa: F401  (an autouse fixture: closes the judge pools)


# ==================================================================== config and thresholds
def test_stale_thresholds():
    # behaviour 7, plus our own numbers
    def rule(ms, interval, mts=None):
        return AsyncProduceStrategy(AsyncProduceStrategy.Config(max_staleness=ms, max_token_staleness=mts,
                                                                enable_partial_rollout=True),
                                    sync_weights_interval=interval).staleness_rule()

    assert rule(0, 4).stale_threshold == 4 and rule(1, 4).stale_threshold == 8
    assert rule(0, 4, 0).token_stale_threshold == 4 and rule(0, 4).token_stale_threshold is None
    assert rule(2, 3).stale_threshold == 9 and rule(1, 2).stale_threshold == 4
    assert SyncProduceStrategy(SyncProduceStrategy.Config(), sync_weights_interval=3).staleness_rule() == \
        StalenessRule(3, None, retryable=False)
    def tail(n):
        return AsyncProduceStrategy(AsyncProduceStrategy.Config(tail_batch_trigger_size=n)).staleness_rule()

    assert not tail(-1).retryable and tail(0).retryable and tail(5).retryable


def test_model_expiry_bound():
    # behaviour 8 in producer terms: threshold 4 -> data for step 8 from model 4 is fine, step 9 is not
    s = AsyncProduceStrategy(AsyncProduceStrategy.Config(max_staleness=1, enable_partial_rollout=True),
                             sync_weights_interval=2)
    assert not s.model_expired(8, 4) and s.model_expired(9, 4)


def test_colocate_model_step_sequence():
    # behaviour 9: the runner's model_step (the colocated runner asks its Schedule)
    from rlcli.runner.schedule import Schedule

    def seq(interval, n):
        sched = Schedule(total_steps=n, sync_interval=interval)
        return [sched.model_step(s) for s in range(1, n + 1)]

    assert seq(2, 3) == [0, 0, 2]
    assert seq(3, 7) == [0, 0, 0, 3, 3, 3, 6]
    assert seq(1, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize("cfg,expect", [
    ({"max_staleness": 1}, ["enable_partial_rollout=false", "tail_batch_max_tries"]),
    ({"max_staleness": 1, "tail_batch_max_tries": 2}, ["enable_partial_rollout=false"]),
    ({"max_staleness": 0, "max_token_staleness": 1, "tail_batch_trigger_size": 0}, ["has no effect"]),
    ({"max_token_staleness": 0}, ["tail_batch_trigger_size=-1"]),
    ({"max_staleness": 2, "enable_partial_rollout": True}, []),
    ({}, []),
])
def test_config_warnings(caplog, cfg, expect):
    with caplog.at_level(logging.WARNING, logger="rlcli.produce"):
        AsyncProduceStrategy(AsyncProduceStrategy.Config(**cfg), sync_weights_interval=1)
    text = "\n".join(r.getMessage() for r in caplog.records)
    for e in expect:
        assert e in text
    if not expect:
        assert text == ""
    if cfg.get("tail_batch_max_tries"):
        assert "tail_batch_max_tries)" not in text


# ======================================================================= over-sampling
def test_oversample_budget_is_fixed_not_scaled_to_the_gap():
    # behaviour 24: batch 4, threshold 1.0, target 10 with 9 COMPLETED present -> 5 new, 14 stored
    backend = ScriptedBackend()
    task = make_task("t", backend, {"over_sample_threshold": 1.0})
    buf = AsyncReplayBuffer()
    for i in range(9):
        buf.put(Group(100 + i, "t", [done_sample(1000 + 2 * i, [0]), done_sample(1001 + 2 * i, [0])]))
    ctx = ProduceContext(batch_size=4, train_step=1, model_step=0, buffer=buf, target=10)

    async def go():
        status = await task.strategy.produce_round(task, ctx)
        spawned = task.sampler.groups_sampled
        await task.strategy.drain(task, ctx)  # not paused: everything in flight finishes
        return status, spawned

    try:
        assert run(go()) == (ProduceStatus.NORMAL, 5)
        assert buf.count("t", Status.COMPLETED) == 14
    finally:
        task.agent_loop.judge_pool.close()


def test_oversampled_groups_are_paused_and_kept():
    # our numbers: batch 6, threshold 0.5 -> 9 in flight; 3 long ones are paused with partial tokens
    backend = ScriptedBackend(lambda uid: 40 if uid // 2 >= 6 else 1)
    task = make_task("t", backend, {"over_sample_threshold": 0.5, "enable_partial_rollout": True, "max_staleness": 1})
    m = make_manager(backend, task)
    res = run(window(m, backend, 6, 1))
    assert [g.group_id for g in res.groups] == [0, 1, 2, 3, 4, 5]
    assert task.sampler.groups_sampled == 9 and task.strategy.pending == 0
    aborted = m.buffer.groups("t", Status.ABORTED)
    assert [g.group_id for g in aborted] == [6, 7, 8]
    assert all(0 < len(s.response_ids) < 40 and s.token_versions == [0] * len(s.response_ids)
               for g in aborted for s in g.samples)
    assert res.metrics["rollout/aborted_groups"] == 3 and res.metrics["rollout/leftover_aborted_groups"] == 3
    assert res.metrics["rollout/groups"] == 6 and res.metrics["rollout/samples"] == 12
    assert res.metrics["rollout/tokens"] == 12 + sum(len(s.response_ids) for g in aborted for s in g.samples)


def test_pending_never_leaks_into_the_next_window():
    # behaviour 28
    backend = ScriptedBackend(lambda uid: 30 if uid % 4 == 3 else 1)
    task = make_task("t", backend, {"over_sample_threshold": 1.0, "enable_partial_rollout": True, "max_staleness": 2,
                                    "tail_batch_trigger_size": 0})
    m = make_manager(backend, task)
    trained: list[int] = []
    for step in (1, 2, 3):
        res = run(window(m, backend, 3, step))
        assert task.strategy.pending == 0 and backend.inflight == 0
        trained += [g.group_id for g in res.groups]
    assert len(trained) == len(set(trained)) == 9
    kept = [g.group_id for g in m.buffer.groups()]
    assert not set(kept) & set(trained)
    assert task.sampler.groups_sampled == len(trained) + len(kept)


def test_produce_batch_refuses_leftover_pending():
    backend = ScriptedBackend(lambda uid: 50, tick=0.002)
    task = make_task("t", backend, {"over_sample_threshold": 1.0})
    buf = AsyncReplayBuffer()
    ctx = ProduceContext(1, 1, 0, buf)

    async def go():
        t = asyncio.ensure_future(task.strategy.produce_batch(task, ctx))
        await asyncio.sleep(0.01)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        assert task.strategy.pending == 2
        with pytest.raises(RuntimeError, match="still in flight"):
            await task.strategy.produce_batch(task, ctx)
        backend.pause()
        await task.strategy.drain(task, ctx)
        assert task.strategy.pending == 0 and buf.count("t", Status.ABORTED) == 2

    try:
        run(go())
    finally:
        task.agent_loop.judge_pool.close()


# =========================================================================== tail batch
def test_tail_mode_rerolls_expired_without_oversampling():
    # behaviour 25: trigger 1, two EXPIRED groups, oversample 1.0, batch 2
    backend = ScriptedBackend()
    task = make_task("t", backend, {"over_sample_threshold": 1.0, "tail_batch_trigger_size": 1,
                                    "max_staleness": 1, "enable_partial_rollout": True})
    m = make_manager(backend, task)
    expired_group(m.buffer, 100)
    expired_group(m.buffer, 101)
    res = run(window(m, backend, 2, 5))
    assert [g.group_id for g in res.groups] == [100, 101]
    assert task.sampler.groups_sampled == 0  # no fresh prompt, no over-sampling
    assert sorted(r.request_id for r in backend.requests) == [200, 201, 202, 203]
    assert all(s.staleness == 0 and s.tries == 1 for g in res.groups for s in g.samples)
    assert res.metrics["rollout/tail_batch_windows"] == 1 and res.metrics["rollout/rerolled_samples"] == 4


def test_trigger_zero_rerolls_at_once_and_keeps_oversampling():
    # behaviour 26
    backend = ScriptedBackend()
    task = make_task("t", backend, {"over_sample_threshold": 1.0, "tail_batch_trigger_size": 0})
    m = make_manager(backend, task)
    expired_group(m.buffer, 100)
    res = run(window(m, backend, 2, 5))
    assert task.sampler.groups_sampled == 3  # 2 + budget 2 = 4 in flight, the expired one first
    assert backend.requests[0].request_id == 200
    assert res.metrics["rollout/tail_batch_windows"] == 0
    assert m.buffer.count("t", Status.EXPIRED) == 0
    assert len(res.groups) + m.buffer.count("t", Status.COMPLETED) == 4


def test_trigger_not_reached_keeps_expired_pooled():
    backend = ScriptedBackend()
    task = make_task("t", backend, {"over_sample_threshold": 1.0, "tail_batch_trigger_size": 3, "max_staleness": 1,
                                    "enable_partial_rollout": True})
    m = make_manager(backend, task)
    expired_group(m.buffer, 100)
    expired_group(m.buffer, 101)
    run(window(m, backend, 2, 5))
    assert task.sampler.groups_sampled == 4 and m.buffer.count("t", Status.EXPIRED) == 2
    assert m.buffer.count("t", Status.COMPLETED) == 2  # over-sampled leftovers (staleness 1 < 2 at step 6)
    expired_group(m.buffer, 102)  # now 3 pooled: tail mode, only the gap (5 - 2 leftovers), expired first
    res = run(window(m, backend, 5, 6))
    assert task.sampler.groups_sampled == 4 and m.buffer.count() == 0
    assert {100, 101, 102} <= {g.group_id for g in res.groups}
    assert res.metrics["rollout/tail_batch_windows"] == 1


def test_trigger_minus_one_drops_expired_groups():
    backend = ScriptedBackend()
    task = make_task("t", backend, {"max_staleness": 0})  # threshold 1, tail -1
    m = make_manager(backend, task)
    m.buffer.put(Group(50, "t", [done_sample(100, [0]), done_sample(101, [0])]))  # a leftover from model 0
    res = run(window(m, backend, 1, 2))  # step 2: staleness 1 >= 1 -> expired, dropped
    assert res.metrics["rollout/expired_groups"] == 1 and m.buffer.discarded_expired == 1
    assert [g.group_id for g in res.groups] == [0]


def test_retry_order_expired_then_aborted_then_fresh():
    # behaviour 21, through the strategy: [EXPIRED, ABORTED] pops the expired group, then the
    # aborted one, then falls back to fresh prompts (our numbers: two of each, FIFO within a status)
    backend = ScriptedBackend()
    task = make_task("t", backend, {"tail_batch_trigger_size": 0, "enable_partial_rollout": True, "max_staleness": 1})
    buf = AsyncReplayBuffer()
    def paused(gid, uid, versions):
        return Group(gid, "t", [done_sample(uid, versions, gid=gid, status=Status.ABORTED),
                                done_sample(uid + 1, [], gid=gid, status=Status.ABORTED)])

    buf.put(paused(30, 60, [0, 0]))
    expired_group(buf, 20)
    buf.put(paused(31, 62, []))
    expired_group(buf, 21)
    ctx = ProduceContext(4, 5, 4, buf)
    statuses = task.strategy.plan(task, ctx)[1]
    assert statuses == [Status.EXPIRED, Status.ABORTED]
    order = [task.strategy.next_group(task, ctx, statuses).group_id for _ in range(6)]
    assert order == [20, 21, 30, 31, 0, 1]
    assert task.stats.partial_resumed_samples == 1  # only uid 60 had tokens to continue
    assert task.stats.rerolled_samples == 4  # the members of the two expired groups
    task.agent_loop.judge_pool.close()


def test_reroll_of_mixed_group_keeps_the_fresh_member():
    # behaviour 27 (and 16: expiry resets only the stale member)
    backend = ScriptedBackend()
    task = make_task("t", backend, {"tail_batch_trigger_size": 0, "max_staleness": 1, "max_token_staleness": 0,
                                    "enable_partial_rollout": True}, interval=4)  # threshold 8, token threshold 4
    m = make_manager(backend, task)
    stale, fresh = done_sample(0, [0, 0], gid=0), done_sample(1, [4, 4], gid=0, reward=0.0)
    m.buffer.put(Group(0, "t", [stale, fresh]), consumer_step=5, rule=task.rule)
    assert stale.status == Status.EXPIRED and stale.response_ids == [] and fresh.status == Status.COMPLETED
    kept = (list(fresh.response_ids), list(fresh.token_versions), dict(fresh.reward))
    backend.version = 4
    res = run(m.produce_batch(1, 5, 4))
    assert [r.request_id for r in backend.requests] == [0]
    g = res.groups[0]
    assert g.group_id == 0 and g.samples[1] is fresh
    assert (fresh.response_ids, fresh.token_versions, fresh.reward) == kept
    assert g.samples[0].token_versions == [4] and g.samples[0].tries == 1


def test_tail_batch_max_tries_drops_and_counts():
    # XTuner's TODO: without partial rollout a sample that never finishes in a window is
    # restarted forever; with tail_batch_max_tries=2 it is restarted twice, then dropped.
    backend = ScriptedBackend(lambda uid: 1000 if uid in (0, 1) else 1)
    task = make_task("t", backend, {"over_sample_threshold": 1.0, "max_staleness": 1, "tail_batch_max_tries": 2},
                     max_tokens=2000)
    m = make_manager(backend, task)
    dropped, restarts = 0, []
    for step in range(1, 6):
        res = run(window(m, backend, 1, step))
        dropped += res.metrics["rollout/dropped_retry_groups"]
        restarts.append(len([r for r in backend.requests_for(0) if len(r.prompt_ids) == len(PROMPT)]))
        assert 0 not in [g.group_id for g in res.groups]
    assert dropped == 1
    assert restarts[-1] == 3  # first attempt + 2 re-rolls, then never again
    assert all(g.group_id != 0 for g in m.buffer.groups())


def test_tries_limit_counts_expiries_too():
    backend = ScriptedBackend()
    task = make_task("t", backend, {"tail_batch_trigger_size": 0, "tail_batch_max_tries": 1})
    m = make_manager(backend, task)
    g = expired_group(m.buffer, 7)
    g.samples[0].tries = 1  # already re-rolled once
    res = run(window(m, backend, 1, 5))
    assert res.metrics["rollout/dropped_retry_groups"] == 1
    assert [x.group_id for x in res.groups] == [0] and m.buffer.count() == 0


# ====================================================================== partial rollout
def test_partial_rollout_flag_is_per_task():
    # XTuner sets one global flag on all workers (the last built strategy wins); ours is per task.
    script = {"long": 50}
    backend = ScriptedBackend(lambda uid: script["long"] if (uid // 2) % 4 >= 2 else 1, tick=0.001)
    common = {"over_sample_threshold": 1.0, "max_staleness": 1}
    a = make_task("a", backend, {**common, "enable_partial_rollout": True})
    b = make_task("b", backend, {**common, "enable_partial_rollout": False, "tail_batch_max_tries": 5}, uid_base=1000)
    m = make_manager(backend, a, b)
    run(window(m, backend, 4, 1))
    paused = {t: {s.uid: list(s.response_ids) for g in m.buffer.groups(t, Status.ABORTED) for s in g.samples}
              for t in ("a", "b")}
    assert len(paused["a"]) == len(paused["b"]) == 4 and all(paused["a"].values())
    script["long"] = 3  # the paused ones can finish now
    backend.requests.clear()
    res = run(window(m, backend, 4, 2))
    assert res.metrics["task/a/partial_resumed_samples"] == 4 and res.metrics["task/b/partial_resumed_samples"] == 0
    assert res.metrics["rollout/partial_resumed_samples"] == 4 and res.metrics["rollout/rerolled_samples"] == 4
    for uid, partial in paused["a"].items():
        (req,) = [r for r in backend.requests if r.request_id == uid and r.prompt_ids[:2] == PROMPT
                  and len(r.prompt_ids) > 2]
        assert req.prompt_ids == PROMPT + partial and req.params.max_tokens == 64 - len(partial)
    for uid in paused["b"]:
        reqs = [r for r in backend.requests if r.request_id == uid]
        assert [r.prompt_ids for r in reqs] == [PROMPT]
    everything = {s.uid: s for g in [*res.groups, *m.buffer.groups()] for s in g.samples}
    for uid, partial in paused["a"].items():
        s = everything[uid]
        assert s.response_ids[:len(partial)] == partial and s.resumes == 1 and s.tries == 0
        assert s.token_versions[:len(partial)] == [0] * len(partial) and set(s.token_versions[len(partial):]) == {1}
    for uid in paused["b"]:
        assert set(everything[uid].token_versions) == {1} and everything[uid].tries == 1


def test_partial_continuation_never_exceeds_the_budget():
    script = {"n": 100}
    backend = ScriptedBackend(lambda uid: script["n"] if uid >= 2 else 1, tick=0.001)
    task = make_task("t", backend, {"over_sample_threshold": 1.0, "max_staleness": 3, "enable_partial_rollout": True},
                     max_tokens=5, k=2)
    m = make_manager(backend, task)
    run(window(m, backend, 1, 1))
    (g,) = m.buffer.groups("t", Status.ABORTED)
    p = len(g.samples[0].response_ids)
    assert 0 < p < 5
    res = run(window(m, backend, 2, 2))
    s = next(s for x in res.groups for s in x.samples if s.uid == 2)
    assert len(s.response_ids) == 5 and s.finish_reason == "length" and s.status == Status.COMPLETED
    assert s.token_versions == [0] * p + [1] * (5 - p) and s.staleness == 2 - 0 - 1
    assert [r.params.max_tokens for r in backend.requests_for(2)] == [5, 5 - p]


def test_partial_response_ending_in_eos_completes_without_a_request():
    backend = ScriptedBackend()
    task = make_task("t", backend, {"enable_partial_rollout": True, "max_staleness": 1})
    m = make_manager(backend, task)
    a = done_sample(10, [0, 0], gid=5, status=Status.ABORTED)  # generation finished, judging was cut
    b = done_sample(11, [0], gid=5)
    m.buffer.put(Group(5, "t", [a, b]))
    res = run(window(m, backend, 1, 2))
    assert backend.requests == [] and res.groups[0].group_id == 5
    assert a.status == Status.COMPLETED and a.reward == {"score": 0.0} and a.finish_reason == "stop"


def test_token_staleness_masks_instead_of_dropping():
    # behaviour 13: token threshold 4 at step 5 on versions [0, 4] -> mask [0, 1]
    backend = ScriptedBackend()
    task = make_task("t", backend, {"max_staleness": 1, "max_token_staleness": 0, "tail_batch_trigger_size": 0},
                     interval=4)
    m = make_manager(backend, task)
    m.buffer.put(Group(3, "t", [done_sample(6, [0, 4]), done_sample(7, [4, 4])]))
    backend.version = 4
    res = run(m.produce_batch(1, 5, 4))
    (g,) = res.groups
    assert [s.response_mask for s in g.samples] == [[0, 1], [1, 1]]
    assert [s.response_ids for s in g.samples] == [[TOK, EOS], [TOK, EOS]]  # nothing dropped
    assert res.metrics["rollout/masked_stale_tokens"] == 1 and res.metrics["rollout/staleness_max"] == 4


# ========================================================================= judge grace
def test_pause_gives_running_judge_calls_a_grace_period():
    # behaviour 53 (second half): a slow judge at pause time -> ABORTED, reward None, re-judged later
    slow = {1: 3.0}
    backend = ScriptedBackend()
    judger = ScoreJudger(slow)
    task = make_task("t", backend, {"over_sample_threshold": 1.0, "enable_partial_rollout": True, "max_staleness": 1},
                     judger=judger, executor="thread", grace=0.3)
    m = make_manager(backend, task)
    t0 = time.perf_counter()
    res = run(window(m, backend, 1, 1))
    took = time.perf_counter() - t0
    assert took < 2.0, took
    assert [g.group_id for g in res.groups] == [1]
    (g,) = m.buffer.groups("t", Status.ABORTED)
    s1 = g.samples[1]
    assert s1.status == Status.ABORTED and s1.reward is None and s1.finish_reason == "abort"
    assert "grace" in s1.error and s1.response_ids == [EOS]
    assert res.metrics["judger/aborted"] == 1 and res.metrics["rollout/aborted_groups"] == 1
    slow.clear()
    res = run(window(m, backend, 1, 2))
    assert res.groups[0].group_id == 0 and s1.status == Status.COMPLETED and s1.reward == {"score": 1.0}
    assert len(backend.requests_for(1)) == 1  # re-judged, not re-generated
    assert judger.calls.count(1) == 2


def test_drain_timeout_cancels_stuck_rollouts_and_keeps_them():
    class StuckLoop:
        judge_pool = None

        async def run_group(self, samples):
            samples[0].response_ids = [TOK]
            samples[0].token_versions = [0]
            samples[0].logprobs = [-0.1]
            await asyncio.sleep(60)

    backend = ScriptedBackend()
    task = make_task("t", backend, {"drain_timeout_s": 0.2, "judge_grace_s": 0.1})
    task.agent_loop = StuckLoop()
    buf = AsyncReplayBuffer()
    ctx = ProduceContext(1, 1, 0, buf)

    async def go():
        t = asyncio.ensure_future(task.strategy.produce_batch(task, ctx))
        await asyncio.sleep(0.01)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        t0 = time.perf_counter()
        await task.strategy.drain(task, ctx)
        return time.perf_counter() - t0

    assert run(go()) < 1.0
    (g,) = buf.groups("t", Status.ABORTED)
    assert g.samples[0].response_ids == [TOK] and all(s.status == Status.ABORTED for s in g.samples)


# ====================================================================== sync strategy
def test_sync_replaces_filtered_and_keeps_aborted():
    # behaviour 22: group 0 filtered, group 1 aborted -> 2 COMPLETED (2, 3), 0 FILTERED, 1 ABORTED
    backend = ScriptedBackend()
    backend.abort_uids = {2, 3}
    task = make_task("t", backend, strategy_cls=SyncProduceStrategy, filters=[RejectGroups({0})])
    buf = SyncReplayBuffer()
    ctx = ProduceContext(2, 1, 0, buf)
    try:
        run(task.strategy.produce_batch(task, ctx))
        assert [g.group_id for g in buf.groups("t", Status.COMPLETED)] == [2, 3]
        assert buf.count("t", Status.FILTERED) == 0 and buf.count("t", Status.ABORTED) == 1
        # behaviour 23: raw reward stats include the filtered group (scores 0 and 1)
        assert len(task.stats.raw_rewards) == 6 and sum(task.stats.raw_rewards) == 3.0
        assert task.stats.filtered_groups == 1 and task.stats.aborted_groups == 1
        # ours: the next sync window restarts the aborted group from scratch instead of leaking it
        backend.abort_uids = set()
        buf.take("t", 2)
        run(task.strategy.produce_batch(task, ctx))
        assert [g.group_id for g in buf.groups("t", Status.COMPLETED)] == [1, 4]
        assert buf.count("t", Status.ABORTED) == 0
        assert [r.prompt_ids for r in backend.requests_for(2)] == [PROMPT, PROMPT]
    finally:
        task.agent_loop.judge_pool.close()


def test_interrupted_sync_window_loses_nothing():
    backend = ScriptedBackend(lambda uid: 40, tick=0.002)
    task = make_task("t", backend, strategy_cls=SyncProduceStrategy)
    buf = SyncReplayBuffer()
    ctx = ProduceContext(3, 1, 0, buf)

    async def go():
        t = asyncio.ensure_future(task.strategy.produce_batch(task, ctx))
        await asyncio.sleep(0.02)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)

    try:
        run(go())
        paused = buf.groups("t", Status.ABORTED)
        assert [g.group_id for g in paused] == [0, 1, 2] and backend.inflight == 0
        backend.script, backend.tick = (lambda uid: 2), 0.0
        run(task.strategy.produce_batch(task, ctx))  # restarted from scratch, nothing new sampled
        assert [g.group_id for g in buf.groups("t", Status.COMPLETED)] == [0, 1, 2]
        assert task.sampler.groups_sampled == 3
        # cancelled before their tokens came back: nothing was thrown away, so not a re-roll
        assert all(s.tries == 0 and s.token_versions == [0, 0] for g in buf.groups() for s in g.samples)
    finally:
        task.agent_loop.judge_pool.close()


def test_all_equal_rewards_filter_and_filter_guard():
    backend = ScriptedBackend()
    flat = ScoreJudger()
    flat.judge = lambda response, label, sample: 1.0  # every group all-equal
    task = make_task("t", backend, {"max_filtered_groups": 5}, judger=flat,
                     filters=[AllEqualRewards(AllEqualRewards.Config())])
    m = make_manager(backend, task)
    with pytest.raises(RuntimeError, match="5 groups in a row were filtered out"):
        run(window(m, backend, 2, 1))
    assert task.strategy.pending == 0 and backend.inflight == 0


def test_broken_agent_loop_fails_samples_not_the_run():
    class Broken(SingleTurnAgentLoop):
        async def run_group(self, samples):
            if samples[0].group_id % 3 == 0:
                raise KeyError("boom")
            return await super().run_group(samples)

    backend = ScriptedBackend()
    task = make_task("t", backend, {"max_failed_groups": 3})
    old = task.agent_loop
    task.agent_loop = Broken(old.config, backend=backend, judge_pool=old.judge_pool, tokenizer=Tok(),
                             eos_token_ids=[EOS], seed=0)
    m = make_manager(backend, task)
    res = run(window(m, backend, 4, 1))
    assert len(res.groups) == 4 and res.metrics["rollout/failed_groups"] >= 1
    assert res.metrics["rollout/failed_samples"] == 2 * res.metrics["rollout/failed_groups"]
    assert res.metrics["agent_loop/errors"] == res.metrics["rollout/failed_samples"]
    task.agent_loop.run_group = lambda samples: (_ for _ in ()).throw(KeyError("always"))
    with pytest.raises(RuntimeError, match="3 groups in a row failed completely.*agent loop 'single_turn' raised Key"):
        run(window(m, backend, 4, 2))
    assert task.strategy.pending == 0
