"""Rows from tables: verl-format parquet files and Hugging Face datasets, as records for
:func:`rlcli.data.rows.parse_records`, and the JSONL <-> parquet conversion of ``rlcli data convert``.

verl's schema is read as is: ``data_source``, ``prompt`` (a list of ``{role, content}`` messages,
or a string), ``ability``, ``reward_model`` (``{style, ground_truth}``) and ``extra_info``. Each
table row becomes its JSON text and then takes the same checks as a JSONL line, numbered from 1
(the first row is row 1, as the first line of a JSONL file; pandas' index is one less).

pyarrow and datasets are optional (``pip install 'rlcli[data]'``) and imported only here, when a
table is read.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from rlcli.data.base import DataError
from rlcli.fsutil import replace_via_tmp
from rlcli.data.rows import (
    DEFAULT_MAX_ROW_BYTES, Record, SkippedRow, bad_record, decode_records, jsonl_records, parse_row,
)

EXTRA = "rlcli[data]"
FIELDS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
_BATCH = 1024
# load_dataset's builder for a data file, by suffix
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


def optional(module: str, what: str) -> Any:
    """Import ``module`` or raise :class:`DataError` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise DataError(f"{what} needs {top}, which is not installed: pip install '{EXTRA}' "
                        f"(or pip install {top})") from None


def _record(obj: dict) -> bytes | Any:
    try:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        return bad_record("json", f"the row holds a value that is not JSON data ({exc})")


def _arrow_records(batches: Iterable[Any]) -> Iterator[Record]:
    """One record per row of a stream of pyarrow record batches (or tables), numbered from 1."""
    n = 0
    for batch in batches:
        for obj in batch.to_pylist():
            n += 1
            yield n, _record(obj)


def _columns(names: list[str], where: Path, all_columns: bool) -> list[str] | None:
    if "prompt" not in names:
        raise DataError(f"{where} has no 'prompt' column (columns: {', '.join(names) or 'none'}); rlcli reads "
                        f"verl's schema: {', '.join(FIELDS)}")
    return None if all_columns else [c for c in names if c in FIELDS]


def parquet_records(path: str | Path, *, all_columns: bool = False) -> Iterator[Record]:
    """The rows of a parquet file, read in batches; only verl's columns unless ``all_columns``."""
    pq = optional("pyarrow.parquet", "reading parquet")
    try:
        f = pq.ParquetFile(str(path))
    except OSError as exc:  # pyarrow's ArrowInvalid is a ValueError: not a parquet file
        raise DataError(f"cannot read the parquet file {path}: {exc}") from None
    except ValueError as exc:
        raise DataError(f"{path} is not a parquet file ({exc})") from None
    cols = _columns(f.schema_arrow.names, Path(path), all_columns)
    yield from _arrow_records(f.iter_batches(batch_size=_BATCH, columns=cols))


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset(Dict).save_to_disk``."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def load_hf_dataset(path: str | Path, split: str) -> Any:
    """``path``'s ``split`` as a ``datasets.Dataset``: a ``save_to_disk`` directory
    (``load_from_disk``), a directory of data files or one data file (``load_dataset``)."""
    datasets = optional("datasets", "the hf_dataset sampler")
    p = Path(path)
    try:
        if p.is_dir() and is_saved_dataset(p):
            ds = datasets.load_from_disk(str(p))
        elif p.is_dir():
            ds = datasets.load_dataset(str(p), split=split)
        elif p.suffix in _BUILDERS:
            ds = datasets.load_dataset(_BUILDERS[p.suffix], data_files={split: str(p)}, split=split)
        else:
            raise DataError(f"{p}: not a saved dataset directory nor a data file datasets reads by its "
                            f"suffix ({', '.join(sorted(_BUILDERS))})")
    except (OSError, ValueError, getattr(datasets.exceptions, "DatasetsError", OSError)) as exc:
        if isinstance(exc, DataError):
            raise
        cause = ""
        if exc.__cause__ is not None:  # datasets wraps the reason (a cast error's first line names the files)
            first = (str(exc.__cause__).splitlines() or [""])[0][:300]
            cause = f" ({type(exc.__cause__).__name__}: {first})"
        raise DataError(f"cannot load the dataset {p} (split {split!r}): {type(exc).__name__}: {exc}{cause}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{p} has no split {split!r} (splits: {', '.join(ds)}); set the sampler's split")
        ds = ds[split]
    return ds


def hf_dataset_records(path: str | Path, split: str = "train") -> Iterator[Record]:
    """The rows of one split of a Hugging Face dataset (verl's columns only)."""
    ds = load_hf_dataset(path, split)
    cols = _columns(list(ds.column_names), Path(path), all_columns=False)
    yield from _arrow_records(ds.select_columns(cols).with_format("arrow").iter(batch_size=_BATCH))


# ------------------------------------------------------------------------------- conversion
def _convertible(records: Iterable[Record], where: str) -> tuple[list[dict], list[SkippedRow]]:
    """The rows a sampler could use (labels optional), each with its prompt as a message list, and
    the rows left out; every other field is kept as it is."""
    rows: list[dict] = []
    skipped: list[SkippedRow] = []
    for item in decode_records(records, where, max_row_bytes=None):
        if isinstance(item, SkippedRow):
            skipped.append(item)
            continue
        n, obj = item
        try:
            messages = parse_row(obj, require_label=False)[0]
        except ValueError as exc:
            skipped.append(SkippedRow(where, n, getattr(exc, "kind", "shape"), str(exc)))
            continue
        rows.append({**obj, "prompt": messages})
    return rows, skipped


def jsonl_to_parquet(src: str | Path, dst: str | Path) -> tuple[int, list[SkippedRow]]:
    """Write the usable rows of a JSONL file as a verl-format parquet file; (rows written, rows left out)."""
    pa = optional("pyarrow", "writing parquet")
    pq = optional("pyarrow.parquet", "writing parquet")
    with open(src, "rb") as f:
        rows, skipped = _convertible(jsonl_records(f, DEFAULT_MAX_ROW_BYTES), str(src))
    for key in {k for r in rows for k in r}:  # an empty object everywhere: parquet has no empty struct
        if all(r.get(key, {}) == {} for r in rows):
            for r in rows:
                r.pop(key, None)
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise DataError(f"{src}: the rows cannot form one table (a field has different types in different "
                        f"rows?): {exc}") from None
    dst = Path(dst)
    replace_via_tmp(dst, lambda tmp: pq.write_table(table, str(tmp)))
    return len(rows), skipped


def parquet_to_jsonl(src: str | Path, dst: str | Path) -> tuple[int, list[SkippedRow]]:
    """Write the usable rows of a parquet file (every column) as RL JSONL; (rows written, rows left out)."""
    rows, skipped = _convertible(parquet_records(src, all_columns=True), str(src))
    dst = Path(dst)

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)

    replace_via_tmp(dst, write)
    return len(rows), skipped
