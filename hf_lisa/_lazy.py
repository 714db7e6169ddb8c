"""Lazy package attributes (PEP 562), shared by ``hf_lisa``, ``hf_lisa.hub`` and ``hf_lisa.export``: their public
names and submodules are imported on first access, so that ``import hf_lisa`` and ``hf-lisa --help`` load no torch."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_attributes(package: str, names: Mapping[str, str], submodules: frozenset[str]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps a public name to the submodule (relative to
    ``package``) that defines it; ``submodules`` are reachable as attributes. A resolved name is stored in the
    package, so later lookups skip ``__getattr__``."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(f".{names[name]}", package), name)
            setattr(sys.modules[package], name, value)
            return value
        if name in submodules:
            return importlib.import_module(f".{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names) | submodules)

    return __getattr__, __dir__
