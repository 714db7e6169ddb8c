"""Nothing lost, nothing silently wrong, where ``hf-lisa train`` writes: output directories, resume, secrets, and saves
interrupted by a full disk or SIGKILL (issue 12).

* ``REFUSED``: bad ``--output_dir`` / ``--resume_from_checkpoint`` inputs. Each must fail with one message naming the
  option, the path or value and the fix, *before* the model or the data load: the loaders are replaced by a tripwire.
* ``HANDLED``: reused folders, resumes and secrets that must train correctly, each checked on what the run left.
* Full disk and SIGKILL during the final save and during a checkpoint save (``tests/output_safety_driver.py`` blocks
  the run inside the save, the test kills it): no folder that a loader would take for a complete model or checkpoint
  is left, and a checkpoint save killed half-way resumes from the previous checkpoint.

Tiny models (a 3-block llama with a character tokenizer) and 16 rows; every run is a few optimizer steps on CPU.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl
from transformers.trainer_utils import get_last_checkpoint

import hf_lisa  # noqa: F401  (registers LISA with PEFT for the reloads)
from hf_lisa.scheduler.state import LISA_STATE_FILE
from hf_lisa.train import main
from hf_lisa.train.run_folder.output_dir import MANIFEST_NAME, latest_checkpoint

REPO = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("output_safety_driver.py")
CHECKPOINT = re.compile(r"^checkpoint-\d+$")

#: the options of each method's runs here (an option a method does not use is refused)
METHOD_OPTIONS = {
    "lisa": ["--lisa_activated_layers", "1", "--lisa_interval_steps", "2"],
    "lisa-adapter": ["--r", "4", "--lisa_activated_layers", "1", "--lisa_interval_steps", "2", "--sparsity", "0.5",
                     "--mask_init", "random", "--mask_update_interval", "2", "--importance_steps", "1"],
    "lora": ["--r", "4"],
    "dora": ["--r", "4"],
    "full": [],
}


def _argv(tiny: dict, output_dir, method: str = "lisa", *extra: str) -> list[str]:
    return [
        "--model_name_or_path", tiny["model"], "--train_file", tiny["train"], "--output_dir", str(output_dir),
        "--max_steps", "4", "--per_device_train_batch_size", "4", "--save_strategy", "steps", "--save_steps", "2",
        "--logging_steps", "3", "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true",
        "--max_seq_length", "64", "--validation_split_percentage", "0", "--eval_generation_samples", "0",
        "--learning_rate", "5e-3", "--method", method, *METHOD_OPTIONS[method], *extra,
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("output_safety")
    return {"root": root, "model": build_tiny_lm_dir(root / "model", num_layers=3),
            "train": write_jsonl(root / "train.jsonl", copy_task_rows(16, seed=0))}


@pytest.fixture(scope="module")
def runs(tiny):
    """Finished runs (checkpoints at steps 2 and 4, then the final model) of three methods; read-only for the tests."""
    done = {}
    for method in ("lisa", "lisa-adapter", "lora"):
        done[method] = str(tiny["root"] / method)
        done[method + ":summary"] = main(_argv(tiny, done[method], method))
    return done


class Ctx:
    """What a case's setup builds on: a fresh ``tmp`` folder, the tiny model and data, and the finished runs."""

    def __init__(self, tmp: Path, tiny: dict, runs: dict, monkeypatch) -> None:
        self.tmp, self.tiny, self.runs, self.monkeypatch = tmp, tiny, runs, monkeypatch
        self.out = tmp / "out"

    def copy_run(self, method: str) -> str:
        shutil.copytree(self.runs[method], self.out)
        return str(self.out)

    def copy_model(self, where: Path) -> str:
        shutil.copytree(self.tiny["model"], where)
        return str(where)

    def checkpoint(self, method: str, step: int = 2) -> str:
        return os.path.join(self.runs[method], f"checkpoint-{step}")

    def broken_checkpoint(self, remove: str, where: Path = None) -> str:
        where = where or self.tmp / "old" / "checkpoint-2"
        shutil.copytree(self.checkpoint("lisa"), where)
        os.remove(where / remove)
        return str(where)


Setup = Callable[[Ctx], tuple[str, list[str]]]  # -> (--output_dir, more options)


@dataclass
class Refused:
    id: str
    setup: Setup
    fragments: tuple[str, ...]
    method: str = "lisa"


def _file(c: Ctx) -> Path:
    path = c.tmp / "notes.txt"
    path.write_text("not a folder")
    return path


def _model_via_symlink(c: Ctx):
    model = c.copy_model(c.tmp / "model")
    (c.tmp / "link").symlink_to(model)
    return str(c.tmp / "link"), ["--model_name_or_path", model]


def _model_via_relative_path(c: Ctx):
    model = c.copy_model(c.tmp / "model")
    (c.tmp / "work").mkdir()
    c.monkeypatch.chdir(c.tmp / "work")
    return "../model/.", ["--model_name_or_path", model]


def _foreign_files(c: Ctx, *names: str) -> str:
    c.out.mkdir()
    for name in names:
        if name.endswith(".bin"):
            torch.save({"w": torch.zeros(2)}, c.out / name)
        else:
            shutil.copy(os.path.join(c.runs["lora"], name), c.out / name)
    return str(c.out)


def _truncated_trainer_state(c: Ctx) -> str:
    checkpoint = c.broken_checkpoint("trainer_state.json")
    Path(checkpoint, "trainer_state.json").write_text('{"global_step": 2, "stateful')
    return checkpoint


def _logs_only(c: Ctx):
    (c.out / "runs" / "Dec01_12-00-00_host").mkdir(parents=True)
    return str(c.out), []


def _resume(method: str, *more: str) -> Setup:
    return lambda c: (str(c.out), ["--resume_from_checkpoint", c.checkpoint(method), *more])


REFUSED = [
    # --output_dir
    Refused("output-dir-is-a-file", lambda c: (str(_file(c)), []), ("notes.txt is a file, not a folder",)),
    Refused("output-dir-inside-a-file", lambda c: (str(_file(c) / "sub"), []),
            ("cannot be created", "notes.txt is a file")),
    Refused("output-dir-is-the-model",
            lambda c: (c.copy_model(c.tmp / "m"), ["--model_name_or_path", str(c.tmp / "m")]),
            ("is the folder of the model being trained", "--model_name_or_path=", "Choose another --output_dir")),
    Refused("output-dir-is-the-model-via-symlink", _model_via_symlink, ("is the folder of the model being trained",)),
    Refused("output-dir-is-the-model-via-relative-path", _model_via_relative_path,
            ("--output_dir=../model/. is the folder of the model being trained",)),
    Refused("output-dir-is-the-model-with-overwrite",
            lambda c: (c.copy_model(c.tmp / "m"), ["--model_name_or_path", str(c.tmp / "m"),
                                                   "--overwrite_output_dir", "true"]),
            ("is the folder of the model being trained", "even with --overwrite_output_dir")),
    Refused("model-is-a-checkpoint-of-output-dir",
            lambda c: (str(c.out), ["--model_name_or_path", c.copy_model(c.out / "checkpoint-2"),
                                    "--overwrite_output_dir", "true"]),
            ("holds the model being trained as checkpoint-2", "checkpoints replace")),
    Refused("output-dir-holds-a-downloaded-model", lambda c: (c.copy_model(c.out), []),
            ("holds model weights (model.safetensors)", "no hf-lisa train run wrote", "training_summary.json")),
    Refused("output-dir-holds-a-downloaded-model-with-overwrite",
            lambda c: (c.copy_model(c.out), ["--overwrite_output_dir", "true"]),
            ("holds model weights", "even with --overwrite_output_dir")),
    Refused("output-dir-holds-a-foreign-adapter",
            lambda c: (_foreign_files(c, "adapter_config.json", "adapter_model.safetensors"), []),
            ("holds model weights (adapter_model.safetensors)",)),
    Refused("output-dir-holds-a-pickled-model", lambda c: (_foreign_files(c, "pytorch_model.bin"), []),
            ("holds model weights (pytorch_model.bin)",)),
    Refused("output-dir-not-empty", lambda c: (str(_file(c).parent), []),
            ("is not empty (it holds notes.txt)", "--overwrite_output_dir", "another --output_dir")),
    Refused("output-dir-holds-only-the-logs-of-a-killed-run", _logs_only,
            ("is not empty (it holds runs)", "--overwrite_output_dir")),
    Refused("output-dir-holds-a-previous-run", lambda c: (c.copy_run("lisa"), []),
            ("is not empty", "--resume_from_checkpoint latest to continue from", "checkpoint-4")),
    # --resume_from_checkpoint
    Refused("resume-latest-without-checkpoints",
            lambda c: (str(_file(c).parent), ["--resume_from_checkpoint", "latest"]),
            ("--resume_from_checkpoint=latest", "holds no complete checkpoint-N folder", "nothing to resume")),
    Refused("resume-true-output-dir-missing", lambda c: (str(c.out), ["--resume_from_checkpoint", "true"]),
            ("--resume_from_checkpoint=true", "does not exist")),
    Refused("resume-latest-only-an-interrupted-checkpoint",
            lambda c: (str(Path(c.broken_checkpoint("trainer_state.json")).parent), ["--resume_from_checkpoint",
                                                                                    "latest"]),
            ("holds no complete checkpoint-N folder",)),
    Refused("resume-path-missing", lambda c: (str(c.out), ["--resume_from_checkpoint", str(c.tmp / "nope")]),
            ("nope is not a checkpoint to resume: it does not exist",)),
    Refused("resume-false", lambda c: (str(c.out), ["--resume_from_checkpoint", "false"]),
            ("--resume_from_checkpoint=false is not a checkpoint to resume", "latest/true")),
    Refused("resume-a-file", lambda c: (str(c.out), ["--resume_from_checkpoint", str(_file(c))]),
            ("is not a checkpoint to resume: it is not a folder",)),
    Refused("resume-checkpoint-without-trainer-state",
            lambda c: (str(c.out), ["--resume_from_checkpoint", c.broken_checkpoint("trainer_state.json")]),
            ("it has no trainer_state.json",)),
    Refused("resume-checkpoint-without-lisa-state",
            lambda c: (str(c.out), ["--resume_from_checkpoint", c.broken_checkpoint(LISA_STATE_FILE)]),
            (f"its LISA schedule has no {LISA_STATE_FILE}",)),
    Refused("resume-checkpoint-with-a-truncated-trainer-state",
            lambda c: (str(c.out), ["--resume_from_checkpoint", _truncated_trainer_state(c)]),
            ("its trainer_state.json is not valid JSON",)),
    Refused("resume-an-unfinished-save",
            lambda c: (str(c.out), ["--resume_from_checkpoint", c.broken_checkpoint(
                "rng_state.pth", c.tmp / "old" / ".partial-checkpoint-2" / "checkpoint-2")]),
            ("is an unfinished save",)),
    Refused("resume-with-overwrite",
            lambda c: (c.copy_run("lisa"), ["--resume_from_checkpoint", "latest", "--overwrite_output_dir", "true"]),
            ("--overwrite_output_dir would delete the checkpoints", "including --resume_from_checkpoint=")),
    Refused("resume-changes-K", _resume("lisa", "--lisa_interval_steps", "3"),
            ("changes the LISA schedule", "--lisa_interval_steps=3 (the checkpoint has 2)")),
    Refused("resume-changes-gamma", _resume("lisa", "--lisa_activated_layers", "2"),
            ("--lisa_activated_layers=2 (the checkpoint has 1)",)),
    Refused("resume-changes-sampling", _resume("lisa", "--lisa_sampling", "cyclic"),
            ("--lisa_sampling='cyclic' (the checkpoint has 'uniform')",)),
    Refused("resume-changes-K-and-gamma", _resume("lisa", "--lisa_interval_steps", "5", "--lisa_activated_layers", "2"),
            ("--lisa_activated_layers=2 (the checkpoint has 1)", "--lisa_interval_steps=5 (the checkpoint has 2)")),
    Refused("resume-changes-mask-update-interval", _resume("lisa-adapter", "--mask_update_interval", "3"),
            ("--mask_update_interval=3 (the checkpoint has 2)",), "lisa-adapter"),
    Refused("resume-changes-importance-steps", _resume("lisa-adapter", "--importance_steps", "2"),
            ("--importance_steps=2 (the checkpoint has 1)",), "lisa-adapter"),
    Refused("resume-adapter-turns-sampling-off",  # K back at its default: with γ = 0 a K of 2 is refused for itself
            _resume("lisa-adapter", "--lisa_activated_layers", "0", "--lisa_interval_steps", "20"),
            ("--lisa_activated_layers=0 (the checkpoint has 1)",), "lisa-adapter"),
    Refused("resume-lora-checkpoint-as-lisa", _resume("lora"),
            ("was written by --method lora, but this run is --method lisa",)),
    Refused("resume-lora-checkpoint-as-dora", _resume("lora"), ("written by --method lora",), "dora"),
    Refused("resume-lisa-checkpoint-as-adapter", _resume("lisa"), ("written by --method lisa,",), "lisa-adapter"),
    Refused("resume-lisa-checkpoint-as-full", _resume("lisa"), ("written by --method lisa,",), "full"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[case.id for case in REFUSED])
def test_refused_before_anything_loads(case, tiny, runs, tmp_path, monkeypatch):
    import transformers

    import hf_lisa.data.pipeline as data_module

    def tripwire(*args, **kwargs):
        raise AssertionError("weights or data were loaded before the output directory was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", tripwire)
    monkeypatch.setattr(data_module, "load_raw_datasets", tripwire)
    output_dir, extra = case.setup(Ctx(tmp_path, tiny, runs, monkeypatch))
    with pytest.raises(ValueError) as raised:
        main(_argv(tiny, output_dir, case.method, *extra))
    for fragment in case.fragments:
        assert fragment in str(raised.value), str(raised.value)


# ----------------------------------------------------------------------------------------------------------------------
# Handled: the run trains, and leaves exactly what it should
# ----------------------------------------------------------------------------------------------------------------------
def _model_in(folder) -> str | None:
    """What a loader would take ``folder`` for: ``"adapter"``, ``"model"`` or ``None``; it must then load whole."""
    files = set(os.listdir(folder))
    weights = {"model.safetensors", "model.safetensors.index.json"} & files
    assert not (weights and "adapter_model.safetensors" in files), f"two models mixed in {folder}: {sorted(files)}"
    if {"adapter_config.json", "adapter_model.safetensors"} <= files:
        load_file(os.path.join(folder, "adapter_model.safetensors"))
        json.loads(Path(folder, "adapter_config.json").read_text())
        return "adapter"
    if weights and "config.json" in files:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(folder)
        return "model"
    return None


def _assert_checkpoints_complete(output_dir) -> list[str]:
    """Every ``checkpoint-N`` (what ``get_last_checkpoint`` picks from) is whole: trainer state, schedule, weights."""
    names = sorted(n for n in os.listdir(output_dir) if CHECKPOINT.match(n))
    for name in names:
        folder = os.path.join(output_dir, name)
        json.loads(Path(folder, "trainer_state.json").read_text())
        assert os.path.isfile(os.path.join(folder, LISA_STATE_FILE)), folder
        assert _model_in(folder) is not None, folder
    last = get_last_checkpoint(output_dir)
    assert last == latest_checkpoint(output_dir) or (last is None and not names)
    return names


def _hidden(folder) -> list[str]:
    """The hidden names in ``folder`` besides the manifest: staging folders or a lock file a run left behind."""
    return [n for n in os.listdir(folder) if n.startswith(".") and n != MANIFEST_NAME]


def _global_step(checkpoint) -> int:
    return json.loads(Path(checkpoint, "trainer_state.json").read_text())["global_step"]


@dataclass
class Handled:
    id: str
    setup: Setup
    check: Callable[[Ctx, dict], None]  # (context, the run's summary)
    method: str = "lisa"


def _check_adapter_replaced_full_model(c: Ctx, summary: dict) -> None:
    files = set(os.listdir(c.out))
    assert _model_in(c.out) == "adapter" and not {"model.safetensors", "config.json", "generation_config.json"} & files
    assert json.loads(Path(c.out, "training_summary.json").read_text())["method"] == "lisa-adapter"
    for name in ("checkpoint-2", "checkpoint-4"):  # the lisa run's checkpoints went before training started
        assert "adapter_model.safetensors" in os.listdir(c.out / name) and "model.safetensors" not in os.listdir(
            c.out / name)


def _check_full_model_replaced_adapter(c: Ctx, summary: dict) -> None:
    files = set(os.listdir(c.out))
    assert _model_in(c.out) == "model" and not {"adapter_config.json", "adapter_model.safetensors"} & files


def _with_interrupted_checkpoint_6(c: Ctx):
    c.copy_run("lisa")
    shutil.copytree(c.out / "checkpoint-4", c.out / "checkpoint-6")  # what an interrupted save left (pre-issue 12)
    os.remove(c.out / "checkpoint-6" / "trainer_state.json")
    return str(c.out), ["--resume_from_checkpoint", "latest", "--max_steps", "6"]


def _check_resumed_to_6(c: Ctx, summary: dict) -> None:
    assert summary["hyperparameters"]["max_steps"] == 6
    assert _assert_checkpoints_complete(c.out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert _global_step(c.out / "checkpoint-6") == 6 and _model_in(c.out) == "model"


def _check_adapter(c: Ctx, summary: dict) -> None:
    assert _model_in(c.out) == "adapter" and summary["hyperparameters"]["max_steps"] == 6


def _with_leftovers(c: Ctx):
    for staging in (".partial-checkpoint-2/checkpoint-2", ".partial-final"):
        (c.out / staging).mkdir(parents=True)
        (c.out / staging / "model.safetensors").write_bytes(b"half")
    return str(c.out), []


def _check_leftovers_gone(c: Ctx, summary: dict) -> None:
    assert not _hidden(c.out)
    assert _model_in(c.out) == "model" and _assert_checkpoints_complete(c.out) == ["checkpoint-2", "checkpoint-4"]


def _check_no_token(c: Ctx, summary: dict) -> None:
    written = [p for p in c.out.rglob("*") if p.is_file()]
    assert any(p.name.startswith("events.out.tfevents") for p in written)  # TensorBoard logged the arguments too
    assert any(p.name == "training_args.bin" for p in written)  # in the checkpoints, without the token
    for path in written:
        assert b"hf_h5_secret_token" not in path.read_bytes(), path


def _check_whole_run_loss(c: Ctx, summary: dict) -> None:
    uninterrupted = c.runs["lisa:summary"]["metrics"]["train_loss"]
    assert summary["metrics"]["train_loss"] == pytest.approx(uninterrupted, rel=1e-5)
    assert f"| train_loss | {uninterrupted:.4g} |" in (c.out / "README.md").read_text()  # the card says the same


HANDLED = [
    Handled("overwrite-full-lisa-run-with-an-adapter-run",
            lambda c: (c.copy_run("lisa"), ["--overwrite_output_dir", "true"]),
            _check_adapter_replaced_full_model, "lisa-adapter"),
    Handled("overwrite-adapter-run-with-a-full-lisa-run",
            lambda c: (c.copy_run("lisa-adapter"), ["--overwrite_output_dir", "true"]),
            _check_full_model_replaced_adapter),
    Handled("resume-latest-skips-an-interrupted-checkpoint", _with_interrupted_checkpoint_6, _check_resumed_to_6),
    Handled("resume-true-continues-own-checkpoints",
            lambda c: (c.copy_run("lisa"), ["--resume_from_checkpoint", "true", "--max_steps", "6"]),
            _check_resumed_to_6),
    Handled("resume-lora-run",  # from checkpoint-4 on: at --max_steps 4 there is nothing left to train (item 5)
            lambda c: (c.copy_run("lora"), ["--resume_from_checkpoint", "latest", "--max_steps", "6"]),
            _check_adapter, "lora"),
    Handled("leftovers-of-a-killed-run-count-as-empty", _with_leftovers, _check_leftovers_gone),
    Handled("hub-token-is-written-nowhere",
            lambda c: (str(c.out), ["--hub_token", "hf_h5_secret_token", "--report_to", "tensorboard"]),
            _check_no_token),
    Handled("train-loss-after-resume-covers-the-whole-run",
            lambda c: (c.copy_run("lisa"), ["--resume_from_checkpoint", str(c.out / "checkpoint-2")]),
            _check_whole_run_loss),
]


@pytest.mark.slow  # full hf-lisa train runs (overwrites, resumes), 1-4 s each
@pytest.mark.parametrize("case", HANDLED, ids=[case.id for case in HANDLED])
def test_handled(case, tiny, runs, tmp_path, monkeypatch):
    ctx = Ctx(tmp_path, tiny, runs, monkeypatch)
    output_dir, extra = case.setup(ctx)
    summary = main(_argv(tiny, output_dir, case.method, *extra))
    case.check(ctx, summary)


# ----------------------------------------------------------------------------------------------------------------------
# A full disk: the save fails, nothing half-written is left
# ----------------------------------------------------------------------------------------------------------------------
def _disk_full_at(monkeypatch, where: str) -> None:
    import transformers.modeling_utils

    real = transformers.modeling_utils.safe_save_file

    def save(tensors, filename, metadata=None):
        if where in str(filename):
            with open(filename, "wb") as f:
                f.write(b"\0" * 64)  # what fitted on the disk
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save)


@pytest.mark.slow  # a full hf-lisa train run up to the failing save
def test_disk_full_during_a_checkpoint_leaves_the_previous_checkpoints(tiny, tmp_path, monkeypatch):
    _disk_full_at(monkeypatch, ".partial-checkpoint-4")
    with pytest.raises(OSError, match="No space left"):
        main(_argv(tiny, tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == [MANIFEST_NAME, "checkpoint-2"]
    assert _assert_checkpoints_complete(tmp_path / "out") == ["checkpoint-2"]


@pytest.mark.slow  # a full hf-lisa train run up to the failing save
def test_disk_full_during_the_final_save_leaves_the_previous_model(tiny, runs, tmp_path, monkeypatch):
    ctx = Ctx(tmp_path, tiny, runs, monkeypatch)
    ctx.copy_run("lisa-adapter")
    before = load_file(str(ctx.out / "adapter_model.safetensors"))
    _disk_full_at(monkeypatch, ".partial-final")
    with pytest.raises(OSError, match="No space left"):
        main(_argv(tiny, ctx.out, "lisa", "--overwrite_output_dir", "true"))
    assert _model_in(ctx.out) == "adapter" and "model.safetensors" not in os.listdir(ctx.out)
    after = load_file(str(ctx.out / "adapter_model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not _hidden(ctx.out)


# ----------------------------------------------------------------------------------------------------------------------
# SIGKILL in the middle of a save
# ----------------------------------------------------------------------------------------------------------------------
def _run_until_blocked_then_kill(argv: list[str], point: str, match: str) -> str:
    """Run the driver until it blocks in the save (``BLOCKED <path>``), SIGKILL it, and return the blocked path."""
    env = {**os.environ, "HF_LISA_TEST_BLOCK": point, "HF_LISA_TEST_BLOCK_IN": match, "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(DRIVER), *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("BLOCKED "):
                os.kill(proc.pid, signal.SIGKILL)
                assert proc.wait() == -signal.SIGKILL
                return line.removeprefix("BLOCKED ").strip()
        pytest.fail("the run ended without reaching the blocked save:\n" + "".join(lines[-40:]))
    finally:
        watchdog.cancel()
        proc.kill()
        proc.stdout.close()


@pytest.mark.slow  # a training process, killed during the save, then a resumed run
@pytest.mark.parametrize("point, match", [("weights", ".partial-checkpoint-4"), ("lisa_state", "checkpoint-4")],
                         ids=["half-written-weights", "before-the-lisa-schedule"])
def test_sigkill_during_a_checkpoint_save_then_resume_latest(tiny, tmp_path, point, match):
    out = tmp_path / "out"
    blocked = _run_until_blocked_then_kill(_argv(tiny, out, "lisa", "--max_steps", "6"), point, match)
    assert ".partial-checkpoint-4" in blocked  # the kill hit the save of checkpoint-4, in its staging folder
    # what transformers and hf-lisa would resume from is the last complete checkpoint; no checkpoint-4 exists
    assert _assert_checkpoints_complete(out) == ["checkpoint-2"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert _model_in(out) is None  # and no final model

    summary = main(_argv(tiny, out, "lisa", "--max_steps", "6", "--resume_from_checkpoint", "latest"))
    assert summary["hyperparameters"]["max_steps"] == 6
    assert _assert_checkpoints_complete(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not _hidden(out) and _model_in(out) == "model"


@pytest.mark.slow  # a training process, killed during the save
@pytest.mark.parametrize("point, match", [("weights", ".partial-final"),
                                          ("rename", os.path.join(".partial-final", "model.safetensors"))],
                         ids=["half-written-weights", "between-the-renames"])
def test_sigkill_during_the_final_save_leaves_no_half_model(tiny, runs, tmp_path, monkeypatch, point, match):
    ctx = Ctx(tmp_path, tiny, runs, monkeypatch)
    ctx.copy_run("lisa-adapter")  # a previous run's adapter, replaced by a full-parameter LISA run
    before = load_file(str(ctx.out / "adapter_model.safetensors"))
    blocked = _run_until_blocked_then_kill(_argv(tiny, ctx.out, "lisa", "--overwrite_output_dir", "true"), point,
                                           match)
    assert ".partial-final" in blocked
    found = _model_in(ctx.out)  # loads whole if a loader would take it for a model
    if point == "weights":  # the new model was still being written: the previous one is untouched
        after = load_file(str(ctx.out / "adapter_model.safetensors"))
        assert found == "adapter" and all(torch.equal(before[k], after[k]) for k in before)
    else:  # the previous model was gone and the new weights not yet in place: no model at all, not half of one
        assert found is None and "adapter_model.safetensors" not in os.listdir(ctx.out)
    assert _assert_checkpoints_complete(ctx.out) == ["checkpoint-2", "checkpoint-4"]  # this run's, complete


@pytest.mark.parametrize("method", ["lisa", "lora"])
def test_resume_from_the_checkpoint_at_max_steps_trains_nothing_and_says_so(method, tiny, runs, tmp_path, capsys):
    """The Ctrl-C message recommends resuming; from the checkpoint at ``--max_steps`` that must change nothing
    (transformers would train step N+1 and save the model again)."""
    out = shutil.copytree(runs[method], tmp_path / "out")
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in Path(out).iterdir() if p.is_file()}
    capsys.readouterr()
    result = main(_argv(tiny, out, method, "--resume_from_checkpoint", "latest", "--lr_scheduler_type", "constant"))
    said = capsys.readouterr().out
    assert result["trained_steps"] == 0 and result["global_step"] == 4
    assert re.search(r"checkpoint-4 was saved at step 4, and --max_steps is 4: nothing left to train", said), said
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in Path(out).iterdir() if p.is_file()}
    assert after == before  # no file rewritten, the model included
    assert sorted(p.name for p in Path(out).glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


# ----------------------------------------------------------------------------------------------------------------------
# Issue 23: one run per folder, overwrite removes only what hf-lisa wrote, checkpoints and held-out rows said
# ----------------------------------------------------------------------------------------------------------------------
from hf_lisa import cli  # noqa: E402
from hf_lisa.train.run_folder.run_lock import LOCK_NAME  # noqa: E402

#: files of a project folder that no hf-lisa run wrote (issue 23: --overwrite_output_dir deleted them)
PROJECT_FILES = {"README.md": "# my project\n", "tsconfig.json": '{"compilerOptions": {}}\n',
                 "app_config.json": '{"port": 8080}\n', "merges.txt": "#version: 0.2\na b\n"}


def _snapshot(folder) -> dict:
    """Every file under ``folder`` with its bytes: what must not change."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


def _fail_final_save(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _run_failing_at_the_final_save(argv: list[str]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules["hf_lisa.train.run"], "save_final_model", _fail_final_save)
        with pytest.raises(OSError, match="No space left"):
            main(argv)


@pytest.fixture(scope="module")
def failed_run(tiny):
    """A run that saved checkpoint-2 and checkpoint-4, then failed writing the final model (a full disk); read-only
    for the tests."""
    out = tiny["root"] / "failed"
    _run_failing_at_the_final_save(_argv(tiny, out))
    return out


@pytest.mark.slow  # a second python process holds the lock; two hf-lisa train runs
def test_a_second_run_into_a_locked_output_dir_exits_2_naming_it_and_a_killed_holder_leaves_no_lock(
        tiny, tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom hf_lisa.train.run_folder.run_lock import OutputDirLock\n"
         "lock = OutputDirLock(sys.argv[1]); lock.acquire(); print('LOCKED', flush=True); time.sleep(600)", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        assert cli.main(["train", *_argv(tiny, out)]) == 2
        message = capsys.readouterr().err
        assert f"--output_dir={out} is in use by another hf-lisa train run (pid {holder.pid} on host " in message
        assert "started 20" in message and "choose another --output_dir" in message
        assert os.listdir(out) == [LOCK_NAME]  # refused before anything was written
    finally:
        holder.kill()  # SIGKILL: no chance to clean up; the kernel drops its flock
        holder.wait()
        holder.stdout.close()
    assert os.listdir(out) == [LOCK_NAME]  # the stale lock file stays behind ...
    main(_argv(tiny, out))  # ... and neither blocks a run nor makes the folder "not empty"
    assert LOCK_NAME not in os.listdir(out) and _model_in(out) == "model"
    assert _assert_checkpoints_complete(out) == ["checkpoint-2", "checkpoint-4"]


def test_overwrite_refuses_files_no_run_wrote_and_deletes_nothing(tiny, failed_run, tmp_path):
    out = shutil.copytree(failed_run, tmp_path / "out")  # a run's checkpoints and manifest, in a project folder
    for name, text in PROJECT_FILES.items():
        (out / name).write_text(text)
    before = _snapshot(out)
    with pytest.raises(ValueError) as raised:
        main(_argv(tiny, out, "lisa", "--overwrite_output_dir", "true"))
    message = str(raised.value)
    assert "holds files that no hf-lisa train run wrote: README.md, app_config.json, merges.txt, tsconfig.json." \
        in message, message
    assert "nothing was deleted" in message and "--delete_foreign_files true" in message
    assert "checkpoint-" not in message
    assert _snapshot(out) == before


def test_overwrite_of_a_finished_run_refuses_the_project_files_beside_it(tiny, runs, tmp_path):
    out = shutil.copytree(runs["lora"], tmp_path / "out")  # its own README.md (the card) is the run's
    for name in ("tsconfig.json", "app_config.json", "merges.txt"):
        (out / name).write_text(PROJECT_FILES[name])
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"wrote: app_config\.json, merges\.txt, tsconfig\.json\. "):
        main(_argv(tiny, out, "lisa", "--overwrite_output_dir", "true"))
    assert _snapshot(out) == before


@pytest.mark.slow  # a full hf-lisa train run
def test_delete_foreign_files_overwrites_a_project_folder(tiny, failed_run, tmp_path):
    out = shutil.copytree(failed_run, tmp_path / "out")
    for name, text in PROJECT_FILES.items():
        (out / name).write_text(text)
    (out / "notes").mkdir()
    (out / "notes" / "todo.txt").write_text("x")
    main(_argv(tiny, out, "lisa", "--delete_foreign_files", "true"))
    files = set(os.listdir(out))
    assert not {"tsconfig.json", "app_config.json", "merges.txt", "notes"} & files
    assert _model_in(out) == "model" and (out / "README.md").read_text() != PROJECT_FILES["README.md"]  # the card
    assert _assert_checkpoints_complete(out) == ["checkpoint-2", "checkpoint-4"] and not _hidden(out)
    assert json.loads((out / MANIFEST_NAME).read_text())["written"] == sorted(visible for visible in files
                                                                              if visible != MANIFEST_NAME)


def test_overwrite_never_deletes_weights_no_run_wrote_even_with_delete_foreign_files(tiny, runs, tmp_path):
    out = shutil.copytree(runs["lora"], tmp_path / "out")
    torch.save({"w": torch.zeros(2)}, out / "pytorch_model.bin")  # beside a training_summary.json, but not listed
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"holds model weights that no hf-lisa train run wrote \(pytorch_model\.bin"):
        main(_argv(tiny, out, "lisa", "--delete_foreign_files", "true"))
    assert _snapshot(out) == before


@pytest.mark.slow  # a full hf-lisa train run
def test_a_folder_from_before_the_manifest_is_judged_by_the_names_a_run_writes(tiny, runs, tmp_path):
    out = shutil.copytree(runs["lisa-adapter"], tmp_path / "out")
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # as an earlier hf-lisa version left it
    (out / "tsconfig.json").write_text(PROJECT_FILES["tsconfig.json"])
    with pytest.raises(ValueError, match=r"wrote: tsconfig\.json\. "):  # README.md beside training_summary.json: ours
        main(_argv(tiny, out, "lisa", "--overwrite_output_dir", "true"))
    os.remove(out / "tsconfig.json")
    main(_argv(tiny, out, "lisa", "--overwrite_output_dir", "true"))  # only an earlier run's outputs: as before
    _check_full_model_replaced_adapter(Ctx(tmp_path, tiny, runs, None), {})
    assert {"checkpoint-2", "checkpoint-4", "README.md", "model.safetensors"} <= set(
        json.loads((out / MANIFEST_NAME).read_text())["written"])


@pytest.mark.slow  # two full hf-lisa train runs
def test_start_summary_says_what_is_held_out_and_what_happens_to_checkpoints(tiny, tmp_path, capsys):
    main(_argv(tiny, tmp_path / "split", "lisa", "--validation_split_percentage", "25"))
    said = capsys.readouterr().out
    assert ("[hf-lisa] held out 25% of train (4 rows) for evaluation (--validation_split_percentage 0 to train on "
            "all)\n") in said, said
    assert ("[hf-lisa] checkpoint-N folders (optimizer state included) stay in output_dir beside the final model: "
            "--keep_checkpoints false removes them once it is saved") in said

    validation = write_jsonl(tmp_path / "validation.jsonl", copy_task_rows(4, seed=1))
    out = tmp_path / "given"
    main(_argv(tiny, out, "lisa", "--validation_split_percentage", "25", "--validation_file", validation,
               "--keep_checkpoints", "false"))
    said = capsys.readouterr().out
    assert "held out" not in said and "[hf-lisa] method=lisa" in said
    assert "[hf-lisa] checkpoint-N folders are removed once the final model is saved (--keep_checkpoints false)" \
        in said
    assert not [n for n in os.listdir(out) if n.startswith("checkpoint-")] and _model_in(out) == "model"
    assert not [n for n in json.loads((out / MANIFEST_NAME).read_text())["written"] if n.startswith("checkpoint-")]


@pytest.mark.slow  # a full hf-lisa train run
def test_keep_checkpoints_false_keeps_them_when_the_run_fails(tiny, tmp_path):
    _run_failing_at_the_final_save(_argv(tiny, tmp_path / "out", "lisa", "--keep_checkpoints", "false"))
    assert _assert_checkpoints_complete(tmp_path / "out") == ["checkpoint-2", "checkpoint-4"]
    assert _model_in(tmp_path / "out") is None and not _hidden(tmp_path / "out")


@pytest.mark.slow  # a full hf-lisa train run
def test_keep_checkpoints_false_removes_the_resumed_checkpoint_only_after_the_final_model(tiny, runs, tmp_path):
    out = shutil.copytree(runs["lisa"], tmp_path / "out")
    resume = ["--resume_from_checkpoint", str(out / "checkpoint-2"), "--keep_checkpoints", "false"]
    _run_failing_at_the_final_save(_argv(tiny, out, "lisa", *resume))
    assert _assert_checkpoints_complete(out) == ["checkpoint-2", "checkpoint-4"]  # the resumed one too
    main(_argv(tiny, out, "lisa", *resume))
    assert not [n for n in os.listdir(out) if n.startswith("checkpoint-")] and _model_in(out) == "model"
