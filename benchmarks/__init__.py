"""Benchmarks of hf-lisa against LoRA, full fine-tuning and the naive LISA callback (see ``benchmarks/README.md``)."""
