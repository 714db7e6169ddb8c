"""Resuming a weighted mixture with other mixing settings is refused before the model loads (issue 33: "resume with a
different --mix_strategy / --mix weights silently rebuilds another mixture").

Every checkpoint of a mixed run records its ``--mix_strategy``, normalised weights, ``--seed`` and sources
(``trainer_state.json``, ``stateful_callbacks.MixtureRecord``); a resume that would draw another mixture names each
option with this run's value and the checkpoint's. The same mixture typed another way (weights ``6,4`` for ``0.6,0.4``,
LLaMA-Factory's ``interleave_under`` for ``first_exhausted``) resumes.

The real command on a tiny 2-block llama (``tests/train_fixtures.py``).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from test_bad_inputs import forbid_weight_loading  # noqa: F401 (a fixture: any weight read raises)
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

from hf_lisa import cli

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """A run on ``a:0.6,b:0.4`` (first_exhausted, seed 13) with a checkpoint at step 3 of 6."""
    root = tmp_path_factory.mktemp("mixture_resume")
    model = build_tiny_lm_dir(root / "model", num_layers=2)
    a = write_jsonl(root / "a.jsonl", copy_task_rows(20, seed=1))
    b = write_jsonl(root / "b.jsonl", copy_task_rows(16, seed=2))
    status = train(model, f"{a}:0.6,{b}:0.4", root / "whole")
    assert status == 0
    return {"root": root, "model": model, "a": a, "b": b}


def train(model, spec, output_dir, *extra) -> int:
    return cli.main([
        "train", "--model_name_or_path", model, "--train_file", spec, "--output_dir", str(output_dir), "--method",
        "full", "--max_steps", "6", "--save_steps", "3", "--save_strategy", "steps", "--per_device_train_batch_size",
        "2", "--learning_rate", "1e-2", "--max_seq_length", "96", "--validation_split_percentage", "0",
        "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true", "--eval_generation_samples", "0",
        "--seed", "13", *extra,
    ])


def resume(run, tmp_path, spec, *extra) -> int:
    out = tmp_path / "resumed"
    shutil.copytree(run["root"] / "whole" / "checkpoint-3", out / "checkpoint-3")  # stopped after step 3
    return train(run["model"], spec.format(**run), out, "--resume_from_checkpoint", "latest", *extra)


def test_each_checkpoint_records_the_mixture(mixed_run):
    for step in (3, 6):
        state = json.loads((mixed_run["root"] / "whole" / f"checkpoint-{step}" / "trainer_state.json").read_text())
        settings = state["stateful_callbacks"]["MixtureRecord"]["args"]["settings"]
        assert settings == {"mix_strategy": "first_exhausted", "mix_strategy_option": "auto", "seed": 13,
                            "weights": [0.6, 0.4], "sources": [f"train_file={mixed_run['a']!r}",
                                                               f"train_file={mixed_run['b']!r}"]}


@pytest.mark.parametrize("spec, extra, message", [
    ("{a}:0.6,{b}:0.4", ["--mix_strategy", "all_exhausted"],
     r"--mix_strategy=all_exhausted \(the checkpoint has first_exhausted\)"),
    ("{a}:0.6,{b}:0.4", ["--mix_strategy", "interleave_over"],
     r"--mix_strategy=interleave_over \(all_exhausted; the checkpoint has first_exhausted\)"),
    ("{a}:0.2,{b}:0.8", [], r"--train_file weights 0\.2, 0\.8 \(the checkpoint has 0\.6, 0\.4\)"),
    ("{a}:0.6,{b}:0.4", ["--seed", "14"], r"--seed=14 \(the checkpoint's mixture was drawn with 13\)"),
    ("{a}:0.2,{b}:0.8", ["--mix_strategy", "all_exhausted"],
     r"--mix_strategy=all_exhausted \(the checkpoint has first_exhausted\); --train_file weights 0\.2, 0\.8"),
    ("{a}", [], r"was trained on a mixture of 2 sources \(train_file='.*a\.jsonl', train_file='.*b\.jsonl'\), but "
                r"this run reads one training source"),
])
@pytest.mark.usefixtures("forbid_weight_loading")
def test_resuming_with_another_mixture_is_refused_before_the_model_loads(mixed_run, tmp_path, capsys, spec, extra,
                                                                        message):
    status = resume(mixed_run, tmp_path, spec, *extra)
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    assert re.search(message, err), err[-2000:]
    assert "Resume with the checkpoint's values, or start a new run in another --output_dir" in err
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir() if not p.name.startswith(".")) == ["checkpoint-3"]


@pytest.mark.parametrize("spec, extra", [("{a}:6,{b}:4", []), ("{a}:0.6,{b}:0.4", ["--mix_strategy",
                                                                                 "interleave_under"])])
def test_the_same_mixture_typed_another_way_resumes(mixed_run, tmp_path, spec, extra):
    assert resume(mixed_run, tmp_path, spec, *extra) == 0
    assert (tmp_path / "resumed" / "model.safetensors").exists()
