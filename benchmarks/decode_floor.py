"""The embedded engine's decode step, timed at each (rows, context) of a grid, on one GPU.

    python benchmarks/decode_floor.py --shape 0.5b --model-cache /tmp/rlcli-sweep-models
    python benchmarks/decode_floor.py --shape 0.5b --rows 8,64,512 --context 128,1024 --profile results/
    python benchmarks/decode_floor.py --tiny                              # CPU: checks the script, measures nothing

Why: the sweep's long-tailed rollouts take about 2 ms a decode step at 0.5B on average over a
batch that tapers from 512 rows to a few (1,023 steps in 2.1 s), against 2.35 ms a step for 512
rows of full length. Fitting ``a + b * rows`` to those two figures (an estimate, which ignores the
long tail's longer contexts) gives a floor ``a`` near 1.9 ms that does not shrink with the batch,
where reading the weights once takes 0.2 ms. This script measures the step directly: the GRPO-step model of
``grpo_step.py`` (``--shape``) in the embedded backend with the settings of a run on CUDA
(compiled decode layers and sampler, CUDA graphs, Triton attention; ``--set`` changes the
rollout config), fed ``rows`` sequences whose prompts are ``context`` tokens long, each decoding
``--steps`` tokens with EOS ignored; with ``--taper MEAN`` also rounds whose rows end at
geometric lengths of that mean (rows finish along the way, as in the long tail, where a
finishing row's outputs are copied to the host). The scheduler is driven on this thread
(``engine.step()``): one round captures the graphs of the shape, a second is timed, and the first
step of each round (admission and prefill) is left out. Reported per point: milliseconds a
decode step, and the weight bytes read a step against that time (GB/s), the floor a
memory-bound step could reach. ``--profile DIR`` adds a torch.profiler kernel table of 19
decode steps at the smallest rows and the longest context (``profiles.txt``): the
round's first step (admission and prefill) runs before the profiler starts, so the table's self
CPU and self CUDA totals compare the host's and the GPU's time of decode steps alone.

Output: one ``RESULT {json}`` line per point; ``--out DIR`` also gets ``decode-floor.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import grpo_step as gs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.5b", choices=[k for k in gs.SHAPES if k != "tiny"])
    ap.add_argument("--model-cache", type=Path, default=None, help="as grpo_step.py's (reuses its model)")
    ap.add_argument("--rows", default="1,8,32,128,512", help="comma-separated row counts")
    ap.add_argument("--context", default="128,512,1024", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps a round (the longest row's)")
    ap.add_argument("--taper", type=float, default=None, metavar="MEAN",
                    help="also time rounds whose rows end at geometric lengths of this mean, cut at --steps "
                         "(rows finish along the way, as in the long tail)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an embedded rollout setting (dotted keys, YAML values), e.g. cuda_graphs=false")
    ap.add_argument("--profile", type=Path, help="write a kernel table of 19 decode steps here (no prefill)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script")
    return ap.parse_args(argv)


def build_backend(args: argparse.Namespace, max_rows: int, max_len: int):
    """The shape's model directory (built or reused) and an embedded backend on it."""
    import grpo_step as gs

    from rlcli.backends.base import BackendContext
    from rlcli.backends.embedded import EmbeddedBackend
    from rlcli.overrides import apply_overrides

    gs.use_shape(args.shape, tiny=args.tiny)
    model_dir = gs.prepare_model(Path(tempfile.mkdtemp(prefix="decode-floor-")), args.model_cache)
    v = gs.SHAPE["vocab"]
    ctx = BackendContext(model_dir=str(model_dir), device=torch.device(gs.DEVICE), dtype=gs.DTYPE,
                         eos_token_ids=[v - 1], seed=0)
    conf = apply_overrides({"max_batch_size": max_rows, "max_model_len": max_len}, list(args.set))
    return EmbeddedBackend(EmbeddedBackend.Config(**conf), ctx), v


def lengths_of(rows: int, steps: int, taper: float | None, seed: int) -> list[int]:
    """Each row's new tokens: ``steps`` for all, or (``taper``) geometric with that mean, cut at
    ``steps`` (as the sweep's long tail, without EOS: rows then finish at every length)."""
    if taper is None:
        return [steps] * rows
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / taper
    u = torch.rand(rows, generator=g, dtype=torch.float64).clamp_min(1e-12)
    drawn = (torch.log(u) / torch.log1p(torch.tensor(-p, dtype=torch.float64))).ceil().long().clamp(1, steps)
    return drawn.tolist()


def one_round(engine, rows: int, context: int, steps: int, vocab: int, seed: int,
              taper: float | None = None, around_decode=contextlib.nullcontext) -> tuple[float, int]:
    """Seconds and number of the round's decode steps after its first (admission + prefill);
    ``around_decode()`` is entered for those steps alone (the profiler, so that its table holds no
    prefill)."""
    from rlcli.backends.base import GenerateRequest
    from rlcli.types import SampleParams

    g = torch.Generator().manual_seed(seed)
    for i, n in enumerate(lengths_of(rows, steps, taper, seed)):
        params = SampleParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0)
        prompt = torch.randint(0, vocab - 3, (context,), generator=g).tolist()
        engine.submit(engine.make_sequence(GenerateRequest(prompt_ids=prompt, params=params, seed=i), seed))
    engine.step()  # admission, prefill and the first token
    sync()
    with around_decode():
        t, n = time.perf_counter(), 0
        while engine.has_work():
            engine.step()
            n += 1
        sync()
        secs = time.perf_counter() - t
    return secs, n


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def weight_bytes(engine) -> int:
    """Bytes of the decode model's parameters (each read once a step; a tied or fused weight is
    counted once: the Hugging Face parameters are views into the fused matrices)."""
    spans = {}
    for p in engine.model.hf.parameters():
        storage = p.untyped_storage()
        spans[storage.data_ptr()] = storage.nbytes()
    return sum(spans.values())


def measure(args: argparse.Namespace) -> list[dict]:
    import grpo_step as gs

    rows_grid = [int(r) for r in args.rows.split(",")]
    ctx_grid = [int(c) for c in args.context.split(",")]
    if args.tiny:
        rows_grid, ctx_grid, args.steps = [1, 4], [8, 16], 4
        args.taper = 2.0 if args.taper is not None else None
    backend, vocab = build_backend(args, max(rows_grid), max(ctx_grid) + args.steps + 8)
    engine = backend.engine
    wbytes = weight_bytes(engine)
    out = []
    for context in ctx_grid:
        for rows in rows_grid:
            one_round(engine, rows, context, args.steps, vocab, seed=1)  # graphs, compilation, allocator
            secs, n = one_round(engine, rows, context, args.steps, vocab, seed=2)
            ms = 1e3 * secs / max(n, 1)
            out.append(gs.result(what="decode_floor", rows=rows, context=context, decode_steps=n,
                                 ms_per_step=round(ms, 4), weight_gb=round(wbytes / 1e9, 3),
                                 weight_gb_per_s=round(wbytes / 1e9 / (ms / 1e3), 3) if ms > 0 else None,
                                 settings=list(args.set)))
            if args.taper is not None:
                one_round(engine, rows, context, args.steps, vocab, seed=1, taper=args.taper)
                secs, n = one_round(engine, rows, context, args.steps, vocab, seed=2, taper=args.taper)
                active = sum(lengths_of(rows, args.steps, args.taper, 2)) / max(n + 1, 1)
                out.append(gs.result(what="decode_floor_taper", rows=rows, context=context, decode_steps=n,
                                     mean_tokens=args.taper, mean_active_rows=round(active, 1),
                                     ms_per_step=round(1e3 * secs / max(n, 1), 4), settings=list(args.set)))
    if args.profile is not None:
        gs.PROFILE_DIR, gs.PROFILE_WHAT = args.profile, "all"
        args.profile.mkdir(parents=True, exist_ok=True)
        one_round(engine, min(rows_grid), max(ctx_grid), min(args.steps, 20), vocab, seed=3,
                  around_decode=lambda: gs.profiled(f"decode-floor-{args.shape}"))
    backend.shutdown()
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = measure(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode-floor.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
