"""The checks of a ``hf-lisa train`` run that need the model but not its weights, made before anything heavy.

:func:`check_before_loading` runs first in :func:`hf_lisa.train.run`, before the data is read, any weight is loaded or
any row is tokenised. It reads the model's ``config.json`` (naming the folder or Hub id at fault when it cannot), then
builds the model on the ``meta`` device, where parameters have shapes but no storage, and runs the very code the run
itself runs on it: the block discovery (``--lisa_layers_attribute``), ``apply_method`` (PEFT's ``target_modules``
resolution, the LISA adapter) and the layer schedule (``--lisa_always_trainable``, γ against the blocks that train).
A typo in any of these fails in seconds with a :class:`~hf_lisa.errors.UsageError`, not after the model load,
tokenisation and the evaluation before training.

A local model folder's files are checked as well, without reading a weight: the safetensors files the load would read
(:func:`check_weight_files`: each header against the file's size, every shard of an index present), the tokenizer files
(:func:`check_tokenizer_files`), and ``--max_seq_length`` against the positions the config gives the model
(:func:`check_max_seq_length`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
import warnings

from ..errors import UsageError
from ..methods import get_method
from .parsing.arguments import LisaArguments, ModelArguments
from .methods import apply_method, resolve_model_path

logger = logging.getLogger("hf_lisa.train")


def _causes(err: BaseException):
    """``err`` and the exceptions it was raised from, innermost last."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _hub_error(err: OSError, option: str, repo_id: str, revision: str) -> Exception:
    """The clear error for a Hub id whose ``config.json`` could not be fetched."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hub

    causes = list(_causes(err))
    if any(isinstance(c, hub.GatedRepoError) for c in causes):
        return PermissionError(
            f"{option}={repo_id!r} is a gated Hub model: accept its terms on its Hub page and log in "
            "(`hf auth login`), or pass a local folder."
        )
    if any(isinstance(c, hub.RepositoryNotFoundError) for c in causes):
        return UsageError(
            f"{option}={repo_id!r} is neither a local folder nor a model on the Hub (if it is private, log in with "
            "`hf auth login`); pass a folder with config.json or a Hub id 'namespace/name'."
        )
    if any(isinstance(c, hub.RevisionNotFoundError) for c in causes):
        return UsageError(f"--model_revision={revision!r} does not exist in {repo_id!r}; pass a branch, tag or commit.")
    if any(isinstance(c, (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled)) for c in causes):
        if constants.HF_HUB_OFFLINE:
            return ConnectionError(
                f"{option}={repo_id!r} is not in the local Hub cache and offline mode (HF_HUB_OFFLINE=1 or "
                f"TRANSFORMERS_OFFLINE=1) forbids downloading it: download it once online (`hf download {repo_id}`), "
                "or pass a local folder."
            )
        return ConnectionError(
            f"{option}={repo_id!r} is not in the local Hub cache and the Hub could not be reached to download it: "
            "check the network connection, or pass a local folder."
        )
    return err


def check_model_source(path: str, option: str = "--model_name_or_path") -> str:
    """Say whether ``path`` is a ``"local"`` folder or a ``"hub"`` id, refusing a path that is neither.

    A path that exists is local; one that does not is a Hub id if it is a valid one (``name`` or
    ``namespace/name``), and a missing local folder otherwise (``/abs/path``, ``./dir``, ``a/b/c``).

    Raises:
        UsageError: for a missing local folder, or a file where a folder is expected.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isdir(path):
        return "local"
    if os.path.exists(path):
        raise UsageError(f"{option}={path!r} is a file; pass the model's folder (with config.json) or a Hub id.")
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise UsageError(
            f"{option}={path!r} does not exist: no such folder, and not a Hub id ('name' or 'namespace/name'). "
            "Check the path."
        ) from None
    return "hub"


def load_model_config(model_args: ModelArguments, path: str):
    """The model's ``PretrainedConfig``, read from ``path`` (a folder or a Hub id) without its weights.

    Raises:
        UsageError: the folder has no ``config.json``, or the Hub has no such model or revision.
        ConnectionError: a Hub model that is not cached while offline or the Hub is unreachable (a runtime error).
        PermissionError: a gated Hub model without access.
    """
    from transformers import AutoConfig

    option = "--model_name_or_path"
    source = check_model_source(path, option)
    if source == "local" and not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(
            f"{option}={path!r} is a folder without config.json; pass the folder save_pretrained wrote (config.json "
            "and the weights)."
        )
    try:
        return AutoConfig.from_pretrained(
            path, revision=model_args.model_revision, cache_dir=model_args.cache_dir,
            trust_remote_code=model_args.trust_remote_code,
        )
    except OSError as err:
        if source == "hub":
            raise _hub_error(err, option, path, model_args.model_revision) from None
        raise UsageError(f"{option}={path!r}: {err}") from None  # e.g. a config.json that is not JSON
    except ValueError as err:  # e.g. a config.json without model_type
        raise UsageError(f"{option}={path!r}: {err}") from None


#: the weight files ``from_pretrained`` looks for in a folder, in its order: the first one present is loaded
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_REDOWNLOAD = "re-download or re-save the model"


def safetensors_problem(path: str) -> str | None:
    """What is wrong with the safetensors file ``path`` (its size against what its header describes), or ``None``.

    Reads the 8-byte little-endian header length and the JSON header only: the file must be exactly as long as the
    header and the end of the last tensor's ``data_offsets`` (what ``safetensors`` itself requires).
    """
    size = os.path.getsize(path)
    if size < 8:
        return f"{size} bytes, too short for a safetensors header"
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if 8 + length > size:
            return f"{size} bytes, its header describes {8 + length}"
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        return f"{size} bytes, its header is not valid JSON"
    if not isinstance(header, dict):
        return f"{size} bytes, its header is not valid: not a JSON object"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
            return f"{size} bytes, its header is not valid: tensor {name!r} has no valid data_offsets"
        end = max(end, offsets[1])
    if 8 + length + end != size:
        return f"{size} bytes, its header describes {8 + length + end}"
    return None


def _shards(folder: str, index_name: str, label: str) -> list[str]:
    """The shard files of the index ``index_name`` in ``folder``, refusing an unreadable index or a missing shard."""
    index = os.path.join(folder, index_name)
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        shards = list(dict.fromkeys(weight_map.values()))
        if not all(isinstance(name, str) for name in shards):
            raise TypeError
    except (ValueError, RecursionError, AttributeError, TypeError):
        raise UsageError(f"{label}: {index} is not a valid index (a JSON object with a \"weight_map\" of tensor names "
                         f"to shard files): {_REDOWNLOAD}.") from None
    missing = [name for name in shards if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        names = ", ".join(map(repr, missing))
        which = f"the shard {names}, which is" if len(missing) == 1 else f"the shards {names}, which are"
        raise UsageError(f"{label}: {index} names {which} not in the folder: {_REDOWNLOAD}.")
    return shards


def check_weight_files(folder: str, label: str) -> None:
    """Check the weight files ``from_pretrained`` would read from ``folder``, reading no weight.

    ``model.safetensors``, or else every shard of ``model.safetensors.index.json``: each header against its file's
    size (:func:`safetensors_problem`); a ``pytorch_model.bin.index.json``: every shard present.

    Raises:
        UsageError: naming the file that is truncated or corrupt, or the missing shard, and what to do.
    """
    if os.path.isfile(os.path.join(folder, SAFETENSORS)):
        files = [SAFETENSORS]
    elif os.path.isfile(os.path.join(folder, SAFETENSORS_INDEX)):
        files = _shards(folder, SAFETENSORS_INDEX, label)
    else:
        if not os.path.isfile(os.path.join(folder, BIN)) and os.path.isfile(os.path.join(folder, BIN_INDEX)):
            _shards(folder, BIN_INDEX, label)
        return  # pickled weights: no header to read; no weights at all: transformers names what it looked for
    for name in files:
        path = os.path.join(folder, name)
        problem = safetensors_problem(path)
        if problem:
            raise UsageError(f"{label}: {path} is truncated or corrupt ({problem}): {_REDOWNLOAD}.")


#: files a tokenizer loads from (``tokenizer.json``, sentencepiece, BPE vocabularies, tiktoken, Mistral's tekken)
_TOKENIZER_NAMES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "special_tokens_map", "tekken")


def _is_tokenizer_file(name: str) -> bool:
    return name.startswith(_TOKENIZER_NAMES) or name.endswith((".model", ".tiktoken"))


def check_tokenizer_files(folder: str, label: str, config=None, option: str = "") -> None:
    """Refuse a local folder without any tokenizer file (``tokenizer.json``, ``tokenizer_config.json``, ...).

    ``label`` names the folder in the message; ``option`` is ``"--tokenizer_name"`` for a folder passed as the
    tokenizer, empty for the model's folder (then ``config``'s ``auto_map`` may name remote tokenizer code instead).

    Raises:
        UsageError: what is missing and what to pass instead.
    """
    if any(_is_tokenizer_file(name) for name in os.listdir(folder)):
        return
    if "AutoTokenizer" in (getattr(config, "auto_map", None) or {}):
        return  # the tokenizer is the model's own code (--trust_remote_code): it says what it needs
    if option:
        raise UsageError(f"{label}: no tokenizer files (tokenizer.json, tokenizer_config.json, ...) in the folder; "
                         f"pass to {option} a folder a tokenizer was saved to, or a Hub id.")
    raise UsageError(f"{label}: no tokenizer files (tokenizer.json, tokenizer_config.json, ...) in the model folder; "
                     "pass --tokenizer_name ID_OR_PATH (the tokenizer's folder or Hub id).")


#: the config attributes that give a model's number of positions (the name depends on the model type)
POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


def model_positions(config) -> tuple[str, int] | None:
    """``(attribute, value)``: the most positions the model's config gives it, e.g. ``("n_positions", 1024)`` for GPT-2;
    ``None`` for a model without a stated limit (relative positions, ALiBi)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()  # a multimodal config's language model
    attribute_map = getattr(config, "attribute_map", {}) or {}
    for name in POSITION_ATTRIBUTES:
        name = attribute_map.get(name, name)  # GPT-2 maps max_position_embeddings to n_positions: name that one
        value = getattr(config, name, None)
        if type(value) is int and value > 0:
            return name, value
    return None


def check_max_seq_length(config, max_seq_length: int | None, label: str, default: int | None = None) -> int | None:
    """The ``--max_seq_length`` to use: refused when longer than the positions ``config`` gives the model
    (:func:`model_positions`), unless it is ``default`` (the option's default, not chosen for this model): then
    lowered to the model's positions, with a warning.

    A model with rope scaling is refused the same way: its ``max_position_embeddings`` is the context it was trained
    for.

    Raises:
        UsageError: naming the config's attribute, its value and what is allowed.
    """
    positions = model_positions(config)
    if positions is None or max_seq_length is None:
        return max_seq_length
    name, limit = positions
    if max_seq_length <= limit:
        return max_seq_length
    if default is not None and max_seq_length == default:
        logger.warning("--max_seq_length is %d by default, more than %s allows (its %s is %d): using %d.",
                       max_seq_length, label, name, limit, limit)
        return limit
    raise UsageError(f"{label}: --max_seq_length={max_seq_length} is larger than the model's {name} ({limit}); "
                     f"allowed: at most {limit}.")


def _meta_model(config, model_args: ModelArguments, label: str):
    """The model built from ``config`` on the meta device, or ``None`` where that is not possible."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(
                config, trust_remote_code=model_args.trust_remote_code,
                attn_implementation=model_args.attn_implementation,
            )
    except ValueError as err:  # no causal-LM class for this config, a bad attn_implementation: the load fails alike
        first_line = str(err).splitlines()[0]  # not the list of every causal-LM config class
        raise UsageError(f"{label} cannot be loaded as a causal LM: {first_line}") from None
    except Exception as err:  # custom modelling code that cannot run on meta tensors: check once the weights load
        logger.warning("Could not build the model on the meta device (%s: %s); its blocks and the method's options are "
                       "checked once its weights are loaded.", type(err).__name__, err)
        return None


def check_on_meta_model(model, lisa_args: LisaArguments, seed: int, label: str) -> None:
    """Run the block discovery, ``apply_method`` and the layer schedule of the run on ``model`` (on the meta device).

    Raises:
        UsageError: naming ``label`` (the method and the model), the option and what the model allows.
    """
    import torch

    from ..scheduler import LayerwiseScheduler
    from ..scheduler.active_set import BlockIndex
    from ..trainer_callbacks import LisaAdapterCallback, LisaCallback
    from ..tuner.config import check_lisa_settings

    method, gamma = lisa_args.method, lisa_args.lisa_activated_layers
    where = label

    def check_gamma(num_blocks: int) -> None:
        if get_method(method).samples_layers:
            check_lisa_settings({"lisa_activated_layers": gamma}, where="--",
                                allow_every_block=not get_method(method).samples_base_blocks,
                                num_blocks=num_blocks)

    try:
        index = BlockIndex.of(model, lisa_args.lisa_layers_attribute)
        where = f"{label} ({index.num_blocks} blocks)"
        check_gamma(index.num_blocks)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run warns once, on the real model
            model, callbacks = apply_method(model, lisa_args, seed=seed)
            for callback in callbacks:
                if isinstance(callback, LisaCallback):  # the scheduler LisaCallback builds at on_train_begin
                    LayerwiseScheduler(model, callback.lisa_activated_layers, callback.lisa_interval_steps,
                                       callback.lisa_sampling, callback.seed, callback.lisa_always_trainable,
                                       callback.lisa_optimizer_state_policy, callback.lisa_layers_attribute)
                elif isinstance(callback, LisaAdapterCallback) and gamma > 0:
                    # γ is drawn from the blocks that hold an adapter (--layers_to_transform may leave some out)
                    adapted = LayerwiseScheduler.for_adapter(model, lisa_activated_layers=1).block_names
                    where = f"{label} ({index.num_blocks} blocks, {len(adapted)} with an adapter)"
                    check_gamma(len(adapted))
    except ValueError as err:
        raise UsageError(f"{where}: {err}") from None


def check_before_loading(model_args: ModelArguments, lisa_args: LisaArguments, training_args,
                         data_args=None) -> None:
    """Check the model source and everything the method needs from the model, before any weight is loaded.

    ``data_args`` (optional) gives ``--max_seq_length``, checked against the model's positions; left at its default
    (512), it is lowered to the positions of a model with fewer.

    Raises:
        UsageError: a missing model folder, an unknown Hub model, a truncated or corrupt weight file, a missing shard,
            a model folder without a tokenizer, or an option the model cannot take (``--max_seq_length`` longer than
            its positions, block path, always-trainable names, γ larger than the blocks, target modules).
        ConnectionError, PermissionError: a Hub model that cannot be fetched now.
    """
    tokenizer_name = model_args.tokenizer_name
    if tokenizer_name and check_model_source(tokenizer_name, "--tokenizer_name") == "local":
        check_tokenizer_files(tokenizer_name, f"--tokenizer_name={tokenizer_name!r}", option="--tokenizer_name")
    path, _ = resolve_model_path(model_args)
    config = load_model_config(model_args, path)
    name = model_args.model_name_or_path
    label = f"--model_name_or_path={name!r}" if name else "the embedded model"
    model = _meta_model(config, model_args, label)
    if os.path.isdir(path):  # a local folder: its files are here to check (a Hub model's are not downloaded yet)
        check_weight_files(path, label)
        if not tokenizer_name:
            check_tokenizer_files(path, label, config)
    if data_args is not None:  # the default adapts to a model with fewer positions; a value chosen is refused
        default = next(f.default for f in dataclasses.fields(data_args) if f.name == "max_seq_length")
        data_args.max_seq_length = check_max_seq_length(config, data_args.max_seq_length, label, default)
    if model is not None:
        check_on_meta_model(model, lisa_args, training_args.seed, f"--method {lisa_args.method} on {label}")
