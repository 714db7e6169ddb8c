"""Export a (merged) model as a GGUF file for llama.cpp and ollama, with the ``gguf`` package.

Llama-family decoders are supported (``llama``, ``mistral`` without a sliding window, ``qwen2``). Weights are renamed
to llama.cpp's tensor names (``gguf.get_tensor_name_map``); for the ``llama`` architecture the rows of ``q_proj`` and
``k_proj`` are permuted as llama.cpp's converter does (its rotary embedding pairs neighbouring dimensions;
transformers pairs the two halves), which transformers' GGUF loader undoes. Tied embeddings are written once
(``token_embd``, no ``output``), as llama.cpp expects.

Types: ``f16`` (2-D weights in float16, norms and biases in float32) and ``q8_0`` (2-D weights in 8-bit blocks of
32 with one float16 scale; a weight whose rows are not a multiple of 32 stays float16).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch

from ..errors import RunError, UsageError
from .common import (
    DEFAULT_CHECK_PROMPTS,
    check_output_path,
    held_out_prompts,
    load_merged_model,
    prompt_ids,
    require_gguf,
    source_links,
    sources_of,
    staged_file,
)
from .gguf_tokenizer import _SCALARS, _STRING, TOKENS_KEY, tokenizer_metadata

logger = logging.getLogger(__name__)

GGUF_TYPES = ("f16", "q8_0")
#: transformers model_type -> (llama.cpp architecture, whether q/k rows are permuted for llama.cpp's rotary layout)
ARCHITECTURES = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False)}
Q8_0_BLOCK = 32
#: the metadata key (written second, after ``general.architecture``) that marks a GGUF file an hf-lisa export wrote:
#: ``--overwrite`` replaces no other file (issue 33 item 3)
EXPORTED_BY_KEY = "hf_lisa.exported_by"
_HEADER_ENTRIES, _HEADER_STRING = 16, 4096  # how much of an unknown file's header is read, at most


@dataclass
class GgufExportReport:
    """What :func:`export_gguf` wrote, and (with ``verify_prompts``) how the file reloads."""

    out_file: str
    type: str
    architecture: str
    tensors: int
    size_bytes: int
    tokenizer_source: str
    warnings: list[str] = field(default_factory=list)
    verification: Optional[dict] = None

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [(f"GGUF export: {self.out_file} ({self.type}, architecture {self.architecture}, {self.tensors} "
                  f"tensors, {self.size_bytes / 2**20:.1f} MiB); tokenizer {self.tokenizer_source}")]
        lines += [f"warning: {w}" for w in self.warnings]
        v = self.verification
        if v:
            lines.append(
                f"verification (the file reloaded with transformers' GGUF loader, against the source model): "
                f"{v['prompts']} held-out demo prompts, {v['max_new_tokens']} greedy tokens each: {v['identical']}/"
                f"{v['prompts']} generations identical, {v['token_agreement']:.1%} of the greedy tokens equal to the "
                f"source model's (up to the first divergence); max |weight difference| {v['max_weight_diff']:.3g}; "
                f"the file's tokenizer encodes {v['tokenizer_identical']}/{v['prompts']} prompts identically"
            )
        else:
            lines.append(f"verification: none (verify_prompts 0); --verify_prompts {DEFAULT_CHECK_PROMPTS} reloads the "
                         "file and compares its greedy generations with the source model's")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# Model -> tensors and metadata
# ----------------------------------------------------------------------------------------------------------------------
def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise UsageError(f"the {config.model_type} config states no rope_theta; cannot write llama.rope.freq_base.")
    return float(theta)


def check_supported(config) -> tuple[str, bool]:
    """``(llama.cpp architecture, permute q/k)`` for ``config``, or a ``UsageError`` naming what is not supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UsageError(f"GGUF export supports model_type {sorted(ARCHITECTURES)}; this model is {model_type!r}. "
                         "Export it merged (hf-lisa export merged) and convert it with llama.cpp's "
                         "convert_hf_to_gguf.py.")
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(config, "rope_scaling", None)
    if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
        raise UsageError(f"rope_type={rope_type!r}: only the default rotary embedding is exported (scaled RoPE needs "
                         "extra tensors that transformers' GGUF loader does not read back).")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UsageError(f"hidden_act={config.hidden_act!r}; the llama.cpp {ARCHITECTURES[model_type][0]} "
                         "architecture computes silu.")
    if model_type == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
        raise UsageError("attention_bias/mlp_bias=True: transformers' GGUF loader builds llama without biases, so "
                         "the file would not load back as this model.")
    if model_type == "mistral" and getattr(config, "sliding_window", None) not in (None, 0) and (
        config.sliding_window < config.max_position_embeddings
    ):
        raise UsageError(f"sliding_window={config.sliding_window}: llama.cpp's llama architecture has no sliding "
                         "window attention, so the exported model would attend differently on long inputs.")
    return ARCHITECTURES[model_type]


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order for the rotary embedding (``convert_hf_to_gguf.py``'s ``permute``)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_tensors(model, architecture: str, permute: bool) -> list[tuple[str, torch.Tensor]]:
    """``(GGUF name, float32 tensor)`` for every weight of ``model``, in llama.cpp's layout."""
    import gguf

    config = model.config
    arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    state = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and "lm_head.weight" in state and not torch.equal(state["lm_head.weight"],
                                                               state["model.embed_tokens.weight"]):
        raise UsageError("tie_word_embeddings=True but lm_head.weight differs from the embeddings (an lm_head trained "
                         "on its own?); GGUF would keep only the embeddings. Untie them in the config first.")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    out = []
    for key, tensor in state.items():
        if tied and key == "lm_head.weight":
            continue
        base, suffix = key.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise UsageError(f"weight {key!r} has no llama.cpp {architecture} tensor name; refusing to drop it.")
        tensor = tensor.detach().to(torch.float32).cpu()
        if permute and suffix == "weight" and name.endswith(".attn_q"):
            tensor = _permute(tensor, heads)
        elif permute and suffix == "weight" and name.endswith(".attn_k"):
            tensor = _permute(tensor, kv_heads)
        out.append((f"{name}.{suffix}", tensor))
    return out


def _add_tensor(writer, name: str, tensor: torch.Tensor, gguf_type: str) -> None:
    import gguf

    array = tensor.numpy()
    if array.ndim < 2:
        writer.add_tensor(name, array.astype(np.float32))
    elif gguf_type == "q8_0" and array.shape[-1] % Q8_0_BLOCK == 0:
        quantized = gguf.quants.quantize(array.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        if gguf_type == "q8_0":
            logger.info("%s: rows of %d are not a multiple of %d; kept as f16.", name, array.shape[-1], Q8_0_BLOCK)
        writer.add_tensor(name, array.astype(np.float16))


def write_gguf(model, tokenizer, path: str, gguf_type: str = "f16", *, name: Optional[str] = None,
               tokenizer_from: Optional[str] = None, tokenizer_pre: Optional[str] = None) -> GgufExportReport:
    """Write ``model`` (a transformers Llama-family model, adapters merged) and its tokenizer to the GGUF file
    ``path`` (written directly; :func:`export_gguf` stages it). Returns the report without verification."""
    gguf = require_gguf()
    if gguf_type not in GGUF_TYPES:
        raise UsageError(f"type={gguf_type!r} is invalid; allowed: {GGUF_TYPES}.")
    config = model.config
    architecture, permute = check_supported(config)
    tensors = gguf_tensors(model, architecture, permute)
    vocab_rows = model.get_input_embeddings().weight.shape[0]
    tokens = tokenizer_metadata(tokenizer, vocab_rows, tokenizer_from, tokenizer_pre)
    n_tokens = len(tokens.value(TOKENS_KEY))
    if n_tokens != vocab_rows:
        raise UsageError(f"the tokenizer metadata ({tokens.source}) has {n_tokens} tokens but the model embeds "
                         f"{vocab_rows}; llama.cpp needs them equal.")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_string(EXPORTED_BY_KEY, "hf-lisa export gguf")
    writer.add_name(name or str(getattr(config, "_name_or_path", "") or "model").rstrip("/").split("/")[-1])
    writer.add_type("model")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if gguf_type == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_rope_dimension_count(head_dim)
    if head_dim * config.num_attention_heads != config.hidden_size:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(vocab_rows)
    tokens.write(writer)
    for tensor_name, tensor in tensors:
        _add_tensor(writer, tensor_name, tensor, gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for warning in tokens.warnings:
        logger.warning(warning)
    return GgufExportReport(out_file=os.path.abspath(path), type=gguf_type, architecture=architecture,
                            tensors=len(tensors), size_bytes=os.path.getsize(path), tokenizer_source=tokens.source,
                            warnings=list(tokens.warnings))


def not_exported(path: str) -> Optional[str]:
    """``None`` when ``path`` is a GGUF file an hf-lisa export wrote (it holds :data:`EXPORTED_BY_KEY`), else why
    not. Reads at most the first entries of the header, each of bounded size: it may be any file at all."""
    import struct

    def read(f, fmt):
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return "it is not a GGUF file"
            if read(f, "<I") < 2:
                return "a GGUF file of version 1, which hf-lisa never writes"
            read(f, "<Q")  # tensor count
            for _ in range(min(read(f, "<Q"), _HEADER_ENTRIES)):
                length = read(f, "<Q")
                if length > _HEADER_STRING:
                    break
                key, vtype = f.read(length).decode("utf-8", errors="replace"), read(f, "<I")
                if key == EXPORTED_BY_KEY:
                    return None
                if vtype == _STRING:
                    size = read(f, "<Q")
                    if size > _HEADER_STRING:
                        break
                    f.read(size)
                elif vtype in _SCALARS:
                    read(f, _SCALARS[vtype])
                else:  # an array: the key is written before any
                    break
    except (OSError, struct.error) as err:
        return f"it cannot be read as GGUF: {err}"
    return f"a GGUF file without the {EXPORTED_BY_KEY} key that hf-lisa writes"


# ----------------------------------------------------------------------------------------------------------------------
# Verification: the file as transformers' GGUF loader reads it back
# ----------------------------------------------------------------------------------------------------------------------
def greedy_tokens(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """The ``max_new_tokens`` greedy continuation of one prompt (no padding, no sampling, no early stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def compare_greedy(reference, candidate, prompts: list[list[int]], max_new_tokens: int = 16) -> dict:
    """Greedy continuations of both models: sequences identical, and the token agreement (the tokens before the
    first divergence, over all generated tokens)."""
    identical = agreeing = 0
    for ids in prompts:
        a, b = greedy_tokens(reference, ids, max_new_tokens), greedy_tokens(candidate, ids, max_new_tokens)
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        identical += a == b
        agreeing += prefix
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "identical": identical,
            "token_agreement": agreeing / max(1, len(prompts) * max_new_tokens)}


def load_gguf(path: str, with_tokenizer: bool = True):
    """``(model, tokenizer)`` read back by transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name) if with_tokenizer else None
    return model, tokenizer


def verify_gguf(path: str, model, tokenizer, n_prompts: int = DEFAULT_CHECK_PROMPTS, max_new_tokens: int = 16) -> dict:
    """Reload ``path`` with transformers and compare it with ``model`` on the demo task's held-out prompts: greedy
    generations, the largest weight difference, and whether the file's tokenizer encodes the prompts the same."""
    loaded, loaded_tokenizer = load_gguf(path)
    prompts = held_out_prompts(n_prompts)
    ids = prompt_ids(tokenizer, prompts)
    result = compare_greedy(model, loaded, ids, max_new_tokens)
    reference = model.state_dict()
    result["max_weight_diff"] = max(
        float((tensor.float() - reference[key].float()).abs().max()) for key, tensor in loaded.state_dict().items()
    )
    result["tokenizer_identical"] = sum(a == b for a, b in zip(prompt_ids(loaded_tokenizer, prompts), ids))
    return result


#: below this share of greedy tokens equal to the source model's, the export warns (``--min_agreement`` refuses):
#: measured on the demo model, f16 agrees on 100% and q8_0 on 89.1% (docs/export.md); a q8_0 export of a LISA run
#: that agreed on 53.9% is what the warning is for (issue 36)
WARN_AGREEMENT = 0.8


def check_verification(report: GgufExportReport, min_agreement: Optional[float]) -> None:
    """Refuse a file whose tokenizer encodes a check prompt differently from the model's, or whose greedy agreement
    is below ``min_agreement``; warn when it is below :data:`WARN_AGREEMENT`. Raises inside the staging block, so
    nothing is written."""
    v = report.verification
    if v["tokenizer_identical"] < v["prompts"]:
        raise RunError(
            f"the GGUF file's tokenizer encodes {v['prompts'] - v['tokenizer_identical']} of {v['prompts']} check "
            "prompts differently from the model's tokenizer (its tokens, merges or chat template differ), so "
            "llama.cpp and ollama would prompt the model wrongly; nothing was written. Pass --tokenizer_from a GGUF "
            "file of the same tokenizer, or --tokenizer_pre, or save the tokenizer the model was trained with "
            "beside it.")
    agreement = v["token_agreement"]
    if min_agreement is not None and agreement < min_agreement:
        raise RunError(
            f"the GGUF file agrees with the source model on {agreement:.1%} of the greedy tokens "
            f"({v['identical']}/{v['prompts']} generations identical), below --min_agreement={min_agreement:g}; "
            f"nothing was written. A {report.type} file loses precision: try --type f16.")
    if agreement < WARN_AGREEMENT:
        report.warnings.append(
            f"the file agrees with the source model on only {agreement:.1%} of the greedy tokens ({v['identical']}/"
            f"{v['prompts']} generations identical; below {WARN_AGREEMENT:.0%}): its answers will differ. "
            "--type f16 keeps more precision; --min_agreement makes this an error.")


def export_gguf(
    source: str,
    out_file: str,
    *,
    gguf_type: str = "f16",
    base_model: Optional[str] = None,
    tokenizer_from: Optional[str] = None,
    tokenizer_pre: Optional[str] = None,
    name: Optional[str] = None,
    verify_prompts: int = 0,
    overwrite: bool = False,
    min_agreement: Optional[float] = None,
) -> GgufExportReport:
    """Write ``source`` (a LISA adapter folder, merged here; a full model folder; a Hub id) as a GGUF file.

    Args:
        source: what to export; an adapter is merged with the tuner's own merge (layer interpolation is refused).
        out_file: the ``.gguf`` path; written to a hidden sibling first, renamed into place when complete.
        gguf_type: ``"f16"`` or ``"q8_0"``.
        base_model: the base of an adapter, instead of the one its config names.
        tokenizer_from: a GGUF file whose ``tokenizer.*`` metadata to copy (same tokenizer). By default the demo
            model's file when the tokenizer is the demo model's, else written from ``tokenizer.json``.
        tokenizer_pre: llama.cpp's pre-tokenizer name, when writing from ``tokenizer.json``.
        name: ``general.name`` in the file (default: the model's name).
        verify_prompts: reload the file with transformers' GGUF loader and compare greedy generations with the merged
            model on this many of the demo task's held-out prompts (0: no check; ``hf-lisa export gguf`` checks 8
            unless given ``--verify_prompts 0``). The report's :meth:`~GgufExportReport.format` states the figures.
        overwrite: replace an existing ``out_file`` that an hf-lisa export wrote (it holds
            :data:`EXPORTED_BY_KEY`); any other file is refused, named and kept.
        min_agreement: with ``verify_prompts``, refuse the file (nothing written) when the share of greedy tokens
            equal to the source model's is below this; without it, a share below :data:`WARN_AGREEMENT` warns.
            A tokenizer in the file that encodes any check prompt differently from the model's always refuses it.
    """
    require_gguf()
    if gguf_type not in GGUF_TYPES:
        raise UsageError(f"type={gguf_type!r} is invalid; allowed: {GGUF_TYPES}.")
    if isinstance(verify_prompts, bool) or not isinstance(verify_prompts, int) or verify_prompts < 0:
        raise UsageError(f"verify_prompts={verify_prompts!r} is invalid; allowed: an integer >= 0.")
    if min_agreement is not None:
        if isinstance(min_agreement, bool) or not isinstance(min_agreement, (int, float)) or not 0 <= min_agreement <= 1:
            raise UsageError(f"--min_agreement={min_agreement!r} is invalid; allowed: a number in [0, 1].")
        if not verify_prompts:
            raise UsageError("--min_agreement needs the reload check; it cannot take effect with --verify_prompts 0.")
    sources = sources_of(source, base_model)
    check_output_path(out_file, sources, overwrite, "OUT_FILE", is_file=True, owned_file=not_exported)
    skipped = source_links(source)  # refuses weights behind a link out of the folder; names the others
    model, tokenizer = load_merged_model(source, base_model)
    check_supported(model.config)  # before anything is written
    if verify_prompts and tokenizer is None:
        raise UsageError("verify_prompts needs the model's tokenizer to encode the prompts; none was found. Pass "
                         "--verify_prompts 0 (verify_prompts=0) to export without the check.")
    recheck = lambda: check_output_path(out_file, sources, overwrite, "OUT_FILE", True, not_exported)  # noqa: E731
    with staged_file(out_file, before_replace=recheck) as staging:  # the file may have changed while this ran
        report = write_gguf(model, tokenizer, staging, gguf_type, name=name or os.path.basename(
            os.path.normpath(source)), tokenizer_from=tokenizer_from, tokenizer_pre=tokenizer_pre)
        report.warnings += [f"skipped {link}: a symbolic link out of the source folder" for link in skipped]
        if verify_prompts:
            report.verification = verify_gguf(staging, model, tokenizer, verify_prompts)
            check_verification(report, min_agreement)
    report.out_file = os.path.abspath(out_file)
    return report
