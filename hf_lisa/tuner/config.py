"""Configuration of the LISA PEFT method."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from peft.config import PeftConfig

from .masks import SPARSITY_STRUCTURES
from .peft_type import PEFT_TYPE_LISA

MASK_INITS = ("importance", "magnitude", "random", "dense")
LAYER_SAMPLING_STRATEGIES = ("uniform", "importance", "cyclic")


def _pair(value, field_name: str) -> tuple[int, int]:
    """Accept ``2``, ``(2, 2)``, ``[2, 2]``, ``"2x2"`` or ``"2:4"`` and return a pair of positive ints."""
    try:
        if isinstance(value, int):
            pair = (value, value)
        elif isinstance(value, str):
            sep = ":" if ":" in value else "x"
            pair = tuple(int(v) for v in value.lower().split(sep))
        else:
            pair = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        pair = ()
    if len(pair) != 2 or min(pair) < 1:
        raise ValueError(
            f"LisaConfig.{field_name}={value!r} is invalid; allowed: two positive integers, e.g. (2, 2) or '2x2'."
        )
    return pair


@dataclass
class LisaConfig(PeftConfig):
    """
    Configuration of a [`LisaModel`]: sparse low-rank adapters ``ΔW = s · M ⊙ (B A)`` with optional layer
    interpolation and layerwise sampling of the adapted blocks.

    With ``sparsity=0`` a LISA adapter is exactly LoRA (same forward, same weights); the other knobs add LISA's three
    mask levels (see the README, "The method").

    Args:
        r (`int`, defaults to `8`): rank of the low-rank factors ``B`` (d×r) and ``A`` (r×k).
        lisa_alpha (`int`, defaults to `8`): scaling numerator, ``s = lisa_alpha / r``.
        lisa_dropout (`float`, defaults to `0.0`): dropout on the adapter input.
        target_modules (`list[str] | str`, *optional*): modules to adapt; per-architecture defaults (the attention
            q/k/v projections) when `None`; `"all-linear"` adapts every linear layer but the output head.
        exclude_modules (`list[str] | str`, *optional*): modules never adapted.
        layers_to_transform (`list[int] | int`, *optional*): only adapt these block indices.
        layers_pattern (`list[str] | str`, *optional*): name of the block list for `layers_to_transform`.
        modules_to_save (`list[str]`, *optional*): extra fully trained modules (e.g. a classifier head).
        fan_in_fan_out (`bool`, defaults to `False`): `True` for GPT-2's `Conv1D` (set automatically).
        init_weights (`bool`, defaults to `True`): `B = 0` so a fresh adapter leaves outputs unchanged. `False`
            draws `B` at random too (tests only).
        sparsity (`float`, defaults to `0.0`): ρ, the fraction of zeros of `M`, in `[0, 1)`.
        sparsity_structure (`str`, defaults to `"block"`): `"block"`, `"n:m"` or `"unstructured"`.
        block_size (`tuple[int, int]`, defaults to `(2, 2)`): block shape (out, in) for `"block"`.
        n_m (`tuple[int, int]`, defaults to `(2, 4)`): keep n of every m inputs for `"n:m"`; ρ must be `1 - n/m`.
        mask_init (`str`, defaults to `"importance"`): how `M` is chosen: `|∂L/∂W|` (selected by the scheduler
            callback from the first `importance_steps` training steps of a fresh adapter, through the trainer's own
            loss; magnitude until then), `|W|`, seeded random, or dense.
        mask_seed (`int`, defaults to `0`): seed of the `"random"` mask.
        mask_update_interval (`int`, defaults to `1000`): re-select `M` every this many optimizer steps; 0 never.
        importance_steps (`int`, defaults to `8`): optimizer steps over which importance is accumulated before a
            selection (capped at `lisa_interval_steps - 1` under layerwise sampling).
        mask_keep_learned (`float`, defaults to `1.0`): weight of `|ΔW|` beside `|∂L/∂W|` in the re-selection score;
            0 scores by the gradient alone.
        new_block_bonus (`float`, defaults to `0.5`): bonus (× mean kept score) for cells switched on at the previous
            update.
        layer_interpolation (`bool`, defaults to `False`): learn ``h_l = α_l f_l(h_{l-1}) + β_l`` per block.
        interpolation_delta_bound (`float`, defaults to `5.0`): `α = exp(δ)` with δ kept within ±bound (the
            scheduler callback projects δ back after every optimizer step, so its gradient stays live).
        interpolation_beta_l2 (`float`, defaults to `0.01`): λ of the penalty λ·Σβ², applied once per optimizer step
            as the gradient 2λβ by the scheduler callback (added to the loss in a plain training loop).
        lisa_activated_layers (`int`, defaults to `0`): γ, blocks whose adapters train at a time; 0 trains all.
        lisa_interval_steps (`int`, defaults to `20`): K, optimizer steps between block switches.
        lisa_sampling (`str`, defaults to `"uniform"`): `"uniform"`, `"importance"` or `"cyclic"`.
        lisa_layers_attribute (`str`, *optional*): dotted path of the block list, overriding discovery.
        rank_pattern / alpha_pattern / sparsity_pattern (`dict`): per-module overrides of `r`, `lisa_alpha`,
            `sparsity`, keyed by module name or regex (as LoRA's `rank_pattern`).

    Example:
        ```py
        >>> import hf_lisa
        >>> from peft import get_peft_model
        >>> config = hf_lisa.LisaConfig(
        ...     target_modules=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
        ...     sparsity=0.4, sparsity_pattern={"up_proj": 0.0, "down_proj": 0.0},
        ... )
        >>> model = get_peft_model(base_model, config)  # doctest: +SKIP
        ```
    """

    r: int = field(default=8, metadata={"help": "Rank of the low-rank factors B (out×r) and A (r×in)."})
    lisa_alpha: int = field(default=8, metadata={"help": "Scaling numerator: the delta is scaled by lisa_alpha / r."})
    lisa_dropout: float = field(default=0.0, metadata={"help": "Dropout probability on the adapter's input."})
    target_modules: Optional[Union[list[str], str]] = field(
        default=None,
        metadata={
            "help": "Module names (or a regex) to adapt. None uses per-architecture defaults (attention q/k/v); "
            "'all-linear' adapts every linear layer except the output head."
        },
    )
    exclude_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Module names (or a regex) never to adapt."}
    )
    layers_to_transform: Optional[Union[list[int], int]] = field(
        default=None, metadata={"help": "Only adapt modules in these block indices."}
    )
    layers_pattern: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Name of the block list used with layers_to_transform, e.g. 'layers'."}
    )
    modules_to_save: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Extra modules trained in full and saved with the adapter, e.g. a classifier head."},
    )
    fan_in_fan_out: bool = field(
        default=False,
        metadata={"help": "True if the target stores its weight as (in, out), like GPT-2's Conv1D (set automatically)."},
    )
    init_weights: bool = field(
        default=True,
        metadata={"help": "Initialise B = 0 so that a fresh adapter is a no-op. False is for tests only."},
    )
    sparsity: float = field(
        default=0.0, metadata={"help": "Fraction rho of zeros in the mask M, in [0, 1). 0 is exactly LoRA."}
    )
    sparsity_structure: Literal["block", "n:m", "unstructured"] = field(
        default="block", metadata={"help": f"Structure of M, one of {SPARSITY_STRUCTURES}."}
    )
    block_size: tuple[int, int] = field(
        default=(2, 2), metadata={"help": "Block shape (out, in) for the 'block' structure, e.g. [2, 2]."}
    )
    n_m: tuple[int, int] = field(
        default=(2, 4),
        metadata={"help": "Keep n of every m entries along the input dimension for 'n:m'; sparsity must be 1 - n/m."},
    )
    mask_init: Literal["importance", "magnitude", "random", "dense"] = field(
        default="importance",
        metadata={
            "help": "How M is chosen: 'importance' (|dL/dW| over a fresh adapter's first importance_steps training "
            "steps, with B held at 0, selected by the scheduler callback; |W| until then), 'magnitude' (|W|), 'random' (seeded) or 'dense' (all ones until the first "
            "re-selection)."
        },
    )
    mask_seed: int = field(default=0, metadata={"help": "Seed of the 'random' mask initialisation."})
    mask_update_interval: int = field(
        default=1000, metadata={"help": "Re-select M every this many optimizer steps (seed 000); 0 disables."}
    )
    importance_steps: int = field(
        default=8, metadata={"help": "Optimizer steps over which |dL/dW| is accumulated before each selection."}
    )
    mask_keep_learned: float = field(
        default=1.0,
        metadata={
            "help": "Weight of |delta W| (what the adapter has learned) beside |dL/dW| in the re-selection score, each "
            "normalised by its mean; 0 scores by the gradient alone."
        },
    )
    new_block_bonus: float = field(
        default=0.5,
        metadata={
            "help": "Importance bonus, as a multiple of the mean kept score, for cells switched on at the previous "
            "update so that they are not dropped again at once."
        },
    )
    layer_interpolation: bool = field(
        default=False, metadata={"help": "Learn h_l = alpha_l * f_l(h_{l-1}) + beta_l for every block (seed 001)."}
    )
    interpolation_delta_bound: float = field(
        default=5.0, metadata={"help": "alpha_l = exp(delta_l) with delta_l clamped to [-bound, bound]."}
    )
    interpolation_beta_l2: float = field(
        default=0.01, metadata={"help": "lambda of the L2 penalty lambda * sum(beta_l^2) added to the training loss."}
    )
    lisa_activated_layers: int = field(
        default=0, metadata={"help": "gamma: number of blocks whose adapters train at a time; 0 trains every block."}
    )
    lisa_interval_steps: int = field(
        default=20, metadata={"help": "K: optimizer steps between two block switches."}
    )
    lisa_sampling: Literal["uniform", "importance", "cyclic"] = field(
        default="uniform", metadata={"help": f"Block sampling strategy, one of {LAYER_SAMPLING_STRATEGIES}."}
    )
    lisa_layers_attribute: Optional[str] = field(
        default=None, metadata={"help": "Dotted path of the block list (e.g. 'model.layers'), overriding discovery."}
    )
    rank_pattern: Optional[dict] = field(
        default_factory=dict, metadata={"help": "Per-module rank overrides, e.g. {'down_proj': 16} (regex keys)."}
    )
    alpha_pattern: Optional[dict] = field(
        default_factory=dict, metadata={"help": "Per-module lisa_alpha overrides (regex keys)."}
    )
    sparsity_pattern: Optional[dict] = field(
        default_factory=dict,
        metadata={"help": "Per-module sparsity overrides, e.g. {'up_proj': 0.0} for dense FFN adapters (regex keys)."},
    )

    def __post_init__(self):
        super().__post_init__()

        self.peft_type = PEFT_TYPE_LISA
        self.target_modules = set(self.target_modules) if isinstance(self.target_modules, list) else self.target_modules
        self.exclude_modules = (
            set(self.exclude_modules) if isinstance(self.exclude_modules, list) else self.exclude_modules
        )
        self.block_size = _pair(self.block_size, "block_size")
        self.n_m = _pair(self.n_m, "n_m")
        self.rank_pattern = dict(self.rank_pattern or {})
        self.alpha_pattern = dict(self.alpha_pattern or {})
        self.sparsity_pattern = dict(self.sparsity_pattern or {})
        self._validate()

    # -- validation -------------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        def need(cond: bool, name: str, value, allowed: str) -> None:
            if not cond:
                raise ValueError(f"LisaConfig.{name}={value!r} is invalid; allowed: {allowed}.")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.r) and self.r > 0, "r", self.r, "a positive integer")
        need(isinstance(self.lisa_alpha, (int, float)) and self.lisa_alpha > 0, "lisa_alpha", self.lisa_alpha, "> 0")
        need(0.0 <= self.lisa_dropout < 1.0, "lisa_dropout", self.lisa_dropout, "a float in [0, 1)")
        need(self.sparsity_structure in SPARSITY_STRUCTURES, "sparsity_structure", self.sparsity_structure,
             f"one of {SPARSITY_STRUCTURES}")
        need(self.mask_init in MASK_INITS, "mask_init", self.mask_init, f"one of {MASK_INITS}")
        need(self.lisa_sampling in LAYER_SAMPLING_STRATEGIES, "lisa_sampling", self.lisa_sampling,
             f"one of {LAYER_SAMPLING_STRATEGIES}")
        n, m = self.n_m
        need(n < m, "n_m", self.n_m, "n < m, e.g. (2, 4)")
        for name, value in [("sparsity", self.sparsity)] + [
            (f"sparsity_pattern[{k!r}]", v) for k, v in self.sparsity_pattern.items()
        ]:
            need(isinstance(value, (int, float)) and 0.0 <= value < 1.0, name, value, "a float in [0, 1)")
            if self.sparsity_structure == "n:m" and value != 0:
                need(abs(value - (1 - n / m)) < 1e-9, name, value,
                     f"0 or 1 - n/m = {1 - n / m:g} with sparsity_structure='n:m' and n_m={n}:{m}")
        for k, v in self.rank_pattern.items():
            need(is_int(v) and v > 0, f"rank_pattern[{k!r}]", v, "a positive integer")
        for k, v in self.alpha_pattern.items():
            need(isinstance(v, (int, float)) and v > 0, f"alpha_pattern[{k!r}]", v, "> 0")
        need(is_int(self.mask_update_interval) and self.mask_update_interval >= 0, "mask_update_interval",
             self.mask_update_interval, "an integer >= 0 (0 never re-selects)")
        need(is_int(self.importance_steps) and self.importance_steps >= 1, "importance_steps",
             self.importance_steps, "an integer >= 1")
        if self.mask_update_interval:
            need(self.mask_update_interval >= self.importance_steps, "mask_update_interval",
                 self.mask_update_interval, f">= importance_steps ({self.importance_steps}), or 0")
        need(self.new_block_bonus >= 0, "new_block_bonus", self.new_block_bonus, ">= 0")
        need(isinstance(self.mask_keep_learned, (int, float)) and self.mask_keep_learned >= 0, "mask_keep_learned",
             self.mask_keep_learned, "a float >= 0")
        need(self.interpolation_delta_bound > 0, "interpolation_delta_bound", self.interpolation_delta_bound, "> 0")
        need(self.interpolation_beta_l2 >= 0, "interpolation_beta_l2", self.interpolation_beta_l2, ">= 0")
        need(is_int(self.lisa_activated_layers) and self.lisa_activated_layers >= 0, "lisa_activated_layers",
             self.lisa_activated_layers, "an integer >= 0 (0 trains every block)")
        need(is_int(self.lisa_interval_steps) and self.lisa_interval_steps >= 1, "lisa_interval_steps",
             self.lisa_interval_steps, "an integer >= 1")

    # -- per-module resolution ----------------------------------------------------------------------------------------
    def resolve(self, key: str) -> dict:
        """Rank, alpha and sparsity for the module ``key`` after applying the patterns."""
        from peft.utils.other import get_pattern_key

        def pick(pattern: dict, default):
            return pattern.get(get_pattern_key(pattern.keys(), key), default)

        return {
            "r": pick(self.rank_pattern, self.r),
            "lisa_alpha": pick(self.alpha_pattern, self.lisa_alpha),
            "sparsity": float(pick(self.sparsity_pattern, self.sparsity)),
        }
