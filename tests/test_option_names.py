"""``hf_lisa.option_names``: the fast refusal of a mistyped ``hf-lisa train`` flag knows exactly the parser's names.

``python tests/test_option_names.py --write`` regenerates ``hf_lisa/option_names.py`` from the real parser (after an
option is added, or for another transformers version).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_lisa import option_names

MODULE = Path(__file__).resolve().parents[1] / "hf_lisa" / "option_names.py"


def parser_names() -> set[str]:
    from hf_lisa.train.parsing.arguments import build_parser

    return {o[2:].replace("-", "_") for action in build_parser()._actions for o in action.option_strings
            if o.startswith("--") and o != "--help"}


def render() -> str:
    names = "\n".join(textwrap.wrap(", ".join(repr(n) for n in sorted(parser_names())), 116,
                                    initial_indent="    ", subsequent_indent="    ")) + ","
    template = (Path(__file__).resolve().parent / "option_names_template.py.txt").read_text()
    return template.format(version=importlib.metadata.version("transformers"), names=names)


generated_here = pytest.mark.skipif(not option_names.matches_installed_transformers(),
                                    reason="generated for another transformers version")


@generated_here
def test_the_names_are_the_parsers():
    assert option_names.NAMES == parser_names(), "out of date: run python tests/test_option_names.py --write"


def test_another_transformers_version_falls_back_to_the_full_parser(monkeypatch):
    monkeypatch.setattr(option_names, "TRANSFORMERS_VERSION", "0.0.0")
    assert option_names.unknown_options(["--lisa_interval_step", "5"]) == []


@generated_here
def test_unknown_flags_are_found_and_known_forms_pass():
    argv = ["run.yaml", "--learning-rate", "1e-4", "--no_remove_unused_columns", "--max_steps=3",
            "--lisa_interval_step", "5", "--lr=0.1", "--help", "--debug"]
    assert option_names.unknown_options(argv) == ["--lisa_interval_step", "--lr"]
    assert option_names.suggestion("--lisa_interval_step") == "'--lisa_interval_step' (did you mean '--lisa_interval_steps'?)"


@pytest.mark.slow  # a fresh interpreter
@generated_here
def test_a_mistyped_flag_is_refused_without_importing_torch():
    code = (
        "import sys\n"
        "from hf_lisa import cli\n"
        "status = cli.main(['train', '--lisa_interval_step', '5', '--output_dir', 'out'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'datasets') if m in sys.modules)\n"
        "print(status, heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "2 []", result.stderr[-2000:]
    assert result.stderr.strip() == (
        "hf-lisa train: error: unrecognised argument(s): '--lisa_interval_step' (did you mean "
        "'--lisa_interval_steps'?). Run `hf-lisa config-reference` for the full list.")


HELP = MODULE.parent / "train_help.txt"


def parser_help() -> str:
    """``hf-lisa train --help`` as the full parser prints it, wrapped for 100 columns."""
    import os

    from hf_lisa.train.parsing.arguments import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return build_parser().format_help()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


@generated_here
def test_the_static_help_is_the_parsers():
    assert HELP.read_text() == parser_help(), "out of date: run python tests/test_option_names.py --write"


@pytest.mark.slow  # a fresh interpreter
@generated_here
def test_train_help_answers_without_importing_torch():
    code = (
        "import sys\n"
        "from hf_lisa import cli\n"
        "status = cli.main(['train', '--help'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'datasets') if m in sys.modules)\n"
        "print(status, heavy, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stderr.strip().splitlines()[-1] == "0 []", result.stderr[-2000:]
    assert result.stdout == HELP.read_text() and "--lisa_activated_layers" in result.stdout


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    MODULE.write_text(render())
    HELP.write_text(parser_help())
    print(f"wrote {MODULE} and {HELP}")
