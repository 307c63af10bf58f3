"""The warm start of the learning race (``python benchmarks/learning_race.py warmstart``): the task files,
the tokenizer trained on train-split text, and a randomly initialised Qwen2 trained supervised on
train-split problems until its stopping rule (:class:`SFTStopper`), saved with ``warmstart.json``
in ``<work>/warmstart``."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from race_model import bf16_autocast, encode_sft, greedy_accuracy, model_config, write_generation_config
from race_task import SIZES, Size, draw_pair_train, draw_pairs, prompt_text, rl_row, solution, write_jsonl
from race_tokenizer import EOS, check_prompt_ids, check_tokenizer, train_tokenizer


def seed_all(seed: int) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
        torch.use_deterministic_algorithms(True, warn_only=True)  # rebuildable from the seed


def write_task_files(out: Path, size: Size, seed: int) -> dict[str, list[dict]]:
    """``train.jsonl`` (RL prompts, train split), ``valid.jsonl`` and ``heldout.jsonl`` (held-out
    split, disjoint from each other)."""
    rng = random.Random(f"race-files-{seed}")
    heldout = draw_pairs(rng, size.n_heldout + size.n_valid, size.max_digits, heldout=True)
    files = {"train": [rl_row(*p) for p in draw_pairs(rng, size.n_rl_train, size.max_digits, heldout=False)],
             "heldout": [rl_row(*p) for p in heldout[:size.n_heldout]],
             "valid": [rl_row(*p) for p in heldout[size.n_heldout:]]}
    for name, rows in files.items():
        write_jsonl(out / f"{name}.jsonl", rows)
    return files


def build_tokenizer_and_model(out: Path, size: Size, seed: int):
    """Train the tokenizer on train-split texts, check it, and build the random-init model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(f"race-bpe-{seed}")
    pairs = draw_pairs(rng, 4000, size.max_digits, heldout=False)
    texts = [prompt_text(a, b) + solution(a, b) + EOS + "\n" for a, b in pairs]
    train_tokenizer(out, texts, size.bpe_vocab)
    check_texts = [prompt_text(a, b) for a, b in pairs[:200]] + [solution(a, b) for a, b in pairs[:200]]
    tok_facts = check_tokenizer(out, check_texts)
    tok = AutoTokenizer.from_pretrained(str(out))
    check_prompt_ids(tok, [rl_row(a, b) for a, b in pairs[:32]])
    longest = max(solution(10**d - 1, 10**d - 1) for d in range(1, size.max_digits + 1))
    need = len(tok(longest, add_special_tokens=False)["input_ids"]) + 1
    assert need <= size.max_new_tokens, f"the longest answer takes {need} tokens > max_new_tokens {size.max_new_tokens}"
    # vocab_size == the tokenizer's size: no embedding row an engine could sample but not detokenize
    cfg = model_config(size, len(tok), tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return tok, model, tok_facts


class SFTStopper:
    """The warm start's stopping rule, on validation greedy accuracy (held-out split, not the RL
    evaluation set): stop at the first evaluation >= ``stop_at``; if that overshoots ``band_hi``,
    keep whichever of it and the previous evaluation's snapshot is nearer the band's middle."""

    def __init__(self, stop_at: float, band: tuple[float, float]):
        self.stop_at, self.band = stop_at, band
        self.prev: tuple[int, float, dict] | None = None  # (step, accuracy, CPU state dict)

    def check(self, step: int, acc: float, model) -> tuple[bool, tuple[int, float, dict] | None]:
        """``(stop, chosen snapshot or None for the current weights)``."""
        if acc < self.stop_at:
            self.prev = (step, acc, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
            return False, None
        mid = sum(self.band) / 2
        if acc > self.band[1] and self.prev is not None and abs(self.prev[1] - mid) < abs(acc - mid):
            return True, self.prev
        return True, None


def sft(model, tok, size: Size, files: dict, args, device) -> dict[str, Any]:
    """Supervised training on train-split problems until the stopping rule or the time budget;
    returns the log of the run (the model holds the chosen weights)."""
    rng = random.Random(f"race-sft-{args.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=size.sft_lr, weight_decay=0.0, betas=(0.9, 0.95))
    stopper, t0, step = SFTStopper(args.stop_at, (args.band_lo, args.band_hi)), time.perf_counter(), 0
    curve: list[dict] = []
    valid_every, reason, acc = size.sft_eval_every, "time budget", None
    model.train()
    while True:
        if args.sft_steps is not None and step >= args.sft_steps:
            reason = "--sft-steps"
            break
        if args.sft_steps is None and time.perf_counter() - t0 > args.sft_seconds:
            break
        step += 1
        for g in opt.param_groups:  # linear warm-up over 50 steps, then constant
            g["lr"] = size.sft_lr * min(1.0, step / 50)
        ids, mask, labels = encode_sft(tok, [draw_pair_train(rng, size) for _ in range(size.sft_batch)], device)
        with bf16_autocast(device):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.sft_steps is None and step % valid_every == 0:
            acc = greedy_accuracy(model, tok, files["valid"], size.max_new_tokens)
            curve.append({"step": step, "seconds": round(time.perf_counter() - t0, 1), "loss": round(loss.item(), 4),
                          "valid_accuracy": acc})
            print(f"[sft] step {step} loss {loss.item():.4f} valid acc {acc:.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
            stop, snapshot = stopper.check(step, acc, model)
            if stop:
                reason = "accuracy reached --stop-at"
                if snapshot is not None:
                    step, acc = snapshot[0], snapshot[1]
                    model.load_state_dict(snapshot[2])
                    reason += f" (overshot {args.band_hi}: kept the snapshot of step {step})"
                break
            if acc >= args.stop_at / 2:  # closing in: look twice as often
                valid_every = max(5, size.sft_eval_every // 2)
    return {"sft_steps": step, "sft_seconds": round(time.perf_counter() - t0, 1), "stop_reason": reason,
            "valid_accuracy": acc, "curve": curve, "final_loss": round(loss.item(), 4) if step else None}


def warmstart(args) -> dict[str, Any]:
    """Build the warm-start model directory ``args.work/warmstart`` and its ``warmstart.json``."""
    from transformers import AutoModelForCausalLM

    t_start = time.perf_counter()
    size = SIZES[args.size]
    out = Path(args.work) / "warmstart"
    out.mkdir(parents=True, exist_ok=True)
    seed_all(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    files = write_task_files(out, size, args.seed)
    tok, model, tok_facts = build_tokenizer_and_model(out, size, args.seed)
    model.to(device)
    log = sft(model, tok, size, files, args, device)
    save_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to(save_dtype).save_pretrained(str(out))
    write_generation_config(out, tok.eos_token_id, tok.pad_token_id)
    del model
    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=save_dtype).to(device)
    heldout_acc = greedy_accuracy(saved, tok, files["heldout"], size.max_new_tokens)
    params = sum(p.numel() for p in saved.parameters())
    info = {"size": args.size, "shape": asdict(size), "seed": args.seed, "params": params, "dtype": str(save_dtype),
            "heldout_accuracy": heldout_acc, "heldout_n": len(files["heldout"]), "device": str(device),
            "in_band": args.band_lo <= heldout_acc <= args.band_hi, "band": [args.band_lo, args.band_hi],
            "stop_at": args.stop_at, "tokenizer": tok_facts, "total_seconds": round(time.perf_counter() - t_start, 1),
            "rebuild": f"python benchmarks/learning_race.py warmstart --size {args.size} --seed {args.seed} "
                       f"--sft-steps {log['sft_steps']} --work {args.work}",
            "pid": os.getpid(), **log}
    (out / "warmstart.json").write_text(json.dumps(info, indent=1))
    print(f"[warmstart] {params / 1e6:.1f}M params, {log['sft_steps']} SFT steps in {log['sft_seconds']}s, "
          f"held-out greedy accuracy {heldout_acc:.3f} ({log['stop_reason']})", flush=True)
    return info
