"""Export a LISA adapter as a PEFT LoRA adapter: what plain PEFT, vLLM and TGI load.

- **ρ = 0** (every module dense): LISA's forward is LoRA's, ``s · B A`` with ``s = alpha / r``. The factors are
  renamed (``lisa_A``/``lisa_B`` → ``lora_A``/``lora_B``) and copied bit for bit; ``r``, ``lisa_alpha`` and the
  per-module ``rank_pattern``/``alpha_pattern`` become ``r``, ``lora_alpha`` and LoRA's patterns, so the scaling is
  unchanged. The export is exact.
- **ρ > 0**: ``ΔW = s · M ⊙ (B A)`` is not low-rank in general. Each sparse module's ``ΔW`` is replaced by its best
  rank-``k`` approximation (truncated SVD, Eckart–Young), split evenly (``√Σ``) between ``B`` and ``A``. The relative
  Frobenius error ``‖ΔW − ΔW_k‖_F / ‖ΔW‖_F`` of every module is reported, and the export is refused (a
  :class:`~hf_lisa.errors.RunError`, nothing written) when the worst module's exceeds ``max_error`` (default
  :data:`~hf_lisa.export.common.DEFAULT_MAX_ERROR`, 0.05), unless ``accept_error=True``: a higher ``rank`` lowers
  it. Dense modules of a mixed adapter (``sparsity_pattern={...: 0.0}``) are still copied exactly.
- **Layer interpolation** is refused: α_l and β_l scale and shift the residual stream (``h = α·f(h) + β``); a LoRA
  adds ``x ΔWᵀ`` to single linear layers and cannot express that.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import RunError, UsageError
from ..tuner import masks as M
from ..tuner.config import LisaConfig
from .common import (
    DEFAULT_MAX_ERROR,
    check_inputs,
    check_output_path,
    load_tokenizer,
    logits,
    max_logit_difference,
    read_adapter,
    source_links,
    sources_of,
    staged_directory,
    write_json,
)

logger = logging.getLogger(__name__)

PREFIX = "base_model.model."
REPORT_NAME = "lisa_export.json"
#: an exact export must reproduce the LISA adapter's logits this closely (float32 noise; measured: 0.0)
EXACT_LOGIT_TOLERANCE = 1e-5
INTERPOLATION_REFUSAL = (
    "the adapter uses layer interpolation (layer_interpolation=True): alpha_l and beta_l scale and shift the residual "
    "stream of whole blocks (h = alpha * f(h) + beta), which no LoRA can express (a LoRA adds x·dW^T to single linear "
    "layers). Serve it as a LISA adapter (hf_lisa.from_pretrained), or retrain with layer_interpolation=False."
)


@dataclass
class ModuleExport:
    """How one adapted module was exported."""

    module: str
    method: str  # "copied" (exact) or "svd" (rank-k approximation)
    rank: int
    sparsity: float
    relative_error: float  # ‖ΔW − ΔW_LoRA‖_F / ‖ΔW‖_F; 0 for copies


@dataclass
class LoraExportReport:
    """What :func:`export_lora` wrote and how close it is to the LISA adapter."""

    out_dir: Optional[str]
    exact: bool
    rank: int
    modules: list[ModuleExport] = field(default_factory=list)
    max_logit_diff: Optional[float] = None
    logit_inputs: Optional[str] = None
    skipped_links: list[str] = field(default_factory=list)  # "name -> target": links out of the adapter folder

    @property
    def max_relative_error(self) -> float:
        return max((m.relative_error for m in self.modules), default=0.0)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "max_relative_error": self.max_relative_error}

    def format(self, per_module: bool = True) -> str:
        """Human-readable lines: one per factorised module, then the summary."""
        svd = [m for m in self.modules if m.method == "svd"]
        lines = [f"  {m.module}: rank {m.rank}, sparsity {m.sparsity:g}, relative Frobenius error "
                 f"{m.relative_error:.4g}" for m in svd] if per_module else []
        copied = len(self.modules) - len(svd)
        kind = "exact (every module copied)" if self.exact else (
            f"{len(svd)} sparse module(s) as rank-{self.rank} SVD, {copied} dense module(s) copied exactly; max "
            f"relative Frobenius error {self.max_relative_error:.4g}")
        lines.append(f"LoRA export: {kind}")
        if self.max_logit_diff is not None:
            lines.append(f"max |logit difference| LISA vs LoRA: {self.max_logit_diff:.3g} ({self.logit_inputs})")
        lines += [f"skipped link (leads out of the adapter folder): {link}" for link in self.skipped_links]
        if self.out_dir:
            lines.append(f"written to {self.out_dir}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# Conversion (pure: config and tensors in, config and tensors out)
# ----------------------------------------------------------------------------------------------------------------------
def _lisa_config(adapter_config: dict) -> LisaConfig:
    peft_type = str(adapter_config.get("peft_type", "")).upper()
    if peft_type == "LORA":
        kind = "DoRA" if adapter_config.get("use_dora") else "LoRA"
        raise UsageError(f"adapter_config.json says peft_type='LORA': this is already a PEFT {kind} adapter (e.g. "
                         f"`hf-lisa train --method {kind.lower()}`), which vLLM, TGI and PEFT load as it is: serve the "
                         "folder directly, no export needed. export lora converts LISA adapters (peft_type 'LISA').")
    if peft_type != "LISA":
        raise UsageError(f"adapter_config.json says peft_type={adapter_config.get('peft_type')!r}; export lora takes a "
                         "LISA adapter (peft_type 'LISA').")
    if adapter_config.get("layer_interpolation"):
        raise UsageError(f"Cannot export to LoRA: {INTERPOLATION_REFUSAL}")
    known = {f.name for f in dataclasses.fields(LisaConfig)}
    unknown = sorted(set(adapter_config) - known)
    if unknown:
        logger.info("adapter_config.json fields not known to this LisaConfig, ignored: %s", unknown)
    return LisaConfig(**{k: v for k, v in adapter_config.items() if k in known and k != "peft_type"})


def _group_weights(state_dict: dict, config: LisaConfig) -> tuple[dict[str, dict], dict]:
    """``({module: {"A", "B", "mask"?}}, other tensors)``; refuses what a LoRA cannot carry."""
    modules: dict[str, dict] = {}
    others = {}
    for key, tensor in state_dict.items():
        if "lisa_interp_" in key:
            raise UsageError(f"Cannot export to LoRA: the weights hold {key!r}; {INTERPOLATION_REFUSAL}")
        for suffix, slot in ((".lisa_A.weight", "A"), (".lisa_B.weight", "B"), (".lisa_mask", "mask")):
            if key.endswith(suffix) and key.startswith(PREFIX):
                modules.setdefault(key[len(PREFIX): -len(suffix)], {})[slot] = tensor
                break
        else:
            if "lisa_" in key:
                raise UsageError(f"adapter weight {key!r} has no LoRA counterpart; this hf-lisa version cannot "
                                 "export it.")
            others[key] = tensor
    if others and not config.modules_to_save:
        raise UsageError(f"adapter weights {sorted(others)[:3]} are neither LISA factors nor modules_to_save; "
                         "refusing to drop them.")
    broken = [name for name, parts in modules.items() if "A" not in parts or "B" not in parts]
    if broken:
        raise UsageError(f"modules {broken[:3]} lack lisa_A or lisa_B weights; the adapter file is incomplete.")
    return modules, others


def _mask(config: LisaConfig, module: str, sparsity: float, packed: torch.Tensor, shape: tuple[int, int]):
    structure, block_size = config.sparsity_structure, tuple(config.block_size)
    grid = M.grid_shape(shape, structure, block_size)
    if packed.numel() != M.packed_size(grid):
        raise UsageError(f"lisa_mask of {module!r} holds {packed.numel()} bytes; a {structure} mask of a {shape} "
                         f"weight needs {M.packed_size(grid)}: the mask and the config disagree.")
    return M.expand_grid(M.unpack_mask(packed, grid), structure, block_size)


def low_rank_factors(delta: torch.Tensor, rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` with ``scaling · B A`` the best rank-``rank`` approximation of ``delta`` (``(out, in)``).

    ``√σ`` goes to each side, so neither factor dwarfs the other. A rank above ``min(out, in)`` pads with zeros, so
    every module of the export has the same ``r``.
    """
    u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
    k = min(rank, s.numel())
    root = (s[:k] / scaling).sqrt()
    b = torch.zeros(delta.shape[0], rank, dtype=torch.float64)
    a = torch.zeros(rank, delta.shape[1], dtype=torch.float64)
    b[:, :k] = u[:, :k] * root
    a[:k] = root[:, None] * vh[:k]
    return b, a


def relative_error(delta: torch.Tensor, approximation: torch.Tensor) -> float:
    """``‖delta − approximation‖_F / ‖delta‖_F`` in float64; 0 for a zero ``delta`` reproduced exactly."""
    delta, approximation = delta.double(), approximation.double()
    norm = float(torch.linalg.matrix_norm(delta))
    diff = float(torch.linalg.matrix_norm(delta - approximation))
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def _resolve(pattern: dict, key: str, default):
    from peft.utils.other import get_pattern_key

    return pattern.get(get_pattern_key(pattern.keys(), key), default)


def convert_lisa_to_lora(adapter_config: dict, state_dict: dict, rank: Optional[int] = None):
    """Convert a LISA adapter (its ``adapter_config.json`` dict and state dict) into a PEFT LoRA adapter.

    Args:
        adapter_config: the LISA adapter's config.
        state_dict: its weights, as ``adapter_model.safetensors`` holds them.
        rank: ``k`` of the sparse modules' truncated SVD; default the adapter's ``r``. Dense modules keep theirs.

    Returns:
        ``(peft.LoraConfig, LoRA state dict, [ModuleExport, ...])``.

    Raises:
        UsageError: layer interpolation, another PEFT type, weights that disagree with the config, or a bad rank.
    """
    from peft import LoraConfig

    config = _lisa_config(adapter_config)
    modules, others = _group_weights(state_dict, config)
    if not modules:
        raise UsageError("the adapter holds no lisa_A/lisa_B weights; nothing to export.")
    rank = config.r if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UsageError(f"rank={rank!r} is invalid; allowed: a positive integer (the LoRA rank of sparse modules).")
    sparse = {name for name in modules if config.resolve(name)["sparsity"] > 0}
    exact = not sparse
    lora_r, lora_alpha = (config.r, config.lisa_alpha) if exact else (rank, config.lisa_alpha)

    tensors, reports, rank_pattern, alpha_pattern = {}, [], {}, {}
    for name in sorted(modules):
        parts, params = modules[name], config.resolve(name)
        a, b = parts["A"], parts["B"]
        if a.shape[0] != params["r"] or b.shape[1] != params["r"]:
            raise UsageError(f"module {name!r}: the config gives r={params['r']} but the weights have rank "
                             f"{a.shape[0]}; the adapter's config and weights disagree.")
        key = f"{PREFIX}{name}"
        if name not in sparse:
            if "mask" in parts:
                raise UsageError(f"module {name!r} is dense by the config (sparsity 0) but has a lisa_mask.")
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a.clone(), b.clone()
            reports.append(ModuleExport(name, "copied", params["r"], 0.0, 0.0))
            if not exact and (params["r"], params["lisa_alpha"]) != (lora_r, lora_alpha):
                rank_pattern[name], alpha_pattern[name] = params["r"], params["lisa_alpha"]
            continue
        if "mask" not in parts:
            raise UsageError(f"module {name!r} is sparse by the config (sparsity {params['sparsity']:g}) but the "
                             "weights hold no lisa_mask: the adapter would not reproduce its training.")
        shape = (b.shape[0], a.shape[1])
        scaling = params["lisa_alpha"] / params["r"]
        mask = _mask(config, name, params["sparsity"], parts["mask"], shape)
        delta = scaling * (b.double() @ a.double()) * mask
        lora_scaling = lora_alpha / lora_r
        new_b, new_a = (t.to(a.dtype) for t in low_rank_factors(delta, lora_r, lora_scaling))
        error = relative_error(delta, lora_scaling * (new_b.double() @ new_a.double()))
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = new_a.contiguous(), new_b.contiguous()
        reports.append(ModuleExport(name, "svd", lora_r, params["sparsity"], error))
    tensors.update({k: v.clone() for k, v in others.items()})

    target_modules = config.target_modules
    if target_modules is None:  # LISA's per-architecture default differs from LoRA's: name the modules adapted
        target_modules = sorted({name.rsplit(".", 1)[-1] for name in modules})
    elif isinstance(target_modules, (set, frozenset)):
        target_modules = sorted(target_modules)
    lora_config = LoraConfig(
        r=lora_r, lora_alpha=lora_alpha, lora_dropout=config.lisa_dropout, target_modules=target_modules,
        exclude_modules=sorted(config.exclude_modules) if isinstance(config.exclude_modules, (set, frozenset))
        else config.exclude_modules,
        layers_to_transform=config.layers_to_transform, layers_pattern=config.layers_pattern,
        modules_to_save=config.modules_to_save, fan_in_fan_out=config.fan_in_fan_out, bias="none",
        rank_pattern=dict(config.rank_pattern) if exact else rank_pattern,
        alpha_pattern=dict(config.alpha_pattern) if exact else alpha_pattern,
        base_model_name_or_path=_hub_base(config.base_model_name_or_path), revision=config.revision,
        task_type=config.task_type, inference_mode=True,
    )
    _check_scalings(lora_config, modules, tensors, config, sparse)
    return lora_config, tensors, reports


def _hub_base(name: Optional[str]) -> Optional[str]:
    """The Hub id of the embedded demo model for its local cache folder (what a server elsewhere can load)."""
    from ..models import DEFAULT_MODEL_ID, is_default_model

    return DEFAULT_MODEL_ID if is_default_model(name) else name


def _check_scalings(lora_config, modules: dict, tensors: dict, config: LisaConfig, sparse: set) -> None:
    """Every module's rank and alpha as PEFT will resolve them from the LoRA config must be the intended ones."""
    for name in modules:
        r = _resolve(lora_config.rank_pattern, name, lora_config.r)
        alpha = _resolve(lora_config.alpha_pattern, name, lora_config.lora_alpha)
        params = config.resolve(name)
        intended = (lora_config.r, lora_config.lora_alpha) if name in sparse else (params["r"], params["lisa_alpha"])
        if (r, alpha) != intended or tensors[f"{PREFIX}{name}.lora_A.weight"].shape[0] != r:
            raise RuntimeError(f"LoRA export of module {name!r}: the config resolves to r={r}, alpha={alpha}, "
                               f"expected r={intended[0]}, alpha={intended[1]}. Please report this.")


# ----------------------------------------------------------------------------------------------------------------------
# The export: convert, check, write whole
# ----------------------------------------------------------------------------------------------------------------------
def _logit_check(adapter_dir: str, lora_dir: str, base_model: Optional[str]) -> tuple[float, str]:
    """Load the base once; the LISA adapter's logits, then (LISA unloaded) the LoRA adapter's, on the same inputs."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from ..hub.load import from_pretrained
    from ..tuner.layer import LisaLayer

    lisa = from_pretrained(adapter_dir, base_model=base_model, torch_dtype=torch.float32).eval()
    base_name = base_model or lisa.peft_config[lisa.active_adapter].base_model_name_or_path
    tokenizer = load_tokenizer(adapter_dir, base_name)
    input_ids, attention_mask = check_inputs(tokenizer, getattr(lisa.config, "vocab_size", 128))
    expected = logits(lisa, input_ids, attention_mask)
    lisa_modules = {n for n, m in lisa.base_model.model.named_modules() if isinstance(m, LisaLayer)}
    lora = PeftModel.from_pretrained(lisa.unload(), lora_dir).eval()
    lora_modules = {n for n, m in lora.base_model.model.named_modules() if isinstance(m, LoraLayer)}
    if lora_modules != lisa_modules:
        only_lora, only_lisa = sorted(lora_modules - lisa_modules)[:3], sorted(lisa_modules - lora_modules)[:3]
        raise RuntimeError(f"the LoRA config targets other modules than the LISA adapter: only LoRA {only_lora}, only "
                           f"LISA {only_lisa}.")
    diff = max_logit_difference(expected, logits(lora, input_ids, attention_mask), attention_mask)
    what = "held-out demo prompts" if tokenizer is not None else "seeded random token ids"
    return diff, f"{input_ids.shape[0]} {what}, {int(attention_mask.sum())} tokens"


def export_lora(
    adapter_dir: str,
    out_dir: str,
    *,
    rank: Optional[int] = None,
    max_error: Optional[float] = None,
    accept_error: bool = False,
    check_logits: bool = True,
    base_model: Optional[str] = None,
    overwrite: bool = False,
) -> LoraExportReport:
    """Write the LISA adapter in ``adapter_dir`` as a PEFT LoRA adapter in ``out_dir``.

    Plain PEFT then loads it without hf-lisa: ``PeftModel.from_pretrained(base, out_dir)``; so do vLLM and TGI,
    which serve PEFT LoRA adapters. ``out_dir`` also gets the tokenizer files of ``adapter_dir`` and
    ``lisa_export.json`` (this report). A base recorded as the embedded demo model's local folder is written as its
    Hub id, which a server elsewhere can load.

    Args:
        adapter_dir: a saved LISA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).
        out_dir: the new LoRA adapter folder; written whole or not at all.
        rank: LoRA rank of the sparse modules' SVD (default: the adapter's ``r``); dense modules are copied.
        max_error: the largest relative Frobenius error a module may have (default ``DEFAULT_MAX_ERROR``, 0.05);
            above it the export is refused and nothing is written. A dense (ρ = 0) export is exact (error 0).
        accept_error: export whatever the error (it is still reported).
        check_logits: load the base model and compare the LISA and LoRA adapters' logits (the report's
            ``max_logit_diff``); an exact export that does not reproduce them within 1e-5 is an error.
        base_model: load this base for the check instead of the adapter config's ``base_model_name_or_path``.
        overwrite: replace a non-empty ``out_dir`` once the new export is complete, when it holds only what an
            export wrote (its ``.hf-lisa-export.json`` lists); anything else is named and refused.

    Raises:
        UsageError: layer interpolation (with the reason), a non-LISA adapter, a bad path or option.
        RunError: the truncated SVD loses more than ``max_error`` (the message names the error, the threshold, and
            the two ways out: a higher ``--rank`` or ``--accept_error``).
    """
    if max_error is not None and not (isinstance(max_error, (int, float)) and max_error >= 0):
        raise UsageError(f"max_error={max_error!r} is invalid; allowed: a number >= 0 (relative Frobenius error).")
    threshold = DEFAULT_MAX_ERROR if max_error is None else max_error
    check_output_path(out_dir, sources_of(adapter_dir, base_model), overwrite, "OUT_DIR")
    skipped = source_links(adapter_dir)  # refuses weights behind a link out of the folder; names the others
    adapter_config, state_dict = read_adapter(adapter_dir)
    lora_config, tensors, modules = convert_lisa_to_lora(adapter_config, state_dict, rank)
    report = LoraExportReport(out_dir=None, exact=all(m.method == "copied" for m in modules), rank=lora_config.r,
                              modules=modules, skipped_links=skipped)
    if not accept_error and report.max_relative_error > threshold:
        worst = sorted(modules, key=lambda m: -m.relative_error)[:3]
        source = "--max_error" if max_error is not None else f"the default --max_error {DEFAULT_MAX_ERROR:g}"
        raise RunError(
            f"export lora refused: the rank-{report.rank} LoRA loses too much of the sparse adapter. Max relative "
            f"Frobenius error {report.max_relative_error:.4g} exceeds max_error={threshold:g} ({source}); worst: "
            + ", ".join(f"{m.module} {m.relative_error:.4g}" for m in worst)
            + ". Nothing was written. Raise --rank (rank=; the error falls to 0 at the modules' full rank) or accept "
            "the error with --accept_error (accept_error=True) or a higher --max_error."
        )
    from safetensors.torch import save_file

    from ..hub.staging import TOKENIZER_FILES, copy_inside

    with staged_directory(out_dir, "hf-lisa export lora", overwrite) as staging:
        lora_config.save_pretrained(staging)
        save_file(tensors, os.path.join(staging, "adapter_model.safetensors"), metadata={"format": "pt"})
        for name in sorted(TOKENIZER_FILES):
            copy_inside(adapter_dir, name, staging)  # never through a link out of the adapter folder
        if check_logits:
            report.max_logit_diff, report.logit_inputs = _logit_check(adapter_dir, staging, base_model)
            if report.exact and report.max_logit_diff > EXACT_LOGIT_TOLERANCE:
                raise RuntimeError(f"the exact LoRA export changes the logits by {report.max_logit_diff:.3g} "
                                   f"(> {EXACT_LOGIT_TOLERANCE:g}); nothing was written. Please report this.")
        report.out_dir = os.path.abspath(out_dir)
        write_json(os.path.join(staging, REPORT_NAME), report.to_dict())
    return report
