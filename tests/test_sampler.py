"""The JSONL sampler: groups, ids, epochs, bad rows, over-long prompts, checkpoint state."""

import json

import pytest

from rlcli.data.base import DataError
from rlcli.data.sampler import JsonlSampler, JsonlSamplerConfig
from rlcli.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:arith")


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(i):
    return {"data_source": "arith", "prompt": [{"role": "user", "content": f"{i}+1="}],
            "reward_model": {"ground_truth": str(i + 1)}}


def make(path, tok, **kw):
    return JsonlSampler(JsonlSamplerConfig(path=str(path), **kw), tokenizer=tok, task_name="t", seed=0)


def test_groups_and_ids(tmp_path, tok):
    # behaviour 20: k=5, third prompt -> group 2, uids 10..14
    s = make(write(tmp_path / "d.jsonl", [row(i) for i in range(4)]), tok, prompt_repeat_k=5, shuffle=False)
    groups = [s.sample_group() for _ in range(3)]
    assert groups[2][0].group_id == 2 and [x.uid for x in groups[2]] == [10, 11, 12, 13, 14]
    assert groups[0][0].prompt_ids == tok("0+1=", add_special_tokens=False)["input_ids"]
    assert groups[0][0].label == "1" and groups[0][0].data_source == "arith"
    assert groups[0][0] is not groups[0][1] and groups[0][0].response_ids is not groups[0][1].response_ids


def test_prompts_the_tokenizer_cannot_encode_are_warned_naming_the_characters(tmp_path, tok, caplog):
    bad = {**row(1), "prompt": [{"role": "user", "content": "Final: 1+1=?"}]}
    with caplog.at_level("WARNING", logger="rlcli"):
        make(write(tmp_path / "d.jsonl", [row(0), bad]), tok)
    (msg,) = [r.getMessage() for r in caplog.records if "cannot encode" in r.getMessage()]
    assert msg.startswith(f"task 't': prompts of {tmp_path / 'd.jsonl'}: 1 of 2 texts hold characters the "
                          "tokenizer cannot encode (each becomes <unk>): 'F'; ")


def test_epochs_reshuffle_and_resume(tmp_path, tok):
    p = write(tmp_path / "d.jsonl", [row(i) for i in range(5)])
    a = make(p, tok, seed=3)
    first = [a.sample_group()[0].label for _ in range(7)]
    state = a.state_dict()
    rest = [a.sample_group()[0].label for _ in range(6)]
    assert sorted(first[:5]) == sorted(str(i + 1) for i in range(5))  # one full epoch
    b = make(p, tok, seed=3)
    b.load_state_dict(state)
    assert [b.sample_group()[0].label for _ in range(6)] == rest


def test_bad_rows_reported_with_line_and_counted(tmp_path, tok):
    p = write(tmp_path / "d.jsonl", [row(0), "{not json", {"prompt": 5}, row(1), {"prompt": [{"role": "user"}]}])
    s = make(p, tok)
    assert len(s) == 2
    assert any(str(m).startswith(f"{p}:2:") for m in s.skipped)
    assert any(f"{p}:3:" in str(m) for m in s.skipped) and any(f"{p}:5:" in str(m) for m in s.skipped)
    assert s.pop_stats() == {"data/skipped_rows": 3.0}
    assert s.pop_stats() == {}


def test_overlong_prompts_dropped(tmp_path, tok):
    p = write(tmp_path / "d.jsonl", [row(0), {"prompt": "1+1+1+1+1+1=", "reward_model": {"ground_truth": "6"}}])
    s = make(p, tok, max_prompt_length=5)
    assert len(s) == 1 and len(s.overlong) == 1
    assert [(r.line, r.kind) for r in s.skipped_rows()] == [(2, "too_long")]


def test_missing_file_and_empty(tmp_path, tok):
    with pytest.raises(DataError, match="missing.jsonl"):
        make(tmp_path / "missing.jsonl", tok)
    with pytest.raises(DataError, match="no usable prompt"):
        make(write(tmp_path / "bad.jsonl", ["{"]), tok)


def test_resume_on_changed_data_refused(tmp_path, tok):
    a = make(write(tmp_path / "a.jsonl", [row(i) for i in range(3)]), tok)
    b = make(write(tmp_path / "b.jsonl", [row(i) for i in range(4)]), tok)
    with pytest.raises(ValueError, match="refusing"):
        b.load_state_dict(a.state_dict())


def test_fixed_groups_are_stable(tmp_path, tok):
    s = make(write(tmp_path / "d.jsonl", [row(i) for i in range(4)]), tok)
    assert [g[0].label for g in s.fixed_groups(3)] == ["1", "2", "3"]
    assert [g[0].label for g in s.fixed_groups()] == ["1", "2", "3", "4"]


def test_decode_tokens_equals_the_tokenizers_decode():
    from rlcli.tokenizer import builtin_tokenizer, decode_tokens

    for name in ("arith", "calc", "digits"):
        tok = builtin_tokenizer(name)
        ids = tok.encode("12+3=15 ab?") + [tok.eos_token_id, tok.pad_token_id] + tok.encode("7")
        want = {skip: tok.decode(ids, skip_special_tokens=skip) for skip in (True, False)}
        tok.decode = None  # the fast path never calls it (an instance attribute: the class checks still pass)
        for skip in (True, False):
            assert decode_tokens(tok, ids, skip) == want[skip]
        del tok.decode
        for skip in (True, False):
            assert decode_tokens(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip)
        tok.clean_up_tokenization_spaces = True  # what the fast path would skip: falls back to decode
        assert decode_tokens(tok, ids) == tok.decode(ids, skip_special_tokens=True)


def test_decode_many_and_the_batcher_equal_decode_tokens(monkeypatch):
    import asyncio

    import rlcli.tokenizer as T

    tok = T.builtin_tokenizer("arith")
    seqs = [tok.encode(f"{i}+{i}={2 * i}") + [tok.eos_token_id] for i in range(40)]
    for skip in (True, False):
        assert T.decode_many(tok, seqs, skip) == [T.decode_tokens(tok, s, skip) for s in seqs]

    calls = []
    real = T.decode_many
    monkeypatch.setattr(T, "decode_many", lambda t, s, skip=True: calls.append((len(s), skip)) or real(t, s, skip))
    batcher = T.DecodeBatcher(tok)

    async def one(i, skip):
        await asyncio.sleep(0)  # all start in one turn of the loop, as the responses of one engine step
        return await batcher.decode(seqs[i], skip)

    async def many():
        return await asyncio.gather(*(one(i, i % 3 != 0) for i in range(len(seqs))))

    texts = asyncio.run(many())
    assert texts == [T.decode_tokens(tok, s, i % 3 != 0) for i, s in enumerate(seqs)]
    assert sorted(calls) == [(14, False), (26, True)]  # one call per flag, not one per response
    assert asyncio.run(many()) == texts  # a second event loop is served too
    assert not batcher._pending


def test_decode_batcher_hands_errors_to_every_waiter_and_survives_cancellation(monkeypatch):
    import asyncio

    import rlcli.tokenizer as T

    batcher = T.DecodeBatcher(T.builtin_tokenizer("arith"))

    def broken(tok, seqs, skip=True):
        raise RuntimeError("tokenizer exploded")

    async def failing():
        return await asyncio.gather(batcher.decode([5]), batcher.decode([6]), return_exceptions=True)

    monkeypatch.setattr(T, "decode_many", broken)
    errors = asyncio.run(failing())
    assert [str(e) for e in errors] == ["tokenizer exploded"] * 2
    monkeypatch.undo()

    async def cancelled_one():
        doomed = asyncio.ensure_future(batcher.decode([5]))
        kept = asyncio.ensure_future(batcher.decode([6]))
        await asyncio.sleep(0)
        doomed.cancel()
        return await kept

    assert asyncio.run(cancelled_one()) == T.decode_tokens(batcher.tok, [6])

    async def truthy_flags():  # any truthy or falsy flag, as decode() takes it; never left waiting
        return await asyncio.wait_for(asyncio.gather(batcher.decode([5], 1), batcher.decode([6], 0)), 10)

    assert asyncio.run(truthy_flags()) == [T.decode_tokens(batcher.tok, [5], True),
                                           T.decode_tokens(batcher.tok, [6], False)]


def test_decode_batcher_chunks_decode_in_the_background_and_hand_each_chunk_over(monkeypatch):
    import asyncio

    import rlcli.tokenizer as T

    tok = T.builtin_tokenizer("arith")
    assert T._rust_decodes(tok)
    seqs = [tok.encode(f"{i}*{i}={i * i}") + [tok.eos_token_id] for i in range(23)]
    inline = []
    real = T.decode_many
    monkeypatch.setattr(T, "decode_many", lambda t, s, skip=True: inline.append(len(s)) or real(t, s, skip))
    batcher = T.DecodeBatcher(tok, chunk=5)
    order = []

    async def one(i):
        await asyncio.sleep(0)
        text = await batcher.decode(seqs[i], i % 2 == 0)
        order.append(i)
        return text

    async def many():
        return await asyncio.gather(*(one(i) for i in range(len(seqs))))

    texts = asyncio.run(many())
    assert texts == [T.decode_tokens(tok, s, i % 2 == 0) for i, s in enumerate(seqs)]
    # 23 requests: four chunks of 5 went to the background thread (on its own copy of the
    # tokenizer) as they were queued; the 3 left when the turn ended, on the loop's thread
    assert sorted(inline) == [1, 2]
    assert batcher._background_tok is not None and batcher._background_tok is not tok._tokenizer
    assert sorted(order) == list(range(len(seqs))) and not batcher._pending

    # a background chunk that fails fails its own callers only
    class Broken:
        def decode_batch(self, seqs, skip_special_tokens=True):
            if any(s == seqs_by_index[7] for s in seqs):
                raise RuntimeError("tokenizer exploded")
            return tok._tokenizer.decode_batch(seqs, skip_special_tokens=skip_special_tokens)

    seqs_by_index = seqs
    batcher._background_tok = Broken()

    async def all_of_them():
        return await asyncio.gather(*(batcher.decode(s) for s in seqs), return_exceptions=True)

    out = asyncio.run(all_of_them())
    failed = [i for i, o in enumerate(out) if isinstance(o, Exception)]
    assert failed == [5, 6, 7, 8, 9] and str(out[7]) == "tokenizer exploded"
    assert inline[2:] == [3]  # the last 3
    assert [o for i, o in enumerate(out) if i not in failed] == [
        T.decode_tokens(tok, s) for i, s in enumerate(seqs) if i not in failed]


def test_decode_batcher_without_the_rust_fast_path_decodes_every_chunk_inline(monkeypatch):
    import asyncio

    import rlcli.tokenizer as T

    tok = T.builtin_tokenizer("arith")
    monkeypatch.setattr(T, "_rust_decodes", lambda t: False)
    batcher = T.DecodeBatcher(tok, chunk=4)
    seqs = [tok.encode(str(i)) for i in range(10)]

    async def many():
        return await asyncio.gather(*(batcher.decode(s) for s in seqs))

    assert asyncio.run(many()) == [tok.decode(s, skip_special_tokens=True) for s in seqs]
    assert batcher._background_tok is None
    with pytest.raises(ValueError, match="chunk"):
        T.DecodeBatcher(tok, chunk=0)

    # a Rust tokenizer that cannot be copied for the background thread: decoded inline from then on
    monkeypatch.undo()
    batcher = T.DecodeBatcher(tok, chunk=4)
    monkeypatch.setattr(T.copy, "deepcopy", lambda x: (_ for _ in ()).throw(TypeError("cannot pickle")))
    assert asyncio.run(many()) == [tok.decode(s, skip_special_tokens=True) for s in seqs]
    assert batcher._background_tok is None and not batcher._background


def test_every_built_in_tokenizer_and_its_vocabulary_is_documented(repo):
    """docs/recipes.md's table of built-in tokenizers lists each one with exactly its vocabulary."""
    import re
    import string

    from rlcli.tokenizer import BUILTIN_TOKENIZERS

    text = (repo / "docs" / "recipes.md").read_text()
    rows = dict(re.findall(r"^\| `builtin:(\w+)` \| (.+) \|$", text, re.MULTILINE))
    assert sorted(rows) == sorted(BUILTIN_TOKENIZERS)
    for name, cell in rows.items():
        tok = load_tokenizer(f"builtin:{name}")
        vocab = sorted(tok.get_vocab(), key=tok.get_vocab().get)
        assert vocab[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"], name
        documented = set(re.match(r"`([^`]+)`", cell).group(1))
        documented |= set(string.ascii_lowercase) if "`a` to `z`" in cell else set()
        documented |= {" "} if "space" in cell else set()
        documented |= {"\n"} if "newline" in cell else set()
        assert documented == set(vocab[4:]), (name, sorted(documented ^ set(vocab[4:])))
    assert load_tokenizer("builtin:digits").tokenize(" Final:") == ["<unk>"] * 7  # as the docs say
