"""Where training rows come from: folders of files (``--train_file DIR``, ``--validation_file DIR``), dataset
folders and their splits (``--dataset_name`` with ``--dataset_config`` / ``--dataset_split``), and the errors that name
the option, the value and what is allowed. The Hub cannot be reached here: a Hub id must fail with a message, not a
traceback."""

from __future__ import annotations

import logging
import os

import pytest
from train_fixtures import build_tiny_lm_dir, build_char_tokenizer, copy_task_rows, write_jsonl

from hf_lisa.errors import UsageError
from hf_lisa.data.pipeline import DataError, check_data, load_raw_datasets, tokenize_datasets
from hf_lisa.data.sources import check_source_arguments, folder_files
from hf_lisa.data.training_data import load_training_data

pytestmark = pytest.mark.usefixtures("one_thread")

CHAT = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}
        for i in range(6)]


def _load(**options):
    data = load_training_data(seed=0, **options)
    formats = data.check(lambda raw: check_data(raw, 64))
    return data, formats


def _prompts(ds) -> list[str]:
    return [row["prompt"] for row in ds]


# -- folders -----------------------------------------------------------------------------------------------------------
def test_a_folder_reads_every_data_file_in_name_order_and_ignores_hidden_files(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(9)]
    write_jsonl(tmp_path / "d" / "b.jsonl", rows[3:6])
    write_jsonl(tmp_path / "d" / "a.json", rows[:3])  # .json and .jsonl: one format
    write_jsonl(tmp_path / "d" / "c.jsonl", rows[6:])
    (tmp_path / "d" / ".hidden.jsonl").write_text("not json at all\n")
    (tmp_path / "d" / ".DS_Store").write_bytes(b"\x00\x01")
    assert [os.path.basename(p) for p in folder_files(str(tmp_path / "d"), "train_file")] == [
        "a.json", "b.jsonl", "c.jsonl"]
    data, formats = _load(train_file=str(tmp_path / "d"), validation_split_percentage=0)
    (source,) = data.sources
    assert formats == ["prompt_completion"] and len(source.parts) == 3 and data.held_out == 0
    assert [p for part in source.parts for p in _prompts(part["train"])] == [r["prompt"] for r in rows]


def test_a_folder_holds_out_a_percentage_of_all_its_rows_seeded(tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", copy_task_rows(30, seed=1))
    write_jsonl(tmp_path / "d" / "b.jsonl", copy_task_rows(10, seed=2))
    first, _ = _load(train_file=str(tmp_path / "d"), validation_split_percentage=10)
    again, _ = _load(train_file=str(tmp_path / "d"), validation_split_percentage=10)
    parts = first.sources[0].parts
    assert first.held_out == 4 == sum(len(p.get("validation", [])) for p in parts)  # 10 % of 40, rounded up
    assert sum(len(p.get("train", [])) for p in parts) == 36
    assert [[dict(r) for r in p.get("validation", [])] for p in parts] == [
        [dict(r) for r in p.get("validation", [])] for p in again.sources[0].parts]


def test_a_skipped_row_of_a_folder_is_named_by_its_file_and_line(tmp_path, caplog):
    write_jsonl(tmp_path / "d" / "a.jsonl", copy_task_rows(3))
    write_jsonl(tmp_path / "d" / "b.jsonl", copy_task_rows(2) + [{"prompt": "x", "completion": ""}])
    data, _ = _load(train_file=str(tmp_path / "d"), validation_split_percentage=0)
    with caplog.at_level(logging.WARNING):
        tokenized, report = data.tokenize(lambda raw: tokenize_datasets(raw, build_char_tokenizer(), 64))
    assert report.kept == {"train": 5} and report.skipped == {"train": {"empty completion": 1}}
    assert f"Skipped 1 of 3 train rows (train_file={str(tmp_path / 'd' / 'b.jsonl')!r})" in caplog.text
    assert len(tokenized["train"]) == 5
    with pytest.raises(DataError, match=r"b.jsonl', line 3: 'completion' is empty"):
        data.tokenize(lambda raw: tokenize_datasets(raw, build_char_tokenizer(), 64, on_bad_row="error"))


def test_a_validation_folder_gives_the_validation_rows(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", copy_task_rows(8))
    write_jsonl(tmp_path / "val" / "1.jsonl", copy_task_rows(2, seed=3))
    write_jsonl(tmp_path / "val" / "2.jsonl", copy_task_rows(3, seed=4))
    data, formats = _load(train_file=train, validation_file=str(tmp_path / "val"))
    tokenized, report = data.tokenize(lambda raw: tokenize_datasets(raw, build_char_tokenizer(), 64))
    assert formats == ["prompt_completion"] and data.held_out == 0  # nothing held out of train
    assert report.kept == {"train": 8, "validation": 5}


@pytest.mark.parametrize("files, message", [
    ({}, r"train_file='.*d' is a folder without data files; allowed: .jsonl, .json, .csv, .parquet, .txt"),
    ({".only-hidden.jsonl": '{"text": "x"}\n'}, r"is a folder without data files"),
    ({"a.jsonl": '{"text": "x"}\n', "b.csv": "text\nx\n"},
     r"train_file='.*d' mixes file formats \(json: a.jsonl; csv: b.csv\); a folder holds files of one format"),
    ({"a.jsonl": '{"text": "x"}\n', "README.md": "# data"},
     r"holds files of an unsupported type: README.md; allowed: .jsonl.*a dataset folder with a README goes to "
     r"--dataset_name"),
    ({"a.jsonl": '{"text": "x"}\n', "b.jsonl": ""}, r"train_file='.*b.jsonl' is empty"),
])
def test_bad_folders_are_refused_naming_the_folder_and_files(tmp_path, files, message):
    folder = tmp_path / "d"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    with pytest.raises(DataError, match=message):
        load_training_data(train_file=str(folder))


def test_files_of_two_formats_in_one_folder_are_refused_naming_both(tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", copy_task_rows(3))
    write_jsonl(tmp_path / "d" / "b.jsonl", CHAT)
    with pytest.raises(DataError, match=r"b.jsonl' is chat data but .*a.jsonl' is prompt/completion data; the files "
                                        r"of train_file='.*d' must have one format"):
        _load(train_file=str(tmp_path / "d"), validation_split_percentage=0)


def test_a_sub_folder_is_not_read_and_a_warning_says_so(tmp_path, caplog):
    write_jsonl(tmp_path / "d" / "a.jsonl", copy_task_rows(3))
    write_jsonl(tmp_path / "d" / "old" / "b.jsonl", copy_task_rows(3))
    with caplog.at_level(logging.WARNING):
        assert [os.path.basename(p) for p in folder_files(str(tmp_path / "d"), "train_file")] == ["a.jsonl"]
    assert "its sub-folders are not read: old" in caplog.text


def test_a_dataset_folder_given_as_train_file_warns_that_its_test_file_trains(dataset_folder, caplog):
    with caplog.at_level(logging.WARNING):
        folder_files(dataset_folder, "train_file")
    assert "every file of a folder trains, test.jsonl included" in caplog.text and "--dataset_name" in caplog.text


# -- dataset folders and splits ----------------------------------------------------------------------------------------
@pytest.fixture
def dataset_folder(tmp_path):
    """A local dataset folder as the Hub lays one out: a train and a test file."""
    write_jsonl(tmp_path / "ds" / "train.jsonl", copy_task_rows(10, seed=5))
    write_jsonl(tmp_path / "ds" / "test.jsonl", copy_task_rows(3, seed=6))
    return str(tmp_path / "ds")


def test_a_dataset_folder_trains_on_its_train_split_and_validates_on_its_test_split(dataset_folder, tmp_path):
    raw = load_raw_datasets(dataset_name=dataset_folder, cache_dir=str(tmp_path / "cache"), line_numbers=True)
    assert {split: len(ds) for split, ds in raw.items()} == {"train": 10, "validation": 3}
    data, _ = _load(dataset_name=dataset_folder, cache_dir=str(tmp_path / "cache"))
    assert data.held_out == 0 and data.sources[0].label == f"dataset_name={dataset_folder!r}"
    assert _prompts(data.sources[0].parts[0]["validation"]) == [r["prompt"] for r in copy_task_rows(3, seed=6)]


def test_dataset_split_chooses_the_training_split(tmp_path):
    import datasets

    saved = str(tmp_path / "saved")
    datasets.DatasetDict({
        "train_sft": datasets.Dataset.from_list(copy_task_rows(20, seed=7)),
        "train_gen": datasets.Dataset.from_list(copy_task_rows(4, seed=8)),
    }).save_to_disk(saved)
    data, _ = _load(dataset_name=saved, dataset_split="train_sft", validation_split_percentage=10,
                    cache_dir=str(tmp_path / "cache"))
    part = data.sources[0].parts[0]
    assert (len(part["train"]), len(part["validation"])) == (18, 2) and data.held_out == 2  # no validation split
    with pytest.raises(DataError, match=r"dataset_split='train' is not a split of dataset_name='.*saved'; its splits: "
                                        r"train_sft, train_gen"):
        load_training_data(dataset_name=saved, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"a folder written by save_to_disk has no configurations"):
        load_training_data(dataset_name=saved, dataset_config_name="main", dataset_split="train_sft")


def test_a_missing_dataset_folder_is_named_without_asking_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"dataset_name='.*nope' does not exist: no such folder, and not a Hub "
                                                 r"id"):
        load_training_data(dataset_name=str(tmp_path / "nope"))


def test_an_unknown_config_is_named(dataset_folder, tmp_path):
    with pytest.raises(DataError, match=r"Could not load dataset_name='.*ds' \(dataset_config='nope'\): ValueError: "
                                        r"BuilderConfig 'nope' not found"):
        load_training_data(dataset_name=dataset_folder, dataset_config_name="nope", cache_dir=str(tmp_path / "c"))


@pytest.fixture
def offline(monkeypatch):
    import datasets
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def test_a_hub_id_offline_fails_with_a_message_not_a_traceback(offline, tmp_path, capsys):
    from hf_lisa import cli

    with pytest.raises(DataError, match=r"Could not load dataset_name='someone/some-dataset': ConnectionError: .* A "
                                        r"Hub id needs network access"):
        load_training_data(dataset_name="someone/some-dataset", cache_dir=str(tmp_path / "c"))
    model = build_tiny_lm_dir(tmp_path / "model", num_layers=2)
    status = cli.main(["train", "--model_name_or_path", model, "--dataset_name", "someone/some-dataset",
                       "--dataset_config", "main", "--output_dir", str(tmp_path / "out"), "--report_to", "none",
                       "--use_cpu", "true", "--max_steps", "1"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert "hf-lisa train: error: Could not load dataset_name='someone/some-dataset' (dataset_config='main')" in err


# -- the options together ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--dataset_split", "test"], r"--dataset_split='test' needs --dataset_name"),
    (["--dataset_config", "main"], r"--dataset_config='main' needs --dataset_name"),
    (["--dataset_name", "a/b", "--train_file", "x.jsonl"],
     r"--dataset_name='a/b' and --train_file='x.jsonl' both name the training data; pass one"),
    (["--dataset_name", "a/b", "--dataset_split", ""], r"--dataset_split='' is invalid; allowed: one name"),
    (["--train_file", "a.jsonl:0"], r"--train_file: the weight of 'a.jsonl' is '0'"),
])
def test_source_options_are_checked_before_anything_loads(argv, message, tmp_path):
    from hf_lisa.train import parse_args

    with pytest.raises(UsageError, match=message):
        parse_args(["--output_dir", str(tmp_path / "out"), "--report_to", "none", *argv])


def test_check_source_arguments_accepts_a_dataset_with_a_split():
    from hf_lisa.train import DataArguments

    check_source_arguments(DataArguments(dataset_name="a/b", dataset_config_name="main", dataset_split="train_sft"))
    check_source_arguments(DataArguments(train_file="a.jsonl:0.7,b/:0.3"))
