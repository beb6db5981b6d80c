"""Names a package imports from its submodules on first use (start-up time: a command imports
only what it runs; tests/test_startup.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_getattr(package: str, submodules: Mapping[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: a name of `submodules` is imported from its
    submodule when first asked for and kept in the package's namespace, so that it is found
    there from then on; any other name is an AttributeError (PEP 562)."""

    def __getattr__(name: str) -> Any:
        if name not in submodules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{submodules[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
