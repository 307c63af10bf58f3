"""The tokenizer of the learning race (``benchmarks/learning_race.py``).

Tokenizer: a byte-level BPE trained here with the ``tokenizers`` library, with exactly the
normaliser and pre-tokeniser that transformers' ``Qwen2Tokenizer`` builds (digits split one by one),
saved as ``vocab.json`` + ``merges.txt`` + ``tokenizer.json`` with ``tokenizer_class: Qwen2Tokenizer``,
a Qwen-style chat template and ``<|im_end|>`` as EOS; :func:`check_tokenizer` asserts that
``AutoTokenizer``, ``PreTrainedTokenizerFast`` and the trained tokenizer give identical, non-empty ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from race_task import question

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
