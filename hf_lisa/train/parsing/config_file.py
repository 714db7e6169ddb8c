"""A ``hf-lisa train`` config file (YAML or JSON): read it, and type its values as the command line would.

The file's values become the defaults of ``hf-lisa train``'s parser (:func:`hf_lisa.train.parsing.arguments.build_parser`),
so they must have the types the command line gives: ``max_steps: [5]`` or ``learning_rate: fast`` is refused here,
naming the file, the option and what it takes, instead of failing inside the Trainer.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Mapping

from ...data.files import read_user_file
from ...errors import UsageError

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
#: the largest config file read (a config of every option is a few KiB)
CONFIG_FILE_LIMIT = 4 * 2**20
#: options that take a YAML list of sources, ``[{path: a.jsonl, weight: 0.7}, b.jsonl]`` (:mod:`hf_lisa.data.sources`)
SOURCE_LIST_OPTIONS = ("train_file",)


def load_config_file(path: str) -> dict:
    """Read a YAML or JSON mapping of option names to values.

    Raises:
        UsageError: if the file is missing, is not valid YAML/JSON (naming its line and column) or is not a mapping.
    """
    if not os.path.exists(path):
        raise UsageError(f"config file {path!r} does not exist; pass the path of a .yaml, .yml or .json file.")
    raw = read_user_file(path, f"config file {path!r}", CONFIG_FILE_LIMIT, "a .yaml, .yml or .json file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise UsageError(
            f"config file {path!r} is not UTF-8 text: line {line} has the byte {raw[err.start]:#04x}; save it as UTF-8."
        ) from None
    if path.endswith(".json"):
        try:
            config = json.loads(text)
        except json.JSONDecodeError as err:
            raise UsageError(
                f"config file {path!r} is not valid JSON: line {err.lineno}, column {err.colno}: {err.msg}."
            ) from None
    else:
        import yaml

        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise UsageError(f"config file {path!r} is not valid YAML: {_yaml_problem(err)}.") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UsageError(
            f"config file {path!r} must hold a mapping of option names to values, got {type(config).__name__}."
        )
    return config


def _yaml_problem(err) -> str:
    """PyYAML's error as ``line L, column C: problem (context, which starts at line L', column C')``."""
    mark, context_mark = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
    if mark is None:
        return str(err)
    text = f"line {mark.line + 1}, column {mark.column + 1}: {err.problem}"
    if err.context and context_mark is not None:
        text += f" ({err.context}, which starts at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return text


def _expected(kind: Any) -> str:
    """What an option of parser type ``kind`` takes, in words."""
    names = {int: "an integer", float: "a number", str: "a string"}
    if kind in names:
        return names[kind]
    name = getattr(kind, "__name__", str(kind))
    return "true or false" if name == "string_to_bool" else f"a {name}"


def _scalar(action: argparse.Action, name: str, value: Any, source: str) -> Any:
    """``value`` converted by the option's own parser type, as ``--name value`` would be."""
    kind = action.type
    if kind is None or kind is str:
        return value
    if isinstance(value, (list, dict)):
        shape = "a list" if isinstance(value, list) else "a mapping"
        fix = f" Write `{name}: {value[0]}`." if isinstance(value, list) and len(value) == 1 else ""
        raise UsageError(f"{source}: {name}: {value!r} is {shape}; --{name} takes one value, {_expected(kind)}.{fix}")
    try:
        return kind(value if isinstance(value, str) else str(value))
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise UsageError(f"{source}: {name}: {value!r} is invalid; --{name} takes {_expected(kind)}.") from None


def _source_list(name: str, value: Any, source: str) -> list:
    """A YAML list of sources, checked as ``--train_file`` checks its value (:func:`.sources.parse_sources`), kept as
    written (``training_summary.json`` records it so)."""
    from ...data.sources import parse_sources

    try:
        parse_sources(value, option=name)
    except UsageError as err:
        raise UsageError(f"{source}: {err}") from None
    return value


def typed_file_values(parser: argparse.ArgumentParser, values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The parser defaults for ``values`` (a config file's, or the demo's), typed as on the command line.

    One value for a list option becomes a list of one (``target_modules: q_proj``); a list for a one-value option of
    a numeric or boolean type is refused, and so is a value its type cannot parse. Options of type ``str`` keep the
    file's value as it is: transformers and LISA take mappings or lists there (``lr_scheduler_kwargs``,
    ``report_to``, ``rank_pattern``), and ``train_file`` a list of sources (``SOURCE_LIST_OPTIONS``), checked here.

    Raises:
        UsageError: naming ``source``, the option, the value and what the option takes.
    """
    actions = {action.dest: action for action in parser._actions}
    typed = {}
    for name, value in values.items():
        action = actions[name]
        if action.nargs == "+":
            items = value if isinstance(value, list) else [value]
            typed[name] = [_scalar(action, name, item, source) for item in items]
        elif name in SOURCE_LIST_OPTIONS and isinstance(value, (list, dict)):
            typed[name] = _source_list(name, value, source)
        else:
            typed[name] = _scalar(action, name, value, source)
    return typed
