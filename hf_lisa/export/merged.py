"""Export merged weights: the base model with ``ΔW = s · M ⊙ (B A)`` folded in, as a plain transformers folder.

The merge is the one ``hf-lisa push --mode merged`` uploads (:mod:`hf_lisa.hub.staging`, from disk, through the
tuner's ``merge_and_unload(safe_merge=True)``, which refuses layer interpolation), written to a folder instead of a
Hub repo, then checked: the merged model's logits against the unmerged adapter's. As for the push, nothing is read
through a symbolic link that leads out of the source folder: such a link is named in the report and not copied.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from .common import (
    check_inputs,
    check_output_path,
    load_tokenizer,
    logits,
    max_logit_difference,
    sources_of,
    staged_directory,
)

#: merged logits must match the unmerged adapter's this closely (float32 rounding of W + ΔW; measured ~1e-6)
MERGED_LOGIT_TOLERANCE = 1e-3


@dataclass
class MergedExportReport:
    """What :func:`export_merged` wrote and how close it is to the unmerged source."""

    out_dir: str
    source_kind: str  # "adapter" (merged here) or "full" (already full weights, re-saved as safetensors)
    files: list[str]
    max_logit_diff: Optional[float] = None
    logit_inputs: Optional[str] = None
    skipped_links: list[str] = field(default_factory=list)  # "name -> target": links out of the source, not copied

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        what = "adapter merged into its base" if self.source_kind == "adapter" else "full weights re-saved"
        lines = [f"merged export ({what}): {self.out_dir} ({', '.join(self.files)})"]
        if self.max_logit_diff is not None:
            lines.append(f"max |logit difference| source vs merged: {self.max_logit_diff:.3g} ({self.logit_inputs})")
        lines += [f"skipped link (leads out of the source folder): {link}" for link in self.skipped_links]
        return "\n".join(lines)


def _parity(source: str, merged_dir: str, base_model: Optional[str]) -> tuple[float, str]:
    import torch
    from peft import PeftModel

    from ..hub.load import from_pretrained

    original = from_pretrained(source, base_model=base_model, torch_dtype=torch.float32).eval()
    tokenizer = load_tokenizer(source, merged_dir)
    input_ids, attention_mask = check_inputs(tokenizer, getattr(original.config, "vocab_size", 128))
    expected = logits(original, input_ids, attention_mask)
    del original
    merged = from_pretrained(merged_dir, torch_dtype=torch.float32).eval()
    if isinstance(merged, PeftModel):
        raise RuntimeError(f"the merged export {merged_dir!r} loads as an adapter; the merge did not happen.")
    diff = max_logit_difference(expected, logits(merged, input_ids, attention_mask), attention_mask)
    what = "held-out demo prompts" if tokenizer is not None else "seeded random token ids"
    return diff, f"{input_ids.shape[0]} {what}, {int(attention_mask.sum())} tokens"


def export_merged(
    source: str,
    out_dir: str,
    *,
    base_model: Optional[str] = None,
    max_shard_size: str = "5GB",
    check_logits: bool = True,
    overwrite: bool = False,
) -> MergedExportReport:
    """Write ``source`` (an ``hf-lisa train`` output or adapter folder) as merged safetensors weights in ``out_dir``.

    Args:
        source: an adapter folder (merged into its base) or a full-weights folder (re-saved as safetensors).
        out_dir: the new model folder (``config.json``, ``model*.safetensors``, tokenizer, loss plot); written whole
            or not at all.
        base_model: Hub id of the base when the adapter config records a local path that no longer exists (as for
            ``hf-lisa push``).
        max_shard_size: largest safetensors shard.
        check_logits: compare the merged model's logits with the unmerged source's (``max_logit_diff``); a
            difference above 1e-3 is an error.
        overwrite: replace a non-empty ``out_dir`` once the new export is complete, when it holds only what an
            export wrote (its ``.hf-lisa-export.json`` lists); anything else is named and refused.

    Raises:
        ValueError: layer interpolation (no merge can express it), or a source that is neither kind.
        UsageError: a weight or config file of ``source`` is a symbolic link out of it (other such links are named
            in the report's ``skipped_links`` and not copied).
    """
    from ..hub.staging import stage_directory, summary_of_dir

    check_output_path(out_dir, sources_of(source, base_model), overwrite, "OUT_DIR")
    if not os.path.isdir(source):
        raise FileNotFoundError(f"source {source!r} is not a directory (an hf-lisa train output or adapter folder).")
    with staged_directory(out_dir, "hf-lisa export merged", overwrite) as staging:
        staged = stage_directory(source, "merged", staging, None, max_shard_size, base_model,
                                  summary_of_dir(source))
        report = MergedExportReport(out_dir=os.path.abspath(out_dir),
                                    source_kind="adapter" if staged.adapter_config is not None else "full",
                                    files=sorted(os.listdir(staging)), skipped_links=staged.skipped_links)
        if check_logits:
            report.max_logit_diff, report.logit_inputs = _parity(source, staging, base_model)
            if report.max_logit_diff > MERGED_LOGIT_TOLERANCE:
                raise RuntimeError(f"the merged weights change the logits by {report.max_logit_diff:.3g} "
                                   f"(> {MERGED_LOGIT_TOLERANCE:g}); nothing was written.")
    return report
