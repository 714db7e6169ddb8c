"""Issue 33: two ``hf-lisa train`` runs into one ``--output_dir``, a refused run's leftovers, read-only and full disks.

Real processes and real faults only: the first run of the race is a real ``hf-lisa train`` process held at its
meta-model preflight (``tests/output_safety_driver.py``, point ``preflight``) until the test creates a file; read-only
folders and full disks are real mounts in a user and mount namespace (``unshare -rm``), skipped where the kernel does
not allow one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

from hf_lisa import cli
from hf_lisa.train.run_folder.output_dir import MANIFEST_NAME
from hf_lisa.train.run_folder.run_lock import LOCK_NAME

REPO = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("output_safety_driver.py")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _argv(tiny: dict, output_dir, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", tiny["model"], "--train_file", tiny["train"], "--output_dir", str(output_dir),
        "--max_steps", "4", "--per_device_train_batch_size", "4", "--save_strategy", "steps", "--save_steps", "2",
        "--logging_steps", "3", "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true",
        "--max_seq_length", "64", "--validation_split_percentage", "0", "--eval_generation_samples", "0",
        "--method", "lisa", "--lisa_activated_layers", "1", "--lisa_interval_steps", "2", *extra,
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_races")
    return {"root": root, "model": build_tiny_lm_dir(root / "model", num_layers=3),
            "train": write_jsonl(root / "train.jsonl", copy_task_rows(16, seed=0))}


def _snapshot(folder) -> dict:
    """Every file under ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


def _learning_rate(output_dir) -> float:
    with open(Path(output_dir) / "training_summary.json") as f:
        return json.load(f)["hyperparameters"]["learning_rate"]


# ----------------------------------------------------------------------------------------------------------------------
# Item 1: the folder is checked under the lock
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a held hf-lisa train process and a second run in this one
def test_a_run_held_after_its_folder_check_keeps_the_folder_and_a_second_run_is_refused(tiny, tmp_path, capsys):
    """The issue's interleaving, made deterministic: the slow run has looked at ``--output_dir`` (empty) and is held
    at the meta-model preflight; a fast run starts into the same folder. It must be refused (exit 2, naming the held
    run), write nothing there, and the held run then writes its model alone. With the lock taken after the preflight
    the fast run trained and wrote, and the held run then wrote over its final model: both exited 0."""
    out, release = tmp_path / "out", tmp_path / "release"
    env = {**os.environ, **OFFLINE, "HF_LISA_TEST_BLOCK": "preflight", "HF_LISA_TEST_BLOCK_IN": str(release)}
    slow = subprocess.Popen([sys.executable, str(DRIVER), *_argv(tiny, out, "--learning_rate", "5e-3")], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, slow.kill)
    watchdog.start()
    lines = []
    try:
        for line in slow.stdout:
            lines.append(line)
            if line.startswith("BLOCKED preflight"):
                break
        else:
            pytest.fail("the first run ended before its preflight:\n" + "".join(lines[-40:]))
        capsys.readouterr()
        fast = cli.main(["train", *_argv(tiny, out, "--learning_rate", "1e-3")])
        message = capsys.readouterr().err
        while_held = _snapshot(out) if out.is_dir() else {}
        release.touch()
        lines += slow.stdout.readlines()
        assert slow.wait() == 0, "".join(lines[-40:])
    finally:
        watchdog.cancel()
        slow.kill()
        slow.stdout.close()
    assert fast == 2, f"the second run was not refused (exit {fast}); the held run then wrote over it:\n{message}"
    assert f"--output_dir={out} is in use by another hf-lisa train run (pid {slow.pid} on host " in message
    assert list(while_held) == [LOCK_NAME]  # the refused run wrote nothing: only the held run's lock was there
    # the folder holds the held run's output alone: its summary, its checkpoints, its model
    assert _learning_rate(out) == 5e-3
    assert sorted(os.listdir(out)) == sorted([
        MANIFEST_NAME, "README.md", "chat_template.jinja", "checkpoint-2", "checkpoint-4", "config.json",
        "generation_config.json", "loss.png", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "training_args.json", "training_summary.json"])
    assert any(line.startswith(f"[hf-lisa] wrote {out} ") for line in lines)


# ----------------------------------------------------------------------------------------------------------------------
# Item 13: a refused run leaves no folder it created, and never removes one it did not create
# ----------------------------------------------------------------------------------------------------------------------
def test_a_refused_run_removes_the_folders_it_created_and_only_those(tiny, tmp_path, capsys):
    missing = ["--train_file", str(tmp_path / "missing.jsonl")]  # refused once the folder is locked, before weights
    created = tmp_path / "new" / "sub"
    assert cli.main(["train", *_argv(tiny, created, *missing)]) == 2
    assert "missing.jsonl' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # both levels it created are gone
    (tmp_path / "mine").mkdir()  # the user's folders: kept, as they were
    for output_dir in (tmp_path / "mine", tmp_path / "mine" / "sub"):
        assert cli.main(["train", *_argv(tiny, output_dir, *missing)]) == 2
        assert os.listdir(tmp_path / "mine") == []
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert cli.main(["train", *_argv(tiny, tmp_path / "mine", *missing)]) == 2
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


# ----------------------------------------------------------------------------------------------------------------------
# Item 12: read-only and full disks, for real (a mount in a user and mount namespace)
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def namespace(tmp_path_factory):
    """Run ``hf-lisa train`` after shell ``mounts`` (``$0``: the mount point) in a new user and mount namespace;
    returns its exit status, its output, and what the mount point held once it ended."""
    probe = tmp_path_factory.mktemp("mount_probe")
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', str(probe)],
            capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespace here (unshare -rm): read-only and full disks cannot be mounted")

    def train(mounts: str, mount_point, argv: list[str]) -> tuple[int, str, list[str]]:
        left = tmp_path_factory.mktemp("left") / "left.txt"
        script = f'{mounts} && left="$1" && shift && {{ "$@"; status=$?; ls -A "$0" > "$left"; exit $status; }}'
        done = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mount_point), str(left), sys.executable,
                               "-m", "hf_lisa.cli", "train", *argv],
                              cwd=REPO, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout + done.stderr, left.read_text().split() if left.exists() else None

    return train


def _last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


@pytest.mark.slow  # a full hf-lisa train run, then one in a namespace
def test_overwrite_with_a_read_only_checkpoint_is_refused_before_the_model_loads(tiny, namespace, tmp_path):
    """Before: the model loaded, checkpoint-2 was deleted, then ``[Errno 30] Read-only file system:
    'training_args.bin'`` (exit 1) left half of the earlier run. Now: refused before any weight loads, nothing
    deleted, the read-only folder named."""
    out = tmp_path / "out"
    assert cli.main(["train", *_argv(tiny, out, "--learning_rate", "5e-3")]) == 0
    before = _snapshot(out)
    read_only = out / "checkpoint-4"
    status, output, _ = namespace('mount --bind "$0" "$0" && mount -o remount,bind,ro "$0"', read_only,
                               _argv(tiny, out, "--overwrite_output_dir", "true"))
    assert status == 2, output
    assert _last_line(output) == (
        f"hf-lisa train: error: --overwrite_output_dir: --output_dir={out}: {read_only} is not writable (a read-only "
        "file system, a mount point, another user's), so it cannot be emptied. Nothing was deleted. Make it writable "
        "or move it away.")
    assert "Loading weights" not in output
    assert _snapshot(out) == before


@pytest.mark.slow  # hf-lisa train in a namespace
def test_a_full_disk_is_found_when_the_lock_is_written_before_the_model_loads(tiny, namespace, tmp_path):
    full = tmp_path / "full"  # a file system with no inode left: not even the lock file can be created
    full.mkdir()
    status, output, left = namespace('mount -t tmpfs -o nr_inodes=1 tmpfs "$0"', full, _argv(tiny, full))
    assert status == 2, output
    assert _last_line(output).startswith(
        f"hf-lisa train: error: --output_dir={full} cannot be written: No space left on device ({full / LOCK_NAME}). "
        "hf-lisa train checks this before any weight loads")
    assert "Loading weights" not in output and left == []


@pytest.mark.slow  # hf-lisa train runs in a namespace, up to the save that fills the disk
@pytest.mark.parametrize("size, save", [("100k", ["--save_strategy", "no"]), ("200k", ["--save_steps", "1"])],
                         ids=["final-model", "checkpoint"])
def test_a_real_full_disk_during_a_save_names_the_output_dir(tiny, namespace, tmp_path, size, save):
    """Before: ``SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)`` (the
    final model) or ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos ...`` (torch.save of a
    checkpoint's optimizer state), neither naming a path."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "out"
    status, output, left = namespace(f'mount -t tmpfs -o size={size} tmpfs "$0"', disk, _argv(tiny, out, *save))
    assert status == 1, output
    line = _last_line(output)
    assert line.startswith("hf-lisa train: error: "), output
    assert f"while writing {out}:" in line or f"writing into --output_dir={out} failed" in line, line
    assert "no space left on the device" in line or "the disk is full" in line, line
    assert "Error" not in line  # no SafetensorError / RuntimeError: the one line says what happened
    assert left == []  # in the mounted disk: no half-written file, and not the folder the run created
