"""rlcli.lockstep (the loop is settled: no ready callback, no tracked off-loop work) and the
embedded engine in lockstep (arrivals admitted in their own order; the backend's switch)."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from rlcli.backends.base import GenerateRequest
from rlcli.lockstep import settled, track
from rlcli.types import SampleParams


def test_settled_waits_for_chains_of_ready_callbacks():
    async def main():
        loop = asyncio.get_running_loop()
        seen = []

        def chain(n):  # each callback schedules the next, as resumed coroutines do
            seen.append(n)
            if n < 50:
                loop.call_soon(chain, n + 1)

        loop.call_soon(chain, 0)
        await settled()
        return seen

    assert asyncio.run(main()) == list(range(51))


def test_settled_waits_for_tracked_work_off_the_loop_and_what_follows_it():
    async def main():
        loop = asyncio.get_running_loop()
        fut = track(loop.create_future())
        order = []

        def worker():
            time.sleep(0.05)
            loop.call_soon_threadsafe(fut.set_result, "judged")

        async def waiter():
            order.append(await fut)
            await asyncio.sleep(0)  # work that follows the answer, on the loop
            order.append("after")

        task = asyncio.ensure_future(waiter())
        threading.Thread(target=worker).start()
        await settled()
        order.append("settled")
        await task
        return order

    assert asyncio.run(main()) == ["judged", "after", "settled"]


def test_a_cancelled_tracked_future_is_no_longer_waited_for():
    async def main():
        fut = track(asyncio.get_running_loop().create_future())
        fut.cancel()
        await asyncio.wait_for(settled(), 5)

    asyncio.run(main())


def test_settled_does_not_wait_for_timers():
    async def main():
        sleeper = asyncio.ensure_future(asyncio.sleep(30))  # a timeout somewhere: not work to wait for
        await asyncio.wait_for(settled(), 5)
        sleeper.cancel()

    asyncio.run(main())


def test_settled_waits_for_text_decoded_in_the_background(monkeypatch):
    """The decode batcher's background chunks are tracked; what it decodes on the loop's thread is a
    ready callback. Either way a settled loop has every text."""
    import rlcli.tokenizer as T

    tok = T.builtin_tokenizer("arith")
    real = T.DecodeBatcher._decode_in_background

    def slow(self, loop, batch):
        time.sleep(0.05)  # the background thread is slower than the loop
        real(self, loop, batch)

    monkeypatch.setattr(T.DecodeBatcher, "_decode_in_background", slow)
    batcher = T.DecodeBatcher(tok, chunk=4)
    seqs = [tok.encode(f"{i}*{i}={i * i}") for i in range(10)]  # two chunks in the background, two on the loop

    async def main():
        texts = {}

        async def one(i):
            texts[i] = await batcher.decode(seqs[i])

        tasks = [asyncio.ensure_future(one(i)) for i in range(10)]
        await asyncio.sleep(0)  # the tasks queue their ids
        await settled()
        done = sorted(texts)
        await asyncio.gather(*tasks)
        return done

    assert asyncio.run(main()) == list(range(10))


def _engine(tmp_path):
    from rlcli.backends.embedded.engine import EmbeddedEngine
    from rlcli.backends.embedded.model import LlamaFamilyModel
    from rlcli.models import tiny_model_dir
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path / "m"), dtype=torch.float32).eval()
    hf.requires_grad_(False)
    return EmbeddedEngine(LlamaFamilyModel(hf), max_batch_size=2, max_model_len=64, max_prefill_tokens=4096,
                          eos_token_ids=[])


def test_engine_in_lockstep_admits_what_arrived_together_in_its_own_order(tmp_path):
    """Two slots, four requests submitted in two different orders: in lockstep the same two are
    admitted first (request id order) and every response is the same; without lockstep the
    submission order decides."""
    params = SampleParams(max_tokens=3, min_tokens=3, temperature=1.0)

    def admitted_first(order, lockstep):
        eng = _engine(tmp_path)
        eng.lockstep = lockstep
        seqs = {}
        for rid in order:
            seqs[rid] = eng.make_sequence(GenerateRequest([5, 6, 7], params, request_id=rid, seed=rid), 0)
            eng.submit(seqs[rid])
        outs = {}
        eng.step()
        first = sorted(rid for rid, s in seqs.items() if s.row is not None)
        while eng.has_work():
            for seq, out in eng.step():
                outs[seq.request.request_id] = out.token_ids
        return first, outs

    a, outs_a = admitted_first([3, 1, 0, 2], lockstep=True)
    b, outs_b = admitted_first([2, 0, 1, 3], lockstep=True)
    assert a == b == [0, 1] and outs_a == outs_b
    assert admitted_first([3, 1, 0, 2], lockstep=False)[0] == [1, 3]  # first come, first served


def test_backend_takes_lockstep_from_the_run_unless_its_config_says(tmp_path):
    from rlcli.backends.embedded import EmbeddedBackend
    from rlcli.models import tiny_model_dir
    from rlcli.testing.engine_plugins import cpu_context

    d = tiny_model_dir(tmp_path / "m")
    for configured, wanted, expected in ((None, True, True), (None, False, False), (False, True, False),
                                         (True, False, True)):
        be = EmbeddedBackend(EmbeddedBackend.Config(lockstep=configured), cpu_context(d))
        try:
            be.use_lockstep(wanted)
            assert be.engine.lockstep is expected, (configured, wanted)
        finally:
            be.shutdown()


def test_the_colocated_runner_turns_lockstep_on_unless_the_recipe_says(repo, tmp_path):
    import yaml

    from rlcli.config import validate_recipe
    from rlcli.runner.colocate import ColocateRunner

    def engine_lockstep(strategy: str, *overrides: str) -> bool:
        raw = yaml.safe_load((repo / "recipes" / "quickstart.yaml").read_text())
        raw["trainer"].update(total_train_steps=1, enable_evaluate=False, checkpoint_interval=-1, auto_resume=False,
                              train_batch_size=4, work_dir=str(tmp_path / strategy / "-".join(overrides or ["w"])))
        raw["tasks"][0]["produce_strategy"] = {"name": strategy}
        if strategy == "async":
            raw["replay_buffer"] = {"name": "async"}
        for kv in overrides:
            key, value = kv.split("=")
            raw["rollout"][key] = yaml.safe_load(value)
        runner = ColocateRunner(validate_recipe(raw, base_dir=repo / "recipes"), quiet=True)
        try:
            return runner.backend.engine.lockstep
        finally:
            runner.close()

    assert engine_lockstep("async") is True
    assert engine_lockstep("sync") is True  # multi-turn continuations and dynamic sampling need it too
    assert engine_lockstep("async", "lockstep=false") is False  # the recipe's word wins
    assert engine_lockstep("sync", "lockstep=false") is False
