"""The model of the learning race (``benchmarks/learning_race.py``): its Qwen2 and generation configs,
the supervised batches of the warm start, and held-out greedy accuracy (the warm start's stopping
rule and the TRL runs' evaluation)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from race_task import Size, judge, prompt_text, solution


def model_config(size: Size, vocab: int, eos_id: int, pad_id: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                       num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                       intermediate_size=size.inter, head_dim=size.hidden // size.heads,
                       max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
                       bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, use_sliding_window=False)


def write_generation_config(model_dir: Path, eos_id: int, pad_id: int) -> None:
    """EOS and pad ids, and sampling from the full distribution for anyone who samples with defaults
    (transformers' global default is top_k=50; vLLM reads these as its default sampling params)."""
    (model_dir / "generation_config.json").write_text(json.dumps({
        "eos_token_id": eos_id, "pad_token_id": pad_id, "bos_token_id": None, "do_sample": True,
        "temperature": 1.0, "top_p": 1.0, "top_k": 0}, indent=1))


def encode_sft(tok, pairs: list[tuple[int, int]], device) -> tuple[torch.Tensor, ...]:
    """Right-padded ``prompt + answer + EOS``; labels only on the answer and EOS."""
    prompts = tok([prompt_text(a, b) for a, b in pairs], add_special_tokens=False)["input_ids"]
    answers = tok([solution(a, b) for a, b in pairs], add_special_tokens=False)["input_ids"]
    width = max(len(p) + len(r) + 1 for p, r in zip(prompts, answers))
    ids = torch.full((len(pairs), width), tok.pad_token_id, dtype=torch.long)
    lab = torch.full((len(pairs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, answers)):
        row = torch.tensor(p + r + [tok.eos_token_id])
        ids[i, :len(row)], mask[i, :len(row)], lab[i, len(p):len(row)] = row, 1, row[len(p):]
    return ids.to(device), mask.to(device), lab.to(device)


@torch.no_grad()
def greedy_texts(model, tok, prompts: list[str], max_new_tokens: int, batch_size: int = 256) -> list[str]:
    """Greedy responses (transformers ``generate``, left padding, stop at EOS), decoded without
    special tokens as rlcli's agent loop and TRL decode them."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    was_training, side = model.training, tok.padding_side
    model.eval()
    tok.padding_side = "left"
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            enc = tok(prompts[i:i + batch_size], add_special_tokens=False, return_tensors="pt", padding=True)
            enc = {k: v.to(device) for k, v in enc.items()}
            seqs = model.generate(**enc, generation_config=gen)
            out += tok.batch_decode(seqs[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tok.padding_side = side
        model.train(was_training)
    return out


def bf16_autocast(device: torch.device):
    """bf16 compute over fp32 weights on GPU (how both frameworks train); nothing on CPU."""
    on_gpu = device.type == "cuda"
    return torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)


def greedy_accuracy(model, tok, rows: list[dict], max_new_tokens: int) -> float:
    """Fraction of ``rows`` (RL JSONL rows) whose greedy response the gsm8k judger scores positive."""
    prompts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    device = next(model.parameters()).device
    with bf16_autocast(device):
        texts = greedy_texts(model, tok, prompts, max_new_tokens)
    return sum(judge(t, r["reward_model"]["ground_truth"]) > 0 for t, r in zip(texts, rows)) / max(1, len(rows))
