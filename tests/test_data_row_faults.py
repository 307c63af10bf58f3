"""Two data rows that are valid JSON text but not usable rows: an integer longer than Python reads
(4,300 digits) and a lone surrogate (``\\ud800``) in a prompt. Each is skipped with its file:line
and kind, like any bad row, instead of stopping ``rlcli validate`` / ``rlcli train`` on the file."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.data.rows import Row, SkippedRow, read_rows
from rlcli.data.sampler import JsonlSampler, JsonlSamplerConfig
from rlcli.tokenizer import load_tokenizer

BIG_INT = b'{"prompt": "1+2=", "reward_model": {"ground_truth": "3"}, "extra_info": {"n": ' + b"9" * 5000 + b"}}"
LONE = {  # valid JSON whose text UTF-8 cannot encode; where the surrogate is -> words of the reason
    b'{"prompt": "1+\\ud800=", "reward_model": {"ground_truth": "3"}}': "'prompt' holds '\\ud800' at character 2",
    b'{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "\\udfff"}], '
    b'"reward_model": {"ground_truth": "3"}}': "the content of message 1 holds '\\udfff'",
    b'{"prompt": [{"role": "us\\udc80er", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}':
        "the role of message 0 holds '\\udc80'",
}


def good(i: int) -> bytes:
    return json.dumps({"prompt": f"{i}+1=", "reward_model": {"ground_truth": str(i + 1)}}).encode()


def write(path, lines):
    path.write_bytes(b"".join(x + b"\n" for x in lines))
    return path


def test_an_integer_too_long_for_python_is_a_json_row(tmp_path):
    p = write(tmp_path / "d.jsonl", [BIG_INT, good(0), BIG_INT.replace(b"9" * 5000, b"-" + b"1" * 4301), good(1)])
    out = list(read_rows(p))
    assert [type(r).__name__ for r in out] == ["SkippedRow", "Row", "SkippedRow", "Row"]
    for r, line in zip(out[::2], (1, 3)):
        assert (r.file, r.line, r.kind) == (str(p), line, "json")
        assert str(r).startswith(f"{p}:{line}: unreadable JSON (") and "4300 digits" in r.reason
    ok = write(tmp_path / "ok.jsonl", [BIG_INT.replace(b"9" * 5000, b"9" * 4300)])  # at the limit: read
    assert isinstance(next(read_rows(ok)), Row)


def test_a_lone_surrogate_in_a_message_is_an_encoding_row(tmp_path):
    lines = [good(0), *LONE, b'{"prompt": "caf\\u00e9 \\ud83d\\ude00", "reward_model": {"ground_truth": "1"}}']
    p = write(tmp_path / "d.jsonl", lines)
    out = list(read_rows(p))
    assert [type(r).__name__ for r in out] == ["Row", "SkippedRow", "SkippedRow", "SkippedRow", "Row"]
    for i, (r, words) in enumerate(zip(out[1:4], LONE.values())):
        assert (r.file, r.line, r.kind) == (str(p), i + 2, "encoding")
        assert str(r).startswith(f"{p}:{i + 2}: {words}") and "cannot be encoded as UTF-8" in r.reason, r.reason
    assert out[-1].messages[0]["content"] == "caf\u00e9 \U0001f600"  # a valid surrogate pair is a character


def test_the_sampler_skips_both_rows_and_tokenizes_the_rest(tmp_path):
    lines = [good(0), BIG_INT, *LONE, good(1)]
    p = write(tmp_path / "d.jsonl", lines)
    s = JsonlSampler(JsonlSamplerConfig(path=str(p)), tokenizer=load_tokenizer("builtin:digits"), task_name="t",
                     seed=0)
    assert len(s) == 2 and [pr.row for pr in s.prompts] == [1, len(lines)]
    assert [(r.line, r.kind) for r in s.skipped_rows()] == [(2, "json"), (3, "encoding"), (4, "encoding"),
                                                             (5, "encoding")]
    assert s.pop_stats() == {"data/skipped_rows": 4.0}


@pytest.mark.parametrize("first", [BIG_INT, next(iter(LONE))])
def test_validate_skips_such_a_first_row_or_refuses_the_file_with_exit_2(repo, tmp_path, first):
    quickstart = str(repo / "recipes" / "quickstart.yaml")
    runner = CliRunner()
    usable = write(tmp_path / "usable.jsonl", [first, good(0)])
    out = runner.invoke(cli, ["validate", quickstart, f"tasks.0.sampler.path={usable}"])
    assert out.exit_code == 0 and out.exception is None, out.output
    only = write(tmp_path / "only.jsonl", [first])
    out = runner.invoke(cli, ["validate", quickstart, f"tasks.0.sampler.path={only}"])
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert "tasks.0.sampler.path" in out.output and f"{only}:1: " in out.output
