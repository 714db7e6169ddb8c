"""Every shell command of README.md is run by a test, or is one of the make targets a reader runs themselves.

The README's ```bash blocks (and any ``$ `` line) are read command by command: a trailing ``\\`` joins lines, a ``#``
comment is dropped. Each command must be listed in ``COMMANDS``:

- ``make`` targets (``make demo``, ``make test``, ...) must exist in the Makefile. ``make test`` is what CI runs
  (``.ci/run``); ``make demo`` is run by whoever follows the README.
- Every other command names the tests that run it, as ``tests/<file>.py::<function>``; each must exist. Those tests
  run the command's form on a tiny model built from a config, and the note says what differs from the README's
  line (the README's own model, data and step counts would take minutes to hours on CPU).

The ```python blocks are run by ``tests/test_readme_snippets.py``.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHELL_FENCES = ("```bash", "```sh", "```shell", "```console")
MAKE_TARGETS = ("demo", "test", "install", "bench", "bench-study", "test-distributed")

#: each README command (whitespace normalised) -> (tests that run it, what they run differently)
COMMANDS: dict[str, tuple[tuple[str, ...], str]] = {
    "make demo": ((), "make target: run as written by the reader"),
    "make test": ((), "make target: run as written by CI (.ci/run)"),
    "make bench-study": (
        ("tests/test_study.py::test_real_runs_record_losses_coverage_and_resume_from_the_file",
         "tests/test_study.py::test_the_grid_extends_until_the_best_rate_is_interior_then_the_seeds_run_at_it"),
        "benchmarks/study.py, what `make bench-study` runs, under its tiny preset (a tiny llama, a few steps); the "
        "grid's extension and the seeds planned on recorded results",
    ),
    "accelerate launch -m hf_lisa.train examples/configs/smollm2_lisa.yaml": (
        ("tests/test_train_cli.py::test_accelerate_launch_runs_the_module_with_a_yaml_config",
         "tests/test_train_cli.py::test_shipped_example_configs_parse"),
        "`accelerate launch -m hf_lisa.train CONFIG.yaml` with a tiny model's config; the shipped YAML is parsed",
    ),
    "accelerate launch -m hf_lisa.train examples/configs/smollm2_lisa.yaml --model_name_or_path "
    "HuggingFaceTB/SmolLM2-360M-Instruct --train_file my_data.jsonl --max_steps 500": (
        ("tests/test_train_cli.py::test_accelerate_launch_runs_the_module_with_a_yaml_config",
         "tests/test_train_cli.py::test_yaml_config_with_a_command_line_override"),
        "a YAML config with command-line overrides, on a tiny model and a tiny jsonl file",
    ),
    "hf-lisa train --method lisa-adapter --sparsity 0.4 --train_file my_data.jsonl --output_dir out --max_steps 200": (
        ("tests/test_train_cli.py::test_every_method_trains_saves_and_reloads",),
        "hf_lisa.train.main (what `hf-lisa train` calls) with --method lisa-adapter --sparsity 0.5, 4 steps",
    ),
    "hf-lisa train --method lisa-adapter --train_file alpaca.jsonl --chat_template chatml --output_dir out "
    "--max_steps 200": (
        ("tests/test_formats.py::test_hf_lisa_train_on_an_alpaca_file",),
        "`hf-lisa train` (hf_lisa.cli.main) on an Alpaca file with --chat_template chatml, a tiny model, 4 steps",
    ),
    "hf-lisa train --method lisa-adapter --train_file my_data.jsonl --output_dir out --push_to_hub --hub_model_id "
    "me/smollm2-lisa --push_mode adapter": (
        ("tests/test_train_cli.py::test_push_to_hub_goes_through_hf_lisa_hub_and_uploads_no_pickle",),
        "hf_lisa.train.main with --push_to_hub --push_mode adapter (method lora) to a local Hub server",
    ),
    "hf-lisa push out me/smollm2-lisa --mode adapter": (
        ("tests/test_hub.py::test_cli_pushes_merged_sharded_safetensors_without_leaking_the_token",
         "tests/test_hub.py::test_adapter_push_uploads_only_safetensors_config_card_plot_and_tokenizer"),
        "`hf-lisa push` (hf_lisa.hub.hub_cli) in a fresh process, --mode merged; --mode adapter through the same "
        "push_to_hub it calls; both to a local Hub server",
    ),
}


def readme_commands(text: str) -> list[str]:
    """The shell commands of ```bash/sh/shell/console blocks and of ``$ `` lines, one string each, in order."""
    commands, words, fence, shell = [], [], False, False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            shell = fence and line.strip() in SHELL_FENCES
            continue
        if not shell and (fence or not line.startswith("$ ")):
            continue
        source = line.strip().removeprefix("$ ")
        continued = source.endswith("\\")
        words += shlex.split(source.removesuffix("\\"), comments=True)
        if not continued and words:
            commands.append(" ".join(words))
            words = []
    return commands


def _defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_readme_commands_are_parsed():
    commands = readme_commands(README.read_text())
    assert "make demo" in commands and "make test" in commands, commands


def test_every_readme_command_is_run_by_a_test_or_is_a_make_target():
    commands = readme_commands(README.read_text())
    unlisted = [c for c in commands if c not in COMMANDS]
    assert not unlisted, f"README commands that no test is known to run (list them in COMMANDS): {unlisted}"
    gone = [c for c in COMMANDS if c not in commands]
    assert not gone, f"COMMANDS lists commands that are no longer in README.md: {gone}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_listed_command_names_tests_that_exist(command):
    tests, note = COMMANDS[command]
    assert note
    if command.startswith("make "):
        target = command.split()[1]
        assert target in MAKE_TARGETS and re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.M)
        return
    assert tests, f"{command!r} names no test"
    for test in tests:
        file, _, name = test.partition("::")
        assert (ROOT / file).is_file(), test
        assert name in _defined_tests(ROOT / file), f"{test} does not exist"
