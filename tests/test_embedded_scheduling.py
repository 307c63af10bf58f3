"""The embedded engine's scheduling: results independent of the batch's composition, prefix sharing,
slot compaction, shape-stable and overlapped decode, deferred finishes (and abort or failure while
they wait), decode shape buckets, max_model_len, failed requests and steps that leave the engine
running, and the stats counters. The fixtures and helpers come from test_embedded_backend.py."""

from __future__ import annotations

import asyncio
import random

import pytest

from .test_embedded_backend import make, prompts, req, run_all
from .test_embedded_backend import model_dir, model_dirs  # noqa: F401  (fixtures: pytest finds them by name)


# ------------------------------------------------------------------------------------------ scheduling
def test_determinism_independent_of_batch_composition(model_dir):
    be = make(model_dir, max_batch_size=64)
    target = req([7, 8, 9, 10, 11], seed=99, temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = run_all(be, [target])[0]
    rng = random.Random(1)

    async def mixed():
        others = [
            be.generate(
                req(p, temperature=rng.choice([0.0, 0.5, 1.0]), top_k=rng.choice([0, 5]), max_tokens=rng.randint(1, 30))
            )
            for p in prompts(50, rng, 1, 20)
        ]
        tasks = [asyncio.ensure_future(o) for o in others]
        await asyncio.sleep(0.01)  # let the others start decoding: the target is admitted later
        late = await be.generate(target)
        await asyncio.gather(*tasks)
        return late

    late = asyncio.run(mixed())
    assert late.token_ids == alone.token_ids
    assert late.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    be.shutdown()


def test_prefix_sharing_matches_no_sharing(model_dir):
    ps = prompts(6, random.Random(2), 3, 12)
    requests = [req(p, seed=100 * i + j, temperature=1.0, max_tokens=10) for i, p in enumerate(ps) for j in range(4)]
    requests += [req(p, temperature=0.0, max_tokens=10) for p in ps for _ in range(2)]
    results = {}
    for sharing in (True, False):
        be = make(model_dir, max_batch_size=64, prefix_sharing=sharing)
        be.stats()
        results[sharing] = run_all(be, requests)
        stats = be.stats()
        unique_tokens = sum(len(p) for p in ps)
        if sharing:
            assert stats["prefill_tokens"] == unique_tokens
            assert stats["shared_prefill_tokens"] == 5 * unique_tokens
        else:
            assert stats["prefill_tokens"] == 6 * unique_tokens and stats["shared_prefill_tokens"] == 0
        be.shutdown()
    for a, b in zip(results[True], results[False]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_slot_compaction_with_staggered_finishing(model_dir):
    """With 8 rows and 60 requests of 1..40 tokens, rows finish and are refilled constantly;
    every request must equal its result when served alone."""
    rng = random.Random(3)
    requests = [
        req(p, seed=i, temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 40), ignore_eos=bool(i % 2))
        for i, p in enumerate(prompts(60, rng, 1, 12))
    ]
    be = make(model_dir, max_batch_size=8, max_prefill_tokens=24)
    batched = run_all(be, requests)
    assert be.engine.num_active == 0 and be.engine.num_waiting == 0
    be.shutdown()
    serial_be = make(model_dir, max_batch_size=1)
    serial = [run_all(serial_be, [r])[0] for r in requests]
    serial_be.shutdown()
    lengths = {len(o.token_ids) for o in batched}
    assert len(lengths) > 10  # staggered
    for r, a, b in zip(requests, batched, serial):
        assert a.token_ids == b.token_ids, f"request {r.prompt_ids} differs batched vs alone"
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.finish_reason == b.finish_reason


def test_shape_stable_decode_gives_identical_results(model_dir):
    rng = random.Random(4)
    requests = [req(p, seed=i, temperature=0.8, max_tokens=rng.randint(1, 25)) for i, p in enumerate(prompts(37, rng))]
    outs = []
    for stable in (False, True):
        be = make(model_dir, max_batch_size=64)
        be.engine.shape_stable_decode = stable
        outs.append(run_all(be, requests))
        be.shutdown()
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def _stopping_requests(be, rng, n):
    """Requests that end on a stop token early (the token their greedy or seeded continuation
    reaches first at a random step), mixed with min_tokens, top-k and plain ones."""
    base = [req(p, seed=i, temperature=rng.choice([0.0, 0.9]), max_tokens=rng.randint(2, 30), ignore_eos=True)
            for i, p in enumerate(prompts(n, rng))]
    full = run_all(be, base)
    out = []
    for i, (r, o) in enumerate(zip(base, full)):
        p = r.params
        stop = [o.token_ids[rng.randrange(len(o.token_ids))]] if i % 3 else []
        out.append(req(r.prompt_ids, seed=r.seed, temperature=p.temperature, max_tokens=p.max_tokens,
                       stop_token_ids=stop, min_tokens=2 if i % 5 == 0 else 0, top_k=5 if i % 7 == 0 else 0))
    return out


def test_overlapped_decode_gives_the_synchronous_results(model_dir):
    """Reading a step's stop flags one step late (the GPU overlap) changes no token, logprob or
    finish reason, with rows stopping at every step and being refilled."""
    be = make(model_dir, max_batch_size=8, max_prefill_tokens=24)
    requests = _stopping_requests(be, random.Random(11), 40)
    outs = []
    for overlap in (False, True):
        be.engine.overlap = overlap
        outs.append(run_all(be, requests))
        assert be.engine.num_active == 0
    be.shutdown()
    assert sum(o.finish_reason == "stop" for o in outs[0]) >= 15
    for r, a, b in zip(requests, *outs):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), f"request {r.prompt_ids}"
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert len(b.token_ids) == len(b.logprobs) == len(b.versions)


class _LateEvent:
    """Stands in for the CUDA event of a deferred finish on the CPU: not complete for the first
    ``lag`` queries (a copy still behind the queued decode step)."""

    def __init__(self, lag):
        self.lag = lag

    def query(self):
        self.lag -= 1
        return self.lag < 0

    def synchronize(self):
        self.lag = -1


def _defer_finishes(engine, lag):
    engine.overlap = True
    engine._copy_event = lambda: _LateEvent(lag)


def test_deferred_finishes_give_the_synchronous_results(model_dir):
    """Finished rows whose outputs are handed out steps later (their copies still in flight, as on a
    GPU) change no token, logprob, version or finish reason, with rows stopping at every step."""
    be = make(model_dir, max_batch_size=8, max_prefill_tokens=24)
    requests = _stopping_requests(be, random.Random(11), 40)
    be.engine.overlap = True
    outs = [run_all(be, requests)]
    _defer_finishes(be.engine, lag=2)
    outs.append(run_all(be, requests))
    assert be.engine.num_active == 0 and not be.engine._in_flight and not be.engine.has_work()
    be.shutdown()
    for r, a, b in zip(requests, *outs):
        assert (a.token_ids, a.finish_reason, a.versions) == (b.token_ids, b.finish_reason, b.versions), r.prompt_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_deferred_finishes_come_later_and_abort_and_failure_hand_them_out(model_dir):
    be = make(model_dir, max_batch_size=4)
    engine = be.engine
    _defer_finishes(engine, lag=100)  # never complete on their own
    short = engine.make_sequence(req([5, 9, 7], temperature=0.0, max_tokens=3, ignore_eos=True), 0)
    long = engine.make_sequence(req([6, 6], temperature=0.0, max_tokens=20, ignore_eos=True), 0)
    engine.submit(short)
    engine.submit(long)
    handed = [engine.step() for _ in range(4)]  # the short row finishes in step 3 (its flag read late)
    assert handed == [[], [], [], []] and len(engine._in_flight) == 1 and engine.num_active == 1
    assert engine.has_work()
    done = dict((id(s), o) for s, o in engine.abort_all())  # finished rows end as they did
    assert done[id(short)].finish_reason == "length" and len(done[id(short)].token_ids) == 3
    assert done[id(long)].finish_reason == "abort" and not engine._in_flight
    for max_tokens in (3, 20):
        engine.submit(engine.make_sequence(req([5, 9, 7], temperature=0.0, max_tokens=max_tokens, ignore_eos=True), 0))
    assert [engine.step() for _ in range(4)] == [[], [], [], []] and len(engine._in_flight) == 1
    failed = engine.fail_all("boom")  # the device's state is unknown: so is the copy in flight
    assert [(o.finish_reason, o.error) for _, o in failed] == [("error", "boom")] * 2 and not engine.has_work()
    engine.submit(engine.make_sequence(req([5, 9, 7], temperature=0.0, max_tokens=2, ignore_eos=True), 0))
    # prefill and one decode step end it in step 1; no row runs then, so its copy is waited for at once
    assert [len(engine.step())] == [1] and not engine._in_flight and not engine.has_work()
    be.shutdown()


def test_abort_after_an_unread_stop_reports_the_stop(model_dir):
    """With overlap, a row that sampled its stop token in the last step is finished by the next
    step; aborting before that step reports it as stopped, with its tokens up to the stop."""
    be = make(model_dir, max_batch_size=4)
    tokens = run_all(be, [req([5, 9, 7], temperature=0.0, max_tokens=8, ignore_eos=True)])[0].token_ids
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    engine = be.engine
    assert not engine.overlap  # off on CPU by default
    engine.overlap = True
    stop_at = engine.make_sequence(req([5, 9, 7], temperature=0.0, max_tokens=8, stop_token_ids=[tokens[k]]), 0)
    other = engine.make_sequence(req([6, 6], temperature=0.0, max_tokens=8, ignore_eos=True), 0)
    engine.submit(stop_at)
    engine.submit(other)
    finished = []
    for _ in range(k):  # step 1 prefills (token 0) and decodes token 1; step k decodes token k, its flag unread
        finished += engine.step()
    assert finished == [] and engine.num_active == 2
    done = dict((id(s), o) for s, o in engine.abort_all())
    assert done[id(stop_at)].finish_reason == "stop"
    assert done[id(stop_at)].token_ids == tokens[: k + 1]
    assert done[id(other)].finish_reason == "abort" and len(done[id(other)].token_ids) == k + 1
    be.shutdown()


def test_decode_shape_buckets(model_dir):
    eng = make(model_dir, max_batch_size=100, max_model_len=300).engine
    assert eng.cuda_graphs is None  # CPU: no graphs, exact shapes
    assert eng._decode_shape(33, 129) == (33, 129)
    eng.shape_stable_decode = True
    assert eng._decode_shape(3, 5) == (4, 128)
    assert eng._decode_shape(32, 128) == (32, 128)
    assert eng._decode_shape(33, 129) == (64, 256)
    assert eng._decode_shape(33, 257) == (64, 300)  # 384, capped by max_model_len
    assert eng._decode_shape(97, 290) == (100, 300)  # capped by max_batch_size / max_model_len
    eng.max_batch_size, eng.max_model_len = 512, 8192
    assert eng._decode_shape(512, 321) == (512, 384)
    assert eng._decode_shape(400, 1025) == (416, 1536)
    assert eng._decode_shape(1, 4097) == (1, 8192)


def test_max_model_len_limits(model_dir):
    be = make(model_dir, max_model_len=16)
    assert be.max_model_len == 16
    too_long, exact_fit, capped, ok = run_all(
        be,
        [
            req(list(range(4, 20)), max_tokens=4),  # 16 prompt tokens: no room
            req(list(range(4, 19)), max_tokens=4, ignore_eos=True),  # 15: one token fits
            req(list(range(4, 14)), max_tokens=50, ignore_eos=True),  # 10 + 50 > 16: capped at 6
            req([5, 6], max_tokens=3, ignore_eos=True),
        ],
    )
    assert too_long.finish_reason == "error" and "max_model_len" in too_long.error and not too_long.token_ids
    assert exact_fit.finish_reason == "length" and len(exact_fit.token_ids) == 1
    assert capped.finish_reason == "length" and len(capped.token_ids) == 6
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3
    be.shutdown()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make(model_dir, max_model_len=10_000)
    assert make(model_dir, max_batch_size=2).max_model_len == 512  # min(max_position_embeddings, 4096)


def test_error_requests_and_failed_steps_do_not_kill_the_engine(model_dir):
    be = make(model_dir, max_batch_size=16)
    good = [req([5, 6, 7], temperature=0.0, max_tokens=8), req([9, 10], temperature=0.0, max_tokens=8)]
    bad = [req([5, 999, 7], max_tokens=4), req([], max_tokens=4), req([5, -1], max_tokens=4)]
    alone = run_all(be, good)
    outs = run_all(be, good + bad)
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in alone]
    for o in outs[2:]:
        assert o.finish_reason == "error" and o.error and not o.token_ids
    assert "999" in outs[2].error and "empty" in outs[3].error

    # a step that raises fails the requests in flight with "error", then the engine serves again
    decode = be.engine.model.decode
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return decode(*args, **kwargs)

    be.engine.model.decode = flaky
    failed = run_all(be, [req([5, 6, 7], max_tokens=8, ignore_eos=True), req([9, 10], max_tokens=8, ignore_eos=True)])
    assert all(o.finish_reason == "error" and "injected failure" in o.error for o in failed)
    assert [o.token_ids for o in run_all(be, good)] == [o.token_ids for o in alone]
    be.shutdown()
    after = run_all(be, good)
    assert all(o.finish_reason == "error" and "shut down" in o.error for o in after)


def test_stats_count_and_reset(model_dir):
    be = make(model_dir, max_batch_size=32)
    be.stats()
    ps = [[5, 6, 7], [8, 9]]
    outs = run_all(be, [req(p, max_tokens=5, ignore_eos=True) for p in ps for _ in range(3)])
    s = be.stats()
    assert s["generated_tokens"] == sum(len(o.token_ids) for o in outs) == 30
    assert s["prefill_tokens"] == 5 and s["shared_prefill_tokens"] == 10
    assert s["steps"] >= 4 and s["busy_s"] > 0
    assert s["running"] == 0 and s["waiting"] == 0
    assert "cuda_graph_captures" not in s  # CPU: no graphs
    again = be.stats()
    assert again["generated_tokens"] == 0 and again["steps"] == 0 and again["busy_s"] == 0
    be.shutdown()
