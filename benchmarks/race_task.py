"""The task, tokenizer, model and warm start of ``benchmarks/learning_race.py``.

Task: multi-digit addition with the carries written out, one clause per column, then the answer::

    user:      What is 4857+968?
    assistant: 7+8=15, write 5 carry 1. 5+6+1=12, write 2 carry 1. 8+9+1=18, write 8 carry 1.
               4+0+1=5, write 5. #### 5825<|im_end|>

Each operand has 1..``max_digits`` digits (the digit count drawn uniformly), so answers run from
about 13 to 13 x (max_digits + 1) tokens. The judge is rlcli's own ``gsm8k`` judger (the last
``#### <number>``, compared as a number), for every framework.

Splits are disjoint by construction: the unordered operand pair is hashed (SHA-256, so the split is
the same in every process), and one pair in ``HELDOUT_MOD`` is held out. Supervised warm-up and RL
train only on train pairs; the held-out pairs feed two files, ``valid.jsonl`` (the warm start's
stopping rule) and ``heldout.jsonl`` (the RL runs' evaluation, never seen by any training).

Tokenizer: a byte-level BPE trained here with the ``tokenizers`` library, with exactly the
normaliser and pre-tokeniser that transformers' ``Qwen2Tokenizer`` builds (digits split one by one),
saved as ``vocab.json`` + ``merges.txt`` + ``tokenizer.json`` with ``tokenizer_class: Qwen2Tokenizer``,
a Qwen-style chat template and ``<|im_end|>`` as EOS; :func:`check_tokenizer` asserts that
``AutoTokenizer``, ``PreTrainedTokenizerFast`` and the trained tokenizer give identical, non-empty ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, EOS
PAD, EOS = "<|endoftext|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# transformers' Qwen2Tokenizer pre-tokeniser (models/qwen2/tokenization_qwen2.py): training the merges
# with the same split makes the trained tokenizer and AutoTokenizer's rebuild of it agree.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
HELDOUT_MOD = 10
DATA_SOURCE = "race/addition"


@dataclass(frozen=True)
class Size:
    """A model shape plus the task and warm-start settings that go with it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    max_digits: int  # operand digits: 1..max_digits
    max_new_tokens: int  # response budget, SFT answers included (the longest answer fits)
    sft_lr: float
    sft_batch: int
    sft_eval_every: int  # optimizer steps between validation evaluations
    n_valid: int  # held-out problems for the warm start's stopping rule
    n_heldout: int  # held-out problems of the RL evaluation (N)
    n_rl_train: int  # train-split prompts of the RL runs
    bpe_vocab: int


SIZES = {
    # CPU smoke test: checks the code paths, measures nothing
    "tiny": Size(hidden=64, layers=2, heads=4, kv_heads=2, inter=128, max_digits=2, max_new_tokens=48,
                 sft_lr=3e-3, sft_batch=32, sft_eval_every=20, n_valid=16, n_heldout=16, n_rl_train=64,
                 bpe_vocab=320),
    # the GPU model: ~76M parameters (12 x 768, GQA 12/4 heads, head dim 64)
    "small": Size(hidden=768, layers=12, heads=12, kv_heads=4, inter=2048, max_digits=5, max_new_tokens=112,
                  sft_lr=5e-4, sft_batch=128, sft_eval_every=25, n_valid=256, n_heldout=256, n_rl_train=8192,
                  bpe_vocab=384),
}


# ------------------------------------------------------------------------------------------ task
def question(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def solution(a: int, b: int) -> str:
    """The worked answer: one clause per column from the right, then ``#### a+b``."""
    ra, rb = str(a)[::-1], str(b)[::-1]
    parts, carry = [], 0
    for i in range(max(len(ra), len(rb))):
        x = int(ra[i]) if i < len(ra) else 0
        y = int(rb[i]) if i < len(rb) else 0
        s = x + y + carry
        lhs = f"{x}+{y}+{carry}" if carry else f"{x}+{y}"
        carry = s // 10
        parts.append(f"{lhs}={s}, write {s % 10}" + (" carry 1." if carry else "."))
    if carry:
        parts.append("write the final carry 1.")
    return " ".join(parts) + f" #### {a + b}"


def is_heldout(a: int, b: int) -> bool:
    """One unordered operand pair in HELDOUT_MOD is held out (the same answer in every process)."""
    key = f"{min(a, b)}+{max(a, b)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % HELDOUT_MOD == 0


def draw_pair(rng: random.Random, max_digits: int) -> tuple[int, int]:
    def operand() -> int:
        d = rng.randint(1, max_digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)

    return operand(), operand()


def draw_pairs(rng: random.Random, n: int, max_digits: int, heldout: bool,
               exclude: set | None = None) -> list[tuple[int, int]]:
    """``n`` distinct pairs of one split (``heldout``), none in ``exclude``."""
    seen = set(exclude or ())
    out: list[tuple[int, int]] = []
    for _ in range(1000 * n + 1000):
        if len(out) == n:
            return out
        p = draw_pair(rng, max_digits)
        if is_heldout(*p) == heldout and p not in seen:
            seen.add(p)
            out.append(p)
    raise RuntimeError(f"could not draw {n} distinct {'held-out' if heldout else 'train'} pairs "
                       f"with {max_digits} digits")


def rl_row(a: int, b: int) -> dict[str, Any]:
    """One RL JSONL row (rlcli's ``jsonl`` sampler format; TRL reads the same file)."""
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": question(a, b)}],
            "reward_model": {"ground_truth": str(a + b)}, "extra_info": {"a": a, "b": b}}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def judge(text: str, label: str) -> float:
    """rlcli's ``gsm8k`` judger with its defaults: the score every framework's reward and eval use."""
    from rlcli.judgers.gsm8k import GSM8KJudger

    return float(GSM8KJudger(GSM8KJudger.Config()).judge(text, label, None)["score"])


# ------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(out_dir: Path, texts: list[str], vocab_size: int) -> None:
    """Train the byte-level BPE on ``texts`` and save it for ``AutoTokenizer`` (Qwen2Tokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tk.model.save(str(out_dir))  # vocab.json + merges.txt: what Qwen2Tokenizer is built from
    tk.save(str(out_dir / "tokenizer.json"))  # what PreTrainedTokenizerFast reads
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "bos_token": None, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}, indent=1))


def check_tokenizer(model_dir: Path, texts: list[str]) -> dict[str, Any]:
    """Assert that AutoTokenizer, PreTrainedTokenizerFast and the trained file give the same
    non-empty ids for ``texts`` and round-trip them; returns the facts recorded in warmstart.json."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    auto = AutoTokenizer.from_pretrained(str(model_dir))
    fast = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for t in texts:
        a = auto(t, add_special_tokens=False)["input_ids"]
        f = fast(t, add_special_tokens=False)["input_ids"]
        r = raw.encode(t, add_special_tokens=False).ids
        assert a and a == f == r, f"tokenizers disagree on {t!r}: auto {a[:12]} fast {f[:12]} trained {r[:12]}"
        assert auto.decode(a) == t, f"AutoTokenizer does not round-trip {t!r}: {auto.decode(a)!r}"
    msgs = [{"role": "user", "content": question(12, 34)}]
    text = auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{question(12, 34)}<|im_end|>\n<|im_start|>assistant\n", text
    assert auto.eos_token == EOS and auto.pad_token == PAD and auto.bos_token is None
    return {"class": type(auto).__name__, "size": len(auto), "eos_token_id": auto.eos_token_id,
            "pad_token_id": auto.pad_token_id, "checked_texts": len(texts)}


def check_prompt_ids(tok, rows: list[dict]) -> None:
    """TRL tokenizes prompts with ``apply_chat_template(tokenize=True)``; rlcli's sampler renders the
    template to text and tokenizes it without special tokens. Both must give the same ids."""
    for r in rows:
        text = tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        ours = tok(text, add_special_tokens=False)["input_ids"]
        theirs = tok.apply_chat_template([r["prompt"]], tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"][0]
        assert ours and list(ours) == list(theirs), f"prompt ids differ: rlcli {ours} TRL {theirs}"


def prompt_text(a: int, b: int) -> str:
    return f"<|im_start|>user\n{question(a, b)}<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------------------- model
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


# ------------------------------------------------------------------------------------ warm start
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


def draw_pair_train(rng: random.Random, size: Size) -> tuple[int, int]:
    while True:
        p = draw_pair(rng, size.max_digits)
        if not is_heldout(*p):
            return p


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


# ---------------------------------------------------------------------------------------- report
def time_to_target(curve: list[dict], target: float) -> float | None:
    """Training seconds at which held-out accuracy first reaches ``target``: linear interpolation
    between the last evaluation below it and the first at or above it (the first point if already
    there); None if never reached."""
    prev = None
    for p in curve:
        if p["accuracy"] >= target:
            if prev is None or p["accuracy"] == prev["accuracy"]:
                return p["seconds"]
            frac = (target - prev["accuracy"]) / (p["accuracy"] - prev["accuracy"])
            return prev["seconds"] + frac * (p["seconds"] - prev["seconds"])
        prev = p
    return None


def curve_from_evals(evals: list[dict]) -> list[dict]:
    """Eval points ``{step, accuracy, wall: s since launch at the eval's end, eval_s}`` -> ``{step, seconds,
    accuracy}``, seconds = wall minus the evaluations so far. The first evaluation is charged at most a warm one's
    cost (the median of the others): warm-up it does on the run's behalf (an engine's first compilation and CUDA
    graphs, cuBLAS start-up) counts as the run's start-up, as it would for a run that never evaluates."""
    warm = statistics.median(e["eval_s"] for e in evals[1:]) if len(evals) > 1 else None
    curve, spent = [], 0.0
    for i, e in enumerate(evals):
        spent += min(e["eval_s"], warm) if i == 0 and warm is not None else e["eval_s"]
        curve.append({"step": e["step"], "seconds": round(e["wall"] - spent, 2), "accuracy": e["accuracy"],
                      "eval_s": round(e["eval_s"], 2)})
    return curve


def load_runs(dirs: list[Path]) -> list[dict]:
    runs = []
    for d in dirs:
        for f in sorted(Path(d).glob("*.json")):
            try:
                r = json.loads(f.read_text())
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and r.get("kind") == "learning_race_run":
                r["source"] = Path(d).name
                runs.append(r)
    return runs


def run_label(r: dict, sources: int = 1) -> str:
    """``framework [recipe overrides]``, and the run's folder when several are merged."""
    sets = (r.get("settings") or {}).get("rlcli_set") or []
    return r["framework"] + (f" [{', '.join(sets)}]" if sets else "") + (f" <{r['source']}>" if sources > 1 else "")


def _fmt(x: Any, nd: int = 3) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def plot(runs: list[dict], target: float, path: Path, sources: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for r in runs:
        c = r.get("curve") or []
        if c:
            ax.plot([p["seconds"] for p in c], [p["accuracy"] for p in c], marker="o", ms=3,
                    label=f"{run_label(r, sources)} (seed {r['seed']})")
    ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.2f}")
    ax.set_xlabel("training seconds since process start (evaluation time excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(inputs: list[Path], out: Path) -> str:
    """Merge the run files of ``inputs`` into ``out/race.png`` and ``out/race.md``; returns the table."""
    runs = sorted(load_runs(inputs), key=lambda r: (r["framework"], r["seed"], r["source"]))
    sources = len({r["source"] for r in runs})
    out.mkdir(parents=True, exist_ok=True)
    if not runs:
        raise SystemExit(f"no run files (kind learning_race_run) in {', '.join(map(str, inputs))}")
    targets = sorted({round(r["target"], 6) for r in runs})
    target = runs[0]["target"]
    steps = [{p["step"] for p in r.get("curve") or []} for r in runs]
    common = max(set.intersection(*steps), default=None) if all(steps) else None
    lines = ["# Learning race: held-out greedy accuracy vs training seconds", "",
             f"Target accuracy {target:.3f}, fixed before the runs"
             + (f" (WARNING: the runs record different targets {targets})" if len(targets) > 1 else "")
             + "; time to target interpolates linearly between the last evaluation below it and the first at or "
             "above it. Training seconds: since the framework's process started, evaluation time subtracted.", "",
             (f"| framework | seed | acc step 0 | time to target (s) | acc @ step {_fmt(common)} | last eval (step: "
              "acc) | steps | median step (s) | peak GPU GiB torch / nvidia-smi | logprob gap mean / max | exit |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        c = r.get("curve") or []
        t = time_to_target(c, target)
        at = next((p["accuracy"] for p in c if p["step"] == common), None)
        last = f"{c[-1]['step']}: {c[-1]['accuracy']:.3f}" if c else "-"
        span = f"> {c[-1]['seconds']:.0f} (not reached)" if c and t is None else _fmt(t, 1)
        lines.append(f"| {run_label(r, sources)} | {r['seed']} | {_fmt(c[0]['accuracy'] if c else None)} | {span} | "
                     f"{_fmt(at)} | {last} | {r.get('steps_done', '-')} | {_fmt(r.get('median_step_s'))} | "
                     f"{_fmt(r.get('peak_gib_torch'), 2)} / {_fmt(r.get('peak_gib_nvidia_smi'), 2)} | "
                     f"{_fmt(r.get('logprob_gap_mean'), 4)} / {_fmt(r.get('logprob_gap_max'), 3)} | "
                     f"{r.get('exit_code')} |")
    lines += ["", *speedups(runs, target), "", *run_notes(runs, sources)]
    text = "\n".join(lines) + "\n"
    plot(runs, target, out / "race.png", sources)
    (out / "race.md").write_text(text)
    print(text, flush=True)
    return text


def speedups(runs: list[dict], target: float) -> list[str]:
    """rlcli's best time to target against ``trl`` and ``trl-vllm``, per seed, within each run folder
    (runs in one folder ran back to back on one machine; across folders machines may differ)."""
    lines = []
    for source in sorted({r["source"] for r in runs}):
        group = [r for r in runs if r["source"] == source]
        ttt = {(run_label(r), r["seed"]): time_to_target(r.get("curve") or [], target) for r in group}
        prefix = f"{source}, " if len({r["source"] for r in runs}) > 1 else ""
        for seed in sorted({r["seed"] for r in group}):
            mine = {fw: t for (fw, s), t in ttt.items() if s == seed}
            best = min(((t, fw) for fw, t in mine.items() if fw.startswith("rlcli") and t is not None), default=None)
            for base in ("trl", "trl-vllm"):
                if base not in mine or not any(fw.startswith("rlcli") for fw in mine):
                    continue
                last = max((p["seconds"] for r in group if run_label(r) == base and r["seed"] == seed
                            for p in r.get("curve") or []), default=0.0)
                head = f"- {prefix}seed {seed}:"
                if best is None:
                    lines.append(f"{head} no rlcli run reached the target; {base}: {_fmt(mine[base], 1)} s")
                elif not last:
                    lines.append(f"{head} {base} has no evaluation (see its exit code and log_tail)")
                elif mine[base] is None:
                    lines.append(f"{head} {base} did not reach the target in {last:.0f} s; rlcli's best "
                                 f"({best[1]}) took {best[0]:.1f} s: speed-up > {last / best[0]:.2f}x")
                else:
                    lines.append(f"{head} speed-up of rlcli's best ({best[1]}, {best[0]:.1f} s) over {base} "
                                 f"({mine[base]:.1f} s): **{mine[base] / best[0]:.2f}x**")
    by_fw: dict[str, list] = {}
    for r in runs:
        by_fw.setdefault(run_label(r), []).append(time_to_target(r.get("curve") or [], target))
    for fw, ts in by_fw.items():
        if len(ts) > 1:
            ok = [t for t in ts if t is not None]
            lines.append(f"- run-to-run noise, {fw}, {len(ts)} runs: time to target "
                         + (f"{min(ok):.1f}-{max(ok):.1f} s" if ok else "never reached")
                         + (f" ({len(ts) - len(ok)} not reached)" if len(ok) < len(ts) else ""))
    return lines


def run_notes(runs: list[dict], sources: int = 1) -> list[str]:
    r0 = runs[0]
    ws, s = r0.get("warmstart", {}), r0.get("settings", {})
    lines = [(f"Warm start: {ws.get('size')} model, {_fmt(ws.get('params'))} parameters, {ws.get('sft_steps')} SFT "
              f"steps in {ws.get('sft_seconds')} s, held-out accuracy {_fmt(ws.get('heldout_accuracy'))} on "
              f"{ws.get('heldout_n')} problems ({ws.get('stop_reason')})."),
             (f"Settings: {s.get('prompts')} prompts x {s.get('group')} samples per step, lr {s.get('lr')}, "
              f"max new tokens {s.get('max_new_tokens')}, temperature 1, top-p 1, top-k off, beta 0, clip 0.2/0.2, "
              f"eval every {s.get('eval_every')} steps, at most {s.get('steps')} steps or {s.get('max_seconds')} "
              "training seconds."), ""]
    for r in runs:
        v = {k: x for k, x in (r.get("versions") or {}).items() if x}
        lines.append(f"- {run_label(r, sources)} seed {r['seed']}: {r.get('gpu', '?')}, {r.get('date', '?')}, rlcli "
                     f"{r.get('commit', '?')}, {', '.join(f'{k} {x}' for k, x in v.items())}; gap metric: "
                     f"{r.get('gap_metric') or '-'}")
    return lines
