"""The rollout manager over a scripted fake backend; the fakes tests/test_produce_strategies.py uses.

The fake backend only controls timing (one token per event-loop tick, pause aborts in flight);
everything else - agent loop, judge pool, strategies, buffer, manager - is the real code.
XTuner behaviour numbers refer to ../shared/reference/xtuner-behavior.md.
"""

from __future__ import annotations

import asyncio
import copy
import pickle
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcli.agent_loops import SingleTurnAgentLoop
from rlcli.backends.base import GenerateOutput, GenerateRequest
from rlcli.judging import JudgePool
from rlcli.produce.manager import RolloutManager, _pct
from rlcli.produce import AsyncProduceStrategy, ProduceContext, ProduceStatus, Task
from rlcli.replay_buffer import AsyncReplayBuffer, StalenessRule
from rlcli.types import Group, Sample, SampleParams, Status

PROMPT = [5, 6]
EOS = 2
TOK = 7


# ================================================================================ fakes
class ScriptedBackend:
    """A fake inference backend whose only job is timing.

    The full response of sample ``uid`` is ``script(uid)`` tokens, the last one EOS (at least
    one new token per request). One token is produced per ``tick`` (an ``asyncio.sleep``),
    stamped with ``version``. ``pause()`` aborts every request in flight at its next token,
    returning the tokens generated so far; requests made while paused abort at once.
    ``abort_uids`` always abort (after one token).
    """

    def __init__(self, script=None, tick: float = 0.0):
        self.script = script or (lambda uid: 1)
        self.tick = tick
        self.version = 0
        self.paused = False
        self.abort_uids: set[int] = set()
        self.requests: list[GenerateRequest] = []
        self.inflight = 0

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def requests_for(self, uid: int) -> list[GenerateRequest]:
        return [r for r in self.requests if r.request_id == uid]

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        self.requests.append(req)
        out = GenerateOutput(finish_reason="abort")
        if self.paused:
            return out
        want = max(1, self.script(req.request_id) - (len(req.prompt_ids) - len(PROMPT)))
        self.inflight += 1
        try:
            for i in range(req.params.max_tokens):
                await asyncio.sleep(self.tick)
                if self.paused:
                    return out
                last = i == want - 1
                out.token_ids.append(EOS if last else TOK)
                out.logprobs.append(-0.1)
                out.versions.append(self.version)
                if req.request_id in self.abort_uids:
                    return out
                if last:
                    out.finish_reason = "stop"
                    return out
            out.finish_reason = "length"
            return out
        finally:
            self.inflight -= 1


class FakeSampler:
    """Fresh groups 0, 1, 2, ... of ``k`` samples; uids start at ``uid_base`` (tasks stay apart)."""

    def __init__(self, task: str, k: int = 2, uid_base: int = 0):
        self.task, self.k, self.uid_base = task, k, uid_base
        self.groups_sampled = 0

    def sample_group(self) -> list[Sample]:
        gid = self.groups_sampled
        self.groups_sampled += 1
        return [Sample(uid=self.uid_base + gid * self.k + i, group_id=gid, task_name=self.task,
                       prompt_ids=list(PROMPT), label=1) for i in range(self.k)]

    def pop_stats(self):
        return {}

    def state_dict(self):
        return {"groups_sampled": self.groups_sampled}

    def load_state_dict(self, state):
        self.groups_sampled = state["groups_sampled"]


class ScoreJudger:
    """Score = uid % 2 (so every group of 2 has signal); sleeps ``slow[uid]`` seconds first."""

    name = "score"

    def __init__(self, slow: dict[int, float] | None = None):
        self.slow = slow if slow is not None else {}
        self.calls: list[int] = []

    def judge(self, response, label, sample):
        self.calls.append(sample.uid)
        if sample.uid in self.slow:
            time.sleep(self.slow[sample.uid])
        return float(sample.uid % 2)


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class RejectGroups:
    """A group filter rejecting the given group ids."""

    name = "reject"

    def __init__(self, gids):
        self.gids = set(gids)

    def keep(self, group):
        return group.group_id not in self.gids


def make_task(name, backend, strategy=None, *, k=2, max_tokens=64, interval=1, judger=None, executor="inline",
              grace=10.0, filters=(), strategy_cls=AsyncProduceStrategy, uid_base=0):
    cfg = strategy_cls.Config(**{"judge_grace_s": grace, **(strategy or {})})
    strat = strategy_cls(cfg, sync_weights_interval=interval)
    judger = judger or ScoreJudger()
    pool = JudgePool(judger, executor=executor, timeout_s=30.0, workers=2)
    loop = SingleTurnAgentLoop(SingleTurnAgentLoop.Config(sample_params=SampleParams(max_tokens=max_tokens)),
                               backend=backend, judge_pool=pool, tokenizer=Tok(), eos_token_ids=[EOS], seed=0)
    return Task(name, 1.0, FakeSampler(name, k, uid_base), loop, strat, list(filters), strat.staleness_rule())


_MANAGERS: list[RolloutManager] = []  # every manager a test made: their judge pools are closed after it


def make_manager(backend, *tasks, buffer=None, **kw):
    m = RolloutManager(list(tasks), buffer if buffer is not None else AsyncReplayBuffer(), backend,
                       [t.agent_loop.judge_pool for t in tasks], **kw)
    _MANAGERS.append(m)
    return m


def close(manager):
    for p in manager.judge_pools:
        p.close()


@pytest.fixture(autouse=True)
def _close_managers():
    yield
    while _MANAGERS:
        close(_MANAGERS.pop())


def model_step(step, interval):
    return (step - 1) - ((step - 1) % interval)


async def window(manager, backend, batch, step, interval=1):
    """One colocated step: the backend serves the last synced policy."""
    backend.version = model_step(step, interval)
    return await manager.produce_batch(batch, step, backend.version)


def run(coro):
    return asyncio.run(coro)


def done_sample(uid, versions, *, task="t", gid=None, status=Status.COMPLETED, reward=1.0):
    s = Sample(uid=uid, group_id=uid // 2 if gid is None else gid, task_name=task, prompt_ids=list(PROMPT), label=1)
    s.response_ids = [TOK] * (len(versions) - 1) + [EOS] if versions else []
    s.logprobs = [-0.1] * len(versions)
    s.token_versions = list(versions)
    s.response_mask = [1] * len(versions)
    s.status = status
    s.finish_reason = "stop" if status == Status.COMPLETED else "abort"
    s.reward = {"score": reward} if status == Status.COMPLETED else None
    s.response = "x"
    return s


def expired_group(buf, gid, task="t", k=2, step=5):
    """Store a group that expires on put (versions [0] at step 5, threshold 1, retryable)."""
    g = Group(gid, task, [done_sample(gid * k + i, [0], task=task, gid=gid) for i in range(k)])
    assert buf.put(g, consumer_step=step, rule=StalenessRule(1, retryable=True)) == Status.EXPIRED
    return g


# ============================================================================ manager
def test_batch_size_errors_and_task_validation():
    # behaviours 4 and 5
    backend = ScriptedBackend()
    t = make_task("t", backend)
    m = make_manager(backend, t)
    with pytest.raises(ValueError, match="produce_batch expects batch_size > 0, got 0"):
        run(m.produce_batch(0, 1, 0))
    with pytest.raises(ValueError, match="duplicate task name 't'"):
        make_manager(backend, t, t)
    with pytest.raises(ValueError, match="at least one task"):
        RolloutManager([], AsyncReplayBuffer(), backend, [])
    t.weight = 0
    with pytest.raises(ValueError, match="weight must be positive"):
        make_manager(backend, t)


def test_each_sample_trains_on_its_own_advantage_from_rollout_to_micro_batch():
    # behaviour 40 on the real path: judged scores [3, -1] -> the step's reward metrics -> the
    # estimator computes the advantages (no precomputed values) -> each sample's own advantage on
    # every trained token of that sample
    from rlcli.algo.advantage import GRPOAdvantage, RLOOAdvantage
    from rlcli.runner.sequences import sequences_from_groups
    from rlcli.train.data import build_micro_batch, pack_sequences

    class ThreeOrMinusOne:
        name = "three_or_minus_one"

        def judge(self, response, label, sample):
            return 3.0 if sample.uid % 2 == 0 else -1.0

    backend = ScriptedBackend(lambda uid: 2 if uid % 2 == 0 else 1)  # responses [TOK, EOS] and [EOS]
    m = make_manager(backend, make_task("t", backend, judger=ThreeOrMinusOne()))
    res = run(window(m, backend, 1, 1))
    assert (res.metrics["reward/mean"], res.metrics["reward/min"], res.metrics["reward/max"]) == (1.0, -1.0, 3.0)
    for estimator, want in ((GRPOAdvantage(), [2 ** -0.5, -(2 ** -0.5)]), (RLOOAdvantage(), [4.0, -4.0])):
        seqs, adv = sequences_from_groups(res.groups, estimator)
        assert [s.seq_id for s in seqs] == [0, 1] and adv == pytest.approx(want, abs=1e-5)
        assert [s.advantage for s in seqs] == adv
        (pack,) = pack_sequences(seqs, 100)
        mb = build_micro_batch(seqs, pack, "packed")
        assert mb.labels.tolist() == [TOK, EOS, EOS]
        assert mb.advantages.tolist() == pytest.approx([want[0], want[0], want[1]], abs=1e-5)


def test_a_batch_without_a_trainable_group_is_an_error():
    # behaviour 63 on the manager's side: a rollout that leaves no group to train on ends the step
    # with an error (after pausing the backend) instead of handing the trainer an empty batch
    backend = ScriptedBackend()
    task = make_task("t", backend)
    m = make_manager(backend, task)

    async def produce_nothing(task, ctx):
        return None

    task.strategy.produce_batch = produce_nothing
    with pytest.raises(RuntimeError, match="rollout produced no trainable group"):
        run(window(m, backend, 2, 1))
    assert backend.paused and task.strategy.pending == 0 and backend.requests == []


def test_multitask_order_sizes_and_per_task_metrics():
    # behaviours 1, 6 and the acceptance's 2:1 split of 9
    backend = ScriptedBackend()
    b, a = make_task("b", backend), make_task("a", backend)
    b.weight, a.weight = 1.0, 2.0
    m = make_manager(backend, b, a)  # config order b, a
    res = run(window(m, backend, 9, 1))
    assert res.task_sizes == {"b": 3, "a": 6}
    assert [g.task_name for g in res.groups] == ["a"] * 6 + ["b"] * 3
    assert [g.group_id for g in res.groups[:6]] == sorted(g.group_id for g in res.groups[:6])
    assert res.metrics["task/a/groups"] == 6 and res.metrics["task/b/groups"] == 3
    assert res.metrics["task/a/samples"] == 12 and res.metrics["task/b/reward_mean"] == 0.5


def test_counters_are_read_once():
    # behaviour 65, and 61 (p50/p99)
    backend = ScriptedBackend()
    task = make_task("t", backend)
    m = make_manager(backend, task)
    try:
        r1 = run(window(m, backend, 2, 1))
        r2 = run(window(m, backend, 3, 2))
        assert r1.metrics["rollout/produced_samples"] == 4 and r2.metrics["rollout/produced_samples"] == 6
        assert r1.metrics["judger/calls"] == 4 and r2.metrics["judger/calls"] == 6
    finally:
        close(m)
    assert _pct([0.5, 1.0], 0.5) == 1.0 and _pct([0.5, 1.0], 0.99) == 1.0 and _pct([], 0.5) == 0.0


def test_save_while_pending_raises_and_restore_is_exact():
    # behaviour 34; and aborted partial responses survive save/restore exactly
    def setup():
        backend = ScriptedBackend(lambda uid: 30 if uid // 2 >= 2 else 1)
        task = make_task("t", backend, {"over_sample_threshold": 1.0, "enable_partial_rollout": True,
                                        "max_staleness": 1}, interval=2)
        return backend, task, make_manager(backend, task)

    backend, task, m = setup()
    backend2, task2, m2 = setup()
    try:
        run(window(m, backend, 2, 1, 2))
        assert m.buffer.count("t", Status.ABORTED) == 2

        async def save_mid_flight():
            backend.version = 0
            t = asyncio.ensure_future(m.produce_batch(2, 2, 0))
            while task.strategy.pending == 0:
                await asyncio.sleep(0)
            with pytest.raises(RuntimeError, match="Cannot save the RolloutManager while pending rollout tasks"):
                m.state_dict()
            return await t

        state = pickle.loads(pickle.dumps(m.state_dict()))
        snapshot = copy.deepcopy(state)
        m2.load_state_dict(state)
        assert m2.state_dict() == snapshot
        r1 = run(save_mid_flight())
        backend2.version = 0
        r2 = run(m2.produce_batch(2, 2, 0))

        def view(groups):
            return [(s.uid, s.response_ids, s.token_versions, s.resumes, s.status) for g in groups for s in g.samples]

        assert view(r1.groups) == view(r2.groups)
        assert r1.metrics["rollout/partial_resumed_samples"] == r2.metrics["rollout/partial_resumed_samples"] == 4
        assert _timeless(m.state_dict()) == _timeless(m2.state_dict())
    finally:
        close(m)
        close(m2)


def _timeless(state):
    """A manager state without wall-clock fields (generation times differ between runs)."""
    state = copy.deepcopy(state)
    for e in state["buffer"]["entries"]:
        for smp in e["group"]["samples"]:
            smp.pop("gen_time_s")
    return state


# ====================================================================== disaggregated
def test_ensure_target_upto_accumulates_per_step_allocations():
    # behaviour 66
    backend = ScriptedBackend()
    a, b = make_task("a", backend), make_task("b", backend)
    m = make_manager(backend, a, b, allocate=lambda bs, step: {"a": step, "b": bs - step})
    assert m.ensure_target_upto(4, 2) == {"a": 2, "b": 2}
    assert m.target_samples == {"a": 3, "b": 5}
    assert m.ensure_target_upto(4, 2) == {"a": 2, "b": 2} and m.target_samples == {"a": 3, "b": 5}


def test_produce_round_expired_and_pause_return_before_sampling():
    # behaviour 29
    backend = ScriptedBackend()
    task = make_task("t", backend, {"tail_batch_trigger_size": 0})  # threshold 1
    buf = AsyncReplayBuffer()
    expired_group(buf, 9)
    before = buf.state_dict()
    stop = asyncio.Event()
    try:
        ctx = ProduceContext(2, 3, 0, buf, target=2, future_step=2, stop=stop)  # 2 - 0 - 1 >= 1: expired
        assert run(task.strategy.produce_round(task, ctx)) == ProduceStatus.EXPIRED_BATCH
        stop.set()
        ctx.future_step = 1
        assert run(task.strategy.produce_round(task, ctx)) == ProduceStatus.UPDATE_WEIGHT_AND_ABORT
        assert task.sampler.groups_sampled == 0 and backend.requests == [] and buf.state_dict() == before
    finally:
        task.agent_loop.judge_pool.close()


def test_get_batch_expired_semantics():
    # behaviour 30
    backend = ScriptedBackend()
    task = make_task("t", backend, {"max_staleness": 0})
    m = make_manager(backend, task)

    async def go():
        m._set_status(ProduceStatus.EXPIRED_BATCH)
        m.model_step = 1
        res = await m.get_batch(1, 3)  # 3 - 1 > 1: sync first
        assert res.groups == [] and res.status == ProduceStatus.EXPIRED_BATCH
        with pytest.raises(RuntimeError, match="EXPIRED_BATCH without a newer model or a ready batch"):
            await m.get_batch(1, 2)
        m.buffer.put(Group(0, "t", [done_sample(0, [1]), done_sample(1, [1])]))
        res = await m.get_batch(1, 2)
        assert [g.group_id for g in res.groups] == [0] and res.status == ProduceStatus.EXPIRED_BATCH
        assert m.consumed_samples == {"t": 1} and m.next_consumer_step == 3

    run(go())


async def _trainer(m, backend, steps, batch, interval, log):
    """A disaggregated trainer in miniature: get_batch, 'train', sync every `interval` steps."""
    step = 1
    while step <= steps:
        res = await m.get_batch(batch, step, timeout_s=10)
        if not res.groups:  # EXPIRED_BATCH: sync the newest weights, then retry the same step
            await m.pause_produce()
            backend.version = step - 1
            await m.continue_produce(step - 1)
            log.append(("expired", step))
            continue
        log.append(("batch", step, res))
        await asyncio.sleep(0.002)  # training
        if step % interval == 0 or res.status == ProduceStatus.EXPIRED_BATCH:
            await m.pause_produce()
            assert m.pending == 0
            log.append(("saved", step, m.state_dict()))
            backend.version = step
            await m.continue_produce(step)
        step += 1


@pytest.mark.parametrize("interval,max_staleness,partial,oversample", [
    (1, 0, False, 0.0), (2, 0, False, 0.0), (2, 1, True, 0.5), (1, 2, True, 1.0), (3, 1, True, 0.25),
])
def test_disaggregated_producer_respects_the_bound(interval, max_staleness, partial, oversample):
    backend = ScriptedBackend(lambda uid: 1 + (uid * 7) % 9, tick=0.0005)
    task = make_task("t", backend, {"max_staleness": max_staleness, "enable_partial_rollout": partial,
                                    "over_sample_threshold": oversample, "tail_batch_trigger_size": 0},
                     interval=interval, k=2)
    m = make_manager(backend, task)
    thr = (max_staleness + 1) * interval
    ahead: list[int] = []
    log: list = []

    async def watch():
        while True:
            ahead.append(m.producer_future_step - m.model_step - 1)
            await asyncio.sleep(0.001)

    async def go():
        producer = m.start_produce_loop(3)
        watcher = asyncio.ensure_future(watch())
        try:
            await _trainer(m, backend, 8, 3, interval, log)
        finally:
            watcher.cancel()
            await m.shutdown()
        assert producer.done() and m.pending == 0

    try:
        run(go())
    finally:
        close(m)
    batches = [x for x in log if x[0] == "batch"]
    assert [x[1] for x in batches] == list(range(1, 9))
    uids = [s.uid for _, _, res in batches for g in res.groups for s in g.samples]
    assert len(uids) == len(set(uids)) == 8 * 3 * 2
    for _, step, res in batches:
        assert len(res.groups) == 3
        for g in res.groups:
            for s in g.samples:
                assert 0 <= s.staleness < thr and s.staleness == step - min(s.token_versions) - 1
                assert len(s.response_ids) == len(s.token_versions) <= 64
    assert max(ahead) <= thr  # the producer runs ahead at most to future = model + threshold
    assert m.consumed_samples == {"t": 24}
    # everything sampled is trained, stored or counted as discarded
    assert task.sampler.groups_sampled == 24 + len(m.buffer) + m.buffer.discarded_expired


def test_disaggregated_resume_waits_for_continue_produce():
    # behaviour 33: restore -> (weight update) -> continue_produce(saved step); nothing generated before
    backend = ScriptedBackend(lambda uid: 3, tick=0.0005)
    task = make_task("t", backend, {"max_staleness": 1, "enable_partial_rollout": True, "over_sample_threshold": 1.0})
    m = make_manager(backend, task)
    log: list = []

    async def first():
        m.start_produce_loop(2)
        await _trainer(m, backend, 2, 2, 1, log)
        await m.shutdown()

    backend2 = ScriptedBackend(lambda uid: 3, tick=0.0005)
    task2 = make_task("t", backend2, {"max_staleness": 1, "enable_partial_rollout": True, "over_sample_threshold": 1.0})
    m2 = make_manager(backend2, task2)

    async def second(state):
        m2.load_state_dict(state)
        m2.start_produce_loop(2)
        await asyncio.sleep(0.05)
        assert backend2.requests == [] and m2.status == ProduceStatus.UPDATE_WEIGHT_AND_ABORT
        backend2.version = state["progress"]["model_step"]
        await m2.continue_produce(backend2.version)
        res = await m2.get_batch(2, state["progress"]["next_consumer_step"], timeout_s=10)
        await m2.shutdown()
        return res

    try:
        run(first())
        saved = [x for x in log if x[0] == "saved"][-1][2]
        assert saved["progress"]["next_consumer_step"] == 3 and saved["progress"]["model_step"] == 1
        res = run(second(saved))
        assert len(res.groups) == 2 and backend2.requests
        trained_before = {g.group_id for x in log if x[0] == "batch" for g in x[2].groups}
        assert not trained_before & {g.group_id for g in res.groups}
    finally:
        close(m)
        close(m2)


def test_get_batch_surfaces_producer_errors_and_times_out():
    backend = ScriptedBackend()
    task = make_task("t", backend)
    m = make_manager(backend, task)

    async def go():
        with pytest.raises(RuntimeError, match="no producer is running"):
            await m.get_batch(1, 1)
        task.sampler.sample_group = lambda: (_ for _ in ()).throw(OSError("disk gone"))
        m.start_produce_loop(1)
        with pytest.raises(RuntimeError, match="background producer failed") as ei:
            await m.get_batch(1, 1, timeout_s=5)
        assert isinstance(ei.value.__cause__, OSError)

    async def slow():
        backend.script, backend.tick = (lambda uid: 10_000), 0.05
        m2 = make_manager(backend, make_task("u", backend))
        m2.start_produce_loop(1)
        try:
            with pytest.raises(TimeoutError):
                await m2.get_batch(1, 1, timeout_s=0.2)
        finally:
            await m2.shutdown()
            close(m2)

    run(go())
    run(slow())


# ============================================================== property: colocated windows
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 12), min_size=6, max_size=6),
    steps=st.integers(2, 6),
    interval=st.integers(1, 3),
    max_staleness=st.integers(0, 2),
    partial=st.booleans(),
    oversample=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    tail=st.sampled_from([-1, 0, 1, 3]),
    tries=st.sampled_from([None, 1, 3]),
    token_staleness=st.sampled_from([None, 0]),
    batch=st.integers(1, 4),
)
def test_colocated_windows_lose_nothing_and_respect_the_bound(lengths, steps, interval, max_staleness, partial,
                                                              oversample, tail, tries, token_staleness, batch):
    backend = ScriptedBackend(lambda uid: lengths[uid % 6])
    task = make_task("t", backend, {
        "max_staleness": max_staleness, "enable_partial_rollout": partial, "over_sample_threshold": oversample,
        "tail_batch_trigger_size": tail, "tail_batch_max_tries": tries,
        "max_token_staleness": min(token_staleness, max_staleness) if token_staleness is not None else None,
    }, interval=interval, max_tokens=8)
    m = make_manager(backend, task)
    thr = (max_staleness + 1) * interval
    trained: list[int] = []
    discarded = 0
    for step in range(1, steps + 1):
        res = run(window(m, backend, batch, step, interval))
        assert task.strategy.pending == 0
        discarded += res.metrics["rollout/dropped_retry_groups"] + res.metrics["rollout/filtered_groups"]
        discarded += res.metrics["rollout/failed_groups"]
        for g in res.groups:
            trained.append(g.group_id)
            for s in g.samples:
                assert s.status == Status.COMPLETED and s.reward is not None
                assert len(s.response_ids) == len(s.token_versions) == len(s.logprobs) <= 8
                assert s.token_versions == sorted(s.token_versions)
                assert s.staleness == step - min(s.token_versions) - 1 < thr
        if step < steps:  # a checkpoint between any two steps changes nothing
            state = pickle.loads(pickle.dumps(m.state_dict()))
            fresh = AsyncReplayBuffer()
            fresh.load_state_dict(state["buffer"])
            assert fresh.state_dict() == state["buffer"]
            m.buffer = fresh
    assert len(trained) == len(set(trained))
    stored = [g.group_id for g in m.buffer.groups()]
    assert not set(stored) & set(trained)
    assert task.sampler.groups_sampled == len(trained) + len(stored) + discarded + m.buffer.discarded_expired
