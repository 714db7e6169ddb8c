"""The benchmark's generated tasks (``benchmarks/tasks.py``).

The generators are checked against their own statement (each reply recomputed from the instruction, each label from
the arithmetic in the text); the classification task runs through the harness for every method of the study on a
tiny llama built from config, and each method must train the fresh ``score`` head.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from train_fixtures import build_tiny_lm_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import tasks  # noqa: E402


def _reply_for(instruction: str) -> str:
    """The reply an instruction asks for, computed independently of the generator."""
    head, _, listed = instruction.partition(": ")
    if "?" in instruction:
        head, _, listed = instruction.partition("? ")
    words = [w.strip() for w in listed.split(",")]
    if head.startswith("Sort"):
        return ", ".join(sorted(words))
    if head.startswith("Reverse"):
        return ", ".join(words[::-1])
    if head.startswith("Write this word in capital"):
        return listed.upper()
    if head.startswith("How many"):
        return str(len(words))
    if head.startswith("Which of these words is the longest"):
        return max(words, key=len)
    if head.startswith("Give the first letter"):
        return ", ".join(w[0] for w in words)
    if head.startswith("Repeat"):
        return " ".join([listed] * 3)
    if head.startswith("Which word comes last"):
        return words[-1]
    raise AssertionError(f"unknown instruction {instruction!r}")


def test_instruction_replies_are_what_each_instruction_asks():
    rows = tasks.instruction_rows(400, seed=3)
    kinds = set()
    for row in rows:
        system, user, assistant = row["messages"]
        assert (system["role"], user["role"], assistant["role"]) == ("system", "user", "assistant")
        assert assistant["content"] == _reply_for(user["content"]), user["content"]
        kinds.add(user["content"].split(" ")[0:2][0])
    assert len(kinds) >= 6  # Sort, Reverse, Write, How, Which, Give, Repeat
    assert tasks.instruction_rows(20, seed=3) == rows[:20]  # deterministic for a seed


def test_classification_labels_follow_the_arithmetic():
    rows = tasks.classification_rows(600, seed=5)
    pattern = re.compile(r"had (\d+) \w+ and (found|gave away) (\d+)( more)?\. Claim: \w+ now has (\d+) \w+\.")
    counts = [0, 0, 0]
    for row in rows:
        a, verb, b, _, claim = pattern.fullmatch(row["text"].split(" ", 1)[1]).groups()
        truth = int(a) + int(b) if verb == "found" else int(a) - int(b)
        expected = 1 if int(claim) == truth else (2 if int(claim) > truth else 0)
        assert row["label"] == expected, row
        assert int(claim) > 0
        counts[row["label"]] += 1
    assert min(counts) == 200 and max(counts) == 200  # balanced by construction


def test_task_files_hold_out_validation_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_LISA_CACHE", str(tmp_path))
    for name in ("instructions", "classification"):
        train, validation = tasks.task_files(name, n_train=300, n_validation=40)
        assert str(tmp_path) in train
        train_rows = [line for line in Path(train).read_text().splitlines()]
        validation_rows = Path(validation).read_text().splitlines()
        assert len(train_rows) == 300 and len(validation_rows) == 40
        assert not set(train_rows) & set(validation_rows)
        assert tasks.task_files(name, n_train=300, n_validation=40) == (train, validation)  # cached
    with pytest.raises(ValueError, match="task='nope' is invalid; allowed: arithmetic, instructions"):
        tasks.task_files("nope")


# ----------------------------------------------------------------------------------------------------------------------
# through the harness
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_lm_dir(tmp_path_factory.mktemp("cls") / "model", num_layers=4, hidden=32)


def _tiny_preset(model_dir, **overrides):
    from benchmarks.presets import PRESETS

    return PRESETS["cpu-small"].updated(**{
        "model": model_dir, "task": "classification", "steps": 4, "batch_size": 4, "seq_len": 64, "eval_every": 2,
        "eval_samples": 8, "lisa_interval_steps": 2, "lisa_activated_layers": 2, "lora_r": 4, "importance_steps": 1,
        "timing_warmup_steps": 1, **overrides})


@pytest.mark.slow  # six methods trained in this process on a tiny model (seconds each)
@pytest.mark.parametrize("method", ["lora", "lisa", "lisa-adapter", "lisa-adapter-mixed", "badam", "galore"])
def test_classification_task_trains_the_head_with_every_value_method(tiny_dir, tmp_path, method):
    from transformers import TrainerCallback

    from benchmarks import side_by_side

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.before = {n: p.detach().clone() for n, p in model.named_parameters() if "score" in n}

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.after = {n: p.detach().clone() for n, p in model.named_parameters() if "score" in n}

    watch = Watch()
    result = side_by_side.run_method(method, _tiny_preset(tiny_dir), str(tmp_path), extra_callbacks=[watch])
    assert result["ok"] and result["task"] == "classification" and result["data_format"] == "text+label"
    # the trained head: PEFT's modules_to_save copy for adapters, the model's own for the full-parameter methods
    trained = [n for n in watch.before if "original_module" not in n]
    assert trained and all(not torch.equal(watch.before[n], watch.after[n]) for n in trained), method
    # the optimizer holds exactly what the formula says at every step, the head included
    assert result["optimizer_state"]["max_abs_diff_from_formula"] == 0, method
    assert 0.0 <= result["exact_match"] <= 1.0  # argmax accuracy on the eval rows
    assert result["evals"][-1][1] != result["evals"][0][1]
