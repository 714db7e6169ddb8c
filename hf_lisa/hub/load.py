"""Load LISA adapters (or merged LISA models) from a local directory or a Hub repo, picking the base model for you.

``import hf_lisa`` is what makes ``"peft_type": "LISA"`` loadable by PEFT; code that never imports hf_lisa cannot be
intercepted, so the model cards say ``import hf_lisa`` and :func:`explain_missing_import` turns PEFT's bare
``KeyError: 'LISA'`` into an instruction wherever hf-lisa's own helpers catch it.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any, Optional, Union

from ..errors import MISSING_IMPORT_HINT, LisaNotRegisteredError, UsageError

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_SAFETENSORS_NAME = "adapter_model.safetensors"
ADAPTER_PICKLE_NAME = "adapter_model.bin"
MODEL_CONFIG_NAME = "config.json"

# PEFT's task_type -> the transformers Auto class that builds the base model
TASK_TYPE_TO_AUTO_CLASS = {
    "CAUSAL_LM": "AutoModelForCausalLM",
    "SEQ_CLS": "AutoModelForSequenceClassification",
    "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM",
    "TOKEN_CLS": "AutoModelForTokenClassification",
    "QUESTION_ANS": "AutoModelForQuestionAnswering",
    "FEATURE_EXTRACTION": "AutoModel",
}


def explain_missing_import(exc: BaseException) -> Optional[LisaNotRegisteredError]:
    """Turn PEFT's ``KeyError: 'LISA'`` (a LISA adapter loaded before ``import hf_lisa``) into a clear error.

    Returns a [`~hf_lisa.errors.LisaNotRegisteredError`] carrying `MISSING_IMPORT_HINT` when ``exc`` is that
    ``KeyError`` (or is caused by it), and ``None`` for any other exception.

    Example:
        ```py
        >>> from peft import PeftConfig
        >>> try:
        ...     PeftConfig.from_pretrained("user/lisa-adapter")  # doctest: +SKIP
        ... except KeyError as exc:
        ...     raise (explain_missing_import(exc) or exc) from exc
        ```
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, LisaNotRegisteredError):
            return exc
        if isinstance(exc, KeyError) and exc.args and str(exc.args[0]).upper() == "LISA":
            return LisaNotRegisteredError(MISSING_IMPORT_HINT)
        exc = exc.__cause__ or exc.__context__
    return None


def _auto_class(name: str):
    import transformers

    return getattr(transformers, name)


def _auto_class_for_config(model_config: dict) -> Any:
    """The concrete architecture class of a saved ``config.json`` when transformers has it, else the causal-LM Auto."""
    import transformers

    for arch in model_config.get("architectures") or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


class _Source:
    """A local directory or a Hub repo at a revision, with the few file operations loading needs."""

    def __init__(self, repo_or_dir: Union[str, os.PathLike], revision: Optional[str], token) -> None:
        self.name = os.fspath(repo_or_dir)
        self.local = os.path.isdir(self.name)
        path_like = os.path.isabs(self.name) or self.name.startswith((".", "~")) or self.name.count("/") > 1
        if not self.local and path_like:
            raise FileNotFoundError(f"{self.name!r} is not a directory, and not a Hub repo id ('namespace/name').")
        self.revision = revision
        self.token = token

    def exists(self, filename: str) -> bool:
        if self.local:
            return os.path.isfile(os.path.join(self.name, filename))
        from huggingface_hub import file_exists

        return file_exists(self.name, filename, revision=self.revision, token=self.token)

    def read_json(self, filename: str) -> Optional[dict]:
        """The parsed file, or ``None`` when the source does not have it."""
        if self.local:
            path = os.path.join(self.name, filename)
            if not os.path.isfile(path):
                return None
        else:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import EntryNotFoundError

            try:
                path = hf_hub_download(self.name, filename, revision=self.revision, token=self.token)
            except EntryNotFoundError:
                return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def describe(self) -> str:
        if self.local:
            return f"directory {self.name!r}"
        return f"Hub repo {self.name!r}" + (f" at revision {self.revision!r}" if self.revision else "")


def recorded_base(recorded: Any, adapter_dir: Optional[str]) -> tuple[Optional[str], str]:
    """What an adapter's recorded ``base_model_name_or_path`` loads: ``(path or Hub id, "")``, or ``(None, why not)``.

    An absolute path loads as recorded, a relative one from the adapter's folder ``adapter_dir``, and from the current
    directory only when that is where the run that saved the adapter ran (:func:`_trained_from_here`), never otherwise:
    that would load whatever lies where the command happens to run. A name that is no path and no folder is a Hub id.
    ``why not`` follows ``base_model_name_or_path=<value>,`` in a message.
    """
    if not isinstance(recorded, str) or not recorded.strip():
        return None, "which names no model"
    expanded = os.path.expanduser(recorded)
    if os.path.isabs(expanded):
        return (expanded, "") if os.path.isdir(expanded) else (None, "which is not a folder here")
    beside = os.path.normpath(os.path.join(adapter_dir, expanded)) if adapter_dir is not None else None
    if beside is not None and os.path.isdir(beside):
        return beside, ""
    path_like = recorded.startswith(".") or recorded.count("/") > 1 or "\\" in recorded
    if not path_like and not os.path.isdir(expanded):
        return recorded, ""  # a Hub id
    if os.path.isdir(expanded) and adapter_dir is not None and _trained_from_here(adapter_dir):
        return os.path.abspath(expanded), ""
    why = (f"a relative path that is not a folder beside the adapter ({beside!r})" if beside is not None else
           "a relative path, and the adapter is no local folder")
    if os.path.isdir(expanded):
        why += (f"; it is one in the current directory ({os.path.abspath(expanded)!r}), but hf-lisa never resolves an "
                "adapter's base against the current directory")
    return None, why


def _trained_from_here(adapter_dir: str) -> bool:
    """Whether the current directory is the one ``hf-lisa train`` ran in when it saved ``adapter_dir``: the relative
    ``output_dir`` its ``training_summary.json`` records leads from here to this very folder. Then a relative base path
    it recorded (``--model_name_or_path ./base``) means, from here, what it meant to the run."""
    try:
        with open(os.path.join(adapter_dir, "training_summary.json"), encoding="utf-8") as f:
            output_dir = json.load(f).get("output_dir")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(output_dir, str) or not output_dir or os.path.isabs(os.path.expanduser(output_dir)):
        return False
    return os.path.realpath(output_dir) == os.path.realpath(adapter_dir)


def resolve_recorded_base(recorded: Any, adapter_dir: Optional[str], config_file: str) -> str:
    """:func:`recorded_base`, or a ``UsageError`` naming ``config_file``, the recorded value and why it cannot load."""
    base, why = recorded_base(recorded, adapter_dir)
    if base is None:
        raise UsageError(f"{config_file} records base_model_name_or_path={recorded!r}, {why}; {PASS_BASE}: the "
                         "folder or Hub id it was trained on.")
    return base


def _check_safetensors_only(folder: str, what: str) -> None:
    """Refuse a local model folder whose weights are pickles only, or whose ``model.safetensors.index.json`` names a
    shard that is not a safetensors file (transformers would ``torch.load`` it), naming the file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map") or {}
        except (ValueError, AttributeError):
            raise UsageError(f"{index!r} is not a safetensors index (a JSON object with a 'weight_map').") from None
        shards = sorted({str(s) for s in weight_map.values()} if isinstance(weight_map, dict) else set())
        bad = [s for s in shards if not s.endswith(".safetensors")]
        if bad:
            raise UsageError(f"{index!r} names {bad[0]!r}, which is not a safetensors file: {what} would be unpickled, "
                             f"which can run code; {PICKLE_ADVICE}")
    elif not os.path.isfile(os.path.join(folder, "model.safetensors")):
        pickles = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
        if pickles:
            found = os.path.join(folder, pickles[0])
            raise UsageError(f"{what} has no model.safetensors, only pickle weights ({found!r}), which can run code "
                             f"when loaded; {PICKLE_ADVICE}")


#: what every refusal of pickle weights advises
#: how an adapter's base is given explicitly, by each caller
PASS_BASE = "pass the base explicitly (chat/generate --base, export --base_model, from_pretrained(base_model=...))"
PICKLE_ADVICE = ("hf-lisa does not unpickle weights: convert them to safetensors where you trust them "
                 "(from_pretrained, then save_pretrained(..., safe_serialization=True)).")


def _explain_load_error(exc: BaseException, what: str) -> Optional[UsageError]:
    """A one-line ``UsageError`` for what transformers or torch raise when a model needs its own code or holds a
    pickle that ``weights_only`` blocked; ``None`` for anything else."""
    import pickle

    message = str(exc)
    if isinstance(exc, ValueError) and "trust_remote_code" in message:
        return UsageError(f"{what} needs its own Python code to load (custom code named by 'auto_map' in its "
                          "config.json or tokenizer_config.json); hf-lisa never runs a model's code: use a model whose "
                          "architecture transformers implements.")
    if isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in message:
        return UsageError(f"{what} holds pickle weights that torch refused to unpickle (they could run code); "
                          f"{PICKLE_ADVICE}")
    return None


def _dtype_kwargs(torch_dtype) -> dict:
    # transformers 5 renamed torch_dtype to dtype; "auto" keeps the dtype the weights were saved in
    return {"dtype": torch_dtype if torch_dtype is not None else "auto"}


def from_pretrained(
    repo_or_dir: Union[str, os.PathLike],
    revision: Optional[str] = None,
    allow_pickle: bool = False,
    torch_dtype=None,
    is_trainable: bool = False,
    *,
    base_model: Optional[str] = None,
    adapter_name: str = "default",
    token: Optional[Union[str, bool]] = None,
    **kwargs,
):
    """Load a LISA adapter with its base model, or a merged model, from a directory or a Hub repo.

    For an adapter (the source has ``adapter_config.json``), the base model named by ``base_model_name_or_path`` is
    loaded with the Auto class that matches the config's ``task_type`` (``CAUSAL_LM`` → ``AutoModelForCausalLM``,
    ``SEQ_CLS`` → ``AutoModelForSequenceClassification``, …; causal LM when unset), then the adapter is attached with
    ``PeftModel.from_pretrained``. A source with ``config.json`` and no adapter config holds merged weights and is
    loaded as a plain transformers model.

    Pickle weights (``adapter_model.bin``, ``pytorch_model.bin``) can run code when unpickled, so they are refused
    unless ``allow_pickle=True``; the base model is loaded with ``use_safetensors=True`` for the same reason.

    Args:
        repo_or_dir: a local directory, or a Hub repo id (``"user/my-lisa-adapter"``).
        revision: branch, tag or commit of the Hub repo (ignored for directories). The base model is loaded at its
            default revision.
        allow_pickle: accept pickle weights.
        torch_dtype: dtype of the loaded model; the saved dtype by default.
        is_trainable: load the adapter in training mode (``PeftModel.from_pretrained(..., is_trainable=True)``).
        base_model: load the adapter onto this base (Hub id or path) instead of the one its config names, e.g. when
            the config records a local path of the machine it was trained on.
        adapter_name: name given to the loaded adapter.
        token: Hub token for private repos (defaults to the saved token / ``HF_TOKEN``).
        kwargs: passed to the base model's ``from_pretrained`` (e.g. ``device_map``).

    Returns:
        a ``peft.PeftModel`` for adapters, a ``transformers.PreTrainedModel`` for merged weights.

    Example:
        ```py
        >>> import hf_lisa
        >>> model = hf_lisa.from_pretrained("user/smollm2-lisa-gsm8k")  # doctest: +SKIP
        >>> model = hf_lisa.from_pretrained("user/smollm2-lisa-gsm8k", revision="v1")  # doctest: +SKIP
        ```
    """
    source = _Source(repo_or_dir, revision, token)
    kwargs.setdefault("trust_remote_code", False)  # never a model's own code, and never transformers' y/N prompt
    adapter_config = source.read_json(ADAPTER_CONFIG_NAME)
    if adapter_config is None:
        model_config = source.read_json(MODEL_CONFIG_NAME)
        if model_config is None:
            raise FileNotFoundError(
                f"{source.describe()} holds neither {ADAPTER_CONFIG_NAME} (a PEFT adapter) nor {MODEL_CONFIG_NAME} "
                "(a transformers model); nothing to load."
            )
        return _load_merged(source, model_config, allow_pickle, torch_dtype, **kwargs)
    return _load_adapter(
        source, adapter_config, allow_pickle, torch_dtype, is_trainable, base_model, adapter_name, **kwargs
    )


def _load_merged(source: _Source, model_config: dict, allow_pickle: bool, torch_dtype, **kwargs):
    if source.local and not allow_pickle:
        _check_safetensors_only(source.name, f"the model {source.name!r}")
    has_safetensors = source.exists("model.safetensors") or source.exists("model.safetensors.index.json")
    if not has_safetensors and not allow_pickle:
        raise ValueError(
            f"{source.describe()} has no safetensors weights (model.safetensors or model.safetensors.index.json); "
            f"pickle weights can run code when loaded, so {PICKLE_ADVICE[:-1]} (in Python, allow_pickle=True loads "
            "them if you trust this repo)."
        )
    model_cls = _auto_class_for_config(model_config)
    hub_kwargs = {} if source.local else {"revision": source.revision, "token": source.token}
    try:
        return model_cls.from_pretrained(
            source.name, use_safetensors=True if not allow_pickle else None, **hub_kwargs,
            **_dtype_kwargs(torch_dtype), **kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - custom code or a blocked pickle become one line; the rest propagates
        explained = _explain_load_error(exc, source.describe())
        if explained is None:
            raise
        raise explained from exc


def _load_adapter(
    source: _Source,
    adapter_config: dict,
    allow_pickle: bool,
    torch_dtype,
    is_trainable: bool,
    base_model: Optional[str],
    adapter_name: str,
    **kwargs,
):
    from peft import PeftModel

    if not source.exists(ADAPTER_SAFETENSORS_NAME):
        if not allow_pickle:
            found = f" (it holds {ADAPTER_PICKLE_NAME}, a pickle)" if source.exists(ADAPTER_PICKLE_NAME) else ""
            raise ValueError(
                f"{source.describe()} has no {ADAPTER_SAFETENSORS_NAME}{found}; pickle weights can run code when "
                f"loaded, so {PICKLE_ADVICE[:-1]} (in Python, allow_pickle=True loads them if you trust this adapter)."
            )
        logger.warning("Loading pickle adapter weights from %s (allow_pickle=True).", source.describe())

    config_file = (repr(os.path.join(source.name, ADAPTER_CONFIG_NAME)) if source.local else
                   f"{ADAPTER_CONFIG_NAME} of {source.describe()}")
    if base_model:
        base_name, base_what = base_model, f"the base model {base_model!r}"
    else:
        recorded = adapter_config.get("base_model_name_or_path")
        if not recorded:
            raise ValueError(
                f"{ADAPTER_CONFIG_NAME} of {source.describe()} has no base_model_name_or_path; pass base_model=... "
                "(the Hub id or path of the model the adapter was trained on)."
            )
        base_name = resolve_recorded_base(recorded, source.name if source.local else None, config_file)
        base_what = f"the base model {recorded!r} (recorded in {config_file})"
    task_type = adapter_config.get("task_type") or "CAUSAL_LM"
    auto_name = TASK_TYPE_TO_AUTO_CLASS.get(str(task_type).upper())
    if auto_name is None:
        raise ValueError(
            f"{ADAPTER_CONFIG_NAME} of {source.describe()} has task_type={task_type!r}; allowed: "
            f"{sorted(TASK_TYPE_TO_AUTO_CLASS)} (or unset for a causal LM)."
        )
    logger.info("Loading base model %s with %s for %s", base_name, auto_name, source.describe())
    if os.path.isdir(base_name) and not allow_pickle:
        _check_safetensors_only(base_name, base_what)
    try:
        base = _auto_class(auto_name).from_pretrained(
            base_name, use_safetensors=True if not allow_pickle else None, token=source.token,
            **_dtype_kwargs(torch_dtype), **kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - one line naming the base and where it was recorded
        explained = _explain_load_error(exc, base_what)
        if explained is not None:
            raise explained from exc
        if isinstance(exc, ValueError) or isinstance(exc, OSError) and exc.errno is None:  # not found, not a model
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"{base_what} does not load ({first}); {PASS_BASE}.") from exc
        raise
    hub_kwargs = {} if source.local else {"revision": source.revision, "token": source.token}
    try:
        with warnings.catch_warnings():  # check_adapter_keys raises a clear error for what PEFT warns about here
            warnings.filterwarnings("ignore", message="Found missing adapter keys")
            model = PeftModel.from_pretrained(
                base, source.name, adapter_name=adapter_name, is_trainable=is_trainable, **hub_kwargs
            )
    except KeyError as exc:
        explained = explain_missing_import(exc)
        if explained is not None:
            raise explained from exc
        raise
    check_adapter_keys(model, source.name, adapter_name, config_file, **hub_kwargs)
    return model


#: how many key names an adapter-key error shows of each kind
SHOWN_KEYS = 3


def check_adapter_keys(model, adapter: str, adapter_name: str, config_file: str, **hub_kwargs) -> None:
    """Refuse an adapter whose weights file does not fill exactly the weights its config builds: a weight the config
    builds that the file lacks would stay at its initial value (a LoRA adapter labelled for LISA weights serves the bare
    base), a tensor of the file that fits nowhere is lost. PEFT only warns about the first and is silent about the
    second; this reads the file again and sets it with PEFT's own ``set_peft_model_state_dict`` (the same values as
    the load, so the model is unchanged), whose result names both.

    Raises:
        UsageError: naming the weights file, the counts and a few key names of each kind.
    """
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    weights = load_peft_weights(adapter, device="cpu", **hub_kwargs)
    result = set_peft_model_state_dict(model, weights, adapter_name=adapter_name)
    prefix = getattr(model.base_model, "prefix", "")
    configured = [k for k in model.state_dict() if prefix in k and f".{adapter_name}" in k]
    missing = [k for k in result.missing_keys if prefix in k and f".{adapter_name}" in k]
    unexpected = list(result.unexpected_keys)
    if not missing and not unexpected:
        return

    def names(keys: list) -> str:
        return ", ".join(k.removeprefix("base_model.model.") for k in keys[:SHOWN_KEYS])

    peft_type = str(getattr(model.peft_config[adapter_name], "peft_type", "?")).split(".")[-1]
    weights_file = (os.path.join(adapter, ADAPTER_SAFETENSORS_NAME) if os.path.isdir(adapter) else
                    f"{ADAPTER_SAFETENSORS_NAME} of {adapter!r}")
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the {len(configured)} weights its config builds are not in the file (e.g. "
                     f"{names(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} of the file's {len(weights)} tensors fit no weight of the model (e.g. "
                     f"{names(unexpected)})")
    raise UsageError(f"the adapter weights {weights_file!r} do not match {config_file} (peft_type {peft_type}): "
                     f"{'; '.join(parts)}. Served as is it would not be the trained model; check that the config "
                     "belongs to these weights and that the base is the model they were trained on.")
