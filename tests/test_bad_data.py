"""Bad data rows: every one located (file:line), skipped, counted and listed in skipped_rows.jsonl;
a file with no usable row refused before any model loads (issue 28, item 6)."""

import json

import pytest
import yaml
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.config import RecipeError, validate_recipe
from rlcli.data.base import DataError
from rlcli.data.rows import DEFAULT_MAX_ROW_BYTES, Row, SkippedRow, read_rows
from rlcli.data.sampler import JsonlSampler, JsonlSamplerConfig
from rlcli.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:arith")


def good(i):
    return json.dumps({"prompt": f"{i}+1=", "reward_model": {"ground_truth": str(i + 1)}}).encode()


BAD = {  # kind -> a line of that kind
    "encoding": b'{"prompt": "caf\xe9", "reward_model": {"ground_truth": "1"}}',
    "json": b'{"prompt": ',
    "shape": b'{"prompt": 5, "reward_model": {"ground_truth": "1"}}',
    "empty_prompt": b'{"prompt": "   ", "reward_model": {"ground_truth": "1"}}',
    "no_label": b'{"prompt": "1+1="}',
}


def write(path, lines):
    path.write_bytes(b"".join(x + b"\n" for x in lines))
    return path


def make(path, tok, **kw):
    return JsonlSampler(JsonlSamplerConfig(path=str(path), **kw), tokenizer=tok, task_name="t", seed=0)


def test_every_bad_row_is_located_with_its_kind(tmp_path):
    lines = [good(0)]
    for _ in range(3):  # 15 bad rows: more than the 5 that used to be located
        lines += list(BAD.values())
    lines += [b"", b'{"prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": ""}], '
              b'"reward_model": {"ground_truth": "1"}}', b'{"prompt": "2+2=", "reward_model": {"ground_truth": ""}}',
              good(1)]
    p = write(tmp_path / "d.jsonl", lines)
    out = list(read_rows(p))
    skipped = [r for r in out if isinstance(r, SkippedRow)]
    assert [r.line for r in out if isinstance(r, Row)] == [1, len(lines)]
    assert [(r.line, r.kind) for r in skipped] == (
        [(2 + 5 * j + i, k) for j in range(3) for i, k in enumerate(BAD)]
        + [(len(lines) - 2, "empty_prompt"), (len(lines) - 1, "no_label")])
    assert all(r.file == str(p) for r in skipped)
    assert "not valid UTF-8" in skipped[0].reason and str(skipped[0]).startswith(f"{p}:2: ")
    # without require_label, label-less rows are usable
    assert sum(isinstance(r, Row) for r in read_rows(p, require_label=False)) == 2 + 3 + 1


def test_an_oversized_row_is_skipped_without_reading_it_whole(tmp_path):
    assert DEFAULT_MAX_ROW_BYTES == 1 << 20
    big = json.dumps({"prompt": "x" * 300_000, "reward_model": {"ground_truth": "1"}}).encode()
    p = write(tmp_path / "d.jsonl", [good(0), big, good(1), b"\xef\xbb\xbf" + good(2)])
    out = list(read_rows(p, max_row_bytes=100_000))
    assert [type(r).__name__ for r in out] == ["Row", "SkippedRow", "Row", "SkippedRow"]
    assert out[1].kind == "size" and f"{len(big):,} bytes" in out[1].reason and out[2].line == 3
    assert out[3].kind == "json"  # a byte-order mark is allowed on the first line only
    bom_first = write(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + good(0)])
    assert isinstance(next(read_rows(bom_first)), Row)
    deep = write(tmp_path / "deep.jsonl", [b"[" * 100_000 + b"]" * 100_000])  # no RecursionError
    assert [(r.kind, r.reason) for r in read_rows(deep)] == [("json", "invalid JSON (nested too deeply)")]
    exact = write(tmp_path / "exact.jsonl", [good(0)])  # a row exactly at the limit is kept
    assert isinstance(next(read_rows(exact, max_row_bytes=len(good(0)))), Row)
    assert isinstance(next(read_rows(exact, max_row_bytes=len(good(0)) - 1)), SkippedRow)


def test_sampler_skips_counts_and_lists_every_bad_row(tmp_path, tok, monkeypatch):
    lines = [good(i) for i in range(3)] + list(BAD.values()) * 2 + [good(3)]
    p = write(tmp_path / "d.jsonl", lines)
    real = JsonlSampler._template

    def template(self, messages):  # a chat template that rejects one row
        if messages[-1]["content"] == "2+1=":
            raise ValueError("role not supported")
        return real(self, messages)

    monkeypatch.setattr(JsonlSampler, "_template", template)
    s = make(p, tok, max_prompt_length=4)
    listed = s.skipped_rows()
    assert len(s) == 3 and [r.line for r in listed] == sorted(r.line for r in listed)
    assert [r.kind for r in listed] == ["template", *BAD, *BAD]
    assert s.pop_stats() == {"data/skipped_rows": 11.0}
    assert all(isinstance(p.prompt_ids, list) for p in s.prompts) and s.prompt_lengths() == [4, 4, 4]


def test_a_sampler_with_no_usable_prompt_raises_a_data_error(tmp_path, tok):
    p = write(tmp_path / "d.jsonl", [good(0), good(1)])
    with pytest.raises(DataError, match=r"task 't': no usable prompt .* 2 over max_prompt_length"):
        make(p, tok, max_prompt_length=1)


@pytest.fixture()
def raw(repo):
    return yaml.safe_load((repo / "recipes" / "quickstart.yaml").read_text())


@pytest.mark.parametrize("lines, words", [
    ([], "holds no rows"),
    ([b"", b"  "], "holds no rows"),
    (list(BAD.values()), "all 5 rows are bad (1 encoding, 1 json, 1 shape, 1 empty_prompt, 1 no_label)"),
])
def test_validate_refuses_a_file_with_no_usable_row(raw, repo, tmp_path, lines, words):
    p = write(tmp_path / "d.jsonl", lines)
    raw["eval"]["tasks"][0]["sampler"]["path"] = str(p)
    with pytest.raises(RecipeError) as ei:
        validate_recipe(raw, base_dir=repo / "recipes")
    (issue,) = ei.value.issues
    assert issue.path == "eval.tasks.0.sampler.path" and words in issue.message and str(p) in issue.message
    if lines and lines[0]:
        assert f"{p}:1: not valid UTF-8" in issue.message


def test_validate_reads_only_up_to_the_first_usable_row(raw, repo, tmp_path):
    p = write(tmp_path / "d.jsonl", [BAD["json"], good(0), b"\xff" * (2 << 20)])
    raw["tasks"][0]["sampler"]["path"] = str(p)
    validate_recipe(raw, base_dir=repo / "recipes")  # no issue: a usable row exists


def test_train_on_an_empty_file_exits_2_before_anything(repo, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    empty = write(tmp_path / "empty.jsonl", [])
    work = tmp_path / "wd"
    out = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work),
                                   f"tasks.0.sampler.path={empty}"])
    assert out.exit_code == 2 and "tasks.0.sampler.path" in out.output and "holds no rows" in out.output
    assert not work.exists()  # nothing written: no metrics.jsonl to block the next run


def train_one_step(repo, work, data, *overrides):
    """One quickstart step on ``data``, without evaluation or checkpoints; the work dir."""
    out = CliRunner().invoke(cli, [
        "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
        f"tasks.0.sampler.path={data}", "trainer.total_train_steps=1", "trainer.train_batch_size=2",
        "trainer.enable_evaluate=false", "trainer.enable_initial_evaluate=false", "trainer.checkpoint_interval=-1",
        "~eval", *overrides])
    assert out.exit_code == 0, out.output
    return work


def test_train_lists_skipped_rows_in_the_work_dir(repo, tmp_path):
    """One short run on a file with bad rows: it trains on the good ones, counts the bad ones and
    lists every one of them (file:line, kind, reason) in skipped_rows.jsonl."""
    src = (repo / "recipes" / "data" / "arith.jsonl").read_bytes().splitlines()[:20]
    p = write(tmp_path / "d.jsonl", src[:3] + list(BAD.values()) + src[3:])
    work = train_one_step(repo, tmp_path / "w", p, "tasks.0.sampler.prompt_repeat_k=2")
    listed = [json.loads(x) for x in (work / "skipped_rows.jsonl").read_text().splitlines()]
    assert [(r["task"], r["file"], r["line"], r["kind"]) for r in listed] == [
        ("arith", str(p), 4 + i, kind) for i, kind in enumerate(BAD)]
    metrics = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["data/skipped_rows"] == 5
    log = (work / "run.log").read_text()
    assert f"{p}:4: not valid UTF-8" in log and "skipped_rows.jsonl" in log


def test_train_refuses_prompts_that_cannot_fit_before_the_model_loads(repo, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    work = tmp_path / "w"
    base = ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
            "trainer.total_train_steps=1"]
    out = CliRunner().invoke(cli, [*base, "model.from_scratch.max_position_embeddings=4"])
    assert out.exit_code == 2, out.output
    assert "task 'arith': 100 of 100 prompts have 4 tokens or more" in out.output
    assert f"the first: {repo / 'recipes' / 'data' / 'arith.jsonl'}:1 (" in out.output  # named by file:line
    assert "model.from_scratch.max_position_embeddings" in out.output
    assert not (work / "metrics.jsonl").exists()
    out = CliRunner().invoke(cli, [*base, "train_worker.pack_max_length=3"])
    assert out.exit_code == 2 and "more than train_worker.pack_max_length=3" in out.output, out.output


def test_gsm8k_converter_lists_every_skipped_line(tmp_path):
    lines = [json.dumps({"question": f"q{i}", "answer": "no final answer"}).encode() for i in range(12)]
    src = write(tmp_path / "raw.jsonl", lines)
    out = CliRunner().invoke(cli, ["data", "gsm8k", str(src), str(tmp_path / "out.jsonl")])
    assert out.exit_code == 2 and "no usable GSM8K row (12 malformed); nothing written" in out.stderr  # issue 29
    assert all(f"{src}:{i}:" in out.stderr for i in range(1, 13)) and not (tmp_path / "out.jsonl").exists()
    good = json.dumps({"question": "q", "answer": "#### 1"}).encode()
    out = CliRunner().invoke(cli, ["data", "gsm8k", str(write(tmp_path / "raw2.jsonl", [*lines, good])),
                                   str(tmp_path / "out.jsonl")])
    assert out.exit_code == 0 and "wrote 1 rows" in out.stdout and "skipped 12 malformed rows" in out.stdout
    assert all(f"raw2.jsonl:{i}:" in out.stderr for i in range(1, 13))
    unwritable = CliRunner().invoke(cli, ["data", "gsm8k", str(src), str(src / "out.jsonl")])
    assert unwritable.exit_code == 2 and "cannot convert" in unwritable.output


def test_prompts_too_long_for_the_model_are_named_by_file_and_line(repo, tmp_path):
    """Some prompts (not all) leave no room for a response: the run goes on, and the warning names
    the first of them by file:line instead of only counting them."""
    src = (repo / "recipes" / "data" / "arith.jsonl").read_bytes().splitlines()[:20]
    row = json.loads(src[0])
    row["prompt"][0]["content"] = "1+2+3+4+5+6+7+8="  # 16 tokens against the 4 of every other row
    p = write(tmp_path / "d.jsonl", src[:2] + [json.dumps(row).encode()] + src[2:])
    work = train_one_step(repo, tmp_path / "w", p, "model.from_scratch.max_position_embeddings=12")
    log = (work / "run.log").read_text()
    assert "1 of 21 prompts have 12 tokens or more" in log and f"the first: {p}:3 (16 tokens)" in log
