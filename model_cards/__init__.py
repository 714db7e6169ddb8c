"""Model card templates of hf-lisa.

The templates are Jinja files rendered through ``huggingface_hub.ModelCard.from_template`` by
[`hf_lisa.hub.render_model_card`]. Copy one, edit it and pass its path as ``template_path=`` to customise the cards
that ``hf_lisa.push_to_hub`` writes.

Example:
    ```py
    >>> from hf_lisa import model_cards
    >>> model_cards.template_path().endswith("model_card.md.j2")
    True
    ```
"""

from __future__ import annotations

if __name__ in ("model_cards",):  # the pre-0.2 top-level name: hand over to the one canonical module
    import importlib as _importlib
    import sys as _sys
    import warnings as _warnings

    _warnings.warn(
        "`import model_cards` is deprecated and will be removed in hf-lisa 0.3; use `import hf_lisa.model_cards` "
        "(the same module).",
        FutureWarning,
        stacklevel=2,
    )
    _canonical = _importlib.import_module("hf_lisa.model_cards")
    for _sub in ():
        _sys.modules[f"model_cards.{_sub}"] = _importlib.import_module(f"hf_lisa.model_cards.{_sub}")
    _sys.modules[__name__] = _canonical
else:
    from pathlib import Path

    TEMPLATES_DIR = Path(__file__).resolve().parent
    DEFAULT_TEMPLATE = "model_card.md.j2"

    def available_templates() -> list[str]:
        """File names of the shipped templates."""
        return sorted(p.name for p in TEMPLATES_DIR.glob("*.md.j2"))


    def template_path(name: str = DEFAULT_TEMPLATE) -> str:
        """Absolute path of the shipped template ``name`` (one card for adapters and merged models, with branches)."""
        path = TEMPLATES_DIR / name
        if not path.is_file():
            raise FileNotFoundError(f"model card template {name!r} not found; available: {available_templates()}")
        return str(path)
