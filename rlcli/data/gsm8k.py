"""Convert raw GSM8K (``{"question", "answer": "... #### 72"}`` per line) to rlcli's RL JSONL.

Each output line::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": question + instruction}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"index": i, "answer": <the full worked answer>, "question": question}}

``index`` is the 0-based position of the record in the input (blank lines are not records), so a
converted line can be traced back to its source even when others were skipped. The ground truth
is the text after the last ``####`` with thousands separators removed ("1,200" -> "1200").

A malformed line (bad JSON, missing or empty fields, no ``####`` answer) is skipped and reported
as ``file:line: reason`` in the returned ``skipped`` list; it never aborts the conversion, but a
file with no usable line at all raises :class:`~rlcli.data.base.DataError` and writes nothing. The
output is written atomically: a temporary file in the target directory, renamed into place at the
end.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

__all__ = ["DATA_SOURCE", "DEFAULT_INSTRUCTION", "ConvertResult", "convert_gsm8k", "convert_record", "extract_ground_truth"]

DATA_SOURCE = "openai/gsm8k"
DEFAULT_INSTRUCTION = (
    "\n\nSolve the problem step by step. On the last line, write the final answer as a plain number "
    'after "####", for example "#### 42".'
)

Progress = Callable[[int, int], None]
"""``progress(bytes_read, total_bytes)``, called as the input is read."""


class ConvertResult(NamedTuple):
    """``(written, skipped)``: rows written, and one ``file:line: reason`` message per skipped line."""

    written: int
    skipped: list[str]


def extract_ground_truth(answer: str) -> str:
    """The final answer after the last ``####`` of a GSM8K solution, without thousands separators."""
    if "####" not in answer:
        raise ValueError("'answer' has no '#### <final answer>'")
    truth = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not truth:
        raise ValueError("'answer' has nothing after '####'")
    return truth


def convert_record(record: object, index: int, instruction: str = DEFAULT_INSTRUCTION,
                   data_source: str = DATA_SOURCE) -> dict:
    """One raw GSM8K record -> one RL record. Raises ValueError saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    question, answer = record.get("question"), record.get("answer")
    for key, value in (("question", question), ("answer", answer)):
        if value is None:
            raise ValueError(f"missing '{key}'")
        if not isinstance(value, str):
            raise ValueError(f"'{key}' must be a string, got {type(value).__name__}")
        if not value.strip():
            raise ValueError(f"'{key}' is empty")
    assert isinstance(question, str) and isinstance(answer, str)
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question + instruction}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_ground_truth(answer)},
        "extra_info": {"index": index, "answer": answer, "question": question},
    }


def convert_gsm8k(
    in_path: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    instruction: str = DEFAULT_INSTRUCTION,
    data_source: str = DATA_SOURCE,
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert a raw GSM8K JSONL file; returns ``(written, skipped)``, ``skipped`` being the messages.

    Raises ``FileNotFoundError`` / ``OSError`` only for an unreadable input or unwritable output;
    malformed lines are skipped. The output directory is created when missing.
    """
    src, dst = Path(in_path), Path(out_path)
    total = src.stat().st_size
    dst.parent.mkdir(parents=True, exist_ok=True)
    written = index = 0
    skipped: list[str] = []
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out, src.open("rb") as raw:
            done = 0
            for lineno, line_bytes in enumerate(raw, start=1):
                done += len(line_bytes)
                if line_bytes.strip():
                    try:
                        record = convert_record(_loads(line_bytes), index, instruction, data_source)
                    except ValueError as exc:
                        skipped.append(f"{src}:{lineno}: {exc}")
                    else:
                        out.write(json.dumps(record, ensure_ascii=False) + "\n")
                        written += 1
                    index += 1
                if progress is not None:
                    progress(done, total)
            out.flush()
            os.fsync(out.fileno())
        if not written:
            from rlcli.data.base import DataError

            empty = DataError(f"{src}: no usable GSM8K row ({len(skipped)} malformed); nothing written to {dst}")
            empty.skipped = skipped  # type: ignore[attr-defined]
            raise empty
        os.chmod(tmp_name, _file_mode(dst))
        os.replace(tmp_name, dst)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        raise
    return ConvertResult(written, skipped)


def _loads(line: bytes) -> object:
    try:
        text = line.decode("utf-8-sig")  # tolerate a byte-order mark
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None


def _file_mode(existing: Path) -> int:
    """Keep an existing output's permissions; else the usual 0666 & ~umask (mkstemp uses 0600)."""
    try:
        return existing.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0o022)
        os.umask(umask)
        return 0o666 & ~umask
