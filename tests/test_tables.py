"""The parquet and hf_dataset samplers read the same rows as the JSONL sampler (one code path after
reading), locate bad rows by file and row, and train alike; `rlcli data convert` round-trips."""

import json
import sys

import pytest
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.data.base import DataError
from rlcli.data.sampler import HfDatasetSampler, HfDatasetSamplerConfig, JsonlSampler, JsonlSamplerConfig, \
    ParquetSampler, ParquetSamplerConfig

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")


def sampler(cls, path, tok, **kw):
    cfg = {JsonlSampler: JsonlSamplerConfig, ParquetSampler: ParquetSamplerConfig,
           HfDatasetSampler: HfDatasetSamplerConfig}[cls]
    return cls(cfg(path=str(path), prompt_repeat_k=2, **kw), tokenizer=tok, task_name="t", seed=3)


@pytest.fixture(scope="module")
def tok():
    from rlcli.tokenizer import load_tokenizer

    return load_tokenizer("builtin:digits")


@pytest.fixture(scope="module")
def arith(repo, tmp_path_factory):
    """The quickstart's JSONL as verl parquet (through `rlcli data convert`) and as a saved dataset."""
    d = tmp_path_factory.mktemp("tables")
    src = repo / "recipes" / "data" / "arith.jsonl"
    out = CliRunner().invoke(cli, ["data", "convert", str(src), str(d / "arith.parquet")])
    assert out.exit_code == 0 and "wrote 100 rows" in out.output, out.output
    rows = [json.loads(x) for x in src.read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(d / "saved"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:10])}).save_to_disk(str(d / "dict"))
    return {"jsonl": src, "parquet": d / "arith.parquet", "saved": d / "saved", "dict": d / "dict"}


def prompts(s):
    return [(p.row, p.messages, p.prompt_ids, p.prompt_text, p.data_source, p.reward_model, p.extra_info)
            for p in s.prompts]


def stream(s, n=120):  # more than one epoch: the reshuffle too
    return [[(x.uid, x.group_id, x.prompt_text, x.label) for x in s.sample_group()] for _ in range(n)]


def test_parquet_and_a_saved_dataset_give_the_jsonl_rows_stream_and_resume(arith, tok, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")  # load_dataset's cache
    ref = sampler(JsonlSampler, arith["jsonl"], tok)
    others = [sampler(ParquetSampler, arith["parquet"], tok), sampler(HfDatasetSampler, arith["saved"], tok),
              sampler(HfDatasetSampler, arith["parquet"], tok)]  # a data file, through load_dataset
    want, groups = prompts(ref), stream(ref)
    assert len(want) == 100 and want[7][1] == [{"role": "user", "content": "0+7="}] and want[7][5]["ground_truth"] == "7"
    for s in others:
        assert prompts(s) == want and stream(s) == groups
    state = ref.state_dict()  # a JSONL run's position resumes on the same rows from parquet
    later = sampler(ParquetSampler, arith["parquet"], tok)
    later.load_state_dict(state)
    assert stream(later, 5) == stream(ref, 5)
    split = sampler(HfDatasetSampler, arith["dict"], tok, split="test")
    assert prompts(split) == want[:10]
    with pytest.raises(DataError, match="no split 'train' \\(splits: test\\)"):
        sampler(HfDatasetSampler, arith["dict"], tok)


def bad_rows():
    good = {"data_source": "arith", "prompt": [{"role": "user", "content": "1+2="}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"i": 0}}
    return [good,
            {**good, "prompt": []},  # shape
            {**good, "prompt": [{"role": "user", "content": "  "}]},  # empty_prompt
            {**good, "reward_model": {"style": "rule", "ground_truth": None}},  # no_label
            {**good, "extra_info": {"i": 10 ** 6, "pad": "x" * 400}},  # size (max_row_bytes=300)
            good]


def test_bad_rows_are_located_by_file_and_row_in_every_format(tmp_path, tok):
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(bad_rows()), tmp_path / "bad.parquet")
    datasets.Dataset.from_list(bad_rows()).save_to_disk(str(tmp_path / "bad"))
    want = [(2, "shape"), (3, "empty_prompt"), (4, "no_label"), (5, "size")]
    for cls, path in ((ParquetSampler, tmp_path / "bad.parquet"), (HfDatasetSampler, tmp_path / "bad")):
        s = sampler(cls, path, tok, max_row_bytes=300)
        assert [(r.file, r.line, r.kind) for r in s.skipped_rows()] == [(str(path), n, k) for n, k in want]
        assert len(s) == 2 and s.pop_stats() == {"data/skipped_rows": 4.0}
        assert str(s.skipped_rows()[2]).startswith(f"{path}:4: no label")
    pq.write_table(pa.Table.from_pylist(bad_rows()[1:4]), tmp_path / "allbad.parquet")
    out = CliRunner().invoke(cli, ["validate", "recipes/quickstart.yaml", "tasks.0.sampler.name=parquet",
                                   f"tasks.0.sampler.path={tmp_path / 'allbad.parquet'}"])
    assert out.exit_code == 2 and f"{tmp_path / 'allbad.parquet'}:1: 'prompt' must be" in out.output, out.output


def test_a_missing_column_or_extra_is_a_clear_data_error(tmp_path, tok, monkeypatch):
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "1+2=", "answer": "3"}]), tmp_path / "qa.parquet")
    with pytest.raises(DataError, match="has no 'prompt' column \\(columns: question, answer\\)"):
        sampler(ParquetSampler, tmp_path / "qa.parquet", tok)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    assert ParquetSampler.check_config(ParquetSamplerConfig(path=str(tmp_path / "qa.parquet"))) == [
        ("path", "reading parquet needs pyarrow, which is not installed: pip install 'rlcli[data]' "
                 "(or pip install pyarrow)")]


def test_convert_round_trips_and_lists_the_rows_it_leaves_out(arith, tmp_path):
    back = tmp_path / "back.jsonl"
    out = CliRunner().invoke(cli, ["data", "convert", str(arith["parquet"]), str(back)])
    assert out.exit_code == 0 and back.read_bytes() == arith["jsonl"].read_bytes(), out.output
    lines = arith["jsonl"].read_text().splitlines()
    (tmp_path / "bad.jsonl").write_text("\n".join([lines[0], "{oops", '{"prompt": ""}', lines[1]]) + "\n")
    out = CliRunner().invoke(cli, ["data", "convert", str(tmp_path / "bad.jsonl"), str(tmp_path / "b.parquet")])
    assert out.exit_code == 0 and "wrote 2 rows" in out.output and "skipped 2 bad rows" in out.output
    assert f"{tmp_path / 'bad.jsonl'}:2: invalid JSON" in out.output and f"{tmp_path / 'bad.jsonl'}:3: empty prompt" \
        in out.output
    out = CliRunner().invoke(cli, ["data", "convert", str(arith["jsonl"]), str(tmp_path / "x.csv")])
    assert out.exit_code == 2 and "from .jsonl to .parquet" in out.output


def test_data_check_reads_every_row_in_every_format_and_lists_the_bad_ones(arith, tmp_path):
    import pyarrow.parquet as pq

    for key in ("jsonl", "parquet", "saved"):
        out = CliRunner().invoke(cli, ["data", "check", str(arith[key])])
        assert out.exit_code == 0 and f"{arith[key]}: 100 rows, 100 usable [read as the" in out.output, out.output
    out = CliRunner().invoke(cli, ["data", "check", str(arith["dict"]), "--split", "test"])
    assert out.exit_code == 0 and ": 10 rows, 10 usable [read as the hf_dataset sampler" in out.output, out.output
    pq.write_table(pa.Table.from_pylist(bad_rows()), tmp_path / "bad.parquet")
    out = CliRunner().invoke(cli, ["data", "check", str(tmp_path / "bad.parquet"), "--show", "2"])
    assert out.exit_code == 1, out.output
    assert "6 rows, 3 usable, 3 would be skipped (1 shape, 1 empty_prompt, 1 no_label)" in out.output
    assert f"{tmp_path / 'bad.parquet'}:2: " in out.output and f"{tmp_path / 'bad.parquet'}:3: " in out.output
    assert f"{tmp_path / 'bad.parquet'}:4: " not in out.output and "and 1 more (--show N" in out.output
    out = CliRunner().invoke(cli, ["data", "check", str(tmp_path / "bad.parquet"), "--no-label"])
    assert out.exit_code == 1 and "4 usable, 2 would be skipped" in out.output, out.output
    (tmp_path / "qa.jsonl").write_text('{"question": "1+2=", "answer": "3"}\n')
    out = CliRunner().invoke(cli, ["data", "check", str(tmp_path / "qa.jsonl")])
    assert out.exit_code == 1 and "1 row, 0 usable, 1 would be skipped (1 shape)" in out.output, out.output
    assert "no row is an RL row" in out.output and "rlcli data gsm8k" in out.output
    mixed = tmp_path / "mixed"  # a folder of data files datasets cannot read as one table
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"x": 1}\n')
    (mixed / "b.jsonl").write_text('{"y": "s", "z": [1]}\n')
    out = CliRunner().invoke(cli, ["data", "check", str(mixed)])
    assert out.exit_code == 2 and f"cannot load the dataset {mixed} (split 'train'): " in out.output, out.output
    assert "Traceback" not in out.output
    (tmp_path / "empty.jsonl").write_text("\n")
    out = CliRunner().invoke(cli, ["data", "check", str(tmp_path / "empty.jsonl")])
    assert out.exit_code == 1 and "no rows (the dataset is empty or blank)" in out.output, out.output


def run_rows(repo, work, *args):
    out = CliRunner().invoke(cli, [
        "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
        "trainer.total_train_steps=3", "trainer.train_batch_size=8", "tasks.0.sampler.prompt_repeat_k=4",
        "trainer.evaluate_step=3", "trainer.enable_initial_evaluate=false", "trainer.checkpoint_interval=-1", *args])
    assert out.exit_code == 0, out.output
    rows = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time" and not k.endswith("_s") and "group_time_" not in k}
            for r in rows]  # clocks aside


def test_training_from_parquet_equals_training_from_jsonl(arith, repo, tmp_path):
    """Identical rows in the same order: the same run, metric for metric (eval accuracy included)."""
    ref = run_rows(repo, tmp_path / "jsonl")
    got = run_rows(repo, tmp_path / "parquet", "tasks.0.sampler.name=parquet", f"tasks.0.sampler.path={arith['parquet']}",
                   "eval.tasks.0.sampler.name=hf_dataset", f"eval.tasks.0.sampler.path={arith['saved']}")
    assert "eval/accuracy" in ref[-1] and "train/loss" in ref[-1] and len(ref[-1]) > 40
    assert got == ref
