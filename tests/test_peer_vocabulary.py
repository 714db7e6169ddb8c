"""The names LLaMA-Factory, axolotl and TRL users type (issue 36 item 1, :mod:`hf_lisa.option_aliases`): an alias
parses to exactly what our own option parses to, on the command line and in a config file; a near miss (another
meaning) is refused naming the option to use, never with a look-alike suggestion; YAML and command line agree, and a
config file's keys are refused before torch loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_lisa import cli
from hf_lisa.errors import UsageError
from hf_lisa.option_aliases import ALIASES, NEAR_MISSES
from hf_lisa.option_names import matches_installed_transformers

BASE = ["--output_dir", "out", "--report_to", "none"]

#: alias -> (its value, as typed, differing from our option's default; the method that uses the option)
ALIAS_CASES = {
    "lora_r": ("4", "lora"),
    "lora_rank": ("4", "lora"),
    "lora_alpha": ("12", "lora"),
    "lora_dropout": ("0.1", "lora"),
    "cutoff_len": ("64", "lisa"),
    "sequence_len": ("64", "lisa"),
    "max_length": ("64", "lisa"),
    "micro_batch_size": ("3", "lisa"),
    "num_epochs": ("2", "lisa"),
    "sample_packing": ("true", "lisa"),
    "lisa_n_layers": ("1", "lisa"),
    "lisa_step_interval": ("7", "lisa"),
}

#: near miss -> the hf-lisa options its refusal must name
NEAR_MISS_CASES = {
    "base_model": ["--model_name_or_path"],
    "dataset": ["--train_file", "--dataset_name"],
    "datasets": ["--train_file", "--dataset_name", "--data_format"],
    "finetuning_type": ["--method"],
    "adapter": ["--method lora --load_in_4bit"],
    "template": ["--chat_template"],
    "val_size": ["--validation_split_percentage", "fraction", "percentage"],
    "val_set_size": ["--validation_split_percentage", "fraction", "percentage"],
    "lora_target": ["--target_modules", "all-linear"],
    "lora_target_modules": ["--target_modules"],
    "lora_target_linear": ["--target_modules all-linear"],
    "quantization_bit": ["--load_in_4bit", "--load_in_8bit"],
}

#: what today's look-alike matching suggested for them (issue 36): options of another meaning
WRONG = ("local_rank", "auto_find_batch_size", "data_seed", "dataset_split", "did you mean")


def _parse(argv):
    from hf_lisa.train import parse_args

    return parse_args(argv)


def _canonical(alias):
    return ALIASES[alias][0]


def _yaml(path: Path, values: dict) -> str:
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    return str(path)


def test_every_alias_and_near_miss_is_in_the_table():
    assert set(ALIAS_CASES) == set(ALIASES) and set(NEAR_MISS_CASES) == set(NEAR_MISSES)
    assert not set(ALIASES) & set(NEAR_MISSES)


@pytest.mark.parametrize("alias", sorted(ALIAS_CASES))
def test_an_alias_parses_to_our_option(alias, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    value, method = ALIAS_CASES[alias]
    option = _canonical(alias)
    ours = _parse([*BASE, "--method", method, f"--{option}", value])
    assert _parse([*BASE, "--method", method, f"--{alias}", value]) == ours
    assert _parse([*BASE, "--method", method, f"--{alias.replace('_', '-')}={value}"]) == ours
    typed = {"true": True}.get(value, json.loads(value))
    config = _yaml(tmp_path / "run.yaml", {"method": method, alias: typed})
    assert _parse([config, *BASE]) == ours
    default = _parse([*BASE, "--method", method])
    found = next(getattr(args, option) for args in ours if hasattr(args, option))
    assert found != next(getattr(args, option) for args in default if hasattr(args, option))  # the value arrived


@pytest.mark.parametrize("alias", ["lora_r", "cutoff_len", "micro_batch_size"])
def test_an_alias_with_its_option_is_refused_naming_both(alias, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    option = _canonical(alias)
    with pytest.raises(UsageError, match=f"--{alias} and --{option} are the same option"):
        _parse([*BASE, "--method", "lora", f"--{alias}", "4", f"--{option}", "4"])
    config = _yaml(tmp_path / "run.yaml", {option: 4, alias: 4})
    with pytest.raises(UsageError, match=f"'{option}' and '{alias}' are the same option"):
        _parse([config, *BASE, "--method", "lora"])
    assert cli.main(["train", "--method", "lora", f"--{option}", "4", f"--{alias}=4", *BASE]) == 2
    assert f"--{option} and --{alias} are the same option" in capsys.readouterr().err


def _hint(message: str, shown: str) -> str:
    """The parenthesised refusal after ``shown`` in an error message: up to the next quoted name or the closing
    sentence."""
    start = message.index(f"{shown!r} (") + len(repr(shown)) + 2
    ends = [i for i in (message.find("), '", start), message.find("). Run `hf-lisa", start)) if i >= 0]
    return message[start:min(ends)]


@pytest.mark.parametrize("key", sorted(NEAR_MISS_CASES))
def test_a_near_miss_names_the_option_to_use_on_the_command_line_and_in_yaml(key, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    messages = {}
    with pytest.raises(UsageError) as full_cli:  # the full parser
        _parse([*BASE, f"--{key}", "x"])
    messages["full cli"] = _hint(str(full_cli.value), f"--{key}")
    config = _yaml(tmp_path / "run.yaml", {key: "x"})
    with pytest.raises(UsageError) as full_yaml:
        _parse([config, *BASE])
    messages["full yaml"] = _hint(str(full_yaml.value), key)
    if matches_installed_transformers():  # the command's refusal before torch
        assert cli.main(["train", f"--{key}", "x", *BASE]) == 2
        messages["fast cli"] = _hint(capsys.readouterr().err, f"--{key}")
        assert cli.main(["train", config, *BASE]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hf-lisa train: error: {config}: unknown option(s) '{key}' (")
        messages["fast yaml"] = _hint(err, key)
    assert len(set(messages.values())) == 1, messages  # YAML and command line, fast and full: one answer
    message = messages["full cli"]
    for expected in NEAR_MISS_CASES[key]:
        assert expected in message
    for wrong in WRONG:
        assert wrong not in message
    assert "did you mean" not in str(full_cli.value) and "did you mean" not in str(full_yaml.value)


def test_the_help_names_the_aliases():
    from importlib.resources import files

    text = " ".join(files("hf_lisa").joinpath("train_help.txt").read_text().split())
    assert "Also: --lora_r (axolotl), --lora_rank (LLaMA-Factory)." in text
    assert "Also: --cutoff_len (LLaMA-Factory), --sequence_len (axolotl), --max_length (TRL SFTConfig)." in text


def test_the_docs_table_lists_every_alias_and_near_miss():
    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    for name in [*ALIASES, *NEAR_MISSES]:
        assert f"`{name}`" in text, name


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.skipif(not matches_installed_transformers(), reason="option names generated for another transformers")
def test_a_config_files_near_miss_is_refused_without_importing_torch(tmp_path):
    config = _yaml(tmp_path / "axolotl.yaml", {"base_model": "HuggingFaceTB/SmolLM2-135M", "lora_r": 8,
                                                "output_dir": str(tmp_path / "out")})
    typo = _yaml(tmp_path / "typo.yaml", {"learning_rat": 1e-4})
    code = (
        "import sys\n"
        "from hf_lisa import cli\n"
        f"statuses = [cli.main(['train', {config!r}]), cli.main(['train', {typo!r}])]\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'datasets') if m in sys.modules)\n"
        "print(statuses, heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[2, 2] []", result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"hf-lisa train: error: {config}: unknown option(s) 'base_model' (axolotl's "
                               "base_model is the model to load: use --model_name_or_path")
    assert lines[1] == (f"hf-lisa train: error: {typo}: unknown option(s) 'learning_rat' (did you mean "
                        "'learning_rate'?). Run `hf-lisa config-reference` for the full list.")
