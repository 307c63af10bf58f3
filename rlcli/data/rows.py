"""Reading RL rows one by one: every bad row is located (``file:line``), skipped and given its
reason; nothing in a row can stop the reading.

A source turns its rows into records (:data:`Record`: a number and the row's JSON text): a JSONL
file one per non-blank line, numbered by line (:func:`jsonl_records`); a parquet file or a Hugging
Face dataset one per table row, counted from 1 (:mod:`rlcli.data.tables`). Every source's records
then take the same path (:func:`parse_records`), so all formats are checked, located, skipped and
counted alike. A record is a usable :class:`Row` when it passes, in this order:

``size``          at most ``max_row_bytes`` bytes (default 1 MiB); a longer line is skipped without
                  being read into memory whole
``encoding``      valid UTF-8 (a byte-order mark on the first line is allowed)
``json``          valid JSON, whose integers Python can read (at most 4,300 digits by default)
``shape``         an object whose ``prompt`` is a string or a non-empty list of ``{role, content}``
                  messages, with a string ``data_source`` and object ``reward_model`` / ``extra_info``
``encoding``      no message role or content holds a lone surrogate (a ``\\ud800`` escape, valid
                  JSON but not text: no tokenizer reads it)
``empty_prompt``  some non-system message has non-blank content
``no_label``      ``reward_model.ground_truth`` is present and not blank (with ``require_label``)

Otherwise the reader yields a :class:`SkippedRow` with that ``kind``. Blank lines are not rows. A
table row holding a value JSON cannot (bytes, a timestamp) is a ``json`` row.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Union

DEFAULT_MAX_ROW_BYTES = 1 << 20  # 1 MiB: GSM8K rows are about 1 KB, a 100k-token prompt about 400 KB
_CHUNK = 1 << 16


class SkippedRow(NamedTuple):
    """A row left out of a dataset: where it is, what kind of problem (see the module doc), why."""

    file: str
    line: int
    kind: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


class Row(NamedTuple):
    """A usable row: its line number and its parsed fields."""

    line: int
    messages: list[dict]
    data_source: str
    reward_model: dict
    extra_info: dict


class _Bad(ValueError):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


# One row as read from its source, before any check: its number (the JSONL line, or the table row
# counted from 1) and its JSON text, or what already makes it unusable (a line too long to read).
Record = tuple[int, Union[bytes, _Bad]]


def bad_record(kind: str, reason: str) -> _Bad:
    """A record a source cannot turn into JSON text (``kind`` as in the module doc)."""
    return _Bad(kind, reason)


def _encodable(text: str, what: str) -> str:
    """``text``, if UTF-8 can encode it; JSON's ``\\ud800`` escapes can make a lone surrogate, which
    no tokenizer reads (it would fail the whole file's batch), so such a row is an ``encoding`` row."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _Bad("encoding", f"{what} holds {text[exc.start]!r} at character {exc.start}, a lone surrogate "
                       "(a \\ud800-\\udfff escape not in a valid pair), which is not text and cannot be "
                       "encoded as UTF-8") from None
    return text


def _messages(prompt: Any) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": _encodable(prompt, "'prompt'")}]
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return [{"role": _encodable(m["role"], f"the role of message {i}"),
                 "content": _encodable(m["content"], f"the content of message {i}")} for i, m in enumerate(prompt)]
    raise _Bad("shape", "'prompt' must be a string or a non-empty list of {role, content} messages")


def parse_row(obj: Any, require_label: bool = True) -> tuple[list[dict], str, dict, dict]:
    """``(messages, data_source, reward_model, extra_info)`` of one decoded JSON row; ``ValueError``
    (with a ``kind``) saying what is wrong."""
    if not isinstance(obj, dict):
        raise _Bad("shape", f"expected a JSON object, got {type(obj).__name__}")
    messages = _messages(obj.get("prompt"))
    data_source = obj.get("data_source", "")
    if not isinstance(data_source, str):
        raise _Bad("shape", "'data_source' must be a string")
    reward_model = obj.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise _Bad("shape", "'reward_model' must be an object")
    extra = obj.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise _Bad("shape", "'extra_info' must be an object")
    if not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise _Bad("empty_prompt", "empty prompt (no message with text besides system messages)")
    label = reward_model.get("ground_truth")
    if require_label and (label is None or (isinstance(label, str) and not label.strip())):
        raise _Bad("no_label", "no label: reward_model.ground_truth is missing or blank (set the sampler's "
                   "require_label: false for a judger that needs none)")
    return messages, data_source, reward_model, extra


def _lines(f, max_bytes: int | None) -> Iterator[tuple[int, bytes | None, int]]:
    """``(line number, bytes, size)`` of every line; ``bytes`` is None for a line over ``max_bytes``,
    which is skipped in chunks (never held whole)."""
    lineno = 0
    while True:
        line = f.readline() if max_bytes is None else f.readline(max_bytes + 1)
        if not line:
            return
        lineno += 1
        if max_bytes is None or len(line.rstrip(b"\n")) <= max_bytes:
            yield lineno, line, len(line)
            continue
        size = len(line)
        while not line.endswith(b"\n"):
            line = f.readline(_CHUNK)
            if not line:
                break
            size += len(line)
        yield lineno, None, size - line.endswith(b"\n")


def _too_long(size: int, max_row_bytes: int | None) -> _Bad:
    return _Bad("size", f"row of {size:,} bytes is longer than max_row_bytes={max_row_bytes:,} "
                "(raise the sampler's max_row_bytes to keep such rows)")


def jsonl_records(f, max_row_bytes: int | None) -> Iterator[Record]:
    """The records of a JSONL file opened in binary: one per non-blank line, numbered by line."""
    for lineno, line, size in _lines(f, max_row_bytes):
        if line is None:
            yield lineno, _too_long(size, max_row_bytes)
        elif line.strip():
            yield lineno, line


def _decode(line: bytes, first: bool) -> str:
    try:
        return line.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as exc:
        raise _Bad("encoding", f"not valid UTF-8 ({exc.reason} at byte {exc.start} of the line: "
                   f"{line[exc.start:exc.start + 4]!r}); the file must be UTF-8") from None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Bad("json", f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise _Bad("json", "invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer longer than Python's int-string limit (4,300 digits by default)
        raise _Bad("json", f"unreadable JSON ({str(exc).split(';')[0]})") from None


def decode_records(records: Iterable[Record], where: str, *,
                   max_row_bytes: int | None = DEFAULT_MAX_ROW_BYTES) -> Iterator[tuple[int, Any] | SkippedRow]:
    """``(number, decoded JSON value)`` of every record, or a :class:`SkippedRow` (size, encoding, json)."""
    for n, data in records:
        try:
            if isinstance(data, _Bad):
                raise data
            size = len(data.rstrip(b"\n"))
            if max_row_bytes is not None and size > max_row_bytes:
                raise _too_long(size, max_row_bytes)
            obj = _loads(_decode(data, n == 1))
        except _Bad as bad:
            yield SkippedRow(where, n, bad.kind, str(bad))
        else:
            yield n, obj


def parse_records(records: Iterable[Record], where: str, *, max_row_bytes: int | None = DEFAULT_MAX_ROW_BYTES,
                  require_label: bool = True) -> Iterator[Row | SkippedRow]:
    """Every record of a source as a :class:`Row` or a :class:`SkippedRow` (the module doc's checks).

    This is the one path every dataset format takes once its rows are read; ``where`` names the
    file in the skipped rows.
    """
    for item in decode_records(records, where, max_row_bytes=max_row_bytes):
        if isinstance(item, SkippedRow):
            yield item
            continue
        n, obj = item
        try:
            yield Row(n, *parse_row(obj, require_label))
        except _Bad as bad:
            yield SkippedRow(where, n, bad.kind, str(bad))


def read_rows(path: str | Path, *, max_row_bytes: int | None = DEFAULT_MAX_ROW_BYTES,
              require_label: bool = True) -> Iterator[Row | SkippedRow]:
    """Every row of the JSONL file ``path`` in file order, each a :class:`Row` or a :class:`SkippedRow`.

    ``OSError`` only when the file cannot be opened or read; a bad row never raises.
    """
    with open(path, "rb") as f:
        yield from parse_records(jsonl_records(f, max_row_bytes), str(path), max_row_bytes=max_row_bytes,
                                 require_label=require_label)


def first_usable(rows: Iterable[Row | SkippedRow]) -> tuple[Row | None, list[SkippedRow]]:
    """The first usable row (None if there is none) and the rows skipped before it."""
    skipped: list[SkippedRow] = []
    for r in rows:
        if isinstance(r, Row):
            return r, skipped
        skipped.append(r)
    return None, skipped


def first_usable_row(path: str | Path, **limits: Any) -> tuple[Row | None, list[SkippedRow]]:
    """The first usable row of the JSONL file ``path`` and the rows skipped before it."""
    return first_usable(read_rows(path, **limits))


def summarize(skipped: list[SkippedRow]) -> str:
    """``"3 encoding, 1 no_label"``: the skipped rows counted by kind, most frequent first."""
    return ", ".join(f"{n} {kind}" for kind, n in Counter(s.kind for s in skipped).most_common())


def no_usable_row_message(path: str | Path, skipped: list[SkippedRow], shown: int = 3) -> str:
    """Why ``path`` has no usable row, locating the first ``shown`` bad rows."""
    if not skipped:
        return f"{path} holds no rows (the file is empty or blank): every task needs at least one usable row"
    first = "; ".join(str(s) for s in skipped[:shown])
    more = f"; and {len(skipped) - shown} more" if len(skipped) > shown else ""
    return f"no usable row in {path}: all {len(skipped)} rows are bad ({summarize(skipped)}): {first}{more}"
