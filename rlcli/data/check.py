"""``rlcli data check``: read every row of a dataset as training would, before any run.

A training run skips a bad row and lists it in ``skipped_rows.jsonl``; ``rlcli validate`` reads
only up to the first usable row. This reads all of them, with the reader the recipe's sampler
would use for that path (``jsonl``, ``parquet``, ``hf_dataset``, chosen as :func:`sampler_for`
says), and the same checks (:mod:`rlcli.data.rows`), so that a dataset can be mended before a run
rather than found wanting in one. Prompt lengths are not checked here (they need the model's
tokenizer and chat template): a run checks them when it starts, before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rlcli.data.rows import Row, SkippedRow, summarize
from rlcli.data.sampler import HfDatasetSampler, JsonlSampler, ParquetSampler, RowSampler


@dataclass
class DatasetCheck:
    """What reading every row of ``path`` found."""

    path: str
    sampler: str  # the sampler whose reader was used
    usable: int = 0
    skipped: list[SkippedRow] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.usable + len(self.skipped)

    def summary(self) -> str:
        if not self.rows:
            return f"{self.path}: no rows (the dataset is empty or blank) [read as the {self.sampler} sampler reads it]"
        text = f"{self.path}: {self.rows} row{'s' * (self.rows != 1)}, {self.usable} usable"
        if self.skipped:
            text += f", {len(self.skipped)} would be skipped ({summarize(self.skipped)})"
        return text + f" [read as the {self.sampler} sampler reads it]"


def sampler_for(path: Path) -> type[RowSampler]:
    """The sampler a recipe would name for ``path``: ``jsonl`` for a .jsonl file, ``parquet`` for a
    .parquet file, else ``hf_dataset`` (a ``save_to_disk`` directory, a folder of data files, or
    one data file that ``datasets.load_dataset`` reads)."""
    if path.is_file() and path.suffix == ".jsonl":
        return JsonlSampler
    if path.is_file() and path.suffix == ".parquet":
        return ParquetSampler
    return HfDatasetSampler


def check_dataset(path: str | Path, *, require_label: bool = True, split: str = "train",
                  progress: Callable[[int], None] | None = None) -> DatasetCheck:
    """Every row of ``path``, counted usable or skipped (with its ``file:line`` and reason), with the
    samplers' default row-size limit. Raises ``OSError`` or :class:`~rlcli.data.base.DataError` when
    the dataset itself cannot be read."""
    path = Path(path)
    cls = sampler_for(path)
    options: dict = {"path": str(path), "require_label": require_label}
    if cls is HfDatasetSampler:
        options["split"] = split
    result = DatasetCheck(str(path), cls.name)
    for r in cls.read(path, cls.Config(**options)):
        if isinstance(r, Row):
            result.usable += 1
        else:
            result.skipped.append(r)
        if progress is not None:
            progress(1)
    return result
