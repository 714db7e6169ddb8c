"""The training methods of hf-lisa, in one table: what each trains, which of its settings differ by method, and how it
is built. The CLI's ``--method`` choices, the option table of ``hf-lisa train``
(:data:`hf_lisa.train.parsing.options.OPTION_METHODS`), the model card and the resume checks all ask this module; no other
module spells a method's name.

A method is described by what it *is*, not by a branch per name elsewhere:

* ``adapter_type``: the PEFT type of the adapter it trains beside a frozen base (``"LISA"``, ``"LORA"``), or ``None``
  when it trains the base weights themselves (saved as full weights, not quantizable, eligible for the optimizer
  step in the backward pass);
* ``schedule``: which LISA schedule runs it: ``"blocks"`` (full-parameter LISA, ``LisaCallback``: E+H+γL), ``"adapter"``
  (``LisaAdapterCallback`` over ``LisaConfig`` adapters), or ``None``;
* ``defaults``: the settings whose default depends on the method (γ: 2 blocks for full-parameter LISA, which needs at
  least one; 0 for the adapter form, where every block's adapter trains and no schedule is needed);
* ``learning_rate``: ``hf-lisa train``'s learning rate when neither the command line nor the config file sets one
  (``None``: the Trainer's 5e-5), and ``sampled_learning_rate`` the LISA adapter's when its schedule samples blocks
  (γ >= 1). Each is the method's best in the T = 300 study (``make bench-study``; the constants below cite the rows).

A new method is one more :class:`Method` in :data:`METHODS`; ``hf_lisa.trainer.methods.setup_method`` builds it from
these fields.

Example:
    ```py
    >>> from hf_lisa.methods import get_method, method_names
    >>> get_method("lora").is_adapter, method_names(lambda m: m.trains_weights)
    (True, ('lisa', 'full'))
    ```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from .errors import UsageError

#: γ of full-parameter LISA when none is given (LisaCallback's default; the paper's E+H+2L)
FULL_LISA_ACTIVATED_LAYERS = 2
#: γ of LISA adapters when none is given: every block's adapter trains, no layer schedule
ADAPTER_ACTIVATED_LAYERS = 0
#: The learning rates ``hf-lisa train`` uses when none is given, one per method and form. Each is the method's best rate
#: in the T = 300 study (issue 37; ``benchmarks/results/study/study-cpu.md``, "Rate selection": SmolLM2-135M, the
#: instruction task, 300 steps of batch 4, warmup then cosine, chosen on the selection half at seed 0 from a ×3 grid
#: extended until the best was interior; `make bench-study`). A larger model usually wants a lower rate: pass
#: ``--learning_rate``.
#:
#: LoRA (all-linear r=16 α=32): 1e-3 (1e-4: 0.262, 3e-4: 0.175, 1e-3: 0.143, 3e-3: 0.234). DoRA and the dense LISA
#: adapter (γ = 0, every block's r-16 adapter trains: LoRA's shape) follow LoRA's row; neither was studied on its own.
ADAPTER_LEARNING_RATE = 1e-3
#: the LISA adapter with a layer schedule (γ >= 1, sampled blocks): 3e-3 (1e-4: 1.126, 3e-4: 0.590, 1e-3: 0.332,
#: 3e-3: 0.266, 1e-2: 0.477; γ = 2, K = 30), 3× LoRA's: each block's adapter trains only while it is drawn
SAMPLED_ADAPTER_LEARNING_RATE = 3e-3
#: full-parameter LISA: 3e-4 at both K = 5 and K = 30 (K = 30: 1e-5: 0.898, 3e-5: 0.470, 1e-4: 0.236, 3e-4: 0.189,
#: 1e-3: 0.305)
FULL_LISA_LEARNING_RATE = 3e-4
#: full fine-tuning: 1e-4 (1e-5: 0.249, 3e-5: 0.171, 1e-4: 0.141, 3e-4: 0.209); the Trainer's 5e-5 was below it
FULL_LEARNING_RATE = 1e-4


#: LoRA's and DoRA's targets when none are given: every linear layer but the output head (PEFT's "all-linear"), the
#: baseline practitioners run (LLaMA-Factory's default lora_target "all", axolotl's lora_target_linear) rather than
#: PEFT's per-architecture q/v defaults, which trail it on held-out tasks (issue 37)
LORA_DEFAULTS = MappingProxyType({"target_modules": ["all-linear"]})
#: LoRA's lora_alpha when none is given: 2·r, LLaMA-Factory's default and the α = 2r of the study's LoRA (issue 37)
LORA_ALPHA_PER_RANK = 2.0


#: LisaConfig settings that PEFT's LoraConfig has too, and their names there: what LoRA-type adapters use
LORA_CONFIG_NAMES = MappingProxyType({
    "r": "r",
    "lisa_alpha": "lora_alpha",
    "lisa_dropout": "lora_dropout",
    "target_modules": "target_modules",
    "exclude_modules": "exclude_modules",
    "layers_to_transform": "layers_to_transform",
    "layers_pattern": "layers_pattern",
    "modules_to_save": "modules_to_save",
    "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern",
})


@dataclass(frozen=True)
class Method:
    """One training method of ``hf-lisa train`` (see the module docstring for the fields' meaning)."""

    name: str
    title: str
    help: str
    adapter_type: Optional[str] = None
    use_dora: bool = False
    schedule: Optional[str] = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    learning_rate: Optional[float] = None
    #: the learning rate when the method's layer schedule samples blocks (γ >= 1; ``None``: ``learning_rate``)
    sampled_learning_rate: Optional[float] = None
    #: ``lisa_alpha`` (LoRA's ``lora_alpha``) when it is not given: this many times ``r``
    alpha_per_rank: Optional[float] = None

    def default_learning_rate(self, activated_layers: Optional[int] = None) -> Optional[float]:
        """``hf-lisa train``'s rate for this method when none is given, at γ = ``activated_layers`` (``None``: the
        method's default γ): ``sampled_learning_rate`` when the schedule samples blocks (γ >= 1), else
        ``learning_rate``."""
        if activated_layers is None:
            activated_layers = self.defaults.get("lisa_activated_layers")
        sampled = isinstance(activated_layers, int) and not isinstance(activated_layers, bool) and activated_layers >= 1
        return self.sampled_learning_rate if self.sampled_learning_rate is not None and sampled else self.learning_rate

    @property
    def is_adapter(self) -> bool:
        """Trains a PEFT adapter beside a frozen base: saved adapter-only, works on a quantized base."""
        return self.adapter_type is not None

    @property
    def trains_weights(self) -> bool:
        """Trains the base weights in place: saved as full weights; may step its optimizer in the backward pass."""
        return self.adapter_type is None

    @property
    def is_lisa_adapter(self) -> bool:
        """Trains ``hf_lisa.LisaConfig`` adapters: every ``LisaConfig`` setting applies."""
        return self.adapter_type == "LISA"

    @property
    def samples_layers(self) -> bool:
        """Runs a LISA layer schedule (γ, K, sampling, optimizer-state policy apply)."""
        return self.schedule is not None

    @property
    def samples_base_blocks(self) -> bool:
        """Full-parameter LISA: the sampled blocks' base weights train, so γ >= 1 and the always-trainable modules
        (E+H) apply."""
        return self.schedule == "blocks"


METHODS: Mapping[str, Method] = MappingProxyType({m.name: m for m in (
    Method("lisa", "full-parameter LISA: sampled blocks train in place",
           "full-parameter layerwise sampling, saves full weights", schedule="blocks",
           defaults=MappingProxyType({"lisa_activated_layers": FULL_LISA_ACTIVATED_LAYERS}),
           learning_rate=FULL_LISA_LEARNING_RATE),
    Method("lisa-adapter", "LISA adapters: sparse low-rank updates, layerwise sampled",
           "LISA PEFT adapters: sparsity, interpolation, sampling", adapter_type="LISA", schedule="adapter",
           defaults=MappingProxyType({"lisa_activated_layers": ADAPTER_ACTIVATED_LAYERS}),
           learning_rate=ADAPTER_LEARNING_RATE, sampled_learning_rate=SAMPLED_ADAPTER_LEARNING_RATE),
    Method("lora", "LoRA", "PEFT LoRA", adapter_type="LORA", learning_rate=ADAPTER_LEARNING_RATE,
           defaults=LORA_DEFAULTS, alpha_per_rank=LORA_ALPHA_PER_RANK),
    Method("dora", "DoRA", "PEFT DoRA (LoRA with use_dora)", adapter_type="LORA", use_dora=True,
           learning_rate=ADAPTER_LEARNING_RATE, defaults=LORA_DEFAULTS, alpha_per_rank=LORA_ALPHA_PER_RANK),
    Method("full", "full fine-tuning", "every weight trains", learning_rate=FULL_LEARNING_RATE),
)})
#: the method ``hf-lisa train`` runs when none is given
DEFAULT_METHOD = "lisa"
#: full-parameter LISA and the LISA adapter form, by name (for code that builds exactly these, e.g. the demo)
FULL_LISA, LISA_ADAPTER, FULL = METHODS["lisa"], METHODS["lisa-adapter"], METHODS["full"]


def method_names(where: Optional[Callable[[Method], bool]] = None) -> tuple[str, ...]:
    """The names of the methods (in the table's order), optionally only those for which ``where(method)`` holds."""
    return tuple(name for name, method in METHODS.items() if where is None or where(method))


def get_method(name: str, *, field_name: str = "--method") -> Method:
    """The method called ``name``; a :class:`~hf_lisa.errors.UsageError` naming the field and the allowed names
    otherwise."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise UsageError(f"{field_name}={name!r} is invalid; allowed: {', '.join(METHODS)}.") from None


def schedules_anything(config: Any) -> bool:
    """Whether a LISA adapter's settings (a ``LisaConfig`` or its ``adapter_config.json`` dict) act through
    ``LisaAdapterCallback``: block sampling (γ > 0), sparse masks, or layer interpolation. Without any, a LISA adapter
    is the same update as LoRA and ``hf-lisa train`` runs no schedule for it
    (:func:`hf_lisa.tuner.schedule_guard.settings_needing_schedule` decides the same once the blocks are known)."""
    def get(name: str) -> Any:
        return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)

    sparse = float(get("sparsity") or 0) > 0 or any((get("sparsity_pattern") or {}).values())
    return int(get("lisa_activated_layers") or 0) > 0 or sparse or bool(get("layer_interpolation"))


def method_of_adapter(adapter_config: Mapping[str, Any]) -> Optional[str]:
    """The method that trains adapters of ``adapter_config`` (a PEFT ``adapter_config.json``), or ``None`` when no
    method of this table does (another PEFT type)."""
    peft_type = str(adapter_config.get("peft_type", "")).upper()
    use_dora = bool(adapter_config.get("use_dora"))
    for name, method in METHODS.items():
        if method.adapter_type == peft_type and (method.use_dora == use_dora or peft_type != "LORA"):
            return name
    return None


def method_defaults(name: str) -> dict[str, Any]:
    """The settings whose default depends on method ``name`` (γ), e.g. ``{"lisa_activated_layers": 2}``."""
    return dict(get_method(name).defaults)


__all__ = [
    "ADAPTER_ACTIVATED_LAYERS", "DEFAULT_METHOD", "FULL", "FULL_LISA", "FULL_LISA_ACTIVATED_LAYERS", "LISA_ADAPTER",
    "LORA_CONFIG_NAMES", "METHODS", "Method", "get_method", "method_defaults", "method_names", "method_of_adapter",
    "schedules_anything",
]
