"""Configuration of the LISA PEFT method."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Optional, Union

from peft.config import PeftConfig

from ..methods import ADAPTER_ACTIVATED_LAYERS
from .masks import SPARSITY_STRUCTURES
from .peft_type import PEFT_TYPE_LISA

MASK_INITS = ("importance", "magnitude", "random", "dense")
LAYER_SAMPLING_STRATEGIES = ("uniform", "importance", "cyclic")
#: what happens to the optimizer state of blocks that leave the active set (see hf_lisa.optim.state)
OPTIMIZER_STATE_POLICIES = ("drop", "keep")
#: the layer schedule's settings that only take effect when blocks are sampled (γ >= 1), with their defaults
LAYER_SCHEDULE_DEFAULTS = {"lisa_interval_steps": 20, "lisa_sampling": "uniform", "lisa_optimizer_state_policy": "drop"}


# ----------------------------------------------------------------------------------------------------------------------
# The value rules of LISA's settings: checked here and nowhere else
# ----------------------------------------------------------------------------------------------------------------------
def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: setting -> (test, what is allowed) for the rules that look at one value alone
_VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "r": (lambda v: is_int(v) and v > 0, "a positive integer"),
    "lisa_alpha": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "lisa_dropout": (lambda v: _is_number(v) and 0.0 <= v < 1.0, "a float in [0, 1)"),
    "sparsity": (lambda v: _is_number(v) and 0.0 <= v < 1.0, "a float in [0, 1)"),
    "sparsity_structure": (lambda v: v in SPARSITY_STRUCTURES, f"one of {SPARSITY_STRUCTURES}"),
    "mask_init": (lambda v: v in MASK_INITS, f"one of {MASK_INITS}"),
    "mask_update_interval": (lambda v: is_int(v) and v >= 0, "an integer >= 0 (0 never re-selects)"),
    "importance_steps": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "mask_keep_learned": (lambda v: _is_number(v) and v >= 0, "a float >= 0"),
    "new_block_bonus": (lambda v: _is_number(v) and v >= 0, "a float >= 0"),
    "interpolation_delta_bound": (lambda v: _is_number(v) and v > 0, "a float > 0"),
    "interpolation_beta_l2": (lambda v: _is_number(v) and v >= 0, "a float >= 0"),
    "lisa_interval_steps": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "lisa_sampling": (lambda v: v in LAYER_SAMPLING_STRATEGIES, f"one of {LAYER_SAMPLING_STRATEGIES}"),
    "lisa_optimizer_state_policy": (lambda v: v in OPTIMIZER_STATE_POLICIES, f"one of {OPTIMIZER_STATE_POLICIES}"),
    "fuse_sparse_delta": (lambda v: isinstance(v, bool), "True or False"),
}
#: per-module pattern -> the setting whose rule its values follow (as in ``LisaConfig.resolve``)
_PATTERN_OF = {"rank_pattern": "r", "alpha_pattern": "lisa_alpha", "sparsity_pattern": "sparsity"}
_SYMBOLS = {"lisa_activated_layers": "γ", "lisa_interval_steps": "K"}


def _pair(value, label: str) -> tuple[int, int]:
    """Accept ``2``, ``(2, 2)``, ``[2, 2]``, ``"2x2"`` or ``"2:4"`` and return a pair of positive ints."""
    try:
        if is_int(value):
            pair = (value, value)
        elif isinstance(value, str):
            sep = ":" if ":" in value else "x"
            pair = tuple(int(v) for v in value.lower().split(sep))
        else:
            pair = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        pair = ()
    if len(pair) != 2 or min(pair) < 1:
        raise ValueError(f"{label}={value!r} is invalid; allowed: two positive integers, e.g. (2, 2) or '2x2'.")
    return pair


def check_lisa_settings(
    values: Mapping[str, Any],
    *,
    where: str = "LisaConfig.",
    arguments: Optional[Mapping[str, str]] = None,
    allow_every_block: bool = True,
    num_blocks: Optional[int] = None,
) -> None:
    """Check LISA's settings against their value rules; the one place these rules live.

    ``LisaConfig`` checks all its fields here; ``hf-lisa train``, the LISA Trainer callbacks and the layer sampler
    check the settings they take, by the same names, instead of restating a rule. A rule that involves several
    settings (``n:m`` sparsity against ``n_m``, ``mask_update_interval`` against ``importance_steps``) applies when
    all of them are in ``values``; names without a rule are ignored.

    Args:
        values: settings by their ``LisaConfig`` field name, e.g. ``{"lisa_activated_layers": 2}``.
        where: prefix of the name in the message: ``"LisaConfig."``, ``"--"`` for command-line options, ``"LisaCallback
            "`` for a constructor.
        arguments: the caller's own argument name of a setting, named beside it, e.g.
            ``{"lisa_activated_layers": "num_active"}``.
        allow_every_block: whether γ = 0 (every block trains: the adapter form without sampling) is allowed; the
            full-parameter form and a sampler need γ >= 1.
        num_blocks: N, the number of transformer blocks, where they are known: γ must be at most N.

    Raises:
        ValueError: naming the setting, its value and what is allowed.
    """
    arguments = arguments or {}

    def label(name: str, key: str = "") -> str:
        shown = f"{arguments[name]}: {name}" if name in arguments else name
        symbol = f" ({_SYMBOLS[name]})" if name in _SYMBOLS else ""
        return f"{where}{shown}{key}{symbol}"

    def need(ok: bool, name: str, value, allowed: str, key: str = "", problem: str = "is invalid") -> None:
        if not ok:
            raise ValueError(f"{label(name, key)}={value!r} {problem}; allowed: {allowed}.")

    for name, (test, allowed) in _VALUE_RULES.items():
        if name in values:
            need(test(values[name]), name, values[name], allowed)
    for pattern, setting in _PATTERN_OF.items():
        test, allowed = _VALUE_RULES[setting]
        for key, value in (values.get(pattern) or {}).items():
            need(test(value), pattern, value, allowed, key=f"[{key!r}]")
    if "block_size" in values:
        _pair(values["block_size"], label("block_size"))
    if "n_m" in values:
        n, m = _pair(values["n_m"], label("n_m"))
        need(n < m, "n_m", values["n_m"], "n < m, e.g. (2, 4)")
        if values.get("sparsity_structure") == "n:m":
            allowed = f"0 or 1 - n/m = {1 - n / m:g} with sparsity_structure='n:m' and n_m={n}:{m}"
            need(values.get("sparsity", 0) == 0 or abs(values["sparsity"] - (1 - n / m)) < 1e-9, "sparsity",
                 values.get("sparsity"), allowed)
            for key, value in (values.get("sparsity_pattern") or {}).items():
                need(value == 0 or abs(value - (1 - n / m)) < 1e-9, "sparsity_pattern", value, allowed,
                     key=f"[{key!r}]")
    interval, window = values.get("mask_update_interval"), values.get("importance_steps")
    if interval and window is not None:
        need(interval >= window, "mask_update_interval", interval,
             f"mask_update_interval >= importance_steps ({window}), or 0",
             problem=f"is shorter than the importance window importance_steps={window}")
    if "lisa_activated_layers" in values:
        gamma, low = values["lisa_activated_layers"], 0 if allow_every_block else 1
        if num_blocks is not None:
            allowed = f"an integer in [{low}, {num_blocks}]" + (" (0 trains every block)" if low == 0 else "")
        elif low == 0:
            allowed = "an integer >= 0 (0 trains every block)"
        else:
            allowed = "an integer >= 1; to train every block, use plain fine-tuning (--method full)"
        need(is_int(gamma) and gamma >= low, "lisa_activated_layers", gamma, allowed)
        if num_blocks is not None:
            need(gamma <= num_blocks, "lisa_activated_layers", gamma, allowed,
                 problem=f"is larger than the number of transformer blocks ({num_blocks})")
        if gamma == 0:  # no block is sampled: the layer schedule's settings would change nothing
            for name, default in LAYER_SCHEDULE_DEFAULTS.items():
                if name in values and values[name] != default:
                    raise ValueError(
                        f"{label(name)}={values[name]!r} has no effect with {label('lisa_activated_layers')}=0 (every "
                        f"block trains, none is sampled); allowed with γ=0: its default {default!r}. Set "
                        "lisa_activated_layers >= 1 to sample blocks, or leave the setting out."
                    )


def lisa_config_fields() -> list[dataclasses.Field]:
    """The fields ``LisaConfig`` declares itself (PEFT's generic ``PeftConfig`` fields left out), in order."""
    inherited = {f.name for f in dataclasses.fields(PeftConfig)}
    return [f for f in dataclasses.fields(LisaConfig) if f.name not in inherited]


@dataclass
class LisaConfig(PeftConfig):
    """
    Configuration of a [`LisaModel`]: sparse low-rank adapters ``ΔW = s · M ⊙ (B A)`` with optional layer
    interpolation and layerwise sampling of the adapted blocks.

    With ``sparsity=0`` a LISA adapter is exactly LoRA (same forward, same weights); the other knobs add LISA's three
    mask levels (see docs/method.md).

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
            callback before the first optimizer step of a fresh adapter, from `importance_steps` steps' worth of
            passes through the trainer's own loss that train nothing; magnitude until then), `|W|`, seeded random,
            or dense.
        mask_seed (`int`, defaults to `0`): seed of the `"random"` mask.
        mask_update_interval (`int`, defaults to `1000`): re-select `M` every this many optimizer steps; 0 never.
        importance_steps (`int`, defaults to `8`): optimizer steps over which importance is accumulated before a
            selection (a re-selection's capped at `lisa_interval_steps - 1` under layerwise sampling); a fresh
            adapter's calibration runs this many steps' worth of extra passes before training starts.
        mask_keep_learned (`float`, defaults to `1.0`): weight of `|ΔW|` beside `|∂L/∂W|` in the re-selection score;
            0 scores by the gradient alone.
        new_block_bonus (`float`, defaults to `0.5`): bonus (× mean kept score) for cells switched on at the previous
            update.
        layer_interpolation (`bool`, defaults to `False`): learn ``h_l = α_l f_l(h_{l-1}) + β_l`` per block.
        interpolation_delta_bound (`float`, defaults to `5.0`): `α = exp(δ)` with δ kept within ±bound (the
            scheduler callback projects δ back after every optimizer step, so its gradient stays live).
        interpolation_beta_l2 (`float`, defaults to `0.01`): λ of the penalty λ·Σβ², applied once per optimizer step
            as the gradient 2λβ by the scheduler callback (added to the loss in a custom loop that declares the
            schedule, ``hf_lisa.tuner.schedule_guard.attach_schedule``).
        lisa_activated_layers (`int`, defaults to `0`): γ, blocks whose adapters train at a time; 0 trains all, like
            LoRA, and needs no schedule (full-parameter LISA's default is 2, ``FULL_LISA_ACTIVATED_LAYERS``). γ >= 1
            needs ``LisaAdapterCallback`` in the Trainer; with γ = 0 the schedule's other settings must keep their
            defaults.
        lisa_interval_steps (`int`, defaults to `20`): K, optimizer steps between block switches.
        lisa_sampling (`str`, defaults to `"uniform"`): `"uniform"`, `"importance"` or `"cyclic"`.
        lisa_layers_attribute (`str`, *optional*): dotted path of the block list, overriding discovery.
        fuse_sparse_delta (`bool`, defaults to `True`): compute a sparse adapter's layer as one matmul with
            ``W + s · M ⊙ (B A)`` where that is the same function as ``base(x) + adapter(x)`` (fp32, no autocast, one
            active adapter, no dropout, a frozen plain base without hooks); elsewhere, or with `False`, the delta
            has its own matmul. The fused result agrees with the separate one to fp32 rounding (not bit for bit)
            and costs about one dense matmul instead of two.
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
    lisa_alpha: int = field(
        default=8, metadata={"help": "Scaling numerator: the delta is scaled by lisa_alpha / r (LoRA's lora_alpha)."}
    )
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
        metadata={
            "help": "True if the target stores its weight as (in, out), like GPT-2's Conv1D (set automatically)."
        },
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
        default=(2, 2), metadata={"help": "Block shape (out, in) for the 'block' structure, e.g. (2, 2) or '2x2'."}
    )
    n_m: tuple[int, int] = field(
        default=(2, 4),
        metadata={
            "help": "Keep n of every m entries along the input dimension for 'n:m', e.g. (2, 4) or '2:4'; sparsity "
            "must be 1 - n/m."
        },
    )
    mask_init: Literal["importance", "magnitude", "random", "dense"] = field(
        default="importance",
        metadata={
            "help": "How M is chosen: 'importance' (|dL/dW| over a fresh adapter's first importance_steps training "
            "steps, with B held at 0, selected by the scheduler callback; |W| until then), 'magnitude' (|W|), "
            "'random' (seeded) or 'dense' (all ones until the first re-selection)."
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
        default=ADAPTER_ACTIVATED_LAYERS,
        metadata={
            "help": "gamma: number of blocks trained at a time (their adapters, in the adapter form); 0 trains every "
            "block's adapter, like LoRA, and needs no schedule (full-parameter LISA defaults to 2). With 0, "
            "lisa_interval_steps and lisa_sampling keep their defaults."
        },
    )
    lisa_interval_steps: int = field(
        default=LAYER_SCHEDULE_DEFAULTS["lisa_interval_steps"],
        metadata={"help": "K: optimizer steps between two block switches."},
    )
    lisa_sampling: Literal["uniform", "importance", "cyclic"] = field(
        default=LAYER_SCHEDULE_DEFAULTS["lisa_sampling"],
        metadata={"help": f"Block sampling strategy, one of {LAYER_SAMPLING_STRATEGIES}."},
    )
    lisa_layers_attribute: Optional[str] = field(
        default=None, metadata={"help": "Dotted path of the block list (e.g. 'model.layers'), overriding discovery."}
    )
    fuse_sparse_delta: bool = field(
        default=True,
        metadata={
            "help": "Fold a sparse adapter's delta into the base layer's matmul, x (W + s*M*(BA))^T, where that is the "
            "same function (fp32, no autocast, one active adapter, no dropout, a frozen base without hooks); equal to "
            "the separate path up to fp32 rounding and about half its cost. False keeps the delta's own matmul "
            "(bitwise reproducible against earlier versions)."
        },
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
        self.block_size = _pair(self.block_size, "LisaConfig.block_size")
        self.n_m = _pair(self.n_m, "LisaConfig.n_m")
        self.rank_pattern = dict(self.rank_pattern or {})
        self.alpha_pattern = dict(self.alpha_pattern or {})
        self.sparsity_pattern = dict(self.sparsity_pattern or {})
        check_lisa_settings({f.name: getattr(self, f.name) for f in lisa_config_fields()})

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
