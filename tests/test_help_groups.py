"""``hf-lisa train --help`` in titled groups (issue 36, last item): model, data, method, training, output, Hub, in that
order, every option once and in its group, no group empty, each option's LLaMA-Factory / axolotl / TRL aliases in
its help; the one mapping option -> group (:data:`hf_lisa.train.parsing.options.OPTION_GROUPS`) names every hf-lisa option;
the configuration reference (docs/training.md) lists the aliases too."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest

from hf_lisa import cli
from hf_lisa.option_aliases import ALIASES, ALIASES_OF
from hf_lisa.option_names import matches_installed_transformers

TITLES = ["model", "data", "method", "training", "output", "Hub"]


def _help(capsys) -> str:
    assert cli.main(["train", "--help"]) == 0
    return capsys.readouterr().out


def _sections(text: str) -> dict[str, list[list[str]]]:
    """title -> its entries, each the lines of one option (its flags first), from argparse's help layout."""
    sections: dict[str, list[list[str]]] = {}
    entries, described = None, False
    for line in text.splitlines():
        if re.fullmatch(r"\S.*:", line) and not line.startswith("usage:"):
            entries, described = sections.setdefault(line[:-1], []), False
        elif entries is not None and not entries and not described and not line.startswith("  -"):
            described = not line.strip()  # the group's description, up to its blank line
        elif entries is not None and re.match(r"  -", line):
            entries.append([line])
        elif entries is not None and entries and line.startswith("   "):
            entries[-1].append(line)
    return sections


def _flags(entry: list[str]) -> list[str]:
    """The flags an entry's first line names (``--r R, --r-r R`` -> ``['--r', '--r-r']``)."""
    invocation = re.split(r"\s{2,}", entry[0].strip(), maxsplit=1)[0]
    return re.findall(r"(?:^|, )(-{1,2}[\w-]+)", invocation)


def _parser_flags() -> list[str]:
    from hf_lisa.train.parsing.arguments import build_parser

    return [o for action in build_parser()._actions for o in action.option_strings]


def test_the_groups_are_titled_in_order_and_none_is_empty(capsys):
    sections = _sections(_help(capsys))
    assert list(sections) == ["options", *TITLES]
    assert [_flags(e) for e in sections["options"]] == [["-h", "--help"]]  # argparse's own group holds --help alone
    for title in TITLES:
        assert sections[title], f"group {title!r} is empty"


def test_every_option_appears_once_in_its_group(capsys):
    sections = _sections(_help(capsys))
    where = {flag: title for title, entries in sections.items() for e in entries for flag in _flags(e)}
    counts = Counter(flag for entries in sections.values() for e in entries for flag in _flags(e))
    assert sorted(counts) == sorted(_parser_flags())
    assert [flag for flag, n in counts.items() if n != 1] == []
    expected = {
        "model": ["--model_name_or_path", "--torch_dtype", "--load_in_4bit"],
        "data": ["--train_file", "--max_seq_length", "--packing", "--chat_template"],
        "method": ["--method", "--stage", "--r", "--lisa_alpha", "--sparsity", "--mask_init",
                   "--lisa_activated_layers", "--lisa_interval_steps"],
        "training": ["--learning_rate", "--per_device_train_batch_size", "--max_steps", "--optim", "--bf16",
                     "--layerwise_lr_decay", "--monitor_block_groups", "--ddp_comm_hook", "--chunked_loss"],
        "output": ["--output_dir", "--overwrite_output_dir", "--save_steps", "--save_total_limit",
                   "--resume_from_checkpoint", "--keep_checkpoints"],
        "Hub": ["--push_to_hub", "--hub_model_id", "--hub_token", "--push_mode"],
    }
    for title, flags in expected.items():
        assert {flag: where[flag] for flag in flags} == dict.fromkeys(flags, title)
    training = [flag for e in sections["training"] for flag in _flags(e)]
    assert training.index("--per_device_train_batch_size") < training.index("--monitor_block_groups")  # theirs first


def test_each_option_lists_its_aliases(capsys):
    sections = _sections(_help(capsys))
    entries = {flag: " ".join(" ".join(e).split()) for es in sections.values() for e in es for flag in _flags(e)}
    for option, aliases in ALIASES_OF.items():
        note = "Also: " + ", ".join(f"--{a} ({ALIASES[a][1]})" for a in aliases) + "."
        assert note in entries[f"--{option}"], option


def test_every_hf_lisa_option_has_a_group():
    """A new option of hf-lisa's own dataclasses fails here until OPTION_GROUPS names its group."""
    from transformers import TrainingArguments

    from hf_lisa.train.parsing.arguments import _argument_classes
    from hf_lisa.train.parsing.options import HELP_GROUPS, OPTION_GROUPS

    theirs = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for cls in _argument_classes() for f in dataclasses.fields(cls) if f.init} - theirs
    assert sorted(own - set(OPTION_GROUPS)) == []
    assert set(OPTION_GROUPS.values()) <= set(HELP_GROUPS) and list(HELP_GROUPS) == TITLES


@pytest.mark.skipif(not matches_installed_transformers(), reason="names of another transformers version")
def test_the_group_mapping_names_only_options():
    from hf_lisa.train.parsing.options import OPTION_GROUPS

    dests = {flag[2:].replace("-", "_") for flag in _parser_flags()}
    assert sorted(set(OPTION_GROUPS) - dests) == []


def test_the_config_reference_lists_the_aliases():
    reference = cli.config_reference("markdown")
    rows = {line.split("`")[1]: line for line in reference.splitlines() if line.startswith("| `--")}
    tail = reference.split("### `TrainingArguments`", 1)[1]
    for alias, (option, tools) in ALIASES.items():
        if f"--{option}" in rows:
            assert f"`--{alias}` ({tools})" in rows[f"--{option}"], alias
        else:  # a TrainingArguments flag: in the paragraph that stands for them
            assert f"`--{alias}` ({tools}) for `--{option}`" in tail, alias
