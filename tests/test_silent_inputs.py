"""Inputs that ran without a word (issue 33, items 4, 5, 7, 9, 10, 11, 12): each case here either says what happens
or stops, through the real command or the data pipeline it runs (:func:`hf_lisa.cli.main`, :func:`load_training_data`
and ``TrainingData.tokenize`` with a real tokenizer). The table rows of the same items are in
``tests/test_bad_inputs.py``."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time

import pytest
from train_fixtures import build_char_tokenizer, build_tiny_lm_dir, copy_task_rows, write_jsonl

from hf_lisa import cli
from hf_lisa.demo_task import bundled_task_notice
from hf_lisa.train import parse_args
from hf_lisa.data.pipeline import check_data, tokenize_datasets
from hf_lisa.data.sources import mixture_order
from hf_lisa.data.training_data import load_training_data

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_lm_dir(tmp_path_factory.mktemp("silent") / "model", num_layers=3)


class WeightsLoaded(BaseException):
    """Raised where the model's weights would load: the run got that far (a BaseException: no policy catches it)."""


@pytest.fixture
def stop_at_weight_loading(monkeypatch):
    import transformers

    def loaded(*args, **kwargs):
        raise WeightsLoaded

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(loaded))


def _tokenize(data, max_seq_length=64, **kwargs):
    tokenizer = build_char_tokenizer()
    data.check(lambda raw: check_data(raw, max_seq_length))
    return data.tokenize(lambda raw: tokenize_datasets(raw, tokenizer, max_seq_length, load_from_cache_file=False,
                                                       **kwargs))


# -- item 4: YAML null is "not set" ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, rate", [("lora", 1e-3), ("lisa", 3e-4), ("full", 1e-4)])
def test_yaml_null_learning_rate_is_the_methods_default(tmp_path, method, rate):
    config = tmp_path / "run.yaml"
    config.write_text(f"method: {method}\nlearning_rate: null\nlisa_activated_layers: null\n")
    *_, training_args = parse_args([str(config), "--output_dir", str(tmp_path / "out"), "--report_to", "none"])
    assert training_args.learning_rate == rate  # not the Trainer's 5e-5


# -- item 5: the bundled task is announced -----------------------------------------------------------------------------
def test_the_bundled_task_is_named_at_the_start_with_how_to_give_data(model, tmp_path, capsys, stop_at_weight_loading):
    argv = ["train", "--model_name_or_path", model, "--output_dir", str(tmp_path / "out"), "--report_to", "none",
            "--use_cpu", "true", "--demo_train_samples", "20"]
    with pytest.raises(WeightsLoaded):  # the data was read; the model would load next
        cli.main(argv)
    out = capsys.readouterr().out
    assert bundled_task_notice(20) in out.splitlines()
    assert "no --train_file or --dataset_name: training on the bundled arithmetic task (20 generated" in out
    assert "Pass --train_file FILE" in out and "--dataset_name ID" in out
    train = write_jsonl(tmp_path / "train.jsonl", copy_task_rows(16))
    with pytest.raises(WeightsLoaded):
        cli.main([*argv[:-2], "--train_file", train, "--output_dir", str(tmp_path / "out2")])
    assert "bundled" not in capsys.readouterr().out


# -- item 7: a validation file that shares rows with the training data -------------------------------------------------
def test_validation_rows_that_are_training_rows_are_counted(tmp_path, caplog):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(10)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    validation = write_jsonl(tmp_path / "validation.jsonl", rows[2:5] + [{"prompt": "new", "completion": "row"}])
    with caplog.at_level(logging.WARNING, logger="hf_lisa"):
        load_training_data(train_file=train, validation_file=validation)
    assert f"3 of the 4 rows of validation_file={validation!r} are training rows too (the same fields in " \
           f"train_file={train!r})" in caplog.text
    caplog.clear()
    write_jsonl(tmp_path / "other.jsonl", [{"prompt": "new", "completion": "row"}])
    with caplog.at_level(logging.WARNING, logger="hf_lisa"):
        load_training_data(train_file=train, validation_file=str(tmp_path / "other.jsonl"))
    assert "training rows too" not in caplog.text


# -- item 9: a mixture that leaves most rows unused --------------------------------------------------------------------
def test_a_mixture_far_from_its_weights_warns_with_the_numbers(tmp_path, caplog):
    big = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"p{i}", "completion": "x"} for i in range(95)])
    tiny = write_jsonl(tmp_path / "tiny.jsonl", [{"prompt": f"q{i}", "completion": "y"} for i in range(5)])
    data = load_training_data(train_file=f"{big}:0.7,{tiny}:0.3", validation_split_percentage=0, seed=42)
    with caplog.at_level(logging.WARNING, logger="hf_lisa"):
        tokenized, _ = _tokenize(data)
    source, _ = mixture_order([95, 5], [0.7, 0.3], seed=42)
    used = len(source)
    assert used < 50 and len(tokenized["train"]) == used
    warning = caplog.text
    assert f"The mixture draws {used} of its 100 training rows ({100 - used} unused)" in warning
    assert f"train_file={tiny!r} {5 / used:.3f} (weight 0.300; 5 of its 5 rows)" in warning
    assert "mixing rule 'first_exhausted'" in warning and f"train_file={tiny!r} did" in warning
    assert f"--train_file '{big}:95,{tiny}:5'" in warning
    caplog.clear()
    data = load_training_data(train_file=f"{big}:95,{tiny}:5", validation_split_percentage=0, seed=42)
    with caplog.at_level(logging.WARNING, logger="hf_lisa"):
        _tokenize(data)
    assert "The mixture draws" not in caplog.text  # weights that follow the rows: every row, no warning


# -- item 10: Ctrl-C reads no file again -------------------------------------------------------------------------------
def test_ctrl_c_does_not_parse_or_read_the_files_again(model, tmp_path, capsys, monkeypatch):
    """The template file becomes a FIFO after the run read it; the interrupt's resume hint must not open it (a FIFO
    nobody writes to blocks its reader forever)."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    run_module = sys.modules["hf_lisa.train.run"]

    def interrupted(*args, **kwargs):
        template.unlink()
        os.mkfifo(template)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "_check_and_prepare", interrupted)
    train = write_jsonl(tmp_path / "train.jsonl", copy_task_rows(16))
    argv = ["train", "--model_name_or_path", model, "--train_file", train, "--output_dir", str(tmp_path / "out"),
            "--report_to", "none", "--use_cpu", "true", "--chat_template", str(template)]
    status = []
    thread = threading.Thread(target=lambda: status.append(cli.main(argv)), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # blocked opening the FIFO: open it for writing so that the reader ends, then fail
        os.close(os.open(template, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(30)
        pytest.fail("the interrupted run opened --chat_template again (it blocked on the FIFO)")
    assert status == [130]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hf-lisa train: interrupted. No checkpoint was saved in {str(tmp_path / 'out')!r}; a new run starts from "
        "the beginning.")


# -- item 11: held out after skipping ----------------------------------------------------------------------------------
def _seed_holding_out_the_long_row(path: str) -> int:
    for seed in range(200):
        data = load_training_data(train_file=path, seed=seed)
        if "z" * 100 in data.sources[0].parts[0]["validation"][0]["completion"]:
            return seed
    raise AssertionError("no seed holds out the long row")


def test_an_overlength_row_drawn_for_validation_is_replaced_by_a_kept_row(tmp_path, caplog):
    rows = [{"prompt": f"say {c}", "completion": c * 3} for c in "abcdefghijklmnopqrst"]
    rows[7]["completion"] = "z" * 500  # longer than max_seq_length: skipped
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    seed = _seed_holding_out_the_long_row(path)  # 5% of 20 rows: the validation split is that row alone
    with caplog.at_level(logging.WARNING, logger="hf_lisa"):
        data = load_training_data(train_file=path, seed=seed)
        tokenized, report = _tokenize(data)
    assert "train_file=" in caplog.text and "only 1 row held out for evaluation (5% of its rows)" in caplog.text
    assert "1 of the 1 rows held out for evaluation were skipped; 1 of its training rows are held out" in caplog.text
    assert report.kept == {"train": 18, "validation": 1}  # 20 rows, 1 too long, 1 held out of the 19 kept
    assert sum(report.skipped["train"].values()) == 1
    held = data.sources[0].parts[0]["validation"]  # the raw rows follow (the generation metric's prompts)
    assert len(held) == 1 and held[0]["completion"] != "z" * 500
    trained = {row["prompt"] for row in data.sources[0].parts[0]["train"]}
    assert held[0]["prompt"] not in trained and len(trained) == 18


def test_nothing_skipped_holds_out_the_same_rows_as_before(tmp_path):
    rows = [{"prompt": f"say {i}", "completion": f"{i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    data = load_training_data(train_file=path, seed=3)
    held = [row["prompt"] for row in data.sources[0].parts[0]["validation"]]
    tokenized, report = _tokenize(data)
    assert report.kept == {"train": 38, "validation": 2}
    assert [row["prompt"] for row in data.sources[0].parts[0]["validation"]] == held
    tokenizer = build_char_tokenizer()
    expected, _ = tokenize_datasets(load_training_data(train_file=path, seed=3).sources[0].parts[0], tokenizer, 64,
                                    load_from_cache_file=False)
    for split in ("train", "validation"):
        assert tokenized[split]["input_ids"] == expected[split]["input_ids"]


# -- item 12: the chat template named in its failures ------------------------------------------------------------------
def test_a_template_that_fails_on_every_row_is_named(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content.missing.field }}{% endfor %}")
    train = write_jsonl(tmp_path / "train.jsonl", copy_task_rows(8))
    data = load_training_data(train_file=train, validation_split_percentage=0)
    with pytest.raises(ValueError, match=rf"Every row of the train split was skipped \(train_file='.*train\.jsonl'\): "
                       rf"the chat template \(--chat_template='{path}', a Jinja file\) refused every one, e\.g\. "
                       r"train_file='.*', line \d+: 'str object' has no attribute 'missing'\. Fix the template"):
        _tokenize(data, chat_template=str(path))


def test_a_template_whose_code_fails_is_named_not_a_raw_type_error(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}")
    train = write_jsonl(tmp_path / "train.jsonl", copy_task_rows(8))
    data = load_training_data(train_file=train, validation_split_percentage=0)
    with pytest.raises(ValueError, match=r"line \d+: the chat template failed: TypeError: can only concatenate str .* "
                       rf"\(the template: --chat_template='{path}', a Jinja file\)\. Fix the template"):
        _tokenize(data, chat_template=str(path))


def test_a_template_that_fails_exits_2_naming_chat_template(model, tmp_path, capsys):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}")
    train = write_jsonl(tmp_path / "train.jsonl", copy_task_rows(8))
    started = time.time()
    status = cli.main(["train", "--model_name_or_path", model, "--train_file", train, "--output_dir",
                       str(tmp_path / "out"), "--report_to", "none", "--use_cpu", "true", "--chat_template", str(path),
                       "--validation_split_percentage", "0", "--max_steps", "1"])
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    assert "Traceback" not in err and time.time() - started < 300
    assert re.search(r"^hf-lisa train: error: .*the chat template failed: TypeError: .*--chat_template=",
                     err.strip().splitlines()[-1])
