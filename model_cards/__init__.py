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
