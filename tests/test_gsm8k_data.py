"""Raw GSM8K -> RL JSONL conversion."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from rlcli.data.gsm8k import DATA_SOURCE, DEFAULT_INSTRUCTION, convert_gsm8k, convert_record, extract_ground_truth
from rlcli.judgers.gsm8k import GSM8KJudger
from rlcli.types import Sample, Status

RAW = Path(__file__).resolve().parent / "data" / "gsm8k"  # 42 rows of the test split (MIT, OpenAI; README.md there)


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


GOOD = {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}


def test_record_shape(tmp_path):
    src = write_lines(tmp_path / "raw.jsonl", [GOOD, {"question": "Q2?", "answer": "big\n#### 1,200"}])
    written, skipped = convert_gsm8k(src, tmp_path / "out.jsonl")
    assert (written, skipped) == (2, [])
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": GOOD["question"] + DEFAULT_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"index": 0, "answer": GOOD["answer"], "question": GOOD["question"]},
    }
    assert rows[1]["reward_model"]["ground_truth"] == "1200"
    assert rows[1]["extra_info"]["index"] == 1
    assert "####" in DEFAULT_INSTRUCTION


def test_malformed_lines_are_skipped_counted_and_reported(tmp_path):
    src = tmp_path / "raw.jsonl"
    lines = [
        GOOD,                                           # 1 ok
        "{not json",                                    # 2
        "",                                             # 3 blank: ignored, not an error
        {"question": "Q?"},                             # 4 missing answer
        {"question": "Q?", "answer": "no final answer"},  # 5 no ####
        {"question": "", "answer": "#### 1"},           # 6 empty question
        [1, 2],                                         # 7 not an object
        {"question": "Q?", "answer": 7},                # 8 wrong type
        {"question": "Q?", "answer": "x ####  "},       # 9 nothing after ####
        GOOD,                                           # 10 ok
    ]
    write_lines(src, lines)
    with src.open("ab") as f:
        f.write(b'{"question": "\xff\xfe", "answer": "#### 1"}\n')  # 11 invalid UTF-8
    result = convert_gsm8k(src, tmp_path / "out.jsonl")
    assert result.written == 2 and len(result.skipped) == 8
    assert [e.split(": ", 1)[0] for e in result.skipped] == [f"{src}:{n}" for n in (2, 4, 5, 6, 7, 8, 9, 11)]
    by_line = {int(e.split(": ", 1)[0].rsplit(":", 1)[1]): e.split(": ", 1)[1] for e in result.skipped}
    assert "invalid JSON" in by_line[2]
    assert by_line[4] == "missing 'answer'"
    assert "no '#### <final answer>'" in by_line[5]
    assert by_line[6] == "'question' is empty"
    assert by_line[7] == "expected a JSON object, got list"
    assert by_line[8] == "'answer' must be a string, got int"
    assert "nothing after '####'" in by_line[9]
    assert "not valid UTF-8" in by_line[11]
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [r["extra_info"]["index"] for r in rows] == [0, 8]  # source record positions (blank line not counted)


def test_custom_instruction_source_and_progress(tmp_path):
    src = write_lines(tmp_path / "raw.jsonl", [GOOD] * 3)
    calls: list[tuple[int, int]] = []
    result = convert_gsm8k(src, tmp_path / "sub" / "dir" / "out.jsonl", instruction=" Answer:",
                           data_source="gsm8k-mini", progress=lambda done, total: calls.append((done, total)))
    assert tuple(result) == (3, [])
    row = read_jsonl(tmp_path / "sub" / "dir" / "out.jsonl")[0]
    assert row["prompt"][0]["content"] == GOOD["question"] + " Answer:"
    assert row["data_source"] == "gsm8k-mini"
    size = src.stat().st_size
    assert len(calls) == 3 and calls[-1] == (size, size)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_atomic_write_leaves_no_partial_output(tmp_path):
    src = write_lines(tmp_path / "raw.jsonl", [GOOD] * 5)
    out = tmp_path / "out.jsonl"
    out.write_text("previous content\n")

    def boom(done, total):
        if done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_gsm8k(src, out, progress=boom)
    assert out.read_text() == "previous content\n"  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "raw.jsonl"]  # no temp file left
    convert_gsm8k(src, out)
    assert len(read_jsonl(out)) == 5


def test_output_permissions_are_not_private(tmp_path):
    src = write_lines(tmp_path / "raw.jsonl", [GOOD])
    out = tmp_path / "out.jsonl"
    convert_gsm8k(src, out)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask


def test_missing_input_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert_gsm8k(tmp_path / "nope.jsonl", tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_helpers():
    assert extract_ground_truth("a #### b\n#### 1,234") == "1234"
    with pytest.raises(ValueError):
        extract_ground_truth("no marker")
    assert convert_record(GOOD, 5)["extra_info"]["index"] == 5


def test_real_gsm8k_rows_round_trip_through_the_judger(tmp_path):
    raw = RAW / "test.jsonl"
    out = tmp_path / "gsm8k_test.jsonl"
    result = convert_gsm8k(raw, out)
    n_lines = sum(1 for line in raw.read_text(encoding="utf-8").splitlines() if line.strip())
    assert (result.written, result.skipped) == (n_lines, []) and n_lines == 42
    rows = read_jsonl(out)
    assert rows[0]["reward_model"]["ground_truth"] == "18"
    assert [r["reward_model"]["ground_truth"] for r in rows[-2:]] == ["2125", "114200"]  # separators dropped
    assert all(r["data_source"] == DATA_SOURCE for r in rows)
    # the reference solution of every problem is judged correct against the converted label
    judger = GSM8KJudger(GSM8KJudger.Config(search_last_chars=0))
    for r in rows:
        answer = r["extra_info"]["answer"]
        s = Sample(uid=0, group_id=0, task_name="t", prompt_ids=[1], response=answer,
                   label=r["reward_model"]["ground_truth"], status=Status.COMPLETED)
        assert judger.judge(answer, s.label, s)["acc"] is True, r["extra_info"]["index"]
