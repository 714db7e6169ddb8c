"""Load LISA adapters (or merged LISA models) from a local directory or a Hub repo, picking the base model for you.

``import hf_lisa`` is what makes ``"peft_type": "LISA"`` loadable by PEFT; code that never imports hf_lisa cannot be
intercepted, so the model cards say ``import hf_lisa`` and :func:`explain_missing_import` turns PEFT's bare
``KeyError: 'LISA'`` into an instruction wherever hf-lisa's own helpers catch it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional, Union

from ..errors import MISSING_IMPORT_HINT, LisaNotRegisteredError

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
    has_safetensors = source.exists("model.safetensors") or source.exists("model.safetensors.index.json")
    if not has_safetensors and not allow_pickle:
        raise ValueError(
            f"{source.describe()} has no safetensors weights (model.safetensors or model.safetensors.index.json). "
            "Pickle weights can run arbitrary code when loaded, so hf-lisa refuses them; pass allow_pickle=True "
            "if you trust this repo."
        )
    model_cls = _auto_class_for_config(model_config)
    hub_kwargs = {} if source.local else {"revision": source.revision, "token": source.token}
    return model_cls.from_pretrained(
        source.name, use_safetensors=True if not allow_pickle else None, **hub_kwargs, **_dtype_kwargs(torch_dtype),
        **kwargs,
    )


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
            found = " It holds adapter_model.bin (pickle)." if source.exists(ADAPTER_PICKLE_NAME) else ""
            raise ValueError(
                f"{source.describe()} has no {ADAPTER_SAFETENSORS_NAME}.{found} Pickle weights can run arbitrary code "
                "when loaded, so hf-lisa refuses them; pass allow_pickle=True if you trust this adapter."
            )
        logger.warning("Loading pickle adapter weights from %s (allow_pickle=True).", source.describe())

    base_name = base_model or adapter_config.get("base_model_name_or_path")
    if not base_name:
        raise ValueError(
            f"{ADAPTER_CONFIG_NAME} of {source.describe()} has no base_model_name_or_path; pass base_model=... "
            "(the Hub id or path of the model the adapter was trained on)."
        )
    task_type = adapter_config.get("task_type") or "CAUSAL_LM"
    auto_name = TASK_TYPE_TO_AUTO_CLASS.get(str(task_type).upper())
    if auto_name is None:
        raise ValueError(
            f"{ADAPTER_CONFIG_NAME} of {source.describe()} has task_type={task_type!r}; allowed: "
            f"{sorted(TASK_TYPE_TO_AUTO_CLASS)} (or unset for a causal LM)."
        )
    logger.info("Loading base model %s with %s for %s", base_name, auto_name, source.describe())
    base = _auto_class(auto_name).from_pretrained(
        base_name, use_safetensors=True if not allow_pickle else None, token=source.token,
        **_dtype_kwargs(torch_dtype), **kwargs,
    )
    hub_kwargs = {} if source.local else {"revision": source.revision, "token": source.token}
    try:
        return PeftModel.from_pretrained(
            base, source.name, adapter_name=adapter_name, is_trainable=is_trainable, **hub_kwargs
        )
    except KeyError as exc:
        explained = explain_missing_import(exc)
        if explained is not None:
            raise explained from exc
        raise
