"""Bare vLLM throughput on the GRPO-step work under each sampling setting an RL framework asks for.

    python benchmarks/vllm_sampling.py --shape 0.5b                 # GPU machine with vLLM 0.26
    python benchmarks/vllm_sampling.py --shape 0.5b --model-cache /tmp/rlcli-sweep-models

The work of ``grpo_step.py`` (its random-init Qwen2.5 shape, 512 sequences of 64 prompt tokens, 256
forced new tokens, temperature 1; here the 512 prompts are all distinct, where the step has 64
prompts x 8 copies: with 64-token prompts the prefill is a small part), driven through ``vllm.LLM.generate``
with no tokenizer (``skip_tokenizer_init``, ``detokenize=False``), ``max_num_seqs`` 512 (one wave),
``gpu_memory_utilization`` 0.3, otherwise vLLM's defaults (CUDA graphs, torch.compile, async
scheduling). Each setting runs once on 64 sequences as a warm-up, then once timed on all 512:

  plain          temperature 1
  logprobs       + the sampled token's logprob (``logprobs=0``: what TRL + vLLM and rlcli ask)
  logprobs-flat  + ``flat_logprobs=True`` (the rlcli-vllm plugin's setting)
  seeded         + a per-request seed (rlcli-vllm's default ``use_request_seeds``)
  seeded-logprobs-flat  the rlcli-vllm plugin's whole request
  greedy         temperature 0

It tells how much of vLLM's rollout time in the GRPO step is the engine's own sampling path (the
gap to the embedded engine that is not in rlcli). Output: one ``RESULT {json}`` line per setting,
and ``--out DIR/vllm-sampling.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SETTINGS = {
    "plain": {},
    "logprobs": {"logprobs": 0},
    "logprobs-flat": {"logprobs": 0, "flat_logprobs": True},
    "seeded": {"seed": 1},
    "seeded-logprobs-flat": {"seed": 1, "logprobs": 0, "flat_logprobs": True},
    "greedy": {"temperature": 0.0},
}


def main() -> None:
    import grpo_step as gs

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b", choices=[k for k in gs.SHAPES if k != "tiny"])
    ap.add_argument("--model-cache", type=Path, default=None, help="as grpo_step.py's (reuses its model)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    gs.use_shape(args.shape)
    model_dir = gs.prepare_model(Path(tempfile.mkdtemp(prefix="vllm-sampling-")), args.model_cache)
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, max_num_seqs=gs.PROMPTS * gs.K,
              gpu_memory_utilization=0.3, max_model_len=gs.PROMPT_LEN + gs.NEW, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, gs.SHAPE["vocab"] - 3, (gs.PROMPT_LEN,),
                                                           generator=g).tolist())
               for _ in range(gs.PROMPTS) for _ in range(gs.K)]
    rows = []
    for name in args.settings.split(","):
        kw = {"temperature": 1.0, **SETTINGS[name]}
        sp = SamplingParams(max_tokens=gs.NEW, min_tokens=gs.NEW, ignore_eos=True, detokenize=False, **kw)
        llm.generate(prompts[:gs.PROMPTS], sp, use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in out)
        row = {"shape": args.shape, "setting": name, "sampling": kw, "tokens": n, "seconds": round(dt, 3),
               "tok_per_s": round(n / dt)}
        rows.append(row)
        print("RESULT " + json.dumps(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        import vllm

        (args.out / "vllm-sampling.json").write_text(json.dumps(
            {"vllm": vllm.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
