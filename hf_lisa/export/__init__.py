"""Exports for serving: a LISA model as a PEFT LoRA adapter, a GGUF file, or merged transformers weights.

- :func:`export_lora` (``hf-lisa export lora``): a ρ = 0 adapter becomes a LoRA adapter exactly; a sparse one a
  rank-``k`` LoRA by truncated SVD of ``s · M ⊙ (B A)``, with the error reported. Plain PEFT, vLLM and TGI load it.
- :func:`export_gguf` (``hf-lisa export gguf``): merged weights as an f16 or q8_0 GGUF file for llama.cpp / ollama
  (Llama-family architectures), with tokenizer metadata.
- :func:`export_merged` (``hf-lisa export merged``): the merge of ``hf-lisa push --mode merged``, written to a folder.

Layer interpolation cannot be merged or expressed as a LoRA; every export refuses it with the reason.

Modules: :mod:`.common` (staged outputs, sources, check inputs), :mod:`.lora`, :mod:`.gguf` (tensors, metadata),
:mod:`.gguf_tokenizer` (tokenizer metadata), :mod:`.merged`, :mod:`.cli` (``hf-lisa export``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:  # at run time these resolve on first use (``__getattr__``): `hf-lisa export --help` loads no torch
    from .gguf import GGUF_TYPES, GgufExportReport, export_gguf, write_gguf
    from .lora import INTERPOLATION_REFUSAL, LoraExportReport, ModuleExport, convert_lisa_to_lora, export_lora
    from .merged import MergedExportReport, export_merged

# public name -> the submodule defining it
_LAZY = {
    "GGUF_TYPES": "gguf", "GgufExportReport": "gguf", "export_gguf": "gguf", "write_gguf": "gguf",
    "INTERPOLATION_REFUSAL": "lora", "LoraExportReport": "lora", "ModuleExport": "lora",
    "convert_lisa_to_lora": "lora", "export_lora": "lora",
    "MergedExportReport": "merged", "export_merged": "merged",
}

# submodules reachable as attributes of the package, imported on first access
_SUBMODULES = frozenset({"cli", "common", "gguf", "gguf_tokenizer", "lora", "merged"})


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, _SUBMODULES)


__all__ = [
    "GGUF_TYPES",
    "INTERPOLATION_REFUSAL",
    "GgufExportReport",
    "LoraExportReport",
    "MergedExportReport",
    "ModuleExport",
    "convert_lisa_to_lora",
    "export_gguf",
    "export_lora",
    "export_merged",
    "write_gguf",
]
