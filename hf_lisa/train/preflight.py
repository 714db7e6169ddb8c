"""The checks of a ``hf-lisa train`` run that need the model but not its weights, made before anything heavy.

:func:`check_before_loading` runs first in :func:`hf_lisa.train.run`, before the data is read, any weight is loaded or
any row is tokenised. It reads the model's ``config.json`` (naming the folder or Hub id at fault when it cannot), then
builds the model on the ``meta`` device, where parameters have shapes but no storage, and runs the very code the run
itself runs on it: the block discovery (``--lisa_layers_attribute``), ``apply_method`` (PEFT's ``target_modules``
resolution, the LISA adapter) and the layer schedule (``--lisa_always_trainable``, γ against the blocks that train).
A typo in any of these fails in seconds with a :class:`~hf_lisa.errors.UsageError`, not after the model load,
tokenisation and the evaluation before training.
"""

from __future__ import annotations

import logging
import os
import warnings

from ..errors import UsageError
from ..methods import get_method
from .arguments import LisaArguments, ModelArguments
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
                    LayerwiseScheduler(model, callback.activated_layers, callback.interval_steps, callback.sampling,
                                       callback.seed, callback.always_trainable, callback.optimizer_state_policy,
                                       callback.layers_attribute)
                elif isinstance(callback, LisaAdapterCallback) and gamma > 0:
                    # γ is drawn from the blocks that hold an adapter (--layers_to_transform may leave some out)
                    adapted = LayerwiseScheduler.for_adapter(model, num_active=1).block_names
                    where = f"{label} ({index.num_blocks} blocks, {len(adapted)} with an adapter)"
                    check_gamma(len(adapted))
    except ValueError as err:
        raise UsageError(f"{where}: {err}") from None


def check_before_loading(model_args: ModelArguments, lisa_args: LisaArguments, training_args) -> None:
    """Check the model source and everything the method needs from the model, before any weight is loaded.

    Raises:
        UsageError: a missing model folder, an unknown Hub model, or an option the model cannot take (block path,
            always-trainable names, γ larger than the blocks, target modules).
        ConnectionError, PermissionError: a Hub model that cannot be fetched now.
    """
    if model_args.tokenizer_name:
        check_model_source(model_args.tokenizer_name, "--tokenizer_name")
    path, _ = resolve_model_path(model_args)
    config = load_model_config(model_args, path)
    name = model_args.model_name_or_path
    label = f"--model_name_or_path={name!r}" if name else "the embedded model"
    model = _meta_model(config, model_args, label)
    if model is not None:
        check_on_meta_model(model, lisa_args, training_args.seed, f"--method {lisa_args.method} on {label}")
