"""``hf-lisa export ... --overwrite`` removes only what an export wrote, and never writes into its own source.

Issue 33 item 3: ``--overwrite`` into a folder holding files that no export wrote deleted them all without naming
them. Now each export records what it wrote (the folder's ``.hf-lisa-export.json``; for a GGUF file, a key in its
own metadata) and ``--overwrite`` replaces only that: anything else is refused (exit 2) and named, and nothing is
deleted. Every export kind is driven through the real ``hf-lisa export`` command on the tiny models of
tests/test_export.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from contextlib import contextmanager, redirect_stderr

import pytest

from test_export import DENSE, _save_adapter, _save_base, _tree, needs_gguf

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

EXPORT_MANIFEST = ".hf-lisa-export.json"
KINDS = ("lora", "merged", pytest.param("gguf", marks=[needs_gguf, pytest.mark.gguf]))
FOLDER_KINDS = ("lora", "merged")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return _save_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def dense(base, tmp_path_factory) -> str:
    return _save_adapter(base, tmp_path_factory.mktemp("dense"), **DENSE)


@pytest.fixture(scope="module")
def dense2(base, tmp_path_factory) -> str:
    return _save_adapter(base, tmp_path_factory.mktemp("dense2"), seed=2, **DENSE)


def export(kind: str, source, out, *extra: str) -> tuple[int, str]:
    """Run ``hf-lisa export KIND SOURCE OUT`` (no logit or generation check: these tests are about files) and return
    ``(exit status, stderr)``."""
    from hf_lisa.cli import main

    checks = ["--verify_prompts", "0"] if kind == "gguf" else ["--skip_logit_check"]
    err = io.StringIO()
    with redirect_stderr(err):
        status = main(["export", kind, str(source), str(out), *checks, *extra])
    return status, err.getvalue()


def _partials(folder) -> list[str]:
    return [name for name in os.listdir(folder) if name.startswith(".partial-")]


def _foreign_folder(out) -> dict[str, bytes]:
    """A folder of someone's own files, hidden ones and weights included, and a training run's manifest that names
    one of them: nothing an export wrote."""
    (out / "data").mkdir(parents=True)
    (out / "notes.md").write_text("my notes\n")
    (out / "data" / "rows.jsonl").write_text('{"prompt": "1+1", "completion": "2"}\n')
    (out / "model.safetensors").write_bytes(b"someone's weights")
    (out / ".env").write_text("KEY=value\n")
    (out / ".hf-lisa-manifest.json").write_text(json.dumps({"written_by": "hf-lisa train", "written": ["notes.md"]}))
    return _tree(out)


# ----------------------------------------------------------------------------------------------------------------------
# folders: lora and merged
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FOLDER_KINDS)
def test_overwrite_refuses_a_folder_of_files_no_export_wrote_and_names_them(kind, dense, tmp_path):
    out = tmp_path / "out"
    before = _foreign_folder(out)
    status, err = export(kind, dense, out, "--overwrite")
    assert status == 2, err
    for name in ("notes.md", "data", "model.safetensors", ".env", ".hf-lisa-manifest.json"):
        assert name in err, err
    assert "rows.jsonl" not in err  # a foreign folder is named once, not file by file
    assert "nothing was deleted" in err.lower(), err
    assert _tree(out) == before, "a file that no export wrote was changed or deleted"
    assert not _partials(tmp_path)


@pytest.mark.parametrize("kind", FOLDER_KINDS)
def test_overwrite_replaces_what_an_export_wrote_and_nothing_else(kind, dense, dense2, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    assert export(kind, dense, out)[0] == 0
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    written = sorted(os.path.relpath(os.path.join(root, name), out) for root, dirs, files in os.walk(out)
                     for name in dirs + files if name != EXPORT_MANIFEST)
    assert manifest["written_by"] == f"hf-lisa export {kind}" and sorted(manifest["written"]) == written
    weights = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    first = load_file(out / weights)

    status, err = export(kind, dense2, out, "--overwrite")  # what an export wrote: replaced
    assert status == 0, err
    second = load_file(out / weights)
    assert first.keys() == second.keys() and any(not first[k].equal(second[k]) for k in first)

    (out / "notes.md").write_text("added by hand\n")  # one foreign file beside the export's own
    before = _tree(out)
    status, err = export(kind, dense, out, "--overwrite")
    assert status == 2 and "notes.md" in err, err
    assert weights not in err.split("holds files that no hf-lisa export wrote")[-1], err  # only the foreign file
    assert _tree(out) == before and not _partials(tmp_path)

    (out / "notes.md").unlink()
    other = "merged" if kind == "lora" else "lora"  # another kind of export replaces it too: an export wrote it
    status, err = export(other, dense, out, "--overwrite")
    assert status == 0, err
    assert json.loads((out / EXPORT_MANIFEST).read_text())["written_by"] == f"hf-lisa export {other}"


@pytest.mark.parametrize("kind", FOLDER_KINDS)
def test_a_folder_without_the_export_record_is_not_replaced(kind, dense, tmp_path):
    """An export folder whose record was removed (or one from before hf-lisa kept it) is judged file by file as
    foreign: nothing is deleted on a guess."""
    out = tmp_path / "out"
    assert export(kind, dense, out)[0] == 0
    (out / EXPORT_MANIFEST).unlink()
    before = _tree(out)
    status, err = export(kind, dense, out, "--overwrite")
    assert status == 2 and EXPORT_MANIFEST in err, err
    assert _tree(out) == before


#: the audit hook's plan: when ``when(event, args)`` first holds, write ``path`` (another program, mid-export)
_late: dict = {"when": None, "path": None, "done": False}


def _write_late(event, args):
    if _late["when"] is None or _late["done"] or not _late["when"](event, args):
        return
    _late["done"] = True
    with open(_late["path"], "w") as f:
        f.write("written while the export ran\n")


@contextmanager
def another_program_writes(path, when):
    """While the block runs, write ``path`` at the moment ``when(event, args)`` holds for an audit event of this
    process: a deterministic interleaving of the export with a program writing into its target."""
    if not getattr(sys, "_hf_lisa_test_late_hook", False):
        sys.addaudithook(_write_late)  # hooks cannot be removed: it does nothing unless armed
        sys._hf_lisa_test_late_hook = True
    _late.update(when=when, path=str(path), done=False)
    try:
        yield _late
    finally:
        _late["when"] = None


@pytest.mark.parametrize("kind", FOLDER_KINDS)
def test_a_file_written_while_the_export_runs_is_not_deleted(kind, dense, tmp_path):
    """The check before the export and the replace after it are minutes apart on a real model: the replace checks
    again, on the folder it has moved aside, and puts it back untouched when it holds something new."""
    out = tmp_path / "out"
    assert export(kind, dense, out)[0] == 0
    # just before the export moves OUT_DIR aside (os.replace, audited as os.rename), a file appears in it
    moving_aside = lambda event, args: event == "os.rename" and os.fspath(args[0]) == str(out)  # noqa: E731
    with another_program_writes(out / "late.txt", moving_aside) as late:
        status, err = export(kind, dense, out, "--overwrite")
    assert late["done"], "the export never moved the folder aside"
    assert status == 2 and "late.txt" in err, err
    assert (out / "late.txt").read_text() == "written while the export ran\n"
    assert (out / EXPORT_MANIFEST).is_file() and not _partials(tmp_path)


# ----------------------------------------------------------------------------------------------------------------------
# a GGUF file
# ----------------------------------------------------------------------------------------------------------------------
def _plain_gguf(path) -> None:
    """A valid GGUF file that hf-lisa did not write (as llama.cpp's converter or a download would be)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("somebody's model")
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@needs_gguf
@pytest.mark.gguf
def test_gguf_overwrite_replaces_only_a_file_an_export_wrote(dense, dense2, tmp_path):
    out = tmp_path / "model.gguf"
    for foreign in (lambda: out.write_bytes(b"not a GGUF file, someone's notes\n"), lambda: _plain_gguf(out)):
        foreign()
        before = out.read_bytes()
        status, err = export("gguf", dense, out, "--overwrite")
        assert status == 2, err
        assert str(out) in err and "no hf-lisa export wrote" in err and "nothing was deleted" in err.lower(), err
        assert out.read_bytes() == before and not _partials(tmp_path)
        out.unlink()
    assert export("gguf", dense, out)[0] == 0
    first = out.read_bytes()
    status, err = export("gguf", dense2, out, "--overwrite")  # an export wrote it: replaced
    assert status == 0, err
    assert out.read_bytes() != first


@needs_gguf
@pytest.mark.gguf
def test_gguf_file_replaced_by_another_program_while_the_export_runs_is_kept(dense, tmp_path):
    out = tmp_path / "model.gguf"
    assert export("gguf", dense, out)[0] == 0
    # once the new file is written (its flush opens it "rb"), another program puts its own file at OUT_FILE
    flushing = lambda event, args: (event == "open" and os.path.basename(os.fspath(args[0])).startswith(  # noqa: E731
        ".partial-model-") and str(args[1]).startswith("r"))
    with another_program_writes(out, flushing) as late:
        status, err = export("gguf", dense, out, "--overwrite")
    assert late["done"] and status == 2, err
    assert "is a file that no hf-lisa export wrote" in err, err
    assert out.read_text() == "written while the export ran\n" and not _partials(tmp_path)


# ----------------------------------------------------------------------------------------------------------------------
# never into the source
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_export_never_writes_into_its_own_source(kind, dense, tmp_path):
    source = tmp_path / "work" / "adapter"
    shutil.copytree(dense, source)
    (tmp_path / "work" / "notes.md").write_text("beside the adapter\n")
    before = _tree(tmp_path / "work")
    # the source itself, a path inside it, a folder around it
    for target in (source, source / ("model.gguf" if kind == "gguf" else "exported"), tmp_path / "work"):
        status, err = export(kind, source, target, "--overwrite")
        assert status == 2, (target, err)
        assert "never writes over what it reads" in err and str(source) in err, err
    assert _tree(tmp_path / "work") == before
