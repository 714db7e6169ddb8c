"""``hf-lisa train --report_to tensorboard``: event files land in the output dir and hold the LISA scalars.

Two bugs this guards against:

* the evaluation before training logs first, so TensorBoard's writer was created before ``on_train_begin`` had chosen
  ``output_dir/runs/...``, and fell back to ``./runs`` of the current directory;
* the Trainer runs user callbacks after the reporting integrations, so the ``lisa/*`` values that
  ``LisaCallback.on_log`` adds to ``logs`` were never written to TensorBoard.
"""

from __future__ import annotations

import glob
import os

import pytest
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

from hf_lisa.train import main

pytest.importorskip("tensorboard")

pytestmark = pytest.mark.slow  # full hf-lisa train runs, with evaluation and TensorBoard


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_tb")
    model_dir = build_tiny_lm_dir(root / "model", num_layers=3)
    train = write_jsonl(root / "train.jsonl", copy_task_rows(32, seed=0))
    validation = write_jsonl(root / "validation.jsonl", copy_task_rows(8, seed=1))
    return {"model": model_dir, "train": train, "validation": validation}


def _argv(tiny, output_dir, *extra) -> list[str]:
    return [
        "--model_name_or_path", tiny["model"], "--train_file", tiny["train"], "--validation_file", tiny["validation"],
        "--output_dir", str(output_dir), "--method", "lisa", "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "8", "--learning_rate", "5e-3", "--logging_steps", "2",
        "--save_strategy", "no", "--report_to", "tensorboard", "--use_cpu", "true", "--disable_tqdm", "true",
        "--eval_generation_samples", "0", "--max_seq_length", "64",
        "--lisa_activated_layers", "1", "--lisa_interval_steps", "2", *extra,
    ]


def _scalars(event_dirs: list[str]) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for directory in event_dirs:
        acc = EventAccumulator(directory, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars


def _event_dirs(root) -> list[str]:
    return sorted({os.path.dirname(p) for p in glob.glob(os.path.join(str(root), "**", "events.out.tfevents.*"),
                                                         recursive=True)})


def test_tensorboard_events_go_to_output_dir_runs_not_the_cwd(tiny, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = tmp_path / "out"
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    main(_argv(tiny, out))

    assert os.listdir(cwd) == []  # no ./runs (nor anything else) in the current directory
    dirs = _event_dirs(out)
    assert dirs, f"no TensorBoard event files under {out}"
    runs = os.path.join(str(out), "runs") + os.sep
    assert all(d.startswith(runs) for d in dirs), dirs
    # the evaluation before training is in there too, at step 0
    scalars = _scalars(dirs)
    assert [step for step, _ in scalars["eval/loss"]] == [0, 4]


def test_tensorboard_logging_dir_override_is_respected(tiny, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    logdir = tmp_path / "tb"
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))  # transformers 5's replacement for logging_dir
    main(_argv(tiny, tmp_path / "out"))

    assert os.listdir(cwd) == []
    assert _event_dirs(logdir) == [str(logdir)]
    assert not _event_dirs(tmp_path / "out")


def test_lisa_and_monitor_scalars_reach_tensorboard(tiny, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    out = tmp_path / "out"
    main(_argv(tiny, out))

    scalars = _scalars(_event_dirs(out))
    # the Trainer prefixes training logs with "train/"
    for tag in ("train/lisa/trainable_params", "train/lisa/active_block_params", "train/lisa/always_trainable_params",
                "train/lisa/optimizer_state_bytes", "train/monitor/grad_norm", "train/loss"):
        assert tag in scalars, (tag, sorted(scalars))
    assert {step for step, _ in scalars["train/lisa/trainable_params"]} == {2, 4}  # logging_steps=2, max_steps=4

    # with --lisa_activated_layers 1, exactly one block's parameters train on top of the always-trainable ones
    base = AutoModelForCausalLM.from_pretrained(tiny["model"])
    block_params = sum(p.numel() for p in base.model.layers[0].parameters())
    always = base.num_parameters() - sum(p.numel() for p in base.model.layers.parameters())
    for step, value in scalars["train/lisa/active_block_params"]:
        assert value == block_params, step
    for step, value in scalars["train/lisa/always_trainable_params"]:
        assert value == always, step
    for step, value in scalars["train/lisa/trainable_params"]:
        assert value == always + block_params, step
    # the monitor's count of trainable parameters agrees with LISA's at every training log
    assert dict(scalars["train/monitor/trainable_params"]) == {2: always + block_params, 4: always + block_params}
