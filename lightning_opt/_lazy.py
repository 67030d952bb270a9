"""Lazy re-exports so that importing a subpackage never pulls in optional or heavy modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for a package whose public names live in submodules.

    Args:
        package: the package's ``__name__``.
        exports: public name -> submodule (relative, without the leading dot).
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{exports[name]}")
        return getattr(module, name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
