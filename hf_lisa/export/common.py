"""What the three exports share: outputs written whole or not at all, the source model merged, the check inputs.

Outputs are staged in a private hidden sibling (``tempfile``'s 0o700 folder / 0o600 file) and get, before the rename
into place, the modes of any file the user writes: ``0o666 & ~umask`` for files, ``0o777 & ~umask`` for folders
(:func:`apply_umask`). An export folder records what the export wrote in :data:`EXPORT_MANIFEST_NAME`, and
``--overwrite`` replaces only a folder that holds nothing else (:func:`foreign_paths`; the rule of ``hf-lisa train
--overwrite_output_dir``, issue 33 item 3): anything else is named and the export refused, before it starts and again
when it renames its output into place. Sources are read as :mod:`hf_lisa.hub.staging` reads them: a symbolic link that leads out of
the source folder is never followed (a warning names it; a weight or config file behind one is refused).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from ..errors import RunError, UsageError
from ..hub.load import ADAPTER_CONFIG_NAME, ADAPTER_PICKLE_NAME, ADAPTER_SAFETENSORS_NAME, MODEL_CONFIG_NAME

logger = logging.getLogger(__name__)

#: how many of the demo task's held-out prompts the checks run by default
DEFAULT_CHECK_PROMPTS = 8
#: ``export lora`` refuses a sparse adapter whose worst module's relative Frobenius error exceeds this, unless told
DEFAULT_MAX_ERROR = 0.05
#: the list of what an export wrote in its folder (hidden; not the training runs' ``.hf-lisa-manifest.json``, so that
#: neither command takes the other's files for its own)
EXPORT_MANIFEST_NAME = ".hf-lisa-export.json"


# ----------------------------------------------------------------------------------------------------------------------
# Permissions and links
# ----------------------------------------------------------------------------------------------------------------------
def current_umask() -> int:
    """The process's umask: read from ``/proc/self/status`` on Linux, else set and put back at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def apply_umask(path: str) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the modes of a file the user writes: ``0o666 & ~umask``
    for files, ``0o777 & ~umask`` for folders. Links are left alone."""
    mask = current_umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    if not os.path.isdir(path):
        os.chmod(path, file_mode)
        return
    for root, dirs, files in os.walk(path):
        for names, mode in ((dirs, dir_mode), (files, file_mode)):
            for name in names:
                if not os.path.islink(os.path.join(root, name)):
                    os.chmod(os.path.join(root, name), mode)
    os.chmod(path, dir_mode)


def source_links(source: Optional[str]) -> list[str]:
    """The links of the folder ``source`` that lead out of it, ``"name -> target"``, each named in a warning and never
    followed; ``[]`` for a Hub id.

    Raises:
        UsageError: a weight or config file of ``source`` is such a link.
    """
    from ..hub.staging import scan_links

    return scan_links(source) if source and os.path.isdir(source) else []


# ----------------------------------------------------------------------------------------------------------------------
# Outputs: staged beside their target, renamed into place when complete
# ----------------------------------------------------------------------------------------------------------------------
def _same_or_inside(path: str, other: str) -> bool:
    path, other = os.path.realpath(path), os.path.realpath(other)
    return path == other or other.startswith(path.rstrip(os.sep) + os.sep)


def sources_of(source: Optional[str], base_model: Optional[str] = None) -> tuple[Optional[str], ...]:
    """What an export of ``source`` reads: the folder itself, the base model given, and the base its adapter config
    records (``base_model_name_or_path``), so that none of them can be the output."""
    recorded = None
    config = os.path.join(source, ADAPTER_CONFIG_NAME) if source else ""
    if config and os.path.isfile(config):
        try:
            with open(config) as f:
                recorded = json.load(f).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            recorded = None
    return (source, base_model, recorded if isinstance(recorded, str) else None)


def check_output_path(
    out: str, sources: tuple[Optional[str], ...], overwrite: bool, what: str, is_file: bool = False,
    owned_file: Optional[Callable[[str], Optional[str]]] = None,
) -> None:
    """Refuse an output that would replace one of its own sources, a non-empty target without ``overwrite``, and
    with ``overwrite`` a folder holding anything that no export wrote (:func:`foreign_paths`) or a file that
    ``owned_file`` (``path -> None`` when an export wrote it, else why not) does not claim.

    Raises:
        UsageError: naming the path, what no export wrote, and what is allowed.
    """
    for source in sources:
        if source and os.path.exists(source) and (_same_or_inside(out, source) or _same_or_inside(source, out)):
            raise UsageError(f"{what} {out!r} is (or contains, or sits inside) the source {source!r}; choose another "
                             "path: an export never writes over what it reads.")
    if not os.path.lexists(out):
        return
    if is_file and os.path.isdir(out):
        raise UsageError(f"{what} {out!r} is a directory; give a file path, e.g. {os.path.join(out, 'model.gguf')!r}.")
    if is_file and not os.path.isfile(out):
        raise UsageError(f"{what} {out!r} exists and is not a regular file; give another path.")
    if not is_file and not os.path.isdir(out):
        raise UsageError(f"{what} {out!r} exists and is a file; give a directory path.")
    non_empty = os.path.isfile(out) or bool(os.listdir(out))
    if non_empty and not overwrite:
        raise UsageError(f"{what} {out!r} already exists and is not empty; pass --overwrite (overwrite=True) to "
                         "replace what an earlier export wrote there once the new export is complete.")
    if non_empty and is_file:
        problem = owned_file(out) if owned_file is not None else "hf-lisa cannot tell whether an export wrote it"
        if problem:
            raise UsageError(f"{what} {out!r} is a file that no hf-lisa export wrote ({problem}). --overwrite "
                             f"replaces only a file an export wrote; nothing was deleted. Move it away, or choose "
                             f"another {what}.")
    elif non_empty:
        foreign = foreign_paths(out)
        if foreign:
            raise UsageError(foreign_refusal(out, foreign, what))


# ----------------------------------------------------------------------------------------------------------------------
# What an export wrote: EXPORT_MANIFEST_NAME
# ----------------------------------------------------------------------------------------------------------------------
def _walk_paths(folder: str) -> Iterator[tuple[str, bool]]:
    """``(relative path with "/", is a folder to descend into)`` for everything under ``folder``, top-down; links
    are entries of their own, never followed."""
    for root, dirs, files in os.walk(folder):
        rel_root = os.path.relpath(root, folder)
        for name in sorted(dirs + files):
            path = name if rel_root == "." else f"{rel_root.replace(os.sep, '/')}/{name}"
            yield path, name in dirs and not os.path.islink(os.path.join(root, name))


def read_export_manifest(folder: str) -> Optional[set[str]]:
    """The paths :data:`EXPORT_MANIFEST_NAME` lists, or ``None`` when ``folder`` has none or it cannot be read."""
    try:
        with open(os.path.join(folder, EXPORT_MANIFEST_NAME), encoding="utf-8") as f:
            data = json.load(f)
        written, by = data["written"], data["written_by"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(by, str) and by.startswith("hf-lisa export") and isinstance(written, list)
            and all(isinstance(path, str) for path in written)):
        return None
    return set(written)


def foreign_paths(folder: str) -> list[str]:
    """What ``folder`` holds that no export wrote (not listed in its :data:`EXPORT_MANIFEST_NAME`): everything, when
    it has no manifest. A foreign folder is named once (``"data/"``), not file by file."""
    listed = read_export_manifest(folder)
    foreign, skip = [], []
    for path, is_dir in _walk_paths(folder):
        if (path == EXPORT_MANIFEST_NAME and listed is not None) or any(path.startswith(s) for s in skip):
            continue
        if listed is None or path not in listed:
            foreign.append(path + "/" if is_dir else path)
            if is_dir:
                skip.append(path + "/")
    return foreign


def foreign_refusal(out: str, foreign: list[str], what: str) -> str:
    """The message that refuses ``--overwrite`` of ``out``, naming what no export wrote there."""
    shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
    why = "" if os.path.isfile(os.path.join(out, EXPORT_MANIFEST_NAME)) else (
        f" (it has no {EXPORT_MANIFEST_NAME}, the record an export keeps of what it wrote: it is no export's folder, "
        "or one from an hf-lisa version that kept none)")
    return (f"--overwrite: {what} {out!r} holds files that no hf-lisa export wrote: {shown}{why}. --overwrite "
            "replaces only what an export wrote there; nothing was deleted. Move those away, or choose another "
            f"{what}.")


def record_export(staging: str, written_by: str) -> None:
    """Write :data:`EXPORT_MANIFEST_NAME` in the staged export ``staging``: every path in it, and who wrote it."""
    write_json(os.path.join(staging, EXPORT_MANIFEST_NAME), {
        "written_by": written_by, "written": [path for path, _ in _walk_paths(staging)],
        "note": "what hf-lisa export wrote here: --overwrite replaces this folder only while it holds nothing else"})


@contextmanager
def staged_directory(out_dir: str, written_by: str = "hf-lisa export", overwrite: bool = False) -> Iterator[str]:
    """A hidden sibling folder of ``out_dir`` to write into; renamed to ``out_dir`` when the block completes (the
    modes following the umask, what it holds recorded in :data:`EXPORT_MANIFEST_NAME`), removed when it raises. A
    failure never leaves half an export.

    An existing ``out_dir`` is replaced only then, after a second look at it once it is moved aside: a non-empty one
    without ``overwrite``, or one holding anything no export wrote (written there while the export ran), is put back
    as it was and the export refused (:class:`UsageError`)."""
    from ..train.run_folder.output_dir import STAGING_PREFIX, fsync_tree  # the training outputs' staging name and flush

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.path.basename(out_dir)}-", dir=parent)
    try:
        yield staging
        record_export(staging, written_by)
        apply_umask(staging)
        fsync_tree(staging)
        if os.path.lexists(out_dir):
            _replace_directory(staging, out_dir, overwrite, STAGING_PREFIX)
        else:
            os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace_directory(staging: str, out_dir: str, overwrite: bool, prefix: str) -> None:
    """Put ``staging`` in the place of the existing ``out_dir``, which is moved aside first and checked there (no
    other program writes into it any more): deleted only when it held nothing but what an export wrote, else put
    back untouched and the export refused."""
    old = tempfile.mkdtemp(prefix=f"{prefix}old-{os.path.basename(out_dir)}-", dir=os.path.dirname(out_dir))
    previous = os.path.join(old, "previous")
    try:
        os.replace(out_dir, previous)
    except OSError:
        os.rmdir(old)
        raise
    try:
        if os.path.isdir(previous) and os.listdir(previous) and not overwrite:
            raise UsageError(f"OUT_DIR {out_dir!r} was written to while the export ran; nothing was deleted and the "
                             "new export was not written. Run it again with --overwrite, or into another OUT_DIR.")
        foreign = foreign_paths(previous) if os.path.isdir(previous) and os.listdir(previous) else []
        if foreign:
            raise UsageError(foreign_refusal(out_dir, foreign, "OUT_DIR") + " (Written there while the export "
                             "ran: the new export was not written.)")
        os.replace(staging, out_dir)
    except BaseException:
        try:
            os.replace(previous, out_dir)  # put the previous content back, as it was
        except OSError as err:
            raise RunError(f"could not put {out_dir!r} back in place ({err}); its previous content is kept, "
                           f"untouched, in {previous!r}.") from err
        os.rmdir(old)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_file(out_file: str, before_replace: Optional[Callable[[], None]] = None) -> Iterator[str]:
    """A hidden sibling path of ``out_file`` (same suffix) to write to; renamed to ``out_file`` (its mode following
    the umask) when the block completes, removed when it raises. ``before_replace`` runs just before the rename and
    may refuse it by raising (e.g. :func:`check_output_path` again: the target may have changed meanwhile)."""
    from ..train.run_folder.output_dir import STAGING_PREFIX

    out_file = os.path.abspath(out_file)
    parent = os.path.dirname(out_file)
    os.makedirs(parent, exist_ok=True)
    stem, suffix = os.path.splitext(os.path.basename(out_file))
    descriptor, staging = tempfile.mkstemp(prefix=f"{STAGING_PREFIX}{stem}-", suffix=suffix, dir=parent)
    os.close(descriptor)
    try:
        yield staging
        apply_umask(staging)
        with open(staging, "rb") as f:
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(staging, out_file)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def require_gguf():
    """The ``gguf`` package, or an ``ImportError`` that says how to install it."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("GGUF export needs the gguf package: `pip install gguf` (part of hf-lisa[demo]).") from exc
    return gguf


# ----------------------------------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------------------------------
def read_adapter(adapter_dir: str) -> tuple[dict, dict]:
    """``(adapter_config, state_dict)`` of a saved PEFT adapter folder; pickle weights are refused.

    Raises:
        FileNotFoundError / UsageError: naming the folder and what it lacks.
    """
    from safetensors.torch import load_file

    if not os.path.isdir(adapter_dir):
        raise FileNotFoundError(f"adapter directory {adapter_dir!r} does not exist.")
    config_path = os.path.join(adapter_dir, ADAPTER_CONFIG_NAME)
    if not os.path.isfile(config_path):
        found = " It holds config.json: a full model, not an adapter." if os.path.isfile(
            os.path.join(adapter_dir, MODEL_CONFIG_NAME)) else ""
        raise UsageError(f"{adapter_dir!r} has no {ADAPTER_CONFIG_NAME}, so it is not a PEFT adapter.{found}")
    weights = os.path.join(adapter_dir, ADAPTER_SAFETENSORS_NAME)
    if not os.path.isfile(weights):
        pickle = os.path.isfile(os.path.join(adapter_dir, ADAPTER_PICKLE_NAME))
        raise UsageError(
            f"{adapter_dir!r} has no {ADAPTER_SAFETENSORS_NAME}"
            + (f" (only the pickle {ADAPTER_PICKLE_NAME}, which hf-lisa never loads for an export; re-save it with "
               "save_pretrained)." if pickle else ".")
        )
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    return config, load_file(weights)


def load_merged_model(source: str, base_model: Optional[str] = None, dtype=None):
    """``(model, tokenizer_or_None)``: a transformers model with any LISA adapter of ``source`` merged in.

    ``source`` is an adapter folder (its base model is loaded and the adapter merged with the tuner's own merge,
    which refuses layer interpolation), a full model folder (``hf-lisa train --method lisa`` output, a merged
    export) or a Hub id. The tokenizer comes from ``source``, else from the adapter's base model.
    """
    import torch
    from peft import PeftModel

    from ..hub.load import from_pretrained
    from ..hub.staging import check_mergeable

    model = from_pretrained(source, base_model=base_model, torch_dtype=dtype or torch.float32)
    tokenizer_sources = [source]
    if isinstance(model, PeftModel):
        check_mergeable(model)
        config = model.peft_config[model.active_adapter]
        tokenizer_sources.append(base_model or config.base_model_name_or_path)
        model = model.merge_and_unload(safe_merge=True)
    return model.eval(), load_tokenizer(*tokenizer_sources)


def load_tokenizer(*sources: Optional[str]):
    """The first tokenizer that loads from ``sources`` (folders or Hub ids), or ``None``. A folder whose tokenizer
    files include a link out of it is passed over."""
    from transformers import AutoTokenizer

    from ..hub.staging import TOKENIZER_FILES, link_out_of

    for source in sources:
        if not source:
            continue
        if os.path.isdir(source) and not any(
            os.path.isfile(os.path.join(source, name)) for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            continue
        if os.path.isdir(source) and any(link_out_of(source, os.path.join(source, name)) for name in TOKENIZER_FILES):
            logger.info("No tokenizer from %s: its tokenizer files include a link out of it.", source)
            continue
        try:
            # never the model's own code, and never transformers' y/N question on stdin (issue 33)
            return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        except (OSError, ValueError) as exc:
            if "trust_remote_code" in str(exc) or "custom code" in str(exc):
                raise UsageError(f"the tokenizer of {source!r} needs its own Python code to load ('auto_map' in its "
                                 "tokenizer_config.json); hf-lisa never runs a model's code: save a tokenizer that "
                                 "transformers implements beside the model.") from None
            logger.info("No tokenizer from %s (%s).", source, exc)
    return None


# ----------------------------------------------------------------------------------------------------------------------
# Check inputs: the demo task's held-out prompts
# ----------------------------------------------------------------------------------------------------------------------
def held_out_prompts(n: int = DEFAULT_CHECK_PROMPTS) -> list[str]:
    """The first ``n`` prompts of the bundled task's validation split (never in its train split)."""
    from ..demo_task import cached_dataset_files

    _, validation = cached_dataset_files(2000)  # the validation rows do not depend on the train size
    prompts = []
    with open(validation, encoding="utf-8") as f:
        for line in f:
            if len(prompts) == n:
                break
            prompts.append(json.loads(line)["prompt"])
    return prompts


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as training renders it: through the chat template when the tokenizer has one."""
    ids = []
    for prompt in prompts:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            ids.append(tokenizer(prompt)["input_ids"])
    return ids


def check_inputs(tokenizer, vocab_size: int, n: int = 4, length: int = 24, seed: int = 0):
    """A batch of inputs for a logit comparison: held-out prompts when a tokenizer is known, else seeded random ids.

    Returns:
        ``(input_ids, attention_mask)``, right-padded (padding positions are masked and excluded from comparisons).
    """
    import torch

    if tokenizer is not None:
        rows = [row[:length] for row in prompt_ids(tokenizer, held_out_prompts(n))]
    else:
        gen = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, vocab_size, (n, length), generator=gen).tolist()
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
    return input_ids, attention_mask


def logits(model, input_ids, attention_mask):
    """The model's float32 logits for the batch, without gradients."""
    import torch

    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.float()


def max_logit_difference(logits_a, logits_b, attention_mask) -> float:
    """``max |logits_a - logits_b|`` over the unpadded positions of the batch."""
    if logits_a.dim() == 3:  # per token: drop padding positions
        keep = attention_mask.bool()
        logits_a, logits_b = logits_a[keep], logits_b[keep]
    return float((logits_a.float() - logits_b.float()).abs().max())
