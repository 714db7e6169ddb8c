"""Benchmark presets and the methods `compare.py` runs.

A preset fixes everything that must be equal across methods (model, data, seed, batch, steps, evaluation) plus the
few per-family knobs (learning rate, LISA's γ and K). Command-line options override any field.

* ``cpu-small``: the embedded SmolLM2-135M-Instruct in fp32 on the bundled arithmetic task, sized to finish all seven
  methods in about 20 minutes on 2 CPU cores. K is 5 instead of the paper's 20 so that eight active sets occur
  in 40 steps; the table says so.
* ``gpu``: the same model and task with bf16 autocast (fp32 master weights), a larger batch, 200 steps and the
  K = 20 (LMFlow's script default): meant for a one-shot run on a single GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked method: how it maps onto ``hf_lisa.train``'s ``LisaArguments``.

    Args:
        name: the name used by ``--methods`` and in the tables.
        train_method: ``LisaArguments.method`` (``lisa-naive`` trains as ``full`` plus the naive callback).
        family: ``"full-parameter"`` or ``"adapter"``; selects the learning rate.
        lisa_overrides: extra ``LisaArguments`` fields (besides γ, K, r and alpha, which come from the preset).
        model_overrides: arguments of ``hf_lisa.models.quantization_config``, e.g. ``{"load_in_4bit": True}`` for a
            quantized base.
        training_overrides: ``TrainingArguments`` fields that differ from the preset's, e.g. ``{"optim": ...}``.
        naive: add ``benchmarks.naive_lisa.NaiveLisaCallback`` (requires_grad toggling only).
        peer: ``"badam"`` or ``"galore"``: another package's method, run in a plain ``transformers.Trainer`` as its
            docs say (``benchmarks/peers.py``); the model is loaded as for ``full``.
        description: one line for the table.
    """

    name: str
    train_method: str
    family: str
    lisa_overrides: dict = field(default_factory=dict)
    model_overrides: dict = field(default_factory=dict)
    training_overrides: dict = field(default_factory=dict)
    naive: bool = False
    peer: str = ""
    description: str = ""


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("full", "full", "full-parameter", description="every parameter trains"),
        MethodSpec("lora", "lora", "adapter", description="PEFT LoRA on all linear layers"),
        MethodSpec("dora", "dora", "adapter", description="PEFT DoRA on all linear layers"),
        MethodSpec("lisa", "lisa", "full-parameter", description="hf-lisa full-parameter LISA, E+H+γL, state dropped"),
        MethodSpec(
            "lisa-naive", "full", "full-parameter", naive=True,
            description="LMFlow/axolotl callback: requires_grad toggling only, state kept",
        ),
        MethodSpec("lisa-adapter", "lisa-adapter", "adapter", description="LISA adapters (dense), γ blocks sampled"),
        MethodSpec(
            "lisa-adapter-4bit", "lisa-adapter", "adapter", model_overrides={"load_in_4bit": True},
            description="LISA adapters (dense), γ blocks sampled, on a 4-bit NF4 base (bitsandbytes, QLoRA-style)",
        ),
        MethodSpec(
            "lisa-adapter-8bit", "lisa-adapter", "adapter", model_overrides={"load_in_8bit": True},
            description="LISA adapters (dense), γ blocks sampled, on an 8-bit base (bitsandbytes LLM.int8())",
        ),
        MethodSpec(
            "lisa-adapter-sparse", "lisa-adapter", "adapter",
            lisa_overrides={"sparsity": 0.4, "sparsity_structure": "block", "block_size": "2x2"},
            description="LISA adapters, 40% 2x2 block sparsity",
        ),
        MethodSpec(
            "lisa-adapter-mixed", "lisa-adapter", "adapter",
            lisa_overrides={"sparsity": 0.4, "sparsity_structure": "block", "block_size": "2x2",
                            "sparsity_pattern": {"o_proj": 0.0, "gate_proj": 0.0, "up_proj": 0.0, "down_proj": 0.0},
                            "rank_pattern": {"o_proj": 8, "gate_proj": 8, "up_proj": 8, "down_proj": 8}},
            description="the design's mixed recipe: LISA adapters 40% 2x2-block sparse on q/k/v, dense rank 8 on "
            "o_proj and the FFN",
        ),
        MethodSpec(
            "lisa-adapter-interp", "lisa-adapter", "adapter", lisa_overrides={"layer_interpolation": True},
            description="LISA adapters (dense) + layer interpolation",
        ),
        MethodSpec(
            "lisa-fused", "lisa", "full-parameter", lisa_overrides={"optim_step_in_backward": True},
            training_overrides={"max_grad_norm": 0.0},
            description="lisa with AdamW stepped in the backward pass (--optim_step_in_backward; no clipping)",
        ),
        MethodSpec(
            "lisa-adamw8bit", "lisa", "full-parameter", training_overrides={"optim": "adamw_bnb_8bit"},
            description="lisa with bitsandbytes 8-bit AdamW (the Trainer keeps the tied E/H state at 32 bits)",
        ),
        MethodSpec(
            "lisa-adamw8bit-eh", "lisa", "full-parameter", training_overrides={"optim": "adamw_bnb_8bit"},
            lisa_overrides={"optim_8bit_embeddings": True},
            description="lisa with bitsandbytes 8-bit AdamW, the E/H state in 8 bits too (--optim_8bit_embeddings)",
        ),
        MethodSpec(
            "lisa-fused-8bit", "lisa", "full-parameter",
            lisa_overrides={"optim_step_in_backward": True, "optim_8bit_embeddings": True},
            training_overrides={"optim": "adamw_bnb_8bit", "max_grad_norm": 0.0},
            description="lisa-fused with 8-bit AdamW, E/H state included (--optim adamw_bnb_8bit "
            "--optim_8bit_embeddings --optim_step_in_backward; no clipping)",
        ),
        MethodSpec(
            "badam", "full", "full-parameter", peer="badam",
            description="BAdam (badam.BlockOptimizer over AdamW): one block at a time, E+H frozen, switched every "
            "K steps",
        ),
        MethodSpec(
            "galore", "full", "full-parameter", peer="galore",
            description="GaLore (galore-torch, optim=galore_adamw): attention/MLP gradients projected to rank r",
        ),
    )
}

#: what ``make bench`` runs, in the order of the tables; ratios are taken against ``lora`` and ``full``. The other
#: methods (``dora`` and the variants the studies add) run when ``--methods`` names them.
DEFAULT_METHODS: tuple[str, ...] = (
    "full", "lora", "lisa", "lisa-naive", "lisa-adapter", "lisa-adapter-sparse", "lisa-adapter-interp",
)

#: what ``make bench-peers`` runs: LISA beside its peers from other packages (BAdam, GaLore) and PEFT's LoRA and DoRA,
#: in one table with ratios against ``lora`` and ``full`` (issue 26)
PEER_COMPARISON: tuple[str, ...] = (
    "full", "lora", "dora", "lisa", "lisa-naive", "lisa-adapter", "badam", "galore",
)

#: names ``--methods`` accepts for a whole list
METHOD_SETS: dict[str, tuple[str, ...]] = {"default": DEFAULT_METHODS, "peers": PEER_COMPARISON}


@dataclass(frozen=True)
class Preset:
    """Settings shared by every method of one benchmark run.

    Args:
        model: model path or Hub id; ``None`` is the embedded SmolLM2-135M-Instruct.
        data: training file (any format ``hf_lisa.train`` accepts); ``None`` is the preset's ``task``.
        task: a task of ``benchmarks/tasks.py`` (``arithmetic``, ``instructions``, ``classification``) when ``data``
            is ``None``.
        steps: optimizer steps per method.
        batch_size: sequences per optimizer step (no gradient accumulation).
        seq_len: ``max_seq_length`` of tokenisation; batches are padded to their longest row, as in ``hf-lisa train``.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        dtype: dtype of the loaded weights (``"float32"`` or ``"bfloat16"``).
        bf16: bf16 autocast (mixed precision, fp32 master weights when ``dtype`` is float32).
        eval_every: evaluate the eval loss every this many steps (and at step 0 and at the end).
        eval_samples: validation rows in the fixed eval set.
        exact_match_samples: validation prompts scored by greedy generation at the end (bundled task only; 0 skips).
        timing_warmup_steps: first steps left out of the median step time.
        lr_full_parameter: learning rate of full, lisa, lisa-naive and the peers badam and galore.
        lr_adapter: learning rate of lora, dora and the lisa-adapter variants.
        lisa_activated_layers: γ.
        lisa_interval_steps: K (also BAdam's ``switch_block_every`` and GaLore's ``update_proj_gap``).
        lora_r: rank of LoRA, of the LISA adapters and of GaLore's projection.
        lora_alpha: scaling numerator (scale = alpha / r).
        importance_steps: calibration batches of the sparse adapter's importance-based first mask.
        seed: seed of everything (model wrapping, data order, LISA's sampler).
        methods: the methods run by default.
        cpu_allocator: ``hf-lisa train``'s ``--cpu_allocator`` for every method: ``"default"`` (glibc's own
            behaviour), ``"trim"`` (free heap pages returned where the peak forms) or ``"lean"`` (the mmap threshold
            fixed: freed tensors leave the heap; slower).
        chunked_loss: ``hf-lisa train``'s ``--chunked_loss`` for every method.
        lisa_extra: further ``LisaArguments`` fields as ``(name, value)`` pairs, applied to every method after its
            own overrides (one-lever-at-a-time variants of a method).
    """

    name: str
    model: Optional[str] = None
    data: Optional[str] = None
    task: str = "arithmetic"
    steps: int = 40
    batch_size: int = 4
    seq_len: int = 128
    device: str = "auto"
    dtype: str = "float32"
    bf16: bool = False
    eval_every: int = 10
    eval_samples: int = 32
    exact_match_samples: int = 32
    timing_warmup_steps: int = 3
    lr_full_parameter: float = 1e-4
    lr_adapter: float = 5e-4
    lisa_activated_layers: int = 2
    lisa_interval_steps: int = 20
    lora_r: int = 16
    lora_alpha: float = 32.0
    importance_steps: int = 8
    seed: int = 42
    methods: tuple[str, ...] = DEFAULT_METHODS
    cpu_allocator: str = "default"
    chunked_loss: bool = True
    lisa_extra: tuple[tuple[str, Any], ...] = ()

    def updated(self, **overrides: Any) -> "Preset":
        """A copy with the non-``None`` ``overrides`` applied; unknown names raise ``TypeError``."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"Unknown preset field(s) {unknown}; allowed: {sorted(known)}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


PRESETS: dict[str, Preset] = {
    # 2 CPU cores: ~85-token rows in batches of 4 take 2-3 s per step; K = 5 gives 8 active sets in 40 steps
    "cpu-small": Preset(
        name="cpu-small", steps=40, batch_size=4, seq_len=128, device="cpu", eval_every=10, eval_samples=32,
        exact_match_samples=32, timing_warmup_steps=3, lisa_interval_steps=5, importance_steps=4,
    ),
    # one GPU: LMFlow's K = 20 over 200 steps (10 switches), bf16 autocast
    "gpu": Preset(
        name="gpu", steps=200, batch_size=16, seq_len=256, device="cuda", bf16=True, eval_every=20, eval_samples=64,
        exact_match_samples=64, timing_warmup_steps=10, lisa_interval_steps=20, importance_steps=8,
    ),
}
