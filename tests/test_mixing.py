"""Several training sources mixed by weight (``--train_file 'a.jsonl:0.7,b.jsonl:0.3'`` or a YAML list): the specs,
the seeded mixture and its proportions, each ``--mix_strategy`` (concat, first_exhausted, all_exhausted; the default
``auto``) against its formula computed here draw by draw, the rows token by token on the embedded SmolLM2 tokenizer,
the skip report of each source, and a resumed mixed run equal to the uninterrupted one for every strategy."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

from hf_lisa.errors import UsageError
from hf_lisa.data.pipeline import IGNORE_INDEX, check_data, data_collator, tokenize_datasets
from hf_lisa.data.sources import check_source_paths, mixture_order, normalised_weights, parse_sources
from hf_lisa.data.training_data import load_training_data

pytestmark = pytest.mark.usefixtures("one_thread")


def _specs(value):
    return [(spec.path, spec.weight) for spec in parse_sources(value)]


# -- specs -------------------------------------------------------------------------------------------------------------
def test_specs_read_weights_after_the_last_colon_only_when_they_are_numbers(tmp_path):
    assert _specs("a.jsonl:0.7,b.jsonl:0.3") == [("a.jsonl", 0.7), ("b.jsonl", 0.3)]
    assert _specs("a.jsonl, b/:2 ,c.jsonl:1e-1") == [("a.jsonl", 1.0), ("b/", 2.0), ("c.jsonl", 0.1)]
    assert _specs(r"C:\data\a.jsonl") == [(r"C:\data\a.jsonl", 1.0)]  # a drive letter is no weight
    assert _specs(r"C:\data\a.jsonl:3") == [(r"C:\data\a.jsonl", 3.0)]
    assert _specs("run:v2/a.jsonl:0.5") == [("run:v2/a.jsonl", 0.5)]
    odd = tmp_path / "scores:2"  # a file whose name ends in ':<number>' is that file, not a weighted entry
    odd.write_text('{"text": "x"}\n')
    assert _specs(str(odd)) == [(str(odd), 1.0)]
    assert _specs([{"path": "a.jsonl", "weight": 0.7}, {"path": "b.jsonl"}, "c.jsonl:2"]) == [
        ("a.jsonl", 0.7), ("b.jsonl", 1.0), ("c.jsonl", 2.0)]
    assert _specs(["with,comma.jsonl"]) == [("with,comma.jsonl", 1.0)]  # a YAML entry is one path
    assert normalised_weights(parse_sources("a:3,b:1")) == [0.75, 0.25]


@pytest.mark.parametrize("value, message", [
    ("a.jsonl:-1,b.jsonl", r"the weight of 'a.jsonl' is '-1'; allowed: a finite number > 0"),
    ("a.jsonl:0,b.jsonl", r"the weight of 'a.jsonl' is '0'; allowed: a finite number > 0"),
    ("a.jsonl:nan,b.jsonl", r"the weight of 'a.jsonl' is 'nan'"),
    ("a.jsonl:inf", r"the weight of 'a.jsonl' is 'inf'"),
    ([{"path": "a.jsonl", "weight": True}], r"the weight of 'a.jsonl' is True; allowed: a number > 0"),
    ([{"path": "a.jsonl", "weight": "heavy"}], r"the weight of 'a.jsonl' is 'heavy'"),
    ("a.jsonl,a.jsonl:2", r"names 'a.jsonl' twice \(entries 1 and 2\)"),
    ("a.jsonl,./a.jsonl", r"names './a.jsonl' twice"),
    ("a.jsonl,,b.jsonl", r"has an empty entry \(2\)"),
    (":0.5", r"the entry ':0.5' has a weight but no path"),
    ([], r"--train_file is an empty list"),
    ([{"file": "a.jsonl"}], r"entry 1 .* has the key\(s\) \['file'\]; allowed keys: path .*, weight"),
    ([3], r"entry 1 is 3; allowed: a path or a mapping"),
    ({"a.jsonl": 0.7}, r"allowed: a path, 'a.jsonl:0.7,b.jsonl:0.3', or .* a list"),
])
def test_bad_specs_are_refused_naming_the_entry(value, message):
    with pytest.raises(UsageError, match=message):
        parse_sources(value)


def test_a_missing_source_is_named_with_the_weight_rule(tmp_path):
    present = write_jsonl(tmp_path / "a.jsonl", copy_task_rows(4))
    with pytest.raises(FileNotFoundError, match=r"train_file='.*b.jsonl' does not exist"):
        check_source_paths(parse_sources(f"{present}:1,{tmp_path / 'b.jsonl'}:1"))
    with pytest.raises(FileNotFoundError, match=r"a.jsonl:heavy' does not exist \(a weight goes after the last ':'"):
        check_source_paths(parse_sources(f"{present}:heavy"))


def test_the_command_line_and_a_yaml_list_give_the_same_sources(tmp_path):
    from hf_lisa.train import parse_args

    a, b = (write_jsonl(tmp_path / f"{n}.jsonl", copy_task_rows(4)) for n in "ab")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"train_file": [{"path": a, "weight": 0.7}, {"path": b, "weight": 0.3}],
                                      "output_dir": str(tmp_path / "out"), "report_to": "none"}))
    _, data_args, _, _ = parse_args([str(config)])
    _, cli_args, _, _ = parse_args(["--train_file", f"{a}:0.7,{b}:0.3", "--output_dir", str(tmp_path / "o"),
                                    "--report_to", "none"])
    assert parse_sources(data_args.train_file) == parse_sources(cli_args.train_file)
    config.write_text(yaml.safe_dump({"train_file": [{"path": a, "weight": -2}], "report_to": "none"}))
    with pytest.raises(UsageError, match=r"run.yaml: --train_file: the weight of '.*a.jsonl' is -2"):
        parse_args([str(config)])


# -- the mixture -------------------------------------------------------------------------------------------------------
def test_mixture_follows_the_weights_until_the_first_source_runs_out():
    sizes, weights = [6000, 6000, 2000], [0.6, 0.3, 0.1]
    source, row = mixture_order(sizes, weights, seed=7)
    counts = np.bincount(source, minlength=3)
    assert counts[0] == 6000  # the heaviest source runs out first: the mixture ends there, no row repeated
    assert counts[1] < 6000 and counts[2] < 2000
    assert np.allclose(counts / counts.sum(), weights, atol=0.015)  # realised proportions ~ weights
    for i, n in enumerate(sizes):
        mine = row[source == i]
        assert len(set(mine.tolist())) == len(mine) and mine.min() >= 0 and mine.max() < n
    assert not np.array_equal(row[source == 0][:50], np.arange(50))  # each source's rows in a random order


def test_the_same_seed_gives_the_same_mixture_and_another_seed_another():
    first = mixture_order([300, 200], [0.5, 0.5], seed=3)
    again = mixture_order([300, 200], [0.5, 0.5], seed=3)
    other = mixture_order([300, 200], [0.5, 0.5], seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(first, again))
    assert not np.array_equal(first[0], other[0]) and not np.array_equal(first[1], other[1])
    # a source that is 10x smaller, weighted 10x higher, runs out first
    source, _ = mixture_order([1000, 100], [1, 10], seed=0)
    assert np.bincount(source)[1] == 100 and len(source) < 400


# -- --mix_strategy: each rule against its formula ---------------------------------------------------------------------
def _expected_counts(sizes, weights, seed, strategy):
    """The rows each source gives, computed draw by draw from the documented rule (not from ``mixture_order``'s
    arrays): ``numpy.random.default_rng(seed)`` first shuffles each source, then each draw is one uniform number
    placed in the cumulative weights."""
    if strategy == "concat":
        return list(sizes)  # every row once, whatever the seed
    rng = np.random.default_rng(seed)
    for n in sizes:
        rng.permutation(n)  # each source's own order comes first
    cdf = np.cumsum(np.asarray(weights, dtype=np.float64) / sum(weights))
    cdf /= cdf[-1]
    counts = [0] * len(sizes)
    while True:
        i = int(np.searchsorted(cdf, rng.random(), side="right"))
        if strategy == "first_exhausted" and counts[i] == sizes[i]:
            return counts  # the first draw whose source has no row left ends the mixture
        counts[i] += 1
        if strategy == "all_exhausted" and all(c >= n for c, n in zip(counts, sizes)):
            return counts  # the draw that takes the last unused row ends it


@pytest.mark.parametrize("strategy", ["concat", "first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("sizes, weights, seed", [
    ([28, 28], [0.7, 0.3], 42),  # issue 36's mixture: first_exhausted used 8 of the 28 ShareGPT rows
    ([50, 7, 19], [1, 2, 3], 0),
    ([5, 300], [0.5, 0.5], 9),
])
def test_each_strategy_gives_the_rows_of_its_formula(strategy, sizes, weights, seed):
    source, row = mixture_order(sizes, weights, seed, strategy)
    counts = np.bincount(source, minlength=len(sizes)).tolist()
    assert counts == _expected_counts(sizes, weights, seed, strategy)
    pairs = list(zip(source.tolist(), row.tolist()))
    for i, n in enumerate(sizes):
        used = row[source == i]
        assert used.min() >= 0 and used.max() < n
        if strategy == "concat":
            assert sorted(used.tolist()) == list(range(n))  # every row exactly once
        elif strategy == "first_exhausted":
            assert len(set(used.tolist())) == len(used)  # no row twice
        else:
            assert set(used.tolist()) == set(range(n))  # every row at least once
    if strategy == "concat":
        assert len(set(pairs)) == sum(sizes) and pairs != sorted(pairs)  # shuffled, not source after source
    if strategy == "all_exhausted":
        assert sum(counts) > sum(sizes) and max(c - n for c, n in zip(counts, sizes)) > 0  # rows re-used
    again = mixture_order(sizes, weights, seed, strategy)
    assert np.array_equal(again[0], source) and np.array_equal(again[1], row)  # the seed decides everything


def test_the_default_strategy_and_the_llama_factory_names():
    from hf_lisa.data.sources import resolve_mix_strategy

    assert resolve_mix_strategy("auto", parse_sources("a.jsonl,b.jsonl")) == "concat"  # no weights: every row once
    assert resolve_mix_strategy("auto", parse_sources([{"path": "a.jsonl"}, "b.jsonl"])) == "concat"
    assert resolve_mix_strategy("auto", parse_sources("a.jsonl:0.7,b.jsonl:0.3")) == "first_exhausted"
    assert resolve_mix_strategy("auto", parse_sources("a.jsonl:1,b.jsonl")) == "first_exhausted"  # one weight given
    assert resolve_mix_strategy("auto", parse_sources([{"path": "a.jsonl", "weight": 2}, "b.jsonl"])) == \
        "first_exhausted"
    assert resolve_mix_strategy("interleave_under", parse_sources("a:1,b:1")) == "first_exhausted"
    assert resolve_mix_strategy("interleave_over", parse_sources("a:1,b:1")) == "all_exhausted"
    assert resolve_mix_strategy("all_exhausted", parse_sources("a,b")) == "all_exhausted"  # equal weights
    assert np.array_equal(mixture_order([30, 20], [0.7, 0.3], 1, "interleave_over")[0],
                          mixture_order([30, 20], [0.7, 0.3], 1, "all_exhausted")[0])


@pytest.mark.parametrize("argv, message", [
    (["--mix_strategy", "concat"], r"--mix_strategy='concat' takes every row of every source once, so weights have "
                                   r"no meaning, but --train_file gives .*a.jsonl:0.7, .*b.jsonl:0.3\. Drop the "
                                   r"weights, or mix by weight with --mix_strategy first_exhausted"),
    (["--mix_strategy", "random"], r"--mix_strategy='random' is invalid; allowed: auto, concat, first_exhausted, "
                                   r"all_exhausted \(or LLaMA-Factory's interleave_under, interleave_over\)"),
])
def test_bad_strategies_are_refused_before_anything_loads(tmp_path, argv, message):
    from hf_lisa.train import parse_args

    a, b = (write_jsonl(tmp_path / f"{n}.jsonl", copy_task_rows(4)) for n in "ab")
    with pytest.raises(UsageError, match=message):
        parse_args(["--train_file", f"{a}:0.7,{b}:0.3", "--output_dir", str(tmp_path / "o"), "--report_to", "none",
                    *argv])
    _, data_args, _, _ = parse_args(["--train_file", f"{a},{b}", "--output_dir", str(tmp_path / "o"),
                                     "--report_to", "none"])
    assert data_args.mix_strategy == "auto"  # the documented default
    config = tmp_path / "run.yaml"  # a config file takes it too, LLaMA-Factory's names included
    config.write_text(yaml.safe_dump({"train_file": [{"path": a, "weight": 0.7}, {"path": b, "weight": 0.3}],
                                      "mix_strategy": "interleave_over", "output_dir": str(tmp_path / "y"),
                                      "report_to": "none"}))
    _, data_args, _, _ = parse_args([str(config)])
    assert data_args.mix_strategy == "interleave_over"


def test_an_oversampled_mixture_that_would_never_end_is_refused():
    from hf_lisa.data.validation import DataError

    with pytest.raises(DataError, match=r"--mix_strategy all_exhausted: to use every row of every source \(1000 rows "
                                        r"at share 1, 1000 rows at share 1e-06\) the mixture would draw about "
                                        r"1,000,001,000 rows"):
        mixture_order([1000, 1000], [1, 1e-6], 0, "all_exhausted")


# -- rows token by token on SmolLM2's tokenizer ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from hf_lisa.models import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


PC_ROWS = [{"prompt": f"pc question {i}", "completion": f"answer {i}"} for i in range(12)]
CHAT_ROWS = [{"messages": [{"role": "user", "content": f"chat hello {i}"},
                           {"role": "assistant", "content": f"first reply {i}"},
                           {"role": "user", "content": f"and then {i}"},
                           {"role": "assistant", "content": f"second reply {i}"}]} for i in range(12)]


def _load_and_tokenize(spec, tokenizer, seed=0, **options):
    data = load_training_data(train_file=spec, validation_split_percentage=0, seed=seed, **options)
    data.check(lambda raw: check_data(raw, 256))
    tokenized, report = data.tokenize(lambda raw: tokenize_datasets(raw, tokenizer, 256, load_from_cache_file=False))
    return data, tokenized, report


def _trained_spans(ids, labels, tokenizer) -> list[str]:
    """The texts of the runs of trained tokens (label == input id), in order; every other label is -100."""
    spans, run = [], []
    for token, label in zip(ids, labels):
        assert label in (token, IGNORE_INDEX)
        if label == token:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run)), run.clear()
    return spans + ([tokenizer.decode(run)] if run else [])


def test_mixed_rows_of_two_formats_have_exact_labels_and_attention_masks(smollm2, tmp_path):
    pc = write_jsonl(tmp_path / "pc.jsonl", PC_ROWS)
    chat = write_jsonl(tmp_path / "chat" / "part-0.jsonl", CHAT_ROWS[:6])
    write_jsonl(tmp_path / "chat" / "part-1.jsonl", CHAT_ROWS[6:])  # a folder of two files: one source
    data, tokenized, report = _load_and_tokenize(f"{pc}:0.5,{tmp_path / 'chat'}:0.5", smollm2, seed=11)
    assert os.path.dirname(chat) == str(tmp_path / "chat")
    train = tokenized["train"]
    assert report.data_format == "prompt_completion+messages" and report.kept == {"train": len(train)}
    system = smollm2.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    system = system[: system.index("<|im_start|>user")]  # SmolLM2's default system turn
    seen = {"pc": 0, "chat": 0}
    for row in train:
        ids, labels, mask = row["input_ids"], row["labels"], row["attention_mask"]
        assert mask == [1] * len(ids) and len(labels) == len(ids)
        text = smollm2.decode(ids)
        spans = _trained_spans(ids, labels, smollm2)
        if "pc question" in text:
            i = int(text.split("pc question ")[1].split("<")[0])
            assert text == (f"{system}<|im_start|>user\npc question {i}<|im_end|>\n"
                            f"<|im_start|>assistant\nanswer {i}<|im_end|>\n")
            assert spans == [f"answer {i}<|im_end|>\n"]  # the completion and its end of turn, nothing else
            seen["pc"] += 1
        else:
            i = int(text.split("chat hello ")[1].split("<")[0])
            assert text == (f"{system}<|im_start|>user\nchat hello {i}<|im_end|>\n<|im_start|>assistant\n"
                            f"first reply {i}<|im_end|>\n<|im_start|>user\nand then {i}<|im_end|>\n"
                            f"<|im_start|>assistant\nsecond reply {i}<|im_end|>\n")
            assert spans == [f"first reply {i}<|im_end|>\n", f"second reply {i}<|im_end|>\n"]  # both assistant turns
            seen["chat"] += 1
    mixture = data.summary()["mixture"]
    assert [s["rows_mixed"] for s in mixture["sources"]] == [seen["pc"], seen["chat"]]
    assert 12 in seen.values() and sum(seen.values()) == len(train)  # one source ran out; no row twice
    # a padded batch of one row of each format: pads attend to nothing and train nothing
    first_pc = next(r for r in train if "pc question" in smollm2.decode(r["input_ids"]))
    first_chat = next(r for r in train if "chat hello" in smollm2.decode(r["input_ids"]))
    batch = data_collator(smollm2)([first_pc, first_chat])
    for k, row in enumerate((first_pc, first_chat)):
        n, width = len(row["input_ids"]), batch["input_ids"].shape[1]
        assert batch["attention_mask"][k].tolist() == [1] * n + [0] * (width - n)
        assert batch["labels"][k].tolist() == row["labels"] + [IGNORE_INDEX] * (width - n)
        assert batch["input_ids"][k, :n].tolist() == row["input_ids"]


def test_each_source_reports_its_own_skipped_rows(smollm2, tmp_path):
    pc_rows = PC_ROWS[:8] + [{"prompt": "q", "completion": ""}, {"prompt": "q", "completion": "  "}]
    chat_rows = CHAT_ROWS[:8] + [{"messages": [{"role": "user", "content": "no answer"}]}]
    pc = write_jsonl(tmp_path / "pc.jsonl", pc_rows)
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    data, tokenized, report = _load_and_tokenize([{"path": pc, "weight": 2}, chat], smollm2)
    by_label = {s.label: s.report for s in data.sources}
    assert by_label[f"train_file={pc!r}"].skipped == {"train": {"empty completion": 2}}
    assert by_label[f"train_file={pc!r}"].skipped_lines == {"train": {"empty completion": [9, 10]}}
    assert by_label[f"train_file={chat!r}"].skipped == {"train": {"no assistant turn": 1}}
    assert by_label[f"train_file={chat!r}"].kept == {"train": 8}
    assert report.skipped == {"train": {"empty completion": 2, "no assistant turn": 1}}  # added up for the run
    sources = data.summary()["mixture"]["sources"]
    assert [s["weight"] for s in sources] == [pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert [s["rows_skipped"] for s in sources] == [{"train": {"empty completion": 2}},
                                                    {"train": {"no assistant turn": 1}}]
    assert sum(s["rows_mixed"] for s in sources) == len(tokenized["train"])


def _row_ids(train, tokenizer):
    """``{"pc": [i, ...], "chat": [i, ...]}``: which rows of PC_ROWS / CHAT_ROWS the tokenised mixture holds."""
    seen = {"pc": [], "chat": []}
    for row in train:
        text = tokenizer.decode(row["input_ids"])
        if "pc question" in text:
            seen["pc"].append(int(text.split("pc question ")[1].split("<")[0]))
        else:
            seen["chat"].append(int(text.split("chat hello ")[1].split("<")[0]))
    return seen


@pytest.mark.parametrize("strategy, weights, resolved", [
    ("auto", "", "concat"),  # the default without weights
    ("auto", ":0.7|:0.3", "first_exhausted"),  # the default with weights
    ("concat", "", "concat"),
    ("interleave_under", ":0.7|:0.3", "first_exhausted"),
    ("all_exhausted", ":0.7|:0.3", "all_exhausted"),
    ("interleave_over", "", "all_exhausted"),
])
def test_each_strategy_mixes_the_tokenised_rows_and_logs_them(smollm2, tmp_path, caplog, strategy, weights,
                                                              resolved):
    pc = write_jsonl(tmp_path / "pc.jsonl", PC_ROWS)
    chat = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    w_pc, w_chat = weights.split("|") if weights else ("", "")
    with caplog.at_level(logging.INFO, logger="hf_lisa"):
        data, tokenized, _ = _load_and_tokenize(f"{pc}{w_pc},{chat}{w_chat}", smollm2, seed=42,
                                                mix_strategy=strategy)
    seen = _row_ids(tokenized["train"], smollm2)
    numbers = [0.7, 0.3] if weights else [1, 1]
    expected = _expected_counts([12, 12], numbers, 42, resolved)
    assert [len(seen["pc"]), len(seen["chat"])] == expected
    if resolved == "concat":
        assert sorted(seen["pc"]) == sorted(seen["chat"]) == list(range(12))  # every row once
    elif resolved == "all_exhausted":
        assert set(seen["pc"]) == set(seen["chat"]) == set(range(12)) and sum(expected) > 24  # all, some twice
    else:
        assert 12 in expected and sum(expected) < 24 and len(set(seen["pc"])) == len(seen["pc"])
    mixture = data.summary()["mixture"]
    assert mixture["strategy"] == resolved and mixture["strategy_option"] == strategy
    assert [s["rows_mixed"] for s in mixture["sources"]] == expected
    assert [s["weight"] for s in mixture["sources"]] == ([None, None] if resolved == "concat" else
                                                         [pytest.approx(w / sum(numbers)) for w in numbers])
    log = caplog.text
    assert f"Mixed 2 sources into {sum(expected)} training rows (seed 42; --mix_strategy {resolved}:" in log
    for label, n in zip((f"train_file={pc!r}", f"train_file={chat!r}"), expected):  # the realised rows, per source
        line = next(line for line in log.splitlines() if line.strip().startswith(label))
        assert line.split()[-2] == str(n), line


def test_the_first_exhausted_warning_names_the_strategies_that_use_every_row(smollm2, tmp_path, caplog):
    pc = write_jsonl(tmp_path / "pc.jsonl", PC_ROWS)
    chat = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS[:3])
    with caplog.at_level(logging.WARNING, logger="hf_lisa"):
        _load_and_tokenize(f"{pc}:0.5,{chat}:0.5", smollm2, seed=0)
    assert "mixing rule 'first_exhausted'" in caplog.text
    assert "--mix_strategy all_exhausted (draws by weight until every source has given every row" in caplog.text
    assert "no option for another rule" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_lisa"):
        _load_and_tokenize(f"{pc}:0.5,{chat}:0.5", smollm2, seed=0, mix_strategy="all_exhausted")
    assert "The mixture draws" not in caplog.text  # every row used: nothing to warn about


def test_max_train_samples_keeps_the_first_rows_of_the_mixture(smollm2, tmp_path):
    pc = write_jsonl(tmp_path / "pc.jsonl", PC_ROWS)
    chat = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    _, full, _ = _load_and_tokenize(f"{pc},{chat}", smollm2, seed=5, max_train_samples=12)
    data, capped, report = _load_and_tokenize(f"{pc},{chat}", smollm2, seed=5, max_train_samples=5)
    assert len(capped["train"]) == 5 and report.kept["train"] == 5
    mixture = data.summary()["mixture"]
    assert mixture["rows"] == 5 and sum(s["rows_mixed"] for s in mixture["sources"]) == 5
    assert all(s["rows_kept"]["train"] == 5 for s in mixture["sources"])  # each source capped first


# -- a resumed mixed run -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_lm_dir(tmp_path_factory.mktemp("mixing_model") / "model", num_layers=2)


def _train(model, spec, output_dir, *extra):
    from hf_lisa.train import main

    return main([
        "--model_name_or_path", model, "--train_file", spec, "--output_dir", str(output_dir), "--method", "full",
        "--max_steps", "6", "--save_steps", "3", "--save_strategy", "steps", "--per_device_train_batch_size", "2",
        "--learning_rate", "1e-2", "--max_seq_length", "96", "--validation_split_percentage", "0",
        "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true", "--eval_generation_samples", "0",
        "--seed", "13", *extra,
    ])


@pytest.mark.parametrize("weights, strategy, resolved", [
    ((":0.6", ":0.4"), None, "first_exhausted"),  # the default with weights
    (("", ""), None, "concat"),  # the default without weights
    ((":0.6", ":0.4"), "all_exhausted", "all_exhausted"),
])
def test_a_resumed_mixed_run_ends_with_the_uninterrupted_runs_weights(tiny_model, tmp_path, weights, strategy,
                                                                      resolved):
    pc = write_jsonl(tmp_path / "pc.jsonl", copy_task_rows(20, seed=1))
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": f"say {c}"}, {"role": "assistant", "content": c * 4}]}
        for c in "abcdefghijklmnop"])
    spec = f"{pc}{weights[0]},{chat}{weights[1]}"
    extra = ["--mix_strategy", strategy] if strategy else []
    summary = _train(tiny_model, spec, tmp_path / "whole", *extra)
    checkpoint = tmp_path / "resumed" / "checkpoint-3"
    shutil.copytree(tmp_path / "whole" / "checkpoint-3", checkpoint)  # stopped after step 3
    resumed = _train(tiny_model, spec, tmp_path / "resumed", "--resume_from_checkpoint", str(checkpoint), *extra)
    assert resumed["hyperparameters"]["max_steps"] == summary["hyperparameters"]["max_steps"] == 6
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    again = load_file(tmp_path / "resumed" / "model.safetensors")
    assert whole.keys() == again.keys()
    for name in whole:
        assert torch.equal(whole[name], again[name]), name
    start = load_file(os.path.join(tiny_model, "model.safetensors"))
    assert not torch.equal(start["model.embed_tokens.weight"], whole["model.embed_tokens.weight"])  # it trained
    recorded = json.loads((tmp_path / "whole" / "training_summary.json").read_text())["data"]
    assert recorded["format"] == "prompt_completion+messages" and recorded["source"].startswith("mixture of")
    mixture = recorded["mixture"]
    sources = mixture["sources"]
    assert mixture["strategy"] == resolved and mixture["strategy_option"] == (strategy or "auto")
    assert [s["weight"] for s in sources] == ([None, None] if resolved == "concat" else [0.6, 0.4])
    assert mixture["seed"] == 13
    numbers = [0.6, 0.4] if weights[0] else [1, 1]
    assert [s["rows_mixed"] for s in sources] == _expected_counts([20, 16], numbers, 13, resolved)
    assert sum(s["rows_mixed"] for s in sources) == recorded["rows_kept"]["train"] == mixture["rows"]
    assert recorded == json.loads((tmp_path / "resumed" / "training_summary.json").read_text())["data"]
