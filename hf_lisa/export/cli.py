"""``hf-lisa export {lora,gguf,merged}``: the command-line front of :mod:`hf_lisa.export`.

Failures propagate to :func:`hf_lisa.cli.main`, which prints one message and exits 2 for a usage error (a path, a
value, an adapter that cannot be exported, with the reason) and 1 for a failure while running (e.g. a LoRA export
that would lose more than ``--max_error``). Nothing is left
half-written: every export is staged beside its target and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json

from .common import DEFAULT_CHECK_PROMPTS, DEFAULT_MAX_ERROR  # plain numbers: common imports no torch

EXPORT_DESCRIPTION = (
    "Export a LISA model for serving: a PEFT LoRA adapter (vLLM, TGI, plain PEFT), a GGUF file (llama.cpp, ollama) "
    "or merged transformers weights."
)
EXPORT_KINDS = ("lora", "gguf", "merged")
#: the choices of ``--type``: :data:`hf_lisa.export.gguf.GGUF_TYPES`, spelled out so that building the parser loads no
#: torch or numpy (tests/test_lazy_imports.py checks that the two agree)
GGUF_TYPE_CHOICES = ("f16", "q8_0")


def _common(parser: argparse.ArgumentParser, output: str) -> None:
    parser.add_argument("--base_model", "--base-model", dest="base_model", default=None,
                        help="the adapter's base model (Hub id or folder) instead of the one its config names")
    parser.add_argument("--overwrite", action="store_true",
                        help=f"replace an existing {output} once the new export is complete, when an earlier export "
                        "wrote it (anything else there is named and refused, never deleted)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def add_export_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``lora``, ``gguf`` and ``merged`` under ``parser`` (the ``export`` subcommand of ``hf-lisa``). Imports
    nothing heavy: the exports load torch when they run."""
    kinds = parser.add_subparsers(dest="export_kind", metavar="{" + ",".join(EXPORT_KINDS) + "}", required=True)
    lora = kinds.add_parser(
        "lora", help="a LISA adapter as a PEFT LoRA adapter (exact for sparsity 0, truncated SVD otherwise)",
        description="Write a LISA adapter as a PEFT LoRA adapter. Sparsity 0: an exact copy (renamed weights, same "
        "scaling). Sparse modules: a rank-k LoRA from the truncated SVD of s·M⊙(BA), the relative Frobenius error of "
        f"each reported; above --max_error (default {DEFAULT_MAX_ERROR:g}) the export is refused (exit 1, nothing "
        "written) unless --accept_error is given. Layer interpolation is refused: it scales the residual stream, which "
        "no LoRA can express.",
    )
    lora.add_argument("adapter_dir", help="a saved LISA adapter (adapter_config.json + adapter_model.safetensors)")
    lora.add_argument("out_dir", help="the LoRA adapter folder to write")
    lora.add_argument("--rank", type=int, default=None,
                      help="LoRA rank of the sparse modules' SVD (default: the adapter's r); dense modules are copied")
    lora.add_argument("--max_error", "--max-error", dest="max_error", type=float, default=None,
                      help="refuse (exit 1, write nothing) when a module's relative Frobenius error exceeds this "
                      f"(default {DEFAULT_MAX_ERROR:g}; a dense adapter is exact, error 0)")
    lora.add_argument("--accept_error", "--accept-error", dest="accept_error", action="store_true",
                      help="export a sparse adapter whatever its truncated SVD loses (the error is still reported)")
    lora.add_argument("--skip_logit_check", "--skip-logit-check", dest="skip_logit_check", action="store_true",
                      help="do not load the base model to compare the LISA and LoRA logits")
    _common(lora, "OUT_DIR")

    gguf = kinds.add_parser(
        "gguf", help="a model or adapter (merged first) as a GGUF file for llama.cpp / ollama",
        description="Merge an adapter if needed and write a GGUF file (llama, mistral, qwen2) with tokenizer "
        "metadata, then reload it with transformers' GGUF loader and print how many greedy generations on "
        f"--verify_prompts N (default {DEFAULT_CHECK_PROMPTS}) held-out prompts equal the source model's.",
    )
    gguf.add_argument("source", help="an adapter folder, a full model folder (e.g. `hf-lisa demo` output) or a Hub id")
    gguf.add_argument("out_file", help="the .gguf file to write")
    gguf.add_argument("--type", dest="gguf_type", choices=GGUF_TYPE_CHOICES, default="f16",
                      help="tensor type (default f16)")
    gguf.add_argument("--tokenizer_from", "--tokenizer-from", dest="tokenizer_from", default=None,
                      help="copy the tokenizer metadata from this GGUF file (same tokenizer); default: the demo "
                      "model's file for its tokenizer, else written from tokenizer.json")
    gguf.add_argument("--tokenizer_pre", "--tokenizer-pre", dest="tokenizer_pre", default=None,
                      help="llama.cpp's pre-tokenizer name (tokenizer.ggml.pre), e.g. llama-bpe, qwen2")
    gguf.add_argument("--name", default=None, help="general.name in the file (default: the source folder's name)")
    gguf.add_argument("--verify_prompts", "--verify-prompts", dest="verify_prompts", type=int,
                      default=DEFAULT_CHECK_PROMPTS,
                      help="reload the file with transformers and compare greedy generations with the source model on "
                      f"this many held-out demo prompts, and print the figures (default {DEFAULT_CHECK_PROMPTS}; 0: "
                      "no check)")
    gguf.add_argument("--min_agreement", "--min-agreement", dest="min_agreement", type=float, default=None,
                      help="refuse the file (nothing written) when fewer than this share of the check's greedy tokens "
                      "equal the source model's (default: warn below 0.8)")
    _common(gguf, "OUT_FILE")

    merged = kinds.add_parser(
        "merged", help="an adapter merged into its base, as transformers safetensors",
        description="Write merged weights (the merge of `hf-lisa push --mode merged`) to a folder, and check its "
        "logits against the unmerged adapter's.",
    )
    merged.add_argument("source", help="an hf-lisa train output or adapter folder")
    merged.add_argument("out_dir", help="the model folder to write")
    merged.add_argument("--max_shard_size", "--max-shard-size", dest="max_shard_size", default="5GB",
                        help="largest safetensors shard (default 5GB)")
    merged.add_argument("--skip_logit_check", "--skip-logit-check", dest="skip_logit_check", action="store_true",
                        help="do not compare the merged model's logits with the adapter's")
    _common(merged, "OUT_DIR")
    return parser


def export_command(args: argparse.Namespace) -> int:
    """Run ``hf-lisa export <kind>`` with parsed arguments; prints the report and returns 0. Errors propagate."""
    if args.export_kind == "lora":
        from .lora import export_lora

        report = export_lora(args.adapter_dir, args.out_dir, rank=args.rank, max_error=args.max_error,
                             accept_error=args.accept_error, check_logits=not args.skip_logit_check,
                             base_model=args.base_model, overwrite=args.overwrite)
    elif args.export_kind == "gguf":
        from .gguf import export_gguf

        report = export_gguf(args.source, args.out_file, gguf_type=args.gguf_type, base_model=args.base_model,
                             tokenizer_from=args.tokenizer_from, tokenizer_pre=args.tokenizer_pre, name=args.name,
                             verify_prompts=args.verify_prompts, overwrite=args.overwrite,
                             min_agreement=args.min_agreement)
    else:
        from .merged import export_merged

        report = export_merged(args.source, args.out_dir, base_model=args.base_model,
                               max_shard_size=args.max_shard_size, check_logits=not args.skip_logit_check,
                               overwrite=args.overwrite)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format(), flush=True)
    return 0
