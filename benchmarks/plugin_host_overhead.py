"""rlcli's own host time on an engine plugin's path, on the CPU, with the SGLang plugin over a stand-in
engine that answers every request of a round at one moment (as a GPU-bound round ends):

    python benchmarks/plugin_host_overhead.py --rounds 4

A round sends 512 requests of 64 prompt tokens and gets 256 tokens with logprobs each. Through rlcli
(``backend.generate`` from a caller's event loop, as the agent loop calls it) against the stand-in
engine driven bare (one ``generate_request`` per sequence on the engine thread, backends.py's
``bare_each``), it reports when the last request reached the engine and how long the round ran past
the engine's answer: the host time a real round would add to the GPU's. The heap is frozen first,
as the runner does after its build (``rlcli.runner.setup.freeze_heap``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "plugins" / "rlcli-sglang"), str(REPO / "plugins" / "rlcli-sglang" / "tests")]

N, PROMPT, NEW = 512, 64, 256


def stand_in(backend, hold_s: float) -> dict:
    """Replace the engine's ``generate_request``: every request answers ``hold_s`` after the round
    starts (``state["start"]``) with 256 tokens; ``state["sends"]`` gets each request's arrival."""
    rng = random.Random(0)
    ids = [rng.randrange(3, backend.model_info.vocab_size) for _ in range(NEW)]
    meta = {"finish_reason": {"type": "length", "length": NEW}, "completion_tokens": NEW,
            "output_token_logprobs": [(-rng.random(), t, None) for t in ids]}
    state = {"start": 0.0, "sends": []}

    async def generate_request(obj, request=None):
        state["sends"].append(time.perf_counter())
        await asyncio.sleep(max(0.0, state["start"] + hold_s - time.perf_counter()))
        yield {"output_ids": list(ids), "meta_info": dict(meta, id=getattr(obj, "rid", None))}

    backend._tm.generate_request = generate_request
    return state


def rlcli_round(backend, prompts, state) -> None:
    from rlcli.backends.base import GenerateRequest
    from rlcli.types import SampleParams

    params = SampleParams(max_tokens=NEW, min_tokens=NEW, ignore_eos=True, temperature=1.0)

    async def once():
        reqs = [GenerateRequest(p, params) for p in prompts]
        state["start"] = time.perf_counter()
        outs = await asyncio.gather(*(backend.generate(r) for r in reqs))
        if any(len(o.token_ids) != NEW for o in outs):
            raise RuntimeError(f"a response is not {NEW} tokens: {outs[0]}")

    asyncio.run(once())


def bare_round(backend, prompts, state) -> None:
    async def once():
        async def one(p):
            obj = type("Req", (), {"rid": "bare", "input_ids": p})()
            async for out in backend._tm.generate_request(obj):
                return out["meta_info"]["completion_tokens"]

        await asyncio.gather(*(one(p) for p in prompts))

    state["start"] = time.perf_counter()
    backend._loop.call(once())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hold-s", type=float, default=0.5, help="when the stand-in engine answers, after the round starts")
    args = ap.parse_args()
    from fake_sglang import FakeSGLangBackend, context

    from rlcli.models import tiny_model_dir
    from rlcli.runner.setup import freeze_heap, thaw_heap

    model = tiny_model_dir(Path(tempfile.mkdtemp()) / "qwen2", arch="qwen2", seed=0)
    backend = FakeSGLangBackend(FakeSGLangBackend.Config(max_batch_size=N), context(model, eos=2))
    try:
        state = stand_in(backend, args.hold_s)
        rng = random.Random(1)
        prompts = [[rng.randrange(3, backend.model_info.vocab_size) for _ in range(PROMPT)] for _ in range(N)]
        freeze_heap()
        print("| round | path | last request at the engine (ms) | past the engine's answer (ms) |")
        print("| --- | --- | --- | --- |")
        for i in range(1 + args.rounds):  # the first round of each path warms up
            for name, run in (("rlcli", rlcli_round), ("bare_each", bare_round)):
                state["sends"] = []
                run(backend, prompts, state)
                end = time.perf_counter()
                last = max(state["sends"]) - state["start"]
                if i:
                    print(f"| {i} | {name} | {1e3 * last:.1f} | {1e3 * (end - state['start'] - args.hold_s):.1f} |")
    finally:
        backend.shutdown()
        thaw_heap()


if __name__ == "__main__":
    main()
