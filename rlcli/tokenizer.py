"""Tokenizers: loading user tokenizers, and small built-in ones that need no download.

``builtin:arith`` is a character-level tokenizer for arithmetic toy tasks (digits, operators,
space, lower-case letters), ``builtin:digits`` a smaller one (digits and ``+-*=`` only) and
``builtin:calc`` the one of the tool-use toy (digits, ``+-*/%().=?``, space and newline - the
newline is its own token, so a model can end a turn with it; no letters, so a random model's
guesses are spread over few tokens); all have a chat template that concatenates message
contents. It is saved
with the model so HF exports load with ``AutoTokenizer`` (llama model type) or
``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import logging
import threading
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rlcli.lockstep import track

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
_ARITH_CHARS = list("0123456789+-*/=()#., ?:") + list("abcdefghijklmnopqrstuvwxyz")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
)


def _char_tokenizer(chars: list[str], split: str = ".") -> PreTrainedTokenizerFast:
    """One token per character of ``chars`` (others are ``<unk>``); ``split`` matches one character
    (``"."`` does not match a newline, ``"[\\s\\S]"`` does)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(_SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


BUILTIN_TOKENIZERS = {
    "arith": lambda: _char_tokenizer(_ARITH_CHARS),
    "digits": lambda: _char_tokenizer(list("0123456789+-*=")),
    "calc": lambda: _char_tokenizer(list("0123456789+-*/%().=? \n"), split=r"[\s\S]"),
}


def builtin_tokenizer(name: str) -> PreTrainedTokenizerFast:
    try:
        return BUILTIN_TOKENIZERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown built-in tokenizer {name!r}; available: {', '.join(sorted(BUILTIN_TOKENIZERS))}"
        ) from None


def warn_unknown_tokens(tok: PreTrainedTokenizerBase, texts: list[str], ids: list[list[int]], what: str) -> int:
    """Log one warning when some of ``texts`` (encoded as ``ids``) hold characters ``tok`` cannot
    encode (they became its unknown token), naming the characters; returns how many texts did."""
    unk = getattr(tok, "unk_token_id", None)
    bad = [t for t, i in zip(texts, ids) if unk is not None and unk in i]
    if bad:
        chars = sorted({c for t in bad[:100] for c in set(t) if unk in tok.encode(c, add_special_tokens=False)})
        log.warning("%s: %d of %d texts hold characters the tokenizer cannot encode (each becomes %s): %s%s; the "
                    "built-in tokenizers' vocabularies are in docs/recipes.md", what, len(bad), len(texts),
                    tok.unk_token, " ".join(repr(c) for c in chars[:30]), " ..." if len(chars) > 30 else "")
    return len(bad)


def load_tokenizer(spec: str | Path) -> PreTrainedTokenizerBase:
    """Load ``builtin:<name>``, a tokenizer directory or a Hub id (``org/name``: the Hugging Face
    cache, downloading only when online, :func:`rlcli.hub.locate`)."""
    from rlcli.hub import locate

    spec = str(spec)
    if spec.startswith(BUILTIN_PREFIX):
        return builtin_tokenizer(spec[len(BUILTIN_PREFIX):])
    path = Path(spec)
    if not path.is_dir():
        path = locate(spec, field="tokenizer", need="tokenizer")  # ModelLocationError: which case, and the fix
    cfg_file = path / "tokenizer_config.json"
    tcfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    if tcfg.get("rlcli_builtin") or tcfg.get("tokenizer_class") == "PreTrainedTokenizerFast":
        # AutoTokenizer may rebuild the pre-tokenizer for some model types (e.g. qwen2 in
        # transformers 5); a tokenizer that declares itself a plain fast tokenizer is loaded as is.
        tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    else:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def save_tokenizer(tok: PreTrainedTokenizerBase, out_dir: str | Path, builtin: str | None = None) -> None:
    out = Path(out_dir)
    tok.save_pretrained(str(out))
    if builtin:
        cfg_file = out / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["rlcli_builtin"] = builtin
        cfg_file.write_text(json.dumps(cfg, indent=2))


def eos_token_ids(tok: PreTrainedTokenizerBase, model_dir: str | Path | None = None) -> list[int]:
    """EOS ids from the tokenizer and, when present, the model's generation_config.json."""
    ids: list[int] = []
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    if model_dir is not None:
        gen = Path(model_dir) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            for e in eos if isinstance(eos, list) else [eos]:
                if isinstance(e, int) and e not in ids:
                    ids.append(e)
    return ids


def _rust_decodes(tok: PreTrainedTokenizerBase) -> bool:
    """Whether ``tok.decode`` is nothing more than its Rust tokenizer's decode: a fast tokenizer
    that does not override decoding and does not clean up spaces."""
    return (isinstance(tok, PreTrainedTokenizerFast) and type(tok)._decode is PreTrainedTokenizerFast._decode
            and type(tok).decode is PreTrainedTokenizerBase.decode and not tok.clean_up_tokenization_spaces)


def decode_tokens(tok: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = True) -> str:
    """``tok.decode(ids, skip_special_tokens=...)``, straight through the Rust tokenizer when that
    is all ``decode`` would do: ``decode`` first walks the id list in Python, 0.08 ms per 256 ids on
    a 2-core CPU (0.105 s against 0.064 s for 512 responses), which is spent with the GPU idle at
    the end of a rollout."""
    if _rust_decodes(tok):
        return tok._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)


def decode_many(tok: PreTrainedTokenizerBase, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """:func:`decode_tokens` of each id list. Through the Rust tokenizer's batch decode when
    possible, which releases the GIL and spreads the sequences over the CPU cores."""
    if _rust_decodes(tok):
        return tok._tokenizer.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
    return [tok.decode(ids, skip_special_tokens=skip_special_tokens) for ids in seqs]


#: One thread for every batcher's background decoding (chunks queue up behind each other).
_DECODE_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_DECODE_POOL_LOCK = threading.Lock()


def _decode_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _DECODE_POOL
    with _DECODE_POOL_LOCK:
        if _DECODE_POOL is None:
            _DECODE_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlcli-decode")
        return _DECODE_POOL


class DecodeBatcher:
    """Turns token ids into text for many coroutines at once.

    ``await batcher.decode(ids)`` queues the ids; the coroutines that ask in the same turn of the
    event loop (the responses that one engine step finished, all resumed together) are decoded
    together instead of one call per response one after another on one core while the GPU
    waits (the responses of a rollout that all end at the same step make one batch). A failing
    decode fails every caller of its chunk with the error.

    With a tokenizer that decodes in Rust (:func:`decode_many`'s fast path), every ``chunk``
    requests are handed to a background thread as soon as they are queued, and each chunk's
    callers get their text as soon as it is decoded: the Rust decode runs without the GIL, so
    it overlaps the loop's Python work around it (resuming the other finished responses before,
    judging the decoded ones after), and the rollout's tail costs about the longer of the two,
    not their sum. What is left when the turn ends (fewer than ``chunk``) is decoded on the
    loop's thread, so a lone response never waits on a thread hop. The background thread uses
    its own copy of the Rust tokenizer: a call on the loop's thread that changes the tokenizer's
    padding or truncation settings never meets a decode in progress. Other tokenizers decode
    everything on the loop's thread, one call per flag.
    """

    def __init__(self, tok: PreTrainedTokenizerBase, chunk: int = 64):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.tok = tok
        self.chunk = chunk
        self._background = _rust_decodes(tok)
        self._background_tok = None  # the background thread's copy of the Rust tokenizer, made on first use
        # per event loop (a batch never waits on a loop other than its callers'): (ids, skip, future)
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[list[int], bool, asyncio.Future]]] = {}

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        batch = self._pending.get(loop)
        if batch is None:
            batch = self._pending[loop] = []
            loop.call_soon(self._flush, loop)
        batch.append((ids, bool(skip_special_tokens), fut))
        if self._background and len(batch) >= self.chunk and self._ensure_background_tok():
            self._pending[loop] = []  # the flush already scheduled takes what comes after
            for _, _, waiting in batch:  # decoded off the loop's thread: a lockstep engine waits for them
                track(waiting)  # (a flush on the loop's thread is a ready callback, which it waits for anyway)
            _decode_pool().submit(self._decode_in_background, loop, batch)
        return await fut

    def _ensure_background_tok(self) -> bool:
        """Make the background thread's copy of the Rust tokenizer; a tokenizer that cannot be
        copied is decoded on the loop's thread from then on."""
        if self._background_tok is None:
            try:
                self._background_tok = copy.deepcopy(self.tok._tokenizer)
            except Exception:  # noqa: BLE001
                log.warning("cannot copy the tokenizer for background decoding; decoding on the event loop's thread",
                            exc_info=True)
                self._background = False
        return self._background

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        rest = self._pending.pop(loop, [])
        with torch.profiler.record_function("rlcli/agent/decode"):  # a named range in profiler traces
            for part, skip in self._by_flag(rest):
                self._settle(part, *self._decode(lambda seqs: decode_many(self.tok, seqs, skip), part))

    @staticmethod
    def _by_flag(batch):
        by_flag: dict[bool, list[tuple[list[int], asyncio.Future]]] = {}
        for ids, skip, fut in batch:
            by_flag.setdefault(skip, []).append((ids, fut))
        return [(part, skip) for skip, part in by_flag.items()]

    @staticmethod
    def _decode(fn, part: list[tuple[list[int], asyncio.Future]]) -> tuple[list[str] | None, Exception | None]:
        try:
            return fn([ids for ids, _ in part]), None
        except Exception as e:  # noqa: BLE001 - handed to every waiter of the chunk
            return None, e

    def _decode_in_background(self, loop: asyncio.AbstractEventLoop, batch) -> None:
        tok = self._background_tok
        for part, skip in self._by_flag(batch):
            outcome = self._decode(lambda seqs: tok.decode_batch(seqs, skip_special_tokens=skip), part)
            try:
                loop.call_soon_threadsafe(self._settle, part, *outcome)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return

    @staticmethod
    def _settle(part: list[tuple[list[int], asyncio.Future]], texts: list[str] | None,
                error: Exception | None) -> None:
        for i, (_, fut) in enumerate(part):
            if fut.done():  # a cancelled waiter
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(texts[i])
