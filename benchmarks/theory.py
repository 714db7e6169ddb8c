"""Theoretical floors from parameter shapes: what each method has to hold, before any implementation overhead.

Everything here is computed from the model's parameters and config, never from a measurement, so that a benchmark
can put a measured number beside the number physics asks for:

* **optimizer state** of ``torch.optim.AdamW``: two moments in the parameter's dtype plus a 4-byte ``step`` tensor
  per parameter tensor, for the parameters that hold state. For LISA that is E+H (plus the final norm) and γ blocks;
  for the naive callback it is E+H plus every block ever activated; for full fine-tuning every parameter;
* **memory floor** = weights + gradients of the trainable set + optimizer state + an activation estimate
  (:func:`activation_bytes`, formula stated in its docstring);
* the same floor from a llama-style **config alone** (:func:`config_floor`, :func:`config_shapes`), for models too
  big to build just to learn that they do not fit (``benchmarks/scaling.py`` checks each cell with it first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Optional, Sequence

import torch
from torch import nn

ADAPTER_MARKERS = ("lora_", "lisa_", "modules_to_save")  # the last: PEFT's trainable copy of a classification head
#: AdamW's per-tensor ``step`` counter: a float32 scalar tensor (fused or not)
ADAMW_STEP_BYTES = 4


def adamw_state_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of ``torch.optim.AdamW`` state for ``params``: ``Σ 2 · numel · element_size + 4``.

    Example:
        >>> import torch
        >>> adamw_state_bytes([torch.zeros(10), torch.zeros(2, 3)])
        136
    """
    return sum(2 * p.numel() * p.element_size() + ADAMW_STEP_BYTES for p in params)


#: bitsandbytes' 8-bit optimizers: blockwise quantisation in blocks of 256 values, one float32 absmax per block and
#: moment; tensors under 4096 elements (``min_8bit_size``) keep 32-bit state; 256-entry float32 code books per moment
BNB_BLOCK_SIZE, BNB_MIN_8BIT_SIZE, BNB_QMAP_BYTES = 256, 4096, 256 * 4


def adamw8bit_state_bytes(params: Iterable[torch.Tensor], fp32: Collection[int] = ()) -> int:
    """Bytes of bitsandbytes' 8-bit AdamW state (``optim_bits=8``) for ``params``, as
    :func:`hf_lisa.scheduler.optimizer_state_bytes` counts them.

    Per tensor: two uint8 moments, two float32 absmax per 256-value block and the two shared 256-entry float32 code
    books (counted per tensor, as the state dict references them); tensors under 4096 elements, and those whose
    ``id`` is in ``fp32`` (transformers keeps ``nn.Embedding`` weights at 32 bits), hold two float32 moments. The
    step counter is a Python int (no tensor).

    Example:
        >>> import torch
        >>> adamw8bit_state_bytes([torch.zeros(5000, 64), torch.zeros(100)])
        652848
    """
    total = 0
    for p in params:
        n = p.numel()
        if n < BNB_MIN_8BIT_SIZE or id(p) in fp32:
            total += 2 * 4 * n
        else:
            total += 2 * n + 2 * 4 * -(-n // BNB_BLOCK_SIZE) + 2 * BNB_QMAP_BYTES
    return total


def _bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _numel(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def is_adapter_parameter(name: str) -> bool:
    """Adapter parameters are named ``lora_*`` (PEFT LoRA) or ``lisa_*`` (hf-lisa) somewhere in their path, or are
    PEFT's trainable ``modules_to_save`` copy of a module (a ``SEQ_CLS`` model's ``score`` head)."""
    return any(marker in part for part in name.split(".") for marker in ADAPTER_MARKERS)


@dataclass
class ParameterInventory:
    """The model's unique parameters (tied weights once), split by where they live.

    Attributes:
        all_params: every unique parameter.
        block_names: qualified names of the transformer blocks, in order (``hf_lisa.find_blocks``).
        block_base: per block, its base-model parameters.
        block_adapter: per block, its adapter parameters (``lora_*`` / ``lisa_*``).
        outside_base: base parameters outside every block: E + H + final norm for a decoder LM (tied E/H once).
        outside_adapter: adapter parameters outside the blocks (layer-interpolation scalars, ``modules_to_save``).
    """

    all_params: list[nn.Parameter]
    block_names: list[str]
    block_base: list[list[nn.Parameter]]
    block_adapter: list[list[nn.Parameter]]
    outside_base: list[nn.Parameter]
    outside_adapter: list[nn.Parameter] = field(default_factory=list)

    @property
    def total_params(self) -> int:
        return _numel(self.all_params)

    @property
    def weight_bytes(self) -> int:
        return _bytes(self.all_params)

    def block_index(self, name: str) -> int:
        return self.block_names.index(name)

    def summary(self) -> dict:
        """Parameter counts and AdamW state bytes of each part, for the results JSON."""
        first_base = self.block_base[0] if self.block_base else []
        first_adapter = self.block_adapter[0] if self.block_adapter else []
        return {
            "total_params": self.total_params,
            "weight_bytes": self.weight_bytes,
            "num_blocks": len(self.block_names),
            "outside_base_params": _numel(self.outside_base),
            "outside_base_state_bytes": adamw_state_bytes(self.outside_base),
            "block_params": _numel(first_base),
            "block_state_bytes": adamw_state_bytes(first_base),
            "blocks_uniform": len({adamw_state_bytes(b) for b in self.block_base}) <= 1,
            "block_adapter_params": _numel(first_adapter),
            "block_adapter_state_bytes": adamw_state_bytes(first_adapter),
            "outside_adapter_params": _numel(self.outside_adapter),
            "outside_adapter_state_bytes": adamw_state_bytes(self.outside_adapter),
            "adapter_params": _numel(self.outside_adapter) + sum(_numel(b) for b in self.block_adapter),
        }


def parameter_inventory(model: nn.Module, layers_attribute: Optional[str] = None) -> ParameterInventory:
    """Split the unique parameters of ``model`` (plain, PEFT-wrapped or DDP-wrapped) by block and by kind."""
    from hf_lisa import find_blocks

    blocks = find_blocks(model, layers_attribute)
    owner: dict[int, int] = {}
    for index, (_, block) in enumerate(blocks):
        for p in block.parameters():
            owner.setdefault(id(p), index)
    seen: set[int] = set()
    all_params: list[nn.Parameter] = []
    block_base: list[list[nn.Parameter]] = [[] for _ in blocks]
    block_adapter: list[list[nn.Parameter]] = [[] for _ in blocks]
    outside_base: list[nn.Parameter] = []
    outside_adapter: list[nn.Parameter] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        all_params.append(p)
        adapter = is_adapter_parameter(name)
        if id(p) in owner:
            (block_adapter if adapter else block_base)[owner[id(p)]].append(p)
        else:
            (outside_adapter if adapter else outside_base).append(p)
    return ParameterInventory(all_params, [n for n, _ in blocks], block_base, block_adapter, outside_base,
                              outside_adapter)


def expected_state_bytes(
    inventory: ParameterInventory, kind: str, active: Sequence[int] = (), seen: Sequence[int] = (),
    state_bytes: Callable[[Iterable[torch.Tensor]], int] = adamw_state_bytes,
) -> int:
    """Optimizer state bytes (AdamW's unless ``state_bytes`` says otherwise) each method must hold after an optimizer
    step, from shapes alone.

    Args:
        inventory: the model's :class:`ParameterInventory`.
        kind: ``"full"`` (every parameter), ``"lisa"`` (E+H+norm + the ``active`` blocks: E+H+γL), ``"lisa-blocks"``
            (the ``active`` blocks only: E+H frozen),
            ``"lisa-naive"`` (E+H+norm + every block in ``seen``: nothing is ever dropped), ``"lora"`` (every
            adapter parameter) or ``"lisa-adapter"`` (adapter parameters outside the blocks + the ``active`` blocks'
            adapters).
        active: indices of the blocks active in this step.
        seen: indices of every block active so far (``"lisa-naive"``).
        state_bytes: the optimizer's state bytes for a list of parameters: :func:`adamw_state_bytes` (torch AdamW),
            or e.g. :func:`adamw8bit_state_bytes` (bitsandbytes' 8-bit AdamW).
    """
    if kind == "full":
        return state_bytes(inventory.all_params)
    if kind == "lisa":
        return state_bytes(inventory.outside_base) + sum(
            state_bytes(inventory.block_base[b]) for b in set(active)
        )
    if kind == "lisa-blocks":  # E+H frozen (always_trainable=()): the active blocks only
        return sum(state_bytes(inventory.block_base[b]) for b in set(active))
    if kind == "lisa-naive":
        return state_bytes(inventory.outside_base) + sum(
            state_bytes(inventory.block_base[b]) for b in set(seen)
        )
    if kind == "lora":
        return state_bytes(inventory.outside_adapter) + sum(
            state_bytes(b) for b in inventory.block_adapter
        )
    if kind == "lisa-adapter":
        return state_bytes(inventory.outside_adapter) + sum(
            state_bytes(inventory.block_adapter[b]) for b in set(active)
        )
    raise ValueError(f"kind={kind!r} is invalid; allowed: full, lisa, lisa-naive, lisa-blocks, lora, lisa-adapter.")


# ----------------------------------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------------------------------
ACTIVATION_FORMULA = (
    "values saved for the backward pass, per token: a block whose weights train saves 6h + 2q + 2kv + a + 4i (each "
    "RMSNorm its input, normalised input and output; rotated q and k, v, the attention output and its log-sum-exp; "
    "gate, up, silu(gate), gate*up); a block whose weights are frozen saves 2h + 2q + 2kv + a + 3i (no normalised "
    "inputs, no linear inputs: "
    "those only serve weight gradients); a block whose adapters train saves the frozen set plus the adapted linears' "
    "inputs, 2h + i, and r values per adapted linear; layer interpolation adds h per block. Blocks the backward pass "
    "never enters (below every trainable parameter) save nothing. A sparse LISA adapter saves no M*(BA): it is recomputed in the "
    "backward pass from the packed mask. The head: 3h if it trains, else h, plus V 4-byte values (the fp32 log-softmax of transformers' loss, or the fp32 logits that --chunked_loss keeps "
    "instead; under bf16 autocast those logits take 2 bytes, so the estimate is then high by 2V). "
    "h, a = heads, q = heads*head_dim, kv = kv_heads*head_dim, i, V from the model config; kv becomes q in steps whose "
    "batch is padded (transformers repeats k and v for SDPA when there is a mask); flash attention assumed (CPU and "
    "CUDA SDPA save no T x T matrix)."
)


def _config_dims(config) -> dict[str, int]:
    h = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or getattr(config, "d_model")
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 1
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    i = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    return {"h": h, "a": heads, "q": heads * head_dim, "kv": kv_heads * head_dim, "i": i, "V": config.vocab_size}


def activation_bytes(
    config,
    tokens: int,
    block_kinds: Sequence[str],
    act_bytes: int = 4,
    adapter_rank: int = 0,
    adapted_linears: int = 7,
    sparse_delta_elements: int = 0,
    interpolation: bool = False,
    head_trains: bool = True,
    padded: bool = False,
) -> int:
    """Estimate the bytes autograd saves for the backward pass of one batch of ``tokens`` tokens
    (:data:`ACTIVATION_FORMULA`).

    Args:
        config: the model config (hidden_size, intermediate_size, heads, kv heads, vocab size).
        tokens: tokens in the batch, padding included.
        block_kinds: per block, ``"train"`` (weights train), ``"frozen"``, ``"adapter"`` (adapters train),
            ``"adapter-sparse"`` (a sparse adapter trains), ``"frozen-sparse"`` (a frozen sparse adapter the backward
            pass crosses) or ``"none"`` (no backward reaches it).
        act_bytes: bytes per activation value (4 in fp32, 2 under bf16 autocast).
        adapter_rank: r of the adapters.
        adapted_linears: adapted linear layers per block (7 for a llama block with all-linear targets).
        sparse_delta_elements: weight elements of one block's adapted linears (the materialised ``M ⊙ (B A)``).
        interpolation: layer interpolation on (h more per block).
        head_trains: the LM head is trainable (its input, the final norm's normalised input and output are saved).
        padded: the batch has padding, so there is an attention mask and transformers' SDPA path repeats k and v to
            the query heads (grouped-query attention then saves them at q's size).

    Example:
        >>> from transformers import LlamaConfig
        >>> config = LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
        ...                      vocab_size=32)
        >>> # block: 6*8 + 2*8 + 2*4 + 2 + 4*16 values; head: 3*8 (1 byte each); 32 fp32 log-probabilities
        >>> activation_bytes(config, tokens=1, block_kinds=["train"], act_bytes=1)
        290
    """
    d = _config_dims(config)
    h, a, q, i, vocab = d["h"], d["a"], d["q"], d["i"], d["V"]
    kv = q if padded else d["kv"]
    frozen = 2 * h + 2 * q + 2 * kv + a + 3 * i
    adapter_inputs = 2 * h + i
    per_token = {
        "train": 6 * h + 2 * q + 2 * kv + a + 4 * i,
        "frozen": frozen,
        "adapter": frozen + adapter_inputs + adapter_rank * adapted_linears,
        "adapter-sparse": frozen + adapter_inputs,
        "frozen-sparse": frozen,
        "none": 0,
    }
    # a sparse adapter's M ⊙ (B A) is recomputed in the backward pass (hf_lisa.tuner.sparse_delta), not saved
    per_block: dict[str, int] = {}
    values = 3 * h if head_trains else h
    fixed = 0
    for kind in block_kinds:
        if kind not in per_token:
            raise ValueError(f"block kind {kind!r} is invalid; allowed: {sorted(per_token)}.")
        # interpolation: alpha_l * f_l keeps f_l in every block, whether or not the backward pass enters the block
        values += per_token[kind] + (h if interpolation else 0)
        fixed += per_block.get(kind, 0)
    return tokens * (values * act_bytes + vocab * 4) + fixed


def block_kinds_for(kind: str, num_blocks: int, active: Sequence[int], sparse: bool = False,
                    interpolation: bool = False, embeddings_train: bool = True) -> list[str]:
    """Per-block activation kinds of a method in a step with ``active`` blocks (see :func:`activation_bytes`)."""
    active = set(active)
    if kind == "full":
        return ["train"] * num_blocks
    if kind == "lora":
        return ["adapter-sparse" if sparse else "adapter"] * num_blocks
    if kind in ("lisa", "lisa-naive", "lisa-blocks"):
        kinds = ["train" if b in active else "frozen" for b in range(num_blocks)]
        lowest = 0 if embeddings_train and kind != "lisa-blocks" else min(active, default=num_blocks)
    elif kind == "lisa-adapter":
        frozen = "frozen-sparse" if sparse else "frozen"
        kinds = [("adapter-sparse" if sparse else "adapter") if b in active else frozen for b in range(num_blocks)]
        # interpolation scalars of block b-1 sit on block b's input, so the backward pass enters every block but
        # block 0 (whose own scalars sit on its output)
        lowest = min(active, default=num_blocks)
        if interpolation:
            lowest = min(lowest, 1)
    else:
        raise ValueError(f"kind={kind!r} is invalid; allowed: full, lisa, lisa-naive, lisa-blocks, lora, lisa-adapter.")
    return ["none" if b < lowest else k for b, k in enumerate(kinds)]


# ----------------------------------------------------------------------------------------------------------------------
# Floors from a config alone: no model is built (the scaling preset checks a cell against the machine before it runs)
# ----------------------------------------------------------------------------------------------------------------------
#: the methods :func:`config_floor` knows
CONFIG_FLOOR_METHODS = ("full", "lora", "lisa")


@dataclass(frozen=True)
class ConfigShapes:
    """Element counts of a llama-style decoder's parameter tensors, read from its config (tied E/H counted once).

    Attributes:
        outside: tensors outside the blocks: the embedding, the LM head unless tied, the final norm.
        block: one block's tensors (q, k, v, o, gate, up, down, biases if any, the two norms); blocks are identical.
        linears: ``(in_features, out_features)`` of one block's seven linear layers (where LoRA adapters go).
        num_blocks: ``num_hidden_layers``.
    """

    outside: tuple[int, ...]
    block: tuple[int, ...]
    linears: tuple[tuple[int, int], ...]
    num_blocks: int

    @property
    def total_params(self) -> int:
        return sum(self.outside) + self.num_blocks * sum(self.block)

    def adapter_block(self, rank: int) -> tuple[int, ...]:
        """One block's LoRA tensors at rank ``rank``: ``A`` (r x in) and ``B`` (out x r) per linear."""
        return tuple(n for fan_in, fan_out in self.linears for n in (rank * fan_in, fan_out * rank))


def config_shapes(config) -> ConfigShapes:
    """The parameter shapes of a llama-style causal LM (``LlamaForCausalLM`` and its look-alikes) from its config.

    Example:
        >>> from transformers import LlamaConfig
        >>> shapes = config_shapes(LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=2,
        ...                                    num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
        ...                                    tie_word_embeddings=True))
        >>> shapes.outside, sum(shapes.block), shapes.total_params
        ((256, 8), 592, 1448)
    """
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not isinstance(getattr(config, name, None), int):
            raise ValueError(f"config.{name}={getattr(config, name, None)!r} is invalid; config_shapes needs a "
                             "llama-style config with an integer for each of hidden_size, intermediate_size, "
                             "num_attention_heads, num_hidden_layers and vocab_size.")
    d = _config_dims(config)
    h, q, kv, i, vocab = d["h"], d["q"], d["kv"], d["i"], d["V"]
    linears = ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h))  # q k v o gate up down
    block = [fan_in * fan_out for fan_in, fan_out in linears]
    if getattr(config, "attention_bias", False):
        block += [q, kv, kv, h]
    if getattr(config, "mlp_bias", False):
        block += [i, i, h]
    block += [h, h]  # input and post-attention RMSNorm
    tied = getattr(config, "tie_word_embeddings", True)
    outside = (vocab * h,) + (() if tied else (vocab * h,)) + (h,)
    return ConfigShapes(outside, tuple(block), linears, config.num_hidden_layers)


def _adamw_numel_bytes(numels: Iterable[int], param_bytes: int) -> int:
    return sum(2 * n * param_bytes + ADAMW_STEP_BYTES for n in numels)


def config_floor(
    config,
    method: str,
    tokens: int,
    activated_layers: int = 2,
    lora_r: int = 16,
    param_bytes: int = 4,
    act_bytes: int = 4,
) -> dict[str, int]:
    """The memory floor of one training step from the config alone, in bytes: the same sum as the benchmark's floor
    (weights + gradients of the trainable set + AdamW state + :func:`activation_bytes`) without building the model.

    Args:
        config: a llama-style config (:func:`config_shapes`).
        method: ``"full"`` (everything trains), ``"lora"`` (LoRA of rank ``lora_r`` on the seven linears of every
            block, the base frozen) or ``"lisa"`` (E+H+final norm and ``activated_layers`` blocks train).
        tokens: tokens in the batch (rows x length; no padding).
        activated_layers: γ of LISA.
        lora_r: LoRA rank.
        param_bytes: bytes per parameter (4 for fp32 weights, also the master weights under bf16 autocast).
        act_bytes: bytes per saved activation (4 in fp32, 2 under bf16 autocast).

    Returns:
        ``weights_bytes``, ``grad_bytes``, ``optimizer_state_bytes``, ``activation_bytes``, ``total_bytes``,
        ``total_params`` and ``trainable_params``.
    """
    if method not in CONFIG_FLOOR_METHODS:
        raise ValueError(f"method={method!r} is invalid; allowed: {', '.join(CONFIG_FLOOR_METHODS)}.")
    shapes = config_shapes(config)
    layers = shapes.num_blocks
    if method == "lisa" and not 0 < activated_layers <= layers:
        raise ValueError(f"activated_layers={activated_layers} is invalid; allowed: 1..{layers} (num_hidden_layers).")
    weights = list(shapes.outside) + list(shapes.block) * layers
    if method == "full":
        trainable = weights
    elif method == "lisa":
        trainable = list(shapes.outside) + list(shapes.block) * activated_layers
    else:
        trainable = list(shapes.adapter_block(lora_r)) * layers
        weights = weights + trainable
    kinds = block_kinds_for(method, layers, active=range(activated_layers))
    activations = activation_bytes(config, tokens, kinds, act_bytes=act_bytes,
                                   adapter_rank=lora_r if method == "lora" else 0, head_trains=method != "lora")
    floor = {
        "weights_bytes": sum(weights) * param_bytes,
        "grad_bytes": sum(trainable) * param_bytes,
        "optimizer_state_bytes": _adamw_numel_bytes(trainable, param_bytes),
        "activation_bytes": activations,
        "total_params": sum(weights),
        "trainable_params": sum(trainable),
    }
    floor["total_bytes"] = (floor["weights_bytes"] + floor["grad_bytes"] + floor["optimizer_state_bytes"]
                            + activations)
    return floor
